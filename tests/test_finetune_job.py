"""The streaming fine-tuning job on the local Flink cluster: routing, DLQ, carry-over, hot config.

One job per scenario, submitted with `flink run -d -py`; assertions read the job's output
topics and compare them with what the test produced.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.messages import DeadLetter, FeedbackSample, RetrainTrigger, VersionRecord
from connectors.artifact_store import ArtifactStore
from streamtune.testing import job_args, job_topics, records_read, spec, spec_fields, wait_for, wait_for_records
from streamtune.feedback import digit_samples, send_config, send_raw, send_samples
from streamtune.stack.flink import cancel_job, job_counters, job_state, submit_detached
from streamtune.tinymodel import digit_pairs

pytestmark = pytest.mark.finetune
REPO = Path(__file__).resolve().parents[1]
T0 = 1_750_000_000_000  # event time of the scenarios (windows are epoch aligned)


def wait_until_running(config, job_id: str, timeout: float = 60) -> None:
    """Until the job runs (records sent before that wait in Kafka, in order)."""
    wait_for(lambda: job_state(config, job_id) == "RUNNING", timeout, "the job to run", interval=0.5)


def wait_until_trainer_read(config, job_id: str, count: int, timeout: float = 60) -> None:
    """Until the trainer has received `count` records: what it received, it handles in order."""
    wait_for(lambda: records_read(config, job_id, "lora-trainer") >= count, timeout,
             f"the trainer to receive {count} records", interval=0.2)


def malformed_records(n: int, model_id: str, seed: int) -> list[tuple[bytes, str]]:
    """n bad payloads of several kinds, with the reason code the job must give each."""
    rng = random.Random(seed)
    good = {"model_id": model_id, "sample_id": "x", "prompt": "x=1;y=", "completion": "2", "ts": T0}
    kinds = [
        (lambda i: f'{{"model_id": "{model_id}", "broken'.encode(), "bad_json"),
        (lambda i: json.dumps({**good, "completion": ""}).encode(), "schema"),
        (lambda i: json.dumps({k: v for k, v in good.items() if k != "prompt"}).encode(), "schema"),
        (lambda i: json.dumps({**good, "weight": "heavy"}).encode(), "schema"),
        (lambda i: json.dumps({**good, "label": "maybe"}).encode(), "schema"),
        (lambda i: json.dumps({**good, "model_id": "has spaces!"}).encode(), "schema"),
        (lambda i: json.dumps([1, 2, i]).encode(), "schema"),
        (lambda i: json.dumps({**good, "prompt": "x" * 70000}).encode(), "oversized"),
        (lambda i: b"\x00\x01 binary", "bad_json"),
    ]
    return [(make(i), reason) for i in range(n) for make, reason in [rng.choice(kinds)]]


@pytest.fixture(scope="module")
def scenario(stack_config, base_model, tmp_path_factory):
    """Two models, a model whose config comes late, an unknown model, 1000 malformed records."""
    from kafka import KafkaProducer

    u = f"{time.time_ns() % 10**9:x}"
    topics = job_topics(stack_config.kafka_bootstrap, f"test.scenario-{u}")
    models = {"a": f"a-{u}", "b": f"b-{u}", "late": f"late-{u}", "ghost": f"ghost-{u}"}
    artifacts = tmp_path_factory.mktemp("adapters")
    job = submit_detached(stack_config, REPO / "jobs" / "stream_finetune.py", job_args(
        topics, base_model, artifacts, "--bootstrap-server", stack_config.kafka_bootstrap,
        "--unknown-model-grace-seconds", "10", "--checkpoint-interval-ms", "1000", "--job-name", f"scenario-{u}"))
    try:
        send_config(stack_config.kafka_bootstrap, topics["configs"], spec(models["a"], topics, rank=4, min_samples=8), T0)
        send_config(stack_config.kafka_bootstrap, topics["configs"],
                    spec(models["b"], topics, rank=8, targets=("q_proj",), min_samples=5, window_seconds=3), T0)
        pairs = digit_pairs(400, seed=3)
        # 20 s of event time: a at 10/s, b at 5/s; the late model's samples precede its config.
        samples = (digit_samples(models["a"], pairs[:200], T0, 100, id_prefix="a")
                   + digit_samples(models["b"], pairs[200:300], T0, 200, id_prefix="b")
                   + digit_samples(models["late"], pairs[300:340], T0, 250, id_prefix="late")
                   + digit_samples(models["ghost"], pairs[340:343], T0, 1000, id_prefix="ghost"))
        samples.sort(key=lambda s: s.ts)
        bad = malformed_records(1000, models["a"], seed=5)
        producer = KafkaProducer(bootstrap_servers=stack_config.kafka_bootstrap, acks="all")
        # The late model's first samples reach the running job, then its config follows a
        # moment later: within the grace period, so none of its samples may be dead-lettered.
        wait_until_running(stack_config, job)
        first_late = [s for s in samples if s.model_id == models["late"]][:5]
        for s in first_late:
            producer.send(topics["feedback"], s.to_json().encode(), timestamp_ms=s.ts)
        producer.flush()
        wait_until_trainer_read(stack_config, job, 2 + len(first_late))  # two configs, then these samples
        send_config(stack_config.kafka_bootstrap, topics["configs"],
                    spec(models["late"], topics, min_samples=10, window_seconds=5), T0 + 1000)
        # The backlog below is read beside the config topic and trains windows of a and b as it
        # goes: sent before the trainer has the config, it can hold the config past the grace
        # period on a loaded machine (CI saw it). "Moments later" means: before the backlog.
        wait_until_trainer_read(stack_config, job, 2 + len(first_late) + 1)
        samples = [s for s in samples if s not in first_late]
        sent_bad, per_sample = [], -(-len(bad) // len(samples))
        for i, s in enumerate(samples):
            producer.send(topics["feedback"], s.to_json().encode(), timestamp_ms=s.ts)
            for payload, reason in bad[i * per_sample:(i + 1) * per_sample]:
                sent_bad.append((producer.send(topics["feedback"], payload, timestamp_ms=s.ts), reason))
        producer.flush()
        bad_offsets = {future.get(timeout=10).offset: reason for future, reason in sent_bad}
        samples = first_late + samples
        # Samples 25 s later close every window above (and the ghost's grace period).
        closers = [s.model_copy(update={"sample_id": f"closer-{s.model_id}", "ts": T0 + 45_000})
                   for s in digit_samples(models["a"], pairs[:1], T0, 1) + digit_samples(models["b"], pairs[:1], T0, 1)
                   + digit_samples(models["late"], pairs[:1], T0, 1)]
        send_samples(stack_config.kafka_bootstrap, topics["feedback"], closers)
        expected_windows = 10 + 7 + 2  # a: 20 s in 2 s windows; b: 3 s windows (epoch aligned); late: 5 s
        versions = wait_for_records(stack_config.kafka_bootstrap, topics["versions"], VersionRecord, expected_windows,
                                    timeout=180)
        dlq = wait_for_records(stack_config.kafka_bootstrap, topics["dlq"], DeadLetter, len(bad_offsets) + 3,
                               timeout=60)
        yield {"job": job, "topics": topics, "models": models, "artifacts": artifacts, "samples": samples, "bad_offsets": bad_offsets,
               "versions": versions, "dlq": dlq, "closers": closers}
    finally:
        cancel_job(stack_config, job)


def test_malformed_records_go_to_dlq_each_with_its_reason(scenario):
    dlq = [d for d in scenario["dlq"] if d.reason != "unknown_model"]
    by_offset = {d.source.offset: d for d in dlq}
    assert len(dlq) == len(by_offset) == 1000, "each malformed record dead-lettered exactly once"
    assert {o: d.reason for o, d in by_offset.items()} == scenario["bad_offsets"]
    assert all(d.detail and d.source.topic == scenario["topics"]["feedback"] for d in dlq)
    payload = next(d for d in dlq if d.reason == "bad_json").payload
    assert payload.startswith('{"model_id"') or "binary" in payload, "the original payload is kept"


def test_unknown_model_is_dead_lettered_after_grace_and_late_config_loses_nothing(scenario):
    ghost = scenario["models"]["ghost"]
    unknown = [d for d in scenario["dlq"] if d.reason == "unknown_model"]
    assert sorted(FeedbackSample.from_json(d.payload).sample_id for d in unknown) == ["ghost0", "ghost1", "ghost2"]
    assert all(d.model_id == ghost and "grace" in d.detail for d in unknown)
    late = scenario["models"]["late"]
    trained = [sid for v in scenario["versions"] if v.model_id == late for sid in v.lineage.sample_ids]
    assert sorted(trained) == sorted(f"late{i}" for i in range(40))


def test_two_models_get_separate_adapters_and_version_sequences(scenario):
    a, b = scenario["models"]["a"], scenario["models"]["b"]
    versions = scenario["versions"]
    va = [v for v in versions if v.model_id == a]
    vb = [v for v in versions if v.model_id == b]
    assert [v.seq for v in va] == list(range(1, len(va) + 1)) and len(va) == 10
    assert [v.seq for v in vb] == list(range(1, len(vb) + 1)) and len(vb) == 7
    assert {(v.adapter.rank, tuple(v.adapter.target_modules)) for v in va} == {(4, ("q_proj", "v_proj"))}
    assert {(v.adapter.rank, tuple(v.adapter.target_modules)) for v in vb} == {(8, ("q_proj",))}
    ids_a = {s for v in va for s in v.lineage.sample_ids}
    ids_b = {s for v in vb for s in v.lineage.sample_ids}
    assert ids_a == {f"a{i}" for i in range(200)} and ids_b == {f"b{i}" for i in range(100)}
    store = ArtifactStore(str(scenario["artifacts"]))
    assert all(v.artifact_uri.startswith(store.uri + "/") and store.get(v.artifact_uri, v.sha256) for v in va + vb)
    assert len({v.artifact_uri for v in va + vb}) == len(va) + len(vb)


def test_counts_reconcile_every_valid_sample_in_exactly_one_version(scenario):
    lineage = [s for v in scenario["versions"] for s in v.lineage.sample_ids]
    assert len(lineage) == len(set(lineage)), "no sample trained twice"
    produced_valid = {s.sample_id for s in scenario["samples"]} | {c.sample_id for c in scenario["closers"]}
    dead = {FeedbackSample.from_json(d.payload).sample_id for d in scenario["dlq"] if d.reason == "unknown_model"}
    # A closer waits for a later window, unless the idle close let it join samples carried over.
    pending = {c.sample_id for c in scenario["closers"]} - set(lineage)
    assert set(lineage) | dead | pending == produced_valid
    assert len(lineage) + len(dead) + len(pending) == len(produced_valid)
    records_in = len(scenario["samples"]) + len(scenario["closers"]) + len(scenario["bad_offsets"])
    dead_lettered = len(scenario["dlq"])
    assert records_in == len(lineage) + len(pending) + dead_lettered


def test_job_counters_reconcile_with_what_was_sent(scenario, stack_config):
    """The running job's own Flink counters (REST metrics), not counts the test derives."""
    sent = {"samples": len(scenario["samples"]) + len(scenario["closers"]), "configs": 3,
            "malformed": len(scenario["bad_offsets"])}
    trained = sum(len(v.lineage.sample_ids) for v in scenario["versions"])
    expected = {"validate.records_in": sum(sent.values()), "validate.valid": sent["samples"] + sent["configs"],
                "validate.dead_lettered": sent["malformed"], "lora-trainer.samples_trained": trained,
                "lora-trainer.windows_fired": len(scenario["versions"]),
                "lora-trainer.unknown_model_dead_lettered": 3}
    counters: dict[str, int] = {}

    def caught_up() -> bool:  # Flink publishes metrics every few seconds
        counters.update(job_counters(stack_config.flink_rest_url, scenario["job"]))
        return all(counters.get(k) == v for k, v in expected.items())

    try:
        wait_for(caught_up, 60, "the job's counters")
    finally:
        assert {k: counters.get(k) for k in expected} == expected
    unknown = counters["lora-trainer.unknown_model_dead_lettered"]
    assert counters["validate.valid"] - sent["configs"] == trained + unknown + len(scenario["closers"])


def test_demo_champion_lifts_held_out_exact_match(stack_config):
    result = subprocess.run([sys.executable, "-m", "streamtune.cli", "demo", "--json"], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["baseline_exact_match"] <= 0.05
    assert summary["final_exact_match"] >= 0.9
    assert summary["versions"] == 14 and summary["dlq"] == 4 and summary["samples"] == 897
    assert summary["tracking_uri"] == stack_config.mlflow_uri


def test_hot_config_takes_effect_at_next_window_and_invalid_config_is_dead_lettered(
        stack_config, base_model, tmp_path, unique):
    """min_samples 10 → 20 and rank 4 → 8 mid-stream; an invalid config that must not apply;
    then a retrain trigger that trains the one pending sample below the minimum.

    Each phase is sent at once and then the model goes quiet: its windows close on the idle
    timer (a small backlog read at once leaves the config topic's partition holding the
    watermark), with the same carry-over as on the watermark."""
    topics = job_topics(stack_config.kafka_bootstrap, f"test.hot-{unique}")
    model_id = f"hot-{unique}"
    job = submit_detached(stack_config, REPO / "jobs" / "stream_finetune.py", job_args(
        topics, base_model, tmp_path, "--bootstrap-server", stack_config.kafka_bootstrap,
        "--checkpoint-interval-ms", "1000", "--idle-close-ms", "3000", "--job-name", f"hot-{unique}"))
    bs = stack_config.kafka_bootstrap
    pairs = digit_pairs(200, seed=9)
    try:
        send_config(bs, topics["configs"], spec(model_id, topics, rank=4, min_samples=10, window_seconds=2), T0)
        # Phase 1: three 2 s windows of 12 samples (12 >= 10), then a window of 8 that carries over.
        phase1 = (digit_samples(model_id, pairs[:36], T0, 2000 / 12, id_prefix="p1-")
                  + digit_samples(model_id, pairs[36:44], T0 + 6000, 2000 / 8, id_prefix="p1w4-"))
        send_samples(bs, topics["feedback"], phase1)
        first = wait_for_records(bs, topics["versions"], VersionRecord, 3, timeout=120, read_committed=False)
        assert len(first) == 3
        send_config(bs, topics["configs"], spec(model_id, topics, rank=8, min_samples=20, window_seconds=2), T0 + 1)
        invalid = spec_fields(model_id, f"kafka://topic={topics['feedback']}", rank=-1, min_samples=20,
                              window_seconds=2)
        send_raw(bs, topics["configs"], model_id, json.dumps(invalid), T0 + 2)
        # The first and the second config and phase 1 (the invalid config stops at validation).
        wait_until_trainer_read(stack_config, job, 1 + len(phase1) + 1)
        # Phase 2: windows 5-7 with 25 samples each, then a lone sample in window 9.
        phase2 = digit_samples(model_id, pairs[44:119], T0 + 8000, 2000 / 25, id_prefix="p2-")
        closer = digit_samples(model_id, pairs[:1], T0 + 16_500, 1, id_prefix="closer-")
        send_samples(bs, topics["feedback"], phase2 + closer)
        wait_for_records(bs, topics["versions"], VersionRecord, 6, timeout=120)
        # A retrain trigger (e.g. from sql/retrain_trigger.sql) trains the lone closer now.
        send_config(bs, topics["configs"], RetrainTrigger(model_id=model_id, reason="correction_rate 0.42 > 0.30"),
                    T0 + 3)
        versions = wait_for_records(bs, topics["versions"], VersionRecord, 7, timeout=60)
        dlq = wait_for_records(bs, topics["dlq"], DeadLetter, 1, timeout=30)
    finally:
        cancel_job(stack_config, job)
    versions.sort(key=lambda v: v.seq)
    forced = versions.pop()
    assert forced.trigger == "forced" and forced.lineage.sample_ids == ["closer-0"]
    assert [v.seq for v in versions] == [1, 2, 3, 4, 5, 6]
    old, new = versions[:3], versions[3:]
    assert all(v.adapter.rank == 4 and v.config_version == 1 and v.metrics.samples == 12 for v in old)
    assert all(v.adapter.rank == 8 and v.config_version == 2 for v in new), "invalid config never applied"
    assert [v.fresh_adapter for v in versions] == [True, False, False, True, False, False]
    # Window 4's 8 samples carry over (8 < 10) and train with window 5's 25.
    assert [v.metrics.samples for v in new] == [33, 25, 25]
    assert new[0].trigger_policy.min_samples_per_window == 20
    assert len(dlq) == 1 and dlq[0].reason == "schema" and dlq[0].kind == "config"
    assert "adapter_config.rank" in dlq[0].detail and json.loads(dlq[0].payload) == invalid
