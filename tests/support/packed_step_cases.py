"""What the whole-step kernel tests share: the runner's packed step (or a skip saying why a CPU
has none) and the attention metadata of a batch laid out in fixed block tables."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.attention.base import AttentionMetadata
from services.worker.cpu.gemm import PanelGemm, keeps_onednn_for_bf16
from services.worker.model_runner import ModelRunner
from services.worker.models.c_step.decode_step import PackedStep

BLOCK = 16  # tokens per KV block in these tests


def packed_step_or_skip(runner: ModelRunner) -> PackedStep:
    """The runner's packed step; a CPU without AVX-512 has no packed GEMM for it to run on, and one
    with AMX keeps oneDNN (its AMX tiles) for bf16 layers where our GEMM lacks the tiles, so it has
    no bf16 packed step there."""
    step = runner.model.packed_step
    gemm = PanelGemm.load()
    if step is None and gemm is None:
        pytest.skip("no AVX-512: the linear layers keep oneDNN and there is no packed step")
    if step is None and runner.dtype not in gemm.dtypes:
        assert runner.dtype == torch.bfloat16 and keeps_onednn_for_bf16(None, gemm.amx_bf16)  # the only other reason
        pytest.skip("AMX: bf16 linear layers keep oneDNN and there is no bf16 packed step")
    assert isinstance(step, PackedStep)
    return step


def step_meta(runner: ModelRunner, ctx: np.ndarray, num_new: np.ndarray) -> AttentionMetadata:
    """Request i owns blocks 1 + 12i .. 12i + 12 and brings num_new[i] tokens after ctx[i]."""
    tables = np.arange(1, 1 + 12 * len(ctx), dtype=np.int32).reshape(len(ctx), 12)
    rows = np.repeat(np.arange(len(ctx)), num_new)
    pos = np.concatenate([np.arange(c, c + n) for c, n in zip(ctx, num_new, strict=True)])
    slots = tables[rows, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK
    qsl = np.concatenate([[0], np.cumsum(num_new)])
    meta = AttentionMetadata.from_host(slots, qsl, ctx + num_new, ctx, tables, BLOCK, "cpu")
    meta.backend_data = runner.attn_backend.prepare(meta)
    return meta
