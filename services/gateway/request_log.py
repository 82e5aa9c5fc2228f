"""`--enable-log-requests`: one INFO line per request with its sampling parameters, as vLLM logs
them, whatever the process's logging setup (the gateway leaves the root logger at WARNING)."""

from __future__ import annotations

import logging

REQUEST_LOGGER = "myvllm.requests"


def request_logger() -> logging.Logger:
    """The request log, writing INFO lines to stderr (its own handler, set up once)."""
    log = logging.getLogger(REQUEST_LOGGER)
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    return log


class _StderrHandler(logging.StreamHandler):
    """The request log's own handler (so that it is added once, whatever others are attached)."""
