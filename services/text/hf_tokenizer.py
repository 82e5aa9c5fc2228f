"""Where a model's HF tokenizer loads from: its directory, or the tokenizer (and chat template,
`tokenizer.chat_template` in its metadata) a .gguf file carries; `--tokenizer` names another."""

from __future__ import annotations

import os
from typing import Any

from services.common.config import is_gguf_file


def load_hf_tokenizer(model_path: str, tokenizer_path: str | None = None) -> Any:
    """transformers' tokenizer for `model_path` (a directory or a .gguf file), from
    `tokenizer_path` where given."""
    # Here, not at module level: transformers (with torch) takes seconds to import.
    from transformers import AutoTokenizer

    source = tokenizer_path or model_path
    if is_gguf_file(source):
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(source)),
                                             gguf_file=os.path.basename(source))
    return AutoTokenizer.from_pretrained(source)
