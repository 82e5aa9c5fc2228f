"""`myvllm bench throughput` / `bench latency`, run in-process through `services.entrypoints.cli.main` on tiny
workloads with the real SmolLM2 checkpoint: both peers report positive figures and the ratio
is the last line."""

from __future__ import annotations

import json
import re

import pytest

from services.entrypoints.bench.workload import SAFE_TOKEN_ID_MIN, format_table, random_requests
from services.entrypoints.cli import main

NUMBER = r"[0-9]+(?:\.[0-9]+)?"


def _rows(out: str, width: int) -> dict[str, list[float]]:
    """Table rows by peer name: lines whose first cell names a peer and whose other cells are numbers."""
    rows = {}
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0] in ("my-vllm", "my-vllm+spec", "hf", "llama.cpp") and len(cells) == width:
            rows[cells[0]] = [float("nan") if c == "n/a" else float(c) for c in cells[1:]]
    return rows


def test_random_requests_deterministic_and_in_range() -> None:
    a = random_requests(16, 5, 9, 2, 3, 1000, seed=7)
    b = random_requests(16, 5, 9, 2, 3, 1000, seed=7)
    assert a == b
    assert a != random_requests(16, 5, 9, 2, 3, 1000, seed=8)
    assert a[0].prompt_token_ids != random_requests(16, 5, 9, 2, 3, 1000, seed=7, stream=1)[0].prompt_token_ids
    for r in a:
        assert 5 <= r.prompt_len <= 9 and 2 <= r.output_len <= 3
        assert all(SAFE_TOKEN_ID_MIN <= t < 999 for t in r.prompt_token_ids)
    with pytest.raises(ValueError):
        random_requests(1, 10, 5, 1, 1, 1000, seed=0)


def test_format_table_aligns() -> None:
    text = format_table(["peer", "x"], [["a", 1], ["long-name", 12345]])
    lines = text.splitlines()
    assert len({len(line) for line in lines}) == 1
    assert lines[1].startswith("a ") and lines[1].endswith("1")


def test_bench_throughput_tiny(smollm2_dir: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    json_path = tmp_path / "throughput.json"
    rc = main(["bench", "throughput", "--model", smollm2_dir, "--num-prompts", "4", "--input-len-min", "8",
               "--input-len-max", "16", "--output-len-min", "4", "--output-len-max", "8", "--no-llamacpp",
               "--json", str(json_path)])
    assert rc == 0
    out = capsys.readouterr().out
    rows = _rows(out, 8)
    assert set(rows) == {"my-vllm", "hf"}
    for peer, (requests, prompt_tokens, output_tokens, elapsed, out_tps, total_tps, threads) in rows.items():
        assert requests == 4, peer
        assert 4 * 8 <= prompt_tokens <= 4 * 16 and 4 * 4 <= output_tokens <= 4 * 8
        assert elapsed > 0 and out_tps > 0 and total_tps > out_tps and threads >= 1
    # Both peers are charged the same useful tokens.
    assert rows["my-vllm"][:3] == rows["hf"][:3]
    last = out.strip().splitlines()[-1]
    match = re.fullmatch(rf"ratio my-vllm / hf \(output tok/s\): ({NUMBER})", last)
    assert match and float(match.group(1)) > 0
    data = json.loads(json_path.read_text())
    assert [r["peer"] for r in data["results"]] == ["my-vllm", "hf"]
    assert data["ratio_my_vllm_over_hf_output_tok_s"] > 0


def test_bench_latency_tiny(smollm2_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "latency", "--model", smollm2_dir, "--input-len", "16", "--output-len", "6",
               "--num-iters", "2", "--no-llamacpp"])
    assert rc == 0
    out = capsys.readouterr().out
    rows = _rows(out, 9)
    assert set(rows) == {"my-vllm", "hf"}
    for peer, (input_len, output_len, iters, ttft, e2e, _itl, _tps, threads) in rows.items():
        assert (input_len, output_len, iters) == (16, 6, 2), peer
        assert ttft > 0 and e2e > 0 and threads >= 1
    last = out.strip().splitlines()[-1]
    match = re.fullmatch(rf"ratio hf / my-vllm \(inter-token latency\): (-?{NUMBER})", last)
    assert match
    # The bandwidth floor of the model it ran, for each peer: bytes per token, floor, efficiency.
    assert re.search(rf"bandwidth floor: streaming read {NUMBER} GB/s", out)
    for peer in ("my-vllm", "hf"):
        assert re.search(rf"^  {peer}: {NUMBER} MB of weights per token, floor {NUMBER} ms/token, "
                         rf"efficiency \(floor / ITL\) {NUMBER}$", out, re.MULTILINE), peer


def test_latency_weight_floors_give_the_llama_server_its_gguf(smollm2_dir: str) -> None:
    from services.common.bandwidth_floor import gguf_weight_bytes, safetensors_weight_bytes
    from services.entrypoints.bench.latency import LatencyResult, report, weight_floors
    from services.entrypoints.bench.llamacpp_peer import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    floors = weight_floors(["my-vllm", "llama.cpp server"], smollm2_dir, 2, gguf, 10e9)
    assert floors["my-vllm"].weight_bytes == safetensors_weight_bytes(smollm2_dir, 2)
    assert floors["llama.cpp server"].weight_bytes == gguf_weight_bytes(gguf)
    assert floors["llama.cpp server"].weight_bytes < floors["my-vllm"].weight_bytes / 2  # 4-bit against 16
    results = [LatencyResult("my-vllm", 8, 3, [0.01], [0.05], 2), LatencyResult("hf", 8, 3, [0.01], [0.09], 2)]
    text = report(results, {"my-vllm": floors["my-vllm"]})
    assert "streaming read 10.0 GB/s" in text and "  my-vllm: " in text and "  hf: " not in text
    assert text.splitlines()[-1].startswith("ratio hf / my-vllm")


def test_bench_latency_interleaved(smollm2_dir: str, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """--interleave loads the in-process peers together and alternates their iterations."""
    from services.entrypoints.bench import workload

    order: list[str] = []
    for cls in (workload.MyVllmPeer, __import__("services.entrypoints.bench.hf_peer", fromlist=["HFPeer"]).HFPeer):
        original = cls.generate
        monkeypatch.setattr(cls, "generate", lambda self, reqs, knobs, _o=original: order.append(self.name) or
                            _o(self, reqs, knobs))
    rc = main(["bench", "latency", "--model", smollm2_dir, "--input-len", "16", "--output-len", "6",
               "--num-iters", "2", "--no-llamacpp", "--interleave"])
    assert rc == 0
    out = capsys.readouterr().out
    rows = _rows(out, 9)
    assert set(rows) == {"my-vllm", "hf"} and all(r[2] == 2 for r in rows.values())
    assert "interleaved" in out
    # Both loaded and warmed up first, then TTFT + E2E of each in turn, twice.
    assert order == ["my-vllm", "hf"] + ["my-vllm", "my-vllm", "hf", "hf"] * 2


def test_bench_latency_repeat_workload_with_speculation(smollm2_dir: str, tmp_path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """--speculative-config adds a my-vllm+spec peer (plain my-vllm still runs) and its ITL ratio;
    --workload repeat gives rewrite-the-paragraph chat prompts."""
    json_path = tmp_path / "latency.json"
    # ITL is (E2E - TTFT) / (n - 1) from two requests: with a few fast (speculated) tokens the
    # difference is within the noise of TTFT, so the ratio may come out negative; it must be printed.
    rc = main(["bench", "latency", "--model", smollm2_dir, "--workload", "repeat", "--output-len", "16",
               "--num-iters", "1", "--no-hf", "--no-llamacpp", "--json", str(json_path), "--speculative-config",
               '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}'])
    assert rc == 0
    out = capsys.readouterr().out
    rows = _rows(out, 9)
    assert set(rows) == {"my-vllm", "my-vllm+spec"}
    assert rows["my-vllm"][0] > 150  # the paragraph and its instruction, not --input-len's 128 random tokens
    assert re.search(rf"ratio my-vllm / my-vllm\+spec \(inter-token latency\): -?{NUMBER}", out)
    data = json.loads(json_path.read_text())
    assert data["workload"]["kind"] == "repeat" and data["ratio_my_vllm_over_spec_itl"] is not None


def test_bench_rejects_bad_sampling(smollm2_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "throughput", "--model", smollm2_dir, "--top-p", "0", "--no-hf"])
    assert rc == 2
    assert "top_p" in capsys.readouterr().err


def test_bench_throughput_json_schema(smollm2_dir: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    schema = {"type": "array", "minItems": 32, "items": {"type": "integer", "minimum": 0, "maximum": 99}}
    schema_path, json_path = tmp_path / "schema.json", tmp_path / "throughput.json"
    schema_path.write_text(json.dumps(schema))
    rc = main(["bench", "throughput", "--model", smollm2_dir, "--num-prompts", "4", "--input-len-min", "8",
               "--input-len-max", "16", "--output-len-min", "4", "--output-len-max", "8", "--no-llamacpp",
               "--no-hf", "--json-schema", str(schema_path), "--json", str(json_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert re.search(rf"^my-vllm json-schema +4 .* ({NUMBER}) +{NUMBER} +[0-9]+$", out, re.MULTILINE)
    last = out.strip().splitlines()[-1]
    match = re.fullmatch(rf"ratio my-vllm json-schema / my-vllm \(output tok/s\): ({NUMBER})", last)
    assert match and float(match.group(1)) > 0
    data = json.loads(json_path.read_text())
    assert [r["peer"] for r in data["results"]] == ["my-vllm", "my-vllm json-schema"]
    assert data["ratio_json_schema_over_my_vllm_output_tok_s"] > 0


def test_bench_rejects_a_bad_json_schema(smollm2_dir: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    schema_path = tmp_path / "schema.json"
    schema_path.write_text('{"type": "objec"}')
    rc = main(["bench", "throughput", "--model", smollm2_dir, "--no-hf", "--json-schema", str(schema_path)])
    assert rc == 2
    assert "Unsupported type" in capsys.readouterr().err
