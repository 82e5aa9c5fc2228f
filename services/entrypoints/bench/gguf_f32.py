"""An fp32 copy of a quantised GGUF, so llama.cpp runs the same weights as the other peers.

The default model ships as a Q4_1 GGUF and my-vllm / HF run its dequantised fp32 weights
(that is what setup converts). Timing llama.cpp on the 4-bit file would compare different
arithmetic; this writes the same dequantised weights back as an all-F32 GGUF (same
metadata, same tensor names) once, into the cache directory, and reuses it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

GENERAL_FILE_TYPE = "general.file_type"
ALL_F32 = 0  # llama.cpp's LLAMA_FTYPE_ALL_F32


def _cache_dir() -> Path:
    root = os.environ.get("MYVLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "myvllm")
    return Path(root) / "gguf"


def f32_gguf(src: str) -> str:
    """Path of the all-F32 copy of `src` (written on first use, ~0.5 GB for SmolLM2-135M)."""
    source = Path(src)
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = _cache_dir() / f"{source.stem}.F32-{key}.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        _write_f32(source, partial)
        os.replace(partial, target)  # atomic: a concurrent reader never sees half a file
    return str(target)


def _write_f32(source: Path, target: Path) -> None:
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by GGUFWriter itself
        vtype = field.types[0]
        value = ALL_F32 if name == GENERAL_FILE_TYPE else field.contents()
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub_type)
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, weights.reshape([int(d) for d in reversed(tensor.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
