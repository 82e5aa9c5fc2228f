"""The decode bandwidth floor: bytes of weights per token (a GGUF at its quantized sizes, a
checkpoint at the run's dtype, a tied embedding counted once as the LM head), the floor and
efficiency arithmetic, and the read-bandwidth probe."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import save_file

from services.common.bandwidth_floor import (
    WeightFloor,
    gguf_weight_bytes,
    last_level_cache_bytes,
    read_bandwidth_bytes_s,
    safetensors_weight_bytes,
    streaming_buffer_bytes,
    weight_bytes_per_token,
)


def test_floor_and_efficiency_arithmetic() -> None:
    floor = WeightFloor(weight_bytes=100_000_000, bandwidth_bytes_s=50e9)
    assert floor.floor_s == pytest.approx(2e-3)
    assert floor.efficiency(4e-3) == pytest.approx(0.5)
    text = floor.describe(4e-3)
    assert "100.0 MB" in text and "floor 2.00 ms/token" in text and "efficiency (floor / ITL) 0.50" in text
    assert "efficiency" not in floor.describe()


def _write_gguf(path: Path, tied: bool) -> dict[str, int]:
    """A GGUF with a Q4_1 embedding, a Q8_0 matrix, an F32 norm (and a Q4_0 head unless tied);
    returns each tensor's stored bytes."""
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": (GGMLQuantizationType.Q4_1, (64, 32)),
               "blk.0.ffn_up.weight": (GGMLQuantizationType.Q8_0, (48, 64)),
               "blk.0.attn_norm.weight": (GGMLQuantizationType.F32, (64,))}
    if not tied:
        tensors["output.weight"] = (GGMLQuantizationType.Q4_0, (64, 32))
    writer = GGUFWriter(str(path), "llama")
    sizes = {}
    for name, (qtype, shape) in tensors.items():
        values = rng.standard_normal(shape).astype(np.float32)
        data = values if qtype == GGMLQuantizationType.F32 else quantize(values, qtype)
        writer.add_tensor(name, data, raw_dtype=None if qtype == GGMLQuantizationType.F32 else qtype)
        sizes[name] = data.nbytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sizes


def test_gguf_bytes_are_the_stored_sizes_with_a_tied_embedding_once(tmp_path: Path) -> None:
    tied = _write_gguf(tmp_path / "tied.gguf", tied=True)
    assert gguf_weight_bytes(str(tmp_path / "tied.gguf")) == sum(tied.values())
    untied = _write_gguf(tmp_path / "untied.gguf", tied=False)
    # The embedding is read one row per token; the separate head is read whole.
    expected = sum(untied.values()) - untied["token_embd.weight"]
    assert weight_bytes_per_token(str(tmp_path / "untied.gguf"), 4) == expected
    assert untied["blk.0.ffn_up.weight"] == 48 * 64 // 32 * 34  # Q8_0: 34 bytes per 32 weights


def test_checkpoint_bytes_at_the_run_dtype(tmp_path: Path) -> None:
    weights = {"model.embed_tokens.weight": torch.zeros(100, 8),
               "model.layers.0.mlp.up_proj.weight": torch.zeros(16, 8), "model.norm.weight": torch.zeros(8)}
    save_file(weights, str(tmp_path / "model.safetensors"))
    assert safetensors_weight_bytes(str(tmp_path), 4) == (800 + 128 + 8) * 4  # tied: the embedding is the head
    assert weight_bytes_per_token(str(tmp_path), 2) == (800 + 128 + 8) * 2
    save_file({"lm_head.weight": torch.zeros(100, 8)}, str(tmp_path / "model-2.safetensors"))
    assert safetensors_weight_bytes(str(tmp_path), 2) == (128 + 8 + 800) * 2  # the head, not the embedding
    with pytest.raises(FileNotFoundError):
        safetensors_weight_bytes(str(tmp_path / "none"), 4)


def test_read_bandwidth_is_measured_and_restores_the_thread_count() -> None:
    before = torch.get_num_threads()
    bandwidth = read_bandwidth_bytes_s(1, buffer_bytes=64 << 20, repeats=2)
    assert 1e8 < bandwidth < 1e13
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError):
        read_bandwidth_bytes_s(0)


def _cache(root: Path, index: int, level: int, kind: str, size: str) -> None:
    d = root / f"index{index}"
    d.mkdir()
    (d / "level").write_text(f"{level}\n")
    (d / "type").write_text(f"{kind}\n")
    (d / "size").write_text(f"{size}\n")


def test_last_level_cache_from_sysfs(tmp_path: Path) -> None:
    _cache(tmp_path, 0, 1, "Data", "48K")
    _cache(tmp_path, 1, 1, "Instruction", "64K")
    _cache(tmp_path, 2, 2, "Unified", "2048K")
    assert last_level_cache_bytes(tmp_path) == 2048 << 10
    _cache(tmp_path, 3, 3, "Unified", "491520K")
    assert last_level_cache_bytes(tmp_path) == 491520 << 10
    assert last_level_cache_bytes(tmp_path / "missing") == 0


def test_streaming_buffer_is_four_caches_at_least_a_gib() -> None:
    assert streaming_buffer_bytes(0) == 1 << 30
    assert streaming_buffer_bytes(32 << 20) == 1 << 30
    assert streaming_buffer_bytes(480 << 20) == 2 << 30  # 4 x 480 MiB, rounded up to whole GiB
    assert streaming_buffer_bytes(1 << 30) == 4 << 30
