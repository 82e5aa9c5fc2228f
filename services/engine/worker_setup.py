"""Setting up an engine's workers, written once for the scheduler's gRPC ranks and the offline
`LLM`'s local ones: LoadModel carrying the whole configuration to every rank, the answer's echo
checked against what was sent, then the KV cache sized (the fullest rank decides, or
num_gpu_blocks_override) and allocated."""

from __future__ import annotations

from typing import Protocol

from services.common.config import WORKER_OWNED_PARTS, VllmConfig, config_mismatch_message, config_mismatches
from services.common.proto import myvllm_pb2 as pb


class WorkerSetup(Protocol):
    """The set-up calls of proto `Worker`, on every rank of the engine."""

    async def load_model(self, request: pb.LoadModelRequest) -> pb.ModelInfo: ...

    async def get_kv_capacity(self, request: pb.KVCapacityRequest) -> pb.KVCapacity: ...

    async def init_kv_cache(self, request: pb.InitKVCacheRequest) -> None: ...


async def set_up_workers(workers: WorkerSetup, config: VllmConfig,
                         worker_owns_model: bool = False) -> tuple[pb.ModelInfo, int]:
    """Load the model on every rank and allocate its KV cache: (the model info, the number of
    KV blocks). `worker_owns_model`: a scheduler's separate workers load their own model (their
    flags); the config then takes its model part from their answer.
    Raises ValueError: a configuration mismatch (naming the fields), or a KV budget too small."""
    sent = config.to_proto(with_model_config=not worker_owns_model)
    info = await workers.load_model(pb.LoadModelRequest(config=sent))
    parts = [f.name for f in pb.VllmConfig.DESCRIPTOR.fields
             if not (worker_owns_model and f.name in WORKER_OWNED_PARTS)]  # every part that was sent
    # The worker refuses a disagreement itself (naming the field); this catches one that did not.
    mismatches = config_mismatches(sent, info.config, parts)
    if mismatches:
        raise ValueError(config_mismatch_message(mismatches, "the scheduler's", "the worker's"))
    if worker_owns_model:
        config.adopt_model_config(info.config.model_config)
    cache = config.cache_config
    capacity = await workers.get_kv_capacity(pb.KVCapacityRequest(
        block_size=cache.block_size, kv_cache_memory_bytes=cache.kv_cache_memory_bytes or 0))
    num_blocks = choose_num_blocks(config, capacity, info.max_model_len)
    await workers.init_kv_cache(pb.InitKVCacheRequest(num_blocks=num_blocks, block_size=cache.block_size))
    return info, num_blocks


def choose_num_blocks(config: VllmConfig, capacity: pb.KVCapacity, max_model_len: int) -> int:
    """Blocks in the pool (the null block included): the override, else what fits the budget."""
    cache = config.cache_config
    if cache.num_gpu_blocks_override:
        return int(cache.num_gpu_blocks_override)
    needed = -(-max_model_len // cache.block_size) + 1
    if capacity.num_blocks < needed:
        raise ValueError(
            f"KV cache budget holds {capacity.num_blocks} blocks of {cache.block_size} tokens; one request of "
            f"max_model_len={max_model_len} needs {needed}. Raise kv_cache_memory_bytes or lower max_model_len.")
    return int(capacity.num_blocks)
