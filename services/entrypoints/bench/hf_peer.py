"""The HuggingFace transformers peer: `AutoModelForCausalLM.generate` on one static batch.

All requests go in one left-padded batch with an attention mask. A static batch runs until
its longest request is done, so every row generates `max(output_len)` tokens
(`min_new_tokens` = `max_new_tokens`, which also keeps EOS from ending a row early); the
tokens past a request's own length are waste, and the benchmarks only count the useful ones.
Same weights (the model directory my-vllm loads), same dtype, same torch thread count, and
the same device the engine picks (CUDA when available, else CPU).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from services.entrypoints.bench.workload import BenchRequest, SamplingKnobs

__all__ = ["HFPeer", "OutputPenaltiesProcessor"]


class OutputPenaltiesProcessor:
    """OpenAI-style frequency / presence penalties over the generated tokens only (as vLLM
    applies them); HF generate has no built-in for these. A `LogitsProcessor`-compatible callable."""

    def __init__(self, prompt_len: int, frequency_penalty: float, presence_penalty: float) -> None:
        self.prompt_len = prompt_len
        self.frequency_penalty = frequency_penalty
        self.presence_penalty = presence_penalty

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_len:]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency_penalty * counts - self.presence_penalty * (counts > 0).to(scores.dtype)


class HFPeer:
    """transformers' `generate` on the same model directory, dtype and thread count."""

    name = "hf"

    def __init__(self, model_dir: str, dtype: str, seed: int = 0, device: str | None = None) -> None:
        from transformers import AutoModelForCausalLM

        from services.common.config import resolve_dtype_name

        self.seed = seed
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, resolve_dtype_name(dtype, "cpu")))
        self.model = model.to(self.device).eval()
        gen = self.model.generation_config
        pad = gen.pad_token_id if gen.pad_token_id is not None else self.model.config.pad_token_id
        if pad is None:
            eos = gen.eos_token_id if gen.eos_token_id is not None else self.model.config.eos_token_id
            pad = eos[0] if isinstance(eos, (list, tuple)) else eos
        self.pad_token_id = int(pad if pad is not None else 0)

    def _generate_kwargs(self, knobs: SamplingKnobs, prompt_len: int) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"do_sample": not knobs.greedy, "repetition_penalty": knobs.repetition_penalty}
        if not knobs.greedy:
            kwargs.update(temperature=knobs.temperature, top_p=knobs.top_p,
                          top_k=knobs.top_k if knobs.top_k > 0 else 0)
        if knobs.frequency_penalty or knobs.presence_penalty:
            from transformers import LogitsProcessorList

            kwargs["logits_processor"] = LogitsProcessorList([
                OutputPenaltiesProcessor(prompt_len, knobs.frequency_penalty, knobs.presence_penalty)])
        return kwargs

    @torch.inference_mode()
    def generate(self, requests: Sequence[BenchRequest], knobs: SamplingKnobs) -> float:
        """One static batch of all requests, run to the longest output length; returns seconds."""
        start = time.perf_counter()
        prompt_len = max(r.prompt_len for r in requests)
        max_new = max(r.output_len for r in requests)
        input_ids = torch.full((len(requests), prompt_len), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(requests), prompt_len), dtype=torch.long)
        for i, r in enumerate(requests):
            input_ids[i, prompt_len - r.prompt_len:] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
            attention_mask[i, prompt_len - r.prompt_len:] = 1
        if not knobs.greedy:
            torch.manual_seed(self.seed)
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
            max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=self.pad_token_id,
            **self._generate_kwargs(knobs, prompt_len))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        if out.shape[1] != prompt_len + max_new:
            raise RuntimeError(f"hf generated {out.shape[1] - prompt_len} tokens per row, expected {max_new}")
        return elapsed

    def close(self) -> None:
        del self.model
