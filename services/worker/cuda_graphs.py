"""Pure-decode steps on persistent input buffers, eager ("static") or as CUDA graphs (vLLM's
FULL_DECODE_ONLY).

A CUDA graph replays the kernels it captured with the addresses and launch shapes of the
capture, so a step it replays must bring its inputs in the same tensors and the same shapes.
`DecodeBuffers` holds those tensors, sized for the largest capture size: token ids, positions,
slot mapping, query start offsets, sequence and context lengths, and a block table whose width
is fixed at ceil(max_model_len / block_size). A pure-decode step (every scheduled row brings
exactly one token: no prefill chunk, no draft tokens; see `StaticDecode.applies`) of n rows is
padded to the smallest capture size P >= n: rows n..P-1 are padding (token 0 at position 0,
its K/V stored in slot 0 of the null block 0, which the block pool never hands out; sequence
length 1; a block table row of zeros, i.e. the null block), copied into the buffers, run, and
the hidden states are sliced back to the n live rows. Every other step (prefill chunks, mixed
steps, drafts, prompt logprobs, pooling, more rows than the largest capture size) takes the
runner's plain path unchanged.

Modes (vLLM's `compilation_config.cudagraph_mode` names, plus our CPU-testable one):
- "none": the plain path for every step (`--enforce-eager`; the default on CPU);
- "static": pure-decode steps run eagerly on the padded buffers: the graphs' buffer logic on
  any device, so the CPU tests check it token for token against the plain path;
- "full_decode_only": on CUDA, one graph per capture size, captured at start-up (after the KV
  cache is allocated) largest first into one shared memory pool, as vLLM does; a pure-decode
  step whose padded size has a graph replays it. The default on CUDA with the Triton
  attention backend, where the step's attention plan is the buffers themselves (its kernels
  read lengths and block tables from them, and their grid depends only on the padded token
  count); the torch/cpu backends plan on the host each step and cannot be replayed.

Capture sizes default to vLLM's list (`default_capture_sizes`); `--cuda-graph-sizes` gives
others.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from services.common.cudagraph_config import (
    FULL_DECODE_ONLY,
    NONE,
    STATIC,
    capture_sizes,
    check_cudagraph_mode,
)
from services.worker.attention.base import AttentionMetadata, forward_context

logger = logging.getLogger("myvllm.worker")

# Eager forwards per capture size before its capture (Triton compiles, the allocator settles).
WARMUP_RUNS = 1


def resolve_cudagraph_mode(mode: str | None, *, enforce_eager: bool, device: torch.device, compile_model: bool,
                           pipeline_parallel_size: int, tensor_parallel_size: int, attention_backend: str,
                           expert_parallel: bool, pooling: bool) -> str:
    """The mode a runner uses. Automatic (None): "full_decode_only" on CUDA with the Triton backend
    (vLLM's default), unless --enforce-eager, --compile, pipeline or tensor parallelism (not yet
    run on GPUs), expert parallelism (its all-to-all sizes its buffers on the host) or the
    pooling runner (nothing decodes); "none" everywhere else. An explicit mode that cannot apply
    is refused (ValueError)."""
    explicit = check_cudagraph_mode(mode, enforce_eager, compile_model, pipeline_parallel_size)
    if explicit is None:
        eligible = (device.type == "cuda" and attention_backend == "triton" and not enforce_eager
                    and not compile_model and pipeline_parallel_size == 1 and tensor_parallel_size == 1
                    and not expert_parallel and not pooling)
        return FULL_DECODE_ONLY if eligible else NONE
    if explicit == FULL_DECODE_ONLY:
        if device.type != "cuda":
            raise ValueError(f"cudagraph_mode 'full_decode_only' needs CUDA (this worker runs on {device.type}); "
                             "'static' runs the same padded buffers eagerly on any device")
        if attention_backend != "triton":
            raise ValueError(f"cudagraph_mode 'full_decode_only' needs the triton attention backend (got "
                             f"{attention_backend!r}: it plans each step on the host, which a replayed graph "
                             "would not redo)")
        if expert_parallel:
            raise ValueError("cudagraph_mode 'full_decode_only' does not combine with expert parallelism (its "
                             "all-to-all sizes its buffers on the host each step)")
    return explicit


def pure_decode_rows(num_scheduled: np.ndarray) -> bool:
    """Every scheduled row brings exactly one token."""
    return num_scheduled.size > 0 and bool((num_scheduled == 1).all())


@contextlib.contextmanager
def layers_only(model: torch.nn.Module) -> Iterator[None]:
    """Run the model's eager layers even where a CPU C step would take the batch: the padded
    forward is the one a graph captures, whatever the device."""
    saved = getattr(model, "decode_step", None), getattr(model, "packed_step", None)
    if saved == (None, None):
        yield
        return
    model.decode_step = model.packed_step = None
    try:
        yield
    finally:
        model.decode_step, model.packed_step = saved


class DecodeBuffers:
    """The persistent inputs of padded decode steps, for up to `max_size` rows (one token each)."""

    def __init__(self, max_size: int, max_blocks: int, block_size: int, device: torch.device) -> None:
        self.max_size, self.max_blocks, self.block_size = max_size, max_blocks, block_size
        with torch.device(device):
            self.input_ids = torch.zeros(max_size, dtype=torch.int64)
            self.positions = torch.zeros(max_size, dtype=torch.int64)
            self.slot_mapping = torch.zeros(max_size, dtype=torch.int64)
            # One token per row: the offsets never change.
            self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32)
            self.seq_lens = torch.ones(max_size, dtype=torch.int32)
            self.context_lens = torch.zeros(max_size, dtype=torch.int32)
            self.block_table = torch.zeros((max_size, max_blocks), dtype=torch.int32)
        self._qsl_np = np.arange(max_size + 1, dtype=np.int64)

    def tensors(self) -> list[torch.Tensor]:
        return [self.input_ids, self.positions, self.slot_mapping, self.query_start_loc, self.seq_lens,
                self.context_lens, self.block_table]

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int) -> None:
        """Copy a pure-decode step's n rows into the buffers and make rows n..size-1 padding."""
        n = meta.num_tokens
        nb = meta.block_table.shape[1]
        if not n <= size <= self.max_size or nb > self.max_blocks:
            raise ValueError(f"a decode step of {n} rows and {nb} blocks does not fit buffers of {self.max_size} "
                             f"rows and {self.max_blocks} blocks padded to {size}")
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.context_lens[:n].copy_(meta.context_lens)
        self.block_table[:n, :nb].copy_(meta.block_table)
        self.block_table[:n, nb:].zero_()
        self.pad(n, size)

    def pad(self, start: int, size: int) -> None:
        """Rows start..size-1 as padding: token 0 at position 0 into slot 0 (the null block), one
        position attended, the null block as the whole block table."""
        if start >= size:
            return
        self.input_ids[start:size].zero_()
        self.positions[start:size].zero_()
        self.slot_mapping[start:size].zero_()
        self.seq_lens[start:size].fill_(1)
        self.context_lens[start:size].zero_()
        self.block_table[start:size].zero_()

    def metadata(self, size: int, seq_lens_np: np.ndarray, context_lens_np: np.ndarray) -> AttentionMetadata:
        """The padded step's metadata over the buffers (views: a replayed graph reads what `load`
        wrote); the host arrays are the padded step's, for backends that plan on the host."""
        return AttentionMetadata(
            num_tokens=size, slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], context_lens=self.context_lens[:size], block_table=self.block_table[:size],
            max_query_len=1, max_seq_len=int(seq_lens_np.max()), block_size=self.block_size,
            query_start_loc_np=self._qsl_np[:size + 1], seq_lens_np=seq_lens_np, context_lens_np=context_lens_np)


def padded_host_lens(meta: AttentionMetadata, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The step's sequence and context lengths with padding rows (1 and 0) up to `size`."""
    pad = size - meta.num_tokens
    seq = np.concatenate((np.asarray(meta.seq_lens_np, dtype=np.int64), np.ones(pad, dtype=np.int64)))
    ctx = np.concatenate((np.asarray(meta.context_lens_np, dtype=np.int64), np.zeros(pad, dtype=np.int64)))
    return seq, ctx


class CudaGraph:
    """One captured forward (torch.cuda.CUDAGraph); `capture` returns its output tensor, which
    every replay rewrites in place."""

    def __init__(self, pool) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    @staticmethod
    def new_pool():
        return torch.cuda.graph_pool_handle()

    def capture(self, forward) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            return forward()

    def replay(self) -> None:
        self.graph.replay()


def plan_reads_only(plan, buffers: DecodeBuffers) -> list[str]:
    """The tensor fields of a backend's plan that are not views of the buffers (empty: a graph
    that captured the plan reads each step's values)."""
    if plan is None:
        return []
    owned = {t.untyped_storage().data_ptr() for t in buffers.tensors()}
    fields = dataclasses.fields(plan) if dataclasses.is_dataclass(plan) else ()
    return [f.name for f in fields if isinstance(getattr(plan, f.name), torch.Tensor)
            and getattr(plan, f.name).untyped_storage().data_ptr() not in owned]


class StaticDecode:
    """Pure-decode steps padded into `DecodeBuffers`: eager on them ("static"), or replayed from
    the graphs `capture` made ("full_decode_only")."""

    graph_type = CudaGraph  # tests on the CPU substitute one that re-runs the captured forward

    def __init__(self, model: torch.nn.Module, backend, mode: str, sizes: Sequence[int], max_model_len: int,
                 block_size: int, device: torch.device) -> None:
        if mode not in (STATIC, FULL_DECODE_ONLY):
            raise ValueError(f"StaticDecode runs modes 'static' and 'full_decode_only', not {mode!r}")
        if not sizes:
            raise ValueError("no capture sizes")
        self.model, self.backend, self.mode = model, backend, mode
        self.sizes = sorted(set(sizes))
        self.buffers = DecodeBuffers(self.sizes[-1], -(-max_model_len // block_size), block_size, device)
        self.device = device
        self.graphs: dict[int, tuple[object, torch.Tensor, AttentionMetadata]] = {}
        # Steps so far: padded ones (by size), graph replays, padding rows run.
        self.padded_steps: dict[int, int] = {}
        self.replays = 0
        self.padding_rows = 0

    def padded_size(self, num_rows: int) -> int | None:
        """The smallest capture size holding `num_rows` (None: more rows than the largest)."""
        i = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def applies(self, runner, rows: np.ndarray, num_scheduled: np.ndarray) -> bool:
        """Whether this step runs padded: a pure decode (one token per row, so no prefill chunk and
        no drafts), no prompt logprobs asked (they are scored from the same hidden states, but the
        plain path keeps them), not the pooling runner, and not more rows than the largest size."""
        if runner.pooler is not None or not pure_decode_rows(num_scheduled):
            return False
        batch = runner.input_batch
        if batch.prompt_logprob_rows and not batch.prompt_logprob_rows.isdisjoint(rows.tolist()):
            return False
        if batch.num_spec[rows].any():
            return False
        return self.padded_size(rows.size) is not None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's final hidden states [n, hidden] (a view of the padded output: used within
        the step, before the next one rewrites it)."""
        n = meta.num_tokens
        size = self.padded_size(n)
        self.buffers.load(input_ids, positions, meta, size)
        self.padded_steps[size] = self.padded_steps.get(size, 0) + 1
        self.padding_rows += size - n
        captured = self.graphs.get(size)
        if captured is not None:
            graph, out, _ = captured
            graph.replay()
            self.replays += 1
            return out[:n]
        return self._eager(size, *padded_host_lens(meta, size))[:n]

    def _eager(self, size: int, seq_lens_np: np.ndarray, context_lens_np: np.ndarray) -> torch.Tensor:
        padded = self.buffers.metadata(size, seq_lens_np, context_lens_np)
        padded.backend_data = self.backend.prepare(padded)
        with forward_context(self.backend, padded), layers_only(self.model):
            return self.model(self.buffers.input_ids[:size], self.buffers.positions[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per capture size, largest first, sharing one memory pool (vLLM's order: the
        smaller graphs' activations fit in what the larger ones left). The dummy forwards are all
        padding: they write K/V only into the null block."""
        pool = self.graph_type.new_pool()
        for size in reversed(self.sizes):
            self.buffers.pad(0, size)
            meta = self.buffers.metadata(size, np.ones(size, dtype=np.int64), np.zeros(size, dtype=np.int64))
            meta.backend_data = self.backend.prepare(meta)
            stray = plan_reads_only(meta.backend_data, self.buffers)
            if stray:
                raise RuntimeError(f"attention backend {getattr(self.backend, 'name', self.backend)!r} plans into "
                                   f"its own tensors ({', '.join(stray)}): a replayed graph would read stale values")

            def run(meta: AttentionMetadata = meta, size: int = size) -> torch.Tensor:
                with forward_context(self.backend, meta), layers_only(self.model):
                    return self.model(self.buffers.input_ids[:size], self.buffers.positions[:size])

            for _ in range(WARMUP_RUNS):
                run()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            graph = self.graph_type(pool)
            out = graph.capture(run)
            self.graphs[size] = (graph, out, meta)  # the metadata and plan the graph reads stay alive
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def build_static_decode(runner) -> StaticDecode | None:
    """The runner's padded decode path for its mode, made after its KV cache exists (graphs
    captured now); None for mode "none". In automatic mode a failed capture is logged at WARNING
    with its reason and counted (`runner.unreported_capture_failures`, which the next step's
    output reports for /metrics' cudagraph_capture_failures), and the worker runs eager; the
    explicit mode raises."""
    mode = runner.cudagraph_mode
    if mode == NONE:
        return None
    sizes = capture_sizes(runner.max_num_seqs, runner.cuda_graph_sizes)
    if not sizes:
        logger.warning("no --cuda-graph-sizes at most twice max_num_seqs (%d): decode steps run plain",
                       runner.max_num_seqs)
        return None
    static = StaticDecode(runner.model, runner.attn_backend, mode, sizes, runner.max_model_len, runner.block_size,
                          runner.device)
    if mode != FULL_DECODE_ONLY:
        logger.info("decode steps padded to %s rows on static buffers (eager)", ", ".join(map(str, static.sizes)))
        return static
    try:
        static.capture()
    except Exception as e:
        if runner.cudagraph_mode_explicit:
            raise
        runner.unreported_capture_failures += 1
        logger.warning("CUDA graph capture failed (%s: %s); decode steps run eager (counted in "
                       "myvllm:cudagraph_capture_failures_total)", type(e).__name__, e)
        return None
    logger.info("captured %d CUDA graphs for decode steps of %s rows", len(static.graphs),
                ", ".join(map(str, static.sizes)))
    return static
