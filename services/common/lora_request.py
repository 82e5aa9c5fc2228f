"""vLLM's `LoRARequest` (vllm.lora.request): the adapter a request runs with, for the offline
`LLM.generate(..., lora_request=...)`; its wire form is the proto `LoRARequest`."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.proto import myvllm_pb2 as pb


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: the adapter's name; lora_int_id: its id, >= 1, one per adapter (the two key the
    prefix cache); lora_path: its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name must not be empty")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError("LoRARequest.lora_path must name the adapter's directory")

    @property
    def adapter_id(self) -> int:  # vLLM's alias
        return self.lora_int_id

    def to_proto(self) -> pb.LoRARequest:
        return pb.LoRARequest(lora_name=self.lora_name, lora_int_id=self.lora_int_id, lora_path=self.lora_path)
