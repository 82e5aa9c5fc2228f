"""Speed cost of the sampler: greedy vs a fully loaded sampling configuration.

    .venv/bin/python scripts/bench_sampling.py [--model DIR] [--prompts 32] [--prompt-len 128]
                                                [--output-len 64] [--repeats 2]

Both runs generate `prompts` random prompts of `prompt-len` tokens × `output-len` tokens
(ignore_eos) through the offline `LLM`; the sampled run uses temperature 0.8, top_p 0.9,
top_k 50, repetition_penalty 1.1, frequency_penalty 0.2, presence_penalty 0.2. The two
configurations alternate `repeats` times (the machine may be shared: keep the best run of
each) and the script prints output tokens/s and the sampled/greedy ratio. Prefix caching is
off so that every run computes the same prefills.

On a shared machine the end-to-end ratio is mostly noise, so the script also times the
sampler itself inside the engine (its calls and the metadata builds) and prints the ratio
implied by the best greedy run with the sampled run's sampler time in place of greedy's:
greedy time / (greedy time - greedy sampler time + sampled sampler time).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.offline import LLM, SamplingParams  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "SmolLM2-135M-Instruct"


class _Timed:
    """Wraps a callable, adding up the seconds spent in it (on CPU the work is done on return)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    # No prefix caching: every run computes the same prefills.
    llm = LLM(args.model, seed=0, enable_prefix_caching=False)
    runner = llm.worker.runner
    runner.sampler = sampler = _Timed(runner.sampler)
    runner._sampling_metadata = metadata = _Timed(runner._sampling_metadata)
    vocab = llm.engine.model_info.vocab_size
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, vocab - 1, size=args.prompt_len).tolist()}
               for _ in range(args.prompts)]
    configs = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True),
        "sampled": SamplingParams(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1,
                                  frequency_penalty=0.2, presence_penalty=0.2,
                                  max_tokens=args.output_len, ignore_eos=True),
    }
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm up
    best: dict[str, float] = {}
    best_time: dict[str, float] = {}
    sampler_time: dict[str, float] = {}
    for rep in range(args.repeats):
        for name, sp in configs.items():
            sampler.seconds = metadata.seconds = 0.0
            sampler.calls = 0
            start, cpu_start = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            tps = n / elapsed
            spent = sampler.seconds + metadata.seconds
            if tps > best.get(name, 0.0):
                best[name], best_time[name] = tps, elapsed
            sampler_time[name] = min(sampler_time.get(name, float("inf")), spent)
            print(f"run {rep} {name:8s}: {n} tokens in {elapsed:6.2f} s (CPU {cpu:6.1f} s) = {tps:6.1f} tok/s; sampler "
                  f"{1e3 * sampler.seconds / max(sampler.calls, 1):6.2f} ms/step over {sampler.calls} steps, "
                  f"metadata builds {1e3 * metadata.seconds:6.1f} ms in all ({spent / elapsed:.1%} of the run)",
                  flush=True)
    ratio = best["sampled"] / best["greedy"]
    implied = best_time["greedy"] / (best_time["greedy"] - sampler_time["greedy"] + sampler_time["sampled"])
    print(f"best greedy {best['greedy']:.1f} tok/s, best sampled {best['sampled']:.1f} tok/s: "
          f"sampled/greedy = {ratio:.1%} end to end, {implied:.1%} implied by the sampler times")


if __name__ == "__main__":
    main()
