"""The shared-memory KV segment format: what a producer writes, a consumer reads back only if
every check passes (layout, block hashes, size, CRC-32; a regular file, not a link or a FIFO)."""

from __future__ import annotations

import os

import pytest
import torch

from services.worker.kv_segment import KVLayout, SegmentError, read_segment, segment_path, write_segment

LAYOUT = KVLayout(model_id="abc", dtype=torch.bfloat16, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)
HASHES = [bytes([i]) * 32 for i in range(5)]
HANDLE = "mvkv-" + "0f" * 16


def layers(n: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, n, 4, 2, 8, generator=g).to(torch.bfloat16) for _ in range(LAYOUT.num_layers)]


@pytest.fixture()
def segment(tmp_path) -> tuple[str, list[torch.Tensor]]:
    path = segment_path(str(tmp_path), HANDLE)
    data = layers()
    write_segment(path, LAYOUT, data, HASHES)
    return path, data


def test_round_trip_of_a_block_range(segment) -> None:
    path, data = segment
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    got = read_segment(path, LAYOUT, 1, HASHES[1:4], max_blocks=8)
    assert len(got) == 3
    for a, b in zip(got, data, strict=True):
        assert torch.equal(a, b[:, 1:4])


@pytest.mark.parametrize("change, message", [
    ({"dtype": torch.float16}, "dtype"),
    ({"model_id": "other"}, "model"),
    ({"num_layers": 2}, "num_layers"),
    ({"block_size": 8}, "block_size"),
    ({"num_kv_heads": 1}, "num_kv_heads"),
])
def test_another_layout_is_refused(segment, change, message) -> None:
    other = KVLayout(**{**LAYOUT.__dict__, **change})
    with pytest.raises(SegmentError, match=message):
        read_segment(segment[0], other, 0, HASHES[:2], max_blocks=8)


def test_hashes_ranges_and_sizes_are_checked(segment) -> None:
    path, _ = segment
    with pytest.raises(SegmentError, match="hash differs"):
        read_segment(path, LAYOUT, 0, [HASHES[1]], max_blocks=8)
    with pytest.raises(SegmentError, match="asked of a segment of 5"):
        read_segment(path, LAYOUT, 4, HASHES[4:] + HASHES[:1], max_blocks=8)
    with pytest.raises(SegmentError, match="more than a segment of 1 blocks"):
        read_segment(path, LAYOUT, 0, HASHES[:1], max_blocks=1)


@pytest.mark.parametrize("damage, message", [
    (lambda p: open(p, "r+b").write(b"NOTMAGIC"), "bad magic"),
    (lambda p: os.truncate(p, os.path.getsize(p) - 1), "payload is"),
    (lambda p: open(p, "ab").write(b"x"), "payload is"),
    (lambda p: os.truncate(p, 20), "header length"),
])
def test_a_damaged_segment_is_refused(segment, damage, message) -> None:
    damage(segment[0])
    with pytest.raises(SegmentError, match=message):
        read_segment(segment[0], LAYOUT, 0, HASHES[:1], max_blocks=8)


def test_a_flipped_payload_byte_fails_the_crc(segment) -> None:
    path, _ = segment
    with open(path, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        b = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(SegmentError, match="CRC-32"):
        read_segment(path, LAYOUT, 0, HASHES[:1], max_blocks=8)


def test_links_fifos_and_missing_files_are_refused_without_blocking(tmp_path, segment) -> None:
    link = segment_path(str(tmp_path), "mvkv-" + "1" * 32)
    os.symlink(segment[0], link)
    with pytest.raises(SegmentError, match="cannot open"):
        read_segment(link, LAYOUT, 0, HASHES[:1], max_blocks=8)
    fifo = segment_path(str(tmp_path), "mvkv-" + "2" * 32)
    os.mkfifo(fifo)
    with pytest.raises(SegmentError, match="not a regular file"):
        read_segment(fifo, LAYOUT, 0, HASHES[:1], max_blocks=8)
    with pytest.raises(SegmentError, match="cannot open"):
        read_segment(segment_path(str(tmp_path), "mvkv-" + "3" * 32), LAYOUT, 0, HASHES[:1], max_blocks=8)


def test_handles_never_leave_the_directory(tmp_path) -> None:
    for bad in ("../x", "mvkv-../../etc/passwd", "mvkv-" + "g" * 32, "", "mvkv-" + "0" * 31):
        with pytest.raises(SegmentError, match="not a transfer handle"):
            segment_path(str(tmp_path), bad)


def test_write_is_atomic_and_refuses_a_wrong_payload(tmp_path) -> None:
    path = segment_path(str(tmp_path), HANDLE)
    with pytest.raises(ValueError, match="do not hold"):
        write_segment(path, LAYOUT, layers(4), HASHES)
    assert os.listdir(tmp_path) == []
