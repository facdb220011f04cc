"""The streaming fine-tuning job: Kafka feedback → per-model windows → LoRA steps → versions.

    flink run -py jobs/stream_finetune.py --bootstrap kafka:9092 --base-model /models/base
    python -m jobs.stream_finetune --base-model /models/base        # embedded mini-cluster

Topics (created when missing):

| option             | default                     | holds                                          |
|--------------------|-----------------------------|------------------------------------------------|
| --feedback-topic   | streamtune.feedback         | feedback samples (streamtune/specs.py)         |
| --config-topic     | streamtune.configs          | fine-tune specs per model (hot updates) and    |
|                    |                             | retrain triggers {model_id, trigger, reason}   |
| --versions-topic   | streamtune.versions         | version records, exactly-once (read_committed) |
| --dlq-topic        | streamtune.dlq              | dead letters: payload, reason, source offset   |

Other options: --base-model (default HF directory when a spec names none), --artifact-dir,
--unknown-model-grace-seconds (30, wall clock), --max-record-bytes (65536), --lateness-ms (0),
--idle-timeout-ms (2000), --checkpoint-interval-ms (the cluster's, else 10000),
--checkpoint-dir and --restore-from (mini-cluster runs), --parallelism.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pyflink.common import Configuration, Types
from pyflink.datastream import CheckpointingMode, StreamExecutionEnvironment
from pyflink.table import StreamTableEnvironment

from connectors.flink_kafka import exactly_once_sink, input_table_ddl
from connectors.kafka import create_topic
from operators.finetune_function import FinetuneFunction, TrainerSettings
from operators.validate import DLQ_TAG, VALID_TYPE, ValidateFunction


def arg_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The options every training job shares (jobs/cdc_retrain.py adds its own)."""
    from streamtune.stack import StackConfig

    stack = StackConfig.from_env()
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bootstrap", default=os.environ.get("STREAMTUNE_KAFKA_BOOTSTRAP", stack.kafka_bootstrap))
    p.add_argument("--config-topic", default="streamtune.configs")
    p.add_argument("--versions-topic", default="streamtune.versions")
    p.add_argument("--dlq-topic", default="streamtune.dlq")
    p.add_argument("--partitions", type=int, default=1, help="for topics this job creates")
    p.add_argument("--base-model", default=str(stack.data_dir / "models" / "tiny-llama"))
    p.add_argument("--artifact-dir", default=str(stack.data_dir / "adapters"))
    p.add_argument("--unknown-model-grace-seconds", type=float, default=30.0)
    p.add_argument("--max-record-bytes", type=int, default=65536)
    p.add_argument("--lateness-ms", type=int, default=0)
    p.add_argument("--idle-timeout-ms", type=int, default=int(os.environ.get("STREAMTUNE_IDLE_TIMEOUT_MS", 2000)),
                   help="a partition without records this long stops holding the watermark")
    p.add_argument("--checkpoint-interval-ms", type=int, default=None)
    p.add_argument("--checkpoint-dir", default=None, help="file:// URI; the cluster's when omitted")
    p.add_argument("--restore-from", default=None, help="a retained checkpoint or savepoint path")
    p.add_argument("--parallelism", type=int, default=None)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = arg_parser("stream_finetune", __doc__)
    p.add_argument("--feedback-topic", default="streamtune.feedback")
    p.add_argument("--job-name", default="streamtune-finetune")
    return p.parse_args(argv)


def build(env: StreamExecutionEnvironment, args: argparse.Namespace) -> None:
    t_env = StreamTableEnvironment.create(env)
    t_env.execute_sql(input_table_ddl("streamtune_input", [args.feedback_topic, args.config_topic],
                                      args.bootstrap, f"{args.job_name}-input", args.lateness_ms, args.idle_timeout_ms))
    rows = t_env.to_data_stream(t_env.from_path("streamtune_input"))

    validated = rows.process(ValidateFunction(frozenset({f"kafka:{args.feedback_topic}"}), args.config_topic,
                                              args.max_record_bytes),
                             output_type=VALID_TYPE).name("validate").uid("validate")
    train(validated, [validated.get_side_output(DLQ_TAG)], args)


def train(trainer_input, dead_letters: list, args: argparse.Namespace) -> None:
    """key_by(model) → LoRA trainer → exactly-once versions; every dead letter → the DLQ."""
    settings = TrainerSettings(default_base_model=str(Path(args.base_model).resolve()),
                               artifact_dir=str(Path(args.artifact_dir).resolve()),
                               unknown_model_grace_ms=int(args.unknown_model_grace_seconds * 1000),
                               lateness_ms=args.lateness_ms)
    versions = (trainer_input.key_by(lambda r: r[1], key_type=Types.STRING())
                .process(FinetuneFunction(settings), output_type=Types.STRING())
                .name("lora-trainer").uid("lora-trainer"))

    versions.sink_to(exactly_once_sink(args.bootstrap, args.versions_topic, f"{args.job_name}-versions")) \
        .name("versions-sink").uid("versions-sink")
    dead_letters[0].union(*dead_letters[1:], versions.get_side_output(DLQ_TAG)) \
        .sink_to(exactly_once_sink(args.bootstrap, args.dlq_topic, f"{args.job_name}-dlq")) \
        .name("dlq-sink").uid("dlq-sink")


def environment(args: argparse.Namespace, settings: dict[str, str] | None = None) -> StreamExecutionEnvironment:
    conf = Configuration()
    for key, value in (settings or {}).items():
        conf.set_string(key, value)
    if args.checkpoint_dir:
        conf.set_string("execution.checkpointing.dir", args.checkpoint_dir)
    if args.restore_from:
        conf.set_string("execution.state-recovery.path", args.restore_from)
    conf.set_string("execution.checkpointing.externalized-checkpoint-retention", "RETAIN_ON_CANCELLATION")
    conf.set_string("execution.checkpointing.num-retained", "3")
    env = StreamExecutionEnvironment.get_execution_environment(conf)
    interval = args.checkpoint_interval_ms or int(
        env.get_checkpoint_config().get_checkpoint_interval() if env.get_checkpoint_config()
        .is_checkpointing_enabled() else 10000)
    env.enable_checkpointing(interval, CheckpointingMode.EXACTLY_ONCE)
    if args.parallelism:
        env.set_parallelism(args.parallelism)
    return env


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for topic in (args.feedback_topic, args.config_topic, args.versions_topic, args.dlq_topic):
        create_topic(args.bootstrap, topic, args.partitions)
    env = environment(args)
    build(env, args)
    env.execute(args.job_name)


if __name__ == "__main__":
    main(sys.argv[1:])
