"""Trainer overhead: the LoRA operator's samples/s inside the job vs a bare PEFT loop.

Same tiny Llama, same LoRA config, same windows of samples, same thread count (1).
The job runs on an embedded mini-cluster over a backlog; its rate is the samples of all
versions over the operator's own wall time per fired window (`operator_seconds`: adapter
state in, loss before, training, loss after, state and artifact out). Prints both rates and
their ratio, measured in this one run.

    .venv/bin/python bench/trainer_overhead.py [--windows 40] [--per-window 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from streamtune.feedback import digit_samples, send_config, send_samples  # noqa: E402
from streamtune.local_job import LocalJob  # noqa: E402
from streamtune.stack import StackConfig  # noqa: E402
from streamtune.testing import job_args, job_topics, spec  # noqa: E402
from core.batching import collate, encode_example  # noqa: E402
from core.messages import VersionRecord  # noqa: E402
from streamtune.tinymodel import build_tiny_llama, digit_pairs  # noqa: E402

T0 = 1_770_000_000_000
TRAINING = {"lr": 0.01, "micro_batch_size": 32, "epochs": 2}


def bare_peft_rate(base: Path, batches: list[list[tuple[str, str]]], rank: int) -> float:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(base)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
                                      task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=TRAINING["lr"])
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
    return sum(len(w) for w in batches) / (time.perf_counter() - started)


def job_rate(config: StackConfig, base: Path, windows: int, per_window: int, rank: int) -> tuple[float, int]:
    from kafka import KafkaConsumer, TopicPartition

    u = f"{time.time_ns() % 10**9:x}"
    topics = job_topics(config.kafka_bootstrap, f"bench.overhead-{u}")
    model_id = f"bench-{u}"
    send_config(config.kafka_bootstrap, topics["configs"],
                spec(model_id, topics, rank=rank, min_samples=per_window, window_seconds=2, training=TRAINING), T0)
    pairs = digit_pairs(windows * per_window, seed=1)
    samples = digit_samples(model_id, pairs, T0, 2000 / per_window)
    closer = digit_samples(model_id, pairs[:1], T0 + windows * 2000, 1, id_prefix="closer")
    send_samples(config.kafka_bootstrap, topics["feedback"], samples + closer)

    arrivals: list[tuple[float, int]] = []
    consumer = KafkaConsumer(bootstrap_servers=config.kafka_bootstrap, isolation_level="read_uncommitted")
    tp = TopicPartition(topics["versions"], 0)
    consumer.assign([tp])
    consumer.seek_to_beginning()
    tmp = Path(tempfile.mkdtemp(prefix="bench-"))
    job = LocalJob(job_args(topics, base, tmp / "adapters", "--bootstrap", config.kafka_bootstrap,
                            "--checkpoint-interval-ms", "5000", "--job-name", f"bench-{u}"),
                   tmp / "chk", tmp / "job.log")
    job.start()
    try:
        deadline = time.monotonic() + 600
        while len(arrivals) < windows and time.monotonic() < deadline:
            for recs in consumer.poll(timeout_ms=200).values():
                for r in recs:
                    m = VersionRecord.from_json(r.value).metrics
                    arrivals.append((m.operator_seconds, m.samples))
    finally:
        job.kill()
        consumer.close()
    if len(arrivals) < windows:
        raise SystemExit(f"only {len(arrivals)} versions arrived; see {tmp / 'job.log'}")
    # The first window also pays for the base model load and the adapter's creation.
    steady = arrivals[1:]
    return sum(n for _, n in steady) / sum(s for s, _ in steady), len(arrivals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--per-window", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    config = StackConfig.from_env()
    base = build_tiny_llama(config.data_dir / "models" / "tiny-llama")
    pairs = digit_pairs(args.windows * args.per_window, seed=1)
    batches = [pairs[i:i + args.per_window] for i in range(0, len(pairs), args.per_window)]
    bare = bare_peft_rate(base, batches, args.rank)
    in_job, versions = job_rate(config, base, args.windows, args.per_window, args.rank)
    print(f"bare PEFT loop:        {bare:8.1f} samples/s")
    print(f"LoRA operator in job:  {in_job:8.1f} samples/s  ({versions} versions)")
    print(f"ratio (job / bare):    {in_job / bare:8.2f}   goal >= 0.90")


if __name__ == "__main__":
    main()
