"""The one rule for the secrets a service is started with: the internal token, Redis' password
(in the Redis URL) and the users' API keys.

The internal token and Redis' password must be real secrets when set: at least
`MIN_SECRET_BYTES` bytes and not a known placeholder (`REPLACE_ME`, `changeme`, ... in any case
and spelling). A deployment file applied unedited, or a value typed to try things out, would
otherwise give every caller who guesses it the run of the services.

A user's API key (serve / gateway `--api-key`, `$MYVLLM_API_KEY`) is what vLLM's users type on
the command line (`vllm serve --api-key k1 k2`): it is refused only when it is a placeholder,
and one shorter than `MIN_SECRET_BYTES` (or one character repeated) is accepted with one
WARNING line naming the flag. `myvllm deploy k8s --api-key` keeps the full rule: the key it
writes into a cluster's Secret guards an API that is meant to be reached.

Unset (or empty) stays allowed and means what it always meant: no token check, an open API, a
Redis without a password. Every service calls `check_service_secrets` before it starts; errors
and warnings name the flag or variable, never the value.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from services.common.auth import TOKEN_ENV
from services.common.redis_registry import REDIS_URL_ENV

API_KEY_ENV = "MYVLLM_API_KEY"
# Several API keys (vLLM's --api-key k1 k2) travel in $MYVLLM_API_KEY one per line: a key cannot
# hold a line break, since it is sent in an HTTP header.
API_KEYS_SEPARATOR = "\n"

MIN_SECRET_BYTES = 16
# Placeholders, compared with case and punctuation removed ("REPLACE_ME" and "replace-me" alike).
_PLACEHOLDERS = frozenset({
    "replaceme", "changeme", "changeit", "changethis", "placeholder", "secret", "password", "passw0rd", "token",
    "apikey", "yourapikey", "yoursecret", "yourtoken", "yourpassword", "todo", "fixme", "example", "dummy",
    "default", "insecure", "none", "null", "test",
})
# Words that make any value a placeholder, however long ("REPLACE_ME_WITH_A_REAL_TOKEN").
_PLACEHOLDER_WORDS = ("replaceme", "changeme", "placeholder")


def _is_placeholder(value: str) -> bool:
    normalized = re.sub(r"[^a-z0-9]", "", value.lower())
    return normalized in _PLACEHOLDERS or any(word in normalized for word in _PLACEHOLDER_WORDS)


def secret_problem(value: str) -> str | None:
    """Why `value` is not a usable secret (None: it is one). Never repeats the value."""
    if _is_placeholder(value):
        return "is a placeholder"
    if len(value.encode()) < MIN_SECRET_BYTES:
        return f"is shorter than {MIN_SECRET_BYTES} bytes"
    if len(set(value)) == 1:
        return "is one character repeated"
    return None


def _secrets_logger() -> logging.Logger:
    """The weak-API-key warning is always shown, whatever the process's logging setup (`serve`
    and the gateway check their secrets before they configure any)."""
    log = logging.getLogger("myvllm.secrets")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s myvllm: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


secrets_logger = _secrets_logger()


def redis_password(url: str | None) -> str | None:
    """The password a Redis URL carries (None: none)."""
    if not url:
        return None
    try:
        return urlsplit(url).password or None
    except ValueError:
        return None  # a malformed URL: the Redis client says what is wrong with it


def _problems(secrets: Mapping[str, str | None]) -> list[str]:
    return [f"{name} {problem}" for name, value in secrets.items()
            if value and (problem := secret_problem(value)) is not None]


def check_secrets(secrets: Mapping[str, str | None]) -> None:
    """`secrets`: what names each secret (its flag and environment variable) -> its value (None
    or empty: not set). ValueError naming every bad one, with how to make a real one."""
    bad = _problems(secrets)
    if bad:
        raise ValueError("; ".join(bad) + f": use a random secret of at least {MIN_SECRET_BYTES} bytes, e.g. "
                         "`openssl rand -hex 32`")


def split_api_keys(text: str | None) -> list[str] | None:
    """$MYVLLM_API_KEY's keys (None: none set)."""
    keys = [key for key in (text or "").split(API_KEYS_SEPARATOR) if key]
    return keys or None


def join_api_keys(keys: str | Sequence[str] | None) -> str | None:
    """The keys as $MYVLLM_API_KEY carries them (None: none)."""
    keys = [keys] if isinstance(keys, str) else [key for key in keys or () if key]
    return API_KEYS_SEPARATOR.join(keys) or None


def _named_api_keys(api_key: str | Sequence[str] | None) -> dict[str, str]:
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    return {f"--api-key / ${API_KEY_ENV}" + (f" (key {i + 1})" if len(keys) > 1 else ""): key
            for i, key in enumerate(keys)}


def check_service_secrets(*, internal_token: str | None = None, api_key: str | Sequence[str] | None = None,
                          redis_url: str | None = None, strict_api_key: bool = False,
                          warn_weak_api_key: bool = True) -> None:
    """What worker, scheduler, gateway, serve and deploy call with the secrets they were given
    (flag or environment, resolved): ValueError naming the flag and variable of each bad one.
    `api_key`: one key or several, each checked: refused when a placeholder, and when short
    only under `strict_api_key` (deploy's rule); otherwise a short key is accepted with one
    WARNING line, unless `warn_weak_api_key` is off (serve: the gateway it starts warns)."""
    named_keys = _named_api_keys(api_key)
    if strict_api_key:
        check_secrets({f"--internal-token / ${TOKEN_ENV}": internal_token, **named_keys,
                       f"the password in --redis / ${REDIS_URL_ENV}": redis_password(redis_url)})
        return
    placeholders = {name: key for name, key in named_keys.items() if _is_placeholder(key)}
    check_secrets({f"--internal-token / ${TOKEN_ENV}": internal_token, **placeholders,
                   f"the password in --redis / ${REDIS_URL_ENV}": redis_password(redis_url)})
    weak = _problems(named_keys)
    if weak and warn_weak_api_key:
        secrets_logger.warning("%s: accepted, but a client who guesses it has the API; use a random key of at "
                               "least %d bytes, e.g. `openssl rand -hex 32`", "; ".join(weak), MIN_SECRET_BYTES)
