"""The ingest benchmark's job (bench/ingest.py submits it with `flink run -py`).

The training job's front, as jobs/stream_finetune.py wires it: the Kafka source (feedback
and config topics, read_committed, event time), validation with its dead letters,
key_by(model_id) and the trainer's own windowing (operators/finetune_function.py: keyed
pending state, event-time and idle timers, carry-over, step chunks). Only a window's step is
replaced, by its sample count and the wall time it fired, so the figure is ingest alone:
bench/trainer_overhead.py measures the step. With --floor-window-ms the windowing itself is
replaced by FloorCounts, the least a keyed Python function does per row and window.

    flink run -py bench/ingest_job.py --counts-topic T --feedback-topic F --config-topic C --dlq-topic D ...
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyflink.common import Types  # noqa: E402
from pyflink.datastream import KeyedProcessFunction  # noqa: E402
from pyflink.datastream.state import ValueStateDescriptor  # noqa: E402

from connectors.flink_kafka import at_least_once_sink  # noqa: E402
from jobs.wiring import (JobConfig, add_job_arguments, environment, input_rows, sink_dead_letters,  # noqa: E402
                         table_environment)
from operators.finetune_function import FinetuneFunction  # noqa: E402
from operators.validate import DLQ_TAG, VALID_TYPE, ValidateFunction  # noqa: E402


class WindowCounts(FinetuneFunction):
    """The trainer's windowing; a fired step yields its count instead of a version."""

    def _fire(self, model_id, spec, cfg, batch, end, trigger):
        yield json.dumps({"model_id": model_id, "window_end": end, "samples": len(batch),
                          "emitted_ms": int(time.time() * 1000)})


class FloorCounts(KeyedProcessFunction):
    """PyFlink's floor (--floor-window-ms): the least a keyed Python function can do per row and
    window (one ValueState read and write per row, one event-time timer per model and window),
    in place of the trainer's windowing. The rate the job's front reaches with it bounds the
    rate of any windowing in Python behind the same front, on the same machine."""

    def __init__(self, window_ms: int):
        self.window_ms = window_ms

    def open(self, runtime_context):
        # {window_end: samples}: a watermark can pass two windows at once, after both rows came.
        self.count = runtime_context.get_state(ValueStateDescriptor("count", Types.PICKLED_BYTE_ARRAY()))

    def process_element(self, value, ctx):
        kind, model_id, body, topic, partition, offset, ts = value
        if kind not in ("batch", "sample"):
            return
        n = partition if kind == "batch" else 1
        end = (ts // self.window_ms + 1) * self.window_ms
        counts = self.count.value() or {}
        counts[end] = counts.get(end, 0) + n
        self.count.update(counts)
        ctx.timer_service().register_event_time_timer(end)

    def on_timer(self, timestamp, ctx):
        counts = self.count.value() or {}
        if timestamp not in counts:
            return
        yield json.dumps({"model_id": ctx.get_current_key(), "window_end": timestamp, "samples": counts.pop(timestamp),
                          "emitted_ms": int(time.time() * 1000)})
        self.count.update(counts)


def build(env, job: JobConfig, feedback_topic: str, counts_topic: str, floor_window_ms: int = 0) -> None:
    """floor_window_ms: FloorCounts over windows this long instead of the trainer's windowing (0: off)."""
    t_env = table_environment(env)
    rows = input_rows(t_env, job, "ingest_input", [feedback_topic], micro_batch_topics=[feedback_topic])
    validated = rows.process(ValidateFunction(frozenset({f"kafka:{feedback_topic}"}), job.config_topic,
                                              job.max_record_bytes, micro_batch_ms=job.micro_batch_ms),
                             output_type=VALID_TYPE).name("validate").uid("validate")
    counts = (validated.key_by(lambda r: r[1], key_type=Types.STRING())
              .process(FloorCounts(floor_window_ms) if floor_window_ms else WindowCounts(job.trainer_settings()),
                       output_type=Types.STRING())
              .name("windowing").uid("windowing"))
    counts.sink_to(at_least_once_sink(job.bootstrap, counts_topic)).name("counts-sink").uid("counts-sink")
    sink_dead_letters([validated.get_side_output(DLQ_TAG), counts.get_side_output(DLQ_TAG)], job)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_job_arguments(parser)
    parser.add_argument("--feedback-topic", required=True)
    parser.add_argument("--counts-topic", required=True)
    parser.add_argument("--job-name", default="streamtune-bench-ingest")
    parser.add_argument("--floor-window-ms", type=int, default=0,
                        help="PyFlink's floor (FloorCounts) over windows this long in place of the trainer's windowing")
    args = parser.parse_args()
    job = JobConfig.from_args(args, args.job_name, register=False)
    env = environment(job)
    build(env, job, args.feedback_topic, args.counts_topic, args.floor_window_ms)
    env.execute(job.job_name)
