"""`--enable-log-requests`: one INFO line per request with its sampling parameters, as vLLM logs
them (its format too), whatever the process's logging setup (a gateway in a test configures none)."""

from __future__ import annotations

import logging

from services.common.log_format import vllm_formatter

REQUEST_LOGGER = "myvllm.requests"


def request_logger() -> logging.Logger:
    """The request log, writing INFO lines to stderr (its own handler, set up once)."""
    log = logging.getLogger(REQUEST_LOGGER)
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(vllm_formatter())
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    return log


class _StderrHandler(logging.StreamHandler):
    """The request log's own handler (so that it is added once, whatever others are attached)."""
