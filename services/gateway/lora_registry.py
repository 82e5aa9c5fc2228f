"""The LoRA adapters this gateway serves: those of --lora-modules, and (with vLLM's switch
VLLM_ALLOW_RUNTIME_LORA_UPDATING) those loaded and unloaded at runtime through
/v1/load_lora_adapter and /v1/unload_lora_adapter, from directories under --lora-root only.

A request whose `model` names an adapter runs the base model with it. Each adapter's
`lora_int_id` is derived from its name and real path, so that several gateways in front of the same
engines (data parallel) give the same adapter the same id and different adapters different ones
(the engines key slots and caches by the id; each gateway keeps its own registry)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from http import HTTPStatus

from services.common.config import MAX_LORA_RANK_LIMIT
from services.common.lora_adapter_config import AdapterConfigError, read_adapter_config
from services.common.message_limits import MAX_LORA_NAME_CHARS, MAX_LORA_PATH_CHARS
from services.common.proto import myvllm_pb2 as pb
from services.gateway.errors import OpenAIError, invalid_request

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_allowed() -> bool:
    """vLLM's switch for the runtime load/unload endpoints."""
    return os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoraModule:
    """One --lora-modules entry: `name=path` or vLLM's JSON form."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoraModule:
    """`name=path` or '{"name": ..., "path": ..., "base_model_name": ...}' (vLLM's forms)."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
        except ValueError:
            entry = None
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or \
                not isinstance(entry.get("path"), str) or not isinstance(entry.get("base_model_name") or "", str):
            raise ValueError(f"--lora-modules: {text[:200]!r} is not a JSON object with string name and path")
        return LoraModule(entry["name"], entry["path"], entry.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {text[:200]!r} is not NAME=PATH (or vLLM's JSON form)")
    return LoraModule(name, path)


def lora_int_id(name: str, real_path: str) -> int:
    """A positive 31-bit id from the adapter's name and real path (see the module's docstring)."""
    digest = hashlib.sha256(name.encode() + b"\0" + real_path.encode()).digest()
    return int.from_bytes(digest[:4], "big") % (2 ** 31 - 1) + 1


class LoraRegistry:
    def __init__(self, modules: list[LoraModule] | tuple[LoraModule, ...] = (), root: str | None = None,
                 max_lora_rank: int = MAX_LORA_RANK_LIMIT) -> None:
        """Every module checked now (ValueError naming the one that cannot be served). `root`:
        where runtime loads may come from (None: runtime loads are refused)."""
        self.root = os.path.realpath(root) if root else None
        self.max_lora_rank = max_lora_rank
        self.adapters: dict[str, pb.LoRARequest] = {}
        self.parents: dict[str, str | None] = {}
        for module in modules:
            try:
                self.add(module.name, module.path, module.base_model_name)
            except OpenAIError as e:
                raise ValueError(f"--lora-modules {module.name}: {e.message}") from None

    def add(self, name: str, path: str, base_model_name: str | None = None,
            max_lora_rank: int | None = None) -> pb.LoRARequest:
        """Register an adapter (400 naming what is wrong with it, or that the name is taken)."""
        if not name or len(name) > MAX_LORA_NAME_CHARS:
            raise invalid_request(f"lora_name must be 1 to {MAX_LORA_NAME_CHARS} characters", param="lora_name")
        if name in self.adapters:
            raise invalid_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        if not path or len(path) > MAX_LORA_PATH_CHARS:
            raise invalid_request(f"lora_path must be 1 to {MAX_LORA_PATH_CHARS} characters", param="lora_path")
        real = os.path.realpath(path)
        try:
            read_adapter_config(real, max_lora_rank or self.max_lora_rank)
        except AdapterConfigError as e:
            raise invalid_request(str(e), param="lora_path") from None
        lora = pb.LoRARequest(lora_name=name, lora_int_id=lora_int_id(name, real), lora_path=real)
        self.adapters[name] = lora
        self.parents[name] = base_model_name
        return lora

    def add_at_runtime(self, name: str, path: str, max_lora_rank: int) -> pb.LoRARequest:
        """/v1/load_lora_adapter: only from under --lora-root (symlinks resolved first, so no link
        or `..` leads out of it)."""
        if self.root is None:
            raise invalid_request("loading LoRA adapters at runtime needs --lora-root (the directory they may be "
                                  "loaded from)", param="lora_path")
        real = os.path.realpath(path) if path else ""
        if not real.startswith(self.root + os.sep):
            raise invalid_request(f"lora_path {path[:200]!r} is not inside --lora-root", param="lora_path")
        return self.add(name, real, max_lora_rank=max_lora_rank)

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise OpenAIError(HTTPStatus.NOT_FOUND, f"The lora adapter '{name}' cannot be found.",
                              param="lora_name", code="model_not_found")
        del self.parents[name]

    def get(self, name: str | None) -> pb.LoRARequest | None:
        return self.adapters.get(name) if name else None
