"""Runs inside the vLLM peer's own venv (`make peer-vllm`): vLLM's offline `LLM`, driven by
`vllm_peer.py` over a pipe. Standard library and vllm only: this file must not import
my-vllm (that venv does not have it).

    python vllm_driver.py '<engine args as JSON>'

Protocol (one JSON object per line): the driver prints {"ready": ...} on its protocol stream
once the model is loaded; then, per line on stdin {"path": P}, it reads the workload from the
JSON file P ({"prompts": [[ids]], "output_lens": [...], "sampling": {...}}), runs it in one
`LLM.generate` call and answers {"elapsed_s": ..., "output_lens": [...]} (or {"error": ...}).
The protocol stream is the original stdout; everything else printed to stdout (vLLM's logs)
goes to stderr, so it cannot corrupt the protocol.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any


def _sampling_params(vllm: Any, knobs: dict[str, Any], output_len: int, seed: int) -> Any:
    top_k = int(knobs.get("top_k", -1))
    return vllm.SamplingParams(
        temperature=float(knobs.get("temperature", 0.0)), top_p=float(knobs.get("top_p", 1.0)),
        top_k=top_k if top_k > 0 else 0, repetition_penalty=float(knobs.get("repetition_penalty", 1.0)),
        frequency_penalty=float(knobs.get("frequency_penalty", 0.0)),
        presence_penalty=float(knobs.get("presence_penalty", 0.0)),
        max_tokens=output_len, min_tokens=0, ignore_eos=True, seed=seed)


def main() -> int:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM (and anything else) printing to stdout now writes to stderr
    engine = json.loads(sys.argv[1])
    seed = int(engine.get("seed", 0))

    import vllm

    llm = vllm.LLM(**engine)
    protocol.write(json.dumps({"ready": True, "vllm_version": vllm.__version__}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            with open(json.loads(line)["path"]) as f:
                work = json.load(f)
            prompts = [{"prompt_token_ids": ids} for ids in work["prompts"]]
            params = [_sampling_params(vllm, work["sampling"], n, seed) for n in work["output_lens"]]
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            reply = {"elapsed_s": elapsed, "output_lens": [len(o.outputs[0].token_ids) for o in outputs]}
        except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
            reply = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        protocol.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
