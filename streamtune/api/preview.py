"""What a pipeline would train on, before it is applied: the console's editor asks these.

| endpoint                       | scope | what it does                                                    |
|--------------------------------|-------|-----------------------------------------------------------------|
| POST /v1/pipelines/preview     | admin | the source's fields, a few of its records, each record's sample or dead-letter reason |
| POST /v1/pipelines/render      | read  | the pipeline as the YAML file `streamtune apply -f` reads       |

The preview reads the real source, bounded (at most 50 records, 5 s to connect, 5 s per
query): a `kafka://` topic's newest records, a PostgreSQL table's columns and first rows,
a MongoDB collection's first documents. Each record goes through the job's own code: a
table row or document through the pipeline's mapping (operators.cdc_mapping: filter, then
prompt / completion / weight, then the sample contract), with its values typed as the
capture types them (connectors.postgres_wal.typed, connectors.mongo_changes.plain); a
topic's record through the job's edge validation (operators.validate.parse). So the preview
and the job cannot disagree on what becomes a sample and what is dead-lettered, and why.

The spec may be unfinished (no `cdc` block yet, say): the fields and records are answered
all the same, with `spec_errors` naming what the spec still lacks, field by field. An unknown
table or collection answers 404, an unreachable source 503, a malformed source URI 422.
It connects with the credentials the pipeline's capture would get (its secret reference,
or the stack's own for the stack's PostgreSQL): admin scope, as applying it would need.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal, Optional

import yaml
from fastapi import APIRouter, HTTPException
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field, ValidationError

from core import transport
from core.errors import ConfigError, InvalidMessage
from core.messages import FeedbackSample
from core.sources.base import source_for
from core.sources.kafka import KafkaSource
from core.sources.mongodb import MongoSource
from core.sources.postgres import PostgresSource
from streamtune.pipeline import Pipeline

from .gateway import StackUnavailable
from .routes import AUTH_ERR, BAD_BODY, STACK_ERR, TOO_LARGE, ControlPlane, Plane, Reader, Writer, _err

router = APIRouter()
CONNECT_TIMEOUT_S = 5
QUERY_TIMEOUT_MS = 5000


class PreviewRequest(BaseModel):
    pipeline: dict[str, Any] = Field(description="the pipeline spec as `streamtune apply -f` reads it, "
                                                 "finished or not (stream_source is enough to read the source)")
    limit: int = Field(default=5, ge=1, le=50, description="records to read")


class SourceField(BaseModel):
    name: str
    type: Optional[str] = None   # the column's type (PostgreSQL); the JSON type first seen otherwise


class SampleView(BaseModel):
    prompt: str
    completion: str
    weight: float


class RecordPreview(BaseModel):
    record: Any                                   # the row, document or record value as the job sees it
    where: str                                    # table, collection or topic/partition/offset
    outcome: Literal["sample", "filtered", "dead_letter", "other_model", "unchecked"]
    sample: Optional[SampleView] = None
    reason: Optional[str] = None                  # the dead-letter reason (as the job's DLQ names it)
    detail: Optional[str] = None


class SpecError(BaseModel):
    field: str                                    # dotted path into the spec, e.g. cdc.prompt
    message: str


class PreviewResponse(BaseModel):
    source: str
    kind: Literal["kafka", "postgres", "mongodb"]
    fields: list[SourceField]
    records: list[RecordPreview]
    spec_errors: list[SpecError] = []


@router.post("/v1/pipelines/preview", response_model=PreviewResponse,
             responses={**AUTH_ERR, **BAD_BODY, **TOO_LARGE, **_err(404, "no such table or collection"),
                        **_err(503, "the source (Kafka, PostgreSQL, MongoDB) is not reachable or failed")})
def preview(body: PreviewRequest, actor: Writer, plane: Plane):
    """The source's fields, up to `limit` of its records, and what the job would make of each:
    its sample (prompt, completion, weight), `filtered`, `other_model`, or `dead_letter` with
    the DLQ's reason. `unchecked` while the spec is unfinished; `spec_errors` says why. A
    missing or malformed source URI answers 422 in FastAPI's validation shape, at
    `body.pipeline.stream_source`."""
    uri = body.pipeline.get("stream_source")
    if not isinstance(uri, str) or not uri:
        raise HTTPException(422, [_problem("stream_source", "choose a source: a Kafka topic, a PostgreSQL table "
                                                            "or a MongoDB collection")])
    try:
        source = source_for(uri)
    except (ValueError, ConfigError) as e:
        raise HTTPException(422, [_problem("stream_source", str(e))]) from None
    pipeline, spec_errors = None, []
    try:
        pipeline = Pipeline.model_validate(body.pipeline)
    except ValidationError as e:
        spec_errors = [SpecError(field=".".join(str(p) for p in err["loc"]) or "pipeline",
                                 message=err["msg"].removeprefix("Value error, ")) for err in e.errors()]
    if isinstance(source, KafkaSource):
        fields, records = _kafka(plane, source, body.limit, pipeline, body.pipeline.get("model_id"))
        kind = "kafka"
    elif isinstance(source, PostgresSource):
        fields, records = _postgres(plane, source, body.limit, pipeline)
        kind = "postgres"
    elif isinstance(source, MongoSource):
        fields, records = _mongo(source, body.limit, pipeline)
        kind = "mongodb"
    else:  # a source kind registered later: its records are not read here
        raise HTTPException(422, [_problem("stream_source", f"no preview for {source.scheme}:// sources")])
    return PreviewResponse(source=source.source_id, kind=kind, fields=fields, records=records,
                           spec_errors=spec_errors)


@router.post("/v1/pipelines/render",  # errors are JSON; only the file itself is YAML
             responses={200: {"content": {"application/yaml": {}}, "description": "the pipeline file"},
                        **AUTH_ERR, **BAD_BODY, **TOO_LARGE})
def render(pipeline: Pipeline, actor: Reader):
    """The validated pipeline as YAML: `streamtune apply -f` reads it as the same pipeline
    (the same hash: `unchanged` once applied). Defaults left out."""
    spec = pipeline.model_dump(mode="json", exclude_defaults=True)
    text = yaml.safe_dump(spec, sort_keys=False, allow_unicode=True, width=100)
    return PlainTextResponse(text, media_type="application/yaml",
                             headers={"Content-Disposition": f'attachment; filename="{pipeline.name}.yaml"'})


def _problem(field: str, message: str) -> dict:
    """A 422 detail entry in FastAPI's shape, so clients show it beside the field."""
    return {"loc": ["body", "pipeline", field], "msg": message, "type": "value_error"}


# ---------------------------------------------------------------- sources

def _kafka(plane: ControlPlane, source: KafkaSource, limit: int, pipeline: Optional[Pipeline],
           model_id: Any) -> tuple[list[SourceField], list[RecordPreview]]:
    """The topic's newest records through the job's edge validation (operators.validate)."""
    from jobs.wiring import JobConfig
    from operators.validate import parse

    records = plane.gateway.tail(source.topic, limit)[-limit:]
    fields: dict[str, str] = {}
    out = []
    for r in records:
        payload = r.value.decode("utf-8", errors="replace") if r.value is not None else None
        try:
            value = json.loads(payload) if payload else None
        except ValueError:
            value = payload
        if isinstance(value, dict):
            for k, v in value.items():
                fields.setdefault(k, json_type(v))
        where = f"{r.topic}/{r.partition}@{r.offset}"
        try:
            kind, record_model = parse("sample", payload, JobConfig.max_record_bytes, frozenset())
        except InvalidMessage as e:
            out.append(RecordPreview(record=value, where=where, outcome="dead_letter", reason=e.code,
                                     detail=e.detail[:500]))
            continue
        sample = FeedbackSample.from_json(payload)
        view = SampleView(prompt=sample.prompt, completion=sample.completion, weight=sample.weight)
        if model_id and record_model != model_id:  # the job trains another model on it
            out.append(RecordPreview(record=value, where=where, outcome="other_model", sample=view,
                                     detail=f"a sample of model {record_model}"))
        else:
            out.append(RecordPreview(record=value, where=where, outcome="sample", sample=view))
    return [SourceField(name=k, type=t) for k, t in fields.items()], out


def _postgres(plane: ControlPlane, source: PostgresSource, limit: int,
              pipeline: Optional[Pipeline]) -> tuple[list[SourceField], list[RecordPreview]]:
    """Each table's columns and first rows, typed as the capture types a change's values."""
    import psycopg
    from psycopg import sql

    from connectors.postgres_wal import typed

    env = plane.captures.env_for(source)
    try:
        password = source.secret_password(env) or env.get("PGPASSWORD")
    except ConfigError as e:
        raise HTTPException(422, [_problem("stream_source", str(e))]) from None
    user = None if source.user else env.get("PGUSER")
    host, port = source.host_port
    fields: dict[str, str] = {}
    out = []
    try:
        with psycopg.connect(source.dsn, user=user, password=password, connect_timeout=CONNECT_TIMEOUT_S,
                             options=f"-c statement_timeout={QUERY_TIMEOUT_MS}", autocommit=True,
                             **transport.psycopg_kwargs()) as conn:
            for table in source.tables:
                schema, _, name = table.partition(".")
                columns = conn.execute(
                    "SELECT a.attname, a.atttypid::int, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a "
                    "WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
                    (table,)).fetchall()
                if not columns:
                    raise HTTPException(404, [_problem("stream_source", f"table {table} does not exist in database "
                                                                        f"{source.db} (or has no columns)")])
                for col, _, type_name in columns:
                    fields.setdefault(col, type_name)
                # As text, then typed like the WAL's text values: the rows the job would map.
                query = sql.SQL("SELECT {} FROM {} LIMIT %s").format(
                    sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(c)) for c, _, _ in columns),
                    sql.Identifier(schema, name))
                for values in conn.execute(query, (limit,)).fetchall():
                    row = {c: typed(v, oid) for (c, oid, _), v in zip(columns, values)}
                    out.append(_mapped(pipeline, row, table, f"postgres:{table}"))
    except psycopg.OperationalError as e:
        raise StackUnavailable(f"PostgreSQL at {host}:{port} not reachable or refused: {str(e).strip()[:300]}")
    except psycopg.Error as e:
        raise StackUnavailable(f"reading {', '.join(source.tables)} failed: {str(e).strip()[:300]}")
    return [SourceField(name=k, type=t) for k, t in fields.items()], out


def _mongo(source: MongoSource, limit: int,
           pipeline: Optional[Pipeline]) -> tuple[list[SourceField], list[RecordPreview]]:
    """The collection's first documents, as the capture turns them into JSON."""
    import pymongo

    from connectors.mongo_changes import plain

    try:
        password = source.secret_password()
    except ConfigError as e:
        raise HTTPException(422, [_problem("stream_source", str(e))]) from None
    auth = {"password": password} if password else {}
    client = pymongo.MongoClient(source.connection_uri, serverSelectionTimeoutMS=CONNECT_TIMEOUT_S * 1000,
                                 socketTimeoutMS=QUERY_TIMEOUT_MS, **transport.pymongo_kwargs(), **auth)
    target = f"{source.db}.{source.collection}"
    try:
        if source.collection not in client[source.db].list_collection_names():
            raise HTTPException(404, [_problem("stream_source", f"collection {target} does not exist")])
        docs = [plain(d) for d in client[source.db][source.collection].find().limit(limit)]
    except pymongo.errors.PyMongoError as e:
        raise StackUnavailable(f"MongoDB {target} not reachable or failed: {str(e).strip()[:300]}")
    finally:
        client.close()
    fields: dict[str, str] = {}
    for d in docs:
        _flatten(d, "", fields)
    return ([SourceField(name=k, type=t) for k, t in fields.items()],
            [_mapped(pipeline, d, target, f"mongodb:{target}") for d in docs])


def _flatten(doc: dict, prefix: str, into: dict[str, str]) -> None:
    """Dotted paths of a document's fields (what a mapping may name), with their JSON type."""
    for k, v in doc.items():
        path = f"{prefix}{k}"
        into.setdefault(path, json_type(v))
        if isinstance(v, dict) and not any(key.startswith("$") for key in v):
            _flatten(v, f"{path}.", into)


def json_type(value: Any) -> str:
    """A value's JSON type name.

    >>> [json_type(v) for v in (None, True, 1, 1.5, "a", [1], {"a": 1})]
    ['null', 'boolean', 'number', 'number', 'string', 'array', 'object']
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return "string" if isinstance(value, str) else "array" if isinstance(value, list) else "object"


def _mapped(pipeline: Optional[Pipeline], row: dict, where: str, source_id: str) -> RecordPreview:
    """The row through the pipeline's mapping, as operators.row_changes maps a change."""
    if pipeline is None or pipeline.cdc is None:
        return RecordPreview(record=row, where=where, outcome="unchecked")
    for m in pipeline.mapping().mappings:
        if m.source != source_id:
            continue
        if not m.applies(row):
            return RecordPreview(record=row, where=where, outcome="filtered",
                                 detail="the filter leaves it out: no sample")
        try:
            sample = FeedbackSample.from_dict({**m.sample_fields(row), "model_id": pipeline.model_id,
                                               "sample_id": "preview", "ts": int(time.time() * 1000)})
        except ValueError as e:  # InvalidMessage included: the job dead-letters it as `unmappable`
            return RecordPreview(record=row, where=where, outcome="dead_letter", reason="unmappable",
                                 detail=str(e)[:500])
        return RecordPreview(record=row, where=where, outcome="sample",
                             sample=SampleView(prompt=sample.prompt, completion=sample.completion,
                                               weight=sample.weight))
    return RecordPreview(record=row, where=where, outcome="unchecked")
