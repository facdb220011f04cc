"""Hostile model ids and names through every entry point (marker `guarantees`).

A model id names directories, topics and MLflow models and reaches command lines, so it
starts with a letter or a digit, is never `.`/`..`, never escapes a directory and never
reads as an option (core/messages/base.py MODEL_ID). Each entry point refuses a hostile one
at its edge, with a message naming the field, before anything runs, is written or is
named after it: the REST API (422), a running job's config and feedback topics (the DLQ,
reason `schema`), a CDC mapping file (ConfigError) and a CDC row's model column
(`unmappable`). CDC source URIs refuse hostile tables, slots, publications, databases and
collections the same way.

Only test_job_dead_letters_hostile_ids_and_writes_only_its_store needs the local stack.
"""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path
from urllib.parse import quote

import pytest

from core.errors import ConfigError, InvalidMessage
from core.messages import (AdapterVersionBroadcast, ChangeEnvelope, ChangeSource, DeadLetter, FeedbackSample,
                           FinetuneSpec, RetrainTrigger, VersionRecord, is_model_id)
from core.messages.version import EXAMPLE as VERSION_EXAMPLE
from core.sources import source_for
from core.sources.postgres import PostgresSource
from streamtune.testing import row_change_function

pytestmark = pytest.mark.guarantees
REPO = Path(__file__).resolve().parents[1]

# Each breaks one rule: a path part, an option, an escape, a shell word, an encoding trick,
# a control character, a non-ASCII letter, the length limit, a trailing newline (`$` in
# Python's `re` matches before one).
HOSTILE_IDS = [".", "..", "-rf", "--help", "../x", "a/b", "a\\b", "", " ", "x" * 129, "a\x00b", "ünï", "a b",
               "$(rm)", "%2e%2e", ".hidden", "_x", "bot\n", "\tbot", "a;b", "a|b", "~root", "a:b"]
# JSON values that are no string at all.
NON_STRING_IDS = [None, 5, 1.5, True, ["a"], {"id": "a"}]
VALID_IDS = ["a", "0", "support-bot.v2", "A_b-c.d", "x" * 128, "x.."]

SEED_SPEC = {"model_id": "llama3-8b-streaming-v2", "stream_source": "kafka://topic=user_feedback_v3",
             "adapter_config": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]},
             "trigger_policy": {"min_samples_per_window": 50, "window_seconds": 60}}
SAMPLE = {"model_id": "m1", "sample_id": "s1", "prompt": "x=1;y=", "completion": "2", "ts": 1}
TRIGGER = {"model_id": "m1", "trigger": "retrain", "reason": "r"}
BROADCAST = {"version_id": "m1@1#0:0-0:1", "model_id": "m1", "seq": 1, "mlflow_version": 3,
             "model_uri": "models:/m1/3", "sha256": "0" * 64, "artifact_uri": "s3://a/" + "0" * 64,
             "aliases": ["candidate"]}


# ---------------------------------------------------------------- the contracts


def test_model_id_rule_refuses_every_hostile_id_and_keeps_valid_ones():
    assert [h for h in HOSTILE_IDS if is_model_id(h)] == []
    assert all(is_model_id(v) for v in VALID_IDS)


@pytest.mark.parametrize("message, fields", [
    (FeedbackSample, SAMPLE), (FinetuneSpec, SEED_SPEC), (RetrainTrigger, TRIGGER), (VersionRecord, VERSION_EXAMPLE),
    (AdapterVersionBroadcast, BROADCAST),
])
def test_every_wire_message_refuses_hostile_model_ids(message, fields):
    assert message.from_dict(fields).model_id == fields["model_id"]  # the control: the rest is valid
    for hostile in HOSTILE_IDS + NON_STRING_IDS:
        with pytest.raises(InvalidMessage) as e:
            message.from_dict({**fields, "model_id": hostile})
        assert e.value.code == "schema" and e.value.detail.startswith("model_id:"), (hostile, e.value.detail)


# ---------------------------------------------------------------- the REST API


class ServiceCalls:
    """Stands in for the API's gateway: records every call to Flink, Kafka or MLflow and
    answers it as an unreachable service (503), so a call can never go unnoticed."""

    def __init__(self):
        self.calls: list[str] = []

    def close(self):  # the app's shutdown: not a call to a service
        pass

    def __getattr__(self, name):
        from streamtune.api.gateway import StackUnavailable

        def call(*args, **kwargs):
            self.calls.append(name)
            raise StackUnavailable(f"test gateway: {name} called")

        return call


def closed_ports(n: int) -> list[int]:
    """`n` distinct ports nothing listens on (bound together, so they differ, then closed)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture
def api(tmp_path):
    """The app in process, every service port closed and its gateway recording calls."""
    from fastapi.testclient import TestClient

    from streamtune.api import ApiSettings, create_app
    from streamtune.stack import StackConfig

    kafka, postgres, mongo, mlflow, flink_rest, flink_rpc = closed_ports(6)
    stack = StackConfig(home=tmp_path / "home", data_dir=tmp_path / "data", kafka_port=kafka, postgres_port=postgres,
                        mongo_port=mongo, mlflow_port=mlflow, flink_rest_port=flink_rest, flink_rpc_port=flink_rpc)
    settings = ApiSettings(stack=stack, token="hostile-token", jobs_file=tmp_path / "api" / "jobs.json",
                           promotion_log=tmp_path / "api" / "promotions.jsonl",
                           artifact_store=str(tmp_path / "adapters"))
    app = create_app(settings)
    calls = ServiceCalls()
    app.state.control_plane.gateway = calls
    with TestClient(app) as client:
        client.headers["Authorization"] = "Bearer hostile-token"
        yield client, calls, tmp_path


def names_model_id(response) -> bool:
    """A 422 whose validation errors point at a `model_id` (body or path) with the rule broken."""
    errors = response.json()["detail"]
    return response.status_code == 422 and any(
        "model_id" in e["loc"] and ("pattern" in e["msg"] or "valid string" in e["msg"]) for e in errors)


def test_api_refuses_hostile_ids_in_bodies_before_any_service_call(api):
    client, calls, home = api
    event = {"type": "click", "event_id": "e1", "prompt": "p", "completion": "c", "ts": 0}
    for hostile in HOSTILE_IDS + NON_STRING_IDS:
        spec = client.post("/v1/stream-finetune", json={**SEED_SPEC, "model_id": hostile})
        assert names_model_id(spec), (hostile, spec.status_code, spec.text)
        for body in ({**event, "model_id": hostile}, [{**event, "model_id": "m1"}, {**event, "model_id": hostile}]):
            feedback = client.post("/v1/feedback", json=body)
            assert names_model_id(feedback), (hostile, feedback.status_code, feedback.text)
    assert calls.calls == [], "a hostile id reached Flink, Kafka or MLflow"
    assert not (home / "api").exists(), "a hostile id was recorded in the jobs file or the promotion log"
    # The control: a valid spec does reach the (unreachable) cluster, so 422 above means
    # validation came first, not that nothing would have been called anyway.
    valid = client.post("/v1/stream-finetune", json=SEED_SPEC)
    assert valid.status_code == 503 and calls.calls == ["live_job"], valid.text


PATH_ROUTES = [("GET", "/v1/stream-finetune/{}", None), ("DELETE", "/v1/stream-finetune/{}", None),
               ("GET", "/v1/models/{}/versions", None), ("GET", "/v1/models/{}/promotions", None),
               ("POST", "/v1/models/{}/aliases", {"alias": "champion", "version": 1})]


@pytest.mark.parametrize("method, route, body", PATH_ROUTES)
def test_api_refuses_hostile_ids_in_paths_before_any_service_call(api, method, route, body):
    """Percent-encoded as a client would send them, and raw (`%2e%2e` decodes to `..`): each
    is a 422 naming model_id, or (`/`, `.`, `..`, empty) matches no route at all."""
    client, calls, home = api
    for hostile in HOSTILE_IDS:
        for path in {route.format(quote(hostile, safe="")), route.format(hostile)}:
            if "\x00" in path or "\n" in path or "\t" in path or " " in path:
                continue  # not a URL a client can send raw; the encoded form covers it
            r = client.request(method, path, json=body)
            routed_nowhere = r.status_code in (404, 405) and r.json()["detail"] in ("Not Found", "Method Not Allowed")
            assert names_model_id(r) or routed_nowhere, (method, path, r.status_code, r.text)
    assert calls.calls == [] and not (home / "api").exists()
    # The control: a valid id gets past validation (to the jobs file, or the gateway).
    r = client.request(method, route.format("m1"), json=body)
    assert r.status_code in (200, 404, 503) and r.status_code != 422, r.text


# ---------------------------------------------------------------- CDC mapping files and rows


def mapping_file(tmp_path, mapping: dict) -> Path:
    path = tmp_path / "mapping.json"  # JSON is YAML: escapes (\u0000) survive the loader
    path.write_text(json.dumps(mapping))
    return path


def test_mapping_file_with_hostile_model_id_value_is_a_config_error(tmp_path):
    entry = {"table": "answers", "model_id": {"value": "bot"}, "prompt": "q", "completion": "a"}
    from operators.cdc_mapping import CdcMapping

    assert CdcMapping.load(mapping_file(tmp_path, {"mappings": [entry]})).mappings[0].model_id.value == "bot"
    for hostile in HOSTILE_IDS + NON_STRING_IDS:
        path = mapping_file(tmp_path, {"mappings": [{**entry, "model_id": {"value": hostile}}]})
        with pytest.raises(ConfigError, match=r"mappings\.0\.model_id"):
            CdcMapping.load(path)


def test_mapping_file_with_hostile_trigger_model_is_a_config_error(tmp_path):
    from operators.cdc_mapping import CdcMapping

    rule = {"table": "policies", "models": ["bot"], "reason": "policy changed"}
    assert CdcMapping.load(mapping_file(tmp_path, {"triggers": [rule]})).triggers[0].models == ["bot"]
    for hostile in HOSTILE_IDS + NON_STRING_IDS:
        path = mapping_file(tmp_path, {"triggers": [{**rule, "models": ["bot", hostile]}]})
        with pytest.raises(ConfigError, match=r"triggers\.0\.models\.1"):
            CdcMapping.load(path)


@pytest.mark.parametrize("yaml_text", [
    "mappings:\n  - table: t\n    model_id: {value: ../x}\n    prompt: q\n    completion: a\n",
    "mappings:\n  - table: t\n    model_id: {value: '-rf'}\n    prompt: q\n    completion: a\n",
    "mappings:\n  - table: t\n    model_id: {value: \"bot\\n\"}\n    prompt: q\n    completion: a\n",
    "triggers:\n  - table: t\n    models: [bot, ..]\n",
])
def test_mapping_yaml_as_people_write_it_refuses_hostile_ids(tmp_path, yaml_text):
    from operators.cdc_mapping import CdcMapping

    (tmp_path / "m.yaml").write_text(yaml_text)
    with pytest.raises(ConfigError, match="model"):
        CdcMapping.load(tmp_path / "m.yaml")


@pytest.mark.parametrize("entry, message", [
    ({"table": "t;DROP TABLE x"}, "table must be NAME or SCHEMA.NAME"),
    ({"table": "../x"}, "table must be NAME or SCHEMA.NAME"),
    ({"table": "a.b.c"}, "table must be NAME or SCHEMA.NAME"),
    ({"collection": "a/b.c"}, "collection must be a MongoDB db.collection name"),
    ({"collection": "shop.$cmd"}, "collection must be a MongoDB db.collection name"),
    ({"collection": "admin.system.users"}, "collection must be a MongoDB db.collection name"),
])
def test_mapping_file_with_hostile_table_or_collection_is_a_config_error(tmp_path, entry, message):
    """A name no source URI accepts could never match a change: refused, not silently idle."""
    from operators.cdc_mapping import CdcMapping

    path = mapping_file(tmp_path, {"mappings": [{**entry, "model_id": {"value": "bot"}, "prompt": "q",
                                                 "completion": "a"}]})
    with pytest.raises(ConfigError, match=re.escape(message)):
        CdcMapping.load(path)


@pytest.mark.parametrize("value", [5, "abc", None, {"a": 1}])
def test_mapping_in_condition_needs_a_list(tmp_path, value):
    """`v in 5` raises on every row (the job would fail, restart and fail again on it)."""
    from operators.cdc_mapping import CdcMapping

    path = mapping_file(tmp_path, {"mappings": [{"table": "t", "model_id": {"value": "bot"}, "prompt": "q",
                                                 "completion": "a",
                                                 "filter": [{"column": "s", "op": "in", "value": value}]}]})
    with pytest.raises(ConfigError, match="op in needs a list value"):
        CdcMapping.load(path)


def pg_change(after: dict) -> ChangeEnvelope:
    src = PostgresSource.change_source("pg", "app", "public", "answers", commit_lsn=200, lsn=100, tx_index=0,
                                       tx_id=7, commit_ts_ms=1_700_000_000_000, snapshot=False)
    return ChangeEnvelope(op="c", after=after, source=ChangeSource.model_validate(src), ts_ms=2)


def test_hostile_model_id_in_a_row_is_unmappable_not_a_sample():
    from operators.cdc_mapping import CdcMapping, Mapping
    from operators.row_changes import RowChangeFunction
    from operators.validate import DLQ_TAG

    mapping = Mapping.model_validate({"table": "answers", "model_id": {"column": "m"}, "prompt": "q",
                                      "completion": "a"})
    row = {"id": 1, "q": "x=1;y=", "a": "2"}
    event = pg_change({**row, "m": "bot"})
    assert RowChangeFunction._sample(mapping, event, event.origin("k")).model_id == "bot"  # the control
    for hostile in HOSTILE_IDS + [None, ["a"], {"id": "a"}]:
        event = pg_change({**row, "m": hostile})
        with pytest.raises(InvalidMessage, match="^model_id: "):
            RowChangeFunction._sample(mapping, event, event.origin("k"))
        # The job's path: the whole change becomes one dead letter, nothing goes to the trainer.
        fn = row_change_function(CdcMapping(mappings=[mapping]))
        out = list(fn.process_element(("k", event.to_json(), "cdc", 0, 7, 1), None))
        assert len(out) == 1 and out[0][0] is DLQ_TAG, (hostile, out)
        letter = DeadLetter.from_json(out[0][1])
        assert letter.reason == "unmappable" and "model_id" in letter.detail and letter.kind == "change"
        assert fn.counters["dead_lettered"].count == 1 and fn.counters["samples"].count == 0


# ---------------------------------------------------------------- CDC source URIs

HOSTILE_IDENTIFIERS = ["x;DROP", "x; DROP TABLE t; --", "'x'", '"x"', "X", "1x", "a-b", "a b", "../x", "ünï",
                       "x" * 64, "a\nb", "$x"]


@pytest.mark.parametrize("option", ["slot", "publication"])
def test_postgres_uri_refuses_hostile_slot_and_publication(option):
    assert getattr(source_for(f"postgres://h/app?table=t&{option}=my_{option}"), option) == f"my_{option}"
    for hostile in HOSTILE_IDENTIFIERS:
        with pytest.raises(ValueError, match=f"^{option} must be a PostgreSQL identifier"):
            source_for(f"postgres://h/app?table=t&{option}={quote(hostile, safe='')}")
    with pytest.raises(ValueError, match=f"^{option} must be"):  # the brief's own example, unencoded
        source_for(f"postgres://h/db?table=t&{option}=x;DROP")


def test_postgres_uri_refuses_hostile_table_names():
    assert source_for("postgres://h/app?table=crm.notes&table=answers").tables == ("crm.notes", "public.answers")
    for hostile in ["t;DROP", 't"; DROP TABLE x; --', "a.b.c", "../x", "a b", "-rf", "1t", "ünï", "a\x00b",
                    "t\n", ".t", "t."]:
        with pytest.raises(ValueError, match="^table must be NAME or SCHEMA.NAME"):
            source_for(f"postgres://h/app?table={quote(hostile, safe='')}")


@pytest.mark.parametrize("db, collection, option", [
    ("a.b", "c", "db"), ("a/b", "c", "db"), ("a\\b", "c", "db"), ("a b", "c", "db"), ('a"b', "c", "db"),
    ("$x", "c", "db"), ("x" * 64, "c", "db"), ("a\x00", "c", "db"),
    ("d", "$cmd", "collection"), ("d", "c\x00", "collection"), ("d", "system.users", "collection"),
])
def test_mongodb_uri_refuses_hostile_database_and_collection(db, collection, option):
    """A database name with a '.' would make `db.collection` ambiguous (a.b + c = a + b.c)."""
    assert source_for("mongodb://h/?db=shop&collection=reviews.v2").source_id == "mongodb:shop.reviews.v2"
    with pytest.raises(ValueError, match=f"^{option} must be a MongoDB"):
        source_for(f"mongodb://h/?db={quote(db, safe='')}&collection={quote(collection, safe='')}")


def test_spec_with_hostile_source_names_is_a_schema_dead_letter():
    from operators.validate import parse

    for source in ["postgres://h/app?table=t&slot=x;DROP", "postgres://h/app?table=t;DROP",
                   "mongodb://h/?db=a.b&collection=c", "kafka://topic=../x"]:
        with pytest.raises(InvalidMessage) as e:
            parse("config", json.dumps({**SEED_SPEC, "stream_source": source}), 65536, frozenset({"kafka:t"}))
        assert e.value.code == "schema" and e.value.detail.startswith("stream_source:"), e.value.detail


# ---------------------------------------------------------------- a running job (local stack)


@pytest.mark.stack  # needs the running stack: excluded by -m "not stack"
@pytest.mark.finetune
def test_job_dead_letters_hostile_ids_and_writes_only_its_store(stack_config, base_model, unique, tmp_path):
    """`flink run -py jobs/stream_finetune.py` with its store in an otherwise empty folder:
    every spec, trigger and sample with a hostile id is dead-lettered (`schema`, naming
    model_id), so is a record nested 60,000 deep (`bad_json`); the job never restarts, a
    valid model trains past them, and nothing but the store (holding only sha256-named
    artifacts) appears in that folder."""
    import requests
    from kafka import KafkaProducer

    from connectors.kafka import read_topic
    from streamtune.feedback import digit_samples, send_config, send_samples
    from streamtune.stack.flink import cancel_job, job_state, submit_detached
    from streamtune.testing import job_args, job_topics, spec, spec_fields, wait_for_records
    from streamtune.tinymodel import digit_pairs

    boot = stack_config.kafka_bootstrap
    topics = job_topics(boot, f"test.hostile-{unique}")
    jail = tmp_path / "jail"
    jail.mkdir()
    store = jail / "store"
    job = submit_detached(stack_config, REPO / "jobs" / "stream_finetune.py", job_args(
        topics, base_model, store, "--bootstrap-server", boot, "--tracking-uri", stack_config.mlflow_uri,
        "--checkpoint-interval-ms", "1000", "--job-name", f"hostile-{unique}"))
    try:
        deadline = time.monotonic() + 90
        while job_state(stack_config, job) != "RUNNING":
            assert time.monotonic() < deadline, "the job never reached RUNNING"
            time.sleep(1)
        t0, valid = 1_773_000_000_000, f"ok-{unique}"
        send_config(boot, topics["configs"], spec(valid, topics, min_samples=8, window_seconds=2), t0)
        sent: dict[str, str] = {}  # payload -> the topic kind it went to
        producer = KafkaProducer(bootstrap_servers=boot, acks="all")
        for i, hostile in enumerate(HOSTILE_IDS + NON_STRING_IDS):
            key = (hostile if isinstance(hostile, str) else repr(hostile)).encode()
            records = [("config", topics["configs"], spec_fields(hostile, f"kafka://topic={topics['feedback']}")),
                       ("config", topics["configs"], {"model_id": hostile, "trigger": "retrain", "reason": "now"}),
                       ("sample", topics["feedback"], {"model_id": hostile, "sample_id": f"h{i}", "prompt": "x=1;y=",
                                                       "completion": "2", "ts": t0 + i})]
            for kind, topic, value in records:
                payload = json.dumps(value)
                sent[payload] = kind
                producer.send(topic, key=key, value=payload.encode(), timestamp_ms=t0 + i)
        # A spec with a password inline in its source URI, produced straight to the config topic
        # (the API would refuse it): refused, and its dead letter must not copy the password.
        planted = f"hunter2-{unique}"
        with_password = json.dumps(spec_fields(f"pw-{unique}", f"postgres://u:{planted}@db/app?table=t"))
        producer.send(topics["configs"], key=b"pw", value=with_password.encode(), timestamp_ms=t0)
        # And one record nested 60,000 deep (under 64 KiB): RecursionError once failed the job on it.
        deep = "[" * 60_000
        sent[deep] = "sample"
        producer.send(topics["feedback"], key=b"deep", value=deep.encode(), timestamp_ms=t0)
        producer.flush()
        producer.close()
        # After the hostile records: one window of the valid model, then a sample that closes it.
        send_samples(boot, topics["feedback"], digit_samples(valid, digit_pairs(10, seed=4), t0 + 100, 100)
                     + digit_samples(valid, digit_pairs(1, seed=5), t0 + 10_000, 1, "c"))

        letters = wait_for_records(boot, topics["dlq"], DeadLetter, len(sent) + 1, 120)
        [refused] = [d for d in letters if d.model_id == f"pw-{unique}" or f"pw-{unique}" in d.payload]
        letters.remove(refused)
        assert (refused.reason, refused.kind) == ("schema", "config"), refused
        assert planted not in refused.payload + refused.detail and "u:***@db" in refused.payload, refused
        # The search can fail: the producer's own record on the config topic holds the password.
        assert any(planted.encode() in r.value for r in read_topic(boot, topics["configs"], timeout=5, idle=0.5))
        assert sorted(d.payload for d in letters) == sorted(sent), "each hostile record dead-lettered once"
        for d in letters:
            expected = ("bad_json", "JSON nested deeper") if d.payload == deep else ("schema", "model_id:")
            assert d.reason == expected[0] and d.detail.startswith(expected[1]), d.detail
            assert d.kind == sent[d.payload] and d.model_id is None, d
        versions = wait_for_records(boot, topics["versions"], VersionRecord, 1, 120)
        assert versions and {v.model_id for v in versions} == {valid}
        exceptions = requests.get(f"{stack_config.flink_rest_url}/jobs/{job}/exceptions", timeout=10).json()
        assert not exceptions["exceptionHistory"]["entries"], "the job failed on a hostile record"
        assert job_state(stack_config, job) == "RUNNING"
        # Nothing was named after a hostile id: the folder holds the store, the store its artifacts.
        assert [p.name for p in jail.iterdir()] == ["store"]
        assert sorted(p.name for p in store.iterdir()) == sorted({v.sha256 for v in versions})
    finally:
        cancel_job(stack_config, job)
