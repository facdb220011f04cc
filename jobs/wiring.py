"""What both training jobs share: their options, a frozen job config, the Flink environment,
the trainer half of the pipeline (key_by model → LoRA trainer → exactly-once versions), the
registration pipeline (the job's own committed versions → MLflow → broadcast) and the DLQ.

The entry points (jobs/stream_finetune.py, jobs/cdc_retrain.py) parse arguments in their
`main` only and pass a `JobConfig` and plain values down.

>>> p = argparse.ArgumentParser()
>>> add_job_arguments(p)
>>> job = JobConfig.from_args(p.parse_args(["--bootstrap-server", "kafka:9092", "--parallelism", "2"]), "demo")
>>> job.bootstrap, job.parallelism, job.trainer_settings().unknown_model_grace_ms, job.register
('kafka:9092', 2, 30000, True)
>>> job.bundle_time_ms, JobConfig.from_args(p.parse_args(["--bundle-time-ms", "1000"]), "demo").bundle_time_ms
(None, 1000)
>>> job.max_event_skew_ms, job.max_event_age_ms
(300000, 0)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pyflink.common import Configuration, Types
from pyflink.datastream import CheckpointingMode, StreamExecutionEnvironment
from pyflink.table import StreamTableEnvironment

from connectors.flink_kafka import at_least_once_sink, exactly_once_sink, input_table_ddl
from connectors.artifact_store import store_uri
from connectors.kafka import create_topic
from core import defaults
from core.errors import ConfigError
from core.options import add_bootstrap_option
from core.redaction import redaction_mode
from operators.arbiter import ArbiterSettings
from operators.finetune_function import JOB_ID_PARAMETER, FinetuneFunction, TrainerSettings
from operators.micro_batches import check_micro_batch_ms, fast_condition, split_input_sql
from operators.registration import VERSION_TYPE, RegistrationFunction, VersionReader
from operators.validate import DLQ_TAG


# A partition without records this long stops holding the watermark back. Longer than the
# start of the Python workers: a source that falls idle before validate's first bundle ends
# loses the watermark of its backlog (input_rows), and the first window then waits for the
# trainer's idle timer. With 2 s and two busy processes beside the stack, 4 of 5 runs of
# bench/submit.py waited for it (first version 26.1 s p50); with 5 s none did (20.9 s).
IDLE_TIMEOUT_MS = 5000
# The config topic's source: configs are rare, and a source holds the watermark until it is
# idle, so at 5 s the first window of a job waited for it (bench/submit.py, first step 4.3 s
# once the Python workers started warm). Its backlog's watermark may be lost without harm: the
# samples' source carries the windows' event time, and a config behind the watermark is one
# the trainer already handles (it takes effect at the model's next window).
CONFIG_IDLE_TIMEOUT_MS = 1000


@dataclass(frozen=True)
class JobConfig:
    """Settings of one training job, fixed at submission."""

    job_name: str
    bootstrap: str
    config_topic: str = defaults.CONFIG_TOPIC
    versions_topic: str = defaults.VERSIONS_TOPIC
    dlq_topic: str = defaults.DLQ_TOPIC
    broadcast_topic: str = defaults.ADAPTER_VERSIONS_TOPIC
    partitions: int = 1                       # for topics this job creates
    base_model: str = str(defaults.base_model_dir())
    artifact_store: str = defaults.artifact_store()
    tracking_uri: str = defaults.mlflow_uri()
    register: bool = True                     # the registration pipeline runs in this job
    versions_delivery: str = "exactly-once"   # or "at-least-once": visible at once, repeats after a restore
    checkpoint_on_version: bool = True        # ask the JobManager for a checkpoint as each version is emitted
    jobmanager_url: str = defaults.flink_rest_url()
    embedded_rest_port: Optional[int] = None  # `python -m` runs: the mini-cluster's REST port (from_args)
    unknown_model_grace_ms: int = 30_000
    max_record_bytes: int = 65536
    lateness_ms: int = 0
    idle_timeout_ms: int = IDLE_TIMEOUT_MS
    idle_close_ms: int = 5000
    max_live_adapters: int = 64
    checkpoint_interval_ms: Optional[int] = None
    checkpoint_dir: Optional[str] = None
    restore_from: Optional[str] = None
    parallelism: Optional[int] = None
    bundle_time_ms: Optional[int] = None      # Python bundles; None: the job's latency setting
    max_event_skew_ms: int = 300_000          # records stamped further ahead: DLQ `timestamp`, no watermark move
    max_event_age_ms: int = 0                 # samples older: DLQ `timestamp`; 0 = off (replays stay possible)
    micro_batch_ms: int = 0                   # samples the JVM proves valid reach Python in micro-batches; 0 = off
    slo_headroom_url: Optional[str] = None    # a co-located `streamtune serve`'s GET /headroom: yield to its SLO
    min_training_share: float = 0.25          # of a step's wall time, however little headroom is left
    training_cpu_priority: str = "idle"       # with slo_headroom_url, on a CPU: the training thread's priority

    @classmethod
    def from_args(cls, args: argparse.Namespace, job_name: str, **overrides) -> "JobConfig":
        """From the options of `add_job_arguments`; `overrides` are a job's own defaults."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if f.name not in ("job_name", "unknown_model_grace_ms") and hasattr(args, f.name)}
        values["unknown_model_grace_ms"] = int(args.unknown_model_grace_seconds * 1000)
        values["register"] = not args.no_register
        if embedded():
            # No cluster to submit to: this process starts a mini-cluster, whose REST API the
            # trainer must reach (--checkpoint-on-version) and the user may open. Flink would
            # pick a random port; pick it here to know it.
            values["embedded_rest_port"] = free_port()
            if values.get("checkpoint_on_version", cls.checkpoint_on_version):
                values["jobmanager_url"] = f"http://127.0.0.1:{values['embedded_rest_port']}"
        return cls(job_name=job_name, **{**values, **overrides})

    def trainer_settings(self) -> TrainerSettings:
        return TrainerSettings(default_base_model=str(Path(self.base_model).resolve()),
                               artifact_store=store_uri(self.artifact_store),
                               unknown_model_grace_ms=self.unknown_model_grace_ms, lateness_ms=self.lateness_ms,
                               idle_close_ms=self.idle_close_ms, max_live_adapters=self.max_live_adapters,
                               tracking_uri=self.tracking_uri,
                               checkpoint_on_version=self.jobmanager_url if self.checkpoint_on_version else None,
                               arbitration=ArbiterSettings(self.slo_headroom_url, self.min_training_share,
                                                           cpu_priority=self.training_cpu_priority)
                               if self.slo_headroom_url else None)

    def create_topics(self, *inputs: str) -> None:
        for topic in (*inputs, self.config_topic, self.versions_topic, self.dlq_topic, self.broadcast_topic):
            create_topic(self.bootstrap, topic, self.partitions)


def micro_batch_ms(text: str) -> int:
    """--micro-batch-ms, refused at the command line unless it divides 1000 or is whole seconds."""
    value = int(text)
    if value:
        try:
            check_micro_batch_ms(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return value


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """The options every training job shares (defaults: core.defaults, the local stack's)."""
    add_bootstrap_option(p, default=defaults.kafka_bootstrap())
    p.add_argument("--config-topic", default=defaults.CONFIG_TOPIC)
    p.add_argument("--versions-topic", default=defaults.VERSIONS_TOPIC)
    p.add_argument("--dlq-topic", default=defaults.DLQ_TOPIC)
    p.add_argument("--broadcast-topic", default=defaults.ADAPTER_VERSIONS_TOPIC,
                   help="registered versions for inference (AdapterVersionBroadcast)")
    p.add_argument("--partitions", type=int, default=1, help="for topics this job creates")
    p.add_argument("--base-model", default=str(defaults.base_model_dir()))
    p.add_argument("--artifact-store", default=defaults.artifact_store(),
                   help="adapter artifacts: a directory every TaskManager and registrar shares, "
                        "s3://…, gs://…, hdfs://… or mlflow-artifacts://host:port/prefix")
    p.add_argument("--tracking-uri", default=defaults.mlflow_uri(), help="the MLflow server versions register in")
    p.add_argument("--versions-delivery", choices=["exactly-once", "at-least-once"], default="exactly-once",
                   help="exactly-once: a version is visible to read_committed readers when its checkpoint "
                        "completes; at-least-once: at once, and again after a restore (readers drop repeats)")
    p.add_argument("--checkpoint-on-version", action=argparse.BooleanOptionalAction, default=True,
                   help="exactly-once versions commit as soon as they are trained: the trainer asks the "
                        "JobManager (--jobmanager-url) for a checkpoint instead of waiting for the next "
                        "periodic one (up to one interval); --no-checkpoint-on-version: periodic only")
    p.add_argument("--jobmanager-url", default=defaults.flink_rest_url(),
                   help="the JobManager's REST API as TaskManagers reach it (--checkpoint-on-version; "
                        "a job run with `python -m` uses its own mini-cluster's)")
    p.add_argument("--no-register", action="store_true",
                   help="no registration pipeline in this job (run `streamtune registrar` instead)")
    p.add_argument("--unknown-model-grace-seconds", type=float, default=30.0)
    p.add_argument("--max-record-bytes", type=int, default=65536)
    p.add_argument("--lateness-ms", type=int, default=0)
    p.add_argument("--idle-timeout-ms", type=int,
                   default=int(os.environ.get("STREAMTUNE_IDLE_TIMEOUT_MS", IDLE_TIMEOUT_MS)),
                   help="a partition without records this long stops holding the watermark "
                        f"(the config topic's after {CONFIG_IDLE_TIMEOUT_MS} ms, or this where shorter)")
    p.add_argument("--idle-close-ms", type=int, default=5000,
                   help="a model with no sample for its window_seconds plus this long closes its open windows "
                        "(the watermark alone may never pass them once the data stops)")
    p.add_argument("--max-live-adapters", type=int, default=64,
                   help="adapters (with optimizer state) a trainer keeps in its model, least recently used "
                        "out; an evicted model's next window loads it from keyed state")
    p.add_argument("--slo-headroom-url", default=None,
                   help="the SLO headroom of a `streamtune serve` on the same device (its --slo-p99-ms, "
                        "e.g. http://127.0.0.1:8790/headroom): training waits between micro-batches while "
                        "the server's p99 is at its target (docs/guides/colocation.md)")
    p.add_argument("--min-training-share", type=float, default=0.25,
                   help="with --slo-headroom-url: the share of a step's wall time training keeps however "
                        "little headroom is left, in (0, 1]")
    p.add_argument("--training-cpu-priority", choices=["idle", "normal"], default="idle",
                   help="with --slo-headroom-url on a CPU: idle runs the training thread only when the "
                        "server leaves the core idle (Linux SCHED_IDLE), normal shares it evenly")
    p.add_argument("--checkpoint-interval-ms", type=int, default=None)
    p.add_argument("--checkpoint-dir", default=None, help="file:// URI; the cluster's when omitted")
    p.add_argument("--restore-from", default=None, help="a retained checkpoint or savepoint path")
    p.add_argument("--parallelism", type=int, default=None)
    p.add_argument("--max-event-skew-ms", type=int, default=300_000,
                   help="a record whose Kafka timestamp is further ahead of the wall clock is dead-lettered "
                        "(reason timestamp) and does not move the watermark; 0 = off (tests and demos only)")
    p.add_argument("--max-event-age-ms", type=int, default=0,
                   help="a sample whose Kafka timestamp is older is dead-lettered (reason timestamp); "
                        "0 = off, the default: replaying or backfilling old data must stay possible")
    p.add_argument("--micro-batch-ms", type=micro_batch_ms, default=0,
                   help="feedback samples the JVM can prove valid (operators/micro_batches.py) cross into "
                        "Python once per model and micro-batch of this much event time, not one by one; "
                        "the rest takes the Python validation as before. It divides 1000 or is whole "
                        "seconds; a config whose window is not a whole number of micro-batches is "
                        "dead-lettered (schema). Longer: faster ingest, and a stream that stops waits "
                        "longer for its last window (docs/concepts/streaming-job.md). 0 = off")
    p.add_argument("--bundle-time-ms", type=int, default=None,
                   help="how long a Python operator holds records before passing them on (default: the "
                        "job's latency setting, 5-10 ms; Flink's 1000 trades freshness for throughput, "
                        "see bench/ingest.py)")


# A version passes three Python operators (validate, trainer, registration) and two network
# hops; each Python operator holds its records, and the watermark, until its bundle finishes.
# Flink's defaults (1 s bundles, 100 ms network flushes) add seconds to a version's freshness
# at low rates; at high rates the bundle fills (size 100) long before this time.
LATENCY_SETTINGS: dict[str, str] = {
    "python.fn-execution.bundle.time": "10",
    "execution.buffer-timeout.interval": "10 ms",
}
# PyFlink caches keyed state per (state, key) in the Python worker, Flink's default 1,000
# entries. On a key change it caches every state the function declared for the old key: the
# trainer declares 12, so the default holds about 83 models, and a worker with more reads
# each state again from the JVM, one blocking round trip per read (bench/ingest.py,
# --models 1000). The entries hold what the states hold; the largest, a model's pending
# samples, is bounded by its window.
STATE_SETTINGS: dict[str, str] = {"python.state.cache-size": "16384"}
# Tansu holds every fetch for fetch.max.wait.ms even when records arrive (measured on the local stack): Kafka's
# 500 ms default put ~120 ms on each read of a version. Apache Kafka answers as soon as
# records arrive, so there the shorter wait only makes idle fetches more frequent.
CONSUMER_PROPERTIES: dict[str, str] = {"fetch.max.wait.ms": "20"}


# Printed by a job run with `python -m` (its own mini-cluster), before the URL of its REST API and web UI.
MINI_CLUSTER_LINE = "Flink web UI and REST API of this job's mini-cluster: "


def environment(job: JobConfig, settings: dict[str, str] | None = None) -> StreamExecutionEnvironment:
    """Exactly-once checkpoints (the cluster's interval, else 10 s), retained on cancellation,
    watermarks every 50 ms, LATENCY_SETTINGS and STATE_SETTINGS, then `settings` (a job's own) over them, then
    --bundle-time-ms."""
    conf = Configuration()
    if job.embedded_rest_port:
        conf.set_string("rest.bind-port", str(job.embedded_rest_port))
        conf.set_string("rest.address", "127.0.0.1")
        conf.set_string("rest.bind-address", "127.0.0.1")
        print(f"{MINI_CLUSTER_LINE}http://127.0.0.1:{job.embedded_rest_port}", file=sys.stderr, flush=True)
    if job.checkpoint_dir:
        conf.set_string("execution.checkpointing.dir", job.checkpoint_dir)
    if job.restore_from:
        conf.set_string("execution.state-recovery.path", job.restore_from)
    conf.set_string("execution.checkpointing.externalized-checkpoint-retention", "RETAIN_ON_CANCELLATION")
    # Windows close when the watermark passes them: emit it every 50 ms (Flink's default, 200).
    conf.set_string("pipeline.auto-watermark-interval", "50 ms")
    conf.set_string("execution.checkpointing.num-retained", "3")
    bundle = {"python.fn-execution.bundle.time": str(job.bundle_time_ms)} if job.bundle_time_ms else {}
    for key, value in {**LATENCY_SETTINGS, **STATE_SETTINGS, **(settings or {}), **bundle}.items():
        conf.set_string(key, value)
    env = StreamExecutionEnvironment.get_execution_environment(conf)
    if job.checkpoint_on_version:
        fix_job_id(env)
    checkpoints = env.get_checkpoint_config()
    interval = job.checkpoint_interval_ms or int(
        checkpoints.get_checkpoint_interval() if checkpoints.is_checkpointing_enabled() else 10000)
    env.enable_checkpointing(interval, CheckpointingMode.EXACTLY_ONCE)
    # A job asking for short checkpoints gets them: the cluster's min pause (2 s) would
    # otherwise stretch a 1 s interval to 2 s plus the checkpoint's own duration.
    checkpoints.set_min_pause_between_checkpoints(min(checkpoints.get_min_pause_between_checkpoints(), interval // 2))
    if job.parallelism:
        env.set_parallelism(job.parallelism)
    return env


def fix_job_id(env: StreamExecutionEnvironment) -> str:
    """The job's id, chosen here unless the cluster chose it (application mode does, and keeps
    it across JobManager failovers), and handed to the operators as a job parameter: the
    trainer asks the REST API for checkpoints of its own job (--checkpoint-on-version)."""
    fixed = "$internal.pipeline.job-id"  # PipelineOptionsInternal.PIPELINE_FIXED_JOB_ID
    job_id = env._j_stream_execution_environment.getConfiguration().toMap().get(fixed)
    if not job_id:
        job_id = secrets.token_hex(16)
        env.configure(Configuration().set_string(fixed, job_id))
    env.get_config().set_global_job_parameters({JOB_ID_PARAMETER: job_id})
    return job_id


def embedded() -> bool:
    """Whether this process runs its job on a mini-cluster of its own: PyFlink connects to the
    gateway of `flink run` (and of application mode) through PYFLINK_GATEWAY_PORT, and starts
    a local JVM without it."""
    return "PYFLINK_GATEWAY_PORT" not in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def table_environment(env: StreamExecutionEnvironment) -> StreamTableEnvironment:
    return StreamTableEnvironment.create(env)


def kafka_rows(t_env: StreamTableEnvironment, job: JobConfig, table: str, topics: list[str],
               consumer_properties: dict[str, str] | None = None, reader: str = "input",
               micro_batch_topics: list[str] | None = None, idle_timeout_ms: int | None = None):
    """Kafka records as rows (key, payload, topic, partition, offset) with event time, read_committed;
    records stamped beyond --max-event-skew-ms do not move the watermark (validate dead-letters them).
    With --micro-batch-ms, the samples of `micro_batch_topics` the JVM proves valid come as one
    row per model and micro-batch (operators/micro_batches.py)."""
    idle = job.idle_timeout_ms if idle_timeout_ms is None else idle_timeout_ms
    t_env.execute_sql(input_table_ddl(table, topics, job.bootstrap, f"{job.job_name}-{reader}", job.lateness_ms,
                                      idle, {**CONSUMER_PROPERTIES, **(consumer_properties or {})},
                                      job.max_event_skew_ms))
    if not (job.micro_batch_ms and micro_batch_topics):
        return t_env.to_data_stream(t_env.from_path(table))
    mode = redaction_mode(os.environ)
    if mode not in ("pii", "off"):
        raise ConfigError(f"--micro-batch-ms proves samples free of personal data by core/redaction.py's rules; "
                          f"STREAMTUNE_REDACT={mode} needs every sample in Python: leave --micro-batch-ms at 0")
    view, query = split_input_sql(table, fast_condition(micro_batch_topics, job.max_record_bytes,
                                                        job.max_event_skew_ms, job.max_event_age_ms),
                                  job.micro_batch_ms)
    t_env.execute_sql(view)
    return t_env.to_data_stream(t_env.sql_query(query))


def input_rows(t_env: StreamTableEnvironment, job: JobConfig, table: str, topics: list[str],
               consumer_properties: dict[str, str] | None = None, micro_batch_topics: list[str] | None = None):
    """`topics` and the job's config topic as rows (kafka_rows), the config topic through a
    Kafka source of its own; `micro_batch_topics` (feedback) as kafka_rows says.

    Why two sources: one source combines its splits' watermarks, and when every split goes
    idle in the same check (a backlog read at start-up, then nothing) it marks itself idle
    without passing on the highest one. The task after two sources does pass on the highest
    watermark once both are idle. A Python operator (validate) holds a watermark until its
    bundle ends but passes "idle" on at once, and Flink drops a watermark sent after "idle":
    at start-up the first bundle waits for the Python worker, so the sources' idle timeout
    (IDLE_TIMEOUT_MS) must outlast that start, or only the trainer's idle timer closes the
    first window.
    """
    data = kafka_rows(t_env, job, table, topics, consumer_properties, micro_batch_topics=micro_batch_topics)
    configs = kafka_rows(t_env, job, f"{table}_configs", [job.config_topic], consumer_properties, reader="configs",
                         idle_timeout_ms=min(job.idle_timeout_ms, CONFIG_IDLE_TIMEOUT_MS))
    return data.union(configs)


def train(trainer_input, job: JobConfig) -> list:
    """key_by(model) → LoRA trainer → exactly-once versions; returns the trainer's dead letters."""
    versions = (trainer_input.key_by(lambda r: r[1], key_type=Types.STRING())
                .process(FinetuneFunction(job.trainer_settings()), output_type=Types.STRING())
                .name("lora-trainer").uid("lora-trainer"))
    sink = exactly_once_sink(job.bootstrap, job.versions_topic, f"{job.job_name}-versions") \
        if job.versions_delivery == "exactly-once" else at_least_once_sink(job.bootstrap, job.versions_topic)
    versions.sink_to(sink).name("versions-sink").uid("versions-sink")
    return [versions.get_side_output(DLQ_TAG)]


def register(t_env: StreamTableEnvironment, job: JobConfig) -> list:
    """The job's committed versions → MLflow (in order per model) → the broadcast topic.

    A pipeline of its own inside the job (operators/registration.py): the cluster supervises
    and restarts it with the training; an MLflow outage queues versions in its state and
    never blocks training. Returns its dead letters (unreadable records, bad artifacts).
    """
    rows = kafka_rows(t_env, job, "versions_input", [job.versions_topic], reader="registrar")
    records = rows.process(VersionReader(), output_type=VERSION_TYPE).name("read-versions").uid("read-versions")
    broadcasts = (records.key_by(lambda r: r[0], key_type=Types.STRING())
                  .process(RegistrationFunction(job.tracking_uri, store_uri(job.artifact_store)),
                           output_type=Types.STRING())
                  .name("register-versions").uid("register-versions"))
    broadcasts.sink_to(at_least_once_sink(job.bootstrap, job.broadcast_topic)) \
        .name("broadcast-sink").uid("broadcast-sink")
    return [records.get_side_output(DLQ_TAG), broadcasts.get_side_output(DLQ_TAG)]


def train_and_register(t_env: StreamTableEnvironment, job: JobConfig, trainer_input, dead_letters: list) -> None:
    """How every training job ends: the trainer, registration (unless --no-register), and one
    DLQ for `dead_letters` and the dead letters of both."""
    dead_letters = [*dead_letters, *train(trainer_input, job)]
    if job.register:
        dead_letters += register(t_env, job)
    sink_dead_letters(dead_letters, job)


def sink_dead_letters(dead_letters: list, job: JobConfig) -> None:
    """Every dead letter of the job → the DLQ topic, exactly-once."""
    dead_letters[0].union(*dead_letters[1:]) \
        .sink_to(exactly_once_sink(job.bootstrap, job.dlq_topic, f"{job.job_name}-dlq")) \
        .name("dlq-sink").uid("dlq-sink")
