"""The tiny random-weight fixtures load in HF and hf_reference gives sane greedy outputs / logprobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support.hf_reference import hf_greedy, hf_greedy_batched, hf_logprobs, load_hf_model

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [9690, 42, 1500], [17]]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_greedy(tiny_model_dir, arch: str) -> None:
    d = tiny_model_dir(arch)
    model = load_hf_model(d)
    assert model.config.model_type == arch
    assert model.config.vocab_size == 49152
    outs = hf_greedy(d, PROMPTS, max_new_tokens=12)
    assert [len(o) for o in outs] == [12, 12, 12]
    flat = [t for o in outs for t in o]
    assert len(set(flat)) > 3, f"degenerate greedy output: {outs}"
    assert all(0 <= t < 49152 for t in flat)
    # Deterministic.
    assert hf_greedy(d, PROMPTS[:1], max_new_tokens=12) == outs[:1]


def test_tiny_layouts(tiny_llama_dir: str, tiny_qwen2_dir: str, tiny_qwen3_dir: str) -> None:
    q2 = Path(tiny_qwen2_dir)
    index = json.loads((q2 / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" in index["weight_map"]
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((q2 / "config.json").read_text())["tie_word_embeddings"] is False

    q3 = Path(tiny_qwen3_dir)
    assert (q3 / "model.safetensors").is_file()
    cfg3 = json.loads((q3 / "config.json").read_text())
    assert cfg3["tie_word_embeddings"] is True and cfg3["head_dim"] == 16
    with safe_open(str(q3 / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())

    for d in (tiny_llama_dir, tiny_qwen2_dir, tiny_qwen3_dir):
        assert (Path(d) / "tokenizer.json").is_file()
        assert json.loads((Path(d) / "generation_config.json").read_text())["eos_token_id"] == 2


def test_hf_logprobs_matches_greedy(tiny_qwen3_dir: str) -> None:
    prompt = PROMPTS[0]
    [gen] = hf_greedy(tiny_qwen3_dir, [prompt], max_new_tokens=4)
    lp = hf_logprobs(tiny_qwen3_dir, prompt + gen)
    assert lp.shape == (len(prompt) + 4, 49152)
    assert lp.dtype == torch.float32
    assert torch.allclose(lp.exp().sum(-1), torch.ones(lp.shape[0]), atol=1e-4)
    # The greedy token at each step is the argmax of the previous position's distribution.
    for i, tok in enumerate(gen):
        assert int(lp[len(prompt) - 1 + i].argmax()) == tok


def test_ignore_eos_runs_past_eos(smollm2_dir: str) -> None:
    from support.hf_reference import load_hf_tokenizer

    tok = load_hf_tokenizer(smollm2_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    prompt = tok.encode(text, add_special_tokens=False)
    [stopped] = hf_greedy(smollm2_dir, [prompt], max_new_tokens=40, ignore_eos=False)
    assert stopped[-1] == tok.eos_token_id and len(stopped) < 40
    [full] = hf_greedy(smollm2_dir, [prompt], max_new_tokens=40, ignore_eos=True)
    assert len(full) == 40
    assert full[: len(stopped)] == stopped


def test_batched_reference_equals_the_one_at_a_time_loop(smollm2_dir: str) -> None:
    """Prompts of different lengths, left-padded in one batch (and one alone, past the padding
    budget): the same greedy ids as running each alone."""
    prompts = PROMPTS + [[100 + i for i in range(300)]]
    assert hf_greedy_batched(smollm2_dir, prompts, max_new_tokens=8) == hf_greedy(smollm2_dir, prompts, 8)
