"""The in-process offline `LLM`, vLLM-compatible: `LLM(model).generate(prompts, params)`.

It runs the scheduler's EngineCore and a Worker in this process and hands each
SchedulerOutput to the worker directly: the same classes the service mesh runs, minus gRPC.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tqdm import tqdm
from transformers import AutoTokenizer

from services.common.config import EngineConfig
from services.common.proto import myvllm_pb2 as pb
from services.common.sampling_params import SamplingParams, sampling_for_choice
from services.scheduler.engine_core import EngineCore, choose_num_blocks, kv_capacity_request, load_model_request
from services.sdk.outputs import CompletionOutput, Logprob, RequestOutput
from services.text.output_processor import ChoiceOutputProcessor
from services.text.tokenizer import Tokenizer
from services.worker.rank_workers import make_workers

PromptType = str | dict[str, Any]


class EngineFault(RuntimeError):
    """A step failed in the worker or the engine. Every request of the call was ended (all
    KV blocks freed, prefix cache dropped); the `LLM` is ready for the next call."""


class _PipelineStep:
    """A step submitted to pipeline-parallel ranks: its answer is collected, in submit order,
    when asked for (so P steps can be on the stages at once)."""

    def __init__(self, workers) -> None:
        self.workers = workers

    def result(self) -> pb.ModelRunnerOutput:
        return self.workers.collect()


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
        try:
            info, num_blocks = self._start_worker()
        except BaseException:
            self.close()
            raise
        self.engine = EngineCore(self.config, info, num_blocks)
        # Text, stop strings and bad words go through the same services/text pieces as the gateway's, so offline
        # and served completions of the same request read the same.
        self.text_tokenizer = Tokenizer(AutoTokenizer.from_pretrained(self.config.model),
                                                  list(info.eos_token_ids), info.vocab_size)
        self.tokenizer = self.text_tokenizer.hf_tokenizer
        self._ids = itertools.count()
        # Async scheduling computes on this thread while the caller schedules the next step.
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llm-compute")

    def _start_worker(self) -> tuple[pb.ModelInfo, int]:
        """Load the model on the worker (every TP rank) and size its KV cache: (model info, blocks)."""
        info = self.worker.load_model(load_model_request(self.config))
        capacity = self.worker.get_kv_capacity(kv_capacity_request(self.config))
        num_blocks = choose_num_blocks(self.config, capacity, info.max_model_len)
        self.worker.init_kv_cache(pb.InitKVCacheRequest(num_blocks=num_blocks, block_size=self.config.block_size))
        return info, num_blocks

    def close(self) -> None:
        """Stop the tensor-parallel rank processes, if any (they also die with this process), and
        the grammar compiler (its helper process and threads)."""
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
        steps = self._steps()
        try:
            while pending:
                for out in next(steps):
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
        except BaseException:
            self.engine.abort(list(pending))  # never leave blocks behind on an exception
            raise
        finally:
            steps.close()
            bar.close()
        for result in results:
            result.finished = True

    def _submit(self, so: pb.SchedulerOutput) -> Future | _PipelineStep | pb.ModelRunnerOutput:
        """Start a step: on the pipeline's stages, on the compute thread (async scheduling), or
        here and now."""
        if self.config.pipeline_parallel_size > 1:
            self.worker.submit(so)
            return _PipelineStep(self.worker)
        if self.config.steps_in_flight > 1:
            return self._compute.submit(self.worker.execute, so)
        return self.worker.execute(so)

    def _steps(self) -> Iterator[list[pb.RequestOutput]]:
        """Run engine steps, yielding each step's outputs.

        With async scheduling two steps are in flight: step N+1 is scheduled (with output
        placeholders) while the worker thread still computes step N; with P pipeline stages, P
        steps. A step that fails raises `EngineFault` after every request has been ended and
        the engine reset.
        """
        depth = self.config.steps_in_flight
        in_flight: deque[tuple[pb.SchedulerOutput, Future | _PipelineStep | pb.ModelRunnerOutput]] = deque()
        stalled = False
        try:
            while True:
                try:
                    while len(in_flight) < depth and self.engine.has_unfinished_requests():
                        so = self.engine.schedule()
                        if not so.num_scheduled_tokens:
                            break
                        in_flight.append((so, self._submit(so)))
                        stalled = False
                    if not in_flight:
                        grammars = self.engine.compiling_grammars()
                        if not grammars and not self.engine.scheduler.failed_outputs:
                            if stalled:
                                raise RuntimeError("the scheduler could not schedule any request (KV cache too "
                                                   "small?)")
                            stalled = True  # (a grammar may have become ready since that schedule: once more)
                            continue
                        # Nothing runs until a grammar is compiled (or a row filled): wait for one.
                        self.engine.structured_output.wait_for_any(grammars)
                        yield self.engine.take_failed_outputs()
                        continue
                    so, result = in_flight.popleft()
                    if isinstance(result, (Future, _PipelineStep)):
                        result = result.result()
                    outputs = self.engine.process(so, result)
                    if in_flight and (followup := self.engine.grammar_followup(in_flight[0][0])) is not None:
                        # Async scheduling (a pipeline never has a step wait on tokens in flight): the next
                        # step waits on the compute thread for its constrained rows' bitmask.
                        next_so, forward = in_flight[0]
                        in_flight[0] = (next_so, self._compute.submit(self._complete, forward, followup))
                except Exception as e:
                    self._reset_after_fault(in_flight)
                    raise EngineFault(f"engine step failed ({type(e).__name__}: {e}); every request of this call "
                                      "was ended and the engine reset, the next call starts clean") from e
                yield outputs
        finally:
            if self._drain(in_flight):  # a step nobody waited for failed: same clean slate
                self._reset_after_fault(in_flight)

    def _complete(self, forward: Future, followup: pb.SchedulerOutput) -> pb.ModelRunnerOutput:
        """Send a deferred step its bitmask (its forward, queued before, has run: re-raise its error)."""
        forward.result()
        return self.worker.execute(followup)

    @staticmethod
    def _drain(in_flight: deque) -> bool:
        """Let the worker finish its queued steps before anyone touches its batch; whether
        any of them failed."""
        failed = False
        while in_flight:
            _, result = in_flight.popleft()
            if isinstance(result, Future) and result.exception() is not None:
                failed = True
            elif isinstance(result, _PipelineStep):
                try:
                    result.result()
                except Exception:  # noqa: BLE001 - any failure means: reset
                    failed = True
        return failed

    def _reset_after_fault(self, in_flight: deque) -> None:
        """After a failed step neither the worker's batch nor the KV a step was writing can be
        trusted: end every request (freeing all blocks), drop the prefix cache, empty the batch."""
        self._drain(in_flight)
        self.engine.fail_all("engine step failed")
        self.worker.reset_batch()

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
