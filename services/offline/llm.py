"""The in-process offline `LLM`, vLLM-compatible: `LLM(model).generate(prompts, params)`.

It runs the engine (services/engine/: EngineCore and the one step loop the scheduler service
also runs) over workers in this process and its children (services/offline/local_workers.py): the
same classes the service mesh runs, minus gRPC. With data_parallel_size D and
enable_expert_parallel (MoE models) it runs D engines as one expert-parallel group: each its own
requests (placed on the least loaded engine) and KV cache, their ranks one process group, their
step loops in lockstep (services/engine/step_loop.py).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from tqdm import tqdm

from services.common.config import VllmConfig
from services.common.kv_transfer_params import params_from_dict, params_to_dict
from services.common.lora_adapter_config import read_adapter_config
from services.common.lora_request import LoRARequest
from services.common.pooling_config import PoolingParams
from services.common.proto import myvllm_pb2 as pb
from services.common.rendezvous import RendezvousStore
from services.common.sampling_params import SamplingParams, sampling_for_choice
from services.engine.engine_core import EngineCore
from services.engine.step_loop import StepLoop
from services.engine.worker_setup import set_up_workers
from services.offline.local_workers import LocalWorkers
from services.offline.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from services.text.hf_tokenizer import load_hf_tokenizer
from services.text.output_processor import ChoiceOutputProcessor
from services.text.tokenizer import Tokenizer
from services.worker.rank_workers import ParallelWorkers, make_workers
from services.worker.worker import Worker

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
    local processes; `close()` stops them), enable_expert_parallel, data_parallel_size (with
    enable_expert_parallel: D engines of T ranks each, one expert-parallel group), enforce_eager,
    cuda_graph_sizes and cudagraph_mode (CUDA graphs for pure-decode steps; "static" runs their
    padded buffers eagerly on any device). `model` may be a .gguf file: its weights stay in their
    blocks (quantization "gguf"; "int8" quantizes an HF checkpoint's linear layers at load), its
    own tokenizer and chat template serve unless `tokenizer` names another (vLLM's argument).
    """

    def __init__(self, model: str | None = None, tokenizer: str | None = None, **engine_args: Any) -> None:
        self.config = c = VllmConfig.from_engine_args(model=model, **engine_args)
        if c.parallel_config.data_parallel_size > 1 and not c.expert_parallel_group:
            raise ValueError("LLM(data_parallel_size > 1) runs its engines as one expert-parallel group: add "
                             "enable_expert_parallel=True (MoE models); independent replicas are `myvllm serve "
                             "--data-parallel-size`")
        kv = c.kv_transfer_config
        if kv is not None and kv.crosses_hosts and kv.is_producer:
            raise ValueError(f"kv_transfer_config {kv.kv_connector} {kv.kv_role}: a producer serves its KV from its "
                             "worker's gRPC server, which an offline LLM has not: run it with `myvllm serve` (an "
                             "offline kv_consumer can fetch from one)")
        self._groups = self._make_rank_groups()
        self.worker = self._groups[0]
        self._handles = [LocalWorkers(group, pipelined=c.parallel_config.pipeline_parallel_size > 1,
                                      threaded=c.expert_parallel_group)
                         for group in self._groups]
        self._workers = self._handles[0]
        self._loop = asyncio.new_event_loop()  # runs the set-up and the step loop, within each call
        try:
            set_ups = self._run_coroutine(_gather(*(set_up_workers(h, c) for h in self._handles)))
        except BaseException:
            self.close()
            raise
        self.engines = [EngineCore(c, info, num_blocks) for info, num_blocks in set_ups]
        self.engine = self.engines[0]
        info = self.engine.model_info
        for handle in self._handles:
            handle.set_steps_in_flight(c.steps_in_flight)
        # Text, stop strings and bad words go through the gateway's pieces (services/text), so
        # offline and served completions of the same request read the same.
        self.text_tokenizer = Tokenizer(load_hf_tokenizer(self.config.model_config.model, tokenizer),
                                        list(info.eos_token_ids), info.vocab_size)
        self.tokenizer = self.text_tokenizer.hf_tokenizer
        self._ids = itertools.count()

    def _make_rank_groups(self) -> list[Worker | ParallelWorkers]:
        """One engine's ranks; or, for a data-parallel expert-parallel group, each engine's, all
        meeting at one store (engine 0's rank 0 in this process, every other rank a child)."""
        c, p = self.config, self.config.parallel_config
        if not c.expert_parallel_group:
            return [make_workers(p.tensor_parallel_size, p.pipeline_parallel_size)]
        store = RendezvousStore()
        return [ParallelWorkers(p.tensor_parallel_size, data_parallel_rank=rank, rendezvous=store, local=rank == 0)
                for rank in range(p.data_parallel_size)]

    def close(self) -> None:
        """Stop the model-parallel rank processes, if any (they also die with this process), and
        the grammar compilers (their helper processes and threads)."""
        for handle in getattr(self, "_handles", ()):
            handle.close()
        if getattr(self, "_loop", None) is not None:
            self._loop.close()
        for group in reversed(getattr(self, "_groups", ())):  # engine 0's, with this process's rank, last
            group.close()
        for engine in getattr(self, "engines", ()):
            engine.structured_output.close()

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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions; outputs come back in input order. `lora_request`: one adapter for
        every prompt or one per prompt (None: the base model), vLLM's LoRARequest."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests")
        for lora in {lora.lora_path: lora for lora in loras if lora is not None}.values():
            # The engine checks them too; a bad adapter is the caller's mistake, raised here before anything runs.
            read_adapter_config(lora.lora_path, self.config.lora_config.max_lora_rank)
        results: list[RequestOutput] = []
        children: dict[str, tuple[RequestOutput, CompletionOutput, ChoiceOutputProcessor]] = {}
        per_engine = [e.scheduler.num_waiting + e.scheduler.num_running for e in self.engines]
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
                text, token_ids = self._tokenize_prompt(prompt)
                result = RequestOutput(request_id=str(next(self._ids)), prompt=text, prompt_token_ids=token_ids,
                                       prompt_logprobs=[] if sp.prompt_logprobs is not None else None)
                results.append(result)
                if sp.bad_words and not sp.bad_words_token_ids:
                    sp.bad_words_token_ids = self.text_tokenizer.bad_words_token_ids(sp.bad_words)
                kv_params = params_from_dict((sp.extra_args or {}).get("kv_transfer_params"))
                for index in range(sp.n):
                    child = CompletionOutput(index=index, text="", token_ids=[],
                                             logprobs=[] if sp.logprobs is not None else None,
                                             cumulative_logprob=0.0 if sp.logprobs is not None else None)
                    result.outputs.append(child)
                    rid = f"{result.request_id}-{index}" if sp.n > 1 else result.request_id
                    msg = sampling_for_choice(sp.to_proto(self.engine.model_info.vocab_size), index)
                    if index > 0:
                        msg.ClearField("prompt_logprobs")  # the prompt is the same: choice 0 scores it
                    engine = min(range(len(self.engines)), key=per_engine.__getitem__)  # the least loaded
                    self.engines[engine].add_request(pb.GenerateRequest(
                        request_id=rid, prompt_token_ids=token_ids, sampling=msg,
                        priority=priority[i] if priority else 0, kv_transfer_params=kv_params,
                        lora_request=loras[i].to_proto() if loras[i] is not None else None))
                    per_engine[engine] += 1
                    children[rid] = (result, child,
                                     ChoiceOutputProcessor(index, self.text_tokenizer, token_ids, sp))
        except BaseException:
            self._abort(list(children))  # a bad prompt must not strand the ones before it
            raise
        self._run(children, results, use_tqdm)
        return results

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Embeddings of the prompts (an LLM built with runner="pooling"), in input order, through the
        same engine loop as `generate`: each prompt one prompt-only request, pooled by the worker."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        pooling = (pooling_params or PoolingParams()).to_proto()
        results: dict[str, EmbeddingRequestOutput] = {}
        per_engine = [e.scheduler.num_waiting + e.scheduler.num_running for e in self.engines]
        try:
            for prompt in prompts:
                text, token_ids = self._tokenize_prompt(prompt)
                rid = str(next(self._ids))
                engine = min(range(len(self.engines)), key=per_engine.__getitem__)  # the least loaded
                self.engines[engine].add_request(pb.GenerateRequest(request_id=rid, prompt_token_ids=token_ids,
                                                                    pooling=pooling))
                per_engine[engine] += 1
                results[rid] = EmbeddingRequestOutput(rid, token_ids, EmbeddingOutput([]), False, text)
        except BaseException:
            self._abort(list(results))
            raise

        def handle(out: pb.RequestOutput) -> bool:
            result = results[out.request_id]
            result.outputs.embedding = np.frombuffer(out.pooled_output, dtype="<f4").tolist()
            result.finished = bool(out.finish_reason)
            return result.finished

        self._drive(set(results), handle, use_tqdm)
        return list(results.values())

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(conv, add_generation_prompt, chat_template)}
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, conversation: list[dict[str, str]], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                 chat_template=chat_template, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def stats(self) -> dict[str, float]:
        """The scheduler's counters; a data-parallel group's summed over its engines (KV usage
        over all their blocks), with its dummy steps."""
        if len(self.engines) == 1:
            return self.engine.scheduler.stats()
        per_engine = [engine.scheduler.stats() for engine in self.engines]
        total = {k: (sum(s[k] for s in per_engine) if isinstance(v, (int, float)) else v)
                 for k, v in per_engine[0].items()}
        total["kv_cache_usage"] = 1.0 - total["num_free_blocks"] / max(total["num_total_blocks"], 1)
        total["num_dummy_steps"] = sum(engine.num_dummy_steps for engine in self.engines)
        return total

    def _abort(self, request_ids: list[str]) -> None:
        for engine in self.engines:
            engine.abort(request_ids)

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
        def handle(out: pb.RequestOutput) -> bool:
            result, child, processor = children[out.request_id]
            self._append(child, processor, out)
            if processor.index == 0:
                result.num_cached_tokens = out.num_cached_tokens
                if out.HasField("kv_transfer_params"):
                    result.kv_transfer_params = params_to_dict(out.kv_transfer_params)
                if result.prompt_logprobs == [] and out.new_token_ids:  # asked for, not yet filled
                    result.prompt_logprobs = [None] + [
                        _logprob_entry(token_id, lp)
                        for token_id, lp in zip(result.prompt_token_ids[1:], out.prompt_logprobs, strict=True)]
            if child.finish_reason is not None and not out.finish_reason:
                self._abort([out.request_id])  # a stop string ended it: free its blocks now
            return child.finish_reason is not None

        self._drive(set(children), handle, use_tqdm)
        for result in results:
            result.finished = True

    def _drive(self, pending: set[str], on_output: Callable[[pb.RequestOutput], bool], use_tqdm: bool) -> None:
        """Run engine steps until every request in `pending` has finished; `on_output` takes each of
        their outputs and says whether it finished the request."""
        bar = tqdm(total=len(pending), desc="Processed prompts", disable=not use_tqdm or len(pending) < 2)

        def emit(outputs: list[pb.RequestOutput]) -> None:
            for out in outputs:
                if out.request_id in pending and on_output(out):
                    pending.discard(out.request_id)
                    bar.update(1)

        loops = [StepLoop(engine, handle, emit) for engine, handle in zip(self.engines, self._handles, strict=True)]
        try:
            self._run_coroutine(self._waves(loops, pending) if len(loops) > 1 else self._steps(loops[0], pending))
        except EngineFault:
            self._abort(list(pending))  # (the engines were reset already)
            raise
        except BaseException:
            self._abort(list(pending))  # never leave blocks behind on an exception (Ctrl-C included)
            if len(loops) > 1:
                # Some engines may wait in an exchange the others will not join: stop their ranks,
                # and set the group up again.
                self._stop_children()
            if any([handle.drain() for handle in self._handles]) or len(loops) > 1:
                self._run_coroutine(self._fail_all(loops))  # a step nobody waited for failed: a clean slate
            raise
        finally:
            bar.close()

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

    async def _waves(self, loops: list[StepLoop], pending: set[str]) -> None:
        """A data-parallel expert-parallel group: waves of lockstep steps until every request of
        the call has finished (each wave ends when no engine has work left). A failed step ends
        every request and sets the whole group up again, then raises `EngineFault`."""
        try:
            while pending:
                if not any(loop.core.has_unfinished_requests() for loop in loops):
                    raise RuntimeError(f"{len(pending)} request(s) of this call are on no engine")
                for loop in loops:
                    loop.group_running = True  # every engine steps, dummy steps where it has nothing
                tasks = [asyncio.ensure_future(loop.run_while_busy()) for loop in loops]
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                if any(not task.cancelled() and task.exception() is not None for task in done):
                    self._stop_children()  # the others wait in an exchange with the failed one
                    await asyncio.wait(tasks)
                errors = [task.exception() for task in tasks if task.exception() is not None]  # (all retrieved)
                if errors:
                    raise errors[0]
        except Exception as e:
            await self._fail_all(loops)
            raise EngineFault(f"engine step failed ({type(e).__name__}: {e}); every request of this call "
                              "was ended and the engines set up again, the next call starts clean") from e

    def _stop_children(self) -> None:
        """Kill every child rank of a data-parallel group: a step blocked in an exchange with
        them fails instead of waiting for the group's timeout."""
        for group in self._groups:
            if isinstance(group, ParallelWorkers):
                group.stop_children()

    async def _fail_all(self, loops: list[StepLoop]) -> None:
        """Every engine's clean slate; a data-parallel group's ranks are set up again together
        (one process group: a rank that failed broke it for all)."""
        if len(loops) > 1:
            for group in self._groups:
                group.break_group()
        await asyncio.gather(*(loop.fail_all("engine step failed") for loop in loops))

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


async def _gather(*coroutines: Coroutine) -> list:
    """asyncio.gather on the loop that runs it (the engines of a group set up together)."""
    return await asyncio.gather(*coroutines)


def _logprob_entry(token_id: int, lp: pb.TokenLogprobs) -> dict[int, Logprob]:
    """vLLM's per-position logprobs: the top-k ids by rank, plus the chosen token."""
    entry = {int(t): Logprob(v, rank=r + 1) for r, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True))}
    entry.setdefault(token_id, Logprob(lp.logprob, rank=lp.rank))
    return entry
