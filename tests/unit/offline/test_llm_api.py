"""The vLLM-compatible offline API (`LLM.generate`, `LLM.chat`, `LLM.stats`) on SmolLM2."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.common.sampling_params import SamplingParams
from services.offline.llm import LLM
from services.offline.outputs import CompletionOutput, RequestOutput

GREEDY = dict(temperature=0.0)
CAPITAL_Q = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(smollm2_dir: str) -> Iterator[LLM]:
    with LLM(smollm2_dir, dtype="float32", seed=0) as llm:
        yield llm


@pytest.fixture(scope="module")
def capital_answer(llm: LLM) -> RequestOutput:
    (out,) = llm.chat(CAPITAL_Q, SamplingParams(max_tokens=32, **GREEDY), use_tqdm=False)
    return out


def _check_all_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_generate_string(llm: LLM) -> None:
    prompt = "The capital of France is"
    (out,) = llm.generate(prompt, SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
    assert isinstance(out, RequestOutput)
    assert out.prompt == prompt
    assert out.prompt_token_ids == llm.get_tokenizer().encode(prompt)
    assert out.finished
    (comp,) = out.outputs
    assert isinstance(comp, CompletionOutput)
    assert comp.index == 0
    assert len(comp.token_ids) == 5
    assert comp.finish_reason == "length"
    assert comp.text == llm.get_tokenizer().decode(comp.token_ids, skip_special_tokens=True)
    # every step counted in the engine's tokens-per-step histogram (vllm:iteration_tokens_total)
    stats = llm.engine.stats()
    assert sum(stats.iteration_tokens_counts) == stats.num_steps >= 5
    assert stats.iteration_tokens_sum >= len(out.prompt_token_ids) + 4
    assert comp.text.strip()
    _check_all_free(llm)


def test_generate_token_ids_dict_matches_string(llm: LLM) -> None:
    prompt = "The capital of France is"
    ids = llm.get_tokenizer().encode(prompt)
    sp = SamplingParams(max_tokens=6, **GREEDY)
    (from_ids,) = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)
    (from_str,) = llm.generate(prompt, sp, use_tqdm=False)
    assert from_ids.prompt_token_ids == ids
    assert from_ids.outputs[0].token_ids == from_str.outputs[0].token_ids
    assert from_ids.outputs[0].text == from_str.outputs[0].text


def test_generate_mixed_list_in_input_order(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    prompts = ["Once upon a time", {"prompt_token_ids": tok.encode("The sky is")}, "1, 2, 3, 4,",
               {"prompt_token_ids": [tok.encode("Hi")[0]]}]
    sp = SamplingParams(max_tokens=4, **GREEDY)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert len(outs) == 4
    assert outs[0].prompt_token_ids == tok.encode("Once upon a time")
    assert outs[1].prompt_token_ids == tok.encode("The sky is")
    assert outs[2].prompt_token_ids == tok.encode("1, 2, 3, 4,")
    assert outs[3].prompt_token_ids == tok.encode("Hi")[:1]
    assert len({o.request_id for o in outs}) == 4
    # Outputs are not shuffled: reversed input, reversed output.
    rev = llm.generate(prompts[::-1], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in rev] == [o.outputs[0].token_ids for o in outs][::-1]
    assert [o.prompt_token_ids for o in rev] == [o.prompt_token_ids for o in outs][::-1]
    _check_all_free(llm)


def test_one_sampling_params_per_prompt(llm: LLM) -> None:
    prompts = ["Paris is", "Water is", "The sun is"]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **GREEDY) for n in (2, 7, 4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 7, 4]
    assert [o.prompt for o in outs] == prompts
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    with pytest.raises(ValueError):
        llm.generate(prompts, params[:2], use_tqdm=False)
    _check_all_free(llm)


def test_max_tokens_gives_length(llm: LLM) -> None:
    (out,) = llm.generate("1, 2, 3, 4, 5,", SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].stop_reason is None


def test_chat_single_conversation(llm: LLM, capital_answer: RequestOutput) -> None:
    out = capital_answer
    comp = out.outputs[0]
    assert "Paris" in comp.text
    # The chat template was applied: the prompt holds the rendered conversation.
    assert out.prompt_token_ids == llm.apply_chat_template(CAPITAL_Q)
    assert len(out.prompt_token_ids) > len(llm.get_tokenizer().encode(CAPITAL_Q[0]["content"]))
    # The short answer ends with EOS: a stop, EOS kept in token_ids but not in the text.
    eos = llm.get_tokenizer().eos_token_id
    assert comp.finish_reason == "stop"
    assert comp.token_ids[-1] == eos
    assert llm.get_tokenizer().eos_token not in comp.text


def test_eos_stop_reason_is_none(capital_answer: RequestOutput) -> None:
    """vLLM: stop_reason is the stop string / stop_token_ids entry that ended the output, and
    None when it finished on EOS."""
    out = capital_answer
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason is None


def test_stop_token_ids_stop_reason(llm: LLM, capital_answer: RequestOutput) -> None:
    ref = capital_answer
    stop_id = ref.outputs[0].token_ids[2]
    (out,) = llm.chat(CAPITAL_Q, SamplingParams(max_tokens=32, stop_token_ids=[stop_id], **GREEDY),
                      use_tqdm=False)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids[:3]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop_id


def test_chat_list_of_conversations(llm: LLM, capital_answer: RequestOutput) -> None:
    convs = [CAPITAL_Q, [{"role": "user", "content": "What is 2 + 2? Answer with a number."}], CAPITAL_Q]
    outs = llm.chat(convs, SamplingParams(max_tokens=32, **GREEDY), use_tqdm=False)
    assert len(outs) == 3
    assert "Paris" in outs[0].outputs[0].text and "Paris" in outs[2].outputs[0].text
    # Batched with other conversations, the greedy answer is the one it gives alone.
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids == capital_answer.outputs[0].token_ids
    assert "4" in outs[1].outputs[0].text
    assert outs[1].prompt_token_ids == llm.apply_chat_template(convs[1])
    _check_all_free(llm)


def test_stats_keys(llm: LLM) -> None:
    llm.generate("Hello", SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    stats = llm.stats()
    expected = {"num_free_blocks", "num_total_blocks", "prefix_cache_queries", "prefix_cache_hits",
                "num_preemptions", "num_waiting", "num_running", "kv_cache_usage"}
    assert expected <= set(stats)
    assert stats["num_total_blocks"] > 0
    assert stats["prefix_cache_queries"] > 0
    assert stats["kv_cache_usage"] == 0.0
    _check_all_free(llm)


def test_prefix_cache_hit_through_api(llm: LLM) -> None:
    prompt = "A long shared system prompt. " * 12  # several full 16-token blocks
    sp = SamplingParams(max_tokens=2, **GREEDY)
    (first,) = llm.generate(prompt, sp, use_tqdm=False)
    hits_before = llm.stats()["prefix_cache_hits"]
    (second,) = llm.generate(prompt, sp, use_tqdm=False)
    num_full = 16 * ((len(first.prompt_token_ids) - 1) // 16)
    assert num_full >= 32
    assert llm.stats()["prefix_cache_hits"] - hits_before >= num_full
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_num_cached_tokens_reported(llm: LLM) -> None:
    """vLLM's RequestOutput.num_cached_tokens: prompt tokens served by the prefix cache."""
    prompt = "Another long shared system prompt, repeated. " * 10
    sp = SamplingParams(max_tokens=1, **GREEDY)
    (first,) = llm.generate(prompt, sp, use_tqdm=False)
    (second,) = llm.generate(prompt, sp, use_tqdm=False)
    num_full = 16 * ((len(first.prompt_token_ids) - 1) // 16)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == num_full


def test_seeded_sampling_reproducible(llm: LLM) -> None:
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    (a,) = llm.generate("Tell me a story:", sp, use_tqdm=False)
    (b,) = llm.generate("Tell me a story:", sp, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert len(a.outputs[0].token_ids) == 10
    # The same seeded request inside a batch of other (unseeded, sampled) requests: same ids.
    noisy = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(["Once", "Tell me a story:", "Why"], [noisy, sp, noisy], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == a.outputs[0].token_ids
    # Another seed gives another sample (10 tokens at temperature 1: equal only by a fluke).
    (c,) = llm.generate("Tell me a story:", SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)
    assert c.outputs[0].token_ids != a.outputs[0].token_ids


def test_n_returns_three_outputs(llm: LLM) -> None:
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate("My favourite food is", sp, use_tqdm=False)
    assert len(out.outputs) == 3
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # distinct sample streams
    (again,) = llm.generate("My favourite food is", sp, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    _check_all_free(llm)


def test_n_greedy_gives_identical_outputs(llm: LLM) -> None:
    (out,) = llm.generate("My favourite food is", SamplingParams(n=3, max_tokens=5, **GREEDY), use_tqdm=False)
    assert len(out.outputs) == 3
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == out.outputs[2].token_ids


# ---------------------------------------------------------------------- faults


LONG_PROMPT = ("A prefix long enough to fill several KV blocks of sixteen tokens: " * 4) + "The capital of France is"


def _failing_execute(llm: LLM, fail_at_call: int):
    """Make the worker's `fail_at_call`-th step (0-based) raise, before it computes anything."""
    real_execute, calls = llm.worker.execute, []

    def execute(so):
        calls.append(so.step_id)
        if len(calls) - 1 == fail_at_call:
            raise RuntimeError("injected worker fault")
        return real_execute(so)

    return execute


@pytest.fixture(scope="module")
def long_prompt_tokens(llm: LLM) -> list[int]:
    """LONG_PROMPT's greedy tokens from a run without faults."""
    (out,) = llm.generate(LONG_PROMPT, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)
    return out.outputs[0].token_ids


@pytest.mark.parametrize("fail_at_call", [0, 2])
def test_a_failed_step_raises_frees_everything_and_poisons_no_prefix(llm: LLM, long_prompt_tokens: list[int],
                                                                    monkeypatch, fail_at_call: int) -> None:
    from services.offline.llm import EngineFault

    sp = SamplingParams(max_tokens=6, **GREEDY)
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    # Start from no cached prefix, so the failing request's own (never written) blocks would be
    # the only cache entries for this prompt: exactly what a poisoned cache would serve.
    pool.reset_prefix_cache()
    monkeypatch.setattr(llm.worker, "execute", _failing_execute(llm, fail_at_call))
    with pytest.raises(EngineFault, match="injected worker fault"):
        llm.generate([LONG_PROMPT, "Another request in the same batch"], sp, use_tqdm=False)
    monkeypatch.undo()
    _check_all_free(llm)
    assert pool.cached_blocks == {} and all(b.block_hash is None for b in pool.blocks)
    # Still usable, and the prompt's blocks are computed again, not read from the cache.
    (again,) = llm.generate(LONG_PROMPT, sp, use_tqdm=False)
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == long_prompt_tokens
    _check_all_free(llm)
