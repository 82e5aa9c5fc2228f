"""The scheduler's side of the worker's LoRA slot table (--max-loras slots): which adapter each
slot holds and how many running requests use it. A request gets its adapter's slot when it is
scheduled (the slot already holding the adapter, else a slot no running request uses, the least
recently used first, else it waits); it gives the slot up when it leaves the running set
(finished, aborted, preempted). A slot a running request uses is never given another adapter, so
the worker never sees a slot change under a request it holds."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from services.common.message_limits import MAX_ERROR_CHARS
from services.common.proto import myvllm_pb2 as pb
from services.engine.request import Request, RequestStatus


class LoraSlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.held: list[int] = [0] * max_loras    # lora_int_id per slot, 0 = none
        self.users: list[int] = [0] * max_loras   # running requests using each slot
        self.last_used: list[int] = [0] * max_loras
        self._clock = 0

    def acquire(self, lora: pb.LoRARequest) -> int | None:
        """A slot holding `lora` for one more running request, or None (every slot is in use by
        other adapters: the request waits)."""
        self._clock += 1
        if lora.lora_int_id in self.held:
            slot = self.held.index(lora.lora_int_id)
        else:
            free = [s for s in range(self.max_loras) if self.users[s] == 0]
            if not free:
                return None
            slot = min(free, key=lambda s: (self.held[s] != 0, self.last_used[s]))  # empty first, then LRU
            self.held[slot] = lora.lora_int_id
        self.users[slot] += 1
        self.last_used[slot] = self._clock
        return slot

    def release(self, slot: int) -> None:
        """A request using `slot` left the running set; the slot keeps its adapter until another
        adapter needs it (its last use now: the least recently used slot goes first)."""
        if self.users[slot] <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        self.users[slot] -= 1
        self._clock += 1
        self.last_used[slot] = self._clock

    def take(self, request: Request) -> bool:
        """Give a request being scheduled its adapter's slot (if it has an adapter and holds none
        yet); False: no slot is free for it, it waits."""
        if request.lora_request is not None and request.lora_slot is None:
            request.lora_slot = self.acquire(request.lora_request)
            return request.lora_slot is not None
        return True

    def give_back(self, request: Request) -> None:
        """The request left the running set (finished, aborted, preempted, not admitted)."""
        if request.lora_slot is not None:
            self.release(request.lora_slot)
            request.lora_slot = None

    def forget(self) -> None:
        """The worker lost its state (restart): it holds no adapter any more."""
        self.held = [0] * self.max_loras


def lora_adapters(running: Iterable[Request], waiting: Iterable[Request]) -> tuple[list[str], list[str]]:
    """The adapters (names) of running and of waiting requests: vLLM's lora_requests_info."""
    def names(requests: Iterable[Request]) -> list[str]:
        return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})
    return names(running), names(waiting)


def fail_lora_loads(failures: Iterable[pb.LoRALoadFailure], scheduler: Any) -> list[pb.RequestOutput]:
    """Requests the worker left out of a step because their adapter could not be read (the worker
    never held them): each ended with the error, a 400 (the adapter named is not servable). The
    blocks the step was to fill hold no KV: their hashes are dropped before the blocks are freed
    (the prefix hits before them stay). `scheduler`: services/engine/scheduler.py's."""
    outputs = []
    for failure in failures:
        request = scheduler.requests.get(failure.request_id)
        if request is None or request.status != RequestStatus.RUNNING:
            continue
        scheduler.worker_known.discard(request.request_id)
        scheduler.kv_cache_manager.uncache_blocks_from(request, max(request.num_cached_tokens, 0)
                                                       // scheduler.block_size)
        scheduler.running.remove(request)
        scheduler._finish(request, RequestStatus.FINISHED_ABORTED)
        error = f"LoRA adapter {request.lora_request.lora_name!r} could not be loaded: {failure.error}"
        outputs.append(pb.RequestOutput(request_id=request.request_id, finish_reason="abort", stop_token_id=-1,
                                        num_prompt_tokens=request.num_prompt_tokens, error_kind=pb.INVALID_REQUEST,
                                        error=error[:MAX_ERROR_CHARS]))
    return outputs
