"""One KV transfer segment: a producer's saved prompt blocks, as a file in shared memory
(SharedMemoryConnector) or bytes a producer's worker serves (GrpcConnector).

Layout: MAGIC (8 bytes) | header length (uint32, little-endian) | JSON header | zero padding to a
64-byte boundary | payload. The header says what the payload is (model, dtype, layout, block
count, each block's chained hash, the payload's size and CRC-32); the payload is, layer by layer,
that layer's [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim] slice of the cache.

A segment file is written under a temporary name (its writer's pid after `.tmp-`) and renamed into
place, so a reader never sees half of one; its header names the writer's pid too, so that a worker
starting on the directory can remove what dead writers left (`sweep_stale`). Everything read back is
checked against the reader's own layout and the hashes it expects before a byte reaches its KV
cache (the segment comes from another process: a trust boundary); a file is read only if this
user owns it (another user's file could be anyone's KV).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import struct
import zlib
from dataclasses import dataclass

import torch

from services.common.kv_transfer_params import HANDLE_RE, HASH_BYTES

MAGIC = b"MVKVSEG1"
VERSION = 1
MAX_HEADER_BYTES = 16 << 20  # hashes of ~200k blocks; a larger header is refused, not parsed
_ALIGN = 64
# A header is its fixed fields and one hex hash (and its JSON punctuation) per block.
_HEADER_FIXED_BYTES = 4096
_HEADER_BYTES_PER_BLOCK = 2 * HASH_BYTES + 8
TMP_MARK = ".tmp-"
# /proc gives a process's start time to the clock tick and the boot time to the second: a process
# that started more than this after a file was last written cannot have written it (a reused pid).
_START_SLACK_S = 2.0

logger = logging.getLogger("myvllm.worker.kv_segment")


class SegmentError(ValueError):
    """A segment that is missing, malformed, or not what the reader expects."""


@dataclass(frozen=True)
class KVLayout:
    """What a segment's bytes mean; producer and consumer must have the same."""

    model_id: str
    dtype: torch.dtype
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def block_bytes_per_layer(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def header_fields(self) -> dict:
        return {"model": self.model_id, "dtype": str(self.dtype).removeprefix("torch."),
                "num_layers": self.num_layers, "block_size": self.block_size,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}


def segment_path(directory: str, handle: str) -> str:
    if not HANDLE_RE.match(handle):
        raise SegmentError(f"{handle[:80]!r} is not a transfer handle")
    return os.path.join(directory, handle)


def _payload_offset(header_len: int) -> int:
    return -(-(len(MAGIC) + 4 + header_len) // _ALIGN) * _ALIGN


def encode_segment(layout: KVLayout, layers: list[torch.Tensor], block_hashes: list[bytes]) -> list[memoryview]:
    """The segment of `layers` (each [2, n, block_size, heads, head_dim] on the CPU, of
    layout.dtype) with their blocks' hashes, as buffers to write (or send) in order."""
    n = len(block_hashes)
    payload = [t.contiguous().view(torch.uint8).numpy() for t in layers]
    size = sum(p.nbytes for p in payload)
    if len(layers) != layout.num_layers or size != n * layout.num_layers * layout.block_bytes_per_layer:
        raise ValueError(f"{len(layers)} layers of {size} bytes do not hold {n} blocks of {layout}")
    crc = 0
    for p in payload:
        crc = zlib.crc32(p, crc)
    header = json.dumps({"version": VERSION, **layout.header_fields(), "num_blocks": n,
                         "block_hashes": [h.hex() for h in block_hashes], "payload_bytes": size,
                         "payload_crc32": crc, "writer_pid": os.getpid(),
                         "writer_pidns": _pid_namespace()}).encode()
    offset = _payload_offset(len(header))
    head = MAGIC + struct.pack("<I", len(header)) + header + b"\0" * (offset - len(MAGIC) - 4 - len(header))
    return [memoryview(head)] + [memoryview(p) for p in payload]


def max_segment_bytes(layout: KVLayout, max_blocks: int) -> int:
    """The largest segment of at most `max_blocks` blocks: more is refused unread."""
    max_header = min(_HEADER_FIXED_BYTES + _HEADER_BYTES_PER_BLOCK * max_blocks, MAX_HEADER_BYTES)
    return _payload_offset(max_header) + max_blocks * layout.num_layers * layout.block_bytes_per_layer


def write_segment(path: str, layout: KVLayout, layers: list[torch.Tensor], block_hashes: list[bytes]) -> int:
    """Write the segment of `layers` to `path`; returns the bytes written. Atomic: a temporary
    file renamed into place."""
    parts = encode_segment(layout, layers, block_hashes)
    tmp = f"{path}{TMP_MARK}{os.getpid()}"
    try:
        # Owner-only (a prompt's KV is as private as its text); never an existing file or link.
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            for part in parts:
                f.write(part)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return sum(part.nbytes for part in parts)


def read_segment(path: str, layout: KVLayout, first_block: int, expected_hashes: list[bytes],
                 max_blocks: int) -> list[torch.Tensor]:
    """`decode_segment` of the file at `path` (never a link, FIFO or device; never more bytes
    than a segment of `max_blocks` blocks)."""
    limit = max_segment_bytes(layout, max_blocks)
    try:
        # Never a link, never a FIFO or device (an open or read that blocks would hang the load).
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise SegmentError(f"cannot open segment: {e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SegmentError("not a regular file")
        if st.st_uid != os.getuid():
            raise SegmentError(f"owned by uid {st.st_uid}, not this engine's user (uid {os.getuid()})")
        if st.st_size > limit:
            raise SegmentError(f"{st.st_size} bytes: more than a segment of {max_blocks} blocks can be")
        # (Read no more than that even if it grows meanwhile.)
        data = f.read(limit + 1)
    return decode_segment(data, layout, first_block, expected_hashes, max_blocks)


def decode_segment(data: bytes | bytearray, layout: KVLayout, first_block: int, expected_hashes: list[bytes],
                   max_blocks: int) -> list[torch.Tensor]:
    """Blocks first_block.. (as many as `expected_hashes`) of the segment `data`, one CPU tensor
    [2, count, block_size, heads, head_dim] per layer, after checking the header matches `layout`,
    the hashes match, and the payload is whole and intact. A segment of more than `max_blocks`
    blocks is refused. Raises SegmentError otherwise."""
    max_header = min(_HEADER_FIXED_BYTES + _HEADER_BYTES_PER_BLOCK * max_blocks, MAX_HEADER_BYTES)
    if len(data) > max_segment_bytes(layout, max_blocks):
        raise SegmentError(f"{len(data)} bytes: more than a segment of {max_blocks} blocks can be")
    if len(data) < len(MAGIC) + 4 or data[:len(MAGIC)] != MAGIC:
        raise SegmentError("not a KV segment (bad magic)")
    (header_len,) = struct.unpack_from("<I", data, len(MAGIC))
    if header_len > max_header or len(MAGIC) + 4 + header_len > len(data):
        raise SegmentError(f"header length {header_len} does not fit the segment")
    try:
        header = json.loads(data[len(MAGIC) + 4:len(MAGIC) + 4 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SegmentError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict) or header.get("version") != VERSION:
        raise SegmentError("unknown segment version")
    for key, want in layout.header_fields().items():
        if header.get(key) != want:
            raise SegmentError(f"segment {key} {header.get(key)!r} differs from this engine's {want!r}")
    n = header.get("num_blocks")
    hashes = header.get("block_hashes")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0 or not isinstance(hashes, list) or len(hashes) != n:
        raise SegmentError("malformed block count or hashes")
    if n > max_blocks:
        raise SegmentError(f"{n} blocks: more than a segment of {max_blocks} blocks can be")
    count = len(expected_hashes)
    if first_block < 0 or count < 1 or first_block + count > n:
        raise SegmentError(f"blocks {first_block}..{first_block + count - 1} asked of a segment of {n}")
    for i, want in enumerate(expected_hashes):
        got = hashes[first_block + i]
        if not isinstance(got, str) or len(got) != 2 * HASH_BYTES or got != want.hex():
            raise SegmentError(f"block {first_block + i}: hash differs from the prompt's (another prompt's KV?)")
    per_layer = n * layout.block_bytes_per_layer
    size = layout.num_layers * per_layer
    offset = _payload_offset(header_len)
    if header.get("payload_bytes") != size or len(data) != offset + size:
        raise SegmentError(f"payload is {len(data) - offset} bytes; {size} expected")
    payload = memoryview(data)[offset:]
    if zlib.crc32(payload) != header.get("payload_crc32"):
        raise SegmentError("payload CRC-32 mismatch (corrupt segment)")
    shape = (2, n, layout.block_size, layout.num_kv_heads, layout.head_dim)
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)  # (a copy the caller owns)
    out = []
    for layer in range(layout.num_layers):
        t = flat[layer * per_layer:(layer + 1) * per_layer].view(layout.dtype).view(shape)
        out.append(t[:, first_block:first_block + count])
    return out


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _pid_namespace() -> str:
    """This process's pid namespace ("" where /proc does not say): a pid means nothing outside it."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _process_start_time(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), where /proc tells; None otherwise."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # (field 22: starttime, in ticks)
    except (OSError, IndexError, ValueError, StopIteration):
        return None


def writer_alive(pid: int, written_at: float) -> bool:
    """Whether process `pid` may still be the writer of a file last written at `written_at`: it
    exists and did not start after that (a pid reused since is another process). When unsure: yes."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists (another user's process: this user's file was not written by it, but keep it)
    started = _process_start_time(pid)
    return started is None or started <= written_at + _START_SLACK_S


def _segment_writer(fd: int) -> tuple[int, str] | None:
    """The (pid, pid namespace) a segment's header names; None when it names none or is not a segment."""
    head = os.read(fd, len(MAGIC) + 4)
    if len(head) < len(MAGIC) + 4 or head[:len(MAGIC)] != MAGIC:
        return None
    (header_len,) = struct.unpack_from("<I", head, len(MAGIC))
    if header_len > MAX_HEADER_BYTES:
        return None
    try:
        header = json.loads(os.read(fd, header_len))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    pid = header.get("writer_pid") if isinstance(header, dict) else None
    if not isinstance(pid, int) or isinstance(pid, bool):
        return None
    return pid, str(header.get("writer_pidns", ""))


def sweep_stale(directory: str) -> list[str]:
    """Remove the segments (mvkv-<hex>) and half-written files (mvkv-<hex>.tmp-<pid>) in
    `directory` that this user owns and whose writer process is gone (it crashed: nothing else
    would ever delete them, and a tmpfs holds them in memory); the names removed. A live process's
    files are never touched (other producers, other engines' runs may share the directory); nor
    are files another pid namespace wrote (their pids mean nothing here), or files not ours."""
    uid, pidns = os.getuid(), _pid_namespace()
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError as e:
        logger.warning("cannot sweep KV segment directory %s: %s", directory, e)
        return removed
    for entry in entries:
        handle, tmp, pid_text = entry.name.partition(TMP_MARK)
        if not HANDLE_RE.match(handle) or (tmp and not pid_text.isdigit()):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                continue
            if tmp:
                pid = int(pid_text)
            else:
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    writer = _segment_writer(fd)
                finally:
                    os.close(fd)
                if writer is None or writer[1] != pidns:
                    continue
                pid = writer[0]
            if writer_alive(pid, st.st_mtime):
                continue
            os.unlink(entry.path)
        except OSError:  # gone meanwhile (read, or swept by another worker), or unreadable: not ours to judge
            continue
        removed.append(entry.name)
    return removed
