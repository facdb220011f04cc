"""Pipelines: one declarative spec per model for every source kind (streamtune.pipeline).

| endpoint                          | scope     | what it does                                       |
|-----------------------------------|-----------|----------------------------------------------------|
| POST   /v1/pipelines[?dry_run=1]  | admin     | create, hot-update or leave as is; answers the diff |
| GET    /v1/pipelines              | read      | every pipeline with its job and capture state       |
| GET    /v1/pipelines/{name}       | read      | one of them                                         |
| DELETE /v1/pipelines/{name}       | admin     | stop its job (savepoint) and capture; forget it     |
| POST   /v1/pipelines/{name}/pause  | admin     | CDC: stop the job with a savepoint (capture goes on)|
| POST   /v1/pipelines/{name}/resume | admin     | CDC: resubmit the job from that savepoint           |
| GET    /v1/pipelines/{name}/dlq    | read      | the newest dead letters of its job, with reasons    |

Applying is idempotent, in kubectl's habits: the same pipeline again is `unchanged` and
touches nothing; `changes` lists each field that differs (`path: old -> new`), and a dry run
answers that without acting.

- `kafka://` sources go the way of POST /v1/stream-finetune (one job per topic; a changed
  spec is a hot update on the config topic).
- `postgres://` and `mongodb://` sources: the control plane writes the mapping file, creates
  the topics (`pipeline.<name>.cdc`, `.configs`, `.versions`, `.dlq`, `.adapter-versions`),
  starts and supervises the capture (streamtune/api/captures.py), submits jobs/cdc_retrain.py
  and publishes the spec. A change of the fine-tune fields alone is a hot update; a change of
  the `cdc` block stops the job with a savepoint and resubmits it from there with the new
  mapping. Deleting stops the job with a savepoint, stops the capture and drops its
  replication slot and publication (PostgreSQL), so the server keeps no WAL for it.
- Pausing a CDC pipeline stops its job with a savepoint; the capture keeps writing changes
  to Kafka, where they wait. Resuming submits the job from the savepoint: nothing is lost or
  trained twice. An apply while paused records the change and leaves the job stopped. (A
  `kafka://` pipeline shares its topic's job with other models: stop it instead.)
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Literal, Optional

from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from core import defaults, transport
from core.errors import ConfigError
from core.messages import DeadLetter
from core.sources.postgres import PostgresSource
from streamtune.pipeline import Pipeline, connector_name

from .gateway import LIVE_STATES, StackUnavailable, job_topics
from .routes import (AUTH_ERR, BAD_BODY, NOT_FOUND, STACK_ERR, TOO_LARGE, ControlPlane, ModelIdPath, Plane, Reader,
                     Writer, _job_id, _now_ms, apply_spec, stop_model)

router = APIRouter()


class ApplyResponse(BaseModel):
    name: str
    action: Literal["created", "unchanged", "updated", "restarted"]
    changes: list[str]
    dry_run: bool
    job_id: Optional[str] = None


class PipelineState(BaseModel):
    name: str
    kind: Literal["kafka", "cdc"]
    hash: str
    pipeline: dict[str, Any]
    job_id: Optional[str] = None
    job_state: Optional[str] = None
    capture: Optional[dict[str, Any]] = None
    topics: dict[str, str] = {}
    paused: Optional[str] = None   # the savepoint a paused CDC pipeline resumes from


class DeleteResponse(BaseModel):
    name: str
    job_id: Optional[str] = None
    job_stopped: bool
    savepoint: Optional[str] = None
    capture_stopped: bool = False


def pipeline_key(name: str) -> str:
    """What a CDC pipeline's topics and job (streamtune-<key>) are named after."""
    return f"pipeline.{name}"


def pipeline_topics(name: str) -> dict[str, str]:
    key = pipeline_key(name)
    return {"cdc": f"{key}.cdc", "configs": f"{key}.configs", "versions": f"{key}.versions", "dlq": f"{key}.dlq",
            "adapter-versions": f"{key}.adapter-versions"}


def changes(old: Any, new: Any, path: str = "") -> list[str]:
    """Each leaf that differs, as `path: old -> new`.

    >>> changes({"a": {"b": 1, "c": [1]}}, {"a": {"b": 2, "c": [1]}, "d": None})
    ['a.b: 1 -> 2']
    """
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            out += changes(old.get(key), new.get(key), f"{path}.{key}" if path else key)
        return out
    return [] if old == new else [f"{path}: {json.dumps(old)} -> {json.dumps(new)}"]


@router.post("/v1/pipelines", response_model=ApplyResponse,
             responses={**AUTH_ERR, **BAD_BODY, **TOO_LARGE, **STACK_ERR,
                        409: {"description": "the model is already trained from another source"}})
def apply(pipeline: Pipeline, actor: Writer, plane: Plane, dry_run: bool = False):
    with plane.jobs_lock:
        data = plane.jobs.load()
        entry = data["pipelines"].get(pipeline.name)
        new = pipeline.model_dump(mode="json")
        diff = changes(entry["pipeline"] if entry else {}, new)
        if entry and entry["hash"] == pipeline.pipeline_hash():
            return ApplyResponse(name=pipeline.name, action="unchanged", changes=[], dry_run=dry_run,
                                 job_id=entry.get("job_id"))
        if entry and Pipeline.model_validate(entry["pipeline"]).source_id != pipeline.source_id:
            raise HTTPException(409, f"pipeline {pipeline.name} reads {entry['pipeline']['stream_source']}; "
                                     "delete it first to move it to another source")
        if not entry and pipeline.model_id in data["models"]:
            raise HTTPException(409, f"model {pipeline.model_id} was submitted through /v1/stream-finetune; "
                                     "stop it there first")
        restart = bool(entry) and pipeline.is_cdc and entry["pipeline"].get("cdc") != new.get("cdc")
        action = "created" if not entry else "restarted" if restart else "updated"
        if dry_run:
            return ApplyResponse(name=pipeline.name, action=action, changes=diff, dry_run=True,
                                 job_id=entry.get("job_id") if entry else None)
        if pipeline.is_cdc:
            job_id = _apply_cdc(plane, pipeline, entry, restart)
        else:
            answer = apply_spec(plane, pipeline.finetune_spec())
            job_id = json.loads(answer.body)["job_id"]
            data = plane.jobs.load()  # apply_spec recorded the model and its job
        data["pipelines"][pipeline.name] = {
            "pipeline": new, "hash": pipeline.pipeline_hash(), "kind": "cdc" if pipeline.is_cdc else "kafka",
            "job_id": job_id, "applied_at": _now_ms(), "paused": entry.get("paused") if entry else None,
            "topics": pipeline_topics(pipeline.name) if pipeline.is_cdc else {}}
        plane.jobs.save(data)
        return JSONResponse(ApplyResponse(name=pipeline.name, action=action, changes=diff, dry_run=False,
                                          job_id=job_id).model_dump(), status_code=201 if not entry else 200)


@router.get("/v1/pipelines", response_model=list[PipelineState], responses={**AUTH_ERR})
def list_pipelines(actor: Reader, plane: Plane):
    data = plane.jobs.load()
    return [_state(plane, data, name, entry) for name, entry in sorted(data["pipelines"].items())]


@router.get("/v1/pipelines/{name}", response_model=PipelineState, responses={**AUTH_ERR, **NOT_FOUND})
def get_pipeline(name: ModelIdPath, actor: Reader, plane: Plane):
    data = plane.jobs.load()
    return _state(plane, data, name, _entry(data, name))


@router.delete("/v1/pipelines/{name}", response_model=DeleteResponse, responses={**AUTH_ERR, **NOT_FOUND, **STACK_ERR})
def delete(name: ModelIdPath, actor: Writer, plane: Plane):
    with plane.jobs_lock:
        data = plane.jobs.load()
        entry = _entry(data, name)
        if entry["kind"] == "kafka":
            stopped = stop_model(plane, name) if name in data["models"] else None
            data = plane.jobs.load()
            data["pipelines"].pop(name, None)
            plane.jobs.save(data)
            return DeleteResponse(name=name, job_id=stopped.job_id if stopped else None,
                                  job_stopped=bool(stopped and stopped.job_stopped),
                                  savepoint=stopped.savepoint if stopped else None)
        job_id, savepoint, job_stopped = entry.get("job_id"), None, False
        if job_id and _job_state(plane, job_id) in LIVE_STATES:
            savepoint, job_stopped = plane.gateway.stop_with_savepoint(job_id), True
        capture_stopped = plane.captures.stop(connector_name(name))
        pipeline = Pipeline.model_validate(entry["pipeline"])
        if isinstance(pipeline.source, PostgresSource):
            _drop_slot(plane, pipeline, connector_name(name))
        del data["pipelines"][name]
        plane.jobs.save(data)
        return DeleteResponse(name=name, job_id=job_id, job_stopped=job_stopped, savepoint=savepoint,
                              capture_stopped=capture_stopped)


class PauseResponse(BaseModel):
    name: str
    paused: bool
    job_id: Optional[str] = None
    savepoint: Optional[str] = None


class DeadLetterView(BaseModel):
    reason: str
    detail: str
    kind: Optional[str] = None
    model_id: Optional[str] = None
    topic: Optional[str] = None
    partition: Optional[int] = None
    offset: Optional[int] = None
    payload: Optional[str] = None
    ts: int


@router.post("/v1/pipelines/{name}/pause", response_model=PauseResponse,
             responses={**AUTH_ERR, **NOT_FOUND, **STACK_ERR, 409: {"description": "not a CDC pipeline"}})
def pause(name: ModelIdPath, actor: Writer, plane: Plane):
    with plane.jobs_lock:
        data = plane.jobs.load()
        entry = _cdc_entry(data, name)
        if entry.get("paused"):
            return PauseResponse(name=name, paused=True, job_id=entry.get("job_id"), savepoint=entry["paused"])
        job_id = entry.get("job_id")
        if not job_id or _job_state(plane, job_id) not in LIVE_STATES:
            raise HTTPException(409, f"the job of pipeline {name} is not running ({job_id}); apply it again")
        savepoint = _stop_with_savepoint(plane, job_id)
        entry["paused"] = savepoint
        plane.jobs.save(data)
        return PauseResponse(name=name, paused=True, job_id=job_id, savepoint=savepoint)


@router.post("/v1/pipelines/{name}/resume", response_model=PauseResponse,
             responses={**AUTH_ERR, **NOT_FOUND, **STACK_ERR, 409: {"description": "not a CDC pipeline"}})
def resume(name: ModelIdPath, actor: Writer, plane: Plane):
    with plane.jobs_lock:
        data = plane.jobs.load()
        entry = _cdc_entry(data, name)
        savepoint = entry.get("paused")
        if not savepoint:
            return PauseResponse(name=name, paused=False, job_id=entry.get("job_id"))
        job_id = plane.gateway.submit_cdc_job(pipeline_key(name), entry["topics"], _mapping_file(plane, name),
                                              savepoint)
        entry.update(job_id=job_id, paused=None)
        plane.jobs.save(data)
        return PauseResponse(name=name, paused=False, job_id=job_id, savepoint=savepoint)


@router.get("/v1/pipelines/{name}/dlq", response_model=list[DeadLetterView], responses={**AUTH_ERR, **NOT_FOUND,
                                                                                         **STACK_ERR})
def dead_letters(name: ModelIdPath, actor: Reader, plane: Plane, limit: int = Query(50, ge=1, le=1000)):
    """The newest dead letters of the pipeline's job (job-wide for a kafka:// topic shared by models)."""
    data = plane.jobs.load()
    entry = _entry(data, name)
    if entry["kind"] == "cdc":
        topic = entry["topics"]["dlq"]
    else:
        model = data["models"].get(name)
        topic = job_topics(model["topic"])["dlq"] if model else None
    out = []
    for record in plane.gateway.tail(topic, limit) if topic else []:
        try:
            d = DeadLetter.from_json(record.value)
            out.append(DeadLetterView(reason=d.reason, detail=d.detail, kind=d.kind, model_id=d.model_id,
                                      topic=d.source.topic, partition=d.source.partition, offset=d.source.offset,
                                      payload=(d.payload or "")[:500], ts=record.timestamp))
        except ValueError as e:  # written by something else: shown, not hidden
            out.append(DeadLetterView(reason="unreadable", detail=str(e).splitlines()[0][:300], ts=record.timestamp,
                                      payload=record.value[:500].decode(errors="replace")))
    return out[-limit:]


# ---------------------------------------------------------------- CDC pipelines

def _apply_cdc(plane: ControlPlane, pipeline: Pipeline, entry: Optional[dict], restart: bool) -> str:
    """Mapping file, capture, job, spec: whatever of them the change needs; the job's id."""
    topics = pipeline_topics(pipeline.name)
    mapping_file = _mapping_file(plane, pipeline.name)
    job_id = entry.get("job_id") if entry else None
    restore_from = None
    if restart and job_id and not entry.get("paused") and _job_state(plane, job_id) in LIVE_STATES:
        restore_from = _stop_with_savepoint(plane, job_id)
    if restart or not entry:
        mapping_file.parent.mkdir(parents=True, exist_ok=True)
        mapping_file.write_text(pipeline.mapping().model_dump_json(indent=1, exclude_none=True))
    start_capture(plane, pipeline)
    if entry and entry.get("paused"):
        pass  # resume submits the job from its savepoint, with this mapping
    elif restart or not entry or job_id is None or _job_state(plane, job_id) not in LIVE_STATES:
        job_id = plane.gateway.submit_cdc_job(pipeline_key(pipeline.name), topics, mapping_file, restore_from)
    spec = pipeline.finetune_spec()
    now = _now_ms()
    # Event time of the spec: before any change, so no change waits for a config from "later".
    plane.gateway.produce(topics["configs"], [(spec.model_id, spec, now - 60_000)])
    return job_id


def start_capture(plane: ControlPlane, pipeline: Pipeline) -> int:
    """(Re)start the pipeline's capture unless it already runs with the same arguments; its pid."""
    name = connector_name(pipeline.name)
    topics = pipeline_topics(pipeline.name)
    argv = [sys.executable, "-m", "streamtune.cli", "cdc", "--source", pipeline.capture_source(name), "--name", name,
            "--topic", topics["cdc"], "--bootstrap-server", plane.gateway.stack.kafka_bootstrap,
            "--offsets-topic", defaults.CDC_OFFSETS_TOPIC, *(["--snapshot"] if pipeline.cdc.snapshot else [])]
    return plane.captures.ensure(name, argv, pipeline.source)  # credentials: its env, never argv


def resume_captures(plane: ControlPlane) -> None:
    """At start: the captures of the CDC pipelines on record."""
    for name, entry in plane.jobs.load()["pipelines"].items():
        if entry["kind"] == "cdc":
            start_capture(plane, Pipeline.model_validate(entry["pipeline"]))


def _drop_slot(plane: ControlPlane, pipeline: Pipeline, connector: str) -> None:
    import psycopg

    env = plane.captures.env_for(pipeline.source)
    deadline = time.monotonic() + 15
    while True:
        try:
            password = pipeline.source.secret_password(env) or env.get("PGPASSWORD")
            user = None if pipeline.source.user else env.get("PGUSER")  # the URI's user first
            with psycopg.connect(pipeline.source.dsn, user=user, password=password,
                                 autocommit=True, connect_timeout=10, **transport.psycopg_kwargs()) as conn:
                conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                             "WHERE slot_name = %s", (connector,))
                conn.execute(f'DROP PUBLICATION IF EXISTS "{connector}"')  # connector_name: an identifier
                return
        except psycopg.errors.ObjectInUse:  # the stopped capture's walsender is still on its way out
            if time.monotonic() > deadline:
                raise StackUnavailable(f"replication slot {connector} is still in use 15 s after its capture "
                                       "stopped; delete the pipeline again") from None
            time.sleep(0.2)
        except (psycopg.Error, ConfigError) as e:
            raise StackUnavailable(f"dropping replication slot {connector} failed: {str(e).strip()[:300]}")


def _stop_with_savepoint(plane: ControlPlane, job_id: str) -> str:
    """`flink stop` with a savepoint; its path, which resuming the job needs."""
    savepoint = plane.gateway.stop_with_savepoint(job_id)
    if savepoint is None:
        raise StackUnavailable(f"job {job_id} stopped without reporting a savepoint; apply again to resubmit")
    return savepoint


def _state(plane: ControlPlane, data: dict, name: str, entry: dict) -> PipelineState:
    job_id = entry.get("job_id")
    if entry["kind"] == "kafka" and name in data["models"]:  # the topic's job, shared with other models
        job_id = _job_id(data, data["models"][name])
    return PipelineState(name=name, kind=entry["kind"], hash=entry["hash"], pipeline=entry["pipeline"],
                         job_id=job_id, job_state=_job_state(plane, job_id) if job_id else None,
                         capture=plane.captures.status(connector_name(name)) if entry["kind"] == "cdc" else None,
                         topics=entry.get("topics", {}), paused=entry.get("paused"))


def _job_state(plane: ControlPlane, job_id: str) -> Optional[str]:
    try:
        return plane.gateway.job_state(job_id)
    except StackUnavailable:
        return None


def _mapping_file(plane: ControlPlane, name: str):
    return plane.pipelines_dir / name / "mapping.json"


def _cdc_entry(data: dict, name: str) -> dict:
    entry = _entry(data, name)
    if entry["kind"] != "cdc":
        raise HTTPException(409, f"pipeline {name} reads a Kafka topic whose job other models share: "
                                 "stop it with DELETE instead")
    return entry


def _entry(data: dict, name: str) -> dict:
    entry = data["pipelines"].get(name)
    if entry is None:
        raise HTTPException(404, f"no pipeline named {name}")
    return entry

