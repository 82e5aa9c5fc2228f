"""The scheduler's side of the worker's LoRA slot table (--max-loras slots): which adapter each
slot holds and how many running requests use it. A request gets its adapter's slot when it is
scheduled (the slot already holding the adapter, else a slot no running request uses, the least
recently used first, else it waits); it gives the slot up when it leaves the running set
(finished, aborted, preempted). A slot a running request uses is never given another adapter, so
the worker never sees a slot change under a request it holds."""

from __future__ import annotations

from services.common.proto import myvllm_pb2 as pb


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

    def forget(self) -> None:
        """The worker lost its state (restart): it holds no adapter any more."""
        self.held = [0] * self.max_loras
