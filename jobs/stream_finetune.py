"""The streaming fine-tuning job: Kafka feedback → per-model windows → LoRA steps → versions.

    flink run -py jobs/stream_finetune.py --bootstrap-server kafka:9092 --base-model /models/base
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
| --inference-log-topic | off                      | InferenceRecord (`streamtune serve`'s log):    |
|                    |                             | pseudo-labels (operators/pseudo_labels.py)     |
| --review-topic     | streamtune.review           | ReviewRecord: responses below the threshold,   |
|                    |                             | exactly-once (with --inference-log-topic)      |

The job also registers its own committed versions in MLflow (--tracking-uri) and broadcasts
them (jobs/wiring.py `register`); --no-register leaves that to `streamtune registrar`.

Other options: --base-model (default HF directory when a spec names none), --artifact-store,
--unknown-model-grace-seconds (30, wall clock), --max-record-bytes (65536), --lateness-ms (0),
--idle-timeout-ms (5000), --checkpoint-interval-ms (the cluster's, else 10000),
--checkpoint-dir and --restore-from (mini-cluster runs), --parallelism, --bundle-time-ms (10:
freshness; 1000 for throughput).
"""

from __future__ import annotations

import argparse
import sys

from pyflink.common import Types
from pyflink.datastream import StreamExecutionEnvironment

from core import defaults
from connectors.flink_kafka import exactly_once_sink
from jobs.wiring import JobConfig, add_job_arguments, environment, input_rows, table_environment, train_and_register
from operators.pseudo_labels import REVIEW_TAG, PseudoLabelFunction
from operators.validate import DLQ_TAG, VALID_TYPE, ValidateFunction


def build(env: StreamExecutionEnvironment, job: JobConfig, feedback_topic: str,
          inference_log_topic: str | None = None, review_topic: str = defaults.REVIEW_TOPIC) -> None:
    """With `inference_log_topic`, its responses become pseudo-labels or review records
    (operators/pseudo_labels.py) before the trainer; without it the graph is as it was."""
    t_env = table_environment(env)
    inference = [inference_log_topic] if inference_log_topic else []
    rows = input_rows(t_env, job, "streamtune_input", [feedback_topic, *inference], micro_batch_topics=[feedback_topic])
    validated = rows.process(ValidateFunction(frozenset({f"kafka:{feedback_topic}"}), job.config_topic,
                                              job.max_record_bytes, inference_topics=frozenset(inference),
                                              max_event_skew_ms=job.max_event_skew_ms,
                                              max_event_age_ms=job.max_event_age_ms,
                                              micro_batch_ms=job.micro_batch_ms),
                             output_type=VALID_TYPE).name("validate").uid("validate")
    dead_letters = [validated.get_side_output(DLQ_TAG)]
    if inference:
        validated = (validated.key_by(lambda r: r[1], key_type=Types.STRING())
                     .process(PseudoLabelFunction(job.unknown_model_grace_ms), output_type=VALID_TYPE)
                     .name("pseudo-labels").uid("pseudo-labels"))
        dead_letters.append(validated.get_side_output(DLQ_TAG))
        validated.get_side_output(REVIEW_TAG) \
            .sink_to(exactly_once_sink(job.bootstrap, review_topic, f"{job.job_name}-review")) \
            .name("review-sink").uid("review-sink")
    train_and_register(t_env, job, validated, dead_letters)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="stream_finetune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_arguments(p)
    p.add_argument("--feedback-topic", default=defaults.FEEDBACK_TOPIC)
    p.add_argument("--inference-log-topic", default=None,
                   help=f"pseudo-labels from this inference log (e.g. {defaults.INFERENCE_LOG_TOPIC}) for models "
                        "whose spec has pseudo_labels; off by default")
    p.add_argument("--review-topic", default=defaults.REVIEW_TOPIC,
                   help="inference-log responses below the spec's pseudo_labels threshold (ReviewRecord)")
    p.add_argument("--job-name", default="streamtune-finetune")
    args = p.parse_args(argv)
    job = JobConfig.from_args(args, args.job_name)
    pseudo = [args.inference_log_topic, args.review_topic] if args.inference_log_topic else []
    job.create_topics(args.feedback_topic, *pseudo)
    env = environment(job)
    build(env, job, args.feedback_topic, args.inference_log_topic, args.review_topic)
    env.execute(job.job_name)


if __name__ == "__main__":
    main(sys.argv[1:])
