"""Keeps one replica's `PrefixIndex` following that replica's KV event stream.

When the stream breaks (the scheduler died, restarted, or dropped us for reading too
slowly) or a batch is missing, the index is reset at once, so routing stops counting on
blocks that may be gone, and the subscription is retried with backoff; the snapshot that
opens the next subscription resynchronises the index.
"""

from __future__ import annotations

import asyncio
import logging

from services.client.grpc_client import AsyncClient, SchedulerUnavailable
from services.gateway.prefix_index import KvEventGap, PrefixIndex

logger = logging.getLogger(__name__)

RETRY_BACKOFF_S = 0.25
MAX_RETRY_BACKOFF_S = 2.0


async def follow_kv_events(client: AsyncClient, index: PrefixIndex, backoff_s: float = RETRY_BACKOFF_S,
                           max_backoff_s: float = MAX_RETRY_BACKOFF_S) -> None:
    """Run until cancelled: subscribe, apply every batch to `index`, resubscribe on failure."""
    delay = backoff_s
    while True:
        try:
            async for batch in client.kv_events():
                index.apply(batch)
                delay = backoff_s  # a working stream: the next failure retries quickly
        except (SchedulerUnavailable, KvEventGap) as e:
            if index.synced:
                logger.info("KV events of %s lost (%s): its prefix index is dropped until it resyncs",
                            client.address, e)
            index.reset()
        except Exception:  # a bug must not end the subscription for good
            logger.exception("following the KV events of %s failed", client.address)
            index.reset()
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_backoff_s)
