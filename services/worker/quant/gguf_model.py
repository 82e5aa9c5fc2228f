"""Read a .gguf checkpoint: its config (from the metadata, as transformers maps it) and its
tensors under HF checkpoint names, block-quantized ones as raw bytes.

gguf.GGUFReader memory-maps the file: a tensor is read only when a rank takes its part of it.
llama.cpp's converter permutes llama's q/k rows (its RoPE pairs adjacent dimensions, ours and
HF's pair halves); `_unpermute_rows` undoes it by moving whole rows, which is exact on the raw
blocks too since blocks run along the input dimension.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from services.worker.quant import DENSE_TYPES, QUANT_TYPES

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
}
# Architectures whose q/k rows llama.cpp permuted.
_PERMUTED_ARCHS = ("llama", "mistral")
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class QuantTensor:
    """One tensor's raw blocks: uint8 [rows, row_bytes] of GGUF type `qtype`."""

    raw: torch.Tensor
    qtype: int
    shape: tuple[int, int]  # (out rows, in features), the dense tensor's shape


def hf_name(gguf_name: str) -> str | None:
    """The HF checkpoint name of a llama.cpp tensor (None: one we do not load, e.g. rope_freqs)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
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
        for t in self.reader.tensors:
            qtype = GGMLQuantizationType(t.tensor_type)
            if qtype not in QUANT_TYPES and qtype not in DENSE_TYPES:
                raise NotImplementedError(f"{path}: tensor {t.name} is {qtype.name}; supported block types: "
                                          f"{', '.join(sorted(q.name for q in QUANT_TYPES))}")

    def quantized_names(self) -> set[str]:
        """HF names of the tensors held in a block type."""
        return {name for t in self.reader.tensors if (name := hf_name(t.name)) is not None
                and GGMLQuantizationType(t.tensor_type) in QUANT_TYPES}

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """(HF name, dense fp32 tensor or QuantTensor) for every tensor we load."""
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is None:
                continue
            qtype = GGMLQuantizationType(t.tensor_type)
            data = self._unpermute_rows(name, np.asarray(t.data))
            if qtype in QUANT_TYPES:
                shape = (int(t.shape[1]) if len(t.shape) > 1 else 1, int(t.shape[0]))
                yield name, QuantTensor(torch.from_numpy(np.array(data, dtype=np.uint8)), int(qtype), shape)
            else:
                yield name, _dense(data, qtype)

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
