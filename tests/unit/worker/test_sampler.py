"""The sampler against an independent numpy reference, its draws against their distributions,
and the OpenAI / vLLM sampling parameters through the real engine (SmolLM2-135M).

Unit part (no model): a persistent `InputBatch` holds prompts and generated tokens; the
`Sampler`'s processed distributions (`processed_logprobs`) must equal a plain numpy
re-implementation of bad words → logit_bias → min_tokens → repetition / frequency /
presence penalties → temperature → min_p → top_k → top_p, over every way a random row can
go (top_k candidates, top_p prefilter and its fallback, full sort, plain temperature).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from services.common.proto import myvllm_pb2 as pb
from services.offline import LLM, SamplingParams
from services.worker.exponential import exponential_, exponential_like
from services.worker.input_batch import InputBatch
from services.worker.logits_processors import apply_processors
from services.worker.sampler import Sampler, greedy_ids
from services.worker.sampling_metadata import build_sampling_metadata

V = 50
EOS = 2
MAX_ROWS = 16
MAX_LEN = 64


# --------------------------------------------------------------------------- numpy reference


def _softmax(x: np.ndarray) -> np.ndarray:
    finite = np.isfinite(x)
    e = np.where(finite, np.exp(x - x[finite].max()), 0.0)
    return e / e.sum()


def ref_processed(logits: np.ndarray, sp: pb.SamplingParams, prompt: list[int], outputs: list[int],
                  eos_ids: list[int]) -> tuple[bool, np.ndarray]:
    """(greedy?, distribution): greedy rows → softmax of the processed logits; random rows → the
    final distribution after temperature, min_p, top_k and top_p. All in float64, token by token."""
    x = logits.astype(np.float64).copy()
    # bad words: a word bans its last token when the generated tokens end with its prefix
    for word in sp.bad_words:
        ids = list(word.ids)
        prefix = ids[:-1]
        if len(outputs) >= len(prefix) and (not prefix or outputs[-len(prefix):] == prefix):
            x[ids[-1]] = -np.inf
    for tok, bias in sp.logit_bias.items():
        x[tok] += bias
    if len(outputs) < sp.min_tokens:
        stops = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(eos_ids))
        for tok in stops:
            x[tok] = -np.inf
    rep = sp.repetition_penalty or 1.0
    if rep != 1.0:
        for tok in set(prompt) | set(outputs):
            x[tok] = x[tok] / rep if x[tok] > 0 else x[tok] * rep
    counts = np.bincount(np.asarray(outputs, dtype=np.int64), minlength=V).astype(np.float64)
    x -= sp.frequency_penalty * counts
    x -= sp.presence_penalty * (counts > 0)
    if sp.temperature < 1e-5 or sp.top_k == 1:
        return True, _softmax(x)
    x = x / sp.temperature
    p = _softmax(x)
    if sp.min_p > 0:
        p[p < p.max() * sp.min_p] = 0.0
        p /= p.sum()
    if 0 < sp.top_k < V:
        kth = np.sort(p)[::-1][sp.top_k - 1]
        p[p < kth] = 0.0
        p /= p.sum()
    if 0 < sp.top_p < 1:
        order = np.argsort(-p, kind="stable")
        above = np.cumsum(p[order]) - p[order]  # mass strictly more likely than each token
        drop = order[above >= sp.top_p]
        p[drop] = 0.0
        p /= p.sum()
    return False, p


# --------------------------------------------------------------------------- batch helpers


def _sp(**kw) -> pb.SamplingParams:
    bad = kw.pop("bad_words", [])
    base = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0,
                frequency_penalty=0.0, presence_penalty=0.0, max_tokens=100, logprobs=-1)
    base.update(kw)
    seed = base.pop("seed", None)
    msg = pb.SamplingParams(**base, bad_words=[pb.TokenIds(ids=w) for w in bad])
    if seed is not None:
        msg.seed = seed
    return msg


class Bench:
    """A persistent batch + sampler, with requests in scrambled rows and sampled in scrambled order."""

    def __init__(self, specs, max_top_k: int = 8, top_p_prefilter: int = 6, allow_sync: bool | None = None) -> None:
        self.batch = InputBatch(MAX_ROWS, MAX_LEN, 4, seed=0)
        self.sampler = Sampler(max_num_reqs=MAX_ROWS, vocab_size=V, device="cpu")
        # fillers take some rows first, then leave: the real requests land in non-trivial rows
        for i in range(5):
            self._add(f"filler{i}", _sp(temperature=0.0, repetition_penalty=1.5), [7, 7, 8], [9])
        for i in (0, 2, 3):
            self.batch.remove(f"filler{i}")
        self.specs = specs
        self.rows = np.array([self._add(f"req{i}", sp, prompt, outputs)
                              for i, (sp, prompt, outputs) in enumerate(specs)], dtype=np.int64)
        self.max_top_k, self.top_p_prefilter, self.allow_sync = max_top_k, top_p_prefilter, allow_sync
        self.md = self._metadata()

    def _add(self, rid, sp, prompt, outputs) -> int:
        data = pb.NewRequestData(request_id=rid, prompt_token_ids=prompt, sampling=sp,
                                 output_token_ids=outputs, num_computed_tokens=0)
        row = self.batch.add(data)
        self.sampler.add_requests([row], [data])
        return row

    def _metadata(self):
        gens = {i: self.batch.generators[r] for i, r in enumerate(self.rows.tolist()) if r in self.batch.generators}
        return build_sampling_metadata([self.batch.sampling[r] for r in self.rows], gens, V, "cpu",
                                       rows=self.rows, history=self.batch, eos_token_ids=[EOS],
                                       penalty_state=self.sampler.penalty_state, max_top_k=self.max_top_k,
                                       top_p_prefilter=self.top_p_prefilter, allow_sync=self.allow_sync)

    def history(self, i: int) -> tuple[list[int], list[int]]:
        r = self.rows[i]
        n, p = self.batch.num_tokens[r], self.batch.num_prompt_tokens[r]
        return self.batch.token_ids[r, :p].tolist(), self.batch.token_ids[r, p:n].tolist()

    def step(self, logits: torch.Tensor) -> torch.Tensor:
        sampled, _ = self.sampler(logits.clone(), self.md)  # the sampler may overwrite its logits
        self.batch.append_tokens(self.rows, sampled.numpy().astype(np.int32))
        return sampled


def _random_logits(n: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * scale


def _mixed_specs():
    rng = np.random.default_rng(0)

    def toks(n):
        return rng.integers(3, 30, size=n).tolist()  # small id range: plenty of repeats

    return [
        # greedy, repetition penalty and bias
        (_sp(temperature=0.0, repetition_penalty=1.3, logit_bias={5: 3.0, 7: -2.0}), toks(10), toks(6)),
        # candidates (top_k 5 <= max_top_k 8) + min_p + frequency
        (_sp(temperature=0.7, top_k=5, min_p=0.25, frequency_penalty=0.5), toks(8), toks(12)),
        # top_p only → prefilter; presence
        (_sp(temperature=1.2, top_p=0.5, presence_penalty=0.7), toks(5), toks(9)),
        # top_k 20 > max_top_k → full sort with top_k and top_p
        (_sp(temperature=0.9, top_k=20, top_p=0.9), toks(7), toks(3)),
        # min_p, bad words (one banned always, two matching the generated tail, one not), min_tokens (EOS)
        (_sp(temperature=1.0, min_p=0.1, min_tokens=30,
             bad_words=[[3], [14, 12], [13, 14, 15], [16, 17], [40, 41, 42, 43]]), toks(6), toks(4) + [16, 13, 14]),
        # seeded; top_p (flat logits: the prefilter falls back to the sort); min_tokens already met
        (_sp(temperature=0.5, top_p=0.95, seed=7, min_tokens=2, bad_words=[[20, 21]]), toks(4), toks(5)),
        # everything at once; min_tokens with ignore_eos bans only the stop token
        (_sp(temperature=1.0, top_k=6, top_p=0.85, min_p=0.2, repetition_penalty=1.2, frequency_penalty=0.3,
             presence_penalty=0.4, logit_bias={9: 5.0, EOS: 4.0}, stop_token_ids=[4], min_tokens=10,
             ignore_eos=True, seed=11), toks(9), toks(7)),
        # top_k 1 is greedy too; negative presence; a 1-token bad word
        (_sp(temperature=1.0, top_k=1, presence_penalty=-0.5, bad_words=[[1]]), toks(3), toks(8)),
        # plain temperature (full, nothing to sort)
        (_sp(temperature=1.3), toks(5), toks(2)),
        # top_k 12 > max_top_k without top_p → full, topk threshold; no output yet, so the bad
        # word whose prefix ends the prompt bans nothing
        (_sp(temperature=0.8, top_k=12, seed=3, bad_words=[[45, 44]]), toks(4) + [45], []),
        # frequency vs presence on repeated outputs, over the whole vocabulary
        (_sp(temperature=1.0, frequency_penalty=0.8, presence_penalty=0.3), toks(4), [5, 5, 5, 6, 7, 7]),
        # min_tokens reached after one step; bad words match generated tokens only, never the prompt
        (_sp(temperature=0.9, min_tokens=3, bad_words=[[9, 46]]), toks(4), [8, 9]),
        # candidates: min_p cuts, then top_p on the renormalised rest
        (_sp(temperature=1.5, top_k=8, min_p=0.15, top_p=0.7), toks(3), toks(3)),
    ]


def _check_processed(bench: Bench, logits: torch.Tensor) -> None:
    got = bench.sampler.processed_logprobs(logits, bench.md).exp().double().numpy()
    for i, (sp, _, _) in enumerate(bench.specs):
        prompt, outputs = bench.history(i)
        _, want = ref_processed(logits[i].numpy(), sp, prompt, outputs, [EOS])
        assert np.array_equal(got[i] > 0, want > 0), f"row {i}: kept tokens differ"
        np.testing.assert_allclose(got[i], want, atol=2e-6, rtol=1e-4, err_msg=f"row {i}")


# --------------------------------------------------------------------------- unit tests


@pytest.mark.parametrize("allow_sync", [True, False], ids=["cpu-paths", "dense-paths"])
def test_processed_distributions_match_numpy_reference(allow_sync: bool) -> None:
    """cpu-paths: top_p prefilter and sparse penalties; dense-paths: what an accelerator runs."""
    specs = _mixed_specs()
    bench = Bench(specs, allow_sync=allow_sync)
    kinds = sorted(g.kind for g in bench.md.groups)
    # full: with and without a sort
    assert kinds == ["candidates", "full", "full"] + (["prefilter"] if allow_sync else [])
    for step in range(4):
        logits = _random_logits(len(specs), seed=step)
        logits[5] *= 0.05  # flat: row 5's nucleus is not inside its 6 prefilter candidates
        _check_processed(bench, logits)
        sampled = bench.step(logits)
        # every sampled token has positive probability under its row's reference distribution
        for i, (sp, _, _) in enumerate(specs):
            prompt, outputs = bench.history(i)
            greedy, want = ref_processed(logits[i].numpy(), sp, prompt, outputs[:-1], [EOS])
            tok = int(sampled[i])
            assert outputs[-1] == tok
            if greedy:
                assert tok == int(np.argmax(want)), f"row {i} step {step}"
            else:
                assert want[tok] > 0, f"row {i} step {step}: sampled a cut token"
    # the incrementally maintained counts equal the outputs' histogram (penalty rows)
    counts = bench.sampler.penalty_state.output_counts
    for i, (sp, _, _) in enumerate(specs):
        if sp.repetition_penalty != 1 or sp.frequency_penalty or sp.presence_penalty:
            _, outputs = bench.history(i)
            assert counts[bench.rows[i]].tolist() == np.bincount(outputs, minlength=V).tolist()


def test_bad_words_and_min_tokens_masks() -> None:
    bench = Bench(_mixed_specs())
    lp = bench.sampler.processed_logprobs(torch.zeros(len(bench.specs), V), bench.md)
    row = lp[4]
    assert torch.isinf(row[[3, 12, 15, EOS]]).all()      # always / prefix 14 / prefix 13 14 / min_tokens
    assert torch.isfinite(row[[17, 43]]).all()           # the tail ends 16 13 14: [16, 17] no longer matches
    assert torch.isinf(lp[6, 4]) and torch.isfinite(lp[6, EOS])  # ignore_eos: only the stop token
    assert torch.isfinite(lp[5, [21, EOS]]).all()         # min_tokens met, [20, 21] not matching
    assert torch.isinf(lp[7, 1])
    assert torch.isinf(lp[11, [46, EOS]]).all()
    assert torch.isfinite(lp[9, 44])  # 45 ends the prompt, not the (empty) output


def test_stages_skipped_for_plain_greedy_batch() -> None:
    specs = [(_sp(temperature=0.0), [5, 6], [7]) for _ in range(4)]
    bench = Bench(specs)
    md = bench.md
    assert md.all_greedy and not md.needs_processing and not md.groups
    logits = _random_logits(4, seed=1)
    assert apply_processors(logits, md) is logits
    sampled, logprobs = bench.sampler(logits, md)
    assert logprobs is None
    assert sampled.tolist() == logits.argmax(-1).tolist()


def test_top_k_one_and_temperature_zero_are_greedy() -> None:
    logits = _random_logits(6, seed=5)
    specs = [(_sp(temperature=0.0), [5], []), (_sp(temperature=0.8, top_k=1), [5], []),
             (_sp(temperature=1e-6), [5], []), (_sp(temperature=0.0, top_p=0.3, top_k=4), [5], []),
             (_sp(temperature=2.0, top_k=1, seed=4), [5], []), (_sp(temperature=0.0, seed=9), [5], [])]
    bench = Bench(specs)
    assert bench.md.all_greedy
    for _ in range(3):
        assert bench.sampler(logits, bench.md)[0].tolist() == logits.argmax(-1).tolist()


def test_logprobs_come_from_raw_logits() -> None:
    specs = [(_sp(temperature=0.0, logprobs=3, logit_bias={4: 50.0}, repetition_penalty=2.0), [5, 6], [7]),
             (_sp(temperature=0.9, top_k=3, logprobs=0), [5], [])]
    bench = Bench(specs)
    logits = _random_logits(2, seed=2)
    sampled, lps = bench.sampler(logits.clone(), bench.md)
    raw = torch.log_softmax(logits, -1)
    assert int(sampled[0]) == 4  # the bias decides the token ...
    assert lps[0].logprob == pytest.approx(float(raw[0, 4]), abs=1e-6)  # ... but logprobs are raw
    assert lps[0].rank == int((raw[0] > raw[0, 4]).sum()) + 1
    assert list(lps[0].top_ids) == raw[0].topk(3).indices.tolist()
    assert len(lps[1].top_ids) == 0 and lps[1].logprob == pytest.approx(float(raw[1, sampled[1]]), abs=1e-6)


def test_resumed_request_counts_its_outputs() -> None:
    outputs = [9, 9, 4, 9, 30]
    bench = Bench([(_sp(temperature=0.0, frequency_penalty=1.0), [1, 2, 3], outputs)])
    counts = bench.sampler.penalty_state.output_counts[bench.rows[0]]
    assert counts.tolist() == np.bincount(outputs, minlength=V).tolist()
    # a re-add (preemption) resets the row, whatever was counted before
    bench.step(_random_logits(1, seed=0))
    data = pb.NewRequestData(request_id="req0", prompt_token_ids=[1, 2, 3], sampling=bench.specs[0][0],
                             output_token_ids=[5])
    row = bench.batch.add(data)
    bench.sampler.add_requests([row], [data])
    assert bench.sampler.penalty_state.output_counts[row].tolist() == np.bincount([5], minlength=V).tolist()


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = _random_logits(1, seed=3)[0]
    mine = _sp(temperature=0.9, top_p=0.9, seed=123)
    alone = Bench([(mine, [5], [])])
    others = [(_sp(temperature=t, top_k=k, seed=s) if s else _sp(temperature=t, top_k=k), [6], [])
              for t, k, s in [(0.0, -1, None), (1.5, 3, 8), (0.7, -1, None), (1.0, 20, None)]]
    mixed = Bench(others[:2] + [(_sp(temperature=0.9, top_p=0.9, seed=123), [5], [])] + others[2:])
    a = [int(alone.sampler(logits[None], alone.md)[0][0]) for _ in range(12)]
    b = [int(mixed.sampler(logits[None].repeat(5, 1), mixed.md)[0][2]) for _ in range(12)]
    assert a == b
    assert len(set(a)) > 1


# --------------------------------------------------------------------------- the draws


def _chi2_sf_4dof(x: float) -> float:
    return math.exp(-x / 2) * (1 + x / 2)


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    expected = n * probs
    return _chi2_sf_4dof(float(((counts - expected) ** 2 / expected).sum()))


@pytest.mark.parametrize("way", ["candidates", "candidates-seeded", "full-topk", "full-topk-topp",
                                 "prefilter-topp", "full-topp"])
def test_draws_follow_the_kept_distribution(way: str) -> None:
    """2,000 draws from one context: chi-square goodness of fit to the 5 kept tokens."""
    n, vocab = 2000, 100
    g = torch.Generator().manual_seed(42)
    row = torch.randn(vocab, generator=g)
    top5 = row.topk(5).indices
    row[top5] += 3.0  # five likely tokens holding most of the mass
    temperature = 0.8
    full = torch.softmax(row.double() / temperature, -1).numpy()
    order = np.argsort(-full)
    if way.endswith("topp"):
        # a top_p whose nucleus is exactly those five tokens
        params = dict(top_p=float(full[order[:4]].sum() + 0.5 * full[order[4]]))
        if way == "full-topk-topp":
            params = dict(top_k=5, top_p=0.9999)
    else:
        params = dict(top_k=5)
    sps = [_sp(temperature=temperature, **params, **({"seed": i} if way.endswith("seeded") else {}))
           for i in range(n)]
    kwargs = {"full-topk": dict(max_top_k=2), "full-topk-topp": dict(max_top_k=2),
              "full-topp": dict(top_p_prefilter=0)}.get(way, {})
    gens = {}
    for i, sp in enumerate(sps):
        if sp.HasField("seed"):
            gens[i] = torch.Generator().manual_seed(sp.seed)
    md = build_sampling_metadata(sps, gens, vocab, "cpu", **kwargs)
    expect_kind = {"candidates": "candidates", "candidates-seeded": "candidates",
                   "prefilter-topp": "prefilter"}.get(way, "full")
    assert [grp.kind for grp in md.groups] == [expect_kind]
    torch.manual_seed(0)
    sampled = Sampler()(row[None].repeat(n, 1), md)[0].numpy()
    kept = order[:5]
    assert np.isin(sampled, kept).all(), "a token outside the kept five was drawn"
    counts = np.array([(sampled == t).sum() for t in kept])
    probs = full[kept] / full[kept].sum()
    p = _chi_square_p(counts, probs)
    assert p > 0.001, f"chi-square p = {p:.2e}: counts {counts.tolist()} vs {(n * probs).round(1).tolist()}"


def test_exponential_noise_is_exp1_and_its_race_draws_by_probability() -> None:
    """The vectorised -log(U) noise: Exp(1) (mean 1, P(q > t) = e^-t), never 0, never NaN in the
    race argmax(p / q), and the race picks each token with its probability (chi-square)."""
    q = exponential_(torch.empty(400_000), torch.Generator().manual_seed(3))
    assert bool((q > 0).all()) and abs(float(q.mean()) - 1.0) < 0.01
    for t in (0.1, 1.0, 3.0):
        assert abs(float((q > t).double().mean()) - math.exp(-t)) < 0.005, t
    half = exponential_(torch.empty(100_000, dtype=torch.bfloat16), torch.Generator().manual_seed(4))
    assert bool(torch.isfinite(half).all()) and abs(float(half.float().mean()) - 1.0) < 0.02  # drawn in fp32
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0])
    torch.manual_seed(0)
    drawn = probs.repeat(20_000, 1).div_(exponential_like(probs.repeat(20_000, 1))).argmax(dim=-1)
    counts = torch.bincount(drawn, minlength=6).numpy()
    assert counts[5] == 0  # probability 0 is never drawn
    p = _chi_square_p(counts[:5], probs[:5].double().numpy())
    assert p > 0.001, (p, counts.tolist())


# --------------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def llm(smollm2_dir: str) -> Iterator[LLM]:
    with LLM(smollm2_dir, dtype="float32", seed=0) as llm:
        yield llm


def _ids(llm: LLM, prompt, sp: SamplingParams) -> list[int]:
    return llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids


def _batch_ids(llm: LLM, prompt, params: list[SamplingParams]) -> list[list[int]]:
    """One prompt under several params, generated together (one batch: one pass of steps)."""
    return [o.outputs[0].token_ids for o in llm.generate([prompt] * len(params), params, use_tqdm=False)]


def test_seeded_request_same_alone_and_in_a_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.8, seed=1234, max_tokens=16, ignore_eos=True)
    prompt = "Tell me a story about a dragon:"
    alone = _ids(llm, prompt, seeded)
    others = [
        SamplingParams(temperature=0.0, max_tokens=16),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=16),
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=12),
        SamplingParams(temperature=1.2, min_p=0.1, seed=5, max_tokens=16),
        SamplingParams(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=10),
        SamplingParams(temperature=0.0, presence_penalty=1.0, max_tokens=16),
        SamplingParams(temperature=0.6, top_k=40, top_p=0.8, min_tokens=8, max_tokens=16),
        SamplingParams(temperature=1.0, logit_bias={504: 5.0}, max_tokens=8),
    ]
    texts = ["Hello,", "The weather today", "Write a poem", "1, 2, 3,", "Once upon a time",
             "What is the capital of France?", "def f(x):", "Lists of fruit:"]
    prompts = [texts[i % len(texts)] + " " * (i // len(texts)) for i in range(15)]
    params = [others[i % len(others)] for i in range(15)]
    # 16 others: 15 above and the same prompt under another seed (which must give other ids)
    other_seed = SamplingParams(temperature=0.8, seed=4321, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompts[:7] + [prompt] + prompts[7:] + [prompt],
                        params[:7] + [seeded] + params[7:] + [other_seed], use_tqdm=False)
    assert outs[7].outputs[0].token_ids == alone
    assert outs[-1].outputs[0].token_ids != alone


def test_min_tokens_holds_eos_back(llm: LLM) -> None:
    prompt = {"prompt_token_ids": llm.apply_chat_template(
        [{"role": "user", "content": "Reply with only the number: what is 2+2?"}])}
    short, held = llm.generate([prompt, prompt], [SamplingParams(temperature=0.0, max_tokens=20),
                                                  SamplingParams(temperature=0.0, max_tokens=20, min_tokens=10)],
                               use_tqdm=False)
    short, held = short.outputs[0], held.outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 10 and short.token_ids[-1] == EOS
    assert len(held.token_ids) >= 10
    assert EOS not in held.token_ids[:10]
    assert held.token_ids[:len(short.token_ids) - 1] == short.token_ids[:-1]  # same text until the EOS


def test_logit_bias_and_bad_words(llm: LLM) -> None:
    prompt = "The capital of France is"
    base = _ids(llm, prompt, SamplingParams(temperature=0.0, max_tokens=6))
    forced = SamplingParams(temperature=0.0, max_tokens=6, logit_bias={1230: 100.0})
    # a 1-token bad word: the greedy first token never appears
    banned = SamplingParams(temperature=0.0, max_tokens=6)
    banned.bad_words_token_ids = [[base[0]]]
    # a 2-token bad word: its first token may come, never followed by its second
    pair = SamplingParams(temperature=0.0, max_tokens=6)
    pair.bad_words_token_ids = [base[:2]]
    # bad words given as text go through the tokenizer
    word = llm.get_tokenizer().decode([base[0]]).strip()
    text = SamplingParams(temperature=0.0, max_tokens=6, bad_words=[word])
    forced_ids, banned_ids, pair_ids, text_ids = _batch_ids(llm, prompt, [forced, banned, pair, text])
    assert forced_ids == [1230] * 6
    assert base[0] not in banned_ids
    assert pair_ids[0] == base[0] and pair_ids[1] != base[1]
    assert text_ids[0] != base[0]


def test_penalties_change_a_repetitive_greedy_output(llm: LLM) -> None:
    prompt = "one two one two one two one two one two one two"
    kws = [dict(repetition_penalty=1.5), dict(frequency_penalty=1.0), dict(presence_penalty=1.5)]
    base, *outs = _batch_ids(llm, prompt, [SamplingParams(temperature=0.0, max_tokens=12, **kw)
                                           for kw in [{}] + kws])
    assert max(base.count(t) for t in set(base)) >= 6  # it repeats itself
    for kw, out in zip(kws, outs, strict=True):
        assert out != base, kw
        assert max(out.count(t) for t in set(out)) < max(base.count(t) for t in set(base)), kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ids_are_argmax_with_its_ties_and_nans(dtype: torch.dtype) -> None:
    logits = torch.randn(64, 49152, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[0, 5] = logits[0, 70] = 100  # a tie: the first
    logits[1] = 0  # all equal: index 0
    logits[2, 3], logits[2, 100] = 100, float("nan")  # a NaN wins, as in argmax
    got = greedy_ids(logits)
    assert got[:3].tolist() == [5, 0, 100]
    assert torch.equal(got, logits.argmax(dim=-1))
