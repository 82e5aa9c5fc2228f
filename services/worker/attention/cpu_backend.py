"""CPU attention: the torch reference for prefill chunks, a small C kernel for decodes.

Decode attention on CPU is memory bound. The torch reference first gathers every decode
request's K/V blocks into a dense copy, then reads them again in SDPA: three passes over
the cache per layer. `cpu_paged_decode.c` reads K/V in place through the block table in
one pass, on torch's own OpenMP threads. It is compiled with the system C compiler at first
use (about a second) into a cache directory, keyed by the source, the compiler and its
version, and the flags. The instruction set is a fixed x86-64 level (v3 = AVX2 + FMA where
the CPU has it), not `-march=native`: every x86 machine of that level (AVX2-only EPYC,
AVX-512 EPYC, Xeon with AMX) then runs the same machine code and gets bit-identical results,
and the kernel is memory bound, so AVX-512 would gain it little. Without a compiler this
backend is unavailable and `torch` is used.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from services.common.config import cpu_flags as read_cpu_flags
from services.worker.attention.base import AttentionMetadata
from services.worker.attention.torch_backend import TorchAttentionBackend, _TorchPlan

_SOURCE = Path(__file__).with_name("cpu_paged_decode.c")
_lib: ctypes.CDLL | None = None
# -fopenmp: the kernel's threads are OpenMP's. torch already loaded its libgomp (soname
# libgomp.so.1), so the dynamic loader binds the kernel to that same runtime and thread pool.
# (An earlier pthreads version fought torch's spinning workers and lost 20% on two cores.)
_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]

# The CPU flags each x86-64 micro-architecture level needs (as /proc/cpuinfo spells them).
_X86_64_V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_X86_64_V2 = {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}


def isa_flags(machine: str | None = None, cpu_flags: set[str] | None = None) -> list[str]:
    """The -march for this CPU: a fixed x86-64 level, so the build depends on the level alone.

    Off x86-64 (aarch64 and the like) the compiler's default target is used."""
    machine = machine or platform.machine()
    if machine not in ("x86_64", "AMD64"):
        return []
    cpu_flags = read_cpu_flags() if cpu_flags is None else cpu_flags
    if _X86_64_V3 <= cpu_flags:
        return ["-march=x86-64-v3"]
    if _X86_64_V2 <= cpu_flags:
        return ["-march=x86-64-v2"]
    return ["-march=x86-64"]


def _compiler_version(cc: str) -> str:
    """`cc --version`'s first line: a compiler upgrade must rebuild the kernel."""
    try:
        result = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout.partition("\n")[0]


def build_key(cc: str, flags: list[str]) -> str:
    """What the compiled library depends on: the source, the compiler and its version, the flags."""
    key = _SOURCE.read_bytes() + "\0".join([cc, _compiler_version(cc), *flags]).encode()
    return hashlib.sha256(key).hexdigest()[:16]


def _cache_dir() -> Path:
    root = os.environ.get("MYVLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "myvllm")
    return Path(root) / "kernels"


def load_library() -> ctypes.CDLL:
    """Compile (once per source version) and load the decode kernel."""
    global _lib
    if _lib is not None:
        return _lib
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler found for the cpu attention backend")
    flags = [*_FLAGS, *isa_flags()]
    target = _cache_dir() / f"cpu_paged_decode_{build_key(cc, flags)}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            cmd = [cc, *flags, str(_SOURCE), "-o", str(out), "-lm"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"compiling the cpu attention kernel failed: {result.stderr.strip()[-500:]}")
            os.replace(out, target)  # atomic: concurrent builders never load a half-written file
    lib = ctypes.CDLL(str(target))
    lib.paged_decode.restype = ctypes.c_int
    lib.paged_decode.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + \
        [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.exp_neg_lanes.restype = None
    lib.exp_neg_lanes.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    _lib = lib
    return lib


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        self.lib = load_library()

    def prepare(self, meta: AttentionMetadata) -> _TorchPlan:
        plan = super().prepare(meta)
        if plan.decode_rows is not None:
            plan.decode_block_table = meta.block_table.index_select(0, plan.decode_rows).contiguous()
        return plan

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _TorchPlan,
                scale: float) -> torch.Tensor:
        if k_cache.dtype not in (torch.float32, torch.bfloat16) or k_cache.device.type != "cpu":
            return super()._decode(q, k_cache, v_cache, plan, scale)
        num_reqs, num_heads, head_dim = q.shape
        q32 = q.float().contiguous()
        out = torch.empty_like(q32)
        bt, seq_lens = plan.decode_block_table, plan.decode_seq_lens
        rc = self.lib.paged_decode(
            q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(), bt.stride(0),
            seq_lens.data_ptr(), out.data_ptr(), num_reqs, num_heads, k_cache.shape[2], head_dim,
            k_cache.shape[1], scale, int(k_cache.dtype == torch.bfloat16), torch.get_num_threads())
        if rc != 0:
            raise MemoryError("cpu paged decode kernel could not allocate its scratch memory")
        return out.to(q.dtype)
