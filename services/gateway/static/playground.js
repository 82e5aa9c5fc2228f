// my-vllm playground: a chat box streaming from /v1/chat/completions and a status view polled
// from /metrics. No framework, no build step. The API key (only needed when the gateway runs
// with --api-key) is kept in sessionStorage and sent as `Authorization: Bearer` on every /v1 call.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORAGE = "myvllm-api-key";
  // `?poll_ms=` (default 2000) and `?window_s=` (the plot's time span, default 300) tune the status view.
  const query = new URLSearchParams(location.search);
  const POLL_MS = Math.max(200, Number(query.get("poll_ms")) || 2000);
  const HISTORY_S = Math.max(10, Number(query.get("window_s")) || 300);

  // ------------------------------------------------------------------ /v1 calls, the API key

  const apiKey = () => sessionStorage.getItem(KEY_STORAGE) || "";

  function v1(path, options = {}) {
    const headers = new Headers(options.headers || {});
    if (apiKey()) headers.set("Authorization", `Bearer ${apiKey()}`);
    return fetch(`v1${path}`, { ...options, headers }); // relative: works behind a path prefix too
  }

  async function errorText(response) {
    let message = response.statusText;
    try {
      const body = await response.json();
      message = body.error?.message || JSON.stringify(body);
    } catch { /* not JSON: keep the status text */ }
    const hint = response.status === 401 ? " Enter the gateway's API key above." : "";
    return `${response.status} ${response.statusText}: ${message}${hint}`;
  }

  function showError(text) {
    $("error").textContent = text;
    $("error").hidden = !text;
  }

  async function loadModels() {
    const select = $("model");
    try {
      const response = await v1("/models");
      if (!response.ok) {
        select.replaceChildren();
        showError(await errorText(response));
        if (response.status === 503) {  // the server is starting: ask again when it says to
          setTimeout(loadModels, 1000 * (Number(response.headers.get("Retry-After")) || 1));
        }
        return;
      }
      const previous = select.value;
      const ids = (await response.json()).data.map((model) => model.id);
      select.replaceChildren(...ids.map((id) => new Option(id, id)));
      if (ids.includes(previous)) select.value = previous;
      showError("");
    } catch (error) {
      showError(`Cannot reach the gateway: ${error.message}`);
    }
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("api-key").value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
    loadModels();
  });

  // ------------------------------------------------------------------ chat

  // Server-sent events from a fetch body: yields each event's data (its `data:` lines joined).
  async function* sseData(body) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      const events = (buffer + value).split(/\r?\n\r?\n/);
      buffer = events.pop(); // an event not complete yet
      for (const event of events) {
        const data = event.split(/\r?\n/).filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
        if (data) yield data;
      }
    }
  }

  const seconds = (ms) => `${(ms / 1000).toFixed(2)} s`;
  let controller = null; // the request in flight (Stop aborts it)

  function setBusy(busy, state) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    $("chat-state").textContent = state;
  }

  function setNumbers(numbers) {
    for (const [id, value] of Object.entries(numbers)) $(id).textContent = value;
  }

  async function send(event) {
    event.preventDefault();
    const prompt = $("prompt").value;
    if (controller || !prompt.trim()) return;
    const messages = [];
    const system = $("system-prompt").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push({ role: "user", content: prompt });
    const request = {
      model: $("model").value || undefined, // none listed (e.g. no key yet): the gateway's own
      messages,
      temperature: Number($("temperature").value),
      max_tokens: Number($("max-tokens").value),
      stream: true,
      stream_options: { include_usage: true },
    };
    showError("");
    $("reply").textContent = "";
    setNumbers({ "prompt-tokens": "–", "completion-tokens": "–", ttft: "–", "total-time": "–", "tok-per-s": "–" });
    controller = new AbortController();
    setBusy(true, "waiting for the first token…");
    const start = performance.now();
    let firstToken = null;
    let usage = null;
    let finish = null;
    try {
      const response = await v1("/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(request),
        signal: controller.signal,
      });
      if (!response.ok) {
        showError(await errorText(response));
        finish = "failed";
        return;
      }
      for await (const data of sseData(response.body)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) {
          showError(`Error: ${chunk.error.message}`);
          finish = "failed";
          break;
        }
        const choice = chunk.choices?.[0];
        if (choice?.delta?.content) {
          if (firstToken === null) {
            firstToken = performance.now();
            setNumbers({ ttft: seconds(firstToken - start) });
            setBusy(true, "streaming…");
          }
          $("reply").append(choice.delta.content);
        }
        if (choice?.finish_reason) finish = `finished: ${choice.finish_reason}`;
        if (chunk.usage) usage = chunk.usage;
      }
    } catch (error) {
      if (error.name === "AbortError") finish = "stopped";
      else {
        showError(`Request failed: ${error.message}`);
        finish = "failed";
      }
    } finally {
      const end = performance.now();
      controller = null;
      setBusy(false, finish || "done");
      setNumbers({ "total-time": seconds(end - start) });
      if (usage) {
        setNumbers({ "prompt-tokens": usage.prompt_tokens, "completion-tokens": usage.completion_tokens });
        // Decode rate: the tokens after the first over the time from the first token to the end.
        if (firstToken !== null && usage.completion_tokens > 1 && end > firstToken) {
          setNumbers({ "tok-per-s": ((usage.completion_tokens - 1) / ((end - firstToken) / 1000)).toFixed(1) });
        }
      }
    }
  }

  $("chat-form").addEventListener("submit", send);
  $("stop").addEventListener("click", () => controller?.abort());
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("chat-form").requestSubmit();
  });

  // ------------------------------------------------------------------ status (/metrics)

  // Prometheus text format: `name{label="value",...} value [timestamp]`; comments skipped.
  function parseMetrics(text) {
    const samples = [];
    for (const line of text.split("\n")) {
      const match = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/);
      if (!match) continue; // blank lines and # HELP / # TYPE
      const labels = {};
      for (const [, name, value] of (match[2] || "").matchAll(/([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"/g)) {
        labels[name] = value.replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
      }
      const value = { "+Inf": Infinity, "-Inf": -Infinity }[match[3]] ?? Number(match[3]);
      samples.push({ name: match[1], labels, value });
    }
    return samples;
  }

  // The sum over a metric's samples (its label sets); null when it is absent.
  function total(samples, name) {
    const found = samples.filter((sample) => sample.name === name);
    return found.length ? found.reduce((sum, sample) => sum + sample.value, 0) : null;
  }

  const history = []; // {t (s), tps}
  let previous = null; // the last poll's {t, tokens}

  function showStatus(samples) {
    const t = performance.now() / 1000;
    const up = total(samples, "myvllm:scheduler_up");
    const routed = new Set(samples.filter((s) => s.name === "myvllm:replica_requests_total").map((s) => s.labels.replica));
    const running = total(samples, "vllm:num_requests_running");
    const waiting = total(samples, "vllm:num_requests_waiting");
    const kv = total(samples, "vllm:kv_cache_usage_perc");
    const tokens = total(samples, "vllm:generation_tokens_total");
    const shown = (value) => (value === null ? "–" : String(value));
    setNumbers({
      "scheduler-up": up === null ? "–" : up > 0 ? "up" : "down",
      replicas: routed.size ? String(routed.size) : "–",
      running: shown(running),
      waiting: shown(waiting),
      "kv-cache": kv === null ? "–" : `${(kv * 100).toFixed(1)} %`,
      "generation-tokens": shown(tokens),
    });
    $("kv-meter").value = kv ?? 0;
    if (tokens !== null) {
      if (previous !== null && t > previous.t) {
        const delta = tokens >= previous.tokens ? tokens - previous.tokens : tokens; // a restart resets the counter
        history.push({ t, tps: delta / (t - previous.t) });
        while (history.length && history[0].t < t - HISTORY_S) history.shift();
        $("output-tps").textContent = history[history.length - 1].tps.toFixed(1);
      }
      previous = { t, tokens };
    }
    $("status-updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    drawChart(t);
  }

  function drawChart(now) {
    const canvas = $("tps-chart");
    const dpr = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 480;
    const height = Math.round(width / 3);
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
    const ctx = canvas.getContext("2d");
    ctx.scale(dpr, dpr);
    const style = getComputedStyle(document.documentElement);
    const color = (name) => style.getPropertyValue(name).trim();
    const left = 44, right = 8, top = 10, bottom = 20;
    const plotW = width - left - right, plotH = height - top - bottom;
    const max = Math.max(1, ...history.map((point) => point.tps)) * 1.1;
    const x = (t) => left + ((t - (now - HISTORY_S)) / HISTORY_S) * plotW;
    const y = (tps) => top + plotH - (tps / max) * plotH;
    ctx.font = "11px system-ui, sans-serif";
    ctx.lineWidth = 1;
    ctx.strokeStyle = color("--line");
    ctx.fillStyle = color("--muted");
    ctx.textAlign = "right";
    for (const fraction of [0, 0.5, 1]) {
      const value = max * fraction;
      ctx.beginPath();
      ctx.moveTo(left, y(value));
      ctx.lineTo(left + plotW, y(value));
      ctx.stroke();
      ctx.fillText(value === 0 ? "0" : value.toFixed(value < 10 ? 1 : 0), left - 4, y(value) + 4);
    }
    ctx.textAlign = "left";
    ctx.fillText(HISTORY_S >= 120 ? `−${HISTORY_S / 60} min` : `−${HISTORY_S} s`, left, height - 5);
    ctx.textAlign = "right";
    ctx.fillText("output tok/s · now", left + plotW, height - 5);
    if (history.length < 2) return;
    ctx.beginPath();
    history.forEach((point, i) => (i ? ctx.lineTo(x(point.t), y(point.tps)) : ctx.moveTo(x(point.t), y(point.tps))));
    ctx.strokeStyle = color("--accent");
    ctx.lineWidth = 2;
    ctx.stroke();
    ctx.lineTo(x(history[history.length - 1].t), y(0));
    ctx.lineTo(x(history[0].t), y(0));
    ctx.closePath();
    ctx.globalAlpha = 0.15;
    ctx.fillStyle = color("--accent");
    ctx.fill();
    ctx.globalAlpha = 1;
  }

  async function poll() {
    try {
      const response = await fetch("metrics", { cache: "no-store" });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      showStatus(parseMetrics(await response.text()));
    } catch (error) {
      $("status-updated").textContent = `/metrics unreachable (${error.message})`;
    }
    setTimeout(poll, POLL_MS);
  }

  // ------------------------------------------------------------------ start

  $("api-key").value = apiKey();
  $("poll-seconds").textContent = String(POLL_MS / 1000);
  loadModels();
  poll();
})();
