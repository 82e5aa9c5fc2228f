"""What every route needs: the replica router (scheduler clients), the tokenizer, metrics,
model names, and the engine's max_model_len (fetched from a scheduler once one is reachable)."""

from __future__ import annotations

import asyncio
import logging
import os
from http import HTTPStatus

from services.gateway.errors import OpenAIError, invalid_request
from services.gateway.metrics import GatewayMetrics
from services.gateway.migration import MigrationPolicy
from services.gateway.protocol import ModelCard
from services.gateway.router import ReplicaRouter
from services.gateway.tokenizer import GatewayTokenizer
from services.gateway.tools import ToolSettings
from services.sdk.client import SchedulerUnavailable

logger = logging.getLogger(__name__)

STATS_RETRY_INTERVAL_S = 1.0


class GatewayContext:
    """Shared state of one gateway process (one per FastAPI app)."""

    def __init__(self, router: ReplicaRouter, tokenizer: GatewayTokenizer, model_path: str,
                 served_model_name: str | None = None, migration: MigrationPolicy | None = None,
                 tools: ToolSettings | None = None, max_choices_per_request: int | None = None) -> None:
        self.router = router
        self.tools = tools or ToolSettings()
        self.migration = migration or MigrationPolicy()
        self.max_choices_per_request = max_choices_per_request
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.served_model_name = served_model_name or os.path.basename(os.path.normpath(model_path))
        self.metrics = GatewayMetrics(self.served_model_name)
        self._max_model_len: int | None = None

    async def max_model_len(self) -> int:
        """The engine's context limit; raises `SchedulerUnavailable` while it is unknown
        and no scheduler is reachable (so requests fail fast with 503)."""
        if self._max_model_len is None:
            stats = await self.router.any_client().get_stats()
            if stats.max_model_len <= 0:
                raise SchedulerUnavailable("the scheduler has not reported max_model_len yet")
            self._max_model_len = stats.max_model_len
        return self._max_model_len

    def check_num_choices(self, num_prompts: int, n: int) -> None:
        """A 400 when one HTTP request would become more engine requests than allowed."""
        limit = self.max_choices_per_request
        if limit is not None and num_prompts * n > limit:
            raise invalid_request(f"{num_prompts} prompts x n={n} = {num_prompts * n} completions; at most {limit} "
                                  "per request (--max-choices-per-request)", param="prompt" if num_prompts > 1 else "n")

    @property
    def known_max_model_len(self) -> int | None:
        return self._max_model_len

    async def fetch_max_model_len_until_known(self) -> None:
        """Background task from startup: retry GetStats until the scheduler answers, so
        the first request does not pay for it (requests before then try themselves)."""
        while self._max_model_len is None:
            try:
                await self.max_model_len()
            except SchedulerUnavailable as e:
                logger.info("waiting for a scheduler (%s): %s", self.router.description, e)
                await asyncio.sleep(STATS_RETRY_INTERVAL_S)

    def check_model(self, requested: str | None) -> None:
        """404 unless `requested` names this model (its served name or its path)."""
        if requested is None or requested in (self.served_model_name, self.model_path):
            return
        raise OpenAIError(HTTPStatus.NOT_FOUND, f"The model `{requested}` does not exist.",
                          param="model", code="model_not_found")

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.served_model_name, root=self.model_path, max_model_len=self._max_model_len)
