"""Engine `TokenLogprobs` -> OpenAI logprobs shapes (chat and legacy completions)."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.proto import myvllm_pb2 as pb
from services.gateway.protocol import ChatLogprobToken, CompletionLogprobs, PromptLogprob, PromptLogprobs, TopLogprob
from services.text.tokenizer import Tokenizer

# JSON has no -inf; vLLM reports masked-out tokens with this floor instead.
MIN_LOGPROB = -9999.0


def _clamp(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)


def token_id_text(token_id: int) -> str:
    """vLLM's return_tokens_as_token_ids form of a token: its id, which any JSON can carry."""
    return f"token_id:{token_id}"


def _top_logprob(tokenizer: Tokenizer, token_id: int, logprob: float, as_token_ids: bool) -> TopLogprob:
    if as_token_ids:
        text = token_id_text(token_id)
        return TopLogprob(token=text, logprob=_clamp(logprob), bytes=list(text.encode("utf-8")))
    return TopLogprob(token=tokenizer.token_text(token_id), logprob=_clamp(logprob),
                      bytes=list(tokenizer.token_bytes(token_id)))


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: Sequence[int], logprobs: Sequence[pb.TokenLogprobs], num_top: int,
    as_token_ids: bool = False,
) -> list[ChatLogprobToken]:
    """`choices[].logprobs.content` entries for the given tokens (`as_token_ids`: each token
    shown as "token_id:N", vLLM's return_tokens_as_token_ids)."""
    entries = []
    for token_id, token_logprobs in zip(token_ids, logprobs, strict=False):
        top = [_top_logprob(tokenizer, top_id, top_lp, as_token_ids) for top_id, top_lp in
               zip(token_logprobs.top_ids[:num_top], token_logprobs.top_logprobs[:num_top], strict=False)]
        sampled = _top_logprob(tokenizer, token_id, token_logprobs.logprob, as_token_ids)
        entries.append(ChatLogprobToken(**sampled.model_dump(), top_logprobs=top))
    return entries


class CompletionLogprobsBuilder:
    """Builds legacy-completions logprobs; `text_offset` runs on across calls, so
    streamed chunks carry offsets into the whole completion. `as_token_ids`: tokens shown as
    "token_id:N" (vLLM's return_tokens_as_token_ids; the offsets then count those, as vLLM's)."""

    def __init__(self, tokenizer: Tokenizer, num_top: int, initial_text_offset: int = 0,
                 as_token_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._num_top = num_top
        self._text_offset = initial_text_offset
        self._as_token_ids = as_token_ids

    def _token(self, token_id: int) -> str:
        return token_id_text(token_id) if self._as_token_ids else self._tokenizer.token_text(token_id)

    def build_prompt(self, prompt_ids: Sequence[int], prompt_logprobs: Sequence[pb.TokenLogprobs],
                     ) -> CompletionLogprobs:
        """The echoed prompt's entries (OpenAI's echo + logprobs): the first token has no
        logprob (nothing precedes it), the others their prompt logprobs."""
        if not prompt_ids:
            return CompletionLogprobs()
        first = self._token(prompt_ids[0])
        result = CompletionLogprobs(tokens=[first], token_logprobs=[None], top_logprobs=[None],
                                    text_offset=[self._text_offset])
        self._text_offset += len(first)
        result.extend(self.build(prompt_ids[1:], prompt_logprobs))
        return result

    def build(self, token_ids: Sequence[int], logprobs: Sequence[pb.TokenLogprobs]) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for token_id, token_logprobs in zip(token_ids, logprobs, strict=False):
            text = self._token(token_id)
            result.tokens.append(text)
            result.token_logprobs.append(_clamp(token_logprobs.logprob))
            result.text_offset.append(self._text_offset)
            self._text_offset += len(text)
            # Keyed by text, so distinct tokens can collide (e.g. partial characters all read
            # "\ufffd"); the list is best-first, so keep the first, most likely, value.
            top: dict[str, float] = {}
            for top_id, top_lp in zip(token_logprobs.top_ids[:self._num_top],
                                      token_logprobs.top_logprobs[:self._num_top], strict=False):
                top.setdefault(self._token(top_id), _clamp(top_lp))
            # Like vLLM (and OpenAI), the sampled token is always among its top_logprobs.
            top.setdefault(text, _clamp(token_logprobs.logprob))
            result.top_logprobs.append(top)
        return result


def vllm_prompt_logprobs(tokenizer: Tokenizer, prompt_ids: Sequence[int],
                         prompt_logprobs: Sequence[pb.TokenLogprobs], num_top: int) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` response field: None for the first prompt token, then per
    position {token id: {logprob, rank, decoded_token}} with the top k and the prompt token."""
    result: PromptLogprobs = [None] if prompt_ids else []
    for token_id, lp in zip(prompt_ids[1:], prompt_logprobs, strict=False):
        entry = {str(t): PromptLogprob(logprob=_clamp(v), rank=rank + 1, decoded_token=tokenizer.token_text(t))
                 for rank, (t, v) in enumerate(zip(lp.top_ids[:num_top], lp.top_logprobs[:num_top], strict=False))}
        entry.setdefault(str(token_id), PromptLogprob(logprob=_clamp(lp.logprob), rank=lp.rank,
                                                      decoded_token=tokenizer.token_text(token_id)))
        result.append(entry)
    return result
