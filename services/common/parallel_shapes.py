"""Whether a model's shapes split over a tensor-parallel size: the one rule, which the worker
applies to the config it loads and `myvllm serve` / `myvllm deploy` apply to the model's
config.json before they start (or write) any process, so that a topology the model cannot take
is refused at once, naming the numbers, instead of as crash-looping ranks."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any


def check_tensor_parallel_shapes(config: Any, size: int, expert_parallel: bool = False) -> None:
    """Refuse (ValueError naming the numbers) a TP size the model's shapes do not split evenly.
    `config`: anything with the HF config's attribute names (an absent one is not checked);
    `expert_parallel`: the MoE experts are split across ranks whole (their columns then do not
    split)."""
    if size <= 1:
        return
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads and heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide num_attention_heads={heads}")
    if kv_heads and kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size={size} and num_key_value_heads={kv_heads}: one must divide "
                         "the other (KV heads are split across ranks, or replicated when there are fewer)")
    intermediate = getattr(config, "intermediate_size", None)
    if intermediate and intermediate % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide intermediate_size={intermediate}")
    expert_width = getattr(config, "moe_intermediate_size", None)  # each routed expert's columns split too
    if expert_width and expert_width % size and not expert_parallel:
        raise ValueError(f"tensor_parallel_size={size} does not divide moe_intermediate_size={expert_width}")
    shared_width = getattr(config, "shared_expert_intermediate_size", None)  # split like a dense MLP
    if shared_width and shared_width % size and not expert_parallel:
        raise ValueError(f"tensor_parallel_size={size} does not divide shared_expert_intermediate_size={shared_width}")


def read_model_shapes(model_dir: str) -> SimpleNamespace | None:
    """The shape fields of `model_dir`'s config.json (a multimodal config's text model's), or None
    when there is none to read (the worker checks the config it loads in any case)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    if "num_attention_heads" not in config and isinstance(text, dict):
        config = text
    return SimpleNamespace(**{k: v for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool)})
