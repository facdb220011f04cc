"""Edge validation: every input record becomes a typed record or a dead letter with a reason.

Samples, specs and retrain triggers are checked against streamtune/specs.py; CDC change
events (jobs/cdc_retrain.py) against the Debezium envelope, and leave on CHANGE_TAG keyed
by the changed row.

Counters `records_in`, `valid` and `dead_lettered` (Flink metrics of this operator)
satisfy records_in == valid + dead_lettered at every checkpoint.
"""

from __future__ import annotations

import json

from pyflink.common import Types
from pyflink.datastream import OutputTag, ProcessFunction

from connectors.debezium import OPS, row_key, table_of
from streamtune.specs import FeedbackSample, FinetuneSpec, RetrainTrigger, ValidationError, describe_error

DLQ_TAG = OutputTag("dead-letters", Types.STRING())
# CDC change events, keyed downstream by the changed row: (row_key, payload, topic, partition, offset, ts).
CHANGE_TYPE = Types.TUPLE([Types.STRING(), Types.STRING(), Types.STRING(), Types.INT(), Types.LONG(), Types.LONG()])
CHANGE_TAG = OutputTag("changes", CHANGE_TYPE)

# (kind, model_id, payload, topic, partition, offset, ts): what the keyed trainer receives;
# the payload is the original, now known to be valid.
VALID_TYPE = Types.TUPLE([Types.STRING(), Types.STRING(), Types.STRING(), Types.STRING(),
                          Types.INT(), Types.LONG(), Types.LONG()])


class Invalid(Exception):
    def __init__(self, code: str, detail: str):
        super().__init__(detail)
        self.code, self.detail = code, detail


def dead_letter(code: str, detail: str, payload, topic: str, partition: int, offset: int, ts: int,
                kind: str, model_id: str | None = None) -> str:
    """The DLQ record: the original payload, why it was rejected, and where it came from."""
    return json.dumps({"reason": code, "detail": detail, "kind": kind, "model_id": model_id,
                       "payload": payload,
                       "source": {"topic": topic, "partition": partition, "offset": offset, "timestamp": ts}},
                      sort_keys=True)


def parse(kind: str, payload, max_bytes: int, served: frozenset[str]):
    """Validate one record; returns (kind, model_id) or raises Invalid.

    A config-topic record with a `trigger` field is a retrain trigger, not a spec. A spec
    whose source (FinetuneSpec.source_id) is not in `served` belongs to another job.
    """
    if payload is None or payload == "":
        raise Invalid("empty", "record has no value")
    size = len(payload.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise Invalid("oversized", f"record of {size} bytes exceeds max_record_bytes={max_bytes}")
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError as e:
        raise Invalid("bad_json", f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise Invalid("schema", f"expected a JSON object, got {type(obj).__name__}")
    if kind == "config" and "trigger" in obj:
        kind = "trigger"
    schema = {"sample": FeedbackSample, "config": FinetuneSpec, "trigger": RetrainTrigger}[kind]
    try:
        record = schema.model_validate(obj)
    except ValidationError as e:
        raise Invalid("schema", describe_error(e)) from None
    if kind == "config" and record.source_id not in served:
        raise Invalid("unsupported_source", f"stream_source {record.stream_source} is not served by this job "
                                            f"(it serves {', '.join(sorted(served))})")
    return kind, record.model_id


def parse_change(payload: str | None, max_bytes: int, kafka_key: str | None) -> str:
    """Check a change event's envelope; returns the changed row's identity or raises Invalid."""
    if not payload:
        raise Invalid("empty", "change event has no value (a tombstone?)")
    if len(payload.encode("utf-8", "surrogatepass")) > max_bytes:
        raise Invalid("oversized", f"change event exceeds max_record_bytes={max_bytes}")
    try:
        event = json.loads(payload)
    except json.JSONDecodeError as e:
        raise Invalid("bad_json", f"not JSON: {e}") from None
    if not isinstance(event, dict) or event.get("op") not in OPS or not isinstance(event.get("source"), dict):
        raise Invalid("not_a_change_event", "expected a Debezium envelope {before, after, op: c|u|d|r, source}")
    src = event["source"]
    needed = ("db", "schema", "table", "sequence") if src.get("connector") == "postgresql" else \
        ("db", "collection", "resume_token", "ts_ms", "ord") if src.get("connector") == "mongodb" else None
    if needed is None or any(k not in src for k in needed):
        raise Invalid("not_a_change_event", f"source must be postgresql {{db, schema, table, sequence}} or "
                                              f"mongodb {{db, collection, resume_token, ts_ms, ord}}, got {sorted(src)}")
    image = event.get("after") if event["op"] != "d" else event.get("before")
    if event["op"] in ("c", "r") and not isinstance(image, dict):
        raise Invalid("not_a_change_event", f"op {event['op']} needs an `after` object")
    if kafka_key:
        return f"{src['connector']}/{src['name'] if 'name' in src else ''}/{table_of(event)}/{kafka_key}"
    keys = event.get("key_fields")
    if not keys or not isinstance(image if image is not None else event.get("before"), dict):
        raise Invalid("no_row_key", "change event without a Kafka key or key_fields: cannot tell which row changed")
    return row_key(event, keys)


class ValidateFunction(ProcessFunction):
    def __init__(self, served: frozenset[str], config_topic: str, max_record_bytes: int,
                 change_topics: frozenset[str] = frozenset()):
        self.served, self.config_topic = served, config_topic
        self.max_record_bytes = max_record_bytes
        self.change_topics = change_topics  # CDC topics: their records go to CHANGE_TAG

    def open(self, runtime_context):
        metrics = runtime_context.get_metrics_group()
        self.records_in = metrics.counter("records_in")
        self.valid = metrics.counter("valid")
        self.dead_lettered = metrics.counter("dead_lettered")

    def process_element(self, row, ctx):
        payload, topic, partition, offset = row["payload"], row["topic"], row["partition"], row["offset"]
        ts = ctx.timestamp()
        kind = "config" if topic == self.config_topic else "change" if topic in self.change_topics else "sample"
        self.records_in.inc()
        try:
            if kind == "change":
                row_key = parse_change(payload, self.max_record_bytes, row["key"])
                self.valid.inc()
                yield CHANGE_TAG, (row_key, payload, topic, partition, offset, ts)
                return
            kind, model_id = parse(kind, payload, self.max_record_bytes, self.served)
        except Invalid as e:
            self.dead_lettered.inc()
            yield DLQ_TAG, dead_letter(e.code, e.detail, payload, topic, partition, offset, ts, kind)
            return
        self.valid.inc()
        yield kind, model_id, payload, topic, partition, offset, ts
