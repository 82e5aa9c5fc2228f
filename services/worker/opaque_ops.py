"""Modules a compiled forward calls as opaque ops: paged attention and prepacked linears.

Inductor cannot trace either (attention plans on host arrays and calls a C kernel through
ctypes; a prepacked weight is a oneDNN tensor fake tensors cannot describe), so the graph
calls them as custom ops (`torch.library.custom_op`) that name their module by an int. The
int is the module's position in its model (`assign`), not a process-wide id, so two models of
the same architecture trace to the same graph: dynamo reuses its code for a new model object
and inductor's on-disk cache hits in the next process. The model being run is pushed with
`active(...)` around each compiled call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torch import nn

_active: list[Sequence[nn.Module]] = []


def assign(model: nn.Module) -> list[nn.Module]:
    """Number `model`'s opaque modules (those with an `opaque_index` attribute) in module order
    and return them as the table the ops look up."""
    table = [m for m in model.modules() if hasattr(m, "opaque_index")]
    for i, m in enumerate(table):
        m.opaque_index = i
    return table


@contextlib.contextmanager
def active(table: Sequence[nn.Module]) -> Iterator[None]:
    """Make `table` the one the opaque ops resolve their indices in, for one forward."""
    _active.append(table)
    try:
        yield
    finally:
        _active.pop()


def lookup(index: int) -> nn.Module:
    if not _active:
        raise RuntimeError("an opaque op ran outside `opaque_ops.active(...)`")
    return _active[-1][index]
