"""An engine's T x P model-parallel ranks, stage-major (global rank = pp_rank * T + tp_rank): the
per-rank LoadModel requests, written once for the scheduler's gRPC workers and the offline
`LLM`'s local ranks, and which rank's answer carries the sampled tokens."""

from __future__ import annotations

from services.common.proto import myvllm_pb2 as pb


def per_rank_load_requests(request: pb.LoadModelRequest, tp_size: int, pp_size: int,
                           init_method: str) -> list[pb.LoadModelRequest]:
    """`request` for every rank, each naming its TP rank, its stage, the group sizes and the
    rendezvous of this set-up."""
    per_rank = []
    for rank in range(tp_size * pp_size):
        r = pb.LoadModelRequest()
        r.CopyFrom(request)
        r.tensor_parallel_rank, r.tensor_parallel_size = rank % tp_size, tp_size
        r.pipeline_parallel_rank, r.pipeline_parallel_size = rank // tp_size, pp_size
        r.distributed_init_method = init_method
        per_rank.append(r)
    return per_rank


def output_rank(tp_size: int, pp_size: int) -> int:
    """The rank that samples, and answers for every step: TP rank 0 of the last stage."""
    return (pp_size - 1) * tp_size


def fullest_rank_capacity(capacities: list[pb.KVCapacity]) -> pb.KVCapacity:
    """Stages hold different numbers of layers: the cache gets what fits on the fullest rank."""
    return min(capacities, key=lambda c: c.num_blocks)
