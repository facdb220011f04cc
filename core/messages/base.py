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
    return bool(_MODEL_ID.match(value))


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


def decode(raw: str | bytes | None) -> Any:
    """JSON text → value; InvalidMessage `empty` or `bad_json` otherwise."""
    if raw is None or raw == "" or raw == b"":
        raise InvalidMessage("empty", "record has no value")
    try:
        return json.loads(raw)
    except (TypeError, ValueError) as e:
        raise InvalidMessage("bad_json", f"not JSON: {e}") from None


def describe_error(err: ValidationError) -> str:
    """One line per failing field, e.g. `trigger_policy.window_seconds: Input should be ...`."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in err.errors())
