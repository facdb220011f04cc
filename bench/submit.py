"""Submit → first version: `flink run` of the training job until its first version is committed.

A window of samples (and one sample past it, to close it) waits in a fresh feedback topic;
the clock starts when `flink run -d -py jobs/stream_finetune.py` starts on the stack's cluster
and stops when a `read_committed` reader sees the first version. It holds the client's JVM,
the job's graph, the Python workers, the base model's load, one LoRA step and one checkpoint
(the cluster's interval, or --checkpoint-ms). Repeated --runs times.

    .venv/bin/python bench/submit.py [--runs 3] [--checkpoint-ms 2000]
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

from connectors.kafka import read_topic  # noqa: E402
from streamtune.feedback import digit_samples, send_config, send_samples  # noqa: E402
from streamtune.stack import StackConfig  # noqa: E402
from streamtune.stack.flink import cancel_job, submit_detached  # noqa: E402
from streamtune.testing import job_args, job_topics, spec  # noqa: E402
from streamtune.tinymodel import build_tiny_llama, digit_pairs  # noqa: E402

T0 = 1_770_000_000_000


def one_run(config: StackConfig, base: Path, checkpoint_ms: int) -> float:
    u = f"{time.time_ns() % 10**9:x}"
    topics = job_topics(config.kafka_bootstrap, f"bench.submit-{u}")
    model_id = f"submit-{u}"
    send_config(config.kafka_bootstrap, topics["configs"], spec(model_id, topics, min_samples=8, window_seconds=2), T0)
    pairs = digit_pairs(9, seed=2)
    send_samples(config.kafka_bootstrap, topics["feedback"],
                 digit_samples(model_id, pairs[:8], T0, 100) + digit_samples(model_id, pairs[8:], T0 + 2000, 1,
                                                                             id_prefix="closer"))
    tmp = Path(tempfile.mkdtemp(prefix="bench-submit-"))
    started = time.monotonic()
    job_id = submit_detached(config, REPO / "jobs" / "stream_finetune.py", job_args(
        topics, base, tmp / "adapters", "--bootstrap-server", config.kafka_bootstrap, "--job-name", f"submit-{u}",
        "--checkpoint-interval-ms", str(checkpoint_ms), "--no-register"))
    try:
        while not read_topic(config.kafka_bootstrap, topics["versions"], expect=1, timeout=5, idle=5):
            if time.monotonic() - started > 300:
                raise SystemExit(f"no version in 300 s (job {job_id})")
        return time.monotonic() - started
    finally:
        cancel_job(config, job_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--checkpoint-ms", type=int, default=2000)
    args = parser.parse_args()
    config = StackConfig.from_env()
    base = build_tiny_llama(config.data_dir / "models" / "tiny-llama")
    seconds = []
    for i in range(args.runs):
        seconds.append(one_run(config, base, args.checkpoint_ms))
        print(f"  run {i + 1}: {seconds[-1]:.1f} s", flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "runs": args.runs, "checkpoint_ms": args.checkpoint_ms,
              "seconds": [round(s, 2) for s in seconds], "p50_s": round(statistics.median(seconds), 2),
              "max_s": round(max(seconds), 2)}
    print(f"submit → first committed version: p50 {result['p50_s']:.1f} s, max {result['max_s']:.1f} s "
          f"over {args.runs} runs ({args.checkpoint_ms} ms checkpoints)")
    (REPO / "bench" / "results").mkdir(exist_ok=True)
    (REPO / "bench" / "results" / "submit.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
