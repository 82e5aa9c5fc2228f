"""Where an engine's model-parallel ranks meet: a torch.distributed TCPStore hosted by the
engine's owner (the scheduler service, or the offline `LLM`) on a free port of its host.

Every rank gets the same `distributed_init_method`, "tcp://host:port/generation", and joins as a
client under that generation's key prefix (services/worker/parallel.py). Setting the ranks up
again after a failure is a new generation on the same store: no stale keys, no port race.
"""

from __future__ import annotations

import itertools
import os
from datetime import timedelta

import torch.distributed as dist


def rank_timeout() -> timedelta:
    """How long a rank waits for its peers (in the rendezvous and in every collective): a rank
    that died leaves the others blocked, and they give up after this long."""
    return timedelta(seconds=float(os.environ.get("MYVLLM_TP_TIMEOUT_S", "300")))


class RendezvousStore:
    """The key-value store the ranks meet at, hosted by the engine's owner on a free port."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None) -> None:
        """`port` 0: a free one."""
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=rank_timeout())
        self.advertise_host = advertise_host or host
        self._generations = itertools.count()

    def next_init_method(self) -> str:
        """The init method for one set-up of the ranks (a fresh key prefix each time)."""
        return self.init_method(next(self._generations))

    def init_method(self, generation: int) -> str:
        """The init method of set-up number `generation` (owners that set up several engines'
        ranks as one group count their set-ups themselves, and agree on the number)."""
        return f"tcp://{self.advertise_host}:{self.store.port}/{generation}"
