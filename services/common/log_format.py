"""Log lines as vLLM writes them (`INFO 12-04 21:40:01 [file.py:123] message`), so what reads a
vLLM server's output (people, log parsers) reads ours.

`configure_service_logging` is what each service process (worker, scheduler, gateway) calls once:
our own loggers (`services.*`) at INFO, everything else at WARNING (third-party libraries log
chatter at INFO, e.g. httpx a line per HTTP request). $MYVLLM_LOGGING_LEVEL changes our level,
as $VLLM_LOGGING_LEVEL does vLLM's.
"""

from __future__ import annotations

import logging
import os
import sys

# vLLM's format (vllm/logger.py): level, month-day, time, [file:line].
VLLM_LOG_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
VLLM_DATE_FORMAT = "%m-%d %H:%M:%S"
LOGGING_LEVEL_ENV = "MYVLLM_LOGGING_LEVEL"
# The package every one of our modules logs under (logging.getLogger(__name__)).
SERVICES_LOGGER = "services"


def vllm_formatter() -> logging.Formatter:
    return logging.Formatter(VLLM_LOG_FORMAT, datefmt=VLLM_DATE_FORMAT)


def logging_level() -> int:
    """Our loggers' level: $MYVLLM_LOGGING_LEVEL (a level name), else INFO."""
    name = (os.environ.get(LOGGING_LEVEL_ENV) or "INFO").upper()
    level = logging.getLevelName(name)
    return level if isinstance(level, int) else logging.INFO


def configure_service_logging() -> None:
    """One stderr handler on the root logger, in vLLM's format; ours at INFO, others at WARNING.
    Idempotent (a second call changes nothing)."""
    root = logging.getLogger()
    if not any(isinstance(h, _ServiceHandler) for h in root.handlers):
        handler = _ServiceHandler(sys.stderr)
        handler.setFormatter(vllm_formatter())
        root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger(SERVICES_LOGGER).setLevel(logging_level())


class _ServiceHandler(logging.StreamHandler):
    """The service's stderr handler (its own class, so that it is added once)."""
