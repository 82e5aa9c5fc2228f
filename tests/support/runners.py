"""Model runners built straight from a model directory, for tests that drive one without a worker."""

from __future__ import annotations

from typing import Any

from services.common.config import VllmConfig
from services.worker.model_runner import ModelRunner


def runner_for(model_dir: str, device: str | None = None, **engine_args: Any) -> ModelRunner:
    """A ModelRunner on `model_dir`, its VllmConfig made from vLLM's engine arguments (dtype, seed,
    max_num_seqs, max_model_len, attention_backend, ...), as `LLM(model_dir, **engine_args)` makes it."""
    return ModelRunner(VllmConfig.from_engine_args(model=model_dir, **engine_args), device=device)
