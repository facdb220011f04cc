"""Registrar: Kafka version records -> MLflow registry (idempotent) -> broadcast topic."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from connectors.kafka import read_topic
from connectors.artifact_store import ArtifactStore, artifact_sha256
from connectors.mlflow_registry import make_client, register_version
from core.errors import ArtifactIntegrityError
from core.messages import AdapterVersionBroadcast, VersionRecord
from streamtune.registrar import Registrar, RegistrarConfig

pytestmark = pytest.mark.finetune


def make_record(tmp_path, model_id: str, seq: int, loss_after: float, **overrides) -> VersionRecord:
    weights = f"fake safetensors {model_id} {seq}".encode() * 64
    config = json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]})
    files = {"adapter_model.safetensors": weights, "adapter_config.json": config.encode()}
    uri = ArtifactStore(str(tmp_path / "store")).put(files, artifact_sha256(files))
    record = {
        "version_id": f"{model_id}-{seq}-{uuid.uuid4().hex[:8]}", "model_id": model_id, "seq": seq,
        "window_start": 1_000 * seq, "window_end": 1_000 * seq + 999,
        "artifact_uri": uri, "sha256": artifact_sha256(files),
        "base_model": "/models/tiny-llama", "config_version": 1, "fresh_adapter": seq == 1,
        "adapter": {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"], "dropout": 0.05},
        "trigger_policy": {"min_samples_per_window": 32, "window_seconds": 1},
        "metrics": {"loss_before": loss_after + 1.0, "loss_after": loss_after, "samples": 32,
                    "tokens": 2048, "step_seconds": 0.25},
        "lineage": {"sample_ids": [f"s{seq}-{i}" for i in range(3)],
                    "offsets": [{"topic": "streamtune.samples", "partition": 0,
                                 "first": 10 * seq, "last": 10 * seq + 9}]},
        "trigger": "window",
    }
    record.update(overrides)
    return VersionRecord.model_validate(record)


def publish(bootstrap: str, topic: str, values: list[bytes]) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap)
    for value in values:
        producer.send(topic, key=b"k", value=value)
    producer.flush()
    producer.close()


@pytest.fixture
def registrar(stack_config, unique):
    events: list[str] = []
    config = RegistrarConfig(bootstrap=stack_config.kafka_bootstrap, tracking_uri=stack_config.mlflow_uri,
                             versions_topic=f"test.versions.{unique}",
                             broadcast_topic=f"test.adapter-versions.{unique}",
                             group_id=f"test-registrar-{unique}")
    reg = Registrar(config, on_event=events.append)
    reg.events = events
    yield reg
    reg.close()


def drain(reg: Registrar, seen: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while reg.counts["seen"] < seen:
        assert time.monotonic() < deadline, f"registrar saw too little: {reg.counts}, {reg.events}"
        reg.poll_once(500)


def versions_of(client, model_id: str) -> list:
    return sorted(client.search_model_versions(f"name = '{model_id}'"), key=lambda v: int(v.version))


def test_duplicate_record_registers_once(stack_config, registrar, unique, tmp_path):
    model_id = f"dup-{unique}"
    value = make_record(tmp_path, model_id, 1, 1.5).to_json().encode()
    publish(stack_config.kafka_bootstrap, registrar.config.versions_topic, [value, value])
    drain(registrar, 2)
    assert registrar.counts == {"seen": 2, "registered": 1, "duplicates": 1, "invalid": 0}
    client = make_client(stack_config.mlflow_uri)
    assert [v.version for v in versions_of(client, model_id)] == ["1"]
    messages = read_topic(stack_config.kafka_bootstrap, registrar.config.broadcast_topic, idle=3.0)
    assert len(messages) == 1
    assert messages[0].key == model_id.encode()
    body = AdapterVersionBroadcast.from_json(messages[0].value)
    assert body.model_uri == f"models:/{model_id}/1" and body.mlflow_version == 1
    assert body.artifact_uri.startswith("file://") and body.artifact_uri.endswith(body.sha256)
    assert set(body.aliases) == {"candidate", "champion"}
    assert any(e.startswith(f"registered {model_id} v1 ") and "loss 2.50 -> 1.50" in e
               for e in registrar.events), registrar.events


def test_consecutive_versions_tags_and_aliases(stack_config, registrar, unique, tmp_path):
    model_id = f"seq-{unique}"
    records = [make_record(tmp_path, model_id, 1, 1.5), make_record(tmp_path, model_id, 2, 1.2),
               make_record(tmp_path, model_id, 3, 2.0)]
    client = make_client(stack_config.mlflow_uri)
    topic = registrar.config.versions_topic

    publish(stack_config.kafka_bootstrap, topic, [r.to_json().encode() for r in records[:2]])
    drain(registrar, 2)
    versions = versions_of(client, model_id)
    assert [v.version for v in versions] == ["1", "2"]
    for v, r in zip(versions, records):
        assert v.source == f"runs:/{v.run_id}/model"  # the pyfunc model; the adapter files stay in adapter/
        assert v.tags["streamtune.version_id"] == r.version_id
        assert v.tags["streamtune.seq"] == str(r.seq)
        assert v.tags["streamtune.sha256"] == r.sha256
        assert v.tags["streamtune.samples"] == "32"
        assert v.tags["streamtune.rank"] == "8"
        assert v.tags["streamtune.target_modules"] == "q_proj,v_proj"
        assert v.tags["streamtune.fresh_adapter"] == str(r.seq == 1)
        assert v.tags["streamtune.window_start"] == str(r.window_start)
        assert v.tags["streamtune.broadcast"] == "sent"
        assert {"adapter/adapter_model.safetensors", "adapter/adapter_config.json", "lineage.json"} <= {
            f.path for f in client.list_artifacts(v.run_id)} | {
            f.path for f in client.list_artifacts(v.run_id, "adapter")}
    aliases = client.get_registered_model(model_id).aliases
    assert aliases == {"candidate": "2", "champion": "2"}  # 1.2 <= 1.5: champion moved

    publish(stack_config.kafka_bootstrap, topic, [records[2].to_json().encode()])
    drain(registrar, 3)
    aliases = client.get_registered_model(model_id).aliases
    assert aliases == {"candidate": "3", "champion": "2"}  # 2.0 > 1.2: champion stays

    # The loss curve lives in the per-model training run, one point per seq.
    run = client.search_runs([client.get_experiment_by_name(f"streamtune/{model_id}").experiment_id],
                             f"attributes.run_name = '{model_id}-training'")[0]
    history = client.get_metric_history(run.info.run_id, "loss_after")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(1, 1.5), (2, 1.2), (3, 2.0)]
    assert len(read_topic(stack_config.kafka_bootstrap, registrar.config.broadcast_topic, expect=3)) == 3


def test_invalid_records_are_counted_and_skipped(stack_config, registrar, unique, tmp_path):
    model_id = f"inv-{unique}"
    missing_field = make_record(tmp_path, model_id, 1, 1.0).to_dict()
    del missing_field["metrics"]
    bad_sha = make_record(tmp_path, model_id, 2, 1.0, sha256="0" * 64)
    good = make_record(tmp_path, model_id, 3, 1.0)
    publish(stack_config.kafka_bootstrap, registrar.config.versions_topic,
            [b"{not json", json.dumps(missing_field).encode(), bad_sha.to_json().encode(),
             good.to_json().encode()])
    drain(registrar, 4)
    assert registrar.counts == {"seen": 4, "registered": 1, "duplicates": 0, "invalid": 3}
    client = make_client(stack_config.mlflow_uri)
    assert [v.tags["streamtune.version_id"] for v in versions_of(client, model_id)] == [good.version_id]
    assert sum("invalid record" in e for e in registrar.events) == 3
    assert any("sha256 mismatch" in e for e in registrar.events)


def test_sha256_mismatch_is_a_clear_error(stack_config, unique, tmp_path):
    model_id = f"sha-{unique}"
    record = make_record(tmp_path, model_id, 1, 1.0, sha256="ab" * 32)
    client = make_client(stack_config.mlflow_uri)
    with pytest.raises(ArtifactIntegrityError, match=r"sha256 mismatch .*adapter_model\.safetensors"):
        register_version(client, record, ArtifactStore(str(tmp_path / "store")))
    assert versions_of(client, model_id) == []


def test_transient_mlflow_failure_is_retried(stack_config, registrar, unique, tmp_path, monkeypatch):
    model_id = f"retry-{unique}"
    record = make_record(tmp_path, model_id, 1, 1.0)
    publish(stack_config.kafka_bootstrap, registrar.config.versions_topic, [record.to_json().encode()])
    real_client = registrar.client
    with monkeypatch.context() as m:
        m.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        m.setattr(registrar, "client", make_client("http://127.0.0.1:9"))  # nothing listens there
        deadline = time.monotonic() + 60
        with pytest.raises(Exception, match="127.0.0.1"):
            while time.monotonic() < deadline:
                registrar.poll_once(500)  # raises once the record arrives
    assert registrar.client is real_client and registrar.counts["registered"] == 0
    drain(registrar, 2)  # the same record again, from the rewound position
    assert registrar.counts["registered"] == 1 and registrar.counts["invalid"] == 0
    assert len(versions_of(real_client, model_id)) == 1


def test_duplicate_without_broadcast_is_broadcast(stack_config, registrar, unique, tmp_path):
    """A crash after registering but before broadcasting: the replay sends the broadcast."""
    model_id = f"heal-{unique}"
    record = make_record(tmp_path, model_id, 1, 1.0)
    register_version(make_client(stack_config.mlflow_uri), record, ArtifactStore(str(tmp_path / "store")))  # registered, never broadcast
    value = record.to_json().encode()
    publish(stack_config.kafka_bootstrap, registrar.config.versions_topic, [value, value])
    drain(registrar, 2)
    assert registrar.counts == {"seen": 2, "registered": 0, "duplicates": 2, "invalid": 0}
    messages = read_topic(stack_config.kafka_bootstrap, registrar.config.broadcast_topic, idle=3.0)
    assert [AdapterVersionBroadcast.from_json(m.value).version_id for m in messages] == [record.version_id]


@pytest.mark.guarantees
def test_registration_queue_restored_without_its_timer_resumes_on_the_next_version(stack_config, unique,
                                                                                    tmp_path):
    """The registration operator (operators/registration.py) restored with its queue and the
    state of a pending poll, but without the poll's timer (seen with PyFlink 2.0.2 after a
    TaskManager kill, while the poll was re-armed every 20 ms around the checkpoint): the model's
    next version starts the queue, and both versions are registered and broadcast in order.
    Driven directly: real MLflow, no Flink."""
    from pyflink.datastream import TimeDomain

    from connectors.artifact_store import store_uri
    from operators.registration import RegistrationFunction
    from streamtune.testing import InMemoryRuntimeContext, KeyedTimers

    model_id = f"restored-{unique}"
    records = [make_record(tmp_path, model_id, seq, 1.0 / seq) for seq in (1, 2)]
    entries = [(model_id, r.to_json(), "versions", 0, seq, 0) for seq, r in enumerate(records)]
    state: dict = {}

    def opened() -> RegistrationFunction:
        fn = RegistrationFunction(stack_config.mlflow_uri, store_uri(str(tmp_path / "store")))
        fn.open(InMemoryRuntimeContext(state))
        return fn

    before = opened()
    assert not list(before.process_element(entries[0], KeyedTimers(model_id, now_ms=1_000)))
    before.close()
    assert state["queue"].value() and state["timer"].value(), "version 1 queued behind a pending poll"

    after, ctx = opened(), KeyedTimers(model_id, now_ms=2_000)  # the restore: no timer came back
    ctx.domain = TimeDomain.PROCESSING_TIME
    out = list(after.process_element(entries[1], ctx))
    deadline = time.monotonic() + 60
    while len([o for o in out if isinstance(o, str)]) < 2:
        assert ctx.processing_timers, f"the restored queue waits on no timer: {state['timer'].value()}"
        assert time.monotonic() < deadline, "versions 1 and 2 registered within 60 s"
        time.sleep(0.02)
        ctx.now_ms += 20
        for t in ctx.due_processing_timers():
            out += list(after.on_timer(t, ctx))
    after.close()
    broadcasts = [AdapterVersionBroadcast.from_json(o) for o in out if isinstance(o, str)]
    assert [b.seq for b in broadcasts] == [1, 2]
    assert [b.version_id for b in broadcasts] == [r.version_id for r in records]
    assert state["queue"].value() is None
