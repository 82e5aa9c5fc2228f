"""The configuration declared once (services/common/config.py, config_fields.py): every field of
every part survives the trip through its proto message, every proto field of the configuration
has its dataclass field (and back), and the generated flags are the commands' flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

import pytest

from services.common.config import PARTS, VllmConfig
from services.common.config_fields import (
    EXAMPLE,
    field_choices,
    field_type,
    from_proto,
    nested_class,
    scalar_class,
    to_proto,
)
from services.common.proto import myvllm_pb2 as pb

COMMAND_FLAGS = Path(__file__).resolve().parents[2] / "data" / "command_flags.json"


def config_classes() -> list[type]:
    """VllmConfig and every dataclass reachable from its fields (the parts, then nested ones)."""
    found: list[type] = []
    todo = [VllmConfig]
    while todo:
        cls = todo.pop(0)
        if cls in found:
            continue
        found.append(cls)
        todo += [n for f in dataclasses.fields(cls) if (n := nested_class(field_type(cls, f))) is not None]
    return found


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def example_value(cls: type, f: dataclasses.Field) -> Any:
    """A valid value of the field other than its default, derived from its declaration."""
    default = _default(f)
    if EXAMPLE in f.metadata:
        return f.metadata[EXAMPLE]
    tp = field_type(cls, f)
    nested = nested_class(tp)
    if nested is not None:
        return example(nested)
    choices = field_choices(f)
    if choices:
        return next(c for c in reversed(choices) if c != default)
    value_type = scalar_class(tp)
    if value_type is bool:
        return not default
    if value_type is int:
        return (default or 0) + 3
    if value_type is float:
        return (default or 0.0) + 1.5
    if typing.get_origin(value_type) is list:
        return [1, 3]
    if typing.get_origin(value_type) is dict:
        return {"key": 1}
    return f"x-{f.name}"


def example(cls: type) -> Any:
    return cls(**{f.name: example_value(cls, f) for f in dataclasses.fields(cls)})


@pytest.mark.parametrize("cls", [c for c in config_classes() if c is not VllmConfig], ids=lambda c: c.__name__)
def test_every_field_of_every_part_round_trips_through_its_proto_message(cls: type) -> None:
    value = example(cls)
    for f in dataclasses.fields(cls):  # (else the trip would prove nothing about the field)
        assert getattr(value, f.name) != _default(f), f"{cls.__name__}.{f.name}: the example is the default"
    message = to_proto(value, getattr(pb, cls.__name__))
    assert message.ListFields(), cls.__name__
    assert from_proto(cls, message) == value


def test_the_whole_configuration_round_trips_with_every_optional_part() -> None:
    config = VllmConfig.from_engine_args(
        model="/m", dtype="float32", seed=5, max_model_len=96, attention_backend="torch", compile_model=True,
        cuda_graph_sizes="1,2", max_num_seqs=3, max_num_batched_tokens=77, block_size=8,
        enable_prefix_caching=False, num_gpu_blocks_override=9, kv_cache_memory_bytes=1 << 20,
        scheduling_policy="priority", async_scheduling=False, data_parallel_size=2,
        structured_outputs_compile_timeout=4.0, structured_outputs_request_timeout=2.5,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        kv_transfer_config={"kv_connector": "SharedMemoryConnector", "kv_role": "kv_both"})
    assert VllmConfig.from_proto(config.to_proto()) == config
    assert VllmConfig.from_proto(VllmConfig.from_engine_args(model="/m").to_proto()) == \
        VllmConfig.from_engine_args(model="/m")


def test_a_sender_that_predates_a_field_gets_its_default() -> None:
    message = VllmConfig.from_engine_args(model="/m").to_proto()
    message.parallel_config.data_parallel_size = 0
    message.structured_outputs_config.request_timeout_s = 0
    message.model_config.runner = ""
    back = VllmConfig.from_proto(message)
    assert (back.parallel_config.data_parallel_size, back.structured_outputs_config.request_timeout_s,
            back.model_config.runner) == (1, 30.0, "generate")


@pytest.mark.parametrize("cls", config_classes(), ids=lambda c: c.__name__)
def test_every_proto_field_of_the_configuration_has_its_dataclass_field(cls: type) -> None:
    message = getattr(pb, cls.__name__)
    assert {f.name for f in dataclasses.fields(cls)} == set(message.DESCRIPTOR.fields_by_name)


def test_every_part_of_the_wire_message_is_a_dataclass_field() -> None:
    parts = {f.name for f in dataclasses.fields(VllmConfig)}
    assert set(PARTS) <= parts and parts == set(pb.VllmConfig.DESCRIPTOR.fields_by_name)


def _command_flags(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    options = sorted(o for a in parser._actions if not isinstance(a, argparse._HelpAction) for o in a.option_strings)
    if prefix and options:
        found[" ".join(prefix)] = options
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_command_flags(sub, (*prefix, name)))
    return found


def test_each_command_keeps_its_flags() -> None:
    """The flags generated from the fields are the ones each command had when they were written
    by hand (tests/data/command_flags.json; a new engine option adds its flag there too)."""
    from services.entrypoints.cli import build_parser

    assert _command_flags(build_parser()) == json.loads(COMMAND_FLAGS.read_text())


def test_help_shows_each_default_and_engine_args_reach_their_part() -> None:
    from services.entrypoints.cli import build_parser
    from services.entrypoints.engine_args import engine_kwargs

    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    text = " ".join(serve.format_help().split())  # (as wrapped to the terminal)
    for needle in ("(default 256)", "(default 2048)", "(default 16)", "(default fcfs)", "(default 1)"):
        assert needle in text
    args = parser.parse_args(["serve", "--max-num-seqs", "5", "--no-enable-prefix-caching", "-tp", "2",
                              "--kv-cache-memory", "4096", "--structured-outputs-request-timeout", "3",
                              "--cuda-graph-sizes", "1", "2", "--no-async-scheduling"])
    config = VllmConfig.from_engine_args(**engine_kwargs(args))
    assert (config.scheduler_config.max_num_seqs, config.cache_config.enable_prefix_caching,
            config.parallel_config.tensor_parallel_size, config.cache_config.kv_cache_memory_bytes,
            config.structured_outputs_config.request_timeout_s, config.model_config.cuda_graph_sizes,
            config.scheduler_config.async_scheduling) == (5, False, 2, 4096, 3.0, [1, 2], False)
    with pytest.raises(TypeError, match="max_num_seq"):
        VllmConfig.from_engine_args(max_num_seq=4)
