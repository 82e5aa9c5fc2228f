"""Tensor parallelism: this process's rank in its engine's TP group, how the model's heads,
MLP columns and vocabulary split across ranks, and the collectives the sharded layers need
(torch.distributed: gloo on CPU, NCCL on CUDA).

Megatron's split, as vLLM does it: column-parallel fused qkv and gate_up (each rank computes
its heads / its slice of the intermediate size), row-parallel o_proj and down_proj (each rank
holds the matching input columns; one all-reduce sums the partial outputs), vocab-parallel
embedding (each rank looks up the ids in its vocabulary range; an all-reduce fills the rest)
and LM head (an all-gather assembles the logits). KV heads split like the query heads; when
there are more ranks than KV heads, each KV head is replicated on tp_size / num_kv_heads ranks.
With one rank every function here is the identity and no collective runs.

Rendezvous: the engine's owner (the scheduler service, or the offline LLM) hosts a
torch.distributed TCPStore (`RendezvousStore`) and hands every rank the same
`distributed_init_method`, "tcp://host:port/generation"; the ranks join as clients under that
generation's key prefix. The owner picks a free port on its own host, and setting the ranks up
again after a failure is a new generation on the same store, with no stale keys and no port race.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    init_method: str = ""


_state = TensorParallel()


def get_tp() -> TensorParallel:
    return _state


def _timeout() -> timedelta:
    # A rank that died leaves the others blocked in a collective: give up after this long.
    return timedelta(seconds=float(os.environ.get("MYVLLM_TP_TIMEOUT_S", "300")))


class RendezvousStore:
    """The key-value store TP ranks meet at, hosted by the engine's owner on a free port."""

    def __init__(self, host: str = "127.0.0.1", advertise_host: str | None = None) -> None:
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=_timeout())
        self.advertise_host = advertise_host or host
        self._generations = itertools.count()

    def next_init_method(self) -> str:
        """The init method for one set-up of the ranks (a fresh key prefix each time)."""
        return f"tcp://{self.advertise_host}:{self.store.port}/{next(self._generations)}"


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device) -> None:
    """Join the engine's TP group (blocks until every rank has joined)."""
    global _state
    if size <= 1:
        _state = TensorParallel()
        return
    if not 0 <= rank < size:
        raise ValueError(f"tensor_parallel_rank={rank} is outside [0, tensor_parallel_size={size})")
    if not init_method:
        raise ValueError("tensor parallelism needs distributed_init_method (e.g. tcp://host:port)")
    if dist.is_initialized() and _state.init_method != init_method:
        # An earlier engine's group in this process (an offline LLM that was never closed):
        # its peers are gone, and a collective over it would wait for them forever.
        dist.destroy_process_group()
    if not dist.is_initialized():
        url = urlsplit(init_method)
        if url.scheme != "tcp" or not url.hostname or not url.port:
            raise ValueError(f"distributed_init_method must be tcp://host:port/generation, got {init_method!r}")
        store = dist.TCPStore(url.hostname, url.port, is_master=False, timeout=_timeout())
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore(url.path or "/", store), rank=rank,
                                world_size=size, timeout=_timeout())
    _state = TensorParallel(rank, size, init_method)


def destroy_tensor_parallel() -> None:
    global _state
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = TensorParallel()


def threads_per_rank(tensor_parallel_size: int) -> int:
    """CPU threads for one rank: the ranks of one machine share its cores (MYVLLM_NUM_THREADS
    overrides)."""
    if "MYVLLM_NUM_THREADS" in os.environ:
        return int(os.environ["MYVLLM_NUM_THREADS"])
    return max((os.cpu_count() or 1) // max(tensor_parallel_size, 1), 1)


# ---------------------------------------------------------------------- how things split

def check_divisible(config, size: int) -> None:
    """Refuse, naming the numbers, a TP size the model's shapes do not split evenly."""
    if size <= 1:
        return
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide num_attention_heads={heads}")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size={size} and num_key_value_heads={kv_heads}: one must divide "
                         "the other (KV heads are split across ranks, or replicated when there are fewer)")
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide intermediate_size={config.intermediate_size}")


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
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x side by side along the last dimension, in rank order."""
    if _state.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast_from_first(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x on every rank (in place)."""
    if _state.size > 1:
        dist.broadcast(x, src=0)
    return x
