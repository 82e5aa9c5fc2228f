"""Keep Triton out of a process whose forward passes run on CPU.

No Triton kernel runs on a CPU, but importing Triton has a cost at exit: its compiled module
(nanobind) reports each type and function still alive then, some 35 lines of `nanobind: leaked
...` at every stop of a worker and at the end of every offline `LLM` script. Our own modules
import Triton only on the CUDA path; torch imports it on its own, as soon as anything imports
torch._dynamo (building a model on the meta device does, through torch._refs), to ask whether
the package exists. On CPU the honest answer is no: torch is told so before it asks.

Only torch's question is answered: Triton itself stays importable, so code that runs Triton
kernels in its interpreter on CPU (TRITON_INTERPRET=1: tests of our kernels) still imports it.
Left alone where Triton is already imported (nothing to save).
"""

from __future__ import annotations

import sys


def _no_triton_package() -> bool:
    return False


def keep_triton_out() -> None:
    """Make torch see no Triton package in this process (see the module's docstring)."""
    if "triton" in sys.modules:
        return
    import torch.utils._triton as torch_triton

    torch_triton.has_triton_package = _no_triton_package
