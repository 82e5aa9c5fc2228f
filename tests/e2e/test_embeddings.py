"""Embeddings: the pooling runner (`--runner pooling`, `--pooler-config`), `/v1/embeddings` and
`LLM.embed`, checked against HF transformers' final hidden states (AutoModel, fp32) pooled the
same way; plus unit checks of the pooling math, the configuration rules, the scheduler's
finished-after-prefill rule and the worker's boundary checks.

One mesh for the module (MEAN pooling, a 64-token step budget so that a ~200-token input runs
as several prefill chunks, which is what MEAN's running sum must survive)."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from openai import BadRequestError, OpenAI
from support.mesh import Mesh
from support.schedulers import scheduler_for

from services.client.grpc_client import Client
from services.common.auth import TOKEN_ENV
from services.common.config import VllmConfig
from services.common.pooling_config import PoolerConfig, dimensions_error
from services.common.proto import myvllm_pb2 as pb
from services.engine.request import Request
from services.worker.input_batch import InputBatch
from services.worker.pooler import Pooler, embedding_bytes, embedding_from_bytes, finish_embedding
from services.worker.step_validation import InvalidStep, PoolingLimits, validate_step

TOL = 1e-5
TOKEN = "test-internal-token"
BUDGET = 64  # --max-num-batched-tokens: the long input below takes 4 prefill chunks
LONG = "The quick brown fox jumps over the lazy dog. " * 20  # 201 tokens with SmolLM2's tokenizer
SHORT = ["Hello world", "What is the capital of France?", "Embeddings map text to vectors of numbers."]


# ---------------------------------------------------------------------- HF reference


@pytest.fixture(scope="module")
def hf_model(smollm2_dir: str):
    from transformers import AutoModel

    return AutoModel.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@torch.inference_mode()
def hf_embedding(model, token_ids: list[int], pooling_type: str) -> np.ndarray:
    """HF's final hidden states (LlamaModel: after the final norm), pooled, L2-normalized."""
    hidden = model(torch.tensor([token_ids])).last_hidden_state[0]
    pooled = hidden[-1] if pooling_type == "LAST" else hidden.mean(0)
    return F.normalize(pooled, dim=-1).numpy()


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


# ---------------------------------------------------------------------- the served mesh


@pytest.fixture(scope="module")
def mesh(smollm2_dir: str) -> Iterator[Mesh]:
    m = Mesh(["--model", smollm2_dir, "--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN"}',
              "--max-num-batched-tokens", str(BUDGET), "--max-model-len", "512", "--kv-cache-memory",
              str(64 << 20)], env={TOKEN_ENV: TOKEN})
    yield m
    assert m.stop() == 0


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> OpenAI:
    return OpenAI(base_url=f"{mesh.base_url}/v1", api_key="none", max_retries=0, timeout=120)


def scheduler_stats(mesh: Mesh) -> pb.Stats:
    with Client(f"127.0.0.1:{mesh.scheduler_port}", timeout=10, token=TOKEN) as scheduler:
        return scheduler.get_stats()


@pytest.fixture(scope="module")
def served(client: OpenAI) -> dict[str, list[float]]:
    """What the server answered for each text (filled by the tests, compared with LLM.embed)."""
    return {}


def test_a_string_a_batch_and_token_ids_equal_hf(client: OpenAI, mesh: Mesh, hf_model, tokenizer, served) -> None:
    model = client.models.list().data[0].id
    one = client.embeddings.create(model=model, input=SHORT[0], encoding_format="float")
    assert one.object == "list" and one.model == model and len(one.data) == 1
    ids = tokenizer.encode(SHORT[0])
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids)
    assert len(one.data[0].embedding) == hf_model.config.hidden_size
    assert max_diff(one.data[0].embedding, hf_embedding(hf_model, ids, "MEAN")) <= TOL

    # Inputs of different lengths, fewer tokens than the budget in all: they share engine steps (the
    # first may run alone: the scheduler steps as soon as the first of their messages arrives).
    steps = scheduler_stats(mesh).num_steps
    batch = client.embeddings.create(model=model, input=SHORT, encoding_format="float")
    assert scheduler_stats(mesh).num_steps - steps < len(SHORT)
    assert [d.index for d in batch.data] == [0, 1, 2]
    assert batch.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in SHORT)
    for text, item in zip(SHORT, batch.data, strict=True):
        assert max_diff(item.embedding, hf_embedding(hf_model, tokenizer.encode(text), "MEAN")) <= TOL
        served[text] = item.embedding

    # Token ids: one list, then a list of lists.
    by_ids = client.embeddings.create(model=model, input=ids, encoding_format="float")
    assert max_diff(by_ids.data[0].embedding, one.data[0].embedding) == 0.0
    lists = client.embeddings.create(model=model, input=[tokenizer.encode(t) for t in SHORT[:2]],
                                     encoding_format="float")
    assert [max_diff(a.embedding, b.embedding) for a, b in zip(lists.data, batch.data[:2], strict=False)] == [0, 0]


def test_base64_decodes_to_the_same_values(client: OpenAI, mesh: Mesh) -> None:
    floats = client.embeddings.create(model="SmolLM2-135M-Instruct", input=SHORT[1], encoding_format="float")
    # The openai client asks for base64 by default and decodes it itself...
    decoded = client.embeddings.create(model="SmolLM2-135M-Instruct", input=SHORT[1])
    assert max_diff(decoded.data[0].embedding, floats.data[0].embedding) == 0.0
    # ... and the raw body is little-endian float32, base64.
    body = httpx.post(f"{mesh.base_url}/v1/embeddings", json={"input": SHORT[1], "encoding_format": "base64"},
                      timeout=60).json()
    raw = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert max_diff(raw, floats.data[0].embedding) == 0.0


def test_a_long_input_chunked_across_prefill_steps_equals_hf(client: OpenAI, hf_model, tokenizer, served) -> None:
    ids = tokenizer.encode(LONG)
    assert len(ids) > 3 * BUDGET
    out = client.embeddings.create(model="SmolLM2-135M-Instruct", input=[LONG, SHORT[0]], encoding_format="float")
    assert max_diff(out.data[0].embedding, hf_embedding(hf_model, ids, "MEAN")) <= TOL
    assert max_diff(out.data[1].embedding, served[SHORT[0]]) <= TOL
    served[LONG] = out.data[0].embedding


def test_refusals_are_clear_400s(client: OpenAI, mesh: Mesh) -> None:
    with pytest.raises(BadRequestError, match="pooling runner"):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=4)
    with pytest.raises(BadRequestError, match="pooling runner"):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}],
                                       stream=True)
    with pytest.raises(BadRequestError, match="Matryoshka"):  # SmolLM2's config has no matryoshka_dimensions
        client.embeddings.create(model="SmolLM2-135M-Instruct", input="Hi", dimensions=64)
    with pytest.raises(BadRequestError, match="maximum context length is 512"):
        client.embeddings.create(model="SmolLM2-135M-Instruct", input=[1] * 513)
    with pytest.raises(BadRequestError, match="empty"):
        client.embeddings.create(model="SmolLM2-135M-Instruct", input=[])
    assert httpx.post(f"{mesh.base_url}/v1/embeddings", json={"input": "x", "encoding_format": "int8"},
                      timeout=30).status_code == 400


def test_every_kv_block_is_free_afterwards(mesh: Mesh) -> None:
    stats = scheduler_stats(mesh)
    assert stats.runner == "pooling" and stats.num_free_blocks == stats.num_total_blocks
    assert stats.prefix_cache_queries == 0  # prefix caching is off under the pooling runner
    metrics = mesh.metrics()
    assert metrics["vllm:kv_cache_usage_perc"] == 0
    assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:num_requests_waiting"] == 0


# ---------------------------------------------------------------------- the offline LLM


def test_offline_embed_equals_the_served_values_and_hf(smollm2_dir: str, served, hf_model) -> None:
    from services.offline import LLM

    if len(served) < len(SHORT) + 1:
        pytest.skip("needs the served values of the tests above")
    with LLM(smollm2_dir, runner="pooling", pooler_config={"pooling_type": "MEAN"}, dtype="float32",
             max_num_batched_tokens=BUDGET, max_model_len=512, kv_cache_memory_bytes=64 << 20) as llm:
        texts = [*SHORT, LONG]
        steps = llm.engine.num_steps
        outputs = llm.embed(texts, use_tqdm=False)
        # The short inputs and LONG's first chunk in one step, then LONG's other three chunks.
        assert llm.engine.num_steps - steps == 4
        assert [o.finished for o in outputs] == [True] * len(texts)
        for text, out in zip(texts, outputs, strict=True):
            assert max_diff(out.outputs.embedding, served[text]) <= TOL
        assert llm.stats()["kv_cache_usage"] == 0


def test_offline_last_pooling_equals_hf(smollm2_dir: str, hf_model, tokenizer) -> None:
    from services.offline import LLM, SamplingParams

    # Async scheduling (off by default on CPU, on for CUDA): the next step is scheduled before the
    # pooled outputs of the one in flight come back; a pooling request takes no placeholder.
    with LLM(smollm2_dir, runner="pooling", dtype="float32", max_num_batched_tokens=BUDGET, max_model_len=512,
             kv_cache_memory_bytes=64 << 20, async_scheduling=True) as llm:
        assert llm.config.model_config.pooler_config == PoolerConfig("LAST", True)
        assert not llm.config.cache_config.enable_prefix_caching
        texts = [LONG, *SHORT, {"prompt_token_ids": tokenizer.encode(SHORT[2])}]
        outputs = llm.embed(texts, use_tqdm=False)
        worst = 0.0
        for out in outputs:
            worst = max(worst, max_diff(out.outputs.embedding, hf_embedding(hf_model, out.prompt_token_ids, "LAST")))
        assert worst <= TOL, worst
        with pytest.raises(ValueError, match="pooling runner"):
            llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


# ---------------------------------------------------------------------- unit: pooling math


def _pool_chunks(pooler: Pooler, hidden: torch.Tensor, chunks: list[list[int]], rows: list[int],
                 prompt_lens: list[int]) -> dict[int, torch.Tensor]:
    """Feed `hidden` ([tokens of every request concatenated]) step by step: chunks[s][i] tokens
    of request i in step s (0: not scheduled)."""
    done_at: dict[int, torch.Tensor] = {}
    offsets = [0] * len(rows)
    starts = np.cumsum([0, *prompt_lens[:-1]])
    for step in chunks:
        sched = [(i, n) for i, n in enumerate(step) if n]
        pieces = [hidden[starts[i] + offsets[i]:starts[i] + offsets[i] + n] for i, n in sched]
        num = np.array([n for _, n in sched])
        for i, n in sched:
            offsets[i] += n
        qsl = np.concatenate([[0], np.cumsum(num)])
        step_rows = np.array([rows[i] for i, _ in sched])
        done = np.array([offsets[i] >= prompt_lens[i] for i, _ in sched])
        result = pooler.pool(torch.cat(pieces), step_rows, num, qsl, np.ones(len(sched), bool), done,
                             np.array([prompt_lens[i] for i, _ in sched]), np.zeros(len(sched), np.int64))
        for j, emb in result:
            done_at[sched[j][0]] = emb
    return done_at


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_pooling_across_chunks_equals_pooling_at_once(pooling_type: str) -> None:
    torch.manual_seed(0)
    lens = [7, 3, 12]
    hidden = torch.randn(sum(lens), 16)
    pooler = Pooler(PoolerConfig(pooling_type, True), max_num_reqs=4, hidden_size=16, device=torch.device("cpu"))
    for row in (0, 2, 3):
        pooler.start_row(row)
    got = _pool_chunks(pooler, hidden, [[4, 3, 5], [3, 0, 5], [0, 0, 2]], rows=[2, 0, 3], prompt_lens=lens)
    starts = np.cumsum([0, *lens[:-1]])
    for i, n in enumerate(lens):
        h = hidden[starts[i]:starts[i] + n]
        want = F.normalize(h[-1] if pooling_type == "LAST" else h.mean(0), dim=-1)
        assert torch.allclose(got[i], want, atol=1e-6)


def test_truncation_then_normalize_and_the_wire_format() -> None:
    x = torch.tensor([3.0, 4.0, 12.0])
    assert torch.allclose(finish_embedding(x, 2, True), torch.tensor([0.6, 0.8]))
    assert torch.allclose(finish_embedding(x, 0, False), x)
    assert embedding_from_bytes(embedding_bytes(torch.tensor([0.5, -1.25]))) == [0.5, -1.25]
    assert embedding_bytes(torch.tensor([1.0])) == b"\x00\x00\x80\x3f"  # little-endian float32


def test_dimensions_only_for_matryoshka_models() -> None:
    assert dimensions_error(0, 576, False) is None
    assert "Matryoshka" in dimensions_error(64, 576, False)
    assert dimensions_error(64, 576, True) is None
    assert "outside" in dimensions_error(600, 576, True)
    assert "matryoshka_dimensions" in dimensions_error(100, 576, True, [64, 128])


# ---------------------------------------------------------------------- unit: configuration


def test_configuration_rules() -> None:
    c = VllmConfig.from_engine_args(runner="pooling", pooler_config='{"pooling_type": "mean"}')
    m = c.model_config
    assert (m.convert, m.pooler_config, c.cache_config.enable_prefix_caching) == ("embed", PoolerConfig("MEAN", True),
                                                                                  False)
    back = VllmConfig.from_proto(c.to_proto())
    assert (back.model_config.runner, back.model_config.pooler_config, back.cache_config.enable_prefix_caching) == \
        ("pooling", m.pooler_config, False)
    g = VllmConfig.from_engine_args()
    assert (g.model_config.runner, g.model_config.convert, g.model_config.pooler_config,
            g.cache_config.enable_prefix_caching) == ("generate", "none", None, True)
    adopted = VllmConfig.from_engine_args()  # a scheduler adopting a pooling worker's model part
    adopted.adopt_model_config(c.to_proto().model_config)
    assert adopted.model_config.runner == "pooling" and not adopted.cache_config.enable_prefix_caching
    for bad, match in [({"runner": "pooling", "convert": "none"}, "convert 'embed'"),
                       ({"convert": "embed"}, "needs runner 'pooling'"),
                       ({"pooler_config": {"pooling_type": "LAST"}}, "needs runner 'pooling'"),
                       ({"runner": "pooling", "pooler_config": {"pooling_type": "CLS"}}, "pooling_type"),
                       ({"runner": "pooling", "pooler_config": '{"normalise": true}'}, "unknown field"),
                       ({"runner": "pooling", "speculative_config": {"method": "ngram",
                                                                    "num_speculative_tokens": 2}}, "pooling"),
                       ({"runner": "embed"}, "runner must be")]:
        with pytest.raises(ValueError, match=match):
            VllmConfig.from_engine_args(**bad)


# ---------------------------------------------------------------------- unit: the scheduler


def _pooling_request(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), pb.SamplingParams(), frozenset(), max_tokens=0,
                   pooling_params=pb.PoolingParams())


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_pooling_request_finishes_after_its_prefill_and_frees_its_blocks(async_scheduling: bool) -> None:
    s = scheduler_for(num_blocks=32, block_size=16, max_num_seqs=4, max_num_batched_tokens=BUDGET, max_model_len=128,
                  enable_prefix_caching=False, async_scheduling=async_scheduling)
    s.add_request(_pooling_request("long", 128))  # may fill the whole context: nothing is generated
    s.add_request(_pooling_request("short", 10))
    finished: dict[str, pb.RequestOutput] = {}
    in_flight: list[tuple[pb.SchedulerOutput, pb.ModelRunnerOutput]] = []
    for _ in range(10):
        so = s.schedule()
        if so.num_scheduled_tokens:
            assert sum(so.num_scheduled_tokens) <= BUDGET
            ids = [r.request_id for r in so.new_requests] + [r.request_id for r in so.cached_requests]
            assert all(r.HasField("pooling") for r in so.new_requests)
            assert all(s.requests[rid].num_output_placeholders == 0 for rid in ids)
            done = [rid for rid in ids if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens]
            in_flight.append((so, pb.ModelRunnerOutput(step_id=so.step_id, pooler_output=[
                pb.PoolerOutput(request_id=rid, embedding=embedding_bytes(torch.ones(2))) for rid in done])))
        elif not in_flight:
            break
        # Async scheduling: the step's output comes back after the next one is scheduled.
        while len(in_flight) > (1 if async_scheduling and so.num_scheduled_tokens else 0):
            for o in s.update_from_output(*in_flight.pop(0)):
                assert o.finish_reason == "stop" and not o.new_token_ids
                finished[o.request_id] = o
    assert set(finished) == {"long", "short"} and finished["long"].num_prompt_tokens == 128
    assert embedding_from_bytes(finished["short"].pooled_output) == [1.0, 1.0]
    assert s.stats()["num_free_blocks"] == 31 and not s.has_unfinished_requests()


# ---------------------------------------------------------------------- unit: the worker's boundary


def test_the_worker_refuses_pooling_steps_it_cannot_run() -> None:
    batch = InputBatch(4, 64, 16, seed=0)
    limits = PoolingLimits(hidden_size=576)

    def new(pooling: pb.PoolingParams | None = None, computed: int = 0) -> pb.SchedulerOutput:
        r = pb.NewRequestData(request_id="a", prompt_token_ids=[1, 2, 3, 4], block_ids=[1],
                              num_computed_tokens=computed, pooling=pooling)
        return pb.SchedulerOutput(step_id=1, new_requests=[r], num_scheduled_tokens=[4 - computed])

    validate_step(new(pb.PoolingParams()), batch, 8, 100, limits)
    validate_step(new(), batch, 8, 100)  # a generate worker, a generate request
    for so, pooling, message in [(new(pb.PoolingParams()), None, "generate runner"),
                                 (new(), limits, "pooling runner"),
                                 (new(pb.PoolingParams(), computed=2), limits, "nothing computed"),
                                 (new(pb.PoolingParams(dimensions=8)), limits, "Matryoshka")]:
        with pytest.raises(InvalidStep, match=message):
            validate_step(so, batch, 8, 100, pooling)
    validate_step(new(pb.PoolingParams(dimensions=8)), batch, 8, 100, PoolingLimits(576, True))


def test_the_largest_pooled_answer_fits_what_a_scheduler_reads() -> None:
    from services.common.message_limits import MAX_POOLED_DIMENSIONS, MAX_REQUEST_ID_CHARS, runner_output_bytes

    max_num_seqs, max_num_batched_tokens = 4, 3  # at most 3 requests complete their prompt in a step
    wide = "\U0001f600"  # 4 bytes in UTF-8
    out = pb.ModelRunnerOutput(step_id=2**62, pooler_output=[
        pb.PoolerOutput(request_id=f"{i}" + wide * (MAX_REQUEST_ID_CHARS - 1),
                        embedding=b"\xff" * (4 * MAX_POOLED_DIMENSIONS)) for i in range(max_num_batched_tokens)])
    assert out.ByteSize() <= runner_output_bytes(max_num_seqs, max_num_batched_tokens, 0)


def test_the_engine_serves_one_kind_of_request_per_runner() -> None:
    from services.engine.engine_core import EngineCore
    from services.engine.request_limits import InvalidRequest

    info = pb.ModelInfo(max_model_len=64, vocab_size=100, hidden_size=8, device="cpu")
    generate, pooling = (EngineCore(VllmConfig.from_engine_args(runner=r), info, num_blocks=16)
                         for r in ("generate", "pooling"))
    embed = pb.GenerateRequest(request_id="e", prompt_token_ids=[1] * 64, pooling=pb.PoolingParams(),
                               sampling=pb.SamplingParams(logprobs=10**6))  # ignored, never sent on
    text = pb.GenerateRequest(request_id="t", prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequest, match="--runner pooling"):
        generate.add_request(embed)
    with pytest.raises(InvalidRequest, match="this model runs the pooling runner"):
        pooling.add_request(text)
    with pytest.raises(InvalidRequest, match="Matryoshka"):
        pooling.add_request(pb.GenerateRequest(request_id="d", prompt_token_ids=[1], pooling=pb.PoolingParams(
            dimensions=4)))
    with pytest.raises(InvalidRequest, match="max_model_len is 64"):
        pooling.add_request(pb.GenerateRequest(request_id="l", prompt_token_ids=[1] * 65, pooling=pb.PoolingParams()))
    pooling.add_request(embed)  # the whole context: nothing is generated
    so = pooling.schedule()
    assert so.new_requests[0].sampling == pb.SamplingParams() and so.new_requests[0].HasField("pooling")
    assert pooling.stats().runner == "pooling" and not pooling.scheduler.kv_cache_manager.enable_prefix_caching


def test_a_generate_engine_answers_embeddings_with_a_400_naming_the_flag(smollm2_dir: str) -> None:
    from support.fake_scheduler import FakeScheduler, FakeSchedulerServer

    from services.gateway.server import BackgroundGateway

    fake = FakeScheduler(max_model_len=256)  # a generate engine (its Stats name no runner)
    with FakeSchedulerServer(fake) as scheduler, BackgroundGateway(scheduler.address, smollm2_dir) as gateway:
        response = httpx.post(f"{gateway.url}/v1/embeddings", json={"input": "hi"}, timeout=30)
        assert response.status_code == 400, response.text
        assert "--runner pooling" in response.json()["error"]["message"]
