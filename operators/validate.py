"""Edge validation: every input record becomes a typed record or a dead letter with a reason.

Counters `records_in`, `valid` and `dead_lettered` (Flink metrics of this operator)
satisfy records_in == valid + dead_lettered at every checkpoint.
"""

from __future__ import annotations

import json

from pyflink.common import Types
from pyflink.datastream import OutputTag, ProcessFunction

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
                from operators.cdc_mapping import parse_change

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
