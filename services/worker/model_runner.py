"""The model runner: persistent batch → flat ragged inputs → one forward → sampled ids.

Inputs are built with vectorised numpy over the whole step (no per-token Python loop):
for num_scheduled = [2, 5, 3] the flat batch has 10 tokens with
req_indices [0 0 1 1 1 1 1 2 2 2] and positions = num_computed[req] + offset-in-request,
and slot = block_table[req, pos // B] * B + pos % B tells attention where each token's
K/V goes. Logits are computed only at the last scheduled position of requests whose
computed tokens catch up with their known tokens (a partial prefill chunk samples nothing).
"""

from __future__ import annotations

import logging
import os
from collections import deque

import numpy as np
import torch

from services.common.config import DEFAULT_CPU_KV_CACHE_BYTES, VllmConfig, check_model_dir, is_gguf_file
from services.common.message_limits import MAX_POOLED_DIMENSIONS
from services.common.pooling_config import matryoshka_of
from services.common.proto import myvllm_pb2 as pb
from services.worker.attention.base import AttentionMetadata, forward_context
from services.worker.attention.selector import get_attention_backend
from services.worker.cpu.malloc_tuning import keep_freed_memory
from services.worker.cpu.triton_off import keep_triton_out
from services.worker.cuda_graphs import StaticDecode, build_static_decode, graph_extent, resolve_cudagraph_mode
from services.worker.grammar_mask import apply_grammar_bitmask
from services.worker.input_batch import InputBatch, runs_own_counts
from services.worker.kv_memory import zeroed_kv_cache
from services.worker.lora.manager import LoraManager, load_step_adapters
from services.worker.memory_profile import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    MemoryProfile,
    kv_cache_budget,
    measure_cuda,
    profile_forward,
)
from services.worker.models import cpu_linear
from services.worker.models.compiled import CompiledForward, Forward
from services.worker.models.fast_paths import c_step_for, use_fast_paths
from services.worker.models.load import load_model
from services.worker.models.loader import resolve_dtype
from services.worker.parallel import (
    any_engine_unfinished,
    broadcast_from_first,
    get_dp,
    get_pp,
    get_tp,
    init_parallel,
    recv_from_previous_stage,
    send_to_next_stage,
    threads_per_rank,
)
from services.worker.pooler import Pooler, pooler_outputs
from services.worker.sampler import Sampler, gather_logprobs
from services.worker.sampling_metadata import SamplingMetadata, build_sampling_metadata
from services.worker.spec_decode.factory import make_proposer
from services.worker.spec_decode.proposer import SpecProposer
from services.worker.spec_decode.verifier import verify_drafts
from services.worker.step_validation import PoolingLimits, validate_step

logger = logging.getLogger(__name__)

# Prompt logprobs take the LM head over every prompt position: in slices of this many rows,
# so a 2048-token chunk never holds a [2048, vocab] fp32 logits tensor at once.
PROMPT_LOGPROBS_ROWS = 256


def _eos_token_ids(model_dir: str, config) -> list[int]:
    """EOS ids from generation_config.json (falling back to config.json)."""
    from transformers import GenerationConfig

    eos = None
    try:  # (a .gguf file has no generation_config.json: its config carries the eos id)
        eos = None if is_gguf_file(model_dir) else GenerationConfig.from_pretrained(model_dir).eos_token_id
    except (OSError, ValueError):
        pass
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (page cache counts as free), else all physical RAM."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class MemoryBudgetError(Exception):
    """A request would make the worker allocate more than its memory holds (RESOURCE_EXHAUSTED)."""


class ModelRunner:
    """Owns the weights, the paged KV tensors, the persistent batch and the sampler."""

    def __init__(self, vllm_config: VllmConfig, *, tensor_parallel_rank: int = 0, pipeline_parallel_rank: int = 0,
                 data_parallel_rank: int = 0, distributed_init_method: str = "", device: str | None = None) -> None:
        """The whole configuration, as vLLM's runner takes it, and where this rank sits: its
        tensor/pipeline/data-parallel ranks, the process group's rendezvous, its device."""
        self.vllm_config = vllm_config
        model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
        model_dir, compile_model = model_config.model, model_config.compile_model
        tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        expert_parallel = parallel.enable_expert_parallel
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # Data-parallel engines join one process group only as an expert-parallel group.
        dp_size = parallel.data_parallel_size if expert_parallel else 1
        dp_rank = data_parallel_rank if dp_size > 1 else 0
        num_ranks = tp_size * pp_size * dp_size  # ranks sharing this host's cores
        if self.device.type == "cpu":
            torch.set_num_threads(threads_per_rank(num_ranks))
            keep_freed_memory()  # activations reused between steps instead of re-faulted
            keep_triton_out()  # no Triton kernel runs here; importing it costs noise at exit
        torch.manual_seed(model_config.seed)
        self.seed = model_config.seed
        self.model_dir = check_model_dir(model_dir)
        # "auto" on CPU is settled by timing this model's GEMMs, a choice of this process alone:
        # ranks of one model, or a KV producer and its consumer, must hold the same dtype, so
        # they keep the instruction-flag rule; a quantized model's GEMMs are not the dense ones timed.
        measured_alone = (num_ranks == 1 and vllm_config.kv_transfer_config is None
                          and not model_config.quantization)
        self.dtype = resolve_dtype(model_config.dtype or "auto", self.device,
                                   probe=cpu_linear.dtype_probe(self.model_dir) if measured_alone else None)
        if compile_model and pp_size > 1:
            raise ValueError("compile_model is not supported with pipeline_parallel_size > 1 (each stage's "
                             "forward takes the previous stage's hidden states); leave --compile out")
        if self.device.type == "cuda" and num_ranks > 1 and self.device.index is None:
            # One GPU per rank on a machine with several (NCCL refuses two ranks on one device).
            global_rank = (dp_rank + pipeline_parallel_rank) * tp_size + tensor_parallel_rank
            self.device = torch.device("cuda", global_rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        # Joins the process group (if any) first: the model builds only this rank's shard / stage.
        init_parallel(tensor_parallel_rank, tp_size, distributed_init_method, self.device,
                      pipeline_parallel_rank, pp_size, expert_parallel, dp_rank, dp_size)
        self.pp = get_pp()
        self.lockstep = get_dp().size > 1  # a data-parallel expert-parallel group's engine
        # Hidden states sent to the next stage and not yet known to have left (kept alive till then).
        self._pending_sends: deque[tuple[torch.distributed.Work, torch.Tensor]] = deque()
        self.model, self.config = load_model(model_dir, self.dtype, self.device,
                                             quantization=model_config.quantization)
        if self.lockstep and not self.model.moe_blocks():
            raise ValueError(f"{model_dir} is a dense model: data_parallel_size > 1 with enable_expert_parallel "
                             "needs a mixture-of-experts model (leave --enable-expert-parallel out for independent "
                             "replicas)")
        self.vocab_size = self.config.vocab_size
        model_max = int(self.config.max_position_embeddings)
        self.max_model_len = min(model_config.max_model_len or model_max, model_max)
        self.eos_token_ids = _eos_token_ids(model_dir, self.config)
        self.attn_backend = get_attention_backend(model_config.attention_backend, self.device)
        # Pure-decode steps on persistent padded buffers, eager or as CUDA graphs (cuda_graphs.py;
        # made by init_kv_cache): "none" | "static" | "full_decode_only".
        pooler_config = model_config.pooler_config if model_config.runner == "pooling" else None
        self.cudagraph_mode = resolve_cudagraph_mode(
            model_config.cudagraph_mode, enforce_eager=model_config.enforce_eager, device=self.device,
            compile_model=compile_model, pipeline_parallel_size=pp_size, tensor_parallel_size=tp_size,
            attention_backend=self.attn_backend.name, expert_parallel=expert_parallel and num_ranks > 1,
            pooling=pooler_config is not None)
        self.cudagraph_mode_explicit = bool(model_config.cudagraph_mode)
        self.cuda_graph_sizes = list(model_config.cuda_graph_sizes) if model_config.cuda_graph_sizes else None
        self.static_decode: StaticDecode | None = None
        # CUDA graph captures that failed (automatic mode) and the next step's output has not yet
        # reported to the scheduler, which counts them for /metrics.
        self.unreported_capture_failures = 0
        # Pooling runner (pooler_config set): every request is pooled after the final norm, none
        # sampled; the per-row pooling state lives with the persistent batch (reset_batch).
        self.pooler_config = pooler_config
        self.pooler: Pooler | None = None
        if pooler_config is not None and int(self.config.hidden_size) > MAX_POOLED_DIMENSIONS:
            raise ValueError(f"{model_dir}: hidden size {self.config.hidden_size} is wider than the "
                             f"{MAX_POOLED_DIMENSIONS} values an embedding may carry (runner pooling)")
        self.is_matryoshka, self.matryoshka_dimensions = matryoshka_of(self.config)
        self.pooling_limits = PoolingLimits(int(self.config.hidden_size), self.is_matryoshka,
                                            tuple(self.matryoshka_dimensions)) if pooler_config else None
        self.input_batch: InputBatch | None = None
        self.block_size = 0
        self.num_kv_blocks = 0
        self._sampling_cache: tuple[tuple, SamplingMetadata] | None = None
        # A step that waits for its grammar bitmask: (its output so far, logits, sampling rows).
        self._pending: tuple[pb.ModelRunnerOutput, torch.Tensor | None, np.ndarray] | None = None
        # What runs the layers faster than their torch ops (fused kernels; on CPU the C steps and
        # packed weights). The small C step's row-major copy of the weights may take at most a
        # tenth of the RAM.
        use_fast_paths(self.model, self.attn_backend.name, compile_model, _available_ram_bytes() // 10)
        # LoRA (--enable-lora): the adapters' slot table, bound into the layers.
        lora_config = vllm_config.lora_config
        self.lora = LoraManager(lora_config, self.model, self.dtype, self.device) if lora_config.enable_lora \
            else None
        # torch.compile, CPU only: on CUDA the Triton kernels and the GPU's own speed leave little to gain.
        self.compiled: CompiledForward | None = None
        if self.device.type == "cpu" and compile_model:
            self.compiled = CompiledForward(self.model)
        self.forward: Forward = self.compiled or self.model
        # Speculative decoding (None: off): proposes drafts after each step's sampling.
        self.proposer: SpecProposer | None = make_proposer(vllm_config.speculative_config, self)
        # The largest step the scheduler sends: the memory profile's dummy forward.
        self.max_num_batched_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.set_max_num_seqs(vllm_config.scheduler_config.max_num_seqs)

    def batch_state_bytes(self, max_num_seqs: int, block_size: int = 1) -> int:
        """Memory that max_num_seqs sizes, whatever the KV cache: the persistent batch (each row's
        token ids up to max_model_len and its block table) and the sampler's penalty state (a
        vocab-wide count and prompt mask per row, allocated by the first request that uses a
        penalty). With block_size 1, the largest block table any block size can need."""
        max_blocks = -(-self.max_model_len // block_size)
        per_row = 4 * self.max_model_len + 4 * max_blocks + 8 * 8 + 5 * self.vocab_size
        return max_num_seqs * per_row

    def check_batch_state_fits(self, max_num_seqs: int) -> None:
        """Refuse a max_num_seqs whose batch state could not be allocated next to the weights
        (LoadModel's field sizes arrays: a caller must not make the worker allocate until it is
        killed)."""
        wanted = self.batch_state_bytes(max_num_seqs)
        budget = self.max_kv_cache_bytes()
        if wanted > budget:
            raise MemoryBudgetError(
                f"max_num_seqs={max_num_seqs} needs {wanted} bytes of batch state (max_model_len "
                f"{self.max_model_len}, vocab {self.vocab_size}); this worker can hold at most {budget}")

    def set_max_num_seqs(self, max_num_seqs: int) -> None:
        """Size the persistent batch and the sampler's per-row state for this many requests
        (the scheduler's --max-num-seqs; changing it needs no reload of the weights)."""
        self.check_batch_state_fits(max_num_seqs)
        self.max_num_seqs = max_num_seqs
        self.sampler = Sampler(max_num_reqs=max_num_seqs, vocab_size=self.vocab_size, device=self.device)
        if self.input_batch is not None:
            self.reset_batch()

    # ------------------------------------------------------------------ KV cache

    def kv_bytes_per_block(self, block_size: int) -> int:
        attn = self.model.attention_layers()[0]
        per_token = 2 * attn.num_kv_heads * attn.head_dim * self.dtype.itemsize
        draft = self.proposer.kv_bytes_per_block(block_size) if self.proposer is not None else 0
        return per_token * block_size * len(self.model.attention_layers()) + draft

    def _free_bytes_for_kv(self) -> int:
        """Memory a KV cache may take: what is free now, plus the cache this worker already
        holds (a re-initialisation replaces it)."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        else:
            free = _available_ram_bytes()
        return free + self._held_kv_bytes()

    def _held_kv_bytes(self) -> int:
        return sum(layer.kv_cache.numel() * layer.kv_cache.element_size()
                   for layer in self.model.attention_layers() if layer.kv_cache is not None)

    def max_kv_cache_bytes(self) -> int:
        """The most KV cache this worker will allocate: 90% of the free GPU memory or available
        RAM (next to the weights). InitKVCache refuses more, so a caller cannot make the worker
        allocate until it is killed."""
        return int(self._free_bytes_for_kv() * 0.9)

    def num_blocks_for_budget(self, block_size: int, kv_cache_memory_bytes: int | None,
                              gpu_memory_utilization: float | None = None) -> int:
        """KV blocks that fit `kv_cache_memory_bytes`, else this device's own budget: on CUDA
        `gpu_memory_utilization` (default 0.9) of the GPU less the peak of a profiled max-size
        forward and the CUDA graphs' estimated pool (vLLM's rule, memory_profile.py); where no
        profile runs (parallel ranks), that share less what this process holds besides its KV
        cache, or without it 80% of the free memory; on CPU DEFAULT_CPU_KV_CACHE_BYTES."""
        if kv_cache_memory_bytes is None:
            if self.device.type == "cuda":
                kv_cache_memory_bytes = self._gpu_kv_budget(gpu_memory_utilization, block_size)
            else:
                if gpu_memory_utilization is not None:
                    logger.warning("--gpu-memory-utilization does not apply on CPU: the KV cache takes "
                                   "--kv-cache-memory bytes (default %d GiB)", DEFAULT_CPU_KV_CACHE_BYTES >> 30)
                kv_cache_memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        return max(int(kv_cache_memory_bytes // self.kv_bytes_per_block(block_size)), 0)

    def _gpu_kv_budget(self, gpu_memory_utilization: float | None, block_size: int) -> int:
        profile = self.profile_memory(block_size)
        if profile is not None:
            return kv_cache_budget(profile, gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION)
        if gpu_memory_utilization is None:
            return int(self._free_bytes_for_kv() * 0.8)
        _, total = torch.cuda.mem_get_info(self.device)
        # What this process holds besides its KV cache (weights, CUDA graphs, the allocator's
        # cached blocks) counts against its share; never more than is free.
        besides_kv = torch.cuda.memory_reserved(self.device) - self._held_kv_bytes()
        return max(min(int(total * gpu_memory_utilization) - besides_kv, self._free_bytes_for_kv()), 0)

    def profile_memory(self, block_size: int) -> MemoryProfile | None:
        """The memory profile of a max-size dummy forward on CUDA; None elsewhere, and on parallel
        ranks (every rank would have to join the forward's collectives at once)."""
        if self.device.type != "cuda" or get_tp().size > 1 or not (self.pp.is_first and self.pp.is_last) \
                or self.lockstep:
            return None
        tokens = max(int(self.max_num_batched_tokens), 1)
        graph_tokens, num_graphs = graph_extent(self)

        def run() -> None:
            profile_forward(self.model, self.attn_backend, tokens, self.max_num_seqs, block_size, self.dtype,
                            self.device)

        return measure_cuda(run, self.device, self._held_kv_bytes(), graph_tokens, num_graphs, tokens)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate [2, num_blocks, block_size, kv_heads, head_dim] per layer and bind it."""
        self.block_size = block_size
        self.num_kv_blocks = num_blocks
        layers = self.model.attention_layers()
        self.static_decode = None  # a re-initialisation: its graphs (and their memory) read the old cache
        for layer in layers:  # a re-initialisation: free the old cache before the new one exists
            layer.kv_cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        for layer in layers:
            layer.kv_cache = zeroed_kv_cache((2, num_blocks, block_size, layer.num_kv_heads, layer.head_dim),
                                             self.dtype, self.device)
        if self.proposer is not None:
            self.proposer.init_kv_cache(num_blocks, block_size)
        self.reset_batch()
        if self.compiled is not None and self.compiled.enabled:
            self._compile()
        self.static_decode = build_static_decode(self)  # after the cache: graphs capture its addresses

    @torch.inference_mode()
    def _compile(self) -> None:
        """Compile with dummy forwards (a single prompt of n tokens, its K/V stored in the null
        block, which no request reads), then clear what they wrote."""
        bs = self.block_size

        def run(n: int) -> None:
            meta = AttentionMetadata.from_host(np.zeros(n, dtype=np.int64), np.array([0, n]), np.array([n]),
                                               np.array([0]), np.zeros((1, -(-n // bs)), dtype=np.int32), bs,
                                               self.device)
            meta.backend_data = self.attn_backend.prepare(meta)
            with forward_context(self.attn_backend, meta):
                self.compiled(torch.zeros(n, dtype=torch.long, device=self.device),
                              torch.zeros(n, dtype=torch.long, device=self.device))

        self.compiled.warm_up(run)
        for layer in self.model.attention_layers():
            layer.kv_cache[:, 0].zero_()

    def reset_batch(self) -> None:
        """Forget every request (a new scheduler stream starts from scratch)."""
        self.input_batch = InputBatch(self.max_num_seqs, self.max_model_len, self.block_size, self.seed)
        if self.pooler_config is not None:
            self.pooler = Pooler(self.pooler_config, self.max_num_seqs, int(self.config.hidden_size), self.device)
        self._sampling_cache = None
        self._pending_sends.clear()
        self._pending = None

    # ------------------------------------------------------------------ one step

    def _apply_scheduler_output(self, so: pb.SchedulerOutput) -> tuple[np.ndarray, np.ndarray]:
        """The step's rows, and how many tokens each runs: the scheduler's counts, except for rows
        that verify this worker's own drafts (num_worker_drafts: 1 + those it has)."""
        batch = self.input_batch
        for rid in so.finished_request_ids:
            batch.remove(rid)
        rows = [batch.add(r) for r in so.new_requests]
        if self.pooler is not None:
            for row in rows:
                self.pooler.start_row(row)
        else:
            self.sampler.add_requests(rows, list(so.new_requests))  # penalty counts / prompt masks of new rows
        rows += [batch.update(r) for r in so.cached_requests]
        rows = np.array(rows, dtype=np.int64)
        num_scheduled = np.asarray(so.num_scheduled_tokens, dtype=np.int64)
        blind = [len(so.new_requests) + i for i, r in enumerate(so.cached_requests) if runs_own_counts(r)]
        if blind:
            num_scheduled[blind] = 1 + batch.num_spec[rows[blind]]
        return rows, num_scheduled

    def _prepare_inputs(self, rows: np.ndarray, num_scheduled: np.ndarray):
        batch, bs = self.input_batch, self.block_size
        num_reqs = rows.size
        cu_num_tokens = np.cumsum(num_scheduled)
        num_tokens = int(cu_num_tokens[-1])
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        query_start_loc[1:] = cu_num_tokens
        req_indices = np.repeat(np.arange(num_reqs), num_scheduled)
        offsets = np.arange(num_tokens) - np.repeat(query_start_loc[:-1], num_scheduled)
        context_lens = batch.num_computed_tokens[rows]
        positions = context_lens[req_indices] + offsets
        token_rows = rows[req_indices]
        input_ids = batch.token_ids[token_rows, positions]
        slot_mapping = batch.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = context_lens + num_scheduled
        max_blocks = int(-(-seq_lens.max() // bs))
        block_table = batch.block_table[rows, :max_blocks]
        # Requests that caught up with their known tokens sample; partial prefills do not. A row
        # verifying d drafts needs logits at its last d + 1 positions.
        samples = (seq_lens >= batch.num_tokens[rows]) & ~batch.is_pooling[rows]  # pooling rows never sample
        num_logits = np.where(samples, batch.num_spec[rows] + 1, 0)
        logits_indices = (np.repeat(cu_num_tokens - num_logits, num_logits) + np.arange(num_logits.sum())
                          - np.repeat(np.cumsum(num_logits) - num_logits, num_logits))

        dev = self.device
        meta = AttentionMetadata.from_host(slot_mapping, query_start_loc, seq_lens, context_lens, block_table,
                                          bs, dev)
        if self.lora is not None:
            meta.lora = self.lora.batch(batch.lora_slot[token_rows])
        # The C decode step attends without the backend's plan; a draft model mirrors the
        # target's forward with the same metadata, so it needs the plan either way.
        if self.proposer is not None or c_step_for(self.model, meta) is None:
            meta.backend_data = self.attn_backend.prepare(meta)
        batch.num_computed_tokens[rows] = seq_lens
        input_ids_t = torch.from_numpy(input_ids.astype(np.int64)).to(dev)
        positions_t = torch.from_numpy(positions).to(dev)
        return input_ids_t, positions_t, meta, samples, torch.from_numpy(logits_indices).to(dev)

    def _sampling_metadata(self, sample_rows: np.ndarray) -> SamplingMetadata:
        """Reuse the previous step's tensors while the sampling rows stay the same."""
        batch = self.input_batch
        rows = sample_rows.tolist()
        key = (batch.version, tuple(rows))
        if self._sampling_cache is not None and self._sampling_cache[0] == key:
            return self._sampling_cache[1]
        gens = {i: batch.generators[r] for i, r in enumerate(rows) if r in batch.generators}
        md = build_sampling_metadata([batch.sampling[r] for r in rows], gens, self.vocab_size, self.device,
                                     rows=sample_rows, history=batch, eos_token_ids=self.eos_token_ids,
                                     penalty_state=self.sampler.penalty_state)
        self._sampling_cache = (key, md)
        return md

    def _prompt_logprobs(self, rows: np.ndarray, num_scheduled: np.ndarray, meta: AttentionMetadata,
                         hidden: torch.Tensor) -> list[pb.PromptLogprobs]:
        """For requests that asked: the logprob of each prompt token this step's positions
        predict (position p's logits score prompt token p+1), from the raw logits."""
        batch = self.input_batch
        result: list[pb.PromptLogprobs] = []
        if not batch.prompt_logprob_rows:
            return result
        for i, row in enumerate(rows.tolist()):
            if row not in batch.prompt_logprob_rows:
                continue
            params = batch.sampling[row]
            first = int(meta.context_lens_np[i])
            end = min(first + int(num_scheduled[i]), int(batch.num_prompt_tokens[row]) - 1)
            if end <= first:
                continue  # nothing of the prompt left to score (decode, or the last prompt token)
            start_row = int(meta.query_start_loc_np[i])
            targets = torch.from_numpy(batch.token_ids[row, first + 1:end + 1].astype(np.int64)).to(self.device)
            logprobs: list[pb.TokenLogprobs] = []
            for lo in range(0, end - first, PROMPT_LOGPROBS_ROWS):
                hi = min(lo + PROMPT_LOGPROBS_ROWS, end - first)
                raw = torch.log_softmax(self.model.compute_logits(hidden[start_row + lo:start_row + hi]), dim=-1)
                logprobs += gather_logprobs(raw, targets[lo:hi], np.full(hi - lo, params.prompt_logprobs))
            result.append(pb.PromptLogprobs(request_id=batch.row_req_ids[row], first_position=first + 1,
                                            logprobs=logprobs))
        return result

    def _send_to_next_stage(self, hidden: torch.Tensor) -> None:
        """Hand this step's hidden states on without waiting for the next stage to take them
        (it may still be computing the previous step). The previous step's transfer is finished
        first: the next stage receives in step order, so this wait is short in steady state."""
        while self._pending_sends:
            work, _ = self._pending_sends.popleft()
            work.wait()
        hidden = hidden.contiguous()
        self._pending_sends.append((send_to_next_stage(hidden), hidden))

    @torch.inference_mode()
    def execute(self, so: pb.SchedulerOutput) -> pb.ModelRunnerOutput | None:
        """Run one step. A step sent with `grammar_bitmask_follows` (async scheduling: its
        constrained rows' bitmask needs the previous step's tokens) stops before sampling and
        returns None; the next message, `grammar_bitmask_only` with the same step id, brings
        the bitmask and gets the step's output."""
        if self.lora is not None:
            so = self.lora.skip_left_out(so)
        validate_step(so, self.input_batch, self.num_kv_blocks, self.vocab_size,  # before anything is applied
                      self.pooling_limits, self.lora.config.max_loras if self.lora is not None else 0)
        if so.grammar_bitmask_only:
            pending, self._pending = self._pending, None
            if pending is None or pending[0].step_id != so.step_id:
                return None  # the step it completes failed (already reported) or was reset
            return self._sample(*pending, so)
        lora_failures = []
        if self.lora is not None and so.new_requests:
            so, lora_failures = load_step_adapters(self.lora, so, self.input_batch)
        rows, num_scheduled = self._apply_scheduler_output(so)
        out = pb.ModelRunnerOutput(step_id=so.step_id, lora_load_failures=lora_failures)
        out.cudagraph_capture_failures, self.unreported_capture_failures = self.unreported_capture_failures, 0
        if self.lockstep:  # every engine's ranks, once per step: does the group go on after it?
            out.dp_global_unfinished = any_engine_unfinished(so.dp_local_unfinished)
        if rows.size == 0:
            if self.lockstep:
                self.model.dummy_step()
            return out
        input_ids, positions, meta, samples, logits_indices = self._prepare_inputs(rows, num_scheduled)
        with forward_context(self.attn_backend, meta):
            if self.static_decode is not None and meta.lora is None and \
                    self.static_decode.applies(self, rows, num_scheduled):
                hidden = self.static_decode.forward(input_ids, positions, meta)  # padded; graphs on CUDA
            elif self.pp.is_first:
                hidden = self.forward(input_ids, positions)
            else:
                received = recv_from_previous_stage((meta.num_tokens, self.config.hidden_size), self.dtype,
                                                    self.device)
                hidden = self.model(input_ids, positions, received)
        if self.proposer is not None:
            self.proposer.observe_step(input_ids, positions, meta, hidden)
        if not self.pp.is_last:
            self._send_to_next_stage(hidden)
            return out  # the last stage samples and answers for the step
        if self.pooler is not None:  # the pooling runner: pool, and skip the LM head (nothing samples)
            self._pool(out, hidden, rows, num_scheduled, meta)
            return out
        out.prompt_logprobs.extend(self._prompt_logprobs(rows, num_scheduled, meta, hidden))
        logits = self.model.compute_logits(hidden.index_select(0, logits_indices)) if logits_indices.numel() else None
        if so.grammar_bitmask_follows:
            self._pending = (out, logits, rows[samples])
            return None
        return self._sample(out, logits, rows[samples], so)

    def _pool(self, out: pb.ModelRunnerOutput, hidden: torch.Tensor, rows: np.ndarray, num_scheduled: np.ndarray,
              meta: AttentionMetadata) -> None:
        """Fold this step's final-norm hidden states into each pooling row's state; the requests
        whose prompt this step completed answer with their embedding (vLLM's pooler_output)."""
        batch = self.input_batch
        done = batch.num_computed_tokens[rows] >= batch.num_prompt_tokens[rows]  # (already advanced)
        embeddings = self.pooler.pool(hidden, rows, num_scheduled, meta.query_start_loc_np, batch.is_pooling[rows],
                                      done, batch.num_prompt_tokens[rows], batch.pooling_dimensions[rows])
        out.pooler_output.extend(pooler_outputs([batch.row_req_ids[r] for r in rows.tolist()], embeddings))

    def _sample(self, out: pb.ModelRunnerOutput, logits: torch.Tensor | None, sample_rows: np.ndarray,
                so: pb.SchedulerOutput) -> pb.ModelRunnerOutput:
        """Sample (verifying drafts where a row brought some), record the tokens in `out`, and
        propose the next step's drafts."""
        if logits is None:
            return out
        num_spec = self.input_batch.num_spec[sample_rows]
        if num_spec.any():
            self._sample_with_drafts(out, logits, sample_rows, num_spec, so)
        else:
            self._sample_plain(out, logits, sample_rows, so)
        if self.proposer is not None and not so.skip_drafts:  # (skip: the scheduler would drop them)
            self.proposer.propose(out, sample_rows)
        return out

    def _sample_with_drafts(self, out: pb.ModelRunnerOutput, logits: torch.Tensor, sample_rows: np.ndarray,
                            num_spec: np.ndarray, so: pb.SchedulerOutput) -> None:
        """Rows without drafts sample as ever (from their last logits row); rows with drafts are
        verified over all their positions. `out` lists the plain rows first, then the verified."""
        batch = self.input_batch
        ends = np.cumsum(num_spec + 1)
        plain = num_spec == 0
        if plain.any():
            self._sample_plain(out, logits[torch.from_numpy(ends[plain] - 1).to(logits.device)], sample_rows[plain], so)
        out.num_sampled_tokens.extend([1] * len(out.request_ids))
        out.num_draft_tokens.extend([0] * len(out.request_ids))
        spec_rows, nd = sample_rows[~plain], num_spec[~plain]
        sel = np.concatenate([np.arange(e - n - 1, e) for e, n in zip(ends[~plain], nd, strict=True)])
        rep_rows = np.repeat(spec_rows, nd + 1)
        md = build_sampling_metadata([batch.sampling[r] for r in rep_rows.tolist()], {}, self.vocab_size,
                                     self.device, rows=rep_rows, history=batch, eos_token_ids=self.eos_token_ids)
        draft_ids = np.zeros((spec_rows.size, int(nd.max())), dtype=np.int64)
        for i, (row, n) in enumerate(zip(spec_rows.tolist(), nd.tolist(), strict=True)):
            start = batch.num_tokens[row]
            draft_ids[i, :n] = batch.token_ids[row, start:start + n]
        draft_probs = self.proposer.draft_probs(spec_rows, nd) if self.proposer is not None else None
        emitted, logprobs = verify_drafts(self.sampler, logits[torch.from_numpy(sel).to(logits.device)], md, nd,
                                          draft_ids, draft_probs,
                                          sync=broadcast_from_first if get_tp().size > 1 else None)
        batch.append_token_lists(spec_rows.tolist(), emitted)
        out.request_ids.extend([batch.row_req_ids[r] for r in spec_rows.tolist()])
        for tokens in emitted:
            out.sampled_token_ids.extend(tokens)
            out.num_sampled_tokens.append(len(tokens))
        out.num_draft_tokens.extend(nd.tolist())
        if logprobs is not None or len(out.logprobs):
            # Logprobs stay parallel to the tokens: empty entries where the rows asked for none.
            num_plain = int(plain.sum())
            out.logprobs.extend(pb.TokenLogprobs() for _ in range(num_plain - len(out.logprobs)))
            for r, tokens in enumerate(emitted):
                out.logprobs.extend(logprobs[r] if logprobs is not None else [pb.TokenLogprobs()] * len(tokens))

    def _sample_plain(self, out: pb.ModelRunnerOutput, logits: torch.Tensor, sample_rows: np.ndarray,
                      so: pb.SchedulerOutput) -> None:
        """Mask the constrained rows (bitmask from `so`), sample one token per row, record it in `out`."""
        if so.structured_output_request_ids:
            row_req_ids = self.input_batch.row_req_ids
            apply_grammar_bitmask(logits, so, {row_req_ids[r]: i for i, r in enumerate(sample_rows.tolist())})
        self.input_batch.reseed_generators(sample_rows)
        sampled, logprobs = self.sampler(logits, self._sampling_metadata(sample_rows))
        # Every TP rank sampled from the same gathered logits with the same generators; rank 0's
        # ids are made everyone's anyway, so the ranks' batches can never drift apart.
        if get_tp().size > 1:
            sampled = broadcast_from_first(sampled.contiguous())
        token_ids = sampled.cpu().numpy().astype(np.int32)
        self.input_batch.append_tokens(sample_rows, token_ids)
        out.request_ids.extend([self.input_batch.row_req_ids[r] for r in sample_rows.tolist()])
        out.sampled_token_ids.extend(token_ids.tolist())
        if logprobs is not None:
            out.logprobs.extend(lp if lp is not None else pb.TokenLogprobs() for lp in logprobs)
