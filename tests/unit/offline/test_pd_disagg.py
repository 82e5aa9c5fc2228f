"""Prefill/decode disaggregation offline: a kv_producer LLM prefills (do_remote_decode, one token),
a kv_consumer LLM loads that KV from shared memory (do_remote_prefill) and decodes. Greedy text is
the colocated engine's; every block is free afterwards on both sides; nothing is left in shared
memory; a bad or missing segment means a local prefill with the same output."""

from __future__ import annotations

import os
import time

import pytest

from services.common.proto import myvllm_pb2 as pb
from services.common.sampling_params import SamplingParams
from services.offline.llm import LLM
from services.worker.step_validation import InvalidStep

BLOCK = 4
ENGINE = dict(dtype="float32", seed=0, block_size=BLOCK, max_model_len=256, num_gpu_blocks_override=96,
              max_num_batched_tokens=64)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog and keeps on running far away",
    "In a hole in the ground there lived a hobbit, not a nasty dirty wet hole",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little money",
]
MAX_TOKENS = 10


def kv_config(role: str, shm_dir: str, **extra) -> dict:
    return {"kv_connector": "SharedMemoryConnector", "kv_role": role,
            "kv_connector_extra_config": {"shm_dir": shm_dir, **extra}}


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("kv_shm"))


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: str, shm_dir: str):
    producer = LLM(tiny_llama_dir, kv_transfer_config=kv_config("kv_producer", shm_dir), **ENGINE)
    consumer = LLM(tiny_llama_dir, kv_transfer_config=kv_config("kv_consumer", shm_dir), **ENGINE)
    colocated = LLM(tiny_llama_dir, **ENGINE)
    yield producer, consumer, colocated
    for llm in (producer, consumer, colocated):
        llm.close()


def prefill(producer: LLM, prompts: list[str]) -> list[dict]:
    outs = producer.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1,
                                                     extra_args={"kv_transfer_params": {"do_remote_decode": True}}),
                             use_tqdm=False)
    return [o.kv_transfer_params for o in outs]


def decode(consumer: LLM, prompts: list[str], params: list[dict]):
    return consumer.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                      extra_args={"kv_transfer_params": p}) for p in params],
                             use_tqdm=False)


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def all_blocks_free(llm: LLM) -> bool:
    s = llm.engine.scheduler
    pool = s.kv_cache_manager.block_pool
    return pool.num_free_blocks == pool.num_blocks - 1 and not s.kv.finishing and not s.kv.waiting_for_remote


def segments(shm_dir: str) -> list[str]:
    return sorted(os.listdir(shm_dir))


def test_disaggregated_greedy_matches_colocated_and_frees_everything(engines, shm_dir):
    producer, consumer, colocated = engines
    expected = token_ids(colocated.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                            use_tqdm=False))
    params = prefill(producer, PROMPTS)
    for p, prompt in zip(params, PROMPTS, strict=True):
        n = len(producer.tokenizer.encode(prompt))
        assert p["do_remote_prefill"] and p["remote_handle"].startswith("mvkv-")
        assert p["remote_num_tokens"] == (n - 1) // BLOCK * BLOCK  # whole blocks, never the last token
    assert len(segments(shm_dir)) == len(PROMPTS)
    assert all_blocks_free(producer)  # saved: the producer's blocks went back
    conn = consumer.engine.scheduler.kv.connector
    loads_before = conn.num_loads
    outs = decode(consumer, PROMPTS, params)
    assert token_ids(outs) == expected
    assert conn.num_loads - loads_before == len(PROMPTS) and conn.num_load_failures == 0
    assert segments(shm_dir) == []  # each read once, then unlinked
    assert all_blocks_free(consumer) and all_blocks_free(producer)


def test_consumer_prefix_cache_serves_the_prompt_again_without_a_transfer(engines, shm_dir):
    producer, consumer, colocated = engines
    prompt = ["A long time ago in a galaxy far, far away, there was a small droid who liked to sing"]
    expected = token_ids(colocated.generate(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                            use_tqdm=False))
    params = prefill(producer, prompt)
    conn = consumer.engine.scheduler.kv.connector
    loads = conn.num_loads
    assert token_ids(decode(consumer, prompt, params)) == expected
    assert conn.num_loads == loads + 1
    again = decode(consumer, prompt, params)  # the same params: the segment is gone, the cache has it
    assert token_ids(again) == expected
    assert conn.num_loads == loads + 1 and again[0].num_cached_tokens == params[0]["remote_num_tokens"]
    # A fresh transfer of a prompt the consumer has cached: discarded unread.
    params = prefill(producer, prompt)
    assert len(segments(shm_dir)) == 1
    assert token_ids(decode(consumer, prompt, params)) == expected
    assert conn.num_loads == loads + 1 and segments(shm_dir) == []
    assert all_blocks_free(consumer)


@pytest.mark.parametrize("damage", ["corrupt_payload", "truncate", "missing", "other_prompt"])
def test_a_bad_segment_means_a_local_prefill_with_the_same_output(engines, shm_dir, damage):
    producer, consumer, colocated = engines
    prompt = [f"Damage test ({damage}): it was the best of times, it was the worst of times, the age of wisdom"]
    expected = token_ids(colocated.generate(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                            use_tqdm=False))
    params = prefill(producer, prompt)
    path = os.path.join(shm_dir, params[0]["remote_handle"])
    if damage == "corrupt_payload":
        with open(path, "r+b") as f:
            f.seek(-5, os.SEEK_END)
            byte = f.read(1)
            f.seek(-5, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "truncate":
        os.truncate(path, os.path.getsize(path) - 64)
    elif damage == "missing":
        os.unlink(path)
    else:  # the handle of another prompt's segment, with this prompt's hash: the hashes inside differ
        other = prefill(producer, ["Something else entirely, a prompt of its own that shares nothing at all here"])
        os.unlink(path)
        os.rename(os.path.join(shm_dir, other[0]["remote_handle"]), path)
    conn = consumer.engine.scheduler.kv.connector
    failures, loads = conn.num_load_failures, conn.num_loads
    assert token_ids(decode(consumer, prompt, params)) == expected
    assert conn.num_load_failures == failures + 1 and conn.num_loads == loads
    assert segments(shm_dir) == []
    assert all_blocks_free(consumer)


def test_params_for_another_prompt_are_not_loaded(engines, shm_dir):
    """The consumer scheduler checks the params' last block hash against its own prompt first."""
    producer, consumer, colocated = engines
    params = prefill(producer, ["One prompt that the producer prefilled for somebody else, long enough"])
    prompt = ["Another prompt entirely, which the consumer is asked to decode with those params"]
    expected = token_ids(colocated.generate(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                            use_tqdm=False))
    conn = consumer.engine.scheduler.kv.connector
    loads, failures = conn.num_loads, conn.num_load_failures
    assert token_ids(decode(consumer, prompt, params)) == expected
    assert (conn.num_loads, conn.num_load_failures) == (loads, failures)
    assert segments(shm_dir) == []  # discarded unread
    assert all_blocks_free(consumer)


def test_unread_segments_expire_and_go_when_the_producer_closes(tiny_llama_dir, tmp_path):
    shm = str(tmp_path)
    with LLM(tiny_llama_dir, kv_transfer_config=kv_config("kv_producer", shm, segment_ttl_s=30), **ENGINE) as llm:
        prefill(llm, PROMPTS[:2])
        assert len(segments(shm)) == 2
        connector = llm.worker.kv_connector
        connector.sweep()
        assert len(segments(shm)) == 2  # not yet expired
        connector.sweep(now=float("inf"))
        assert segments(shm) == []
        prefill(llm, PROMPTS[:1])
        assert len(segments(shm)) == 1
    assert segments(shm) == []  # close() deletes what nobody read


def test_requests_are_checked_against_the_engine_role(engines):
    producer, consumer, colocated = engines
    remote_decode = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    with pytest.raises(ValueError, match="do_remote_decode needs an engine"):
        consumer.generate(PROMPTS[:1], remote_decode, use_tqdm=False)
    with pytest.raises(ValueError, match="do_remote_decode needs an engine"):
        colocated.generate(PROMPTS[:1], remote_decode, use_tqdm=False)
    with pytest.raises(ValueError, match="not a transfer handle"):
        consumer.generate(PROMPTS[:1], SamplingParams(extra_args={"kv_transfer_params": {
            "do_remote_prefill": True, "remote_handle": "../../etc/passwd", "remote_num_tokens": 4,
            "remote_block_hash": "00" * 32}}), use_tqdm=False)
    with pytest.raises(ValueError, match="unknown field"):
        consumer.generate(PROMPTS[:1], SamplingParams(extra_args={"kv_transfer_params": {"do_remote": True}}),
                          use_tqdm=False)
    assert all_blocks_free(consumer) and all_blocks_free(producer)


def test_kv_both_with_async_scheduling_mixes_loads_with_running_requests(tiny_llama_dir, tmp_path, engines):
    """kv_both engines with two steps in flight: one request loads its prompt's KV while another
    (local) one prefills and decodes in the same steps; greedy output is still the colocated one."""
    colocated = engines[2]
    shm = str(tmp_path)
    config = dict(ENGINE, async_scheduling=True, kv_transfer_config=kv_config("kv_both", shm))
    with LLM(tiny_llama_dir, **config) as a, LLM(tiny_llama_dir, **config) as b:
        expected = token_ids(colocated.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                                use_tqdm=False))
        params = prefill(a, PROMPTS[1:])
        mixed = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)] + [
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, extra_args={"kv_transfer_params": p})
            for p in params]
        assert token_ids(b.generate(PROMPTS, mixed, use_tqdm=False)) == expected
        assert b.engine.scheduler.kv.connector.num_loads == 2
        assert segments(shm) == [] and all_blocks_free(a) and all_blocks_free(b)


def test_the_worker_refuses_connector_metadata_it_cannot_apply(engines):
    producer, consumer, colocated = engines
    handle = "mvkv-" + "a" * 32
    load = pb.KVLoad(request_id="x", handle=handle, block_ids=[1], block_hashes=[b"\0" * 32])
    cases = [
        (colocated, pb.KVConnectorMetadata(discard_handles=[handle]), "has no KV connector"),
        (producer, pb.KVConnectorMetadata(loads=[load]), "sent to a kv_producer"),
        (consumer, pb.KVConnectorMetadata(loads=[pb.KVLoad(request_id="x", handle=handle, block_ids=[10**6],
                                                           block_hashes=[b"\0" * 32])]), "outside"),
        (consumer, pb.KVConnectorMetadata(loads=[pb.KVLoad(request_id="x", handle=handle, block_ids=[0],
                                                           block_hashes=[b"\0" * 32])]), "outside"),
        (consumer, pb.KVConnectorMetadata(loads=[pb.KVLoad(request_id="x", handle=handle, block_ids=[1, 2],
                                                           block_hashes=[b"\0" * 32])]), "differ in length"),
        (consumer, pb.KVConnectorMetadata(discard_handles=["../etc/passwd"]), "not a transfer handle"),
    ]
    for llm, meta, message in cases:
        with pytest.raises(InvalidStep, match=message):
            llm.worker.execute(pb.SchedulerOutput(step_id=10**6, kv_connector_metadata=meta))


def test_a_consumer_without_prefix_caching_loads_too(tiny_llama_dir, engines):
    producer, _, colocated = engines
    shm = producer.worker.kv_connector.directory  # (the module's shared directory)
    expected = token_ids(colocated.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                            use_tqdm=False))
    with LLM(tiny_llama_dir, kv_transfer_config=kv_config("kv_consumer", shm), enable_prefix_caching=False,
             **ENGINE) as consumer:
        params = prefill(producer, PROMPTS[:2])
        assert token_ids(decode(consumer, PROMPTS[:2], params)) == expected
        assert consumer.engine.scheduler.kv.connector.num_loads == 2
        assert segments(shm) == [] and all_blocks_free(consumer)


def test_a_producer_under_preemption_pressure_never_lets_a_save_read_reused_blocks(tiny_llama_dir, tmp_path,
                                                                                    engines):
    """Async scheduling keeps each max_tokens=1 prefill running for one more step, where it is the
    newest request and so the first preemption victim, while its save is in flight; decodes grow
    into a tiny pool beside it. The save thread is slowed (as a busy device or tmpfs would make it):
    had the victim's blocks been freed, a decode's KV would be in them by the time it reads them,
    and the consumer would decode from that. Greedy text on both sides is the colocated text."""
    _, _, colocated = engines
    shm = str(tmp_path)
    decodes = ["Once upon a time in a land far away there", "To be or not to be, that is the question"]
    prefills = [f"Prefill {i}: the rain in Spain stays mainly in the plain, said the professor" for i in range(4)]
    # (No prefix caching: a preempted request's freed blocks are anybody's at once, its own included.)
    config = dict(ENGINE, async_scheduling=True, num_gpu_blocks_override=20, enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=30)
    with LLM(tiny_llama_dir, kv_transfer_config=kv_config("kv_producer", shm), **config) as producer, \
            LLM(tiny_llama_dir, kv_transfer_config=kv_config("kv_consumer", shm), **ENGINE) as consumer:
        connector = producer.worker.kv_connector
        save = connector._save

        def slow_save(*args):
            time.sleep(0.3)
            return save(*args)

        connector._save = slow_save
        remote_decode = SamplingParams(temperature=0.0, max_tokens=1,
                                       extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        outs = producer.generate(decodes + prefills, [greedy] * len(decodes) + [remote_decode] * len(prefills),
                                 use_tqdm=False)
        assert producer.engine.scheduler.counters.num_preemptions > 0  # there was pressure
        assert token_ids(outs[:2]) == token_ids(colocated.generate(decodes, greedy, use_tqdm=False))
        params = [o.kv_transfer_params for o in outs[2:]]
        assert all(p["remote_handle"] for p in params)
        got = decode(consumer, prefills, params)
        assert consumer.engine.scheduler.kv.connector.num_loads == len(prefills)
        expected = colocated.generate(prefills, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
        assert token_ids(got) == token_ids(expected)
        assert segments(shm) == [] and all_blocks_free(producer) and all_blocks_free(consumer)
