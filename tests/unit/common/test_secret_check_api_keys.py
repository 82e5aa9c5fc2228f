"""The API key rule (services/common/secret_check.py): a user's key is refused only when it is
a placeholder, a short one accepted with one WARNING line naming the flag (never the value);
the internal token, Redis' password and `deploy k8s --api-key` keep the full rule."""

from __future__ import annotations

import logging

import pytest

from services.common.secret_check import check_service_secrets, secrets_logger

GOOD = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"  # as `openssl rand -hex 32` gives


@pytest.fixture
def secrets_log(caplog: pytest.LogCaptureFixture):
    # The secrets logger does not propagate (it prints on its own); let caplog see it here.
    secrets_logger.propagate = True
    try:
        with caplog.at_level(logging.INFO, logger=secrets_logger.name):
            yield caplog
    finally:
        secrets_logger.propagate = False


def test_the_internal_token_and_redis_password_keep_the_length_rule() -> None:
    with pytest.raises(ValueError, match=r"--internal-token / \$MYVLLM_INTERNAL_TOKEN is shorter than 16 bytes"):
        check_service_secrets(internal_token="short-token", api_key=GOOD)
    with pytest.raises(ValueError, match=r"the password in --redis / \$MYVLLM_REDIS_URL is shorter than 16 bytes"):
        check_service_secrets(redis_url="redis://:short-pw@redis:6379/0")


def test_a_short_api_key_is_accepted_with_one_warning_naming_the_flag(secrets_log) -> None:
    """vLLM's users start `vllm serve --api-key k1 k2`: the same command line serves here."""
    check_service_secrets(internal_token=GOOD, api_key=["k1", "k2"])
    warnings = [r.getMessage() for r in secrets_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "--api-key / $MYVLLM_API_KEY (key 1) is shorter than 16 bytes" in warnings[0]
    assert "--api-key / $MYVLLM_API_KEY (key 2) is shorter than 16 bytes" in warnings[0]
    assert "k1" not in warnings[0] and "k2" not in warnings[0]
    secrets_log.clear()
    check_service_secrets(api_key="sk-short", warn_weak_api_key=False)  # (serve: its gateway warns)
    check_service_secrets(api_key=GOOD)
    assert not secrets_log.records
    with pytest.raises(ValueError, match="is a placeholder"):  # a placeholder stays refused, however long
        check_service_secrets(api_key=["k1", "REPLACE_ME_WITH_A_LONG_RANDOM_KEY"])


def test_deploy_keeps_the_full_rule_for_the_api_key() -> None:
    with pytest.raises(ValueError) as caught:
        check_service_secrets(api_key="sk-short", strict_api_key=True)
    assert "--api-key / $MYVLLM_API_KEY is shorter than 16 bytes" in str(caught.value)
    assert "sk-short" not in str(caught.value)
