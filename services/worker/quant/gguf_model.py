"""Read a .gguf checkpoint: its config (from the metadata, as transformers maps it) and its
tensors under HF checkpoint names, block-quantized ones as raw bytes.

gguf.GGUFReader memory-maps the file: a tensor is read only when a rank takes its part of it.
A mixture-of-experts layer's 3-D expert tensors come out one expert at a time, under the
per-expert names of an HF checkpoint (gguf_moe.py names them).
llama.cpp's converter permutes llama's q/k rows (its RoPE pairs adjacent dimensions, ours and
HF's pair halves); `_unpermute_rows` undoes it by moving whole rows, which is exact on the raw
blocks too since blocks run along the input dimension.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from services.worker.quant import DENSE_TYPES, QUANT_TYPES
from services.worker.quant.gguf_moe import (
    EXPERT_KINDS,
    MOE_ARCHS,
    ROUTER_KIND,
    SHARED_EXPERT_NAMES,
    moe_config,
    moe_names,
)
from services.worker.quant.torch_dequant import dequantize

# llama.cpp tensor names → HF checkpoint names (per block: blk.N.<key>).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    **SHARED_EXPERT_NAMES,
}
# Architectures whose q/k rows llama.cpp permuted.
_PERMUTED_ARCHS = ("llama", "mistral")
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", *MOE_ARCHS)


@dataclass
class QuantTensor:
    """One tensor's raw blocks: uint8 [rows, row_bytes] of GGUF type `qtype`."""

    raw: torch.Tensor
    qtype: int
    shape: tuple[int, int]  # (out rows, in features), the dense tensor's shape


_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """The HF checkpoint name of a llama.cpp tensor (None: one we do not load, e.g. rope_freqs)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}.{match.group(3)}"


class GgufCheckpoint:
    """A .gguf file: `config` (a transformers config) and `tensors()`."""

    def __init__(self, path: str) -> None:
        from transformers import AutoConfig

        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file not found: {path}")
        self.path = path
        self.reader = GGUFReader(path)
        self.architecture = str(self.reader.fields["general.architecture"].contents())
        if self.architecture not in SUPPORTED_ARCHS:
            raise NotImplementedError(f"{path}: GGUF architecture {self.architecture!r} is not supported "
                                      f"(supported: {', '.join(SUPPORTED_ARCHS)})")
        self.config = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                 gguf_file=os.path.basename(path))
        # transformers takes head_dim from rope.dimension_count for llama only (Qwen3's default
        # is 128 whatever the file says); llama.cpp writes the true one as attention.key_length.
        key_length = self.reader.fields.get(f"{self.architecture}.attention.key_length")
        if key_length is not None:
            self.config.head_dim = int(key_length.contents())
        self.moe_names = moe_names(self.architecture, self.reader)
        self.config = moe_config(self.config, self.architecture, self.reader)
        for t in self.reader.tensors:
            qtype = GGMLQuantizationType(t.tensor_type)
            if qtype not in QUANT_TYPES and qtype not in DENSE_TYPES:
                raise NotImplementedError(f"{path}: tensor {t.name} is {qtype.name}; supported block types: "
                                          f"{', '.join(sorted(q.name for q in QUANT_TYPES))}")

    def quantized_names(self) -> set[str]:
        """HF names of the tensors held in a block type (a router is always dense: it is read
        whole for every token and sets the routing)."""
        return {name for t in self.reader.tensors if GGMLQuantizationType(t.tensor_type) in QUANT_TYPES
                for name, _ in self._hf_names(t.name, t.shape) if not self._is_router(t.name)}

    def tensors(self, wanted: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """(HF name, dense fp32 tensor or QuantTensor) for every tensor we load, or only those
        `wanted(name)` keeps (the others are never read from the file); an experts tensor as one
        per expert."""
        for t in self.reader.tensors:
            qtype = GGMLQuantizationType(t.tensor_type)
            shape = (int(t.shape[1]) if len(t.shape) > 1 else 1, int(t.shape[0]))
            for name, expert in self._hf_names(t.name, t.shape):
                if wanted is not None and not wanted(name):
                    continue
                data = np.asarray(t.data) if expert is None else np.asarray(t.data)[expert]
                data = self._unpermute_rows(name, data)
                if qtype not in QUANT_TYPES:
                    dense = _dense(data, qtype)
                    # HF holds a shared expert's gate as a [1, hidden] linear weight, llama.cpp as a vector.
                    yield name, dense.reshape(shape) if name.endswith("shared_expert_gate.weight") else dense
                    continue
                raw = torch.from_numpy(np.array(data, dtype=np.uint8))
                if self._is_router(t.name):
                    yield name, dequantize(raw, int(qtype))
                else:
                    yield name, QuantTensor(raw, int(qtype), shape)

    def _hf_names(self, gguf_name: str, shape: np.ndarray) -> list[tuple[str, int | None]]:
        """(HF name, expert index into the tensor's first dimension or None) of each tensor a
        llama.cpp tensor holds: none for one we do not load, one per expert for an experts tensor."""
        match = _BLOCK_TENSOR.fullmatch(gguf_name)
        if self.moe_names is not None and match is not None and match.group(3) == "weight":
            layer, kind = int(match.group(1)), match.group(2)
            if kind in EXPERT_KINDS:
                return [(self.moe_names.expert(layer, e, kind), e) for e in range(int(shape[2]))]
            if kind == ROUTER_KIND:
                return [(self.moe_names.router(layer), None)]
        name = hf_name(gguf_name)
        return [] if name is None else [(name, None)]

    def _is_router(self, gguf_name: str) -> bool:
        return self.moe_names is not None and gguf_name.endswith(f".{ROUTER_KIND}.weight")

    def _unpermute_rows(self, name: str, data: np.ndarray) -> np.ndarray:
        if self.architecture not in _PERMUTED_ARCHS:
            return data
        config = self.config
        if ".q_proj." in name:
            heads = config.num_attention_heads
        elif ".k_proj." in name:
            heads = config.num_key_value_heads
        else:
            return data
        rows = data.shape[0]
        # llama.cpp: rows (heads, half, 2) from HF's (heads, 2, half).
        return data.reshape(heads, rows // heads // 2, 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)


def _dense(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """A dense GGUF tensor as fp32 (BF16 arrives as raw 16-bit words)."""
    if qtype == GGMLQuantizationType.BF16:
        words = torch.from_numpy(np.array(data).view(np.int16).astype(np.int32) << 16)
        return words.view(torch.float32)
    return torch.from_numpy(np.array(data, dtype=np.float32))
