"""Engine flags, with vLLM's names, grouped by the service that reads them.

The worker reads the model flags (what weights, in what dtype, with which attention
backend); the scheduler reads the scheduling flags (batch bounds, KV block accounting); both
read the parallel, speculative and KV transfer flags, which must agree (LoadModel checks).
`myvllm worker` and `myvllm scheduler` list only their own group; `serve`, `generate`
and `bench` (one process, or all three services) take both.
"""

from __future__ import annotations

import argparse

from services.common.config import (
    DEFAULT_ENGINE_TIMEOUT_S,
    DEFAULT_MAX_WAITING_REQUESTS,
    DEFAULT_STRUCTURED_OUTPUTS_COMPILE_TIMEOUT_S,
    DEFAULT_STRUCTURED_OUTPUTS_REQUEST_TIMEOUT_S,
    STRUCTURED_OUTPUTS_COMPILE_WALL_FACTOR,
)

MODEL_KEYS = ("model", "dtype", "seed", "max_model_len", "attention_backend", "tensor_parallel_size",
              "pipeline_parallel_size", "enable_expert_parallel", "data_parallel_size", "compile_model", "runner",
              "convert", "pooler_config", "enforce_eager", "cuda_graph_sizes", "cudagraph_mode")
SCHEDULING_KEYS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "enable_prefix_caching",
                   "num_gpu_blocks_override", "kv_cache_memory_bytes", "scheduling_policy", "async_scheduling",
                   "speculative_config", "structured_outputs_compile_timeout",
                   "structured_outputs_request_timeout", "kv_transfer_config")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """What the worker loads and how it computes."""
    p.add_argument("--model", default=None, help="HF model directory (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["float32", "bfloat16", "float16", "auto"],
                   help="default auto: bfloat16 on a CPU with bf16 instructions (avx512_bf16 / AMX) or CUDA, "
                        "float32 on other CPUs (logged with the reason)")
    p.add_argument("--compile", dest="compile_model", action="store_true",
                   help="CPU: compile the model's forward with torch.compile (inductor; opt-in: the first start "
                        "compiles for minutes; see BENCHMARKS.md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--attention-backend", default=None, choices=["torch", "cpu", "triton"],
                   help="default: triton on CUDA, cpu (C decode kernel) on CPU; torch when cpu cannot be built")
    p.add_argument("--runner", default="generate", choices=["generate", "pooling"],
                   help="generate: sample tokens (default); pooling: embeddings only (/v1/embeddings, LLM.embed), "
                        "prefix caching off")
    p.add_argument("--convert", default=None, choices=["none", "embed"],
                   help="how a causal LM runs under --runner pooling: embed (implied), its final-norm hidden states "
                        "pooled")
    p.add_argument("--pooler-config", default=None,
                   help='the pooling runner\'s pooler, vLLM\'s JSON: \'{"pooling_type": "LAST"|"MEAN", '
                        '"normalize": true}\' (default LAST, normalized)')
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: every step runs eager (vLLM's flag; on CPU steps always do)")
    p.add_argument("--cuda-graph-sizes", nargs="+", action=_JoinSizes, default=None, metavar="N",
                   help="batch sizes pure-decode steps are padded to and captured at, e.g. 1 2 4 8 (or 1,2,4,8); "
                        "default vLLM's list, 1 2 4 8 16 24 ... 248 256 272 ... 512, up to the first size >= "
                        "--max-num-seqs")
    p.add_argument("--cudagraph-mode", default=None, type=str.lower, choices=["none", "static", "full_decode_only"],
                   help="vLLM's compilation_config.cudagraph_mode: full_decode_only captures one CUDA graph per "
                        "size at start-up and replays it for pure-decode steps (mixed and prefill steps run eager); "
                        "static runs those steps eagerly on the same padded buffers (any device: what the CPU tests "
                        "check); none: plain steps. Default: full_decode_only on CUDA with the triton backend "
                        "(unless --enforce-eager, --compile, tensor/pipeline/expert parallelism or --runner "
                        "pooling), none elsewhere")
    add_parallel_args(p)


class _JoinSizes(argparse.Action):
    """--cuda-graph-sizes 1 2 4 or 1,2,4: kept as one "1,2,4" string (EngineConfig parses it), so
    that serve forwards it to the worker as one argument."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, ",".join(str(v) for v in values))


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Read by the worker (a rank loads its shard once its scheduler assigns its rank) and by the
    scheduler (its --workers are T ranks per stage, stage-major; it keeps P steps in flight)."""
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks that split each layer's heads and MLP columns (a worker started with T > 1 waits "
                        "for its scheduler to assign its rank)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="stages that split the model's layers, T ranks each; the scheduler keeps P steps in "
                        "flight so that no stage idles")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: split the experts across the ranks (each holds whole experts) instead of every "
                        "expert's columns: the tensor-parallel ranks, or with --data-parallel-size D > 1 all D x T "
                        "ranks of the D engines, which then step in lockstep; dense models ignore it with one engine")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas (each a scheduler and its worker ranks); serve starts a redis-server for "
                        "their load (or uses --redis) and the gateway routes between them. With "
                        "--enable-expert-parallel the replicas are one group (data-parallel attention, "
                        "expert-parallel MoE layers)")


def add_scheduling_args(p: argparse.ArgumentParser) -> None:
    """How the scheduler batches requests and accounts KV blocks."""
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--kv-cache-memory", dest="kv_cache_memory_bytes", type=int, default=None,
                   help="KV cache budget in bytes")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--async-scheduling", dest="async_scheduling", action="store_true", default=None,
                   help="keep two steps in flight (default: on for CUDA, off on CPU)")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    p.add_argument("--structured-outputs-compile-timeout", type=float,
                   default=DEFAULT_STRUCTURED_OUTPUTS_COMPILE_TIMEOUT_S,
                   help="seconds of CPU time a structured-output grammar (JSON schema, regex, grammar) may take "
                        "to compile, in a low-priority helper process that is killed past it (or past "
                        f"{STRUCTURED_OUTPUTS_COMPILE_WALL_FACTOR}x it of wall-clock time); the request then ends "
                        f"with a 400 (default {DEFAULT_STRUCTURED_OUTPUTS_COMPILE_TIMEOUT_S:g})")
    p.add_argument("--structured-outputs-request-timeout", type=float,
                   default=DEFAULT_STRUCTURED_OUTPUTS_REQUEST_TIMEOUT_S,
                   help="seconds of wall-clock time one structured-output request may spend waiting for its "
                        "grammar work: its compile (queue included) and every allowed-token row and matcher "
                        "advance, together; the request then ends with a 400 naming this flag "
                        f"(default {DEFAULT_STRUCTURED_OUTPUTS_REQUEST_TIMEOUT_S:g})")
    add_speculative_arg(p)
    add_kv_transfer_arg(p)


def add_kv_transfer_arg(p: argparse.ArgumentParser) -> None:
    """Read by the scheduler (requests that wait for remote KV, blocks kept until saved) and by the
    worker (the transport)."""
    p.add_argument("--kv-transfer-config", default=None,
                   help='prefill/decode disaggregation, vLLM\'s JSON: \'{"kv_connector": "SharedMemoryConnector", '
                        '"kv_role": "kv_producer"}\' (or "kv_consumer", "kv_both"); "kv_connector_extra_config": '
                        '{"shm_dir": DIR, "segment_ttl_s": S}')


def add_speculative_arg(p: argparse.ArgumentParser) -> None:
    """Read by the scheduler (it schedules the drafts and sends the setting to its worker with
    LoadModel) and by the worker (the draft model it may load)."""
    p.add_argument("--speculative-config", default=None,
                   help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"method": "draft_model", '
                        '"model": DIR, "num_speculative_tokens": 4}\'; "disable_by_batch_size": N turns drafts off '
                        'while N requests run (default 0 = never)')


def add_scheduler_service_args(p: argparse.ArgumentParser) -> None:
    """The scheduler service's own flags (how it guards itself), not the engine's configuration."""
    p.add_argument("--engine-timeout", type=float, default=DEFAULT_ENGINE_TIMEOUT_S,
                   help="seconds the scheduler waits for the worker's answer to a step before it treats the "
                        f"worker as dead (default {DEFAULT_ENGINE_TIMEOUT_S:g})")
    p.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                   help="requests the scheduler queues waiting for a batch slot; more are refused with "
                        f"RESOURCE_EXHAUSTED, a 429 at the gateway (default {DEFAULT_MAX_WAITING_REQUESTS})")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Both groups: for commands that run a whole engine replica."""
    add_model_args(p)
    add_scheduling_args(p)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig arguments among the parsed flags."""
    return {k: getattr(args, k) for k in MODEL_KEYS + SCHEDULING_KEYS if hasattr(args, k)}
