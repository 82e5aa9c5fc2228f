"""The SmolLM2 checkpoint converted from GGUF by scripts/convert_gguf.py (run by `make setup`)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from support.hf_reference import hf_greedy, load_hf_tokenizer


def test_converted_files(smollm2_dir: str) -> None:
    d = Path(smollm2_dir)
    config = json.loads((d / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert "quantization_config" not in config, "GGUF quantization_config leaked into config.json"
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        emb = f.get_slice("model.embed_tokens.weight")
        assert list(emb.get_shape()) == [config["vocab_size"], config["hidden_size"]]
        assert str(emb.get_dtype()).upper() in ("F32", "FLOAT32", "TORCH.FLOAT32")
    if config.get("tie_word_embeddings"):
        assert "lm_head.weight" not in keys
    assert sum(k.startswith("model.layers.") for k in keys) > 0

    gen = json.loads((d / "generation_config.json").read_text())
    assert gen.get("eos_token_id") is not None


def test_tokenizer_chat_template(smollm2_dir: str) -> None:
    tok = load_hf_tokenizer(smollm2_dir)
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"


def test_greedy_france_is_paris(smollm2_dir: str) -> None:
    tok = load_hf_tokenizer(smollm2_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    prompt = tok.encode(text, add_special_tokens=False)
    [out] = hf_greedy(smollm2_dir, [prompt], max_new_tokens=24, ignore_eos=False)
    reply = tok.decode(out, skip_special_tokens=True).strip()
    assert reply
    assert "Paris" in reply, reply
