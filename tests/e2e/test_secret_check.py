"""The secrets a service starts with (services/common/secret_check.py): placeholders and short
values are refused, naming the flag and variable but never the value; a user's API key only when
it is a placeholder (a short one warned about, deploy's keeping the full rule); unset stays
allowed. Then each service, started as `myvllm worker | scheduler | gateway | serve` in a process
of its own, exits non-zero at once on such a secret, before it loads or starts anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.secret_check import MIN_SECRET_BYTES, check_service_secrets, redis_password, secret_problem

REPO = Path(__file__).resolve().parents[2]
GOOD = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"  # as `openssl rand -hex 32` gives


@pytest.mark.parametrize("value", ["REPLACE_ME", "replace-me", "Replace_Me", "changeme", "CHANGE_ME", "change-it",
                                   "REPLACE_ME_WITH_A_LONG_RANDOM_SECRET", "your-api-key", "placeholder-token-000",
                                   "PASSWORD", "secret"])
def test_placeholders_are_refused_in_any_spelling(value: str) -> None:
    assert secret_problem(value) == "is a placeholder"


def test_short_and_degenerate_values_are_refused() -> None:
    assert secret_problem("a1b2c3d4e5f6g7h") == f"is shorter than {MIN_SECRET_BYTES} bytes"  # 15 bytes
    assert secret_problem("é" * 7 + "ab") is None  # 9 characters, 16 bytes: bytes count
    assert secret_problem("x" * 40) == "is one character repeated"
    assert secret_problem("a1b2c3d4e5f6g7h8") is None  # 16 bytes
    assert secret_problem(GOOD) is None


def test_the_error_names_every_bad_secret_but_no_value() -> None:
    with pytest.raises(ValueError) as caught:
        check_service_secrets(internal_token="REPLACE_ME", api_key="your-api-key",
                              redis_url="redis://:changeme@redis:6379/0")
    message = str(caught.value)
    assert "--internal-token / $MYVLLM_INTERNAL_TOKEN is a placeholder" in message
    assert "--api-key / $MYVLLM_API_KEY is a placeholder" in message
    assert "the password in --redis / $MYVLLM_REDIS_URL is a placeholder" in message
    assert not any(v in message for v in ("REPLACE_ME", "your-api-key", "changeme"))


def test_unset_secrets_and_real_ones_pass() -> None:
    check_service_secrets()  # no token check, an open API, a Redis without a password: as before
    check_service_secrets(internal_token="", api_key=None, redis_url="redis://127.0.0.1:6379/0")
    check_service_secrets(internal_token=GOOD, api_key=GOOD, redis_url=f"redis://:{GOOD}@127.0.0.1:6379/0")
    assert redis_password(f"redis://user:{GOOD}@h:1/0") == GOOD and redis_password("redis://h:1/0") is None


def _start(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if k not in ("MYVLLM_INTERNAL_TOKEN", "MYVLLM_API_KEY", "MYVLLM_REDIS_URL")}
    return subprocess.run([sys.executable, "-m", "services.entrypoints.cli", *args], cwd=REPO, capture_output=True,
                          text=True, env=base | {"PYTHONPATH": str(REPO)} | env, timeout=120)


def test_every_service_refuses_a_placeholder_or_short_secret_at_start_up(smollm2_dir: str) -> None:
    """As a Secret applied unedited, or a compose env file with a sample value, would start them."""
    cases = [
        (["worker", "--port", "1", "--model", smollm2_dir], {"MYVLLM_INTERNAL_TOKEN": "REPLACE_ME"},
         "--internal-token / $MYVLLM_INTERNAL_TOKEN is a placeholder", "REPLACE_ME"),
        (["scheduler", "--port", "1", "--workers", "127.0.0.1:2"],
         {"MYVLLM_INTERNAL_TOKEN": GOOD, "MYVLLM_REDIS_URL": "redis://:CHANGE_ME@127.0.0.1:1/0"},
         "the password in --redis / $MYVLLM_REDIS_URL is a placeholder", "CHANGE_ME"),
        (["gateway", "--port", "1", "--scheduler", "127.0.0.1:2", "--model", smollm2_dir],
         {"MYVLLM_INTERNAL_TOKEN": GOOD, "MYVLLM_API_KEY": "your-api-key"},
         "--api-key / $MYVLLM_API_KEY is a placeholder", "your-api-key"),
        (["serve", "--model", smollm2_dir, "--api-key", "sk-short", "REPLACE_ME"], {},
         "--api-key / $MYVLLM_API_KEY (key 2) is a placeholder", "REPLACE_ME"),
        (["serve", "--model", smollm2_dir, "--internal-token", "changeme"], {},
         "--internal-token / $MYVLLM_INTERNAL_TOKEN is a placeholder", "changeme"),
    ]
    for args, env, message, value in cases:
        result = _start(args, env)
        assert result.returncode != 0, (args[0], result.stderr[-2000:])
        assert message in result.stderr, (args[0], result.stderr[-2000:])
        assert value not in result.stderr, args[0]
        assert "Traceback" not in result.stderr, args[0]
