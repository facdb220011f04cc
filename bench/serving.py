"""Serving: in-memory adapter swap vs a PEFT load, request latency under swaps, 1 → 1,000 models.

Three measurements in one run, on real LoRA adapters of the tiny base (rank 4 on q/v, trained
here for a few dozen steps by operators/lora_trainer.py, then copied with one weight nudged so
every version has its own sha256):

1. Swap vs load, in this process: `AdapterPool.activate` of a version that sits in no slot
   (the tensor copy the server does on a swap) against `PeftModel.load_adapter` from the
   version's saved artifact directory, and against `pool.put` + `activate` (parse the
   artifact's bytes, then copy). Goal: swap ≤ 1 ms and ≥ 10× faster than a load.
2. Requests through the whole path a user sees: a real `streamtune serve` process following a
   bench broadcast topic (`--no-registry`: aliases from the broadcasts), requests over HTTP
   from several client threads at a fixed pace, (a) with no swaps and (b) with a new version
   of the model broadcast as champion every second (the server fetches, checks and swaps it
   in). Same pace, same prompts; (a) and (b) take turns in 2 s blocks (ABBA), so load from other
   processes and drift hit both alike. Also printed: the median over block pairs of the p95
   ratio (robust to one block hit by a burst elsewhere), the CPUs other processes used, the
   latency inside the server (the `streamtune.latency_ms` of each answer), and (b) split into
   requests sent within 250 ms after a publish (the ones a swap can slow) and the others.
   Goal: p95 with swaps within 10% of p95 without.
3. Scale: one server with 1, then 100, then 1,000 model_ids (one version each, champion via
   its own broadcast, each its own artifact): server RSS, and latency of hot requests (one
   model already in a slot, asked again and again) and cold ones (each a model never asked
   before and not in a slot: the request copies it into one), with `--slots 8 --cpu-cache 1024`.
   The server parses every champion when its broadcast arrives, so with up to 1,024 models a
   cold request finds the version in the CPU cache: its extra cost is the slot copy, not a load.

Prints a table of measured figures beside each goal and writes bench/results/serving.json.

    .venv/bin/python bench/serving.py [--reps 200] [--requests 600] [--block-seconds 2] [--rate 20]
                                      [--clients 4] [--models 1,100,1000]

Run it on a quiet machine: with 2 CPUs, anything else busy (a pip install, a test run) shows
up in every latency here.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import requests  # noqa: E402

from streamtune.auth import bearer_headers  # noqa: E402
from streamtune.demo import quiet_libraries  # noqa: E402

SWAP_GOAL_MS = 1.0
SPEEDUP_GOAL = 10.0
P95_RATIO_GOAL = 1.10
SLOTS, CPU_CACHE = 8, 1024
PROMPTS = ["x=1234;y=", "x=5071;y=", "x=9999;y=", "x=3141;y="]
MAX_TOKENS = 6
AFTER_PUBLISH_S = 0.25  # requests sent this soon after a publish are the ones a swap may slow
TRAIN_STEPS = 30  # a few dozen steps: the adapter answers with digits (4-5 tokens), not an early stop


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else float("nan")


def stats(values: list[float]) -> dict:
    return {"n": len(values), "p50": pct(values, 0.50), "p95": pct(values, 0.95),
            "mean": statistics.fmean(values) if values else float("nan"), "max": max(values, default=float("nan"))}


# -- adapters ---------------------------------------------------------------------------
def train_adapter(base: str) -> dict[str, bytes]:
    """A real PEFT artifact of the tiny base: rank 4, alpha 8, q/v, TRAIN_STEPS LoRA steps."""
    from core.messages import AdapterConfig, TrainingConfig
    from operators.lora_trainer import LoraTrainer
    from streamtune.feedback import digit_samples
    from streamtune.tinymodel import digit_pairs

    trainer = LoraTrainer.for_base(base)
    adapter = AdapterConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    training = TrainingConfig(lr=0.05, micro_batch_size=8)
    state, result = None, None
    for step in range(TRAIN_STEPS):
        samples = digit_samples("bench-serving", digit_pairs(32, seed=100 + step), 0, 1)
        result = trainer.step("bench-serving", adapter, training, state, samples, seed=step)
        state = result.state
    return result.files


def variants(files: dict[str, bytes], n: int, offset: int) -> list[tuple[dict[str, bytes], str]]:
    """`n` copies of an artifact, each with one weight nudged by (offset + i + 1) · 1e-6: own sha256."""
    from safetensors.torch import load as load_safetensors
    from safetensors.torch import save as save_safetensors

    from connectors.artifact_store import WEIGHTS, artifact_sha256

    state = load_safetensors(files[WEIGHTS])
    first = sorted(k for k in state if k.endswith("lora_A.weight"))[0]
    out = []
    for i in range(n):
        nudged = dict(state)
        t = state[first].clone()
        t[0, 0] += (offset + i + 1) * 1e-6
        nudged[first] = t
        weights = save_safetensors({k: v.contiguous() for k, v in nudged.items()})
        nudged_files = {"adapter_config.json": files["adapter_config.json"], WEIGHTS: weights}
        out.append((nudged_files, artifact_sha256(nudged_files)))
    assert len({sha for _, sha in out}) == n, "nudged copies share a sha256"
    return out


# -- 1. swap vs load ------------------------------------------------------------------
def measure_swap(base: str, versions: list[tuple[dict[str, bytes], str]], reps: int, tmp: Path) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from operators.adapter_pool import AdapterPool

    pool = AdapterPool(base, slots=SLOTS, cpu_cache=CPU_CACHE)
    keys = [f"v/{i}" for i in range(len(versions))]
    assert len(keys) > SLOTS, "round-robin over more versions than slots: every activate misses"
    for key, (files, _) in zip(keys, versions):
        pool.put(key, files)

    def swap_once(key: str) -> float:
        with pool.lock:
            before = pool.swaps
            started = time.perf_counter()
            pool.activate(key)
            took = time.perf_counter() - started
            assert pool.swaps == before + 1, f"{key} was already in a slot"
        return took * 1000

    for i in range(2 * len(keys)):  # warm-up
        swap_once(keys[i % len(keys)])
    swap = [swap_once(keys[i % len(keys)]) for i in range(reps)]

    put_activate = []
    for i in range(reps + 10):
        key, files = f"p/{i}", versions[i % len(versions)][0]
        with pool.lock:
            started = time.perf_counter()
            pool.put(key, files)
            pool.activate(key)
            took = (time.perf_counter() - started) * 1000
        if i >= 10:
            put_activate.append(took)

    # In-process generation, for scale: what a request costs without HTTP.
    with pool.lock:
        pool.activate(keys[0])
    for p in PROMPTS:
        pool.generate(keys[0], p, MAX_TOKENS)
    generate = []
    tokens = []
    for i in range(100):
        started = time.perf_counter()
        g = pool.generate(keys[0], PROMPTS[i % len(PROMPTS)], MAX_TOKENS)
        generate.append((time.perf_counter() - started) * 1000)
        tokens.append(g.tokens)

    dirs = []
    for i, (files, _) in enumerate(versions):
        d = tmp / "peft" / f"v{i}"
        d.mkdir(parents=True)
        for name, data in files.items():
            (d / name).write_bytes(data)
        dirs.append(d)
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True).eval()
    peft = PeftModel.from_pretrained(model, str(dirs[0]), adapter_name="first").eval()

    def load_once(i: int) -> float:
        name = f"load{i}"
        started = time.perf_counter()
        peft.load_adapter(str(dirs[i % len(dirs)]), adapter_name=name)
        took = time.perf_counter() - started
        peft.delete_adapter(name)
        return took * 1000

    for i in range(10):
        load_once(-1 - i)
    load = [load_once(i) for i in range(reps)]
    return {"swap_ms": stats(swap), "peft_load_adapter_ms": stats(load), "put_activate_ms": stats(put_activate),
            "generate_in_process_ms": stats(generate), "generated_tokens_mean": statistics.fmean(tokens)}


# -- the server -----------------------------------------------------------------------
def serve_options() -> set[str]:
    """The options `streamtune serve` takes, from its own parser."""
    from streamtune.serve.cli import add_parser

    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    return set(sub.choices["serve"]._option_string_actions)


class Server:
    """`streamtune serve` as a child process (its own session: killed with its group)."""

    def __init__(self, base: str, topic_regex: str, store: Path, log_file: Path, bootstrap: str):
        from streamtune.local_job import spawn_logged
        from streamtune.testing import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = log_file
        # No registry and no inference log: automatic rollback (where the server has it) needs both.
        extra = ["--no-auto-rollback"] if "--no-auto-rollback" in serve_options() else []
        self.proc = spawn_logged(
            [sys.executable, "-m", "streamtune.cli", "serve", "--port", str(self.port), "--base-model", base,
             "--no-registry", "--broadcast-topics", topic_regex, "--artifact-store", str(store),
             "--bootstrap-server", bootstrap, "--no-inference-log", "--slots", str(SLOTS), "--cpu-cache", str(CPU_CACHE),
             *extra],
            log_file)
        OURS.add(self.proc.pid)

    def wait_ready(self, timeout: float = 180) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited ({self.proc.returncode}); see {self.log_file}:\n"
                                 + self.log_file.read_text()[-3000:])
            try:
                if requests.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return time.monotonic() - started
            except requests.RequestException:
                pass
            time.sleep(0.25)
        raise SystemExit(f"server not ready in {timeout} s; see {self.log_file}")

    def models(self) -> dict[str, dict]:
        return {m["id"]: m for m in requests.get(f"{self.url}/v1/models", timeout=30,
                                                 headers=bearer_headers("inference")).json()["data"]}

    def wait_champions(self, wanted: dict[str, int], timeout: float = 300) -> float:
        """Until every model in `wanted` has its champion acknowledged at that version."""
        started = time.monotonic()
        while True:
            models = self.models()
            missing = [m for m, v in wanted.items() if models.get(m, {}).get("aliases", {}).get("champion") != v]
            if not missing:
                return time.monotonic() - started
            if time.monotonic() - started > timeout or self.proc.poll() is not None:
                raise SystemExit(f"{len(missing)} champions not acknowledged (e.g. {missing[:3]}); see {self.log_file}")
            time.sleep(0.2)

    def rss_mb(self) -> float:
        """VmRSS of the server and every process under it, MiB."""
        total, todo = 0, [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                total += int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
        return total / 1024

    def stop(self) -> None:
        from streamtune.local_job import kill_group

        kill_group(self.proc)
        OURS.discard(self.proc.pid)


def paced_load(url: str, n: int, rate: float, clients: int, model_for, prompt_offset: int = 0) -> list[dict]:
    """`n` requests at `rate`/s (request i due at t0 + i/rate), from `clients` threads with their
    own keep-alive sessions; latency from the moment each is sent to its answer."""
    results: list[dict | None] = [None] * n
    counter, lock = itertools.count(), threading.Lock()
    t0 = time.perf_counter() + 0.05

    def client() -> None:
        session = requests.Session()
        session.headers.update(bearer_headers("inference"))  # where the environment holds tokens
        while True:
            with lock:
                i = next(counter)
            if i >= n:
                return
            due = t0 + i / rate
            if due > time.perf_counter():
                time.sleep(due - time.perf_counter())
            model = model_for(i)
            sent = time.perf_counter()
            try:
                r = session.post(f"{url}/v1/completions", timeout=60,
                                 json={"model": model, "prompt": PROMPTS[(i + prompt_offset) % len(PROMPTS)],
                                       "max_tokens": MAX_TOKENS})
                body = r.json() if r.status_code == 200 else {}
                status, text = r.status_code, "" if r.status_code == 200 else r.text[:200]
            except requests.RequestException as e:
                body, status, text = {}, 0, str(e)[:200]
            done = time.perf_counter()
            now = time.time()
            results[i] = {"ms": (done - sent) * 1000, "late_ms": max(0.0, sent - due) * 1000, "status": status,
                          "error": text, "model": model, "done_wall": now, "sent_wall": now - (done - sent),
                          "server_ms": body.get("streamtune", {}).get("latency_ms"),
                          "version": body.get("streamtune", {}).get("version"),
                          "tokens": body.get("usage", {}).get("completion_tokens")}

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


OURS: set[int] = {os.getpid()}  # this bench and the server it runs: the rest of the machine is "other"


def _jiffies() -> tuple[int, int]:
    """(CPU time the whole machine spent busy, CPU time of OURS), in clock ticks."""
    with open("/proc/stat") as f:
        t = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    ours = 0
    for pid in list(OURS):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ours += int(fields[11]) + int(fields[12])  # utime + stime, every thread
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return sum(t) - t[3] - t[4], ours


class CpuWatch:
    """How many CPUs other processes (the local stack included) kept busy while a block ran."""

    def __enter__(self) -> "CpuWatch":
        self.started, (self.busy, self.ours) = time.monotonic(), _jiffies()
        return self

    def __exit__(self, *exc) -> None:
        busy, ours = _jiffies()
        self.seconds = time.monotonic() - self.started
        self.other = max(0.0, (busy - self.busy - (ours - self.ours)) / os.sysconf("SC_CLK_TCK") / self.seconds)


def mean_other(watches: list[CpuWatch]) -> float:
    total = sum(w.seconds for w in watches)
    return sum(w.other * w.seconds for w in watches) / total if total else float("nan")


def ok_ms(results: list[dict]) -> list[float]:
    return [r["ms"] for r in results if r["status"] == 200]


def failures(results: list[dict]) -> list[str]:
    return [f"{r['status']}: {r['error']}" for r in results if r["status"] != 200]


class Broadcaster:
    def __init__(self, bootstrap: str, topic: str, store):
        from kafka import KafkaProducer

        self.topic, self.store = topic, store
        self.producer = KafkaProducer(bootstrap_servers=bootstrap, acks=1, linger_ms=0)

    def send(self, model_id: str, version: int, files: dict[str, bytes], sha256: str, aliases: list[str],
             flush: bool = True) -> None:
        from core.messages import AdapterVersionBroadcast

        uri = self.store.put(files, sha256)
        b = AdapterVersionBroadcast(version_id=f"{model_id}@bench#{version}", model_id=model_id, seq=version,
                                    mlflow_version=version, model_uri=f"models:/{model_id}/{version}",
                                    sha256=sha256, artifact_uri=uri, aliases=aliases)
        self.producer.send(self.topic, key=model_id.encode(), value=b.to_json().encode())
        if flush:
            self.producer.flush()

    def close(self) -> None:
        self.producer.flush()
        self.producer.close()


# -- 2. latency with and without swaps ----------------------------------------------
def measure_swaps_under_load(args, base: str, bootstrap: str, u: str, store, versions, tmp: Path) -> dict:
    from connectors.kafka import create_topic

    topic = f"bench.serving-{u}.swap.adapter-versions"
    create_topic(bootstrap, topic)
    model_id = f"swap-{u}"
    out = Broadcaster(bootstrap, topic, store)
    out.send(model_id, 1, *versions[0], ["champion", "candidate"])
    server = Server(base, re.escape(topic), store.uri[len("file://"):], tmp / "serve-swap.log", bootstrap)
    try:
        ready_s = server.wait_ready()
        server.wait_champions({model_id: 1})
        say(f"  server ready in {ready_s:.1f} s; warming up")
        paced_load(server.url, 60, args.rate, args.clients, lambda i: model_id)
        per_block = max(1, round(args.rate * args.block_seconds))
        pairs = math.ceil(args.requests / per_block)
        by_condition: dict[str, list[dict]] = {"no_swaps": [], "swaps": []}
        watches: dict[str, list[CpuWatch]] = {"no_swaps": [], "swaps": []}
        block_p95: dict[str, list[float]] = {"no_swaps": [], "swaps": []}
        published: dict[int, float] = {}
        next_version = [2]
        say(f"  {pairs} pairs of {args.block_seconds:g} s blocks ({per_block} requests each), with and without swaps, "
            "in turn (ABBA)")
        for pair in range(pairs):
            for condition in (("no_swaps", "swaps") if pair % 2 == 0 else ("swaps", "no_swaps")):
                stop = threading.Event()

                def publish() -> None:  # a new champion every second, from 0.5 s into the block
                    delay = 0.5
                    while not stop.wait(delay):
                        delay = 1.0
                        v = next_version[0]
                        files, sha = versions[(v - 1) % len(versions)]
                        published[v] = time.time()
                        out.send(model_id, v, files, sha, ["champion", "candidate"])
                        next_version[0] += 1

                publisher = threading.Thread(target=publish, daemon=True) if condition == "swaps" else None
                if publisher:
                    publisher.start()
                with CpuWatch() as watch:
                    results = paced_load(server.url, per_block, args.rate, args.clients, lambda i: model_id)
                stop.set()
                if publisher:
                    publisher.join()
                watches[condition].append(watch)
                by_condition[condition] += results
                block_p95[condition].append(pct(ok_ms(results), .95))
            if (pair + 1) % 5 == 0 or pair == pairs - 1:
                a, b = ok_ms(by_condition["no_swaps"]), ok_ms(by_condition["swaps"])
                say(f"  {pair + 1:2d}/{pairs} pairs: no swaps p50 {pct(a, .5):.1f} p95 {pct(a, .95):.1f} ms, "
                    f"swaps p50 {pct(b, .5):.1f} p95 {pct(b, .95):.1f} ms ({len(published)} versions published); "
                    f"other processes busy {mean_other(watches['no_swaps'][-5:] + watches['swaps'][-5:]):.2f} CPUs")
        # Publish → the first answer from that version (swap acknowledged under load).
        first_answer: dict[int, float] = {}
        for r in by_condition["swaps"]:
            v = r["version"]
            if v in published and (v not in first_answer or r["done_wall"] < first_answer[v]):
                first_answer[v] = r["done_wall"]
        visible = [(first_answer[v] - published[v]) * 1000 for v in published if v in first_answer]
        # Which requests of (b) a swap could touch: sent in the AFTER_PUBLISH_S after a publish.
        times = sorted(published.values())
        near = {True: [], False: []}
        for r in by_condition["swaps"]:
            if r["status"] == 200:
                before = [t for t in times if t <= r["sent_wall"]]
                near[bool(before) and r["sent_wall"] - before[-1] <= AFTER_PUBLISH_S].append(r["ms"])
        metrics = requests.get(f"{server.url}/metrics", timeout=10, headers=bearer_headers("read")).text
        acked = re.search(r'streamtune_serve_swaps_total\{alias="champion"\} ([0-9.e+]+)', metrics)
        result = {"model_id": model_id, "requests_per_condition": {c: len(r) for c, r in by_condition.items()},
                  "failures": {c: failures(r)[:5] for c, r in by_condition.items()},
                  "latency_ms": {c: stats(ok_ms(r)) for c, r in by_condition.items()},
                  "late_ms_p95": {c: pct([x["late_ms"] for x in r], .95) for c, r in by_condition.items()},
                  "tokens_mean": {c: statistics.fmean([x["tokens"] for x in r if x["tokens"] is not None])
                                  for c, r in by_condition.items()},
                  "versions_published": len(published),
                  "versions_served_in_swaps": len({r["version"] for r in by_condition["swaps"]}),
                  "champion_swaps_acknowledged": float(acked.group(1)) if acked else None,
                  "publish_to_first_answer_ms": stats(visible),
                  "server_side_ms": {c: stats([x["server_ms"] for x in r if x["server_ms"] is not None])
                                     for c, r in by_condition.items()},
                  "swaps_sent_after_publish_ms": stats(near[True]), "swaps_sent_otherwise_ms": stats(near[False]),
                  "other_processes_cpus": {c: mean_other(w) for c, w in watches.items()},
                  "blocks": {"pairs": pairs, "seconds": args.block_seconds, "requests_each": per_block,
                             "p95_ms": block_p95},
                  "paired_p95_ratio_median": statistics.median(
                      b / a for a, b in zip(block_p95["no_swaps"], block_p95["swaps"])),
                  "server_ready_s": ready_s}
        result["p95_ratio"] = result["latency_ms"]["swaps"]["p95"] / result["latency_ms"]["no_swaps"]["p95"]
        result["p50_ratio"] = result["latency_ms"]["swaps"]["p50"] / result["latency_ms"]["no_swaps"]["p50"]
        return result
    finally:
        out.close()
        server.stop()


# -- 3. 1, 100, 1,000 models ----------------------------------------------------------
def measure_fleet(args, base: str, bootstrap: str, u: str, store, versions, tmp: Path) -> list[dict]:
    from connectors.kafka import create_topic

    topic = f"bench.serving-{u}.fleet.adapter-versions"
    create_topic(bootstrap, topic)
    sizes = [int(s) for s in args.models.split(",")]
    assert len(versions) >= max(sizes)
    model_ids = [f"fleet-{u}-{i:04d}" for i in range(max(sizes))]
    out = Broadcaster(bootstrap, topic, store)
    out.send(model_ids[0], 1, *versions[0], ["champion"])
    server = Server(base, re.escape(topic), store.uri[len("file://"):], tmp / "serve-fleet.log", bootstrap)
    registered, asked, rows = 1, {model_ids[0]}, []
    try:
        ready_s = server.wait_ready()
        server.wait_champions({model_ids[0]: 1})
        rss_start = server.rss_mb()
        say(f"  server ready in {ready_s:.1f} s, RSS {rss_start:.0f} MiB with 1 model")
        hot_model = model_ids[0]
        for size in sizes:
            ack_s = 0.0
            if size > registered:
                sending = time.monotonic()
                for i in range(registered, size):
                    out.send(model_ids[i], 1, *versions[i], ["champion"], flush=False)
                out.producer.flush()
                server.wait_champions({m: 1 for m in model_ids[:size]})
                ack_s = time.monotonic() - sending  # first broadcast sent → all acknowledged
                say(f"  {size - registered} more models broadcast; all {size} champions acknowledged in {ack_s:.1f} s")
                registered = size
            rss_idle = server.rss_mb()
            paced_load(server.url, 20, args.rate, args.clients, lambda i: hot_model)  # back into a slot
            in_slot = {m for m, d in server.models().items() if d.get("hot")}
            cold_ids = [m for m in model_ids[:size] if m not in asked and m not in in_slot][:args.fleet_requests]
            asked |= set(cold_ids)
            hot, cold, watch_hot, watch_cold = [], [], [], []
            per_block = max(1, round(args.rate * args.block_seconds))
            while len(hot) < args.fleet_requests or len(cold) < len(cold_ids):  # hot and cold blocks in turn
                if len(hot) < args.fleet_requests:
                    with CpuWatch() as watch:
                        hot += paced_load(server.url, min(per_block, args.fleet_requests - len(hot)), args.rate,
                                          args.clients, lambda i: hot_model)
                    watch_hot.append(watch)
                todo = cold_ids[len(cold):len(cold) + per_block]
                if todo:
                    with CpuWatch() as watch:
                        cold += paced_load(server.url, len(todo), args.rate, args.clients, lambda i: todo[i])
                    watch_cold.append(watch)
            rss = server.rss_mb()
            row = {"models": size, "acknowledge_all_s": ack_s, "rss_mib_before_requests": rss_idle, "rss_mib": rss,
                   "hot_ms": stats(ok_ms(hot)), "cold_ms": stats(ok_ms(cold)),
                   "hot_failures": failures(hot)[:5], "cold_failures": failures(cold)[:5],
                   "hot_requests": len(hot), "cold_requests": len(cold),
                   "other_processes_cpus": {"hot": mean_other(watch_hot), "cold": mean_other(watch_cold)}}
            rows.append(row)
            say(f"  {size:5d} models: RSS {rss:.0f} MiB; hot p50 {row['hot_ms']['p50']:.1f} p95 "
                f"{row['hot_ms']['p95']:.1f} ms ({len(hot)}); cold p50 {row['cold_ms']['p50']:.1f} p95 "
                f"{row['cold_ms']['p95']:.1f} ms ({len(cold)}); failures {len(failures(hot)) + len(failures(cold))}; "
                f"other processes busy {mean_other(watch_hot + watch_cold):.2f} CPUs")
        for row in rows:
            row["server_ready_s"], row["rss_mib_start_1_model"] = ready_s, rss_start
        return rows
    finally:
        out.close()
        server.stop()


# -- report ---------------------------------------------------------------------------
def met(ok: bool) -> str:
    return "met" if ok else "NOT MET"


def report(swap: dict, under_load: dict, fleet: list[dict], args) -> None:
    s, ld, pa, gen = (swap["swap_ms"], swap["peft_load_adapter_ms"], swap["put_activate_ms"],
                      swap["generate_in_process_ms"])
    speedup, speedup_put = ld["p50"] / s["p50"], pa["p50"] / s["p50"]
    print()
    print(f"1. adapter swap vs load, in process ({s['n']} repetitions each; tiny Llama, rank-4 q/v adapter, CPU)")
    print(f"   {'':44s} {'p50':>9s} {'p95':>9s}   goal")
    print(f"   {'swap: AdapterPool.activate (tensor copy)':44s} {s['p50']:7.3f}ms {s['p95']:7.3f}ms   "
          f"p95 ≤ {SWAP_GOAL_MS:g} ms: {met(s['p95'] <= SWAP_GOAL_MS)}")
    print(f"   {'PeftModel.load_adapter from disk':44s} {ld['p50']:7.3f}ms {ld['p95']:7.3f}ms")
    print(f"   {'pool.put (parse bytes) + activate':44s} {pa['p50']:7.3f}ms {pa['p95']:7.3f}ms")
    print(f"   {'load_adapter / swap (p50)':44s} {speedup:8.1f}×             ≥ {SPEEDUP_GOAL:g}×: "
          f"{met(speedup >= SPEEDUP_GOAL)}")
    print(f"   {'put+activate / swap (p50)':44s} {speedup_put:8.1f}×")
    print(f"   {'(for scale) generate in process, hot':44s} {gen['p50']:7.3f}ms {gen['p95']:7.3f}ms   "
          f"{swap['generated_tokens_mean']:.1f} tokens on average")
    lat = under_load["latency_ms"]
    a, b = lat["no_swaps"], lat["swaps"]
    print()
    print(f"2. requests over HTTP to `streamtune serve` ({args.clients} client threads, {args.rate:g} requests/s, "
          f"max_tokens {MAX_TOKENS}, {under_load['blocks']['pairs']} ABBA pairs of {args.block_seconds:g} s blocks)")
    other = under_load["other_processes_cpus"]
    print(f"   {'':44s} {'p50':>9s} {'p95':>9s} {'n':>6s}   other processes busy")
    print(f"   {'(a) no swaps':44s} {a['p50']:7.2f}ms {a['p95']:7.2f}ms {a['n']:6d}   {other['no_swaps']:.2f} CPUs")
    print(f"   {'(b) a new champion every second':44s} {b['p50']:7.2f}ms {b['p95']:7.2f}ms {b['n']:6d}   "
          f"{other['swaps']:.2f} CPUs")
    print(f"   {'p95 (b) / (a)':44s} {under_load['p95_ratio']:8.3f}              ≤ {P95_RATIO_GOAL:.2f}: "
          f"{met(under_load['p95_ratio'] <= P95_RATIO_GOAL)}")
    print(f"   {'p95 (b) / (a), median over block pairs':44s} {under_load['paired_p95_ratio_median']:8.3f}")
    print(f"   {'p50 (b) / (a)':44s} {under_load['p50_ratio']:8.3f}")
    sa, sb = under_load["server_side_ms"]["no_swaps"], under_load["server_side_ms"]["swaps"]
    print(f"   {'(a) inside the server (ServedModels.complete)':44s} {sa['p50']:7.2f}ms {sa['p95']:7.2f}ms")
    print(f"   {'(b) inside the server (ServedModels.complete)':44s} {sb['p50']:7.2f}ms {sb['p95']:7.2f}ms")
    near, far = under_load["swaps_sent_after_publish_ms"], under_load["swaps_sent_otherwise_ms"]
    print(f"   {f'(b) sent ≤ {AFTER_PUBLISH_S * 1000:.0f} ms after a publish':44s} {near['p50']:7.2f}ms "
          f"{near['p95']:7.2f}ms {near['n']:6d}")
    print(f"   {'(b) the others':44s} {far['p50']:7.2f}ms {far['p95']:7.2f}ms {far['n']:6d}")
    v = under_load["publish_to_first_answer_ms"]
    print(f"   versions published during (b): {under_load['versions_published']}, served: "
          f"{under_load['versions_served_in_swaps']}; champion swaps acknowledged by the server: "
          f"{under_load['champion_swaps_acknowledged']:.0f}; publish → first answer from it p50 {v['p50']:.0f} ms "
          f"p95 {v['p95']:.0f} ms")
    fails = sum(len(f) for f in under_load["failures"].values())
    if fails:
        print(f"   failures: {under_load['failures']}")
    print()
    print(f"3. models registered (--slots {SLOTS} --cpu-cache {CPU_CACHE}; {args.rate:g} requests/s, "
          f"{args.clients} client threads; hot = one model in a slot asked again and again, cold = each request a "
          f"model never asked before and in no slot, its version in the CPU cache: a slot copy in the request)")
    print(f"   {'models':>6s} {'RSS MiB':>8s} {'hot p50':>9s} {'hot p95':>9s} {'n':>5s} {'cold p50':>9s} "
          f"{'cold p95':>9s} {'n':>5s} {'all acked in':>12s} {'other busy':>11s}")
    for r in fleet:
        h, c = r["hot_ms"], r["cold_ms"]
        cold = (f"{c['p50']:7.2f}ms {c['p95']:7.2f}ms" if c["n"] else f"{'n/a':>9s} {'n/a':>9s}")
        o = r["other_processes_cpus"]
        busy = f"{o['hot']:.2f}/{o['cold']:.2f}" if c["n"] else f"{o['hot']:.2f}/-"
        print(f"   {r['models']:6d} {r['rss_mib']:8.0f} {h['p50']:7.2f}ms {h['p95']:7.2f}ms {h['n']:5d} {cold} "
              f"{c['n']:5d} {r['acknowledge_all_s']:11.1f}s {busy:>11s}")
    print("   other busy: CPUs other processes (the local stack included) kept busy during the hot/cold blocks")
    if len(fleet) >= 2:
        first, last = fleet[0], fleet[-1]
        per = (last["rss_mib"] - first["rss_mib"]) * 1024 / max(1, last["models"] - first["models"])
        print(f"   RSS growth {first['models']} → {last['models']} models: "
              f"{last['rss_mib'] - first['rss_mib']:+.0f} MiB ({per:.0f} KiB per model)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=200, help="repetitions of each swap / load measurement")
    parser.add_argument("--requests", type=int, default=600, help="requests per condition, with and without swaps")
    parser.add_argument("--fleet-requests", type=int, default=300, help="hot (and at most cold) requests per size")
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second, paced")
    parser.add_argument("--clients", type=int, default=4, help="client threads")
    parser.add_argument("--block-seconds", type=float, default=2.0,
                        help="conditions alternate in blocks this long (with/without swaps, hot/cold)")
    parser.add_argument("--models", default="1,100,1000", help="model counts, growing")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "serving.json"))
    args = parser.parse_args()
    quiet_libraries()
    import logging
    logging.getLogger("kafka").setLevel(logging.ERROR)

    from connectors.artifact_store import ArtifactStore
    from streamtune.stack import StackConfig
    from streamtune.tinymodel import build_tiny_llama

    started, load_before = time.monotonic(), os.getloadavg()
    config = StackConfig.from_env()
    base = str(build_tiny_llama(config.data_dir / "models" / "tiny-llama"))
    u = f"{time.time_ns() % 10**9:x}"
    tmp = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    store = ArtifactStore(str(tmp / "store"))
    say(f"training a rank-4 adapter ({TRAIN_STEPS} steps) on {base}; logs and store in {tmp}")
    files = train_adapter(base)
    fleet_size = max(int(s) for s in args.models.split(","))
    swap_versions = variants(files, 16, offset=0)
    load_versions = variants(files, 64, offset=100)
    fleet_versions = variants(files, fleet_size, offset=1000)
    say(f"artifacts: {len(files['adapter_model.safetensors'])} bytes of weights each, "
        f"{16 + 64 + fleet_size} distinct sha256")

    say(f"1. swap vs PEFT load, {args.reps} repetitions each")
    swap = measure_swap(base, swap_versions, args.reps, tmp)
    say(f"   swap p50 {swap['swap_ms']['p50']:.3f} ms, load_adapter p50 {swap['peft_load_adapter_ms']['p50']:.3f} ms")

    say(f"2. request latency with and without a swap every second ({args.requests} requests per condition)")
    under_load = measure_swaps_under_load(args, base, config.kafka_bootstrap, u, store, load_versions, tmp)

    say(f"3. 1 → {fleet_size} models")
    fleet = measure_fleet(args, base, config.kafka_bootstrap, u, store, fleet_versions, tmp)

    report(swap, under_load, fleet, args)
    elapsed, load_after = time.monotonic() - started, os.getloadavg()
    print(f"\nload average (1/5/15 min) before {load_before[0]:.1f}/{load_before[1]:.1f}/{load_before[2]:.1f}, "
          f"after {load_after[0]:.1f}/{load_after[1]:.1f}/{load_after[2]:.1f} on {os.cpu_count()} CPUs "
          "(the bench itself keeps about 1.5 busy)")
    results = {
        "run": {"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "elapsed_s": round(elapsed, 1), "base_model": base,
                "cpu_count": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": load_after,
                "device": "cuda" if _cuda() else "cpu", "slots": SLOTS,
                "cpu_cache": CPU_CACHE, "rate_per_s": args.rate, "clients": args.clients, "max_tokens": MAX_TOKENS,
                "prompts": PROMPTS, "adapter": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"],
                                                "train_steps": TRAIN_STEPS,
                                                "weights_bytes": len(files["adapter_model.safetensors"])},
                "logs": str(tmp)},
        "goals": {"swap_p95_ms_max": SWAP_GOAL_MS, "load_over_swap_min": SPEEDUP_GOAL,
                  "p95_with_swaps_over_without_max": P95_RATIO_GOAL},
        "swap_vs_load": swap, "swaps_under_load": under_load, "models": fleet}
    results["met"] = {
        "swap_le_1ms": swap["swap_ms"]["p95"] <= SWAP_GOAL_MS,
        "load_ge_10x_swap": swap["peft_load_adapter_ms"]["p50"] / swap["swap_ms"]["p50"] >= SPEEDUP_GOAL,
        "p95_with_swaps_within_10pct": under_load["p95_ratio"] <= P95_RATIO_GOAL}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwritten {out} ({elapsed:.0f} s in all)")


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
