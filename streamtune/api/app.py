"""The REST control plane (FastAPI). Start it with `streamtune api --host H --port P`.

| endpoint                                | auth            | what it does                                  |
|-----------------------------------------|-----------------|-----------------------------------------------|
| POST   /v1/stream-finetune              | bearer          | submit a job for the spec's topic, or hot-update |
| GET    /v1/stream-finetune/{model_id}   | read_auth       | job state, spec hash in force, last version, counters |
| DELETE /v1/stream-finetune/{model_id}   | bearer          | forget the model; last model: stop job with savepoint |
| GET    /v1/models/{model_id}/versions   | read_auth       | MLflow versions                               |
| POST   /v1/models/{model_id}/aliases    | bearer          | move an alias (promote / roll back), logged   |
| GET    /v1/models/{model_id}/promotions | read_auth       | the promotion log of that model               |
| POST   /v1/feedback                     | bearer          | click / dwell / correction events → feedback topic |

Jobs. One Flink job per Kafka source topic T, named `streamtune-T`, reading feedback from T
and configs from `T.configs`, writing versions to `T.versions` and dead letters to `T.dlq`.
A spec is idempotent by (model_id, spec hash): posting the spec in force again returns 200
with the first answer and publishes nothing. Only `kafka://` sources can be submitted here:
`postgres://` and `mongodb://` sources get 501, because a CDC job also needs a capture
process and a mapping file (README "CDC"): run `streamtune cdc`, submit
`jobs/cdc_retrain.py` and publish the spec to that job's config topic.

Errors from the stack (Flink cluster, Kafka, MLflow unreachable or failing) are answered
with a documented 503 and a one-line `detail`; nothing is recorded in that case.

Counters (GET status): `in` and `dlq` are the end offsets of the job's feedback and DLQ
topics summed over partitions (job-wide, not per model; the DLQ is written transactionally,
so its offsets also count transaction markers: an upper bound); `versions` is the end
offset of the versions topic (same caveat); `trained_samples` is the sum of the `samples`
tag over the model's MLflow versions (per model, exact for registered versions).

Feedback events map to feedback samples (streamtune/specs.py FeedbackSample):

| event type  | fields                                        | sample                                   |
|-------------|-----------------------------------------------|------------------------------------------|
| click       | prompt, completion                            | label accepted, weight 1                 |
| dwell       | prompt, completion, dwell_seconds             | label accepted, weight min(dwell/10, 3)  |
| correction  | prompt, corrected_completion (original ignored)| label corrected, completion = corrected, weight 1 |

Every event has event_id (→ sample_id), model_id and ts (epoch ms, → sample ts and the
Kafka record timestamp). A request holds one event or a JSON array of at most
`max_feedback_batch` events (413 beyond); every model must have a registered spec (404
otherwise) and nothing is produced unless the whole request is valid.
"""

import contextlib
import hmac
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import requests
from fastapi import Body, Depends, FastAPI, HTTPException, Path as PathParam, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, field_validator

from streamtune.specs import MODEL_ID, FeedbackSample, FinetuneSpec
from streamtune.stack.config import StackConfig

from .registry import JobsRegistry, PromotionLog

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
JOB_SCRIPT = REPO / "jobs" / "stream_finetune.py"
# Flink job states in which a job still serves (or is about to serve) its topic.
LIVE_STATES = {"CREATED", "INITIALIZING", "RUNNING", "RESTARTING", "RECONCILING"}
DWELL_UNIT_SECONDS = 10.0
DWELL_MAX_WEIGHT = 3.0


@dataclass
class ApiSettings:
    stack: StackConfig
    token: Optional[str] = None
    read_auth: bool = False
    max_body_bytes: int = 1 << 20
    max_feedback_batch: int = 500
    base_model: Optional[Path] = None          # default <data_dir>/models/tiny-llama
    artifact_dir: Optional[Path] = None        # default <data_dir>/adapters
    jobs_file: Optional[Path] = None           # default <home>/api/jobs.json
    promotion_log: Optional[Path] = None       # default <home>/api/promotions.jsonl
    job_script: Path = JOB_SCRIPT
    extra_job_args: list[str] = field(default_factory=list)
    flink_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        s = self.stack
        self.base_model = Path(self.base_model or s.data_dir / "models" / "tiny-llama")
        self.artifact_dir = Path(self.artifact_dir or s.data_dir / "adapters")
        self.jobs_file = Path(self.jobs_file or s.home / "api" / "jobs.json")
        self.promotion_log = Path(self.promotion_log or s.home / "api" / "promotions.jsonl")
        if self.max_body_bytes < 1 or self.max_feedback_batch < 1:
            raise ValueError("max_body_bytes and max_feedback_batch must be >= 1")

    @classmethod
    def from_env(cls, token_file: Optional[str] = None, **kwargs) -> "ApiSettings":
        """Stack from STREAMTUNE_*; token from --token-file, else STREAMTUNE_API_TOKEN;
        read auth on when STREAMTUNE_API_READ_AUTH is 1/true/yes."""
        token = Path(token_file).read_text().strip() if token_file else os.environ.get("STREAMTUNE_API_TOKEN")
        read_auth = os.environ.get("STREAMTUNE_API_READ_AUTH", "").lower() in ("1", "true", "yes")
        kwargs.setdefault("stack", StackConfig.from_env())
        kwargs.setdefault("read_auth", read_auth)
        return cls(token=token or None, **kwargs)


# ---------------------------------------------------------------- response and request models

class ErrorBody(BaseModel):
    detail: str


class SubmitResponse(BaseModel):
    job_id: str
    model_id: str
    config_version: str = Field(description="the spec hash")
    submitted: bool = Field(description="true when this request submitted a new Flink job")


class VersionInfo(BaseModel):
    version: int
    aliases: list[str]
    status: str
    run_id: Optional[str] = None
    source: Optional[str] = None
    created_ms: Optional[int] = None
    version_id: Optional[str] = None
    seq: Optional[int] = None
    window_start: Optional[int] = None
    window_end: Optional[int] = None
    samples: Optional[int] = None
    loss_after: Optional[float] = None


class VersionsResponse(BaseModel):
    model_id: str
    versions: list[VersionInfo]


class Window(BaseModel):
    start: int
    end: int


class Counters(BaseModel):
    in_: Optional[int] = Field(default=None, alias="in", description="feedback topic end offsets (job-wide)")
    dlq: Optional[int] = Field(default=None, description="DLQ topic end offsets (job-wide, upper bound)")
    versions: Optional[int] = Field(default=None, description="versions topic end offsets (job-wide, upper bound)")
    trained_samples: Optional[int] = Field(default=None, description="samples in the model's MLflow versions")

    model_config = ConfigDict(populate_by_name=True)


class StatusResponse(BaseModel):
    model_id: str
    topic: str
    job_id: str
    job_name: str
    job_state: Optional[str] = Field(description="Flink's job state; null when the cluster is unreachable")
    config_version: str
    spec: dict[str, Any]
    last_window: Optional[Window] = None
    last_version: Optional[VersionInfo] = None
    counters: Counters


class StopResponse(BaseModel):
    model_id: str
    job_id: str
    job_stopped: bool
    savepoint: Optional[str] = None


class AliasRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    alias: str = Field(default="champion", pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
    version: int = Field(ge=1, le=2**31 - 1)

    @field_validator("alias")
    @classmethod
    def _not_reserved(cls, v: str) -> str:
        if v.lower() == "latest" or re.fullmatch(r"[vV]\d+", v):
            raise ValueError("'latest' and v<N> are reserved by MLflow")
        return v


class AliasResponse(BaseModel):
    model_id: str
    alias: str
    from_version: Optional[int]
    to_version: int


class Promotion(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    ts: int
    model_id: str
    alias: str
    from_: Optional[int] = Field(alias="from")
    to: int
    actor: str


class PromotionsResponse(BaseModel):
    model_id: str
    promotions: list[Promotion]


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_id: str = Field(pattern=MODEL_ID)
    event_id: str = Field(min_length=1, max_length=256, description="becomes the sample_id")
    prompt: str = Field(max_length=65536)
    ts: int = Field(ge=0, le=2**53, description="event time, epoch milliseconds")


class ClickEvent(_Event):
    type: Literal["click"]
    completion: str = Field(min_length=1, max_length=65536)


class DwellEvent(_Event):
    type: Literal["dwell"]
    completion: str = Field(min_length=1, max_length=65536)
    dwell_seconds: float = Field(ge=0, le=86400)


class CorrectionEvent(_Event):
    type: Literal["correction"]
    corrected_completion: str = Field(min_length=1, max_length=65536)
    original_completion: Optional[str] = Field(default=None, max_length=65536)


FeedbackEvent = Annotated[Union[ClickEvent, DwellEvent, CorrectionEvent], Field(discriminator="type")]


class FeedbackAccepted(BaseModel):
    accepted: int
    topics: dict[str, str] = Field(description="model_id -> feedback topic")


def to_sample(e: Union[ClickEvent, DwellEvent, CorrectionEvent]) -> dict:
    """The feedback sample (specs.FeedbackSample) an event becomes."""
    return FeedbackSample.model_validate(_sample_fields(e)).model_dump(mode="json", exclude={"origin"})


def _sample_fields(e) -> dict:
    base = {"model_id": e.model_id, "sample_id": e.event_id, "prompt": e.prompt, "ts": e.ts}
    if isinstance(e, CorrectionEvent):
        return {**base, "completion": e.corrected_completion, "label": "corrected", "weight": 1.0}
    if isinstance(e, DwellEvent):
        weight = min(e.dwell_seconds / DWELL_UNIT_SECONDS, DWELL_MAX_WEIGHT)
        return {**base, "completion": e.completion, "label": "accepted", "weight": weight}
    return {**base, "completion": e.completion, "label": "accepted", "weight": 1.0}


# ---------------------------------------------------------------- helpers

class StackUnavailable(Exception):
    """The Flink cluster, Kafka or MLflow failed or cannot be reached (answered with 503)."""


def _err(status: int, description: str) -> dict:
    return {status: {"model": ErrorBody, "description": description}}


AUTH_ERR = _err(401, "missing or wrong bearer token")
STACK_ERR = _err(503, "the Flink cluster, Kafka or MLflow is not reachable or failed")
NOT_FOUND = _err(404, "no such model")
TOO_LARGE = _err(413, "request body or batch too large")
BAD_BODY = _err(400, "the body cannot be parsed (not UTF-8 JSON)")


def topics_for(topic: str) -> dict[str, str]:
    return {"feedback": topic, "configs": f"{topic}.configs", "versions": f"{topic}.versions",
            "dlq": f"{topic}.dlq"}


class BodyLimit:
    """ASGI middleware: 413 for a body over `max_bytes` (declared or streamed)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def _reject(self, send) -> None:
        body = json.dumps({"detail": f"request body exceeds {self.max_bytes} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    if int(value) > self.max_bytes:
                        return await self._reject(send)
                except ValueError:
                    pass
        chunks, total, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                return await self._reject(send)
            chunks.append(chunk)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


# ---------------------------------------------------------------- the app

def create_app(settings: ApiSettings) -> FastAPI:
    stack = settings.stack
    registry = JobsRegistry(settings.jobs_file)
    promotions = PromotionLog(settings.promotion_log)
    submit_lock = threading.Lock()
    state: dict[str, Any] = {"producer": None}
    state_lock = threading.Lock()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if state["producer"] is not None:
            state["producer"].close()

    app = FastAPI(title="streamtune control plane", version="1", lifespan=lifespan,
                  description=__doc__.split("\n\n")[0])
    app.state.settings = settings
    app.state.registry = registry
    app.state.promotions = promotions
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

    bearer = HTTPBearer(auto_error=False, description="STREAMTUNE_API_TOKEN")

    def _check(creds: Optional[HTTPAuthorizationCredentials]) -> str:
        token = settings.token
        if not token or creds is None or creds.scheme.lower() != "bearer" or \
                not hmac.compare_digest(creds.credentials.encode(), token.encode()):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})
        return "token"

    def require_write(creds: Annotated[Optional[HTTPAuthorizationCredentials], Depends(bearer)]) -> str:
        return _check(creds)

    def require_read(creds: Annotated[Optional[HTTPAuthorizationCredentials], Depends(bearer)]) -> str:
        return _check(creds) if settings.read_auth else "anonymous"

    @app.exception_handler(StackUnavailable)
    async def _stack_unavailable(request: Request, exc: StackUnavailable):
        return JSONResponse({"detail": str(exc)}, status_code=503)

    # -- stack access (each raises StackUnavailable on failure)

    def flink_get(path: str) -> dict:
        try:
            r = requests.get(f"{stack.flink_rest_url}{path}", timeout=5)
        except requests.RequestException as e:
            raise StackUnavailable(f"Flink cluster not reachable at {stack.flink_rest_url}: {type(e).__name__}")
        if r.status_code == 404:
            return {}
        if r.status_code >= 400:
            raise StackUnavailable(f"Flink REST {path} answered {r.status_code}")
        return r.json()

    def live_job(topic: str, data: dict) -> Optional[str]:
        """The id of a live job serving `topic`: the registry's, else one named streamtune-<topic>."""
        known = data["jobs"].get(topic)
        if known and flink_get(f"/jobs/{known['job_id']}").get("state") in LIVE_STATES:
            return known["job_id"]
        for job in flink_get("/jobs/overview").get("jobs", []):
            if job.get("name") == f"streamtune-{topic}" and job.get("state") in LIVE_STATES:
                return job["jid"]
        return None

    def get_producer():
        with state_lock:
            if state["producer"] is None:
                from kafka import KafkaProducer
                try:
                    state["producer"] = KafkaProducer(bootstrap_servers=stack.kafka_bootstrap, acks="all",
                                                      linger_ms=5, request_timeout_ms=15000, max_block_ms=15000)
                except Exception as e:
                    raise StackUnavailable(f"Kafka not reachable at {stack.kafka_bootstrap}: {type(e).__name__}: {e}")
            return state["producer"]

    def produce(topic: str, records: list[tuple[str, dict, int]]) -> None:
        p = get_producer()
        try:
            futures = [p.send(topic, key=k.encode(), value=json.dumps(v).encode(), timestamp_ms=ts)
                       for k, v, ts in records]
            p.flush(timeout=30)
            for f in futures:
                f.get(timeout=30)
        except Exception as e:
            raise StackUnavailable(f"producing to Kafka topic {topic} failed: {type(e).__name__}: {e}")

    def mlflow():
        from connectors.mlflow_registry import make_client
        return make_client(stack.mlflow_uri)

    def mlflow_call(fn, *args, missing_ok: bool = False):
        from mlflow.exceptions import MlflowException
        try:
            return fn(*args)
        except MlflowException as e:
            code = getattr(e, "error_code", "")
            if code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
                if missing_ok:
                    return None
                raise HTTPException(404, f"MLflow: {str(e).splitlines()[0][:300]}")
            raise StackUnavailable(f"MLflow at {stack.mlflow_uri} failed: {str(e).splitlines()[0][:300]}")
        except (requests.RequestException, OSError) as e:
            raise StackUnavailable(f"MLflow not reachable at {stack.mlflow_uri}: {type(e).__name__}")

    def versions_of(model_id: str) -> list[VersionInfo]:
        client = mlflow()
        if mlflow_call(client.get_registered_model, model_id, missing_ok=True) is None:
            return []
        mvs = mlflow_call(client.search_model_versions, f"name = '{model_id}'") or []
        out = []
        for mv in sorted(mvs, key=lambda v: int(v.version)):
            t = mv.tags or {}

            def num(key, cast=int):
                try:
                    return cast(t[f"streamtune.{key}"])
                except (KeyError, ValueError):
                    return None

            out.append(VersionInfo(
                version=int(mv.version), aliases=sorted(mv.aliases or []), status=str(mv.status),
                run_id=mv.run_id, source=mv.source, created_ms=mv.creation_timestamp,
                version_id=t.get("streamtune.version_id"), seq=num("seq"), window_start=num("window_start"),
                window_end=num("window_end"), samples=num("samples"), loss_after=num("loss_after", float)))
        return out

    def end_offsets(topic: str) -> Optional[int]:
        from kafka import KafkaConsumer, TopicPartition
        try:
            c = KafkaConsumer(bootstrap_servers=stack.kafka_bootstrap, request_timeout_ms=10000)
        except Exception:
            return None
        try:
            parts = c.partitions_for_topic(topic)
            if not parts:
                return None
            return sum(c.end_offsets([TopicPartition(topic, p) for p in parts]).values())
        except Exception:
            return None
        finally:
            c.close()

    # -- endpoints

    @app.post("/v1/stream-finetune", status_code=202, response_model=SubmitResponse,
              responses={200: {"model": SubmitResponse, "description": "the same spec is already in force"},
                         **AUTH_ERR, **BAD_BODY, **_err(409, "the model is registered on another source topic"),
                         **TOO_LARGE, **_err(501, "CDC sources (postgres, mongodb) are not submitted through the API"),
                         **STACK_ERR})
    def submit(spec: FinetuneSpec, actor: Annotated[str, Depends(require_write)]):
        topic = spec.kafka_topic
        if topic is None:
            raise HTTPException(501, f"stream_source {spec.stream_source.split(':', 1)[0]}:// is not implemented "
                                     "in the API: CDC sources need `streamtune cdc` and jobs/cdc_retrain.py with a "
                                     "mapping file (README, CDC); publish the spec to that job's config topic")
        spec_hash = spec.spec_hash()
        with submit_lock:
            data = registry.load()
            entry = data["models"].get(spec.model_id)
            if entry and entry["spec_hash"] == spec_hash:
                return JSONResponse(entry["response"], status_code=200)
            if entry and entry["topic"] != topic:
                raise HTTPException(409, f"model {spec.model_id} is trained from topic {entry['topic']}; "
                                         "DELETE it first to move it to another source")
            topics = topics_for(topic)
            job_id = live_job(topic, data)
            submitted = job_id is None
            if submitted:
                job_id = submit_job(topic, topics)
                data["jobs"][topic] = {"job_id": job_id, "job_name": f"streamtune-{topic}", "topics": topics,
                                       "submitted_at": int(time.time() * 1000)}
            else:
                data["jobs"].setdefault(topic, {"job_id": job_id, "job_name": f"streamtune-{topic}",
                                                "topics": topics, "submitted_at": None})
                data["jobs"][topic]["job_id"] = job_id
            now = int(time.time() * 1000)
            try:
                produce(topics["configs"], [(spec.model_id, spec.model_dump(mode="json"), now)])
            except StackUnavailable:
                if submitted:  # record the job so a retry hot-updates it instead of submitting another
                    registry.save(data)
                raise
            response = SubmitResponse(job_id=job_id, model_id=spec.model_id, config_version=spec_hash,
                                      submitted=submitted).model_dump()
            data["models"][spec.model_id] = {"topic": topic, "spec": spec.model_dump(mode="json"),
                                             "spec_hash": spec_hash, "job_id": job_id, "response": response,
                                             "registered_at": now}
            registry.save(data)
            return JSONResponse(response, status_code=202)

    def submit_job(topic: str, topics: dict) -> str:
        import subprocess

        from connectors.kafka import create_topic
        from streamtune.stack.flink import submit_detached
        from streamtune.stack.process import StackError

        try:
            for t in topics.values():
                create_topic(stack.kafka_bootstrap, t)
        except Exception as e:
            raise StackUnavailable(f"Kafka not reachable at {stack.kafka_bootstrap}: {type(e).__name__}: {e}")
        args = ["--bootstrap", stack.kafka_bootstrap, "--feedback-topic", topics["feedback"],
                "--config-topic", topics["configs"], "--versions-topic", topics["versions"],
                "--dlq-topic", topics["dlq"], "--base-model", str(settings.base_model),
                "--artifact-dir", str(settings.artifact_dir), "--job-name", f"streamtune-{topic}",
                *settings.extra_job_args]
        try:
            return submit_detached(stack, settings.job_script, args)
        except (StackError, subprocess.TimeoutExpired, OSError) as e:
            raise StackUnavailable(f"submitting the job to Flink failed: {str(e).strip().splitlines()[0][:300]}")

    ModelIdPath = Annotated[str, PathParam(pattern=MODEL_ID)]

    @app.get("/v1/stream-finetune/{model_id}", response_model=StatusResponse,
             responses={**AUTH_ERR, **NOT_FOUND, **STACK_ERR})
    def status(model_id: ModelIdPath, actor: Annotated[str, Depends(require_read)]):
        data = registry.load()
        entry = data["models"].get(model_id)
        if entry is None:
            raise HTTPException(404, f"model {model_id} has no registered spec")
        job = data["jobs"].get(entry["topic"], {})
        job_id = job.get("job_id", entry["job_id"])
        try:
            job_state = flink_get(f"/jobs/{job_id}").get("state", "UNKNOWN")
        except StackUnavailable:
            job_state = None
        try:
            versions = versions_of(model_id)
        except StackUnavailable:
            versions = []
        last = versions[-1] if versions else None
        topics = job.get("topics") or topics_for(entry["topic"])
        counters = Counters(in_=end_offsets(topics["feedback"]), dlq=end_offsets(topics["dlq"]),
                            versions=end_offsets(topics["versions"]),
                            trained_samples=sum(v.samples or 0 for v in versions) if versions else None)
        window = Window(start=last.window_start, end=last.window_end) \
            if last and last.window_start is not None and last.window_end is not None else None
        return StatusResponse(model_id=model_id, topic=entry["topic"], job_id=job_id,
                              job_name=f"streamtune-{entry['topic']}", job_state=job_state,
                              config_version=entry["spec_hash"], spec=entry["spec"], last_window=window,
                              last_version=last, counters=counters)

    @app.delete("/v1/stream-finetune/{model_id}", response_model=StopResponse,
                responses={**AUTH_ERR, **NOT_FOUND, **STACK_ERR})
    def stop(model_id: ModelIdPath, actor: Annotated[str, Depends(require_write)]):
        from streamtune.stack.flink import flink_cli

        with submit_lock:
            data = registry.load()
            entry = data["models"].get(model_id)
            if entry is None:
                raise HTTPException(404, f"model {model_id} has no registered spec")
            topic = entry["topic"]
            job = data["jobs"].get(topic, {})
            job_id = job.get("job_id", entry["job_id"])
            others = [m for m, e in data["models"].items() if e["topic"] == topic and m != model_id]
            stopped, savepoint = False, None
            if not others:
                state_now = flink_get(f"/jobs/{job_id}").get("state")
                if state_now in LIVE_STATES:
                    target = str(stack.data_dir / "flink" / "savepoints")
                    try:
                        r = flink_cli(stack, "stop", "--savepointPath", target, job_id,
                                      timeout=settings.flink_timeout_s)
                    except Exception as e:
                        raise StackUnavailable(f"flink stop failed: {type(e).__name__}: {e}")
                    if r.returncode != 0:
                        tail = (r.stdout + r.stderr).strip().splitlines()
                        raise StackUnavailable(f"flink stop failed: {tail[-1][:300] if tail else r.returncode}")
                    m = re.search(r"Savepoint completed\. Path: (\S+)", r.stdout)
                    savepoint, stopped = (m.group(1) if m else None), True
                data["jobs"].pop(topic, None)
            del data["models"][model_id]
            registry.save(data)
            return StopResponse(model_id=model_id, job_id=job_id, job_stopped=stopped, savepoint=savepoint)

    @app.get("/v1/models/{model_id}/versions", response_model=VersionsResponse,
             responses={**AUTH_ERR, **NOT_FOUND, **STACK_ERR})
    def versions(model_id: ModelIdPath, actor: Annotated[str, Depends(require_read)]):
        client = mlflow()
        if mlflow_call(client.get_registered_model, model_id, missing_ok=True) is None:
            raise HTTPException(404, f"model {model_id} is not registered in MLflow")
        return VersionsResponse(model_id=model_id, versions=versions_of(model_id))

    @app.post("/v1/models/{model_id}/aliases", response_model=AliasResponse,
              responses={**AUTH_ERR, **BAD_BODY, **_err(404, "no such model or version"), **TOO_LARGE, **STACK_ERR})
    def move_alias(model_id: ModelIdPath, body: AliasRequest, actor: Annotated[str, Depends(require_write)]):
        client = mlflow()
        if mlflow_call(client.get_registered_model, model_id, missing_ok=True) is None:
            raise HTTPException(404, f"model {model_id} is not registered in MLflow")
        if mlflow_call(client.get_model_version, model_id, str(body.version), missing_ok=True) is None:
            raise HTTPException(404, f"model {model_id} has no version {body.version}")
        current = mlflow_call(client.get_model_version_by_alias, model_id, body.alias, missing_ok=True)
        from_version = int(current.version) if current is not None else None
        mlflow_call(client.set_registered_model_alias, model_id, body.alias, str(body.version))
        promotions.append(model_id, body.alias, from_version, body.version, actor)
        return AliasResponse(model_id=model_id, alias=body.alias, from_version=from_version,
                             to_version=body.version)

    @app.get("/v1/models/{model_id}/promotions", response_model=PromotionsResponse,
             responses={**AUTH_ERR})
    def promotion_log(model_id: ModelIdPath, actor: Annotated[str, Depends(require_read)]):
        return PromotionsResponse(model_id=model_id,
                                  promotions=[Promotion.model_validate(e) for e in promotions.entries(model_id)])

    @app.post("/v1/feedback", status_code=202, response_model=FeedbackAccepted,
              responses={**AUTH_ERR, **BAD_BODY, **_err(404, "a model has no registered spec"), **TOO_LARGE, **STACK_ERR})
    def feedback(body: Annotated[Union[FeedbackEvent, Annotated[list[FeedbackEvent], Field(min_length=1)]], Body()],
                 actor: Annotated[str, Depends(require_write)]):
        events = body if isinstance(body, list) else [body]
        if len(events) > settings.max_feedback_batch:
            raise HTTPException(413, f"{len(events)} events exceed the batch limit of {settings.max_feedback_batch}")
        models = registry.load()["models"]
        missing = sorted({e.model_id for e in events} - set(models))
        if missing:
            raise HTTPException(404, f"no registered spec for model(s) {', '.join(missing[:5])}")
        by_topic: dict[str, list] = {}
        for e in events:
            by_topic.setdefault(models[e.model_id]["topic"], []).append((e.model_id, to_sample(e), e.ts))
        for topic, records in by_topic.items():
            produce(topic, records)
        return FeedbackAccepted(accepted=len(events),
                                topics={e.model_id: models[e.model_id]["topic"] for e in events})

    return app
