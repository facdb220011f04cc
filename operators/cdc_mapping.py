"""Database changes → training samples, retractions and retrain triggers (declarative).

A mapping file (YAML or JSON) says which table or collection feeds which model:

    mappings:
      - table: public.support_answers        # PostgreSQL schema.table (bare name: public)
        model_id: {column: model}            # or {value: support-bot}
        prompt: question                     # a column, or a template over columns:
        completion: answer                   #   "Q: {question}\nContext: {doc.title}"
        weight: score                        # optional column; default 1
        filter:                              # optional; every condition must hold
          - {column: status, op: eq, value: approved}
      - collection: shop.reviews             # MongoDB db.collection (dotted paths for fields)
        model_id: {value: review-bot}
        prompt: text
        completion: reply.body
    triggers:
      - table: public.policies               # any change here …
        models: [support-bot]                # … trains these models' pending samples now
        reason: support policy changed

Inserts and updates that pass the filter become samples (an update supersedes the row's
untrained sample); a delete, or an update that no longer passes, retracts the row's
sample. Samples carry `origin` (row, op, LSNs or resume token) into version lineage.

`prompt` and `completion` name a column (a dotted path in a document), or are templates:
text with `{column}` placeholders (dotted paths too; `{{` and `}}` are literal braces). A
row whose named column is missing or null is dead-lettered with reason `unmappable`.

>>> m = Mapping.model_validate({"table": "answers", "model_id": {"value": "bot"},
...                             "prompt": "q", "completion": "a",
...                             "filter": [{"column": "ok", "op": "eq", "value": True}]})
>>> m.source, m.applies({"q": "2+2?", "a": "4", "ok": True}), m.applies({"q": "x", "a": "y", "ok": False})
('postgres:public.answers', True, False)
>>> render("Q: {q} ({meta.lang}) {{raw}}", {"q": "2+2?", "meta": {"lang": "en"}})
'Q: 2+2? (en) {raw}'
>>> m.sample_fields({"q": "2+2?", "a": None, "ok": True})
Traceback (most recent call last):
...
ValueError: field 'a' is missing or null
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import Field, ValidationError, model_validator

from core.errors import ConfigError
from core.messages import MODEL_ID, Message, describe_error
from core.sources.mongodb import COLLECTION, DB, collection_source_id
from core.sources.postgres import TABLE, table_source_id


class Condition(Message):
    column: str = Field(min_length=1)
    op: Literal["eq", "ne", "in", "not_in", "not_null", "is_null"] = "eq"
    value: Any = None

    @model_validator(mode="after")
    def _list_for_in(self) -> "Condition":
        # `v in 5` raises for every row (a crash loop, not a filter); `v in "abc"` matches substrings.
        if self.op in ("in", "not_in") and not isinstance(self.value, list):
            raise ValueError(f"op {self.op} needs a list value, got {self.value!r}")
        return self

    def holds(self, row: dict) -> bool:
        v = field(row, self.column)
        return {"eq": lambda: v == self.value, "ne": lambda: v != self.value,
                "in": lambda: v in (self.value or []), "not_in": lambda: v not in (self.value or []),
                "not_null": lambda: v is not None, "is_null": lambda: v is None}[self.op]()


class ModelRef(Message):
    column: Optional[str] = None
    value: Optional[str] = Field(default=None, pattern=MODEL_ID)

    @model_validator(mode="after")
    def _one(self) -> "ModelRef":
        if (self.column is None) == (self.value is None):
            raise ValueError("model_id takes exactly one of column or value")
        return self


class _Target(Message):
    table: Optional[str] = None
    collection: Optional[str] = None

    @model_validator(mode="after")
    def _one_target(self):
        if (self.table is None) == (self.collection is None):
            raise ValueError("give exactly one of table (PostgreSQL) or collection (MongoDB db.collection)")
        if self.collection is not None and self.collection.count(".") < 1:
            raise ValueError("collection must be db.collection")
        # The names a source URI accepts (core.sources): any other could never match a change.
        if self.table is not None and not TABLE.fullmatch(self.table):
            raise ValueError(f"table must be NAME or SCHEMA.NAME, got {self.table!r}")
        if self.collection is not None:
            db, _, name = self.collection.partition(".")
            if not DB.fullmatch(db) or not COLLECTION.fullmatch(name):
                raise ValueError(f"collection must be a MongoDB db.collection name, got {self.collection!r}")
        return self

    @property
    def source(self) -> str:
        """The same id as FinetuneSpec.source_id for the spec's stream_source."""
        return table_source_id(self.table) if self.table is not None else collection_source_id(self.collection)


class Mapping(_Target):
    model_id: ModelRef
    prompt: str = Field(min_length=1)
    completion: str = Field(min_length=1)
    weight: Optional[str] = None
    filter: list[Condition] = []

    def applies(self, row: dict | None) -> bool:
        return row is not None and all(c.holds(row) for c in self.filter)

    def model_for(self, row: dict) -> Any:
        return self.model_id.value if self.model_id.value is not None else field(row, self.model_id.column)

    def sample_fields(self, row: dict) -> dict[str, Any]:
        """The sample's prompt, completion and weight from a row image (ValueError: why not);
        what the job trains on and what the console's preview shows."""
        prompt, completion = render(self.prompt, row), render(self.completion, row)
        weight = field(row, self.weight) if self.weight else 1.0
        return {"prompt": prompt, "completion": completion, "weight": weight}


class TriggerRule(_Target):
    models: list[Annotated[str, Field(pattern=MODEL_ID)]] = Field(min_length=1)
    reason: str = Field(default="source table changed", min_length=1)


class CdcMapping(Message):
    mappings: list[Mapping] = []
    triggers: list[TriggerRule] = []

    @model_validator(mode="after")
    def _something(self) -> "CdcMapping":
        if not self.mappings and not self.triggers:
            raise ValueError("a mapping file needs at least one entry under mappings or triggers")
        return self

    @classmethod
    def load(cls, path: str | Path) -> "CdcMapping":
        """Read and validate a YAML or JSON mapping file; ConfigError names what is wrong."""
        import yaml

        try:
            return cls.model_validate(yaml.safe_load(Path(path).read_text()))
        except OSError as e:
            raise ConfigError(f"{path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not YAML/JSON: {e}") from None
        except ValidationError as e:
            raise ConfigError(f"{path}: {describe_error(e)}") from None

    @property
    def sources(self) -> frozenset[str]:
        return frozenset(m.source for m in self.mappings)


def field(row: dict, path: str) -> Any:
    """A column, or a dotted path into a document."""
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]+)\}")


def render(spec: str, row: dict) -> str:
    """A column's text (`spec` without placeholders) or the template filled from the row."""
    if "{" not in spec and "}" not in spec:
        return _required(spec, row)

    def fill(match: re.Match) -> str:
        return {"{{": "{", "}}": "}"}.get(match.group(0)) or _required(match.group(1).strip(), row)

    return PLACEHOLDER.sub(fill, spec)


def _required(path: str, row: dict) -> str:
    value = text(field(row, path))
    if value is None:
        raise ValueError(f"field {path!r} is missing or null")
    return value


def text(value) -> str | None:
    """A column's value as sample text: strings as they are, anything else as JSON."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def content_hash(row: dict | None) -> str:
    return hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode()).hexdigest()[:16]

