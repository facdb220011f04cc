"""What every wire message shares: strict, frozen, one way in and one way out.

Producers build a message and call `to_json()`; consumers call `Cls.from_json(raw)`, which
raises `InvalidMessage` with the dead-letter reason (`bad_json` or `schema`) and one line
per failing field.

>>> class Ping(Message):
...     n: int
>>> Ping.from_json('{"n": 1}').to_json()
'{"n":1}'
>>> Ping.from_json('{"n": "x"}')
Traceback (most recent call last):
...
core.errors.InvalidMessage: n: Input should be a valid integer, unable to parse string as an integer
"""

from __future__ import annotations

import json
import re
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from core.errors import InvalidMessage

# A model id names directories, topics and MLflow models: it starts with a letter or a
# digit (never '.', '..' or '-option'), and holds only letters, digits, '.', '_' and '-'.
MODEL_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_MODEL_ID = re.compile(MODEL_ID)


def is_model_id(value: str) -> bool:
    """Whether `value` is a valid model id.

    >>> is_model_id("support-bot.v2"), is_model_id(".."), is_model_id("-rf")
    (True, False, False)
    """
    return bool(_MODEL_ID.fullmatch(value))  # fullmatch: `$` also matches before a final "\n"


class Message(BaseModel):
    """A strict, immutable record; unknown fields are an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def to_json(self) -> str:
        """Compact JSON; fields left at None are omitted."""
        return self.model_dump_json(exclude_none=True)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)

    @classmethod
    def from_json(cls, raw: str | bytes | None) -> Self:
        return cls.from_dict(decode(raw))

    @classmethod
    def from_dict(cls, data: Any) -> Self:
        if not isinstance(data, dict):
            raise InvalidMessage("schema", f"expected a JSON object, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise InvalidMessage("schema", describe_error(e)) from None


# Deeper JSON is `bad_json`: a record accepted here must parse again wherever a consumer
# reads it, however deep its call stack (MongoDB itself stops at 100 levels).
MAX_JSON_DEPTH = 128


def decode(raw: str | bytes | None) -> Any:
    """JSON text → value; InvalidMessage `empty` or `bad_json` otherwise.

    >>> decode("[" * 5000)
    Traceback (most recent call last):
    ...
    core.errors.InvalidMessage: JSON nested deeper than 128 levels
    """
    if raw is None or raw == "" or raw == b"":
        raise InvalidMessage("empty", "record has no value")
    try:
        value = json.loads(raw)
    except RecursionError:
        raise InvalidMessage("bad_json", f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (TypeError, ValueError) as e:
        raise InvalidMessage("bad_json", f"not JSON: {e}") from None
    if _deeper_than(value, MAX_JSON_DEPTH):
        raise InvalidMessage("bad_json", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` levels (iterative: no recursion)."""
    pending = [(value, 1)]
    while pending:
        node, depth = pending.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                return True
            pending.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False


def describe_error(err: ValidationError) -> str:
    """One line per failing field, e.g. `trigger_policy.window_seconds: Input should be ...`."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in err.errors())
