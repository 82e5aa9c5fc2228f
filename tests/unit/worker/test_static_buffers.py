"""Pure-decode steps on persistent padded buffers (services/worker/cuda_graphs.py).

The "static" mode runs the CUDA-graph path's buffer logic (padding a pure-decode step to a
capture size, copying it into the persistent buffers, slicing the hidden states back to the
live rows) eagerly, so on the CPU it is checked token for token against the plain path: batches
of 3 live requests padded to 4, 5 padded to 8, steps where requests finished so fewer rows run
than the previous size, and mixed steps (a prompt arriving while others decode) that must take
the plain path. The graph capture itself needs CUDA (scripts/gpu_check.py `cudagraphs` stage);
here its capture-and-replay order runs with a stand-in graph that re-runs the captured forward
with the metadata and attention plan of the capture, on the Triton backend (interpreted), whose
plan reads the buffers themselves."""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from services.common.config import VllmConfig
from services.common.cudagraph_config import (
    capture_sizes,
    check_cudagraph_mode,
    default_capture_sizes,
    parse_capture_sizes,
    vllm_capture_sizes,
)
from services.common.sampling_params import SamplingParams
from services.entrypoints.engine_args import add_model_args, engine_kwargs
from services.entrypoints.topology import forwarded_flags
from services.offline.llm import LLM
from services.worker import cuda_graphs
from services.worker.attention.base import AttentionMetadata, current_metadata
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.cuda_graphs import StaticDecode, resolve_cudagraph_mode

B = 4  # block size of the unit tests


# --------------------------------------------------------------------------- capture sizes and flags


def test_default_capture_sizes_are_vllms_list_up_to_max_num_seqs() -> None:
    vllm_512 = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))
    assert vllm_capture_sizes(512) == vllm_512
    assert vllm_capture_sizes(6) == [1, 2, 4]
    assert default_capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert default_capture_sizes(512) == vllm_512
    assert default_capture_sizes(4096) == vllm_512  # vLLM caps its default at 512
    assert default_capture_sizes(300) == [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 305, 16))
    # The first size holding max_num_seqs rows ends the list: every decode batch has a graph.
    assert default_capture_sizes(5) == default_capture_sizes(8) == [1, 2, 4, 8]
    assert default_capture_sizes(3) == [1, 2, 4]
    assert default_capture_sizes(9) == [1, 2, 4, 8, 16]
    assert default_capture_sizes(1) == [1]
    # Given sizes: sorted, deduplicated, cut the same way; larger batches run eager.
    assert capture_sizes(8, [16, 4, 1, 4, 32]) == [1, 4, 16]
    assert capture_sizes(64, [2, 1]) == [1, 2]
    assert capture_sizes(8, [1, 4, 17, 1 << 30]) == [1, 4] and capture_sizes(8, [100]) == []  # above 2 x 8
    assert parse_capture_sizes("1,2 4, 8") == [1, 2, 4, 8]
    assert parse_capture_sizes([8, 1, 8]) == [1, 8]
    assert parse_capture_sizes(None) is None and parse_capture_sizes("") is None
    for bad in ("1,x", "0,4", [-1]):
        with pytest.raises(ValueError, match="cuda-graph-sizes"):
            parse_capture_sizes(bad)


def test_the_flags_travel_with_vllms_names() -> None:
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    args = parser.parse_args(["--model", "m", "--cuda-graph-sizes", "1", "2,4", "8", "--cudagraph-mode", "static"])
    assert args.cuda_graph_sizes == "1,2,4,8"
    # serve forwards it to the worker as one argument, which parses back the same
    forwarded = forwarded_flags(args, add_model_args)
    assert forwarded[forwarded.index("--cuda-graph-sizes") + 1] == "1,2,4,8"
    again = parser.parse_args(forwarded)
    config = VllmConfig.from_engine_args(**engine_kwargs(again))
    m = config.model_config
    assert (m.cuda_graph_sizes, m.cudagraph_mode, m.enforce_eager) == ([1, 2, 4, 8], "static", False)
    model = config.to_proto().model_config
    assert list(model.cuda_graph_sizes) == [1, 2, 4, 8] and model.cudagraph_mode == "static"
    back = VllmConfig.from_proto(config.to_proto()).model_config
    assert (back.cuda_graph_sizes, back.cudagraph_mode, back.enforce_eager) == ([1, 2, 4, 8], "static", False)
    eager = VllmConfig.from_engine_args(**engine_kwargs(parser.parse_args(["--model", "m", "--enforce-eager"])))
    m = eager.model_config
    assert m.enforce_eager and m.cudagraph_mode is None and m.cuda_graph_sizes is None
    assert VllmConfig.from_proto(eager.to_proto()).model_config.enforce_eager
    adopted = VllmConfig.from_engine_args(model="")
    adopted.adopt_model_config(config.to_proto().model_config)
    assert adopted.to_proto() == config.to_proto()


@pytest.mark.parametrize(("kwargs", "named"), [
    (dict(cudagraph_mode="full_decode_only", enforce_eager=True), "contradicts enforce_eager"),
    (dict(cudagraph_mode="static", compile_model=True), "compile_model"),
    (dict(cudagraph_mode="static", pipeline_parallel_size=2), "pipeline_parallel_size > 1"),
    (dict(cudagraph_mode="piecewise"), "must be one of"),
    (dict(cuda_graph_sizes="4,zero"), "must be integers"),
])
def test_what_cannot_apply_is_refused_naming_the_flag(kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        VllmConfig.from_engine_args(model="m", **kwargs)


def test_the_mode_each_worker_runs() -> None:
    def resolve(mode=None, device="cuda", backend="triton", **kw):
        args = dict(enforce_eager=False, compile_model=False, pipeline_parallel_size=1, tensor_parallel_size=1,
                    expert_parallel=False, pooling=False)
        return resolve_cudagraph_mode(mode, device=torch.device(device), attention_backend=backend, **{**args, **kw})

    assert resolve() == "full_decode_only"  # vLLM's default on CUDA
    assert resolve(device="cpu", backend="cpu") == "none"  # the plain path is the CPU default
    assert resolve(enforce_eager=True) == resolve(backend="torch") == resolve(pipeline_parallel_size=2) == "none"
    assert resolve(tensor_parallel_size=2) == resolve(pooling=True) == resolve(expert_parallel=True) == "none"
    assert resolve("STATIC", device="cpu", backend="cpu") == "static"
    assert resolve("static", enforce_eager=True) == "static"  # eager on the buffers: no graphs
    assert resolve("full_decode_only", tensor_parallel_size=2) == "full_decode_only"
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve("full_decode_only", device="cpu", backend="cpu")
    with pytest.raises(ValueError, match="needs the triton attention backend"):
        resolve("full_decode_only", backend="torch")
    with pytest.raises(ValueError, match="expert parallelism"):
        resolve("full_decode_only", expert_parallel=True)
    assert check_cudagraph_mode("none", enforce_eager=True, compile_model=True, pipeline_parallel_size=4) == "none"


# --------------------------------------------------------------------------- padding


class _Echo(torch.nn.Module):
    """A 'model' whose hidden state of a token is what attention was told about it."""

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        meta = current_metadata()
        return torch.stack((ids, positions, meta.slot_mapping, meta.seq_lens.long(), meta.context_lens.long()),
                           1).float()


class _RecordingBackend:
    name = "recording"

    def __init__(self) -> None:
        self.prepared: list[AttentionMetadata] = []

    def prepare(self, meta: AttentionMetadata) -> None:
        self.prepared.append(meta)


def _decode_meta(ctx: list[int], blocks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A pure-decode step as the runner builds it: each request's next token at position ctx."""
    ctx_np = np.asarray(ctx, dtype=np.int64)
    seq = ctx_np + 1
    nb = int(max(-(-s // B) for s in seq))
    table = np.zeros((len(ctx), nb), dtype=np.int32)
    for i, row in enumerate(blocks):
        table[i, :min(nb, len(row))] = row[:nb]
    slots = np.array([blocks[i][c // B] * B + c % B for i, c in enumerate(ctx)], dtype=np.int64)
    meta = AttentionMetadata.from_host(slots, np.arange(len(ctx) + 1), seq, ctx_np, table, B, "cpu")
    ids = torch.arange(100, 100 + len(ctx))
    return ids, torch.from_numpy(ctx_np), meta


def test_a_decode_step_is_padded_into_the_null_block_and_sliced_to_its_live_rows() -> None:
    backend = _RecordingBackend()
    static = StaticDecode(_Echo(), backend, "static", [1, 2, 4, 8], max_model_len=64, block_size=B,
                          device=torch.device("cpu"))
    buffers = static.buffers
    assert (buffers.max_size, buffers.max_blocks) == (8, 16)  # ceil(max_model_len / block_size)

    steps = [  # (context lengths, block ids), padded to 4, 8, then 2 (requests finished)
        ([5, 9, 2], [[7, 3], [4, 11, 6], [9]]),
        ([6, 10, 3, 0, 13], [[7, 3], [4, 11, 6], [9], [12], [1, 2, 5, 8]]),
        ([14, 1], [[1, 2, 5, 8], [12]]),
    ]
    for (ctx, blocks), size in zip(steps, (4, 8, 2), strict=True):
        ids, pos, meta = _decode_meta(ctx, blocks)
        n = len(ctx)
        hidden = static.forward(ids, pos, meta)
        # Only the live rows come back, each with its own inputs.
        assert hidden.shape == (n, 5)
        assert hidden[:, 0].long().tolist() == ids.tolist()
        assert hidden[:, 1].long().tolist() == ctx
        assert hidden[:, 2].long().tolist() == meta.slot_mapping.tolist()
        assert hidden[:, 3].long().tolist() == [c + 1 for c in ctx] and hidden[:, 4].long().tolist() == ctx
        padded = backend.prepared[-1]
        assert padded.num_tokens == size and padded.max_query_len == 1
        # Padding rows: token 0 at position 0, stored in slot 0 of the null block, attending to
        # that one position through a block table of zeros.
        assert buffers.input_ids[n:size].tolist() == [0] * (size - n)
        assert buffers.positions[n:size].tolist() == [0] * (size - n)
        assert padded.slot_mapping[n:].tolist() == [0] * (size - n)
        assert (padded.slot_mapping[n:] // B == 0).all()
        assert padded.seq_lens[n:].tolist() == [1] * (size - n)
        assert padded.context_lens[n:].tolist() == [0] * (size - n)
        assert not padded.block_table[n:].any()
        assert padded.query_start_loc.tolist() == padded.query_start_loc_np.tolist() == list(range(size + 1))
        assert padded.seq_lens_np.tolist() == [c + 1 for c in ctx] + [1] * (size - n)
        assert padded.context_lens_np.tolist() == ctx + [0] * (size - n)
        # Live rows: their blocks, and nothing left of a longer table of the previous step.
        assert padded.block_table.shape == (size, buffers.max_blocks)
        for i, row in enumerate(blocks):
            nb = -(-(ctx[i] + 1) // B)
            assert padded.block_table[i, :nb].tolist() == row[:nb]
            assert not padded.block_table[i, meta.block_table.shape[1]:].any()
    assert static.padded_steps == {4: 1, 8: 1, 2: 1} and static.padding_rows == 1 + 3 + 0
    assert static.replays == 0  # static mode: eager on the buffers
    assert static.padded_size(8) == 8 and static.padded_size(9) is None


def test_which_steps_run_padded() -> None:
    static = StaticDecode(_Echo(), _RecordingBackend(), "static", [1, 2, 4], max_model_len=64, block_size=B,
                          device=torch.device("cpu"))
    batch = SimpleNamespace(prompt_logprob_rows=set(), num_spec=np.zeros(8, dtype=np.int64))
    runner = SimpleNamespace(pooler=None, input_batch=batch)
    rows = np.array([0, 3, 5])
    assert static.applies(runner, rows, np.ones(3, dtype=np.int64))
    assert not static.applies(runner, rows, np.array([1, 4, 1]))  # a prefill chunk among them: mixed
    assert not static.applies(runner, np.arange(5), np.ones(5, dtype=np.int64))  # more than the largest size
    assert not static.applies(runner, rows[:0], np.ones(0, dtype=np.int64))
    batch.prompt_logprob_rows = {3}
    assert not static.applies(runner, rows, np.ones(3, dtype=np.int64))  # prompt logprobs: the plain path
    assert static.applies(runner, np.array([0, 5]), np.ones(2, dtype=np.int64))
    batch.num_spec[5] = 2
    assert not static.applies(runner, np.array([0, 5]), np.ones(2, dtype=np.int64))
    assert not static.applies(SimpleNamespace(pooler=object(), input_batch=batch), np.array([0]), np.ones(1))


class EagerReplay:
    """A stand-in for torch.cuda.CUDAGraph on the CPU: `capture` runs the forward once and keeps it
    with its output tensor; `replay` runs it again with the metadata and plan of the capture and
    writes the result into that tensor, as a replayed graph would."""

    def __init__(self, pool) -> None:
        self.forward = self.out = None

    @staticmethod
    def new_pool() -> None:
        return None

    def capture(self, forward) -> torch.Tensor:
        self.forward = forward
        self.out = forward()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.forward())


def test_a_graph_needs_a_plan_that_reads_the_buffers() -> None:
    """Capture refuses a backend that plans into tensors of its own (the torch and cpu backends
    plan on the host each step): a replay would read the capture's values. The Triton plan is
    views of the buffers."""
    static = StaticDecode(_Echo(), TorchAttentionBackend(), "full_decode_only", [1, 2], max_model_len=32,
                          block_size=B, device=torch.device("cpu"))
    static.graph_type = EagerReplay
    with pytest.raises(RuntimeError, match="decode_seq_lens"):
        static.capture()
    from services.worker.attention.triton_backend import TritonAttentionBackend

    static.backend = TritonAttentionBackend()
    static.capture()
    assert sorted(static.graphs) == [1, 2]
    assert cuda_graphs.plan_reads_only(static.graphs[2][2].backend_data, static.buffers) == []


# --------------------------------------------------------------------------- token-exact vs the plain path


def _workload(vocab: int) -> tuple[list[dict], list[SamplingParams]]:
    """Seven prompts of different lengths and output lengths: with max_num_seqs=6 and a 32-token
    budget the prompts arrive in chunks among decodes (mixed steps), the seventh once a request
    finishes, decode batches of 5-6 rows pad to 8 and of 3 to 4, and shrink as requests end."""
    gen = torch.Generator().manual_seed(0)
    lens, outs = (3, 9, 17, 30, 5, 12, 40), (12, 5, 9, 3, 14, 7, 10)
    prompts = [{"prompt_token_ids": torch.randint(100, vocab - 1, (n,), generator=gen).tolist()} for n in lens]
    return prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in outs]


def _spy(llm: LLM) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
    """(the query lengths of every plain-path forward, (live rows, padded size) of every padded one)."""
    runner = llm.worker.runner
    plain, padded = [], []
    forward = runner.forward

    def plain_forward(*args):
        plain.append(np.diff(current_metadata().query_start_loc_np))
        return forward(*args)

    runner.forward = plain_forward
    static = runner.static_decode
    if static is not None:
        padded_forward = static.forward

        def padded_step(ids, positions, meta):
            padded.append((meta.num_tokens, static.padded_size(meta.num_tokens)))
            return padded_forward(ids, positions, meta)

        static.forward = padded_step
    return plain, padded


def _generate(model_dir: str, prompts, params, **kwargs) -> tuple[list[list[int]], list, list, str]:
    """Greedy outputs, the spies' records and the mode the worker ran."""
    with LLM(model_dir, dtype="float32", max_num_seqs=6, max_num_batched_tokens=32, max_model_len=256,
             kv_cache_memory_bytes=16 << 20, seed=0, **kwargs) as llm:
        plain, padded = _spy(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        mode = llm.worker.runner.cudagraph_mode
    return [list(o.outputs[0].token_ids) for o in outs], plain, padded, mode


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_static_buffers_greedy_equal_the_plain_path(tiny_model_dir, arch: str) -> None:
    model_dir = tiny_model_dir(arch)
    prompts, params = _workload(49152)
    want, _, none_padded, mode = _generate(model_dir, prompts, params)
    assert mode == "none" and not none_padded  # the CPU default: the plain path
    got, plain, padded, mode = _generate(model_dir, prompts, params, cudagraph_mode="static")
    assert mode == "static"
    assert got == want
    assert [len(t) for t in got] == [p.max_tokens for p in params]
    sizes = [size for _, size in padded]
    assert (3, 4) in padded and any(n in (5, 6) and size == 8 for n, size in padded)
    # Requests finished between padded steps: fewer live rows than the previous capture size.
    assert any(b < a for a, b in zip(sizes, sizes[1:], strict=False))
    # Every step the plain path ran had a prefill chunk; some mixed it with decodes.
    assert plain and all(q.max() > 1 for q in plain)
    assert any((q == 1).any() for q in plain)


def test_static_buffers_on_smollm2(smollm2_dir: str) -> None:
    """The real model (tied head, 30 layers), fewer tokens, one engine (its load dominates): its
    decode steps first plain, then padded; prefix caching off, so the second run computes
    everything again."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far", "1, 2, 3,",
               "The quick brown fox"]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (10, 6, 8, 4, 9)]
    with LLM(smollm2_dir, dtype="float32", cudagraph_mode="static", max_num_seqs=6, max_num_batched_tokens=32,
             max_model_len=256, kv_cache_memory_bytes=16 << 20, enable_prefix_caching=False, seed=0) as llm:
        runner = llm.worker.runner
        static, runner.static_decode = runner.static_decode, None
        want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        runner.static_decode = static
        _, padded = _spy(llm)
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert any(size == 8 for _, size in padded) and any(n < size for n, size in padded)


@pytest.mark.parametrize("num_splits", [None, 3])
def test_replayed_graphs_equal_the_plain_path_on_the_triton_backend(tiny_model_dir, num_splits: int | None) -> None:
    """The full_decode_only order on the CPU: graphs captured (the stand-in) per size at start-up
    over all-padding buffers, then each pure-decode step copied into the buffers and replayed
    with the capture's metadata and plan. One engine, its decode steps first plain, then replayed
    (prefix caching off: the second run computes everything again). With num_splits the decode
    steps' attention runs split-KV (3 partitions) in the graphs."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("the Triton kernels need CUDA or TRITON_INTERPRET=1")
    prompts = _workload(49152)[0][:4]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (5, 3, 4, 2)]
    with LLM(tiny_model_dir("llama"), dtype="float32", attention_backend="triton", cudagraph_mode="static",
             max_num_seqs=4, max_model_len=64, kv_cache_memory_bytes=4 << 20, enable_prefix_caching=False,
             seed=0) as llm:
        runner = llm.worker.runner
        static = runner.static_decode
        runner.static_decode = None
        want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        runner.attn_backend.num_splits = num_splits
        graphs = StaticDecode(runner.model, runner.attn_backend, "full_decode_only", static.sizes, runner.max_model_len,
                              runner.block_size, runner.device)
        graphs.graph_type = EagerReplay
        graphs.capture()
        assert sorted(graphs.graphs) == [1, 2, 4]
        runner.static_decode = graphs
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert graphs.replays == sum(graphs.padded_steps.values()) > 0
    assert 4 in graphs.padded_steps and graphs.padding_rows > 0  # 3 live rows replayed the graph of 4


# --------------------------------------------------------------------------- a failed capture


class FailingCapture(EagerReplay):
    """A graph whose capture fails, as a host sync inside torch.cuda.graph does."""

    def capture(self, forward) -> torch.Tensor:
        raise RuntimeError("operation not permitted when stream is capturing")


def _graph_runner(explicit: bool) -> SimpleNamespace:
    from services.worker.attention.triton_backend import TritonAttentionBackend

    return SimpleNamespace(cudagraph_mode="full_decode_only", cudagraph_mode_explicit=explicit, max_num_seqs=2,
                           cuda_graph_sizes=None, model=_Echo(), attn_backend=TritonAttentionBackend(),
                           max_model_len=32, block_size=B, device=torch.device("cpu"),
                           unreported_capture_failures=0)


def test_a_failed_capture_is_a_warning_with_its_reason_and_counted(monkeypatch, caplog) -> None:
    monkeypatch.setattr(StaticDecode, "graph_type", FailingCapture)
    runner = _graph_runner(explicit=False)
    with caplog.at_level("WARNING", logger="myvllm.worker"):
        assert cuda_graphs.build_static_decode(runner) is None  # automatic mode: eager from here
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "operation not permitted when stream is capturing" in warned[0].getMessage()
    assert "RuntimeError" in warned[0].getMessage()
    assert runner.unreported_capture_failures == 1
    with pytest.raises(RuntimeError, match="stream is capturing"):  # an explicit mode stops the worker
        cuda_graphs.build_static_decode(_graph_runner(explicit=True))


def test_the_next_step_reports_a_failed_capture_once(monkeypatch, tiny_model_dir) -> None:
    """The failure travels in the next step's output to the scheduler's counters (the gateway's
    myvllm:cudagraph_capture_failures_total), once."""
    with LLM(tiny_model_dir("llama"), dtype="float32", max_num_seqs=2, max_model_len=64,
             kv_cache_memory_bytes=4 << 20, seed=0) as llm:
        llm.worker.runner.unreported_capture_failures = 1  # as build_static_decode leaves it
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        llm.generate([{"prompt_token_ids": [5, 6, 8]}], params, use_tqdm=False)
        assert llm.stats()["cudagraph_capture_failures"] == 1
        assert llm.worker.runner.unreported_capture_failures == 0


# --------------------------------------------------------------------------- speculative steps


def test_speculative_steps_replay_graphs_of_one_plus_k_tokens_per_row(tiny_model_dir) -> None:
    """With k drafts per row, a step whose every row verifies k drafts runs padded at 1 + k tokens
    per row (here replayed from the stand-in graphs, captured per size for both query lengths),
    giving the plain path's tokens. The draft model is the target itself: every row always
    carries k drafts."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("the Triton kernels need CUDA or TRITON_INTERPRET=1")
    model_dir = tiny_model_dir("llama")
    prompts = _workload(49152)[0][:3]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (7, 5, 6)]
    spec = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 2}
    with LLM(model_dir, dtype="float32", attention_backend="triton", cudagraph_mode="static", max_num_seqs=4,
             max_model_len=64, kv_cache_memory_bytes=4 << 20, enable_prefix_caching=False, seed=0,
             speculative_config=spec) as llm:
        runner = llm.worker.runner
        static = runner.static_decode
        assert static.query_lens == [1, 3]
        runner.static_decode = None
        want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        graphs = StaticDecode(runner.model, runner.attn_backend, "full_decode_only", static.sizes,
                              runner.max_model_len, runner.block_size, runner.device, num_speculative_tokens=2)
        graphs.graph_type = EagerReplay
        graphs.capture()
        assert {q: sorted(g) for q, g in graphs.graphs_of.items()} == {1: [1, 2, 4], 3: [1, 2, 4]}
        runner.static_decode = graphs
        got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert graphs.spec_steps and 4 in graphs.spec_steps  # 3 rows of 1 + 2 tokens replayed the graph of 4
    assert graphs.replays == sum(graphs.padded_steps.values()) + sum(graphs.spec_steps.values())


def test_which_steps_run_at_which_query_length() -> None:
    static = StaticDecode(_Echo(), _RecordingBackend(), "static", [1, 2, 4], max_model_len=64, block_size=B,
                          device=torch.device("cpu"), num_speculative_tokens=3)
    batch = SimpleNamespace(prompt_logprob_rows=set(), num_spec=np.array([3, 3, 0, 3, 2, 0]))
    runner = SimpleNamespace(pooler=None, input_batch=batch)
    assert static.query_len(runner, np.array([0, 1, 3]), np.full(3, 4)) == 4  # every row: 1 + 3 drafts
    assert static.query_len(runner, np.array([2, 5]), np.ones(2, dtype=np.int64)) == 1
    assert static.query_len(runner, np.array([0, 4]), np.array([4, 3])) is None  # different draft counts
    assert static.query_len(runner, np.array([4]), np.array([3])) is None  # 1 + 2: no such buffers
    assert static.query_len(runner, np.array([2]), np.array([4])) is None  # a prefill chunk of 4
    assert static.query_len(runner, np.array([0, 1, 3, 0, 1]), np.full(5, 4)) is None  # more rows than 4


class _TokenEcho(torch.nn.Module):
    """A 'model' whose hidden state of a token is its id, position and slot."""

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.stack((ids, positions, current_metadata().slot_mapping), 1).float()


def test_a_speculative_step_is_padded_row_by_row() -> None:
    static = StaticDecode(_TokenEcho(), _RecordingBackend(), "static", [1, 2, 4], max_model_len=64, block_size=B,
                          device=torch.device("cpu"), num_speculative_tokens=1)
    # Two rows of 2 tokens (the token and one draft) at context lengths 5 and 9.
    ctx = np.array([5, 9])
    positions = torch.tensor([5, 6, 9, 10])
    slots = np.array([7 * B + 1, 7 * B + 2, 3 * B + 1, 3 * B + 2])
    table = np.array([[1, 7, 0], [2, 4, 3]], dtype=np.int32)
    meta = AttentionMetadata.from_host(slots, np.array([0, 2, 4]), ctx + 2, ctx, table, B, "cpu")
    ids = torch.tensor([100, 101, 102, 103])
    hidden = static.forward(ids, positions, meta)
    assert hidden[:, 0].long().tolist() == ids.tolist() and hidden[:, 1].long().tolist() == positions.tolist()
    assert hidden[:, 2].long().tolist() == slots.tolist()
    buffers = static.buffers_of[2]
    padded = static.backend.prepared[-1]
    assert padded.num_tokens == 4 and padded.max_query_len == 2  # 2 rows: the capture size 2
    assert static.spec_steps == {2: 1} and not static.padded_steps
    static.forward(ids[:2], positions[:2], AttentionMetadata.from_host(slots[:2], np.array([0, 2]), ctx[:1] + 2,
                                                                       ctx[:1], table[:1], B, "cpu"))
    assert static.spec_steps == {2: 1, 1: 1}
    ids3 = torch.arange(200, 206)
    meta3 = AttentionMetadata.from_host(np.arange(6) + 40, np.array([0, 2, 4, 6]), np.array([3, 4, 5]),
                                        np.array([1, 2, 3]), np.ones((3, 2), dtype=np.int32), B, "cpu")
    static.forward(ids3, torch.arange(6), meta3)
    padded = static.backend.prepared[-1]  # 3 rows padded to 4: the last row's 2 tokens are padding
    assert padded.query_start_loc.tolist() == [0, 2, 4, 6, 8]
    assert buffers.input_ids[6:8].tolist() == [0, 0] and buffers.slot_mapping[6:8].tolist() == [0, 0]
    assert padded.seq_lens.tolist() == [3, 4, 5, 2] and padded.context_lens.tolist() == [1, 2, 3, 0]
    assert padded.seq_lens_np.tolist() == [3, 4, 5, 2] and not padded.block_table[3].any()
