"""The batched sampler: logits of the rows that sample this step → one token id each.

Order (shared/DESIGN.md §4), every stage batched on tensors and skipped when no row needs it:

1. logprobs (and top logprobs) from the RAW logits, if any row asked;
2. bad words: a 1-token bad word is always banned; a longer one bans its last token when
   the request's last len-1 *generated* tokens equal its prefix;
3. logit_bias (added per token);
4. min_tokens: while a request has generated fewer than min_tokens tokens its EOS ids
   (unless ignore_eos) and stop_token_ids are banned;
5. penalties, vLLM semantics: repetition (tokens in the prompt or the output: logits > 0
   divided by the penalty, logits <= 0 multiplied), frequency (minus penalty × the token's
   count in the output), presence (minus penalty × 1[token in the output]);
6. greedy rows take the argmax of those processed logits;
7. random rows: temperature, min_p, top_k / top_p, then a draw `argmax(probs / q)` with
   `q ~ Exp(1)`; a seeded request draws its q from its own generator, so its tokens do not
   depend on the batch around it.

Random rows go one of three ways, chosen from each row's own parameters (so a seeded row
takes the same way whatever the batch):

- "candidates": 1 < top_k <= max_top_k. `topk(k)` of the logits, then temperature, min_p,
  the k-th cut and top_p all act on those k sorted candidates only, and q has k entries.
  (min_p and top_k both drop a lowest-logit set, so they commute.)
- "prefilter" (CPU only, top_p < 1 without top_k or min_p): the top `top_p_prefilter` tokens
  with their probabilities under the full softmax; when they hold at least top_p of the
  mass the nucleus lies inside them, otherwise that row falls back to the full sort. (The
  check reads the tensor back, which costs nothing on CPU; on an accelerator it would be a
  sync, so there every such row takes the full sort.)
- "full": the whole vocabulary; rows with top_p sort it (with their top_k, if larger than
  max_top_k), the others (plain temperature / min_p / a large top_k) do not.

Everything that depends only on the batch membership (the per-row parameter tensors, the
logit_bias index tensors, the EOS/stop pairs of min_tokens rows, the padded bad-word
prefixes, the row groups) is built in `build_sampling_metadata` and cached by the model
runner until the membership changes. Penalties read a device tensor of output-token counts
[max_num_reqs, vocab] and a prompt-presence mask [max_num_reqs, vocab] (`PenaltyState`),
allocated on the first request that uses a penalty, initialised for a row when its request
is added (from its output tokens when it resumes after a preemption) and updated with each
step's sampled tokens by one `index_put_`. On CPU the penalties only touch the tokens each
row has seen (its prompt + output tokens, gathered from the token history) instead of
making [B, vocab] passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from services.common.proto import myvllm_pb2 as pb
from services.worker.exponential import exponential_

_GREEDY_EPS = 1e-5
# top_k at most this goes the "candidates" way (topk + work on k values); larger top_k: full sort.
MAX_TOP_K_CANDIDATES = 1024
# top_p-only rows on CPU first try the nucleus inside this many most likely tokens.
TOP_P_PREFILTER = 256
# The prefilter must hold at least top_p + this much mass (float slack at the boundary).
_PREFILTER_MARGIN = 1e-4

_NEG_INF = float("-inf")


class TokenHistory(Protocol):
    """What the sampler reads of the persistent batch (an `InputBatch` is one)."""

    token_ids: np.ndarray          # [max_num_reqs, max_model_len]
    num_tokens: np.ndarray         # [max_num_reqs]: prompt + output tokens known before this step
    num_prompt_tokens: np.ndarray  # [max_num_reqs]


def uses_penalties(sp: pb.SamplingParams) -> bool:
    return (sp.repetition_penalty not in (0.0, 1.0)) or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0


# ---------------------------------------------------------------------------- per-row state


class PenaltyState:
    """Output-token counts and prompt-token presence per persistent-batch row, on the device.

    Allocated on the first request that uses a penalty (256 × 49152 × (4 + 1) bytes ≈ 60 MB).
    Rows of requests without penalties are not initialised and may hold stale values: their
    penalties are neutral (1, 0, 0), which makes any value harmless.
    """

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device | str) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.output_counts: torch.Tensor | None = None  # [max_num_reqs, vocab] int32
        self.prompt_mask: torch.Tensor | None = None    # [max_num_reqs, vocab] bool

    @property
    def allocated(self) -> bool:
        return self.output_counts is not None

    def _allocate(self) -> None:
        if self.output_counts is None:
            shape = (self.max_num_reqs, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)

    def _ids(self, ids) -> torch.Tensor:
        t = torch.from_numpy(np.asarray(list(ids), dtype=np.int64))
        t = t[(t >= 0) & (t < self.vocab_size)]
        return t.to(self.device)

    def add_request(self, row: int, data: pb.NewRequestData) -> None:
        """(Re)initialise `row` for a newly added request (a no-op for one without penalties)."""
        if not uses_penalties(data.sampling):
            return
        self._allocate()
        counts, mask = self.output_counts[row], self.prompt_mask[row]
        counts.zero_()
        mask.zero_()
        if data.output_token_ids:
            ids = self._ids(data.output_token_ids)
            counts.index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
        if data.prompt_token_ids:
            mask[self._ids(data.prompt_token_ids)] = True

    def update(self, rows: torch.Tensor, sampled: torch.Tensor, ones: torch.Tensor) -> None:
        """Count this step's sampled tokens (one scatter-add for the whole batch)."""
        self.output_counts.index_put_((rows, sampled), ones, accumulate=True)


# ---------------------------------------------------------------------------- metadata


@dataclass
class _RandomGroup:
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
class _BadWords:
    rows: np.ndarray        # [W] persistent-batch row of each multi-token word's request
    batch_index: np.ndarray  # [W]
    prefix: np.ndarray      # [W, P] prefixes right-aligned
    care: np.ndarray        # [W, P] bool: the positions a prefix covers
    last: np.ndarray        # [W] the token banned when the prefix matches


@dataclass
class _MinTokens:
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
    groups: list[_RandomGroup] = field(default_factory=list)
    # Logits processors (None: no row needs the stage).
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (batch idx, token, bias)
    static_bans: tuple[np.ndarray, np.ndarray] | None = None  # 1-token bad words: (batch idx, token)
    bad_words: _BadWords | None = None
    min_tokens: _MinTokens | None = None
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


def _index(idx: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64)).to(device)


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
    n = len(params)
    temperature = np.array([p.temperature for p in params], dtype=np.float32)
    top_k_raw = np.array([p.top_k for p in params], dtype=np.int64)
    top_k = np.where(top_k_raw > 0, np.minimum(top_k_raw, vocab_size), vocab_size)
    top_p = np.array([p.top_p if 0 < p.top_p < 1 else 1.0 for p in params], dtype=np.float32)
    min_p = np.array([p.min_p for p in params], dtype=np.float32)
    greedy = (temperature < _GREEDY_EPS) | (top_k_raw == 1)
    logprobs_k = np.array([p.logprobs for p in params], dtype=np.int64)
    random_rows = ~greedy
    temp = np.where(greedy, 1.0, temperature).astype(np.float32)
    md = SamplingMetadata(
        all_greedy=bool(greedy.all()),
        any_greedy=bool(greedy.any()),
        greedy_mask=torch.from_numpy(greedy).to(device),
        temperature=_col(temp, device),
        top_k=torch.from_numpy(top_k).to(device) if (top_k[random_rows] < vocab_size).any() else None,
        top_p=torch.from_numpy(top_p).to(device) if (top_p[random_rows] < 1.0).any() else None,
        min_p=_col(min_p, device) if (min_p[random_rows] > 0).any() else None,
        generators=generators,
        logprobs_k=logprobs_k if (logprobs_k >= 0).any() else None,
        history=history,
        allow_sync=device.type == "cpu" if allow_sync is None else allow_sync,
    )
    if rows is not None:
        rows = np.asarray(rows, dtype=np.int64)

    # -------------------------------------------------------------- random-row groups
    cand = random_rows & (top_k_raw > 1) & (top_k <= max_top_k) & (top_k < vocab_size)
    prefilter = (random_rows & ~cand & (top_k >= vocab_size) & (top_p < 1.0) & (min_p <= 0)
                 & md.allow_sync & (top_p_prefilter > 0))
    full = random_rows & ~cand & ~prefilter
    full_sort = full & (top_p < 1.0)  # only these pay for the sort
    for kind, mask in (("candidates", cand), ("prefilter", prefilter), ("full", full & ~full_sort),
                       ("full", full_sort)):
        idx = np.flatnonzero(mask)
        if idx.size == 0:
            continue
        local = {int(j): generators[int(i)] for j, i in enumerate(idx) if int(i) in generators}
        g = _RandomGroup(kind=kind, index=_index(idx, device), whole=idx.size == n,
                         temperature=_col(temp[idx], device), generators=local)
        if kind == "candidates":
            ks = top_k[idx]
            g.max_k = int(ks.max())
            g.top_k = _index(ks, device)
            g.draw_k = ks.tolist()
            if (ks != g.max_k).any():
                g.k_mask = torch.from_numpy(np.arange(g.max_k)[None, :] >= ks[:, None]).to(device)
        elif kind == "prefilter":
            g.max_k = min(top_p_prefilter, vocab_size)
        elif (top_k[idx] < vocab_size).any():
            g.top_k = _index(top_k[idx], device)
            g.max_k = int(top_k[idx][top_k[idx] < vocab_size].max())
        if kind != "prefilter" and (min_p[idx] > 0).any():
            g.min_p = _col(min_p[idx], device)
        if (top_p[idx] < 1.0).any():
            g.top_p = _col(top_p[idx], device)
        md.groups.append(g)

    # -------------------------------------------------------------- logit_bias
    bias_b, bias_t, bias_v = [], [], []
    for i, p in enumerate(params):
        for tok, val in p.logit_bias.items():
            if 0 <= tok < vocab_size and val != 0:
                bias_b.append(i)
                bias_t.append(tok)
                bias_v.append(val)
    if bias_b:
        md.logit_bias = (_index(np.array(bias_b), device), _index(np.array(bias_t), device),
                         torch.tensor(bias_v, dtype=torch.float32, device=device))

    # -------------------------------------------------------------- bad words
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
    if ban_b:
        md.static_bans = (np.array(ban_b, dtype=np.int64), np.array(ban_t, dtype=np.int64))
    if words:
        _need_history(rows, history, "bad_words")
        width = max(len(ids) for _, ids in words) - 1
        prefix = np.full((len(words), width), -1, dtype=np.int64)
        care = np.zeros((len(words), width), dtype=bool)
        for j, (_, ids) in enumerate(words):
            prefix[j, width - len(ids) + 1:] = ids[:-1]
            care[j, width - len(ids) + 1:] = True
        b = np.array([i for i, _ in words], dtype=np.int64)
        md.bad_words = _BadWords(rows=rows[b], batch_index=b, prefix=prefix, care=care,
                                 last=np.array([ids[-1] for _, ids in words], dtype=np.int64))

    # -------------------------------------------------------------- min_tokens
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
    if mt_idx:
        _need_history(rows, history, "min_tokens")
        md.min_tokens = _MinTokens(rows=rows[np.array(mt_idx)], min_tokens=np.array(mt_min, dtype=np.int64),
                                   owner=np.array(owner, dtype=np.int64), batch_index=np.array(pair_b, dtype=np.int64),
                                   token=np.array(pair_t, dtype=np.int64))

    # -------------------------------------------------------------- penalties
    rep = np.array([p.repetition_penalty if p.repetition_penalty > 0 else 1.0 for p in params], dtype=np.float32)
    freq = np.array([p.frequency_penalty for p in params], dtype=np.float32)
    pres = np.array([p.presence_penalty for p in params], dtype=np.float32)
    if (rep != 1.0).any() or (freq != 0).any() or (pres != 0).any():
        if penalty_state is None or not penalty_state.allocated or rows is None:
            raise ValueError("penalties need the persistent rows and an initialised PenaltyState")
        md.penalty_state = penalty_state
        md.rows, md.rows_t = rows, _index(rows, device)
        md.count_ones = torch.ones(n, dtype=torch.int32, device=device)
        md.repetition = _col(rep, device) if (rep != 1.0).any() else None
        md.frequency = _col(freq, device) if (freq != 0).any() else None
        md.presence = _col(pres, device) if (pres != 0).any() else None
    return md


def _need_history(rows, history, what: str) -> None:
    if rows is None or history is None:
        raise ValueError(f"{what} needs the persistent rows and the batch's token history")


# ---------------------------------------------------------------------------- the sampler


@dataclass
class _Dist:
    """Final (unnormalised) probabilities of some random rows, over candidates or the vocab."""

    index: torch.Tensor                  # [G'] batch indices
    probs: torch.Tensor                  # [G', K]
    ids: torch.Tensor | None             # [G', K] token ids of the columns; None: column = token id
    generators: dict[int, torch.Generator]
    draw_k: list[int] | None = None      # per-row draw size of seeded rows (None: K)


class Sampler:
    def __init__(self, max_num_reqs: int = 256, vocab_size: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.penalty_state = PenaltyState(max_num_reqs, vocab_size, device) if vocab_size else None

    def add_requests(self, rows: list[int], requests: list[pb.NewRequestData]) -> None:
        """Initialise the per-row penalty state of newly added requests."""
        if self.penalty_state is None:
            return
        for row, data in zip(rows, requests, strict=True):
            self.penalty_state.add_request(row, data)

    # ------------------------------------------------------------------ entry points

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, list | None]:
        """Returns sampled ids [B] and, if any row asked, per-row TokenLogprobs (or None).

        `logits` may be overwritten (as in vLLM): pass a copy to keep them.
        """
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.logprobs_k is not None else None
        logits = self.apply_processors(logits, md, inplace=True)
        if md.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            sampled = logits.argmax(dim=-1) if md.any_greedy else None
            for dist in self._random_dists(logits, md):
                ids = self._draw(dist)
                if sampled is None and dist.index.numel() == logits.shape[0]:
                    sampled = ids  # one group holds every row, in order
                else:
                    if sampled is None:
                        sampled = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
                    sampled[dist.index] = ids
        if md.has_penalties:
            md.penalty_state.update(md.rows_t, sampled, md.count_ones)
        logprobs = gather_logprobs(raw_logprobs, sampled, md.logprobs_k) if raw_logprobs is not None else None
        return sampled, logprobs

    def processed_logprobs(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The distributions the rows draw from, as log-probabilities [B, vocab] (no draw, no state change).

        Random rows: after every stage up to top_k / top_p (-inf outside the kept set). Greedy
        rows: log_softmax of the processed logits (before temperature), whose argmax they take.
        """
        logits = self.apply_processors(logits, md)
        out = torch.log_softmax(logits.float(), dim=-1)
        for dist in self._random_dists(logits, md):
            probs = dist.probs / dist.probs.sum(dim=-1, keepdim=True)
            lp = probs.log()
            if dist.ids is None:
                out[dist.index] = lp
            else:
                rows = torch.full((dist.index.numel(), logits.shape[1]), _NEG_INF, device=logits.device)
                rows.scatter_(1, dist.ids, lp)
                out[dist.index] = rows
        return out

    def target_distributions(self, logits: torch.Tensor,
                             md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What each row would sample from, without sampling (speculative decoding verifies drafts
        against it): the argmax of the processed logits (a greedy row's choice) for every row, and
        for random rows their normalised distribution after every stage, [B, vocab] (zeros on
        greedy rows; None when every row is greedy). `logits` are left untouched."""
        x = self.apply_processors(logits, md)
        argmax = x.argmax(dim=-1)
        if md.all_greedy:
            return argmax, None
        probs = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for dist in self._random_dists(x, md):
            p = dist.probs.float()
            p = p / p.sum(dim=-1, keepdim=True)
            if dist.ids is None:
                probs[dist.index] = p
            else:
                probs[dist.index] = torch.zeros((p.shape[0], x.shape[1]), device=x.device).scatter_(1, dist.ids, p)
        return argmax, probs

    # ------------------------------------------------------------------ logits processors

    @staticmethod
    def apply_processors(logits: torch.Tensor, md: SamplingMetadata, inplace: bool = False) -> torch.Tensor:
        """Bad words, logit_bias, min_tokens and the penalties (returns `logits` itself if none apply).

        `inplace`: `logits` may be overwritten (the sampler's own call; saves a copy).
        The bans (bad words, min_tokens) all set -inf, and -inf + bias stays -inf, so adding
        the bias first and then one -inf scatter for every ban gives the documented order.
        """
        if not md.needs_processing:
            return logits
        x = logits if inplace else logits.clone()
        if md.logit_bias is not None:
            b, t, v = md.logit_bias
            x.index_put_((b, t), v.to(x.dtype), accumulate=True)
        bans = Sampler._bans(md)
        if bans is not None:
            x.index_put_(bans, torch.tensor(_NEG_INF, dtype=x.dtype, device=x.device))
        if md.has_penalties:
            x = Sampler._penalties(x, md)
        return x

    @staticmethod
    def _penalties(x: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Repetition, frequency and presence penalties (vLLM semantics).

        On an accelerator: dense [B, vocab] tensor ops over the counts and the prompt mask.
        On CPU, where each [B, vocab] pass is costly, only the tokens a row has seen can
        change: gather the logits at the row's prompt + output tokens (read from the token
        history; padded with its first token), penalise those, scatter them back. Every such
        token is in the prompt or the output, so the repetition penalty applies to all of them;
        duplicates compute and write the same value.
        """
        st, h = md.penalty_state, md.history
        vocab = x.shape[-1]
        if md.allow_sync and h is not None and md.rows is not None:
            n = h.num_tokens[md.rows]
            width = int(n.max())
            if 0 < width < vocab // 2 and (n > 0).all():
                tok = h.token_ids[md.rows, :width].astype(np.int64)
                keep = (np.arange(width)[None, :] < n[:, None]) & (tok < vocab)
                idx = _index(np.where(keep, tok, tok[:, :1]), x.device)
                vals = x.gather(1, idx)
                if md.repetition is not None:
                    vals = torch.where(vals > 0, vals / md.repetition, vals * md.repetition)
                if md.frequency is not None or md.presence is not None:
                    counts = st.output_counts[md.rows_t[:, None], idx]
                    if md.frequency is not None:
                        vals = vals - md.frequency * counts
                    if md.presence is not None:
                        vals = vals - md.presence * (counts > 0)
                return x.scatter_(1, idx, vals)
        counts = st.output_counts[md.rows_t]
        present = counts > 0
        if md.repetition is not None:
            seen = present | st.prompt_mask[md.rows_t]
            factor = torch.where(seen, md.repetition, 1.0)
            x = torch.where(x > 0, x / factor, x * factor)
        if md.frequency is not None:
            x = x - md.frequency * counts
        if md.presence is not None:
            x = x - md.presence * present
        return x

    @staticmethod
    def _bans(md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(batch index, token) pairs to set to -inf this step: one vectorised pass per kind."""
        parts_b, parts_t = [], []
        if md.static_bans is not None:
            parts_b.append(md.static_bans[0])
            parts_t.append(md.static_bans[1])
        h = md.history
        if md.bad_words is not None:
            bw = md.bad_words
            width = bw.prefix.shape[1]
            end = h.num_tokens[bw.rows]
            pos = end[:, None] - width + np.arange(width)[None, :]
            generated = pos >= h.num_prompt_tokens[bw.rows][:, None]  # only generated tokens count
            tokens = h.token_ids[bw.rows[:, None], np.maximum(pos, 0)]
            match = np.where(bw.care, generated & (tokens == bw.prefix), True).all(axis=1)
            if match.any():
                parts_b.append(bw.batch_index[match])
                parts_t.append(bw.last[match])
        if md.min_tokens is not None:
            mt = md.min_tokens
            num_output = h.num_tokens[mt.rows] - h.num_prompt_tokens[mt.rows]
            active = (num_output < mt.min_tokens)[mt.owner]
            if active.any():
                parts_b.append(mt.batch_index[active])
                parts_t.append(mt.token[active])
        if not parts_b:
            return None
        device = md.greedy_mask.device
        return _index(np.concatenate(parts_b), device), _index(np.concatenate(parts_t), device)

    # ------------------------------------------------------------------ random rows

    def _random_dists(self, logits: torch.Tensor, md: SamplingMetadata) -> list[_Dist]:
        dists: list[_Dist] = []
        for g in md.groups:
            x = logits if g.whole else logits[g.index]
            if g.kind == "candidates":
                dists.append(self._candidates(x, g))
            elif g.kind == "prefilter":
                dists.extend(self._prefilter(x, g))
            else:
                dists.append(self._full(x, g))
        return dists

    @staticmethod
    def _filter_sorted(probs: torch.Tensor, min_p: torch.Tensor | None, top_p: torch.Tensor | None,
                       normalised: bool = False) -> torch.Tensor:
        """min_p then top_p on probabilities sorted in descending order (zeros where cut).

        `normalised`: the probabilities are already those of the whole distribution (the
        prefilter's), not to be renormalised over the columns before top_p.
        """
        if min_p is not None:
            probs = probs.masked_fill(probs < probs[:, :1] * min_p, 0.0)
        if top_p is not None:
            if not normalised:
                probs = probs / probs.sum(dim=-1, keepdim=True)
            # keep a token while the mass strictly above it is < top_p (the first always stays)
            above = probs.cumsum(dim=-1) - probs
            probs = probs.masked_fill(above >= top_p, 0.0)
        return probs

    def _candidates(self, x: torch.Tensor, g: _RandomGroup) -> _Dist:
        values, ids = x.topk(g.max_k, dim=-1)
        values = values / g.temperature
        if g.k_mask is not None:
            values = values.masked_fill(g.k_mask, _NEG_INF)
        probs = self._filter_sorted(values.softmax(dim=-1), g.min_p, g.top_p)
        return _Dist(g.index, probs, ids, g.generators, g.draw_k)

    def _prefilter(self, x: torch.Tensor, g: _RandomGroup) -> list[_Dist]:
        scaled = x / g.temperature
        values, ids = scaled.topk(g.max_k, dim=-1)
        probs = (values - torch.logsumexp(scaled, dim=-1, keepdim=True)).exp()  # under the full softmax
        inside = probs.sum(dim=-1) >= g.top_p[:, 0] + _PREFILTER_MARGIN
        if bool(inside.all()):
            return [_Dist(g.index, self._filter_sorted(probs, None, g.top_p, normalised=True), ids, g.generators)]
        sel = torch.nonzero(inside)[:, 0]
        rest = torch.nonzero(~inside)[:, 0]
        out = []
        sel_l, rest_l = sel.tolist(), rest.tolist()
        if sel_l:
            gens = {j: g.generators[i] for j, i in enumerate(sel_l) if i in g.generators}
            kept = self._filter_sorted(probs[sel], None, g.top_p[sel], normalised=True)
            out.append(_Dist(g.index[sel], kept, ids[sel], gens))
        gens = {j: g.generators[i] for j, i in enumerate(rest_l) if i in g.generators}
        full = _RandomGroup(kind="full", index=g.index[rest], whole=False, temperature=g.temperature[rest],
                            top_p=g.top_p[rest], generators=gens)
        out.append(self._full(x[rest], full))
        return out

    def _full(self, x: torch.Tensor, g: _RandomGroup) -> _Dist:
        x = x / g.temperature
        if g.min_p is not None:
            probs = x.softmax(dim=-1)
            x = x.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * g.min_p, _NEG_INF)
        if g.top_p is not None:
            x = self._top_k_top_p(x, g.top_k, g.top_p[:, 0])
        elif g.top_k is not None:
            x = self._top_k_only(x, g.top_k, g.max_k)
        return _Dist(g.index, x.softmax(dim=-1), None, g.generators)

    @staticmethod
    def _draw(dist: _Dist) -> torch.Tensor:
        """argmax(probs / q), q ~ Exp(1); a seeded row draws its q from its own generator."""
        probs = dist.probs
        q = torch.empty_like(probs)
        if len(dist.generators) < probs.shape[0]:
            exponential_(q)
        elif dist.draw_k is not None:
            q.fill_(1.0)  # columns past a seeded row's own k have probability 0: any q > 0 will do
        for i, gen in dist.generators.items():
            k = dist.draw_k[i] if dist.draw_k is not None else probs.shape[1]
            if gen.device == q.device:
                exponential_(q[i, :k], gen)
            else:
                q[i, :k] = exponential_(torch.empty(k, dtype=q.dtype, device=gen.device), gen).to(q.device)
        choice = probs.div_(q).argmax(dim=-1)
        return choice if dist.ids is None else dist.ids.gather(1, choice[:, None])[:, 0]

    @staticmethod
    def _top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
        # topk with the largest k in use, then each row's own k-th value as its threshold: no
        # full sort. Rows without top_k (k = vocab) keep everything.
        values = logits.topk(max_k, dim=-1).values
        kth = values.gather(1, (top_k.clamp(max=max_k) - 1)[:, None])
        kth = kth.masked_fill((top_k >= logits.shape[-1])[:, None], _NEG_INF)
        return logits.masked_fill(logits < kth, _NEG_INF)

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        vocab = logits.shape[-1]
        if top_k is not None:
            kth = sorted_logits.gather(1, (vocab - top_k.clamp(max=vocab))[:, None])
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p)[:, None]
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def gather_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, ks: np.ndarray) -> list[pb.TokenLogprobs | None]:
    """Per row: the logprob and rank of `token_ids[row]` under `raw` (log-softmaxed logits),
    plus the top `ks[row]` ids (None for rows with ks < 0). Shared by sampled-token and
    prompt logprobs."""
    max_k = int(ks.max())
    chosen_lp = raw.gather(1, token_ids[:, None])
    ranks = (raw > chosen_lp).sum(dim=-1) + 1
    top_lp, top_ids = raw.topk(max_k, dim=-1) if max_k > 0 else (raw[:, :0], token_ids[:, None][:, :0])
    chosen_lp, ranks = chosen_lp[:, 0].tolist(), ranks.tolist()
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    out: list[pb.TokenLogprobs | None] = []
    for i, k in enumerate(ks.tolist()):
        if k < 0:
            out.append(None)
            continue
        out.append(pb.TokenLogprobs(logprob=chosen_lp[i], rank=ranks[i],
                                    top_ids=top_ids[i][:k], top_logprobs=top_lp[i][:k]))
    return out
