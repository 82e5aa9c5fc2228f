"""The short engine stages of `make gpu-check` beside graphs (scripts/gpu_check.py runs them):

  bf16        the engine in bf16 against HF transformers in fp32, teacher-forced: HF's greedy
              continuation (32 tokens) fed back as the prompt, with prompt logprobs; HF's
              token must be the engine's top-1 at >= 99% of the positions, and its logprob
              within BF16_LOGPROB_ERROR of HF's.
  moe_graphs  a tiny random Qwen3-MoE with CUDA graphs against --enforce-eager (the routing
              and expert grouping must be capturable: no failed capture, steps replayed).
  spec_graphs speculative decoding (a draft model: the target itself, so every row carries k
              drafts) with CUDA graphs against --enforce-eager: the verification steps replay
              graphs of 1 + k tokens per row.
  pd          prefill/decode disaggregation over shared memory: a kv_producer prefills, a
              kv_consumer with CUDA graphs loads the KV and decodes, against a colocated engine.

Graphs against eager compare greedy tokens with a near-tie tolerance: a mismatch counts only
where the eager run's top-2 logprob gap at the first divergence exceeds TIE_EPSILON (graphs
plan attention for the longest context, e.g. split-KV, so sums may run in another order).
`--device cpu` smoke-runs each stage's code (the eager "static" buffers instead of graphs).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import gpu_check as gc

TIE_EPSILON = 1e-3
BF16_TOKENS = 32
BF16_TOP1_AGREEMENT = 0.99
BF16_LOGPROB_ERROR = 0.3

TINY_QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=128,
                      intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=4096,
                      max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                      hidden_act="silu", attention_bias=False, bos_token_id=1, eos_token_id=2, torch_dtype="float32")


def top2_gaps(outs) -> list[list[float]]:
    """Per request, per generated token: its top-1 minus top-2 logprob (inf where only one came back)."""
    gaps = []
    for o in outs:
        row = []
        for entry in o.outputs[0].logprobs or []:
            values = sorted((lp.logprob for lp in entry.values()), reverse=True)
            row.append(values[0] - values[1] if len(values) > 1 else math.inf)
        gaps.append(row)
    return gaps


def compare_with_ties(name: str, got: list[list[int]], want: list[list[int]], gaps: list[list[float]],
                      epsilon: float = TIE_EPSILON) -> bool:
    """Token-for-token equality, except a first divergence where the reference's top-2 gap is at
    most `epsilon` (a near tie: reported, not failed)."""
    ok = True
    for r, (g, w) in enumerate(zip(got, want, strict=True)):
        if g == w:
            continue
        j = next((j for j, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), min(len(g), len(w)))
        gap = gaps[r][j] if j < len(gaps[r]) else math.inf
        if gap <= epsilon:
            gc.say(f"  {name}: request {r} diverges at token {j} on a near tie (top-2 gap {gap:.2e}): accepted")
            continue
        ok = False
        gc.say(f"  {name}: request {r} diverges at token {j} (top-2 gap {gap:.3f}): got {g[j:j + 5]}, "
               f"want {w[j:j + 5]}")
    return ok


def _device(args: argparse.Namespace) -> str | None:
    import torch
    return args.device or ("cuda" if torch.cuda.is_available() else None)


def _engine_flags(device: str, graphs: bool) -> dict:
    if not graphs:
        return {"enforce_eager": True}
    return {"cudagraph_mode": "full_decode_only" if device == "cuda" else "static"}


def _prompts(vocab: int, lens: tuple[int, ...], seed: int) -> list[list[int]]:
    import torch
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 1, (n,), generator=gen).tolist() for n in lens]


def graphs_vs_eager(stage: str, model_dir: str, device: str, prompts: list[list[int]], max_tokens: int,
                    **engine) -> tuple[bool, dict]:
    """Greedy with graphs against --enforce-eager (near ties tolerated); also fails when graphs
    were asked on CUDA but no step replayed one or a capture failed. Returns (ok, the graphs
    engine's figures)."""
    from services.common.sampling_params import SamplingParams
    from services.offline.llm import LLM
    got, gaps, figures, ok = {}, [], {}, True
    for name in ("eager", "graphs"):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=2 if name == "eager" else None)
        t0 = time.perf_counter()
        llm = LLM(model_dir, dtype="float32", attention_backend="triton" if device == "cuda" else None,
                  max_num_seqs=8, max_num_batched_tokens=128, block_size=16, max_model_len=1024,
                  kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False, seed=0,
                  **_engine_flags(device, name == "graphs"), **engine)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            got[name] = [list(o.outputs[0].token_ids) for o in outs]
            if name == "eager":
                gaps = top2_gaps(outs)
                continue
            static = llm.worker.runner.static_decode
            failures = llm.stats().get("cudagraph_capture_failures", 0)
            figures = {"mode": llm.worker.runner.cudagraph_mode, "capture_failures": failures,
                       "replays": static.replays if static is not None else 0,
                       "spec_steps": sum(static.spec_steps.values()) if static is not None else 0,
                       "seconds": round(time.perf_counter() - t0, 1)}
            if device == "cuda" and (failures or static is None or not static.replays):
                gc.say(f"  {stage}: FAIL, graphs did not run ({figures})")
                ok = False
        finally:
            llm.close()
    equal = compare_with_ties(f"{stage} graphs vs eager", got["graphs"], got["eager"], gaps)
    verdict = "equal to" if equal else "DIFFERENT from"
    gc.say(f"  {stage}: {len(prompts)} prompts x {max_tokens} tokens, graphs {verdict} eager; {figures}")
    return ok and equal, figures


def write_moe_checkpoint(out_dir: Path, device: str) -> None:
    """A random Qwen3-MoE through transformers (its own weight names), with the word tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    config = Qwen3MoeConfig(**{k: v for k, v in TINY_QWEN3_MOE.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, 1.0 if "embed" in name else 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    gc.write_word_tokenizer(out_dir, config.vocab_size)


def stage_moe_graphs(args: argparse.Namespace) -> int:
    device = _device(args)
    if gc.engine_stage_skip("moe_graphs", device, ("transformers", "safetensors", "tokenizers")):
        return gc.SKIP
    import torch
    torch.set_float32_matmul_precision("highest")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        write_moe_checkpoint(Path(tmp), device)
        prompts = _prompts(TINY_QWEN3_MOE["vocab_size"], (5, 17, 40, 9, 3), seed=21)
        ok, figures = graphs_vs_eager("moe_graphs", tmp, device, prompts, 12 if device == "cuda" else 4)
    gc.record("moe_graphs", greedy_equal=ok, **figures)
    gc.say(f"moe_graphs: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def _tiny_dense(tmp: str, device: str) -> str:
    import torch
    model_dir = str(Path(tmp) / "tiny-qwen3")
    gc.write_random_checkpoint(Path(model_dir), gc.TINY_QWEN3, torch.float32, device, seed=3, std=0.1, embed_std=1.0)
    return model_dir


def stage_spec_graphs(args: argparse.Namespace) -> int:
    device = _device(args)
    if gc.engine_stage_skip("spec_graphs", device, ("transformers", "safetensors", "tokenizers")):
        return gc.SKIP
    import torch
    torch.set_float32_matmul_precision("highest")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        model_dir = _tiny_dense(tmp, device)
        prompts = _prompts(gc.TINY_QWEN3["vocab_size"], (5, 17, 40, 9), seed=22)
        spec = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3}
        ok, figures = graphs_vs_eager("spec_graphs", model_dir, device, prompts, 16 if device == "cuda" else 4,
                                      speculative_config=spec)
    if ok and device == "cuda" and not figures.get("spec_steps"):
        gc.say("  spec_graphs: FAIL, no speculative step ran padded (1 + k tokens per row)")
        ok = False
    gc.record("spec_graphs", greedy_equal=ok, **figures)
    gc.say(f"spec_graphs: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def stage_pd(args: argparse.Namespace) -> int:
    device = _device(args)
    if gc.engine_stage_skip("pd", device, ("transformers", "safetensors", "tokenizers")):
        return gc.SKIP
    import torch

    from services.common.sampling_params import SamplingParams
    from services.offline.llm import LLM
    torch.set_float32_matmul_precision("highest")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        model_dir = _tiny_dense(tmp, device)
        shm = Path(tmp) / "kv_shm"
        shm.mkdir()
        prompts = [{"prompt_token_ids": p} for p in _prompts(gc.TINY_QWEN3["vocab_size"], (40, 23, 77), seed=23)]
        engine = dict(dtype="float32", seed=0, block_size=16, max_model_len=1024, kv_cache_memory_bytes=1 << 28,
                      max_num_batched_tokens=128, attention_backend="triton" if device == "cuda" else None)

        def kv(role: str) -> dict:
            return {"kv_connector": "SharedMemoryConnector", "kv_role": role,
                    "kv_connector_extra_config": {"shm_dir": str(shm)}}

        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
        with LLM(model_dir, enforce_eager=True, **engine) as colocated:
            outs = colocated.generate(prompts, greedy, use_tqdm=False)
            want, gaps = [list(o.outputs[0].token_ids) for o in outs], top2_gaps(outs)
        # The producer stays up until the consumer has loaded: it owns the segments it saved.
        graphs = _engine_flags(device, True)
        with LLM(model_dir, kv_transfer_config=kv("kv_producer"), enforce_eager=True, **engine) as producer, \
                LLM(model_dir, kv_transfer_config=kv("kv_consumer"), **graphs, **engine) as consumer:
            first = SamplingParams(temperature=0.0, max_tokens=1,
                                   extra_args={"kv_transfer_params": {"do_remote_decode": True}})
            params = [o.kv_transfer_params for o in producer.generate(prompts, first, use_tqdm=False)]
            outs = consumer.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                              extra_args={"kv_transfer_params": p}) for p in params],
                                     use_tqdm=False)
            got = [list(o.outputs[0].token_ids) for o in outs]
            loads = consumer.stats().get("kv_transfer_loads", 0)
    ok = compare_with_ties("pd consumer vs colocated", got, want, gaps)
    if loads < len(prompts):
        gc.say(f"  pd: FAIL, the consumer loaded {loads} of {len(prompts)} prompts' KV")
        ok = False
    gc.record("pd", greedy_equal=ok, kv_loads=loads)
    gc.say(f"pd: {'PASS' if ok else 'FAIL'} ({loads} KV loads)")
    return 0 if ok else 1


def bf16_closeness(model_dir: str, device: str, prompts: list[list[int]]) -> dict:
    """Teacher-forced bf16 engine against HF fp32 (see the module docstring): the figures."""
    import torch

    from services.common.sampling_params import SamplingParams
    from services.offline.llm import LLM
    want, logits = gc.hf_greedy(model_dir, prompts, BF16_TOKENS, device)
    forced = [p + w for p, w in zip(prompts, want, strict=True)]
    with LLM(model_dir, dtype="bfloat16", attention_backend="triton" if device == "cuda" else None, block_size=16,
             max_num_batched_tokens=256, kv_cache_memory_bytes=1 << 28, max_model_len=1024, seed=0,
             enable_prefix_caching=False) as llm:
        outs = llm.generate([{"prompt_token_ids": f} for f in forced],
                            SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    agree, errors = 0, []
    for prompt, cont, steps, out in zip(prompts, want, logits, outs, strict=True):
        for j, token in enumerate(cont):
            entry = out.prompt_logprobs[len(prompt) + j]
            engine = entry[token]
            agree += engine.rank == 1
            errors.append(abs(engine.logprob - float(torch.log_softmax(steps[j], -1)[token])))
    total = len(errors)
    return {"tokens": total, "top1_agreement": round(agree / total, 4), "max_logprob_error": round(max(errors), 4),
            "mean_logprob_error": round(sum(errors) / total, 4)}


def stage_bf16(args: argparse.Namespace) -> int:
    device = _device(args)
    if gc.engine_stage_skip("bf16", device, ("transformers", "safetensors", "tokenizers")):
        return gc.SKIP
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        if (gc.SMOLLM2_DIR / "model.safetensors").is_file():
            model_dir = str(gc.SMOLLM2_DIR)
        else:
            model_dir = _tiny_dense(tmp, device)
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        figures = bf16_closeness(model_dir, device, _prompts(vocab, (7, 30, 61, 18), seed=24))
    ok = figures["top1_agreement"] >= BF16_TOP1_AGREEMENT and figures["max_logprob_error"] <= BF16_LOGPROB_ERROR
    gc.record("bf16", model=Path(model_dir).name, **figures)
    gc.say(f"bf16: {'PASS' if ok else 'FAIL'} {figures} (need top-1 >= {BF16_TOP1_AGREEMENT}, "
           f"logprob error <= {BF16_LOGPROB_ERROR})")
    return 0 if ok else 1


STAGES = {"bf16": stage_bf16, "moe_graphs": stage_moe_graphs, "spec_graphs": stage_spec_graphs, "pd": stage_pd}
