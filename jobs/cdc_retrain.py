"""CDC-triggered retraining: database changes → samples → the same LoRA trainer and registry path.

    streamtune cdc --source 'postgres://u@db/app?table=public.answers&table=public.policies&password_env=PG_PASSWORD'
    flink run -py jobs/cdc_retrain.py --cdc-topic streamtune.cdc.pg-app --mapping mapping.yaml
    python -m jobs.cdc_retrain --cdc-topic streamtune.cdc.pg-app --mapping mapping.yaml  # mini-cluster

Reads Debezium-envelope change events (from `streamtune cdc`, Debezium or Flink CDC) and
the config topic. Each change is checked (bad → DLQ), keyed by its row, stripped of
repeats by source position, and mapped by the mapping file (operators/cdc_mapping.py) to
samples, retractions and retrain triggers for the trainer of jobs/stream_finetune.py: the
same windows, LoRA steps, exactly-once version records, DLQ and registrar.

A model is trained here when its fine-tune spec (on the config topic) names a mapped
source, e.g. `"stream_source": "postgres://db/app?table=public.answers"` or
`"mongodb://host/?db=shop&collection=reviews"`.

Options: --cdc-topic (repeatable, required), --mapping (YAML/JSON, required), and the
stream_finetune options: --config-topic, --versions-topic, --dlq-topic, --base-model,
--artifact-store, --tracking-uri, --broadcast-topic, --no-register, --checkpoint-*, --restore-from, … (`--help` lists them).
"""

from __future__ import annotations

import argparse
import sys

from pyflink.common import Types
from pyflink.datastream import StreamExecutionEnvironment

from core.errors import ConfigError
from jobs.wiring import JobConfig, add_job_arguments, environment, input_rows, table_environment, train_and_register
from operators.cdc_mapping import CdcMapping
from operators.row_changes import RowChangeFunction
from operators.validate import CHANGE_TAG, DLQ_TAG, VALID_TYPE, ValidateFunction


# Flink settings of this job (over the cluster's): see docs/guides/cdc.md, "Latency".
CDC_JOB_SETTINGS: dict[str, str] = {
    "python.fn-execution.bundle.time": "5",
    "python.fn-execution.bundle.size": "10",
    "execution.buffer-timeout.interval": "5 ms",
}
# The broker answers a fetch with no new records after this wait.
CDC_CONSUMER_PROPERTIES = {"fetch.max.wait.ms": "5"}


def build(env: StreamExecutionEnvironment, job: JobConfig, cdc_topics: list[str], mapping: CdcMapping) -> None:
    t_env = table_environment(env)
    rows = input_rows(t_env, job, "cdc_input", cdc_topics, CDC_CONSUMER_PROPERTIES)
    validated = rows.process(ValidateFunction(mapping.sources, job.config_topic, job.max_record_bytes,
                                              change_topics=frozenset(cdc_topics),
                                              max_event_skew_ms=job.max_event_skew_ms),
                             output_type=VALID_TYPE).name("validate").uid("validate")
    mapped = (validated.get_side_output(CHANGE_TAG)
              .key_by(lambda c: c[0], key_type=Types.STRING())
              .process(RowChangeFunction(mapping), output_type=VALID_TYPE)
              .name("row-changes").uid("row-changes"))
    train_and_register(t_env, job, validated.union(mapped),
                       [validated.get_side_output(DLQ_TAG), mapped.get_side_output(DLQ_TAG)])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="cdc_retrain", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_arguments(p)
    p.add_argument("--cdc-topic", action="append", required=True, help="change events (repeatable)")
    p.add_argument("--mapping", required=True, help="YAML or JSON mapping file (operators/cdc_mapping.py)")
    p.add_argument("--job-name", default="streamtune-cdc-retrain")
    args = p.parse_args(argv)
    try:
        mapping = CdcMapping.load(args.mapping)
    except ConfigError as e:
        p.error(f"--mapping: {e}")
    # Any parallelism: a row's changes all pass one row-changes subtask, so they reach the
    # trainer in commit order; changes of different rows may interleave, which windows
    # closing on the watermark do not see (a retrain trigger trains what has arrived).
    job = JobConfig.from_args(args, args.job_name)
    job.create_topics(*args.cdc_topic)
    env = environment(job, CDC_JOB_SETTINGS)
    build(env, job, args.cdc_topic, mapping)
    env.execute(job.job_name)


if __name__ == "__main__":
    main(sys.argv[1:])
