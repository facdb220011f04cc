"""Versions reach MLflow in every deployment, with nothing started by hand (marker `deploy`).

The training job registers its own committed versions (operators/registration.py): through
the API started as a process, through `flink run -py` alone, and (tests/test_cdc.py) through
jobs/cdc_retrain.py. MLflow stopped mid-stream only delays registration; a bad artifact is
reported and never registered.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from connectors.artifact_store import WEIGHTS
from core.messages import AdapterVersionBroadcast, DeadLetter, VersionRecord
from streamtune.feedback import digit_samples, send_config, send_samples
from streamtune.local_job import kill_group, spawn_logged
from streamtune.stack.flink import cancel_job, job_state, submit_detached
from streamtune.stack.mlflow import MLflow
from streamtune.testing import (free_port, job_args, job_report, job_topics, restored_and_running, spec, wait_for,
                                wait_for_records)
from streamtune.tinymodel import digit_pairs

pytestmark = pytest.mark.deploy
REPO = Path(__file__).resolve().parents[1]
TOKEN = "deploy-test-token"


def mlflow_client(stack_config):
    from mlflow import MlflowClient

    return MlflowClient(stack_config.mlflow_uri, stack_config.mlflow_uri)


def registered(client, model_id: str) -> list:
    """The model's MLflow versions, oldest first ([] before the model exists)."""
    return sorted(client.search_model_versions(f"name = '{model_id}'"), key=lambda v: int(v.version))


LOAD_CHAMPION = r"""
import hashlib, json, sys, tempfile
from pathlib import Path
import mlflow
from peft import PeftModel
from transformers import AutoModelForCausalLM
model_id, base = sys.argv[1], sys.argv[2]
with tempfile.TemporaryDirectory() as tmp:
    model_dir = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{model_id}@champion", dst_path=tmp))
    local = model_dir / "artifacts" / "adapter"  # the PEFT files inside the version's MLflow model
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), local)
    print(json.dumps({"sha256": hashlib.sha256((local / "manifest.json").read_bytes()).hexdigest(),
                      "lora_tensors": sum("lora_" in n for n, _ in model.named_parameters())}))
"""


def test_api_process_registers_versions_loadable_from_another_process(stack_config, base_model, unique, tmp_path):
    """`streamtune api` as a process, a plain Kafka client, versions over the API, the champion
    loaded elsewhere from `models:/<id>@champion` with only the MLflow URI."""
    from kafka import KafkaProducer

    port = free_port()
    api = spawn_logged([sys.executable, "-m", "streamtune.cli", "api", "--port", str(port)], tmp_path / "api.log",
                       extra_env={"STREAMTUNE_API_TOKEN": TOKEN})
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {TOKEN}"}
    model_id, topic = f"deploy-{unique}", f"test.deploy-{unique}"
    try:
        wait_for(lambda: _answers(f"{url}/healthz"), 60, "the API to listen")
        r = requests.post(f"{url}/v1/stream-finetune", headers=auth, timeout=120, json={
            "model_id": model_id, "stream_source": f"kafka://topic={topic}",
            "adapter_config": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
            "trigger_policy": {"min_samples_per_window": 8, "window_seconds": 2}, "training": {"lr": 0.01}})
        assert r.status_code == 202, r.text
        wait_for(lambda: requests.get(f"{url}/v1/stream-finetune/{model_id}", timeout=10, headers=auth).json()["job_state"]
                 == "RUNNING", 90, "the job to run")
        # A plain client: JSON values, the event time as the record timestamp.
        producer = KafkaProducer(bootstrap_servers=stack_config.kafka_bootstrap, acks="all")
        t0 = (int(time.time() * 1000) // 2000 + 1) * 2000
        for i, (prompt, completion) in enumerate(digit_pairs(31, seed=21)):
            ts = t0 + i * 200 if i < 30 else t0 + 12_000  # three windows of 10, then a closer
            value = {"model_id": model_id, "sample_id": f"u{i}", "prompt": prompt, "completion": completion, "ts": ts}
            producer.send(topic, json.dumps(value).encode(), timestamp_ms=ts)
        producer.flush()
        producer.close()

        versions = wait_for(lambda: _versions(url, model_id, 3), 150, "3 versions listed by the API")
        assert [v["seq"] for v in versions] == [1, 2, 3] and all(v["samples"] == 10 for v in versions)
        # A version is listed once it exists; its aliases move just after, before its broadcast.
        wait_for_records(stack_config.kafka_bootstrap, f"{topic}.adapter-versions", AdapterVersionBroadcast, 3, 60)
        champion = mlflow_client(stack_config).get_model_version_by_alias(model_id, "champion")
        loaded = subprocess.run([sys.executable, "-c", LOAD_CHAMPION, model_id, str(base_model)], capture_output=True,
                                text=True, timeout=300, cwd=tmp_path,
                                env={"PATH": os.environ["PATH"], "HOME": str(tmp_path),
                                     "MLFLOW_TRACKING_URI": stack_config.mlflow_uri, "HF_HUB_OFFLINE": "1"})
        assert loaded.returncode == 0, loaded.stderr[-3000:]
        result = json.loads(loaded.stdout.strip().splitlines()[-1])
        assert result["sha256"] == champion.tags["streamtune.sha256"] and result["lora_tensors"] > 0
        r = requests.delete(f"{url}/v1/stream-finetune/{model_id}", headers=auth, timeout=300)
        assert r.status_code == 200 and r.json()["job_stopped"], r.text
    finally:
        kill_group(api)


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


def _versions(url: str, model_id: str, count: int):
    r = requests.get(f"{url}/v1/models/{model_id}/versions", timeout=10, headers={"Authorization": f"Bearer {TOKEN}"})
    versions = r.json()["versions"] if r.status_code == 200 else []
    return sorted(versions, key=lambda v: v["seq"]) if len(versions) >= count else None


def stream_windows(bootstrap: str, topic: str, model_id: str, t0: int, windows: int,
                   stop: threading.Event) -> threading.Thread:
    """A live stream in a thread: one 2 s window of 10 samples every 2 s of wall time, until `stop`."""
    pairs = digit_pairs(windows * 10, seed=8)

    def stream():
        for w in range(windows):
            if stop.is_set():
                return
            send_samples(bootstrap, topic, digit_samples(model_id, pairs[w * 10:(w + 1) * 10], t0 + w * 2000, 200,
                                                         f"w{w}-"))
            stop.wait(2)

    producer = threading.Thread(target=stream, daemon=True)
    producer.start()
    return producer


@pytest.fixture
def cluster_job(stack_config, base_model, unique, tmp_path):
    """`flink run -py jobs/stream_finetune.py` alone, 1 s checkpoints; yields (topics, store, start)."""
    topics = job_topics(stack_config.kafka_bootstrap, f"test.deploy-{unique}")
    store = tmp_path / "store"
    jobs: list[str] = []

    def start(*extra: str) -> str:
        jobs.append(submit_detached(stack_config, REPO / "jobs" / "stream_finetune.py", job_args(
            topics, base_model, store, "--bootstrap-server", stack_config.kafka_bootstrap, "--tracking-uri",
            stack_config.mlflow_uri, "--checkpoint-interval-ms", "1000", "--job-name", f"deploy-{unique}", *extra)))
        wait_for(lambda: job_state(stack_config, jobs[-1]) == "RUNNING", 60, "the job to run")
        return jobs[-1]

    yield topics, store, start
    for job in jobs:
        cancel_job(stack_config, job)


def test_flink_run_alone_registers_and_broadcasts(stack_config, cluster_job, unique):
    topics, store, start = cluster_job
    start()
    model_id, t0 = f"run-{unique}", 1_770_000_000_000
    boot = stack_config.kafka_bootstrap
    send_config(boot, topics["configs"], spec(model_id, topics, min_samples=8, window_seconds=2), t0)
    samples = digit_samples(model_id, digit_pairs(40, seed=5), t0, 200)  # four 2 s windows of 10
    send_samples(boot, topics["feedback"], samples + digit_samples(model_id, digit_pairs(1, seed=6), t0 + 20_000, 1, "c"))
    broadcasts = wait_for_records(boot, topics["adapter-versions"], AdapterVersionBroadcast, 4, 120)
    committed = {v.version_id: v for v in wait_for_records(boot, topics["versions"], VersionRecord, 4, 30)}
    client = mlflow_client(stack_config)
    mvs = registered(client, model_id)
    assert [int(mv.tags["streamtune.seq"]) for mv in mvs] == [1, 2, 3, 4]
    assert {mv.tags["streamtune.version_id"] for mv in mvs} == set(committed) == {b.version_id for b in broadcasts}
    for mv in mvs:
        record = committed[mv.tags["streamtune.version_id"]]
        # The store URI travels everywhere; it names the artifact by its manifest's sha256.
        assert mv.tags["streamtune.artifact_uri"] == record.artifact_uri
        assert record.artifact_uri == f"file://{store}/{record.sha256}"
        files = {f.path for f in client.list_artifacts(mv.run_id, "adapter")}
        assert files == {"adapter/adapter_config.json", f"adapter/{WEIGHTS}", "adapter/manifest.json"}
    assert all(b.artifact_uri == committed[b.version_id].artifact_uri for b in broadcasts)
    assert client.get_registered_model(model_id).aliases["candidate"] == mvs[-1].version


def test_mlflow_outage_delays_registration_never_training(stack_config, cluster_job, unique):
    """MLflow stopped for 60 s mid-stream: versions keep being committed; afterwards every one
    is registered exactly once, in seq order, with no gap."""
    topics, _, start = cluster_job
    start()
    boot, model_id, t0 = stack_config.kafka_bootstrap, f"outage-{unique}", 1_771_000_000_000
    send_config(boot, topics["configs"], spec(model_id, topics, min_samples=8, window_seconds=2), t0)
    stop = threading.Event()
    producer = stream_windows(boot, topics["feedback"], model_id, t0, 40, stop)
    mlflow = MLflow(stack_config)
    try:
        wait_for_records(boot, topics["adapter-versions"], AdapterVersionBroadcast, 1, 120)
        mlflow.stop()
        outage_started = time.monotonic()
        committed_at_stop = len(wait_for_records(boot, topics["versions"], VersionRecord, 0, 0))
        time.sleep(60)  # the outage under test: its length is the point, not a wait for state
        committed_during = len(wait_for_records(boot, topics["versions"], VersionRecord, 0, 0)) - committed_at_stop
        assert committed_during >= 10, f"training stalled while MLflow was down: {committed_during} new versions"
        assert time.monotonic() - outage_started >= 60
    finally:
        if not mlflow.safe_healthy():
            mlflow.start()
    stop.set()
    producer.join(timeout=30)
    client = mlflow_client(stack_config)

    def caught_up():  # every committed version registered (the last windows may still commit)
        committed = {v.version_id for v in wait_for_records(boot, topics["versions"], VersionRecord, 0, 0)}
        mvs = registered(client, model_id)
        return mvs if {mv.tags["streamtune.version_id"] for mv in mvs} == committed else None

    mvs = wait_for(caught_up, 180, "registration to catch up", interval=3)
    seqs = [int(mv.tags["streamtune.seq"]) for mv in mvs]
    assert seqs == list(range(1, len(mvs) + 1)), f"registered once each, in seq order, no gap: {seqs}"
    assert len(mvs) >= committed_at_stop + committed_during

    def unfinished():  # a version's run gets its params and metrics just after its broadcast
        return [mv.version for mv in mvs if client.get_run(mv.run_id).info.status != "FINISHED"]

    wait_for(lambda: not unfinished(), 60, "every version's run to finish", interval=1)
    for mv in mvs:
        data = client.get_run(mv.run_id).data
        assert data.params["adapter.rank"] and "loss_after" in data.metrics, (mv.version, data)


def test_bad_artifact_is_reported_not_registered(stack_config, cluster_job, unique):
    """An artifact deleted, another altered, between training and registration (15 s periodic
    checkpoints leave the window; a checkpoint asked for as each version is trained would close
    it in well under a second, a race this test could lose): each goes to the DLQ with its
    reason; the next versions register."""
    topics, store, start = cluster_job
    start("--checkpoint-interval-ms", "15000", "--no-checkpoint-on-version")
    boot, model_id, t0 = stack_config.kafka_bootstrap, f"bad-{unique}", 1_772_000_000_000
    send_config(boot, topics["configs"], spec(model_id, topics, min_samples=8, window_seconds=2), t0)
    pairs = digit_pairs(50, seed=3)
    send_samples(boot, topics["feedback"], digit_samples(model_id, pairs[:20], t0, 200))  # windows 1, 2
    send_samples(boot, topics["feedback"], digit_samples(model_id, pairs[20:21], t0 + 4000, 1, "x"))  # closes 2
    # Both artifacts are written when their windows fire, before the checkpoint commits them.
    written = wait_for(lambda: len(_artifacts(store)) >= 2 and _artifacts(store), 60, "two artifacts in the store",
                       interval=0.1)
    first, second = sorted(written, key=lambda p: p.stat().st_mtime)[:2]
    for f in first.iterdir():
        f.unlink()
    first.rmdir()
    (second / WEIGHTS).write_bytes(b"tampered" + (second / WEIGHTS).read_bytes())
    send_samples(boot, topics["feedback"], digit_samples(model_id, pairs[21:40], t0 + 4200, 100, "y")
                 + digit_samples(model_id, pairs[40:41], t0 + 20_000, 1, "z"))
    dlq = wait_for_records(boot, topics["dlq"], DeadLetter, 2, 120, predicate=lambda d: d.kind == "version")
    assert sorted(d.reason for d in dlq) == ["artifact_integrity", "artifact_integrity"]
    details = " | ".join(d.detail for d in dlq)
    assert f"{first.name} does not exist" in details and "sha256 mismatch" in details, details
    bad = {VersionRecord.from_json(d.payload).version_id for d in dlq}
    later = wait_for_records(boot, topics["adapter-versions"], AdapterVersionBroadcast, 1, 120)
    mvs = registered(mlflow_client(stack_config), model_id)
    assert mvs and bad.isdisjoint(mv.tags["streamtune.version_id"] for mv in mvs)
    assert {int(mv.tags["streamtune.seq"]) for mv in mvs} == {b.seq for b in later} and min(b.seq for b in later) > 2
    digest = hashlib.sha256((store / mvs[0].tags["streamtune.sha256"] / "manifest.json").read_bytes()).hexdigest()
    assert digest == mvs[0].tags["streamtune.sha256"]


def _artifacts(store: Path) -> list[Path]:
    return [p for p in store.glob("*") if p.is_dir() and not p.name.startswith(".tmp-")] if store.exists() else []


def test_taskmanager_killed_while_registering_loses_nothing_registers_nothing_twice(
        stack_config, cluster_job, unique):
    """kill -9 of the TaskManager when a committed version is not registered yet; a new
    TaskManager takes over from the last checkpoint: every version registered exactly once."""
    import signal

    from streamtune.stack.flink import Flink

    topics, _, start = cluster_job
    job = start()
    boot, model_id, t0 = stack_config.kafka_bootstrap, f"tmkill-{unique}", 1_773_000_000_000
    send_config(boot, topics["configs"], spec(model_id, topics, min_samples=8, window_seconds=2), t0)
    stop = threading.Event()
    producer = stream_windows(boot, topics["feedback"], model_id, t0, 30, stop)
    flink, client = Flink(stack_config), mlflow_client(stack_config)
    try:
        wait_for_records(boot, topics["adapter-versions"], AdapterVersionBroadcast, 2, 120)

        pending = first_unregistered(boot, topics["versions"], client, model_id, 60)
        (victim,) = flink.taskmanager_pids()
        os.kill(victim, signal.SIGKILL)
        killed_at_ms = time.time() * 1000
        flink.start_taskmanager()
        wait_for(lambda: victim not in flink.taskmanager_pids() and flink.taskmanager_pids(), 30, "a new TaskManager")
        wait_for(lambda: restored_and_running(stack_config, job) and _restarts(stack_config, job) >= 1, 120,
                 "the job to run again after the restart")
        producer.join(timeout=120)
    finally:
        stop.set()

    def caught_up():
        committed = {v.version_id for v in wait_for_records(boot, topics["versions"], VersionRecord, 0, 0)}
        mvs = registered(client, model_id)
        return mvs if {mv.tags["streamtune.version_id"] for mv in mvs} == committed else None

    mvs = wait_for(caught_up, 180, "registration to catch up", interval=3)
    version_ids = [mv.tags["streamtune.version_id"] for mv in mvs]
    assert len(version_ids) == len(set(version_ids)), "no version registered twice"
    assert [int(mv.tags["streamtune.seq"]) for mv in mvs] == list(range(1, len(mvs) + 1)), "none lost, in order"
    assert len(mvs) >= 20
    (was_pending,) = [mv for mv in mvs if mv.tags["streamtune.version_id"] == pending]
    assert was_pending.creation_timestamp > killed_at_ms, "the kill landed before that version was registered"


def first_unregistered(bootstrap: str, topic: str, client, model_id: str, timeout: float) -> str:
    """The version_id of the first committed version seen before MLflow has it: read as the
    versions commit (20 ms polls), MLflow asked at each new one (registration takes a few
    hundred ms, a full re-read of the topic took longer)."""
    from streamtune.testing import committed_reader

    consumer = committed_reader(bootstrap, topic)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fresh = [VersionRecord.from_json(r.value).version_id
                     for records in consumer.poll(timeout_ms=20).values() for r in records]
            if fresh:
                have = {mv.tags["streamtune.version_id"] for mv in registered(client, model_id)}
                missing = [v for v in fresh if v not in have]
                if missing:
                    return missing[0]
        raise AssertionError(f"no committed version seen unregistered within {timeout} s")
    finally:
        consumer.close()


@pytest.mark.guarantees
def test_taskmanager_killed_while_training_loses_nothing_trains_nothing_twice(stack_config, cluster_job, unique):
    """kill -9 of the TaskManager after a window's closing sample reached the trainer and before
    its version was emitted (a long step: 100 epochs), with the window before it checkpointed;
    the window is trained again from that checkpoint: every sample in exactly one version,
    each version registered once, in order."""
    import signal

    from streamtune.stack.flink import Flink
    from streamtune.testing import records_read

    topics, _, start = cluster_job
    job = start()
    boot, model_id, t0 = stack_config.kafka_bootstrap, f"trainkill-{unique}", 1_774_000_000_000
    # A step of about 10 s (90 samples, 100 epochs): the kill, aimed from Flink's metrics
    # (fetched every 2 s), must fall inside it. 30 samples (3-4 s) once let the version out
    # first in CI.
    per_window = 90
    send_config(boot, topics["configs"], spec(model_id, topics, min_samples=8, window_seconds=2,
                                              training={"lr": 0.01, "micro_batch_size": 8, "epochs": 100}), t0)
    pairs = digit_pairs(4 * per_window, seed=21)
    # 2 s windows of 90 samples: the first sample of each window closes the one before.
    windows = [digit_samples(model_id, pairs[w * per_window:(w + 1) * per_window], t0 + w * 2000,
                             2000 / per_window, f"w{w}-") for w in range(4)]
    # Window 0 and one sample of window 1 first: at start-up the first window may close by the
    # trainer's idle timer, which closes every pending window, and window 1 must not close with it.
    send_samples(boot, topics["feedback"], windows[0] + windows[1][:1])
    wait_for_records(boot, topics["versions"], VersionRecord, 1, 120)  # window 0 trained and checkpointed
    send_samples(boot, topics["feedback"], windows[1][1:] + windows[2][:1])  # closes window 1: its long step starts
    flink, client = Flink(stack_config), mlflow_client(stack_config)
    wait_for(lambda: records_read(stack_config, job, "lora-trainer") >= 1 + 2 * per_window + 1, 60,
             "window 1's closing sample to reach the trainer", interval=0.1)
    (victim,) = flink.taskmanager_pids()
    os.kill(victim, signal.SIGKILL)
    flink.start_taskmanager()
    wait_for(lambda: victim not in flink.taskmanager_pids() and flink.taskmanager_pids(), 30, "a new TaskManager")
    wait_for(lambda: restored_and_running(stack_config, job) and _restarts(stack_config, job) >= 1, 120,
             "the job to run again after the restart")
    restored = requests.get(f"{stack_config.flink_rest_url}/jobs/{job}/checkpoints", timeout=5).json()["latest"]
    assert restored.get("restored"), "the restart restored a checkpoint"
    send_samples(boot, topics["feedback"], windows[2][1:] + windows[3][:1])  # closes window 2

    versions = sorted(wait_for_records(boot, topics["versions"], VersionRecord, 3, 240), key=lambda v: v.seq)
    assert len(versions) >= 3, f"training stalled after the restore, {len(versions)} of 3 versions committed: " \
                               f"{job_report(stack_config, job)}"
    try:
        mvs = wait_for(lambda: (r := registered(client, model_id)) and len(r) >= 3 and r, 240, "3 registered versions")
    except AssertionError as timeout:
        raise AssertionError(f"{timeout}: {job_report(stack_config, job)}; registered "
                             f"{[mv.tags.get('streamtune.seq') for mv in registered(client, model_id)]}") from None
    # The kill fell before window 1's version was emitted: no copy of it from the killed run
    # exists, even among records of aborted transactions.
    every_copy = wait_for_records(boot, topics["versions"], VersionRecord, 0, 0, read_committed=False)
    assert sorted(v.seq for v in every_copy) == [1, 2, 3], \
        f"the killed run emitted nothing after window 0 (window 1's step took {versions[1].metrics})"
    assert [set(v.lineage.sample_ids) for v in versions] == [{s.sample_id for s in w} for w in windows[:3]], \
        "each window trained whole, once, none lost"
    assert [int(mv.tags["streamtune.seq"]) for mv in mvs] == [1, 2, 3]
    assert [mv.tags["streamtune.version_id"] for mv in mvs] == [v.version_id for v in versions]


def _restarts(stack_config, job_id: str) -> int:
    r = requests.get(f"{stack_config.flink_rest_url}/jobs/{job_id}/metrics", params={"get": "numRestarts"}, timeout=5)
    values = [int(float(m["value"])) for m in r.json()] if r.ok else []
    return values[0] if values else 0
