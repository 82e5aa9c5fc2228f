"""What a LoRA adapter directory must be before anything of it is loaded: PEFT's on-disk format
(`adapter_config.json` + `adapter_model.safetensors`), a plain LoRA of a rank the engine allows
on the linear layers the engine can adapt. The gateway checks it when an adapter is registered
(--lora-modules, the runtime load endpoint) and the worker again before it reads the tensors: the
same rules in one place, each refusal an `AdapterConfigError` naming the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The decoder's linear layers an adapter may target (HF's module names).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A config file is a few hundred bytes; a larger one is not PEFT's.
MAX_CONFIG_BYTES = 1 << 20


class AdapterConfigError(ValueError):
    """The adapter cannot be served (the message says which field or file, and why)."""


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scaling: float            # what B @ A is multiplied by: lora_alpha / r (or / sqrt(r) with rsLoRA)
    target_modules: tuple[str, ...]


def read_adapter_config(path: str | os.PathLike, max_lora_rank: int) -> AdapterConfig:
    """The adapter at `path` (a PEFT directory) as the engine will run it; refuses anything the
    engine would run differently from PEFT (DoRA, biases, per-module ranks, extra modules)."""
    root = Path(path)
    if not root.is_dir():
        raise AdapterConfigError(f"LoRA adapter path {str(path)!r} is not a directory")
    config_file, weights_file = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not config_file.is_file():
        raise AdapterConfigError(f"LoRA adapter {str(path)!r} has no {CONFIG_FILE}")
    if not weights_file.is_file():
        raise AdapterConfigError(f"LoRA adapter {str(path)!r} has no {WEIGHTS_FILE} (PEFT's safetensors format)")
    if config_file.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterConfigError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterConfigError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterConfigError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not a JSON object")
    return check_adapter_config(config, max_lora_rank, where=str(path))


def check_adapter_config(config: dict, max_lora_rank: int, where: str = "adapter") -> AdapterConfig:
    def refuse(field: str, why: str) -> AdapterConfigError:
        return AdapterConfigError(f"LoRA adapter {where!r}: {field} {why}")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse("peft_type", f"must be LORA, got {config.get('peft_type')!r}")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise refuse("r", f"must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise refuse("r", f"is {rank}, above --max-lora-rank {max_lora_rank}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise refuse("lora_alpha", f"must be a positive number, got {alpha!r}")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise refuse("target_modules", "must name the linear layers adapted (a list of module names)")
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise refuse("target_modules", f"names {unknown}: only {list(TARGET_MODULES)} can be adapted")
    if config.get("bias", "none") != "none":
        raise refuse("bias", f"must be 'none' (LoRA biases are not supported), got {config.get('bias')!r}")
    for field in ("use_dora", "fan_in_fan_out", "lora_bias", "use_qalora", "use_bdlora", "target_parameters",
                  "layer_replication", "alora_invocation_tokens", "trainable_token_indices"):
        if config.get(field):
            raise refuse(field, "is not supported (plain LoRA on the linear layers only)")
    for field in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform", "layers_pattern",
                  "exclude_modules"):
        if config.get(field):
            raise refuse(field, "is not supported (every targeted layer must share one rank and alpha)")
    scaling = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
    return AdapterConfig(rank=rank, scaling=float(scaling), target_modules=tuple(sorted(set(targets))))
