"""Engine flags, with vLLM's names, grouped by the service that reads them.

Each flag is declared once, on its field of VllmConfig's parts (services/common/config.py);
these functions group the parts by the service that reads them. The worker reads the model
flags (what weights, in what dtype, with which attention backend); the scheduler reads the
scheduling flags (batch bounds, KV block accounting); both read the parallel, speculative and
KV transfer flags, which must agree (LoadModel checks). `myvllm worker` and `myvllm scheduler`
list only their own group; `serve`, `generate` and `bench` (one process, or all three
services) take both.
"""

from __future__ import annotations

import argparse

from services.common.config import (
    DEFAULT_ENGINE_TIMEOUT_S,
    DEFAULT_MAX_WAITING_REQUESTS,
    PARTS,
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    VllmConfig,
)
from services.common.config_fields import add_flags, flag_dests

# Every engine argument (a flag's dest), as VllmConfig.from_engine_args takes them.
ENGINE_ARG_NAMES = tuple(name for part in (*PARTS.values(), VllmConfig) for name in flag_dests(part))


def add_model_args(p: argparse.ArgumentParser) -> None:
    """What the worker loads and how it computes."""
    add_flags(p, ModelConfig)
    add_parallel_args(p)


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Read by the worker (a rank loads its shard once its scheduler assigns its rank) and by the
    scheduler (its --workers are T ranks per stage, stage-major; it keeps P steps in flight); so
    are the LoRA slots (the scheduler assigns them, the worker holds the adapters in them)."""
    add_flags(p, ParallelConfig)
    add_flags(p, LoRAConfig)


def add_scheduling_args(p: argparse.ArgumentParser) -> None:
    """How the scheduler batches requests and accounts KV blocks."""
    add_flags(p, SchedulerConfig)
    add_flags(p, CacheConfig)
    add_flags(p, StructuredOutputsConfig)
    add_speculative_arg(p)
    add_kv_transfer_arg(p)


def add_kv_transfer_arg(p: argparse.ArgumentParser) -> None:
    """Read by the scheduler (requests that wait for remote KV, blocks kept until saved) and by the
    worker (the transport)."""
    add_flags(p, VllmConfig, only=("kv_transfer_config",))


def add_speculative_arg(p: argparse.ArgumentParser) -> None:
    """Read by the scheduler (it schedules the drafts and sends the setting to its worker with
    LoadModel) and by the worker (the draft model it may load)."""
    add_flags(p, VllmConfig, only=("speculative_config",))


def add_scheduler_service_args(p: argparse.ArgumentParser) -> None:
    """The scheduler service's own flags (how it guards itself), not the engine's configuration."""
    p.add_argument("--engine-timeout", type=float, default=DEFAULT_ENGINE_TIMEOUT_S,
                   help="seconds the scheduler waits for the worker's answer to a step before it treats the "
                        f"worker as dead (default {DEFAULT_ENGINE_TIMEOUT_S:g})")
    p.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                   help="requests the scheduler queues waiting for a batch slot; more are refused with "
                        f"RESOURCE_EXHAUSTED, a 429 at the gateway (default {DEFAULT_MAX_WAITING_REQUESTS})")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Both groups: for commands that run a whole engine replica."""
    add_model_args(p)
    add_scheduling_args(p)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine arguments among the parsed flags (VllmConfig.from_engine_args takes them)."""
    return {k: getattr(args, k) for k in ENGINE_ARG_NAMES if hasattr(args, k)}
