"""A stand-in `llama-server` for tests that need no llama.cpp build: a small HTTP server speaking
the endpoints the bench uses, started from the command line the bench gives the real one."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

# Answers /health, /v1/models, the native /completion (non-streamed) and a streamed
# /v1/completions, one token per chunk then a last one with the usage, as llama-server streams;
# records its argv beside itself.
FAKE_SERVER = '''#!{python}
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

Path(__file__).with_name("argv.json").write_text(json.dumps(sys.argv[1:]))
port = int(sys.argv[sys.argv.index("--port") + 1])

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _json(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._json({{"status": "ok"}} if self.path == "/health" else {{"data": [{{"id": "fake.gguf"}}]}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/completion":
            Path(__file__).with_name("completion.json").write_text(json.dumps(body))
            self._json({{"content": "x" * body["n_predict"], "tokens_predicted": body["n_predict"]}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            chunk = {{"choices": [{{"text": "x", "index": 0, "finish_reason": None}}]}}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\\n\\n")
        # llama-server's last chunk: no text, the finish reason, and the usage.
        usage = {{"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}}
        last = {{"choices": [{{"text": "", "index": 0, "finish_reason": "length"}}], "usage": usage}}
        self.wfile.write(b"data: " + json.dumps(last).encode() + b"\\n\\n")
        self.wfile.write(b"data: [DONE]\\n\\n")

ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def write_fake_llama_server(folder: Path) -> Path:
    """An executable `llama-server` in `folder` (which then stands for $MYVLLM_LLAMA_BIN_DIR)."""
    server = folder / "llama-server"
    server.write_text(FAKE_SERVER.format(python=sys.executable))
    server.chmod(server.stat().st_mode | stat.S_IXUSR)
    return server
