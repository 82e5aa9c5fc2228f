"""Engine configuration (vLLM's VllmConfig and its parts, with vLLM's argument names), and where the
default model lives."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.config_fields import flag, flag_dest, flag_dests, flag_fields, from_proto, to_proto
from services.common.cpu_dtype_probe import GemmTimings, choose_dtype_by_timings
from services.common.cudagraph_config import CUDAGRAPH_MODES, check_cudagraph_mode, parse_capture_sizes
from services.common.flag_values import DTYPE_ALIASES, dtype_name, max_model_len_value
from services.common.kv_transfer_config import KVTransferConfig
from services.common.log_format import vllm_formatter
from services.common.pooling_config import CONVERTS, RUNNERS, PoolerConfig
from services.common.proto import myvllm_pb2 as pb
from services.common.quantization import QUANTIZATION_METHODS, quantization_method
from services.common.spec_config import SpeculativeConfig


def _dtype_logger() -> logging.Logger:
    """The dtype choice is always shown (as vLLM's INFO line is), in vLLM's format, whatever the
    process's logging setup: the offline LLM configures none."""
    log = logging.getLogger("myvllm.dtype")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(vllm_formatter())
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


dtype_logger = _dtype_logger()

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"
# How long a scheduler waits for its worker's answer to one step before it declares the
# worker dead (`--engine-timeout`): far above any step's compute time, far below "forever".
DEFAULT_ENGINE_TIMEOUT_S = 30.0
# Requests a scheduler holds waiting for a batch slot (`--max-waiting-requests`); one more is
# refused with RESOURCE_EXHAUSTED (a 429 at the gateway) instead of growing the queue without
# bound: a gRPC client has no gateway admission in front of it. Eight times the gateway's
# default concurrency, so one gateway at its defaults (n = 1) never meets it.
DEFAULT_MAX_WAITING_REQUESTS = 8192
# CPU seconds one structured-output grammar may take to compile (`--structured-outputs-compile-timeout`):
# real schemas compile in milliseconds; a pathological one (huge repetition bounds) can take
# minutes and is stopped, its request ended with a 400.
DEFAULT_STRUCTURED_OUTPUTS_COMPILE_TIMEOUT_S = 10.0
# The limit counts the compile's CPU time (it runs at low priority: on a busy machine it waits
# for a core, and a schema must not fail for the load); a starved compile is also stopped after
# this many times the limit of wall-clock time.
STRUCTURED_OUTPUTS_COMPILE_WALL_FACTOR = 10
# Wall-clock seconds one constrained request may spend waiting for its grammar work, its compile
# and every allowed-token row and matcher advance together (`--structured-outputs-request-timeout`):
# a compile within its CPU limit can still take minutes of wall-clock time on a busy machine
# (it runs at the lowest priority), and some grammars get slower with every token; past this the
# request ends with a 400 instead of holding its place that long.
DEFAULT_STRUCTURED_OUTPUTS_REQUEST_TIMEOUT_S = 30.0
# A CPU worker's KV cache budget when --kv-cache-memory does not give one.
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


def default_model_path() -> str:
    """The default model: $MYVLLM_MODEL, else the HF directory `make setup` converts."""
    return os.environ.get("MYVLLM_MODEL", str(DEFAULT_MODEL_DIR))


def is_gguf_file(model: str | None) -> bool:
    """Whether `model` names a .gguf checkpoint file (served with its weights kept quantized)."""
    return bool(model) and str(model).endswith(".gguf")


def check_model_dir(model: str) -> str:
    """Fail with one clear line when the model directory (or .gguf file) is missing."""
    if is_gguf_file(model):
        if not os.path.isfile(model):
            raise FileNotFoundError(f"GGUF file not found: {model}")
        return model
    if not os.path.isdir(model):
        hint = " (run `make setup` to convert the default model)" if model == str(DEFAULT_MODEL_DIR) else ""
        raise FileNotFoundError(f"model directory not found: {model}{hint}")
    return model


def check_quantization(model: str | None, quantization: str | None) -> str | None:
    """The quantization a model loads with: gguf for a .gguf file (which takes no other);
    ValueError, in one line, for a combination that cannot load."""
    if is_gguf_file(model):
        if quantization not in (None, "gguf"):
            raise ValueError(f"--quantization {quantization}: {model} is a GGUF file, already quantized "
                             "(leave --quantization out or give gguf)")
        return "gguf"
    if quantization == "gguf" and model:
        raise ValueError(f"--quantization gguf needs a .gguf file; {model} is not one")
    return quantization


# x86 (avx512_bf16: AVX-512 dot products of bf16 pairs; amx_bf16: AMX tiles) and Arm (bf16)
# /proc/cpuinfo flags for bf16 arithmetic. Without one, oneDNN converts bf16 to fp32 in
# software around every GEMM: bf16 halves the bytes but runs slower than fp32.
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_flags() -> set[str]:
    """This CPU's instruction-set flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def choose_cpu_dtype(flags: Iterable[str]) -> tuple[str, str]:
    """`--dtype auto` on CPU: ("bfloat16", why) where the CPU has bf16 instructions, else
    ("float32", why). A pure function of the flags, so it is tested with fake ones."""
    flags = set(flags)
    found = [f for f in CPU_BF16_FLAGS if f in flags]
    if found:
        return "bfloat16", f"the CPU has bf16 instructions ({', '.join(found)})"
    return "float32", f"the CPU has no bf16 instructions (none of {', '.join(CPU_BF16_FLAGS)})"


def resolve_dtype_name(dtype: str, device_type: str, flags: Iterable[str] | None = None,
                       cuda_bf16: bool = True, probe: Callable[[], GemmTimings | None] | None = None) -> str:
    """The dtype a worker on `device_type` runs for the requested `dtype` ("auto" included),
    logging the automatic choice and warning when bf16 is asked of a CPU that lacks it.

    `probe`: times the model's projection GEMMs in fp32 and bf16 (None: nothing to time) to
    settle "auto" on a CPU with bf16 instructions (services/common/cpu_dtype_probe.py); without
    one the instruction-flag rule decides (a choice every process makes alike)."""
    if device_type == "cpu":
        flags = cpu_flags() if flags is None else set(flags)
        if dtype == "auto":
            chosen, why = choose_cpu_dtype(flags)
            # Without bf16 instructions every bf16 GEMM converts in software: nothing to measure.
            timings = probe() if probe is not None and chosen == "bfloat16" else None
            if timings is not None:
                chosen, why = choose_dtype_by_timings(timings)
            dtype_logger.info("dtype auto -> %s: %s", chosen, why)
            return chosen
        if dtype in ("bfloat16", "bf16") and choose_cpu_dtype(flags)[0] != "bfloat16":
            dtype_logger.warning("dtype bfloat16 on a CPU without bf16 instructions (none of %s): it runs, but every "
                           "GEMM converts in software and is slower than float32", ", ".join(CPU_BF16_FLAGS))
        return dtype
    if dtype == "auto":
        chosen = "bfloat16" if cuda_bf16 else "float16"
        dtype_logger.info("dtype auto -> %s on %s", chosen, device_type)
        return chosen
    return dtype


# Upper bounds a worker accepts in LoadModel whoever sends it (the persistent batch and the
# sampler's per-row state are sized by them before any request arrives).
MAX_NUM_SEQS_LIMIT = 16384
MAX_NUM_BATCHED_TOKENS_LIMIT = 1 << 20
# vLLM's largest supported LoRA rank (its max_lora_rank choices end at 512).
MAX_LORA_RANK_LIMIT = 512
# The KV tier's backends (vLLM's --kv-offloading-backend; its "lmcache" is a separate package).
KV_OFFLOADING_BACKENDS = ("native",)


def kv_tier_medium(device: str, kv_offloading_dir: str | None) -> str:
    """Where the native KV tier keeps blocks (KV events' `medium`): "CPU", pinned host memory, on
    a GPU without --kv-offloading-dir (vLLM's native CPU offloading); "DISK", files, otherwise."""
    return "CPU" if device == "cuda" and not kv_offloading_dir else "DISK"


class JoinSizes(argparse.Action):
    """--cuda-graph-sizes 1 2 4 or 1,2,4: kept as one "1,2,4" string (VllmConfig parses it), so
    that serve forwards it to the worker as one argument."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, ",".join(str(v) for v in values))


# The parts of VllmConfig, vLLM's names. Each field is declared once, with its flag (help,
# choices, vLLM's spelling) and its wire form (services/common/config_fields.py): the flags, the
# engine arguments, the proto conversion and the proto messages themselves (proto/myvllm.proto,
# VllmConfig and its parts: `make proto` regenerates them, services/common/config_proto_gen.py)
# are generated from these declarations. A class's docstring is its message's comment, a flag's
# help its field's.


@dataclass
class ModelConfig:
    """What the worker loads and how it computes (the worker's flags own it)."""

    model: str | None = field(default=None, metadata=flag(
        help="HF model directory or a .gguf file (default: the converted SmolLM2-135M-Instruct)"))
    # Weights kept quantized in memory (services/worker/quant): gguf reads a .gguf file's blocks
    # as they are (a path ending .gguf implies it); int8 quantizes an HF checkpoint's linear
    # layers to Q8_0 blocks at load. None: the checkpoint's dense weights.
    quantization: str | None = field(default=None, metadata=flag(
        aliases=("-q",), choices=QUANTIZATION_METHODS, type=quantization_method,
        help="gguf: a .gguf file's weights kept in their blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; implied by a "
             ".gguf path); int8: the linear layers quantized to Q8_0 blocks at load (a scale per 32 inputs)"))
    # "auto", as in vLLM: bf16 on CUDA, fp32 on a CPU without bf16 instructions; on a CPU with
    # them (avx512_bf16 / AMX) the worker times the model's projection GEMMs in both dtypes at
    # start-up and keeps the faster overall (services/common/cpu_dtype_probe.py): bf16 instructions
    # alone do not make bf16 faster (without AMX a bf16 GEMM may run at half the fp32 rate).
    # vLLM's spellings half and float are read as float16 and float32 (flag_values.DTYPE_ALIASES).
    dtype: str = field(default="auto", metadata=flag(
        choices=("float32", "bfloat16", "float16", "auto"), type=dtype_name,
        metavar="{auto,bfloat16,float16,half,float32,float}",
        help="default auto: bfloat16 on CUDA; on a CPU with bf16 instructions (avx512_bf16 / AMX) whichever of "
             "bfloat16 and float32 runs the model's GEMMs faster, measured at start-up; float32 on other CPUs "
             "(logged with the figures and the reason); half = float16, float = float32"))
    # CPU: run the forward through torch.compile (services/worker/models/compiled.py). Off by
    # default: it compiles for minutes at start-up for a modestly faster step (BENCHMARKS.md, CPU kernels).
    compile_model: bool = field(default=False, metadata=flag(
        name="--compile",
        help="CPU: compile the model's forward with torch.compile (inductor; opt-in: the first start compiles for "
             "minutes; see BENCHMARKS.md)"))
    seed: int = field(default=0, metadata=flag(
        help="the engine's random seed (sampling without a per-request seed)", proto_type="int64"))
    max_model_len: int | None = field(default=None, metadata=flag(
        type=max_model_len_value,
        help="the longest a request (prompt and output) may be, in tokens; vLLM's spellings: 4096, 4k (4000), "
             "4K (4096), 1m, 1M; auto or -1: the model's max_position_embeddings (the default)"))
    attention_backend: str | None = field(default=None, metadata=flag(
        choices=("torch", "cpu", "triton"),
        help="default: triton on CUDA, cpu (C decode kernel) on CPU; torch when cpu cannot be built"))
    # vLLM's runner: "generate" (sample tokens) or "pooling" (embeddings only). A causal LM runs
    # pooling as convert "embed" (None: what the runner implies); pooler_config (vLLM's dict or
    # its JSON text; None: LAST + normalize) says how its hidden states become one vector.
    runner: str = field(default="generate", metadata=flag(
        choices=RUNNERS, zero_is_default=True,
        help="generate: sample tokens (default); pooling: embeddings only (/v1/embeddings, LLM.embed), prefix "
             "caching off"))
    convert: str | None = field(default=None, metadata=flag(
        choices=CONVERTS,
        help="how a causal LM runs under --runner pooling: embed (implied), its final-norm hidden states pooled"))
    pooler_config: PoolerConfig | dict | str | None = field(default=None, metadata=flag(
        help='the pooling runner\'s pooler, vLLM\'s JSON: \'{"pooling_type": "LAST"|"MEAN", "normalize": true}\' '
             '(default LAST, normalized)'))
    # CUDA graphs for pure-decode steps (services/worker/cuda_graphs.py), vLLM's names:
    # enforce_eager turns them off; cuda_graph_sizes (a list, or "1,2,4,8") are the batch sizes
    # steps are padded to (None: vLLM's default list up to max_num_seqs); cudagraph_mode is
    # "none", "static" (the padded buffers run eagerly, on any device: what the CPU tests check)
    # or "full_decode_only" (CUDA graphs); None: full_decode_only on CUDA with the triton
    # backend, none elsewhere.
    enforce_eager: bool = field(default=False, metadata=flag(
        help="no CUDA graphs: every step runs eager (vLLM's flag; on CPU steps always do)"))
    cuda_graph_sizes: list[int] | str | None = field(default=None, metadata=flag(
        nargs="+", action=JoinSizes, metavar="N",
        help="batch sizes pure-decode steps are padded to and captured at, e.g. 1 2 4 8 (or 1,2,4,8); default "
             "vLLM's list, 1 2 4 8 16 24 ... 248 256 272 ... 512, up to the first size >= --max-num-seqs"))
    cudagraph_mode: str | None = field(default=None, metadata=flag(
        type=str.lower, choices=CUDAGRAPH_MODES,
        help="vLLM's compilation_config.cudagraph_mode: full_decode_only captures one CUDA graph per size at "
             "start-up and replays it for pure-decode steps (mixed and prefill steps run eager); static runs those "
             "steps eagerly on the same padded buffers (any device: what the CPU tests check); none: plain steps. "
             "Default: full_decode_only on CUDA with the triton backend (unless --enforce-eager, --compile, "
             "tensor/pipeline/expert parallelism or --runner pooling), none elsewhere"))


@dataclass
class CacheConfig:
    """How the KV cache is laid out and sized (the scheduler's; the worker reads the KV tier's
    fields)."""

    block_size: int = field(default=16, metadata=flag(help="tokens per KV cache block"))
    enable_prefix_caching: bool = field(default=True, metadata=flag(
        help="recompute every prompt instead of reusing the KV blocks of an earlier identical prefix"))
    num_gpu_blocks_override: int | None = field(default=None, metadata=flag(
        help="KV cache blocks to allocate (the null block included), instead of what fits the budget"))
    kv_cache_memory_bytes: int | None = field(default=None, metadata=flag(
        name="--kv-cache-memory", help="KV cache budget in bytes (default: the worker's own budget)",
        proto_type="int64"))
    # vLLM's fraction of the GPU's memory this engine may take (weights, activations and KV
    # cache); what the weights and this process's other allocations leave of it sizes the KV
    # cache. None keeps the worker's own rule (80% of the memory free once the model is loaded);
    # a CPU worker sizes its cache by --kv-cache-memory alone and says so.
    gpu_memory_utilization: float | None = field(default=None, metadata=flag(
        example=0.5,
        help="CUDA: the fraction of the GPU's memory (0-1] for this engine, weights and KV cache together; the KV "
             "cache gets what the weights leave of it (default: 0.8 of the memory free once the model is loaded; "
             "--kv-cache-memory, if given, wins; on CPU it does not apply, see --kv-cache-memory)"))
    # A second KV tier (vLLM's KV offloading): blocks evicted from the pool are kept there, keyed
    # by the prefix cache's chained hash, and loaded back on a prefix hit instead of recomputed.
    # "native": files in a directory on local disk (kv_offloading_dir), which outlive the worker.
    kv_offloading_size: float | None = field(default=None, metadata=flag(
        example=0.5,
        help="GiB of KV blocks to keep in a second tier beyond the KV cache and load back on a prefix hit "
             "(default: no tier); backend native: files under --kv-offloading-dir, which outlive a worker restart "
             "(on a GPU without --kv-offloading-dir: pinned host memory)"))
    kv_offloading_backend: str | None = field(default=None, metadata=flag(
        choices=KV_OFFLOADING_BACKENDS,
        help="the KV tier's backend (default: native when --kv-offloading-size is given)"))
    kv_offloading_dir: str | None = field(default=None, metadata=flag(
        example="/tmp/kv-tier",
        help="the native KV tier's directory, one per engine (default: ~/.cache/myvllm/kv-tier/<model "
             "digest>-dp<rank>)"))


@dataclass
class ParallelConfig:
    """Read by the worker (a rank loads its shard once its scheduler assigns its rank) and by the
    scheduler (its --workers are T ranks per stage, stage-major; it keeps P steps in flight).

    An engine has T x P ranks, stage-major: rank = pipeline_parallel_rank * T + tensor_parallel_rank."""

    # Worker ranks per engine, each holding 1/T of the heads and MLP columns.
    tensor_parallel_size: int = field(default=1, metadata=flag(
        aliases=("-tp",),
        help="ranks that split each layer's heads and MLP columns (a worker started with T > 1 waits for its "
             "scheduler to assign its rank)"))
    # Pipeline stages per engine, each holding 1/P of the layers (T x P ranks in all); the
    # scheduler keeps P steps in flight so no stage idles.
    pipeline_parallel_size: int = field(default=1, metadata=flag(
        aliases=("-pp",),
        help="stages that split the model's layers, T ranks each; the scheduler keeps P steps in flight so that "
             "no stage idles"))
    # MoE models: the experts are split across the tensor-parallel ranks (each rank holds whole
    # experts) instead of every expert's columns; ignored by dense models, as in vLLM.
    enable_expert_parallel: bool = field(default=False, metadata=flag(
        help="MoE models: split the experts across the ranks (each holds whole experts) instead of every expert's "
             "columns: the tensor-parallel ranks, or with --data-parallel-size D > 1 all D x T ranks of the D "
             "engines, which then step in lockstep; dense models ignore it with one engine"))
    # Engine replicas. Dense models (or MoE without enable_expert_parallel): independent replicas
    # behind the gateway's load-based routing. With enable_expert_parallel: one group whose MoE
    # layers split the experts over all D x T ranks and whose engines step in lockstep (an idle
    # engine runs dummy steps; services/engine/step_loop.py, docs/design.md, "Waves").
    data_parallel_size: int = field(default=1, metadata=flag(
        aliases=("-dp",), zero_is_default=True,
        help="engine replicas (each a scheduler and its worker ranks); serve starts a redis-server for their load "
             "(or uses --redis) and the gateway routes between them. With --enable-expert-parallel the replicas "
             "are one group (data-parallel attention, expert-parallel MoE layers)"))


@dataclass
class SchedulerConfig:
    """How the scheduler batches requests (the scheduler's)."""

    max_num_seqs: int = field(default=256, metadata=flag(help="requests one step may run at most"))
    max_num_batched_tokens: int = field(default=2048, metadata=flag(help="tokens one step may compute at most"))
    scheduling_policy: str = field(default="fcfs", metadata=flag(
        choices=("fcfs", "priority"), help="the order waiting requests are scheduled in"))
    # None: on where the worker runs on CUDA, off on CPU (see VllmConfig.resolve_async_scheduling).
    async_scheduling: bool | None = field(default=None, metadata=flag(
        help="keep two steps in flight (default: on for CUDA, off on CPU)"))


@dataclass
class StructuredOutputsConfig:
    """Budgets of structured-output grammar work (the scheduler's)."""

    # Seconds a constrained request's grammar may take to compile (a helper process runs the
    # compile and kills it past this); the request then ends with a 400.
    compile_timeout_s: float = field(default=DEFAULT_STRUCTURED_OUTPUTS_COMPILE_TIMEOUT_S, metadata=flag(
        name="--structured-outputs-compile-timeout", dest="structured_outputs_compile_timeout",
        help="seconds of CPU time a structured-output grammar (JSON schema, regex, grammar) may take to compile, "
             "in a low-priority helper process that is killed past it (or past "
             f"{STRUCTURED_OUTPUTS_COMPILE_WALL_FACTOR}x it of wall-clock time); the request then ends with a 400 "
             f"(default {DEFAULT_STRUCTURED_OUTPUTS_COMPILE_TIMEOUT_S:g})"))
    # Wall-clock seconds a constrained request's grammar work (compile, rows, matcher) may take
    # in all; the request then ends with a 400.
    request_timeout_s: float = field(default=DEFAULT_STRUCTURED_OUTPUTS_REQUEST_TIMEOUT_S, metadata=flag(
        name="--structured-outputs-request-timeout", dest="structured_outputs_request_timeout",
        zero_is_default=True,
        help="seconds of wall-clock time one structured-output request may spend waiting for its grammar work: its "
             "compile (queue included) and every allowed-token row and matcher advance, together; the request then "
             f"ends with a 400 naming this flag (default {DEFAULT_STRUCTURED_OUTPUTS_REQUEST_TIMEOUT_S:g})"))


@dataclass
class LoRAConfig:
    """LoRA adapters over the base model (vLLM's LoRAConfig): how many one step may mix, their
    largest rank, how many the worker keeps loaded. Read by the scheduler (slots per step) and the
    worker (slot table, CPU cache); the gateway's --lora-modules name the adapters served."""

    enable_lora: bool = field(default=False, metadata=flag(
        help="serve LoRA adapters (PEFT format) over the base model: --lora-modules, a request's model naming an "
             "adapter, LLM.generate(lora_request=...)"))
    max_loras: int = field(default=1, metadata=flag(
        help="distinct LoRA adapters one step may run (the worker's slot table)"))
    max_lora_rank: int = field(default=16, metadata=flag(help="the largest LoRA rank an adapter may have"))
    # None: max_loras (vLLM's default); never fewer than max_loras.
    max_cpu_loras: int | None = field(default=None, metadata=flag(
        help="LoRA adapters the worker keeps loaded in host memory, least recently used dropped first (default: "
             "--max-loras)"))


# The parts, in VllmConfig's order, that are dataclasses of flags of their own (the other
# fields of VllmConfig are one JSON-valued flag each).
PARTS = {"model_config": ModelConfig, "cache_config": CacheConfig, "parallel_config": ParallelConfig,
         "scheduler_config": SchedulerConfig, "structured_outputs_config": StructuredOutputsConfig,
         "lora_config": LoRAConfig}


@dataclass
class VllmConfig:
    """Everything one engine replica (scheduler + its worker) is built from: vLLM's VllmConfig,
    with vLLM's names, built once (from flags, LLM(...) arguments or LoadModel) and carried whole:
    in every LoadModel to every rank, and back in ModelInfo as the worker runs it.

    Where scheduler and worker are separate processes, each part has one owner: model_config is
    the worker's (a scheduler leaves it out and adopts the worker's); parallel_config,
    speculative_config and kv_transfer_config are read by both and must agree; cache_config,
    scheduler_config and structured_outputs_config are the scheduler's."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Speculative decoding, vLLM's dict (or its JSON text): {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_max": ..., "prompt_lookup_min": ...} or
    # {"method": "draft_model", "model": dir, "num_speculative_tokens": k}. None: off.
    speculative_config: SpeculativeConfig | dict | str | None = field(default=None, metadata=flag(
        help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
             '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"method": "draft_model", "model": DIR, '
             '"num_speculative_tokens": 4}\'; "disable_by_batch_size": N turns drafts off while N requests run '
             '(default 0 = never)', comment="absent = no speculative decoding"))
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    # Prefill/decode disaggregation, vLLM's kv_transfer_config dict (or its JSON text):
    # {"kv_connector": "SharedMemoryConnector", "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
    # "kv_connector_extra_config": {...}}. None: no KV connector.
    kv_transfer_config: KVTransferConfig | dict | str | None = field(default=None, metadata=flag(
        help='prefill/decode disaggregation, vLLM\'s JSON: \'{"kv_connector": "SharedMemoryConnector", '
             '"kv_role": "kv_producer"}\' (or "kv_consumer", "kv_both"); "kv_connector_extra_config": '
             '{"shm_dir": DIR, "segment_ttl_s": S}', comment="absent = no KV connector (no P/D disaggregation)"))
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)

    @classmethod
    def from_engine_args(cls, **engine_args: Any) -> VllmConfig:
        """From vLLM's flat engine arguments (LLM(**kwargs), the parsed flags), each taken by the
        part whose field declares it."""
        args = dict(engine_args)
        parts = {}
        for name, part in PARTS.items():
            parts[name] = part(**{f.name: args.pop(flag_dest(f)) for f in flag_fields(part) if flag_dest(f) in args})
        unknown = sorted(set(args) - set(flag_dests(cls)))
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}")
        return cls(**parts, **args)

    def __post_init__(self) -> None:
        m, c, p, s = self.model_config, self.cache_config, self.parallel_config, self.scheduler_config
        so = self.structured_outputs_config
        if m.model is None:
            m.model = default_model_path()
        m.quantization = check_quantization(m.model, m.quantization)
        self._apply_runner()
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None:
            self._check_speculation()
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        if self.kv_transfer_config is not None:
            self._check_kv_transfer()
        self._check_cuda_graphs()
        if s.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {s.scheduling_policy!r}")
        if not so.compile_timeout_s > 0:
            raise ValueError("structured_outputs_compile_timeout (--structured-outputs-compile-timeout) must be "
                             f"positive, got {so.compile_timeout_s}")
        if not so.request_timeout_s > 0:
            raise ValueError("structured_outputs_request_timeout (--structured-outputs-request-timeout) must be "
                             f"positive, got {so.request_timeout_s}")
        m.dtype = DTYPE_ALIASES.get(m.dtype, m.dtype)  # LLM(dtype="half") as the flag reads it
        if c.gpu_memory_utilization is not None and not 0 < c.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization (--gpu-memory-utilization) must be in (0, 1], got "
                             f"{c.gpu_memory_utilization}")
        if c.block_size < 1:
            raise ValueError(f"block_size must be positive, got {c.block_size}")
        self._check_kv_offloading()
        if not 1 <= s.max_num_seqs <= MAX_NUM_SEQS_LIMIT:
            raise ValueError(f"max_num_seqs must be in [1, {MAX_NUM_SEQS_LIMIT}], got {s.max_num_seqs}")
        if not 1 <= s.max_num_batched_tokens <= MAX_NUM_BATCHED_TOKENS_LIMIT:
            raise ValueError(f"max_num_batched_tokens must be in [1, {MAX_NUM_BATCHED_TOKENS_LIMIT}], "
                             f"got {s.max_num_batched_tokens}")
        if p.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be positive, got {p.tensor_parallel_size}")
        if p.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be positive, got {p.pipeline_parallel_size}")
        if p.pipeline_parallel_size > 1 and s.async_scheduling:
            raise ValueError("async scheduling does not combine with pipeline parallelism (the first stage "
                             "needs each sampled token before it schedules the next); the pipeline keeps "
                             "pipeline_parallel_size steps in flight instead")
        if p.pipeline_parallel_size > 1 and m.compile_model:
            raise ValueError("compile_model is not supported with pipeline_parallel_size > 1")
        if p.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be positive, got {p.data_parallel_size}")
        if self.expert_parallel_group:
            self._check_expert_parallel_group()
        self._check_lora()

    @property
    def kv_offloading(self) -> bool:
        """Whether the engine keeps a second KV tier (--kv-offloading-size)."""
        return self.cache_config.kv_offloading_size is not None

    def _check_kv_offloading(self) -> None:
        c = self.cache_config
        if c.kv_offloading_size is None:
            if c.kv_offloading_backend is not None or c.kv_offloading_dir is not None:
                raise ValueError("--kv-offloading-backend and --kv-offloading-dir need --kv-offloading-size")
            return
        if not c.kv_offloading_size > 0:
            raise ValueError(f"kv_offloading_size (--kv-offloading-size) must be positive GiB, got "
                             f"{c.kv_offloading_size}")
        if c.kv_offloading_backend is None:
            c.kv_offloading_backend = "native"
        if c.kv_offloading_backend not in KV_OFFLOADING_BACKENDS:
            raise ValueError(f"kv_offloading_backend (--kv-offloading-backend) must be one of "
                             f"{KV_OFFLOADING_BACKENDS}, got {c.kv_offloading_backend!r} (LMCache is not bundled)")
        refused = [(self.model_config.runner == "pooling", "runner 'pooling'"),
                   (not c.enable_prefix_caching, "--no-enable-prefix-caching (the tier is keyed by the prefix "
                    "cache's hashes)"),
                   (self.kv_transfer_config is not None, "--kv-transfer-config (one KV connector per engine)"),
                   (self.parallel_config.tensor_parallel_size > 1 or self.parallel_config.pipeline_parallel_size > 1,
                    "tensor or pipeline parallelism (a tier holds one rank's whole KV)"),
                   (self.speculative_config is not None and self.speculative_config.method == "draft_model",
                    "speculative_config method draft_model (the draft's own KV is not kept)")]
        for hit, what in refused:
            if hit:
                raise ValueError(f"kv_offloading_size (--kv-offloading-size) does not combine with {what} yet")

    def _check_lora(self) -> None:
        lora = self.lora_config
        if lora.max_loras < 1:
            raise ValueError(f"max_loras (--max-loras) must be positive, got {lora.max_loras}")
        if not 1 <= lora.max_lora_rank <= MAX_LORA_RANK_LIMIT:
            raise ValueError(f"max_lora_rank (--max-lora-rank) must be in [1, {MAX_LORA_RANK_LIMIT}], "
                             f"got {lora.max_lora_rank}")
        if lora.enable_lora:
            p, m = self.parallel_config, self.model_config
            if p.tensor_parallel_size > 1 or p.pipeline_parallel_size > 1:
                raise ValueError("LoRA adapters (--enable-lora) with tensor or pipeline parallelism are not "
                                 "supported yet: serve with one rank per replica (--data-parallel-size for more)")
            if m.compile_model:
                raise ValueError("LoRA adapters (--enable-lora) do not combine with --compile yet")
            if m.runner == "pooling":
                raise ValueError("LoRA adapters (--enable-lora) need the generate runner")
        if lora.max_cpu_loras is None:
            lora.max_cpu_loras = lora.max_loras
        if lora.max_cpu_loras < lora.max_loras:
            raise ValueError(f"max_cpu_loras (--max-cpu-loras) must be at least max_loras ({lora.max_loras}), "
                             f"got {lora.max_cpu_loras}")

    def _apply_runner(self) -> None:
        """The pooling runner's rules, in one place (also run when a scheduler adopts its
        worker's model part, which carries the runner)."""
        m = self.model_config
        if m.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {m.runner!r}")
        if m.convert is None:  # vLLM: a causal LM under the pooling runner is converted to embed
            m.convert = "embed" if m.runner == "pooling" else "none"
        if m.convert not in CONVERTS:
            raise ValueError(f"convert must be one of {CONVERTS}, got {m.convert!r}")
        m.pooler_config = PoolerConfig.parse(m.pooler_config)
        if m.runner == "generate":
            if m.convert != "none":
                raise ValueError(f"convert {m.convert!r} (--convert) needs runner 'pooling' (--runner pooling)")
            if m.pooler_config is not None:
                raise ValueError("pooler_config (--pooler-config) needs runner 'pooling' (--runner pooling)")
            return
        if m.convert != "embed":
            raise ValueError("runner 'pooling' on a causal LM needs convert 'embed' (--convert embed; the default): "
                             "the model has no pooling head of its own")
        if m.pooler_config is None:
            m.pooler_config = PoolerConfig()
        if self.speculative_config is not None:
            raise ValueError("speculative_config does not combine with runner 'pooling' (nothing is decoded)")
        # Prefix caching is off under the pooling runner: MEAN pooling needs every prompt token's
        # hidden state, and a prefix-cache hit would skip computing them (vLLM turns it off too).
        self.cache_config.enable_prefix_caching = False

    def _check_cuda_graphs(self) -> None:
        """Parse --cuda-graph-sizes and refuse a --cudagraph-mode that cannot apply (the worker
        checks the device-dependent rest)."""
        m = self.model_config
        m.cuda_graph_sizes = parse_capture_sizes(m.cuda_graph_sizes)
        m.cudagraph_mode = check_cudagraph_mode(m.cudagraph_mode, m.enforce_eager, m.compile_model,
                                                self.parallel_config.pipeline_parallel_size)

    @property
    def expert_parallel_group(self) -> bool:
        """The data-parallel engines form one expert-parallel group that steps in lockstep."""
        return self.parallel_config.enable_expert_parallel and self.parallel_config.data_parallel_size > 1

    def _check_expert_parallel_group(self) -> None:
        """Refuse what the lockstep group does not run (yet), naming the flag."""
        refused = [(self.parallel_config.pipeline_parallel_size > 1,
                    "pipeline_parallel_size > 1 (--pipeline-parallel-size)"),
                   (bool(self.scheduler_config.async_scheduling), "async_scheduling (--async-scheduling)"),
                   (self.model_config.compile_model, "compile_model (--compile)")]
        for hit, what in refused:
            if hit:
                raise ValueError(f"data_parallel_size > 1 with enable_expert_parallel does not combine with {what}: "
                                 "the engines step in lockstep, one step in flight, eager forward")

    def _check_speculation(self) -> None:
        """Refuse the combinations speculative decoding does not make exact (yet), naming the flag."""
        if self.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("speculative_config does not combine with pipeline_parallel_size > 1 "
                             "(--pipeline-parallel-size)")
        if self.expert_parallel_group and self.speculative_config.method == "draft_model":
            raise ValueError("speculative_config method draft_model does not combine with data_parallel_size > 1 and "
                             "enable_expert_parallel (the engines' forwards must match step for step; ngram does)")

    def _check_kv_transfer(self) -> None:
        """Refuse what the KV connector does not transfer (yet), naming the flag."""
        p = self.parallel_config
        refused = [(p.tensor_parallel_size > 1, "tensor_parallel_size > 1 (--tensor-parallel-size)"),
                   (p.pipeline_parallel_size > 1, "pipeline_parallel_size > 1 (--pipeline-parallel-size)"),
                   (self.expert_parallel_group, "data_parallel_size > 1 with enable_expert_parallel"),
                   (self.model_config.runner == "pooling", "runner 'pooling' (--runner pooling)"),
                   (self.speculative_config is not None and self.speculative_config.method == "draft_model",
                    "speculative_config method draft_model (the draft's own KV is not transferred)")]
        for hit, what in refused:
            if hit:
                raise ValueError(f"kv_transfer_config does not combine with {what} yet: the connector moves one "
                                 "rank's whole KV cache")

    def resolve_async_scheduling(self, device: str) -> bool:
        """Fix the automatic choice once the worker's device is known."""
        s = self.scheduler_config
        if s.async_scheduling is None:
            s.async_scheduling = (device == "cuda" and self.parallel_config.pipeline_parallel_size == 1
                                  and not self.expert_parallel_group)
        return s.async_scheduling

    def to_proto(self, with_model_config: bool = True) -> pb.VllmConfig:
        """The whole configuration as it travels (LoadModel, ModelInfo). A scheduler leaves out
        the model part, which is its worker's (see VllmConfig in proto/myvllm.proto)."""
        message = to_proto(self, pb.VllmConfig)
        if not with_model_config:
            message.ClearField("model_config")
        return message

    @classmethod
    def from_proto(cls, config: pb.VllmConfig) -> VllmConfig:
        """The configuration a proto carries, checked by the same rules as any other (ValueError)."""
        return from_proto(cls, config)

    def adopt_model_config(self, model_config: pb.ModelConfig) -> None:
        """A scheduler takes its worker's model part (model_config is the worker's)."""
        self.model_config = from_proto(ModelConfig, model_config)
        self._apply_runner()

    @property
    def steps_in_flight(self) -> int:
        """How many scheduled steps the engine loop keeps on the workers at once: one per
        pipeline stage, two with async scheduling, else one."""
        if self.parallel_config.pipeline_parallel_size > 1:
            return self.parallel_config.pipeline_parallel_size
        return 2 if self.scheduler_config.async_scheduling else 1


# Where scheduler and worker are separate processes, who sets which part of VllmConfig: the
# worker's flags set the model part (a scheduler adopts it from ModelInfo); both read these
# parts, which must agree; the rest is the scheduler's, and the worker takes it from LoadModel.
WORKER_OWNED_PARTS = ("model_config",)
SHARED_PARTS = ("parallel_config", "speculative_config", "kv_transfer_config")


def config_mismatches(ours: pb.VllmConfig, theirs: pb.VllmConfig, parts: Iterable[str]) -> list[str]:
    """The fields of `parts` whose values differ, each as "part.field: ours vs theirs" (an absent
    part, as speculative_config is when off, reads "off")."""
    found = []
    for part in parts:
        a, b = getattr(ours, part), getattr(theirs, part)
        if ours.HasField(part) != theirs.HasField(part):
            found.append(f"{part}: {_part_text(ours, part)} vs {_part_text(theirs, part)}")
            continue
        for desc in a.DESCRIPTOR.fields:
            x, y = getattr(a, desc.name), getattr(b, desc.name)
            if desc.has_presence and a.HasField(desc.name) != b.HasField(desc.name):
                x, y = (v if m.HasField(desc.name) else None for v, m in ((x, a), (y, b)))
            if x != y:
                found.append(f"{part}.{desc.name}: {x!r} vs {y!r}")
    return found


def config_mismatch_message(mismatches: list[str], ours: str, theirs: str) -> str:
    return (f"configuration mismatch between scheduler and worker ({ours} vs {theirs}): {'; '.join(mismatches)}. "
            f"Start both with the same flags ({', '.join(SHARED_PARTS)} are read by both)")


def _part_text(config: pb.VllmConfig, part: str) -> str:
    if not config.HasField(part):
        return "off"
    return "{" + ", ".join(f"{f.name}={v!r}" for f, v in getattr(config, part).ListFields()) + "}"
