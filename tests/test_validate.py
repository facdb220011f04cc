"""Edge validation of feedback samples, specs and triggers (operators/validate.py)."""

import json

import pytest

from core.errors import InvalidMessage
from core.messages import DeadLetter
from operators.validate import dead_letter, parse

SEED_SPEC = {"model_id": "llama3-8b-streaming-v2", "stream_source": "kafka://topic=user_feedback_v3",
             "adapter_config": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]},
             "trigger_policy": {"min_samples_per_window": 50, "window_seconds": 60}}
SAMPLE = {"model_id": "m1", "sample_id": "s1", "prompt": "x=1234;y=", "completion": "2345", "ts": 1}


def reason(kind, payload, max_bytes=65536):
    with pytest.raises(InvalidMessage) as e:
        parse(kind, payload, max_bytes, frozenset({"kafka:user_feedback_v3"}))
    return e.value.code, e.value.detail


def test_seed_spec_is_accepted_as_is():
    assert parse("config", json.dumps(SEED_SPEC), 65536, frozenset({"kafka:user_feedback_v3"})) == ("config", "llama3-8b-streaming-v2")


def test_valid_sample_routes_by_model_id():
    assert parse("sample", json.dumps(SAMPLE), 65536, frozenset({"kafka:t"})) == ("sample", "m1")


def test_bad_json_schema_and_size_each_get_a_reason():
    assert reason("sample", "{nope")[0] == "bad_json"
    assert reason("sample", "[1]")[0] == "schema"
    assert reason("sample", "")[0] == "empty"
    code, detail = reason("sample", json.dumps({**SAMPLE, "completion": ""}))
    assert code == "schema" and detail.startswith("completion:")
    assert reason("sample", json.dumps({**SAMPLE, "prompt": "x" * 100}), max_bytes=64)[0] == "oversized"


def test_spec_for_another_topic_is_rejected():
    code, detail = reason("config", json.dumps({**SEED_SPEC, "stream_source": "kafka://topic=other"}))
    assert code == "unsupported_source" and "other" in detail


def test_invalid_spec_names_the_field():
    bad = {**SEED_SPEC, "trigger_policy": {"min_samples_per_window": 0, "window_seconds": 60}}
    code, detail = reason("config", json.dumps(bad))
    assert code == "schema" and "trigger_policy.min_samples_per_window" in detail


def test_config_topic_record_with_trigger_is_a_retrain_trigger():
    trigger = {"model_id": "m1", "trigger": "retrain", "reason": "correction rate"}
    assert parse("config", json.dumps(trigger), 65536, frozenset({"kafka:t"})) == ("trigger", "m1")
    assert reason("config", json.dumps({**trigger, "trigger": "maybe"}))[0] == "schema"


def test_dead_letter_keeps_payload_reason_and_offset():
    record = DeadLetter.from_json(dead_letter("bad_json", "not JSON", "{nope", "fb", 2, 41, 7, "sample"))
    assert record.payload == "{nope" and record.reason == "bad_json" and record.model_id is None
    assert record.source.model_dump() == {"topic": "fb", "partition": 2, "offset": 41, "timestamp": 7}


def test_sql_trigger_record_with_evidence_fields_is_accepted():
    trigger = {"model_id": "m-1", "trigger": "retrain", "reason": "correction_rate 0.40 > 0.30",
               "window_start": 1, "window_end": 2, "correction_rate": 0.4, "corrected": 4, "labelled": 10,
               "threshold": 0.3}
    assert parse("config", json.dumps(trigger), 65536, frozenset({"kafka:t"})) == ("trigger", "m-1")
