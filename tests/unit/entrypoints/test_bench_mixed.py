"""`myvllm bench serve --workload mixed`, without processes: the workload, the latency
arithmetic, the report, and a deployment that fails to start."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from services.entrypoints.bench import mixed_workload as mw
from services.entrypoints.bench.workload import SAFE_TOKEN_ID_MIN

VOCAB = 1000


def _workload(seed: int = 0, **kw) -> mw.MixedWorkload:
    sizes = dict(long_prompts=3, long_input_len_min=40, long_input_len_max=60, long_output_len=4,
                 long_interval_s=1.5, short_input_len_min=5, short_input_len_max=9, short_output_len=7)
    sizes.update(kw)
    return mw.mixed_workload(**sizes, vocab_size=VOCAB, seed=seed)


def test_workload_sizes_arrivals_and_determinism():
    w = _workload()
    assert len(w.long_requests) == 3
    assert all(40 <= r.prompt_len <= 60 and r.output_len == 4 for r in w.long_requests)
    assert w.long_arrivals_s == [1.5, 3.0, 4.5]  # the first one interval after the short streams start
    shorts = [w.short_request(s, i) for s in range(4) for i in range(20)]
    assert all(5 <= r.prompt_len <= 9 and r.output_len == 7 for r in shorts)
    assert {r.prompt_len for r in shorts} == set(range(5, 10))
    ids = [t for r in shorts + w.long_requests for t in r.prompt_token_ids]
    assert SAFE_TOKEN_ID_MIN <= min(ids) and max(ids) < VOCAB - 1
    # Same seed: the same requests; distinct streams and indices: distinct prompts.
    again = _workload()
    assert again.long_requests == w.long_requests
    assert again.short_request(2, 5) == w.short_request(2, 5)
    assert len({tuple(r.prompt_token_ids) for r in shorts}) == len(shorts)
    other = _workload(seed=1)
    assert other.long_requests != w.long_requests and other.short_request(0, 0) != w.short_request(0, 0)
    # Long prompts share no prefix with the short ones nor with each other.
    firsts = {tuple(r.prompt_token_ids[:4]) for r in shorts + w.long_requests}
    assert len(firsts) == len(shorts) + len(w.long_requests)


@pytest.mark.parametrize("kw", [dict(long_interval_s=0), dict(long_prompts=0), dict(short_input_len_min=10),
                                dict(short_output_len=0), dict(long_input_len_min=70)])
def test_workload_rejects_bad_sizes(kw):
    with pytest.raises(ValueError):
        _workload(**kw)


def test_describe_and_select_deployments():
    text = _workload().describe(8)
    assert "8 short streams" in text and "3 long prompts (" in text and "every 1.5 s" in text
    assert mw.select_deployments("colocated,pd,pd-grpc") == mw.DEPLOYMENTS
    assert mw.select_deployments(" pd ") == [("pd", ("--prefill-replicas", "1", "--decode-replicas", "1"))]
    with pytest.raises(ValueError, match="unknown"):
        mw.select_deployments("colocated,disagg")
    with pytest.raises(ValueError):
        mw.select_deployments(",")


def test_ttft_and_per_token_itl_from_chunk_times():
    # Sent at 10.0; first token at 10.5; then one token 0.1 s later; then a chunk of 3 tokens 0.3 s later.
    t = mw.StreamTiming(10.0, ((10.5, 1), (10.6, 1), (10.9, 3)))
    assert t.num_tokens == 5
    assert t.ttft_s == pytest.approx(0.5)
    assert t.itl_s == pytest.approx([0.1, 0.1, 0.1, 0.1])
    # A first chunk of 2 tokens: its extra token has no gap; a single chunk: no ITL at all.
    assert mw.StreamTiming(0.0, ((1.0, 2), (1.4, 2))).itl_s == pytest.approx([0.2, 0.2])
    assert mw.StreamTiming(0.0, ((1.0, 4),)).itl_s == []
    # bench serve's per-request figure (vLLM's TPOT): (end - first token) / (tokens - 1).
    assert mw.StreamTiming(10.0, ((10.5, 1), (10.6, 1), (10.9, 3)), 11.3).time_per_output_token_s == \
        pytest.approx(0.2)
    assert mw.StreamTiming(0.0, ((1.0, 1),), 1.1).time_per_output_token_s is None


def test_percentiles_and_result_figures():
    assert mw.pct_ms([0.001 * i for i in range(1, 101)], 50) == pytest.approx(50.5)
    assert mw.pct_ms([0.001 * i for i in range(1, 101)], 99) == pytest.approx(99.01)
    assert math.isnan(mw.pct_ms([], 50))
    r = mw.MixedResult("colocated", ("--data-parallel-size", "2"))
    r.add(mw.StreamTiming(0.0, ((0.2, 1), (0.3, 1), (0.4, 2))), long=False)
    r.add(mw.StreamTiming(1.0, ((3.0, 1), (3.1, 1))), long=True)
    r.elapsed_s = 2.0
    assert (r.short_requests, r.long_requests, r.output_tokens) == (1, 1, 6)
    assert r.short_ttft_s == pytest.approx([0.2]) and r.long_ttft_s == pytest.approx([2.0])
    assert r.short_itl_s == pytest.approx([0.1, 0.05, 0.05])  # the long request's ITL is not a short one's
    d = r.to_dict()
    assert d["output_tok_s"] == pytest.approx(3.0)
    assert d["short_ttft_p50_ms"] == pytest.approx(200) and d["long_ttft_p99_ms"] == pytest.approx(2000)
    assert d["short_itl_p50_ms"] == pytest.approx(50) and d["error"] is None


def test_table_and_json(tmp_path):
    ok = mw.MixedResult("colocated", ("--data-parallel-size", "2"), elapsed_s=4.0)
    for i in range(4):
        ok.add(mw.StreamTiming(0.0, ((0.1 + i / 100, 1), (0.15 + i / 100, 1))), long=False)
    ok.add(mw.StreamTiming(0.0, ((1.25, 1),)), long=True)
    failed = mw.MixedResult("pd", ("--prefill-replicas", "1"), error="start: RuntimeError: exit code 2")
    table = mw.format_report([ok, failed]).splitlines()
    assert table[0].split()[:3] == ["deployment", "short", "reqs"]
    assert table[1].split() == ["colocated", "4", "115", "130", "50.0", "50.0", "1250", "1250", "2.2", "ok"]
    assert table[2].split() == ["pd"] + ["-"] * 8 + ["failed"]
    path = tmp_path / "mixed.json"
    from services.entrypoints.bench.workload import write_json

    write_json(str(path), mw.report_json(_workload(), 8, [ok, failed]))
    data = json.loads(path.read_text())["mixed"]
    assert data["workload"]["short_streams"] == 8 and data["workload"]["long_arrivals_s"] == [1.5, 3.0, 4.5]
    assert data["deployments"]["colocated"]["long_ttft_p50_ms"] == pytest.approx(1250)
    assert data["deployments"]["pd"]["error"].startswith("start: RuntimeError")


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    from services.entrypoints.bench import serve

    serve.add_arguments(p)
    args = p.parse_args(["--workload", "mixed", "--short-streams", "2", "--long-prompts", "2",
                         "--long-input-len-min", "20", "--long-input-len-max", "30"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_a_deployment_that_fails_to_start_is_a_failed_row_and_the_others_run(monkeypatch, capsys, tmp_path):
    started, stopped, driven = [], [], []

    def fake_start(args, extra):
        started.append((args.data_parallel_size, list(extra)))
        if "--prefill-replicas" in extra:
            raise RuntimeError("myvllm serve failed to start (exit code 2)")
        return "proc", "http://fake"

    async def fake_run_level(base_url, requests, concurrency, name=""):
        assert base_url == "http://fake" and len(requests) == concurrency == 2

    async def fake_drive(base_url, workload, short_streams, result):
        driven.append(result.deployment)
        result.add(mw.StreamTiming(0.0, ((0.1, 1), (0.2, 1))), long=False)
        result.add(mw.StreamTiming(0.0, ((0.5, 2),)), long=True)
        result.elapsed_s = 1.0

    monkeypatch.setattr(mw, "start_mesh", fake_start)
    monkeypatch.setattr(mw, "stop_mesh", stopped.append)
    monkeypatch.setattr(mw, "run_level", fake_run_level)
    monkeypatch.setattr(mw, "drive", fake_drive)
    out_json = tmp_path / "m.json"
    rc = mw.run(_args(mixed_deployments="pd,colocated", json=str(out_json)), VOCAB)
    out = capsys.readouterr().out
    assert rc == 1
    # The replicas come from each deployment's own flags, never from --data-parallel-size.
    assert started == [(1, ["--prefill-replicas", "1", "--decode-replicas", "1"]),
                       (1, ["--data-parallel-size", "2"])]
    assert driven == ["colocated"] and stopped == ["proc"]
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[-1:] in (["ok"], ["failed"])}
    assert rows["pd"][-1] == "failed" and rows["colocated"][-1] == "ok" and rows["colocated"][1] == "1"
    assert "pd failed: start: RuntimeError: myvllm serve failed to start (exit code 2)" in out
    assert json.loads(out_json.read_text())["mixed"]["deployments"]["colocated"]["output_tok_s"] == 4.0


def test_a_deployment_that_fails_while_serving_is_stopped_and_reported(monkeypatch, capsys):
    stopped = []

    async def fake_run_level(*a, **kw):
        return None

    async def failing_drive(base_url, workload, short_streams, result):
        raise ExceptionGroup("tasks", [RuntimeError("got 3 tokens for a request of 128")])

    monkeypatch.setattr(mw, "start_mesh", lambda args, extra: ("proc", "http://fake"))
    monkeypatch.setattr(mw, "stop_mesh", stopped.append)
    monkeypatch.setattr(mw, "run_level", fake_run_level)
    monkeypatch.setattr(mw, "drive", failing_drive)
    assert mw.run(_args(mixed_deployments="colocated"), VOCAB) == 1
    assert stopped == ["proc"]
    assert "colocated failed: run: RuntimeError: got 3 tokens for a request of 128" in capsys.readouterr().out


def test_run_refuses_base_url_and_data_parallel_size():
    with pytest.raises(ValueError, match="--base-url"):
        mw.run(_args(base_url="http://x"), VOCAB)
    with pytest.raises(ValueError, match="--data-parallel-size"):
        mw.run(_args(data_parallel_size=2), VOCAB)
