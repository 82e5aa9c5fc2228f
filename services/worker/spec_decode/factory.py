"""The proposer a LoadModel's speculative_config asks for."""

from __future__ import annotations

from services.common.spec_config import SpeculativeConfig
from services.worker.spec_decode.draft_model import DraftModelProposer
from services.worker.spec_decode.proposer import NgramSpecProposer, SpecProposer, TargetRunner


def make_proposer(config: SpeculativeConfig | None, runner: TargetRunner) -> SpecProposer | None:
    if config is None or not config.method:
        return None
    if config.method == "ngram":
        return NgramSpecProposer(config, runner)
    if config.method == "draft_model":
        return DraftModelProposer(config, runner)
    raise ValueError(f"speculative_config.method {config.method!r} is not one of 'ngram', 'draft_model'")
