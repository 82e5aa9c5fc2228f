"""`myvllm serve`'s banner: its ready-to-paste curl line works as printed, with --api-key too."""

from __future__ import annotations

from services.entrypoints.launcher import _curl_example

BODY = '{"model": "m", "messages": [{"role": "user", "content": "Hello!"}]}'


def test_the_curl_line_without_api_key() -> None:
    assert _curl_example("http://localhost:8000/v1", "m", None) == (
        f"curl http://localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{BODY}'")


def test_the_curl_line_carries_the_first_api_key() -> None:
    assert _curl_example("http://localhost:8000/v1", "m", ["k1", "k2"]) == (
        "curl http://localhost:8000/v1/chat/completions -H 'Content-Type: application/json' "
        f"-H \"Authorization: Bearer k1\" -d '{BODY}'")
