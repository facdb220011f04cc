"""Submit → first version: `flink run` of the training job until its first version is committed.

A window of samples (and one sample past it, to close it) waits in a fresh feedback topic;
the clock starts when `flink run -d -py jobs/stream_finetune.py` starts on the stack's cluster
and stops when a `read_committed` reader sees the first version. It holds the client's JVM,
the job's graph, the Python workers, the base model's load, one LoRA step and one checkpoint
(the cluster's interval, or --checkpoint-ms). Repeated --runs times.

Each run is split where the time goes, from the JobManager's and the trainer subtask's state
timestamps (Flink REST) and the trainer's own gauges (`opened_at_ms`, `last_version_at_ms`,
wall clock; every process runs on this machine):

    client       the start of `flink run` → the JobManager has the job (client JVM, the Python
                 program building the graph, the upload)
    deploy       → the trainer's subtask starts initializing (scheduling, slots, deployment)
    start        → the trainer's open() is done (its Python worker, imports, the base model's load)
    first step   → the first version leaves the trainer (reading the backlog, the window, the step)
    commit       → a read_committed reader sees it (the checkpoint and the transaction's commit)

Goal (the project's): p50 <= 10 s, worst <= 15 s, over at least 5 runs, the first on the
stack as it is (cold when the stack was just started). --busy N runs N busy-looping processes
beside the stack throughout (a loaded machine); --idle-timeout-ms sets the job's option.
The job's Python workers are forked warm by the stack's server (streamtune/stack/python_workers.py);
--compare-cold interleaves, after each run, one whose workers start as fresh interpreters
(`-Dpython.executable=` the real one), so the two compare within one run of the benchmark.

    .venv/bin/python bench/submit.py [--runs 5] [--checkpoint-ms 2000] [--busy 0] [--idle-timeout-ms MS] [--compare-cold]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from streamtune.feedback import digit_samples, send_config, send_samples  # noqa: E402
from streamtune.stack import StackConfig  # noqa: E402
from streamtune.stack.flink import cancel_job, submit_detached  # noqa: E402
from streamtune.testing import committed_reader, job_args, job_topics, spec  # noqa: E402
from streamtune.tinymodel import build_tiny_llama, digit_pairs  # noqa: E402

T0 = 1_770_000_000_000


PHASES = ("client", "deploy", "start", "first step", "commit")


def one_run(config: StackConfig, base: Path, checkpoint_ms: int, extra: list[str], cold: bool = False) -> dict:
    """One submit on a fresh set of topics: the total and its phases, in seconds. `cold`: the
    job's Python workers start as fresh interpreters (python.executable the real one) instead of
    being forked warm by the stack's server."""
    u = f"{time.time_ns() % 10**9:x}"
    topics = job_topics(config.kafka_bootstrap, f"bench.submit-{u}")
    model_id = f"submit-{u}"
    send_config(config.kafka_bootstrap, topics["configs"], spec(model_id, topics, min_samples=8, window_seconds=2), T0)
    pairs = digit_pairs(9, seed=2)
    send_samples(config.kafka_bootstrap, topics["feedback"],
                 digit_samples(model_id, pairs[:8], T0, 100) + digit_samples(model_id, pairs[8:], T0 + 2000, 1,
                                                                             id_prefix="closer"))
    reader = committed_reader(config.kafka_bootstrap, topics["versions"])
    tmp = Path(tempfile.mkdtemp(prefix="bench-submit-"))
    started, started_wall = time.monotonic(), time.time() * 1000
    job_id = submit_detached(config, REPO / "jobs" / "stream_finetune.py", job_args(
        topics, base, tmp / "adapters", "--bootstrap-server", config.kafka_bootstrap, "--job-name", f"submit-{u}",
        "--checkpoint-interval-ms", str(checkpoint_ms), "--no-register", *extra),
        properties={"python.executable": sys.executable} if cold else None)
    try:
        while not reader.poll(timeout_ms=50):
            if time.monotonic() - started > 300:
                raise SystemExit(f"no version in 300 s (job {job_id})")
        seen_wall, total = time.time() * 1000, time.monotonic() - started
        marks, idle_closed = job_marks(config.flink_rest_url, job_id)
        marks = [started_wall, *marks, seen_wall]
        return {"total_s": round(total, 2),
                **{phase: round((b - a) / 1000, 2) for phase, a, b in zip(PHASES, marks, marks[1:])},
                "closed_by_idle_timer": idle_closed}
    finally:
        reader.close()
        cancel_job(config, job_id)


def job_marks(rest: str, job_id: str) -> list[float]:
    """Wall-clock ms: the JobManager got the job, the trainer subtask began initializing, its
    open() ended, its first version left the step; and whether the trainer's idle timer closed
    the window (the watermark had not passed it: window_seconds + --idle-close-ms later)."""
    job = requests.get(f"{rest}/jobs/{job_id}", timeout=5).json()
    trainer = next(v for v in job["vertices"] if "lora-trainer" in v["name"])
    times = requests.get(f"{rest}/jobs/{job_id}/vertices/{trainer['id']}/subtasktimes", timeout=5).json()
    initializing = min(s["timestamps"]["INITIALIZING"] for s in times["subtasks"])
    base = f"{rest}/jobs/{job_id}/vertices/{trainer['id']}/subtasks/metrics"
    for _ in range(60):  # the metric fetcher refreshes every few seconds: wait for the version's mark
        names = {m["id"].rsplit(".", 1)[-1]: m["id"] for m in requests.get(base, timeout=5).json()}
        wanted = [names.get("opened_at_ms"), names.get("last_version_at_ms"), names.get("windows_closed_idle")]
        values = {m["id"].rsplit(".", 1)[-1]: m["max"] for m in requests.get(
            base, params={"get": ",".join(filter(None, wanted)), "agg": "max"}, timeout=5).json()} \
            if all(wanted[:2]) else {}
        if values.get("last_version_at_ms", 0) > 0:
            return [job["timestamps"]["INITIALIZING"], initializing, values["opened_at_ms"],
                    values["last_version_at_ms"]], values.get("windows_closed_idle", 0) > 0
        time.sleep(0.5)
    raise SystemExit(f"job {job_id}: the trainer never reported its version's time")


def summary(runs: list[dict]) -> dict:
    seconds = [r["total_s"] for r in runs]
    return {"seconds": seconds, "p50_s": round(statistics.median(seconds), 2), "max_s": round(max(seconds), 2),
            "phases_p50_s": {p: round(statistics.median(r[p] for r in runs), 2) for p in PHASES},
            "per_run": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--checkpoint-ms", type=int, default=2000)
    parser.add_argument("--busy", type=int, default=0, help="busy-looping processes beside the stack")
    parser.add_argument("--idle-timeout-ms", type=int, help="the job's --idle-timeout-ms (default: the job's)")
    parser.add_argument("--compare-cold", action="store_true",
                        help="after each run, one whose Python workers start cold (a fresh interpreter)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "submit.json")
    args = parser.parse_args()
    config = StackConfig.from_env()
    base = build_tiny_llama(config.data_dir / "models" / "tiny-llama")
    extra = ["--idle-timeout-ms", str(args.idle_timeout_ms)] if args.idle_timeout_ms else []
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    runs, cold_runs = [], []
    try:
        for i in range(args.runs):
            for cold in (False, True) if args.compare_cold else (False,):
                r = one_run(config, base, args.checkpoint_ms, extra, cold)
                (cold_runs if cold else runs).append(r)
                print(f"  run {i + 1}{' (cold workers)' if cold else ''}: {r['total_s']:.1f} s  (" + ", ".join(
                    f"{p} {r[p]:.1f}" for p in PHASES) + (", closed by the idle timer" if r[
                        "closed_by_idle_timer"] else "") + ")", flush=True)
    finally:
        for p in busy:
            p.kill()
    result = {"date": time.strftime("%Y-%m-%d"), "runs": args.runs, "checkpoint_ms": args.checkpoint_ms,
              "busy_processes": args.busy, "idle_timeout_ms": args.idle_timeout_ms, **summary(runs)}
    if cold_runs:
        result["cold_workers"] = summary(cold_runs)
        result["p50_over_cold"] = round(result["p50_s"] / result["cold_workers"]["p50_s"], 3)
    print(f"submit → first committed version over {args.runs} runs ({args.checkpoint_ms} ms checkpoints"
          + (f", {args.busy} busy processes beside" if args.busy else "") + ")")
    print("| phase | p50 s | max s |\n|---|---|---|")
    for p in PHASES:
        print(f"| {p} | {result['phases_p50_s'][p]} | {max(r[p] for r in runs)} |")
    print(f"| total | {result['p50_s']} | {result['max_s']} |")
    if cold_runs:
        cold = result["cold_workers"]
        print(f"cold Python workers (interleaved, same stack): p50 {cold['p50_s']} s, max {cold['max_s']} s; "
              f"start phase p50 {cold['phases_p50_s']['start']} s against {result['phases_p50_s']['start']} s "
              f"warm; p50 warm / cold {result['p50_over_cold']}")
    print(f"goal: p50 <= 10 s: measured {result['p50_s']} s: {'met' if result['p50_s'] <= 10 else 'NOT met'}; "
          f"worst <= 15 s: measured {result['max_s']} s: {'met' if result['max_s'] <= 15 else 'NOT met'}"
          + ("" if args.runs >= 5 else f" (only {args.runs} runs: the goal needs at least 5)"))
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
