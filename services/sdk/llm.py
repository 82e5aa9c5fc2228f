"""The in-process offline `LLM`, vLLM-compatible: `LLM(model).generate(prompts, params)`.

It runs the engine (services/engine/: EngineCore and the one step loop the scheduler service
also runs) over workers in this process and its children (services/sdk/local_workers.py): the
same classes the service mesh runs, minus gRPC.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm import tqdm
from transformers import AutoTokenizer

from services.common.config import EngineConfig
from services.common.proto import myvllm_pb2 as pb
from services.common.sampling_params import SamplingParams, sampling_for_choice
from services.engine.engine_core import EngineCore
from services.engine.step_loop import StepLoop
from services.engine.worker_setup import set_up_workers
from services.sdk.local_workers import LocalWorkers
from services.sdk.outputs import CompletionOutput, Logprob, RequestOutput
from services.text.output_processor import ChoiceOutputProcessor
from services.text.tokenizer import Tokenizer
from services.worker.rank_workers import make_workers

PromptType = str | dict[str, Any]


class EngineFault(RuntimeError):
    """A step failed in the worker or the engine. Every request of the call was ended (all
    KV blocks freed, prefix cache dropped); the `LLM` is ready for the next call."""


class LLM:
    """An engine replica in this process.

    Engine arguments use vLLM's names: max_num_seqs, max_num_batched_tokens,
    max_model_len, block_size, enable_prefix_caching, num_gpu_blocks_override,
    kv_cache_memory_bytes, dtype, seed, scheduling_policy, attention_backend,
    tensor_parallel_size, pipeline_parallel_size (T x P ranks: rank 0 here, the rest as
    local processes; `close()` stops them).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.config = EngineConfig(model=model, **engine_args)
        self.worker = make_workers(self.config.tensor_parallel_size, self.config.pipeline_parallel_size)
        self._workers = LocalWorkers(self.worker, pipelined=self.config.pipeline_parallel_size > 1)
        self._loop = asyncio.new_event_loop()  # runs the set-up and the step loop, within each call
        try:
            info, num_blocks = self._run_coroutine(set_up_workers(self._workers, self.config))
        except BaseException:
            self.close()
            raise
        self.engine = EngineCore(self.config, info, num_blocks)
        self._workers.set_steps_in_flight(self.config.steps_in_flight)
        # Text, stop strings and bad words go through the gateway's pieces (services/text), so
        # offline and served completions of the same request read the same.
        self.text_tokenizer = Tokenizer(AutoTokenizer.from_pretrained(self.config.model),
                                        list(info.eos_token_ids), info.vocab_size)
        self.tokenizer = self.text_tokenizer.hf_tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel rank processes, if any (they also die with this process), and
        the grammar compiler (its helper process and threads)."""
        if getattr(self, "_workers", None) is not None:
            self._workers.close()
            self._loop.close()
        self.worker.close()
        if getattr(self, "engine", None) is not None:
            self.engine.structured_output.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ public API

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions; outputs come back in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        results: list[RequestOutput] = []
        children: dict[str, tuple[RequestOutput, CompletionOutput, ChoiceOutputProcessor]] = {}
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
                text, token_ids = self._tokenize_prompt(prompt)
                result = RequestOutput(request_id=str(next(self._ids)), prompt=text, prompt_token_ids=token_ids,
                                       prompt_logprobs=[] if sp.prompt_logprobs is not None else None)
                results.append(result)
                if sp.bad_words and not sp.bad_words_token_ids:
                    sp.bad_words_token_ids = self.text_tokenizer.bad_words_token_ids(sp.bad_words)
                for index in range(sp.n):
                    child = CompletionOutput(index=index, text="", token_ids=[],
                                             logprobs=[] if sp.logprobs is not None else None,
                                             cumulative_logprob=0.0 if sp.logprobs is not None else None)
                    result.outputs.append(child)
                    rid = f"{result.request_id}-{index}" if sp.n > 1 else result.request_id
                    msg = sampling_for_choice(sp.to_proto(self.engine.model_info.vocab_size), index)
                    if index > 0:
                        msg.ClearField("prompt_logprobs")  # the prompt is the same: choice 0 scores it
                    self.engine.add_request(pb.GenerateRequest(
                        request_id=rid, prompt_token_ids=token_ids, sampling=msg,
                        priority=priority[i] if priority else 0))
                    children[rid] = (result, child,
                                     ChoiceOutputProcessor(index, self.text_tokenizer, token_ids, sp))
        except BaseException:
            self.engine.abort(list(children))  # a bad prompt must not strand the ones before it
            raise
        self._run(children, results, use_tqdm)
        return results

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(conv, add_generation_prompt, chat_template)}
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, conversation: list[dict[str, str]], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                 chat_template=chat_template, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def stats(self) -> dict[str, float]:
        return self.engine.scheduler.stats()

    # ------------------------------------------------------------------ internals

    def _tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise TypeError("a prompt is a string or a dict with 'prompt' or 'prompt_token_ids'")

    def _run(self, children: dict, results: list[RequestOutput], use_tqdm: bool) -> None:
        pending = set(children)
        bar = tqdm(total=len(pending), desc="Processed prompts", disable=not use_tqdm or len(pending) < 2)

        def emit(outputs: list[pb.RequestOutput]) -> None:
            for out in outputs:
                if out.request_id not in pending:
                    continue
                result, child, processor = children[out.request_id]
                self._append(child, processor, out)
                if processor.index == 0:
                    result.num_cached_tokens = out.num_cached_tokens
                    if result.prompt_logprobs == [] and out.new_token_ids:  # asked for, not yet filled
                        result.prompt_logprobs = [None] + [
                            _logprob_entry(token_id, lp)
                            for token_id, lp in zip(result.prompt_token_ids[1:], out.prompt_logprobs, strict=True)]
                if child.finish_reason is not None:
                    if not out.finish_reason:  # a stop string ended it: free its blocks now
                        self.engine.abort([out.request_id])
                    pending.discard(out.request_id)
                    bar.update(1)

        steps = StepLoop(self.engine, self._workers, emit)
        try:
            self._run_coroutine(self._steps(steps, pending))
        except BaseException:
            self.engine.abort(list(pending))  # never leave blocks behind on an exception (Ctrl-C included)
            if self._workers.drain():  # a step nobody waited for failed: the same clean slate
                self._run_coroutine(steps.fail_all("engine step failed"))
            raise
        finally:
            bar.close()
        for result in results:
            result.finished = True

    async def _steps(self, steps: StepLoop, pending: set[str]) -> None:
        """Run engine steps until every request of the call has finished. A step that fails
        raises `EngineFault` after every request has been ended and the engine reset."""
        stalled = False
        try:
            while pending:
                before = len(pending)
                if await steps.run_while_busy() or len(pending) < before:
                    stalled = False
                    continue
                grammars = self.engine.compiling_grammars()
                if grammars:  # nothing runs until a grammar is compiled (or a row filled): wait for one
                    self.engine.structured_output.wait_for_any(grammars)
                    continue
                if stalled:
                    raise RuntimeError("the scheduler could not schedule any request (KV cache too small?)")
                stalled = True  # (a grammar may have become ready since that schedule: once more)
        except Exception as e:
            await steps.fail_all("engine step failed")
            raise EngineFault(f"engine step failed ({type(e).__name__}: {e}); every request of this call "
                              "was ended and the engine reset, the next call starts clean") from e

    def _run_coroutine(self, coroutine: Coroutine) -> Any:
        """Run `coroutine` on this LLM's event loop, here; from inside a running event loop (a
        notebook's, say) on a helper thread, since a thread runs one loop at a time."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self._loop.run_until_complete(coroutine)
        with ThreadPoolExecutor(max_workers=1) as helper:
            return helper.submit(self._loop.run_until_complete, coroutine).result()

    @staticmethod
    def _append(child: CompletionOutput, processor: ChoiceOutputProcessor, out: pb.RequestOutput) -> None:
        delta = processor.process(out)
        child.text += delta.text
        child.token_ids.extend(delta.token_ids)
        for token_id, lp in zip(delta.token_ids, delta.logprobs, strict=False):
            child.logprobs.append(_logprob_entry(token_id, lp))
            child.cumulative_logprob += lp.logprob
        if delta.finish_reason:
            child.finish_reason = delta.finish_reason
            child.stop_reason = delta.stop_reason


def _logprob_entry(token_id: int, lp: pb.TokenLogprobs) -> dict[int, Logprob]:
    """vLLM's per-position logprobs: the top-k ids by rank, plus the chosen token."""
    entry = {int(t): Logprob(v, rank=r + 1) for r, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True))}
    entry.setdefault(token_id, Logprob(lp.logprob, rank=lp.rank))
    return entry
