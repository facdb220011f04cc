"""What both training jobs share: their options, a frozen job config, the Flink environment,
and the trainer half of the pipeline (key_by model → LoRA trainer → exactly-once sinks).

The entry points (jobs/stream_finetune.py, jobs/cdc_retrain.py) parse arguments in their
`main` only and pass a `JobConfig` and plain values down.

>>> p = argparse.ArgumentParser()
>>> add_job_arguments(p)
>>> job = JobConfig.from_args(p.parse_args(["--bootstrap", "kafka:9092", "--parallelism", "2"]), "demo")
>>> job.bootstrap, job.parallelism, job.trainer_settings().unknown_model_grace_ms
('kafka:9092', 2, 30000)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pyflink.common import Configuration, Types
from pyflink.datastream import CheckpointingMode, StreamExecutionEnvironment
from pyflink.table import StreamTableEnvironment

from connectors.flink_kafka import exactly_once_sink, input_table_ddl
from connectors.kafka import create_topic
from core import defaults
from operators.finetune_function import FinetuneFunction, TrainerSettings
from operators.validate import DLQ_TAG


@dataclass(frozen=True)
class JobConfig:
    """Settings of one training job, fixed at submission."""

    job_name: str
    bootstrap: str
    config_topic: str = defaults.CONFIG_TOPIC
    versions_topic: str = defaults.VERSIONS_TOPIC
    dlq_topic: str = defaults.DLQ_TOPIC
    partitions: int = 1                       # for topics this job creates
    base_model: str = str(defaults.base_model_dir())
    artifact_dir: str = str(defaults.artifact_dir())
    unknown_model_grace_ms: int = 30_000
    max_record_bytes: int = 65536
    lateness_ms: int = 0
    idle_timeout_ms: int = 2000
    checkpoint_interval_ms: Optional[int] = None
    checkpoint_dir: Optional[str] = None
    restore_from: Optional[str] = None
    parallelism: Optional[int] = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, job_name: str, **overrides) -> "JobConfig":
        """From the options of `add_job_arguments`; `overrides` are a job's own defaults."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if f.name not in ("job_name", "unknown_model_grace_ms") and hasattr(args, f.name)}
        values["unknown_model_grace_ms"] = int(args.unknown_model_grace_seconds * 1000)
        return cls(job_name=job_name, **{**values, **overrides})

    def trainer_settings(self) -> TrainerSettings:
        return TrainerSettings(default_base_model=str(Path(self.base_model).resolve()),
                               artifact_dir=str(Path(self.artifact_dir).resolve()),
                               unknown_model_grace_ms=self.unknown_model_grace_ms, lateness_ms=self.lateness_ms)

    def create_topics(self, *inputs: str) -> None:
        for topic in (*inputs, self.config_topic, self.versions_topic, self.dlq_topic):
            create_topic(self.bootstrap, topic, self.partitions)


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """The options every training job shares (defaults: core.defaults, the local stack's)."""
    p.add_argument("--bootstrap", default=defaults.kafka_bootstrap())
    p.add_argument("--config-topic", default=defaults.CONFIG_TOPIC)
    p.add_argument("--versions-topic", default=defaults.VERSIONS_TOPIC)
    p.add_argument("--dlq-topic", default=defaults.DLQ_TOPIC)
    p.add_argument("--partitions", type=int, default=1, help="for topics this job creates")
    p.add_argument("--base-model", default=str(defaults.base_model_dir()))
    p.add_argument("--artifact-dir", default=str(defaults.artifact_dir()))
    p.add_argument("--unknown-model-grace-seconds", type=float, default=30.0)
    p.add_argument("--max-record-bytes", type=int, default=65536)
    p.add_argument("--lateness-ms", type=int, default=0)
    p.add_argument("--idle-timeout-ms", type=int, default=int(os.environ.get("STREAMTUNE_IDLE_TIMEOUT_MS", 2000)),
                   help="a partition without records this long stops holding the watermark")
    p.add_argument("--checkpoint-interval-ms", type=int, default=None)
    p.add_argument("--checkpoint-dir", default=None, help="file:// URI; the cluster's when omitted")
    p.add_argument("--restore-from", default=None, help="a retained checkpoint or savepoint path")
    p.add_argument("--parallelism", type=int, default=None)


def environment(job: JobConfig, settings: dict[str, str] | None = None) -> StreamExecutionEnvironment:
    """Exactly-once checkpoints (the cluster's interval, else 10 s), retained on cancellation."""
    conf = Configuration()
    for key, value in (settings or {}).items():
        conf.set_string(key, value)
    if job.checkpoint_dir:
        conf.set_string("execution.checkpointing.dir", job.checkpoint_dir)
    if job.restore_from:
        conf.set_string("execution.state-recovery.path", job.restore_from)
    conf.set_string("execution.checkpointing.externalized-checkpoint-retention", "RETAIN_ON_CANCELLATION")
    conf.set_string("execution.checkpointing.num-retained", "3")
    env = StreamExecutionEnvironment.get_execution_environment(conf)
    checkpoints = env.get_checkpoint_config()
    interval = job.checkpoint_interval_ms or int(
        checkpoints.get_checkpoint_interval() if checkpoints.is_checkpointing_enabled() else 10000)
    env.enable_checkpointing(interval, CheckpointingMode.EXACTLY_ONCE)
    if job.parallelism:
        env.set_parallelism(job.parallelism)
    return env


def kafka_rows(env: StreamExecutionEnvironment, job: JobConfig, table: str, topics: list[str],
               consumer_properties: dict[str, str] | None = None):
    """The job's Kafka input as rows (key, payload, topic, partition, offset) with event time."""
    t_env = StreamTableEnvironment.create(env)
    t_env.execute_sql(input_table_ddl(table, topics, job.bootstrap, f"{job.job_name}-input", job.lateness_ms,
                                      job.idle_timeout_ms, consumer_properties))
    return t_env.to_data_stream(t_env.from_path(table))


def train(trainer_input, dead_letters: list, job: JobConfig) -> None:
    """key_by(model) → LoRA trainer → exactly-once versions; every dead letter → the DLQ."""
    versions = (trainer_input.key_by(lambda r: r[1], key_type=Types.STRING())
                .process(FinetuneFunction(job.trainer_settings()), output_type=Types.STRING())
                .name("lora-trainer").uid("lora-trainer"))

    versions.sink_to(exactly_once_sink(job.bootstrap, job.versions_topic, f"{job.job_name}-versions")) \
        .name("versions-sink").uid("versions-sink")
    dead_letters[0].union(*dead_letters[1:], versions.get_side_output(DLQ_TAG)) \
        .sink_to(exactly_once_sink(job.bootstrap, job.dlq_topic, f"{job.job_name}-dlq")) \
        .name("dlq-sink").uid("dlq-sink")
