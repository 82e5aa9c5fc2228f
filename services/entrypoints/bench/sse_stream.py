"""One streamed completion as the serve benchmarks time it: when each chunk that carried
tokens arrived, and how many it carried (from `continuous_usage_stats`, which vLLM's server
supports too, so a peer is timed the same way)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from services.entrypoints.bench.workload import BenchRequest


@dataclass(frozen=True)
class StreamTiming:
    """One streamed request: when it was sent, and (arrival time, tokens carried) of each chunk
    that carried tokens."""

    start_s: float
    chunks: tuple[tuple[float, int], ...]
    end_s: float = 0.0  # when the stream ended ([DONE]); 0 where unknown

    @property
    def time_per_output_token_s(self) -> float | None:
        """vLLM bench's TPOT: (end - first token) / (tokens - 1); None for one token."""
        n = self.num_tokens
        return (self.end_s - self.chunks[0][0]) / (n - 1) if n > 1 else None

    @property
    def num_tokens(self) -> int:
        return sum(k for _, k in self.chunks)

    @property
    def ttft_s(self) -> float:
        return self.chunks[0][0] - self.start_s

    @property
    def itl_s(self) -> list[float]:
        """Per-token inter-token latencies: the gap before each chunk after the first, once per
        token it carries (split evenly). The first chunk's own extra tokens have no gap to measure."""
        out: list[float] = []
        for (prev, _), (t, k) in zip(self.chunks, self.chunks[1:], strict=False):
            out.extend([(t - prev) / k] * k)
        return out


async def stream_request(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest) -> StreamTiming:
    """Stream one completion; the tokens of each chunk come from the usage it carries
    (`continuous_usage_stats`), so a chunk holding several tokens counts them all."""
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    start = time.perf_counter()
    chunks: list[tuple[float, int]] = []
    seen = 0
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"server answered {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error in the stream: {chunk['error']}")
            usage = chunk.get("usage")
            total = usage["completion_tokens"] if usage else seen + (1 if chunk.get("choices") else 0)
            if total > seen:
                chunks.append((now, total - seen))
                seen = total
    if seen != req.output_len:
        raise RuntimeError(f"got {seen} tokens for a request of {req.output_len}")
    return StreamTiming(start, tuple(chunks), time.perf_counter())
