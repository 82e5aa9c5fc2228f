"""Per-choice output processing: engine token batches -> text deltas.

One `ChoiceOutputProcessor` per engine request. It owns that sequence's incremental
detokenizer and stop-string matcher, hides the stop token's text the way vLLM does,
and decides when a stop string ends the choice early.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.proto import myvllm_pb2 as pb
from services.common.sampling_params import SamplingParams
from services.text.detokenizer import IncrementalDetokenizer
from services.text.stop import StopStringMatcher
from services.text.tokenizer import Tokenizer


@dataclass
class ChoiceDelta:
    """What one engine step added to one choice."""

    index: int
    text: str
    token_ids: list[int]  # every token the engine produced, a hidden stop token included
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)  # parallel to token_ids
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string, or a non-EOS stop token id
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Once, with the first tokens, when prompt logprobs were asked for (prompt positions 1..).
    prompt_logprobs: list[pb.TokenLogprobs] = field(default_factory=list)


class ChoiceOutputProcessor:
    """Turns one engine request's `RequestOutput`s into `ChoiceDelta`s."""

    def __init__(self, index: int, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self.index = index
        self._eos_token_ids = tokenizer.eos_token_ids
        self._params = params
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._stop_matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.num_output_tokens = 0

    def process(self, output: pb.RequestOutput) -> ChoiceDelta:
        """Detokenize one step's tokens; a matched stop string sets finish_reason "stop"
        (the caller then aborts the engine request, which has not stopped by itself)."""
        token_ids = list(output.new_token_ids)
        self.num_output_tokens += len(token_ids)
        finish_reason = output.finish_reason or None
        stop_reason: int | str | None = None
        text_token_ids = token_ids
        if finish_reason == "stop" and token_ids:
            # The scheduler stops on token ids only (EOS, stop_token_ids). As in vLLM, that
            # token's text is not part of the output unless include_stop_str_in_output.
            if output.stop_token_id not in self._eos_token_ids and output.stop_token_id >= 0:
                stop_reason = output.stop_token_id
            if not self._params.include_stop_str_in_output:
                text_token_ids = token_ids[:-1]
        new_text = "".join(self._detokenizer.add(token_id) for token_id in text_token_ids)
        if finish_reason:
            new_text += self._detokenizer.flush()
        # Stop strings only count once min_tokens tokens exist (vLLM's rule).
        text, matched_stop = self._stop_matcher.feed(new_text, check=self.num_output_tokens > self._params.min_tokens)
        if matched_stop is not None:
            finish_reason, stop_reason = "stop", matched_stop
        elif finish_reason:
            text += self._stop_matcher.flush()
        return ChoiceDelta(
            index=self.index, text=text, token_ids=token_ids, logprobs=list(output.logprobs),
            finish_reason=finish_reason, stop_reason=stop_reason,
            num_prompt_tokens=output.num_prompt_tokens, num_cached_tokens=output.num_cached_tokens,
            prompt_logprobs=list(output.prompt_logprobs),
        )
