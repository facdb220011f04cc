"""`streamtune demo`: the main job end to end on the local stack.

It brings the stack up, saves a tiny Llama (built from a config, tokenizer trained here)
as an HF directory, submits jobs/stream_finetune.py to the local Flink cluster, registers a
config for a demo model, streams learnable feedback (`x=1234;y=` → `2345`, each digit +1)
plus a few malformed records, registers versions in MLflow as their checkpoints complete,
then loads the `champion` adapter from MLflow with plain PEFT and reports held-out exact
match before and after.
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
        adapter = mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{model_id}@champion", dst_path=tmp)
        tuned = PeftModel.from_pretrained(base, adapter)
        return baseline, exact_match(tuned, tokenizer, held_out)


def follow_broadcasts(config: StackConfig, topic: str, count: int, timeout_s: float, say) -> dict[str, int]:
    """version_id → MLflow version, from the adapter-versions topic, until `count` arrived."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=config.kafka_bootstrap, enable_auto_commit=False,
                             fetch_max_wait_ms=100)
    consumer.assign([TopicPartition(topic, 0)])
    consumer.seek_to_beginning()
    seen: dict[str, int] = {}
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

    job_id = submit_detached(config, REPO / "jobs" / "stream_finetune.py", [
        "--bootstrap", config.kafka_bootstrap, "--feedback-topic", topics["feedback"],
        "--config-topic", topics["configs"], "--versions-topic", topics["versions"],
        "--dlq-topic", topics["dlq"], "--broadcast-topic", topics["adapter-versions"], "--base-model", str(base_dir),
        "--artifact-store", str(config.data_dir / "adapters"), "--tracking-uri", config.mlflow_uri,
        "--checkpoint-interval-ms", "2000", "--job-name", f"demo-{run}"])
    say(f"job {job_id} submitted to {config.flink_rest_url}")

    held_out = digit_pairs(200, seed=999)
    train = digit_pairs(SAMPLES_PER_WINDOW * WINDOWS, seed=1, exclude={p[2:6] for p, _ in held_out})
    window_ms = WINDOW_SECONDS * 1000
    start = (int(time.time() * 1000) // window_ms - WINDOWS - 2) * window_ms
    send_config(config.kafka_bootstrap, topics["configs"], demo_spec(model_id, topics["feedback"]), start)
    samples = digit_samples(model_id, train, start, window_ms / SAMPLES_PER_WINDOW, id_prefix=f"{run}-")
    # One later sample closes the last window (event time only moves with the data).
    closer = digit_samples(model_id, train[:1], start + WINDOWS * window_ms, 1, id_prefix=f"{run}-closer-")
    sent = send_samples(config.kafka_bootstrap, topics["feedback"], samples + closer)
    bad = producer(config.kafka_bootstrap)
    for payload in MALFORMED:
        bad.send(topics["feedback"], payload, timestamp_ms=start)
    bad.flush()
    bad.close()
    say(f"sent {sent} feedback samples ({WINDOWS} windows of {SAMPLES_PER_WINDOW}) and {len(MALFORMED)} malformed records")

    # The job registers its committed versions in MLflow and broadcasts each: follow the broadcasts.
    registered = follow_broadcasts(config, topics["adapter-versions"], WINDOWS, timeout_s=300, say=say)
    cancel_job(config, job_id)
    say(f"job {job_id} cancelled")
    if len(registered) < WINDOWS:
        raise StackError(f"only {len(registered)} of {WINDOWS} versions registered in 300 s")

    dlq = read_topic(config.kafka_bootstrap, topics["dlq"], expect=len(MALFORMED), timeout=20)
    baseline, final = champion_exact_match(config, model_id, base_dir, held_out)
    summary = {"model_id": model_id, "versions": len(registered),
               "baseline_exact_match": baseline, "final_exact_match": final,
               "samples": sent, "dlq": len(dlq), "tracking_uri": config.mlflow_uri}
    if as_json:
        print(json.dumps(summary))
    else:
        say(f"held-out exact match: {baseline:.2f} before, {final:.2f} with models:/{model_id}@champion")
        say(json.dumps(summary, indent=2))
    return 0
