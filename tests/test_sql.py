"""Every shipped .sql file against the local stack's Kafka, on an embedded mini-cluster.

One module-wide TableEnvironment (a local mini-cluster per query) reads topics named for this
module run. The records are core.messages models written as their `.to_json()`, as the job,
the registrar and producers write them (so a drift between the models and sql/ fails here),
produced with kafka-python, record timestamps = event times, in event-time order; a final
"closer" record far later in event time moves the watermark past every window of the data
(its own windows never close, so it never shows in results). Each query's rows are compared
with values computed here in plain Python from the produced models.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import subprocess
import sys
import uuid
from collections import Counter, defaultdict
from datetime import datetime, timezone
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from types import SimpleNamespace

import pytest

from core.messages import (AdapterConfig, AdapterVersionBroadcast, DeadLetter, FeedbackSample, FinetuneSpec,
                           InferenceRecord, Lineage, Message, OffsetRange, RetrainTrigger, SourcePosition,
                           TriggerPolicy, VersionMetrics, VersionRecord)
from streamtune.sqlclient.command import add_parser, cmd_sql
from streamtune.sqlclient.runner import new_table_env, run_file, run_statements

pytestmark = pytest.mark.sql

REPO = Path(__file__).resolve().parents[1]
SQL = REPO / "sql"
MIN = 60_000
HOUR = 60 * MIN
BASE = 1_767_225_600_000            # 2026-01-01T00:00:00Z
FAR = BASE + 10 * 24 * HOUR + 30_000  # the closers: past every window of the data
TRIG_START = BASE + 5 * MIN         # model `trig`: window w is [TRIG_START + 5 min * w, + 5 min)
TIMEOUT = 120                       # seconds a query may take to return its rows
IDLE = 3.0                          # a query is done once no row came for this long (all rows
                                    # come in one burst when the closer's watermark arrives)
THRESHOLD, MIN_LABELLED, TRIGGER_MINUTES = 0.3, 4, 5
SERVE_START = BASE + 30 * MIN       # served responses: minutes 30 and 31 (two windows)
JUDGE = 10 * MIN                    # serving_metrics.sql's judge_minutes (its default)
SEVERITY = {"accepted": 1, "corrected": 2, "rejected": 3}  # a response's verdict: its most severe label
LABELS = ("accepted", "corrected", "rejected")
WORDS = ["x=1234;y=", "2345", "hello", "world", "stream", "tune", "lora", "adapter", "token", "9", "a+b", "éß"]


def utc(ms: int) -> datetime:
    """How a TIMESTAMP(3) column (UTC session time zone) comes back from PyFlink."""
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).replace(tzinfo=None)


def floor(ms: int, size: int) -> int:
    return ms - ms % size


# ----------------------------------------------------------------------------------- data

def trigger_plan() -> list[tuple[int, int, int]]:
    """Model `trig`, 5-minute windows: (corrected, labelled, unlabelled) per window.

    threshold 0.30, min_labelled 4; windows that must fire: 3 (0.4 after 0.3 = threshold),
    6 (0.6 after 0.2) and 8 (0.5 after an empty window 7). Window 4 (0.5) follows an above-
    threshold window; window 9 is all corrected but has only 3 labels.
    """
    return [(1, 10, 2), (2, 10, 1), (3, 10, 2), (4, 10, 0), (5, 10, 2), (2, 10, 1), (6, 10, 2), (0, 0, 0),
            (5, 10, 1), (3, 3, 1), (0, 10, 2)]


TRIG_FIRES = [3, 6, 8]


def make_feedback(rng: random.Random, extra=()) -> list[tuple[int, FeedbackSample | bytes]]:
    """(event time ms, record) of the feedback topic, sorted by event time: samples (and the
    `extra` ones), two records the queries must not count, then the closer."""
    records = list(extra)

    def sample(model, ts, label, weight=1.0):
        completion = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 14)))
        records.append((ts, FeedbackSample(model_id=model, sample_id=f"{model}-{len(records)}", prompt="x=1234;y=",
                                           completion=completion, label=label, weight=weight, ts=ts)))

    start = BASE + 3 * MIN
    for model in ("m-a", "m-b"):
        for _ in range(110):
            ts = start + rng.randrange(0, 70 * MIN)  # crosses an hour: two CUMULATE hours
            label = rng.choices([*LABELS, None], weights=[45, 25, 10, 20])[0]
            sample(model, ts, label, rng.choice([0.0, 0.5, 1.0, 2.0, 3.5]))
    for w, (corrected, labelled, unlabelled) in enumerate(trigger_plan()):
        labels = ["corrected"] * corrected + ["rejected"] * min(1, labelled - corrected)
        labels += ["accepted"] * (labelled - len(labels)) + [None] * unlabelled
        for label in labels:
            sample("trig", TRIG_START + w * TRIGGER_MINUTES * MIN + rng.randrange(0, TRIGGER_MINUTES * MIN), label)
    # not JSON: skipped by the table; a sample without its model: filtered by every query
    records.append((start + 7 * MIN, b"{not json"))
    orphan = FeedbackSample(model_id="orphan", sample_id="orphan", prompt="p", completion="c", ts=start + 8 * MIN)
    records.append((orphan.ts, json.dumps({k: v for k, v in orphan.to_dict().items() if k != "model_id"}).encode()))
    records.sort(key=lambda r: r[0])
    records.append((FAR, FeedbackSample(model_id="zz-closer", sample_id="closer", prompt="", completion="closer",
                                        ts=FAR)))
    return records


def make_serving(rng: random.Random):
    """Responses as `streamtune serve` logs them (InferenceRecord; event time = ts) and the
    feedback citing them: (inference log records with the closer, feedback samples).

    Models, arms and versions: bot-a champion 3 / candidate 4 / base, bot-b pinned 5 and
    champion 6, promoted to 7 in the second minute. By response number, feedback: none; one
    label within the judging bound; a click and a correction or rejection, in either order
    (the verdict is the more severe); unlabelled; at exactly ts + JUDGE (counts) and
    ts + JUDGE + 1 ms (does not); at ts - 1 ms (does not) and at ts (counts); from the other
    model (does not); accepted twice (counts once). Plus a response logged twice (counts
    once) and labelled feedback citing unknown request ids.
    """
    responses, feedback = [], []

    def judge(model, ts, label, request_id):
        feedback.append((ts, FeedbackSample(model_id=model, sample_id=f"judge-{len(feedback)}", prompt="x=1234;y=",
                                            completion=rng.choice(WORDS), label=label, ts=ts,
                                            request_id=request_id)))

    for i in range(96):
        ts = SERVE_START + rng.randrange(0, 2 * MIN)
        model = ("bot-a", "bot-b")[i % 2]
        if model == "bot-a":
            arm, version, alias = rng.choice([("champion", 3, "champion"), ("candidate", 4, "candidate"),
                                              ("base", None, None)])
        elif rng.random() < 0.3:
            arm, version, alias = "pinned", 5, None
        else:
            arm, version, alias = "champion", 6 if ts < SERVE_START + 90_000 else 7, "champion"
        r = InferenceRecord(request_id=f"cmpl-{i:04d}{uuid.UUID(int=rng.getrandbits(128)).hex[:8]}", model_id=model,
                            version=version, alias=alias, arm=arm, user=rng.choice([None, "u1", "u2"]),
                            prompt="x=1234;y=", completion=rng.choice(WORDS),
                            mean_logprob=-round(rng.uniform(0.01, 3.0), 6), latency_ms=round(rng.uniform(1, 250), 3),
                            ts=ts)
        responses.append((ts, r))
        rid, case = r.request_id, i // 2 % 8
        if case == 1:
            judge(model, ts + rng.randrange(0, JUDGE), rng.choice(list(SEVERITY)), rid)
        elif case == 2:  # a click and a correction or rejection, in either order
            labels = ["accepted", rng.choice(["corrected", "rejected"])]
            first = ts + rng.randrange(0, JUDGE // 2)
            for label, at in zip(labels[::rng.choice([1, -1])], (first, first + rng.randrange(1, JUDGE // 2))):
                judge(model, at, label, rid)
        elif case == 3:
            judge(model, ts + rng.randrange(0, JUDGE), None, rid)
        elif case == 4:
            judge(model, ts + JUDGE, rng.choice(list(SEVERITY)), rid)
            judge(model, ts + JUDGE + 1, "rejected", rid)
        elif case == 5:
            judge(model, ts - 1, "rejected", rid)
            judge(model, ts, rng.choice(list(SEVERITY)), rid)
        elif case == 6:
            judge("bot-b" if model == "bot-a" else "bot-a", ts + 1000, "accepted", rid)
        elif case == 7:
            judge(model, ts + rng.randrange(0, JUDGE), "accepted", rid)
            judge(model, ts + rng.randrange(0, JUDGE), "accepted", rid)  # judged twice, counted once
        if i == 11:
            responses.append((ts, r))  # logged twice (an at-least-once producer retried)
    for k in range(5):
        judge(rng.choice(["bot-a", "bot-b"]), SERVE_START + rng.randrange(0, 3 * MIN), "rejected", f"cmpl-unknown-{k}")
    responses.sort(key=lambda x: x[0])
    responses.append((FAR, InferenceRecord(request_id="closer", model_id="zz-closer", arm="base", prompt="",
                                           completion="closer", mean_logprob=-1.0, latency_ms=1.0, ts=FAR)))
    return responses, feedback


def make_dlq(rng: random.Random, feedback_topic: str) -> list[tuple[int, DeadLetter]]:
    """Dead letters as the job writes them (core.messages.DeadLetter), of every record kind."""
    records = []
    for i in range(70):
        ts = BASE + 2 * MIN + rng.randrange(0, 30 * MIN)
        kind, model_id = "sample", None
        reason = rng.choice(["bad_json", "schema", "schema", "unknown_model", "empty", "unsupported_source",
                             "not_a_change_event"])
        model = rng.choice(["m-a", "m-b", "m-c"])
        sample = FeedbackSample(model_id=model, sample_id=f"s{i}", prompt="p", completion="c", ts=ts)
        if reason == "bad_json":
            payload = sample.to_json()[:-1] + ", oops"
        elif reason == "schema":  # a sample missing fields
            kept = ("model_id", "sample_id") if rng.random() < 0.7 else ("prompt",)
            payload = json.dumps({k: v for k, v in sample.to_dict().items() if k in kept})
        elif reason == "unknown_model":
            payload, model_id = sample.to_json(), model
        elif reason == "empty":
            payload = None
        elif reason == "unsupported_source":  # a spec for another job's source
            kind, payload = "config", FinetuneSpec(
                model_id=model, stream_source="kafka://topic=other",
                adapter_config=AdapterConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]),
                trigger_policy=TriggerPolicy(min_samples_per_window=8, window_seconds=60)).to_json()
        else:  # a sample on a change-event topic
            kind, payload = "change", sample.to_json()
        records.append((ts, DeadLetter(reason=reason, detail="detail", kind=kind, model_id=model_id, payload=payload,
                                       source=SourcePosition(topic=feedback_topic, partition=0, offset=i, timestamp=ts))))
    records.sort(key=lambda r: r[0])
    records.append((FAR, DeadLetter(reason="empty", detail="closer", kind="sample",
                                    source=SourcePosition(topic=feedback_topic, partition=0, offset=999, timestamp=FAR))))
    return records


def version_record(model_id: str, seq: int, window_end: int, version_id: str) -> VersionRecord:
    """A version record as the trainer emits it (operators/finetune_function.py)."""
    return VersionRecord(
        version_id=version_id, model_id=model_id, seq=seq, window_start=window_end - 2 * MIN, window_end=window_end,
        artifact_uri="file:///adapters/" + "ab" * 32, sha256="ab" * 32, base_model="/models/tiny",
        config_version=1, fresh_adapter=seq == 1,
        adapter=AdapterConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]),
        trigger_policy=TriggerPolicy(min_samples_per_window=8, window_seconds=120),
        metrics=VersionMetrics(loss_before=2.5, loss_after=2.1, samples=8, tokens=96, step_seconds=0.05,
                               operator_seconds=0.07 * seq),
        lineage=Lineage(sample_ids=["s1"], offsets=[OffsetRange(topic="t", partition=0, first=0, last=7)]),
        trigger=("window", "max_samples", "forced")[seq % 3])


def broadcast(model_id: str, seq: int, version_id: str, aliases: list[str]) -> AdapterVersionBroadcast:
    """The registrar's broadcast of a registered version (streamtune/registrar.py)."""
    return AdapterVersionBroadcast(version_id=version_id, model_id=model_id, seq=seq, mlflow_version=seq,
                                   model_uri=f"models:/{model_id}/{seq}", sha256="ab" * 32,
                                   artifact_uri="file:///adapters/" + "ab" * 32, aliases=aliases)


def make_versions(rng: random.Random):
    """Version records (event time = window_end) and registrar broadcasts (event time = publish time)."""
    versions, broadcasts = [], []
    for model in ("m-a", "m-b", "m-c"):
        for seq in range(1, 7):
            window_end = BASE + seq * 9 * MIN + rng.randrange(0, 3) * MIN
            vid = f"{model}-v{seq}-{uuid.uuid4().hex[:6]}"
            versions.append((window_end, version_record(model, seq, window_end, vid)))
            published = window_end + rng.randrange(500, 20 * MIN)
            if (model, seq) == ("m-a", 2):
                continue                               # never broadcast: not reported
            if (model, seq) == ("m-b", 3):
                published = window_end + HOUR + 1      # over the interval bound: not reported
            if (model, seq) == ("m-c", 5):
                published = window_end + HOUR          # exactly at the bound: reported
            msg = broadcast(model, seq, vid, ["candidate", "champion"] if seq % 2 else ["candidate"])
            broadcasts.append((published, msg))
            if (model, seq) == ("m-a", 4):              # the registrar re-broadcast it (at-least-once)
                broadcasts.append((published + 30_000, msg))
            if (model, seq) == ("m-b", 5):              # the version record came twice (replay)
                versions.append((window_end, versions[-1][1]))
    broadcasts.append((BASE + 20 * MIN, broadcast("m-a", 99, "unknown", [])))
    versions.sort(key=lambda r: r[0])
    broadcasts.sort(key=lambda r: r[0])
    versions.append((FAR, version_record("zz-closer", 1, FAR, "closer-version")))
    broadcasts.append((FAR, broadcast("zz-closer", 1, "closer-broadcast", [])))
    return versions, broadcasts


def produce(bootstrap: str, topic: str, records) -> None:
    """Each message as its `.to_json()` (bytes as they are), record timestamp = event time."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    for ts, value in records:
        if isinstance(value, Message):
            value = value.to_json().encode()
        producer.send(topic, value=value, key=None, partition=0, timestamp_ms=ts)
    producer.flush()
    producer.close()


def counted_samples(records) -> list[FeedbackSample]:
    """The samples the queries count: those with a model_id, minus the closer (event time = ts)."""
    return [s for _, s in records if isinstance(s, FeedbackSample) and s.model_id != "zz-closer"]


# ------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def sql_env(stack_config, base_model, tmp_path_factory):
    from connectors.kafka import create_topic
    from udfs import tokenizer_catalogue

    bootstrap = stack_config.kafka_bootstrap
    prefix = f"test.sql-{uuid.uuid4().hex[:8]}"
    topics = {k: f"{prefix}.{k}" for k in ("feedback", "dlq", "versions", "adapter-versions", "configs",
                                           "inference-log")}
    for topic in topics.values():
        create_topic(bootstrap, topic)
    inference, judgements = make_serving(random.Random(16))  # its own rng: the other data stays the same
    rng = random.Random(6)
    feedback = make_feedback(rng, judgements)
    dlq = make_dlq(rng, topics["feedback"])
    versions, broadcasts = make_versions(rng)
    produce(bootstrap, topics["feedback"], feedback)
    produce(bootstrap, topics["dlq"], dlq)
    produce(bootstrap, topics["versions"], versions)
    produce(bootstrap, topics["adapter-versions"], broadcasts)
    produce(bootstrap, topics["inference-log"], inference)

    with pytest.MonkeyPatch.context() as mp:
        # Python UDFs of a local job run in this process: they see this catalogue
        mp.setenv("STREAMTUNE_TOKENIZER_CATALOGUE", str(tmp_path_factory.mktemp("tokenizers")))
        tokenizer_catalogue.register(topics["feedback"], base_model)  # the per-topic tokenizer
        variables = {"bootstrap": bootstrap, "feedback_topic": topics["feedback"], "dlq_topic": topics["dlq"],
                     "versions_topic": topics["versions"], "adapter_versions_topic": topics["adapter-versions"],
                     "inference_log_topic": topics["inference-log"],
                     "config_topic": topics["configs"], "lateness_seconds": "0", "tokenizer": topics["feedback"],
                     "threshold": str(THRESHOLD), "min_labelled": str(MIN_LABELLED),
                     "window_minutes": str(TRIGGER_MINUTES)}
        t_env = new_table_env()
        run_file(SQL / "ddl.sql", variables, t_env)
        yield SimpleNamespace(t_env=t_env, variables=variables, topics=topics, bootstrap=bootstrap,
                              base_model=base_model, feedback=feedback, samples=counted_samples(feedback), dlq=dlq,
                              versions=versions, broadcasts=broadcasts, inference=inference)


def query(env, name: str, **extra) -> list[dict]:
    """All rows of a shipped query: it runs until no row came for IDLE seconds (extra rows show)."""
    results = run_file(SQL / name, {**env.variables, **extra}, env.t_env, idle=IDLE, timeout=TIMEOUT)
    select = [r for r in results if r.kind == "query"]
    assert len(select) == 1, [r.kind for r in results]
    return [dict(zip(select[0].columns, row)) for row in select[0].rows]


def approx(x, digits=9):
    return None if x is None else round(float(x), digits)


# ---------------------------------------------------------------------------------- tests

def test_ddl_declares_the_tables_with_watermarks(sql_env):
    tables = set(sql_env.t_env.list_temporary_tables())
    assert {"feedback", "dlq", "versions", "adapter_versions", "inference_log"} <= tables
    for table, column in (("feedback", "event_time"), ("dlq", "event_time"), ("versions", "data_end"),
                          ("adapter_versions", "published_at"), ("inference_log", "served_at")):
        [described] = [r for r in run_statements(f"DESCRIBE {table}", sql_env.variables, sql_env.t_env)]
        by_name = {row[0]: row for row in described.rows}
        assert "ROWTIME" in str(by_name[column][1]), by_name[column]
        assert by_name[column][5], f"{table}.{column} has no watermark"


def plain(value, flink_type):
    """A collected value as JSON-like Python: a ROW (positional in PyFlink) as a dict by field name."""
    if value is None:
        return None
    if flink_type.name == "ROW":
        # PyFlink 2.0.2 collects a nested ROW as a Row holding one list of its values
        values = value[0] if len(value) == 1 and len(flink_type.fields) > 1 else value
        assert len(values) == len(flink_type.fields), (value, flink_type)
        return {f.name: plain(v, f.type) for f, v in zip(flink_type.fields, values)}
    if flink_type.name == "ARRAY":
        return [plain(v, flink_type.element) for v in value]
    return value


def read_as(wire, flink_type):
    """A JSON value as a column of `flink_type` holds it: a ROW keeps the fields it names."""
    if wire is None:
        return None
    if flink_type.name == "ROW":
        return {f.name: read_as(wire.get(f.name), f.type) for f in flink_type.fields}
    if flink_type.name == "ARRAY":
        return [read_as(v, flink_type.element) for v in wire]
    return wire


def test_tables_read_the_messages_as_the_models_write_them(sql_env):
    """Every physical column of every table, collected from the produced records, holds what
    the record's JSON holds; the columns are those tests/test_contracts.py reads from ddl.sql."""
    from test_contracts import Tokens, create_tables, parse_type

    declared = create_tables((SQL / "ddl.sql").read_text())
    from test_contracts import TABLES

    sources = {"feedback": sql_env.feedback, "dlq": sql_env.dlq, "versions": sql_env.versions,
               "adapter_versions": sql_env.broadcasts, "inference_log": sql_env.inference}
    assert set(sources) == set(TABLES)  # every table of the contract, read back here
    for table, records in sources.items():
        [described] = run_statements(f"DESCRIBE {table}", sql_env.variables, sql_env.t_env)
        columns = {row[0]: parse_type(Tokens(row[1])) for row in described.rows if row[4] is None}  # no extras
        assert [(c.name, str(c.type)) for c in declared[table]] == [(n, str(t)) for n, t in columns.items()]
        expected = []
        for _, record in records:
            try:
                wire = json.loads(record.to_json() if isinstance(record, Message) else record)
            except ValueError:
                continue  # not JSON: the table skips it
            expected.append({name: read_as(wire.get(name), t) for name, t in columns.items()})
        select = ", ".join(f"`{name}`" for name in columns)
        [result] = run_statements(f"SELECT {select} FROM {table}", sql_env.variables, sql_env.t_env,
                                  max_rows=len(expected), timeout=TIMEOUT)
        got = [{name: plain(value, t) for (name, t), value in zip(columns.items(), row)} for row in result.rows]
        assert got == expected, table


def expected_samples(env) -> Counter:
    groups = defaultdict(list)
    for s in env.samples:
        groups[(floor(s.ts, MIN), s.model_id)].append(s)
    out = Counter()
    for (start, model), ss in groups.items():
        weight = sum(s.effective_weight for s in ss)  # the weight the trainer gives each sample
        out[(utc(start), utc(start + MIN), model, len(ss), sum(s.label in LABELS for s in ss), approx(weight))] += 1
    return out


def test_samples_per_model_through_the_command_line(sql_env, capsys):
    """`streamtune sql -f sql/samples_per_model.sql -D ... --idle S` (ddl.sql runs first)."""
    expected = expected_samples(sql_env)
    parser = argparse.ArgumentParser(prog="streamtune")
    add_parser(parser.add_subparsers(dest="command"))
    defines = [arg for k, v in sql_env.variables.items() for arg in ("-D", f"{k}={v}")]
    args = parser.parse_args(["sql", "-f", str(SQL / "samples_per_model.sql"), *defines,
                              "--idle", str(IDLE), "--timeout", str(TIMEOUT)])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split("\t") == ["window_start", "window_end", "model_id", "samples", "labelled", "weight_sum"]
    got = Counter()
    for line in lines[1:]:
        start, end, model, samples, labelled, weight = line.split("\t")
        got[(datetime.fromisoformat(start), datetime.fromisoformat(end), model, int(samples), int(labelled),
             approx(weight))] += 1
    assert got == expected


def test_label_rates(sql_env):
    groups = defaultdict(list)
    for s in sql_env.samples:
        first = floor(s.ts, MIN)
        for start in range(first - 4 * MIN, first + 1, MIN):  # the 5 hop windows holding it
            groups[(start, s.model_id)].append(s.label)
    expected = Counter()
    for (start, model), labels in groups.items():
        n = Counter(labels)
        labelled = n["accepted"] + n["corrected"] + n["rejected"]
        rate = (lambda k: n[k] / labelled if labelled else None)
        expected[(utc(start), utc(start + 5 * MIN), model, len(labels), labelled, n["accepted"], n["corrected"],
                  n["rejected"], approx(rate("accepted")), approx(rate("corrected")), approx(rate("rejected")))] += 1
    rows = query(sql_env, "label_rates.sql")
    got = Counter((r["window_start"], r["window_end"], r["model_id"], r["samples"], r["labelled"], r["accepted"],
                   r["corrected"], r["rejected"], approx(r["acceptance_rate"]), approx(r["correction_rate"]),
                   approx(r["rejection_rate"])) for r in rows)
    assert got == expected


def test_token_lengths_use_the_catalogued_tokenizer(sql_env):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(sql_env.base_model), local_files_only=True)
    width = 8
    groups = defaultdict(list)
    for s in sql_env.samples:
        n = len(tok(s.completion, add_special_tokens=False)["input_ids"])
        hour = floor(s.ts, HOUR)
        for step in range(1, 7):  # cumulative windows [hour, hour + 10 min * step)
            if s.ts < hour + step * 10 * MIN:
                groups[(hour, hour + step * 10 * MIN, s.model_id, n - n % width)].append(n)
    expected = Counter({(utc(h), utc(e), m, lo, lo + width - 1, len(ns), sum(ns)): 1
                        for (h, e, m, lo), ns in groups.items()})
    assert len({lo for (_, _, _, lo) in groups}) >= 2, "the data should spread over several buckets"
    rows = query(sql_env, "token_lengths.sql", bucket_width=str(width))
    got = Counter((r["window_start"], r["window_end"], r["model_id"], r["bucket_lo"], r["bucket_hi"],
                   r["samples"], r["tokens"]) for r in rows)
    assert got == expected


def dlq_model(record: DeadLetter):
    """The model of a dead letter: its model_id, else the payload's (plain json, not the UDF)."""
    if record.model_id is not None:
        return record.model_id
    try:
        payload = json.loads(record.payload)
    except (TypeError, ValueError):
        return None
    return payload.get("model_id") if isinstance(payload, dict) else None


def test_dlq_rate_by_reason(sql_env):
    groups = Counter()
    for _, record in sql_env.dlq[:-1]:
        first = floor(record.source.timestamp, MIN)
        for start in range(first - 4 * MIN, first + 1, MIN):
            groups[(start, record.reason, dlq_model(record))] += 1
    expected = Counter({(utc(s), utc(s + 5 * MIN), reason, model, n, approx(n / 5)): 1
                        for (s, reason, model), n in groups.items()})
    assert any(model is None for (_, _, model) in groups) and any(model for (_, _, model) in groups)
    assert {r.kind for _, r in sql_env.dlq} == {"sample", "config", "change"}
    rows = query(sql_env, "dlq_rate.sql")
    got = Counter((r["window_start"], r["window_end"], r["reason"], r["model_id"], r["dead_letters"],
                   approx(r["per_minute"])) for r in rows)
    assert got == expected


def test_freshness_per_adapter_version(sql_env):
    versions = {}
    for _, v in sql_env.versions[:-1]:
        versions[v.version_id] = v
    published = defaultdict(list)
    for ts, b in sql_env.broadcasts[:-1]:
        v = versions.get(b.version_id)
        if v is not None and v.window_end <= ts <= v.window_end + HOUR:
            published[b.version_id].append(ts)
    expected = Counter()
    for vid, times in published.items():
        v, first = versions[vid], min(times)
        hour = floor(first, HOUR)
        expected[(utc(hour), utc(hour + HOUR), v.model_id, vid, v.seq, v.seq, utc(v.window_end),
                  utc(first), first - v.window_end, len(set(times)))] += 1
    assert len(expected) == 18 - 2  # one never broadcast, one broadcast too late
    assert any(key[-1] == 2 for key in expected)
    rows = query(sql_env, "freshness.sql")
    got = Counter((r["window_start"], r["window_end"], r["model_id"], r["version_id"], r["seq"], r["mlflow_version"],
                   r["data_window_end"], r["published_at"], r["freshness_ms"], r["broadcasts"]) for r in rows)
    assert got == expected


def expected_serving_metrics(env) -> Counter:
    """Per minute of response time, model, arm and version: the responses (each request id
    once), those judged by labelled feedback of the same model within [ts, ts + JUDGE], their
    verdicts (the most severe label), the rates over judged, mean latency and mean logprob."""
    served = {}
    for ts, r in env.inference[:-1]:
        served.setdefault(r.request_id, (ts, r))
    verdicts = defaultdict(int)
    for ts, f in env.feedback:
        if isinstance(f, FeedbackSample) and f.request_id in served and f.label in SEVERITY:
            t, r = served[f.request_id]
            if f.model_id == r.model_id and t <= ts <= t + JUDGE:
                verdicts[r.request_id] = max(verdicts[r.request_id], SEVERITY[f.label])
    groups = defaultdict(list)
    for rid, (t, r) in served.items():
        groups[(floor(t, MIN), r.model_id, r.arm, r.version)].append((verdicts[rid], r))
    out = Counter()
    for (start, model, arm, version), rs in groups.items():
        n = Counter(v for v, _ in rs)
        judged = len(rs) - n[0]
        rate = (lambda k: n[k] / judged if judged else None)
        out[(utc(start), utc(start + MIN), model, arm, version, len(rs), judged, n[1], n[2], n[3],
             approx(rate(1)), approx(rate(2)), sum(r.latency_ms for _, r in rs) / len(rs),
             sum(r.mean_logprob for _, r in rs) / len(rs))] += 1
    return out


def means_close(got: Counter, expected: Counter) -> bool:
    """The same rows, the two means (the last fields) equal to 1e-6 relative: a double average in
    Flink and one in Python differ in the last digits, so rounding both could split at a boundary."""
    def split(rows: Counter) -> dict:
        return {key[:-2]: [float(x) for x in key[-2:]] for key in rows.elements()}
    g, e = split(got), split(expected)
    return sum(got.values()) == sum(expected.values()) == len(g) == len(e) and g.keys() == e.keys() and all(
        math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) for k in g for a, b in zip(g[k], e[k]))


def test_serving_metrics_per_arm(sql_env):
    expected = expected_serving_metrics(sql_env)
    # the data covers what the query must tell apart
    keys = {(start, model, arm, version) for (start, _, model, arm, version, *_) in expected}
    assert len({k[0] for k in keys}) == 2 and {k[2] for k in keys} == {"champion", "candidate", "pinned", "base"}
    assert {(k[1], k[3]) for k in keys if k[2] == "champion"} == {("bot-a", 3), ("bot-b", 6), ("bot-b", 7)}
    assert all(sum(row[i] for row in expected) > 0 for i in (7, 8, 9))  # accepted, corrected, rejected
    assert sum(row[5] - row[6] for row in expected) > 0                  # responses not judged
    assert len(sql_env.inference) - 1 == len({r.request_id for _, r in sql_env.inference[:-1]}) + 1  # one duplicate
    rows = query(sql_env, "serving_metrics.sql")
    got = Counter((r["window_start"], r["window_end"], r["model_id"], r["arm"], r["version"], r["responses"],
                   r["judged"], r["accepted"], r["corrected"], r["rejected"], approx(r["acceptance_rate"]),
                   approx(r["correction_rate"]), r["mean_latency_ms"], r["mean_logprob"])
                  for r in rows)
    assert means_close(got, expected), (got, expected)


def expected_triggers(env) -> list[dict]:
    """One trigger per crossing: rate > threshold, the window before it not above (or absent)."""
    size = TRIGGER_MINUTES * MIN
    windows = defaultdict(lambda: [0, 0])
    for s in env.samples:
        w = windows[(s.model_id, floor(s.ts, size))]
        w[0] += s.label == "corrected"
        w[1] += s.label in LABELS
    triggers, previous = [], {}
    for (model, start), (corrected, labelled) in sorted(windows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if labelled < MIN_LABELLED:
            continue
        rate = corrected / labelled
        prev = previous.get(model)
        previous[model] = (start, rate)
        if rate > THRESHOLD and not (prev and prev[0] + size == start and prev[1] > THRESHOLD):
            shown = Decimal(repr(rate)).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
            triggers.append({"model_id": model, "trigger": "retrain",
                             "reason": f"correction_rate {shown} > {THRESHOLD} ({corrected} of {labelled} labelled)",
                             "window_start": start, "window_end": start + size, "correction_rate": rate,
                             "corrected": corrected, "labelled": labelled, "threshold": THRESHOLD})
    return triggers


def test_retrain_trigger_fires_exactly_when_the_threshold_is_crossed(sql_env):
    from connectors.kafka import read_topic

    expected = expected_triggers(sql_env)
    trig = [t for t in expected if t["model_id"] == "trig"]
    # the designed model: fires at windows 3, 6, 8 only (not at 2 where rate == threshold,
    # not at 4 which stays above, not at 9 with too few labels)
    assert [(t["window_start"] - TRIG_START) // (TRIGGER_MINUTES * MIN) for t in trig] == TRIG_FIRES
    assert trig[0]["reason"] == "correction_rate 0.40 > 0.3 (4 of 10 labelled)"

    results = run_file(SQL / "retrain_trigger.sql", sql_env.variables, sql_env.t_env)
    job = results[-1].table_result.get_job_client()
    assert results[-1].kind == "insert" and job is not None
    try:
        records = read_topic(sql_env.bootstrap, sql_env.topics["configs"], expect=len(expected), timeout=TIMEOUT)
        # nothing more comes: the closer closed every window, and the job is idle now
        records = read_topic(sql_env.bootstrap, sql_env.topics["configs"], idle=3.0, timeout=30)
    finally:
        job.cancel().result()
    got = [json.loads(r.value) for r in records]
    assert [r.key.decode() for r in records] == [t["model_id"] for t in got]
    # the job reads each as a RetrainTrigger (the evidence fields ride along, ignored)
    triggers = [RetrainTrigger.from_json(r.value) for r in records]
    assert [(t.model_id, t.trigger, t.reason, t.window_end) for t in triggers] == \
        [(t["model_id"], t["trigger"], t["reason"], t["window_end"]) for t in got]
    order = lambda t: (t["window_end"], t["model_id"])
    assert sorted(got, key=order) == sorted(expected, key=order)
    for model in {t["model_id"] for t in got}:  # each model's triggers in window order
        ends = [t["window_end"] for t in got if t["model_id"] == model]
        assert ends == sorted(ends)


def test_functions_sql_registers_the_udfs_as_sql_client_would(sql_env):
    """sql/functions.sql in a TableEnvironment without register_all; each UDF checked in SQL."""
    from transformers import AutoTokenizer

    from udfs.json_path import extract
    from udfs.pseudo_label import label_for

    t_env = new_table_env(udfs=False)
    with pytest.raises(Exception, match="json_path"):
        t_env.execute_sql("SELECT json_path('{}', '$.a')").collect().close()
    run_file(SQL / "functions.sql", sql_env.variables, t_env, udfs=False)
    cases = [('{"a": {"b": [1, "two"]}}', "$.a.b[1]", "x=1234;y= 2345", -1.2, 3, 0.9),
             ("not json", "$.a", "hello world", -0.1, 1, 0.6),
             ('{"a": 1}', "$.missing", "", -5.0, 2, 0.2)]
    values = ", ".join(f"('{d}', '{p}', '{t}', CAST({lp} AS DOUBLE), {n}, CAST({s} AS DOUBLE))"
                       for d, p, t, lp, n, s in cases)
    tokenizer = sql_env.topics["feedback"]
    [result] = run_statements(
        f"SELECT json_path(d, p) AS j, token_count(t, '{tokenizer}') AS n_model, token_count(t, 'whitespace') AS n_ws, "
        f"confidence(lp, n) AS c, pseudo_label(s, 0.8, 0.5) AS l, pseudo_label(confidence(lp, n), 0.8, 0.5) AS l2 "
        f"FROM (VALUES {values}) AS v(d, p, t, lp, n, s)", sql_env.variables, t_env, udfs=False,
        max_rows=len(cases), timeout=TIMEOUT)
    tok = AutoTokenizer.from_pretrained(str(sql_env.base_model), local_files_only=True)
    expected = [(extract(d, p), len(tok(t, add_special_tokens=False)["input_ids"]), len(t.split()),
                 approx(math.exp(lp / n)), label_for(s, 0.8, 0.5), label_for(math.exp(lp / n), 0.8, 0.5))
                for d, p, t, lp, n, s in cases]
    assert expected[0][0] == "two" and expected[1][0] is None
    got = [(r[0], r[1], r[2], approx(r[3]), r[4], r[5]) for r in result.rows]
    assert sorted(got, key=str) == sorted(expected, key=str)


def test_prompt_runs_statements_ending_in_semicolons(sql_env):
    parser = argparse.ArgumentParser(prog="streamtune")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["sql", "-D", f"bootstrap={sql_env.bootstrap}", "--max-rows", "5"])
    stdin = io.StringIO("-- a comment; not a statement\n"
                        "SELECT json_path('{\"a\": [1, 2]}', '$.a[1]') AS v,\n"
                        "       pseudo_label(0.9, 0.8, 0.5) AS l;\n"
                        "SELECT no_such_column FROM feedback;\n"
                        "SHOW TABLES;\n"
                        "quit;\n"
                        "SELECT 'not reached';\n")
    out = io.StringIO()
    assert cmd_sql(args, stdin=stdin, out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["v\tl", "2\taccepted"]
    assert any(line.startswith("ERROR:") and "no_such_column" in line for line in lines)
    assert "feedback" in lines and "adapter_versions" in lines  # ddl.sql ran before the prompt
    assert "not reached" not in out.getvalue()


def test_module_entry_point_help():
    r = subprocess.run([sys.executable, "-m", "streamtune.sqlclient", "--help"], cwd=REPO, capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
    assert r.returncode == 0 and "-D NAME=VALUE" in r.stdout and "--max-rows" in r.stdout


def test_statements_variables_and_render():
    from streamtune.sqlclient.errors import SqlError
    from streamtune.sqlclient.runner import file_variables, render
    from streamtune.sqlclient.scanner import is_complete, split_statements

    text = ("-- var topic = t.default   a comment\n"
            "SET 'a' = 'b';  /* block; comment */\n"
            "SELECT ';' AS `semi;colon`, '${topic}' FROM x -- tail; comment\n;\n"
            "INSERT INTO y SELECT 'it''s; fine'")
    assert split_statements(text) == ["SET 'a' = 'b'", "SELECT ';' AS `semi;colon`, '${topic}' FROM x",
                                      "INSERT INTO y SELECT 'it''s; fine'"]
    assert file_variables(text) == {"topic": "t.default"}
    assert "'t.default'" in render(text, {"bootstrap": "b"})
    assert "'other'" in render(text, {"bootstrap": "b", "topic": "other"})
    with pytest.raises(SqlError, match="undefined variables \\['nope'\\]"):
        render("SELECT '${nope}'", {"bootstrap": "b"})
    assert not is_complete("SELECT 1") and not is_complete("SELECT ';'  -- x") and is_complete("SELECT 1; -- x")
    assert not is_complete("EXECUTE STATEMENT SET BEGIN INSERT INTO a SELECT 1;")
    assert is_complete("EXECUTE STATEMENT SET BEGIN INSERT INTO a SELECT 1; END;")
    assert not is_complete("SELECT 'a;") and not is_complete("SELECT 1; /* open;") and is_complete(";")
    assert split_statements("SELECT /*+ OPTIONS('a'=';') */ 1 FROM t; SELECT 2") == \
        ["SELECT /*+ OPTIONS('a'=';') */ 1 FROM t", "SELECT 2"]
    with pytest.raises(SqlError, match="unterminated ' quote"):
        split_statements("SELECT 'it''s")
    with pytest.raises(SqlError, match="unterminated /\\* comment"):
        split_statements("SELECT 1 /* never closed")

    parser = argparse.ArgumentParser(prog="streamtune")
    add_parser(parser.add_subparsers(dest="command"))
    out = io.StringIO()
    args = parser.parse_args(["sql", "--render", "-f", str(SQL / "label_rates.sql"), "-D", "bootstrap=kafka:9092",
                              "-D", "feedback_topic=fb"])
    assert cmd_sql(args, out=out) == 0
    rendered = out.getvalue()
    assert rendered.index("ddl.sql") < rendered.index("label_rates.sql")  # the init file first
    assert "'kafka:9092'" in rendered and "'fb'" in rendered and "HOP(TABLE feedback" in rendered


def test_every_shipped_file_renders_for_sql_client():
    """What `streamtune sql --render` gives sql-client.sh: no ${...} left, same statements."""
    from streamtune.sqlclient.runner import render
    from streamtune.sqlclient.scanner import split_statements

    shipped = sorted(SQL.glob("*.sql"))
    assert {p.name for p in shipped} == {"ddl.sql", "functions.sql", "samples_per_model.sql", "label_rates.sql",
                                         "token_lengths.sql", "dlq_rate.sql", "freshness.sql", "retrain_trigger.sql",
                                         "serving_metrics.sql"}
    for path in shipped:
        text = path.read_text()
        assert text.startswith("-- "), f"{path.name} lacks its header comment"
        out = render(text, {"bootstrap": "kafka:9092"})
        assert "${" not in out and len(split_statements(out)) == len(split_statements(text)), path.name
    import udfs

    assert split_statements((SQL / "functions.sql").read_text()) == udfs.create_statements()


def test_errors_go_to_stderr_with_the_usage_exit_code(capsys, tmp_path):
    from core.errors import EXIT_USAGE, StreamtuneError
    from streamtune.sqlclient.errors import SqlError
    from streamtune.sqlclient.prompt import repl

    assert issubclass(SqlError, StreamtuneError) and SqlError("x").exit_code == EXIT_USAGE == 2
    undefined, unterminated = tmp_path / "undefined.sql", tmp_path / "unterminated.sql"
    undefined.write_text("SELECT '${nope}';")
    unterminated.write_text("SELECT 'open;")
    parser = argparse.ArgumentParser(prog="streamtune")
    add_parser(parser.add_subparsers(dest="command"))
    for argv, message in ((["-D", "no-equals-sign"], "-D wants name=value, got 'no-equals-sign'"),
                          (["-f", str(tmp_path / "missing.sql")], "missing.sql: No such file or directory"),
                          (["-f", str(undefined)], "undefined variables ['nope']"),
                          (["-f", str(unterminated)], "unterminated ' quote")):
        out = io.StringIO()
        assert cmd_sql(parser.parse_args(["sql", "--render", "--no-init", *argv]), out=out) == EXIT_USAGE, argv
        err = capsys.readouterr().err
        assert err.startswith("streamtune: ") and message in err and len(err.splitlines()) == 1, err
    # the prompt: input ending inside a statement (a table environment is never needed)
    with pytest.raises(SqlError, match="incomplete statement at end of input"):
        repl(object(), stdin=io.StringIO("-- a comment; then\nSELECT 1"), out=io.StringIO())
    assert repl(object(), stdin=io.StringIO("-- only a comment\n"), out=io.StringIO()) == 0

