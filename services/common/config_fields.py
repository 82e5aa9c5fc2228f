"""Configuration fields declared once: a dataclass field carries its flag (name, help, choices)
and its wire form, and everything else is generated from it: the argparse flags
(`add_flags`), the flat engine arguments (`flag_dests`), and the proto conversion
(`to_proto` / `from_proto`, walking the fields by name).

Wire rules, one place for every field:
- a field whose type is a dataclass (a config part, or a nested one such as PoolerConfig)
  travels as the proto message of the same field name; None = the message absent ("off");
- a field defaulting to None travels as the proto field's zero value (or unset, where the
  proto field has presence): None <-> 0 / "" / [];
- a list travels as a repeated field, a dict as JSON text ("" = empty);
- `wire(zero_is_default=True)`: a zero value read means the field's default (a sender that
  predates the field).

The proto messages themselves are generated from the same declarations
(services/common/config_proto_gen.py): `wire(proto_type="int64")` widens an int field,
`wire(comment=...)` replaces the flag's help as the proto field's comment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from google.protobuf.message import Message

FLAG = "flag"
ZERO_IS_DEFAULT = "zero_is_default"
EXAMPLE = "example"
PROTO_TYPE = "proto_type"
COMMENT = "comment"


def flag(help: str | None = None, name: str | None = None, aliases: Sequence[str] = (),
         choices: Sequence[str] | None = None, dest: str | None = None, type: Callable[[str], Any] | None = None,
         nargs: str | None = None, action: type[argparse.Action] | None = None, metavar: str | None = None,
         show_default: bool = True, zero_is_default: bool = False, example: Any = None,
         proto_type: str | None = None, comment: str | None = None) -> dict[str, Any]:
    """A field's metadata for `dataclasses.field(metadata=...)`: its flag, with vLLM's spelling.

    name: the flag (default `--` + the field name with dashes); dest: the engine argument's name
    (default the field name); type: how the flag's text is read (default from the field's type);
    booleans become `--name` (default False), `--no-name` (default True) or both (default None,
    "automatic"). show_default: append a non-None default to the help text (unless it already
    speaks of it). example: a valid non-default value for the round-trip test, where one cannot be derived
    from the type and choices. proto_type, comment: the proto field's, as `wire` takes them."""
    meta: dict[str, Any] = {FLAG: {"help": help, "name": name, "aliases": tuple(aliases), "choices": choices,
                                   "dest": dest, "type": type, "nargs": nargs, "action": action,
                                   "metavar": metavar, "show_default": show_default}}
    return {**meta, **wire(zero_is_default=zero_is_default, example=example, proto_type=proto_type,
                           comment=comment)}


def wire(zero_is_default: bool = False, example: Any = None, choices: Sequence[str] | None = None,
         proto_type: str | None = None, comment: str | None = None) -> dict[str, Any]:
    """A field's metadata where it has no flag of its own (the fields of a JSON-valued flag's
    config): its wire rule and, for the round-trip test, a valid example or its choices.

    proto_type: the proto scalar type where the Python type's default one is too narrow
    ("int64" for an int that can pass 2**31); comment: the proto field's comment (default the
    flag's help)."""
    meta: dict[str, Any] = {}
    if zero_is_default:
        meta[ZERO_IS_DEFAULT] = True
    if example is not None:
        meta[EXAMPLE] = example
    if choices is not None:
        meta["choices"] = tuple(choices)
    if proto_type is not None:
        meta[PROTO_TYPE] = proto_type
    if comment is not None:
        meta[COMMENT] = comment
    return meta


def field_choices(f: dataclasses.Field) -> Sequence[str] | None:
    return (f.metadata.get(FLAG) or {}).get("choices") or f.metadata.get("choices")


def field_type(cls: type, f: dataclasses.Field) -> Any:
    """The field's declared type, resolved (the modules use `from __future__ import annotations`)."""
    return typing.get_type_hints(cls)[f.name]


def _members(tp: Any) -> tuple[Any, ...]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return typing.get_args(tp)
    return (tp,)


def nested_class(tp: Any) -> type | None:
    """The dataclass among a field type's union members (a nested config), else None."""
    return next((m for m in _members(tp) if dataclasses.is_dataclass(m)), None)


def scalar_class(tp: Any) -> Any:
    """The field's value type, None and the text forms a caller may also pass left out."""
    members = [m for m in _members(tp) if m is not type(None)]
    for m in members:
        if typing.get_origin(m) in (list, dict) or m in (bool, int, float):
            return m
    return members[0]


def flag_dest(f: dataclasses.Field) -> str:
    return (f.metadata.get(FLAG) or {}).get("dest") or f.name


def flag_fields(cls: type) -> Iterator[dataclasses.Field]:
    """The fields of `cls` that are engine arguments (a flag each)."""
    return (f for f in dataclasses.fields(cls) if FLAG in f.metadata)


def flag_dests(cls: type) -> tuple[str, ...]:
    """The engine-argument names `cls`'s flags set (LLM(**kwargs) takes the same names)."""
    return tuple(flag_dest(f) for f in flag_fields(cls))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def add_flags(p: argparse.ArgumentParser, cls: type, only: Sequence[str] | None = None) -> None:
    """Add the flags of `cls`'s fields (`only` these, by field name) to `p`, in field order."""
    for f in flag_fields(cls):
        if only is not None and f.name not in only:
            continue
        meta = f.metadata[FLAG]
        default = _default(f)
        option = meta["name"] or "--" + f.name.replace("_", "-")
        dest = flag_dest(f)
        tp = scalar_class(field_type(cls, f))
        help_text = meta["help"]
        # (a switch's default is its absence; a None default is explained by the help itself)
        if meta["show_default"] and tp is not bool and default is not None and "default" not in (help_text or ""):
            shown = f"{default:g}" if isinstance(default, float) else default
            help_text = f"{help_text} (default {shown})" if help_text else f"default {shown}"
        if tp is bool:
            _add_switch(p, option, meta["aliases"], dest, default, help_text)
            continue
        kwargs: dict[str, Any] = {"dest": dest, "default": default, "help": help_text}
        if meta["choices"] is not None:
            kwargs["choices"] = list(meta["choices"])
        for key in ("nargs", "action", "metavar"):
            if meta[key] is not None:
                kwargs[key] = meta[key]
        reader = meta["type"] or (tp if tp in (int, float) else None)
        if reader is not None and meta["action"] is None:
            kwargs["type"] = reader
        p.add_argument(option, *meta["aliases"], **kwargs)


def _add_switch(p: argparse.ArgumentParser, option: str, aliases: Sequence[str], dest: str, default: bool | None,
                help_text: str | None) -> None:
    """A boolean's two spellings, as vLLM's BooleanOptionalAction gives them: `--name` and
    `--no-name`. Two actions rather than one, so that the flag given is the one a launcher
    forwards. A switch that is on by default is described by its `--no-` form (what giving it
    changes); one off by default by its `--name` form; an automatic one (None) by its `--name` form."""
    negative = "--no-" + option.removeprefix("--")
    if default is True:
        p.add_argument(option, dest=dest, action="store_true", default=True,
                       help=f"on (the default); {negative} turns it off")
        p.add_argument(negative, *aliases, dest=dest, action="store_false", help=help_text)
        return
    p.add_argument(option, *aliases, dest=dest, action="store_true", default=None if default is None else False,
                   help=help_text)
    if default is None:  # automatic unless either is given
        p.add_argument(negative, dest=dest, action="store_false",
                       help=f"turn it off (default: automatic, see {option})")


def to_proto(obj: Any, message_type: type[Message]) -> Message:
    """`obj` (a config dataclass) as `message_type`, field by field by name."""
    message = message_type()
    cls = type(obj)
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        if value is None:
            continue  # absent / zero
        target = message.DESCRIPTOR.fields_by_name[f.name]
        nested = nested_class(field_type(cls, f))
        if nested is not None:
            getattr(message, f.name).CopyFrom(to_proto(value, target.message_type._concrete_class))
        elif isinstance(value, dict):
            setattr(message, f.name, json.dumps(value, sort_keys=True) if value else "")
        elif isinstance(value, (list, tuple)):
            getattr(message, f.name).extend(value)
        else:
            setattr(message, f.name, value)
    return message


def from_proto(cls: type, message: Message, **overrides: Any) -> Any:
    """A `cls` (a config dataclass) from its proto message, field by field by name; the class's
    own checks run as for any other construction (ValueError)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            continue
        descriptor = message.DESCRIPTOR.fields_by_name[f.name]
        tp = field_type(cls, f)
        nested = nested_class(tp)
        value = getattr(message, f.name)
        if nested is not None:
            values[f.name] = from_proto(nested, value) if message.HasField(f.name) else None
            continue
        default = _default(f)
        if descriptor.has_presence:
            value = value if message.HasField(f.name) else None
        elif typing.get_origin(scalar_class(tp)) is dict:
            value = json.loads(value) if value else {}
        elif descriptor.is_repeated:
            value = list(value) or (None if default is None else [])
        elif not value and (default is None or f.metadata.get(ZERO_IS_DEFAULT)):
            value = default
        values[f.name] = value
    return cls(**values, **overrides)
