"""Adapter-version broadcast: a version is registered in MLflow and can be loaded.

Published by the registrar to the adapter-versions topic (key: model_id) after the model
version exists; sent again for a version whose broadcast was never confirmed, so readers
are idempotent by version_id.

>>> b = AdapterVersionBroadcast(version_id="bot@1#0:0-0:1", model_id="bot", seq=1, mlflow_version=3,
...     model_uri="models:/bot/3", sha256="0" * 64, artifact_uri="s3://adapters/" + "0" * 64,
...     aliases=["candidate", "champion"])
>>> AdapterVersionBroadcast.from_json(b.to_json()).aliases
['candidate', 'champion']
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from core.messages.base import MODEL_ID, Message


class AdapterVersionBroadcast(Message):
    version_id: str
    model_id: str = Field(pattern=MODEL_ID)
    seq: int = Field(ge=1)
    mlflow_version: int = Field(ge=1)
    model_uri: str                       # models:/<model_id>/<mlflow_version>
    sha256: str                          # of the artifact's manifest.json: covers every file, as in the version record
    artifact_uri: str                    # the artifact store URI, as in the version record
    aliases: list[str]
    # When the registry created the version (ms), the time its `aliases` hold as of: readers
    # that merge broadcasts with alias moves order by it, never by the record's timestamp
    # (the job stamps versions in event time, or wall time when an idle timer closed them).
    registered_at: Optional[int] = None
