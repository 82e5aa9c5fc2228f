"""The part of a checkpoint tensor that a rank needs, and reading only that part from safetensors files.

A `Part` is a box: one slice for each leading dimension, the rest whole; `WHOLE` (the empty box) is
the whole tensor. The model says which part of a tensor it needs from the tensor's name and shape
(loader.checkpoint_part; None for a tensor it needs none of) before anything is read, and
`read_parts` reads exactly that: `get_tensor` for a whole tensor, `get_slice(name)[part]` for a
part, which touches only the pages of the file that hold it.

safetensors maps the file into memory, and the pages a read touches stay resident (counted in
the process's RSS) until the file is closed. Over a whole checkpoint that would keep every page
read resident beside the parameters copied from it, doubling what a rank holds. So `read_parts`
closes and reopens the file once it has read `WINDOW_BYTES`: at most that much (or one tensor's
part, if larger) stays mapped beside the parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from safetensors import safe_open
from tqdm import tqdm

Part = tuple[slice, ...]
WHOLE: Part = ()
# Reopening a file parses its header again; a few tens of MiB between reopens keep that rare.
WINDOW_BYTES = 16 << 20

PartFor = Callable[[str, tuple[int, ...]], Part | None]


def part_of(shape: Sequence[int], ranges: Mapping[int, tuple[int, int]]) -> Part:
    """The part of a tensor of `shape` taking [start, start + length) along each dimension that
    `ranges` maps to (start, length), whole along the others; WHOLE where that is the whole
    tensor. A range is cut at the tensor's end (the last vocabulary shard's range runs past the
    table into its padding rows)."""
    if not ranges:
        return WHOLE
    box = [slice(None)] * (max(ranges) + 1)
    whole = True
    for dim, (start, length) in ranges.items():
        stop = min(start + length, shape[dim])
        box[dim] = slice(start, stop)
        whole = whole and start == 0 and stop == shape[dim]
    return WHOLE if whole else tuple(box)


def take(tensor: torch.Tensor, part: Part) -> torch.Tensor:
    """`part` of a tensor already in memory (a view)."""
    return tensor[part] if part else tensor


def read_parts(files: Sequence[str], part_for: PartFor, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, part) for every tensor of the safetensors `files` that `part_for(name, shape)` gives
    a part of, reading only that part; the tensors it gives None for are never read."""
    for path in tqdm(files, desc="Loading safetensors shards", disable=not progress or len(files) < 2):
        yield from _read_file(path, part_for)


def _read_file(path: str, part_for: PartFor) -> Iterator[tuple[str, torch.Tensor]]:
    names: list[str] | None = None
    index = 0
    while names is None or index < len(names):
        with safe_open(path, framework="pt") as f:
            if names is None:
                names = list(f.keys())
            mapped = 0
            while index < len(names) and mapped < WINDOW_BYTES:
                name = names[index]
                index += 1
                piece = f.get_slice(name)
                shape = tuple(piece.get_shape())
                part = part_for(name, shape)
                if part is None:
                    continue
                tensor = piece[part] if part else f.get_tensor(name)
                mapped += _spanned_bytes(shape, part, tensor.element_size())
                yield name, tensor


def _spanned_bytes(shape: tuple[int, ...], part: Part, item_bytes: int) -> int:
    """Bytes of the file a read of `part` touches at most: its rows of the first dimension,
    whole (a part of the columns touches every row it crosses)."""
    if not shape:
        return item_bytes
    first = part[0] if part else slice(None)
    rows = len(range(*first.indices(shape[0])))
    return rows * math.prod(shape[1:]) * item_bytes
