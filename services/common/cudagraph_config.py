"""CUDA-graph settings (vLLM's --enforce-eager, --cuda-graph-sizes, compilation_config.cudagraph_mode):
the capture sizes and the checks that need no device; services/worker/cuda_graphs.py runs them."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

NONE, STATIC, FULL_DECODE_ONLY = "none", "static", "full_decode_only"
CUDAGRAPH_MODES = (NONE, STATIC, FULL_DECODE_ONLY)
# vLLM: max_cudagraph_capture_size = min(2 * max_num_seqs * decode query length, 512).
MAX_DEFAULT_CAPTURE_SIZE = 512


def vllm_capture_sizes(max_capture_size: int) -> list[int]:
    """vLLM's default list (VllmConfig._set_cudagraph_sizes) up to `max_capture_size`: 1, 2, 4,
    then multiples of 8 below 256, then multiples of 16 from 256."""
    sizes = [i for i in (1, 2, 4) if i <= max_capture_size]
    if max_capture_size >= 8:
        sizes += list(range(8, min(max_capture_size + 1, 256), 8))
    if max_capture_size >= 256:
        sizes += list(range(256, max_capture_size + 1, 16))
    return sizes


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's default capture sizes for `max_num_seqs` (its max_cudagraph_capture_size is
    min(2 * max_num_seqs, 512) for plain decoding), cut after the first size that holds
    max_num_seqs rows: a pure-decode step never has more rows, so larger graphs would never
    replay (256 -> 1, 2, 4, 8, ..., 248, 256; 5 -> 1, 2, 4, 8; 3 -> 1, 2, 4)."""
    return capture_sizes(max_num_seqs)


def capture_sizes(max_num_seqs: int, requested: Sequence[int] | None = None) -> list[int]:
    """The sizes to pad pure-decode steps to: `requested` (--cuda-graph-sizes; sorted, duplicates
    dropped, sizes above 2 * max_num_seqs dropped: a decode step has at most max_num_seqs rows,
    and buffers that large are never worth it) or vLLM's default list, each cut after its first
    size >= max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    if requested:
        sizes = sorted({int(s) for s in requested})
        if sizes[0] < 1:
            raise ValueError(f"cuda_graph_sizes must be positive, got {list(requested)}")
        sizes = [s for s in sizes if s <= 2 * max_num_seqs]
    else:
        sizes = vllm_capture_sizes(min(2 * max_num_seqs, MAX_DEFAULT_CAPTURE_SIZE))
    covering = bisect.bisect_left(sizes, max_num_seqs)
    return sizes[:covering + 1]


def parse_capture_sizes(value: str | Sequence[int] | None) -> list[int] | None:
    """--cuda-graph-sizes as given: "1,2,4,8", "1 2 4 8" or a list of ints (None / empty: the
    default list). Raises ValueError naming the flag."""
    if value is None:
        return None
    items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    try:
        sizes = sorted({int(s) for s in items})
    except (TypeError, ValueError) as e:
        raise ValueError(f"cuda_graph_sizes (--cuda-graph-sizes) must be integers, got {value!r}") from e
    if sizes and sizes[0] < 1:
        raise ValueError(f"cuda_graph_sizes (--cuda-graph-sizes) must be positive, got {value!r}")
    return sizes or None


def check_cudagraph_mode(mode: str | None, enforce_eager: bool = False, compile_model: bool = False,
                         pipeline_parallel_size: int = 1) -> str | None:
    """The configured mode, lower-cased (None: automatic), refused where it cannot apply whatever
    the device (ValueError naming the flags). VllmConfig and the runner both check."""
    if mode is None or mode == "":
        return None
    mode = mode.lower()
    if mode not in CUDAGRAPH_MODES:
        raise ValueError(f"cudagraph_mode (--cudagraph-mode) must be one of {CUDAGRAPH_MODES}, got {mode!r}")
    if mode == NONE:
        return mode
    if mode == FULL_DECODE_ONLY and enforce_eager:
        raise ValueError("cudagraph_mode 'full_decode_only' contradicts enforce_eager (--enforce-eager turns CUDA "
                         "graphs off)")
    if compile_model:
        raise ValueError(f"cudagraph_mode {mode!r} does not combine with compile_model (--compile): the compiled "
                         "forward runs every step itself")
    if pipeline_parallel_size > 1:
        raise ValueError(f"cudagraph_mode {mode!r} does not combine with pipeline_parallel_size > 1: a later stage's "
                         "forward takes the previous stage's hidden states, which the padded buffers do not "
                         "carry; leave --cudagraph-mode out (pipeline stages run eager)")
    return mode
