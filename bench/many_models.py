"""Many models per worker: step time and memory as the number of models sharing one base grows.

One LoraTrainer (the job's trainer code, one base model per worker) trains N models round
robin, three windows each, as a TaskManager slot does when N model_ids hash to it. With a
bounded cache (`--max-live`, the job's --max-live-adapters) a model evicted between its
windows reloads its adapter and optimizer from the state bytes the job keeps in keyed
state. Prints, for N = 1, 10, 100 and each cache bound, the mean step time, the adapters
held, their bytes (weights + AdamW moments) and the worker's RSS; each row runs in a fresh
process (so RSS is that row's), and ratios are to N = 1 in the same run. Writes
bench/results/many_models.json.

    .venv/bin/python bench/many_models.py [--models 1 10 100] [--max-live 16 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.messages import AdapterConfig, TrainingConfig  # noqa: E402
from operators.lora_trainer import LoraTrainer, threads_from_env  # noqa: E402
from operators.quality import Kept  # noqa: E402
from streamtune.stack import StackConfig  # noqa: E402
from streamtune.tinymodel import build_tiny_llama, digit_pairs  # noqa: E402

WINDOWS, PER_WINDOW = 3, 16


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run(trainer: LoraTrainer, models: int, max_live: int) -> dict:
    adapter = AdapterConfig(rank=16, alpha=32, target_modules=["q_proj", "v_proj"])
    training = TrainingConfig(lr=0.01, micro_batch_size=16)
    trainer.max_live_adapters = max_live
    pairs = digit_pairs(PER_WINDOW * WINDOWS, seed=2)
    states, times, held, held_bytes = {}, [], 0, 0
    for w in range(WINDOWS):
        batch = [Kept(f"{w}-{i}", *pairs[w * PER_WINDOW + i], 1.0, "") for i in range(PER_WINDOW)]
        for m in range(models):
            model_id = f"bench-{models}-{max_live}-{m}"
            started = time.perf_counter()
            states[model_id] = trainer.step(model_id, adapter, training, states.get(model_id), batch, seed=w).state
            times.append(time.perf_counter() - started)
            live = trainer.live_adapters()
            held, held_bytes = max(held, live["adapters"]), max(held_bytes, live["bytes"])
    steady = times[models:] or times  # the first window of each model also creates its adapter
    state_bytes = sum(len(s["lora"]) + len(s["optim"]) for s in states.values())
    return {"models": models, "max_live": max_live, "step_ms": round(1000 * sum(steady) / len(steady), 2),
            "adapters_held": held, "held_mib": round(held_bytes / 2**20, 2),
            "keyed_state_mib": round(state_bytes / 2**20, 2), "rss_mib": round(rss_mib(), 1)}


def row(models: int, max_live: int) -> dict:
    threads_from_env()
    base = build_tiny_llama(StackConfig.from_env().data_dir / "models" / "tiny-llama")
    return run(LoraTrainer.for_base(str(base)), models, max_live)


def main() -> None:
    import subprocess

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=int, nargs="+", default=[1, 10, 100])
    p.add_argument("--max-live", type=int, nargs="+", default=[16, 1000])
    p.add_argument("--row", type=int, nargs=2, help=argparse.SUPPRESS)  # models, max_live: one row, as JSON
    args = p.parse_args()
    if args.row:
        print(json.dumps(row(*args.row)))
        return
    rows = []
    for bound in args.max_live:
        for n in args.models:
            out = subprocess.run([sys.executable, __file__, "--row", str(n), str(bound)], check=True,
                                 capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'models':>6} {'max_live':>8} {'step ms':>8} {'x N=1':>6} {'held':>5} {'held MiB':>9} "
          f"{'state MiB':>9} {'RSS MiB':>8}")
    for r in rows:
        one = next(x for x in rows if x["max_live"] == r["max_live"] and x["models"] == min(args.models))
        r["step_ratio_to_one"] = round(r["step_ms"] / one["step_ms"], 2)
        print(f"{r['models']:>6} {r['max_live']:>8} {r['step_ms']:>8} {r['step_ratio_to_one']:>6} "
              f"{r['adapters_held']:>5} {r['held_mib']:>9} {r['keyed_state_mib']:>9} {r['rss_mib']:>8}")
    out = REPO / "bench" / "results" / "many_models.json"
    out.write_text(json.dumps({"date": str(date.today()), "machine": f"{platform.machine()}, "
                               f"{os.cpu_count()} cores", "threads": 1, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
