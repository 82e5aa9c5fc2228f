"""The KV tier end to end on the real model (--kv-offloading-size, files in a directory): prompts
whose prefixes the small KV pool evicts are loaded back from the tier on their second pass
instead of recomputed, with greedy text identical to an engine without a tier; a new engine on the
same directory (a restart) loads them too; tier files corrupted in between are refused and the
prompts recomputed, text still exact."""

from __future__ import annotations

import os
import random

import pytest

from services.common.block_hash import block_hashes
from services.common.sampling_params import SamplingParams
from services.offline import LLM

BLOCK = 16
POOL_BLOCKS = 1 + 30  # one 205-token prompt takes 13 blocks: the pool holds about two
rng = random.Random(0)
PROMPTS = [[rng.randrange(100, 40000) for _ in range(205)] for _ in range(6)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _run(model: str, prompts: list[list[int]], **tier) -> tuple[list[list[int]], dict]:
    """Each prompt alone, in order (so the pool evicts the earlier ones), then the stats."""
    with LLM(model, dtype="float32", block_size=BLOCK, num_gpu_blocks_override=POOL_BLOCKS, **tier) as llm:
        texts = [list(llm.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)[0].outputs[0].token_ids)
                 for p in prompts]
        return texts, llm.stats()


@pytest.fixture(scope="module")
def reference(smollm2_dir: str) -> list[list[int]]:
    texts = _run(smollm2_dir, PROMPTS)[0]
    return texts + texts


def test_evicted_prefixes_load_from_the_tier_and_survive_a_restart(smollm2_dir: str, reference, tmp_path) -> None:
    tier = {"kv_offloading_size": 0.25, "kv_offloading_dir": str(tmp_path)}
    texts, stats = _run(smollm2_dir, PROMPTS + PROMPTS, **tier)
    assert texts == reference
    assert stats["kv_tier_loads"] == len(PROMPTS) and stats["kv_tier_load_failures"] == 0
    assert stats["kv_tier_hits"] == len(PROMPTS) * 12 * BLOCK  # every block but the last token's
    assert stats["prefix_cache_hits"] == 0  # (the pool itself kept none of them)
    assert len(os.listdir(tmp_path)) == stats["kv_tier_blocks"] > 0
    # A new engine on the directory: the first answer reports the files; then every prompt loads.
    texts, stats = _run(smollm2_dir, [[5, 6, 7]] + PROMPTS, **tier)
    assert texts[1:] == reference[:len(PROMPTS)]
    assert stats["kv_tier_loads"] == len(PROMPTS) and stats["kv_tier_load_failures"] == 0


def test_corrupted_tier_files_are_refused_and_recomputed(smollm2_dir: str, reference, tmp_path) -> None:
    tier = {"kv_offloading_size": 0.25, "kv_offloading_dir": str(tmp_path)}
    _run(smollm2_dir, PROMPTS + PROMPTS[:1], **tier)
    # (the prompts the pool evicted; those it still held when the engine closed never reached the tier)
    in_tier = sum(block_hashes(p, BLOCK)[0].hex() + ".kvb" in os.listdir(tmp_path) for p in PROMPTS)
    assert in_tier >= 3
    for name in os.listdir(tmp_path):  # every file: one byte of its KV flipped
        path = tmp_path / name
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x40
        path.write_bytes(data)
    texts, stats = _run(smollm2_dir, [[5, 6, 7]] + PROMPTS, **tier)
    assert texts[1:] == reference[:len(PROMPTS)]
    assert stats["kv_tier_loads"] == 0 and stats["kv_tier_load_failures"] == in_tier
