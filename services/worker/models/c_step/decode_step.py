"""The whole decode step in one C call, for CPU workers: `decode_step.c` for a few requests,
`packed_step.c` for more.

At batch 1 a decode step reads every weight once and does little else, so its speed is the
speed of streaming the weights; the eager forward adds a few hundred op dispatches and OpenMP
regions per step on top of that. `CpuDecodeStep` runs the decoder (and, through `lm_head`, the
LM head) of a step whose requests each bring one new token, at most `max_rows` of them, as one
OpenMP region. Beyond that the projections stop being bound by reading the weights and blocked
GEMMs win: `PackedStep` runs the decoder of the other steps (larger decode batches, prefill
chunks, draft tokens), again as one region, on the weights gemm.c packed for the linear layers
(around those GEMMs the eager forward's Python dispatch and per-op OpenMP regions are a large
share of the step).

The C code reads the checkpoint's row-major weights, while the eager path runs on oneDNN's
prepacked copies (`cpu_linear.py`): the step keeps the row-major tensors too, which doubles
the projections' memory. `fast_paths.use_cpu_decode_step` therefore turns it on only
when that copy is small next to the available RAM, and `MYVLLM_CPU_DECODE_STEP=0` turns it off.
Projections kept in GGUF blocks are read in place by the small step's quantized build
(`quant_step.py`); the packed step takes dense weights only. Mixture-of-experts layers run in the
packed step alone (routing and the experts' kernel, cpu/moe_share.h, on the packed experts; one
rank, no shared expert); the small step never sees them (`fast_paths` keeps it off for MoE models).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from services.worker.attention.base import AttentionMetadata
from services.worker.cpu import cbuild
from services.worker.cpu.gemm import HIGHEST_ISA
from services.worker.cpu.moe_experts import BLOCK as EXPERT_BLOCK
from services.worker.lora.slots import GROUPS as LORA_SLOT_GROUPS
from services.worker.lora.slots import LoraSlots
from services.worker.models.c_step import quant_step
from services.worker.models.moe import FusedExperts, SparseMoeBlock
from services.worker.quant import kernels as quant_kernels
from services.worker.quant.ops import quant_matmul
from services.worker.quant.weights import QuantWeights

_SOURCE = Path(__file__).with_name("decode_step.c")
_PACKED_SOURCE = Path(__file__).with_name("packed_step.c")
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# The C side's per-layer pointer order (step_model.h's enum).
LAYER_SLOTS = ("in_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "post_norm", "gate_up",
               "gate_up_bias", "down", "down_bias", "router", "experts13", "experts2")
_lib: ctypes.CDLL | None = None
_packed_libs: dict[str | None, ctypes.CDLL] = {}
MAX_ROWS = {torch.float32: 8, torch.bfloat16: 4}


class _StepModel(ctypes.Structure):
    _fields_ = [("num_layers", _I), ("hidden", _I), ("num_heads", _I), ("num_kv_heads", _I), ("head_dim", _I),
                ("intermediate", _I), ("block_size", _I), ("bf16", _I), ("eps", _F), ("scale", _F),
                ("layers", _P), ("kv", _P), ("final_norm", _P), ("cos", _P), ("sin", _P),
                ("wtypes", _P), ("row_bytes", _P), ("int8_dot", _I), ("num_experts", _I), ("top_k", _I),
                ("moe_ip", _I), ("moe_hp", _I), ("renormalize", _I), ("weights_fp32", _I)]


def load_library() -> ctypes.CDLL:
    """decode_step.c, at most at the avx512_bf16 level (its bf16 GEMV's vdpbf16ps)."""
    global _lib
    if _lib is None:
        lib = cbuild.build(_SOURCE, ["-ffp-contract=off"], highest="avx512_bf16")
        lib.decode_step.restype = _I
        lib.decode_step.argtypes = [_P, _I, _P, _P, _P, _P, _I64, _P, _P, _I]
        lib.lm_head.restype = _I
        lib.lm_head.argtypes = [_P, _P, _P, _I, _I, _I, _I, _I]
        lib.max_rows.restype = _I
        _lib = lib
    return _lib


def load_packed_library(level: str | None = None) -> ctypes.CDLL:
    """packed_step.c, built at gemm.c's level (its projections are gemm.c's tiles)."""
    if level not in _packed_libs:
        lib = cbuild.build(_PACKED_SOURCE, ["-ffp-contract=off"], highest=HIGHEST_ISA, level=level)
        lib.packed_step.restype = _I
        lib.packed_step.argtypes = [_P, _I, _I, _P, _P, _P, _P, _P, _P, _I64, _P, _P, _P, _I]
        lib.packed_step_available.restype = _I
        lib.packed_step_available.argtypes = [_I]
        lib.packed_step_max_tokens.restype = _I
        _packed_libs[level] = lib
    return _packed_libs[level]


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class _CStep:
    """What the two C steps share: the model description (`_StepModel`) over per-layer weight
    pointers, the KV cache bound by address, and the call."""

    def __init__(self, model: torch.nn.Module, weights: list[list[torch.Tensor | None]]) -> None:
        """weights: per layer, the tensors of LAYER_SLOTS in order (None where the model has none)."""
        layers = list(model._stage())
        attn0 = layers[0].self_attn
        # the dense MLPs' width (0 where every layer's MLP is a mixture of experts)
        intermediate = next((layer.mlp.intermediate_size for layer in layers
                             if not isinstance(layer.mlp, SparseMoeBlock)), 0)
        self.dtype = next(model.parameters()).dtype
        # Kept alive here: the C side holds their addresses.
        self._weights = [t for layer in weights for t in layer]
        self._layer_ptrs = (_P * len(self._weights))(*[_ptr(t) for t in self._weights])
        rope = model.rotary_emb
        self._rope = (rope.cos.contiguous(), rope.sin.contiguous())
        self._final_norm = model.norm.weight
        self._model = _StepModel(
            num_layers=len(layers), hidden=model.config.hidden_size, num_heads=attn0.num_heads,
            num_kv_heads=attn0.num_kv_heads, head_dim=attn0.head_dim, intermediate=intermediate,
            block_size=0, bf16=int(self.dtype == torch.bfloat16), eps=float(layers[0].input_layernorm.eps),
            scale=float(attn0.attn.scale), layers=ctypes.addressof(self._layer_ptrs), kv=None,
            final_norm=self._final_norm.data_ptr(), cos=self._rope[0].data_ptr(), sin=self._rope[1].data_ptr())
        self._attention = [layer.self_attn.attn for layer in layers]
        self._kv_bound: list[torch.Tensor] = []
        self._kv_ptrs = None

    @staticmethod
    def _norms(layer: torch.nn.Module) -> dict[str, torch.Tensor | None]:
        attn = layer.self_attn
        return {"in_norm": layer.input_layernorm.weight, "q_norm": attn.q_norm.weight if attn.q_norm else None,
                "k_norm": attn.k_norm.weight if attn.k_norm else None,
                "post_norm": layer.post_attention_layernorm.weight}

    def _bind_kv(self) -> None:
        caches = [a.kv_cache for a in self._attention]
        if len(caches) == len(self._kv_bound) and all(c is b for c, b in zip(caches, self._kv_bound, strict=True)):
            return
        if any(c is None for c in caches):
            raise RuntimeError("decode step before the KV cache exists")
        self._kv_bound = caches
        self._kv_ptrs = (_P * (2 * len(caches)))(*[p for c in caches for p in (c[0].data_ptr(), c[1].data_ptr())])
        self._model.kv = ctypes.addressof(self._kv_ptrs)
        self._model.block_size = int(caches[0].shape[2])

    def applies(self, meta: AttentionMetadata) -> bool:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: [T, hidden] embeddings of the step's tokens → [T, hidden], the final norm's output;
        each token's K/V is written into the cache at meta.slot_mapping on the way."""
        self._bind_kv()
        x = x.contiguous()
        positions = positions.to(torch.int64).contiguous()
        assert meta.block_table.dtype == torch.int32 and meta.block_table.stride(-1) == 1
        assert meta.seq_lens.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
        out = torch.empty_like(x)
        rc = self._call(x, positions, meta, out)
        if rc != 0:
            raise MemoryError(f"cpu decode step failed ({rc})")
        return out

    def _call(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> int:
        raise NotImplementedError


class CpuDecodeStep(_CStep):
    """Holds the row-major weights of one model and runs its small decode steps in C. A model
    whose projections stay in GGUF blocks needs the quantized build (`quant_step.
    load_quant_library`); the step reads its blocks where they are."""

    def __init__(self, model: torch.nn.Module, lib: ctypes.CDLL) -> None:
        self.lib = lib
        weights, qtypes, row_bytes = [], [], []
        for layer in model._stage():
            attn, mlp = layer.self_attn, layer.mlp
            slots, types, sizes = {**self._norms(layer)}, dict.fromkeys(LAYER_SLOTS, 0), dict.fromkeys(LAYER_SLOTS, 0)
            for name, module in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                                 ("down", mlp.down_proj)):
                proj = quant_step.projection(module)
                slots[name], slots[f"{name}_bias"], types[name], sizes[name] = (proj.weight, proj.bias, proj.qtype,
                                                                                proj.row_bytes)
            weights.append([slots.get(name) for name in LAYER_SLOTS])
            qtypes += [types[name] for name in LAYER_SLOTS]
            row_bytes += [sizes[name] for name in LAYER_SLOTS]
        super().__init__(model, weights)
        self.quantized = any(qtypes)
        self._rows: int | None = None
        if self.quantized:
            self._wtypes = (_I * len(qtypes))(*qtypes)
            self._row_bytes = (_I64 * len(row_bytes))(*row_bytes)
            self._model.wtypes = ctypes.addressof(self._wtypes)
            self._model.row_bytes = ctypes.addressof(self._row_bytes)
            # The step's products have the layer-by-layer kernels' bits at every row count where
            # both take the int8 products (every projection of a type they cover); the exact fp32
            # products only below the row count where quant_gemm.c switches to its tiles.
            self._int8_rows = int(lib.max_rows()) if all(lib.quant_int8_dot(q) for q in qtypes if q) else 0
            self._fp32_rows = min(int(lib.max_rows()), int(lib.quant_tile_min_rows()) - 1)
        else:
            # Up to these many rows the step beats the eager forward (forward + LM head); beyond
            # them the projections stop being bound by the weights' bytes. Fewer for bf16: the
            # step widens bf16 to fp32 for its AVX2 FMAs, where oneDNN has bf16 dot products.
            self.max_rows = min(int(lib.max_rows()), MAX_ROWS[self.dtype])
        self.head = model.embed_tokens if model.tie_word_embeddings else model.lm_head
        self.head_weight = None if isinstance(self.head, QuantWeights) else self.head.weight.detach()

    @property
    def max_rows(self) -> int:
        """Most requests one step takes (the quantized step's depends on INT8_DOT, read per call
        as the kernels read it)."""
        if self._rows is not None:
            return self._rows
        return self._int8_rows if quant_kernels.INT8_DOT and self._int8_rows else self._fp32_rows

    @max_rows.setter
    def max_rows(self, rows: int) -> None:
        self._rows = rows

    def applies(self, meta: AttentionMetadata) -> bool:
        """A step of at most `max_rows` requests, each bringing exactly one new token."""
        return meta.max_query_len == 1 and 0 < meta.num_tokens <= self.max_rows

    def _call(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> int:
        bt = meta.block_table
        self._model.int8_dot = int(quant_kernels.INT8_DOT)  # as the layer-by-layer kernels read it
        return self.lib.decode_step(ctypes.addressof(self._model), x.shape[0], x.data_ptr(), positions.data_ptr(),
                                    meta.slot_mapping.data_ptr(), bt.data_ptr(), bt.stride(0),
                                    meta.seq_lens.data_ptr(), out.data_ptr(), torch.get_num_threads())

    @staticmethod
    def plain_weight_bytes(model: torch.nn.Module) -> int:
        """What the row-major copy of the projections costs next to the packed ones."""
        total = 0
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                total += module.weight.numel() * module.weight.element_size()
        return total

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, hidden] → [M, vocabulary rows] logits in the model's dtype, for M <= max_rows."""
        hidden = hidden.contiguous()
        if isinstance(self.head, QuantWeights):
            return self._quant_lm_head(hidden)
        w = self.head_weight
        out = torch.empty((hidden.shape[0], w.shape[0]), dtype=w.dtype)
        rc = self.lib.lm_head(hidden.data_ptr(), w.data_ptr(), out.data_ptr(), hidden.shape[0], w.shape[1],
                              w.shape[0], int(w.dtype == torch.bfloat16), torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"cpu LM head failed ({rc})")
        return out

    def _quant_lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head (or tied embedding) in GGUF blocks: in C where the step's kernels take them,
        else as the layer-by-layer forward runs it."""
        head, bias = self.head, getattr(self.head, "bias", None)
        if not (quant_step.takes_blocks(head) and bias is None and hasattr(self.lib, "lm_head_quant")):
            return quant_matmul(hidden, head, bias)
        qtype, rows = head.parts()[0]
        out = torch.empty((hidden.shape[0], rows.shape[0]), dtype=hidden.dtype)
        rc = self.lib.lm_head_quant(int(qtype), rows.shape[1], int(quant_kernels.INT8_DOT), hidden.data_ptr(),
                                    rows.data_ptr(), out.data_ptr(), hidden.shape[0], head.in_features,
                                    rows.shape[0], int(hidden.dtype == torch.bfloat16), torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"cpu LM head failed ({rc})")
        return out


def router_weight(block: SparseMoeBlock) -> torch.Tensor | None:
    """The router's row-major [E, hidden] weight: kept aside by `fast_paths` before the linear
    layers were packed (a packed router hides it), or the plain layer's own."""
    if block.router_weight is not None:
        return block.router_weight
    return block.gate.weight.detach() if isinstance(block.gate, torch.nn.Linear) else None


# lora_step.h's groups, in its order
LORA_GROUPS = ("qkv", "o", "gate_up", "down")
assert set(LORA_GROUPS) == set(LORA_SLOT_GROUPS)


class _LoraTables(ctypes.Structure):
    """lora_step.h's LoraTables."""
    _fields_ = [("a", _P), ("b", _P), ("width", _I * len(LORA_GROUPS)), ("parts", _I * len(LORA_GROUPS)),
                ("slots", _I), ("rank", _I)]


class PackedStep(_CStep):
    """Runs whole steps (decodes, prefill chunks, or both; `packed_step.c`) on the weights the
    linear layers already hold packed for gemm.c, and the experts packed for their kernel: no
    copy of its own."""

    def __init__(self, model: torch.nn.Module, lib: ctypes.CDLL) -> None:
        weights, moe = [], None
        for layer in model._stage():
            attn, mlp = layer.self_attn, layer.mlp
            slots = {**self._norms(layer)}
            linears = [("qkv", attn.qkv_proj), ("o", attn.o_proj)]
            if isinstance(mlp, SparseMoeBlock):
                moe = mlp
                slots.update(router=router_weight(mlp).contiguous(), experts13=mlp.experts.w13,
                             experts2=mlp.experts.w2)
            else:
                linears += [("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)]
            for name, linear in linears:
                slots[name], slots[f"{name}_bias"] = linear.packed, linear.bias
            weights.append([slots.get(name) for name in LAYER_SLOTS])
        super().__init__(model, weights)
        if moe is not None:  # every MoE layer of a model alike
            self._model.num_experts, self._model.top_k = moe.num_experts, moe.top_k
            self._model.moe_ip = moe.experts.w13.shape[1] * EXPERT_BLOCK
            self._model.moe_hp = moe.experts.w2.shape[1] * EXPERT_BLOCK
            self._model.renormalize, self._model.weights_fp32 = int(moe.renormalize), int(moe.spec.fp32_weights)
        self.lib = lib
        self.max_tokens = int(lib.packed_step_max_tokens())
        self._lora: _LoraTables | None = None

    def bind_lora(self, slots: LoraSlots) -> bool:
        """Run steps whose tokens use adapters too, adding the products of `slots`' tables (read by
        address: they are repacked in place). False where the tables are not packed for gemm.c
        in the model's dtype: such steps stay with the eager layers."""
        tables = [slots.groups[group] for group in LORA_GROUPS]
        if any(t.a_packed is None or t.a_packed.dtype != self.dtype for t in tables):
            return False
        self._lora_ptrs = [(_P * (slots.num_layers * len(LORA_GROUPS)))(
            *[getattr(t, packed)[layer].data_ptr() for layer in range(slots.num_layers) for t in tables])
            for packed in ("a_packed", "b_packed")]
        self._lora = _LoraTables(a=ctypes.addressof(self._lora_ptrs[0]), b=ctypes.addressof(self._lora_ptrs[1]),
                                 width=(_I * len(tables))(*[t.a.shape[1] for t in tables]),
                                 parts=(_I * len(tables))(*[t.parts for t in tables]),
                                 slots=slots.max_loras, rank=slots.max_rank)
        return True

    def runs_lora(self) -> bool:
        return self._lora is not None

    @staticmethod
    def supports(model: torch.nn.Module, lib: ctypes.CDLL) -> bool:
        """Every projection of every layer is packed for gemm.c, in a dtype this build runs, the
        head size suits the prefill tiles (a multiple of 8), and every mixture-of-experts layer
        is one the step runs (`runs_moe_block`)."""
        dtype = next(model.parameters()).dtype
        if dtype not in (torch.float32, torch.bfloat16) or not lib.packed_step_available(int(dtype == torch.bfloat16)):
            return False
        layers = list(model._stage())
        linears = [linear for layer in layers for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj)]
        linears += [linear for layer in layers if not isinstance(layer.mlp, SparseMoeBlock)
                    for linear in (layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        return (layers[0].self_attn.head_dim % 8 == 0
                and all(getattr(linear, "gemm", None) is not None for linear in linears)
                and all(PackedStep.runs_moe_block(layer.mlp, dtype) for layer in layers
                        if isinstance(layer.mlp, SparseMoeBlock)))

    @staticmethod
    def runs_moe_block(block: SparseMoeBlock, dtype: torch.dtype) -> bool:
        """The step's MoE layer: every expert on this rank, packed for the experts' kernel, routed
        here (no data-parallel dispatch), no shared expert, the router's row-major weight at hand."""
        router = router_weight(block)
        return (isinstance(block.experts, FusedExperts) and block.experts.packed and block.shared_expert is None
                and block.dispatch_starts is None and block.num_local_experts == block.num_experts
                and router is not None and router.dtype == dtype and block.experts.w13.dtype == dtype)

    def applies(self, meta: AttentionMetadata) -> bool:
        """Any step of at most `max_tokens` tokens."""
        return 0 < meta.num_tokens <= self.max_tokens

    def _call(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> int:
        bt = meta.block_table
        lora = getattr(meta, "lora", None)
        if lora is not None and self._lora is None:
            raise RuntimeError("a step with LoRA adapters on a packed step without the slot tables")
        return self.lib.packed_step(ctypes.addressof(self._model), x.shape[0], bt.shape[0], x.data_ptr(),
                                    positions.data_ptr(), meta.slot_mapping.data_ptr(),
                                    meta.query_start_loc.data_ptr(), meta.seq_lens.data_ptr(), bt.data_ptr(),
                                    bt.stride(0), ctypes.addressof(self._lora) if lora is not None else None,
                                    lora.token_slots.data_ptr() if lora is not None else None, out.data_ptr(),
                                    torch.get_num_threads())
