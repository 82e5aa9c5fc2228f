"""Prefill/decode disaggregation at the gateway: the prefill half of a request.

With prefill replicas (`--kv-transfer-config` kv_producer, `serve --prefill-replicas P`) and decode
replicas (kv_consumer) behind one gateway, a request whose decode replica loads remote KV is
first sent to a prefill replica, picked by the routing policy among those (cache-aware: by its
prompt's cached prefix), as vLLM's proxy does: the same prompt with `max_tokens` 1 and
`do_remote_decode`. That replica computes the prompt, saves its full blocks to a segment, and ends
the request with `kv_transfer_params` naming it; the decode replica then gets the client's request
with those params (`do_remote_prefill`), loads the blocks instead of computing them, and samples
every token the client sees (the prefill's one token is dropped: sampling settings, seeds,
logprobs and stops all apply on the decode replica alone).

Whatever goes wrong on the prefill side costs time, never the request: no prefill replica up, one
that fails or is refused, or params that name nothing all mean the decode replica computes the
prompt itself (a segment that cannot be read there, too: services/engine/kv_connector.py). A
prefill replica that is down is marked so and the next one tried first.
"""

from __future__ import annotations

import logging

from services.client.grpc_client import RequestRejected, SchedulerUnavailable
from services.common.proto import myvllm_pb2 as pb
from services.gateway.metrics import GatewayMetrics
from services.gateway.migration import ResumableRequest
from services.gateway.router import ReplicaRouter

logger = logging.getLogger(__name__)

# The prefill half: one greedy token (dropped), the prompt's KV saved for the decode replica.
PREFILL_SAMPLING = pb.SamplingParams(temperature=0.0, max_tokens=1)
PREFILL_PARAMS = pb.KVTransferParams(do_remote_decode=True)


def wants_remote_prefill(request: ResumableRequest) -> bool:
    """Whether the request may be prefilled elsewhere: not one resuming generated tokens, nor one
    asking for prompt logprobs (which the decode replica can only compute)."""
    return not request.output_token_ids and not request.sampling.HasField("prompt_logprobs")


async def remote_prefill(router: ReplicaRouter, request: ResumableRequest,
                         metrics: GatewayMetrics) -> pb.KVTransferParams | None:
    """Prefill `request`'s prompt on a prefill replica; the params its decode replica gets, or
    None: the decode replica computes the prompt itself (the outcome is counted in `metrics`)."""
    prompt = request.route_prompt()
    tried: set[str] = set()
    while True:
        try:
            replica = router.pick(exclude=tried, prompt=prompt, prefill=True)
        except SchedulerUnavailable:
            metrics.on_remote_prefill("no_prefill_replica" if not tried else "failed")
            return None
        final: pb.RequestOutput | None = None
        try:
            async for output in replica.client.generate(
                    request.prompt_token_ids, PREFILL_SAMPLING, request_id=f"{request.request_id}-prefill",
                    priority=request.priority, cache_salt=request.cache_salt, kv_transfer_params=PREFILL_PARAMS,
                    lora_request=request.lora_request):
                final = output
        except SchedulerUnavailable as e:
            router.mark_down(replica, e)
            tried.add(replica.address)
            logger.warning("prefill replica %s failed request %s: %s; trying another", replica.address,
                           request.request_id, e)
            continue
        except RequestRejected as e:
            if e.is_engine_failure:  # its engine failed (a worker that died): another may not
                tried.add(replica.address)
                logger.warning("prefill replica %s failed request %s: %s; trying another", replica.address,
                               request.request_id, e.message)
                continue
            logger.warning("prefill replica %s refused request %s: %s; the decode replica prefills it",
                           replica.address, request.request_id, e.message)
            metrics.on_remote_prefill("failed")
            return None
        params = final.kv_transfer_params if final is not None and final.HasField("kv_transfer_params") else None
        if params is None or not params.remote_handle:
            # (A prompt shorter than a block and a token has nothing to load.)
            metrics.on_remote_prefill("nothing_to_transfer")
            return None
        metrics.on_remote_prefill("transferred")
        return params
