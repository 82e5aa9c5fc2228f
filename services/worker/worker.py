"""The worker's protocol surface: the calls of proto `Worker`, as plain methods.

The gRPC servicer and the in-process executor both call these, so the offline `LLM`
and the service mesh run exactly the same code.
"""

from __future__ import annotations

import gc
import logging
import time

from services.common.config import VllmConfig, kv_tier_medium
from services.common.kv_transfer_config import KVTransferConfig
from services.common.proto import myvllm_pb2 as pb
from services.worker.cpu.malloc_tuning import release_freed_memory
from services.worker.kv_connector import KVConnectorWorker, make_connector, model_id
from services.worker.kv_segment import KVLayout
from services.worker.kv_tier import FileTier, HostTier, KVTier, default_tier_dir, tier_capacity_bytes
from services.worker.model_runner import ModelRunner
from services.worker.step_validation import InvalidStep

logger = logging.getLogger("myvllm.worker")

MAX_INT32 = 2**31 - 1


def weights_key(req: pb.LoadModelRequest) -> bytes:
    """What the loaded weights depend on: a LoadModel that changes none of it keeps them (a
    reconnecting scheduler, or one that only sizes the batch). A new TP/PP rank, group size or
    rendezvous means new shards and a new process group: a reload. So does turning LoRA on or
    resizing it (the slot table is built with the model): a key only while enable_lora is set, so
    a LoadModel without LoRA keeps the weights whatever its LoRA defaults."""
    c = req.config
    key = pb.LoadModelRequest(tensor_parallel_rank=req.tensor_parallel_rank,
                              pipeline_parallel_rank=req.pipeline_parallel_rank,
                              data_parallel_rank=req.data_parallel_rank,
                              distributed_init_method=req.distributed_init_method,
                              config=pb.VllmConfig(model_config=c.model_config, parallel_config=c.parallel_config,
                                                   speculative_config=c.speculative_config
                                                   if c.HasField("speculative_config") else None,
                                                   lora_config=c.lora_config if c.lora_config.enable_lora else None))
    return key.SerializeToString(deterministic=True)


class Worker:
    def __init__(self, device: str | None = None, token: str | None = None) -> None:
        self.device = device
        self.token = token  # the mesh's internal token (GrpcConnector: presented to producers' workers)
        self.runner: ModelRunner | None = None
        self.info: pb.ModelInfo | None = None
        self._loaded_key: bytes | None = None
        # P/D disaggregation: the KV connector's settings, and its transport once the cache exists;
        # or the KV tier (--kv-offloading-size), which takes the connector's place.
        self.kv_transfer_config: KVTransferConfig | None = None
        self.kv_connector: KVConnectorWorker | KVTier | None = None
        self.data_parallel_rank = 0

    def load_model(self, req: pb.LoadModelRequest) -> pb.ModelInfo:
        """Load the weights, unless the same weights are already loaded (then only the batch
        size changes). The answer carries the configuration as loaded."""
        c = req.config
        max_num_seqs = c.scheduler_config.max_num_seqs
        self.kv_transfer_config = KVTransferConfig.from_proto(c.kv_transfer_config) \
            if c.HasField("kv_transfer_config") else None
        self.data_parallel_rank = req.data_parallel_rank
        if self.runner is not None and self._loaded_key == weights_key(req):
            if self.runner.max_num_seqs != max_num_seqs:
                self.runner.set_max_num_seqs(max_num_seqs)
            self.info.config.CopyFrom(c)
            return self.info
        started = time.monotonic()
        if self.runner is not None:  # another model: the old one's objects must be collectable again
            self.runner = None
            gc.unfreeze()
            gc.collect()
        self.runner = ModelRunner(VllmConfig.from_proto(c), tensor_parallel_rank=req.tensor_parallel_rank,
                                  pipeline_parallel_rank=req.pipeline_parallel_rank,
                                  data_parallel_rank=req.data_parallel_rank,
                                  distributed_init_method=req.distributed_init_method, device=self.device)
        r = self.runner
        self._loaded_key = weights_key(req)
        self.info = pb.ModelInfo(model=r.model_dir, max_model_len=r.max_model_len, vocab_size=r.vocab_size,
                                 eos_token_ids=r.eos_token_ids, dtype=str(r.dtype).removeprefix("torch."),
                                 device=r.device.type, attention_backend=r.attn_backend.name, config=c,
                                 hidden_size=int(r.config.hidden_size), is_matryoshka=r.is_matryoshka,
                                 matryoshka_dimensions=r.matryoshka_dimensions)
        # What loading built (hundreds of thousands of objects: modules, tokenizer tables) lives as
        # long as the model: out of the collector's sight, so that a full pass during serving does
        # not walk it and stall a step. vLLM's engine core freezes its start-up heap the same way.
        gc.collect()
        gc.freeze()
        logger.info("loaded %s in %.1fs: dtype %s on %s, attention backend %s, cudagraph mode %s", r.model_dir,
                       time.monotonic() - started, self.info.dtype, self.info.device, self.info.attention_backend,
                       r.cudagraph_mode)
        return self.info

    def get_kv_capacity(self, req: pb.KVCapacityRequest) -> pb.KVCapacity:
        r = self._loaded()
        # (the latest LoadModel's cache part: the scheduler's, which a preloaded worker adopts)
        num_blocks = r.num_blocks_for_budget(req.block_size, req.kv_cache_memory_bytes or None,
                                             self.info.config.cache_config.gpu_memory_utilization or None)
        return pb.KVCapacity(num_blocks=min(num_blocks, MAX_INT32),  # a budget in petabytes must not overflow
                             bytes_per_block=r.kv_bytes_per_block(req.block_size))

    def init_kv_cache(self, req: pb.InitKVCacheRequest) -> pb.Empty:
        runner = self._loaded()
        self._close_kv_connector()  # (its transfers would write into the old cache)
        runner.init_kv_cache(req.num_blocks, req.block_size)
        cache = self.info.config.cache_config
        if self.kv_transfer_config is not None or cache.kv_offloading_size > 0:
            layers = runner.model.attention_layers()
            kv_dtype = layers[0].kv_cache.dtype
            layout = KVLayout(model_id=model_id(runner.model_dir, kv_dtype), dtype=kv_dtype, num_layers=len(layers),
                              block_size=req.block_size, num_kv_heads=layers[0].num_kv_heads,
                              head_dim=layers[0].head_dim)
            caches = [layer.kv_cache for layer in layers]
            if self.kv_transfer_config is not None:
                self.kv_connector = make_connector(self.kv_transfer_config, layout, caches, self.token)
            elif kv_tier_medium(caches[0].device.type, cache.kv_offloading_dir) == "CPU":
                self.kv_connector = HostTier(tier_capacity_bytes(cache.kv_offloading_size), layout, caches)
            else:
                directory = cache.kv_offloading_dir or default_tier_dir(layout.model_id, req.block_size,
                                                                        self.data_parallel_rank)
                self.kv_connector = FileTier(directory, tier_capacity_bytes(cache.kv_offloading_size), layout, caches)
        return pb.Empty()

    def execute(self, so: pb.SchedulerOutput) -> pb.ModelRunnerOutput | None:
        """The step's output; None for a step that waits for its grammar bitmask (the output
        comes with the `grammar_bitmask_only` message that brings it). A KV connector starts the
        step's loads before its forward and its saves after it, and reports ended transfers."""
        runner, connector = self._loaded(), self.kv_connector
        meta = so.kv_connector_metadata if so.HasField("kv_connector_metadata") else None
        if meta is not None:
            if connector is None:
                raise InvalidStep("kv_connector_metadata", "this worker has no KV connector (--kv-transfer-config) "
                                  "or KV tier (--kv-offloading-size)")
            connector.check(meta)
            connector.start_loads(meta)
        out = runner.execute(so)
        if meta is not None and (meta.saves or meta.store_block_ids):
            failed = {f.request_id for f in out.lora_load_failures} if out is not None else set()
            connector.start_saves(meta, frozenset(b for r in so.new_requests if r.request_id in failed
                                                  for b in r.block_ids))
        if out is not None and connector is not None:
            connector.report(out)
        return out

    def reset_batch(self) -> None:
        """Forget every request (a new scheduler stream, or after a failed step), and every transfer."""
        if self.runner is not None and self.runner.input_batch is not None:
            self.runner.reset_batch()
        if self.kv_connector is not None:
            self.kv_connector.reset()

    def _close_kv_connector(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.close()
            self.kv_connector = None

    def close(self) -> None:
        """Drop the model and its KV cache, and hand the freed memory back to the OS (an offline
        `LLM` closed in a long-lived process; ParallelWorkers stops its rank processes here)."""
        self._close_kv_connector()
        self.runner = None
        self.info = None
        gc.unfreeze()  # load_model froze them
        gc.collect()  # the model's modules refer to each other: free them now, not at some later pass
        release_freed_memory()

    def _loaded(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("LoadModel must be called first")
        return self.runner
