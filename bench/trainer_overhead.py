"""Trainer throughput: samples/s through the whole running job against a bare PEFT loop.

Same Llama built from a config, same LoRA config, same windows of samples, same thread
count (STREAMTUNE_TORCH_THREADS, 1). The bare loop is what a PEFT user would write: for each
window, forward, backward and AdamW step per micro-batch, nothing else. The job is
jobs/stream_finetune.py on an embedded mini-cluster over a backlog of windows (5 s
checkpoints). The first window starts it (its version pays for start-up: the JVM, the
Python workers, the base model's load); then the other windows are sent as one backlog, and
the job's rate is their samples over the time from that send to their last version, so it
holds everything the job does per window: Kafka in, validation, windowing, keyed state, the
losses, the artifact, the version record out and the checkpoints. Every sample must be in a
version.

Versions are written at-least-once here, so the last is visible when the job writes it
(exactly-once: at the next checkpoint, which bench/freshness.py measures). Versions come
out in bursts over a backlog: the watermark passes many windows at once, their timers fire
inside one Python bundle, and its outputs (and the checkpoint barrier) wait for the bundle
to end. The spacing between the first and the last version therefore measures nothing: it
made the job look 5.5 times faster than the bare loop on 2026-12-04 (17 of 20 versions of
`30m` visible within 10 ms), and the 0.925 of 2026-12-03 came from five such bursts.

Two shapes, so the per-window fixed cost is visible: `tiny` (64 wide, 2 layers) and `30m`
(a 34M-parameter Llama, 512 wide, 8 layers: a bare micro-batch step of 32 samples takes
well over 20 ms on one CPU thread). Goal (ours): job ÷ bare ≥ 0.9 on `30m`.

    .venv/bin/python bench/trainer_overhead.py [--shapes tiny,30m] [--windows 20] [--per-window 64]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.batching import collate, encode_example  # noqa: E402
from core.messages import VersionRecord  # noqa: E402
from streamtune.feedback import digit_samples, send_config, send_samples  # noqa: E402
from streamtune.local_job import LocalJob  # noqa: E402
from streamtune.stack import StackConfig  # noqa: E402
from streamtune.testing import job_args, job_topics, spec  # noqa: E402
from streamtune.tinymodel import build_tiny_llama, digit_pairs  # noqa: E402

T0 = 1_770_000_000_000
TRAINING = {"lr": 0.01, "micro_batch_size": 32, "epochs": 2}
SHAPES = {"tiny": {}, "30m": {"hidden_size": 512, "layers": 8, "heads": 8}}
GOAL = 0.9


def bare_peft_rate(base: Path, batches: list[list[tuple[str, str]]], rank: int) -> tuple[float, float]:
    """(samples/s, seconds per micro-batch step) of a plain PEFT loop."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(base)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
                                      task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=TRAINING["lr"])
    model.train()
    steps = 0
    started = time.perf_counter()
    for window in batches:
        examples = [encode_example(tok, p, c, 256) for p, c in window]
        for _ in range(TRAINING["epochs"]):
            for i in range(0, len(examples), TRAINING["micro_batch_size"]):
                b = collate(examples[i:i + TRAINING["micro_batch_size"]], tok.pad_token_id)
                loss = model(**b).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                steps += 1
    elapsed = time.perf_counter() - started
    return sum(len(w) for w in batches) / elapsed, elapsed / steps


def job_rate(config: StackConfig, base: Path, windows: int, per_window: int, rank: int) -> tuple[float, list[dict]]:
    """(samples/s, each version as read: seconds after the backlog was sent, samples, losses)."""
    from kafka import KafkaConsumer, TopicPartition

    from connectors.kafka import seek_to_first

    u = f"{time.time_ns() % 10**9:x}"
    topics = job_topics(config.kafka_bootstrap, f"bench.overhead-{u}")
    model_id = f"bench-{u}"
    send_config(config.kafka_bootstrap, topics["configs"],
                spec(model_id, topics, rank=rank, min_samples=per_window, window_seconds=2, training=TRAINING), T0)
    pairs = digit_pairs(windows * per_window, seed=1)
    samples = digit_samples(model_id, pairs, T0, 2000 / per_window)
    closer = digit_samples(model_id, pairs[:1], T0 + windows * 2000, 1, id_prefix="closer")
    # The first window (and the first sample of the second, which closes it) starts the job:
    # its version pays for start-up (the base model's load, the adapter's creation).
    send_samples(config.kafka_bootstrap, topics["feedback"], samples[:per_window + 1])

    written: list[tuple] = []  # (wall time the version was read, samples, loss before, loss after)
    consumer = KafkaConsumer(bootstrap_servers=config.kafka_bootstrap, fetch_max_wait_ms=20, auto_offset_reset="earliest")
    tp = TopicPartition(topics["versions"], 0)
    consumer.assign([tp])
    seek_to_first(consumer, [tp])
    tmp = Path(tempfile.mkdtemp(prefix="bench-"))
    job = LocalJob(job_args(topics, base, tmp / "adapters", "--bootstrap-server", config.kafka_bootstrap,
                            "--checkpoint-interval-ms", "5000", "--job-name", f"bench-{u}", "--no-register",
                            "--versions-delivery", "at-least-once", "--parallelism", "1"),
                   tmp / "chk", tmp / "job.log")
    job.start()
    sent_at = None
    try:
        deadline = time.monotonic() + 1200
        while len(written) < windows and time.monotonic() < deadline:
            for recs in consumer.poll(timeout_ms=100).values():
                now = time.time()
                metrics = [VersionRecord.from_json(r.value).metrics for r in recs]
                written += [(now, m.samples, m.loss_before, m.loss_after) for m in metrics]
            if written and sent_at is None:  # the job runs: the clock starts with the backlog
                sent_at = time.time()
                send_samples(config.kafka_bootstrap, topics["feedback"], samples[per_window + 1:] + closer)
    finally:
        job.kill()
        consumer.close()
    if len(written) < windows or sum(n for _, n, _, _ in written) != windows * per_window:
        raise SystemExit(f"{len(written)} versions of {windows} ({sum(n for _, n, _, _ in written)} samples of "
                         f"{windows * per_window}) after 1200 s; see {tmp}")
    return (sum(n for _, n, _, _ in written[1:]) / (written[-1][0] - sent_at),
            [{"t_s": round(t - sent_at, 3), "samples": n, "loss_before": b, "loss_after": a}
             for t, n, b, a in written])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,30m")
    parser.add_argument("--windows", type=int, default=20)
    parser.add_argument("--per-window", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    config = StackConfig.from_env()
    results = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} ({platform.machine()})",
               "windows": args.windows, "per_window": args.per_window, "rank": args.rank, "training": TRAINING,
               "shapes": {}}
    pairs = digit_pairs(args.windows * args.per_window, seed=1)
    batches = [pairs[i:i + args.per_window] for i in range(0, len(pairs), args.per_window)]
    for shape in args.shapes.split(","):
        base = build_tiny_llama(config.data_dir / "models" / f"bench-{shape}", **SHAPES[shape])
        bare, step_s = bare_peft_rate(base, batches, args.rank)
        in_job, versions = job_rate(config, base, args.windows, args.per_window, args.rank)
        results["shapes"][shape] = {"bare_samples_per_s": round(bare, 1), "bare_step_ms": round(step_s * 1000, 1),
                                    "job_samples_per_s": round(in_job, 1), "ratio": round(in_job / bare, 3),
                                    "versions": versions}
        print(f"{shape:>5}: bare PEFT loop {bare:8.1f} samples/s ({step_s * 1000:.0f} ms a micro-batch step), "
              f"whole job {in_job:8.1f} samples/s, job ÷ bare = {in_job / bare:.2f}"
              + (f"   goal ≥ {GOAL}: {'met' if in_job / bare >= GOAL else 'NOT met'}" if shape == "30m" else ""),
              flush=True)
    (REPO / "bench" / "results").mkdir(exist_ok=True)
    (REPO / "bench" / "results" / "trainer_overhead.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
