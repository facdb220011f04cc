"""Which adapter version answers a request: model names, the champion/candidate split, routes.

A request's `model` names `<model_id>` (routed by the split), `<model_id>@<alias>`,
`<model_id>@v<version>` (one version, pinned), or `base` (the base model, no adapter). An
alias never has the form `v<digits>`: MLflow reserves those names for versions, as here.

>>> parse_model_name("bot"), parse_model_name("bot@candidate"), parse_model_name("bot@v7")
(ModelName(model_id='bot', alias=None, version=None), ModelName(model_id='bot', alias='candidate', version=None), ModelName(model_id='bot', alias=None, version=7))

The split is sticky: the same key always lands in the same arm for a given fraction.

>>> arm_for("bot", "user-42", 0.5) == arm_for("bot", "user-42", 0.5)
True
>>> abs(sum(arm_for("bot", f"u{i}", 0.2) == "candidate" for i in range(10_000)) / 10_000 - 0.2) < 0.01
True
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Optional

from core.errors import ConfigError
from core.messages import is_model_id

BASE = "base"  # the model name (and pool key) of the base model without an adapter
_NAME = re.compile(r"^(?P<model>[^@/]+)(?:@v(?P<version>[1-9][0-9]*)|@(?P<alias>(?!v[0-9])[A-Za-z][A-Za-z0-9_-]*))?$")


@dataclass(frozen=True)
class ModelName:
    model_id: str
    alias: Optional[str] = None
    version: Optional[int] = None


def parse_model_name(value: str) -> ModelName:
    """`model` of a request, checked; ConfigError (a 400) with what is allowed otherwise."""
    m = _NAME.fullmatch(value or "")
    if m is None or not is_model_id(m["model"]):
        raise ConfigError(f"model {value!r}: expected <model_id>, <model_id>@<alias>, <model_id>@v<version> or base")
    return ModelName(m["model"], m["alias"], int(m["version"]) if m["version"] else None)


def pinned_name(model_id: str, version: int) -> str:
    """The model name of one version, what `system_fingerprint` says.

    >>> pinned_name("bot", 7), parse_model_name(pinned_name("bot", 7)).version
    ('bot@v7', 7)
    """
    return f"{model_id}@v{int(version)}"


def arm_for(model_id: str, key: str, candidate_fraction: float) -> str:
    """`champion` or `candidate` for this request key (a user, else the request id)."""
    if candidate_fraction <= 0:
        return "champion"
    digest = hashlib.sha256(f"{model_id}\x00{key}".encode()).digest()
    return "candidate" if int.from_bytes(digest[:8], "big") / 2**64 < candidate_fraction else "champion"
