"""Strict pydantic configs: the base every config.json section derives from, and errors that name the key.

A wrong config otherwise surfaces as a shape error deep inside a layer, so loading rejects unknown keys, missing
keys and wrong JSON types (no `true` where a number goes, no `"4"` where an integer goes), and every message starts
with the dotted path of the offending key, e.g. `config.mamba2.n_groups: 3 must divide num_heads (8)`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PositiveInt = Annotated[int, Field(gt=0)]


class ConfigError(ValueError):
    """A config.json that does not describe a valid model; the message names the key."""


class StrictConfig(BaseModel):
    """A config section: unknown keys and loose JSON types are errors (an integer is still accepted as a float).

    Cross-field checks are `model_validator(mode="after")` methods that raise `ValueError("key: what is wrong")`;
    the key is relative to the section, and `config_error` prefixes the section's path.
    """

    model_config = ConfigDict(extra="forbid", strict=True)


# What a JSON value should have been, by pydantic error type.
_EXPECTED = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "bool_type": "true/false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}

_KEY = re.compile(r"[A-Za-z_]\w*(\[\d+\])?")
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def config_error(error: ValidationError, where: str, model: type[BaseModel]) -> ConfigError:
    """The first problem of a validation error as a `ConfigError` whose message starts with the key's path."""
    first = error.errors()[0]
    loc = [str(part) for part in first["loc"]]
    value = first.get("input")
    kind = first["type"]
    if kind in _EXPECTED:
        what = f"expected {_EXPECTED[kind]}, got {_json_type(value)} {_short(value)}"
    elif kind == "extra_forbidden":
        what = f"unknown key (known: {sorted(_fields_at(model, loc[:-1]))})"
    elif kind in _BOUNDS:
        bound = next(iter(first["ctx"].values()))
        what = "must be positive" if (kind, bound) == ("greater_than", 0) else f"must be {_BOUNDS[kind]} {bound}"
        what = f"{what}, got {_short(value)}"
    elif kind == "literal_error":
        what = f"must be {first['ctx']['expected']}, got {_short(value)}"
    elif kind == "missing":
        what = "required key is missing"
    elif kind == "value_error":
        # Our own checks say "key: message" relative to the section the validator ran on.
        what = str(first["ctx"]["error"]) if "ctx" in first else first["msg"]
        key, sep, rest = what.partition(": ")
        if sep and _KEY.fullmatch(key):
            loc, what = [*loc, key], rest
    else:
        what = first["msg"]
    return ConfigError(f"{'.'.join([where, *loc])}: {what}")


def _fields_at(model: type[BaseModel], loc: Sequence[str]) -> Mapping[str, Any]:
    """The fields of the (sub-)model at `loc` below `model`."""
    for part in loc:
        annotation = model.model_fields[part].annotation
        model = next(a for a in (*getattr(annotation, "__args__", ()), annotation) if _is_model(a))
    return model.model_fields


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _json_type(value: Any) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "object"}.get(
        type(value), type(value).__name__
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
