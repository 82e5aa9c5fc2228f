"""The gateway's operational settings (its command-line flags), in one place."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from services.gateway.limits import RequestLimits
from services.gateway.migration import MigrationPolicy
from services.gateway.routing import RoutingConfig, RoutingPolicy
from services.gateway.tool_parsers import TOOL_PARSERS
from services.gateway.tools import ToolSettings
from services.text.tokenizer import load_chat_template

DEFAULT_MAX_CONCURRENT_REQUESTS = 1024
DEFAULT_MAX_QUEUED_REQUESTS = 4096
DEFAULT_MAX_CHOICES_PER_REQUEST = 256
# Threads that render chat templates and tokenize prompts, off the event loop (HF fast
# tokenizers release the GIL while encoding, so two prompts tokenize in parallel).
DEFAULT_TOKENIZER_POOL_SIZE = 2
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
# Flags (argparse dests) that carry secrets: a launcher passes them through the environment,
# never on the (world-readable) command line.
CREDENTIAL_OPTIONS = ("api_key", "internal_token")


@dataclass(frozen=True)
class GatewayOptions:
    """Limits and credentials of one gateway process."""

    migration: MigrationPolicy = field(default_factory=MigrationPolicy)
    # Generation requests served at once; up to max_queued_requests more wait, the rest get 429.
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    # Engine requests one HTTP request may become (prompts x n): admission counts HTTP requests.
    max_choices_per_request: int = DEFAULT_MAX_CHOICES_PER_REQUEST
    # Stop strings, tools, messages and prompt characters per request (--max-stop-strings, ...).
    limits: RequestLimits = field(default_factory=RequestLimits)
    tokenizer_pool_size: int = DEFAULT_TOKENIZER_POOL_SIZE
    # On SIGTERM: how long in-flight requests may take to finish before the gateway exits.
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    # Clients must send `Authorization: Bearer <api_key>` on /v1/* (None: open).
    api_key: str | None = None
    # Presented to the schedulers (the engine's internal token), if the SDK supports it.
    internal_token: str | None = None
    # Tool calling: the parser for tool_choice "auto" and whether "auto" is allowed.
    tools: ToolSettings = field(default_factory=ToolSettings)
    # A chat template (a file, or the template text) used instead of the model's.
    chat_template: str | None = None
    # How requests are spread over engine replicas (--routing and its weights).
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    # Chat and completions bodies with keys no field declares: a 400 naming them (OpenAI's
    # answer) instead of vLLM's warning (request_fields.py).
    strict_request_fields: bool = False

    def __post_init__(self) -> None:
        if self.max_concurrent_requests < 1:
            raise ValueError(f"--max-concurrent-requests must be at least 1, got {self.max_concurrent_requests}")
        if self.max_choices_per_request < 1:
            raise ValueError(f"--max-choices-per-request must be at least 1, got {self.max_choices_per_request}")
        if self.tokenizer_pool_size < 1:
            raise ValueError(f"--tokenizer-pool-size must be at least 1, got {self.tokenizer_pool_size}")
        if self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must not be negative, got {self.max_queued_requests}")
        if self.migration.max_migrations < 0 or self.migration.wait_s < 0:
            raise ValueError("--max-migrations and --migration-wait must not be negative")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"--shutdown-timeout must not be negative, got {self.shutdown_timeout_s}")
        if self.chat_template is not None:
            load_chat_template(self.chat_template)  # a missing file fails at start-up, not at the first chat


def env_default(name: str) -> str | None:
    """A flag's default from the environment (empty = unset)."""
    return os.environ.get(name) or None


def add_gateway_options(parser: argparse.ArgumentParser) -> None:
    """The gateway's limit, migration, shutdown and credential flags (also `myvllm serve`'s)."""
    defaults = GatewayOptions()
    parser.add_argument("--max-migrations", type=int, default=defaults.migration.max_migrations,
                        help="times one request may be re-submitted after its engine replica failed (0 = never)")
    parser.add_argument("--migration-wait", type=float, default=defaults.migration.wait_s,
                        help="seconds a request whose replica failed waits for one to answer before giving up")
    parser.add_argument("--max-concurrent-requests", type=int, default=defaults.max_concurrent_requests,
                        help="generation requests served at once")
    parser.add_argument("--max-queued-requests", type=int, default=defaults.max_queued_requests,
                        help="requests waiting for a slot; beyond that: 429 with Retry-After")
    parser.add_argument("--max-choices-per-request", type=int, default=defaults.max_choices_per_request,
                        help="engine requests one HTTP request may make (prompts x n); beyond that: 400")
    limits = defaults.limits
    parser.add_argument("--max-stop-strings", type=int, default=limits.max_stop_strings,
                        help="stop strings one request may give; beyond that: 400")
    parser.add_argument("--max-stop-string-length", type=int, default=limits.max_stop_string_length,
                        help="characters one stop string may have; beyond that: 400")
    parser.add_argument("--max-tools", type=int, default=limits.max_tools,
                        help="tools one chat request may offer (OpenAI's limit); beyond that: 400")
    parser.add_argument("--max-tool-definition-bytes", type=int, default=limits.max_tool_definition_bytes,
                        help="bytes one tool definition may take as JSON; beyond that: 400")
    parser.add_argument("--max-messages", type=int, default=limits.max_messages,
                        help="messages one chat request may have; beyond that: 400")
    parser.add_argument("--max-prompt-chars-per-token", type=int, default=limits.max_prompt_chars_per_token,
                        help="a prompt (the chat template's output, or a completions prompt) longer than this many "
                             "characters per token of max_model_len is a 400 before it is tokenized (0 = no check)")
    parser.add_argument("--tokenizer-pool-size", type=int, default=defaults.tokenizer_pool_size,
                        help="threads that render chat templates and tokenize prompts, off the event loop")
    parser.add_argument("--shutdown-timeout", type=float, default=defaults.shutdown_timeout_s,
                        help="on SIGTERM, seconds in-flight requests get to finish (new ones get 503)")
    parser.add_argument("--api-key", default=env_default("MYVLLM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $MYVLLM_API_KEY; none = open)")
    parser.add_argument("--internal-token", default=env_default("MYVLLM_INTERNAL_TOKEN"),
                        help="token presented to the schedulers (default: $MYVLLM_INTERNAL_TOKEN)")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="how tool calls are read from the model's output for tool_choice 'auto'")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="allow tool_choice 'auto' (needs --tool-call-parser)")
    parser.add_argument("--chat-template", default=None,
                        help="chat template file (or template text) to use instead of the model's")
    parser.add_argument("--strict-request-fields", action="store_true",
                        help="refuse chat and completions requests with fields this server does not know (a 400 "
                             "naming them, as OpenAI does) instead of ignoring them with a warning, as vLLM does")
    routing = defaults.routing
    parser.add_argument("--routing", default=routing.policy.value, choices=[p.value for p in RoutingPolicy],
                        help="how requests are spread over engine replicas: by load (4*waiting + running), "
                             "round-robin, or cache-aware (load plus the prompt's prefix cached on each replica)")
    parser.add_argument("--routing-prefill-weight", type=float, default=routing.prefill_weight,
                        help="cache-aware cost per prompt token not cached on the replica")
    parser.add_argument("--routing-load-weight", type=float, default=routing.load_weight,
                        help="cache-aware cost per unit of load (4 per waiting request, 1 per running one)")
    parser.add_argument("--routing-kv-weight", type=float, default=routing.kv_weight,
                        help="cache-aware cost per unit of KV cache usage (0-1)")
    parser.add_argument("--routing-max-imbalance", type=float, default=routing.max_imbalance,
                        help="cache-aware: replicas loaded more than this above the least loaded one are skipped")
    parser.add_argument("--routing-remote-prefill-min-tokens", type=int, default=routing.remote_prefill_min_tokens,
                        help="prefill/decode disaggregation: a prompt goes to a prefill replica only when its decode "
                             "replica would otherwise compute at least this many of its tokens (and more than a "
                             f"block); shorter ones are prefilled where they decode (default "
                             f"{routing.remote_prefill_min_tokens})")


def gateway_options(args: argparse.Namespace) -> GatewayOptions:
    """`GatewayOptions` from the flags of `add_gateway_options` (ValueError names a bad one)."""
    return GatewayOptions(
        migration=MigrationPolicy(max_migrations=args.max_migrations, wait_s=args.migration_wait),
        max_concurrent_requests=args.max_concurrent_requests, max_queued_requests=args.max_queued_requests,
        max_choices_per_request=args.max_choices_per_request, shutdown_timeout_s=args.shutdown_timeout,
        limits=RequestLimits(args.max_stop_strings, args.max_stop_string_length, args.max_tools,
                             args.max_tool_definition_bytes, args.max_messages, args.max_prompt_chars_per_token),
        tokenizer_pool_size=args.tokenizer_pool_size,
        api_key=args.api_key, internal_token=args.internal_token,
        tools=ToolSettings(args.tool_call_parser, args.enable_auto_tool_choice), chat_template=args.chat_template,
        strict_request_fields=args.strict_request_fields,
        routing=RoutingConfig(args.routing, args.routing_prefill_weight, args.routing_load_weight,
                              args.routing_kv_weight, args.routing_max_imbalance,
                              args.routing_remote_prefill_min_tokens))
