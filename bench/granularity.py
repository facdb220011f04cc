"""Update granularity on a drifting stream: fixed step sizes against `trigger_policy.mode: adaptive`.

The stream is task A, then the conflicting task B (streamtune/conflicting_tasks.py, as
bench/forgetting.py), 64 samples per second of event time. It runs through the job's trainer
operator (operators/finetune_function.py) without Flink, as tests/test_trainer_windows.py
drives it: windows, carry-over and step sizes are the job's. Per policy: the B samples, the
time, the training time and the optimizer steps from the first B sample until held-out exact
match on B reaches 0.9 (scored after every version), and held-out A at the end of A and at the
end (forgetting).

Training: micro-batches of 32, 2 epochs, lr 0.01, rank 16 on q/v.

    .venv/bin/python bench/granularity.py [--samples-per-task 1024] [--json out.json]

Time to B is what a user waits after the switch: the stream's seconds of B (at 64 samples/s)
until the version that first scores B >= 0.9 was emitted, plus the training seconds of the
versions up to it.

Goals (the project's): adaptive reaches B >= 0.9 about as fast as the smallest fixed window
(time within 1.2x of fixed 64's) with at most 1.2x the optimizer steps of the largest (fixed
256's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.messages import FeedbackSample, FinetuneSpec, VersionRecord  # noqa: E402
from operators.quality import Kept  # noqa: E402
from streamtune.conflicting_tasks import digits_of, task_a, task_b  # noqa: E402
from streamtune.testing import KeyedTimers, trainer_function  # noqa: E402
from streamtune.tinymodel import build_tiny_llama  # noqa: E402

T0 = 1_777_000_000_000
PER_SECOND, TARGET, MICRO, EPOCHS = 64, 0.9, 32, 2
POLICIES = {"fixed 64": {"min_samples_per_window": 64, "max_samples_per_step": 64},
            "fixed 128": {"min_samples_per_window": 128, "max_samples_per_step": 128},
            "fixed 256": {"min_samples_per_window": 256, "max_samples_per_step": 256},
            "adaptive 64-256": {"min_samples_per_window": 64, "max_samples_per_step": 256, "mode": "adaptive",
                                "adaptive": {"min_samples_low": 64, "min_samples_high": 256}}}


def spec(model_id: str, policy: dict) -> FinetuneSpec:
    return FinetuneSpec.model_validate({
        "model_id": model_id, "stream_source": "kafka://topic=feedback",
        "adapter_config": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]},
        "trigger_policy": {"window_seconds": 1, **policy},
        "training": {"lr": 0.01, "micro_batch_size": MICRO, "epochs": EPOCHS}, "seed": 1})


def records(model_id: str, pairs: list[tuple]) -> list[tuple]:
    """The job's input tuples, PER_SECOND samples per second, and one far later that moves the
    watermark past every window of the stream."""
    out = []
    for i, (task, prompt, completion) in enumerate(pairs + [("end", "x=0000;y=", "1111")]):
        ts = T0 + (i * 1000 // PER_SECOND if i < len(pairs) else 10**7)
        sample = FeedbackSample(model_id=model_id, sample_id=f"{task}{i}", prompt=prompt, completion=completion, ts=ts)
        out.append(("sample", model_id, sample.to_json(), "feedback", 0, i, ts))
    return out


def run_policy(base: str, name: str, policy: dict, pairs: list[tuple], first_b: int, held_a, held_b) -> dict:
    from operators.lora_trainer import LoraTrainer

    model_id = "g-" + name.replace(" ", "-")
    fn = trainer_function(base, tempfile.mkdtemp(prefix="granularity-"))
    ctx, s = KeyedTimers(model_id), spec(model_id, policy)
    trainer = LoraTrainer.for_base(base)
    score = lambda held: trainer.evaluate(model_id, s.adapter_config, s.training, held)["exact_match"]  # noqa: E731
    list(fn.process_element(("config", model_id, s.to_json(), "configs", 0, 0, T0 - 1), ctx))
    out = {"steps_to_target": None, "seconds_to_target": None, "b_samples_to_target": None, "time_to_target": None,
           "versions": 0, "sizes": []}
    train_s, steps_b, a_after_a = 0.0, 0, None
    from pyflink.datastream import TimeDomain

    for i, record in enumerate(records(model_id, pairs)):
        if i == first_b and a_after_a is None:
            a_after_a = score(held_a)
        versions = list(fn.process_element(record, ctx))
        ctx.domain = TimeDomain.EVENT_TIME
        for t in ctx.due_event_timers(record[6] - 1):
            versions += fn.on_timer(t, ctx)
        for v in (VersionRecord.from_json(r) for r in versions if isinstance(r, str)):
            out["versions"] += 1
            out["sizes"].append(v.metrics.samples)
            if not any(sid.startswith("b") for sid in v.lineage.sample_ids):
                continue
            train_s += v.metrics.step_seconds
            steps_b += EPOCHS * math.ceil(v.metrics.samples / MICRO)  # flush_every 1: a step per micro-batch
            if out["steps_to_target"] is None and score(held_b) >= TARGET:
                out["steps_to_target"], out["seconds_to_target"] = steps_b, round(train_s, 2)
                # What a user waits: the stream's seconds of B up to this version, plus training.
                out["b_samples_to_target"] = i - first_b + 1
                out["time_to_target"] = round((i - first_b + 1) / PER_SECOND + train_s, 2)
    out.update({"A after A": a_after_a, "A at end": score(held_a), "B at end": score(held_b),
                "B seconds": round(train_s, 2)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples-per-task", type=int, default=1024)
    parser.add_argument("--held-out", type=int, default=64)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    base = str(build_tiny_llama(Path(tempfile.mkdtemp(prefix="granularity-base-")) / "tiny"))
    held_a = [Kept(f"ha{i}", p, c) for i, (p, c) in enumerate(task_a(args.held_out, seed=999))]
    held_b = [Kept(f"hb{i}", p, c) for i, (p, c) in enumerate(task_b(args.held_out, seed=998))]
    exclude = digits_of((k.prompt, k.completion) for k in held_a + held_b)
    pairs = [("a", p, c) for p, c in task_a(args.samples_per_task, seed=1, exclude=exclude)] + \
            [("b", p, c) for p, c in task_b(args.samples_per_task, seed=2, exclude=exclude)]
    started = time.perf_counter()
    results = {name: run_policy(base, name, policy, pairs, args.samples_per_task, held_a, held_b)
               for name, policy in POLICIES.items()}
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, 1 thread"
    print(f"bench/granularity.py, {when}, {machine}, {time.perf_counter() - started:.0f} s")
    print(f"tiny Llama, A then B, {args.samples_per_task} samples each, {PER_SECOND}/s; held-out exact match on "
          f"{args.held_out} samples per task\n")
    print("| policy | versions | B samples to B >= 0.9 | time to B >= 0.9, s | training s to it | "
          "optimizer steps to it | B at end | A after A | A at end | step sizes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        sizes = sorted(set(r["sizes"]))
        print(f"| {name} | {r['versions']} | {r['b_samples_to_target'] or 'not reached'} | "
              f"{r['time_to_target'] or 'not reached'} | {r['seconds_to_target'] or 'not reached'} | "
              f"{r['steps_to_target'] or 'not reached'} | {r['B at end']:.2f} | {r['A after A']:.2f} | "
              f"{r['A at end']:.2f} | {sizes[0]}-{sizes[-1]} |")
    adaptive, smallest, largest = results["adaptive 64-256"], results["fixed 64"], results["fixed 256"]
    print()
    for what, key, ref, name in (("time", "time_to_target", smallest, "fixed 64"),
                                 ("optimizer steps", "steps_to_target", largest, "fixed 256")):
        mine, theirs = adaptive[key], ref[key]
        if mine and theirs:
            print(f"goal: adaptive's {what} to B >= {TARGET} <= 1.2x {name}'s ({theirs}); measured {mine} = "
                  f"{mine / theirs:.2f}x: {'met' if mine <= 1.2 * theirs else 'NOT met'}")
        else:
            print(f"goal: adaptive's {what} to B >= {TARGET} <= 1.2x {name}'s: NOT met "
                  f"(adaptive {mine or 'never reached it'}, {name} {theirs or 'never reached it'})")
    if args.json:
        Path(args.json).write_text(json.dumps({"when": when, "machine": machine, "results": results}, indent=1))


if __name__ == "__main__":
    main()
