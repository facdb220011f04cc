"""Freshness: time from a window's close to its version being ready in MLflow.

A live stream whose event time is the wall clock (a window of 2 s holds ~32 samples) runs
through the job on an embedded mini-cluster, which registers its versions in MLflow as their
checkpoints complete and broadcasts each (the deployed path: nothing else runs). For each
version, freshness = arrival of its broadcast − window end;
the window end is when its last sample could arrive, so the window wait is already taken
out. Prints p50 and p95 against the goal: checkpoint interval + 1 s.

    .venv/bin/python bench/freshness.py [--windows 20] [--checkpoint-ms 2000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kafka import KafkaConsumer, TopicPartition  # noqa: E402

from core.messages import AdapterVersionBroadcast, FeedbackSample  # noqa: E402
from streamtune.demo import quiet_libraries  # noqa: E402
from streamtune.feedback import producer, send_config  # noqa: E402
from streamtune.local_job import LocalJob  # noqa: E402
from streamtune.stack import StackConfig  # noqa: E402
from streamtune.testing import job_args, job_topics, spec  # noqa: E402
from streamtune.tinymodel import build_tiny_llama, digit_pairs  # noqa: E402

WINDOW_S = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=20)
    parser.add_argument("--per-window", type=int, default=32)
    parser.add_argument("--checkpoint-ms", type=int, default=2000)
    args = parser.parse_args()
    quiet_libraries()
    config = StackConfig.from_env()
    base = build_tiny_llama(config.data_dir / "models" / "tiny-llama")
    u = f"{time.time_ns() % 10**9:x}"
    topics = job_topics(config.kafka_bootstrap, f"bench.fresh-{u}")
    model_id = f"fresh-{u}"
    send_config(config.kafka_bootstrap, topics["configs"],
                spec(model_id, topics, min_samples=args.per_window // 2, window_seconds=WINDOW_S),
                int(time.time() * 1000))
    tmp = Path(tempfile.mkdtemp(prefix="bench-"))
    job = LocalJob(job_args(topics, base, tmp / "adapters", "--bootstrap", config.kafka_bootstrap,
                            "--checkpoint-interval-ms", str(args.checkpoint_ms), "--job-name", f"fresh-{u}"),
                   tmp / "chk", tmp / "job.log")
    registered: dict[str, float] = {}
    stop = threading.Event()

    def follow() -> None:  # broadcasts arrive once the version is in MLflow
        consumer = KafkaConsumer(bootstrap_servers=config.kafka_bootstrap, fetch_max_wait_ms=20)
        consumer.assign([TopicPartition(topics["adapter-versions"], 0)])
        while not stop.is_set():
            for records in consumer.poll(timeout_ms=200).values():
                for r in records:
                    registered.setdefault(AdapterVersionBroadcast.from_json(r.value).version_id, time.time())
        consumer.close()

    worker = threading.Thread(target=follow, daemon=True)
    worker.start()
    job.start()
    time.sleep(12)  # start-up; the stream starts once the job runs
    pairs = digit_pairs(args.windows * args.per_window + 1, seed=4)
    interval = WINDOW_S / args.per_window
    out = producer(config.kafka_bootstrap)
    try:
        for i, (prompt, completion) in enumerate(pairs):
            now = int(time.time() * 1000)
            sample = FeedbackSample(model_id=model_id, sample_id=f"s{i}", prompt=prompt, completion=completion, ts=now)
            out.send(topics["feedback"], sample.to_json().encode(), timestamp_ms=now)
            out.flush()
            time.sleep(interval)
        deadline = time.monotonic() + 60
        while len(registered) < args.windows - 1 and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        stop.set()
        worker.join(timeout=30)
        out.close()
        job.kill()
    # version_id = model@<window_end>#...: freshness is registration time minus window end.
    fresh = sorted(t - int(v.split("@")[1].split("#")[0]) / 1000 for v, t in registered.items())
    if len(fresh) < 3:
        raise SystemExit(f"only {len(fresh)} versions registered; see {tmp / 'job.log'}")
    p50, p95 = statistics.median(fresh), fresh[min(len(fresh) - 1, int(0.95 * len(fresh)))]
    goal = args.checkpoint_ms / 1000 + 1
    print(f"versions registered:   {len(fresh)}")
    print(f"freshness p50:         {p50:6.2f} s")
    print(f"freshness p95:         {p95:6.2f} s")
    print(f"goal (checkpoint+1 s): {goal:6.2f} s   p95/goal = {p95 / goal:.2f}")


if __name__ == "__main__":
    main()
