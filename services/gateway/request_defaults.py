"""What the server's flags set for every generation request, as vLLM's do:

- `--generation-config auto|vllm|DIR`: default sampling parameters from the model's
  generation_config.json (auto), from DIR's, or none (vllm), applied where a request leaves a
  field unset;
- `--max-logprobs N`: the most logprobs a request may ask for (a 400 naming the flag beyond it);
- `--response-role`: the role of the reply message when the request asks for a generation prompt.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.common.sampling_params import MAX_LOGPROBS
from services.gateway.errors import invalid_request

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json's sampling fields and the request fields they default (vLLM's list).
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
DEFAULT_RESPONSE_ROLE = "assistant"


def generation_config_defaults(generation_config: str, model_path: str) -> dict[str, Any]:
    """The request defaults `--generation-config` names: request field -> value. 'vllm': none;
    'auto': the model directory's generation_config.json (none there: none); else that
    directory's (ValueError when it has none)."""
    if generation_config == "vllm":
        return {}
    directory = model_path if generation_config == "auto" else generation_config
    path = os.path.join(directory, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        if generation_config != "auto":
            raise ValueError(f"--generation-config {generation_config}: no {GENERATION_CONFIG_FILE} there")
        return {}  # a model without one: no defaults
    try:
        with open(path) as f:
            values = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--generation-config: cannot read {path}: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"--generation-config: {path} is not a JSON object")
    return {target: values[source] for source, target in GENERATION_CONFIG_FIELDS.items()
            if values.get(source) is not None}


@dataclass(frozen=True)
class RequestDefaults:
    """One gateway's request defaults and bounds (see the module's docstring)."""

    # request field -> its default where the request leaves it unset (temperature, ..., max_tokens)
    sampling: Mapping[str, Any] = field(default_factory=dict)
    max_logprobs: int = MAX_LOGPROBS
    response_role: str = DEFAULT_RESPONSE_ROLE

    def value(self, name: str, requested: Any, fallback: Any = None) -> Any:
        """A sampling field's value: the request's, else the generation config's, else `fallback`."""
        if requested is not None:
            return requested
        return self.sampling.get(name, fallback)

    def check_logprobs(self, logprobs: int | None, prompt_logprobs: int | None, logprobs_param: str) -> None:
        """A 400 naming --max-logprobs when the request asks for more."""
        for asked, param in ((logprobs, logprobs_param), (prompt_logprobs, "prompt_logprobs")):
            if asked is not None and asked > self.max_logprobs:
                raise invalid_request(f"{param}: {asked} logprobs requested, more than this server's limit of "
                                      f"{self.max_logprobs} (--max-logprobs)", param=param)

    def role(self, add_generation_prompt: bool) -> str:
        """The reply message's role: --response-role when the prompt ends with the generation
        prompt (vLLM's rule), else assistant."""
        return self.response_role if add_generation_prompt else DEFAULT_RESPONSE_ROLE
