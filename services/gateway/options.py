"""The gateway's operational settings (its command-line flags), in one place."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.sampling_params import MAX_LOGPROBS
from services.common.secret_check import API_KEY_ENV, split_api_keys
from services.gateway.cors import CorsSettings
from services.gateway.limits import RequestLimits
from services.gateway.lora_registry import RUNTIME_UPDATES_ENV, LoraModule, parse_lora_module
from services.gateway.migration import MigrationPolicy
from services.gateway.request_defaults import DEFAULT_RESPONSE_ROLE
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
# uvicorn's log level, vLLM's: info, with its access log (a line per request; off with
# --disable-uvicorn-access-log).
DEFAULT_UVICORN_LOG_LEVEL = "info"
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
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
    # Clients must send `Authorization: Bearer <key>` with one of these on /v1/* (None: open);
    # one key or several (vLLM's --api-key k1 k2).
    api_key: str | Sequence[str] | None = None
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
    # Where the tokenizer (and chat template) load from instead of the model directory (--tokenizer).
    tokenizer: str | None = None
    # vLLM's frontend flags: CORS, the path prefix behind a proxy, uvicorn's logging, a log line
    # per request, the most logprobs a request may ask, the reply's role, default sampling.
    cors: CorsSettings = field(default_factory=CorsSettings)
    root_path: str | None = None
    uvicorn_log_level: str = DEFAULT_UVICORN_LOG_LEVEL
    disable_uvicorn_access_log: bool = False
    # The periodic engine stats line (stats_log.py) is off.
    disable_log_stats: bool = False
    enable_log_requests: bool = False
    max_logprobs: int = MAX_LOGPROBS
    response_role: str = DEFAULT_RESPONSE_ROLE
    generation_config: str = "auto"
    # LoRA adapters served by name (--lora-modules, vLLM's), and the directory runtime loads may
    # come from (--lora-root).
    lora_modules: tuple[LoraModule, ...] = ()
    lora_root: str | None = None

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys a client may present (empty: the API is open)."""
        keys = [self.api_key] if isinstance(self.api_key, str) else list(self.api_key or ())
        return tuple(key for key in keys if key)

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
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}] (the engine's limit; -1 = the limit), "
                             f"got {self.max_logprobs}")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"--uvicorn-log-level must be one of {', '.join(UVICORN_LOG_LEVELS)}, got "
                             f"{self.uvicorn_log_level!r}")
        if self.tokenizer is not None and not (os.path.isdir(self.tokenizer) or (
                self.tokenizer.endswith(".gguf") and os.path.isfile(self.tokenizer))):
            raise ValueError(f"--tokenizer {self.tokenizer} is not a directory or a .gguf file")
        if self.lora_root is not None and not os.path.isdir(self.lora_root):
            raise ValueError(f"--lora-root {self.lora_root} is not a directory")
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
    parser.add_argument("--api-key", nargs="+", metavar="KEY", default=split_api_keys(env_default(API_KEY_ENV)),
                        help="require 'Authorization: Bearer KEY' on /v1/* with one of these keys (default: "
                             f"${API_KEY_ENV}, one key per line; none = open)")
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
    parser.add_argument("--tokenizer", default=None,
                        help="the tokenizer's directory, when not the model's (default: the model directory)")
    add_frontend_options(parser, defaults)
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="LoRA adapters to serve (the engine needs --enable-lora): NAME=PATH (a PEFT directory) "
                             "or vLLM's JSON '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; a request "
                             "whose model is NAME runs with the adapter")
    parser.add_argument("--lora-root", default=None,
                        help="the directory LoRA adapters may be loaded from at runtime (/v1/load_lora_adapter, "
                             f"with {RUNTIME_UPDATES_ENV}=true); without it runtime loads are refused")
    routing = defaults.routing
    parser.add_argument("--routing", default=routing.policy.value, choices=[p.value for p in RoutingPolicy],
                        help="how requests are spread over engine replicas: by load (4*waiting + running), "
                             "round-robin, or cache-aware: the replica where the first token is expected soonest, "
                             "its uncached prompt tokens over its measured prefill rate plus its queue in its "
                             "measured step times")
    parser.add_argument("--routing-max-imbalance", type=float, default=routing.max_imbalance,
                        help="cache-aware: replicas loaded more than this above the least loaded one are skipped")
    parser.add_argument("--routing-remote-prefill-min-tokens", type=int, default=routing.remote_prefill_min_tokens,
                        help="prefill/decode disaggregation: a prompt goes to a prefill replica only when its decode "
                             "replica would otherwise compute at least this many of its tokens (and more than a "
                             f"block); shorter ones are prefilled where they decode (default "
                             f"{routing.remote_prefill_min_tokens})")


def _json_list(text: str) -> str:
    """A flag whose value is a JSON list of strings (vLLM's --allowed-origins): checked, kept as
    text (so a launcher forwards it as given)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r} (e.g. '[\"https://example.com\"]')")
    return text


def add_frontend_options(parser: argparse.ArgumentParser, defaults: GatewayOptions) -> None:
    """vLLM's frontend flags, with vLLM's names and meanings."""
    cors = defaults.cors
    parser.add_argument("--allowed-origins", type=_json_list, default=json.dumps(list(cors.allowed_origins)),
                        help="CORS: the origins a browser page may call the API from, a JSON list")
    parser.add_argument("--allowed-methods", type=_json_list, default=json.dumps(list(cors.allowed_methods)),
                        help="CORS: the HTTP methods allowed, a JSON list")
    parser.add_argument("--allowed-headers", type=_json_list, default=json.dumps(list(cors.allowed_headers)),
                        help="CORS: the request headers allowed, a JSON list")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="CORS: allow credentials (cookies, authorization headers)")
    parser.add_argument("--root-path", default=None,
                        help="the path prefix a path-based proxy serves the API under (FastAPI's root_path)")
    parser.add_argument("--uvicorn-log-level", default=defaults.uvicorn_log_level, choices=UVICORN_LOG_LEVELS,
                        help="the HTTP server's log level (info and below: its access log too, a line per request)")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="no access log line per request, whatever --uvicorn-log-level")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic engine stats line (throughput, running and waiting requests, KV cache "
                             "usage, prefix cache hit rate per replica, every 10 s while there is activity)")
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="log each generation request's sampling parameters at INFO")
    parser.add_argument("--max-logprobs", type=int, default=defaults.max_logprobs,
                        help=f"the most logprobs (top_logprobs, logprobs, prompt_logprobs) a request may ask for; "
                             f"more is a 400 (-1 = the engine's limit, {MAX_LOGPROBS})")
    parser.add_argument("--response-role", default=defaults.response_role,
                        help="chat: the role of the reply message when the request has add_generation_prompt")
    parser.add_argument("--generation-config", default=defaults.generation_config, metavar="{auto,vllm,DIR}",
                        help="default sampling parameters (temperature, top_p, top_k, min_p, repetition_penalty, "
                             "max_new_tokens as max_tokens) for a request that leaves them unset: auto = the model's "
                             "generation_config.json, vllm = none, DIR = that directory's generation_config.json")


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
        routing=RoutingConfig(args.routing, args.routing_max_imbalance, args.routing_remote_prefill_min_tokens),
        tokenizer=args.tokenizer,
        cors=CorsSettings(tuple(json.loads(args.allowed_origins)), tuple(json.loads(args.allowed_methods)),
                          tuple(json.loads(args.allowed_headers)), args.allow_credentials),
        root_path=args.root_path, uvicorn_log_level=args.uvicorn_log_level,
        disable_uvicorn_access_log=args.disable_uvicorn_access_log, disable_log_stats=args.disable_log_stats,
        enable_log_requests=args.enable_log_requests,
        max_logprobs=MAX_LOGPROBS if args.max_logprobs == -1 else args.max_logprobs,
        response_role=args.response_role, generation_config=args.generation_config,
        lora_modules=tuple(parse_lora_module(text) for text in args.lora_modules or ()), lora_root=args.lora_root)
