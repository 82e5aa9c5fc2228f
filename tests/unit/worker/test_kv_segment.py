"""The shared-memory KV segment format: what a producer writes, a consumer reads back only if
every check passes (layout and model identity, block hashes, size, CRC-32; a regular file this user
owns, not a link or a FIFO); what dead producers left is swept at start-up, a live one's never; a
load whose copy into the cache fails fails that request alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from services.common.kv_transfer_config import KVTransferConfig
from services.common.proto import myvllm_pb2 as pb
from services.worker import kv_segment
from services.worker.kv_connector import SharedMemoryConnector, model_id
from services.worker.kv_segment import (
    KVLayout,
    SegmentError,
    read_segment,
    segment_path,
    sweep_stale,
    write_segment,
    writer_alive,
)

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


def test_another_users_file_is_refused(segment, monkeypatch) -> None:
    path, _ = segment
    read_segment(path, LAYOUT, 0, HASHES[:1], max_blocks=8)  # ours: read
    monkeypatch.setattr(kv_segment.os, "getuid", lambda: os.stat(path).st_uid + 1)
    with pytest.raises(SegmentError, match=r"owned by uid \d+, not this engine's user"):
        read_segment(path, LAYOUT, 0, HASHES[:1], max_blocks=8)


def _checkpoint(directory, config: bytes, seed: int) -> str:
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "wb") as f:
        f.write(config)
    g = torch.Generator().manual_seed(seed)
    save_file({"embed.weight": torch.randn(64, 32, generator=g), "head.weight": torch.randn(64, 32, generator=g)},
              os.path.join(directory, "model.safetensors"))
    return str(directory)


def test_two_checkpoints_of_one_config_refuse_each_others_segments(tmp_path) -> None:
    """Two fine-tunes of one base: the same config.json and safetensors headers, other weights."""
    config = b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 32}'
    a = _checkpoint(tmp_path / "a", config, seed=1)
    b = _checkpoint(tmp_path / "b", config, seed=2)
    a_again = _checkpoint(tmp_path / "a_again", config, seed=1)
    headers = []
    for d in (a, b):
        with open(os.path.join(d, "model.safetensors"), "rb") as f:
            headers.append(f.read(int.from_bytes(f.read(8), "little")))
    assert headers[0] == headers[1]  # the same tensor names, dtypes, shapes and offsets: only the bytes differ
    assert model_id(a, torch.float32) == model_id(a_again, torch.float32)
    assert model_id(a, torch.float32) != model_id(b, torch.float32)
    assert model_id(a, torch.float32) != model_id(a, torch.bfloat16)  # the KV dtype is part of it
    layout_a = KVLayout(**{**LAYOUT.__dict__, "model_id": model_id(a, torch.bfloat16)})
    layout_b = KVLayout(**{**LAYOUT.__dict__, "model_id": model_id(b, torch.bfloat16)})
    path = segment_path(str(tmp_path), HANDLE)
    write_segment(path, layout_a, layers(), HASHES)
    with pytest.raises(SegmentError, match="segment model .* differs"):
        read_segment(path, layout_b, 0, HASHES[:1], max_blocks=8)
    assert len(read_segment(path, layout_a, 0, HASHES[:1], max_blocks=8)) == LAYOUT.num_layers


def _shm_config(role: str, directory: str) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="SharedMemoryConnector", kv_role=role,
                            kv_connector_extra_config={"shm_dir": directory})


def test_a_failed_copy_into_the_cache_fails_that_load_not_the_step(tmp_path) -> None:
    layout = KVLayout(model_id="m", dtype=torch.float32, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
    caches = [torch.randn(2, 8, 4, 2, 8) for _ in range(2)]
    producer = SharedMemoryConnector(_shm_config("kv_producer", str(tmp_path)), layout, caches)
    # The consumer's second layer cannot take the segment's blocks (index_copy_ refuses another dtype).
    broken = [torch.zeros(2, 8, 4, 2, 8), torch.zeros(2, 8, 4, 2, 8, dtype=torch.float16)]
    consumer = SharedMemoryConnector(_shm_config("kv_consumer", str(tmp_path)), layout, broken)
    try:
        assert producer._save(HANDLE, [1, 2], HASHES[:2]).ok
        meta = pb.KVConnectorMetadata(loads=[pb.KVLoad(request_id="r", handle=HANDLE, block_ids=[3, 4],
                                                       block_hashes=HASHES[:2])])
        consumer.check(meta)
        consumer.start_loads(meta)
        out = pb.ModelRunnerOutput()
        for _ in range(200):
            consumer.report(out)  # (raised the copy's error before: the whole step failed)
            if out.failed_recving or out.finished_recving:
                break
            time.sleep(0.05)
        assert list(out.failed_recving) == ["r"] and not out.finished_recving
    finally:
        producer.close()
        consumer.close()


PRODUCER = """
import os, sys, time
import torch
from services.common.kv_transfer_config import KVTransferConfig
from services.common.proto import myvllm_pb2 as pb
from services.worker.kv_connector import SharedMemoryConnector
from services.worker.kv_segment import KVLayout
directory, tag = sys.argv[1], sys.argv[2]
layout = KVLayout(model_id="m", dtype=torch.float32, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
config = KVTransferConfig(kv_connector="SharedMemoryConnector", kv_role="kv_producer",
                          kv_connector_extra_config={"shm_dir": directory})
c = SharedMemoryConnector(config, layout, [torch.randn(2, 8, 4, 2, 8) for _ in range(2)])
c.start_saves(pb.KVConnectorMetadata(saves=[
    pb.KVSave(request_id=str(i), handle="mvkv-" + tag * 15 + str(i) * 2, block_ids=[1, 2],
              block_hashes=[bytes([i]) * 32] * 2) for i in range(2)]))
out = pb.ModelRunnerOutput()
while len(out.finished_sending) < 2:
    c.report(out)
    time.sleep(0.01)
with open(os.path.join(directory, "mvkv-" + tag * 16 + ".tmp-" + str(os.getpid())), "wb") as f:
    f.write(b"a write cut short")
print("ready", flush=True)
time.sleep(600)
"""


def _producer(directory: str, tag: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER, directory, tag], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_start_up_sweeps_what_dead_producers_left_and_never_a_live_ones(tmp_path, monkeypatch) -> None:
    directory = str(tmp_path)
    dead, live = _producer(directory, "aa"), _producer(directory, "bb")
    try:
        written = sorted(os.listdir(directory))
        assert len(written) == 6  # 2 segments and a half-written file each
        dead.send_signal(signal.SIGKILL)  # nothing of its own ever deletes its files now
        dead.wait(30)
        # Another user's files are never touched, dead writer or not (as another user sees them).
        real_uid = os.getuid()
        monkeypatch.setattr(kv_segment.os, "getuid", lambda: real_uid + 1)
        assert sweep_stale(directory) == [] and sorted(os.listdir(directory)) == written
        monkeypatch.undo()
        # A worker starting on the directory (any role) sweeps: the dead producer's files go.
        SharedMemoryConnector(_shm_config("kv_consumer", directory), LAYOUT, [torch.zeros(2, 4, 4, 2, 8)]).close()
        left = sorted(os.listdir(directory))
        assert left == [n for n in written if n.startswith("mvkv-bb")] and len(left) == 3
    finally:
        live.kill()
        live.wait(30)
        if dead.poll() is None:
            dead.kill()
    assert sorted(sweep_stale(directory)) == left  # its writer gone too: now they go
    assert os.listdir(directory) == []


def test_a_reused_pid_is_not_the_writer() -> None:
    now = time.time()
    assert writer_alive(os.getpid(), now)  # this process, started before `now`
    assert not writer_alive(os.getpid(), now - 3600 * 24 * 365)  # written before this process started
    assert not writer_alive(0, now) and not writer_alive(2**22 + 1, now)  # no such process
