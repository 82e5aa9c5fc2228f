"""Build a C source file into a shared library at first use, cached on disk, and load it.

The CPU kernels (paged decode attention, the fused elementwise ops) are small C files compiled
with the system C compiler (about a second each) into a cache directory, keyed by the source,
the compiler and its version, and the flags. The instruction set is a fixed x86-64 level (v3 =
AVX2 + FMA where the CPU has it), not `-march=native`: every x86 machine of that level
(AVX2-only EPYC, AVX-512 EPYC, Xeon with AMX) then runs the same machine code and gets
bit-identical results. Without a compiler the caller falls back to torch.
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

from services.common.config import cpu_flags as read_cpu_flags

# -fopenmp: the kernels' threads are OpenMP's. torch already loaded its libgomp (soname
# libgomp.so.1), so the dynamic loader binds the kernels to that same runtime and thread pool.
# (An earlier pthreads version fought torch's spinning workers and lost 20% on two cores.)
BASE_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]

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


def compiler_version(cc: str) -> str:
    """`cc --version`'s first line: a compiler upgrade must rebuild the kernels."""
    try:
        result = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout.partition("\n")[0]


INCLUDE_DIR = Path(__file__).parent  # vec.h, threads.h and the other headers the kernels share


def build_key(source: Path, cc: str, flags: list[str], version: str | None = None) -> str:
    """What a compiled library depends on: the source and the shared headers, the compiler
    and its version, the flags."""
    version = compiler_version(cc) if version is None else version
    key = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(INCLUDE_DIR.glob("*.h")))
    key += "\0".join([cc, version, *flags]).encode()
    return hashlib.sha256(key).hexdigest()[:16]


def cache_dir() -> Path:
    root = os.environ.get("MYVLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "myvllm")
    return Path(root) / "kernels"


def find_compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler found for the CPU kernels")
    return cc


def build(source: Path, extra_flags: list[str] | None = None, version: str | None = None) -> ctypes.CDLL:
    """Compile `source` (once per source, compiler and flags) and load it."""
    cc = find_compiler()
    flags = [*BASE_FLAGS, *isa_flags(), f"-I{INCLUDE_DIR}", *(extra_flags or [])]
    target = cache_dir() / f"{source.stem}_{build_key(source, cc, flags, version)}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            cmd = [cc, *flags, str(source), "-o", str(out), "-lm"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"compiling {source.name} failed: {result.stderr.strip()[-500:]}")
            os.replace(out, target)  # atomic: concurrent builders never load a half-written file
    return ctypes.CDLL(str(target))
