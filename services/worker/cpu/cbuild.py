"""Build a C source file into a shared library at first use, cached on disk, and load it.

The CPU kernels (paged attention, the fused elementwise ops, the GEMM, the whole-model step) are
small C files compiled with the system C compiler (about a second each) into a cache directory,
keyed by the source and the headers it can include, the compiler and its version, and the flags.
A kernel may live outside this folder (attention/, models/c_step/): it includes the shared
headers here through -I, and its own from beside it.

Instruction sets: each kernel is built for a fixed x86-64 *level*, never `-march=native`, so
every machine of a level runs the same machine code and gets the same results. A kernel says the
highest level it has code for (`highest`): the decode step stops at `avx2` (x86-64-v3, AVX2 +
FMA; its quantized build at quant_gemm.c's `amx_int8`), the fused ops at `avx512` (a 16-lane
SiLU·up with the same bits as the 8-lane one), the attention kernels, the GEMM and the packed
step (gemm.c's tiles) carry AVX-512 paths (`#ifdef __AVX512F__`, `__AVX512BF16__`) and are built
at `avx512` or `avx512_bf16` where /proc/cpuinfo lists those flags (16-lane vectors, bf16 dot
products: the fixed v3 build left half of an AVX-512 machine's vector width unused).
`MYVLLM_CPU_ISA` caps the level for every kernel (for example `avx2` to run the v3 code on an
AVX-512 machine); the tests build each kernel at every level this CPU can run. Without a
compiler the caller falls back to torch.
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
# (A pthreads version fought torch's spinning workers for the cores.)
BASE_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
# Extra compiler flags for every kernel, after the kernel's own (space-separated; part of the
# cache key). For checking builds: tests/unit/worker/test_kernels_asan.py sets
# "-fsanitize=address -fno-omit-frame-pointer" and runs the kernel tests with libasan preloaded.
EXTRA_CFLAGS_ENV = "MYVLLM_KERNEL_CFLAGS"

# The CPU flags each x86-64 micro-architecture level needs (as /proc/cpuinfo spells them).
_X86_64_V2 = {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}
_X86_64_V3 = _X86_64_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

# The levels a kernel can be built for, highest first: (name, compiler flags, CPU flags needed).
# avx512_vnni (AVX-512's int8 dot products, vpdpbusd) sits above avx512_bf16 although neither
# implies the other, and amx_int8 (its tiles' int8 products, tdpbusd) above it: only the quantized
# kernels (quant/quant_gemm.c) ask for them. amx_bf16 (the tiles' bf16 products, tdpbf16ps) sits
# between avx512_vnni and avx512_bf16: gemm.c and the whole-step kernel on its tiles ask for it,
# the quantized kernels pass over it on a CPU with VNNI, and every kernel whose highest level is
# avx512_bf16 or lower gets the same levels as before.
ISA_LEVELS = [
    ("amx_int8", ["-march=x86-64-v4", "-mavx512vnni", "-mamx-tile", "-mamx-int8"],
     _X86_64_V4 | {"avx512_vnni", "amx_tile", "amx_int8"}),
    ("avx512_vnni", ["-march=x86-64-v4", "-mavx512vnni"], _X86_64_V4 | {"avx512_vnni"}),
    ("amx_bf16", ["-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
     _X86_64_V4 | {"avx512_bf16", "amx_tile", "amx_bf16"}),
    ("avx512_bf16", ["-march=x86-64-v4", "-mavx512bf16"], _X86_64_V4 | {"avx512_bf16"}),
    ("avx512", ["-march=x86-64-v4"], _X86_64_V4),
    ("avx2", ["-march=x86-64-v3"], _X86_64_V3),
    ("sse4", ["-march=x86-64-v2"], _X86_64_V2),
    ("x86-64", ["-march=x86-64"], set()),
]
_LEVEL_NAMES = [name for name, _, _ in ISA_LEVELS]
ISA_ENV = "MYVLLM_CPU_ISA"


def isa_levels(machine: str | None = None, cpu_flags: set[str] | None = None, highest: str = "avx2") -> list[str]:
    """Every level this CPU can run, at most `highest` (and at most $MYVLLM_CPU_ISA), best first.
    Off x86-64 (aarch64 and the like): [""], the compiler's default target."""
    machine = machine or platform.machine()
    if machine not in ("x86_64", "AMD64"):
        return [""]
    cpu_flags = read_cpu_flags() if cpu_flags is None else cpu_flags
    caps = [highest, os.environ.get(ISA_ENV) or highest]
    for cap in caps:
        if cap not in _LEVEL_NAMES:
            raise ValueError(f"unknown CPU instruction-set level {cap!r} (one of {', '.join(_LEVEL_NAMES)})")
    top = max(_LEVEL_NAMES.index(cap) for cap in caps)
    return [name for name, _, needs in ISA_LEVELS[top:] if needs <= cpu_flags]


def isa_flags(machine: str | None = None, cpu_flags: set[str] | None = None, highest: str = "avx2",
              level: str | None = None) -> list[str]:
    """The -march (and extension) flags of `level`, or of the best level this CPU can run, at most
    `highest`: a fixed x86-64 level, so the build depends on the level alone."""
    level = isa_levels(machine, cpu_flags, highest)[0] if level is None else level
    return next((flags for name, flags, _ in ISA_LEVELS if name == level), [])


def compiler_version(cc: str) -> str:
    """`cc --version`'s first line: a compiler upgrade must rebuild the kernels."""
    try:
        result = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout.partition("\n")[0]


INCLUDE_DIR = Path(__file__).parent  # vec.h, threads.h and the other headers the kernels share


def headers_of(source: Path, include_dirs: list[Path] | None = None) -> list[Path]:
    """The headers `source` can include: the shared ones here, those beside it and those in
    `include_dirs`."""
    found = set(INCLUDE_DIR.glob("*.h")) | set(source.parent.glob("*.h"))
    for folder in include_dirs or []:
        found |= set(folder.glob("*.h"))
    return sorted(found)


def build_key(source: Path, cc: str, flags: list[str], version: str | None = None,
              include_dirs: list[Path] | None = None) -> str:
    """What a compiled library depends on: the source and the headers it can include, the
    compiler and its version, the flags."""
    version = compiler_version(cc) if version is None else version
    key = source.read_bytes() + b"".join(h.read_bytes() for h in headers_of(source, include_dirs))
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


def build(source: Path, extra_flags: list[str] | None = None, version: str | None = None, highest: str = "avx2",
          level: str | None = None, include_dirs: list[Path] | None = None) -> ctypes.CDLL:
    """Compile `source` (once per source, compiler and flags) and load it, built for `level` or
    for the best level this CPU can run up to `highest` (see the module's docstring).
    `include_dirs`: other folders whose headers it includes (searched with -I, part of the key)."""
    cc = find_compiler()
    includes = [f"-I{folder}" for folder in include_dirs or []]
    flags = [*BASE_FLAGS, *isa_flags(highest=highest, level=level), f"-I{INCLUDE_DIR}", *includes,
             *(extra_flags or []), *os.environ.get(EXTRA_CFLAGS_ENV, "").split()]
    target = cache_dir() / f"{source.stem}_{build_key(source, cc, flags, version, include_dirs)}.so"
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
