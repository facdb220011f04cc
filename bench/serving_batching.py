"""Serving throughput with batched decoding: one request at a time vs 16 concurrent clients.

In this process only: the tiny base built from code (streamtune.tinymodel), an AdapterPool
with 8 slots and 8 random LoRA adapters of rank 8 (q/v) put into it, and the pool's batch
scheduler (operators/batched_decoding.py), the path `streamtune serve` sends every request
through. Each request: a digit prompt to one of the 8 adapters (round robin), greedy,
`--max-tokens` new tokens.

1. Sequential: `--sequential` requests one at a time, (a) decoded alone (`pool.generate`:
   no scheduler, what the server did per request before batching) and (b) through the
   scheduler (one request per batch: the window's wait included).
2. Concurrent: `--clients` threads each sending requests back to back through the scheduler,
   `--requests` in all (≥ 200): throughput, p50/p95 latency, batch sizes seen.

The ratio printed is concurrent throughput over sequential (a). The project's goal: ≥ 5× at
16 clients. Writes bench/results/serving_batching.json.

    .venv/bin/python bench/serving_batching.py [--clients 16] [--requests 256] [--sequential 32]
                                               [--max-tokens 16] [--window-ms 5] [--max-batch 16]

Run it on a quiet machine: on 2 CPUs anything else busy shows in every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GOAL_RATIO = 5.0
ADAPTERS, RANK = 8, 8


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else float("nan")


def adapter_files(base: Path, seed: int) -> dict[str, bytes]:
    """A PEFT artifact of rank RANK on q/v with random (non-zero) B: every adapter its own answers."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save as save_safetensors
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                        task_type="CAUSAL_LM")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)), config)
    weights = save_safetensors({k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()})
    peft_config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in model.peft_config["default"].to_dict().items()}
    return {"adapter_model.safetensors": weights, "adapter_config.json": json.dumps(peft_config).encode()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=256, help="requests under concurrent load (≥ 200)")
    parser.add_argument("--sequential", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--window-ms", type=float, default=5.0)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "serving_batching.json"))
    args = parser.parse_args()

    from streamtune.demo import quiet_libraries

    quiet_libraries()
    from operators.adapter_pool import AdapterPool
    from operators.batched_decoding import Group, Row, SamplingParams
    from streamtune.tinymodel import build_tiny_llama, digit_pairs, digit_prompt  # noqa: F401

    base = build_tiny_llama(Path(tempfile.gettempdir()) / "streamtune-bench" / "tiny-llama")
    pool = AdapterPool(base, slots=ADAPTERS, device="cpu")
    keys = [f"bench/{i + 1}" for i in range(ADAPTERS)]
    for i, key in enumerate(keys):
        pool.put(key, adapter_files(base, seed=i))
    prompts = [p for p, _ in digit_pairs(64, seed=5)]
    params = SamplingParams(max_tokens=args.max_tokens)

    def request_of(i: int) -> tuple[str, str]:
        return keys[i % len(keys)], prompts[i % len(prompts)]

    scheduler = pool.scheduler(window_ms=args.window_ms, max_batch=args.max_batch,
                               on_batch=lambda rows, versions: batch_sizes.append(rows))
    batch_sizes: list[int] = []

    def through_scheduler(key: str, prompt: str) -> tuple[float, int]:
        started = time.perf_counter()
        group = scheduler.submit(Group([Row(pool.tokenize(prompt), params)], lambda: (key, key)))
        while True:
            event = group.events.get(timeout=300)
            if event[0] == "error":
                raise event[1]
            if event[0] == "row":
                return time.perf_counter() - started, event[2].tokens

    for i in range(2 * len(keys)):  # warm-up: every adapter once into its slot, both paths
        pool.generate(*request_of(i), max_tokens=args.max_tokens)
        through_scheduler(*request_of(i))
    batch_sizes.clear()

    say(f"sequential: {args.sequential} requests one at a time, decoded alone (pool.generate)")
    started, tokens = time.perf_counter(), 0
    alone_latency = []
    for i in range(args.sequential):
        t0 = time.perf_counter()
        tokens += pool.generate(*request_of(i), max_tokens=args.max_tokens).tokens
        alone_latency.append(time.perf_counter() - t0)
    seq_s = time.perf_counter() - started
    seq_rps, seq_tps = args.sequential / seq_s, tokens / seq_s

    say(f"sequential: {args.sequential} requests one at a time through the scheduler (window {args.window_ms} ms)")
    started = time.perf_counter()
    sched_latency = [through_scheduler(*request_of(i))[0] for i in range(args.sequential)]
    seq_sched_rps = args.sequential / (time.perf_counter() - started)

    say(f"concurrent: {args.clients} clients, {args.requests} requests through the scheduler")
    batch_sizes.clear()
    latencies: list[float] = []
    done_tokens = [0]
    counter = iter(range(args.requests))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            took, n = through_scheduler(*request_of(i))
            with lock:
                latencies.append(took)
                done_tokens[0] += n

    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    conc_s = time.perf_counter() - started
    scheduler.stop()
    conc_rps, conc_tps = args.requests / conc_s, done_tokens[0] / conc_s
    ratio = conc_rps / seq_rps
    results = {
        "adapters": ADAPTERS, "rank": RANK, "max_tokens": args.max_tokens, "window_ms": args.window_ms,
        "max_batch": args.max_batch, "clients": args.clients,
        "sequential_alone": {"requests": args.sequential, "seconds": round(seq_s, 3), "requests_per_s": round(seq_rps, 2),
                             "tokens_per_s": round(seq_tps, 1),
                             "p50_ms": round(pct(alone_latency, .5) * 1000, 2)},
        "sequential_scheduler": {"requests_per_s": round(seq_sched_rps, 2),
                                 "p50_ms": round(pct(sched_latency, .5) * 1000, 2)},
        "concurrent": {"requests": args.requests, "seconds": round(conc_s, 3), "requests_per_s": round(conc_rps, 2),
                       "tokens_per_s": round(conc_tps, 1), "p50_ms": round(pct(latencies, .5) * 1000, 2),
                       "p95_ms": round(pct(latencies, .95) * 1000, 2),
                       "batches": len(batch_sizes), "mean_batch": round(statistics.fmean(batch_sizes), 2),
                       "max_batch_seen": max(batch_sizes)},
        "throughput_ratio": round(ratio, 2), "goal_ratio": GOAL_RATIO, "met": ratio >= GOAL_RATIO,
        "date": time.strftime("%Y-%m-%d"),
    }
    print()
    print(f"{'measure':44s} {'value':>12s}")
    print(f"{'sequential, alone: requests/s':44s} {seq_rps:12.2f}  (p50 {results['sequential_alone']['p50_ms']} ms)")
    print(f"{'sequential, via scheduler: requests/s':44s} {seq_sched_rps:12.2f}  "
          f"(p50 {results['sequential_scheduler']['p50_ms']} ms)")
    print(f"{f'{args.clients} clients, batched: requests/s':44s} {conc_rps:12.2f}  "
          f"(p50 {results['concurrent']['p50_ms']} ms, p95 {results['concurrent']['p95_ms']} ms, "
          f"n={args.requests})")
    print(f"{'batches / mean rows / largest':44s} {len(batch_sizes):>6d} / {statistics.fmean(batch_sizes):.1f} / "
          f"{max(batch_sizes)}")
    print(f"{'throughput ratio (goal >= 5x)':44s} {ratio:11.2f}x  {'met' if ratio >= GOAL_RATIO else 'NOT met'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    say(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
