"""Peak resident memory of loading an MoE checkpoint on each rank of a data-parallel expert-parallel
group, against one rank holding every expert: each rank loads in a process of its own (the group's
place set directly, no process group joined, since loading exchanges nothing), then packs its
experts for the CPU kernel as a worker does.

    python scripts/load_rss.py models/moe-a3b-16 --ranks 2

Prints the checkpoint's expert and dense bytes, and per rank: resident memory before the load
(the interpreter, torch and the model's code: a first build on the meta device loads what it
imports), its peak after the load and after packing (VmHWM), what it holds once packed (VmRSS),
the parameters' bytes, and whether peak - before <= experts / ranks + dense holds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 1 << 20
_EXPERT = re.compile(r"\.experts\.")


def _vm(field: str) -> int:
    """A /proc/self/status memory figure (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def checkpoint_bytes(model_dir: str) -> tuple[int, int]:
    """(expert bytes, everything else's bytes) of a safetensors checkpoint, from its headers."""
    from safetensors import safe_open

    from services.worker.models.loader import _safetensors_files

    experts = dense = 0
    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                size = piece.get_dtype()
                nbytes = {"F32": 4, "BF16": 2, "F16": 2}[size]
                for dim in piece.get_shape():
                    nbytes *= dim
                if _EXPERT.search(name):
                    experts += nbytes
                else:
                    dense += nbytes
    return experts, dense


def _load_rank(model_dir: str, rank: int, ranks: int, dtype: str, out: multiprocessing.Queue) -> None:
    import torch

    from services.worker import parallel
    from services.worker.models.fast_paths import use_cpu_moe
    from services.worker.models.load import load_model
    from services.worker.models.loader import build_model, resolve_dtype

    if ranks > 1:
        parallel._ep_state = parallel.ExpertParallel(rank, ranks)
        parallel._dp_state = parallel.DataParallel(rank, ranks)
    from transformers import AutoConfig

    build_model(AutoConfig.from_pretrained(model_dir))
    before = _vm("VmRSS")
    model, _ = load_model(model_dir, resolve_dtype(dtype), torch.device("cpu"), progress=False)
    loaded = _vm("VmHWM")
    packed_layers = use_cpu_moe(model)
    out.put(dict(rank=rank, before=before, after_load=loaded, after_pack=_vm("VmHWM"), held_after_pack=_vm("VmRSS"),
                 packed=packed_layers,
                 held=sum(p.numel() * p.element_size() for p in model.parameters())))


def measure(model_dir: str, ranks: int, dtype: str) -> list[dict]:
    """Each rank's figures, every rank loading in a process of its own, one after the other."""
    context = multiprocessing.get_context("spawn")
    results = []
    for rank in range(ranks):
        out = context.Queue()
        process = context.Process(target=_load_rank, args=(model_dir, rank, ranks, dtype, out))
        process.start()
        results.append(out.get())
        process.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("--ranks", type=int, default=2, help="expert-parallel ranks (1: one rank, every expert)")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    experts, dense = checkpoint_bytes(args.model_dir)
    budget = experts // args.ranks + dense
    print(f"checkpoint: experts {experts / MIB:.1f} MiB, dense {dense / MIB:.1f} MiB; "
          f"budget per rank (experts / {args.ranks} + dense) {budget / MIB:.1f} MiB")
    for r in measure(args.model_dir, args.ranks, args.dtype):
        grown = r["after_pack"] - r["before"]
        print(json.dumps({k: (round(v / MIB, 1) if k not in ("rank", "packed") else v) for k, v in r.items()}),
              f"peak - before {grown / MIB:.1f} MiB: {'within' if grown <= budget else 'OVER'} budget")


if __name__ == "__main__":
    main()
