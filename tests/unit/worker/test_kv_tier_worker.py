"""The KV tier's worker side (services/worker/kv_tier.py) on small CPU caches: an evicted block's KV
is copied out before the step's forward and written to the directory (or kept in host memory); a
load puts it back bit for bit; a corrupted, foreign or vanished file is refused (never loaded),
deleted and reported gone; the capacity evicts the least recently used files; a restarted worker
adopts the files (and drops half-written ones); malformed metadata is refused before anything runs."""

from __future__ import annotations

import os
import time

import pytest
import torch

from services.common.proto import myvllm_pb2 as pb
from services.worker.kv_segment import TMP_MARK, KVLayout
from services.worker.kv_tier import FileTier, HostTier
from services.worker.step_validation import InvalidStep

LAYOUT = KVLayout(model_id="m" * 32, dtype=torch.float32, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
NUM_BLOCKS = 10


def caches(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NUM_BLOCKS, 4, 2, 8, generator=gen) for _ in range(LAYOUT.num_layers)]


def h(i: int) -> bytes:
    return bytes([i]) * 32


def settle(tier: FileTier) -> pb.ModelRunnerOutput:
    """Wait for the writer and load threads; the answer's report."""
    tier._writer.submit(lambda: None).result()
    for future in list(tier._loads.values()):
        future.result()
    out = pb.ModelRunnerOutput()
    tier.report(out)
    return out


def offer(tier: FileTier, ids: list[int], hashes: list[bytes]) -> None:
    meta = pb.KVConnectorMetadata(offload_block_ids=ids, offload_block_hashes=hashes)
    tier.check(meta)
    tier.start_loads(meta)


def load(tier: FileTier, rid: str, ids: list[int], hashes: list[bytes]) -> pb.ModelRunnerOutput:
    meta = pb.KVConnectorMetadata(loads=[pb.KVLoad(request_id=rid, block_ids=ids, block_hashes=hashes)])
    tier.check(meta)
    tier.start_loads(meta)
    return settle(tier)


def test_an_offered_block_is_kept_and_loaded_back_exactly(tmp_path) -> None:
    kv = caches()
    tier = FileTier(str(tmp_path), 1 << 30, LAYOUT, kv)
    before = [t[:, [2, 3]].clone() for t in kv]
    offer(tier, [2, 3], [h(2), h(3)])
    for t in kv:  # the step's forward writes new KV into the evicted blocks right after
        t[:, [2, 3]] = 0
    out = settle(tier)
    assert list(out.kv_tier_stored) == [h(2), h(3)]
    assert sorted(os.listdir(tmp_path)) == sorted(x.hex() + ".kvb" for x in (h(2), h(3)))
    assert all(os.stat(tmp_path / name).st_mode & 0o777 == 0o600 for name in os.listdir(tmp_path))
    out = load(tier, "r", [7, 5], [h(2), h(3)])
    assert list(out.finished_recving) == ["r"] and out.kv_loaded_bytes > 0
    for t, b in zip(kv, before, strict=True):
        assert torch.equal(t[:, [7, 5]], b)
    tier.close()


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "foreign_model", "missing"])
def test_a_bad_file_is_refused_deleted_and_reported(tmp_path, damage: str) -> None:
    kv = caches()
    tier = FileTier(str(tmp_path), 1 << 30, LAYOUT, kv)
    offer(tier, [1, 2], [h(1), h(2)])
    settle(tier)
    path = tier.path(h(2))
    data = bytearray(open(path, "rb").read())
    if damage == "flip_payload":
        data[-5] ^= 0xFF
    elif damage == "truncate":
        data = data[:-64]
    elif damage == "foreign_model":  # another model's KV under the same hash: the header says so
        other = FileTier(str(tmp_path / "other"), 1 << 30, KVLayout(**{**LAYOUT.__dict__, "model_id": "x" * 32}),
                         caches(1))
        offer(other, [2], [h(2)])
        settle(other)
        data = bytearray(open(other.path(h(2)), "rb").read())
    if damage == "missing":
        os.unlink(path)
    else:
        with open(path, "wb") as f:
            f.write(data)
    target = [t[:, 6].clone() for t in kv]
    out = load(tier, "r", [6, 6 + 1], [h(1), h(2)])
    assert list(out.failed_recving) == ["r"] and h(2) in out.kv_tier_removed
    assert not os.path.exists(path)
    # Nothing of it reached the cache (the good first block is not copied either: all or nothing).
    assert all(torch.equal(t[:, 6], b) for t, b in zip(kv, target, strict=True))
    tier.close()


def test_the_capacity_drops_the_least_recently_used_files(tmp_path) -> None:
    kv = caches()
    one = FileTier(str(tmp_path / "probe"), 1 << 30, LAYOUT, kv)
    offer(one, [1], [h(1)])
    settle(one)
    size = os.path.getsize(one.path(h(1)))
    tier = FileTier(str(tmp_path / "t"), 3 * size, LAYOUT, kv)
    offer(tier, [1, 2, 3], [h(1), h(2), h(3)])
    settle(tier)
    load(tier, "r", [8], [h(1)])  # h(1) is now the most recent
    offer(tier, [4], [h(4)])
    out = settle(tier)
    assert list(out.kv_tier_removed) == [h(2)] and list(out.kv_tier_stored) == [h(4)]
    assert sorted(os.listdir(tmp_path / "t")) == sorted(x.hex() + ".kvb" for x in (h(1), h(3), h(4)))


def test_a_restarted_worker_adopts_the_files_and_drops_half_written_ones(tmp_path) -> None:
    kv = caches()
    tier = FileTier(str(tmp_path), 1 << 30, LAYOUT, kv)
    offer(tier, [1, 2], [h(1), h(2)])
    settle(tier)
    tier.close()
    (tmp_path / f"{h(9).hex()}.kvb{TMP_MARK}12345").write_bytes(b"half")
    (tmp_path / "unrelated.txt").write_text("kept")
    os.utime(tier.path(h(2)), (time.time() - 100, time.time() - 100))  # h(2): the older
    fresh = caches(3)
    again = FileTier(str(tmp_path), 1 << 30, LAYOUT, fresh)
    out = pb.ModelRunnerOutput()
    again.report(out)
    assert list(out.kv_tier_stored) == [h(2), h(1)]  # oldest first
    assert sorted(os.listdir(tmp_path)) == sorted([h(1).hex() + ".kvb", h(2).hex() + ".kvb", "unrelated.txt"])
    out = load(again, "r", [4, 5], [h(1), h(2)])
    assert list(out.finished_recving) == ["r"]
    assert all(torch.equal(f[:, [4, 5]], k[:, [1, 2]]) for f, k in zip(fresh, kv, strict=True))


def test_malformed_metadata_is_refused_before_anything_runs(tmp_path) -> None:
    tier = FileTier(str(tmp_path), 1 << 30, LAYOUT, caches())
    bad = [
        pb.KVConnectorMetadata(offload_block_ids=[1], offload_block_hashes=[]),
        pb.KVConnectorMetadata(offload_block_ids=[NUM_BLOCKS], offload_block_hashes=[h(1)]),
        pb.KVConnectorMetadata(offload_block_ids=[0], offload_block_hashes=[h(1)]),
        pb.KVConnectorMetadata(offload_block_ids=[1], offload_block_hashes=[b"short"]),
        pb.KVConnectorMetadata(loads=[pb.KVLoad(request_id="r", block_ids=[1, 2], block_hashes=[h(1)])]),
        pb.KVConnectorMetadata(loads=[pb.KVLoad(request_id="r", handle="mvkv-x", block_ids=[1], block_hashes=[h(1)])]),
        pb.KVConnectorMetadata(saves=[pb.KVSave(request_id="r", handle="mvkv-x", block_ids=[1], block_hashes=[h(1)])]),
    ]
    for meta in bad:
        with pytest.raises(InvalidStep, match="kv_connector_metadata"):
            tier.check(meta)
    assert os.listdir(tmp_path) == []


def test_blocks_a_step_filled_are_stored_after_its_forward_but_not_a_left_out_requests(tmp_path) -> None:
    kv = caches()
    tier = FileTier(str(tmp_path), 1 << 30, LAYOUT, kv)
    meta = pb.KVConnectorMetadata(store_block_ids=[1, 2, 3], store_block_hashes=[h(1), h(2), h(3)])
    tier.check(meta)
    tier.start_loads(meta)  # (before the forward: nothing of them is copied yet)
    for t in kv:
        t[:, 1:4] += 1  # the forward writes their KV
    after = [t[:, [1, 2]].clone() for t in kv]
    tier.start_saves(meta, left_out=frozenset({3}))
    out = settle(tier)
    assert list(out.kv_tier_stored) == [h(1), h(2)]
    load(tier, "r", [8, 9], [h(1), h(2)])
    assert all(torch.equal(t[:, [8, 9]], a) for t, a in zip(kv, after, strict=True))


def test_the_host_memory_tier_keeps_blocks_within_its_capacity() -> None:
    kv = caches()
    per_block = LAYOUT.num_layers * LAYOUT.block_bytes_per_layer
    tier = HostTier(2 * per_block, LAYOUT, kv)
    before = [t[:, [1, 2, 3]].clone() for t in kv]
    offer(tier, [1, 2], [h(1), h(2)])
    for t in kv:
        t[:, 1:4] = 0
    assert list(settle(tier).kv_tier_stored) == [h(1), h(2)]
    tier.start_saves(pb.KVConnectorMetadata(store_block_ids=[3], store_block_hashes=[h(3)]))
    out = settle(tier)  # a third block: the least recent goes
    assert list(out.kv_tier_stored) == [h(3)] and list(out.kv_tier_removed) == [h(1)]
    assert list(load(tier, "r", [7], [h(2)]).finished_recving) == ["r"]
    assert all(torch.equal(t[:, 7], b[:, 1]) for t, b in zip(kv, before, strict=True))
    assert list(load(tier, "s", [8], [h(1)]).failed_recving) == ["s"]  # dropped: refused, never half-loaded
