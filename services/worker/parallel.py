"""Model parallelism: this process's place in its engine's tensor- and pipeline-parallel
groups, how the model's heads, MLP columns, vocabulary and layers split across ranks, and the
collectives and point-to-point transfers the sharded model needs (torch.distributed: gloo on
CPU, NCCL on CUDA).

Tensor parallelism is Megatron's split, as vLLM does it: column-parallel fused qkv and gate_up
(each rank computes its heads / its slice of the intermediate size), row-parallel o_proj and
down_proj (each rank holds the matching input columns; one all-reduce sums the partial outputs),
vocab-parallel embedding (each rank looks up the ids in its vocabulary range; an all-reduce fills
the rest) and LM head (an all-gather assembles the logits). KV heads split like the query heads;
when there are more ranks than KV heads, each KV head is replicated on tp_size / num_kv_heads
ranks. With one rank every function here is the identity and no collective runs.

Pipeline parallelism splits the layers into P contiguous stages: the first stage embeds, the last
one holds the final norm and the LM head and samples; each stage sends its hidden states to the
next (point-to-point, one transfer per step; the residual stream is the hidden state itself in
this model code, so there is nothing else to send). T x P ranks make one engine, stage-major:
global rank = pp_rank * T + tp_rank, and the T ranks of one stage form its TP group.

Expert parallelism (`enable_expert_parallel`, MoE models): the experts split across the TP
ranks instead of their columns; each rank runs its own experts on every token (the tokens are
the same on all TP ranks) and the same all-reduce that ends a dense MLP sums the experts'
outputs. With D data-parallel engines as one group (`data_parallel_size` > 1) the world is
D x T ranks, data-parallel-major (global rank = dp_rank * T + tp_rank), each engine's T ranks
its TP group; the experts split over the whole world, and since the engines' tokens differ each
(token, expert) pair goes to its expert's rank and back by all-to-all
(models/expert_dispatch.py). The engines step in lockstep: every step all-reduces whether any
engine has unfinished requests (`any_engine_unfinished`).

Rendezvous: the ranks join the store their engine's owner hosts (services/common/rendezvous.py)
under the generation's key prefix that `distributed_init_method` names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from services.common.rendezvous import rank_timeout


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    init_method: str = ""


@dataclass(frozen=True)
class PipelineParallel:
    rank: int = 0
    size: int = 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1


@dataclass(frozen=True)
class ExpertParallel:
    rank: int = 0
    size: int = 1


@dataclass(frozen=True)
class DataParallel:
    """This engine's place in its expert-parallel group of data-parallel engines (size 1: an
    engine of its own)."""
    rank: int = 0
    size: int = 1


_state = TensorParallel()
_pp_state = PipelineParallel()
_ep_state = ExpertParallel()
_dp_state = DataParallel()
# The TP group's handle (None: the default group, i.e. every rank of the engine).
_tp_group = None


def get_tp() -> TensorParallel:
    return _state


def get_pp() -> PipelineParallel:
    return _pp_state


def get_ep() -> ExpertParallel:
    """This rank's place among the ranks that split an MoE layer's experts (size 1: every rank
    holds every expert, TP splits their columns)."""
    return _ep_state


def get_dp() -> DataParallel:
    return _dp_state


def _engine_first_rank() -> int:
    """Global rank of this engine's first rank (0 unless data-parallel engines share the world)."""
    return _dp_state.rank * _state.size * _pp_state.size


def _global_rank() -> int:
    return _engine_first_rank() + _pp_state.rank * _state.size + _state.rank


def init_parallel(tp_rank: int, tp_size: int, init_method: str, device: torch.device, pp_rank: int = 0,
                  pp_size: int = 1, expert_parallel: bool = False, dp_rank: int = 0, dp_size: int = 1) -> None:
    """Join the engine's process group of tp_size x pp_size ranks (blocks until all have joined);
    with dp_size > 1 (expert parallel only) the group of every data-parallel engine's ranks."""
    global _state, _pp_state, _tp_group, _ep_state, _dp_state
    tp_size, pp_size, dp_size = max(tp_size, 1), max(pp_size, 1), max(dp_size, 1)
    if dp_size > 1 and not expert_parallel:
        raise ValueError("data-parallel engines share a process group only with expert parallelism")
    if dp_size > 1 and pp_size > 1:
        raise ValueError("data-parallel expert parallelism does not combine with pipeline_parallel_size > 1")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"data_parallel_rank={dp_rank} is outside [0, data_parallel_size={dp_size})")
    world = tp_size * pp_size * dp_size
    ep_size = world if dp_size > 1 else tp_size
    _ep_state = ExpertParallel(dp_rank * tp_size + tp_rank, ep_size) if expert_parallel and ep_size > 1 \
        else ExpertParallel()
    _dp_state = DataParallel(dp_rank, dp_size)
    if world == 1:
        _state, _pp_state, _tp_group = TensorParallel(), PipelineParallel(), None
        return
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor_parallel_rank={tp_rank} is outside [0, tensor_parallel_size={tp_size})")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline_parallel_rank={pp_rank} is outside [0, pipeline_parallel_size={pp_size})")
    if not init_method:
        raise ValueError("model parallelism needs distributed_init_method (e.g. tcp://host:port)")
    if dist.is_initialized():
        # An earlier engine's group in this process (an offline LLM that was never closed, or a
        # set-up being redone): its peers are gone, and a collective over it would wait forever.
        dist.destroy_process_group()
    url = urlsplit(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"distributed_init_method must be tcp://host:port/generation, got {init_method!r}")
    store = dist.TCPStore(url.hostname, url.port, is_master=False, timeout=rank_timeout())
    backend = "nccl" if device.type == "cuda" else "gloo"
    global_rank = dp_rank * tp_size + pp_rank * tp_size + tp_rank  # (dp_size > 1 only with pp_size 1)
    dist.init_process_group(backend, store=dist.PrefixStore(url.path or "/", store), rank=global_rank,
                            world_size=world, timeout=rank_timeout())
    _tp_group = None
    if (pp_size > 1 or dp_size > 1) and tp_size > 1:
        # Every rank creates every TP group (each stage's, each engine's), in the same order
        # (torch.distributed's rule).
        for index in range(pp_size * dp_size):
            group = dist.new_group(list(range(index * tp_size, (index + 1) * tp_size)), timeout=rank_timeout())
            if index == dp_rank * pp_size + pp_rank:
                _tp_group = group
    _state = TensorParallel(tp_rank, tp_size, init_method)
    _pp_state = PipelineParallel(pp_rank, pp_size)


def destroy_parallel() -> None:
    global _state, _pp_state, _tp_group, _ep_state, _dp_state
    if dist.is_initialized():
        dist.destroy_process_group()
    _state, _pp_state, _tp_group, _ep_state = TensorParallel(), PipelineParallel(), None, ExpertParallel()
    _dp_state = DataParallel()


def threads_per_rank(num_ranks: int) -> int:
    """CPU threads for one of an engine's `num_ranks` ranks (T x P): the ranks of one machine
    share its cores (MYVLLM_NUM_THREADS overrides)."""
    if "MYVLLM_NUM_THREADS" in os.environ:
        return int(os.environ["MYVLLM_NUM_THREADS"])
    return max((os.cpu_count() or 1) // max(num_ranks, 1), 1)


# ---------------------------------------------------------------------- how things split

def stage_layers(num_layers: int, pp: PipelineParallel) -> range:
    """The layers of pipeline stage pp.rank: contiguous, as even as the count allows. As in vLLM,
    the layers left over go to the stages before the last (the last also holds the final norm,
    the LM head and the sampler)."""
    if pp.size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp.size} is more than the model's {num_layers} layers")
    per_stage, extra = divmod(num_layers, pp.size)
    sizes = [per_stage] * pp.size
    for i in range(extra):
        sizes[pp.size - 2 - i] += 1
    start = sum(sizes[:pp.rank])
    return range(start, start + sizes[pp.rank])


def head_range(num_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(first query head, number of query heads) of this rank."""
    per_rank = num_heads // tp.size
    return tp.rank * per_rank, per_rank


def kv_head_range(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(first KV head, number of KV heads) of this rank: a slice, or one replicated head."""
    if tp.size <= num_kv_heads:
        per_rank = num_kv_heads // tp.size
        return tp.rank * per_rank, per_rank
    return tp.rank // (tp.size // num_kv_heads), 1


def expert_range(num_experts: int, ep: ExpertParallel) -> tuple[int, int]:
    """(first expert, how many) this rank holds: contiguous, the first num_experts % size ranks
    one more (vLLM's split)."""
    per_rank, extra = divmod(num_experts, ep.size)
    if per_rank == 0:
        raise ValueError(f"expert parallelism over {ep.size} ranks needs at least as many experts "
                         f"(the model has {num_experts})")
    return ep.rank * per_rank + min(ep.rank, extra), per_rank + (ep.rank < extra)


def column_range(size: int, tp: TensorParallel) -> tuple[int, int]:
    """(start, length) of this rank's slice of a dimension that splits evenly."""
    per_rank = size // tp.size
    return tp.rank * per_rank, per_rank


def vocab_range(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(first id, rows held) of this rank's vocabulary shard. Every rank holds the same number
    of rows (the last one padded with zeros) so the logits all-gather is one equal-sized call."""
    per_rank = -(-vocab_size // tp.size)
    return tp.rank * per_rank, per_rank


# ---------------------------------------------------------------------- collectives

def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the TP group (in place)."""
    if _state.size > 1:
        dist.all_reduce(x, group=_tp_group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Every TP rank's x side by side along the last dimension, in rank order."""
    if _state.size == 1:
        return x
    return torch.cat(all_gather_tp(x), dim=-1)


def broadcast_from_first(x: torch.Tensor) -> torch.Tensor:
    """TP rank 0's x on every rank of the TP group (in place)."""
    if _state.size > 1:
        src = _engine_first_rank() + _pp_state.rank * _state.size  # global rank of TP rank 0
        dist.broadcast(x, src=src, group=_tp_group)
    return x


def all_gather_tp(x: torch.Tensor) -> list[torch.Tensor]:
    """Every TP rank's x (same shape on all), in rank order."""
    parts = [torch.empty_like(x) for _ in range(_state.size)]
    dist.all_gather(parts, x.contiguous(), group=_tp_group)
    return parts


def any_engine_unfinished(local: bool) -> bool:
    """Whether any data-parallel engine of the group has unfinished requests (every rank of the
    group calls this once per step, with its engine's answer)."""
    if _dp_state.size == 1:
        return local
    flag = torch.tensor([int(local)], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def send_to_next_stage(x: torch.Tensor) -> dist.Work:
    """Start sending x to the same TP rank of the next pipeline stage; the caller keeps x alive
    until the returned work completes."""
    return dist.isend(x.contiguous(), dst=_global_rank() + _state.size)


def recv_from_previous_stage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The previous stage's hidden states for this step (blocks until they arrive)."""
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src=_global_rank() - _state.size)
    return x
