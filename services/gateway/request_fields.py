"""Keys of a chat or completions body that no field declares: ignored with a warning naming
them, as vLLM does (its clients send fields of newer or older vLLM versions), or a 400 naming
them under the gateway's --strict-request-fields (OpenAI's answer)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from services.gateway.errors import unrecognized_fields
from services.gateway.protocol_vllm import LenientModel

logger = logging.getLogger(__name__)


def _ignored_paths(value: Any, path: str) -> Iterator[str]:
    if isinstance(value, LenientModel):
        for key in value.ignored_keys:
            yield f"{path}.{key}" if path else key
        for name in type(value).model_fields:
            yield from _ignored_paths(getattr(value, name), f"{path}.{name}" if path else name)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _ignored_paths(item, f"{path}[{index}]")


def ignored_fields(body: LenientModel) -> list[str]:
    """Where `body` had undeclared keys, as parameter paths ("stream_options.usage", "tools[0].function.x")."""
    return list(_ignored_paths(body, ""))


def check_request_fields(body: LenientModel, strict: bool) -> None:
    """Log `body`'s undeclared keys (vLLM's warning), or refuse them when `strict`."""
    ignored = ignored_fields(body)
    if not ignored:
        return
    if strict:
        raise unrecognized_fields(ignored)
    logger.warning("The following fields were present in the request but ignored: {%s}",
                   ", ".join(repr(name) for name in ignored))
