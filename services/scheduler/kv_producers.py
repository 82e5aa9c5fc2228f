"""A GrpcConnector consumer's list of the producers it may fetch KV from, out of the registry.

Its worker fetches a segment from the producer worker a request's kv_transfer_params name,
presenting the internal token: a request must not be able to send the token elsewhere. Besides
the configured kv_connector_extra_config.producer_addresses, a served consumer with Redis trusts
the `kv_address` of kv_producer entries in `myvllm:engines`, signed with the internal token
(services/common/redis_registry.py: nobody without the token can add or move one). It reads them
again when a request names an address it does not know yet (a producer started since), at most
every `min_interval_s` (a flood of such requests costs one Redis read per interval).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from services.common.redis_registry import kv_producer_addresses, read_engine_loads

logger = logging.getLogger("myvllm.scheduler.kv_producers")

READ_TIMEOUT_S = 2.0


class ProducerRegistry:
    def __init__(self, client: Any, token: str | None, min_interval_s: float = 0.5) -> None:
        self.client = client
        self.token = token
        self.min_interval_s = min_interval_s
        self.addresses: frozenset[str] = frozenset()
        self._read_at = float("-inf")

    async def refresh(self) -> frozenset[str]:
        """The producers' worker addresses in fresh, signed entries (read again unless just read)."""
        now = time.monotonic()
        if now - self._read_at < self.min_interval_s:
            return self.addresses
        self._read_at = now
        try:
            # (Bounded: the gateway stream whose request asked waits for it.)
            entries = await asyncio.wait_for(read_engine_loads(self.client, token=self.token), READ_TIMEOUT_S)
            self.addresses = kv_producer_addresses(entries)
        except Exception as e:  # noqa: BLE001 - Redis down or slow: what was known stays known, nothing new
            logger.warning("cannot read the KV producers from redis: %s", e)
        return self.addresses
