"""Training beside serving on one device: serving alone, with training, with SLO arbitration.

A CPU stand-in for one shared accelerator, in two processes as deployed (`streamtune serve`
beside a TaskManager's Python worker), both pinned to the same CPU (`--cpus`, default one
core: the device they share; on separate cores nothing would be shared to arbitrate): a serving process answers requests arriving at a fixed
rate (open loop: latency counts the queueing) with greedy decoding of the tiny model, while
in this process the job's trainer operator (operators/finetune_function.py, driven without
Flink as tests/test_trainer_windows.py does) trains a stream of samples. Serving latencies
feed the server's SLO headroom (streamtune/serve/headroom.py), published on a real loopback
endpoint; with arbitration the trainer reads it there (operators/arbiter.py).

Arms, in one run: the serving capacity (requests one at a time, back to back), training
alone, then at 50% and 90% of that capacity: serving alone, serving beside training, serving
beside training that pauses for the SLO between micro-batches (`cpu_priority` normal), and
serving beside training arbitrated as a job does by default on a CPU: those pauses, and its
thread at idle CPU priority (operators/arbiter.py). The SLO target at each load is
`--slo-factor` times serving alone's p99 at that load.

    .venv/bin/python bench/colocation.py [--seconds 15] [--cpus 0] [--json out.json] [--plot out.png]

Goals (the project's): with arbitration, serving p99 <= 1.2x serving alone at the same load;
training with arbitration >= 0.7x training alone at 50% load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.messages import FeedbackSample, FinetuneSpec  # noqa: E402
from streamtune.serve.headroom import HeadroomServer, SloHeadroom  # noqa: E402
from streamtune.testing import KeyedTimers, trainer_function  # noqa: E402
from streamtune.tinymodel import build_tiny_llama, digit_pairs  # noqa: E402

T0 = 1_777_000_000_000
MIN_SHARE = 0.25


def serving_process(base: str, seconds: float, rate: float, target_ms: float | None, publish: bool,
                    out) -> None:
    """The serving process: its headroom URL (or None) on `out`, a go from it, then its latencies."""
    import torch

    torch.set_num_threads(1)
    slo = SloHeadroom(target_ms, window_s=2.0) if target_ms else None
    server = HeadroomServer(slo).start() if slo and publish else None
    out.send(server.url if server else None)
    out.recv()  # the trainer is running
    out.send(serve(base, seconds, rate, slo))
    if server:
        server.close()


def serve(base: str, seconds: float, rate: float, slo: SloHeadroom | None) -> list[float]:
    """Open-loop requests at `rate`/s for `seconds`; each latency (arrival to answer), in seconds."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True).eval()
    arrivals: queue.Queue = queue.Queue()
    prompts = [p for p, _ in digit_pairs(64, seed=5)]
    latencies: list[float] = []

    def arrive():
        start = time.perf_counter()
        for i in range(int(seconds * rate)):
            time.sleep(max(0.0, start + i / rate - time.perf_counter()))
            arrivals.put((time.perf_counter(), prompts[i % len(prompts)]))
        arrivals.put(None)

    threading.Thread(target=arrive, daemon=True).start()
    while (item := arrivals.get()) is not None:
        arrived, prompt = item
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        latency = time.perf_counter() - arrived
        latencies.append(latency)
        if slo is not None:
            slo.observe(latency)
    return latencies


def capacity(base: str, seconds: float) -> float:
    """Requests per second served one at a time, back to back (no queueing)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True).eval()
    prompts, done, start = [p for p, _ in digit_pairs(64, seed=5)], 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        with torch.no_grad():
            model.generate(**tokenizer(prompts[done % len(prompts)], return_tensors="pt"), max_new_tokens=8,
                           do_sample=False, pad_token_id=tokenizer.eos_token_id)
        done += 1
    return done / (time.perf_counter() - start)


def train_alone(base: str, seconds: float) -> float:
    """Training samples/s with nothing beside it."""
    stop, out = threading.Event(), {}
    trainer = threading.Thread(target=lambda: out.update(train(base, stop, None)))
    trainer.start()
    time.sleep(seconds)  # the arm's length, not a wait on state
    stop.set()
    trainer.join()
    return round(out["samples"] / out["seconds"], 1)


def train(base: str, stop: threading.Event, url: str | None, ready: threading.Event | None = None,
          cpu_priority: str = "idle") -> dict:
    """The trainer on a stream of 1 s windows of 32 samples until `stop`; samples trained, seconds.
    Run it in a thread of its own: with `url` and cpu_priority idle its steps lower that thread's
    priority for good, as in a TaskManager's Python worker."""
    from operators.arbiter import ArbiterSettings
    from pyflink.datastream import TimeDomain

    settings = {"arbitration": ArbiterSettings(url, min_training_share=MIN_SHARE, cpu_priority=cpu_priority)} \
        if url else {}
    fn = trainer_function(base, tempfile.mkdtemp(prefix="colocation-"), **settings)
    if url:
        fn.start_arbiter()
    spec = FinetuneSpec.model_validate({
        "model_id": "co", "stream_source": "kafka://topic=feedback",
        "adapter_config": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]},
        "trigger_policy": {"min_samples_per_window": 32, "window_seconds": 1},
        "training": {"lr": 0.01, "micro_batch_size": 4}})
    ctx = KeyedTimers("co")
    list(fn.process_element(("config", "co", spec.to_json(), "configs", 0, 0, T0 - 1), ctx))
    if ready is not None:
        ready.set()
    trained, started, i = 0, time.perf_counter(), 0
    pairs = digit_pairs(4096, seed=6)
    while not stop.is_set():
        prompt, completion = pairs[i % len(pairs)]
        ts = T0 + i * 1000 // 32
        sample = FeedbackSample(model_id="co", sample_id=f"s{i}", prompt=prompt, completion=completion, ts=ts)
        list(fn.process_element(("sample", "co", sample.to_json(), "feedback", 0, i, ts), ctx))
        ctx.domain = TimeDomain.EVENT_TIME
        for t in ctx.due_event_timers(ts - 1):
            trained += sum(json.loads(r)["metrics"]["samples"] for r in fn.on_timer(t, ctx) if isinstance(r, str))
        i += 1
    out = {"samples": trained, "seconds": time.perf_counter() - started}
    if url:
        out.update(yielded_s=round(fn.arbiter.yielded_s, 2), yields=fn.arbiter.yields,
                   idle_priority=fn.background)
    return out


def run(base: str, mode: str, seconds: float, rate: float, target_ms: float | None) -> dict:
    import multiprocessing

    ours, theirs = multiprocessing.Pipe()
    child = multiprocessing.get_context("spawn").Process(
        target=serving_process, args=(base, seconds, rate, target_ms, mode in ("paused", "arbitrated"), theirs))
    child.start()
    url = ours.recv()
    stop, ready, training = threading.Event(), threading.Event(), {}
    trainer = None
    if mode != "serving alone":
        priority = "normal" if mode == "paused" else "idle"
        trainer = threading.Thread(target=lambda: training.update(train(base, stop, url, ready, priority)))
        trainer.start()
        ready.wait(300)  # the base model loaded: serving starts beside training, not beside the load
    ours.send("go")
    latencies = ours.recv()
    child.join()
    stop.set()
    if trainer:
        trainer.join()
    ms = sorted(x * 1000 for x in latencies)
    result = {"p50_ms": round(statistics.median(ms), 1), "p99_ms": round(ms[max(0, -(-99 * len(ms) // 100) - 1)], 1),
              "requests": len(ms)}
    if training:
        result["train_samples_per_s"] = round(training["samples"] / training["seconds"], 1)
        result.update({k: v for k, v in training.items() if k in ("yielded_s", "yields", "idle_priority")})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each arm")
    parser.add_argument("--slo-factor", type=float, default=1.2, help="SLO target: this times serving alone's p99")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--plot", help="also draw p99 and training share per arm into this PNG")
    parser.add_argument("--cpus", default="0",
                        help="the CPUs both processes share (comma-separated ids): the stand-in device")
    args = parser.parse_args()
    cpus = {int(c) for c in args.cpus.split(",")}
    os.sched_setaffinity(0, cpus)  # inherited by the serving process

    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    base = str(build_tiny_llama(Path(tempfile.mkdtemp(prefix="colocation-base-")) / "tiny"))
    cap = round(capacity(base, 5.0), 1)
    alone_training = train_alone(base, args.seconds)
    loads: dict[str, dict] = {}
    for share in (0.5, 0.9):
        rate = round(share * cap, 1)
        arms = {"serving alone": run(base, "serving alone", args.seconds, rate, None)}
        target = round(args.slo_factor * arms["serving alone"]["p99_ms"], 1)
        arms["serving + training"] = run(base, "training", args.seconds, rate, target)
        arms["serving + training, pauses only"] = run(base, "paused", args.seconds, rate, target)
        arms["serving + training, arbitrated"] = run(base, "arbitrated", args.seconds, rate, target)
        loads[f"{share:.0%}"] = {"rate": rate, "target_ms": target, "arms": arms}

    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, both processes on CPU {sorted(cpus)}, "
               f"torch {torch.__version__}, 1 thread each")
    print(f"bench/colocation.py, {when}, {machine}, {time.perf_counter() - started:.0f} s")
    print(f"tiny Llama, 8 greedy tokens a request; serving capacity {cap} requests/s one at a time; training "
          f"alone {alone_training} samples/s; {args.seconds:g} s an arm; SLO target {args.slo_factor}x serving "
          f"alone's p99; min training share {MIN_SHARE}\n")
    print("| load | run | requests | p50 ms | p99 ms | training samples/s | ÷ training alone | yielded s |")
    print("|---|---|---|---|---|---|---|---|")
    for load, r in loads.items():
        for name, arm in r["arms"].items():
            tps = arm.get("train_samples_per_s")
            print(f"| {load} ({r['rate']}/s) | {name} | {arm['requests']} | {arm['p50_ms']} | {arm['p99_ms']} | "
                  f"{tps if tps is not None else '-'} | {round(tps / alone_training, 2) if tps else '-'} | "
                  f"{arm.get('yielded_s', '-')} |")
    print()
    for load, r in loads.items():
        alone, arb = r["arms"]["serving alone"], r["arms"]["serving + training, arbitrated"]
        ratio = arb["p99_ms"] / alone["p99_ms"]
        print(f"goal: at {load} load, arbitrated p99 <= 1.2x serving alone ({alone['p99_ms']} ms); measured "
              f"{arb['p99_ms']} ms = {ratio:.2f}x: {'met' if ratio <= 1.2 else 'NOT met'}")
    arb50 = loads["50%"]["arms"]["serving + training, arbitrated"]["train_samples_per_s"]
    share = arb50 / alone_training
    print(f"goal: at 50% load, arbitrated training >= 0.7x training alone ({alone_training} samples/s); measured "
          f"{arb50} = {share:.2f}x: {'met' if share >= 0.7 else 'NOT met'}")
    if args.plot:
        plot(loads, alone_training, when, Path(args.plot))
    if args.json:
        Path(args.json).write_text(json.dumps({"when": when, "machine": machine, "capacity_rps": cap,
                                               "training_alone_samples_per_s": alone_training, "loads": loads},
                                              indent=1))


def plot(loads: dict, alone_training: float, when: str, path: Path) -> None:
    """Serving p99 per arm and load against the 1.2x goal; training share against the 0.7 goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = ["serving alone", "serving + training", "serving + training, pauses only", "serving + training, arbitrated"]
    fig, (lat, share) = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.2
    for k, arm in enumerate(arms):
        xs = [i + (k - 1.5) * width for i in range(len(loads))]
        lat.bar(xs, [r["arms"][arm]["p99_ms"] for r in loads.values()], width, label=arm)
    for i, r in enumerate(loads.values()):
        goal = 1.2 * r["arms"]["serving alone"]["p99_ms"]
        lat.hlines(goal, i - 2 * width, i + 2 * width, colors="black", linestyles=":",
                   label="goal: 1.2x serving alone" if i == 0 else None)
    lat.set_xticks(range(len(loads)), [f"{k} load ({r['rate']}/s)" for k, r in loads.items()])
    lat.set(ylabel="serving p99, ms (log scale)", yscale="log", title="Serving p99")
    lat.legend(fontsize=8)
    for k, arm in enumerate(arms[1:]):
        xs = [i + (k - 1) * width for i in range(len(loads))]
        share.bar(xs, [r["arms"][arm]["train_samples_per_s"] / alone_training for r in loads.values()], width,
                  label=arm, color=f"C{k + 1}")
    share.axhline(0.7, color="black", linestyle=":", label="goal at 50% load: 0.7")
    share.set_xticks(range(len(loads)), [f"{k} load" for k in loads])
    share.set(ylabel="training samples/s ÷ training alone", ylim=(0, 1.1), title="Training kept")
    share.legend(fontsize=8)
    fig.suptitle(f"bench/colocation.py, {when}, tiny Llama on a 2-core CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
