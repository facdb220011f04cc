"""The CDC mapping file, change-event checks and Debezium positions (pure Python)."""

from __future__ import annotations

import json

import pytest

from core.errors import ConfigError, InvalidMessage
from core.messages import ChangeEnvelope, ChangeSource
from core.sources.mongodb import MongoSource
from core.sources.postgres import PostgresSource, lsn_text, parse_lsn
from operators.cdc_mapping import CdcMapping, Mapping, field
from operators.validate import parse_change

pytestmark = pytest.mark.cdc


def pg_event(op="c", after={"id": 1}, before=None, commit=200, lsn=100, index=0) -> ChangeEnvelope:
    src = PostgresSource.change_source("pg", "app", "public", "answers", commit_lsn=commit, lsn=lsn, tx_index=index,
                                       tx_id=7, commit_ts_ms=1, snapshot=False)
    return ChangeEnvelope(op=op, before=before, after=after, source=ChangeSource.model_validate(src), ts_ms=2)


def mongo_event(token: str, increment: int) -> ChangeEnvelope:
    src = MongoSource.change_source("m", "d", "c", resume_token=token, cluster_time=(10, increment), tx_number=None)
    return ChangeEnvelope(op="c", after={"_id": 1}, source=ChangeSource.model_validate(src))


def test_lsn_text_round_trips():
    for value in (0, 1, 0x16B374D848, 2**63 - 1):
        assert parse_lsn(lsn_text(value)) == value
    assert lsn_text(0x16B374D848) == "16/B374D848"


def test_positions_order_changes_of_one_source():
    def position(event: ChangeEnvelope) -> tuple:
        return ChangeEnvelope.from_json(event.to_json()).position()  # as a consumer reads it

    assert position(pg_event(commit=200, lsn=100)) < position(pg_event(commit=200, lsn=150))
    assert position(pg_event(commit=200, lsn=100, index=0)) < position(pg_event(commit=200, lsn=100, index=1))
    assert position(pg_event(commit=200, lsn=190)) < position(pg_event(commit=300, lsn=110))
    assert position(mongo_event("a", 2)) < position(mongo_event("b", 3))


def test_parse_change_names_the_row():
    assert parse_change(pg_event(after={"id": 1}).to_json(), 65536, '{"id":1}') == \
        'postgresql/pg/app.public.answers/{"id":1}'
    event = pg_event(after={"id": 1}).model_copy(update={"key_fields": ["id"]})
    assert parse_change(event.to_json(), 65536, None) == "postgresql/pg/app.public.answers/[1]"


@pytest.mark.parametrize("payload, code", [
    (None, "empty"), ("{", "bad_json"), ('{"op": "x"}', "not_a_change_event"),
    (json.dumps({"op": "c", "source": {"connector": "oracle"}}), "not_a_change_event"),
    (json.dumps({**pg_event(after={"id": 1}).to_dict(), "after": None}), "not_a_change_event"),
    (json.dumps({**pg_event(after={"id": 1}).to_dict(), "source": {"connector": "mongodb", "db": "d"}}),
     "not_a_change_event"),
    (pg_event(after={"id": 1}).to_json(), "no_row_key"),
    ("x" * 70000, "oversized"),
])
def test_bad_change_events_have_reasons(payload, code):
    with pytest.raises(InvalidMessage) as e:
        parse_change(payload, 65536, None)
    assert e.value.code == code


def test_mapping_filters_and_paths():
    m = Mapping.model_validate({"collection": "shop.reviews", "model_id": {"column": "meta.model"},
                                "prompt": "text", "completion": "reply.body",
                                "filter": [{"column": "stars", "op": "in", "value": [4, 5]},
                                           {"column": "reply.body", "op": "not_null"}]})
    doc = {"text": "t", "reply": {"body": "b"}, "stars": 5, "meta": {"model": "bot"}}
    assert m.source == "mongodb:shop.reviews" and m.applies(doc) and m.model_for(doc) == "bot"
    assert not m.applies({**doc, "stars": 3}) and not m.applies({**doc, "reply": {}})
    assert field(doc, "reply.missing.deeper") is None


@pytest.mark.parametrize("text, message", [
    ("mappings:\n  - table: t\n    prompt: q\n    completion: a\n", "model_id"),
    ("mappings:\n  - table: t\n    collection: d.c\n    model_id: {value: m}\n    prompt: q\n    completion: a\n",
     "exactly one of table"),
    ("mappings:\n  - collection: nodot\n    model_id: {value: m}\n    prompt: q\n    completion: a\n",
     "db.collection"),
    ("mappings:\n  - table: t\n    model_id: {value: m, column: c}\n    prompt: q\n    completion: a\n",
     "exactly one of column or value"),
    ("triggers: []\n", "at least one entry"),
    ("mappings:\n  - table: t\n    model_id: {value: ..}\n    prompt: q\n    completion: a\n", "model_id.value"),
    ("mappings: [\n", "not YAML"),
])
def test_mapping_file_errors_are_clear(tmp_path, text, message):
    (tmp_path / "m.yaml").write_text(text)
    with pytest.raises(ConfigError, match=message):
        CdcMapping.load(tmp_path / "m.yaml")
