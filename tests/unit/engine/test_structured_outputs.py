"""Structured outputs through the offline `LLM` (the same EngineCore + Worker as the mesh):
JSON schemas, regex, choice and an EBNF grammar hold for greedy and sampled outputs; the
free rows of a mixed batch are untouched; invalid constraints are refused up front; a
request waits for its grammar without holding up the batch."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from support.schedulers import scheduler_for

from services.common.proto import myvllm_pb2 as pb
from services.common.structured_outputs import StructuredOutputsError, StructuredOutputsParams, build_grammar
from services.engine.request import Request
from services.engine.scheduler import Scheduler
from services.engine.structured_output import COMPILE_WORKERS, StructuredOutputManager
from services.offline import LLM, SamplingParams
from services.worker.grammar_mask import unpack_bitmask

SCHEMAS = json.loads((Path(__file__).resolve().parents[2] / "data" / "structured_output_schemas.json").read_text())

ARITHMETIC = r"""
root ::= expr
expr ::= term (" " op " " term)?
term ::= num | "(" num " " op " " num ")"
op ::= "+" | "-" | "*"
num ::= [1-9] [0-9]?
"""


@pytest.fixture(scope="module")
def llm(smollm2_dir: str) -> Iterator[LLM]:
    # Outputs are compared across runs: fp32. The grammar budget is raised: these tests check what
    # the grammars allow, and the compiles run at the lowest CPU priority, which other processes on
    # a loaded machine (a test run beside this one) can hold off for longer than the default 30 s;
    # the budget itself has its own tests (tests/e2e/test_grammar_compile_timeout.py).
    with LLM(smollm2_dir, dtype="float32", seed=0, structured_outputs_request_timeout=600) as llm:
        yield llm


def _chat(llm: LLM, contents: list[str], params: list[SamplingParams]) -> list:
    return llm.chat([[{"role": "user", "content": c}] for c in contents], params, use_tqdm=False)


def _greedy_and_sampled(spec: StructuredOutputsParams, max_tokens: int = 150) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec),
            SamplingParams(temperature=1.0, seed=7, max_tokens=max_tokens, structured_outputs=spec)]


def _check_all_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and not llm.engine.has_unfinished_requests()


def test_at_least_20_schemas_greedy_and_sampled_validate(llm: LLM) -> None:
    assert len(SCHEMAS) >= 20
    contents, params = [], []
    for schema in SCHEMAS:
        spec = StructuredOutputsParams(json=schema)
        for sp in _greedy_and_sampled(spec):
            contents.append(f"Reply with JSON that follows this schema: {json.dumps(schema)}")
            params.append(sp)
    outputs = _chat(llm, contents, params)
    for i, out in enumerate(outputs):
        completion = out.outputs[0]
        schema = SCHEMAS[i // 2]
        assert completion.finish_reason == "stop", (i, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)
    _check_all_free(llm)


def test_json_object(llm: LLM) -> None:
    spec = StructuredOutputsParams(json_object=True)
    outputs = _chat(llm, ["Describe a cat as a JSON object."] * 2, _greedy_and_sampled(spec, 200))
    for out in outputs:
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(out.outputs[0].text), dict)
        else:  # free-form JSON may run past max_tokens; what there is still starts an object
            assert out.outputs[0].text.startswith("{")


def test_json_object_grammar_takes_an_object_and_nothing_else() -> None:
    """vLLM's and OpenAI's json_object: an object (any keys, any whitespace), never a bare array
    or scalar, which xgrammar's builtin JSON grammar would take."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    grammar = build_grammar(pb.StructuredOutputs(json_object=True))
    assert accepts(grammar, '{"name": "Tom", "legs": [1, 2, {"left": true}]}')
    assert accepts(grammar, '{\n  "a":1\n}') and accepts(grammar, "{}")
    assert not accepts(grammar, '["a cat"]') and not accepts(grammar, '"a cat"') and not accepts(grammar, "3")


@pytest.mark.parametrize("pattern", [r"[A-Z][a-z]{2,8}, (yes|no)", r"\d{3}-\d{4}", r"(cat|dog)s? [0-9]{1,2}"])
def test_regex_outputs_fullmatch(llm: LLM, pattern: str) -> None:
    spec = StructuredOutputsParams(regex=pattern)
    for out in _chat(llm, ["Answer in the requested format."] * 2, _greedy_and_sampled(spec, 40)):
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text


def test_choice_outputs_are_in_the_set(llm: LLM) -> None:
    choices = ["Paris", "London", "Berlin", "New York City"]
    spec = StructuredOutputsParams(choice=choices)
    params = _greedy_and_sampled(spec, 20) + [SamplingParams(temperature=1.0, seed=s, max_tokens=20,
                                                             structured_outputs=spec) for s in range(4)]
    for out in _chat(llm, ["What is the capital of Germany?"] * len(params), params):
        assert out.outputs[0].text in choices
        assert out.outputs[0].finish_reason == "stop"


def test_ebnf_arithmetic_grammar_holds(llm: LLM) -> None:
    spec = StructuredOutputsParams(grammar=ARITHMETIC)
    term = r"(?:[1-9][0-9]?|\([1-9][0-9]? [-+*] [1-9][0-9]?\))"
    params = _greedy_and_sampled(spec, 40) + [SamplingParams(temperature=1.0, seed=s, max_tokens=40,
                                                             structured_outputs=spec) for s in range(3)]
    for out in _chat(llm, ["Write an arithmetic expression."] * len(params), params):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(rf"{term}(?: [-+*] {term})?", text), text
        eval(text, {"__builtins__": {}})  # noqa: S307 (the grammar admits only digits, ops, parens)


def test_mixed_batch_leaves_free_rows_identical(llm: LLM) -> None:
    free = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are"]
    free_params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(free, free_params, use_tqdm=False)
    constrained = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=s))
                   for s in SCHEMAS[:4]]
    mixed = llm.generate(free + ["Some JSON:"] * 4, [free_params] * 4 + constrained, use_tqdm=False)
    for a, m in zip(alone, mixed[:4], strict=True):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
    for m, schema in zip(mixed[4:], SCHEMAS[:4], strict=True):
        jsonschema.validate(json.loads(m.outputs[0].text), schema)


def test_grammar_cache_hits_and_compile_time(llm: LLM) -> None:
    manager = llm.engine.structured_output
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"]}
    spec = StructuredOutputsParams(json=schema)
    compiles, hits = manager.num_compiles, manager.cache_hits
    llm.generate(["x"] * 3, SamplingParams(temperature=0, max_tokens=20, structured_outputs=spec), use_tqdm=False)
    assert manager.num_compiles == compiles + 1
    assert manager.cache_hits == hits + 2
    stats = llm.engine.stats()
    assert stats.grammar_compiles == manager.num_compiles and stats.grammar_compile_seconds > 0


@pytest.mark.parametrize("kwargs, needle", [
    ({"json": {"type": "objec"}}, "Unsupported type"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "(abc"}, "parenthesis"),
    ({"grammar": "root ::= foo"}, "not defined"),
    ({"choice": []}, "non-empty strings"),
])
def test_invalid_constraints_are_refused(llm: LLM, kwargs: dict, needle: str) -> None:
    with pytest.raises(StructuredOutputsError, match=needle) as info:
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs)), use_tqdm=False)
    assert info.value.param.startswith("structured_outputs")
    _check_all_free(llm)


def test_schema_nesting_is_bounded() -> None:
    """xgrammar's conversion time grows fast with depth: a schema nested past the bound is a 400."""
    deep: dict = {"type": "integer"}
    for _ in range(40):  # 80 JSON levels: fine
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    StructuredOutputsParams(json=deep).to_proto()
    for _ in range(1000):  # past Python's own recursion limit too
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    with pytest.raises(StructuredOutputsError, match="more than 128 levels deep"):
        StructuredOutputsParams(json=deep).to_proto()
    text = '{"type": "integer"}'
    for _ in range(100):
        text = '{"type": "object", "properties": {"a": ' + text + '}}'
    with pytest.raises(StructuredOutputsError, match="more than 128 levels deep"):
        StructuredOutputsParams(json=text).to_proto()


def test_exactly_one_constraint() -> None:
    with pytest.raises(StructuredOutputsError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(StructuredOutputsError, match="exactly one"):
        StructuredOutputsParams()


def test_unpacked_bitmask_masks_like_xgrammar() -> None:
    import xgrammar as xgr

    vocab = 100
    rng = np.random.default_rng(0)
    packed = torch.from_numpy(rng.integers(-(2**31), 2**31, size=(3, 4), dtype=np.int64).astype(np.int32))
    logits = torch.randn(3, vocab)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, packed, vocab_size=vocab)
    ours = logits.masked_fill(~unpack_bitmask(packed, vocab), float("-inf"))
    assert torch.equal(ours, expected)


def test_request_waits_for_its_grammar_without_holding_up_the_batch(smollm2_dir: str) -> None:
    manager = StructuredOutputManager(smollm2_dir, vocab_size=49152, eos_token_ids=[2], max_num_seqs=8)
    try:
        sched = scheduler_for(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                              max_model_len=256, structured_output=manager)
        release = threading.Event()
        for _ in range(COMPILE_WORKERS):  # every compile thread is busy: the grammar stays pending
            manager._executor.submit(release.wait)
        constrained = Request("c", [1, 2, 3], pb.SamplingParams(max_tokens=5), frozenset({2}), max_tokens=5)
        constrained.grammar = manager.grammar_for(pb.StructuredOutputs(regex="ab+"))
        free = Request("f", [4, 5, 6], pb.SamplingParams(max_tokens=5), frozenset({2}), max_tokens=5)
        sched.add_request(constrained)
        sched.add_request(free)
        out = sched.schedule()
        assert [r.request_id for r in out.new_requests] == ["f"]
        assert [r.request_id for r in sched.waiting] == ["c"] and not out.structured_output_request_ids
        release.set()
        # Its compile, then its first row (a step waits 5 ms for rows at most; a loaded machine can take
        # longer): steps go on without it until both are ready, then it joins.
        deadline = time.monotonic() + 120
        while not any(r.request_id == "c" for r in out.new_requests):
            assert time.monotonic() < deadline, "the grammar never became ready"
            manager.wait_for_any(sched.compiling_grammars(), timeout=1)
            ids = [r.request_id for r in out.new_requests] + [r.request_id for r in out.cached_requests]
            sched.update_from_output(out, pb.ModelRunnerOutput(step_id=out.step_id, request_ids=ids,
                                                               sampled_token_ids=[7] * len(ids)))
            out = sched.schedule()
        assert [r.request_id for r in out.new_requests] == ["c"]
        assert list(out.structured_output_request_ids) == ["c"]
        packed = np.frombuffer(out.grammar_bitmask, dtype="<i4").reshape(1, -1).copy()
        allowed = unpack_bitmask(torch.from_numpy(packed), 49152)[0]
        assert 0 < int(allowed.sum()) < 49152  # only tokens starting with "a" (or "ab...")
    finally:  # (its compile helper is a process: never leave it behind)
        manager.close()


def _scheduler(smollm2_dir: str) -> tuple[StructuredOutputManager, Scheduler]:
    manager = StructuredOutputManager(smollm2_dir, vocab_size=49152, eos_token_ids=[2], max_num_seqs=8)
    return manager, scheduler_for(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                              max_model_len=256, structured_output=manager)


def _allowed(out: pb.SchedulerOutput, row: int = 0) -> torch.Tensor:
    packed = np.frombuffer(out.grammar_bitmask, dtype="<i4").reshape(len(out.structured_output_request_ids), -1)
    return unpack_bitmask(torch.from_numpy(packed.copy()), 49152)[row]


def test_a_migrated_request_resumes_its_grammar(smollm2_dir: str, llm: LLM) -> None:
    """Resumed output tokens (request migration) advance the matcher before the first step;
    tokens the grammar refuses end the request with an error instead."""
    tokenizer = llm.get_tokenizer()
    manager, sched = _scheduler(smollm2_dir)
    spec = pb.StructuredOutputs(choice=pb.StringList(values=["alphabet soup", "alpha"]))
    resumed = tokenizer.encode("alphabet", add_special_tokens=False)
    good = Request("good", [1, 2, 3], pb.SamplingParams(max_tokens=20), frozenset({2}), max_tokens=20,
                   resumed_output_token_ids=resumed)
    good.grammar = manager.grammar_for(spec)
    bad = Request("bad", [4, 5, 6], pb.SamplingParams(max_tokens=20), frozenset({2}), max_tokens=20,
                  resumed_output_token_ids=tokenizer.encode("beta", add_special_tokens=False))
    bad.grammar = manager.grammar_for(spec)
    sched.add_request(good)
    sched.add_request(bad)
    manager.wait_for_any(sched.compiling_grammars(), timeout=30)
    out = sched.schedule()
    assert [r.request_id for r in out.new_requests] == ["good"]
    allowed = _allowed(out)
    soup = tokenizer.encode(" soup", add_special_tokens=False)[0]
    assert allowed[soup] and not allowed[tokenizer.encode("alpha", add_special_tokens=False)[0]]
    failed = sched.take_failed_outputs()
    assert [(f.request_id, f.error_kind) for f in failed] == [("bad", pb.INVALID_REQUEST)]
    assert "does not match" in failed[0].error and "bad" not in sched.requests
    manager.close()


def test_constrained_requests_survive_preemption(smollm2_dir: str, llm: LLM) -> None:
    """A preempted constrained request keeps its matcher: the same greedy output as unpreempted."""
    schemas = SCHEMAS[:6]
    contents = [f"Reply with JSON that follows this schema: {json.dumps(s)}" for s in schemas]
    params = [SamplingParams(temperature=0, max_tokens=100, structured_outputs=StructuredOutputsParams(json=s))
              for s in schemas]
    expected = [out.outputs[0].token_ids for out in _chat(llm, contents, params)]
    small = LLM(smollm2_dir, dtype="float32", seed=0, num_gpu_blocks_override=14, block_size=16, max_num_seqs=8)
    # Every row waited for, so every constrained request is in every step (a loaded machine would
    # fill some rows after the 5 ms a step waits, and those requests would sit steps out).
    small.engine.scheduler.grammar.step_fill_wait_s = 60.0
    try:
        outputs = _chat(small, contents, params)
        assert small.stats()["num_preemptions"] > 0
        assert [out.outputs[0].token_ids for out in outputs] == expected
        for out, schema in zip(outputs, schemas, strict=True):
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
    finally:
        small.close()


def test_async_scheduling_gives_the_same_constrained_and_free_outputs(smollm2_dir: str, llm: LLM) -> None:
    """With async scheduling step N+1 is on the worker while step N's tokens are folded in: its
    constrained rows' bitmask follows it (the worker waits for it before sampling). Outputs are
    those of the synchronous engine."""
    prompts = ["The capital of France is", "Some JSON:", "Once upon a time", "More JSON:"]
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    json_spec = StructuredOutputsParams(json=SCHEMAS[0])
    regex_spec = StructuredOutputsParams(regex=r"[a-z]{3,6} [0-9]{2}")
    params = [free, SamplingParams(temperature=0, max_tokens=60, structured_outputs=json_spec), free,
              SamplingParams(temperature=0, max_tokens=60, structured_outputs=regex_spec)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    overlapped = LLM(smollm2_dir, dtype="float32", seed=0, async_scheduling=True, max_num_seqs=8)
    # Both grammars compiled (and cached) first: on a loaded machine the low-priority compiles
    # finish at different times, and a request waits for its own, so the two constrained requests
    # would not share steps. Cached, both start in the counted run's first step.
    overlapped.generate([prompts[1], prompts[3]], [SamplingParams(temperature=0, max_tokens=1, structured_outputs=spec)
                                                   for spec in (json_spec, regex_spec)], use_tqdm=False)
    followups = []
    scheduler_followup = overlapped.engine.scheduler.grammar_followup

    def counted(so: pb.SchedulerOutput) -> pb.SchedulerOutput | None:
        followup = scheduler_followup(so)
        if followup is not None:
            followups.append(len(followup.structured_output_request_ids))
        return followup

    overlapped.engine.scheduler.grammar_followup = counted
    overlapped.engine.scheduler.grammar.step_fill_wait_s = 60.0  # both constrained rows in every step, loaded or not
    try:
        assert overlapped.config.scheduler_config.async_scheduling
        assert [o.outputs[0].token_ids for o in overlapped.generate(prompts, params, use_tqdm=False)] == expected
        assert len(followups) > 10 and max(followups) == 2  # both constrained rows, step after step
        assert not overlapped.engine.scheduler.grammar.deferred_bitmasks
    finally:
        overlapped.close()


def test_deferred_bitmask_follows_the_tokens_in_flight(smollm2_dir: str, llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    manager = StructuredOutputManager(smollm2_dir, vocab_size=49152, eos_token_ids=[2], max_num_seqs=8)
    sched = scheduler_for(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
                      structured_output=manager, async_scheduling=True)
    request = Request("c", [1, 2, 3], pb.SamplingParams(max_tokens=20), frozenset({2}), max_tokens=20)
    request.grammar = manager.grammar_for(pb.StructuredOutputs(choice=pb.StringList(values=["alpha beta"])))
    sched.add_request(request)
    manager.wait_for_any(sched.compiling_grammars(), timeout=30)
    first = sched.schedule()
    assert list(first.structured_output_request_ids) == ["c"] and not first.grammar_bitmask_follows
    second = sched.schedule()  # while `first` is in flight: the matcher cannot know its token yet
    assert second.grammar_bitmask_follows and not second.structured_output_request_ids
    assert sched.grammar_followup(first) is None
    alpha, beta = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("alpha", " beta"))
    sched.update_from_output(first, pb.ModelRunnerOutput(step_id=first.step_id, request_ids=["c"],
                                                         sampled_token_ids=[alpha]))
    followup = sched.grammar_followup(second)
    assert followup.grammar_bitmask_only and followup.step_id == second.step_id
    allowed = _allowed(followup)
    assert allowed[beta] and int(allowed.sum()) < 10  # after "alpha": only " beta" (and its prefixes)
    assert sched.grammar_followup(second) is None and not sched.grammar.deferred_bitmasks
    manager.close()


@pytest.mark.parametrize("tp, pp, overlapped", [(2, 1, True), (1, 2, False)])
def test_model_parallel_ranks_apply_the_bitmask(tiny_llama_dir: str, tp: int, pp: int, overlapped: bool) -> None:
    """Real rank processes: two TP ranks with async scheduling (every rank masks the constrained
    rows with the bitmask that follows the step) and two pipeline stages (the last one masks and
    samples); the output is the single-rank synchronous one."""
    schemas = SCHEMAS[:3]
    prompts = [f"JSON for {json.dumps(s)}" for s in schemas] + ["Once upon a time"]
    params = [SamplingParams(temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=s))
              for s in schemas] + [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    results = []
    for args in ({}, {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "async_scheduling": overlapped}):
        engine = LLM(tiny_llama_dir, dtype="float32", seed=0, **args)
        try:
            outputs = engine.generate(prompts, params, use_tqdm=False)
        finally:
            engine.close()
        for out, schema in zip(outputs[:3], schemas, strict=True):
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
        results.append([o.outputs[0].token_ids for o in outputs])
    assert results[0] == results[1]


def test_an_invalid_spec_from_a_raw_client_ends_the_request_with_the_error(smollm2_dir: str) -> None:
    """The scheduler's port is public: a spec nobody checked is parsed off the engine loop and
    its request ends with INVALID_REQUEST naming the problem, while a valid one runs."""
    manager, sched = _scheduler(smollm2_dir)
    bad = Request("bad", [1, 2, 3], pb.SamplingParams(max_tokens=5), frozenset({2}), max_tokens=5)
    bad.grammar = manager.grammar_for(pb.StructuredOutputs(regex="(ab"))
    good = Request("good", [4, 5, 6], pb.SamplingParams(max_tokens=5), frozenset({2}), max_tokens=5)
    good.grammar = manager.grammar_for(pb.StructuredOutputs(regex="ab"))
    sched.add_request(bad)
    sched.add_request(good)
    while sched.compiling_grammars():
        manager.wait_for_any(sched.compiling_grammars(), timeout=30)
    out = sched.schedule()
    assert [r.request_id for r in out.new_requests] == ["good"]
    [failed] = sched.take_failed_outputs()
    assert (failed.request_id, failed.error_kind, failed.finish_reason) == ("bad", pb.INVALID_REQUEST, "abort")
    assert "structured_outputs.regex" in failed.error and "parenthesis" in failed.error
    manager.close()
