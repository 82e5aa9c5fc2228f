"""Mixture-of-experts GGUF checkpoints with their experts kept in blocks (quant/experts.py): tiny
Qwen3-MoE (qwen3moe, one dense layer among the MoE ones), Qwen2-MoE (qwen2moe, the same layout plus
a shared expert in blocks like a dense MLP) and Mixtral (a llama file with experts, its experts'
down projection left F32 beside Q4_0 gate and Q4_1 up) load the weights of their
dequantized HF twins, compute as the dense experts on those weights (on the kernels' exact fp32
products, and on their int8 activations as a per-token reference on the same activations), an
expert-parallel rank takes only its experts' blocks and a tensor-parallel split off block
boundaries is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from support.gguf_fixtures import GGUF_ARCHS, write_quantized_pair

from services.worker.models.load import load_model
from services.worker.models.moe import SparseMoeBlock, grouped_experts, route
from services.worker.parallel import ExpertParallel
from services.worker.quant import kernels
from services.worker.quant.experts import QuantExperts
from services.worker.quant.gguf_model import QuantTensor
from services.worker.quant.linear import QuantLinear
from services.worker.quant.ops import dequantize_part

MOE_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]


@pytest.fixture(scope="module")
def moe_pairs(tiny_model_dir, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """(gguf path, dequantized twin) per arch, written once."""
    pairs = {}
    for arch in MOE_ARCHS:
        out = tmp_path_factory.mktemp(f"gguf-{arch}")
        pairs[arch] = write_quantized_pair(tiny_model_dir(arch), GGUF_ARCHS[arch], out)
    return pairs


@pytest.fixture(scope="module")
def loaded(moe_pairs) -> dict[str, tuple]:
    """(quantized model, twin model, config) per arch."""
    out = {}
    for arch, (gguf_path, twin_dir) in moe_pairs.items():
        model, config = load_model(gguf_path, torch.float32, torch.device("cpu"))
        twin, _ = load_model(twin_dir, torch.float32, torch.device("cpu"))
        out[arch] = model, twin, config
    return out


def _moe_layers(model) -> list[int]:
    return [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoeBlock)]


def _dense(weights) -> torch.Tensor:
    return torch.cat([dequantize_part(q, rows) for q, rows in weights.parts()])


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_a_tiny_moe_gguf_keeps_its_experts_in_blocks_with_its_twins_weights(arch: str, loaded) -> None:
    model, twin, config = loaded[arch]
    assert type(model) is type(twin) and _moe_layers(model) == _moe_layers(twin)
    if arch in ("qwen3_moe", "qwen2_moe"):
        assert config.mlp_only_layers == [1] and config.moe_intermediate_size == 32 and _moe_layers(model) == [0, 2]
    if arch == "qwen2_moe":  # the shared expert in blocks like a dense MLP, its gate dense
        assert config.shared_expert_intermediate_size == 96 and not config.norm_topk_prob
        for i in _moe_layers(model):
            shared, dense = model.layers[i].mlp.shared_expert, twin.layers[i].mlp.shared_expert
            assert isinstance(shared.gate_up_proj, QuantLinear) and isinstance(shared.down_proj, QuantLinear)
            assert shared.gate_up_proj.qtypes == [int(Q.Q4_0), int(Q.Q4_1)] and shared.down_proj.qtypes == [int(Q.Q8_0)]
            assert torch.equal(_dense(shared.gate_up_proj), dense.gate_up_proj.weight)
            assert torch.equal(_dense(shared.down_proj), dense.down_proj.weight)
            assert type(model.layers[i].mlp.shared_expert_gate) is torch.nn.Linear
    for i in _moe_layers(model):
        experts, dense = model.layers[i].mlp.experts, twin.layers[i].mlp.experts
        assert isinstance(experts, QuantExperts) and experts.num_experts == 8
        for e in range(8):
            assert experts.gate_up[e].qtypes == [int(Q.Q4_0), int(Q.Q4_1)]  # gate, then up
            # Mixtral's 48-wide down rows are not whole blocks: a dense part.
            assert experts.down[e].qtypes == [int(Q.F32 if arch == "mixtral" else Q.Q8_0)]
            assert torch.equal(_dense(experts.gate_up[e]), dense.w13[e]), (i, e)
            assert torch.equal(_dense(experts.down[e]), dense.w2[e]), (i, e)
    twin_params = dict(twin.named_parameters())
    for name, param in model.named_parameters():  # routers, norms, the dense layer: as loaded
        assert torch.equal(param, twin_params[name]), name
    assert not any(".experts." in name for name, _ in model.named_parameters())


def _int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels' integer path reads it (quant_q8.h): per 32 values, dx = max |x| / (127 *
    254) and x ~ dx * (254 hi + lo), hi = round(x / (254 dx)), lo the remainder rounded to the
    nearest in [-127, 127] (ties to even)."""
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    dx, dh = amax / (127 * 254), amax / 127
    hi = torch.round(blocks * torch.where(dh == 0, torch.zeros_like(dh), 1 / dh))
    lo = torch.round((blocks - dx * (254 * hi)) * torch.where(dx == 0, torch.zeros_like(dx), 1 / dx)).clamp(-127, 127)
    return (dx * (254 * hi + lo)).reshape(x.shape)


def _int8_product(x: torch.Tensor, weights) -> torch.Tensor:
    """x [K] times a QuantWeights' dequantized rows as the integer path sums them: Q4_0, Q4_1 (its
    offsets too, quant_q8.h) and Q8_0 on the quantized x, a dense part on x itself."""
    outs = []
    for qtype, rows in weights.parts():
        w = dequantize_part(qtype, rows)
        outs.append(w @ (_int8_activations(x) if qtype in (int(Q.Q4_0), int(Q.Q4_1), int(Q.Q8_0)) else x))
    return torch.cat(outs)


def _int8_mlp(x: torch.Tensor, gate_up, down) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for one token, each product as the integer path sums it."""
    gate, up = _int8_product(x, gate_up).chunk(2)
    return _int8_product(torch.nn.functional.silu(gate) * up, down)


def _int8_reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """`block`'s quantized experts (and shared expert), one token and slot at a time, on int8
    activations as the kernels take them."""
    weights, ids = route(block.gate(x), block.top_k, block.renormalize, torch.float32)
    experts = block.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in sorted(range(ids.shape[1]), key=lambda j: int(ids[t, j])):
            e = int(ids[t, j])
            out[t] += weights[t, j] * _int8_mlp(x[t], experts.gate_up[e], experts.down[e])
    if block.shared_expert is not None:
        shared = block.shared_expert
        for t in range(x.shape[0]):
            gated = torch.sigmoid(block.shared_expert_gate(x[t]))
            out[t] += gated * _int8_mlp(x[t], shared.gate_up_proj, shared.down_proj)
    return out


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("num_tokens", [3, 37])
def test_quantized_experts_compute_as_the_dense_experts_on_the_same_weights(arch: str, num_tokens: int, loaded,
                                                                            monkeypatch) -> None:
    """The same routing, grouping and order of sums: on the kernels' exact fp32 products the two
    agree to fp32 rounding; on their int8 activations, with a per-token reference that takes the
    same int8 activations (the products then differ by fp32 rounding only)."""
    model, twin, _ = loaded[arch]
    x = torch.randn(num_tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(num_tokens))
    gemm = kernels.QuantGemm.load()
    int8_path = gemm is not None and all(gemm.has_int8_dot(q) for q in (Q.Q4_0, Q.Q4_1, Q.Q8_0))
    for i in _moe_layers(model):
        want = twin.layers[i].mlp(None, x)
        monkeypatch.setattr(kernels, "INT8_DOT", False)
        torch.testing.assert_close(model.layers[i].mlp(None, x), want, rtol=1e-5, atol=1e-5)
        monkeypatch.setattr(kernels, "INT8_DOT", True)
        if int8_path:
            want = _int8_reference(model.layers[i].mlp, x)
        # The kernels' and the reference's activations (products of their own fp32 sums) can round to
        # adjacent int8 steps: a step moves an output by ~1e-4 here. A shared expert's output, not
        # scaled down by a routing weight below 1, shows a few such steps (up to ~2.2e-4 observed).
        tolerance = 3e-4 if model.layers[i].mlp.shared_expert is not None else 1e-4
        torch.testing.assert_close(model.layers[i].mlp(None, x), want, rtol=tolerance, atol=tolerance)


def test_an_expert_parallel_rank_loads_and_runs_only_its_experts_blocks(moe_pairs, loaded, monkeypatch) -> None:
    from services.worker import parallel

    monkeypatch.setattr(kernels, "INT8_DOT", False)
    _, twin, _ = loaded["qwen3_moe"]
    monkeypatch.setattr(parallel, "_ep_state", ExpertParallel(1, 2))  # the second of two ranks
    model, _ = load_model(moe_pairs["qwen3_moe"][0], torch.float32, torch.device("cpu"))
    block, dense = model.layers[0].mlp, twin.layers[0].mlp
    experts = block.experts
    assert (block.expert_start, experts.num_experts, len(experts.gate_up)) == (4, 4, 4)
    for local in range(4):
        assert torch.equal(_dense(experts.gate_up[local]), dense.experts.w13[4 + local])
        assert torch.equal(_dense(experts.down[local]), dense.experts.w2[4 + local])
    x = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    weights, ids = route(dense.gate(x), dense.top_k, dense.renormalize, torch.float32)
    w13, w2 = dense.experts.w13.detach().clone(), dense.experts.w2.detach().clone()
    w13[:4], w2[:4] = 0, 0  # rank 0's experts add nothing here
    assert (ids < 4).any() and (ids >= 4).any()
    torch.testing.assert_close(block(None, x), grouped_experts(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_quantized_experts_skip_ids_outside_their_range_and_experts_without_tokens(monkeypatch) -> None:
    from gguf.quants import quantize

    monkeypatch.setattr(kernels, "INT8_DOT", False)
    g = torch.Generator().manual_seed(5)
    experts = QuantExperts(3, 32, 32)
    w13, w2 = torch.randn(3, 64, 32, generator=g), torch.randn(3, 32, 32, generator=g)
    for e in range(3):
        experts.gate_up[e].set_parts([(int(Q.F32), w13[e])])
        experts.down[e].set_parts([(int(Q.Q8_0), torch.from_numpy(quantize(w2[e].numpy(), Q.Q8_0)))])
    w2 = torch.stack([_dense(experts.down[e]) for e in range(3)])
    x = torch.randn(6, 32, generator=g)
    ids = torch.tensor([[0, -1], [3, 0], [2, 0], [-1, 3], [2, 0], [0, 2]])  # expert 1 gets no token
    weights = torch.rand(6, 2, generator=g)
    torch.testing.assert_close(experts(x, weights, ids), grouped_experts(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)
    assert experts.empty_input().shape == (0, 32)


def test_a_tensor_parallel_split_of_the_experts_slices_rows_and_refuses_inputs_off_block_boundaries(
        monkeypatch) -> None:
    from services.worker.models import quant_loader

    monkeypatch.setattr(quant_loader, "get_tp", lambda: SimpleNamespace(size=2))
    raw = torch.arange(64 * 2 * 34, dtype=torch.int32).to(torch.uint8).reshape(64, 2 * 34)  # Q8_0, 64 inputs
    half = SimpleNamespace(intermediate_start=32, intermediate_size=32)
    down = QuantTensor(raw, int(Q.Q8_0), (64, 64))
    qtype, inputs = quant_loader._expert_part(half, "x", None, down, torch.device("cpu"))
    assert qtype == int(Q.Q8_0) and torch.equal(inputs, raw[:, 34:])  # the second block of inputs
    _, rows = quant_loader._expert_part(half, "x", 0, down, torch.device("cpu"))  # as a gate: rows 32..63
    assert torch.equal(rows, raw[32:])
    quarter = SimpleNamespace(intermediate_start=16, intermediate_size=16)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 .*Q8_0 block boundaries"):
        quant_loader._expert_part(quarter, "layers.0.mlp.experts.0.down_proj.weight", None, down,
                                  torch.device("cpu"))


def test_a_qwen2_moe_gguf_reads_its_shared_expert_under_hf_names_and_loads(tmp_path) -> None:
    """qwen2moe files name their shared expert (ffn_*_shexp) as HF does, its gate a [1, hidden]
    weight, and their config gets the experts' widths; the model loads with every layer's
    shared expert (this file: every layer sparse, no dense MLP)."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    from services.worker.quant.gguf_model import GgufCheckpoint

    config = Qwen2MoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(tmp_path / "hf"))
    gguf_path, _ = write_quantized_pair(str(tmp_path / "hf"), GGUF_ARCHS["qwen2_moe"], tmp_path)
    checkpoint = GgufCheckpoint(gguf_path)
    read = checkpoint.config
    assert (read.moe_intermediate_size, read.shared_expert_intermediate_size, read.mlp_only_layers) == (32, 64, [])
    tensors = dict(checkpoint.tensors())
    assert {"model.layers.1.mlp.shared_expert.down_proj.weight", "model.layers.1.mlp.gate.weight",
            "model.layers.1.mlp.experts.3.up_proj.weight"} <= set(tensors)
    assert tensors["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, 64)
    model, _ = load_model(gguf_path, torch.float32, torch.device("cpu"))
    assert _moe_layers(model) == [0, 1]
    assert all(isinstance(model.layers[i].mlp.shared_expert.down_proj, QuantLinear) for i in (0, 1))


def test_a_quantized_router_loads_dense(tiny_model_dir, tmp_path) -> None:
    """llama.cpp keeps routers in F32, but a file may not: its blocks are dequantized at load (the
    routing reads every row for every token)."""
    qtypes = {kind: Q.Q8_0 for kind in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
    gguf_path, twin_dir = write_quantized_pair(tiny_model_dir("qwen3_moe"), "qwen3moe", tmp_path, qtypes)
    model, _ = load_model(gguf_path, torch.float32, torch.device("cpu"))
    twin, _ = load_model(twin_dir, torch.float32, torch.device("cpu"))
    router = model.layers[0].mlp.gate
    assert type(router) is torch.nn.Linear and torch.equal(router.weight, twin.layers[0].mlp.gate.weight)
    assert isinstance(model.layers[0].mlp.experts, QuantExperts)
    assert model.layers[0].mlp.experts.gate_up[0].qtypes == [int(Q.Q8_0)]
