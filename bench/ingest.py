"""Ingest: records/s through the training job's validation and windowing ÷ the same
aggregation in Flink SQL, on the stack's Flink cluster at parallelism 1, in one run.

The same backlog of feedback records (--models models, event time spread over --minutes
one-minute windows, one record in --bad-every not JSON) goes to each arm's own topics:

    job               bench/ingest_job.py, submitted with `flink run -py`: the training job's
                      Kafka source, validation (bad records → the DLQ), key_by(model_id) and
                      the trainer's own windowing, each window's LoRA step replaced by its count;
                      with the job's 10 ms Python bundles (jobs/wiring.py LATENCY_SETTINGS)
    job, 1 s bundles  the same with --bundle-time-ms 1000 (Flink's default): throughput bought
                      with freshness
    job, micro-batches[, 1 s bundles]
                      the same with --micro-batch-ms 1000: the samples the JVM proves valid
                      cross into Python once per model and second of event time
                      (operators/micro_batches.py)
    job, window micro-batches[, 1 s bundles]
                      the same with micro-batches as long as the window (--micro-batch-ms
                      60000): once per model and window
    floor, window micro-batches (only with --ceiling or --arm)
                      the same front with the trainer's windowing replaced by the least a
                      keyed Python function does (bench/ingest_job.py FloorCounts: one state
                      read and write per row, one timer per model and window): the ceiling of
                      any windowing in Python behind this front, on this machine
    sql               sql/ddl.sql's `feedback` table and sql/samples_per_model.sql (TUMBLE 1
                      minute, samples per model), as `streamtune sql` submits it to the
                      cluster, into a Kafka table with the time each row was emitted

Every arm gets the whole backlog before it starts: a job fed while it runs would measure the
producer (kafka-python, about 25,000 records/s here), not the job. A job arm reads the
backlog with a long unknown-model grace: the local broker can serve the config topic after
much of the backlog, and the samples wait for their config instead of going to the DLQ.
A last sample per model, two windows on, moves the watermark past the last window. Every
window an arm closed must hold exactly the samples this script sent to it, per model; the
dead letters a job commits within 60 s are counted against the records it read that are not
JSON, and a shortfall is printed and kept in the results. Throughput is the
steady rate while windows close: the samples of every window output after the first output ÷
the time from the first output to the last (a window's time is its last model's row; windows
output with the first, in the same watermark's burst, are left out), so start-up (class
loading, Python workers, the first bundle) is out of every figure. A job arm
stops after --job-seconds of output; SQL reads the whole backlog (it needs it: at ~10^5
records/s the backlog lasts seconds), three times, and its figure is the median of the three.

    .venv/bin/python bench/ingest.py [--records 300000] [--models 10] [--minutes 180] [--arm ARM ...]

--minutes sets how dense the backlog is: 180 (the default) is 28 records a second of event
time, a quiet stream's replay; 5 is 1,000 a second, a busy stream's.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kafka import KafkaConsumer, KafkaProducer  # noqa: E402

from connectors.kafka import create_topic  # noqa: E402
from core.messages import DeadLetter, FeedbackSample  # noqa: E402
from jobs.wiring import LATENCY_SETTINGS  # noqa: E402
from streamtune.feedback import send_config  # noqa: E402
from streamtune.stack import StackConfig  # noqa: E402
from streamtune.stack.flink import cancel_job, submit_detached  # noqa: E402
from streamtune.testing import job_args, job_topics, spec, wait_for_records  # noqa: E402

SQL_RUNS = 3  # SQL's figure: the median of this many jobs over the same backlog
GOAL_RATIO = 0.5  # the project's goal: the job ingests at least half as fast as Flink SQL
MICRO_BATCH_MS = 1000  # the micro-batch arms' --micro-batch-ms (the window micro-batches': WINDOW_MS)
UNKNOWN_MODEL_GRACE_S = 900  # longer than any arm: a sample never waits that long for its config
WINDOW_MS = 60_000  # sql/samples_per_model.sql's TUMBLE; the job's spec gets the same
T0 = 1_770_000_000_000 // WINDOW_MS * WINDOW_MS
BAD_RECORD = "{not json"


def backlog(models: int, records: int, minutes: int, bad_every: int):
    """(model_id, value, ts) in send order; the expected counts per (model_id, window_end)."""
    span = minutes * WINDOW_MS
    rows, expected = [], Counter()
    for i in range(records):
        model, ts = f"m{i % models}", T0 + i * span // records
        if bad_every and i % bad_every == bad_every - 1:
            rows.append((model, BAD_RECORD, ts))
            continue
        sample = FeedbackSample(model_id=model, sample_id=f"s{i}", prompt=f"x={i % 97};y=",
                                completion=str(i % 89), label="corrected", ts=ts)
        rows.append((model, sample.to_json(), ts))
        expected[(model, (ts // WINDOW_MS + 1) * WINDOW_MS)] += 1
    closing = T0 + span + 2 * WINDOW_MS  # past the last window: the watermark closes it
    rows += [(f"m{m}", FeedbackSample(model_id=f"m{m}", sample_id=f"end{m}", prompt="x=0;y=", completion="0",
                                      label="corrected", ts=closing).to_json(), closing) for m in range(models)]
    return rows, expected


def send(bootstrap: str, topic: str, rows) -> None:
    p = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20, batch_size=256 * 1024)
    for key, value, ts in rows:
        p.send(topic, key=key.encode(), value=value.encode(), timestamp_ms=ts)
    p.flush()
    p.close()


def collect(bootstrap: str, topic: str, parse, total: int, timeout: float, what: str,
            budget: float | None = None) -> list[dict]:
    """Rows of `topic` until their samples add up to `total`, or until `budget` seconds after
    the first row; progress every 15 s."""
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             enable_auto_commit=False, isolation_level="read_committed")
    rows, counted, first = [], 0, None
    deadline, report = time.monotonic() + timeout, time.monotonic() + 15
    try:
        while counted < total and (first is None or budget is None or time.monotonic() - first < budget):
            if time.monotonic() > deadline:
                raise SystemExit(f"{what}: {counted} of {total} samples counted after {timeout:.0f} s")
            for records in consumer.poll(timeout_ms=500).values():
                for r in records:
                    rows.append(parse(r.value))
                    counted += rows[-1]["samples"]
                    first = first or time.monotonic()
            if time.monotonic() > report:
                print(f"  {what}: {counted} / {total} samples counted", flush=True)
                report += 15
    finally:
        consumer.close()
    return rows


def iso_ms(text: str) -> int:
    """Flink's ISO-8601 JSON timestamps: TIMESTAMP(3) without a zone (UTC here), LTZ with Z."""
    t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return int((t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp() * 1000)


def parse_sql_row(value: bytes) -> dict:
    row = json.loads(value)
    return {"model_id": row["model_id"], "window_end": iso_ms(row["window_end"]), "samples": row["samples"],
            "emitted_ms": iso_ms(row["emitted_at"])}


def steady_rate(rows: list[dict]) -> dict:
    """Samples of the windows output after the first output ÷ the time from it to the last.

    Windows close in bursts, one per watermark (SQL closes dozens at once): those output
    with the first are left out, since their samples were read before the clock started."""
    closed: dict[int, int] = {}
    samples: Counter = Counter()
    for r in rows:
        closed[r["window_end"]] = max(closed.get(r["window_end"], 0), r["emitted_ms"])
        samples[r["window_end"]] += r["samples"]
    ends = sorted(closed)
    first = min(closed.values())
    later = [e for e in ends if closed[e] > first]
    if len(ends) < 3 or not later:
        raise SystemExit("fewer than 3 windows, or all output at once: raise --minutes or --records")
    seconds = (max(closed.values()) - first) / 1000
    counted = sum(samples[e] for e in later)
    return {"records_per_s": round(counted / seconds, 1), "samples": counted, "seconds": round(seconds, 2),
            "windows": len(ends), "timed_windows": len(later)}


def per_window(rows: list[dict]) -> Counter:
    c: Counter = Counter()
    for r in rows:
        c[(r["model_id"], r["window_end"])] += r["samples"]
    return c


def run_job(config: StackConfig, topics: dict, counts_topic: str, rows: list, total: int, models: int,
            timeout: float, bundle_ms: int | None, budget: float,
            bad_ts: list[int], micro_batch_ms: int = 0, floor: bool = False) -> tuple[list, str, Counter, int]:
    """Send the backlog, start the job on it, read its counts for `budget` seconds of output (or
    the whole backlog); then (up to 60 s) its committed dead letters, by reason, and how many it
    owes: the records not JSON (stamped `bad_ts`) before the last closed window."""
    job_name = f"streamtune-bench-{topics['feedback'].split('.')[1]}"  # unique: its metrics are looked up by name
    args = job_args(topics, "/no-base-model", tempfile.mkdtemp(prefix="streamtune-ingest-"), "--parallelism", "1",
                    "--no-register", "--counts-topic", counts_topic, "--checkpoint-interval-ms", "2000",
                    # The local broker can serve the config topic after much of a backlog (below):
                    # samples wait for their config rather than go to the DLQ as unknown_model.
                    "--unknown-model-grace-seconds", str(UNKNOWN_MODEL_GRACE_S),
                    "--job-name", job_name, *(["--bundle-time-ms", str(bundle_ms)] if bundle_ms else []),
                    "--micro-batch-ms", str(micro_batch_ms), *(["--floor-window-ms", str(WINDOW_MS)] if floor else []))
    send(config.kafka_bootstrap, topics["feedback"], rows)
    job_id = submit_detached(config, REPO / "bench" / "ingest_job.py", args)
    print(f"job {job_id} (bench/ingest_job.py, bundles {bundle_ms or 'the job default'} ms, micro-batches "
          f"{micro_batch_ms or 'off'}{', FloorCounts' if floor else ''}) on the cluster",
          flush=True)
    try:
        rows_out = collect(config.kafka_bootstrap, counts_topic, json.loads, total, timeout, "job", budget)
        owed = sum(ts < max(r["window_end"] for r in rows_out) for ts in bad_ts)
        reasons = Counter(d.reason for d in wait_for_records(config.kafka_bootstrap, topics["dlq"], DeadLetter,
                                                             owed, 60))
        return rows_out, job_id, reasons, owed
    finally:
        cancel_job(config, job_id)


def run_sql(config: StackConfig, topics: dict, counts_topic: str, rows: list | None, total: int,
            timeout: float) -> tuple[list, str]:
    """The backlog first (None: it is there already), then the query: SQL needs no config."""
    from streamtune.sqlclient.runner import new_table_env, read_sql, run_statements

    if rows is not None:
        send(config.kafka_bootstrap, topics["feedback"], rows)

    t_env = new_table_env(cluster=True, udfs=False)
    variables = {"bootstrap": config.kafka_bootstrap, "feedback_topic": topics["feedback"],
                 "startup_mode": "earliest-offset", "lateness_seconds": "0"}
    run_statements(read_sql(REPO / "sql" / "ddl.sql"), variables, t_env, udfs=False)
    query = re.sub(r"--[^\n]*", "", read_sql(REPO / "sql" / "samples_per_model.sql")).strip().rstrip(";")
    t_env.execute_sql(f"""
        CREATE TEMPORARY TABLE ingest_counts (
          model_id STRING, window_end TIMESTAMP(3), samples BIGINT, emitted_at TIMESTAMP_LTZ(3)
        ) WITH ('connector' = 'kafka', 'topic' = '{counts_topic}',
                'properties.bootstrap.servers' = '{config.kafka_bootstrap}',
                'format' = 'json', 'json.timestamp-format.standard' = 'ISO-8601')""")
    result = t_env.execute_sql(
        f"INSERT INTO ingest_counts SELECT model_id, window_end, samples, CURRENT_ROW_TIMESTAMP() FROM ({query})")
    job_id = str(result.get_job_client().get_job_id())
    print(f"job {job_id} (sql/samples_per_model.sql) on the cluster", flush=True)
    try:
        return collect(config.kafka_bootstrap, counts_topic, parse_sql_row, total, timeout, "sql"), job_id
    finally:
        cancel_job(config, job_id)


def check_counts(arm: str, rows: list[dict], expected: Counter) -> None:
    """Every window up to the last one every model closed holds exactly what was sent (a job
    arm may stop before the backlog ends; a model's windows come in order, but one model may
    close a later window before another closes an earlier one)."""
    got, closed = per_window(rows), {}
    for r in rows:
        closed[r["model_id"]] = max(closed.get(r["model_id"], 0), r["window_end"])
    if silent := {m for m, _ in expected} - set(closed):
        raise SystemExit(f"{arm}: no window of {sorted(silent)[:5]} closed")
    last = min(closed.values())
    got = Counter({k: n for k, n in got.items() if k[1] <= last})
    wanted = Counter({k: n for k, n in expected.items() if k[1] <= last})
    if got != wanted:
        wrong = sorted(k for k in set(got) | set(wanted) if got[k] != wanted[k])[:5]
        raise SystemExit(f"{arm}: counts differ from what was sent, e.g. {[(k, got[k], wanted[k]) for k in wrong]}")


# (arm, Python bundle ms: 0 the job's default, None SQL, micro-batch ms: 0 off, FloorCounts for the windowing)
ARMS = (("job", 0, 0, False), ("job, 1 s bundles", 1000, 0, False), ("job, micro-batches", 0, MICRO_BATCH_MS, False),
        ("job, micro-batches, 1 s bundles", 1000, MICRO_BATCH_MS, False),
        ("job, window micro-batches", 0, WINDOW_MS, False),
        ("job, window micro-batches, 1 s bundles", 1000, WINDOW_MS, False),
        ("floor, window micro-batches", 0, WINDOW_MS, True), ("sql", None, 0, False))
# --ceiling: the floor beside the trainer's fastest arm and SQL, in one run (the floor is not in the default set)
CEILING_ARMS = ["job, window micro-batches", "floor, window micro-batches", "sql"]


def main(records: int, models: int, minutes: int, bad_every: int, job_seconds: float, timeout: float,
         out: Path, only: list[str] | None = None) -> dict:
    config = StackConfig.from_env()
    u = f"{time.time_ns() % 10**9:x}"
    rows, expected = backlog(models, records, minutes, bad_every)
    bad_ts = [ts for _, value, ts in rows if value == BAD_RECORD]
    total = sum(expected.values())
    print(f"backlog: {len(rows)} records ({total} samples in {len(expected)} model windows, {len(bad_ts)} not "
          "JSON), sent to each arm's own feedback topic", flush=True)

    arms = {}
    chosen = [a for a in ARMS if a[0] in only] if only else [a for a in ARMS if not a[3]]
    for n, (arm, bundle_ms, micro_batch_ms, floor) in enumerate(chosen):
        topics = job_topics(config.kafka_bootstrap, f"bench.ingest-{u}-{n}")
        counts_topic = f"bench.ingest-{u}-{n}.counts"
        create_topic(config.kafka_bootstrap, counts_topic)
        if bundle_ms is None:
            # SQL reads the backlog in under a second, where one GC or JIT pause moves its
            # rate by half: the median of SQL_RUNS jobs over the same topic.
            runs = []
            for k in range(SQL_RUNS):
                create_topic(config.kafka_bootstrap, f"{counts_topic}-{k}")
                out_rows, job_id = run_sql(config, topics, f"{counts_topic}-{k}", rows if k == 0 else None,
                                           total, timeout)
                check_counts(arm, out_rows, expected)
                rate = steady_rate(out_rows)
                runs.append((rate["records_per_s"], out_rows, job_id))
                print(f"  sql run {k + 1}: {rate['records_per_s']:.0f} records/s ({rate['samples']} samples of "
                      f"{rate['timed_windows']} windows in {rate['seconds']} s)", flush=True)
            _, out_rows, job_id = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
            extra = {"runs_records_per_s": [r[0] for r in runs]}
        else:
            for m in range(models):
                send_config(config.kafka_bootstrap, topics["configs"],
                            spec(f"m{m}", topics, min_samples=1, window_seconds=WINDOW_MS // 1000), T0 - 1)
            out_rows, job_id, reasons, owed = run_job(config, topics, counts_topic, rows, total, models, timeout,
                                                      bundle_ms or None, job_seconds, bad_ts, micro_batch_ms, floor)
            if set(reasons) - {"bad_json"}:
                raise SystemExit(f"{arm}: dead letters {dict(reasons)}; only bad_json expected")
            if sum(reasons.values()) < owed:
                # Not a throughput question, so the run goes on; docs/benchmarks.md, "Ingest", has the case.
                print(f"  WARNING {arm}: {sum(reasons.values())} dead letters visible (read_committed) within "
                      f"60 s; {owed} records before the last closed window were not JSON", flush=True)
            extra = {"bundle_ms": bundle_ms or int(LATENCY_SETTINGS["python.fn-execution.bundle.time"]),
                     "micro_batch_ms": micro_batch_ms, "floor": floor,
                     "dead_lettered": sum(reasons.values()), "bad_read": owed}
        check_counts(arm, out_rows, expected)
        arms[arm] = {"job_id": job_id, **steady_rate(out_rows), **extra}
        print(f"  {arm}: {arms[arm]['records_per_s']:.0f} records/s ({arms[arm]['samples']} samples of "
              f"{arms[arm]['timed_windows']} windows in {arms[arm]['seconds']} s); counts match what was sent",
              flush=True)

    sql = arms["sql"]["records_per_s"] if "sql" in arms else None
    ratios = {arm: round(a["records_per_s"] / sql, 4) for arm, a in arms.items() if arm != "sql" and sql}
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} ({platform.machine()})",
              "records": records, "models": models, "minutes": minutes, "bad_records": len(bad_ts),
              "parallelism": 1, "arms": arms, "ratio_over_sql": ratios, "goal_ratio": GOAL_RATIO}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\ningest at parallelism 1, {models} models, records/s while windows close "
          f"(goal, the project's: >= {GOAL_RATIO} of SQL):")
    for arm, a in arms.items():
        ratio = (f"{ratios[arm]:.4f} of SQL: the most any Python windowing reaches behind this front"
                 if a.get("floor") else f"{ratios[arm]:.4f} of SQL: goal >= {GOAL_RATIO} "
                 f"{'met' if ratios[arm] >= GOAL_RATIO else 'NOT met'}") if arm in ratios else (
            f"median of {', '.join(f'{r:.0f}' for r in a['runs_records_per_s'])}" if "runs_records_per_s" in a else "")
        print(f"  {arm:<40} {a['records_per_s']:>10.0f}   {ratio}")
    print("  every window's count matches what was sent; dead letters: "
          + ", ".join(f"{arm} {a['dead_lettered']} of {a['bad_read']}" for arm, a in arms.items() if "bad_read" in a)
          + "\n"
          f"results: {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=300_000)
    p.add_argument("--models", type=int, default=10)
    p.add_argument("--minutes", type=int, default=180, help="event-time span, in one-minute windows")
    p.add_argument("--bad-every", type=int, default=100, help="one record in this many is not JSON (0: none)")
    p.add_argument("--job-seconds", type=float, default=60,
                   help="a job arm stops after this long of output (SQL reads the whole backlog)")
    p.add_argument("--timeout", type=float, default=600, help="seconds each arm may take")
    p.add_argument("--arm", action="append", choices=[arm for arm, *_ in ARMS],
                   help="run only this arm (repeatable; sql is needed for the ratios)")
    p.add_argument("--ceiling", action="store_true",
                   help=f"run the arms {', '.join(CEILING_ARMS)}: the ceiling of windowing in Python")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ingest.json")
    a = p.parse_args()
    main(a.records, a.models, a.minutes, a.bad_every, a.job_seconds, a.timeout, a.out,
         CEILING_ARMS + (a.arm or []) if a.ceiling else a.arm)
