"""The gateway's side of the DP wave protocol (services/common/dp_wave.py): what it knows of
each data-parallel expert-parallel group's wave (read from Redis with the replicas' loads), the
wave number every request to such a group carries, and FIRST_REQ to the group's coordinator
when a request goes to a group that is paused."""

from __future__ import annotations

import asyncio
import logging

from services.common.dp_wave import FIRST_REQ, coordinator_channel, encode_message, parse_wave_entry, wave_key

logger = logging.getLogger(__name__)


class GroupWaves:
    def __init__(self, client, token: str | None) -> None:
        self.client, self.token = client, token
        self.state: dict[str, tuple[int, bool]] = {}  # group -> (current wave, engines running)
        self._sends: set[asyncio.Task] = set()

    async def refresh(self, groups: set[str]) -> None:
        for group in groups:
            found = parse_wave_entry(await self.client.hgetall(wave_key(group)), self.token, group)
            known = self.state.get(group)
            if found is not None and (known is None or found[0] >= known[0]):
                # (An older hash written back to Redis is not taken: wave numbers never go back.
                # Should the coordinator itself have started from one, the requests carrying this
                # newer number move its engines, and so it, forward again: scheduler/dp_wave.py.)
                self.state[group] = found

    def before_send(self, group: str, dp_rank: int) -> int:
        """The wave for a request to engine `dp_rank` of `group`; FIRST_REQ if the group is paused
        (then counted as running until the next read, so a burst sends one)."""
        wave, running = self.state.get(group, (0, False))
        if not running:
            self.state[group] = (wave, True)
            channel = coordinator_channel(group)
            text = encode_message(channel, {"type": FIRST_REQ, "engine": dp_rank, "wave": wave}, self.token)
            task = asyncio.get_running_loop().create_task(self._publish(channel, text))
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)
        return wave

    async def _publish(self, channel: str, text: str) -> None:
        try:
            await self.client.publish(channel, text)
        except Exception as e:  # the engine asks the coordinator itself as well (dp_wave.py)
            logger.warning("cannot send FIRST_REQ to %s: %s", channel, e)
