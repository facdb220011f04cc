"""Samples in the JVM: a fast path that checks and groups feedback before any Python runs.

Every record that crosses into Python costs a serialization, a gRPC frame and a Python call
on each side (bench/ingest.py: a few thousand records/s through validate and the trainer's
windows, against a few hundred thousand for the same counts in Flink SQL; figures in
docs/benchmarks.md). With `--micro-batch-ms` the job's input table splits in two, in SQL:

- **fast**: a feedback record that the JVM can prove valid, unchanged by redaction and not
  late (`fast_condition`) joins its model's micro-batch, an event-time tumbling window of
  `micro_batch_ms` (epoch aligned; it divides 1 s, or is whole seconds and validate refuses
  a config whose window is not a whole number of micro-batches, so it never straddles a
  trainer window). Each closed micro-batch crosses into Python once: validate counts its
  samples and passes it on, the trainer unpacks it (`unpack`) into the same pending samples, with their own
  source positions and timestamps, as the records would have made one by one.
- **everything else** (configs, triggers, inference logs, change events, any record the
  condition cannot prove, late ones) goes through operators/validate.py as before: its exact
  reasons, details and redaction for dead letters are unchanged.

The fast condition is a subset of what validate accepts, so the two paths give the same
windows (`pytest -m ingest`: tests/test_micro_batches.py, tests/test_scale.py): a payload in FeedbackSample's canonical layout
(core.messages: the fields in declaration order, as `to_json` writes them, with optional
JSON whitespace), strings without escapes, control characters or `@`, a prompt and a
completion of fewer than 9 digits each (so no e-mail, phone or card rule of
core/redaction.py can match), a size that is certainly within --max-record-bytes, a
timestamp within the event-time bounds, and a timestamp after the watermark. A producer that
writes another layout only takes the Python path.

Why `window_time` and not a count: the micro-batch closes when the watermark passes it,
before any trainer window that contains it, so which samples a trainer window holds does not
change; a record that is already behind the watermark never enters a micro-batch (Flink
would drop it) but goes the Python way and joins the next window, as it does without the
fast path. The cost of that choice: a micro-batch closes only when a later record moves the
watermark past it, so the last one of a stream that stops waits for the next record (the
trainer's idle close cannot reach samples still in SQL, nor can a retrain trigger); this is
why the option is off by default. The longer the micro-batch, the fewer rows cross into Python
(bench/ingest.py: one the length of the window is the fastest arm) and the longer that wait.

>>> import re
>>> fast = re.compile(FAST_SAMPLE)
>>> bool(fast.fullmatch('{"model_id":"m1","sample_id":"s1","prompt":"x=1;y=","completion":"5",'
...                     '"label":"corrected","weight":1.0,"ts":1770000000000}'))
True
>>> bool(fast.fullmatch('{"model_id": "m1", "sample_id": "s1", "prompt": "call 020 7946 0958", '
...                     '"completion": "ok", "ts": 1}'))
False
>>> bool(fast.fullmatch('{"sample_id": "s1", "model_id": "m1", "prompt": "p", "completion": "c", "ts": 1}'))
False
>>> entries = pack_entry(1000, "t", 0, 7, '{"x":1}') + ENTRY_SEPARATOR + pack_entry(1001, "t", 1, 3, '{"x":2}')
>>> [(ts, topic, partition, offset, payload) for ts, topic, partition, offset, payload in unpack(entries)]
[(1000, 't', 0, 7, '{"x":1}'), (1001, 't', 1, 3, '{"x":2}')]
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator

from operators.windowing import Pending

# A topic name Kafka cannot have (legal names: [a-zA-Z0-9._-]): marks a micro-batch row.
MICRO_BATCH_TOPIC = "<micro-batch>"
# Neither may occur in a fast-path payload (FAST_SAMPLE refuses control characters) or a topic name.
ENTRY_SEPARATOR = "\x01"
FIELD_SEPARATOR = "\x02"

# JSON whitespace (not Java's \s, which also takes \x0B and \f, which JSON refuses).
_WS = "[ \\t\\n\\r]*"
# A string without escapes, quotes, control characters or `@` (no e-mail can hide in it).
_PLAIN = '[^"\\\\@\\x00-\\x1f]'
# ... holding fewer than 9 digits: no phone number (9-15) or card number (13-19) fits.
_FEW_DIGITS = f'(?=(?:[^"0-9]*[0-9]){{0,8}}[^"0-9]*")'


def _field(name: str, value: str, first: bool = False) -> str:
    return f'{"" if first else "," + _WS}"{name}"{_WS}:{_WS}{value}{_WS}'


# FeedbackSample (core/messages/feedback.py) in to_json's layout: its constraints, spelled for java.util.regex.
FAST_SAMPLE = (
    "\\{" + _WS
    + _field("model_id", '"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"', first=True)
    + _field("sample_id", f'"{_PLAIN}{{1,256}}"')
    + _field("prompt", f'"{_FEW_DIGITS}{_PLAIN}*"')
    + _field("completion", f'"{_FEW_DIGITS}{_PLAIN}+"')
    + "(?:" + _field("label", '"(?:accepted|corrected|rejected)"') + ")?"
    + "(?:" + _field("weight", "(?:10(?:\\.0+)?|[0-9](?:\\.[0-9]+)?)") + ")?"
    + _field("ts", "(?:0|[1-9][0-9]{0,17})")
    + "\\}")


def _sql_string(text: str) -> str:
    return text.replace("'", "''")


def fast_condition(feedback_topics: list[str], max_record_bytes: int, max_skew_ms: int, max_age_ms: int) -> str:
    """A SQL condition over the input table's columns (connectors/flink_kafka.py input_table_ddl),
    TRUE only for a record operators/validate.py would pass as a sample unchanged."""
    topics = ", ".join(f"'{_sql_string(t)}'" for t in feedback_topics)
    # UTF-8 takes at most 4 bytes a character: certainly within the limit, or the Python path measures it.
    terms = [f"`topic` IN ({topics})", "`payload` IS NOT NULL",
             f"CHAR_LENGTH(`payload`) * 4 <= {int(max_record_bytes)}",
             f"REGEXP(`payload`, '^{_sql_string(FAST_SAMPLE)}$')",
             "(CURRENT_WATERMARK(`ts`) IS NULL OR `ts` > CURRENT_WATERMARK(`ts`))"]
    if max_skew_ms > 0:  # whole seconds, rounded down: a record near the bound goes the exact way
        terms.append(f"`ts` <= TIMESTAMPADD(SECOND, {max_skew_ms // 1000}, NOW())")
    if max_age_ms > 0:
        terms.append(f"`ts` >= TIMESTAMPADD(SECOND, -{-(-max_age_ms // 1000)}, NOW())")
    return " AND ".join(terms)


def check_micro_batch_ms(micro_batch_ms: int) -> None:
    """A micro-batch length that divides a second or is whole seconds: either way it divides
    every window that is a whole number of micro-batches (validate refuses other configs).

    >>> check_micro_batch_ms(250), check_micro_batch_ms(60_000)
    (None, None)
    >>> check_micro_batch_ms(1500)
    Traceback (most recent call last):
    ...
    ValueError: micro_batch_ms=1500 must divide 1000 or be whole seconds: a micro-batch may not straddle a trainer window
    """
    if micro_batch_ms <= 0 or (1000 % micro_batch_ms and micro_batch_ms % 1000):
        raise ValueError(f"micro_batch_ms={micro_batch_ms} must divide 1000 or be whole seconds: a micro-batch "
                         "may not straddle a trainer window")


def straddled_window(window_seconds: int, micro_batch_ms: int) -> str | None:
    """Why a trainer window of `window_seconds` cannot take this job's micro-batches whole
    (None when it can): epoch-aligned micro-batches fit epoch-aligned windows (operators/
    windowing.py) exactly when their length divides the window's.

    >>> straddled_window(120, 60_000), straddled_window(7, 250), straddled_window(45, 0)
    (None, None, None)
    >>> print(straddled_window(45, 60_000))
    trigger_policy.window_seconds: 45 s is not a whole number of this job's 60000 ms micro-batches (--micro-batch-ms): a micro-batch may not straddle a window
    """
    if micro_batch_ms > 0 and window_seconds * 1000 % micro_batch_ms:
        return (f"trigger_policy.window_seconds: {window_seconds} s is not a whole number of this job's "
                f"{micro_batch_ms} ms micro-batches (--micro-batch-ms): a micro-batch may not straddle a window")
    return None


def split_input_sql(table: str, condition: str, micro_batch_ms: int) -> tuple[str, str]:
    """The input table as validate reads it: the records `condition` does not prove, and one
    row per model and micro-batch for those it does (topic MICRO_BATCH_TOPIC, key the model,
    partition the count, payload the packed entries, timestamp the micro-batch's last ms).
    Returns the statement creating the view of the proven records, and the query."""
    check_micro_batch_ms(micro_batch_ms)
    # Epoch ms of the Kafka timestamp (TIMESTAMPDIFF is an INT; MOD: whatever EXTRACT counts beyond the ms).
    millis = ("(CAST(TIMESTAMPDIFF(SECOND, TO_TIMESTAMP_LTZ(0, 3), `ts`) AS BIGINT) * 1000"
              " + MOD(EXTRACT(MILLISECOND FROM `ts`), 1000))")
    entry = (f"CONCAT_WS(U&'\\0002', CAST({millis} AS STRING), `topic`, CAST(`partition` AS STRING), "
             "CAST(`offset` AS STRING), `payload`)")
    # The proven layout puts model_id first, in a string without escapes: it is the fourth
    # piece between double quotes, no JSON parse needed. ARRAY_AGG, not LISTAGG, whose
    # accumulator is copied whole on every append (quadratic in a micro-batch's entries).
    view = f"""
        CREATE TEMPORARY VIEW `{table}_fast` AS
        SELECT SPLIT_INDEX(`payload`, '"', 3) AS `model_id`, {entry} AS `entry`, `ts` FROM `{table}`
        WHERE ({condition}) IS TRUE"""
    query = f"""
        SELECT `key`, `payload`, `topic`, `partition`, `offset`, `ts` FROM `{table}`
        WHERE ({condition}) IS NOT TRUE
        UNION ALL
        SELECT `model_id` AS `key`, ARRAY_JOIN(ARRAY_AGG(`entry`), U&'\\0001') AS `payload`,
               '{MICRO_BATCH_TOPIC}' AS `topic`,
               CAST(COUNT(*) AS INT) AS `partition`, CAST(0 AS BIGINT) AS `offset`, `window_time` AS `ts`
        FROM TABLE(TUMBLE(TABLE `{table}_fast`, DESCRIPTOR(`ts`), INTERVAL '{micro_batch_ms / 1000:.3f}' SECOND))
        GROUP BY `model_id`, `window_start`, `window_end`, `window_time`"""
    return view, query


def pack_entry(ts: int, topic: str, partition: int, offset: int, payload: str) -> str:
    """One sample of a micro-batch, as the SQL above writes it (for tests and docs)."""
    return FIELD_SEPARATOR.join((str(ts), topic, str(partition), str(offset), payload))


def unpack(body: str) -> Iterator[tuple[int, str, int, int, str]]:
    """A micro-batch's samples: (ts, topic, partition, offset, payload)."""
    for entry in body.split(ENTRY_SEPARATOR):
        ts, topic, partition, offset, payload = entry.split(FIELD_SEPARATOR, 4)
        yield int(ts), topic, int(partition), int(offset), payload


def micro_batch_samples(body: str) -> list[Pending]:
    """A micro-batch's samples as the trainer keeps them, as FeedbackSample would give them
    (core/messages/feedback.py: weight 1.0 by default, 0 for a rejected completion).

    >>> [(p.sample_id, p.weight, p.ts, p.offset) for p in micro_batch_samples(pack_entry(
    ...     5, "t", 0, 9, '{"model_id":"m","sample_id":"s","prompt":"p","completion":"c","label":"rejected","ts":5}'))]
    [('s', 0.0, 5, 9)]
    """
    samples = []
    for ts, topic, partition, offset, payload in unpack(body):
        d = json.loads(payload)
        weight = 0.0 if d.get("label") == "rejected" else float(d.get("weight", 1.0))
        samples.append(Pending(d["sample_id"], d["prompt"], d["completion"], weight, ts, topic, partition, offset,
                               payload))
    return samples


@dataclass(frozen=True)
class PendingBatch:
    """A micro-batch waiting in its model's pending samples as it came, unpacked only when a
    window closes (`expand`): appending it costs one element, not one per sample. `ts` is the
    micro-batch's last millisecond: its samples all end the same trainer window as it does
    (a micro-batch divides its window: `check_micro_batch_ms`, `straddled_window`)."""

    ts: int
    count: int
    body: str


def expand(pending) -> list[Pending]:
    """Pending samples with every micro-batch unpacked.

    >>> body = pack_entry(5, "t", 0, 9, '{"model_id":"m","sample_id":"a","prompt":"p","completion":"c","ts":5}')
    >>> [p.sample_id for p in expand([PendingBatch(99, 1, body)] + micro_batch_samples(body))]
    ['a', 'a']
    """
    out: list[Pending] = []
    for item in pending:
        if isinstance(item, PendingBatch):
            out.extend(micro_batch_samples(item.body))
        else:
            out.append(item)
    return out
