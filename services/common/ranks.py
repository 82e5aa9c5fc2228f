"""An engine's T x P model-parallel ranks, stage-major (global rank = pp_rank * T + tp_rank): the
per-rank LoadModel requests, written once for the scheduler's gRPC workers and the offline
`LLM`'s local ranks, and which rank's answer carries the sampled tokens."""

from __future__ import annotations

from services.common.proto import myvllm_pb2 as pb


def per_rank_load_requests(request: pb.LoadModelRequest, init_method: str,
                           data_parallel_rank: int = 0) -> list[pb.LoadModelRequest]:
    """`request` for every rank of its configuration's T x P, each naming its TP rank, its stage,
    its engine's data-parallel rank and the rendezvous of this set-up."""
    parallel = request.config.parallel_config
    tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    per_rank = []
    for rank in range(tp_size * pp_size):
        r = pb.LoadModelRequest()
        r.CopyFrom(request)
        r.tensor_parallel_rank, r.pipeline_parallel_rank = rank % tp_size, rank // tp_size
        r.distributed_init_method = init_method
        r.data_parallel_rank = data_parallel_rank
        per_rank.append(r)
    return per_rank


def output_rank(tp_size: int, pp_size: int) -> int:
    """The rank that samples, and answers for every step: TP rank 0 of the last stage."""
    return (pp_size - 1) * tp_size


def fullest_rank_capacity(capacities: list[pb.KVCapacity]) -> pb.KVCapacity:
    """Stages hold different numbers of layers: the cache gets what fits on the fullest rank."""
    return min(capacities, key=lambda c: c.num_blocks)
