"""Serving under concurrent load over HTTP, as a user sees it: `streamtune serve`, and vLLM CPU beside it.

On each base shape (`tiny`: 64 wide, 2 layers; `30m`: 512 wide, 8 layers, 8 heads, the
shape bench/trainer_overhead.py uses), built from code by streamtune.tinymodel:

- 8 distinct LoRA adapters (rank 8 on q/v, random non-zero B: each answers its own way), one
  per model_id, each broadcast as version 1 (champion) on a bench broadcast topic;
- a real `streamtune serve` process following that topic (`--no-registry`), behind a bearer
  token (the bench's own where the environment holds none);
- requests over HTTP from client threads with their own keep-alive sessions: request i goes to
  adapter i mod 8 by its pinned name `<model_id>@v1`, a digit prompt, greedy, `--max-tokens`;
- arms: the same requests one at a time (`--sequential` of them), then 16 and 64 concurrent
  clients (`--requests` each, ≥ 200 where a p95 is quoted), then the same with `stream: true`:
  time to first token = send → the first SSE chunk with non-empty text.

Throughput ratio = requests/s at N clients ÷ requests/s one at a time, measured in the same run.
Goal (ours): ≥ 5× at 16 clients on `30m`.

vLLM arm (`--vllm-shape`, default `30m`: vLLM's CPU attention needs head_dim 32, 64, …; `tiny`
has 16): vLLM's OpenAI server started from its venv (scripts/vllm_env.sh), the same 8 adapter
directories loaded through vLLM's /v1/load_lora_adapter (names `<model_id>@v1`), the same
requests at `--vllm-clients` concurrency. Reported: throughput and p95 of each engine and
`streamtune serve` ÷ vLLM. Without the venv the arm is skipped with the reason printed.

Prints a table (each goal beside its figure, met or not) and writes bench/results/serving_load.json.

    .venv/bin/python bench/serving_load.py [--shapes tiny,30m] [--requests 256] [--sequential 64]
                                           [--clients 16,64] [--max-tokens 16] [--no-vllm]

Run it on a quiet machine: on 2 CPUs, client threads and server share the cores, and anything
else busy shows in every figure (the CPUs other processes used are printed per arm).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import requests  # noqa: E402

from serving import OURS, Broadcaster, CpuWatch, mean_other, serve_options  # noqa: E402
from serving_batching import adapter_files  # noqa: E402
from streamtune.auth import bearer_headers, client_token  # noqa: E402

SHAPES = {"tiny": {}, "30m": {"hidden_size": 512, "layers": 8, "heads": 8}}
GOAL_RATIO, GOAL_SHAPE, GOAL_CLIENTS = 5.0, "30m", 16
ADAPTERS, RANK = 8, 8
VLLM_HEAD_DIMS = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}  # connectors/vllm_target.py
VLLM_PYTHON = Path(os.environ.get("STREAMTUNE_VLLM_PYTHON",
                                  Path.home() / ".cache" / "streamtune" / "vllm-venv" / "bin" / "python"))
VLLM_KEY = "bench-vllm-key"


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else float("nan")


def head_dim(shape: str) -> int:
    p = SHAPES[shape]
    return p.get("hidden_size", 64) // p.get("heads", 4)


def descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


# -- load -------------------------------------------------------------------------------
class Load:
    """Requests over HTTP to one OpenAI-compatible server."""

    def __init__(self, url: str, headers: dict[str, str], names: list[str], prompts: list[str], max_tokens: int,
                 batches=None):
        self.url, self.headers, self.names, self.prompts = url, headers, names, prompts
        self.max_tokens, self.batches = max_tokens, batches  # batches(): (rows, batches) so far, where known

    def body(self, i: int, stream: bool) -> dict:
        return {"model": self.names[i % len(self.names)], "prompt": self.prompts[i % len(self.prompts)],
                "max_tokens": self.max_tokens, "temperature": 0, "stream": stream}

    def one(self, session: requests.Session, i: int, stream: bool) -> dict:
        sent = time.perf_counter()
        first, tokens, text = None, None, ""
        try:
            if not stream:
                r = session.post(f"{self.url}/v1/completions", json=self.body(i, False), timeout=300)
                if r.status_code != 200:
                    return {"ok": False, "error": f"{r.status_code}: {r.text[:200]}"}
                body = r.json()
                tokens = body.get("usage", {}).get("completion_tokens")
                text = body["choices"][0]["text"]
            else:
                with session.post(f"{self.url}/v1/completions", json=self.body(i, True), timeout=300,
                                  stream=True) as r:
                    if r.status_code != 200:
                        return {"ok": False, "error": f"{r.status_code}: {r.text[:200]}"}
                    buffer, chunks = b"", 0
                    for data in r.iter_content(chunk_size=None):  # as it arrives, not in fixed blocks
                        buffer += data
                        while b"\n\n" in buffer:
                            event, buffer = buffer.split(b"\n\n", 1)
                            line = event.strip()
                            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                                continue
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                return {"ok": False, "error": str(chunk["error"])[:200]}
                            for choice in chunk.get("choices") or []:
                                if choice.get("text"):
                                    chunks += 1
                                    text += choice["text"]
                                    if first is None:
                                        first = time.perf_counter() - sent
                    tokens = chunks  # a lower bound where a chunk holds several tokens
        except requests.RequestException as e:
            return {"ok": False, "error": str(e)[:200]}
        return {"ok": True, "s": time.perf_counter() - sent, "ttft_s": first, "tokens": tokens, "chars": len(text)}

    def run(self, n: int, clients: int, stream: bool = False, offset: int = 0) -> dict:
        """`n` requests from `clients` threads, each sending its next one as soon as its last is answered."""
        results: list[dict] = []
        counter, lock = iter(range(offset, offset + n)), threading.Lock()

        def client() -> None:
            session = requests.Session()
            session.headers.update(self.headers)
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                r = self.one(session, i, stream)
                with lock:
                    results.append(r)

        threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
        rows_before, batches_before = self.batches() if self.batches else (0, 0)
        with CpuWatch() as watch:
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            seconds = time.perf_counter() - started
        ok = [r for r in results if r["ok"]]
        latency = [r["s"] * 1000 for r in ok]
        out = {"clients": clients, "requests": n, "ok": len(ok), "seconds": round(seconds, 3),
               "requests_per_s": round(len(ok) / seconds, 2),
               "p50_ms": round(pct(latency, .5), 1), "p95_ms": round(pct(latency, .95), 1),
               "mean_completion_tokens": round(statistics.fmean([r["tokens"] for r in ok if r["tokens"] is not None]
                                                                or [float("nan")]), 2),
               "other_processes_cpus": round(watch.other, 2),
               "failures": [r["error"] for r in results if not r["ok"]][:5]}
        if self.batches:  # how full the server's batches were: why a ratio is what it is
            rows, batches = self.batches()
            out.update(batches=int(batches - batches_before),
                       mean_batch_rows=round((rows - rows_before) / max(1, batches - batches_before), 2))
        if stream:
            ttft = [r["ttft_s"] * 1000 for r in ok if r["ttft_s"] is not None]
            out.update(ttft_p50_ms=round(pct(ttft, .5), 1), ttft_p95_ms=round(pct(ttft, .95), 1), ttft_n=len(ttft))
        return out


def arms(load: Load, args, clients: list[int], label: str, sequential: bool = True, streamed: bool = True) -> dict:
    """Warm-up, then one at a time, then each concurrency, plain and streamed."""
    load.run(4 * ADAPTERS, max(clients), offset=1000)  # every adapter into its slot, the batch path warm
    out: dict = {}
    if sequential:
        out["sequential"] = load.run(args.sequential, 1)
        say(f"  {label}: one at a time {out['sequential']['requests_per_s']:.2f} requests/s "
            f"(p50 {out['sequential']['p50_ms']:.0f} ms, {out['sequential']['mean_completion_tokens']} tokens)")
    out["concurrent"], out["streamed"] = {}, {}
    for c in clients:
        r = out["concurrent"][str(c)] = load.run(args.requests, c)
        say(f"  {label}: {c} clients {r['requests_per_s']:.2f} requests/s, p50 {r['p50_ms']:.0f} p95 "
            f"{r['p95_ms']:.0f} ms, {r['mean_completion_tokens']} tokens, "
            + (f"{r['mean_batch_rows']} rows a batch, " if "mean_batch_rows" in r else "") + "other processes "
            f"{r['other_processes_cpus']:.2f} CPUs" + (f", failures {r['failures']}" if r["failures"] else ""))
        if streamed:
            s = out["streamed"][str(c)] = load.run(args.requests, c, stream=True)
            say(f"  {label}: {c} clients streamed {s['requests_per_s']:.2f} requests/s, first token p50 "
                f"{s['ttft_p50_ms']:.0f} p95 {s['ttft_p95_ms']:.0f} ms, whole p95 {s['p95_ms']:.0f} ms"
                + (f", failures {s['failures']}" if s["failures"] else ""))
    if sequential:
        seq = out["sequential"]["requests_per_s"]
        out["throughput_ratio"] = {c: round(r["requests_per_s"] / seq, 2) for c, r in out["concurrent"].items()}
    return out


# -- servers ----------------------------------------------------------------------------
class StreamtuneServer:
    """`streamtune serve` as a child process in its own session, following the bench's topic."""

    def __init__(self, base: Path, topic: str, store: Path, log_file: Path, bootstrap: str, args):
        from streamtune.local_job import spawn_logged
        from streamtune.testing import free_port

        self.url, self.log_file = None, log_file
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        extra = ["--no-auto-rollback"] if "--no-auto-rollback" in serve_options() else []
        self.proc = spawn_logged(
            [sys.executable, "-m", "streamtune.cli", "serve", "--port", str(port), "--base-model", str(base),
             "--no-registry", "--broadcast-topics", re.escape(topic), "--artifact-store", str(store),
             "--bootstrap-server", bootstrap, "--no-inference-log", "--slots", str(ADAPTERS),
             "--max-batch", str(args.max_batch), "--batch-window-ms", str(args.window_ms),
             "--batch-max-wait-ms", str(args.max_wait_ms), *extra],
            log_file)
        OURS.add(self.proc.pid)

    def wait_serving(self, model_ids: list[str], timeout: float = 300) -> float:
        started = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"streamtune serve exited ({self.proc.returncode}):\n"
                                 + self.log_file.read_text()[-3000:])
            try:
                r = requests.get(f"{self.url}/v1/models", timeout=5, headers=bearer_headers("inference"))
                cards = {m["id"]: m for m in r.json()["data"]} if r.status_code == 200 else {}
                if all(cards.get(m, {}).get("aliases", {}).get("champion") == 1 for m in model_ids):
                    return time.monotonic() - started
            except requests.RequestException:
                pass
            if time.monotonic() - started > timeout:
                raise SystemExit(f"streamtune serve: adapters not served in {timeout:.0f} s; see {self.log_file}")
            time.sleep(0.5)

    def batches(self) -> tuple[float, float]:
        """(rows, batches) decoded so far, from the server's `streamtune_serve_batch_size` histogram."""
        text = requests.get(f"{self.url}/metrics", timeout=10, headers=bearer_headers("read")).text
        found = dict(re.findall(r"^streamtune_serve_batch_size_(sum|count) ([0-9.e+]+)$", text, re.M))
        return float(found.get("sum", 0)), float(found.get("count", 0))

    def stop(self) -> None:
        from streamtune.local_job import kill_group

        kill_group(self.proc)
        OURS.discard(self.proc.pid)


class VllmServer:
    """vLLM's OpenAI server from its venv (as tests/test_vllm.py starts it), LoRA runtime loading on."""

    def __init__(self, base: Path, log_file: Path, threads: int):
        from streamtune.local_job import spawn_logged
        from streamtune.testing import free_port

        port = free_port()
        self.url, self.log_file = f"http://127.0.0.1:{port}", log_file
        self.proc = spawn_logged(
            [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(base),
             "--host", "127.0.0.1", "--port", str(port), "--api-key", VLLM_KEY, "--enable-lora",
             "--max-lora-rank", str(RANK), "--max-loras", str(ADAPTERS), "--max-model-len", "256",
             "--dtype", "float32"],
            log_file,
            extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "HF_HUB_OFFLINE": "1",
                       "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                       "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)})

    def wait_ready(self, timeout: float) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}): "
                                   + self.log_file.read_text(errors="replace")[-2000:])
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - started
            except requests.RequestException:
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM not healthy in {timeout:.0f} s; see {self.log_file}")

    def stop(self) -> None:
        import signal

        from streamtune.local_job import kill_group

        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except Exception:
                pass
        if self.proc.poll() is None:
            kill_group(self.proc)
        else:
            try:  # the engine's own processes, should any outlive the API server
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- one shape ------------------------------------------------------------------------
def build(shape: str, data_dir: Path, u: str) -> tuple[Path, list[str], list[dict[str, bytes]]]:
    from streamtune.tinymodel import build_tiny_llama

    base = build_tiny_llama(data_dir / "models" / f"bench-{shape}", **SHAPES[shape])
    model_ids = [f"load-{u}-{shape}-{i + 1}" for i in range(ADAPTERS)]
    files = [adapter_files(base, seed=i) for i in range(ADAPTERS)]
    return base, model_ids, files


def measure_shape(shape: str, args, config, u: str, tmp: Path, store, clients: list[int], prompts: list[str]):
    from connectors.artifact_store import artifact_sha256
    from connectors.kafka import create_topic

    base, model_ids, files = build(shape, config.data_dir, u)
    topic = f"bench.serving-load-{u}.{shape}.adapter-versions"
    create_topic(config.kafka_bootstrap, topic)
    out = Broadcaster(config.kafka_bootstrap, topic, store)
    for model_id, f in zip(model_ids, files):
        out.send(model_id, 1, f, artifact_sha256(f), ["champion"], flush=False)
    out.close()
    server = StreamtuneServer(base, topic, Path(store.uri[len("file://"):]), tmp / f"serve-{shape}.log",
                              config.kafka_bootstrap, args)
    try:
        ready_s = server.wait_serving(model_ids)
        say(f"  {shape}: `streamtune serve` serving {ADAPTERS} adapters in {ready_s:.1f} s ({base})")
        names = [f"{m}@v1" for m in model_ids]  # pinned: one version, one adapter, in either engine
        load = Load(server.url, bearer_headers("inference"), names, prompts, args.max_tokens, server.batches)
        result = arms(load, args, clients, shape, streamed=not args.no_stream)
    finally:
        server.stop()
    result.update(base=str(base), head_dim=head_dim(shape), server_ready_s=round(ready_s, 1), **SHAPES[shape])
    return result, base, model_ids, files


def measure_vllm(shape: str, base: Path, model_ids: list[str], files: list[dict[str, bytes]], args, tmp: Path,
                 prompts: list[str]) -> dict:
    server = VllmServer(base, tmp / f"vllm-{shape}.log", threads=os.cpu_count() or 1)
    try:
        ready_s = server.wait_ready(args.vllm_start_timeout)
        headers = {"Authorization": f"Bearer {VLLM_KEY}"}
        started = time.perf_counter()
        for model_id, f in zip(model_ids, files):  # the saved adapter directories, by their pinned names
            d = tmp / "vllm-adapters" / shape / model_id
            d.mkdir(parents=True)
            for name, data in f.items():
                (d / name).write_bytes(data)
            r = requests.post(f"{server.url}/v1/load_lora_adapter", headers=headers, timeout=120,
                              json={"lora_name": f"{model_id}@v1", "lora_path": str(d)})
            if r.status_code != 200:
                raise RuntimeError(f"vLLM refused {model_id}@v1: {r.status_code} {r.text[:300]}")
        load_s = time.perf_counter() - started
        say(f"  vLLM healthy in {ready_s:.0f} s; {ADAPTERS} adapters loaded in {load_s:.1f} s")
        for p in descendants(server.proc.pid):
            OURS.add(p)
        load = Load(server.url, headers, [f"{m}@v1" for m in model_ids], prompts,
                    args.max_tokens)
        result = arms(load, args, [args.vllm_clients], f"{shape} vLLM", sequential=False, streamed=not args.no_stream)
        result.update(ready_s=round(ready_s, 1), adapters_load_s=round(load_s, 2))
        return result
    finally:
        server.stop()


# -- report ---------------------------------------------------------------------------
def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report(results: dict) -> None:
    rows: list[tuple[str, str, str]] = []
    for shape, s in results["shapes"].items():
        seq = s["sequential"]
        rows.append((f"{shape}: one at a time, requests/s (n={seq['ok']})",
                     f"{seq['requests_per_s']:.2f} (p50 {seq['p50_ms']:.0f} ms)", ""))
        for c, r in s["concurrent"].items():
            ratio = s["throughput_ratio"][c]
            goal = (f"≥ {GOAL_RATIO:g}×: {met(ratio >= GOAL_RATIO)}"
                    if shape == GOAL_SHAPE and int(c) == GOAL_CLIENTS else "(no goal set)")
            rows.append((f"{shape}: {c} clients ÷ one at a time, throughput",
                         f"{ratio:.2f}× ({r['requests_per_s']:.1f} req/s)", goal))
            rows.append((f"{shape}: {c} clients, latency (n={r['ok']})",
                         f"p50 {r['p50_ms']:.0f} / p95 {r['p95_ms']:.0f} ms", ""))
            if "mean_batch_rows" in r:
                rows.append((f"{shape}: {c} clients, rows a batch in the server (mean)", f"{r['mean_batch_rows']:.1f}",
                             f"(--max-batch {results['max_batch']})"))
            st = s["streamed"].get(c)
            if st:
                rows.append((f"{shape}: {c} clients streamed, first token (n={st['ttft_n']})",
                             f"p50 {st['ttft_p50_ms']:.0f} / p95 {st['ttft_p95_ms']:.0f} ms", ""))
    v = results["vllm"]
    if "skipped" in v:
        rows.append(("vLLM CPU arm", "skipped", v["skipped"]))
    else:
        c = str(v["clients"])
        a, b = v["streamtune"], v["vllm"]
        rows.append((f"{v['shape']}, {c} clients: streamtune serve (n={a['ok']})",
                     f"{a['requests_per_s']:.1f} req/s, p95 {a['p95_ms']:.0f} ms", ""))
        rows.append((f"{v['shape']}, {c} clients: vLLM CPU (n={b['ok']})",
                     f"{b['requests_per_s']:.1f} req/s, p95 {b['p95_ms']:.0f} ms", ""))
        rows.append((f"{v['shape']}, {c} clients: streamtune ÷ vLLM, throughput", f"{v['throughput_ratio']:.2f}",
                     "(no goal set)"))
        rows.append((f"{v['shape']}, {c} clients: streamtune ÷ vLLM, p95 latency", f"{v['p95_ratio']:.2f}",
                     "(no goal set)"))
        st = v["vllm_streamed"]
        if st:
            rows.append((f"{v['shape']}, {c} clients streamed: vLLM first token (n={st['ttft_n']})",
                         f"p50 {st['ttft_p50_ms']:.0f} / p95 {st['ttft_p95_ms']:.0f} ms", ""))
    print()
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':{width}s}  {'figure':>32s}   goal")
    for measure, figure, goal in rows:
        print(f"{measure:{width}s}  {figure:>32s}   {goal}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="tiny,30m", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--requests", type=int, default=256, help="requests per concurrent arm (≥ 200 for a p95)")
    parser.add_argument("--sequential", type=int, default=64, help="requests one at a time")
    parser.add_argument("--clients", default="16,64", help="concurrent clients, one arm each")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=16, help="`streamtune serve --max-batch` (its default)")
    parser.add_argument("--window-ms", type=float, default=5.0, help="`streamtune serve --batch-window-ms`")
    parser.add_argument("--max-wait-ms", type=float, default=50.0, help="`streamtune serve --batch-max-wait-ms`")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM CPU arm")
    parser.add_argument("--vllm-shape", default="30m")
    parser.add_argument("--vllm-clients", type=int, default=16)
    parser.add_argument("--vllm-start-timeout", type=float, default=300)
    parser.add_argument("--no-stream", action="store_true", help="skip the streamed arms")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "serving_load.json"))
    args = parser.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    clients = [int(c) for c in args.clients.split(",") if c]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}: known {list(SHAPES)}")
    if args.requests < 200:
        say(f"--requests {args.requests} < 200: the p95 figures below rest on fewer requests than the bench quotes")

    from streamtune.demo import quiet_libraries

    quiet_libraries()
    import logging

    logging.getLogger("kafka").setLevel(logging.ERROR)
    from connectors.artifact_store import ArtifactStore
    from streamtune.stack import StackConfig
    from streamtune.tinymodel import digit_pairs

    if not client_token("inference"):  # the server behind a token, as deployed: the bench's own
        os.environ["STREAMTUNE_API_TOKEN"] = secrets.token_hex(16)
    started, load_before = time.monotonic(), os.getloadavg()
    config = StackConfig.from_env()
    u = f"{time.time_ns() % 10**9:x}"
    tmp = Path(tempfile.mkdtemp(prefix="bench-serving-load-"))
    store = ArtifactStore(str(tmp / "store"))
    prompts = [p for p, _ in digit_pairs(64, seed=5)]
    say(f"{ADAPTERS} adapters (rank {RANK}, q/v) per shape, shapes {shapes}, clients {clients}; logs in {tmp}")

    results: dict = {"date": time.strftime("%Y-%m-%d"), "adapters": ADAPTERS, "rank": RANK,
                     "max_tokens": args.max_tokens, "max_batch": args.max_batch, "window_ms": args.window_ms,
                     "max_wait_ms": args.max_wait_ms,
                     "requests": args.requests, "sequential": args.sequential, "clients": clients,
                     "goal": {"ratio": GOAL_RATIO, "shape": GOAL_SHAPE, "clients": GOAL_CLIENTS},
                     "cpu_count": os.cpu_count(), "shapes": {}}
    built = {}
    for shape in shapes:
        say(f"{shape}: `streamtune serve`")
        result, base, model_ids, files = measure_shape(shape, args, config, u, tmp, store, clients, prompts)
        results["shapes"][shape] = result
        built[shape] = (base, model_ids, files)

    vs = args.vllm_shape
    if args.no_vllm:
        results["vllm"] = {"skipped": "--no-vllm"}
    elif not VLLM_PYTHON.exists():
        results["vllm"] = {"skipped": f"no vLLM venv at {VLLM_PYTHON} (bash scripts/vllm_env.sh builds it)"}
    elif vs not in built:
        results["vllm"] = {"skipped": f"--vllm-shape {vs} not among --shapes {args.shapes}"}
    elif head_dim(vs) not in VLLM_HEAD_DIMS:
        results["vllm"] = {"skipped": f"{vs} has head_dim {head_dim(vs)}, which vLLM's CPU attention does not take"}
    elif str(args.vllm_clients) not in results["shapes"][vs]["concurrent"]:
        results["vllm"] = {"skipped": f"--vllm-clients {args.vllm_clients} not among --clients {args.clients}"}
    else:
        say(f"{vs}: vLLM CPU, {args.vllm_clients} clients, the same adapters and requests")
        try:
            v = measure_vllm(vs, *built[vs], args, tmp, prompts)
        except RuntimeError as e:
            results["vllm"] = {"skipped": f"vLLM did not serve: {str(e)[:300]}"}
            say(f"  {results['vllm']['skipped']}")
        else:
            c = str(args.vllm_clients)
            ours, theirs = results["shapes"][vs]["concurrent"][c], v["concurrent"][c]
            results["vllm"] = {"shape": vs, "clients": args.vllm_clients, "streamtune": ours, "vllm": theirs,
                               "vllm_streamed": v["streamed"].get(c), "vllm_ready_s": v["ready_s"],
                               "vllm_adapters_load_s": v["adapters_load_s"],
                               "throughput_ratio": round(ours["requests_per_s"] / theirs["requests_per_s"], 2),
                               "p95_ratio": round(ours["p95_ms"] / theirs["p95_ms"], 2)}

    goal = results["shapes"].get(GOAL_SHAPE, {}).get("throughput_ratio", {}).get(str(GOAL_CLIENTS))
    results["throughput_ratio_goal_shape"] = goal
    results["met"] = None if goal is None else goal >= GOAL_RATIO
    report(results)
    elapsed, load_after = time.monotonic() - started, os.getloadavg()
    results.update(elapsed_s=round(elapsed, 1), loadavg_before=load_before, loadavg_after=load_after, logs=str(tmp))
    print(f"\nload average (1 min) before {load_before[0]:.1f}, after {load_after[0]:.1f} on {os.cpu_count()} CPUs")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    say(f"wrote {out} ({elapsed:.0f} s in all)")
    shutil.rmtree(tmp / "store", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
