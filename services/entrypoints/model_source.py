"""Where a MODEL argument's files are: a directory as given, else a Hugging Face repo id looked up
in the local Hugging Face cache (`--revision`, `--download-dir`), as `vllm serve ORG/NAME` finds
a model it has downloaded before. Nothing is downloaded: the machines my-vllm runs on are often
offline, and a download is a step of its own (`huggingface-cli download`)."""

from __future__ import annotations

import os

from services.common.config import check_model_dir, is_gguf_file


def hf_cache_dir(download_dir: str | None = None) -> str:
    """The hub cache the lookup reads: --download-dir, else huggingface_hub's ($HF_HUB_CACHE,
    $HF_HOME/hub, ~/.cache/huggingface/hub)."""
    if download_dir:
        return download_dir
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _looks_like_path(model: str) -> bool:
    """A repo id is NAME or ORG/NAME; an absolute, relative (./x, ../x) or deeper path is a path."""
    return os.path.isabs(model) or model.startswith((".", "~")) or model.count("/") > 1


def resolve_model(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """`model` itself when it is a directory or a .gguf file, else its snapshot directory in the local Hugging
    Face cache. FileNotFoundError (one line) when it is neither."""
    if os.path.isdir(model) or (is_gguf_file(model) and os.path.isfile(model)):
        return model
    if _looks_like_path(model):
        return check_model_dir(model)  # (raises, naming the directory)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True)
    except (HFValidationError, OSError, ValueError):
        # (a malformed repo id, or LocalEntryNotFoundError / a missing revision: OSError subclasses)
        pass
    home = os.environ.get("HF_HOME", "~/.cache/huggingface")
    at = f" at revision {revision}" if revision else ""
    raise FileNotFoundError(f"model {model}{at} is not a directory and not in the local Hugging Face cache "
                            f"(HF_HOME={home}, cache {hf_cache_dir(download_dir)}); download it first "
                            f"(`huggingface-cli download {model}`) or give its directory")
