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


@torch.inference_mode()
def hf_logprobs(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """``log_softmax`` of the HF logits at every position: float32 tensor of shape [len(token_ids), vocab].

    Row ``i`` is the distribution over the token *following* ``token_ids[i]``.
    """
    model = load_hf_model(str(model_dir))
    input_ids = torch.tensor([list(token_ids)], dtype=torch.long)
    logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)
