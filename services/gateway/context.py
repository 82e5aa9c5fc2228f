"""What every route needs: the replica router (scheduler clients), the tokenizer and the
thread pool that renders and tokenizes prompts, metrics, model names, the request limits, and
the engine's max_model_len (fetched from a scheduler once one is reachable)."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import ParamSpec, TypeVar

from services.client.grpc_client import SchedulerUnavailable
from services.common.pooling_config import GENERATE_ONLY_MESSAGE, POOLING_ONLY_MESSAGE
from services.common.proto import myvllm_pb2 as pb
from services.gateway.errors import OpenAIError, invalid_request
from services.gateway.generation import PromptSampling
from services.gateway.limits import RequestLimits
from services.gateway.lora_registry import LoraRegistry
from services.gateway.metrics import GatewayMetrics
from services.gateway.migration import MigrationPolicy
from services.gateway.options import DEFAULT_TOKENIZER_POOL_SIZE
from services.gateway.prompts import PromptBound
from services.gateway.protocol import ModelCard
from services.gateway.request_defaults import RequestDefaults
from services.gateway.request_log import request_logger
from services.gateway.router import ReplicaRouter
from services.gateway.tools import ToolSettings
from services.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

STATS_RETRY_INTERVAL_S = 1.0

P = ParamSpec("P")
R = TypeVar("R")


class GatewayContext:
    """Shared state of one gateway process (one per FastAPI app)."""

    def __init__(self, router: ReplicaRouter, tokenizer: Tokenizer, model_path: str,
                 served_model_name: str | Sequence[str] | None = None, migration: MigrationPolicy | None = None,
                 tools: ToolSettings | None = None, max_choices_per_request: int | None = None,
                 limits: RequestLimits | None = None,
                 tokenizer_pool_size: int = DEFAULT_TOKENIZER_POOL_SIZE,
                 request_defaults: RequestDefaults | None = None, log_requests: bool = False,
                 lora: LoraRegistry | None = None) -> None:
        self.router = router
        self.tools = tools or ToolSettings()
        self.migration = migration or MigrationPolicy()
        self.max_choices_per_request = max_choices_per_request
        self.limits = limits or RequestLimits()
        self.tokenizer = tokenizer
        # Chat templates and tokenizing run here, not on the event loop: one long prompt must not
        # stall every other stream. HF fast tokenizers release the GIL while they encode.
        self._tokenizer_pool = ThreadPoolExecutor(tokenizer_pool_size, thread_name_prefix="myvllm-tokenizer")
        self.model_path = model_path
        # vLLM's --served-model-name a b: responses report the first, requests may name any.
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or ())
        self.served_model_names = names or [os.path.basename(os.path.normpath(model_path))]
        self.served_model_name = self.served_model_names[0]
        self.lora = lora or LoraRegistry()
        self.request_defaults = request_defaults or RequestDefaults()
        self._request_log = request_logger() if log_requests else None
        self.metrics = GatewayMetrics(self.served_model_name)
        self._max_model_len: int | None = None
        self._ready = False  # see ready()
        self._runner = "generate"  # the engine's runner, learnt with max_model_len (Stats.runner)

    async def max_model_len(self) -> int:
        """The engine's context limit; raises `SchedulerUnavailable` while it is unknown
        and no scheduler is reachable (so requests fail fast with 503)."""
        if self._max_model_len is None:
            stats = await self.router.any_client().get_stats()
            if stats.max_model_len <= 0:
                raise SchedulerUnavailable("the scheduler has not reported max_model_len yet")
            self._runner = stats.runner or "generate"
            self._max_model_len = stats.max_model_len
            self.metrics.set_max_model_len(stats.max_model_len)
        return self._max_model_len

    async def require_runner(self, runner: str) -> None:
        """A 400 unless the engine runs `runner` (vLLM's rule: a pooling model serves embeddings
        only, a generate model no embeddings); the engine refuses the same requests itself."""
        await self.max_model_len()
        if self._runner != runner:
            raise invalid_request(POOLING_ONLY_MESSAGE if self._runner == "pooling" else GENERATE_ONLY_MESSAGE,
                                  param="model" if runner == "generate" else None)

    async def in_tokenizer_pool(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """`fn(*args, **kwargs)` in the tokenizer pool; what it raises (e.g. a 400) is raised here."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_pool, functools.partial(fn, *args, **kwargs))

    def prompt_bound(self, max_model_len: int) -> PromptBound:
        """What a prompt may be before it is tokenized (--max-prompt-chars-per-token)."""
        return PromptBound(max_model_len, self.limits.max_prompt_chars_per_token)

    def close(self) -> None:
        """Stop the tokenizer pool (work not yet started is dropped)."""
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

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
        log = logger.info  # once: while the model loads it would repeat every retry
        while self._max_model_len is None:
            try:
                await self.max_model_len()
            except SchedulerUnavailable as e:
                log("waiting for a scheduler (%s): %s", self.router.description, e)
                log = logger.debug
                await asyncio.sleep(STATS_RETRY_INTERVAL_S)

    async def ready(self) -> bool:
        """Whether /v1 serves yet: some replica is routable (what /metrics counts in
        myvllm:engine_replicas_routable) and the model's config (max_model_len) is known from
        one, fetched now if need be (a fast refusal while nothing listens; at most the client
        timeout when a replica hangs). Once true it stays true: a replica lost later is the
        request path's to report (503, migration), and start-up is over."""
        if self._ready:
            return True
        await self.router.first_round()  # (only just started: a replica up may not be heard yet)
        if self.router.routable():
            try:
                await self.max_model_len()
            except SchedulerUnavailable:
                return False
            self._ready = True
        return self._ready

    def check_model(self, requested: str | None) -> pb.LoRARequest | None:
        """404 unless `requested` names this model (its served name or its path) or one of its LoRA
        adapters; returns the adapter (None: the base model)."""
        if requested is None or requested == self.model_path or requested in self.served_model_names:
            return None
        lora = self.lora.get(requested)
        if lora is not None:
            return lora
        raise OpenAIError(HTTPStatus.NOT_FOUND, f"The model `{requested}` does not exist.",
                          param="model", code="model_not_found")

    def response_model(self, requested: str | None) -> str:
        """The `model` a response reports: the adapter's name for a LoRA request (vLLM's), else the
        first served name."""
        return requested if self.lora.get(requested) is not None else self.served_model_name

    def model_card(self, name: str | None = None) -> ModelCard:
        """The card of `name` (one of the served names or an adapter's; default the first served
        name). An adapter's card names its directory as `root` and the base model as `parent`."""
        lora = self.lora.get(name)
        if lora is not None:
            return ModelCard(id=name, root=lora.lora_path, parent=self.lora.parents[name] or self.served_model_name,
                             max_model_len=self._max_model_len)
        return ModelCard(id=name or self.served_model_name, root=self.model_path, max_model_len=self._max_model_len)

    def model_cards(self) -> list[ModelCard]:
        """/v1/models: the served names, then the adapters."""
        return [self.model_card(name) for name in [*self.served_model_names, *self.lora.adapters]]

    def log_request(self, request_id: str, prompts: Sequence[PromptSampling]) -> None:
        """--enable-log-requests: each prompt's parameters and length, at INFO (vLLM's line)."""
        if self._request_log is not None:
            for index, prompt in enumerate(prompts):
                self._request_log.info("Received request %s (prompt %d): %d prompt tokens, params: %s", request_id,
                                       index, len(prompt.token_ids), prompt.params)
