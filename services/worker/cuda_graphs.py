"""Pure-decode steps on persistent input buffers, eager ("static") or as CUDA graphs (vLLM's
FULL_DECODE_ONLY).

A CUDA graph replays the kernels it captured with the addresses and launch shapes of the
capture, so a step it replays must bring its inputs in the same tensors and the same shapes.
`DecodeBuffers` holds those tensors for one query length q (tokens per row), sized for the
largest capture size: token ids, positions, slot mapping, query start offsets, sequence and
context lengths, and a block table whose width is fixed at ceil(max_model_len / block_size).
A uniform step (every scheduled row brings the same q tokens: one, a pure decode; or 1 + k, a
speculative step whose every row verifies k drafts; see `StaticDecode.query_len`) of n rows is
padded to the smallest capture size P >= n: rows n..P-1 are padding (q tokens 0 at position 0,
their K/V stored in slot 0 of the null block 0, which the block pool never hands out; context
length 0; a block table row of zeros, i.e. the null block), copied into the buffers, run, and
the hidden states are sliced back to the n live rows. Every other step (prefill chunks, mixed
steps, rows with different draft counts, prompt logprobs, pooling, more rows than the largest
capture size) takes the runner's plain path unchanged.

Query lengths: 1, and 1 + num_speculative_tokens with speculative decoding (the proposers
draft that many per row whenever they can), each with every capture size.

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
    """The persistent inputs of padded uniform steps, for up to `max_size` rows of `query_len`
    tokens each."""

    def __init__(self, max_size: int, max_blocks: int, block_size: int, device: torch.device,
                 query_len: int = 1) -> None:
        self.max_size, self.max_blocks, self.block_size = max_size, max_blocks, block_size
        self.query_len = query_len
        max_tokens = max_size * query_len
        with torch.device(device):
            self.input_ids = torch.zeros(max_tokens, dtype=torch.int64)
            self.positions = torch.zeros(max_tokens, dtype=torch.int64)
            self.slot_mapping = torch.zeros(max_tokens, dtype=torch.int64)
            # query_len tokens per row: the offsets never change.
            self.query_start_loc = torch.arange(0, max_tokens + 1, query_len, dtype=torch.int32)
            self.seq_lens = torch.full((max_size,), query_len, dtype=torch.int32)
            self.context_lens = torch.zeros(max_size, dtype=torch.int32)
            self.block_table = torch.zeros((max_size, max_blocks), dtype=torch.int32)
        self._qsl_np = np.arange(0, max_tokens + 1, query_len, dtype=np.int64)

    def tensors(self) -> list[torch.Tensor]:
        return [self.input_ids, self.positions, self.slot_mapping, self.query_start_loc, self.seq_lens,
                self.context_lens, self.block_table]

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int) -> None:
        """Copy a uniform step's n rows into the buffers and make rows n..size-1 padding."""
        n, nb = meta.block_table.shape
        tokens = meta.num_tokens
        if not n <= size <= self.max_size or nb > self.max_blocks or tokens != n * self.query_len:
            raise ValueError(f"a step of {n} rows, {tokens} tokens and {nb} blocks does not fit buffers of "
                             f"{self.max_size} rows of {self.query_len} tokens and {self.max_blocks} blocks "
                             f"padded to {size}")
        self.input_ids[:tokens].copy_(input_ids)
        self.positions[:tokens].copy_(positions)
        self.slot_mapping[:tokens].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.context_lens[:n].copy_(meta.context_lens)
        self.block_table[:n, :nb].copy_(meta.block_table)
        self.block_table[:n, nb:].zero_()
        self.pad(n, size)

    def pad(self, start: int, size: int) -> None:
        """Rows start..size-1 as padding: query_len tokens 0 at position 0 into slot 0 (the null
        block), attending (causally) to the first query_len positions of the null block, which
        is the whole block table."""
        if start >= size:
            return
        q = self.query_len
        self.input_ids[start * q:size * q].zero_()
        self.positions[start * q:size * q].zero_()
        self.slot_mapping[start * q:size * q].zero_()
        self.seq_lens[start:size].fill_(q)
        self.context_lens[start:size].zero_()
        self.block_table[start:size].zero_()

    def metadata(self, size: int, seq_lens_np: np.ndarray, context_lens_np: np.ndarray) -> AttentionMetadata:
        """The padded step's metadata over the buffers (views: a replayed graph reads what `load`
        wrote); the host arrays are the padded step's, for backends that plan on the host."""
        tokens = size * self.query_len
        return AttentionMetadata(
            num_tokens=tokens, slot_mapping=self.slot_mapping[:tokens], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], context_lens=self.context_lens[:size], block_table=self.block_table[:size],
            max_query_len=self.query_len, max_seq_len=int(seq_lens_np.max()), block_size=self.block_size,
            query_start_loc_np=self._qsl_np[:size + 1], seq_lens_np=seq_lens_np, context_lens_np=context_lens_np)


def padded_host_lens(meta: AttentionMetadata, size: int, query_len: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The step's sequence and context lengths with padding rows (query_len and 0) up to `size`."""
    pad = size - len(meta.seq_lens_np)
    seq = np.concatenate((np.asarray(meta.seq_lens_np, dtype=np.int64), np.full(pad, query_len, dtype=np.int64)))
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
    """Uniform steps padded into `DecodeBuffers` (one set per query length): eager on them
    ("static"), or replayed from the graphs `capture` made ("full_decode_only")."""

    graph_type = CudaGraph  # tests on the CPU substitute one that re-runs the captured forward

    def __init__(self, model: torch.nn.Module, backend, mode: str, sizes: Sequence[int], max_model_len: int,
                 block_size: int, device: torch.device, num_speculative_tokens: int = 0) -> None:
        if mode not in (STATIC, FULL_DECODE_ONLY):
            raise ValueError(f"StaticDecode runs modes 'static' and 'full_decode_only', not {mode!r}")
        if not sizes:
            raise ValueError("no capture sizes")
        self.model, self.backend, self.mode = model, backend, mode
        self.sizes = sorted(set(sizes))
        max_blocks = -(-max_model_len // block_size)
        self.query_lens = sorted({1, 1 + num_speculative_tokens})
        self.buffers_of = {q: DecodeBuffers(self.sizes[-1], max_blocks, block_size, device, q) for q in self.query_lens}
        self.device = device
        # Per query length: padded size → (graph, output, the metadata it reads).
        self.graphs_of: dict[int, dict[int, tuple[object, torch.Tensor, AttentionMetadata]]] = {
            q: {} for q in self.query_lens}
        # Steps so far: padded pure decodes (by size), padded speculative ones (by size), graph
        # replays, padding rows run.
        self.padded_steps: dict[int, int] = {}
        self.spec_steps: dict[int, int] = {}
        self.replays = 0
        self.padding_rows = 0

    @property
    def buffers(self) -> DecodeBuffers:
        """The pure-decode buffers (one token per row)."""
        return self.buffers_of[1]

    @property
    def graphs(self) -> dict[int, tuple[object, torch.Tensor, AttentionMetadata]]:
        """The pure-decode graphs by padded size."""
        return self.graphs_of[1]

    def padded_size(self, num_rows: int) -> int | None:
        """The smallest capture size holding `num_rows` (None: more rows than the largest)."""
        i = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def query_len(self, runner, rows: np.ndarray, num_scheduled: np.ndarray) -> int | None:
        """The query length this step runs padded at, or None (the plain path): every row brings
        the same q tokens, its one token plus its q - 1 drafts (q = 1: a pure decode; no prefill
        chunk), q is one the buffers have, no prompt logprobs asked (they are scored from the same
        hidden states, but the plain path keeps them), not the pooling runner, and not more rows
        than the largest size."""
        if runner.pooler is not None or num_scheduled.size == 0:
            return None
        q = int(num_scheduled[0])
        if q not in self.buffers_of or not bool((num_scheduled == q).all()):
            return None
        batch = runner.input_batch
        if batch.prompt_logprob_rows and not batch.prompt_logprob_rows.isdisjoint(rows.tolist()):
            return None
        if not bool((batch.num_spec[rows] == q - 1).all()):
            return None
        return q if self.padded_size(rows.size) is not None else None

    def applies(self, runner, rows: np.ndarray, num_scheduled: np.ndarray) -> bool:
        """Whether this step runs padded (see `query_len`)."""
        return self.query_len(runner, rows, num_scheduled) is not None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's final hidden states [tokens, hidden] (a view of the padded output: used within
        the step, before the next one rewrites it)."""
        n = meta.block_table.shape[0]
        q = meta.num_tokens // n
        size = self.padded_size(n)
        buffers = self.buffers_of[q]
        buffers.load(input_ids, positions, meta, size)
        steps = self.padded_steps if q == 1 else self.spec_steps
        steps[size] = steps.get(size, 0) + 1
        self.padding_rows += size - n
        captured = self.graphs_of[q].get(size)
        if captured is not None:
            graph, out, _ = captured
            graph.replay()
            self.replays += 1
            return out[:n * q]
        return self._eager(buffers, size, *padded_host_lens(meta, size, q))[:n * q]

    def _eager(self, buffers: DecodeBuffers, size: int, seq_lens_np: np.ndarray,
               context_lens_np: np.ndarray) -> torch.Tensor:
        padded = buffers.metadata(size, seq_lens_np, context_lens_np)
        padded.backend_data = self.backend.prepare(padded)
        tokens = size * buffers.query_len
        with forward_context(self.backend, padded), layers_only(self.model):
            return self.model(buffers.input_ids[:tokens], buffers.positions[:tokens])

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per query length and capture size, largest first, sharing one memory pool
        (vLLM's order: the smaller graphs' activations fit in what the larger ones left). The
        dummy forwards are all padding: they write K/V only into the null block."""
        pool = self.graph_type.new_pool()
        order = sorted(((size * q, q, size) for q in self.query_lens for size in self.sizes), reverse=True)
        for tokens, q, size in order:
            buffers = self.buffers_of[q]
            buffers.pad(0, size)
            meta = buffers.metadata(size, np.full(size, q, dtype=np.int64), np.zeros(size, dtype=np.int64))
            # The graph serves every later context: the backend plans (e.g. splits the keys of
            # long decodes) for the longest one the block table holds.
            meta.max_seq_len = buffers.max_blocks * buffers.block_size
            meta.backend_data = self.backend.prepare(meta)
            stray = plan_reads_only(meta.backend_data, buffers)
            if stray:
                raise RuntimeError(f"attention backend {getattr(self.backend, 'name', self.backend)!r} plans into "
                                   f"its own tensors ({', '.join(stray)}): a replayed graph would read stale values")

            def run(meta: AttentionMetadata = meta, buffers: DecodeBuffers = buffers,
                    tokens: int = tokens) -> torch.Tensor:
                with forward_context(self.backend, meta), layers_only(self.model):
                    return self.model(buffers.input_ids[:tokens], buffers.positions[:tokens])

            for _ in range(WARMUP_RUNS):
                run()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            graph = self.graph_type(pool)
            out = graph.capture(run)
            self.graphs_of[q][size] = (graph, out, meta)  # the metadata and plan the graph reads stay alive
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def speculative_tokens(runner) -> int:
    """Drafts per row the runner's proposer makes (0: no speculative decoding)."""
    proposer = getattr(runner, "proposer", None)
    return proposer.config.num_speculative_tokens if proposer is not None else 0


def graph_extent(runner) -> tuple[int, int]:
    """(tokens of the largest graph, number of graphs) the runner will capture; (0, 0) without
    graphs. For the memory profile's estimate of the graphs' pool, before they exist."""
    if runner.cudagraph_mode != FULL_DECODE_ONLY:
        return 0, 0
    sizes = capture_sizes(runner.max_num_seqs, runner.cuda_graph_sizes)
    if not sizes:
        return 0, 0
    k = speculative_tokens(runner)
    return sizes[-1] * (1 + k), len(sizes) * (2 if k else 1)


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
                          runner.device, num_speculative_tokens=speculative_tokens(runner))
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
    logger.info("captured %d CUDA graphs for steps of %s rows, %s tokens per row",
                sum(map(len, static.graphs_of.values())), ", ".join(map(str, static.sizes)),
                " or ".join(map(str, static.query_lens)))
    return static
