"""The streaming fine-tuning job: Kafka feedback → per-model windows → LoRA steps → versions.

    flink run -py jobs/stream_finetune.py --bootstrap kafka:9092 --base-model /models/base
    python -m jobs.stream_finetune --base-model /models/base        # embedded mini-cluster

Topics (created when missing):

| option             | default                     | holds                                          |
|--------------------|-----------------------------|------------------------------------------------|
| --feedback-topic   | streamtune.feedback         | FeedbackSample (core/messages/feedback.py)     |
| --config-topic     | streamtune.configs          | FinetuneSpec per model (hot updates) and       |
|                    |                             | RetrainTrigger {model_id, trigger, reason}     |
| --versions-topic   | streamtune.versions         | VersionRecord, exactly-once (read_committed)   |
| --dlq-topic        | streamtune.dlq              | DeadLetter: payload, reason, source offset     |
| --broadcast-topic  | streamtune.adapter-versions | AdapterVersionBroadcast per registered version |

The job also registers its own committed versions in MLflow (--tracking-uri) and broadcasts
them (jobs/wiring.py `register`); --no-register leaves that to `streamtune registrar`.

Other options: --base-model (default HF directory when a spec names none), --artifact-store,
--unknown-model-grace-seconds (30, wall clock), --max-record-bytes (65536), --lateness-ms (0),
--idle-timeout-ms (2000), --checkpoint-interval-ms (the cluster's, else 10000),
--checkpoint-dir and --restore-from (mini-cluster runs), --parallelism.
"""

from __future__ import annotations

import argparse
import sys

from pyflink.datastream import StreamExecutionEnvironment

from core import defaults
from jobs.wiring import JobConfig, add_job_arguments, environment, kafka_rows, table_environment, train_and_register
from operators.validate import DLQ_TAG, VALID_TYPE, ValidateFunction


def build(env: StreamExecutionEnvironment, job: JobConfig, feedback_topic: str) -> None:
    t_env = table_environment(env)
    rows = kafka_rows(t_env, job, "streamtune_input", [feedback_topic, job.config_topic])
    validated = rows.process(ValidateFunction(frozenset({f"kafka:{feedback_topic}"}), job.config_topic,
                                              job.max_record_bytes),
                             output_type=VALID_TYPE).name("validate").uid("validate")
    train_and_register(t_env, job, validated, [validated.get_side_output(DLQ_TAG)])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="stream_finetune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_arguments(p)
    p.add_argument("--feedback-topic", default=defaults.FEEDBACK_TOPIC)
    p.add_argument("--job-name", default="streamtune-finetune")
    args = p.parse_args(argv)
    job = JobConfig.from_args(args, args.job_name)
    job.create_topics(args.feedback_topic)
    env = environment(job)
    build(env, job, args.feedback_topic)
    env.execute(job.job_name)


if __name__ == "__main__":
    main(sys.argv[1:])
