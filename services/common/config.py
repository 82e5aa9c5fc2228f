"""Engine configuration, with vLLM's argument names, and where the default model lives."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from services.common.cudagraph_config import check_cudagraph_mode, parse_capture_sizes
from services.common.kv_transfer_config import KVTransferConfig
from services.common.pooling_config import CONVERTS, RUNNERS, PoolerConfig
from services.common.proto import myvllm_pb2 as pb
from services.common.spec_config import SpeculativeConfig


def _dtype_logger() -> logging.Logger:
    """The dtype choice is always shown (as vLLM's INFO line is), whatever the process's logging
    setup: `serve` keeps the root logger at WARNING and the offline LLM configures none."""
    log = logging.getLogger("myvllm.dtype")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s myvllm: %(message)s"))
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


def default_model_path() -> str:
    """The default model: $MYVLLM_MODEL, else the HF directory `make setup` converts."""
    return os.environ.get("MYVLLM_MODEL", str(DEFAULT_MODEL_DIR))


def check_model_dir(model: str) -> str:
    """Fail with one clear line when the model directory is missing."""
    if not os.path.isdir(model):
        hint = " (run `make setup` to convert the default model)" if model == str(DEFAULT_MODEL_DIR) else ""
        raise FileNotFoundError(f"model directory not found: {model}{hint}")
    return model


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
                       cuda_bf16: bool = True) -> str:
    """The dtype a worker on `device_type` runs for the requested `dtype` ("auto" included),
    logging the automatic choice and warning when bf16 is asked of a CPU that lacks it."""
    if device_type == "cpu":
        flags = cpu_flags() if flags is None else set(flags)
        if dtype == "auto":
            chosen, why = choose_cpu_dtype(flags)
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


@dataclass
class EngineConfig:
    """Everything one engine replica (scheduler + its worker) is built from."""

    model: str | None = None
    # "auto", as in vLLM: bf16 on a CPU with bf16 instructions (avx512_bf16 / AMX; measured 1.4x
    # our fp32 on an avx512_bf16 EPYC, BENCHMARKS.md), fp32 on other CPUs, bf16 on CUDA.
    dtype: str = "auto"
    seed: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    scheduling_policy: str = "fcfs"
    attention_backend: str | None = None
    # None: on where the worker runs on CUDA, off on CPU (see resolve_async_scheduling).
    async_scheduling: bool | None = None
    # Worker ranks per engine, each holding 1/T of the heads and MLP columns.
    tensor_parallel_size: int = 1
    # Pipeline stages per engine, each holding 1/P of the layers (T x P ranks in all); the
    # scheduler keeps P steps in flight so no stage idles.
    pipeline_parallel_size: int = 1
    # MoE models: the experts are split across the tensor-parallel ranks (each rank holds whole
    # experts) instead of every expert's columns; ignored by dense models, as in vLLM.
    enable_expert_parallel: bool = False
    # Engine replicas. Dense models (or MoE without enable_expert_parallel): independent replicas
    # behind the gateway's load-based routing. With enable_expert_parallel: one group whose MoE
    # layers split the experts over all D x T ranks and whose engines step in lockstep (an idle
    # engine runs dummy steps; services/engine/step_loop.py, docs/design.md, "Waves").
    data_parallel_size: int = 1
    # CPU: run the forward through torch.compile (services/worker/models/compiled.py). Off by
    # default: it compiles for minutes at start-up for a 1.15-1.3x step (BENCHMARKS.md).
    compile_model: bool = False
    # Speculative decoding, vLLM's dict (or its JSON text): {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_max": ..., "prompt_lookup_min": ...} or
    # {"method": "draft_model", "model": dir, "num_speculative_tokens": k}. None: off.
    speculative_config: SpeculativeConfig | dict | str | None = None
    # Seconds a constrained request's grammar may take to compile (a helper process runs the
    # compile and kills it past this); the request then ends with a 400.
    structured_outputs_compile_timeout: float = DEFAULT_STRUCTURED_OUTPUTS_COMPILE_TIMEOUT_S
    # Wall-clock seconds a constrained request's grammar work (compile, rows, matcher) may take
    # in all; the request then ends with a 400.
    structured_outputs_request_timeout: float = DEFAULT_STRUCTURED_OUTPUTS_REQUEST_TIMEOUT_S
    # vLLM's runner: "generate" (sample tokens) or "pooling" (embeddings only). A causal LM runs
    # pooling as convert "embed" (None: what the runner implies); pooler_config (vLLM's dict or
    # its JSON text; None: LAST + normalize) says how its hidden states become one vector.
    runner: str = "generate"
    convert: str | None = None
    pooler_config: PoolerConfig | dict | str | None = None
    # CUDA graphs for pure-decode steps (services/worker/cuda_graphs.py), vLLM's names:
    # enforce_eager turns them off; cuda_graph_sizes (a list, or "1,2,4,8") are the batch sizes
    # steps are padded to (None: vLLM's default list up to max_num_seqs); cudagraph_mode is
    # "none", "static" (the padded buffers run eagerly, on any device: what the CPU tests check)
    # or "full_decode_only" (CUDA graphs); None: full_decode_only on CUDA with the triton
    # backend, none elsewhere.
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | str | None = None
    cudagraph_mode: str | None = None
    # Prefill/decode disaggregation, vLLM's kv_transfer_config dict (or its JSON text):
    # {"kv_connector": "SharedMemoryConnector", "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
    # "kv_connector_extra_config": {...}}. None: no KV connector.
    kv_transfer_config: KVTransferConfig | dict | str | None = None

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = default_model_path()
        self._apply_runner()
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None:
            self._check_speculation()
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        if self.kv_transfer_config is not None:
            self._check_kv_transfer()
        self._check_cuda_graphs()
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if not self.structured_outputs_compile_timeout > 0:
            raise ValueError("structured_outputs_compile_timeout (--structured-outputs-compile-timeout) must be "
                             f"positive, got {self.structured_outputs_compile_timeout}")
        if not self.structured_outputs_request_timeout > 0:
            raise ValueError("structured_outputs_request_timeout (--structured-outputs-request-timeout) must be "
                             f"positive, got {self.structured_outputs_request_timeout}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not 1 <= self.max_num_seqs <= MAX_NUM_SEQS_LIMIT:
            raise ValueError(f"max_num_seqs must be in [1, {MAX_NUM_SEQS_LIMIT}], got {self.max_num_seqs}")
        if not 1 <= self.max_num_batched_tokens <= MAX_NUM_BATCHED_TOKENS_LIMIT:
            raise ValueError(f"max_num_batched_tokens must be in [1, {MAX_NUM_BATCHED_TOKENS_LIMIT}], "
                             f"got {self.max_num_batched_tokens}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be positive, got {self.pipeline_parallel_size}")
        if self.pipeline_parallel_size > 1 and self.async_scheduling:
            raise ValueError("async scheduling does not combine with pipeline parallelism (the first stage "
                             "needs each sampled token before it schedules the next); the pipeline keeps "
                             "pipeline_parallel_size steps in flight instead")
        if self.pipeline_parallel_size > 1 and self.compile_model:
            raise ValueError("compile_model is not supported with pipeline_parallel_size > 1")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be positive, got {self.data_parallel_size}")
        if self.expert_parallel_group:
            self._check_expert_parallel_group()

    def _apply_runner(self) -> None:
        """The pooling runner's rules, in one place (also run when a scheduler adopts its
        worker's model part, which carries the runner)."""
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.convert is None:  # vLLM: a causal LM under the pooling runner is converted to embed
            self.convert = "embed" if self.runner == "pooling" else "none"
        if self.convert not in CONVERTS:
            raise ValueError(f"convert must be one of {CONVERTS}, got {self.convert!r}")
        self.pooler_config = PoolerConfig.parse(self.pooler_config)
        if self.runner == "generate":
            if self.convert != "none":
                raise ValueError(f"convert {self.convert!r} (--convert) needs runner 'pooling' (--runner pooling)")
            if self.pooler_config is not None:
                raise ValueError("pooler_config (--pooler-config) needs runner 'pooling' (--runner pooling)")
            return
        if self.convert != "embed":
            raise ValueError("runner 'pooling' on a causal LM needs convert 'embed' (--convert embed; the default): "
                             "the model has no pooling head of its own")
        if self.pooler_config is None:
            self.pooler_config = PoolerConfig()
        if self.speculative_config is not None:
            raise ValueError("speculative_config does not combine with runner 'pooling' (nothing is decoded)")
        # Prefix caching is off under the pooling runner: MEAN pooling needs every prompt token's
        # hidden state, and a prefix-cache hit would skip computing them (vLLM turns it off too).
        self.enable_prefix_caching = False

    def _check_cuda_graphs(self) -> None:
        """Parse --cuda-graph-sizes and refuse a --cudagraph-mode that cannot apply (the worker
        checks the device-dependent rest)."""
        self.cuda_graph_sizes = parse_capture_sizes(self.cuda_graph_sizes)
        self.cudagraph_mode = check_cudagraph_mode(self.cudagraph_mode, self.enforce_eager, self.compile_model,
                                                   self.pipeline_parallel_size)

    @property
    def expert_parallel_group(self) -> bool:
        """The data-parallel engines form one expert-parallel group that steps in lockstep."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    def _check_expert_parallel_group(self) -> None:
        """Refuse what the lockstep group does not run (yet), naming the flag."""
        refused = [(self.pipeline_parallel_size > 1, "pipeline_parallel_size > 1 (--pipeline-parallel-size)"),
                   (bool(self.async_scheduling), "async_scheduling (--async-scheduling)"),
                   (self.compile_model, "compile_model (--compile)")]
        for hit, what in refused:
            if hit:
                raise ValueError(f"data_parallel_size > 1 with enable_expert_parallel does not combine with {what}: "
                                 "the engines step in lockstep, one step in flight, eager forward")

    def _check_speculation(self) -> None:
        """Refuse the combinations speculative decoding does not make exact (yet), naming the flag."""
        if self.pipeline_parallel_size > 1:
            raise ValueError("speculative_config does not combine with pipeline_parallel_size > 1 "
                             "(--pipeline-parallel-size)")
        if self.expert_parallel_group and self.speculative_config.method == "draft_model":
            raise ValueError("speculative_config method draft_model does not combine with data_parallel_size > 1 and "
                             "enable_expert_parallel (the engines' forwards must match step for step; ngram does)")

    def _check_kv_transfer(self) -> None:
        """Refuse what the KV connector does not transfer (yet), naming the flag."""
        refused = [(self.tensor_parallel_size > 1, "tensor_parallel_size > 1 (--tensor-parallel-size)"),
                   (self.pipeline_parallel_size > 1, "pipeline_parallel_size > 1 (--pipeline-parallel-size)"),
                   (self.expert_parallel_group, "data_parallel_size > 1 with enable_expert_parallel"),
                   (self.runner == "pooling", "runner 'pooling' (--runner pooling)"),
                   (self.speculative_config is not None and self.speculative_config.method == "draft_model",
                    "speculative_config method draft_model (the draft's own KV is not transferred)")]
        for hit, what in refused:
            if hit:
                raise ValueError(f"kv_transfer_config does not combine with {what} yet: the connector moves one "
                                 "rank's whole KV cache")

    def resolve_async_scheduling(self, device: str) -> bool:
        """Fix the automatic choice once the worker's device is known."""
        if self.async_scheduling is None:
            self.async_scheduling = (device == "cuda" and self.pipeline_parallel_size == 1
                                     and not self.expert_parallel_group)
        return self.async_scheduling

    def to_proto(self, with_model_config: bool = True) -> pb.VllmConfig:
        """The whole configuration as it travels (LoadModel, ModelInfo). A scheduler leaves out
        the model part, which is its worker's (see VllmConfig in proto/myvllm.proto)."""
        spec = self.speculative_config
        return pb.VllmConfig(
            model_config=pb.ModelConfig(model=self.model, dtype=self.dtype, seed=self.seed,
                                        max_model_len=self.max_model_len or 0,
                                        attention_backend=self.attention_backend or "",
                                        compile_model=self.compile_model, runner=self.runner,
                                        convert=self.convert,
                                        pooler_config=self.pooler_config.to_proto() if self.pooler_config else None,
                                        enforce_eager=self.enforce_eager,
                                        cuda_graph_sizes=self.cuda_graph_sizes or (),
                                        cudagraph_mode=self.cudagraph_mode or "")
            if with_model_config else None,
            cache_config=pb.CacheConfig(block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
                                        num_gpu_blocks_override=self.num_gpu_blocks_override or 0,
                                        kv_cache_memory_bytes=self.kv_cache_memory_bytes or 0),
            parallel_config=pb.ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                              pipeline_parallel_size=self.pipeline_parallel_size,
                                              enable_expert_parallel=self.enable_expert_parallel,
                                              data_parallel_size=self.data_parallel_size),
            scheduler_config=pb.SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                                max_num_batched_tokens=self.max_num_batched_tokens,
                                                scheduling_policy=self.scheduling_policy,
                                                async_scheduling=self.async_scheduling),
            speculative_config=spec.to_proto() if spec else None,
            structured_outputs_config=pb.StructuredOutputsConfig(
                compile_timeout_s=self.structured_outputs_compile_timeout,
                request_timeout_s=self.structured_outputs_request_timeout),
            kv_transfer_config=self.kv_transfer_config.to_proto() if self.kv_transfer_config else None)

    @classmethod
    def from_proto(cls, config: pb.VllmConfig) -> EngineConfig:
        """The configuration a proto carries, checked by the same rules as any other (ValueError)."""
        m, c, p, s = config.model_config, config.cache_config, config.parallel_config, config.scheduler_config
        return cls(model=m.model, dtype=m.dtype, seed=m.seed, max_model_len=m.max_model_len or None,
                   attention_backend=m.attention_backend or None, compile_model=m.compile_model,
                   runner=m.runner or "generate", convert=m.convert or None,
                   pooler_config=PoolerConfig.from_proto(m.pooler_config) if m.HasField("pooler_config") else None,
                   enforce_eager=m.enforce_eager, cuda_graph_sizes=list(m.cuda_graph_sizes) or None,
                   cudagraph_mode=m.cudagraph_mode or None,
                   block_size=c.block_size, enable_prefix_caching=c.enable_prefix_caching,
                   num_gpu_blocks_override=c.num_gpu_blocks_override or None,
                   kv_cache_memory_bytes=c.kv_cache_memory_bytes or None,
                   tensor_parallel_size=p.tensor_parallel_size, pipeline_parallel_size=p.pipeline_parallel_size,
                   enable_expert_parallel=p.enable_expert_parallel, data_parallel_size=p.data_parallel_size or 1,
                   max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
                   scheduling_policy=s.scheduling_policy,
                   async_scheduling=s.async_scheduling if s.HasField("async_scheduling") else None,
                   speculative_config=SpeculativeConfig.from_proto(config.speculative_config)
                   if config.HasField("speculative_config") else None,
                   structured_outputs_compile_timeout=config.structured_outputs_config.compile_timeout_s,
                   # (unset: a sender that predates the field)
                   structured_outputs_request_timeout=config.structured_outputs_config.request_timeout_s
                   or DEFAULT_STRUCTURED_OUTPUTS_REQUEST_TIMEOUT_S,
                   kv_transfer_config=KVTransferConfig.from_proto(config.kv_transfer_config)
                   if config.HasField("kv_transfer_config") else None)

    def adopt_model_config(self, model_config: pb.ModelConfig) -> None:
        """A scheduler takes its worker's model part (model_config is the worker's)."""
        self.model, self.dtype, self.seed = model_config.model, model_config.dtype, model_config.seed
        self.max_model_len = model_config.max_model_len or None
        self.attention_backend = model_config.attention_backend or None
        self.compile_model = model_config.compile_model
        self.runner, self.convert = model_config.runner or "generate", model_config.convert or None
        self.pooler_config = PoolerConfig.from_proto(model_config.pooler_config) \
            if model_config.HasField("pooler_config") else None
        self.enforce_eager = model_config.enforce_eager
        self.cuda_graph_sizes = list(model_config.cuda_graph_sizes) or None
        self.cudagraph_mode = model_config.cudagraph_mode or None
        self._apply_runner()

    @property
    def steps_in_flight(self) -> int:
        """How many scheduled steps the engine loop keeps on the workers at once: one per
        pipeline stage, two with async scheduling, else one."""
        if self.pipeline_parallel_size > 1:
            return self.pipeline_parallel_size
        return 2 if self.async_scheduling else 1


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
        for field in a.DESCRIPTOR.fields:
            x, y = getattr(a, field.name), getattr(b, field.name)
            if field.has_presence and a.HasField(field.name) != b.HasField(field.name):
                x, y = (v if m.HasField(field.name) else None for v, m in ((x, a), (y, b)))
            if x != y:
                found.append(f"{part}.{field.name}: {x!r} vs {y!r}")
    return found


def config_mismatch_message(mismatches: list[str], ours: str, theirs: str) -> str:
    return (f"configuration mismatch between scheduler and worker ({ours} vs {theirs}): {'; '.join(mismatches)}. "
            f"Start both with the same flags ({', '.join(SHARED_PARTS)} are read by both)")


def _part_text(config: pb.VllmConfig, part: str) -> str:
    if not config.HasField(part):
        return "off"
    return "{" + ", ".join(f"{f.name}={v!r}" for f, v in getattr(config, part).ListFields()) + "}"
