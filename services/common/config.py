"""Engine configuration, with vLLM's argument names, and where the default model lives."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"
# How long a scheduler waits for its worker's answer to one step before it declares the
# worker dead (`--engine-timeout`): far above any step's compute time, far below "forever".
DEFAULT_ENGINE_TIMEOUT_S = 30.0


def default_model_path() -> str:
    """The default model: $MYVLLM_MODEL, else the HF directory `make setup` converts."""
    return os.environ.get("MYVLLM_MODEL", str(DEFAULT_MODEL_DIR))


def check_model_dir(model: str) -> str:
    """Fail with one clear line when the model directory is missing."""
    if not os.path.isdir(model):
        hint = " (run `make setup` to convert the default model)" if model == str(DEFAULT_MODEL_DIR) else ""
        raise FileNotFoundError(f"model directory not found: {model}{hint}")
    return model


@dataclass
class EngineConfig:
    """Everything one engine replica (scheduler + its worker) is built from."""

    model: str | None = None
    dtype: str = "float32"
    seed: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    scheduling_policy: str = "fcfs"
    attention_backend: str | None = None
    # None: on where the worker runs on CUDA, off on CPU (see resolve_async_scheduling).
    async_scheduling: bool | None = None
    # Worker ranks per engine, each holding 1/T of the heads and MLP columns.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = default_model_path()
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}")

    def resolve_async_scheduling(self, device: str) -> bool:
        """Fix the automatic choice once the worker's device is known."""
        if self.async_scheduling is None:
            self.async_scheduling = device == "cuda"
        return self.async_scheduling
