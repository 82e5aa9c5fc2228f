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
                tools: list[dict[str, Any]] | None = None, bound: PromptBound | None = None) -> EnginePrompt:
    """Render `messages` (and the `tools` offered) with the chat template and, unless the text
    is over `bound`, tokenize the result."""
    if add_generation_prompt and continue_final_message:
        raise invalid_request("add_generation_prompt and continue_final_message cannot both be true",
                              param="continue_final_message")
    template_input = [_template_message(i, m) for i, m in enumerate(messages)]
    try:
        text = tokenizer.render_chat(template_input, add_generation_prompt, continue_final_message,
                                     chat_template_kwargs, tools)
    except Exception as e:  # jinja errors, raise_exception() in templates, missing template
        raise invalid_request(f"Could not apply the chat template: {e}", param="messages") from None
    if bound is not None:
        bound.check_text(text, "messages")
    # The template already placed BOS and other special tokens.
    return EnginePrompt(tokenizer.encode(text, add_special_tokens=False), text)


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
                       bound: PromptBound | None = None) -> list[EnginePrompt]:
    """One `EnginePrompt` per prompt in a completions request (none tokenized if any is over `bound`)."""
    items = _prompt_items(prompt)
    if not items:
        raise invalid_request("prompt must not be empty", param="prompt")
    if bound is not None:
        for item in items:
            if isinstance(item, str):
                bound.check_text(item, "prompt")
            else:
                bound.check_num_tokens(len(item), "prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append(EnginePrompt(tokenizer.encode(item, add_special_tokens=add_special_tokens), item))
        else:
            check_token_ids(item, tokenizer.vocab_size, "prompt")
            prompts.append(EnginePrompt(list(item), tokenizer.decode(item, skip_special_tokens=False)))
        if not prompts[-1].token_ids:
            raise invalid_request("prompt must not be empty", param="prompt")
    return prompts
