"""Edge validation: every input record becomes a typed record or a dead letter with a reason.

Samples, specs and retrain triggers are checked against their contracts in core.messages,
inference-log responses (--inference-log-topic: kind "inference", for operators/pseudo_labels.py)
against InferenceRecord; CDC change events (jobs/cdc_retrain.py) against the change
envelope, and leave on CHANGE_TAG keyed by the changed row.

Counters `records_in`, `valid` and `dead_lettered` (Flink metrics of this operator)
satisfy records_in == valid + dead_lettered at every checkpoint. With --micro-batch-ms the
samples the JVM proved valid arrive here as one row per model and micro-batch
(operators/micro_batches.py): each counts its samples as records in and valid, and passes on.

Personal data (core/redaction.py, STREAMTUNE_REDACT: `pii` by default, `off`): the prompt and
completion of every valid sample and inference record, and the payload and detail of every
dead letter, are redacted here, before any window or the DLQ; counters `redactions` (total)
and `redactions_<rule>` (email, card, phone) count the replacements.

Event time (check_event_time, --max-event-skew-ms / --max-event-age-ms): a record whose
Kafka timestamp lies further ahead of now than the skew, or a sample older than the
retention, is dead-lettered with reason `timestamp`; the input table's watermark skips the
same far-future records (connectors.flink_kafka), so a producer writing straight to the
topic cannot close windows early or stall them until the idle rule.

>>> parse("sample", '{"model_id": "bot", "sample_id": "1", "prompt": "p", "completion": "c", "ts": 0}',
...       1024, frozenset())
('sample', 'bot')
>>> parse("sample", '{"model_id": ".."}', 1024, frozenset())
Traceback (most recent call last):
...
core.errors.InvalidMessage: model_id: String should match pattern '^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$'; sample_id: Field required; prompt: Field required; completion: Field required; ts: Field required
"""

from __future__ import annotations

import json
import os
import time

from pyflink.common import Types
from pyflink.datastream import OutputTag, ProcessFunction

from core.errors import InvalidMessage
from core.redaction import BUILTIN_RULES, redact, redact_payload, redaction_mode, scrub_credentials
from core.messages import (ChangeEnvelope, DeadLetter, FeedbackSample, FinetuneSpec, InferenceRecord, RetrainTrigger,
                           SourcePosition, decode)
from operators.micro_batches import MICRO_BATCH_TOPIC, straddled_window

DLQ_TAG = OutputTag("dead-letters", Types.STRING())
# CDC change events, keyed downstream by the changed row: (row_key, payload, topic, partition, offset, ts).
CHANGE_TYPE = Types.TUPLE([Types.STRING(), Types.STRING(), Types.STRING(), Types.INT(), Types.LONG(), Types.LONG()])
CHANGE_TAG = OutputTag("changes", CHANGE_TYPE)

# (kind, model_id, payload, topic, partition, offset, ts): what the keyed trainer receives;
# the payload is the original, now known to be valid. Kind "batch" (--micro-batch-ms): a
# model's micro-batch of samples, payload its packed entries and partition their count.
VALID_TYPE = Types.TUPLE([Types.STRING(), Types.STRING(), Types.STRING(), Types.STRING(),
                          Types.INT(), Types.LONG(), Types.LONG()])

CONTRACTS = {"sample": FeedbackSample, "config": FinetuneSpec, "trigger": RetrainTrigger, "inference": InferenceRecord}


def dead_letter(code: str, detail: str, payload, topic: str, partition: int, offset: int, ts: int,
                kind: str, model_id: str | None = None) -> str:
    """The DLQ record: the original payload, why it was rejected, and where it came from."""
    return DeadLetter(reason=code, detail=detail, kind=kind, model_id=model_id, payload=payload,
                      source=SourcePosition(topic=topic, partition=partition, offset=offset, timestamp=ts)).to_json()


def _check_size(payload: str, max_bytes: int) -> None:
    size = len(payload.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise InvalidMessage("oversized", f"record of {size} bytes exceeds max_record_bytes={max_bytes}")


def parse(kind: str, payload, max_bytes: int, served: frozenset[str], micro_batch_ms: int = 0):
    """Validate one record; returns (kind, model_id) or raises InvalidMessage.

    A config-topic record with a `trigger` field is a retrain trigger, not a spec. An
    inference-topic record with a `label` is feedback already judged (e.g. a correction
    citing the response), a sample like any other, not a pseudo-label. A spec whose source
    (FinetuneSpec.source_id) is not in `served` belongs to another job; one whose window is not
    a whole number of the job's micro-batches (`micro_batch_ms`, operators/micro_batches.py)
    is refused as `schema`.

    >>> parse("inference", '{"model_id": "bot", "sample_id": "1", "prompt": "p", "completion": "c", "ts": 0, '
    ...       '"label": "corrected", "request_id": "r1"}', 1024, frozenset())
    ('sample', 'bot')
    """
    if payload:
        _check_size(payload, max_bytes)
    obj = decode(payload)
    if kind == "config" and isinstance(obj, dict) and "trigger" in obj:
        kind = "trigger"
    if kind == "inference" and isinstance(obj, dict) and "label" in obj:
        kind = "sample"
    record = CONTRACTS[kind].from_dict(obj)
    if kind == "config" and record.source_id not in served:
        raise InvalidMessage("unsupported_source", f"stream_source {record.stream_source} is not served by this "
                                                   f"job (it serves {', '.join(sorted(served))})")
    if kind == "config" and (why := straddled_window(record.trigger_policy.window_seconds, micro_batch_ms)):
        raise InvalidMessage("schema", why)
    return kind, record.model_id


def check_event_time(kind: str, ts: int | None, now_ms: int, max_skew_ms: int, max_age_ms: int) -> None:
    """InvalidMessage `timestamp` for a record stamped more than `max_skew_ms` ahead of now
    (any kind: it would move the watermark) or, for samples and inference responses, more
    than `max_age_ms` ago (configs are state, replayed from the start of their topic). 0 = off.

    >>> check_event_time("sample", 10_000, 10_000, 1000, 0)
    >>> check_event_time("config", 20_000, 10_000, 1000, 0)
    Traceback (most recent call last):
    ...
    core.errors.InvalidMessage: event time 20000 is 10000 ms ahead of now (max_event_skew_ms=1000)
    >>> check_event_time("sample", 1, 10_000, 0, 5000)
    Traceback (most recent call last):
    ...
    core.errors.InvalidMessage: event time 1 is 9999 ms old (max_event_age_ms=5000)
    """
    if ts is None:
        return
    if max_skew_ms > 0 and ts > now_ms + max_skew_ms:
        raise InvalidMessage("timestamp", f"event time {ts} is {ts - now_ms} ms ahead of now "
                                          f"(max_event_skew_ms={max_skew_ms})")
    if max_age_ms > 0 and kind in ("sample", "inference") and ts < now_ms - max_age_ms:
        raise InvalidMessage("timestamp", f"event time {ts} is {now_ms - ts} ms old (max_event_age_ms={max_age_ms})")


def parse_change(payload: str | None, max_bytes: int, kafka_key: str | None) -> str:
    """Check a change event's envelope; returns the changed row's identity or raises InvalidMessage."""
    if not payload:
        raise InvalidMessage("empty", "change event has no value (a tombstone?)")
    _check_size(payload, max_bytes)
    event = ChangeEnvelope.from_dict(decode(payload))
    if kafka_key:
        return event.row_key_from(kafka_key)
    if not event.key_fields or event.image is None:
        raise InvalidMessage("no_row_key",
                             "change event without a Kafka key or key_fields: cannot tell which row changed")
    return event.row_key(event.key_fields)


def redact_sample(payload: str, mode: str) -> tuple[str, dict[str, int]]:
    """A valid sample's payload with its prompt and completion redacted (core/redaction.py);
    the payload is returned unchanged, byte for byte, when nothing was found.

    >>> redact_sample('{"prompt": "mail a@b.io", "completion": "ok", "ts": 0}', "pii")
    ('{"prompt": "mail [email]", "completion": "ok", "ts": 0}', {'email': 1})
    """
    if mode == "off":
        return payload, {}
    obj, counts = json.loads(payload), {}
    for name in ("prompt", "completion"):
        if isinstance(obj.get(name), str):
            obj[name], found = redact(obj[name], mode)
            counts = {k: counts.get(k, 0) + found.get(k, 0) for k in {*counts, *found}}
    return (json.dumps(obj) if counts else payload), counts  # ASCII: a lone surrogate stays escaped


class ValidateFunction(ProcessFunction):
    def __init__(self, served: frozenset[str], config_topic: str, max_record_bytes: int,
                 change_topics: frozenset[str] = frozenset(), inference_topics: frozenset[str] = frozenset(),
                 max_event_skew_ms: int = 0, max_event_age_ms: int = 0, micro_batch_ms: int = 0):
        self.served, self.config_topic = served, config_topic
        self.max_record_bytes = max_record_bytes
        self.change_topics = change_topics  # CDC topics: their records go to CHANGE_TAG
        self.inference_topics = inference_topics  # inference logs: kind "inference" (operators/pseudo_labels.py)
        self.redact_mode = redaction_mode(os.environ)  # read where the job is built; travels with the function
        # Event time bounds (check_event_time; 0 = off): the input's watermark ignores what they refuse.
        self.max_event_skew_ms, self.max_event_age_ms = max_event_skew_ms, max_event_age_ms
        self.micro_batch_ms = micro_batch_ms  # --micro-batch-ms: a config's window must hold whole micro-batches

    def open(self, runtime_context):
        metrics = runtime_context.get_metrics_group()
        self.records_in = metrics.counter("records_in")
        self.valid = metrics.counter("valid")
        self.dead_lettered = metrics.counter("dead_lettered")
        self.micro_batched = metrics.counter("micro_batched")  # of valid: proved valid in the JVM (--micro-batch-ms)
        self.redactions = {"total": metrics.counter("redactions"),
                           **{rule: metrics.counter(f"redactions_{rule}") for rule, _, _ in BUILTIN_RULES}}

    def process_element(self, row, ctx):
        payload, topic, partition, offset = row["payload"], row["topic"], row["partition"], row["offset"]
        ts = ctx.timestamp()
        if topic == MICRO_BATCH_TOPIC:  # samples the JVM proved valid (operators/micro_batches.py)
            self.records_in.inc(partition)
            self.valid.inc(partition)
            self.micro_batched.inc(partition)
            yield "batch", row["key"], payload, topic, partition, offset, ts
            return
        kind = ("config" if topic == self.config_topic else "change" if topic in self.change_topics
                else "inference" if topic in self.inference_topics else "sample")
        self.records_in.inc()
        try:
            if kind == "change":
                row_key = parse_change(payload, self.max_record_bytes, row["key"])
                self.valid.inc()
                yield CHANGE_TAG, (row_key, payload, topic, partition, offset, ts)
                return
            kind, model_id = parse(kind, payload, self.max_record_bytes, self.served, self.micro_batch_ms)
            check_event_time(kind, ts, int(time.time() * 1000), self.max_event_skew_ms, self.max_event_age_ms)
        except InvalidMessage as e:
            self.dead_lettered.inc()
            payload, detail = self._redacted(payload, redact_payload), self._redacted(e.detail)
            yield DLQ_TAG, dead_letter(e.code, detail, payload, topic, partition, offset, ts, kind)
            return
        self.valid.inc()
        if kind in ("sample", "inference"):  # before any window: personal data never reaches a batch, version or run
            payload, found = redact_sample(payload, self.redact_mode)
            self._count_redactions(found)
        yield kind, model_id, payload, topic, partition, offset, ts

    def _redacted(self, text, how=redact):
        if not text:
            return text
        text, _ = scrub_credentials(text)  # whatever the redaction mode: never copy a credential
        text, found = how(text, self.redact_mode)
        self._count_redactions(found)
        return text

    def _count_redactions(self, found: dict[str, int]) -> None:
        for rule, n in found.items():
            self.redactions["total"].inc(n)
            if rule in self.redactions:
                self.redactions[rule].inc(n)
