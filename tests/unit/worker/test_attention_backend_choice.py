"""Which attention backend a worker gets (services/worker/attention/selector.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("asked", [None, "cpu"])
def test_a_cpu_backend_that_cannot_be_built_falls_back_to_torch_with_the_reason(monkeypatch, caplog, asked) -> None:
    from services.worker.attention import cpu_backend, selector

    def no_compiler(level=None):
        raise RuntimeError("no C compiler found for the cpu attention backend")

    monkeypatch.setattr(cpu_backend, "load_library", no_compiler)
    with caplog.at_level("WARNING", logger="myvllm.worker"):
        backend = selector.get_attention_backend(asked, torch.device("cpu"))
    assert backend.name == "torch"
    assert "attention backend 'cpu' cannot be built (no C compiler found" in caplog.text
    assert "falling back to 'torch'" in caplog.text
