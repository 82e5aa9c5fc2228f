"""Load an HF model directory (config.json + safetensors, single file or sharded index) into
our architecture: checkpoint names mapped onto the fused parameters (q/k/v into `qkv_proj`,
gate/up into `gate_up_proj`), each tensor sliced to this rank's shard under tensor parallelism
(services/worker/parallel.py says how things split), to its experts under expert parallelism and
to its stage under pipeline parallelism; with one rank every tensor is loaded whole.

Which part of a tensor this rank needs is decided from its name and shape before it is read
(`checkpoint_part`), and only that part is read (checkpoint_parts.py): a rank never reads another
stage's layers or another rank's experts, nor more of a tensor than its shard."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial

import torch
from transformers import AutoConfig

from services.common.config import resolve_dtype_name
from services.common.cpu_dtype_probe import GemmTimings
from services.common.parallel_shapes import check_tensor_parallel_shapes
from services.worker.models import MODEL_REGISTRY, MODEL_TYPE_TO_ARCH
from services.worker.models.checkpoint_parts import WHOLE, Part, PartFor, part_of, read_parts, take
from services.worker.models.layers import DecoderForCausalLM, DecoderLayer
from services.worker.models.moe import SparseMoeBlock
from services.worker.models.shared_expert import shared_expert_range
from services.worker.parallel import get_ep, get_tp, vocab_range
from services.worker.models.quant_install import quantize_linears_int8

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str = "cpu",
                  probe: Callable[[], GemmTimings | None] | None = None) -> torch.dtype:
    """A torch dtype for `dtype`; "auto" picks by `device` (on a CPU with bf16 instructions by
    the GEMM timings `probe` measures, when given; see services.common.config.resolve_dtype_name)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    device_type = torch.device(device).type
    cuda_bf16 = device_type == "cuda" and torch.cuda.is_bf16_supported()
    dtype = resolve_dtype_name(dtype, device_type, cuda_bf16=cuda_bf16, probe=probe)
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose from float32, bfloat16, float16")
    return DTYPES[dtype]


def _safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def iterate_weights(model_dir: str, progress: bool = True,
                    part_for: PartFor | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint in `model_dir`; with `part_for` (as
    `checkpoint_part`), (name, part) for every tensor it gives a part of, reading only that."""
    return read_parts(_safetensors_files(model_dir), part_for or (lambda name, shape: WHOLE), progress)


def load_hf_model(model_dir: str, dtype: torch.dtype, device: torch.device, progress: bool = True,
                  quantization: str | None = None):
    """Build the architecture named in config.json and fill it from the safetensors checkpoint;
    `quantization` "int8" quantizes its linear layers to Q8_0 blocks at load."""
    if quantization not in (None, "int8"):
        raise ValueError(f"unsupported quantization {quantization!r}; choose from gguf, int8")
    config = AutoConfig.from_pretrained(model_dir)
    model = build_model(config).to_empty(device=device)
    load_weights(model, iterate_weights(model_dir, progress, partial(checkpoint_part, model)))
    if quantization == "int8":
        quantize_linears_int8(model)
    return finish_model(model, dtype, device), config


def build_model(config) -> DecoderForCausalLM:
    """The architecture `config` names, this rank's shard and stage of it, on the meta device
    (`to_empty` gives it uninitialised weights)."""
    archs = getattr(config, "architectures", None) or [MODEL_TYPE_TO_ARCH.get(config.model_type, config.model_type)]
    arch = archs[0]
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {sorted(MODEL_REGISTRY)}")
    # this rank builds and loads only its shard
    check_tensor_parallel_shapes(config, get_tp().size, expert_parallel=get_ep().size > 1)
    with torch.device("meta"):
        model = MODEL_REGISTRY[arch](config)
    return model


def finish_model(model: DecoderForCausalLM, dtype: torch.dtype, device: torch.device) -> DecoderForCausalLM:
    """The loaded model in `dtype` (quantized blocks stay uint8), ready to run."""
    model = model.to(dtype=dtype).eval()
    model.rotary_emb.reset_tables(device)  # meta buffers → real fp32 tables
    return model


# HF checkpoint names → (our fused parameter, which shard of it).
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def fused_target(name: str) -> tuple[str, int | None]:
    """(our parameter, which shard of it) for checkpoint name `name` (None: loaded whole)."""
    for hf_name, (fused, idx) in _FUSED_SHARDS.items():
        if f".{hf_name}." in name:
            return name.replace(hf_name, fused), idx
    return name, None


def needs_weight(model: DecoderForCausalLM, name: str) -> bool:
    """Whether this rank needs any of checkpoint tensor `name`, from its name alone: not one we
    never load, another stage's (`holds_weight`) or another rank's expert (the MoE block says)."""
    name = name.removeprefix("model.")
    if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and model.tie_word_embeddings) \
            or not holds_weight(model, name):
        return False
    moe = _moe_block_of(model, name)
    return moe is None or moe[0].holds(moe[2])


def checkpoint_part(model: DecoderForCausalLM, name: str, shape: Sequence[int]) -> Part | None:
    """This rank's part of checkpoint tensor `name` of `shape`, decided before it is read: None
    where it `needs_weight` none of it, else its shard under tensor parallelism (`tp_range`) or
    what its MoE block takes (its experts, their columns); WHOLE with one rank."""
    if not needs_weight(model, name):
        return None
    name = name.removeprefix("model.")
    moe = _moe_block_of(model, name)
    if moe is not None:
        return moe[0].part(moe[2], shape)
    piece = tp_range(model, name)
    return WHOLE if piece is None else part_of(shape, {piece[0]: piece[1:]})


def rank_parts(model: DecoderForCausalLM,
               weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's part) of whole checkpoint tensors already in memory, as `checkpoint_part`
    takes them; the tensors it needs none of left out."""
    for name, tensor in weights:
        part = checkpoint_part(model, name, tensor.shape)
        if part is not None:
            yield name, take(tensor, part)


@torch.no_grad()
def load_weights(model: DecoderForCausalLM, parts: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy this rank's parts of checkpoint tensors (as `checkpoint_part` takes them: read so by
    `iterate_weights`, or cut from whole tensors by `rank_parts`) into `model`'s parameters;
    KeyError for a tensor the model has no place for, or a parameter the checkpoint leaves out."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in parts:
        name = name.removeprefix("model.")
        moe = _moe_block_of(model, name)
        if moe is not None:  # a router or expert tensor: the block puts it in place
            block, prefix, relative = moe
            loaded.update(prefix + key for key in block.load(relative, tensor))
            continue
        target, shard = fused_target(name)
        if target not in params:
            raise KeyError(f"unexpected weight {name!r} in checkpoint")
        param = params[target]
        if shard is not None:
            param = param.narrow(0, *shard_range(model, target, shard))
        if tensor.shape[0] < param.shape[0]:  # the last vocabulary shard's padding rows
            param[tensor.shape[0]:].zero_()
            param = param[:tensor.shape[0]]
        param.copy_(tensor)
        loaded.add(f"{target}#{shard}")
    expected = {f"{n}#{s}" for n in params for s in _shards_of(model, n)}
    missing = sorted(expected - loaded)
    if missing:
        raise KeyError(f"checkpoint lacks weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def holds_weight(model: DecoderForCausalLM, name: str) -> bool:
    """Whether this pipeline stage holds checkpoint weight `name` (everything, with one stage)."""
    layer = re.match(r"layers\.(\d+)\.", name)
    if layer:
        return int(layer.group(1)) in model.layer_range
    if name.startswith("embed_tokens."):
        return model.embed_tokens is not None
    if name.startswith(("norm.", "lm_head.")):
        return model.is_last_stage
    return True


def _layer_of(model: DecoderForCausalLM, name: str) -> DecoderLayer:
    """The layer a checkpoint name belongs to (the stage's first for a name outside the layers)."""
    layer = re.match(r"layers\.(\d+)\.", name)
    return model.layers[int(layer.group(1)) if layer else model.layer_range.start]


def _moe_block_of(model: DecoderForCausalLM, name: str) -> tuple[SparseMoeBlock, str, str] | None:
    """(block, our prefix, name relative to the block) for a router or expert tensor."""
    if model.spec.moe is None:
        return None
    match = re.match(r"layers\.(\d+)\.(\w+)\.(.+)", name)
    if match is None:
        return None
    mlp = model.layers[int(match.group(1))].mlp
    if not isinstance(mlp, SparseMoeBlock) or match.group(2) not in ("mlp", model.spec.moe.checkpoint_module):
        return None
    return mlp, f"layers.{match.group(1)}.mlp.", match.group(3)


def tp_range(model: DecoderForCausalLM, name: str) -> tuple[int, int, int] | None:
    """(dim, start, length) of this rank's part of checkpoint tensor `name`, None for the whole
    tensor (one rank; norms and row-parallel biases, which every rank holds whole). The last
    vocabulary shard's range may run past the table: its padding rows."""
    tp = get_tp()
    if tp.size == 1:
        return None
    layer = _layer_of(model, name)
    attn, mlp = layer.self_attn, layer.mlp
    d = attn.head_dim
    if "embed_tokens." in name or "lm_head." in name:
        return (0, *vocab_range(model.config.vocab_size, tp))
    if ".q_proj." in name:
        return 0, attn.head_start * d, attn.q_size
    if ".k_proj." in name or ".v_proj." in name:
        return 0, attn.kv_head_start * d, attn.kv_size
    if ".o_proj.weight" in name:
        return 1, attn.head_start * d, attn.q_size
    if attn.full_qk_norm and ".q_norm." in name:
        return 0, attn.head_start * d, attn.q_size
    if attn.full_qk_norm and ".k_norm." in name:
        return 0, attn.kv_head_start * d, attn.kv_size
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None and ".shared_expert." in name:  # its own columns (whole under expert parallelism)
        return shared_expert_range(shared, name)
    if ".gate_proj." in name or ".up_proj." in name:
        return 0, mlp.intermediate_start, mlp.intermediate_size
    if ".down_proj.weight" in name:
        return 1, mlp.intermediate_start, mlp.intermediate_size
    return None


def _shards_of(model: DecoderForCausalLM, name: str) -> tuple:
    """The pieces parameter `name` is loaded in: q/k/v, gate/up, an expert block's, or itself whole."""
    moe = _moe_block_of(model, name)
    if moe is not None:
        return moe[0].pieces(moe[2])
    if "qkv_proj" in name:
        return (0, 1, 2)
    if "gate_up_proj" in name:
        return (0, 1)
    return (None,)


def shard_range(model: DecoderForCausalLM, name: str, shard: int) -> tuple[int, int]:
    """(first row, rows) of piece `shard` in fused parameter `name`."""
    layer = _layer_of(model, name)
    if "qkv_proj" in name:
        sizes = [layer.self_attn.q_size, layer.self_attn.kv_size, layer.self_attn.kv_size]
    else:
        sizes = [layer.mlp.intermediate_size] * 2
    return sum(sizes[:shard]), sizes[shard]
