"""Request prompts -> token ids: chat messages through the chat template, and the
four shapes a legacy-completions `prompt` can take.

These functions render and tokenize: the routes run them in the tokenizer pool
(`GatewayContext.in_tokenizer_pool`), never on the event loop. A prompt that cannot fit the
model's context is refused by its `PromptBound` before it is tokenized (or decoded)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.gateway.errors import invalid_request, unsupported
from services.gateway.protocol import ChatMessage, PromptInput
from services.gateway.sampling import check_context_length
from services.text.tokenizer import Tokenizer


@dataclass
class EnginePrompt:
    token_ids: list[int]
    text: str  # what `echo` shows


@dataclass(frozen=True)
class PromptBound:
    """What a prompt may be before it is tokenized: at most `chars_per_token` x `max_model_len`
    characters (`chars_per_token` 0: any number), and as token ids fewer than `max_model_len`."""

    max_model_len: int
    chars_per_token: int = 0

    def check_text(self, text: str, prompt_name: str) -> None:
        """A 400 context_length_exceeded, naming `prompt_name`, for text too long to be worth tokenizing."""
        limit = self.chars_per_token * self.max_model_len
        if self.chars_per_token and len(text) > limit:
            raise invalid_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, the prompt has "
                f"{len(text)} characters, more than the {limit} ({self.chars_per_token} per token) a prompt may "
                f"have before it is tokenized (--max-prompt-chars-per-token). Please reduce the length of the "
                f"{prompt_name}.", param=prompt_name, code="context_length_exceeded")

    def check_num_tokens(self, num_tokens: int, prompt_name: str) -> None:
        """Token ids that fill the whole context leave no room for a completion (the later
        check would say the same, after every id was checked and the prompt decoded)."""
        if num_tokens >= self.max_model_len:
            check_context_length(None, num_tokens, self.max_model_len, prompt_name)


@dataclass(frozen=True)
class PromptTruncation:
    """vLLM's truncate_prompt_tokens: a tokenized prompt keeps at most `num_tokens` tokens, its
    last ones (truncation_side "left", the default: the start is cut) or its first ("right")."""

    num_tokens: int
    side: str = "left"

    def apply(self, token_ids: list[int]) -> list[int]:
        if len(token_ids) <= self.num_tokens:
            return token_ids
        return token_ids[-self.num_tokens:] if self.side == "left" else token_ids[:self.num_tokens]


def prompt_truncation(truncate_prompt_tokens: int | None, truncation_side: str | None,
                      max_model_len: int) -> PromptTruncation | None:
    """The truncation a request asks for (None: none); -1 means max_model_len, as in vLLM."""
    if truncate_prompt_tokens is None:
        return None
    num_tokens = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if num_tokens < 1:
        raise invalid_request(f"truncate_prompt_tokens must be -1 or at least 1, got {truncate_prompt_tokens}",
                              param="truncate_prompt_tokens")
    if num_tokens > max_model_len:
        raise invalid_request(f"truncate_prompt_tokens value ({num_tokens}) is greater than max_model_len "
                              f"({max_model_len}). Please, select a smaller truncation size.",
                              param="truncate_prompt_tokens")
    return PromptTruncation(num_tokens, truncation_side or "left")


def message_text(message: ChatMessage) -> str:
    """A message's content as the chat template gets it (text parts joined by newlines)."""
    content = message.content
    if isinstance(content, list):
        return "\n".join(part.text or "" for part in content)
    return content or ""


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    rendered = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        texts = []
        for part_index, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise unsupported(f"Content part type {part.type!r}",
                                  param=f"messages[{index}].content[{part_index}].type")
            texts.append(part.text)
        content = "\n".join(texts)
    # Templates concatenate content; a missing one (e.g. an assistant turn) is "".
    rendered["content"] = content or ""
    for call in rendered.get("tool_calls") or []:
        # OpenAI sends a call's arguments as JSON text; templates format them as an object.
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass
    return rendered


def chat_prompt(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False,
                chat_template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None, bound: PromptBound | None = None,
                documents: list[dict[str, str]] | None = None, add_special_tokens: bool = False,
                truncation: PromptTruncation | None = None) -> EnginePrompt:
    """Render `messages` (and the `tools` offered, the `documents`) with the chat template and,
    unless the text is over `bound`, tokenize the result (`add_special_tokens`: BOS and the like
    on top of those the template placed), keeping what `truncation` keeps."""
    if add_generation_prompt and continue_final_message:
        raise invalid_request("add_generation_prompt and continue_final_message cannot both be true",
                              param="continue_final_message")
    template_input = [_template_message(i, m) for i, m in enumerate(messages)]
    try:
        text = tokenizer.render_chat(template_input, add_generation_prompt, continue_final_message,
                                     chat_template_kwargs, tools, documents)
    except Exception as e:  # jinja errors, raise_exception() in templates, missing template
        raise invalid_request(f"Could not apply the chat template: {e}", param="messages") from None
    if bound is not None:
        bound.check_text(text, "messages")
    token_ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return EnginePrompt(truncation.apply(token_ids) if truncation is not None else token_ids, text)


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise invalid_request(f"Token id {token_id} is out of vocabulary (size {vocab_size})", param=param)


def _prompt_items(prompt: PromptInput) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def num_prompts(prompt: PromptInput) -> int:
    """How many prompts a completions request carries (before any is tokenized)."""
    return len(_prompt_items(prompt))


def completion_prompts(tokenizer: Tokenizer, prompt: PromptInput, add_special_tokens: bool = True,
                       bound: PromptBound | None = None,
                       truncation: PromptTruncation | None = None) -> list[EnginePrompt]:
    """One `EnginePrompt` per prompt in a completions request (none tokenized if any is over
    `bound`), each keeping what `truncation` keeps. A text prompt's echo is its text, as sent
    (vLLM's); a token-id prompt's is what its kept tokens decode to."""
    items = _prompt_items(prompt)
    if not items:
        raise invalid_request("prompt must not be empty", param="prompt")
    if truncation is not None:
        items = [item if isinstance(item, str) else truncation.apply(item) for item in items]
    if bound is not None:
        for item in items:
            if isinstance(item, str):
                bound.check_text(item, "prompt")
            else:
                bound.check_num_tokens(len(item), "prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            token_ids = tokenizer.encode(item, add_special_tokens=add_special_tokens)
            prompts.append(EnginePrompt(truncation.apply(token_ids) if truncation is not None else token_ids, item))
        else:
            check_token_ids(item, tokenizer.vocab_size, "prompt")
            prompts.append(EnginePrompt(list(item), tokenizer.decode(item, skip_special_tokens=False)))
        if not prompts[-1].token_ids:
            raise invalid_request("prompt must not be empty", param="prompt")
    return prompts
