"""The GPU checks behind `make gpu-check` (scripts/gpu_check.sh runs each stage under a timeout).

Stages (python scripts/gpu_check.py STAGE [options]); exit 0 pass, 1 fail, 77 skipped:

  probe       what this python has: torch/CUDA, triton, and every package the engine needs.
  kernels     tests/unit/worker/test_triton_kernels.py, test_fused_moe_triton.py, test_triton_ops.py and
              test_quant_triton.py on CUDA (under TRITON_INTERPRET=1 on the CPU without CUDA), through
              pytest, or (attention only) the module's own runner.
  greedy      (1) model level, needing only torch + triton + numpy: our model classes (random
              Qwen3- and Llama-shaped weights, fp32) driven step by step over the paged KV cache
              with the Triton backend (chunked prefills mixed with decodes, shuffled block ids)
              must pick the same greedy tokens as a pure-torch dense implementation of the
              model that recomputes the whole sequence each step;
              (2) engine level, when the engine imports (transformers, protobuf and the
              generated *_pb2 modules): `LLM(..., attention_backend="triton")` greedy against
              HF transformers on the GPU, on SmolLM2 when models/ holds it, else on a tiny
              random Qwen3 written on the fly.
  cudagraphs  the engine with CUDA graphs for pure-decode steps (cudagraph_mode full_decode_only, graphs
              captured at start-up per padded batch size) against --enforce-eager, greedy token for
              token (a mismatch counts only where eager's top-2 logprob gap exceeds 1e-3) on a tiny
              random Qwen3 (or SmolLM2 with --smollm2), batches that pad (3 -> 4,
              5 -> 8) and shrink as requests finish, with mixed prefill steps; prints the decode
              time per token of each at batch 1 and 8. `--device cpu` smoke-runs the stage's code
              with the eager "static" buffers instead of graphs.
  sampling    the sampler on the GPU under torch.cuda.set_sync_debug_mode("error"): greedy, top-k,
              top-p and min-p rows in one batch sample without a single host sync (the one copy of
              the sampled ids per step happens after it, in the model runner).
  throughput  a Qwen3-0.6B-shaped random-weight model (written on the fly; needs the engine,
              hence transformers) in bf16: 64 requests (--num-requests), input and output lengths
              uniform in 100..1024 (--max-len), ignore_eos, once with --enforce-eager and once with
              CUDA graphs; prints output tok/s of each. With --profile, per mode, a torch-profiler
              run of a decode-bound batch (64 requests, 16 prompt tokens, 48 outputs): GPU kernel
              time over wall time and kernel launches per engine step.
  bf16, moe_graphs, spec_graphs, pd
              scripts/gpu_check_stages.py: bf16 closeness to HF fp32, and CUDA graphs against eager
              with an MoE model, with speculative decoding, and on a P/D consumer.
  report      merges the stages' figures (kept as JSON under $GPU_CHECK_RESULTS) with the verdicts
              scripts/gpu_check.sh collected into gpu_check.json and a table, gpu_check.md, under
              --out (the device tool's $OUT when set).

The machine may have no network and nothing beyond torch and triton: every stage says what
it could not import and skips (77) rather than fails when the missing piece is a package.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

SKIP = 77
SMOLLM2_DIR = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"


def say(msg: str) -> None:
    print(f"[gpu-check] {msg}", flush=True)


def try_import(name: str) -> tuple[bool, str]:
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any import failure is reported, not raised
        return False, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    return True, str(getattr(module, "__version__", "") or "")


def engine_import_error() -> str | None:
    """None when the offline engine imports here, else why not (one line)."""
    ok, why = try_import("services.offline.llm")
    if ok:
        return None
    if "myvllm_pb2" in why:
        why += (" (the generated protobuf modules are git-ignored: run `make setup` or grpc_tools.protoc, "
                "or carry services/common/proto along)")
    return why


def cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


# Each stage's figures, one JSON file per stage, merged by `report` (stages run as separate processes).
RESULTS_DIR = Path(os.environ.get("GPU_CHECK_RESULTS", Path(tempfile.gettempdir()) / "gpu-check-results"))


def record(stage: str, **figures: object) -> None:
    """Keep figures of `stage` for the report (merged into what the stage recorded before)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{stage}.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.update(figures)
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


def engine_stage_skip(stage: str, device: str | None, packages: tuple[str, ...] = ("transformers",)) -> str | None:
    """Why an engine-level stage cannot run here (None: it can), said and recorded."""
    why = "CUDA is absent" if device is None else engine_import_error()
    for name in packages:
        if why is None and not try_import(name)[0]:
            why = f"{name} is missing"
    if why is not None:
        say(f"{stage}: SKIPPED, {why}")
        record(stage, skipped=why)
    return why


# --------------------------------------------------------------------------- probe


def stage_probe(_args: argparse.Namespace) -> int:
    say(f"python {sys.version.split()[0]} at {sys.executable}")
    ok, ver = try_import("torch")
    if not ok:
        say(f"torch: not importable ({ver})")
        return 1
    import torch
    cuda = torch.cuda.is_available()
    say(f"torch {torch.__version__}; CUDA {'available: ' + torch.cuda.get_device_name(0) if cuda else 'absent'}")
    record("probe", python=sys.version.split()[0], torch=torch.__version__,
           gpu=torch.cuda.get_device_name(0) if cuda else None, triton=try_import("triton")[1] or None)
    for name in ("triton", "numpy", "pytest", "transformers", "tokenizers", "safetensors", "google.protobuf",
                 "grpc", "tqdm"):
        ok, info = try_import(name)
        say(f"{name}: {(info or 'ok') if ok else 'MISSING (' + info + ')'}")
    why = engine_import_error()
    say("engine (services.offline.llm): " + ("importable" if why is None else f"NOT importable: {why}"))
    say(f"SmolLM2 checkpoint: {'present' if (SMOLLM2_DIR / 'model.safetensors').is_file() else 'absent'} "
        f"at {SMOLLM2_DIR.relative_to(REPO_ROOT)}")
    return 0


# --------------------------------------------------------------------------- kernels


def stage_kernels(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    if cuda_available() and not args.interpret:
        env.pop("TRITON_INTERPRET", None)
        where = "CUDA"
    else:
        env["TRITON_INTERPRET"] = "1"
        where = "the CPU under TRITON_INTERPRET=1"
    test_file = REPO_ROOT / "tests" / "unit" / "worker" / "test_triton_kernels.py"
    if try_import("pytest")[0]:
        say(f"kernel tests on {where} (pytest)")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(test_file),
               str(test_file.with_name("test_fused_moe_triton.py")),  # and the fused-MoE kernels
               str(test_file.with_name("test_triton_ops.py")),  # and the layers' elementwise kernels
               str(test_file.with_name("test_quant_triton.py"))]  # and the GGUF dequantizing GEMM
        return subprocess.run(cmd, cwd=REPO_ROOT, env=env).returncode
    say(f"pytest is missing: attention kernel cases on {where} through the test module's own runner "
        "(the fused-MoE and elementwise kernel tests need pytest)")
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import test_triton_kernels as t; "
            "n, bad = t.run_cases(t.DEVICE); print(f'{n - len(bad)} passed, {len(bad)} failed'); "
            "sys.exit(1 if bad or t.DEVICE is None else 0)")
    return subprocess.run([sys.executable, "-c", code, str(REPO_ROOT), str(test_file.parent)],
                          cwd=REPO_ROOT, env=env).returncode


# --------------------------------------------------------------------------- dense reference


def _rms(x, w, eps):
    import torch
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def dense_logits(model, ids: list[int]):
    """The model's logits for every position of `ids`, computed densely from its parameters in plain
    torch (no KV cache, no paging, no engine code): the oracle for the paged path."""
    import torch
    cfg = model.config
    p = dict(model.named_parameters())
    n_h, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_h
    eps = cfg.rms_norm_eps
    dev = p["embed_tokens.weight"].device
    n = len(ids)
    x = p["embed_tokens.weight"][torch.tensor(ids, device=dev)]
    inv_freq = 1.0 / (float(cfg.rope_theta) ** (torch.arange(0, d, 2, device=dev).float() / d))
    ang = torch.arange(n, device=dev).float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None, :], torch.cat([ang, ang], -1).sin()[:, None, :]

    def rope(t):
        rot = torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1)
        return t * cos + rot * sin

    causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
    for i in range(cfg.num_hidden_layers):
        pre = f"layers.{i}."
        h = _rms(x, p[pre + "input_layernorm.weight"], eps)
        qkv = h @ p[pre + "self_attn.qkv_proj.weight"].T
        if pre + "self_attn.qkv_proj.bias" in p:
            qkv = qkv + p[pre + "self_attn.qkv_proj.bias"]
        q, k, v = qkv.split([n_h * d, n_kv * d, n_kv * d], -1)
        q, k, v = q.view(n, n_h, d), k.view(n, n_kv, d), v.view(n, n_kv, d)
        if pre + "self_attn.q_norm.weight" in p:
            q = _rms(q, p[pre + "self_attn.q_norm.weight"], eps)
            k = _rms(k, p[pre + "self_attn.k_norm.weight"], eps)
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(n_h // n_kv, 1)
        v = v.repeat_interleave(n_h // n_kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, n_h * d)
        x = x + attn @ p[pre + "self_attn.o_proj.weight"].T
        h = _rms(x, p[pre + "post_attention_layernorm.weight"], eps)
        gate, up = (h @ p[pre + "mlp.gate_up_proj.weight"].T).split(cfg.intermediate_size, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ p[pre + "mlp.down_proj.weight"].T
    x = _rms(x, p["norm.weight"], eps)
    head = p["embed_tokens.weight"] if getattr(cfg, "tie_word_embeddings", False) else p["lm_head.weight"]
    return (x @ head.T).float()


def dense_greedy(model, prompt: list[int], max_new: int) -> tuple[list[int], list]:
    ids, steps = list(prompt), []
    for _ in range(max_new):
        logits = dense_logits(model, ids)[-1]
        steps.append(logits)
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], steps


# --------------------------------------------------------------------------- paged model-level runner


def paged_greedy(model, prompts: list[list[int]], max_new: int, block_size: int, token_budget: int,
                 backend, device, seed: int = 0) -> list[list[int]]:
    """Greedy decoding through the paged KV cache: each step schedules the running requests' decodes
    first, then prefill chunks up to `token_budget` tokens, so steps mix decodes with chunked prefills
    that have prior context in the cache. Block ids are handed out in shuffled order."""
    import numpy as np
    import torch

    from services.worker.attention.base import AttentionMetadata, forward_context

    layers = model.attention_layers()
    need = [-(-(len(p) + max_new) // block_size) for p in prompts]
    num_blocks = sum(need) + 1
    dtype = next(model.parameters()).dtype
    for layer in layers:
        layer.kv_cache = torch.zeros(2, num_blocks, block_size, layer.num_kv_heads, layer.head_dim,
                                     dtype=dtype, device=device)
    ids = np.random.default_rng(seed).permutation(np.arange(1, num_blocks))
    table = np.zeros((len(prompts), max(need)), dtype=np.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = ids[used:used + n]
        used += n
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    out: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < max_new for o in out):
        budget, sched = token_budget, []
        order = sorted(range(len(prompts)), key=lambda i: len(tokens[i]) - computed[i] > 1)  # decodes first
        for i in order:
            left = len(tokens[i]) - computed[i]
            if len(out[i]) >= max_new or left <= 0 or budget <= 0:
                continue
            take = min(left, budget)
            sched.append((i, take))
            budget -= take
        rows = np.array([i for i, _ in sched])
        nsched = np.array([n for _, n in sched])
        qsl = np.zeros(len(sched) + 1, dtype=np.int64)
        qsl[1:] = np.cumsum(nsched)
        ctx = np.array([computed[i] for i in rows], dtype=np.int64)
        req = np.repeat(np.arange(len(sched)), nsched)
        pos = ctx[req] + np.arange(int(qsl[-1])) - qsl[req]
        input_ids = np.array([tokens[rows[r]][p] for r, p in zip(req, pos, strict=True)], dtype=np.int64)
        seq = ctx + nsched
        bt = table[rows, :int(-(-seq.max() // block_size))]
        slots = bt[req, pos // block_size].astype(np.int64) * block_size + pos % block_size
        meta = AttentionMetadata(
            num_tokens=int(qsl[-1]),
            slot_mapping=torch.from_numpy(slots).to(device),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(device),
            seq_lens=torch.from_numpy(seq.astype(np.int32)).to(device),
            context_lens=torch.from_numpy(ctx.astype(np.int32)).to(device),
            block_table=torch.from_numpy(np.ascontiguousarray(bt)).to(device),
            max_query_len=int(nsched.max()), max_seq_len=int(seq.max()), block_size=block_size,
            query_start_loc_np=qsl, seq_lens_np=seq, context_lens_np=ctx)
        meta.backend_data = backend.prepare(meta)
        with forward_context(backend, meta):
            hidden = model(torch.from_numpy(input_ids).to(device), torch.from_numpy(pos).to(device))
        for r, (i, n) in enumerate(sched):
            computed[i] += n
            if computed[i] == len(tokens[i]):  # caught up: sample the next token
                nxt = int(model.compute_logits(hidden[int(qsl[r + 1]) - 1][None]).argmax())
                tokens[i].append(nxt)
                out[i].append(nxt)
    for layer in layers:
        layer.kv_cache = None
    return out


def compare_greedy(name: str, got: list[list[int]], want: list[list[int]], ref_logits: list[list] | None,
                   tie_margin: float = 1e-3) -> bool:
    """Token-for-token equality; a first divergence where the reference's top two logits are closer
    than `tie_margin` is a near tie (reported, not failed): fp32 sums in another order may flip it."""
    ok = True
    for r, (g, w) in enumerate(zip(got, want, strict=True)):
        if g == w:
            continue
        j = next((j for j, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), min(len(g), len(w)))
        margin = None
        if ref_logits is not None and j < len(ref_logits[r]):
            logits = ref_logits[r][j]
            margin = float(logits[w[j]] - logits[g[j]]) if j < len(g) else None
        if margin is not None and abs(margin) < tie_margin:
            say(f"  {name}: request {r} diverges at token {j} on a near tie (logit margin {margin:.2e}): accepted")
            continue
        ok = False
        say(f"  {name}: request {r} diverges at token {j}: got {g[j:j + 5]}, want {w[j:j + 5]}"
            + (f" (reference logit margin {margin:.3f})" if margin is not None else ""))
    return ok


def _random_model(arch: str, cfg: SimpleNamespace, device, seed: int):
    import torch

    from services.worker.models import MODEL_REGISTRY
    torch.manual_seed(seed)
    model = MODEL_REGISTRY[arch](cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    return model.to(device=device, dtype=torch.float32).eval()


def model_level_greedy(device: str, quick: bool) -> bool:
    import torch

    from services.worker.attention.triton_backend import TritonAttentionBackend
    common = dict(max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
                  attention_bias=False)
    shapes = [
        ("Qwen3ForCausalLM", "qwen3-like, GQA 4, head_dim 64, tied",
         SimpleNamespace(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=64, vocab_size=2048, tie_word_embeddings=True, **common)),
        ("LlamaForCausalLM", "llama-like, GQA 3, head_dim 128, untied",
         SimpleNamespace(hidden_size=384, intermediate_size=768, num_hidden_layers=2, num_attention_heads=6,
                         num_key_value_heads=2, head_dim=128, vocab_size=2048, tie_word_embeddings=False,
                         **common)),
    ]
    lens = (5, 23, 1, 40) if quick else (7, 61, 33, 90, 1, 18, 130)
    max_new = 4 if quick else 20
    budget = 24 if quick else 48
    all_ok = True
    for arch, label, cfg in shapes:
        model = _random_model(arch, cfg, device, seed=len(label))
        gen = torch.Generator().manual_seed(7)
        prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in lens]
        t0 = time.perf_counter()
        with torch.inference_mode():
            got = paged_greedy(model, prompts, max_new, 16, budget, TritonAttentionBackend(), device)
            ref = [dense_greedy(model, p, max_new) for p in prompts]
        ok = compare_greedy(label, got, [r[0] for r in ref], [r[1] for r in ref])
        say(f"  model level, {label}: {len(prompts)} prompts x {max_new} tokens, "
            f"{'equal' if ok else 'DIFFERENT'} ({time.perf_counter() - t0:.1f} s)")
        all_ok &= ok
    return all_ok


# --------------------------------------------------------------------------- engine level


def write_random_checkpoint(out_dir: Path, config: dict, dtype, device: str, seed: int, std: float = 0.02,
                            embed_std: float = 0.02) -> None:
    """config.json + model.safetensors (HF names, random weights) + generation_config.json + a word-level
    tokenizer (token i is the word "t<i>"), so the engine and HF can both load the directory."""
    import torch
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // nh

    def rnd(*shape, scale=std):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype).cpu()

    def ones(n):
        return (1.0 + 0.1 * torch.randn(n, generator=gen, device=device)).to(dtype).cpu()

    tensors = {"model.embed_tokens.weight": rnd(vocab, h, scale=embed_std), "model.norm.weight": ones(h)}
    if not config.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = rnd(vocab, h)
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        tensors.update({
            pre + "self_attn.q_proj.weight": rnd(nh * hd, h),
            pre + "self_attn.k_proj.weight": rnd(nkv * hd, h),
            pre + "self_attn.v_proj.weight": rnd(nkv * hd, h),
            pre + "self_attn.o_proj.weight": rnd(h, nh * hd),
            pre + "mlp.gate_proj.weight": rnd(inter, h),
            pre + "mlp.up_proj.weight": rnd(inter, h),
            pre + "mlp.down_proj.weight": rnd(h, inter),
            pre + "input_layernorm.weight": ones(h),
            pre + "post_attention_layernorm.weight": ones(h),
        })
        if config.get("model_type") == "qwen3":
            tensors[pre + "self_attn.q_norm.weight"] = ones(hd)
            tensors[pre + "self_attn.k_norm.weight"] = ones(hd)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}))
    write_word_tokenizer(out_dir, vocab)


def write_word_tokenizer(out_dir: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "bos_token": "t1", "eos_token": "t2",
        "model_max_length": 1 << 20}))


TINY_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=4096,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                  hidden_act="silu", attention_bias=False, bos_token_id=1, eos_token_id=2, torch_dtype="float32")




def hf_greedy(model_dir: str, prompts: list[list[int]], max_new: int, device: str) -> tuple[list, list]:
    """HF transformers' greedy continuation (fp32, full recompute each step) and its logits per step."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    outs, all_logits = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids, steps = list(prompt), []
            for _ in range(max_new):
                logits = model(torch.tensor([ids], device=device)).logits[0, -1].float()
                steps.append(logits)
                ids.append(int(logits.argmax()))
            outs.append(ids[len(prompt):])
            all_logits.append(steps)
    del model
    return outs, all_logits


def engine_level_greedy(device: str, quick: bool, work: Path, use_smollm2: bool = True,
                        tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> bool | None:
    """None: skipped (the engine does not import here)."""
    why = engine_import_error()
    if why is None and not try_import("transformers")[0]:
        why = "transformers is missing"
    if why is not None:
        say(f"  engine level: SKIPPED, the engine does not import here: {why}")
        return None
    import torch

    from services.common.sampling_params import SamplingParams
    from services.offline.llm import LLM
    if use_smollm2 and (SMOLLM2_DIR / "model.safetensors").is_file():
        model_dir, label = str(SMOLLM2_DIR), "SmolLM2-135M-Instruct"
    else:
        model_dir = str(work / "tiny-qwen3")
        label = "a tiny random Qwen3" + (" (SmolLM2 is absent)" if use_smollm2 else "")
        write_random_checkpoint(Path(model_dir), TINY_QWEN3, torch.float32, device, seed=3, std=0.1, embed_std=1.0)
    gen = torch.Generator().manual_seed(11)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    lens = (3, 17, 40) if quick else (5, 17, 40, 77, 130)
    prompts = [torch.randint(100, vocab - 1, (n,), generator=gen).tolist() for n in lens]
    prompts.append(prompts[-1][:-3] + prompts[0])  # shares a prefix with the previous prompt (prefix cache)
    max_new = 4 if quick else 24
    t0 = time.perf_counter()
    llm = LLM(model_dir, dtype="float32", attention_backend="triton", block_size=16, max_num_batched_tokens=64,
              kv_cache_memory_bytes=1 << 30, max_model_len=1024, enable_prefix_caching=True, seed=0,
              tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size)
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.close()
    got = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    if not try_import("transformers")[0]:
        say("  engine level: transformers is missing: no HF reference")
        return None
    want, logits = hf_greedy(model_dir, prompts, max_new, device)
    ok = compare_greedy("engine vs HF", got, want, logits)
    tp = f", tensor_parallel_size={tensor_parallel_size}" if tensor_parallel_size > 1 else ""
    tp += f", pipeline_parallel_size={pipeline_parallel_size}" if pipeline_parallel_size > 1 else ""
    say(f"  engine level, {label}: LLM(attention_backend='triton'{tp}) vs HF transformers, {len(prompts)} prompts x "
        f"{max_new} tokens, {'equal' if ok else 'DIFFERENT'} ({time.perf_counter() - t0:.1f} s)")
    return ok


def stage_greedy(args: argparse.Namespace) -> int:
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else None)
    if device is None:
        say("greedy: SKIPPED, CUDA is absent")
        return SKIP
    if not try_import("numpy")[0]:
        say("greedy: SKIPPED, numpy is missing (the attention metadata needs it)")
        return SKIP
    torch.set_float32_matmul_precision("highest")  # no TF32: greedy equality in fp32
    ok = model_level_greedy(device, args.quick)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        engine_ok = engine_level_greedy(device, args.quick, Path(tmp), use_smollm2=not args.no_smollm2)
    if engine_ok is False:
        ok = False
    say(f"greedy: {'PASS' if ok else 'FAIL'}" + (" (model level only)" if engine_ok is None else ""))
    return 0 if ok else 1


def stage_tp2(args: argparse.Namespace) -> int:
    """Model parallelism over NCCL: LLM(tensor_parallel_size=2), then LLM(pipeline_parallel_size=2)
    (hidden states sent GPU to GPU), one rank per GPU, each vs HF."""
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        say(f"tp2: SKIPPED, tensor parallelism over NCCL needs two GPUs and this machine has {count}")
        return SKIP
    torch.set_float32_matmul_precision("highest")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        ok = engine_level_greedy("cuda", args.quick, Path(tmp), use_smollm2=not args.no_smollm2,
                                 tensor_parallel_size=2)
        if ok is None:
            return SKIP
        ok = engine_level_greedy("cuda", True, Path(tmp), use_smollm2=not args.no_smollm2,
                                 pipeline_parallel_size=2) and ok
    say(f"tp2: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


# --------------------------------------------------------------------------- cudagraphs


def stage_cudagraphs(args: argparse.Namespace) -> int:
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else None)
    if engine_stage_skip("cudagraphs", device):
        return SKIP
    from services.common.sampling_params import SamplingParams
    from services.offline.llm import LLM
    torch.set_float32_matmul_precision("highest")  # no TF32: greedy equality in fp32
    import gpu_check_stages as stages
    graphs_mode = "full_decode_only" if device == "cuda" else "static"  # cpu: a smoke run of this code
    gaps: list[list[float]] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        if args.smollm2 and (SMOLLM2_DIR / "model.safetensors").is_file():
            model_dir, label = str(SMOLLM2_DIR), "SmolLM2-135M-Instruct"
        else:
            model_dir, label = str(Path(tmp) / "tiny-qwen3"), "a tiny random Qwen3"
            write_random_checkpoint(Path(model_dir), TINY_QWEN3, torch.float32, device, seed=3, std=0.1,
                                    embed_std=1.0)
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        gen = torch.Generator().manual_seed(5)
        lens = (5, 17, 40, 9, 77, 3, 130, 23, 11, 60, 31, 8)
        outs = (24, 9, 17, 30, 5, 12, 20, 3, 28, 14, 7, 19)
        prompts = [{"prompt_token_ids": torch.randint(100, vocab - 1, (n,), generator=gen).tolist()} for n in lens]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in outs]
        single = [{"prompt_token_ids": prompts[1]["prompt_token_ids"]}]
        batch8 = prompts[:8]
        got: dict[str, list[list[int]]] = {}
        timing: dict[str, str] = {}
        ok = True
        for name, flags in (("eager", {"enforce_eager": True}), ("graphs", {"cudagraph_mode": graphs_mode})):
            t0 = time.perf_counter()
            llm = LLM(model_dir, dtype="float32", attention_backend="triton" if device == "cuda" else None,
                      max_num_seqs=8, max_num_batched_tokens=64, block_size=16, max_model_len=1024,
                      kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False, seed=0, **flags)
            try:
                runner = llm.worker.runner
                static = runner.static_decode
                say(f"  {name}: mode {runner.cudagraph_mode}, loaded in {time.perf_counter() - t0:.1f} s"
                    + (f", graphs for sizes {sorted(static.graphs)}" if static is not None and static.graphs else ""))
                if name == "graphs" and device == "cuda" and (static is None or not static.graphs):
                    say("  graphs: FAIL, no CUDA graph was captured")
                    ok = False
                asked = params if name == "graphs" else [
                    SamplingParams(temperature=0.0, max_tokens=p.max_tokens, ignore_eos=True, logprobs=2)
                    for p in params]  # the eager run's top-2 gaps judge near ties
                outs = llm.generate(prompts, asked, use_tqdm=False)
                got[name] = [list(o.outputs[0].token_ids) for o in outs]
                if name == "eager":
                    gaps = stages.top2_gaps(outs)
                lines = []
                for what, batch, n_tok in (("batch 1", single, 128), ("batch 8", batch8, 64)):
                    p = SamplingParams(temperature=0.0, max_tokens=n_tok, ignore_eos=True)
                    llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                                 use_tqdm=False)  # warm
                    if device == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    llm.generate(batch, p, use_tqdm=False)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    ms = 1000 * (time.perf_counter() - t0) / n_tok
                    lines.append(f"{what}: {ms:.2f} ms per step")
                    record("cudagraphs", **{f"{name}_ms_per_step_{what.replace(' ', '')}": round(ms, 3)})
                if static is not None:
                    by_size = dict(sorted(static.padded_steps.items()))
                    lines.append(f"{static.replays} replays, padded steps by size {by_size}")
                    if name == "graphs" and device == "cuda" and not static.replays:
                        say("  graphs: FAIL, no step replayed a graph")
                        ok = False
                timing[name] = "; ".join(lines)
            finally:
                llm.close()
            say(f"  {name}: {timing.get(name, '')}")
        equal = stages.compare_with_ties("graphs vs eager", got["graphs"], got["eager"], gaps)
        say(f"  {label}: {len(prompts)} prompts, greedy with {graphs_mode} {'equal to' if equal else 'DIFFERENT from'} "
            "--enforce-eager")
    ok = ok and equal
    record("cudagraphs", model=label, greedy_equal=equal, mode=graphs_mode)
    say(f"cudagraphs: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


# --------------------------------------------------------------------------- throughput


QWEN3_0_6B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  tie_word_embeddings=True, hidden_act="silu", attention_bias=False, bos_token_id=151643,
                  eos_token_id=151645, torch_dtype="bfloat16")


def stage_throughput(args: argparse.Namespace) -> int:
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else None)
    if engine_stage_skip("throughput", device, ("transformers", "safetensors", "tokenizers")):
        return SKIP
    import numpy as np

    from services.common.sampling_params import SamplingParams
    config = dict(QWEN3_0_6B)
    if args.tiny:  # a smoke run of this stage's code on a small shape
        config.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=1000, bos_token_id=1, eos_token_id=2)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    rng = np.random.default_rng(0)
    n, lo, hi = args.num_requests, args.min_len, args.max_len
    in_lens, out_lens = rng.integers(lo, hi + 1, n), rng.integers(lo, hi + 1, n)
    prompts = [{"prompt_token_ids": rng.integers(100, config["vocab_size"] - 1, int(k)).tolist()} for k in in_lens]
    params = [SamplingParams(temperature=0.0, max_tokens=int(k), ignore_eos=True) for k in out_lens]
    want = int(out_lens.sum())
    record("throughput", model="tiny" if args.tiny else "Qwen3-0.6B-shaped, random weights", dtype=args.dtype,
           num_requests=n, lengths=f"{lo}..{hi}", prompt_tokens=int(in_lens.sum()), output_tokens=want)
    ok = True
    tok_s: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        t0 = time.perf_counter()
        write_random_checkpoint(Path(tmp), config, dtype, device, seed=0)
        say(f"throughput: wrote a random {'tiny' if args.tiny else 'Qwen3-0.6B-shaped'} checkpoint "
            f"({time.perf_counter() - t0:.1f} s)")
        for mode in args.modes.split(","):
            flags = {"enforce_eager": True} if mode == "eager" else \
                {"cudagraph_mode": "full_decode_only" if device == "cuda" else "static"}
            got, elapsed, figures = throughput_run(args, tmp, device, config, flags, prompts, params)
            if got != want:
                say(f"throughput {mode}: FAIL, generated {got} tokens, expected {want}")
                ok = False
                continue
            tok_s[mode] = got / elapsed
            say(f"throughput {mode}: {n} requests, {int(in_lens.sum())} prompt + {got} output tokens in "
                f"{elapsed:.1f} s: {tok_s[mode]:.1f} output tok/s, {(got + int(in_lens.sum())) / elapsed:.1f} total")
            for key, value in figures.items():
                say(f"  {mode} {key}: {value}")
            record("throughput", **{f"{mode}_output_tok_s": round(tok_s[mode], 1), f"{mode}_seconds": round(elapsed, 2),
                                    **{f"{mode}_{k}": v for k, v in figures.items()}})
    if "eager" in tok_s and "graphs" in tok_s:
        record("throughput", graphs_over_eager=round(tok_s["graphs"] / tok_s["eager"], 2))
        say(f"throughput: graphs / eager {tok_s['graphs'] / tok_s['eager']:.2f}x")
    return 0 if ok else 1


def throughput_run(args: argparse.Namespace, model_dir: str, device: str, config: dict, flags: dict,
                   prompts: list[dict], params: list) -> tuple[int, float, dict]:
    """One engine with `flags` (eager or graphs): the timed run, then a profiled decode-bound one.
    Returns (output tokens, seconds, figures)."""
    import numpy as np
    import torch

    from services.common.sampling_params import SamplingParams
    from services.offline.llm import LLM
    rng = np.random.default_rng(1)
    t0 = time.perf_counter()
    kv_bytes = args.kv_cache_gib << 30
    if device == "cuda":
        kv_bytes = min(kv_bytes, int(torch.cuda.mem_get_info()[0] * 0.6))
    llm = LLM(model_dir, dtype=args.dtype, attention_backend="triton" if device == "cuda" else None,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, block_size=16,
              max_model_len=2 * args.max_len + 16, kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=True,
              seed=0, **flags)
    try:
        runner = llm.worker.runner
        static = runner.static_decode
        figures: dict[str, object] = {
            "mode": runner.cudagraph_mode, "load_s": round(time.perf_counter() - t0, 1),
            "graphs_captured": len(static.graphs) if static is not None else 0}
        vocab = config["vocab_size"]
        warm = [{"prompt_token_ids": rng.integers(100, vocab - 1, k).tolist()}
                for k in (args.min_len, (args.min_len + args.max_len) // 2, args.max_len)]
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        sync(device)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync(device)
        elapsed = time.perf_counter() - t0
        if static is not None:
            figures["graph_replays"] = static.replays
        if device == "cuda" and args.profile and not args.no_profile:
            figures.update(profile_decode(llm, vocab, rng))
        return sum(len(o.outputs[0].token_ids) for o in outs), elapsed, figures
    finally:
        llm.close()


def sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


# Launch calls the profiler records on the CPU side, one per kernel or graph launched.
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")


def profile_decode(llm, vocab: int, rng) -> dict[str, object]:
    """A decode-bound batch (64 requests, 16 prompt tokens, 48 outputs) under torch.profiler: GPU
    kernel time over wall time, and kernel/graph launches per engine step (the profiler's own
    overhead is in the wall time, so the ratio is a lower bound)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from services.common.sampling_params import SamplingParams
    prompts = [{"prompt_token_ids": rng.integers(100, vocab - 1, 16).tolist()} for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    steps_before = llm.stats()["num_steps"]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    steps = max(llm.stats()["num_steps"] - steps_before, 1)
    events = prof.events()
    kernel_us = sum(e.device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    launches = sum(1 for e in events if e.name in LAUNCH_CALLS)
    return {"profiled_steps": steps, "profiled_wall_s": round(wall, 3), "kernel_s": round(kernel_us / 1e6, 3),
            "kernel_over_wall": round(kernel_us / 1e6 / wall, 3), "launches_per_step": round(launches / steps, 1)}


# --------------------------------------------------------------------------- sampling


def stage_sampling(args: argparse.Namespace) -> int:
    """The sampler on the GPU with no host sync (torch raises on one under sync debug mode "error")."""
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else None)
    if engine_stage_skip("sampling", device, ()):
        return SKIP
    from services.common.proto import myvllm_pb2 as pb
    from services.worker.sampler import Sampler
    from services.worker.sampling_metadata import build_sampling_metadata
    vocab, rows = 151936, 256
    kinds = [pb.SamplingParams(temperature=0.0), pb.SamplingParams(temperature=0.8, top_k=20),
             pb.SamplingParams(temperature=1.0, top_p=0.9), pb.SamplingParams(temperature=0.7, top_k=200, top_p=0.95),
             pb.SamplingParams(temperature=1.0, min_p=0.05), pb.SamplingParams(temperature=1.0, top_k=5000)]
    params = [kinds[i % len(kinds)] for i in range(rows)]
    md = build_sampling_metadata(params, {}, vocab, device)  # built on the host, as each step does
    sampler = Sampler(max_num_reqs=rows, vocab_size=vocab, device=device)
    logits = torch.randn(rows, vocab, device=device)
    sampler(logits.clone(), md)  # warm (lazy inits, kernels compiled)
    sync(device)
    timings = []
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            x = logits.clone()
            t0 = time.perf_counter()
            sampled, _ = sampler(x, md)
            timings.append(time.perf_counter() - t0)
    except RuntimeError as e:
        say(f"sampling: FAIL, the sampler synchronised with the host: {e}")
        record("sampling", host_syncs=True, error=str(e)[:300])
        return 1
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    ids = sampled.cpu()  # the step's one copy
    ok = bool(((ids >= 0) & (ids < vocab)).all())
    launch_ms = 1000 * sorted(timings)[len(timings) // 2]
    say(f"sampling: {rows} rows (greedy, top-k, top-p, top-k+top-p, min-p, large top-k) without a host sync; "
        f"{launch_ms:.2f} ms to enqueue")
    record("sampling", host_syncs=False, rows=rows, enqueue_ms=round(launch_ms, 3))
    return 0 if ok else 1


# --------------------------------------------------------------------------- report


def stage_report(args: argparse.Namespace) -> int:
    """gpu_check.json and gpu_check.md under --out: each stage's verdict and seconds (the lines
    `name<TAB>verdict<TAB>seconds` in --verdicts) with the figures it recorded."""
    stages = []
    verdicts = Path(args.verdicts).read_text().splitlines() if args.verdicts and Path(args.verdicts).is_file() else []
    for line in verdicts:
        name, verdict, seconds = line.split("\t")
        path = RESULTS_DIR / f"{name}.json"
        figures = json.loads(path.read_text()) if path.is_file() else {}
        stages.append({"stage": name, "verdict": verdict, "seconds": int(seconds), "figures": figures})
    probe = RESULTS_DIR / "probe.json"
    report = {"machine": json.loads(probe.read_text()) if probe.is_file() else {}, "stages": stages,
              "total_seconds": sum(s["seconds"] for s in stages)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, sort_keys=True))
    lines = [f"# make gpu-check: {report['machine'].get('gpu') or 'no GPU'}, torch {report['machine'].get('torch')}",
             "", "| stage | verdict | seconds | figures |", "| --- | --- | ---: | --- |"]
    for s in stages:
        figures = ", ".join(f"{k} {v}" for k, v in s["figures"].items())
        lines.append(f"| {s['stage']} | {s['verdict']} | {s['seconds']} | {figures} |")
    lines.append(f"\nTotal {report['total_seconds']} s.")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    import gpu_check_stages
    ap.add_argument("stage", choices=["probe", "kernels", "greedy", "tp2", "cudagraphs", "sampling", "throughput",
                                      "report", *gpu_check_stages.STAGES])
    ap.add_argument("--device", default=None, help="force a device (e.g. cpu with TRITON_INTERPRET=1, for testing)")
    ap.add_argument("--interpret", action="store_true", help="kernels: run under TRITON_INTERPRET=1 even with CUDA")
    ap.add_argument("--quick", action="store_true", help="greedy: fewer, shorter prompts")
    ap.add_argument("--no-smollm2", action="store_true", help="greedy: the tiny random model even if SmolLM2 is here")
    ap.add_argument("--smollm2", action="store_true",
                    help="cudagraphs: SmolLM2 (when models/ holds it), not the tiny model")
    ap.add_argument("--tiny", action="store_true", help="throughput: a tiny model shape (smoke run)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-cache-gib", type=int, default=64)
    ap.add_argument("--modes", default="eager,graphs", help="throughput: the engine modes to run, in order")
    ap.add_argument("--profile", action="store_true", help="throughput: a profiled decode run after each mode")
    ap.add_argument("--no-profile", action="store_true", help="throughput: no profiled run (the default)")
    ap.add_argument("--verdicts", default=None, help="report: the stages' verdicts (name, verdict, seconds per line)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO_ROOT / "build" / "gpu-check"),
                    help="report: where gpu_check.json and gpu_check.md go (default $OUT, else build/gpu-check)")
    args = ap.parse_args(argv)
    stage = {"probe": stage_probe, "kernels": stage_kernels, "greedy": stage_greedy, "tp2": stage_tp2,
             "cudagraphs": stage_cudagraphs, "sampling": stage_sampling, "throughput": stage_throughput,
             "report": stage_report, **gpu_check_stages.STAGES}[args.stage]
    try:
        return stage(args)
    except Exception:  # noqa: BLE001 - a stage that raises fails with its traceback
        traceback.print_exc()
        say(f"{args.stage}: FAIL (exception)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
