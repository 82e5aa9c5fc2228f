"""Exp(1) noise for sampling by argmax(probs / q) (the exponential race, vLLM's random sampling).

`Tensor.exponential_` draws it with a scalar loop on CPU: for a full batch of rows times a
vocabulary that costs more than a decode step of the model itself. -log(U) with U ~ uniform[0, 1)
is the same distribution from torch's vectorised uniform generator and a vectorised log, several
times faster. U = 0 (probability 2^-24 per entry) gives q = +inf: that entry loses the race, as an
exponential sample too large to matter would; q is never 0, so probs / q is never NaN.
"""

from __future__ import annotations

import torch


def exponential_(q: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill q (a tensor or a view) with Exp(1) samples in place; returns q."""
    if q.dtype in (torch.float16, torch.bfloat16):  # their uniforms hit 0 every 2^8 / 2^11 draws
        return q.copy_(exponential_(torch.empty_like(q, dtype=torch.float32), generator))
    return q.uniform_(generator=generator).log_().neg_()


def exponential_like(x: torch.Tensor) -> torch.Tensor:
    return exponential_(torch.empty_like(x))
