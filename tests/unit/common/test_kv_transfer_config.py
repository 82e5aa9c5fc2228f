"""--kv-transfer-config (vLLM's kv_transfer_config) and a request's kv_transfer_params: parsed,
checked with clear messages, carried through VllmConfig, compared between scheduler and worker."""

from __future__ import annotations

import argparse

import pytest

from services.common.config import SHARED_PARTS, VllmConfig, config_mismatches
from services.common.kv_transfer_config import KVTransferConfig
from services.common.kv_transfer_params import params_from_dict, params_to_dict
from services.entrypoints.engine_args import add_engine_args, engine_kwargs

PRODUCER = {"kv_connector": "SharedMemoryConnector", "kv_role": "kv_producer"}


def test_parse_vllm_names_from_dict_and_json() -> None:
    c = KVTransferConfig.parse('{"kv_connector": "SharedMemoryConnector", "kv_role": "kv_both", '
                               '"kv_connector_extra_config": {"shm_dir": "/x", "segment_ttl_s": 5}}')
    assert (c.is_producer, c.is_consumer, c.shm_dir, c.segment_ttl_s) == (True, True, "/x", 5.0)
    assert KVTransferConfig.parse(PRODUCER).is_consumer is False
    assert KVTransferConfig.parse(None) is None


@pytest.mark.parametrize("value, message", [
    ("{", "not valid JSON"),
    ([], "must be a dict"),
    ({"kv_role": "kv_producer"}, "kv_connector is required"),
    ({**PRODUCER, "kv_connector": "NixlConnector"}, "kv_connector must be one of"),
    ({**PRODUCER, "kv_role": "producer"}, "kv_role must be one of"),
    ({**PRODUCER, "kv_rank": 0}, r"unknown field\(s\) \['kv_rank'\]"),
    ({**PRODUCER, "kv_connector_extra_config": {"ttl": 1}}, "unknown field"),
    ({**PRODUCER, "kv_connector_extra_config": {"segment_ttl_s": 0}}, "segment_ttl_s must be positive"),
    ({**PRODUCER, "kv_connector_extra_config": {"shm_dir": 3}}, "shm_dir has the wrong type"),
])
def test_bad_configs_are_refused_naming_the_field(value, message) -> None:
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.parse(value)


def test_it_rides_in_vllm_config_and_is_a_shared_part() -> None:
    kv = {**PRODUCER, "kv_connector_extra_config": {"shm_dir": "/s"}}
    config = VllmConfig.from_engine_args(model="/m", kv_transfer_config=kv)
    proto = config.to_proto()
    assert proto.kv_transfer_config.kv_role == "kv_producer"
    assert VllmConfig.from_proto(proto).kv_transfer_config == config.kv_transfer_config
    assert "kv_transfer_config" in SHARED_PARTS
    consumer = VllmConfig.from_engine_args(model="/m", kv_transfer_config={**PRODUCER, "kv_role": "kv_consumer",
                                                            "kv_connector_extra_config": {"shm_dir": "/s"}})
    assert config_mismatches(proto, consumer.to_proto(), SHARED_PARTS) == [
        "kv_transfer_config.kv_role: 'kv_producer' vs 'kv_consumer'"]
    assert config_mismatches(proto, VllmConfig.from_engine_args(model="/m").to_proto(), SHARED_PARTS) == [
        "kv_transfer_config: {kv_connector='SharedMemoryConnector', kv_role='kv_producer', "
        "kv_connector_extra_config='{\"shm_dir\": \"/s\"}'} vs off"]


def test_engine_flag() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", "/m", "--kv-transfer-config", '{"kv_connector": "SharedMemoryConnector", '
                                                                        '"kv_role": "kv_consumer"}'])
    assert VllmConfig.from_engine_args(**engine_kwargs(args)).kv_transfer_config.is_consumer


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size > 1"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size > 1"),
    ({"runner": "pooling"}, "runner 'pooling'"),
    ({"speculative_config": {"method": "draft_model", "model": "/d", "num_speculative_tokens": 2}}, "draft_model"),
])
def test_what_the_connector_does_not_transfer_yet_is_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        VllmConfig.from_engine_args(model="/m", kv_transfer_config=PRODUCER, **kwargs)


def test_request_params_round_trip_and_checks() -> None:
    params = {"do_remote_prefill": True, "remote_handle": "mvkv-" + "ab" * 16, "remote_num_tokens": 32,
              "remote_block_hash": "cd" * 32}
    assert params_to_dict(params_from_dict(params)) == params
    assert params_to_dict(params_from_dict({"do_remote_decode": True})) == {"do_remote_decode": True}
    assert params_from_dict(None) is None
    for bad, message in [({"do_remote_decode": True, "do_remote_prefill": True}, "exclude each other"),
                         ({**params, "remote_handle": "/dev/shm/x"}, "not a transfer handle"),
                         ({**params, "remote_block_hash": "zz"}, "hex"),
                         ({**params, "remote_block_hash": "cd"}, "32 bytes"),
                         ({**params, "remote_num_tokens": -1}, "non-negative"),
                         ({"do_remote_decode": 1}, "must be a bool"),
                         ({"engine_id": "x"}, "unknown field")]:
        with pytest.raises(ValueError, match=message):
            params_from_dict(bad)
