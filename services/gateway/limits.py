"""Bounds on what one HTTP request may ask of the gateway, checked before the work they bound.

The 8 MiB body limit (body_limit.py) bounds the request's bytes; these bound the parts whose
cost is not linear in their bytes, or that would otherwise be paid before the token-level
checks can refuse them:

- stop strings: every streamed delta of every choice is searched for each one (on the event
  loop), and the longest decides how much text is held back. OpenAI allows 4; vLLM has no
  limit. 64 strings of at most 1024 characters leave room for any real use (format and turn
  delimiters); 64 of them cost about 30 us per delta (the worst text, ~1000 held-back
  characters that end up matching none, about 50 ms once per ~1000 tokens).
- tools: each is rendered into the prompt by the chat template and, for tool_choice
  "required" or a named function, compiled into the output grammar. 128 is OpenAI's limit
  on `tools`; 64 KiB is far above a large real definition (128 of them fill the 8 MiB body).
- chat messages: the chat template loops over them in Python, about 30 us per message:
  4096 of them render in about 0.13 s (100,000 would take 4 s).
- the rendered prompt's characters: tokenizing costs one to two microseconds per character
  (an 8 MiB prompt: 17 s of a CPU), and a prompt refused for too many tokens has already
  paid it. Prose and code run 3-4.5 characters per token, CJK text under 1; only long runs
  of one symbol (64-80 characters per token in SmolLM2's vocabulary) go above 16. So a
  prompt over 16 x max_model_len characters is refused before its first token: a 7 MiB one
  at once, a real one that fits never (0 turns the check off).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.gateway.errors import invalid_request
from services.gateway.protocol import ChatCompletionToolParam, ChatMessage

DEFAULT_MAX_STOP_STRINGS = 64
DEFAULT_MAX_STOP_STRING_LENGTH = 1024  # characters
DEFAULT_MAX_TOOLS = 128  # OpenAI's limit
DEFAULT_MAX_TOOL_DEFINITION_BYTES = 64 * 1024  # one tool, serialized as JSON
DEFAULT_MAX_MESSAGES = 4096
DEFAULT_MAX_PROMPT_CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class RequestLimits:
    """The gateway's per-request bounds (their flags are named after the fields)."""

    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_string_length: int = DEFAULT_MAX_STOP_STRING_LENGTH
    max_tools: int = DEFAULT_MAX_TOOLS
    max_tool_definition_bytes: int = DEFAULT_MAX_TOOL_DEFINITION_BYTES
    max_messages: int = DEFAULT_MAX_MESSAGES
    # A prompt may have at most this many characters per token of the model's context (0: no check).
    max_prompt_chars_per_token: int = DEFAULT_MAX_PROMPT_CHARS_PER_TOKEN

    def __post_init__(self) -> None:
        for name in ("max_stop_strings", "max_stop_string_length", "max_tools", "max_tool_definition_bytes",
                     "max_messages"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_prompt_chars_per_token < 0:
            raise ValueError("--max-prompt-chars-per-token must not be negative, "
                             f"got {self.max_prompt_chars_per_token}")

    def check_stop(self, stop: str | list[str] | None) -> None:
        """A 400 naming `stop` (or the long one, `stop[i]`) beyond the count or length bound."""
        if stop is None:
            return
        stops = [stop] if isinstance(stop, str) else stop
        if len(stops) > self.max_stop_strings:
            raise invalid_request(f"{len(stops)} stop strings; at most {self.max_stop_strings} per request "
                                  "(--max-stop-strings)", param="stop")
        for i, text in enumerate(stops):
            if len(text) > self.max_stop_string_length:
                raise invalid_request(f"a stop string of {len(text)} characters; at most "
                                      f"{self.max_stop_string_length} (--max-stop-string-length)",
                                      param="stop" if isinstance(stop, str) else f"stop[{i}]")

    def check_tools(self, tools: Sequence[ChatCompletionToolParam] | None) -> None:
        """A 400 naming `tools` (or the large one, `tools[i]`) beyond the count or size bound."""
        if not tools:
            return
        if len(tools) > self.max_tools:
            raise invalid_request(f"{len(tools)} tools; at most {self.max_tools} per request (--max-tools)",
                                  param="tools")
        for i, tool in enumerate(tools):
            size = len(tool.model_dump_json(exclude_none=True).encode("utf-8"))
            if size > self.max_tool_definition_bytes:
                raise invalid_request(f"a tool definition of {size} bytes (as JSON); at most "
                                      f"{self.max_tool_definition_bytes} (--max-tool-definition-bytes)",
                                      param=f"tools[{i}]")

    def check_messages(self, messages: Sequence[ChatMessage]) -> None:
        if len(messages) > self.max_messages:
            raise invalid_request(f"{len(messages)} messages; at most {self.max_messages} per request "
                                  "(--max-messages)", param="messages")
