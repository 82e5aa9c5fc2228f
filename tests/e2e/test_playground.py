"""The gateway's page at `/` (services/gateway/static/), driven in a real headless Chromium via
Selenium against a real uvicorn gateway in front of the fake scheduler.

The fake replays a scripted reply one token per `step_delay_s`, slowly enough that the test sees
the reply grow; its stats report one running request per request it is generating, so the status
view's "running" goes 0 → 1 → 0. Needs Debian's `chromium` and `chromium-driver` (`make setup`);
without them the tests skip. `scripts/playground_screenshot.py` reuses the helpers here.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from support.fake_scheduler import FakeScheduler, FakeSchedulerServer

from services.common.proto import myvllm_pb2 as pb
from services.gateway.options import GatewayOptions
from services.gateway.server import BackgroundGateway
from services.text.tokenizer import Tokenizer

MODEL = "SmolLM2-135M-Instruct"  # the served name: the model directory's basename
EOS = 2  # <|im_end|>
REPLY = "Hello 世界 🎉! How are you today?"
API_KEY = "sesame-open"
STEP_DELAY_S = 0.12  # per token: ~1.5 s for REPLY, several status polls at POLL_MS
POLL_MS = 250


# ---------------------------------------------------------------------- helpers (also the screenshot script's)


def find_browser() -> tuple[str, str] | None:
    """(chromium binary, chromedriver) on PATH, or None."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def start_browser(width: int = 1280, height: int = 900):  # -> selenium.webdriver.Chrome
    """Headless Chromium through its WebDriver (the Debian binaries: Selenium Manager downloads nothing)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    found = find_browser()
    assert found is not None, "chromium / chromedriver not found"
    browser, driver = found
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--disable-extensions", "--no-first-run", f"--window-size={width},{height}"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))


class CountingScheduler(FakeScheduler):
    """The fake scheduler, with stats that count the requests it is generating (running) and
    a KV usage that follows them, so the status view has numbers that move."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.live: set[str] = set()

    def _step(self, running):  # one token of one request
        output = super()._step(running)
        if output.finish_reason:
            self.live.discard(output.request_id)
        else:
            self.live.add(output.request_id)
        return output

    async def Generate(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        try:
            async for step in super().Generate(request_iterator, context):
                yield step
        finally:
            self.live.clear()  # stream closed: the fake aborts what it had

    async def GetStats(self, request, context):  # noqa: N802
        running = len(self.live.difference(self.aborted))
        used = 10 * running
        return pb.Stats(num_free_blocks=100 - used, num_total_blocks=100, num_waiting=0, num_running=running,
                        kv_cache_usage=used / 100, max_model_len=self.max_model_len, model=self.model, block_size=16)


@dataclass
class Stack:
    scheduler: FakeSchedulerServer
    gateway: BackgroundGateway
    tokenizer: Tokenizer

    @property
    def fake(self) -> CountingScheduler:
        return self.scheduler.servicer


@contextlib.contextmanager
def playground_stack(model_dir: str, reply: str = REPLY, step_delay_s: float = STEP_DELAY_S,
                     api_key: str | None = None) -> Iterator[Stack]:
    """A gateway (with `api_key`, if given) in front of a fake scheduler that answers `reply`."""
    tokenizer = Tokenizer.load(model_dir)
    script = tokenizer.encode(reply, add_special_tokens=False) + [EOS]
    fake = CountingScheduler(script=script, eos_token_id=EOS, max_model_len=2048, step_delay_s=step_delay_s)
    with FakeSchedulerServer(fake) as scheduler, \
            BackgroundGateway(scheduler.address, model_dir, options=GatewayOptions(api_key=api_key)) as gateway:
        yield Stack(scheduler, gateway, tokenizer)


def text_of(driver, element_id: str) -> str:
    return driver.execute_script("return document.getElementById(arguments[0]).textContent", element_id)


def wait_for(condition: Callable[[], object], timeout_s: float = 10.0, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.03)
    return value


def fill(driver, element_id: str, value: str) -> None:
    element = driver.find_element("id", element_id)
    element.clear()
    element.send_keys(value)


def model_listed(driver) -> bool:
    return driver.execute_script("return [...document.getElementById('model').options].map(o => o.value)") == [MODEL]


# ---------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if find_browser() is None:
        pytest.skip("headless Chromium not found: `chromium` and `chromedriver` must be on PATH "
                    "(Debian: apt-get install chromium chromium-driver; `make setup` does it)")
    driver = start_browser()
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def stack(smollm2_dir: str) -> Iterator[Stack]:
    with playground_stack(smollm2_dir) as stack:
        yield stack


# ---------------------------------------------------------------------- tests


def test_page_streams_a_reply_and_shows_status(browser, stack: Stack) -> None:
    driver, url = browser, stack.gateway.url
    driver.get(f"{url}/?poll_ms={POLL_MS}")
    assert driver.title == "my-vllm playground"
    wait_for(lambda: model_listed(driver), what="the model list from /v1/models")
    wait_for(lambda: text_of(driver, "scheduler-up") == "up" and text_of(driver, "running") == "0",
             what="the status view's first poll")
    assert text_of(driver, "waiting") == "0"
    assert text_of(driver, "kv-cache") == "0.0 %"
    tokens_before = int(wait_for(lambda: text_of(driver, "generation-tokens").isdigit() and
                                 text_of(driver, "generation-tokens"), what="the generation token count"))

    system = "You answer briefly."
    fill(driver, "system-prompt", system)
    fill(driver, "temperature", "0")
    fill(driver, "max-tokens", "64")
    fill(driver, "prompt", "Say hello")
    driver.find_element("id", "send").click()

    # Watch the reply, the status view and the chat state until the stream ends.
    observed: list[str] = []
    running_seen: set[str] = set()
    kv_seen: set[str] = set()
    tps_seen: set[str] = set()
    deadline = time.monotonic() + 15
    while True:
        reply, running, kv, tps, state, stop_enabled = driver.execute_script(
            "const t = (id) => document.getElementById(id).textContent;"
            "return [t('reply'), t('running'), t('kv-cache'), t('output-tps'), t('chat-state'),"
            "        !document.getElementById('stop').disabled]")
        running_seen.add(running)
        kv_seen.add(kv)
        tps_seen.add(tps)
        if not observed or observed[-1] != reply:
            observed.append(reply)
        if not stop_enabled and state.startswith("finished"):
            break
        assert time.monotonic() < deadline, f"the stream did not end (state {state!r}, reply {reply!r})"
        time.sleep(0.03)

    assert observed[-1] == REPLY
    partial = [text for text in observed if text and text != REPLY]
    assert len(partial) >= 2, f"the reply did not grow while streaming: {observed}"
    assert all(a.startswith(b) for a, b in zip(observed[1:], observed, strict=False)), observed  # it only grew
    assert text_of(driver, "chat-state") == "finished: stop"
    assert text_of(driver, "error") == ""

    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Say hello"}]
    prompt_ids = stack.tokenizer.encode(stack.tokenizer.render_chat(messages), add_special_tokens=False)
    num_completion = len(stack.tokenizer.encode(REPLY, add_special_tokens=False)) + 1  # + EOS
    assert text_of(driver, "prompt-tokens") == str(len(prompt_ids))
    assert text_of(driver, "completion-tokens") == str(num_completion)
    request = stack.fake.requests[-1]
    assert request.sampling.temperature == 0 and request.sampling.max_tokens == 64
    for timing in ("ttft", "total-time"):
        assert text_of(driver, timing).endswith(" s"), timing
    assert float(text_of(driver, "ttft").removesuffix(" s")) <= float(text_of(driver, "total-time").removesuffix(" s"))
    assert float(text_of(driver, "tok-per-s")) > 0

    # The status view saw the request run, and counts its tokens once it is done.
    assert "1" in running_seen, running_seen  # (0 before it: checked above; after it: below)
    assert "10.0 %" in kv_seen, kv_seen
    wait_for(lambda: text_of(driver, "generation-tokens") == str(tokens_before + num_completion),
             what="generated tokens counted in the status view")
    wait_for(lambda: text_of(driver, "running") == "0", what="running back to 0")
    assert text_of(driver, "replicas") == "1"
    # Output tok/s is the generated-token delta between two polls: > 0 while the request streamed.
    tps_seen.add(text_of(driver, "output-tps"))
    assert max(float(v) for v in tps_seen if v != "–") > 0, tps_seen
    assert driver.execute_script("return document.getElementById('tps-chart').width") > 0


def test_stop_aborts_the_stream(browser, stack: Stack) -> None:
    driver = browser
    driver.get(f"{stack.gateway.url}/?poll_ms={POLL_MS}")
    wait_for(lambda: model_listed(driver), what="the model list")
    stack.fake.step_delay_s = 0.5
    try:
        fill(driver, "prompt", "Say hello slowly")
        driver.find_element("id", "send").click()
        wait_for(lambda: text_of(driver, "reply"), what="the first streamed text")
        driver.find_element("id", "stop").click()
        wait_for(lambda: text_of(driver, "chat-state") == "stopped", what="the stopped state")
        request_id = stack.fake.requests[-1].request_id
        wait_for(lambda: request_id in stack.fake.aborted, what="the abort at the scheduler")
        assert text_of(driver, "reply") != REPLY
        assert not driver.find_element("id", "send").get_property("disabled")
        wait_for(lambda: text_of(driver, "running") == "0", what="running back to 0 after the abort")
    finally:
        stack.fake.step_delay_s = STEP_DELAY_S


def test_api_key_is_asked_for_and_sent(browser, smollm2_dir: str) -> None:
    driver = browser
    with playground_stack(smollm2_dir, step_delay_s=0.01, api_key=API_KEY) as keyed:
        driver.get(f"{keyed.gateway.url}/?poll_ms={POLL_MS}")  # a fresh origin: no key in sessionStorage
        error = driver.find_element("id", "error")
        wait_for(lambda: error.is_displayed() and "401" in error.text, what="the 401 from /v1/models")
        assert "Missing API key" in error.text and "API key above" in error.text
        assert not model_listed(driver)
        wait_for(lambda: text_of(driver, "scheduler-up") == "up", what="/metrics, open without a key")

        fill(driver, "prompt", "Say hello")
        driver.find_element("id", "send").click()
        wait_for(lambda: text_of(driver, "chat-state") == "failed", what="the refused request")
        assert "401" in error.text and text_of(driver, "reply") == ""
        assert not keyed.fake.requests

        fill(driver, "api-key", "wrong")
        driver.find_element("id", "save-key").click()
        wait_for(lambda: "Incorrect API key" in error.text, what="the wrong key refused")

        fill(driver, "api-key", API_KEY)
        driver.find_element("id", "save-key").click()
        wait_for(lambda: model_listed(driver), what="the model list with the key")
        assert not error.is_displayed()
        driver.find_element("id", "send").click()
        wait_for(lambda: text_of(driver, "chat-state") == "finished: stop", what="the reply with the key")
        assert text_of(driver, "reply") == REPLY

        # The key lives in sessionStorage: a reload keeps it (and the page uses it at once).
        driver.refresh()
        wait_for(lambda: model_listed(driver), what="the model list after a reload")
        assert driver.find_element("id", "api-key").get_property("value") == API_KEY


def test_page_opened_while_the_server_starts_lists_the_model_once_it_is_ready(browser, smollm2_dir: str) -> None:
    """The page loaded before any replica is up shows the 503 and asks /v1/models again after its
    Retry-After, so the model appears without a reload once the scheduler answers."""
    driver = browser
    with FakeSchedulerServer() as probe:  # a free port, nothing listening once it stops
        port = probe.port
    fake = CountingScheduler(script=[EOS], eos_token_id=EOS, max_model_len=2048)
    with BackgroundGateway(f"127.0.0.1:{port}", smollm2_dir) as gateway:
        driver.get(f"{gateway.url}/?poll_ms={POLL_MS}")
        error = driver.find_element("id", "error")
        wait_for(lambda: error.is_displayed() and "503" in error.text, what="the 503 from /v1/models")
        assert "The server is starting" in error.text and not model_listed(driver)
        with FakeSchedulerServer(fake, port=port):
            wait_for(lambda: model_listed(driver), what="the model list once a replica is ready")
            assert not error.is_displayed()


def test_page_routes_leave_the_api_alone(stack: Stack) -> None:
    """`/` and /static/* serve the page (no browser needed); /health, /metrics and /v1 are as before,
    and the page is not part of the OpenAPI schema."""
    import httpx

    url = stack.gateway.url
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="send"' in page.text and 'src="static/playground.js"' in page.text
    for name, kind in (("playground.js", "javascript"), ("playground.css", "text/css")):
        asset = httpx.get(f"{url}/static/{name}")
        assert asset.status_code == 200 and kind in asset.headers["content-type"], name
    # Self-contained: nothing loaded from another origin.
    assert "://" not in page.text and "://" not in httpx.get(f"{url}/static/playground.js").text
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert "vllm:generation_tokens_total" in httpx.get(f"{url}/metrics").text
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == MODEL
    assert "/" not in httpx.get(f"{url}/openapi.json").json()["paths"]
