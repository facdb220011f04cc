"""Every call the control plane makes to the stack: the Flink cluster (REST API and the `flink`
command line), Kafka and MLflow.

A service that fails or cannot be reached raises StackUnavailable, which the routes answer
with 503; a model or version that MLflow does not have raises MlflowNotFound (404).
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import requests
from kafka import KafkaProducer

from connectors.kafka import create_topic, read_tail
from core import transport
from core.errors import ServiceUnavailable, StreamtuneError
from core.messages import Message
from streamtune.stack.config import StackConfig
from streamtune.stack.flink import flink_cli, job_counters, submit_detached
from streamtune.stack.process import StackError

from .models import EvalSetView, GateView, ModelSummary, ServingResponse, VersionInfo

# `streamtune serve --port`'s default: where the control plane looks for the server when
# STREAMTUNE_SERVE_URL is not set.
SERVE_PORT = 8100
# Flink job states in which a job still serves (or is about to serve) its topic.
CDC_JOB_SCRIPT = Path(__file__).resolve().parents[2] / "jobs" / "cdc_retrain.py"
LIVE_STATES = {"CREATED", "INITIALIZING", "RUNNING", "RESTARTING", "RECONCILING"}
# What running the `flink` command line raises when it cannot run or does not finish.
FLINK_CLI_ERRORS = (StackError, subprocess.SubprocessError, OSError)
# What Flink answers when a savepoint is asked of a job whose tasks are not all running yet.
TASKS_NOT_RUNNING = re.compile(r"not all required tasks are currently running|is not being executed at the moment|"
                               r"not running|INITIALIZING|DEPLOYING", re.IGNORECASE)
# MLflow's error codes for a registered model, version or alias that does not exist.
MLFLOW_NOT_FOUND = {"RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"}


def flink_failure_reason(output: str) -> str:
    """The innermost exception message in the `flink` command line's output (its last line
    is usually a stack trace's `... N more`).

    >>> flink_failure_reason("x\\nCaused by: a.B: outer\\n\\tat x\\nCaused by: c.D: inner cause\\n\\t... 5 more")
    'c.D: inner cause'
    >>> flink_failure_reason("")
    'no output'
    """
    causes = re.findall(r"^Caused by: (.+)$", output, re.MULTILINE)
    if causes:
        return causes[-1].strip()[:300]
    lines = [line.strip() for line in output.splitlines()
             if line.strip() and not line.startswith("\t") and not line.strip().startswith("at ")]
    return lines[-1][:300] if lines else "no output"


class StackUnavailable(ServiceUnavailable):
    """The Flink cluster, Kafka or MLflow failed or cannot be reached (answered with 503)."""


class MlflowNotFound(StreamtuneError, LookupError):
    """MLflow has no such registered model or version (answered with 404)."""


class NotServed(StreamtuneError, LookupError):
    """`streamtune serve` does not serve that model (answered with 404)."""


def job_name(topic: str) -> str:
    """The name of the Flink job that trains from Kafka topic `topic`."""
    return f"streamtune-{topic}"


def job_topics(topic: str) -> dict[str, str]:
    """The topics of the job that trains from `topic`.

    >>> job_topics("clicks")["adapter-versions"]
    'clicks.adapter-versions'
    """
    return {"feedback": topic, "configs": f"{topic}.configs", "versions": f"{topic}.versions",
            "dlq": f"{topic}.dlq", "adapter-versions": f"{topic}.adapter-versions"}


# Kafka refuses a topic name over 249 characters, and the names "." and "..".
KAFKA_TOPIC_MAX = 249


def unusable_job_topic(topic: str) -> Optional[str]:
    """Why Kafka would refuse one of the topics of the job for `topic`; None when it takes them.

    >>> unusable_job_topic("clicks") is None
    True
    >>> unusable_job_topic("x" * 233)
    'the job topic x….adapter-versions would be 250 characters; Kafka allows 249'
    """
    for t in job_topics(topic).values():
        if len(t) > KAFKA_TOPIC_MAX:
            return (f"the job topic {t[0]}…{t[len(topic):]} would be {len(t)} characters; "
                    f"Kafka allows {KAFKA_TOPIC_MAX}")
        if t in (".", ".."):
            return f"Kafka does not allow a topic named {t!r}"
    return None


class StackGateway:
    """The stack as the control plane sees it.

    `job_args` are the arguments of every submitted job besides its topics and name (base
    model, artifact directory, extra options). One Kafka producer is shared by all requests
    and closed by `close()`.
    """

    def __init__(self, stack: StackConfig, job_script: Path, job_args: list[str], flink_timeout_s: float,
                 serve_url: Optional[str] = None, serve_token: Callable[[], Optional[str]] = lambda: None):
        self.stack = stack
        self.serve_url = (serve_url or f"http://{stack.host}:{SERVE_PORT}").rstrip("/")
        self.serve_token = serve_token  # a read token for streamtune serve, current at each call
        self.job_script = job_script
        self.job_args = job_args
        self.flink_timeout_s = flink_timeout_s
        self._producer: Optional[KafkaProducer] = None
        self._producer_lock = threading.Lock()

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close()

    # ------------------------------------------------------------ Flink

    def job_state(self, job_id: str) -> str:
        """Flink's state of the job; UNKNOWN when the cluster does not know the job."""
        return self._flink_get(f"/jobs/{job_id}").get("state", "UNKNOWN")

    def live_job(self, topic: str, known_job_id: Optional[str]) -> Optional[str]:
        """The id of a live job serving `topic`: `known_job_id` (the jobs file's), else one
        named streamtune-<topic>."""
        if known_job_id and self.job_state(known_job_id) in LIVE_STATES:
            return known_job_id
        for job in self._flink_get("/jobs/overview").get("jobs", []):
            if job.get("name") == job_name(topic) and job.get("state") in LIVE_STATES:
                return job["jid"]
        return None

    def submit_job(self, topic: str) -> str:
        """Create the job's topics and submit a job that trains from `topic`; answers its id."""
        topics = job_topics(topic)
        return self._submit(self.job_script, job_name(topic), topics, ["--feedback-topic", topics["feedback"]])

    def submit_cdc_job(self, key: str, topics: dict[str, str], mapping_file: Path,
                       restore_from: Optional[str] = None) -> str:
        """Create the topics and submit jobs/cdc_retrain.py reading `topics["cdc"]` with the
        mapping file (a pipeline's job, named streamtune-<key>); answers its id."""
        return self._submit(CDC_JOB_SCRIPT, job_name(key), topics,
                            ["--cdc-topic", topics["cdc"], "--mapping", str(mapping_file),
                             *(["--restore-from", restore_from] if restore_from else [])])

    def _submit(self, script: Path, name: str, topics: dict[str, str], source_args: list[str]) -> str:
        """Create `topics`, then `flink run -d -py script` with the topics every training job
        writes, `source_args` and the gateway's job_args; answers the job's id."""
        try:
            for t in topics.values():
                create_topic(self.stack.kafka_bootstrap, t)
        except Exception as e:
            raise StackUnavailable(f"Kafka not reachable at {self.stack.kafka_bootstrap}: {type(e).__name__}: {e}")
        args = ["--bootstrap-server", self.stack.kafka_bootstrap, *source_args,
                "--config-topic", topics["configs"], "--versions-topic", topics["versions"],
                "--dlq-topic", topics["dlq"], "--broadcast-topic", topics["adapter-versions"],
                "--job-name", name, *self.job_args]
        try:
            return submit_detached(self.stack, script, args)
        except FLINK_CLI_ERRORS as e:
            raise StackUnavailable(f"submitting the job to Flink failed: {str(e).strip().splitlines()[0][:300]}")

    def stop_with_savepoint(self, job_id: str) -> Optional[str]:
        """`flink stop` with a savepoint under <data_dir>/flink/savepoints; answers the
        savepoint's path, None when flink did not print it.

        A savepoint needs every task running: a job just (re)submitted is RUNNING before its
        tasks are, so this waits for them first, and tries once more when Flink still
        declines because a task is not running yet.
        """
        target = str(self.stack.data_dir / "flink" / "savepoints")
        deadline = time.monotonic() + self.flink_timeout_s
        for attempt in (1, 2):
            self._wait_for_running_tasks(job_id, deadline)
            try:
                r = flink_cli(self.stack, "stop", "--savepointPath", target, job_id,
                              timeout=max(1.0, deadline - time.monotonic()))
            except FLINK_CLI_ERRORS as e:
                raise StackUnavailable(f"flink stop failed: {type(e).__name__}: {e}")
            if r.returncode == 0:
                m = re.search(r"Savepoint completed\. Path: (\S+)", r.stdout)
                return m.group(1) if m else None
            reason = flink_failure_reason(r.stdout + r.stderr)
            if attempt == 2 or not TASKS_NOT_RUNNING.search(r.stdout + r.stderr):
                raise StackUnavailable(f"flink stop failed: {reason}")
        raise AssertionError("unreachable")

    def _wait_for_running_tasks(self, job_id: str, deadline: float) -> None:
        """Until every task of the job runs (or has finished), the job ended, or the deadline."""
        while time.monotonic() < deadline:
            job = self._flink_get(f"/jobs/{job_id}")
            if not job or job.get("state") != "RUNNING":
                if job.get("state") not in LIVE_STATES:
                    return  # ended (or unknown): `flink stop` says so itself
            elif all(v.get("status") in ("RUNNING", "FINISHED") for v in job.get("vertices", [])):
                return
            time.sleep(0.5)

    def job_counters(self, job_id: str) -> Optional[dict[str, int]]:
        """The job's Flink counters (`<operator>.<counter>`; one never incremented is absent);
        None when they cannot be read (status counters are best effort)."""
        try:
            return job_counters(self.stack.flink_rest_url, job_id)
        except (requests.RequestException, ValueError, KeyError):
            return None

    def _flink_get(self, path: str) -> dict:
        """GET from Flink's REST API; {} for 404."""
        url = self.stack.flink_rest_url
        try:
            r = requests.get(f"{url}{path}", timeout=5)
        except requests.RequestException as e:
            raise StackUnavailable(f"Flink cluster not reachable at {url}: {type(e).__name__}")
        if r.status_code == 404:
            return {}
        if r.status_code >= 400:
            raise StackUnavailable(f"Flink REST {path} answered {r.status_code}")
        return r.json()

    # ------------------------------------------------------------ Kafka

    def ensure_topic(self, topic: str) -> None:
        try:
            create_topic(self.stack.kafka_bootstrap, topic)
        except Exception as e:
            raise StackUnavailable(f"creating Kafka topic {topic} failed: {type(e).__name__}: {e}")

    def produce(self, topic: str, records: Iterable[tuple[str, Message, int]]) -> None:
        """Send (key, message, timestamp ms) records; returns once Kafka acknowledged them all."""
        producer = self._kafka_producer()
        try:
            futures = [producer.send(topic, key=key.encode(), value=message.to_json().encode(), timestamp_ms=ts)
                       for key, message, ts in records]
            producer.flush(timeout=30)
            for f in futures:
                f.get(timeout=30)
        except Exception as e:
            raise StackUnavailable(f"producing to Kafka topic {topic} failed: {type(e).__name__}: {e}")

    def tail(self, topic: str, limit: int) -> list:
        """About the last `limit` committed records of each partition of `topic`."""
        try:
            return read_tail(self.stack.kafka_bootstrap, topic, limit)
        except Exception as e:
            raise StackUnavailable(f"reading Kafka topic {topic} failed: {type(e).__name__}: {e}")

    def _kafka_producer(self) -> KafkaProducer:
        with self._producer_lock:
            if self._producer is None:
                bootstrap = self.stack.kafka_bootstrap
                try:
                    self._producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5,
                                                   request_timeout_ms=15000, max_block_ms=15000,
                                                   **transport.kafka_python_kwargs())
                except Exception as e:
                    raise StackUnavailable(f"Kafka not reachable at {bootstrap}: {type(e).__name__}: {e}")
            return self._producer

    # ------------------------------------------------------------ streamtune serve

    def serving(self, model_id: str) -> ServingResponse:
        """The split and online metrics of `model_id` from the inference server's
        GET /v1/models/{id}/serving (StackUnavailable when it cannot be asked, NotServed when
        it does not serve the model)."""
        url = f"{self.serve_url}/v1/models/{model_id}/serving"
        try:
            token = self.serve_token()
            r = requests.get(url, timeout=5, headers={"Authorization": f"Bearer {token}"} if token else {})
        except requests.RequestException as e:
            raise StackUnavailable(f"streamtune serve not reachable at {self.serve_url}: {type(e).__name__} "
                                   "(start it with `streamtune serve`, or point STREAMTUNE_SERVE_URL at it)")
        if r.status_code == 404:
            raise NotServed(f"streamtune serve at {self.serve_url} does not serve model {model_id}: "
                            f"{_error_text(r)}")
        if r.status_code >= 400:
            raise StackUnavailable(f"streamtune serve at {self.serve_url} answered {r.status_code}: {_error_text(r)}")
        try:
            return ServingResponse.model_validate({**r.json(), "serve_url": self.serve_url})
        except ValueError as e:
            raise StackUnavailable(f"streamtune serve at {self.serve_url} answered what is not its serving status "
                                   f"(another program on that port?): {str(e).splitlines()[0][:200]}")

    # ------------------------------------------------------------ MLflow

    def models(self) -> list[ModelSummary]:
        """Every registered model with its aliases and newest version, by name."""
        client = self._mlflow_client()
        found, token = [], None
        while True:
            page = self._mlflow(client.search_registered_models, None, 1000, None, token)
            found += list(page)
            token = page.token
            if not token:
                break
        out = []
        for model in sorted(found, key=lambda m: m.name):
            latest = max(model.latest_versions or [], key=lambda mv: int(mv.version), default=None)
            out.append(ModelSummary(model_id=model.name,
                                    aliases={a: int(v) for a, v in (model.aliases or {}).items()},
                                    latest_version=int(latest.version) if latest else None,
                                    latest_created_ms=latest.creation_timestamp if latest else None))
        return out

    def versions(self, model_id: str) -> list[VersionInfo]:
        """The model's MLflow versions, oldest first."""
        client = self._mlflow_client()
        model = self._mlflow(client.get_registered_model, model_id, missing_ok=True)
        if model is None:
            raise MlflowNotFound(f"model {model_id} is not registered in MLflow")
        found = self._mlflow(client.search_model_versions, f"name = '{model_id}'") or []
        # search_model_versions answers versions without their aliases: the model has them.
        aliases: dict[int, list[str]] = {}
        for alias, version in (model.aliases or {}).items():
            aliases.setdefault(int(version), []).append(alias)
        return [_version_info(mv, aliases.get(int(mv.version), []))
                for mv in sorted(found, key=lambda mv: int(mv.version))]

    def move_alias(self, model_id: str, alias: str, version: int) -> Optional[int]:
        """Point the model's `alias` at `version`; answers the version it pointed at before."""
        client = self._mlflow_client()
        if self._mlflow(client.get_registered_model, model_id, missing_ok=True) is None:
            raise MlflowNotFound(f"model {model_id} is not registered in MLflow")
        if self._mlflow(client.get_model_version, model_id, str(version), missing_ok=True) is None:
            raise MlflowNotFound(f"model {model_id} has no version {version}")
        current = self._mlflow(client.get_model_version_by_alias, model_id, alias, missing_ok=True)
        self._mlflow(client.set_registered_model_alias, model_id, alias, str(version))
        return int(current.version) if current is not None else None

    def _mlflow_client(self):
        # Imported here: mlflow takes seconds to import and only the MLflow calls need it.
        from connectors.mlflow_registry import make_client

        return make_client(self.stack.tracking_uri)

    def _mlflow(self, call: Callable[..., Any], *args: Any, missing_ok: bool = False) -> Any:
        """`call(*args)` on an MLflow client; None for a missing model, version or alias when
        `missing_ok`, MlflowNotFound otherwise."""
        from mlflow.exceptions import MlflowException

        uri = self.stack.tracking_uri
        try:
            return call(*args)
        except MlflowException as e:
            first_line = str(e).splitlines()[0][:300]
            if getattr(e, "error_code", "") in MLFLOW_NOT_FOUND:
                if missing_ok:
                    return None
                raise MlflowNotFound(f"MLflow: {first_line}")
            raise StackUnavailable(f"MLflow at {uri} failed: {first_line}")
        except (requests.RequestException, OSError) as e:
            raise StackUnavailable(f"MLflow not reachable at {uri}: {type(e).__name__}")


def _error_text(r: requests.Response) -> str:
    """The error message of an answer of streamtune serve (OpenAI's shape), else its text."""
    try:
        body = r.json()
        return str(body["error"]["message"] if "error" in body else body.get("detail", body))[:300]
    except (ValueError, KeyError, TypeError, AttributeError):
        return r.text[:300]


def gate_view(tags: dict[str, str]) -> Optional[GateView]:
    """The promotion gate's decision and scores from a version's tags (see
    connectors.mlflow_registry.gate_tags); None for a version registered without a gate.

    >>> g = gate_view({"streamtune.gate": "refused", "streamtune.gate_reason": "forgot",
    ...                "streamtune.eval.retained.exact_match": "0.2", "streamtune.eval.retained.passed": "False",
    ...                "streamtune.eval.recent.loss": "0.3"})
    >>> g.decision, [(s.name, s.exact_match, s.passed) for s in g.sets]
    ('refused', [('recent', None, None), ('retained', 0.2, False)])
    """
    decision = tags.get("streamtune.gate")
    if decision is None:
        return None
    sets: dict[str, dict[str, Any]] = {}
    for key, value in tags.items():
        m = re.fullmatch(r"streamtune\.eval\.([A-Za-z0-9_-]+)\.([a-z_]+)", key)
        if m is None or m.group(2) not in EvalSetView.model_fields:
            continue
        name, field = m.groups()
        try:
            parsed: Any = value == "True" if field == "passed" else int(value) if field == "size" else float(value)
        except ValueError:
            continue
        sets.setdefault(name, {"name": name})[field] = parsed
    order = ["recent", "retained", "fixed"]
    return GateView(decision=decision, rule=tags.get("streamtune.gate_rule"), reason=tags.get("streamtune.gate_reason"),
                    metric=tags.get("streamtune.gate_metric"), champion=tags.get("streamtune.gate_champion"),
                    sets=[EvalSetView(**sets[n]) for n in sorted(sets, key=lambda n: (order.index(n) if n in order
                                                                                       else len(order), n))])


def _rollback(tags: dict[str, str]) -> Optional[dict]:
    """The serving guard's decision on a version (tag streamtune.rollback, JSON), if any."""
    try:
        value = json.loads(tags["streamtune.rollback"])
    except (KeyError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _version_info(mv, aliases: list[str]) -> VersionInfo:
    """An MLflow model version, its aliases and the streamtune.* tags the registrar set on it."""
    tags = mv.tags or {}

    def tag(key: str, cast: Callable[[str], Any] = int) -> Any:
        try:
            return cast(tags[f"streamtune.{key}"])
        except (KeyError, ValueError):
            return None

    return VersionInfo(version=int(mv.version), aliases=sorted(aliases), status=str(mv.status),
                       run_id=mv.run_id, source=mv.source, created_ms=mv.creation_timestamp,
                       version_id=tags.get("streamtune.version_id"), seq=tag("seq"),
                       window_start=tag("window_start"), window_end=tag("window_end"), samples=tag("samples"),
                       loss_after=tag("loss_after", float), gate=gate_view(tags), rollback=_rollback(tags))
