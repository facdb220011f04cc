"""Helpers that tests and benchmarks share: a job's topics and arguments, specs, waiting on
a topic, `streamtune cdc` as a killable child process, psql.

They run real things (topics on the broker, processes, the psql client); nothing here fakes
a component.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from core import transport
from core.messages import FinetuneSpec, Message
from streamtune.local_job import kill_group, spawn_logged

JOB_TOPICS = ("feedback", "configs", "versions", "dlq", "adapter-versions")
M = TypeVar("M", bound=Message)


def job_topics(bootstrap: str, prefix: str) -> dict[str, str]:
    """`<prefix>.feedback|configs|versions|dlq|adapter-versions`, created on the broker."""
    from connectors.kafka import create_topic

    topics = {k: f"{prefix}.{k}" for k in JOB_TOPICS}
    for topic in topics.values():
        create_topic(bootstrap, topic)
    return topics


def job_args(topics: dict, base_model, artifact_store, *extra: str) -> list[str]:
    """jobs/stream_finetune.py arguments for these topics (the job registers in the stack's MLflow)."""
    return ["--feedback-topic", topics["feedback"], "--config-topic", topics["configs"],
            "--versions-topic", topics["versions"], "--dlq-topic", topics["dlq"],
            "--broadcast-topic", topics["adapter-versions"],
            "--base-model", str(base_model), "--artifact-store", str(artifact_store), *extra]


def spec_fields(model_id: str, stream_source: str, *, rank=4, targets=("q_proj", "v_proj"), min_samples=8,
                window_seconds=2, max_samples=None, **extra) -> dict[str, Any]:
    """A fine-tune spec's fields, unchecked: tests of the dead-letter path break them on purpose."""
    policy = {"min_samples_per_window": min_samples, "window_seconds": window_seconds}
    if max_samples is not None:
        policy["max_samples_per_step"] = max_samples
    return {"model_id": model_id, "stream_source": stream_source,
            "adapter_config": {"rank": rank, "alpha": 2 * rank, "target_modules": list(targets)},
            "trigger_policy": policy,
            "training": {"lr": 0.01, "micro_batch_size": 8}, **extra}


def spec(model_id: str, topics: dict, **options) -> FinetuneSpec:
    """A spec for the job reading `topics["feedback"]` (options: see spec_fields)."""
    return FinetuneSpec.model_validate(spec_fields(model_id, f"kafka://topic={topics['feedback']}", **options))


def cdc_spec(model_id: str, stream_source: str, *, min_samples: int, window_seconds: int = 2,
             rank: int = 4) -> FinetuneSpec:
    """A spec for a CDC source (postgres://…?table=… or mongodb://…?db=…&collection=…)."""
    return FinetuneSpec.model_validate(spec_fields(model_id, stream_source, rank=rank, min_samples=min_samples,
                                                   window_seconds=window_seconds))


def wait_for_records(bootstrap: str, topic: str, message: type[M], count: int, timeout: float,
                     read_committed=True, predicate: Callable[[M], bool] | None = None) -> list[M]:
    """Poll a topic until `count` records (matching `predicate`) are there, or time out; each
    record is parsed as `message` (a core.messages model), so a drifted record fails here."""
    from connectors.kafka import read_topic

    deadline = time.monotonic() + timeout
    while True:
        records = [message.from_json(r.value) for r in read_topic(bootstrap, topic, timeout=10, idle=1.0,
                                                                   read_committed=read_committed)]
        if predicate:
            records = [r for r in records if predicate(r)]
        if len(records) >= count or time.monotonic() > deadline:
            return records
        time.sleep(1)


def committed_reader(bootstrap: str, topic: str):
    """A read_committed consumer of partition 0 of `topic` from its start, fetching every 20 ms
    (assign(), not subscribe(): on Tansu a subscription sometimes read nothing for a minute)."""
    from kafka import KafkaConsumer, TopicPartition

    from connectors.kafka import seek_to_first

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed", auto_offset_reset="earliest",
                             enable_auto_commit=False, fetch_max_wait_ms=20, **transport.kafka_python_kwargs())
    consumer.assign([TopicPartition(topic, 0)])
    seek_to_first(consumer, [TopicPartition(topic, 0)])
    return consumer


def password_to_env(source: str) -> tuple[str, dict[str, str]]:
    """A source URI without its password, and the password as PGPASSWORD: a URI with one is
    refused (core/sources/base.py), and argv is no place for it.

    >>> password_to_env("postgresql://u:p%40ss@h:5432/db?table=t")
    ('postgresql://u@h:5432/db?table=t', {'PGPASSWORD': 'p@ss'})
    """
    from urllib.parse import unquote, urlsplit, urlunsplit

    parts = urlsplit(source)
    if not parts.password:
        return source, {}
    user, host = parts.netloc.rsplit("@", 1)[0].split(":", 1)[0], parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}")), {"PGPASSWORD": unquote(parts.password)}


class CaptureProcess:
    """`streamtune cdc` as a child process that a test can SIGKILL and start again (a password
    in `source` goes to its environment)."""

    def __init__(self, source: str, name: str, topic: str, log_file: Path, bootstrap: str,
                 offsets_topic: str, *extra: str):
        source, self.env = password_to_env(source)
        self.cmd = [sys.executable, "-m", "streamtune.cli", "cdc", "--source", source, "--name", name,
                    "--topic", topic, "--bootstrap-server", bootstrap, "--offsets-topic", offsets_topic, *extra]
        self.log_file = Path(log_file)
        self.proc: subprocess.Popen | None = None

    def start(self) -> "CaptureProcess":
        self.proc = spawn_logged(self.cmd, self.log_file, extra_env=self.env)
        return self

    def kill(self) -> None:
        """SIGKILL: no flush, no confirmation, no goodbye to the server."""
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def wait_for_log(self, text: str, timeout: float = 30.0, times: int = 1) -> None:
        deadline = time.monotonic() + timeout
        while self.log().count(text) < times:
            assert time.monotonic() < deadline, f"capture never logged {text!r}:\n{self.log()[-3000:]}"
            assert self.alive(), f"capture exited:\n{self.log()[-3000:]}"
            time.sleep(0.2)


def psql(dsn: str, sql: str) -> str:
    """Run SQL with the real psql client, as a user would."""
    result = subprocess.run(["psql", dsn, "-v", "ON_ERROR_STOP=1", "-qAt", "-c", sql],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"psql failed: {result.stderr}"
    return result.stdout


def save_screenshot(browser, path: Path) -> Path:
    """The browser's screenshot at `path`; with STREAMTUNE_SCREENSHOT_DIR set (`make
    docs-screenshots`), a copy there under the same name for the manual."""
    import os
    import shutil

    browser.save_screenshot(str(path))
    target = os.environ.get("STREAMTUNE_SCREENSHOT_DIR")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, Path(target) / Path(path).name)
    return path


def free_port() -> int:
    """A TCP port nothing listens on right now (for a server a test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 1.0) -> Any:
    """Poll `predicate` until it returns something true (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


def wait_past_window(bootstrap: str, topic: str, window_ms: int, captured: Callable[[list], bool],
                     timeout: float = 60) -> None:
    """Until the records on `topic` satisfy `captured`, then until the wall clock has passed the
    end of the event-time window of the newest of them. CDC event time is commit time: a change
    committed after this returns falls in a later window than every change captured so far."""
    from connectors.kafka import read_topic

    records = wait_for(lambda: (r := read_topic(bootstrap, topic, timeout=10, idle=0.5, read_committed=False))
                       and captured(r) and r, timeout, f"the changes to reach {topic}", interval=0.2)
    end = (max(r.timestamp for r in records) // window_ms + 1) * window_ms
    wait_for(lambda: time.time() * 1000 >= end, timeout, f"the window ending at {end} to pass", interval=0.05)


class InMemoryValue:
    """Flink's ValueState reduced to a variable: to call an operator's process_element directly."""

    def __init__(self):
        self.held = None

    def value(self):
        return self.held

    def update(self, value) -> None:
        self.held = value

    def clear(self) -> None:
        self.held = None


class InMemoryList:
    """Flink's ListState reduced to a list."""

    def __init__(self):
        self.held: list = []

    def get(self) -> list:
        return list(self.held)

    def add(self, value) -> None:
        self.held.append(value)

    def add_all(self, values) -> None:
        self.held.extend(values)

    def update(self, values) -> None:
        self.held = list(values)

    def clear(self) -> None:
        self.held = []


class KeyedTimers:
    """A keyed process function's context reduced to one key, a wall clock and the timers it
    registered: to drive process_element and on_timer directly, firing timers as Flink would.

    >>> t = KeyedTimers("m")
    >>> t.register_event_time_timer(2000); t.register_event_time_timer(1000)
    >>> t.due_event_timers(1500)
    [1000]
    """

    def __init__(self, key: str, now_ms: int = 0):
        self.key, self.now_ms = key, now_ms
        self.event_timers: set[int] = set()
        self.processing_timers: set[int] = set()
        self.event_registrations: list[int] = []  # every call, repeats included (each is a message to the JVM)
        self.watermark = -2**63  # Flink's before the first one
        self.domain = None

    def get_current_key(self) -> str:
        return self.key

    def timer_service(self) -> "KeyedTimers":
        return self

    def current_processing_time(self) -> int:
        return self.now_ms

    def current_watermark(self) -> int:
        return self.watermark

    def register_event_time_timer(self, ts: int) -> None:
        self.event_timers.add(ts)
        self.event_registrations.append(ts)

    def register_processing_time_timer(self, ts: int) -> None:
        self.processing_timers.add(ts)

    def time_domain(self):
        return self.domain

    def due_event_timers(self, watermark: int) -> list[int]:
        """The event-time timers a watermark fires, in order (and forgets them)."""
        self.watermark = max(self.watermark, watermark)
        due = sorted(t for t in self.event_timers if t <= watermark)
        self.event_timers -= set(due)
        return due

    def due_processing_timers(self) -> list[int]:
        due = sorted(t for t in self.processing_timers if t <= self.now_ms)
        self.processing_timers -= set(due)
        return due


class TallyCounters:
    """FunctionCounters (operators/counters.py) reduced to a tally."""

    def __init__(self):
        from collections import Counter

        self.counts = Counter()

    def enter_element(self) -> None:
        pass

    def inc(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def observe(self, name: str, value: float) -> None:
        """A histogram's value (FunctionCounters.observe): `<name>_count` and `<name>_sum`."""
        self.counts[f"{name}_count"] += 1
        self.counts[f"{name}_sum"] += int(round(value))


def trainer_function(base, store_dir, **settings):
    """The job's trainer (operators/finetune_function.py) with its keyed state in variables and
    a tally for counters: its process_element, on_timer and _fire, no Flink."""
    from connectors.artifact_store import ArtifactStore, store_uri
    from operators.finetune_function import FinetuneFunction, TrainerSettings

    fn = FinetuneFunction(TrainerSettings(default_base_model=str(base), artifact_store=store_uri(str(store_dir)),
                                          **{"unknown_model_grace_ms": 1000, **settings}))
    fn.store = ArtifactStore(fn.settings.artifact_store)
    for attribute in FinetuneFunction.KEYED_STATE:
        setattr(fn, attribute, InMemoryValue())
    fn.pending_samples = InMemoryList()
    fn.champion_files, fn.counters, fn.opened_at = {}, TallyCounters(), 0
    fn.start_worker_memory()
    fn.watch_pending()
    return fn


class CountingCounter:
    """Flink's Counter reduced to an int."""

    def __init__(self):
        self.count = 0

    def inc(self, n: int = 1) -> None:
        self.count += n


class InMemoryMetrics:
    """Flink's metric group reduced to counters that count and gauges that are dropped."""

    def counter(self, name: str) -> CountingCounter:
        return CountingCounter()

    def gauge(self, name: str, value) -> None:
        pass


class InMemoryRuntimeContext:
    """What a function's open() asks of Flink's runtime context: keyed state, one InMemoryValue
    per descriptor name in `state`, and metrics. Two functions opened on the same `state`
    dict are a worker and its restore.

    >>> from pyflink.datastream.state import ValueStateDescriptor
    >>> from pyflink.common import Types
    >>> state = {}
    >>> InMemoryRuntimeContext(state).get_state(ValueStateDescriptor("queue", Types.STRING())).update("v1")
    >>> InMemoryRuntimeContext(state).get_state(ValueStateDescriptor("queue", Types.STRING())).value()
    'v1'
    """

    def __init__(self, state: dict | None = None):
        self.state = {} if state is None else state

    def get_state(self, descriptor) -> InMemoryValue:
        return self.state.setdefault(descriptor.name, InMemoryValue())

    def get_list_state(self, descriptor) -> InMemoryList:
        return self.state.setdefault(descriptor.name, InMemoryList())

    def get_metrics_group(self) -> InMemoryMetrics:
        return InMemoryMetrics()


def row_change_function(mapping):
    """RowChangeFunction with in-memory state and counters: its process_element, no Flink."""
    from collections import defaultdict

    from operators.row_changes import RowChangeFunction

    fn = RowChangeFunction(mapping)
    fn.row, fn.counters = InMemoryValue(), defaultdict(CountingCounter)
    return fn


def records_read(config, job_id: str, vertex: str) -> int:
    """How many records the job's vertices named like `vertex` have received (Flink REST)."""
    import requests

    details = requests.get(f"{config.flink_rest_url}/jobs/{job_id}", timeout=5).json()
    return sum(v["metrics"]["read-records"] for v in details.get("vertices", []) if vertex in v["name"])


def input_watermark(config, job_id: str, vertex: str) -> int:
    """The least input watermark (ms) of the job's vertices named like `vertex` over their
    subtasks (Flink REST); Long.MIN_VALUE before any arrived."""
    import requests

    rest = config.flink_rest_url
    details = requests.get(f"{rest}/jobs/{job_id}", timeout=5).json()
    marks = [int(m["value"]) for v in details.get("vertices", []) if vertex in v["name"]
             for m in requests.get(f"{rest}/jobs/{job_id}/vertices/{v['id']}/watermarks", timeout=5).json()
             if m["id"].endswith(".currentInputWatermark")]
    return min(marks, default=-2**63)


def restored_and_running(config, job_id: str) -> bool:
    """The job runs again from a restored checkpoint, every vertex RUNNING (Flink REST).

    The restored checkpoint is the signal: REST caches the job's graph for a few seconds and
    fetches numRestarts on its own schedule, so right after a kill a stale "RUNNING" beside a
    fresh restart count once read as restarted while the job was still failing over."""
    import requests

    rest = config.flink_rest_url
    restored = (requests.get(f"{rest}/jobs/{job_id}/checkpoints", timeout=5).json().get("latest") or {}).get("restored")
    details = requests.get(f"{rest}/jobs/{job_id}", timeout=5).json()
    return bool(restored) and details["state"] == "RUNNING" and all(
        v["status"] == "RUNNING" for v in details.get("vertices", []))


def job_report(config, job_id: str) -> str:
    """A stuck or failed job as its REST API shows it, for a failure message: its state, its
    checkpoints (counts, seconds since the last completed, whether one was restored), its last
    failures, and each vertex's status and records in and out (a vertex that reads and writes
    nothing is where it hangs). A restart resets Flink's counters: the restored checkpoint says so."""
    import requests

    rest = config.flink_rest_url
    details = requests.get(f"{rest}/jobs/{job_id}", timeout=5).json()
    checkpoints = requests.get(f"{rest}/jobs/{job_id}/checkpoints", timeout=5).json()
    latest = checkpoints.get("latest") or {}
    completed_ms = (latest.get("completed") or {}).get("latest_ack_timestamp", 0)
    history = requests.get(f"{rest}/jobs/{job_id}/exceptions", timeout=5).json().get("exceptionHistory", {})
    entries = history.get("entries", [])
    last = [(e.get("exceptionName"), (e.get("stacktrace") or "")[:400]) for e in entries[:2]]
    flow = {v["name"][:40]: (v["status"], v["metrics"]["read-records"], v["metrics"]["write-records"])
            for v in details.get("vertices", [])}
    since = f"{time.time() - completed_ms / 1000:.0f} s ago" if completed_ms else "none"
    return (f"job {details.get('state')}, checkpoints {checkpoints.get('counts')} (last completed {since}, "
            f"restored {bool(latest.get('restored'))}), {len(entries)} failures (last: {last}), "
            f"vertices (status, records in, out) {flow}")


PROMETHEUS_PORTS = range(9249, 9261)  # metrics.reporter.prom.port in flink-conf/config.yaml
PROMETHEUS_OPERATOR_PREFIX = "flink_taskmanager_job_task_operator_"


def scrape_prometheus(host: str, job_name: str) -> dict[tuple[str, str], list[float]]:
    """Every answering Prometheus endpoint of the cluster (the JobManager and each TaskManager
    take the next free port of the range), the job's operator metrics:
    (operator, metric) -> one value per subtask. The reporter writes `_` for `-` and other
    characters in label values: job and operator names are compared that way."""
    import re
    from collections import defaultdict

    import requests
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[tuple[str, str], list[float]] = defaultdict(list)
    job_name = re.sub(r"\W", "_", job_name)
    for port in PROMETHEUS_PORTS:
        try:
            text = requests.get(f"http://{host}:{port}/metrics", timeout=2).text
        except requests.RequestException:
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if (sample.name.startswith(PROMETHEUS_OPERATOR_PREFIX)
                        and re.sub(r"\W", "_", sample.labels.get("job_name", "")) == job_name):
                    operator = re.sub(r"\W", "_", sample.labels["operator_name"])
                    values[(operator, sample.name[len(PROMETHEUS_OPERATOR_PREFIX):])].append(sample.value)
    return values


def random_adapter_files(base_model: str | Path, seed: int) -> tuple[dict[str, bytes], str]:
    """A PEFT LoRA artifact of a base model as the trainer writes it (rank 4 on q/v, random B
    so that seeds give different versions), and its sha256 (of its manifest)."""
    import json

    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save as save_safetensors
    from transformers import AutoModelForCausalLM

    from connectors.artifact_store import artifact_sha256

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                        task_type="CAUSAL_LM")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base_model)), config)
    weights = save_safetensors({k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()})
    peft_config = {k: (sorted(v) if isinstance(v, set) else v)
                   for k, v in model.peft_config["default"].to_dict().items()}
    files = {"adapter_model.safetensors": weights, "adapter_config.json": json.dumps(peft_config).encode()}
    return files, artifact_sha256(files)
