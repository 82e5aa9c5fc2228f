"""Draft-model proposer: a second, smaller model with the same tokenizer, run by the worker with
its own paged KV cache under the target's block ids.

Every target forward is mirrored by the draft (same tokens, positions and slots), so the draft's
KV holds every position the target computed. After sampling, the draft runs k one-token steps
per proposing row from its last token. Positions of refused drafts hold stale draft KV, but
each is rewritten before any query reads it: the next proposal starts at the first of them,
and every later position is written by the step that reaches it. The scheduler allocates k
lookahead slots per step for these positions.

Drafts are drawn from the draft model's distribution processed exactly like the target's
(logit bias, temperature, top-k / top-p / min-p: the same `SamplingMetadata` stages), and
that distribution is kept for the rejection sampler, which needs p_draft of each draft.

Tensor parallelism: the draft is sharded over the TP ranks exactly like the target (load_model
builds this rank's shard), not replicated. vLLM does the same (its draft runs with the target's
TP size): each rank holds 1/T of the draft's weights and KV heads and the draft's layers
all-reduce like the target's, where a replicated draft would cost every rank the whole draft's
memory and compute and need its collectives switched off. The price: every rank must run the
same draft forwards on the same tokens, since each all-reduce sums the ranks' partial results.
The rows are the same on every rank (so is the persistent batch: rank 0's tokens are broadcast),
greedy drafts are the argmax of the same all-gathered logits, and random drafts come from
`self.generator`, seeded alike on every rank and consumed in lockstep (same rows, same shapes,
every round; reseeded with each KV cache, which every rank makes together) on the same
distributions: so every rank draws the same token at every draft step, with no collective per
step, and keeps the same draft probabilities. Once per proposal round rank 0's drafts [R, k]
are broadcast anyway (one small collective beside the round's k x (2 x layers + 2)): every
rank then holds rank 0's drafts whatever happened, and a rank whose own draws differed says so
(`num_rank_mismatches`, a warning). Nothing wider is broadcast: the probabilities are [R, k,
vocab] and only feed verification, whose result is rank 0's on every rank
(`verify_drafts(sync=...)`). So even ranks that computed differently (hardware that does not
compute bitwise alike) could only lower the acceptance rate, never change an output or let the
ranks' batches drift: rank 0 draws each draft from the distribution it keeps for verification.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from services.common.spec_config import SpeculativeConfig
from services.worker.attention.base import AttentionMetadata, forward_context
from services.worker.exponential import exponential_
from services.worker.kv_memory import zeroed_kv_cache
from services.worker.models.fast_paths import pack_for_cpu
from services.worker.models.load import load_model
from services.worker.parallel import broadcast_from_first, get_tp
from services.worker.sampling_metadata import build_sampling_metadata
from services.worker.spec_decode.proposer import SpecProposer, TargetRunner

logger = logging.getLogger(__name__)


class DraftModelProposer(SpecProposer):
    def __init__(self, config: SpeculativeConfig, runner: TargetRunner) -> None:
        super().__init__(config, runner)
        self.k = config.num_speculative_tokens
        try:  # this rank's shard, like the target's (see the module docstring)
            self.model, draft_config = load_model(config.model, runner.dtype, runner.device, progress=False)
        except ValueError as e:  # e.g. a TP size its heads do not split by: name the draft
            raise ValueError(f"speculative_config.model {config.model}: {e}") from e
        if draft_config.vocab_size != runner.vocab_size:
            raise ValueError(f"speculative_config.model {config.model} has vocab size {draft_config.vocab_size}, "
                             f"the target {runner.vocab_size}: a draft model must share the target's tokenizer")
        if runner.device.type == "cpu":
            pack_for_cpu(self.model)
        # Row -> [n, vocab] distributions its last proposal drew from (random rows only).
        self.probs: dict[int, torch.Tensor] = {}
        # The random drafts' own stream: the same on every TP rank (see the module docstring),
        # and not the global generator, which rank 0's process may also draw from elsewhere.
        self.generator = torch.Generator(device=runner.device)
        self._reseed()
        # Proposal rounds in which this rank's own drafts differed from rank 0's (TP ranks > 0).
        self.num_rank_mismatches = 0

    def _reseed(self) -> None:
        # Derived from the engine seed, not equal to it: the global generator starts from that
        # seed, and the drafts' noise must not repeat the target sampler's.
        self.generator.manual_seed((self.runner.seed * 0x9E3779B1 + 0x5EED) % (1 << 63))

    # ------------------------------------------------------------------ KV cache

    def kv_bytes_per_block(self, block_size: int) -> int:
        layers = self.model.attention_layers()
        per_token = 2 * layers[0].num_kv_heads * layers[0].head_dim * self.runner.dtype.itemsize
        return per_token * block_size * len(layers)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        for layer in self.model.attention_layers():
            layer.kv_cache = None
        for layer in self.model.attention_layers():
            layer.kv_cache = zeroed_kv_cache((2, num_blocks, block_size, layer.num_kv_heads, layer.head_dim),
                                             self.runner.dtype, self.runner.device)
        self.probs.clear()
        self._reseed()  # every rank at once (also when a failed group is set up again)

    # ------------------------------------------------------------------ per step

    def observe_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                     hidden: torch.Tensor) -> None:
        with forward_context(self.runner.attn_backend, meta):
            self.model(input_ids, positions)

    def draft_probs(self, rows: np.ndarray, num_draft: np.ndarray) -> torch.Tensor | None:
        if not any(r in self.probs for r in rows.tolist()):
            return None  # every verified row is greedy
        out = torch.zeros((rows.size, int(num_draft.max()), self.runner.vocab_size), device=self.runner.device)
        for i, (row, n) in enumerate(zip(rows.tolist(), num_draft.tolist(), strict=True)):
            probs = self.probs.get(row)
            if probs is not None:
                out[i, :n] = probs[:n]
        return out

    @torch.inference_mode()
    def propose_rows(self, rows: list[int]) -> list[list[int]]:
        runner, batch = self.runner, self.runner.input_batch
        bs, dev = runner.block_size, runner.device
        for row in rows:
            self.probs.pop(row, None)
        rows_np = np.asarray(rows, dtype=np.int64)
        # Never propose a draft whose bonus token would fall past max_model_len.
        num = np.minimum(self.k, batch.max_model_len - batch.num_tokens[rows_np] - 1)
        rows_np, num = rows_np[num > 0], num[num > 0]
        drafts: dict[int, list[int]] = {}
        if rows_np.size == 0:
            return [[] for _ in rows]
        md = build_sampling_metadata([batch.sampling[r] for r in rows_np.tolist()], {}, runner.vocab_size, dev,
                                     rows=rows_np, history=batch, eos_token_ids=runner.eos_token_ids)
        random_idx = torch.nonzero(~md.greedy_mask)[:, 0]
        positions = batch.num_tokens[rows_np] - 1
        tokens = torch.from_numpy(batch.token_ids[rows_np, positions].astype(np.int64)).to(dev)
        qsl = np.arange(rows_np.size + 1)
        steps: list[torch.Tensor] = []
        step_probs: list[torch.Tensor] = []
        for _ in range(int(num.max())):
            pos = np.minimum(positions, batch.max_model_len - 1)  # rows already done write harmlessly in place
            slots = batch.block_table[rows_np, pos // bs].astype(np.int64) * bs + pos % bs
            max_blocks = int(pos.max() // bs + 1)
            meta = AttentionMetadata.from_host(slots, qsl, pos + 1, pos, batch.block_table[rows_np, :max_blocks],
                                               bs, dev)
            meta.backend_data = runner.attn_backend.prepare(meta)
            with forward_context(runner.attn_backend, meta):
                hidden = self.model(tokens, torch.from_numpy(pos).to(dev))
            argmax, probs = runner.sampler.target_distributions(self.model.compute_logits(hidden), md)
            tokens = argmax
            if probs is not None and random_idx.numel():
                p = probs[random_idx]
                tokens = argmax.clone()
                tokens[random_idx] = p.div(exponential_(torch.empty_like(p), self.generator)).argmax(dim=-1)
                step_probs.append(p)
            steps.append(tokens)
            positions = positions + 1
        drafted = torch.stack(steps, dim=1)  # [R, max num]
        if get_tp().size > 1:
            drafted = self._rank_zero_drafts(drafted)
        drafted = drafted.cpu().numpy()
        for i, (row, n) in enumerate(zip(rows_np.tolist(), num.tolist(), strict=True)):
            drafts[row] = drafted[i, :n].tolist()
        if step_probs:
            stacked = torch.stack(step_probs, dim=1)  # [random rows, steps, vocab]
            for j, i in enumerate(random_idx.tolist()):
                self.probs[int(rows_np[i])] = stacked[j]
        return [drafts.get(r, []) for r in rows]

    def _rank_zero_drafts(self, drafted: torch.Tensor) -> torch.Tensor:
        """Rank 0's drafts on every TP rank: one collective per proposal round. They are this
        rank's own unless the ranks computed differently (see the module docstring)."""
        own = drafted.clone() if get_tp().rank else None
        drafted = broadcast_from_first(drafted.contiguous())
        if own is not None and not torch.equal(own, drafted):
            self.num_rank_mismatches += 1
            if self.num_rank_mismatches & (self.num_rank_mismatches - 1) == 0:  # 1st, 2nd, 4th, ... time
                logger.warning("tensor-parallel rank %d drew other drafts than rank 0 (%d proposal rounds so far); "
                               "rank 0's are used: outputs stay exact, acceptance may drop",
                               get_tp().rank, self.num_rank_mismatches)
        return drafted
