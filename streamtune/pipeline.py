"""A declarative pipeline: one file for every source kind, applied with `streamtune apply -f`
or `POST /v1/pipelines`.

    model_id: support-bot
    stream_source: postgres://db.internal/app?table=public.answers
    adapter_config: {rank: 8, alpha: 16, target_modules: [q_proj, v_proj]}
    trigger_policy: {min_samples_per_window: 16, window_seconds: 60}
    cdc:                                     # PostgreSQL and MongoDB sources: rows → samples
      prompt: question                       # column (dotted path in a document)
      completion: answer
      weight: score                          # optional column; default 1
      filter: [{column: status, op: eq, value: approved}]
      triggers: [{table: public.policies, reason: support policy changed}]
      snapshot: false                        # first start: existing rows become samples too

A pipeline is a fine-tune spec (core.messages.FinetuneSpec, the same validation) plus `cdc`,
the mapping of the model's own table or collection. The smallest pipeline is a fine-tune
JSON with a `kafka://` source and no `cdc`. Credentials never go in the file (a URI with a
password is refused): the source names a secret reference, `password_env=VAR` or
`password_file=/run/secrets/FILE` (core/sources/base.py), that the capture resolves in its own
environment; on Kubernetes, `streamtune render` maps VAR to a key of the Secret
`<name>-source`. Without a reference, a source on the stack's own PostgreSQL gets the stack's
user and password from the control plane (PGUSER / PGPASSWORD); any other host gets none.

>>> p = Pipeline.model_validate({
...     "model_id": "bot", "stream_source": "postgres://db/app?table=answers",
...     "adapter_config": {"rank": 4, "alpha": 8, "target_modules": ["q_proj"]},
...     "trigger_policy": {"min_samples_per_window": 4, "window_seconds": 2},
...     "cdc": {"prompt": "q", "completion": "a", "triggers": [{"table": "policies"}]}})
>>> [(m.table, m.model_id.value) for m in p.mapping().mappings], p.mapping().triggers[0].models
([('public.answers', 'bot')], ['bot'])
>>> p.capture_source("st_bot")
'postgres://db/app?table=public.answers&table=public.policies&slot=st_bot&publication=st_bot'
>>> p.model_copy(update={"stream_source": "postgres://bot@db/app?table=answers&password_env=BOT_PG_PASSWORD"}
...              ).capture_source("st_bot")  # the secret reference goes with it, never a secret
'postgres://bot@db/app?table=public.answers&table=public.policies&slot=st_bot&publication=st_bot&password_env=BOT_PG_PASSWORD'
>>> Pipeline.model_validate({**p.finetune_spec().model_dump(), "cdc": None})
Traceback (most recent call last):
...
pydantic_core._pydantic_core.ValidationError: 1 validation error for Pipeline
  Value error, a postgres:// source needs a `cdc` block (prompt and completion columns) [type=value_error, input_value=..., input_type=dict]
...
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Optional
from urllib.parse import urlencode, urlsplit, urlunsplit

from pydantic import Field, model_validator

from core.messages import FinetuneSpec, Message
from core.sources.base import SECRET_OPTIONS
from core.sources.kafka import KafkaSource
from core.sources.mongodb import MongoSource
from core.sources.postgres import PostgresSource, qualified
from operators.cdc_mapping import CdcMapping, Condition, Mapping, TriggerRule


class CdcTrigger(Message):
    """Any change of this table (or collection) trains the pipeline's pending samples now."""
    table: Optional[str] = None
    collection: Optional[str] = None
    reason: str = Field(default="source table changed", min_length=1)


class CdcBlock(Message):
    prompt: str = Field(min_length=1)
    completion: str = Field(min_length=1)
    weight: Optional[str] = None
    filter: list[Condition] = []
    triggers: list[CdcTrigger] = []
    snapshot: bool = False


class Pipeline(FinetuneSpec):
    cdc: Optional[CdcBlock] = None

    @model_validator(mode="after")
    def _cdc_matches_source(self) -> "Pipeline":
        kafka = isinstance(self.source, KafkaSource)
        if kafka and self.cdc is not None:
            raise ValueError("a kafka:// source takes no `cdc` block: its records are samples already")
        if not kafka and self.cdc is None:
            raise ValueError(f"a {self.source.scheme}:// source needs a `cdc` block (prompt and completion columns)")
        if self.cdc is not None:
            self.mapping()  # the mapping's own checks (table and collection names)
        return self

    @property
    def name(self) -> str:
        return self.model_id

    @property
    def is_cdc(self) -> bool:
        return self.cdc is not None

    def finetune_spec(self) -> FinetuneSpec:
        """What the trainer gets on its config topic (hot updates compare its hash)."""
        return FinetuneSpec.model_validate(self.model_dump(exclude={"cdc"}))

    def pipeline_hash(self) -> str:
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def mapping(self) -> CdcMapping:
        """The mapping file of jobs/cdc_retrain.py for this pipeline alone."""
        cdc, source = self.cdc, self.source
        targets = ([{"table": t} for t in source.tables] if isinstance(source, PostgresSource)
                   else [{"collection": f"{source.db}.{source.collection}"}])
        mappings = [Mapping.model_validate({**target, "model_id": {"value": self.model_id}, "prompt": cdc.prompt,
                                            "completion": cdc.completion, "weight": cdc.weight,
                                            "filter": [c.model_dump() for c in cdc.filter]}) for target in targets]
        triggers = [TriggerRule.model_validate({**t.model_dump(exclude_none=True), "models": [self.model_id]})
                    for t in cdc.triggers]
        return CdcMapping(mappings=mappings, triggers=triggers)

    def capture_source(self, connector: str) -> str:
        """The `streamtune cdc --source` URI: the model's tables plus the trigger tables, on a
        slot and publication named `connector` (PostgreSQL); the collection (MongoDB)."""
        parts = urlsplit(self.stream_source)
        if isinstance(self.source, MongoSource):
            if any(t.table is not None or t.collection != f"{self.source.db}.{self.source.collection}"
                   for t in self.cdc.triggers):
                raise ValueError("a mongodb:// pipeline's triggers can only name its own collection")
            return self.stream_source
        tables = list(self.source.tables) + [qualified(t.table) for t in self.cdc.triggers
                                             if t.table is not None and qualified(t.table) not in self.source.tables]
        secret_refs = [(k, v) for k in SECRET_OPTIONS for v in self.source.query.get(k, [])]
        query = urlencode([("table", t) for t in tables] + [("slot", connector), ("publication", connector)]
                          + secret_refs)
        return urlunsplit((parts.scheme, parts.netloc, parts.path, query, ""))


def connector_name(model_id: str) -> str:
    """A PostgreSQL identifier for the pipeline's slot, publication and capture (unique per model).

    >>> connector_name("Support-Bot.v2")
    'st_support_bot_v2_9cb7a018'
    """
    slug = re.sub(r"[^a-z0-9_]", "_", model_id.lower())[:40]
    return f"st_{slug}_{hashlib.sha256(model_id.encode()).hexdigest()[:8]}"
