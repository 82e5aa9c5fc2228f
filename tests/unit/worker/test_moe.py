"""Mixture-of-experts models: routing, the fused experts' torch path (the Triton kernel is in
test_fused_moe_triton.py), loading both checkpoint layouts, and greedy token ids equal to HF
transformers for tiny random Qwen3-MoE (one dense layer among the MoE ones, renormalised
top-k), Qwen2-MoE (q/k/v biases, top-k not renormalised, a gated shared expert beside the routed
ones; its logits too), Mixtral (fp32 routing weights, `block_sparse_moe` names) and OLMoE
(whole-projection q/k norms, clipped q/k/v, top-k not renormalised): one rank under chunked prefill and
preemption, and two tensor-parallel ranks, with each expert's columns split or, with
`enable_expert_parallel`, the experts themselves (each rank runs its own on every token); and
two data-parallel engines as one expert-parallel group (tokens dispatched to their experts'
ranks by all-to-all, lockstep steps, dummy steps), with TP inside, and through a dead rank.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support.hf_reference import hf_greedy, load_hf_model

from services.common.sampling_params import SamplingParams
from services.offline.llm import LLM
from services.worker.models import moe
from services.worker.models.checkpoint_parts import take
from services.worker.models.load import load_model
from services.worker.models.moe import MoeSpec, SparseMoeBlock, grouped_experts, route
from services.worker.parallel import ExpertParallel, TensorParallel, expert_range

MOE_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
MAX_NEW_TOKENS = 24
BLOCK_SIZE = 16


def _per_token_reference(x, w13, w2, weights, ids) -> torch.Tensor:
    """The definition, one token and one slot at a time (fine for a test's few tokens)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in sorted(range(ids.shape[1]), key=lambda j: int(ids[t, j])):
            e = int(ids[t, j])
            if 0 <= e < w13.shape[0]:
                gate, up = (w13[e] @ x[t]).chunk(2)
                out[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def test_grouped_experts_equal_the_per_token_definition() -> None:
    """Ids outside [0, E) (experts held by another rank) add nothing; experts without tokens are skipped."""
    g = torch.Generator().manual_seed(0)
    num_tokens, top_k, experts, hidden, width = 37, 3, 6, 24, 10
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * width, hidden, generator=g) / 5
    w2 = torch.randn(experts, hidden, width, generator=g) / 5
    ids = torch.stack([torch.randperm(experts + 2, generator=g)[:top_k] - 1 for _ in range(num_tokens)])
    ids[ids == 4] = 5  # expert 4 gets no token
    weights = torch.rand(num_tokens, top_k, generator=g)
    got = grouped_experts(x, w13, w2, weights, ids)
    assert (ids == -1).any() and (ids == experts).any()
    torch.testing.assert_close(got, _per_token_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_route_softmax_top_k_and_renormalisation() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.5, 1.0, 0.0]])
    probs = torch.softmax(logits, -1)
    weights, ids = route(logits, 2, renormalize=False, weights_dtype=torch.float32)
    assert ids.tolist() == [[3, 2], [0, 2]]
    torch.testing.assert_close(weights[0], probs[0, [3, 2]])
    weights, _ = route(logits.bfloat16(), 2, renormalize=True, weights_dtype=torch.bfloat16)
    assert weights.dtype == torch.bfloat16
    torch.testing.assert_close(weights.float().sum(-1), torch.ones(2), atol=1e-2, rtol=0)


def test_a_block_loads_per_expert_and_stacked_checkpoints_alike() -> None:
    """HF's saved layout (experts.<e>.gate_proj/up_proj/down_proj) and transformers' in-memory
    stacked one (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) fill the same weights."""
    config = SimpleNamespace(hidden_size=8, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=4,
                             norm_topk_prob=True, hidden_act="silu")
    g = torch.Generator().manual_seed(1)
    gate, up, down = (torch.randn(3, 4, 8, generator=g), torch.randn(3, 4, 8, generator=g),
                      torch.randn(3, 8, 4, generator=g))
    per_expert, stacked = SparseMoeBlock(config, MoeSpec()), SparseMoeBlock(config, MoeSpec())
    keys = set()
    with torch.no_grad():
        for e in range(3):
            keys.update(per_expert.load(f"experts.{e}.gate_proj.weight", gate[e]))
            keys.update(per_expert.load(f"experts.{e}.up_proj.weight", up[e]))
            keys.update(per_expert.load(f"experts.{e}.down_proj.weight", down[e]))
        stacked_keys = set(stacked.load("experts.gate_up_proj", torch.cat((gate, up), dim=1)))
        stacked_keys |= set(stacked.load("experts.down_proj", down))
        with pytest.raises(KeyError, match="experts.3.gate_proj"):
            per_expert.load("experts.3.gate_proj.weight", gate[0])
    assert keys == stacked_keys == {f"experts.w13#{p}" for p in per_expert.pieces("experts.w13")} | {
        f"experts.w2#{p}" for p in per_expert.pieces("experts.w2")}
    assert torch.equal(per_expert.experts.w13, stacked.experts.w13)
    assert torch.equal(per_expert.experts.w2, stacked.experts.w2)
    assert torch.equal(per_expert.experts.w13[1, :4], gate[1]) and torch.equal(per_expert.experts.w13[1, 4:], up[1])


def test_experts_split_contiguously_the_first_ranks_taking_the_remainder() -> None:
    assert [expert_range(8, ExpertParallel(r, 2)) for r in range(2)] == [(0, 4), (4, 4)]
    assert [expert_range(10, ExpertParallel(r, 4)) for r in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]
    with pytest.raises(ValueError, match="at least as many experts"):
        expert_range(2, ExpertParallel(0, 4))


def test_an_expert_parallel_rank_holds_loads_and_runs_only_its_experts(monkeypatch) -> None:
    from services.worker import parallel

    monkeypatch.setattr(parallel, "_ep_state", ExpertParallel(1, 2))  # the second of two ranks
    config = SimpleNamespace(hidden_size=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4,
                             norm_topk_prob=False, hidden_act="silu")
    block = SparseMoeBlock(config, MoeSpec())
    assert (block.expert_start, block.num_local_experts, block.experts.w13.shape[0]) == (2, 2, 2)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        assert block.load("experts.0.gate_proj.weight", torch.randn(4, 8, generator=g)) == []  # rank 0's
        weight = torch.randn(4, 8, generator=g)
        assert block.load("experts.3.up_proj.weight", weight) == ["experts.w13#3.1"]
        assert torch.equal(block.experts.w13[1, 4:], weight)
        block.load("gate.weight", torch.randn(4, 8, generator=g))
        block.experts.w13.normal_(generator=g)
        block.experts.w2.normal_(generator=g)
    x = torch.randn(5, 8, generator=g)
    weights, ids = route(block.gate(x), 2, False, torch.float32)
    local = ids.clone()
    local[ids < 2] = -1  # rank 0's experts add nothing here
    want = grouped_experts(x, torch.cat((torch.zeros_like(block.experts.w13), block.experts.w13)),
                           torch.cat((torch.zeros_like(block.experts.w2), block.experts.w2)), weights, ids)
    torch.testing.assert_close(block(None, x), want)
    assert (local >= 2).any() and (local == -1).any()


def _qwen2_moe_block_config(**overrides) -> object:
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**{"hidden_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                             "moe_intermediate_size": 8, "shared_expert_intermediate_size": 16,
                             "norm_topk_prob": False, "initializer_range": 0.3, **overrides})


def _hf_qwen2_moe_block(config) -> torch.nn.Module:
    """HF's Qwen2-MoE block with random weights (the router and shared-expert gate too)."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    torch.manual_seed(3)
    block = Qwen2MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block


def _loaded_block(config, hf_block: torch.nn.Module) -> tuple[SparseMoeBlock, set[str]]:
    """Our block with HF's block's weights (its in-memory names: experts stacked), each cut to
    the part the block takes of it; the keys filled."""
    block = SparseMoeBlock(config, MoeSpec(shared_expert=True))
    keys = set()
    with torch.no_grad():
        for name, tensor in hf_block.state_dict().items():
            keys.update(block.load(name, take(tensor, block.part(name, tensor.shape))))
    return block, keys


def test_a_shared_expert_adds_its_gated_output_to_the_routed_experts_as_hf() -> None:
    """sigmoid(shared_expert_gate(x)) * shared_expert(x) + the routed sum, every parameter
    loaded (the shared expert's gate/up fused as the dense MLP's), HF's output in fp32."""
    config = _qwen2_moe_block_config()
    hf_block = _hf_qwen2_moe_block(config)
    block, keys = _loaded_block(config, hf_block)
    want_keys = {f"{name}#{piece}" for name, _ in block.named_parameters() for piece in block.pieces(name)}
    assert keys == want_keys and "shared_expert.gate_up_proj.weight#1" in keys
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf_block(x[None])[0]
        routed_only = hf_block.experts(x, *reversed(hf_block.gate(x)[1:]))
        torch.testing.assert_close(block(None, x), want, rtol=1e-6, atol=1e-6)
    assert (want - routed_only).abs().max() > 0.1  # the shared expert counts


def test_tensor_parallel_ranks_split_the_shared_expert_and_their_partial_outputs_sum_to_the_whole(
        monkeypatch) -> None:
    """Two TP ranks: each holds its half of the routed experts' and of the shared expert's columns
    (the gate whole) and returns its partial output before the all-reduce (here the identity), so
    the two partials sum to the whole block's output: the reduce covers the shared expert once."""
    from services.worker import parallel

    config = _qwen2_moe_block_config()
    hf_block = _hf_qwen2_moe_block(config)
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = _loaded_block(config, hf_block)[0](None, x)
        monkeypatch.setattr(moe, "all_reduce", lambda y: y)
        partials = []
        for rank in range(2):
            monkeypatch.setattr(parallel, "_state", TensorParallel(rank, 2))
            block, _ = _loaded_block(config, hf_block)
            shared = block.shared_expert
            assert (shared.intermediate_start, shared.intermediate_size, shared.partial) == (8 * rank, 8, True)
            down = hf_block.shared_expert.down_proj.weight
            assert torch.equal(shared.down_proj.weight, down[:, 8 * rank:8 * rank + 8])
            partials.append(block(None, x))
    torch.testing.assert_close(partials[0] + partials[1], whole, rtol=1e-5, atol=1e-5)


def test_an_expert_parallel_rank_holds_the_whole_shared_expert(monkeypatch) -> None:
    from services.worker import parallel

    monkeypatch.setattr(parallel, "_ep_state", ExpertParallel(1, 2))
    monkeypatch.setattr(parallel, "_state", TensorParallel(1, 2))
    block = SparseMoeBlock(_qwen2_moe_block_config(), MoeSpec(shared_expert=True))
    shared = block.shared_expert
    assert (shared.intermediate_start, shared.intermediate_size, shared.partial) == (0, 16, False)
    assert block.intermediate_size == 8 and block.num_local_experts == 2


def _prefill_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Every position's logits of one prompt, prefilled through the torch attention backend."""
    from services.worker.attention.base import AttentionMetadata, forward_context
    from services.worker.attention.torch_backend import TorchAttentionBackend

    n, block = ids.shape[0], BLOCK_SIZE
    num_blocks = -(-n // block)
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(2, num_blocks + 1, block, layer.num_kv_heads, layer.head_dim)
    table = np.arange(1, num_blocks + 1, dtype=np.int32)[None]
    slots = table[0, np.arange(n) // block].astype(np.int64) * block + np.arange(n) % block
    seq = np.array([n])
    meta = AttentionMetadata.from_host(slots, np.array([0, n]), seq, np.zeros_like(seq), table, block, "cpu")
    backend = TorchAttentionBackend()
    meta.backend_data = backend.prepare(meta)
    with torch.inference_mode(), forward_context(backend, meta):
        return model.compute_logits(model(ids, torch.arange(n)))


def test_qwen2_moe_logits_equal_hf_in_fp32(tiny_model_dir) -> None:
    """Every position of a 150-token prompt: the layers' torch ops give HF's logits to fp32
    rounding; with the CPU fast paths (packed linear layers, the experts' C kernel, the fused
    elementwise ops) too, within their other order of sums."""
    from services.worker.models.fast_paths import pack_for_cpu, use_cpu_moe, use_fused_ops

    model_dir = tiny_model_dir("qwen2_moe")
    ids = torch.tensor(_prompts()[3])
    with torch.inference_mode():
        want = load_hf_model(model_dir)(input_ids=ids[None]).logits[0].float()
    model, _ = load_model(model_dir, torch.float32, torch.device("cpu"))
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["SparseMoeBlock", "MLP", "SparseMoeBlock"]
    torch.testing.assert_close(_prefill_logits(model, ids), want, rtol=1e-5, atol=1e-4)
    pack_for_cpu(model)
    use_cpu_moe(model)
    use_fused_ops(model)
    torch.testing.assert_close(_prefill_logits(model, ids), want, rtol=1e-4, atol=1e-3)


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 7, 40, 150, 17, 300, 64, 96)]


def _greedy(model_dir: str, prompts: list[list[int]], **engine_args) -> tuple[list[list[int]], dict]:
    llm = LLM(model_dir, dtype="float32", seed=0, block_size=BLOCK_SIZE, **engine_args)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], llm.stats()
    finally:
        llm.close()


@pytest.fixture(scope="module")
def moe_reference(tiny_model_dir) -> dict[str, tuple[str, list[list[int]]]]:
    """arch -> (checkpoint dir, HF's greedy continuations of `_prompts()`), computed once."""
    return {arch: (tiny_model_dir(arch), hf_greedy(tiny_model_dir(arch), _prompts(), MAX_NEW_TOKENS))
            for arch in MOE_ARCHS}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_greedy_equals_hf_under_chunked_prefill_and_preemption(moe_reference, arch: str) -> None:
    model_dir, want = moe_reference[arch]
    prompts = _prompts()
    # Every request fits alone, not all together: the later ones are preempted as they grow.
    need = sum(-(-(len(p) + MAX_NEW_TOKENS) // BLOCK_SIZE) for p in prompts)
    got, stats = _greedy(model_dir, prompts, max_num_batched_tokens=32, num_gpu_blocks_override=need * 2 // 3)
    assert got == want
    assert stats["num_preemptions"] > 0, stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["columns", "experts"])
def test_moe_tensor_parallel_greedy_equals_hf(moe_reference, arch: str, expert_parallel: bool) -> None:
    model_dir, want = moe_reference[arch]
    got, stats = _greedy(model_dir, _prompts(), tensor_parallel_size=2, max_num_batched_tokens=64,
                         enable_expert_parallel=expert_parallel)
    assert got == want
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_data_parallel_expert_parallel_greedy_equals_hf(moe_reference, arch: str) -> None:
    """Two engines as one expert-parallel group (each holds half of the experts; its tokens go to
    the other's experts and back), under chunked prefill and preemption: HF's tokens, every
    block of both engines free afterwards. The last request leaves one engine idle while the
    other still works: the idle one runs dummy steps."""
    model_dir, want = moe_reference[arch]
    prompts = _prompts()
    need = sum(-(-(len(p) + MAX_NEW_TOKENS) // BLOCK_SIZE) for p in prompts)
    llm = LLM(model_dir, dtype="float32", seed=0, block_size=BLOCK_SIZE, data_parallel_size=2,
              enable_expert_parallel=True, max_num_batched_tokens=32, num_gpu_blocks_override=need // 2)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        stats = llm.stats()  # (summed over the engines)
        assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
        assert stats["num_preemptions"] > 0 and stats["num_dummy_steps"] > 0, stats
        assert [e.num_steps > 0 for e in llm.engines] == [True, True]
        # One more request: engine 0 takes it, engine 1 only runs dummy steps.
        dummies = llm.engines[1].num_dummy_steps
        out = llm.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == want[1]
        assert llm.engines[1].num_dummy_steps - dummies >= MAX_NEW_TOKENS
    finally:
        llm.close()


def test_moe_data_parallel_group_survives_a_dead_rank(tiny_model_dir) -> None:
    """Engine 1's rank dies mid-call: engine 0's rank, waiting in an exchange with it, fails too
    (gloo notices the closed connection), the call raises EngineFault, and the whole group is set
    up again: the next call gives the same tokens, every block free."""
    import os
    import signal
    import threading

    from services.offline.llm import EngineFault

    llm = LLM(tiny_model_dir("qwen3_moe"), dtype="float32", seed=0, data_parallel_size=2, enable_expert_parallel=True,
              kv_cache_memory_bytes=32 << 20)
    try:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in _prompts()[:4]]
        want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        child = llm._groups[1].children[0].proc
        killer = threading.Timer(1.0, os.kill, (child.pid, signal.SIGKILL))
        killer.start()
        long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
        with pytest.raises(EngineFault, match="engine step failed"):
            llm.generate(prompts, long, use_tqdm=False)
        killer.join()
        assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == want
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    finally:
        llm.close()


def test_moe_data_parallel_with_tensor_parallel_inside_greedy_equals_hf(moe_reference) -> None:
    """Two engines of two TP ranks each, all four ranks one expert-parallel group (each TP rank of
    an engine sends a half of its tokens' pairs, the halves are gathered back): HF's tokens."""
    model_dir, want = moe_reference["qwen3_moe"]
    got, stats = _greedy(model_dir, _prompts(), data_parallel_size=2, tensor_parallel_size=2,
                         enable_expert_parallel=True, max_num_batched_tokens=64)
    assert got == want
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
