"""`myvllm bench serve` on a tiny workload: real mesh, offline LLM, percentiles, plot."""

from __future__ import annotations

import re

from support.fake_llama_server import write_fake_llama_server

from services.entrypoints.cli import main


def test_bench_serve_reports_percentiles_ratio_and_plot_and_keeps_them_when_the_peer_fails(
        tmp_path, capsys, monkeypatch, smollm2_dir):
    plot = tmp_path / "serve.png"
    # A vLLM peer that dies at start-up: its error is printed, every row measured is kept, exit 1.
    broken_python = tmp_path / "python"
    broken_python.write_text("#!/bin/sh\necho 'peer: ImportError: no module named vllm' >&2\nexit 3\n")
    broken_python.chmod(0o755)
    monkeypatch.setenv("MYVLLM_VLLM_PYTHON", str(broken_python))
    # The llama.cpp server peer (a stand-in speaking its protocol): restarted per level, its rows kept.
    write_fake_llama_server(tmp_path)
    monkeypatch.setenv("MYVLLM_LLAMA_BIN_DIR", str(tmp_path))
    rc = main(["bench", "serve", "--model", smollm2_dir, "--num-prompts", "4", "--concurrency", "1,2",
               "--input-len-min", "8", "--input-len-max", "16", "--output-len-min", "4", "--output-len-max", "8",
               "--no-hf", "--plot", str(plot), "--vllm", "--llamacpp-server"])
    out = capsys.readouterr().out
    assert rc == 1
    assert re.search(r"^vllm serve failed after 0 of 2 levels: RuntimeError: vllm serve exited \(code 3\).*"
                     r"no module named vllm", out, re.M | re.S), out[-3000:]
    rows = [line for line in out.splitlines() if line.startswith("my-vllm serve c=")]
    assert len(rows) == 2
    for row in rows:
        figures = [float(x) for x in row.split()[3:]]
        assert len(figures) == 8 and all(f > 0 for f in figures)
    llama_rows = [line for line in out.splitlines() if line.startswith("llama-server c=")]
    assert [row.split()[1] for row in llama_rows] == ["c=1", "c=2"]
    assert re.search(r"^ratio my-vllm serve / llama-server c=2 \(output tok/s\): \d+\.\d\d$", out, re.M)
    assert re.search(r"my-vllm offline LLM \(max_num_seqs=2\)\s+\d+\.\d", out)
    assert re.search(r"^mesh c=2 / offline LLM \(output tok/s\): \d+\.\d\d$", out, re.M)
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_against_a_running_server_the_dtype_is_the_servers(monkeypatch) -> None:
    """`bench serve --base-url` reports (and runs its peers in) the dtype the server runs, read
    from its /metrics, not what "auto" would pick here; a server that does not say: None."""
    import httpx

    from services.common.proto import myvllm_pb2 as pb
    from services.entrypoints.bench.serve import _server_dtype
    from services.gateway.metrics import GatewayMetrics

    pages = {"http://h:1/metrics": GatewayMetrics("m").render(pb.Stats(dtype="float32")),
             "http://h:2/metrics": GatewayMetrics("m").render(None)}
    monkeypatch.setattr(httpx, "get", lambda url, **_: httpx.Response(200, text=pages[url]))
    assert _server_dtype("http://h:1") == _server_dtype("http://h:1/v1") == "float32"
    assert _server_dtype("http://h:2") is None
