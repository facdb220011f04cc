"""Forgetting: task A, then the conflicting task B, learned window by window by the job's
trainer; held-out exact match on A after B, and on B, per method.

Runs `operators.lora_trainer.LoraTrainer` directly, without Flink (the job adds transport
and state around the same steps; tests/test_quality.py runs them through the job). Tasks
are streamtune/conflicting_tasks.py: A `x=1234;y=` -> `2345`, B `b:x=1234;y=` -> `0123`.
Each window is one step of the trainer (64 samples, 4 epochs, micro-batches of 32, lr 0.01,
rank 16 on q/v, as the demo), seeded as the job seeds it; replay draws from the job's
reservoir (operators/quality.py); EWC is the trainer's online EWC (spec section `ewc`).
Every method runs with several seeds (the job's seed is
a hash of the version id): the table gives the mean and the range.

    .venv/bin/python bench/forgetting.py [--windows 14] [--seeds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core import defaults  # noqa: E402
from core.messages import AdapterConfig, EwcConfig, TrainingConfig  # noqa: E402
from operators.quality import Kept, QualityState, draw_replay  # noqa: E402
from streamtune.conflicting_tasks import digits_of, task_a, task_b  # noqa: E402
from streamtune.tinymodel import build_tiny_llama  # noqa: E402

PER_WINDOW, BUFFER = 64, 512
ADAPTER = AdapterConfig(rank=16, alpha=32, target_modules=["q_proj", "v_proj"])
TRAINING = TrainingConfig(lr=0.01, micro_batch_size=32, epochs=4)
METHODS = {"plain LoRA": {}, "replay 1:1": {"replay_ratio": 1.0}, "replay 2:1": {"replay_ratio": 2.0},
           "EWC λ=1e2": {"ewc": 1e2}, "EWC λ=1e4": {"ewc": 1e4}, "EWC λ=1e6": {"ewc": 1e6}}


def run_method(trainer, name: str, options: dict, seed: int, windows: int, held_a: list, held_b: list) -> dict:
    """Train A then B window by window; exact match on the held-out sets at the end of each task."""
    a = [Kept(f"a{i}", p, c) for i, (p, c) in enumerate(task_a(PER_WINDOW * windows, seed=1, exclude=_exclude(held_a, held_b)))]
    b = [Kept(f"b{i}", p, c) for i, (p, c) in enumerate(task_b(PER_WINDOW * windows, seed=2, exclude=_exclude(held_a, held_b)))]
    model_id = f"{name}-{seed}"
    state, quality, ratio, out = None, QualityState(), options.get("replay_ratio"), {}
    ewc = EwcConfig(strength=options["ewc"]) if "ewc" in options else None
    started = time.perf_counter()
    for task, data in (("A", a), ("B", b)):
        for w in range(windows):
            batch = data[w * PER_WINDOW:(w + 1) * PER_WINDOW]
            step_seed = seed * 1000 + (0 if task == "A" else windows) + w
            replayed = draw_replay(quality.replay, len(batch), ratio, step_seed) if ratio else []
            state = trainer.step(model_id, ADAPTER, TRAINING, state, batch, step_seed, replay=replayed, ewc=ewc).state
            quality = quality.with_trained(batch, BUFFER)
        out[f"A after {task}"] = trainer.evaluate(model_id, ADAPTER, TRAINING, held_a)["exact_match"]
        out[f"B after {task}"] = trainer.evaluate(model_id, ADAPTER, TRAINING, held_b)["exact_match"]
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


def _exclude(held_a: list, held_b: list) -> set[str]:
    return digits_of((s.prompt, s.completion) for s in held_a + held_b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=14, help="windows per task")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    import torch

    from operators.lora_trainer import LoraTrainer

    torch.set_num_threads(1)
    base = build_tiny_llama(defaults.base_model_dir())
    trainer = LoraTrainer.for_base(str(base))
    held_a = [Kept(f"ha{i}", p, c) for i, (p, c) in enumerate(task_a(200, seed=999))]
    held_b = [Kept(f"hb{i}", p, c) for i, (p, c) in enumerate(task_b(200, seed=998))]
    results = {name: [run_method(trainer, f"m{i}", options, seed, args.windows, held_a, held_b)
                      for seed in range(1, args.seeds + 1)] for i, (name, options) in enumerate(METHODS.items())}

    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, 1 thread"
    print(f"bench/forgetting.py, {when}, {machine}")
    print(f"tiny Llama, {args.windows} windows of {PER_WINDOW} per task, {args.seeds} seeds; held-out exact match "
          "(mean, min-max over seeds)\n")
    columns = ("A after A", "A after B", "B after B")
    print(f"| method | {' | '.join(columns)} | seconds per run |")
    print("|---|" + "---|" * (len(columns) + 1))
    for name, runs in results.items():
        cells = []
        for c in columns:
            values = [r[c] for r in runs]
            cells.append(f"{sum(values) / len(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        print(f"| {name} | {' | '.join(cells)} | {sum(r['seconds'] for r in runs) / len(runs):.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"when": when, "machine": machine, "windows": args.windows,
                                               "results": results}, indent=1))


if __name__ == "__main__":
    main()
