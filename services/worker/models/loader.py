"""Load an HF model directory (config.json + safetensors, single file or sharded index)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig

from services.common.config import resolve_dtype_name
from services.common.parallel_shapes import check_tensor_parallel_shapes
from services.worker.models import MODEL_REGISTRY, MODEL_TYPE_TO_ARCH
from services.worker.parallel import get_ep, get_tp

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """A torch dtype for `dtype`; "auto" picks by `device` (bf16 on CPUs with bf16 instructions,
    see services.common.config.resolve_dtype_name)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    device_type = torch.device(device).type
    cuda_bf16 = device_type == "cuda" and torch.cuda.is_bf16_supported()
    dtype = resolve_dtype_name(dtype, device_type, cuda_bf16=cuda_bf16)
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose from float32, bfloat16, float16")
    return DTYPES[dtype]


def _safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def iterate_weights(model_dir: str, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    files = _safetensors_files(model_dir)
    for path in tqdm(files, desc="Loading safetensors shards", disable=not progress or len(files) < 2):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, progress: bool = True):
    """Build the architecture named in config.json and fill it from the checkpoint."""
    config = AutoConfig.from_pretrained(model_dir)
    archs = getattr(config, "architectures", None) or [MODEL_TYPE_TO_ARCH.get(config.model_type, config.model_type)]
    arch = archs[0]
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {sorted(MODEL_REGISTRY)}")
    # this rank builds and loads only its shard
    check_tensor_parallel_shapes(config, get_tp().size, expert_parallel=get_ep().size > 1)
    with torch.device("meta"):
        model = MODEL_REGISTRY[arch](config)
    model = model.to_empty(device=device)
    model.load_weights(iterate_weights(model_dir, progress))
    model = model.to(dtype=dtype).eval()
    model.rotary_emb.reset_tables(device)  # meta buffers → real fp32 tables
    return model, config
