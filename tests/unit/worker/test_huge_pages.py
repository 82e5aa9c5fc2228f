"""Packed weights in 2 MiB-aligned mappings that ask for huge pages (services/worker/cpu/huge_pages.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from services.worker.cpu import huge_pages
from services.worker.cpu.gemm import PanelGemm

linux_only = pytest.mark.skipif(not huge_pages.enabled(), reason="huge pages are asked for on Linux only")


@linux_only
def test_a_large_tensor_is_aligned_to_a_huge_page_and_outlives_every_other_reference() -> None:
    t = huge_pages.empty((3, 1024, 1024), torch.float32)  # 12 MiB
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape))
    gc.collect()  # only the tensor holds its mapping now
    assert float(t[2, 1023, 1023]) == t.numel() - 1
    b = huge_pages.empty((huge_pages.MIN_BYTES // 2,), torch.bfloat16)
    b.fill_(1.5)
    assert b.data_ptr() % huge_pages.HUGE_PAGE == 0 and float(b.float().sum()) == 1.5 * b.numel()


def test_small_tensors_and_the_switch_leave_torchs_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    small = huge_pages.empty((16, 16), torch.float32)
    assert small.shape == (16, 16) and small.untyped_storage().nbytes() == 16 * 16 * 4
    monkeypatch.setenv("MYVLLM_HUGE_PAGES", "0")
    big = huge_pages.empty((huge_pages.MIN_BYTES,), torch.uint8)
    assert big.untyped_storage().nbytes() == huge_pages.MIN_BYTES  # not a mapping with room to align


@linux_only
def test_packed_weights_live_in_the_aligned_mapping_and_multiply_alike() -> None:
    gemm = PanelGemm.load()
    if gemm is None or torch.float32 not in gemm.dtypes:
        pytest.skip("no packed GEMM on this CPU")
    torch.manual_seed(0)
    w, x = torch.randn(4096, 576), torch.randn(5, 576)
    packed = gemm.pack(w)
    assert packed.data_ptr() % huge_pages.HUGE_PAGE == 0
    torch.testing.assert_close(gemm.matmul(x, packed, None), x @ w.T, rtol=1e-4, atol=1e-4)
