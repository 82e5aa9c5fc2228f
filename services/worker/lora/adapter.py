"""One PEFT adapter read from disk into host tensors, checked against the model it adapts."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from services.common.lora_adapter_config import WEIGHTS_FILE, AdapterConfigError, read_adapter_config

# PEFT's tensor names: base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}[.adapter].weight
_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                   r"(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class ModuleShape:
    """An adaptable linear layer of the decoder: its input and output widths."""

    in_features: int
    out_features: int


@dataclass
class LoraAdapter:
    lora_int_id: int
    rank: int
    # (layer, module) -> (A [rank, in], B [out, rank] already multiplied by the adapter's scaling)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(path: str, lora_int_id: int, max_lora_rank: int, num_layers: int,
                 shapes: dict[str, ModuleShape], dtype: torch.dtype) -> LoraAdapter:
    """The adapter at `path`, every tensor checked (names, shapes, finite values) before any is
    kept; raises AdapterConfigError naming what is wrong."""
    config = read_adapter_config(path, max_lora_rank)
    untargetable = sorted(set(config.target_modules) - set(shapes))
    if untargetable:
        raise AdapterConfigError(f"LoRA adapter {path!r}: target_modules {untargetable} are not in this model")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as f:
            for name in f.keys():
                match = _NAME.match(name)
                if match is None:
                    raise AdapterConfigError(f"LoRA adapter {path!r}: tensor {name!r} is not a LoRA weight of a "
                                             "decoder layer")
                layer, module, part = int(match[1]), match[2], match[3]
                if module not in config.target_modules or not 0 <= layer < num_layers:
                    raise AdapterConfigError(f"LoRA adapter {path!r}: tensor {name!r} is outside its target "
                                             f"modules / the model's {num_layers} layers")
                shape = shapes[module]
                expected = (config.rank, shape.in_features) if part == "A" else (shape.out_features, config.rank)
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != expected:
                    raise AdapterConfigError(f"LoRA adapter {path!r}: tensor {name!r} has shape "
                                             f"{tuple(tensor.shape)}, expected {expected}")
                if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
                    raise AdapterConfigError(f"LoRA adapter {path!r}: tensor {name!r} is not finite floats")
                pairs.setdefault((layer, module), {})[part] = tensor
    except AdapterConfigError:
        raise
    except Exception as e:  # a truncated or foreign file: safetensors' own error, as the adapter's
        raise AdapterConfigError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} cannot be read ({e})") from None
    missing = [f"layers.{layer}.{module}" for layer in range(num_layers) for module in config.target_modules
               if set(pairs.get((layer, module), {})) != {"A", "B"}]
    if missing:
        raise AdapterConfigError(f"LoRA adapter {path!r}: lora_A/lora_B missing for {missing[:4]}"
                                 f"{' ...' if len(missing) > 4 else ''}")
    weights = {key: (p["A"].to(torch.float32).to(dtype).contiguous(),
                     (p["B"].to(torch.float32) * config.scaling).to(dtype).contiguous())
               for key, p in pairs.items()}
    return LoraAdapter(lora_int_id=lora_int_id, rank=config.rank, weights=weights)
