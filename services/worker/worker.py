"""The worker's protocol surface: the calls of proto `Worker`, as plain methods.

The gRPC servicer and the in-process executor both call these, so the offline `LLM`
and the service mesh run exactly the same code.
"""

from __future__ import annotations

from services.common.proto import myvllm_pb2 as pb
from services.worker.model_runner import ModelRunner


class Worker:
    def __init__(self, device: str | None = None) -> None:
        self.device = device
        self.runner: ModelRunner | None = None

    def load_model(self, req: pb.LoadModelRequest) -> pb.ModelInfo:
        self.runner = ModelRunner(
            req.model, dtype=req.dtype or "auto", seed=req.seed, max_num_seqs=req.max_num_seqs or 256,
            max_model_len=req.max_model_len or None, attention_backend=req.attention_backend or None,
            device=self.device, compile_model=req.compile_model)
        r = self.runner
        return pb.ModelInfo(model=req.model, max_model_len=r.max_model_len, vocab_size=r.vocab_size,
                            eos_token_ids=r.eos_token_ids, dtype=str(r.dtype).removeprefix("torch."),
                            device=r.device.type)

    def get_kv_capacity(self, req: pb.KVCapacityRequest) -> pb.KVCapacity:
        r = self._loaded()
        return pb.KVCapacity(num_blocks=r.num_blocks_for_budget(req.block_size, req.kv_cache_memory_bytes or None),
                             bytes_per_block=r.kv_bytes_per_block(req.block_size))

    def init_kv_cache(self, req: pb.InitKVCacheRequest) -> pb.Empty:
        self._loaded().init_kv_cache(req.num_blocks, req.block_size)
        return pb.Empty()

    def execute(self, so: pb.SchedulerOutput) -> pb.ModelRunnerOutput:
        return self._loaded().execute(so)

    def _loaded(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("LoadModel must be called first")
        return self.runner
