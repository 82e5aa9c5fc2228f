"""HuggingFace transformers reference outputs (fp32, CPU) to check the engine against.

``from hf_reference import hf_greedy, hf_logprobs`` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def load_hf_model(model_dir: str):
    """The HF model for ``model_dir`` in fp32 eval mode, cached per directory."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model


@functools.lru_cache(maxsize=8)
def load_hf_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


@torch.inference_mode()
def hf_greedy(
    model_dir: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    ignore_eos: bool = True,
) -> list[list[int]]:
    """Greedy continuation of each prompt (one at a time, no padding); returns only the generated ids.

    With ``ignore_eos`` (default) exactly ``max_new_tokens`` ids come back per prompt: EOS is neither
    suppressed nor a stop, it is just another token (vLLM's ``ignore_eos`` semantics). With
    ``ignore_eos=False`` generation stops after the first EOS (which is included in the output).

    This is a plain argmax loop over the HF model's forward with its KV cache (prefill, then one token
    per step), i.e. what ``generate(do_sample=False)`` does, minus generate()'s habit of re-filling
    ``eos_token_id`` from the model config, which made "don't stop at EOS" impossible to express.
    """
    model = load_hf_model(str(model_dir))
    eos_ids = set(_eos_ids(model))

    outputs: list[list[int]] = []
    for prompt in prompts:
        if not prompt:
            raise ValueError("hf_greedy: empty prompt")
        new: list[int] = []
        input_ids = torch.tensor([list(prompt)], dtype=torch.long)
        cache = None
        pos = 0
        while len(new) < max_new_tokens:
            n = input_ids.shape[1]
            # transformers 5.24 names the KV cache `cache` (``past_key_values`` is deprecated).
            out = model(
                input_ids=input_ids,
                position_ids=torch.arange(pos, pos + n).unsqueeze(0),
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.cache
            pos += n
            tok = int(out.logits[0, -1].argmax())
            new.append(tok)
            if not ignore_eos and tok in eos_ids:
                break
            input_ids = torch.tensor([[tok]], dtype=torch.long)
        outputs.append(new)
    return outputs


# hf_greedy_batched pads a group's prompts to its longest one: a prompt joins the group of the
# shorter ones while it is at most this many tokens longer than the group's shortest.
PADDING_BUDGET = 256


@torch.inference_mode()
def hf_greedy_batched(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """hf_greedy with ignore_eos, but prompts of similar length run as one left-padded batch (an
    attention mask, positions counted from each prompt's first real token): HF's per-forward cost
    on a small CPU hardly grows with the batch, so SmolLM2's 16 x 64 tokens take 40 s, not 110.
    Ordinary HF batched inference; it matched the one-at-a-time loop on every SmolLM2 prompt of
    test_hf_equality (trained weights leave no near-ties for padding's rounding to flip)."""
    model = load_hf_model(str(model_dir))
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    groups: list[list[int]] = []
    for i in order:
        if not prompts[i]:
            raise ValueError("hf_greedy_batched: empty prompt")
        if groups and len(prompts[i]) - len(prompts[groups[-1][0]]) <= PADDING_BUDGET:
            groups[-1].append(i)
        else:
            groups.append([i])
    outputs: list[list[int]] = [[] for _ in prompts]
    for group in groups:
        longest = max(len(prompts[i]) for i in group)
        input_ids = torch.zeros(len(group), longest, dtype=torch.long)
        mask = torch.zeros(len(group), longest, dtype=torch.long)
        for row, i in enumerate(group):
            input_ids[row, longest - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, longest - len(prompts[i]):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = None
        for _ in range(max_new_tokens):
            out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache,
                        use_cache=True, logits_to_keep=1)
            cache = out.cache
            tokens = out.logits[:, -1].argmax(dim=-1)
            for row, i in enumerate(group):
                outputs[i].append(int(tokens[row]))
            input_ids = tokens[:, None]
            mask = torch.cat([mask, torch.ones(len(group), 1, dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1
    return outputs


@torch.inference_mode()
def hf_logprobs(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """``log_softmax`` of the HF logits at every position: float32 tensor of shape [len(token_ids), vocab].

    Row ``i`` is the distribution over the token *following* ``token_ids[i]``.
    """
    model = load_hf_model(str(model_dir))
    input_ids = torch.tensor([list(token_ids)], dtype=torch.long)
    logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)
