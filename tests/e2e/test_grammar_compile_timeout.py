"""Structured-output grammars cannot stall a replica.

A grammar compiles in a helper process within --structured-outputs-compile-timeout seconds of
CPU time (services/engine/grammar_compiler.py): past it the compile is killed, the request
ends with a 400 naming the limit, and later compiles still work. A constrained request whose
allowed-token row is not filled yet sits the step out instead of holding it up. And a request
whose grammar work (compile wait, rows, matcher) outlasts --structured-outputs-request-timeout
of wall-clock time ends with a 400 naming that limit while the others run on.

Unit tests use the manager, its real helper process and the scheduler without a model; then
the real thing: a worker and a scheduler process (tests/support/replica.py) with a gateway in front,
and the inter-token latency of 8 unconstrained streams while a pathological schema compiles.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import pytest
import torch
from support.replica import Replica
from support.schedulers import scheduler_for

from services.client.grpc_client import AsyncClient, RequestRejected
from services.common.config import VllmConfig
from services.common.proto import myvllm_pb2 as pb
from services.common.sampling_params import SamplingParams
from services.common.structured_outputs import StructuredOutputsError
from services.engine.grammar_compiler import CompilerUnavailable, GrammarCompileTimeout
from services.engine.request import Request
from services.engine.scheduler import Scheduler
from services.engine.structured_output import GrammarBudgetExceeded, RequestGrammar, StructuredOutputManager
from services.gateway.server import BackgroundGateway
from services.offline import LLM, StructuredOutputsParams
from services.worker.grammar_mask import unpack_bitmask

VOCAB = 49152
# Nested bounded repetition: xgrammar expands it into a large automaton that takes seconds of CPU
# time to compile (and many more of wall-clock time on a loaded machine), against milliseconds for
# an ordinary schema.
SLOW_REGEX = r"(([a-z0-9 ]{1,200},){1,200}\|){1,5}"
UNIT_TIMEOUT_S = 0.5
# A JSON string whose pattern has a bounded repetition: it compiles at once, but filling one
# row of allowed tokens takes ~100 ms in most states (~30 us for an ordinary schema).
SLOW_FILL_SCHEMA = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-z0-9 ]{20,400}$"}},
                    "required": ["s"]}


# Compiles in milliseconds of CPU time, but the compiled grammar serializes to ~10 MB (~0.6 s to
# write, ~0.3 s to read back), which at the helper's low priority took 40-90 s of wall-clock time
# on a loaded machine; and its rows and matcher advances roughly double with every 4-byte token.
BUDGET_REGEX = "((a{1,1000}){1,1000}){1,1000}b"
UNIT_BUDGET_S = 0.3
BUDGET_MESSAGE = "a request may spend on it (--structured-outputs-request-timeout)"


def slow_spec(tag: str) -> pb.StructuredOutputs:
    """The slow regex, made a distinct constraint (a timed-out one stays cached as failed)."""
    return pb.StructuredOutputs(regex=f"{tag}{SLOW_REGEX}")


def helper_children(pid: int) -> list[int]:
    """The helper's live child processes (its running compiles)."""
    children: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        children += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return children


@pytest.fixture
def manager(smollm2_dir: str) -> Iterator[StructuredOutputManager]:
    m = StructuredOutputManager(smollm2_dir, vocab_size=VOCAB, eos_token_ids=[2], max_num_seqs=8,
                                compile_timeout_s=UNIT_TIMEOUT_S)
    yield m
    m.close()


def _request(request_id: str, prompt: list[int], grammar: RequestGrammar | None = None,
             max_tokens: int = 5) -> Request:
    request = Request(request_id, prompt, pb.SamplingParams(max_tokens=max_tokens), frozenset({2}),
                      max_tokens=max_tokens)
    request.grammar = grammar
    return request


def _run_until_failed(sched: Scheduler, timeout_s: float = 300) -> tuple[pb.RequestOutput, int]:
    """Step the scheduler (its free requests sampling token 7) until a request fails; that
    failure and how many steps ran meanwhile."""
    steps, failed = 0, []
    deadline = time.monotonic() + timeout_s
    while not failed:
        assert time.monotonic() < deadline, "no request failed"
        out = sched.schedule()
        scheduled = [r.request_id for r in out.new_requests] + [r.request_id for r in out.cached_requests]
        if scheduled:
            outputs = sched.update_from_output(out, pb.ModelRunnerOutput(
                step_id=out.step_id, request_ids=scheduled, sampled_token_ids=[7] * len(scheduled)))
            failed += [o for o in outputs if o.error]
            steps += 1
        failed += sched.take_failed_outputs()
        time.sleep(0.02)
    [out] = failed
    return out, steps


def _scheduler(manager: StructuredOutputManager) -> Scheduler:
    return scheduler_for(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
                     structured_output=manager)


# ---------------------------------------------------------------------- the compile helper


def test_a_compile_past_the_timeout_is_killed_and_the_helper_compiles_on(manager: StructuredOutputManager) -> None:
    slow = manager.grammar_for(slow_spec("a"))
    message = rf"did not compile within {UNIT_TIMEOUT_S:g} s of CPU time \(--structured-outputs-compile-timeout\)"
    with pytest.raises(GrammarCompileTimeout, match=message):
        slow.compiled.result(timeout=300)  # (the helper's start-up, seconds, is not counted)
    helper = manager.compiler.pid
    assert helper is not None and helper_children(helper) == []  # the compile was killed, nothing left running
    assert manager.num_compile_timeouts == 1 and manager.num_compiles == 0
    # The same helper compiles the next constraints (a timeout does not cost a restart).
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for spec in (pb.StructuredOutputs(json=json.dumps(schema)), pb.StructuredOutputs(regex="ab+")):
        assert manager.grammar_for(spec).compiled.result(timeout=60) is not None
    assert manager.compiler.pid == helper and manager.compiler.num_starts == 1 and manager.num_compiles == 2
    # The timed-out constraint stays cached as failed: sent again, it fails at once.
    again = manager.grammar_for(slow_spec("a"))
    assert again.compiled.done() and isinstance(again.compiled.exception(), GrammarCompileTimeout)
    assert manager.num_compile_timeouts == 1


def test_an_invalid_constraint_is_reported_by_the_helper(manager: StructuredOutputManager) -> None:
    grammar = manager.grammar_for(pb.StructuredOutputs(regex="(ab"))
    with pytest.raises(StructuredOutputsError, match="parenthesis") as info:
        grammar.compiled.result(timeout=300)
    assert info.value.param == "structured_outputs.regex"


def test_a_timed_out_request_ends_with_the_error_while_free_requests_run(manager: StructuredOutputManager) -> None:
    sched = _scheduler(manager)
    sched.add_request(_request("slow", [1, 2, 3], manager.grammar_for(slow_spec("b"))))
    sched.add_request(_request("free", [4, 5, 6], max_tokens=200))
    steps, failed = 0, []
    deadline = time.monotonic() + 300
    while not failed:
        assert time.monotonic() < deadline, "the slow compile never timed out"
        out = sched.schedule()
        scheduled = [r.request_id for r in out.new_requests] + [r.request_id for r in out.cached_requests]
        assert scheduled == (["free"] if "free" in sched.requests else [])
        if scheduled:
            outputs = sched.update_from_output(out, pb.ModelRunnerOutput(step_id=out.step_id, request_ids=["free"],
                                                                         sampled_token_ids=[7]))
            failed += [o for o in outputs if o.error]  # (a failure is reported with the next step's outputs)
            steps += 1
        failed += sched.take_failed_outputs()
        time.sleep(0.05)
    [out] = failed
    assert (out.request_id, out.error_kind, out.finish_reason) == ("slow", pb.INVALID_REQUEST, "abort")
    assert "did not compile within 0.5 s of CPU time (--structured-outputs-compile-timeout)" in out.error
    assert steps > 1 and "slow" not in sched.requests  # the free request ran a step each time meanwhile


def test_a_dead_helper_fails_its_compiles_as_the_engines_fault_and_a_new_one_starts(
        manager: StructuredOutputManager) -> None:
    manager.grammar_for(pb.StructuredOutputs(regex="warm")).compiled.result(timeout=300)
    sched = _scheduler(manager)
    grammar = manager.grammar_for(slow_spec("c"))
    sched.add_request(_request("slow", [1, 2, 3], grammar))
    time.sleep(0.2)  # the compile is running
    os.kill(manager.compiler.pid, signal.SIGKILL)
    with pytest.raises(CompilerUnavailable):
        grammar.compiled.result(timeout=60)
    sched.schedule()
    [out] = sched.take_failed_outputs()
    assert out.error_kind == pb.ENGINE_FAULT and "exited" in out.error
    # Not cached as failed: the same constraint is compiled again, by a new helper.
    assert manager.grammar_for(slow_spec("c")).compiled is not grammar.compiled
    assert manager.grammar_for(pb.StructuredOutputs(regex="ok")).compiled.result(timeout=300) is not None
    assert manager.compiler.num_starts == 2


def test_the_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="--structured-outputs-compile-timeout"):
        VllmConfig.from_engine_args(model="m", structured_outputs_compile_timeout=0)
    with pytest.raises(ValueError, match="--structured-outputs-request-timeout"):
        VllmConfig.from_engine_args(model="m", structured_outputs_request_timeout=-1)
    config = VllmConfig.from_engine_args(model="m", structured_outputs_request_timeout=2.5)
    assert VllmConfig.from_proto(config.to_proto()).structured_outputs_config.request_timeout_s == 2.5


def test_serve_passes_the_timeout_to_the_scheduler() -> None:
    from services.entrypoints.cli import build_parser
    from services.entrypoints.launcher import _serve_commands

    args = build_parser().parse_args(["serve", "--structured-outputs-compile-timeout", "3",
                                      "--structured-outputs-request-timeout", "7"])
    worker, scheduler, _ = (cmd for _, cmd, _ in _serve_commands(args, "/m", [[1]], [2], None))
    assert scheduler[scheduler.index("--structured-outputs-compile-timeout") + 1] == "3.0"
    assert scheduler[scheduler.index("--structured-outputs-request-timeout") + 1] == "7.0"
    assert "--structured-outputs-compile-timeout" not in worker and "--structured-outputs-request-timeout" not in worker
    parsed = build_parser().parse_args(scheduler[scheduler.index("services.entrypoints.cli") + 1:])
    assert parsed.structured_outputs_compile_timeout == 3.0 and parsed.structured_outputs_request_timeout == 7.0


def test_the_request_timeout_is_in_the_help_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    from services.common.config import DEFAULT_STRUCTURED_OUTPUTS_REQUEST_TIMEOUT_S
    from services.entrypoints.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--structured-outputs-request-timeout" in text
    assert f"(default {DEFAULT_STRUCTURED_OUTPUTS_REQUEST_TIMEOUT_S:g})" in text


# ---------------------------------------------------------------------- the per-request budget


@pytest.fixture
def budget_manager(smollm2_dir: str) -> Iterator[StructuredOutputManager]:
    """A manager whose requests may spend UNIT_BUDGET_S on grammar work (and whose compiles
    have the default CPU limit, so that only the budget ends them); its helper already started."""
    m = StructuredOutputManager(smollm2_dir, vocab_size=VOCAB, eos_token_ids=[2], max_num_seqs=8,
                                request_timeout_s=UNIT_BUDGET_S)
    m.grammar_for(pb.StructuredOutputs(regex="warm")).compiled.result(timeout=300)
    yield m
    m.close()


def test_a_compile_that_outlasts_the_budget_ends_its_request_while_free_requests_run(
        budget_manager: StructuredOutputManager) -> None:
    sched = _scheduler(budget_manager)
    grammar = budget_manager.grammar_for(pb.StructuredOutputs(regex=BUDGET_REGEX))
    sched.add_request(_request("slow", [1, 2, 3], grammar))
    sched.add_request(_request("free", [4, 5, 6], max_tokens=200))
    start = time.monotonic()
    out, steps = _run_until_failed(sched)
    took = time.monotonic() - start
    assert (out.request_id, out.error_kind, out.finish_reason) == ("slow", pb.INVALID_REQUEST, "abort")
    assert f"longer than the {UNIT_BUDGET_S:g} s of wall-clock time {BUDGET_MESSAGE}" in out.error, out.error
    assert took < UNIT_BUDGET_S + 2.0, took  # (it ends at a schedule past the budget, not at the compile's end)
    assert steps >= 1 and "slow" not in sched.requests and "free" in sched.requests
    assert sched.grammar.num_budget_exceeded == 1
    # The compile itself runs on (another request may share it) and stays cached: sent again
    # once compiled, the constraint starts at once (no compile wait counts against it).
    grammar.compiled.result(timeout=300)
    again = budget_manager.grammar_for(pb.StructuredOutputs(regex=BUDGET_REGEX))
    assert again.compiled is grammar.compiled and not again.over_budget()


def test_a_row_that_outlasts_the_budget_ends_its_request_and_wakes_an_idle_loop(
        budget_manager: StructuredOutputManager, monkeypatch: pytest.MonkeyPatch) -> None:
    """A running request whose allowed-token row takes longer than the budget: the engine loop,
    idle meanwhile, is woken at the deadline (on_ready), and the next schedule ends the request;
    the free request beside it ran every step."""
    grammar = budget_manager.grammar_for(pb.StructuredOutputs(regex="ab+"))
    grammar.compiled.result(timeout=300)
    release = threading.Event()
    fill = RequestGrammar._fill

    def held_fill(self: RequestGrammar):
        self._fill_started = time.monotonic()  # (what the real fill marks before xgrammar's call)
        release.wait(60)
        return fill(self)

    monkeypatch.setattr(RequestGrammar, "_fill", held_fill)
    woken = threading.Event()
    budget_manager.on_ready = woken.set
    sched = _scheduler(budget_manager)
    sched.add_request(_request("c", [1, 2, 3], grammar))
    sched.add_request(_request("f", [4, 5, 6], max_tokens=200))
    out = sched.schedule()
    assert [r.request_id for r in out.new_requests] == ["f"]  # "c" sits out: its row is not there
    start = time.monotonic()
    # Woken at the deadline, not when the row ends (60 s): the slack is for a busy machine's scheduling.
    assert woken.wait(10) and time.monotonic() - start < UNIT_BUDGET_S + 3.0
    assert grammar.over_budget() and isinstance(grammar.budget_error(), GrammarBudgetExceeded)
    sched.update_from_output(out, pb.ModelRunnerOutput(step_id=out.step_id, request_ids=["f"], sampled_token_ids=[7]))
    out = sched.schedule()
    assert [r.request_id for r in out.cached_requests] == ["f"]
    [failed] = sched.take_failed_outputs()
    assert failed.request_id == "c" and failed.error_kind == pb.INVALID_REQUEST and BUDGET_MESSAGE in failed.error
    release.set()


def test_matcher_advances_count_against_the_budget(budget_manager: StructuredOutputManager) -> None:
    """Each sampled token's matcher advance is timed: a grammar whose advances grow with the
    output (BUDGET_REGEX over 4-byte tokens) runs out of budget after some tokens."""
    budget_manager.grammar_for(pb.StructuredOutputs(regex=BUDGET_REGEX)).compiled.result(timeout=300)
    grammar = budget_manager.grammar_for(pb.StructuredOutputs(regex=BUDGET_REGEX))  # cached: no compile wait
    grammar.start([])
    assert not grammar.over_budget()
    grammar.row()
    before = grammar.seconds_spent()
    aaaa = 46880  # SmolLM2's "aaaa"
    tokens = 0
    while not grammar.over_budget():
        assert tokens < 64, "the advances never added up to the budget"
        assert grammar.accept(aaaa)
        tokens += 1
    assert grammar.seconds_spent() > before
    grammar.prefetch()
    assert grammar.pending is None and not grammar.row_ready  # no row is started past the budget
    # A step that needs its row anyway (sent before the request is ended; its token is dropped)
    # gets an unmasked one at once.
    assert grammar.row().shape == (1, budget_manager.num_words) and (grammar.row() == -1).all()


# ---------------------------------------------------------------------- allowed-token rows


def test_a_request_whose_row_is_not_filled_sits_the_step_out(manager: StructuredOutputManager,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The step waits a few ms at most for a row; the free request runs, the constrained one
    keeps its place and runs once its row is there."""
    sched = _scheduler(manager)
    grammar = manager.grammar_for(pb.StructuredOutputs(regex="ab+"))
    grammar.compiled.result(timeout=300)
    release = threading.Event()
    fill = RequestGrammar._fill

    def held_fill(self: RequestGrammar):
        release.wait(60)
        return fill(self)

    monkeypatch.setattr(RequestGrammar, "_fill", held_fill)
    sched.add_request(_request("c", [1, 2, 3], grammar))
    sched.add_request(_request("f", [4, 5, 6]))
    start = time.perf_counter()
    out = sched.schedule()
    assert time.perf_counter() - start < 1.0
    assert [r.request_id for r in out.new_requests] == ["f"] and not out.structured_output_request_ids
    assert sched.compiling_grammars() == [grammar] and sched.grammar.num_row_waits == 1
    release.set()
    manager.wait_for_any(sched.compiling_grammars(), timeout=30)
    sched.update_from_output(out, pb.ModelRunnerOutput(step_id=out.step_id, request_ids=["f"], sampled_token_ids=[7]))
    out = sched.schedule()
    assert [r.request_id for r in out.new_requests] == ["c"] and list(out.structured_output_request_ids) == ["c"]
    packed = np.frombuffer(out.grammar_bitmask, dtype="<i4").reshape(1, -1).copy()
    assert 0 < int(unpack_bitmask(torch.from_numpy(packed), VOCAB)[0].sum()) < VOCAB


def test_a_slow_filling_grammar_does_not_change_the_free_rows(smollm2_dir: str) -> None:
    """A real grammar whose rows take ~100 ms each: it sits steps out while its row fills, the
    free requests' greedy outputs are those of a run without it, and its output holds."""
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time"]
    with LLM(smollm2_dir, dtype="float32", seed=0) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
        constrained = SamplingParams(temperature=0, max_tokens=40,
                                     structured_outputs=StructuredOutputsParams(json=SLOW_FILL_SCHEMA))
        llm.generate(["Some JSON:"], constrained, use_tqdm=False)  # compiled (and cached) before
        before = llm.engine.stats()
        outputs = llm.generate(prompts + ["Some JSON:"], [free, free, constrained], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs[:2]] == alone
        text = outputs[2].outputs[0].text
        if outputs[2].outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(text), SLOW_FILL_SCHEMA)
        else:
            assert re.fullmatch(r'\{"s": ?"[a-z0-9 ]*', text), text  # cut by max_tokens, inside the string
        stats = llm.engine.stats()
        waits, steps = stats.grammar_row_waits - before.grammar_row_waits, stats.num_steps - before.num_steps
        print(f"\nslow-filling grammar: sat {waits} steps out; {steps} steps for 2 x 24 free tokens and "
              f"{len(outputs[2].outputs[0].token_ids)} constrained ones")
        assert waits > 0, "the slow rows never made the request sit a step out"
        # It ran in some of the free requests' steps (between its rows), not only after them.
        assert steps < 24 + len(outputs[2].outputs[0].token_ids)


# ---------------------------------------------------------------------- served: scheduler + worker + gateway

SERVED_TIMEOUT_S = 1.0
# Past the compile timeout's wall-clock backstop (10x it), so that the tests of timed-out compiles
# always meet that limit first, whatever the machine's load.
SERVED_BUDGET_S = 15.0
NUM_STREAMS = 8
STREAM_TOKENS = 64
REPEATS = 4
ITL_BOUND = 1.5


@pytest.fixture(scope="module")
def served(smollm2_dir: str) -> Iterator[tuple[Replica, str]]:
    replica = Replica(smollm2_dir, max_num_seqs=NUM_STREAMS + 2,
                      extra_scheduler_args=("--structured-outputs-compile-timeout", str(SERVED_TIMEOUT_S),
                                            "--structured-outputs-request-timeout", str(SERVED_BUDGET_S)))
    try:
        replica.wait_healthy()
        with BackgroundGateway(replica.address, smollm2_dir) as gateway:
            yield replica, gateway.url
    finally:
        replica.stop()


def test_a_timed_out_compile_is_a_400_naming_the_limit_and_later_ones_work(served: tuple[Replica, str]) -> None:
    replica, url = served
    for i, (path, body) in enumerate([("/v1/completions", {"prompt": "Answer:"}),
                                      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                      ("/v1/completions", {"prompt": "Answer:", "stream": True})]):
        request = {"model": Path(replica.model_dir).name, "max_tokens": 8, **body,
                   "structured_outputs": {"regex": f"http{i}{SLOW_REGEX}"}}
        response = httpx.post(url + path, json=request, timeout=600)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error", error
        assert (f"did not compile within {SERVED_TIMEOUT_S:g} s of CPU time (--structured-outputs-compile-timeout)"
                in error["message"]), error
    ok = httpx.post(url + "/v1/completions", timeout=600, json={
        "model": Path(replica.model_dir).name, "prompt": "Answer:", "max_tokens": 10, "temperature": 0,
        "structured_outputs": {"regex": "[0-9]{3}-[A-Z]{2}"}})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"][0]["text"]) == 6
    stats = replica.stats()
    assert stats.grammar_compile_timeouts == 3 and stats.grammar_compiles >= 1


def test_the_budget_regex_answers_within_the_budget_while_a_plain_request_runs(
        served: tuple[Replica, str]) -> None:
    """The regex of the report (answered after ~89 s before the budget existed): its request ends
    within the budget, with a 400 naming the limit or with its result; a plain streamed request
    sent beside it finishes normally."""
    replica, url = served
    model = Path(replica.model_dir).name
    warm = httpx.post(url + "/v1/completions", timeout=600, json={  # the compile helper is up
        "model": model, "prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "[0-9]+"}})
    assert warm.status_code == 200, warm.text
    results: dict[str, tuple[float, httpx.Response]] = {}

    def constrained() -> None:
        start = time.monotonic()
        response = httpx.post(url + "/v1/completions", timeout=600, json={
            "model": model, "prompt": "Answer:", "max_tokens": 8, "structured_outputs": {"regex": BUDGET_REGEX}})
        results["constrained"] = (time.monotonic() - start, response)

    thread = threading.Thread(target=constrained)
    thread.start()
    time.sleep(0.2)  # (its compile is under way)
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", timeout=600, json={
            "model": model, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}) as plain:
        assert plain.status_code == 200
        chunks = [json.loads(line[6:]) for line in plain.iter_lines() if line.startswith("data: {")]
    thread.join(SERVED_BUDGET_S + 60)
    assert chunks[-1]["usage"]["completion_tokens"] == 16
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    took, response = results["constrained"]
    print(f"\nthe budget regex answered {response.status_code} after {took:.1f} s")
    assert took < SERVED_BUDGET_S + 10, took
    if response.status_code == 400:
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error", error
        assert f"longer than the {SERVED_BUDGET_S:g} s of wall-clock time {BUDGET_MESSAGE}" in error["message"], error
    else:
        assert response.status_code == 200, response.text
        assert re.fullmatch(r"a*b?", response.json()["choices"][0]["text"]), response.text


async def _measure(address: str) -> tuple[list[float], list[float], int]:
    """The inter-token latency p99 of NUM_STREAMS greedy unconstrained streams, REPEATS times
    alone and REPEATS times with a pathological constraint compiling throughout (each one
    refused at the timeout is followed at once by another, distinct one); and how many were
    refused. One event loop for all of it (grpc.aio keeps to the loop it started on)."""
    async with AsyncClient(address, timeout=30) as client:

        async def streams() -> list[float]:
            async def stream(i: int) -> list[float]:
                arrivals = []
                sampling = SamplingParams(temperature=0, max_tokens=STREAM_TOKENS, ignore_eos=True)
                async for out in client.generate([100 + i, 200 + i, 300 + i, 400 + i], sampling):
                    arrivals += [time.perf_counter()] * len(out.new_token_ids)
                assert len(arrivals) == STREAM_TOKENS
                return arrivals

            arrivals = await asyncio.gather(*(stream(i) for i in range(NUM_STREAMS)))
            gaps = [b - a for times in arrivals for a, b in zip(times, times[1:], strict=False) if b > a]
            return gaps

        async def refused(tag: str) -> str:
            sampling = pb.SamplingParams(max_tokens=8, temperature=0, structured_outputs=slow_spec(tag))
            try:
                async for _ in client.generate([1, 2, 3], sampling):
                    pass
            except RequestRejected as e:
                return e.message
            raise AssertionError(f"the pathological constraint {tag} compiled within the limit")

        await streams()  # warm-up: the worker's first steps
        async for _ in client.generate([1, 2], pb.SamplingParams(max_tokens=2, structured_outputs=pb.StructuredOutputs(
                regex="warm"))):
            pass  # warm-up: the compile helper is started by the first constraint
        without, with_compile, num_refused = [], [], 0
        for rep in range(REPEATS):
            without.append(float(np.percentile(await streams(), 99)))
            done = asyncio.Event()

            async def feed(rep: int, done: asyncio.Event) -> int:
                n = 0
                while not done.is_set():
                    message = await refused(f"itl{rep}-{n}")
                    assert "did not compile within" in message, message
                    n += 1
                return n

            feeder = asyncio.create_task(feed(rep, done))
            await asyncio.sleep(0.3)  # its first compile is under way before the streams start
            gaps = await streams()
            done.set()
            num_refused += await asyncio.wait_for(feeder, 600)
            with_compile.append(float(np.percentile(gaps, 99)))
        return without, with_compile, num_refused


def test_a_compiling_pathological_schema_leaves_the_streams_inter_token_latency_alone(
        served: tuple[Replica, str]) -> None:
    replica, _ = served
    without, with_compile, num_refused = asyncio.run(_measure(replica.address))
    p99_without, p99_with = statistics.median(without), statistics.median(with_compile)
    print(f"\ninter-token latency p99 over {NUM_STREAMS} streams x {STREAM_TOKENS} tokens, median of {REPEATS} runs: "
          f"{p99_without * 1000:.1f} ms without a compile, {p99_with * 1000:.1f} ms with a pathological schema "
          f"compiling ({num_refused} refused at the timeout; runs: {[round(x * 1000, 1) for x in without]} / "
          f"{[round(x * 1000, 1) for x in with_compile]})")
    assert num_refused >= REPEATS
    assert p99_with <= ITL_BOUND * p99_without, (p99_with, p99_without)
