"""Freshness end to end, stage by stage: a window closes → its version is committed →
registered in MLflow → broadcast → the first response served by it.

A live stream (event time = wall clock, 1 s windows of 8 samples) runs through
jobs/stream_finetune.py submitted to the stack's Flink cluster with `flink run` (1 s
checkpoints; the job registers its own versions in MLflow and broadcasts them: the deployed
path, nothing else helps), and `streamtune serve` follows them. A client asks the server for
`<model>@candidate` (every new version becomes the candidate) every ~50 ms over HTTP, a
`read_committed` consumer watches the versions topic and another the broadcast topic.

For each version, every stage is timed from its window's end (the window wait is taken out:
a sample cannot be trained before its window closes):

    committed   the version record visible to read_committed readers (training + checkpoint)
    registered  MLflow's creation_timestamp of the model version
    broadcast   the broadcast record visible
    served      the first response produced by it or by a later version (each trains on from
                the one before, so it holds the window's samples too)

Windows ending in the first 30 s after the first answer are sent but not measured: the first
versions after a job starts register slowly (cold MLflow model and connections), which is
start-up, not freshness.

Goals: broadcast p95 ≤ one checkpoint interval (our goal); served p95 ≤ checkpoint interval
+ 1.5 s (our goal; Ekko reports 2.4 s model-update latency in production).

Restart the stack first (`streamtune stack down && streamtune stack up`): Tansu slows down as
topics pile up.

    .venv/bin/python bench/freshness.py [--windows 260] [--checkpoint-ms 1000]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import requests  # noqa: E402
from kafka import KafkaConsumer  # noqa: E402

from core.messages import AdapterVersionBroadcast, FeedbackSample, VersionRecord  # noqa: E402
from streamtune.demo import DemoServer, quiet_libraries  # noqa: E402
from streamtune.feedback import producer, send_config  # noqa: E402
from streamtune.local_job import kill_group  # noqa: E402
from streamtune.stack import StackConfig  # noqa: E402
from streamtune.stack.flink import cancel_job, job_state, submit_detached  # noqa: E402
from streamtune.testing import job_args, job_topics, spec  # noqa: E402
from streamtune.tinymodel import build_tiny_llama, digit_pairs  # noqa: E402

WINDOW_S, PER_WINDOW, WARM_UP_WINDOWS = 1, 8, 3
# Start-up is not freshness: the first versions after a job starts register slowly (a new
# MLflow model and experiment, cold connections and imports; in a clean clone's first run
# they queued for about 40 s). Windows ending in the first STEADY_AFTER_S after the first
# served version are sent but not measured.
STEADY_AFTER_S = 30
# The client's own load is not the path measured: one token every 50 ms (a request every
# 20 ms for 4 tokens took a core of this 2-core machine from the job).
ASK_EVERY_S = 0.05
STAGES = ("committed", "registered", "broadcast", "served")


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def window_end_ms(version_id: str) -> int:
    """version_id = <model>@<window end ms>#<offsets>"""
    return int(version_id.split("@")[1].split("#")[0])


class Watcher(threading.Thread):
    """Wall time each version_id first shows up on a topic (read_committed)."""

    def __init__(self, bootstrap: str, topic: str, parse, stop: threading.Event):
        super().__init__(daemon=True)
        self.seen: dict[str, float] = {}
        self.records: dict[str, object] = {}
        self.bootstrap, self.topic, self.parse, self.stop = bootstrap, topic, parse, stop

    def run(self) -> None:
        consumer = KafkaConsumer(self.topic, bootstrap_servers=self.bootstrap, isolation_level="read_committed",
                                 auto_offset_reset="earliest", enable_auto_commit=False, fetch_max_wait_ms=20)
        while not self.stop.is_set():
            for records in consumer.poll(timeout_ms=100).values():
                now = time.time()
                for r in records:
                    record = self.parse(r.value)
                    if record.version_id not in self.seen:
                        self.seen[record.version_id], self.records[record.version_id] = now, record
        consumer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=260)
    parser.add_argument("--checkpoint-ms", type=int, default=1000)
    parser.add_argument("--periodic-only", action="store_true",
                        help="--no-checkpoint-on-version: versions wait for the periodic checkpoint")
    args = parser.parse_args()
    quiet_libraries()
    config = StackConfig.from_env()
    base = build_tiny_llama(config.data_dir / "models" / "tiny-llama")
    u = f"{time.time_ns() % 10**9:x}"
    topics = job_topics(config.kafka_bootstrap, f"bench.fresh-{u}")
    model_id = f"fresh-{u}"
    send_config(config.kafka_bootstrap, topics["configs"],
                spec(model_id, topics, min_samples=1, window_seconds=WINDOW_S), int(time.time() * 1000))
    tmp = Path(tempfile.mkdtemp(prefix="bench-fresh-"))
    server = DemoServer(config, base, topics["adapter-versions"], tmp / "serve.log", tmp / "adapters",
                        ("--no-inference-log",))
    url = server.url
    stop = threading.Event()
    committed = Watcher(config.kafka_bootstrap, topics["versions"], VersionRecord.from_json, stop)
    broadcast = Watcher(config.kafka_bootstrap, topics["adapter-versions"], AdapterVersionBroadcast.from_json, stop)
    served: dict[str, float] = {}  # version_id -> wall time of its first response
    measured_from = [float("inf")]  # windows ending STEADY_AFTER_S after the first served version

    def ask() -> None:
        session = requests.Session()
        session.headers.update(server.headers)  # the inference token, where the environment holds one
        while not stop.is_set():
            try:
                r = session.post(f"{url}/v1/completions", timeout=10,
                                 json={"model": f"{model_id}@candidate", "prompt": "x=1234;y=", "max_tokens": 1})
            except requests.RequestException:
                time.sleep(0.2)
                continue
            now = time.time()
            if r.status_code == 200:
                served.setdefault(r.json()["streamtune"]["audit_trace"][1]["version_id"], now)
            time.sleep(ASK_EVERY_S)

    asker = threading.Thread(target=ask, daemon=True)
    job_id = None
    try:
        server.wait_ready(120)
        job_id = submit_detached(config, REPO / "jobs" / "stream_finetune.py", job_args(
            topics, base, tmp / "adapters", "--bootstrap-server", config.kafka_bootstrap,
            "--checkpoint-interval-ms", str(args.checkpoint_ms), "--job-name", f"fresh-{u}",
            *(("--no-checkpoint-on-version",) if args.periodic_only else ())))
        for watcher in (committed, broadcast, asker):
            watcher.start()
        pairs = digit_pairs((args.windows + WARM_UP_WINDOWS + STEADY_AFTER_S) * PER_WINDOW + 1, seed=4)
        out = producer(config.kafka_bootstrap)
        print(f"job {job_id} on the cluster; streaming {args.windows} windows of {PER_WINDOW} samples, "
              f"one window per second (after the first version is served) ...", flush=True)
        for i, (prompt, completion) in enumerate(pairs):
            if i == WARM_UP_WINDOWS * PER_WINDOW:  # start-up (Python workers, the base model) is not freshness
                deadline = time.monotonic() + 180
                while not served and time.monotonic() < deadline:
                    time.sleep(0.1)
                if not served:
                    raise SystemExit(f"no version served in 180 s (job {job_state(config, job_id)}); see {tmp}")
                measured_from[0] = time.time() + STEADY_AFTER_S
            now = int(time.time() * 1000)
            sample = FeedbackSample(model_id=model_id, sample_id=f"s{i}", prompt=prompt, completion=completion, ts=now)
            # Not flushed one by one: a slow acknowledgement would hold the next sample, and the
            # window closes only when a later sample moves the watermark past its end.
            out.send(topics["feedback"], sample.to_json().encode(), timestamp_ms=now)
            if i % (PER_WINDOW * 30) == 0:
                print(f"  {i // PER_WINDOW} windows sent, {len(committed.seen)} committed, "
                      f"{len(broadcast.seen)} broadcast, {len(served)} served", flush=True)
            time.sleep(WINDOW_S / PER_WINDOW)
        out.flush()
        deadline = time.monotonic() + 30
        while len(broadcast.seen) < len(committed.seen) and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(1)  # the last broadcast's first answer
    finally:
        stop.set()
        if job_id:
            cancel_job(config, job_id)
        kill_group(server.proc)

    measured = [v for v in broadcast.seen if window_end_ms(v) / 1000 > measured_from[0] and v in committed.seen]
    if len(measured) < 3:
        raise SystemExit(f"only {len(measured)} versions broadcast; see {tmp}")
    # A version trains on from the one before (one adapter, one spec), so a window's samples
    # are first served by the first answer from that version or any later one: a version
    # overtaken before a request reached it still gets its point.
    first_answer, later = {}, float("inf")
    for v in sorted(committed.seen, key=lambda v: committed.records[v].seq, reverse=True):
        later = min(later, served.get(v, float("inf")))
        first_answer[v] = later if later < float("inf") else None
    at = {v: {"committed": committed.seen[v], "registered": broadcast.records[v].registered_at / 1000,
              "broadcast": broadcast.seen[v], "served": first_answer[v]} for v in measured}
    goals = {"broadcast": args.checkpoint_ms / 1000, "served": args.checkpoint_ms / 1000 + 1.5}
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} ({platform.machine()})",
              "checkpoint_ms": args.checkpoint_ms, "window_s": WINDOW_S, "versions": len(measured),
              "checkpoints": "periodic only" if args.periodic_only else "periodic and on each version",
              "answered_before_replaced": sum(1 for v in measured if v in served), "stages": {}}
    print(f"\n{len(measured)} versions broadcast, {result['answered_before_replaced']} of them answered a request "
          f"before a newer one replaced them; seconds after the window's end:")
    print(f"{'stage':<12}{'n':>5}{'p50':>8}{'p95':>8}{'p99':>8}   goal")
    for stage in STAGES:
        values = sorted(at[v][stage] - window_end_ms(v) / 1000 for v in measured if at[v][stage] is not None)
        row = {"n": len(values), "p50_s": round(statistics.median(values), 3),
               "p95_s": round(percentile(values, 0.95), 3), "p99_s": round(percentile(values, 0.99), 3)}
        goal = ""
        if stage in goals:
            row["goal_p95_s"] = goals[stage]
            goal = f"p95 ≤ {goals[stage]:.2f} s: {'met' if row['p95_s'] <= goals[stage] else 'NOT met'}" \
                   f" (p95/goal = {row['p95_s'] / goals[stage]:.2f})" + ("" if len(values) >= 200 else
                                                                        "; fewer than 200 points")
        row["values_s"] = [round(x, 3) for x in values]  # for the plot (bench/report.py)
        result["stages"][stage] = row
        print(f"{stage:<12}{row['n']:>5}{row['p50_s']:>8.2f}{row['p95_s']:>8.2f}{row['p99_s']:>8.2f}   {goal}")
    # Where the time goes, version by version: each stage minus the one before it.
    print(f"\n{'step':<24}{'n':>5}{'p50':>8}{'p95':>8}{'p99':>8}")
    result["steps"] = {}
    for before, after in zip(STAGES, STAGES[1:]):
        values = sorted(at[v][after] - at[v][before] for v in measured if at[v][after] is not None)
        row = {"n": len(values), "p50_s": round(statistics.median(values), 3),
               "p95_s": round(percentile(values, 0.95), 3), "p99_s": round(percentile(values, 0.99), 3)}
        result["steps"][f"{before}→{after}"] = row
        print(f"{before + ' → ' + after:<24}{row['n']:>5}{row['p50_s']:>8.2f}{row['p95_s']:>8.2f}{row['p99_s']:>8.2f}")
    (REPO / "bench" / "results").mkdir(exist_ok=True)
    name = "freshness-periodic.json" if args.periodic_only else "freshness.json"
    (REPO / "bench" / "results" / name).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
