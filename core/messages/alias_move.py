"""Alias move: `champion` or `candidate` of a model pointed elsewhere (or deleted).

Published by whoever moves an alias in the registry (the control plane, the rollback guard)
to the alias-moves topic (key: model_id), after the move. Followers take it as a hint to
read the model's aliases from the registry at once, rather than at their next poll; the
registry stays the truth, so a lost or repeated move is harmless.

>>> AliasMove(model_id="bot", alias="champion", version=3, from_version=4, actor="api", ts=0).to_json()
'{"model_id":"bot","alias":"champion","version":3,"from_version":4,"actor":"api","ts":0}'
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from core.messages.base import MODEL_ID, Message


class AliasMove(Message):
    model_id: str = Field(pattern=MODEL_ID)
    alias: str
    version: Optional[int] = None        # None: the alias was deleted
    from_version: Optional[int] = None
    actor: str
    ts: int                              # epoch ms
