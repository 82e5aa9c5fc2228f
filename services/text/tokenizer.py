"""The model's tokenizer and what is derived from it (EOS ids, vocab size, per-token text for
logprobs, bad-words token sequences), for the gateway and the offline `LLM`."""

from __future__ import annotations

import json
import os
from typing import Any

from services.common.config import is_gguf_file
from services.text.hf_tokenizer import load_hf_tokenizer


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: printable stand-in char -> raw byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


# apply_chat_template's own arguments: request-supplied template variables must not
# change how the template is applied (or swap the template itself).
_RESERVED_TEMPLATE_ARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def load_chat_template(value: str) -> str:
    """--chat-template: a file's contents, or the value itself when it is the template text."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a template")
    return value


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


class Tokenizer:
    """Wraps a HF tokenizer; the only text <-> token-id boundary in the system."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int], vocab_size: int) -> None:
        self.hf_tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self._token_texts: dict[int, str] = {}  # bounded by the vocabulary
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        # Byte-level BPE tokens are raw bytes in disguise; knowing that lets logprobs
        # report the true bytes of a token that is only part of a character.
        self._byte_alphabet = _byte_level_alphabet() if type(decoder).__name__ == "ByteLevel" else None
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", []))
        # The chat template to use instead of the model's own (--chat-template), if any.
        self.chat_template: str | None = None

    @classmethod
    def load(cls, model_path: str, tokenizer_path: str | None = None) -> Tokenizer:
        """Load the tokenizer, generation-config EOS ids and vocab size of a HF model dir; the
        tokenizer itself from `tokenizer_path` where given (vLLM's --tokenizer)."""
        # Here, not at module level: `serve` imports this module for its flags, and transformers
        # (with torch) takes seconds to import.
        from transformers import GenerationConfig

        tokenizer = load_hf_tokenizer(model_path, tokenizer_path)
        try:
            if is_gguf_file(model_path):  # no generation_config.json: the tokenizer's eos below
                raise OSError(model_path)
            eos_token_ids = _as_id_list(GenerationConfig.from_pretrained(model_path).eos_token_id)
        except OSError:  # no generation_config.json
            eos_token_ids = []
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_token_ids:
            eos_token_ids.append(tokenizer.eos_token_id)
        vocab_size = len(tokenizer)
        config_path = os.path.join(model_path, "config.json")
        if os.path.exists(config_path):
            with open(config_path) as f:
                vocab_size = max(vocab_size, int(json.load(f).get("vocab_size") or 0))
        return cls(tokenizer, eos_token_ids, vocab_size)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, str]] | None = None,
    ) -> str:
        """The prompt text the chat template makes of `messages` (and the `tools` offered, the
        `documents` for retrieval-augmented generation, both as the template shows them)."""
        overridden = _RESERVED_TEMPLATE_ARGS.intersection(chat_template_kwargs or {})
        if overridden:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(overridden))}")
        return self.hf_tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            chat_template=self.chat_template,
            **(chat_template_kwargs or {}),
        )

    def token_text(self, token_id: int) -> str:
        """One token's text as shown in logprobs (a partial character decodes to U+FFFD)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.hf_tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The raw UTF-8 bytes one token contributes (OpenAI's logprobs `bytes`)."""
        if self._byte_alphabet is not None and token_id not in self._special_ids:
            piece = self.hf_tokenizer.convert_ids_to_tokens(token_id)
            if piece is not None and all(c in self._byte_alphabet for c in piece):
                return bytes(self._byte_alphabet[c] for c in piece)
        return self.token_text(token_id).encode("utf-8")

    def bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Token sequences to forbid for each bad word, with and without a leading space
        (the same word tokenizes differently at the start and in the middle of text)."""
        sequences: list[list[int]] = []
        for word in bad_words:
            plain = self.encode(word.lstrip(), add_special_tokens=False)
            if plain:
                sequences.append(plain)
            spaced = self.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced != plain and (not plain or spaced[0] != plain[0]) and len(spaced) == len(plain):
                sequences.append(spaced)
        return sequences
