"""A rank reads only its part of an HF checkpoint: every read is recorded (safe_open wrapped) while
one process plays one rank. An expert-parallel rank never reads another rank's experts and holds
exactly the full load's share of them; a tensor-parallel rank reads its shard of each split
tensor (a slice, never the whole) and gets what cutting the whole tensors gives; a later pipeline
stage never reads an earlier stage's layers.
"""

from __future__ import annotations

import re

import pytest
import torch

from services.worker import parallel
from services.worker.models import checkpoint_parts
from services.worker.models.checkpoint_parts import WHOLE
from services.worker.models.loader import build_model, iterate_weights, load_hf_model, load_weights, rank_parts

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@pytest.fixture
def reads(monkeypatch) -> list[tuple[str, tuple]]:
    """(name, part) of every tensor read from a safetensors file while the test runs."""
    recorded: list[tuple[str, tuple]] = []
    real_open = checkpoint_parts.safe_open

    class RecordedSlice:
        def __init__(self, name: str, inner) -> None:
            self.name, self.inner = name, inner

        def get_shape(self) -> list[int]:
            return self.inner.get_shape()

        def __getitem__(self, part):
            recorded.append((self.name, part))
            return self.inner[part]

    class RecordedFile:
        def __init__(self, path: str, framework: str) -> None:
            self.handle = real_open(path, framework=framework)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc) -> None:
            self.handle.__exit__(*exc)

        def keys(self) -> list[str]:
            return self.inner.keys()

        def get_tensor(self, name: str) -> torch.Tensor:
            recorded.append((name, WHOLE))
            return self.inner.get_tensor(name)

        def get_slice(self, name: str) -> RecordedSlice:
            return RecordedSlice(name, self.inner.get_slice(name))

    monkeypatch.setattr(checkpoint_parts, "safe_open", RecordedFile)
    return recorded


def _load(model_dir: str) -> torch.nn.Module:
    return load_hf_model(model_dir, torch.float32, torch.device("cpu"), progress=False)[0]


def test_an_expert_parallel_rank_reads_none_of_another_ranks_experts(tiny_model_dir, reads, monkeypatch) -> None:
    """Two data-parallel engines as one expert-parallel group (8 experts: 4 a rank)."""
    model_dir = tiny_model_dir("qwen3_moe")
    full = _load(model_dir)
    whole_reads = list(reads)
    for rank in range(2):
        reads.clear()
        monkeypatch.setattr(parallel, "_ep_state", parallel.ExpertParallel(rank, 2))
        monkeypatch.setattr(parallel, "_dp_state", parallel.DataParallel(rank, 2))
        model = _load(model_dir)
        own = range(4 * rank, 4 * rank + 4)
        read_experts = {int(m.group(1)) for name, _ in reads if (m := _EXPERT.search(name))}
        assert read_experts == set(own)
        # Everything else is read as the one rank reads it (whole: no tensor parallelism).
        assert sorted(r for r in reads if not _EXPERT.search(r[0])) \
            == sorted(r for r in whole_reads if not _EXPERT.search(r[0]))
        assert all(part == WHOLE for _, part in reads)
        held = dict(model.named_parameters())
        for name, want in full.named_parameters():
            if ".experts." in name:
                want = want[4 * rank:4 * rank + 4]
            assert torch.equal(held[name], want), name


def test_a_tensor_parallel_rank_reads_only_its_shard_of_each_split_tensor(tiny_model_dir, reads,
                                                                          monkeypatch) -> None:
    """Qwen2-MoE (q/k/v biases, a shared expert): rank 1 of 2 reads slices of every split tensor and
    its weights equal those cut from the whole tensors in memory."""
    model_dir = tiny_model_dir("qwen2_moe")
    monkeypatch.setattr(parallel, "_state", parallel.TensorParallel(1, 2))
    model = _load(model_dir)
    split = re.compile(r"(q_proj|k_proj|v_proj|o_proj\.weight|gate_proj|up_proj|down_proj|embed_tokens|lm_head)")
    assert reads and all(part != WHOLE for name, part in reads if split.search(name))
    assert {name for name, part in reads if part == WHOLE} >= {"model.norm.weight", "model.layers.0.mlp.gate.weight"}
    cut = build_model(model.config).to_empty(device="cpu")
    load_weights(cut, rank_parts(cut, iterate_weights(model_dir, progress=False)))
    held = dict(model.named_parameters())
    for name, want in cut.named_parameters():
        assert torch.equal(held[name], want), name


def test_a_later_pipeline_stage_reads_none_of_an_earlier_stages_layers(tiny_model_dir, reads, monkeypatch) -> None:
    model_dir = tiny_model_dir("qwen3_moe")
    monkeypatch.setattr(parallel, "_pp_state", parallel.PipelineParallel(1, 2))
    model = _load(model_dir)
    read_layers = {int(m.group(1)) for name, _ in reads if (m := re.search(r"\.layers\.(\d+)\.", name))}
    assert read_layers == set(model.layer_range) and model.layer_range.start > 0
    assert not any("embed_tokens" in name for name, _ in reads)
