"""Making small models' tool calls usable.

Models as small as Llama 3.2 1B pass numbers as strings, emit the call as JSON text
instead of `tool_calls`, or echo the tool's schema instead of arguments. Arguments are
coerced to the schema's scalar types and validated; a bad call goes back to the model
with the expected shape instead of reaching the tool server.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from luftpause.runtime.errors import RuntimeServiceError

if TYPE_CHECKING:
    import jsonschema.protocols


class ToolCallArgumentsError(RuntimeServiceError, ValueError):
    """Arguments the tool would not accept; the message is written for the model."""


def prepare_arguments(raw: Any, schema: dict[str, Any]) -> dict[str, Any]:
    """Parsed, coerced and validated arguments for a tool with input ``schema``."""
    arguments = _parse(raw)
    if _is_schema_echo(arguments, schema):
        raise ToolCallArgumentsError(
            "you passed the tool's schema instead of arguments; call it with values shaped like "
            + json.dumps(expected_shape(schema))
        )
    arguments = coerce_scalars(arguments, schema)
    error = first_validation_error(arguments, schema)
    if error is not None:
        raise ToolCallArgumentsError(f"invalid arguments ({error}); expected {json.dumps(expected_shape(schema))}")
    return arguments


def was_coerced(raw: Any, arguments: dict[str, Any]) -> bool:
    """Whether ``prepare_arguments`` changed what the model sent (it accepted ``raw``)."""
    try:
        return _parse(raw) != arguments
    except ToolCallArgumentsError:
        return True


def _parse(raw: Any) -> dict[str, Any]:
    if raw is None or raw == "":
        return {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise ToolCallArgumentsError(f"arguments are not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ToolCallArgumentsError("arguments must be a JSON object")
    return raw


def _is_schema_echo(arguments: dict[str, Any], schema: dict[str, Any]) -> bool:
    declared = set((schema.get("properties") or {}).keys())
    looks_like_schema = arguments.get("type") == "object" or isinstance(arguments.get("properties"), dict)
    return looks_like_schema and not ({"type", "properties"} & declared)


def _scalar_types(property_schema: dict[str, Any]) -> list[str]:
    declared = property_schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [t for t in declared if isinstance(t, str)]
    # `x: int | None` arrives as anyOf [{type: integer}, {type: null}]
    return [t for option in property_schema.get("anyOf", []) if isinstance(option, dict) for t in _scalar_types(option)]


def coerce_scalars(arguments: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """Top-level values converted to the scalar type their property declares, when lossless."""
    properties = schema.get("properties") or {}
    coerced = dict(arguments)
    for name, value in arguments.items():
        property_schema = properties.get(name)
        if isinstance(property_schema, dict):
            coerced[name] = _coerce(value, _scalar_types(property_schema))
    return coerced


def _coerce(value: Any, types: list[str]) -> Any:
    if not types or _matches_any(value, types):
        return value
    for target in types:
        converted = _convert(value, target)
        if converted is not None:
            return converted
    return value


def _matches_any(value: Any, types: list[str]) -> bool:
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
    }
    return any(checks.get(t, lambda v: True)(value) for t in types)


def _convert(value: Any, target: str) -> Any:
    if isinstance(value, str):
        text = value.strip()
        if target == "integer" and re.fullmatch(r"[-+]?\d+", text):
            return int(text)
        if target == "number":
            try:
                return float(text) if not re.fullmatch(r"[-+]?\d+", text) else int(text)
            except ValueError:
                return None
        if target == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        return None
    if target == "string" and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if target == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def first_validation_error(arguments: dict[str, Any], schema: dict[str, Any]) -> str | None:
    validator = _validator(json.dumps(schema, sort_keys=True))
    if validator is None:
        return None  # a server with a broken schema gets the arguments unchecked
    import jsonschema.exceptions

    error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    return None if error is None else error.message


@functools.lru_cache(maxsize=512)
def _validator(schema_json: str) -> jsonschema.protocols.Validator | None:
    """A checked validator per distinct schema: checking a schema against its metaschema
    costs milliseconds, and every call of a tool has the same schema. (jsonschema is
    imported on the first tool call, not while the runtime starts.)"""
    import jsonschema
    from jsonschema.validators import validator_for

    schema = json.loads(schema_json)
    validator_class = validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator_class.check_schema(schema)
    except jsonschema.SchemaError:
        return None
    return validator_class(schema)


def expected_shape(schema: dict[str, Any]) -> dict[str, str]:
    """``{"query": "string (required)"}``: the shape a model can copy."""
    required = set(schema.get("required") or [])
    shape = {}
    for name, property_schema in (schema.get("properties") or {}).items():
        types = _scalar_types(property_schema) if isinstance(property_schema, dict) else []
        kind = "|".join(t for t in types if t != "null") or "any"
        shape[name] = f"{kind} (required)" if name in required else kind
    return shape


_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def recover_text_tool_calls(content: str | None, offered: Collection[str]) -> list[dict[str, Any]] | None:
    """Tool calls a model wrote as JSON text (`{"name": ..., "parameters": {...}}`), if any."""
    if not content or not offered:
        return None
    text = content.strip().removeprefix("<|python_tag|>").strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1)
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    candidates = parsed if isinstance(parsed, list) else [parsed]
    calls = [_as_tool_call(candidate, offered) for candidate in candidates]
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def _as_tool_call(candidate: Any, offered: Collection[str]) -> dict[str, Any] | None:
    if not isinstance(candidate, dict) or candidate.get("name") not in offered:
        return None
    arguments = candidate.get("parameters", candidate.get("arguments", {}))
    if not isinstance(arguments, dict | str):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {
            "name": candidate["name"],
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        },
    }
