"""Sampling metadata: the per-row tensors of one batch composition (parameters, row groups by
sampling path, logits-processor index tensors), built once per composition by
`build_sampling_metadata` and cached by the model runner until the membership changes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from services.common.proto import myvllm_pb2 as pb
from services.common.sampling_params import GREEDY_TEMPERATURE
from services.worker.penalties import PenaltyState

# top_k at most this goes the "candidates" way (topk + work on k values); larger top_k: full sort.
MAX_TOP_K_CANDIDATES = 1024
# top_p-only rows on CPU first try the nucleus inside this many most likely tokens.
TOP_P_PREFILTER = 256


class TokenHistory(Protocol):
    """What the sampler reads of the persistent batch (an `InputBatch` is one)."""

    token_ids: np.ndarray          # [max_num_reqs, max_model_len]
    num_tokens: np.ndarray         # [max_num_reqs]: prompt + output tokens known before this step
    num_prompt_tokens: np.ndarray  # [max_num_reqs]


@dataclass
class RandomGroup:
    """Random rows that go the same way ("candidates", "prefilter" or "full")."""

    kind: str
    index: torch.Tensor                 # [G] batch indices (device)
    whole: bool                         # index == arange(B): no gather needed
    temperature: torch.Tensor           # [G, 1]
    top_k: torch.Tensor | None = None   # candidates: [G] k per row; full: [G] (vocab where off) or None
    max_k: int = 0                      # candidates / full: max k (of rows using top_k); prefilter: its size
    k_mask: torch.Tensor | None = None  # candidates: [G, max_k] True past a row's k (None: all k equal)
    draw_k: list[int] | None = None     # candidates: per-row k (a seeded row draws exactly that many q)
    top_p: torch.Tensor | None = None   # [G, 1] or None
    min_p: torch.Tensor | None = None   # [G, 1] or None
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # group index → generator


@dataclass
class BadWords:
    rows: np.ndarray        # [W] persistent-batch row of each multi-token word's request
    batch_index: np.ndarray  # [W]
    prefix: np.ndarray      # [W, P] prefixes right-aligned
    care: np.ndarray        # [W, P] bool: the positions a prefix covers
    last: np.ndarray        # [W] the token banned when the prefix matches


@dataclass
class MinTokens:
    rows: np.ndarray        # [M] persistent-batch rows of requests with min_tokens > 0
    min_tokens: np.ndarray  # [M]
    owner: np.ndarray       # [N] which of the M requests each (batch index, token) pair belongs to
    batch_index: np.ndarray  # [N]
    token: np.ndarray       # [N] EOS / stop token ids


@dataclass
class SamplingMetadata:
    """Per-row sampling tensors for one batch composition (rebuilt only when it changes)."""

    all_greedy: bool
    greedy_mask: torch.Tensor          # [B] bool
    temperature: torch.Tensor          # [B, 1] (1.0 on greedy rows)
    top_k: torch.Tensor | None         # [B] int64, vocab size where off; None: no random row uses it
    top_p: torch.Tensor | None         # [B]; None: no random row uses it
    min_p: torch.Tensor | None         # [B, 1]; None: no random row uses it
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # batch index → generator
    logprobs_k: np.ndarray | None = None  # [B] top-k per row (-1: none); None: no row asks
    any_greedy: bool = True
    groups: list[RandomGroup] = field(default_factory=list)
    # Logits processors (None: no row needs the stage).
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (batch idx, token, bias)
    static_bans: tuple[np.ndarray, np.ndarray] | None = None  # 1-token bad words: (batch idx, token)
    bad_words: BadWords | None = None
    min_tokens: MinTokens | None = None
    repetition: torch.Tensor | None = None  # [B, 1]
    frequency: torch.Tensor | None = None   # [B, 1]
    presence: torch.Tensor | None = None    # [B, 1]
    penalty_state: PenaltyState | None = None
    rows: np.ndarray | None = None          # [B] persistent-batch rows
    rows_t: torch.Tensor | None = None      # [B] the same on the device, for the penalty state
    count_ones: torch.Tensor | None = None  # [B] int32 ones, for the count update
    history: TokenHistory | None = None
    allow_sync: bool = True                 # may read tensors back mid-pipeline (CPU)

    @property
    def needs_processing(self) -> bool:
        return (self.logit_bias is not None or self.static_bans is not None or self.bad_words is not None
                or self.min_tokens is not None or self.has_penalties)

    @property
    def has_penalties(self) -> bool:
        return self.repetition is not None or self.frequency is not None or self.presence is not None


def _col(values: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(device)[:, None]


def index_tensor(idx: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64)).to(device)


@dataclass
class RowParams:
    """The batch's per-row sampling parameters as arrays (batch index i: params[i])."""

    temperature: np.ndarray  # [B] float32, 1.0 on greedy rows
    top_k_raw: np.ndarray    # [B] int64 as requested (0 or less: off)
    top_k: np.ndarray        # [B] int64, at most the vocab size, which means off
    top_p: np.ndarray        # [B] float32, 1.0 where off
    min_p: np.ndarray        # [B] float32
    greedy: np.ndarray       # [B] bool

    @classmethod
    def of(cls, params: list[pb.SamplingParams], vocab_size: int) -> RowParams:
        temperature = np.array([p.temperature for p in params], dtype=np.float32)
        top_k_raw = np.array([p.top_k for p in params], dtype=np.int64)
        greedy = (temperature < GREEDY_TEMPERATURE) | (top_k_raw == 1)
        return cls(temperature=np.where(greedy, 1.0, temperature).astype(np.float32), top_k_raw=top_k_raw,
                   top_k=np.where(top_k_raw > 0, np.minimum(top_k_raw, vocab_size), vocab_size),
                   top_p=np.array([p.top_p if 0 < p.top_p < 1 else 1.0 for p in params], dtype=np.float32),
                   min_p=np.array([p.min_p for p in params], dtype=np.float32), greedy=greedy)


def build_sampling_metadata(
    params: list[pb.SamplingParams],
    generators: dict[int, torch.Generator],
    vocab_size: int,
    device: torch.device | str,
    *,
    rows: np.ndarray | None = None,
    history: TokenHistory | None = None,
    eos_token_ids: list[int] | tuple[int, ...] = (),
    penalty_state: PenaltyState | None = None,
    max_top_k: int = MAX_TOP_K_CANDIDATES,
    top_p_prefilter: int = TOP_P_PREFILTER,
    allow_sync: bool | None = None,
) -> SamplingMetadata:
    """Everything the sampler needs for rows `params` (batch index i ↔ persistent row rows[i]).

    `rows` / `history` are needed for bad words and min_tokens (the generated tokens so far),
    `penalty_state` for penalties; `generators` maps batch index → the request's generator.
    `allow_sync` (default: on CPU) lets the step read tensors back: the top_p prefilter and
    the sparse penalties; without it every stage stays on dense device tensors.
    """
    device = torch.device(device)
    row_params = RowParams.of(params, vocab_size)
    md = _row_tensors(row_params, params, generators, vocab_size, device, history,
                      device.type == "cpu" if allow_sync is None else allow_sync)
    if rows is not None:
        rows = np.asarray(rows, dtype=np.int64)
    md.groups = _random_groups(row_params, generators, vocab_size, device, md.allow_sync, max_top_k,
                               top_p_prefilter)
    md.logit_bias = _logit_bias(params, vocab_size, device)
    md.static_bans, md.bad_words = _bad_words(params, vocab_size, rows, history)
    md.min_tokens = _min_tokens(params, vocab_size, eos_token_ids, rows, history)
    _add_penalties(md, params, rows, penalty_state, device)
    return md


def _row_tensors(row_params: RowParams, params: list[pb.SamplingParams], generators: dict[int, torch.Generator],
                 vocab_size: int, device: torch.device, history: TokenHistory | None,
                 allow_sync: bool) -> SamplingMetadata:
    """The whole batch's tensors; top_k, top_p and min_p only where a random row uses them."""
    r = row_params
    random_rows = ~r.greedy
    logprobs_k = np.array([p.logprobs for p in params], dtype=np.int64)
    return SamplingMetadata(
        all_greedy=bool(r.greedy.all()),
        any_greedy=bool(r.greedy.any()),
        greedy_mask=torch.from_numpy(r.greedy).to(device),
        temperature=_col(r.temperature, device),
        top_k=torch.from_numpy(r.top_k).to(device) if (r.top_k[random_rows] < vocab_size).any() else None,
        top_p=torch.from_numpy(r.top_p).to(device) if (r.top_p[random_rows] < 1.0).any() else None,
        min_p=_col(r.min_p, device) if (r.min_p[random_rows] > 0).any() else None,
        generators=generators,
        logprobs_k=logprobs_k if (logprobs_k >= 0).any() else None,
        history=history,
        allow_sync=allow_sync,
    )


def _random_groups(row_params: RowParams, generators: dict[int, torch.Generator], vocab_size: int,
                   device: torch.device, allow_sync: bool, max_top_k: int, top_p_prefilter: int) -> list[RandomGroup]:
    """The random rows, grouped by the way they sample: top-k candidates, the top_p prefilter
    (CPU), or the full distribution (those with a top_p apart: only they pay for the sort)."""
    r = row_params
    n = r.greedy.size
    top_k, top_p, min_p = r.top_k, r.top_p, r.min_p
    random_rows = ~r.greedy
    cand = random_rows & (r.top_k_raw > 1) & (top_k <= max_top_k) & (top_k < vocab_size)
    prefilter = (random_rows & ~cand & (top_k >= vocab_size) & (top_p < 1.0) & (min_p <= 0)
                 & allow_sync & (top_p_prefilter > 0))
    full = random_rows & ~cand & ~prefilter
    full_sort = full & (top_p < 1.0)  # only these pay for the sort
    groups = []
    for kind, mask in (("candidates", cand), ("prefilter", prefilter), ("full", full & ~full_sort),
                       ("full", full_sort)):
        idx = np.flatnonzero(mask)
        if idx.size == 0:
            continue
        local = {int(j): generators[int(i)] for j, i in enumerate(idx) if int(i) in generators}
        g = RandomGroup(kind=kind, index=index_tensor(idx, device), whole=idx.size == n,
                        temperature=_col(r.temperature[idx], device), generators=local)
        if kind == "candidates":
            ks = top_k[idx]
            g.max_k = int(ks.max())
            g.top_k = index_tensor(ks, device)
            g.draw_k = ks.tolist()
            if (ks != g.max_k).any():
                g.k_mask = torch.from_numpy(np.arange(g.max_k)[None, :] >= ks[:, None]).to(device)
        elif kind == "prefilter":
            g.max_k = min(top_p_prefilter, vocab_size)
        elif (top_k[idx] < vocab_size).any():
            g.top_k = index_tensor(top_k[idx], device)
            g.max_k = int(top_k[idx][top_k[idx] < vocab_size].max())
        if kind != "prefilter" and (min_p[idx] > 0).any():
            g.min_p = _col(min_p[idx], device)
        if (top_p[idx] < 1.0).any():
            g.top_p = _col(top_p[idx], device)
        groups.append(g)
    return groups


def _logit_bias(params: list[pb.SamplingParams], vocab_size: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(batch index, token, bias) of every non-zero bias on a token of the vocabulary."""
    bias_b, bias_t, bias_v = [], [], []
    for i, p in enumerate(params):
        for tok, val in p.logit_bias.items():
            if 0 <= tok < vocab_size and val != 0:
                bias_b.append(i)
                bias_t.append(tok)
                bias_v.append(val)
    if not bias_b:
        return None
    return (index_tensor(np.array(bias_b), device), index_tensor(np.array(bias_t), device),
            torch.tensor(bias_v, dtype=torch.float32, device=device))


def _bad_words(params: list[pb.SamplingParams], vocab_size: int, rows: np.ndarray | None,
               history: TokenHistory | None) -> tuple[tuple[np.ndarray, np.ndarray] | None, BadWords | None]:
    """One-token bad words, banned outright as (batch index, token); longer ones, banned when
    their prefix ends the row's tokens so far (their prefixes right-aligned)."""
    ban_b, ban_t = [], []
    words: list[tuple[int, list[int]]] = []
    for i, p in enumerate(params):
        for w in p.bad_words:
            ids = list(w.ids)
            if not ids or not 0 <= ids[-1] < vocab_size:
                continue
            if len(ids) == 1:
                ban_b.append(i)
                ban_t.append(ids[0])
            else:
                words.append((i, ids))
    static_bans = (np.array(ban_b, dtype=np.int64), np.array(ban_t, dtype=np.int64)) if ban_b else None
    if not words:
        return static_bans, None
    _need_history(rows, history, "bad_words")
    width = max(len(ids) for _, ids in words) - 1
    prefix = np.full((len(words), width), -1, dtype=np.int64)
    care = np.zeros((len(words), width), dtype=bool)
    for j, (_, ids) in enumerate(words):
        prefix[j, width - len(ids) + 1:] = ids[:-1]
        care[j, width - len(ids) + 1:] = True
    b = np.array([i for i, _ in words], dtype=np.int64)
    return static_bans, BadWords(rows=rows[b], batch_index=b, prefix=prefix, care=care,
                                 last=np.array([ids[-1] for _, ids in words], dtype=np.int64))


def _min_tokens(params: list[pb.SamplingParams], vocab_size: int, eos_token_ids: list[int] | tuple[int, ...],
                rows: np.ndarray | None, history: TokenHistory | None) -> MinTokens | None:
    """The rows with min_tokens and the stop tokens (EOS unless ignored) each must hold back."""
    mt_idx, mt_min, owner, pair_b, pair_t = [], [], [], [], []
    for i, p in enumerate(params):
        if p.min_tokens <= 0:
            continue
        stops = {t for t in p.stop_token_ids if 0 <= t < vocab_size}
        if not p.ignore_eos:
            stops.update(t for t in eos_token_ids if 0 <= t < vocab_size)
        if not stops:
            continue
        for t in sorted(stops):
            owner.append(len(mt_idx))
            pair_b.append(i)
            pair_t.append(t)
        mt_idx.append(i)
        mt_min.append(p.min_tokens)
    if not mt_idx:
        return None
    _need_history(rows, history, "min_tokens")
    return MinTokens(rows=rows[np.array(mt_idx)], min_tokens=np.array(mt_min, dtype=np.int64),
                     owner=np.array(owner, dtype=np.int64), batch_index=np.array(pair_b, dtype=np.int64),
                     token=np.array(pair_t, dtype=np.int64))


def _add_penalties(md: SamplingMetadata, params: list[pb.SamplingParams], rows: np.ndarray | None,
                   penalty_state: PenaltyState | None, device: torch.device) -> None:
    """Repetition, frequency and presence penalties, each only where a row asks for it."""
    rep = np.array([p.repetition_penalty if p.repetition_penalty > 0 else 1.0 for p in params], dtype=np.float32)
    freq = np.array([p.frequency_penalty for p in params], dtype=np.float32)
    pres = np.array([p.presence_penalty for p in params], dtype=np.float32)
    if not ((rep != 1.0).any() or (freq != 0).any() or (pres != 0).any()):
        return
    if penalty_state is None or not penalty_state.allocated or rows is None:
        raise ValueError("penalties need the persistent rows and an initialised PenaltyState")
    md.penalty_state = penalty_state
    md.rows, md.rows_t = rows, index_tensor(rows, device)
    md.count_ones = torch.ones(len(params), dtype=torch.int32, device=device)
    md.repetition = _col(rep, device) if (rep != 1.0).any() else None
    md.frequency = _col(freq, device) if (freq != 0).any() else None
    md.presence = _col(pres, device) if (pres != 0).any() else None


def _need_history(rows, history, what: str) -> None:
    if rows is None or history is None:
        raise ValueError(f"{what} needs the persistent rows and the batch's token history")
