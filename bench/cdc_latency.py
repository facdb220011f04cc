"""CDC latency: database commit → sample visible in the job, PostgreSQL and MongoDB.

`streamtune cdc` captures a table and a collection; a mini-cluster job runs the CDC job's
own front (Kafka source table, validation, per-row dedup and mapping: jobs/cdc_retrain.py,
with its Flink settings) and stamps the wall clock when each change comes out of the
mapping as a sample. The driver commits one row (or inserts one document) at a time and
notes when the commit returned. Same machine, same clock. Prints p50 / p95 per source, the
capture's share (commit → Kafka record timestamp) and p50 against the goal (50 ms).

The front runs twice in one run: with the job's Python worker processes (what
jobs/cdc_retrain.py runs with) and with `python.execution-mode: thread` (Python inside the
TaskManager), and the ratio of the two p50s is printed.

    .venv/bin/python bench/cdc_latency.py [--changes 200] [--gap-ms 20] [--modes process,thread]

Start from a fresh stack (`streamtune stack down && streamtune stack up`): the local broker
(Tansu, memory storage) slows down as topics pile up, and then its acknowledgements, not the
job, dominate the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GOAL_MS = 50.0
RESULTS = REPO / "bench" / "results"


def run_job(args) -> None:
    """The measured job: cdc_retrain's front, then a stamp per sample into a file."""
    from pyflink.common import Configuration, Types
    from pyflink.datastream import MapFunction, StreamExecutionEnvironment
    from pyflink.table import StreamTableEnvironment

    from connectors.flink_kafka import input_table_ddl
    from core.messages import FeedbackSample
    from jobs.cdc_retrain import CDC_CONSUMER_PROPERTIES, CDC_JOB_SETTINGS
    from operators.cdc_mapping import CdcMapping
    from operators.row_changes import RowChangeFunction
    from operators.validate import CHANGE_TAG, VALID_TYPE, ValidateFunction

    class Stamp(MapFunction):
        def __init__(self, out: str):
            self.out = out

        def open(self, runtime_context):
            self.file = open(self.out, "a", buffering=1)

        def map(self, value):
            sample = FeedbackSample.from_json(value[2])
            self.file.write(f"{sample.prompt} {time.time() * 1000:.3f} {value[6]}\n")
            return value[1]

    conf = Configuration()
    for k, v in CDC_JOB_SETTINGS.items():
        conf.set_string(k, v)
    conf.set_string("python.execution-mode", args.mode)
    env = StreamExecutionEnvironment.get_execution_environment(conf)
    env.set_parallelism(1)
    t_env = StreamTableEnvironment.create(env)
    mapping = CdcMapping.load(args.mapping)
    t_env.execute_sql(input_table_ddl("cdc_input", args.topics, args.bootstrap, f"bench-{time.time_ns()}", 0, 2000,
                                      CDC_CONSUMER_PROPERTIES))
    rows = t_env.to_data_stream(t_env.from_path("cdc_input"))
    validated = rows.process(ValidateFunction(mapping.sources, "none", 65536, change_topics=frozenset(args.topics)),
                             output_type=VALID_TYPE)
    (validated.get_side_output(CHANGE_TAG).key_by(lambda c: c[0], key_type=Types.STRING())
     .process(RowChangeFunction(mapping), output_type=VALID_TYPE)
     .map(Stamp(args.out), output_type=Types.STRING()).print())
    env.execute("cdc-latency")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--changes", type=int, default=200)
    p.add_argument("--gap-ms", type=float, default=20)
    p.add_argument("--modes", default="process,thread")
    p.add_argument("--run-job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--topics", nargs="*", help=argparse.SUPPRESS)
    p.add_argument("--bootstrap", help=argparse.SUPPRESS)
    p.add_argument("--mapping", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run_job:
        run_job(args)
        return

    p50s = {}
    for mode in args.modes.split(","):
        print(f"python.execution-mode: {mode}" + (" (jobs/cdc_retrain.py)" if mode == "process" else ""))
        sources = measure(args, mode)
        p50s[mode] = statistics.median(s["p50_ms"] for s in sources.values())
        if mode == "process":  # the job's own mode: bench/report.py's row
            RESULTS.mkdir(exist_ok=True)
            (RESULTS / "cdc_latency.json").write_text(json.dumps(
                {"date": time.strftime("%Y-%m-%d"), "changes": args.changes, "goal_p50_ms": GOAL_MS,
                 "sources": sources}, indent=2))
    if {"process", "thread"} <= set(p50s):
        print(f"p50 process / thread: {p50s['process'] / p50s['thread']:.2f}")


def measure(args, mode: str) -> dict:
    import psycopg
    import pymongo

    from streamtune.testing import CaptureProcess
    from connectors.kafka import create_topic
    from streamtune.local_job import kill_group, spawn_logged
    from streamtune.stack import StackConfig

    stack = StackConfig.from_env()
    boot, u = stack.kafka_bootstrap, f"{time.time_ns() % 10**9:x}"
    table, db = f"bench_{u}", f"bench_{u}"
    tmp = Path(tempfile.mkdtemp(prefix="cdc-latency-"))
    topics = {"pg": f"bench.cdc-{u}.pg", "mongo": f"bench.cdc-{u}.mongo"}
    for t in topics.values():
        create_topic(boot, t)
    mapping = {"mappings": [
        {"table": table, "model_id": {"value": "bench"}, "prompt": "q", "completion": "a"},
        {"collection": f"{db}.docs", "model_id": {"value": "bench"}, "prompt": "q", "completion": "a"}]}
    (tmp / "mapping.json").write_text(json.dumps(mapping))
    pg = psycopg.connect(stack.postgres_dsn, autocommit=True)
    pg.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, q text, a text)")
    mongo = pymongo.MongoClient(stack.mongo_uri)
    captures = [
        CaptureProcess(f"{stack.postgres_dsn}?table={table}", f"bench-pg-{u}", topics["pg"], tmp / "pg.log", boot,
                       f"bench.cdc-{u}.offsets", "--linger-ms", "1").start(),
        CaptureProcess(f"{stack.mongo_uri}&db={db}&collection=docs", f"bench-mongo-{u}", topics["mongo"],
                       tmp / "mongo.log", boot, f"bench.cdc-{u}.offsets", "--linger-ms", "1").start()]
    out = tmp / "arrivals.txt"
    out.touch()
    job = spawn_logged([sys.executable, __file__, "--run-job", "--topics", *topics.values(), "--bootstrap", boot,
                        "--mapping", str(tmp / "mapping.json"), "--out", str(out), "--mode", mode], tmp / "job.log",
                       # a mini-cluster would otherwise run "process" functions as client threads
                       extra_env={"_python_worker_execution_mode": "process"} if mode == "process" else None)
    committed: dict[str, float] = {}
    try:
        captures[0].wait_for_log("created replication slot")
        captures[1].wait_for_log("capturing")

        def arrivals() -> dict[str, tuple[float, float]]:
            lines = [line.split() for line in out.read_text().splitlines() if line.strip()]
            return {prompt: (float(at), float(kafka_ts)) for prompt, at, kafka_ts in lines}

        # Warm-up: until a change makes it through (job start-up, first fetches).
        deadline, i = time.monotonic() + 120, 0
        while not arrivals():
            assert job.poll() is None, (tmp / "job.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no change reached the job in 120 s"
            i += 1
            pg.execute(f"INSERT INTO {table} VALUES (%s, %s, 'w')", (-i, f"warm{i}"))
            time.sleep(0.5)
        time.sleep(2)
        for n in range(args.changes):
            pg.execute(f"INSERT INTO {table} VALUES (%s, %s, 'a')", (n, f"pg{n}"))
            committed[f"pg{n}"] = time.time() * 1000
            time.sleep(args.gap_ms / 1000)
            mongo[db].docs.insert_one({"_id": n, "q": f"mongo{n}", "a": "a"})
            committed[f"mongo{n}"] = time.time() * 1000
            time.sleep(args.gap_ms / 1000)
        deadline = time.monotonic() + 60
        while len([k for k in arrivals() if k in committed]) < len(committed) and time.monotonic() < deadline:
            time.sleep(0.5)
        seen = arrivals()
    finally:
        kill_group(job)  # the job's JVM and Python workers too
        for c in captures:
            c.kill()
        pg.execute(f"SELECT pg_drop_replication_slot('streamtune_bench_pg_{u}')")

    print(f"  commit → sample visible in the job ({args.changes} changes per source, one per commit, "
          f"{args.gap_ms:g} ms apart)")
    sources = {}
    for source in ("pg", "mongo"):
        keys = [k for k in committed if k.startswith(source)]
        lost = [k for k in keys if k not in seen]
        total = sorted(seen[k][0] - committed[k] for k in keys if k in seen)
        capture = sorted(seen[k][1] - committed[k] for k in keys if k in seen)
        p50, p95 = statistics.median(total), total[int(0.95 * (len(total) - 1))]
        print(f"  {source:5s}  p50 {p50:6.1f} ms  p95 {p95:6.1f} ms  (commit → Kafka record p50 "
              f"{statistics.median(capture):5.1f} ms)  p50/goal {p50 / GOAL_MS:.2f}  missing {len(lost)}")
        sources["postgres" if source == "pg" else "mongo"] = {"p50_ms": round(p50, 1), "p95_ms": round(p95, 1),
                                                              "missing": len(lost)}
    return sources


if __name__ == "__main__":
    main()
