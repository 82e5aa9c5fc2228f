"""The model's forward compiled for the CPU (torch.compile, inductor): the CPU's CUDA graphs.

Eagerly, a decode step of SmolLM2-135M is ~1,300 small torch ops (RMSNorm, RoPE, SiLU·mul,
residual adds, views), each a dispatch and a pass over memory. Inductor fuses them into a few
C++ loops per layer. The linear layers (prepacked oneDNN weights, `cpu_linear.py`) and paged
attention (host planning plus a C kernel through ctypes) stay outside as opaque custom ops
(`opaque_ops.py`), so no weight is frozen into the graph and one graph with a dynamic token
count serves every step: no padding, no per-size compiles. (Inductor's own `freezing` path
was measured here: it packs fp32 weights for MKL per static shape and its GEMMs came out
slower than the oneDNN prepacked ones.)

Both graphs (one token, which dynamo specialises, and any other count) are compiled at
start-up (`warm_up`), so no request waits on the compiler; inductor's on-disk cache makes
later starts of the same architecture cheaper. Where compilation is unavailable (no C
compiler, an inductor error) the model runs eagerly and says so in one log line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from services.worker import opaque_ops

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Token counts run at start-up: dynamo specialises a count of 1; any other count shares a graph.
WARM_UP_SIZES = (1, 2)


class CompiledForward:
    """`model(input_ids, positions)` through an inductor-compiled forward (eager once disabled)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.table = opaque_ops.assign(model)
        self._compiled = torch.compile(model.forward, dynamic=True, fullgraph=True)
        self.enabled = True

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return self.model(input_ids, positions)
        with opaque_ops.active(self.table):
            return self._compiled(input_ids, positions)

    def warm_up(self, run: Callable[[int], None]) -> bool:
        """Compile now: `run(n)` makes one forward of n tokens through this object (with the
        attention context it needs). On any failure: log it once and run eagerly from then on."""
        start = time.perf_counter()
        try:
            for n in WARM_UP_SIZES:
                run(n)
        except Exception as e:  # noqa: BLE001 - any compiler / inductor failure means: run eagerly
            self.enabled = False
            first_line = str(e).splitlines()[0][:300] if str(e) else ""
            logger.warning("torch.compile of the model is unavailable (%s: %s); running eagerly",
                           type(e).__name__, first_line)
            return False
        logger.info("compiled the model's forward in %.1f s", time.perf_counter() - start)
        return True
