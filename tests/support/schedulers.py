"""A Scheduler from the few settings a scheduler test varies (the rest: VllmConfig's defaults)."""

from __future__ import annotations

from typing import Any

from services.common.config import CacheConfig, LoRAConfig, ParallelConfig, SchedulerConfig, VllmConfig
from services.engine.scheduler import Scheduler
from services.engine.structured_output import StructuredOutputManager


def scheduler_for(num_blocks: int, block_size: int = 16, max_num_seqs: int = 256,
                   max_num_batched_tokens: int = 2048, max_model_len: int = 2048,
                   enable_prefix_caching: bool = True, policy: str = "fcfs", async_scheduling: bool = False,
                   pipeline_parallel: bool = False, structured_output: StructuredOutputManager | None = None,
                   speculative_config: Any = None, kv_transfer_config: Any = None,
                   kv_producer_address: str | None = None, lora_config: LoRAConfig | None = None,
                   kv_offloading_size: float | None = None) -> Scheduler:
    config = VllmConfig(
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                                 kv_offloading_size=kv_offloading_size),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                         scheduling_policy=policy, async_scheduling=async_scheduling),
        parallel_config=ParallelConfig(pipeline_parallel_size=2 if pipeline_parallel else 1),
        speculative_config=speculative_config, kv_transfer_config=kv_transfer_config,
        lora_config=lora_config or LoRAConfig())
    return Scheduler(config, num_blocks, max_model_len, structured_output, kv_producer_address)
