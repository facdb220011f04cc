"""The local default stack: each service checked over its real protocol."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from connectors.kafka import create_topic, read_topic
from streamtune.stack.flink import flink_cli

pytestmark = pytest.mark.stack
REPO = Path(__file__).resolve().parents[1]


def test_kafka_produce_and_consume(stack_config, unique):
    from kafka import KafkaProducer

    topic = f"test.plain.{unique}"
    create_topic(stack_config.kafka_bootstrap, topic)
    producer = KafkaProducer(bootstrap_servers=stack_config.kafka_bootstrap)
    for i in range(5):
        producer.send(topic, key=b"k", value=f"v{i}".encode())
    producer.flush()
    producer.close()
    records = read_topic(stack_config.kafka_bootstrap, topic, expect=5, read_committed=False)
    assert [r.value for r in records] == [b"v0", b"v1", b"v2", b"v3", b"v4"]


def test_kafka_transactional_producer_visible_after_commit(stack_config, unique):
    from kafka import KafkaProducer

    topic = f"test.txn.{unique}"
    create_topic(stack_config.kafka_bootstrap, topic)
    producer = KafkaProducer(bootstrap_servers=stack_config.kafka_bootstrap, transactional_id=f"txn-{unique}")
    producer.init_transactions()
    producer.begin_transaction()
    for i in range(3):
        producer.send(topic, value=f"t{i}".encode())
    producer.flush()
    producer.commit_transaction()
    producer.close()
    records = read_topic(stack_config.kafka_bootstrap, topic, expect=3, read_committed=True)
    assert [r.value for r in records] == [b"t0", b"t1", b"t2"]


def test_postgres_logical_slot_sees_insert(stack_config, unique):
    import psycopg

    table, slot = f"t_{unique}", f"slot_{unique}"
    with psycopg.connect(stack_config.postgres_dsn, autocommit=True) as conn:
        assert conn.execute("SHOW wal_level").fetchone()[0] == "logical"
        conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, body text)")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'wal2json')", (slot,))
        try:
            conn.execute(f"INSERT INTO {table} VALUES (1, 'hello wal')")
            changes = [json.loads(row[0]) for row in conn.execute(
                "SELECT data FROM pg_logical_slot_get_changes(%s, NULL, NULL)", (slot,))]
        finally:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            conn.execute(f"DROP TABLE {table}")
    inserts = [c for tx in changes for c in tx["change"] if c["kind"] == "insert"]
    assert len(inserts) == 1
    assert inserts[0]["table"] == table
    assert inserts[0]["columnvalues"] == [1, "hello wal"]


def test_mongo_change_stream_sees_insert(stack_config, unique):
    from pymongo import MongoClient

    client = MongoClient(stack_config.mongo_uri, serverSelectionTimeoutMS=5000)
    coll = client["streamtune_test"][f"c_{unique}"]
    try:
        with coll.watch(full_document="updateLookup", max_await_time_ms=500) as stream:
            coll.insert_one({"_id": 1, "prompt": "x=1234;y=", "completion": "2345"})
            deadline, change = time.monotonic() + 15, None
            while change is None and time.monotonic() < deadline:
                change = stream.try_next()
        assert change is not None, "no change event within 15 s"
        assert change["operationType"] == "insert"
        assert change["fullDocument"] == {"_id": 1, "prompt": "x=1234;y=", "completion": "2345"}
        assert change["_id"], "change events carry a resume token"
    finally:
        coll.drop()
        client.close()


def test_mlflow_registers_model_version(stack_config, unique, tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=stack_config.mlflow_uri, registry_uri=stack_config.mlflow_uri)
    experiment = client.create_experiment(f"stack-test-{unique}")
    run = client.create_run(experiment)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "weights.txt").write_text("not really weights")
    client.log_artifacts(run.info.run_id, str(tmp_path / "adapter"), artifact_path="adapter")
    client.set_terminated(run.info.run_id)
    name = f"stack-test-{unique}"
    client.create_registered_model(name)
    version = client.create_model_version(name, f"runs:/{run.info.run_id}/adapter", run_id=run.info.run_id,
                                          tags={"streamtune.test": unique})
    client.set_registered_model_alias(name, "candidate", version.version)
    got = client.get_model_version_by_alias(name, "candidate")
    assert got.version == version.version == "1"
    assert got.tags["streamtune.test"] == unique
    downloaded = client.download_artifacts(run.info.run_id, "adapter", str(tmp_path / "dl"))
    assert (Path(downloaded) / "weights.txt").read_text() == "not really weights"


def test_flink_cluster_runs_pyflink_job_submitted_with_flink_run(stack_config, unique):
    topic = f"test.smoke.{unique}"
    create_topic(stack_config.kafka_bootstrap, topic)
    result = flink_cli(stack_config, "run", "-py", str(REPO / "jobs" / "smoke.py"),
                       "--bootstrap-server", stack_config.kafka_bootstrap, "--topic", topic,
                       "--run-id", unique, "--count", "10")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "has finished" in result.stdout
    records = [json.loads(r.value) for r in read_topic(stack_config.kafka_bootstrap, topic, expect=10)]
    assert sorted((r["n"], r["square"]) for r in records) == [(n, n * n) for n in range(10)]
    assert {r["run_id"] for r in records} == {unique}


def test_stack_status_reports_every_component_healthy(stack_config):
    result = subprocess.run([sys.executable, "-m", "streamtune.cli", "stack", "status"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["postgres", "kafka", "mongo", "mlflow", "flink"]
    assert all(line.split()[1] == "healthy" for line in lines), result.stdout


def test_compose_file_is_valid():
    compose = shutil.which("docker-compose")
    assert compose, "docker-compose (Debian's 1.29) is installed by `make install`"
    result = subprocess.run([compose, "config", "-q"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
