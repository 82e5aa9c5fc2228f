"""The engine configuration's proto messages, written from the dataclasses that declare its fields
(services/common/config.py): one message per dataclass, one field per dataclass field, so that a
new engine option is declared once, in Python, and reaches the wire without a hand-written proto
line. The messages fill the region of proto/myvllm.proto between BEGIN GENERATED and END
GENERATED; the rest of the file stays hand-written.

    python -m services.common.config_proto_gen           # rewrite the region (`make proto` runs it)
    python -m services.common.config_proto_gen --check   # exit 1 if the region is stale

Field numbers are the wire contract, so they come from the region being replaced: a field keeps
its number, a new field takes the next number free in its message, and a removed field's number
is reserved (its old name in a comment) and never handed out again. Fields are written in number
order, so a new field lands at the end of its message.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import textwrap
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common.config_fields import (
    COMMENT,
    FLAG,
    PROTO_TYPE,
    field_choices,
    field_type,
    nested_class,
    scalar_class,
)

PROTO_PATH = Path(__file__).resolve().parents[2] / "proto" / "myvllm.proto"
BEGIN = "// BEGIN GENERATED: the engine configuration's messages"
END = "// END GENERATED"
REGENERATE = "make proto"
# The proto file's line length: a field's comment trails it where the line stays within it, else
# goes above it, wrapped.
LINE_LENGTH = 100

SCALAR_TYPES = {str: "string", bool: "bool", int: "int32", float: "double"}
# The proto scalar types a `wire(proto_type=...)` may name instead of its Python type's default.
PROTO_SCALARS = frozenset({"double", "float", "int32", "int64", "uint32", "uint64", "sint32", "sint64",
                           "fixed32", "fixed64", "sfixed32", "sfixed64", "bool", "string", "bytes"})

HEADER = f"""{BEGIN}, one per dataclass
// of services/common/config.py (VllmConfig, its parts and the configs they nest), one field per
// dataclass field, commented with its flag's help. Do not edit here: change the dataclass, then run
// `{REGENERATE}` (python -m services.common.config_proto_gen). A field keeps its number, a new one
// takes the next free number, a removed one's number stays reserved. A Python None (automatic, or
// none given) travels as the field's zero value (0, "", empty), as an unset `optional` field, or as
// an absent message (a part that is off); a dict travels as its JSON text."""


@dataclass(frozen=True)
class ProtoField:
    """One field of a generated message, before its number is known."""

    name: str
    type: str  # a proto scalar type or a message name
    label: str  # "", "optional" or "repeated"
    comment: str | None


# A field with its number; a reserved span of numbers, (first, last, what it was), that no field
# may take again.
Numbered = tuple[int, ProtoField]
Reserved = tuple[int, int, str]


@dataclass
class WireNumbers:
    """A message's field numbers as the region being replaced has them."""

    fields: dict[str, int]
    reserved: list[Reserved]

    def taken(self) -> set[int]:
        return set(self.fields.values()) | {n for first, last, _ in self.reserved for n in range(first, last + 1)}


def config_classes(root: type) -> list[type]:
    """`root` and every dataclass its fields nest, depth first in field order (the order their
    messages are written in: each part, then what it nests)."""
    found: list[type] = []

    def visit(cls: type) -> None:
        if cls in found:
            return
        found.append(cls)
        for f in dataclasses.fields(cls):
            nested = nested_class(field_type(cls, f))
            if nested is not None:
                visit(nested)

    visit(root)
    return found


def _comment(f: dataclasses.Field) -> str | None:
    text = f.metadata.get(COMMENT) or (f.metadata.get(FLAG) or {}).get("help")
    choices = field_choices(f)
    if choices:
        listed = " | ".join(f'"{c}"' for c in choices)
        text = f"{text} ({listed})" if text else listed
    return text


def proto_field(cls: type, f: dataclasses.Field) -> ProtoField:
    """The proto form of one dataclass field, from its annotation and its metadata."""
    tp = field_type(cls, f)
    comment = _comment(f)
    nested = nested_class(tp)
    if nested is not None:
        return ProtoField(f.name, nested.__name__, "", comment)
    value = scalar_class(tp)
    if value is dict or typing.get_origin(value) is dict:
        return ProtoField(f.name, "string", "", comment)  # its JSON text
    label = ""
    if typing.get_origin(value) is list:
        label, (value,) = "repeated", typing.get_args(value)
    elif value is bool and type(None) in typing.get_args(tp):
        label = "optional"  # None (automatic) must read back as None, not as False
    if value not in SCALAR_TYPES:
        raise TypeError(f"{cls.__name__}.{f.name}: no proto type for {tp!r}")
    proto_type = f.metadata.get(PROTO_TYPE, SCALAR_TYPES[value])
    if proto_type not in PROTO_SCALARS:
        raise TypeError(f"{cls.__name__}.{f.name}: proto_type {proto_type!r} is not a proto scalar type")
    return ProtoField(f.name, proto_type, label, comment)


def class_comment(cls: type) -> str | None:
    """The class's own docstring (not the signature `dataclass` writes when there is none)."""
    doc = cls.__dict__.get("__doc__")
    if not doc or doc.startswith(cls.__name__ + "("):
        return None
    return inspect.cleandoc(doc)


_MESSAGE = re.compile(r"^message\s+(\w+)\s*\{(.*?)^\}", re.MULTILINE | re.DOTALL)
_FIELD = re.compile(r"^\s*(?:optional\s+|repeated\s+)?[\w.]+\s+(\w+)\s*=\s*(\d+)\s*;", re.MULTILINE)
_RESERVED = re.compile(r"^\s*reserved\s+([\d\s,to]+);[ \t]*(?://[ \t]*(?:was[ \t]+)?(\S[^\n]*))?", re.MULTILINE)


def read_numbers(region: str) -> dict[str, WireNumbers]:
    """Each message's field numbers and reserved numbers, read from the region's text."""
    found = {}
    for name, body in _MESSAGE.findall(region):
        fields = {field_name: int(number) for field_name, number in _FIELD.findall(body)}
        reserved = []
        for spans, what in _RESERVED.findall(body):
            for span in spans.split(","):
                first, _, last = span.strip().partition(" to ")
                reserved.append((int(first), int(last or first), what.strip()))
        found[name] = WireNumbers(fields, reserved)
    return found


def _comment_lines(text: str, indent: str) -> list[str]:
    lines = []
    for paragraph in text.split("\n\n"):
        if lines:
            lines.append(indent + "//")
        width = LINE_LENGTH - len(indent + "// ")
        lines += [indent + "// " + line for line in textwrap.wrap(" ".join(paragraph.split()), width)]
    return lines


def number_fields(fields: Sequence[ProtoField], numbers: WireNumbers) -> tuple[list[Numbered], list[Reserved]]:
    """(number, field) in number order, and the reserved spans: a field keeps its number, a new
    one takes the next number no field or reservation ever had, a removed one's is reserved."""
    next_free = max(numbers.taken(), default=0) + 1
    numbered = []
    for pf in fields:
        number = numbers.fields.get(pf.name)
        if number is None:
            number, next_free = next_free, next_free + 1
        numbered.append((number, pf))
    names = {pf.name for pf in fields}
    removed = [(n, n, name) for name, n in numbers.fields.items() if name not in names]
    return sorted(numbered, key=lambda item: item[0]), sorted(numbers.reserved + removed)


def _field_lines(numbered: Sequence[Numbered]) -> list[str]:
    """The fields' lines: a comment that fits trails its field (the message's trailing comments
    aligned where the line allows), a longer one goes above it."""
    decls = {pf.name: " ".join(filter(None, (pf.label, pf.type, pf.name))) + f" = {n};" for n, pf in numbered}

    def fits(text: str) -> bool:
        return len(text) <= LINE_LENGTH

    trailing = {pf.name for _, pf in numbered if pf.comment and fits(f"  {decls[pf.name]}  // {pf.comment}")}
    column = max((len(decls[name]) for name in trailing), default=0)
    lines = []
    for _, pf in numbered:
        decl = decls[pf.name]
        if pf.name in trailing:
            padded = f"  {decl.ljust(column)}  // {pf.comment}"
            lines.append(padded if fits(padded) else f"  {decl}  // {pf.comment}")
            continue
        if pf.comment:
            lines += _comment_lines(pf.comment, "  ")
        lines.append(f"  {decl}")
    return lines


def render_message(cls: type, numbers: WireNumbers | None) -> str:
    """`cls`'s message, its fields numbered as `numbers` has them (None: a new message)."""
    fields = [proto_field(cls, f) for f in dataclasses.fields(cls)]
    numbered, reserved = number_fields(fields, numbers or WireNumbers({}, []))
    doc = class_comment(cls)
    lines = _comment_lines(doc, "") if doc else []
    lines.append(f"message {cls.__name__} {{")
    for first, last, what in reserved:
        span = str(first) if first == last else f"{first} to {last}"
        lines.append(f"  reserved {span};" + (f"  // was {what}" if what else ""))
    lines += _field_lines(numbered)
    lines.append("}")
    return "\n".join(lines)


def render_region(classes: Sequence[type], numbers: dict[str, WireNumbers]) -> str:
    """The whole region, BEGIN and END lines included."""
    messages = [render_message(cls, numbers.get(cls.__name__)) for cls in classes]
    return "\n\n".join([HEADER, *messages, END])


def _region_span(proto_text: str) -> tuple[int, int]:
    start = proto_text.find(BEGIN)
    end = proto_text.find(END, start)
    if start < 0 or end < 0 or proto_text.find(BEGIN, start + 1) >= 0:
        raise ValueError(f"the proto needs exactly one region from {BEGIN!r} to {END!r}")
    return start, end + len(END)


def generate(proto_text: str, classes: Sequence[type] | None = None) -> str:
    """`proto_text` with its generated region rewritten from `classes` (default: VllmConfig's)."""
    if classes is None:
        from services.common.config import VllmConfig

        classes = config_classes(VllmConfig)
    start, end = _region_span(proto_text)
    region = render_region(classes, read_numbers(proto_text[start:end]))
    return proto_text[:start] + region + proto_text[end:]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only say whether the region is current (exit 1 if not)")
    parser.add_argument("--proto", type=Path, default=PROTO_PATH, help="the .proto file (default: the project's)")
    args = parser.parse_args(argv)
    current = args.proto.read_text()
    wanted = generate(current)
    if args.check:
        if wanted != current:
            print(f"{args.proto}: the configuration's messages are stale; run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    if wanted != current:  # (an unchanged file keeps its mtime: make then has nothing to redo)
        args.proto.write_text(wanted)
        print(f"{args.proto}: configuration messages regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
