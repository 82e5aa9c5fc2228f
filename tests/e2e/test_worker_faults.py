"""Engine-side faults with real processes on loopback: a worker killed (-9) or hung
(SIGSTOP) under a scheduler, the internal token, LoadModel / InitKVCache limits, and
`myvllm serve` restarting a killed worker while applying every flag it was given.

One replica (worker + scheduler publishing to a real redis-server, internal token set,
--engine-timeout 3, a waiting queue of 4) is shared by the tests of this module; each leaves
it healthy.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis
from support.mesh import Mesh
from support.replica import Replica

from services.client.grpc_client import Client, RequestRejected, SchedulerAuthError, SchedulerUnavailable
from services.common.auth import TOKEN_ENV, TOKEN_METADATA_KEY
from services.common.config import VllmConfig
from services.common.proto import myvllm_pb2 as pb
from services.common.proto import myvllm_pb2_grpc as pb_grpc
from services.common.redis_registry import ENGINES_KEY
from services.common.sampling_params import SamplingParams

TOKEN = "test-internal-token"
ENGINE_TIMEOUT_S = 3.0
MAX_NUM_SEQS = 8  # replica.scheduler_args' default
MAX_WAITING_REQUESTS = 4
# Four full blocks of 16 tokens plus a tail: what the prefix cache holds after one run.
PROMPT = [1] + list(range(3000, 3070))
GREEDY = SamplingParams(temperature=0, max_tokens=8)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def replica(smollm2_dir: str, redis_server: str):
    r = Replica(smollm2_dir, redis_server, token=TOKEN,
                extra_scheduler_args=("--engine-timeout", str(ENGINE_TIMEOUT_S),
                                      "--max-waiting-requests", str(MAX_WAITING_REQUESTS)))
    r.redis = redis.Redis.from_url(redis_server)
    try:
        r.wait_healthy()
        yield r
    finally:
        r.stop()


def _greedy(client: Client, prompt: list[int] = PROMPT) -> tuple[list[int], int]:
    """(generated token ids, prompt tokens served by the prefix cache)."""
    tokens, cached = [], 0
    for out in client.generate(prompt, GREEDY):
        tokens += out.new_token_ids
        cached = out.num_cached_tokens
    return tokens, cached


def _in_redis(replica: Replica) -> bool:
    return replica.redis.hget(ENGINES_KEY, replica.address) is not None


def _wait_for(condition, what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _start_long_requests(client: Client, n: int, prefix: str = "long", sampling: SamplingParams = LONG
                         ) -> tuple[list[threading.Event], list, ThreadPoolExecutor]:
    """n long requests on threads (ids prefix-0 .. prefix-(n-1)); each event is set once its
    request produced a token. The futures return the exception that ended each request (None
    if it finished or was aborted)."""
    started = [threading.Event() for _ in range(n)]

    def run(i: int) -> BaseException | None:
        try:
            for _ in client.generate([1, 2, 3 + i], sampling, request_id=f"{prefix}-{i}"):
                started[i].set()
        except (RequestRejected, SchedulerUnavailable) as e:
            started[i].set()
            return e
        return None

    pool = ThreadPoolExecutor(n)
    return started, [pool.submit(run, i) for i in range(n)], pool


def _raw_call(address: str, stub_class, method: str, request, token: str | None):
    with grpc.insecure_channel(address) as channel:
        metadata = ((TOKEN_METADATA_KEY, token),) if token is not None else None
        result = getattr(stub_class(channel), method)(request, timeout=10, metadata=metadata)
        return list(result) if hasattr(result, "__next__") else result  # read a stream before the channel closes


# ---------------------------------------------------------------------- auth and limits


@pytest.mark.parametrize("service", ["worker", "scheduler"])
def test_every_rpc_needs_the_internal_token(replica: Replica, service: str) -> None:
    address, stub = ((replica.worker_address, pb_grpc.WorkerStub) if service == "worker"
                     else (replica.address, pb_grpc.SchedulerStub))
    for token, reason in ((None, "missing internal token"), ("wrong", "wrong internal token")):
        with pytest.raises(grpc.RpcError) as info:
            _raw_call(address, stub, "Health", pb.Empty(), token)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and reason in info.value.details()
    assert _raw_call(address, stub, "Health", pb.Empty(), TOKEN).ok
    # The streams too (Generate / Execute would otherwise run requests or steps).
    generate = pb.ClientMessage(generate=pb.GenerateRequest(request_id="x", prompt_token_ids=[1]))
    method, message = ("Execute", pb.SchedulerOutput(step_id=1)) if service == "worker" else ("Generate", generate)
    with pytest.raises(grpc.RpcError) as info:
        _raw_call(address, stub, method, iter([message]), None)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_sdk_client_sends_its_token_and_a_wrong_one_is_refused(replica: Replica) -> None:
    with Client(replica.address, timeout=5, token="wrong") as client:
        assert not client.health()
        with pytest.raises(SchedulerAuthError, match="refused this client's internal token"):  # (saying so)
            _greedy(client)
    with replica.client() as client:
        tokens, _ = _greedy(client)
        assert len(tokens) == 8


def _load_request(model: str | None = None, **engine_args) -> pb.LoadModelRequest:
    """A LoadModel as a scheduler sends it (no model part: the worker's), or naming `model`.
    VllmConfig would refuse the out-of-range values these tests send: they go in the proto."""
    max_num_seqs = engine_args.pop("max_num_seqs", 8)
    config = VllmConfig.from_engine_args(model=model or "", **engine_args).to_proto(with_model_config=model is not None)
    config.scheduler_config.max_num_seqs = max_num_seqs
    return pb.LoadModelRequest(config=config)


def test_load_model_of_another_path_and_an_oversized_kv_cache_are_refused(replica: Replica, tmp_path) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _raw_call(replica.worker_address, pb_grpc.WorkerStub, "LoadModel", _load_request(str(tmp_path)), TOKEN)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and str(tmp_path) in info.value.details()
    # Its own model, spelt another way, is allowed and keeps the loaded weights.
    info = _raw_call(replica.worker_address, pb_grpc.WorkerStub, "LoadModel",
                     _load_request(replica.model_dir + "/.", max_num_seqs=8, dtype="float32", max_model_len=1024),
                     TOKEN)
    assert info.model == replica.model_dir
    assert len(re.findall(r"loaded .* attention backend", replica.log(f"worker-{replica.worker_starts}"))) == 1
    with pytest.raises(grpc.RpcError) as info:  # sizes the batch arrays: bounded whoever asks
        _raw_call(replica.worker_address, pb_grpc.WorkerStub, "LoadModel",
                  _load_request(max_num_seqs=2**31 - 1), TOKEN)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "LoadModel.config: max_num_seqs must be in" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        _raw_call(replica.worker_address, pb_grpc.WorkerStub, "InitKVCache",
                  pb.InitKVCacheRequest(num_blocks=1 << 30, block_size=16), TOKEN)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert re.search(r"sequences need \d+ bytes; this worker can hold at most \d+", info.value.details())


def test_bad_requests_end_with_invalid_request(replica: Replica) -> None:
    with replica.client() as client:
        for prompt, sp, message in (
                ([1] * 1024, GREEDY, "max_model_len is 1024"),
                ([1, 2], pb.SamplingParams(logprobs=21), "logprobs must be in"),
                ([1, 2], pb.SamplingParams(logprobs=-1, logit_bias={10**6: 1.0}), "out of range")):
            with pytest.raises(RequestRejected, match=re.escape(message)) as info:
                list(client.generate(prompt, sp))
            assert info.value.error_kind == pb.INVALID_REQUEST and not info.value.is_engine_failure


def test_a_full_waiting_queue_refuses_with_resource_exhausted(replica: Replica) -> None:
    """--max-waiting-requests bounds what a raw gRPC client can pile up: with the batch full and
    the queue full, one more request ends at once with RESOURCE_EXHAUSTED (backpressure, not an
    engine failure: a gateway answers 429 and does not migrate it)."""
    # A full batch fits the KV cache (no preemption moves requests between the queues) and runs
    # long enough that none finishes while the test looks.
    sampling = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    seen: list[tuple[int, int]] = []  # (running, waiting), for a failure

    def wait_until(running: int, waiting: int, futures: list) -> None:
        deadline = time.monotonic() + 60
        while not seen or seen[-1] != (running, waiting):
            assert time.monotonic() < deadline, (f"never {running} running and {waiting} waiting: {seen[-10:]}; "
                                                 f"ended: {[f.result() for f in futures if f.done()]}")
            stats = replica.stats()
            seen.append((stats.num_running, stats.num_waiting))
            time.sleep(0.05)

    with replica.client() as client:
        # In rounds of at most the cap: requests that arrive together all wait until a step takes
        # them, so a bigger burst would already meet the cap.
        rounds = [("batch-a", MAX_NUM_SEQS // 2), ("batch-b", MAX_NUM_SEQS // 2), ("queued", MAX_WAITING_REQUESTS)]
        expected = [(MAX_NUM_SEQS // 2, 0), (MAX_NUM_SEQS, 0), (MAX_NUM_SEQS, MAX_WAITING_REQUESTS)]
        futures, pools = [], []
        try:
            for (prefix, n), (running, waiting) in zip(rounds, expected, strict=True):
                _, started, pool = _start_long_requests(client, n, prefix=prefix, sampling=sampling)
                futures += started
                pools.append(pool)
                wait_until(running, waiting, futures)
            with pytest.raises(RequestRejected, match="--max-waiting-requests") as info:
                _greedy(client)
            assert info.value.error_kind == pb.RESOURCE_EXHAUSTED and not info.value.is_engine_failure
        finally:
            client.abort([f"{prefix}-{i}" for prefix, n in rounds for i in range(n)])
            results = [f.result(timeout=60) for f in futures]
            for pool in pools:
                pool.shutdown()
        assert results == [None] * (MAX_NUM_SEQS + MAX_WAITING_REQUESTS)  # aborted, not failed
        _wait_for(lambda: (s := replica.stats()).num_running == 0 and s.num_waiting == 0, "the aborts")
        assert _greedy(client)[0]  # and it serves again


def test_allowed_model_root_admits_only_directories_below_it(tmp_path) -> None:
    from services.worker.server import _is_under

    root = tmp_path / "models"
    (root / "a").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "link").symlink_to(tmp_path / "elsewhere")
    assert _is_under(str(root / "a"), str(root))
    assert not _is_under(str(root / ".." / "elsewhere"), str(root))
    assert not _is_under(str(root / "link"), str(root))  # a symlink out of the root does not count
    assert not _is_under(str(tmp_path / "models-2"), str(root))


# ---------------------------------------------------------------------- a hung worker


def test_a_stopped_worker_is_detected_within_the_engine_timeout_and_recovers(replica: Replica) -> None:
    with replica.client() as client:
        started, futures, pool = _start_long_requests(client, 2)
        for event in started:
            assert event.wait(60)
        replica.kill_worker(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            errors = [f.result(timeout=ENGINE_TIMEOUT_S + 15) for f in futures]
            detected_after = time.monotonic() - stopped_at
            assert all(isinstance(e, RequestRejected) and e.error_kind == pb.ENGINE_FAULT for e in errors), errors
            assert "--engine-timeout" in errors[0].message
            assert detected_after < ENGINE_TIMEOUT_S + 5
            replica.wait_healthy(False, timeout_s=5)
            _wait_for(lambda: not _in_redis(replica), "the replica to leave redis")
        finally:
            replica.kill_worker(signal.SIGCONT)
            pool.shutdown()
    replica.wait_healthy(True, timeout_s=60)
    with replica.client() as client:
        assert len(_greedy(client)[0]) == 8
    _wait_for(lambda: _in_redis(replica), "the replica to rejoin redis")


# ---------------------------------------------------------------------- a killed worker


def test_killed_worker_fails_running_requests_and_a_restarted_one_is_set_up_again(replica: Replica) -> None:
    with replica.client() as client:
        reference, _ = _greedy(client)
        again, cached = _greedy(client)
        assert again == reference and cached >= 64  # the prompt's blocks are in the prefix cache
        started, futures, pool = _start_long_requests(client, 3)
        for event in started:
            assert event.wait(60)
        replica.kill_worker(signal.SIGKILL)
        errors = [f.result(timeout=30) for f in futures]
        pool.shutdown()
        assert all(isinstance(e, RequestRejected) and e.error_kind == pb.ENGINE_FAULT for e in errors), errors
        assert "engine fault" in errors[0].message
        # No worker: unhealthy, out of redis, and a new request fails at once instead of queueing.
        replica.wait_healthy(False, timeout_s=10)
        _wait_for(lambda: not _in_redis(replica), "the replica to leave redis")
        t0 = time.monotonic()
        with pytest.raises(RequestRejected) as info:
            _greedy(client)
        assert info.value.error_kind == pb.UNAVAILABLE and time.monotonic() - t0 < 5

        replica.start_worker()  # same port: the scheduler finds it and sets it up again
        replica.wait_healthy(True, timeout_s=120)
        _wait_for(lambda: _in_redis(replica), "the replica to rejoin redis")
        after, cached = _greedy(client)
        assert after == reference
        assert cached == 0  # the prefix cache was dropped with the old worker's KV
    # The restarted worker read its weights once (the scheduler's LoadModel found them loaded).
    log = replica.log(f"worker-{replica.worker_starts}")
    assert len(re.findall(r"loaded .* attention backend \w+", log)) == 1, log[-2000:]



def test_an_idle_scheduler_notices_its_dead_worker_and_takes_the_restarted_one(replica: Replica) -> None:
    replica.kill_worker(signal.SIGKILL)
    t0 = time.monotonic()
    replica.wait_healthy(False, timeout_s=15)  # no request needed to notice
    assert time.monotonic() - t0 < 10
    _wait_for(lambda: not _in_redis(replica), "the replica to leave redis")
    replica.start_worker()
    replica.wait_healthy(True, timeout_s=120)
    with replica.client() as client:
        assert len(_greedy(client)[0]) == 8

# ---------------------------------------------------------------------- myvllm serve


def test_serve_applies_its_flags_and_restarts_a_killed_worker(smollm2_dir: str) -> None:
    import openai

    mesh = Mesh(["--model", smollm2_dir, "--dtype", "bfloat16", "--max-num-seqs", "4", "--max-model-len", "512",
                 "--kv-cache-memory", str(32 << 20)], env={TOKEN_ENV: TOKEN, "MYVLLM_NUM_THREADS": "1"})
    try:
        with Client(f"127.0.0.1:{mesh.scheduler_port}", timeout=10, token=TOKEN) as client:
            stats = client.get_stats()
            assert (stats.dtype, stats.max_num_seqs, stats.max_model_len) == ("bfloat16", 4, 512)
            assert stats.attention_backend in ("cpu", "torch")
            # Eight concurrent requests, at most four running at once.
            seen_running, done = [], threading.Event()

            def poll() -> None:
                while not done.is_set():
                    seen_running.append(client.get_stats().num_running)
                    time.sleep(0.05)

            poller = threading.Thread(target=poll)
            poller.start()
            sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            try:
                with ThreadPoolExecutor(8) as pool:
                    outs = list(pool.map(lambda i: [t for o in client.generate([1, 5 + i], sp)
                                                    for t in o.new_token_ids], range(8)))
            finally:
                done.set()
                poller.join()
            assert [len(o) for o in outs] == [24] * 8
            assert max(seen_running) == 4, seen_running

        worker_pid = int(re.search(r"started worker \(pid (\d+)\)", "".join(mesh.output)).group(1))
        os.kill(worker_pid, signal.SIGKILL)
        _wait_for(lambda: re.search(rf"worker \(pid {worker_pid}\) exited with code -9; restarting",
                                    "".join(mesh.output)), "serve to notice the dead worker")
        client = openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        deadline = time.monotonic() + 120
        while True:  # until the restarted worker is set up again by the scheduler
            try:
                reply = client.completions.create(model=client.models.list().data[0].id, prompt="Hello",
                                                  max_tokens=4, temperature=0)
                break
            except openai.APIError:
                assert time.monotonic() < deadline, "".join(mesh.output)[-3000:]
                time.sleep(1)
        assert reply.choices[0].text
        assert mesh.proc.poll() is None  # serve itself never went down
        assert len(re.findall(r"started worker \(pid \d+\)", "".join(mesh.output))) == 2
    finally:
        assert mesh.stop() == 0
