"""Which faster implementation runs a loaded model's forward, chosen once after loading.

The layers (models/layers.py) compute the same thing whatever runs them; this module decides,
for the model's device, dtype and parallel layout, what runs them:
- the elementwise ops: the fused C kernels on CPU, Triton on CUDA, else torch's
  (models/layer_ops.py; `model.fused_ops`);
- on CPU, the linear layers' weights prepacked for oneDNN or gemm.c (models/cpu_linear.py),
  and the routed experts' weights packed for their C kernel (cpu/moe_experts.c);
- on CPU, whole steps as one C call (models/c_step/): the small decode step on its row-major
  copy of the weights (`model.decode_step`), the packed step on the packed ones
  (`model.packed_step`); `c_step_for` says which one, if any, takes a batch.
Each falls back (returns False) where it does not apply, and the torch path runs.
"""

from __future__ import annotations

import logging
import os

from torch import nn

from services.worker.attention.base import AttentionMetadata
from services.worker.cpu.cpu_ops import CpuOps
from services.worker.models import cpu_linear
from services.worker.models.c_step import quant_step
from services.worker.models.c_step.decode_step import CpuDecodeStep, PackedStep, load_library, load_packed_library
from services.worker.models.layer_ops import FusedCpuOps, TritonOps
from services.worker.models.moe import FusedExperts
from services.worker.parallel import get_tp

logger = logging.getLogger(__name__)

# Set to 0 to run every CPU step layer by layer (as --compile does), without the C steps.
CPU_DECODE_STEP_ENV = "MYVLLM_CPU_DECODE_STEP"


def use_fast_paths(model: nn.Module, attention_backend: str, compile_model: bool, max_step_copy_bytes: int) -> None:
    """The runner's choice for a freshly loaded model. On CPU: the C steps with the C attention
    kernels, outside a compiled graph, unless $MYVLLM_CPU_DECODE_STEP is 0 (the small step's
    row-major copy of the weights at most `max_step_copy_bytes`), and the packed weights. Then,
    everywhere, the fused elementwise ops (outside a compiled graph inductor fuses these itself)."""
    if _param(model).device.type == "cpu":
        c_steps = (attention_backend == "cpu" and not compile_model
                   and os.environ.get(CPU_DECODE_STEP_ENV, "1") != "0")
        if c_steps:
            # Before packing: the small step keeps the row-major weights.
            use_cpu_decode_step(model, max_step_copy_bytes)
        packed_step = c_steps
        if c_steps and model.is_quantized():
            # packed_step.c reads gemm.c's packed dense weights only (quant/ops.py runs the rest).
            logger.info("cpu packed step off: the model keeps quantized weights; larger steps run layer by layer")
            packed_step = False
        if packed_step:
            keep_router_weights(model)  # before packing: a packed router hides its weight
        packed_linears = pack_for_cpu(model)
        use_cpu_moe(model)
        if packed_linears and packed_step:
            use_cpu_packed_step(model)  # on the packed weights and experts: after packing both
    use_fused_ops(model)


def _param(model: nn.Module) -> nn.Parameter:
    return next(model.parameters())


def use_cpu_moe(model: nn.Module) -> int:
    """Pack every routed-experts layer's weights for the C kernel (cpu/moe_experts.c: one call per
    layer); returns how many were packed. Under tensor and expert parallelism too: each rank packs
    its own experts or columns, and the block's all-reduce stays outside the kernel. Layers where it
    does not apply (another dtype, no AVX2, no C compiler) keep the torch path."""
    packed = sum(experts.pack_for_cpu() for experts in model.modules() if isinstance(experts, FusedExperts))
    if packed:
        logger.info("cpu moe kernel: %d expert layers packed", packed)
    return packed


def keep_router_weights(model: nn.Module) -> None:
    """Keep each MoE block's router weight row-major beside the packed copy `pack_for_cpu` gives
    the router, for the packed step's routing (E x hidden values a layer)."""
    for block in model.moe_blocks():
        if isinstance(block.gate, nn.Linear):
            block.router_weight = block.gate.weight.detach()


def cpu_ops(model: nn.Module) -> FusedCpuOps | None:
    """The fused C ops, when they are this model's elementwise backend."""
    return model.fused_ops if isinstance(model.fused_ops, FusedCpuOps) else None


def use_fused_ops(model: nn.Module) -> bool:
    """Run the elementwise ops through fused kernels (models/layer_ops.py): the C ones on CPU,
    the Triton ones on CUDA; False where neither applies (torch's ops run)."""
    if _param(model).device.type == "cuda":
        return use_triton_ops(model)
    return use_cpu_ops(model)


def use_cpu_ops(model: nn.Module) -> bool:
    """Run the elementwise ops through the fused C kernels (services/worker/cpu/cpu_ops.c);
    False where they do not apply (not on CPU, another dtype, no C compiler)."""
    param = _param(model)
    ops = CpuOps.load() if CpuOps.supports(param) else None
    model.fused_ops = FusedCpuOps(ops) if ops is not None else None
    return model.fused_ops is not None


def use_triton_ops(model: nn.Module) -> bool:
    """Run the elementwise ops as Triton kernels (models/triton_ops.py); False where they do
    not apply (not on CUDA, another dtype, no triton)."""
    model.fused_ops = TritonOps() if TritonOps.supports(_param(model)) else None
    return model.fused_ops is not None


def c_step_for(model: nn.Module, meta: AttentionMetadata) -> CpuDecodeStep | PackedStep | None:
    """The C step that runs this batch's whole decoder, or None: the eager layers do. The small
    decode step first: for the few requests it takes it beats the packed one. A step with LoRA
    adapters runs the packed step where it holds the slot tables (`PackedStep.bind_lora`), else
    the eager layers, which add the adapters' products."""
    if getattr(meta, "lora", None) is not None:
        step = model.packed_step
        return step if step is not None and step.runs_lora() and step.applies(meta) else None
    return next((step for step in (model.decode_step, model.packed_step)
                 if step is not None and step.applies(meta)), None)


def c_steps_apply(model: nn.Module) -> bool:
    """Whether the C steps implement this model's layers on this rank: CPU, one rank and one
    stage, no whole-projection q/k norms or clipped q/k/v. Routed experts only in the packed
    step, which checks each MoE block itself (`PackedStep.supports`)."""
    return (CpuOps.supports(_param(model)) and get_tp().size == 1
            and model.is_first_stage and model.is_last_stage
            and not model.spec.full_qk_norm and not getattr(model.config, "clip_qkv", None))


def use_cpu_packed_step(model: nn.Module) -> bool:
    """Run steps the small decode step does not take (more requests, prefill chunks) as one C
    call on the packed weights (models/c_step/packed_step.c). Call after `pack_for_cpu` and
    `use_cpu_moe`; off where the C steps do not apply, a projection is not packed for gemm.c
    (no AVX-512, another dtype) or a MoE layer is not one the step runs (a shared expert, experts
    on other ranks or left unpacked)."""
    if not c_steps_apply(model):
        return False
    try:
        lib = load_packed_library()
    except (RuntimeError, OSError) as e:
        logger.warning("cpu packed decode step unavailable (%s); larger decode steps run layer by layer", e)
        return False
    if not PackedStep.supports(model, lib):
        return False
    model.packed_step = PackedStep(model, lib)
    return True


def use_cpu_decode_step(model: nn.Module, max_extra_bytes: int) -> bool:
    """Run decode steps of a few requests as one C call (models/c_step/decode_step.py). Call
    before `pack_for_cpu`: the step keeps the row-major weights, which costs their bytes again
    beside the packed copies, so it is left off when that exceeds `max_extra_bytes`; also off
    where it does not apply (not CPU, tensor or pipeline parallel, another dtype, no C compiler,
    a layer it does not implement: routed experts (decode_step.c has none; the packed step takes
    MoE models' decodes too), whole-projection q/k norms, clipped q/k/v).
    A quantized model's step reads its blocks in place, where every projection is one block type
    (or a dense linear layer): the quantized build of the step (models/c_step/quant_step.py)."""
    if not c_steps_apply(model) or model.spec.moe is not None:
        return False
    quantized = model.is_quantized()
    if quantized and (reason := quant_step.unsupported(model)) is not None:
        logger.info("cpu decode step off: %s; decode steps run layer by layer", reason)
        return False
    extra = CpuDecodeStep.plain_weight_bytes(model)
    if extra > max_extra_bytes:
        logger.info("cpu decode step off: its row-major weights (%.1f GB) exceed the %.1f GB allowed",
                    extra / 1e9, max_extra_bytes / 1e9)
        return False
    try:
        model.decode_step = CpuDecodeStep(model, quant_step.load_quant_library() if quantized else load_library())
    except (RuntimeError, OSError) as e:
        logger.warning("cpu decode step unavailable (%s); decode steps run layer by layer", e)
        return False
    return True


def pack_for_cpu(model: nn.Module) -> bool:
    """Give every linear layer (and the LM head) oneDNN-prepacked weights (see cpu_linear.py;
    quantized layers and a quantized tied embedding are left as they are);
    False where this torch build or dtype has no such path (the layers stay as they are).
    Tensor-parallel ranks keep plain layers: a packed copy would drop the row-parallel
    all-reduce (RowParallelLinear's forward)."""
    if get_tp().size > 1 or not cpu_linear.available(_param(model).dtype):
        return False
    cpu_linear.pack_linears(model)
    if model.tie_word_embeddings and model.is_last_stage and isinstance(model.embed_tokens, nn.Embedding):
        model.tied_head = cpu_linear.PackedLinear(model.embed_tokens.weight, None)
    return True
