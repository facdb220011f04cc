"""`streamtune demo`: the main job end to end on the local stack.

It brings the stack up, saves a tiny Llama (built from a config, tokenizer trained here)
as an HF directory, submits jobs/stream_finetune.py to the local Flink cluster, registers a
config for a demo model, streams learnable feedback (`x=1234;y=` → `2345`, each digit +1)
plus a few malformed records, registers versions in MLflow as their checkpoints complete,
then loads the `champion` adapter from MLflow with plain PEFT and reports held-out exact
match before and after. Beside the job, `streamtune serve` follows the versions as they are
registered: the same held-out prompts, asked over HTTP, are answered by the base model
first and then by each new champion as it swaps in (served exact match, live).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import uuid
import warnings
from pathlib import Path

from connectors.kafka import read_topic
from core import transport
from core.messages import AdapterVersionBroadcast, FinetuneSpec

from .feedback import digit_samples, producer, send_config, send_samples
from .stack import Stack, StackConfig, StackError
from .stack.flink import cancel_job, submit_detached

REPO = Path(__file__).resolve().parents[1]
WINDOW_SECONDS, SAMPLES_PER_WINDOW, WINDOWS = 4, 64, 14
MALFORMED = [b"{not json", b'{"model_id": "x"}', b"[1, 2, 3]", b'{"prompt": 5}']


def quiet_libraries() -> None:
    """Our progress lines replace MLflow's run links and the libraries' progress bars."""
    for var in ("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "HF_HUB_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(var, "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)


def demo_spec(model_id: str, feedback_topic: str) -> FinetuneSpec:
    return FinetuneSpec.model_validate({
        "model_id": model_id, "stream_source": f"kafka://topic={feedback_topic}",
        "adapter_config": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]},
        "trigger_policy": {"min_samples_per_window": SAMPLES_PER_WINDOW, "window_seconds": WINDOW_SECONDS},
        "training": {"lr": 0.01, "micro_batch_size": 32, "epochs": 4}, "seed": 7})


def champion_exact_match(config: StackConfig, model_id: str, base_dir: Path, held_out: list) -> tuple[float, float]:
    """Exact match of the bare base and of base + the MLflow `champion` adapter, via plain PEFT."""
    import mlflow
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .tinymodel import exact_match

    tokenizer = AutoTokenizer.from_pretrained(base_dir, local_files_only=True)
    base = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True)
    baseline = exact_match(base, tokenizer, held_out)
    mlflow.set_tracking_uri(config.mlflow_uri)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{model_id}@champion", dst_path=tmp)
        # The version's source is its MLflow pyfunc model; the PEFT files are its `adapter` artifact.
        tuned = PeftModel.from_pretrained(base, Path(model_dir) / "artifacts" / "adapter")
        return baseline, exact_match(tuned, tokenizer, held_out)


class DemoServer:
    """`streamtune serve` for the demo's broadcast topic, as a child process."""

    def __init__(self, config: StackConfig, base_dir: Path, topic: str, log_file: Path,
                 artifact_store: Path | None = None, extra_args: tuple[str, ...] = ()):
        import re
        import sys

        from .local_job import spawn_logged
        from .testing import free_port

        self.url = f"http://127.0.0.1:{free_port()}"
        self.proc = spawn_logged([sys.executable, "-m", "streamtune.cli", "serve", "--port", self.url.rsplit(":", 1)[1],
                                  "--base-model", str(base_dir), "--bootstrap-server", config.kafka_bootstrap,
                                  "--tracking-uri", config.mlflow_uri, "--broadcast-topics", re.escape(topic),
                                  "--artifact-store", str(artifact_store or config.data_dir / "adapters"),
                                  "--no-auto-rollback", *extra_args],
                                 log_file)
        self.log_file = log_file
        # The server reads the same environment: where it holds tokens, calls carry one.
        from .auth import bearer_headers
        self.headers = bearer_headers("inference")

    def wait_ready(self, timeout_s: float) -> None:
        import requests

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise StackError(f"streamtune serve did not get ready in {timeout_s:.0f} s (its log: {self.log_file})")

    def exact_match(self, model: str, pairs: list) -> tuple[float, int | None]:
        """Served exact match of `model` on (prompt, completion) pairs, and the version that answered."""
        import requests

        hits, version = 0, None
        for prompt, completion in pairs:
            r = requests.post(f"{self.url}/v1/completions", timeout=60, headers=self.headers,
                              json={"model": model, "prompt": prompt, "max_tokens": 8})
            r.raise_for_status()
            body = r.json()
            hits += body["choices"][0]["text"].strip() == completion
            version = body["streamtune"]["version"]
        return hits / len(pairs), version

    def wait_for_champion(self, model_id: str, version: int, timeout_s: float) -> None:
        """Until the server acknowledged `version` as champion (it follows within about 1 s)."""
        import requests

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            models = requests.get(f"{self.url}/v1/models", timeout=10, headers=self.headers).json()["data"]
            if any(m["id"] == model_id and m.get("aliases", {}).get("champion") == version for m in models):
                return
            time.sleep(0.05)

    def stop(self) -> None:
        from .local_job import kill_group

        kill_group(self.proc)


def follow_broadcasts(config: StackConfig, topic: str, count: int, timeout_s: float, say,
                      on_version=lambda broadcast: None, seen: dict[str, int] | None = None) -> dict[str, int]:
    """version_id → MLflow version, from the adapter-versions topic, until `count` arrived
    (`seen`: those already reported by an earlier call, updated in place)."""
    from kafka import KafkaConsumer, TopicPartition

    from connectors.kafka import seek_to_first

    consumer = KafkaConsumer(bootstrap_servers=config.kafka_bootstrap, enable_auto_commit=False,
                             auto_offset_reset="earliest", fetch_max_wait_ms=100, **transport.kafka_python_kwargs())
    consumer.assign([TopicPartition(topic, 0)])
    seek_to_first(consumer, [TopicPartition(topic, 0)])
    seen = {} if seen is None else seen
    deadline = time.monotonic() + timeout_s
    try:
        while len(seen) < count and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                for r in records:
                    b = AdapterVersionBroadcast.from_json(r.value)
                    if b.version_id not in seen:  # a replay may broadcast a version again
                        seen[b.version_id] = b.mlflow_version
                        say(f"registered {b.model_id} v{b.mlflow_version} (seq {b.seq}) "
                            f"aliases {', '.join(b.aliases)}")
                        on_version(b)
    finally:
        consumer.close()
    return seen


def run_demo(config: StackConfig, as_json: bool = False) -> int:
    from .tinymodel import build_tiny_llama, digit_pairs

    say = (lambda line: None) if as_json else (lambda line: print(line, flush=True))
    quiet_libraries()
    Stack(config).up(echo=say)
    run = uuid.uuid4().hex[:6]
    model_id = f"digits-demo-{run}"
    topics = {k: f"streamtune.demo-{run}.{k}" for k in ("feedback", "configs", "versions", "dlq", "adapter-versions")}
    base_dir = build_tiny_llama(config.data_dir / "models" / "tiny-llama")
    say(f"base model: {base_dir}")
    server = DemoServer(config, base_dir, topics["adapter-versions"], config.log_dir / f"serve-demo-{run}.log")
    try:
        return _run(config, as_json, say, run, model_id, topics, base_dir, server)
    finally:
        server.stop()


def _run(config: StackConfig, as_json: bool, say, run: str, model_id: str, topics: dict, base_dir: Path,
         server: DemoServer) -> int:
    from .tinymodel import digit_pairs

    held_out = digit_pairs(200, seed=999)
    server.wait_ready(120)
    served_before, _ = server.exact_match("base", held_out[:50])
    say(f"serving at {server.url}: base model, held-out exact match {served_before:.2f} (50 prompts)")

    job_id = submit_detached(config, REPO / "jobs" / "stream_finetune.py", [
        "--bootstrap-server", config.kafka_bootstrap, "--feedback-topic", topics["feedback"],
        "--config-topic", topics["configs"], "--versions-topic", topics["versions"],
        "--dlq-topic", topics["dlq"], "--broadcast-topic", topics["adapter-versions"], "--base-model", str(base_dir),
        "--artifact-store", str(config.data_dir / "adapters"), "--tracking-uri", config.mlflow_uri,
        "--checkpoint-interval-ms", "2000", "--job-name", f"demo-{run}"])
    say(f"job {job_id} submitted to {config.flink_rest_url}")

    train = digit_pairs(SAMPLES_PER_WINDOW * WINDOWS, seed=1, exclude={p[2:6] for p, _ in held_out})
    window_ms = WINDOW_SECONDS * 1000
    start = (int(time.time() * 1000) // window_ms - WINDOWS - 2) * window_ms
    send_config(config.kafka_bootstrap, topics["configs"], demo_spec(model_id, topics["feedback"]), start)
    samples = digit_samples(model_id, train, start, window_ms / SAMPLES_PER_WINDOW, id_prefix=f"{run}-")
    # One later sample closes the last window (event time only moves with the data).
    closer = digit_samples(model_id, train[:1], start + WINDOWS * window_ms, 1, id_prefix=f"{run}-closer-")
    bad = producer(config.kafka_bootstrap)
    for payload in MALFORMED:
        bad.send(topics["feedback"], payload, timestamp_ms=start)
    bad.flush()
    bad.close()

    # Feedback arrives window by window: each window's first sample closes the one before, the
    # job trains and registers it, the server swaps it in, and the held-out prompts are asked
    # again over HTTP (the served exact match, live).
    live: list[dict] = []

    def served_now(b: AdapterVersionBroadcast) -> None:
        if "champion" in b.aliases:
            server.wait_for_champion(model_id, b.mlflow_version, timeout_s=5)
            score, version = server.exact_match(model_id, held_out[:50])
            live.append({"version": version, "exact_match": score})
            say(f"  served: {model_id} answered by v{version}, held-out exact match {score:.2f} (50 prompts)")

    registered: dict[str, int] = {}
    sent = 0
    for w in range(WINDOWS + 1):
        batch = samples[w * SAMPLES_PER_WINDOW:(w + 1) * SAMPLES_PER_WINDOW] if w < WINDOWS else closer
        sent += send_samples(config.kafka_bootstrap, topics["feedback"], batch)
        if w > 0:  # the job registers its committed versions in MLflow and broadcasts each
            follow_broadcasts(config, topics["adapter-versions"], w, timeout_s=120, say=say, on_version=served_now,
                              seen=registered)
    say(f"sent {sent} feedback samples ({WINDOWS} windows of {SAMPLES_PER_WINDOW}) and {len(MALFORMED)} malformed records")
    cancel_job(config, job_id)
    say(f"job {job_id} cancelled")
    if len(registered) < WINDOWS:
        raise StackError(f"only {len(registered)} of {WINDOWS} versions registered in 300 s")

    dlq = read_topic(config.kafka_bootstrap, topics["dlq"], expect=len(MALFORMED), timeout=20)
    baseline, final = champion_exact_match(config, model_id, base_dir, held_out)
    served_final, served_version = server.exact_match(model_id, held_out)
    summary = {"model_id": model_id, "versions": len(registered),
               "baseline_exact_match": baseline, "final_exact_match": final,
               "served_exact_match": served_final, "served_version": served_version,
               "served_live": live, "serve_url": server.url,
               "samples": sent, "dlq": len(dlq), "tracking_uri": config.mlflow_uri}
    if as_json:
        print(json.dumps(summary))
    else:
        say(f"held-out exact match: {baseline:.2f} before, {final:.2f} with models:/{model_id}@champion; "
            f"served by streamtune serve (v{served_version}): {served_final:.2f}")
        say(json.dumps(summary, indent=2))
    return 0
