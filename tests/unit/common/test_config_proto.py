"""The configuration's proto messages are generated from its dataclasses
(services/common/config_proto_gen.py): the checked-in region is what the generator writes, the
messages keep every field's wire form (name, number, type, label, presence) as the hand-written
proto had them (tests/data/config_proto_fields.json, captured from its compiled descriptors), and
the generator's rules (types, numbering, reserved numbers) hold on small declarations of their own."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from services.common.config_fields import flag, wire
from services.common.config_proto_gen import (
    BEGIN,
    END,
    PROTO_PATH,
    REGENERATE,
    config_classes,
    generate,
    main,
    read_numbers,
    render_message,
)

FROZEN_FIELDS = Path(__file__).resolve().parents[2] / "data" / "config_proto_fields.json"
FieldProto = descriptor_pb2.FieldDescriptorProto


def test_the_checked_in_region_is_what_the_generator_writes() -> None:
    text = PROTO_PATH.read_text()
    assert generate(text) == text, (f"the configuration's messages in {PROTO_PATH.name} are stale (a dataclass "
                                    f"field changed since they were generated): run `{REGENERATE}` and commit the "
                                    "proto")


def _compiled_messages(proto_text: str, tmp_path: Path) -> dict[str, descriptor_pb2.DescriptorProto]:
    source = tmp_path / "myvllm.proto"
    source.write_text(proto_text)
    out = tmp_path / "myvllm.desc"
    assert protoc.main(["protoc", f"-I{tmp_path}", f"--descriptor_set_out={out}", str(source)]) == 0
    (file_proto,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    return {m.name: m for m in file_proto.message_type}


def _wire_form(f: FieldProto) -> dict:
    return {"name": f.name, "number": f.number, "type": FieldProto.Type.Name(f.type),
            "label": FieldProto.Label.Name(f.label), "type_name": f.type_name, "proto3_optional": f.proto3_optional}


def test_every_field_keeps_its_wire_form(tmp_path: Path) -> None:
    """Each field the hand-written messages had is generated the same (name, number, type, label,
    presence), in the same order, or, once removed, has its number reserved; a field added since
    comes after them."""
    messages = _compiled_messages(generate(PROTO_PATH.read_text()), tmp_path)
    for name, frozen in json.loads(FROZEN_FIELDS.read_text()).items():
        message = messages[name]
        generated = [_wire_form(f) for f in message.field]
        by_name = {f["name"]: f for f in generated}
        reserved = {n for r in message.reserved_range for n in range(r.start, r.end)}
        kept = [f for f in frozen["fields"] if f["name"] in by_name]
        assert [by_name[f["name"]] for f in kept] == kept, name
        assert generated[:len(kept)] == kept, f"{name}: a new field comes after the existing ones"
        assert {f["number"] for f in frozen["fields"] if f["name"] not in by_name} <= reserved, name
        assert {n for first, last in frozen["reserved"] for n in range(first, last + 1)} <= reserved, name


def test_the_region_holds_one_message_per_configuration_dataclass(tmp_path: Path) -> None:
    from services.common.config import VllmConfig

    text = PROTO_PATH.read_text()
    region = text[text.index(BEGIN):text.index(END)]
    assert list(read_numbers(region)) == [cls.__name__ for cls in config_classes(VllmConfig)]
    assert "message LoadModelRequest" in text and "message LoadModelRequest" not in region


# Small declarations of the generator's rules (a nested config, every field type it maps).
@dataclass
class Inner:
    """A nested config."""

    ratio: float = 0.5


@dataclass
class Sample:
    """A config part.

    Its second paragraph."""

    name: str = field(default="x", metadata=flag(help="the name", choices=("x", "y")))
    count: int | None = None
    big: int = field(default=0, metadata=flag(help="many bytes", proto_type="int64"))
    automatic: bool | None = field(default=None, metadata=flag(help="on where it helps"))
    sizes: list[int] | str | None = None
    extra: dict | str | None = field(default=None, metadata=wire(comment="a JSON object"))
    inner: Inner | dict | None = None


def test_each_python_type_has_its_proto_type() -> None:
    assert render_message(Sample, None).splitlines() == [
        "// A config part.",
        "//",
        "// Its second paragraph.",
        "message Sample {",
        '  string name = 1;              // the name ("x" | "y")',
        "  int32 count = 2;",
        "  int64 big = 3;                // many bytes",
        "  optional bool automatic = 4;  // on where it helps",
        "  repeated int32 sizes = 5;",
        "  string extra = 6;             // a JSON object",
        "  Inner inner = 7;",
        "}",
    ]
    assert config_classes(Sample) == [Sample, Inner]
    assert "double ratio = 1;" in render_message(Inner, None)


@dataclass
class Grown:
    kept: str = ""
    added: bool = field(default=False, metadata=flag(help="a new switch"))
    also_added: int = 0


def test_numbers_stay_new_fields_take_the_next_free_one_and_removed_ones_stay_reserved() -> None:
    before = "\n".join([BEGIN, "message Grown {", "  reserved 4;  // was older", "  int32 gone = 1;",
                        "  string kept = 3;", "}", END])
    message = render_message(Grown, read_numbers(before)["Grown"])
    assert message.splitlines() == [
        "message Grown {",
        "  reserved 1;  // was gone",
        "  reserved 4;  // was older",
        "  string kept = 3;",
        "  bool added = 5;  // a new switch",
        "  int32 also_added = 6;",
        "}",
    ]
    again = read_numbers(message)["Grown"]  # (the next run reads what this one wrote)
    assert render_message(Grown, again) == message


@dataclass
class Unmapped:
    when: complex = 0j


def test_a_field_without_a_proto_type_is_refused() -> None:
    with pytest.raises(TypeError, match=r"Unmapped\.when"):
        render_message(Unmapped, None)


def test_check_mode_names_the_command_that_regenerates(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    proto = tmp_path / "myvllm.proto"
    current = PROTO_PATH.read_text()
    proto.write_text(current.replace("int32 disable_by_batch_size = 6;", "int32 disable_by_batch_size = 7;"))
    assert main(["--check", "--proto", str(proto)]) == 0  # (a number is read back, not rewritten)
    proto.write_text(current.replace("int32 max_num_seqs = 1;", "int32 max_num_seqs = 1;\n  bool stale = 9;"))
    assert main(["--check", "--proto", str(proto)]) == 1
    assert REGENERATE in capsys.readouterr().err
    assert main(["--proto", str(proto)]) == 0
    assert "reserved 9;  // was stale" in proto.read_text()
    assert main(["--check", "--proto", str(proto)]) == 0
    with pytest.raises(ValueError, match="BEGIN GENERATED"):
        generate("syntax = \"proto3\";\n")
