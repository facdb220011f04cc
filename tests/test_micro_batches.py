"""The JVM fast path (operators/micro_batches.py, marker `ingest`): what it proves valid,
operators/validate.py accepts unchanged, and the trainer keeps as the Python path would.

- Over 3,000 generated samples in the canonical layout, each with a chance of a digit run,
  an `@`, an escape, a control character, an out-of-range weight or timestamp, a bad label,
  another separator: whenever FAST_SAMPLE matches, `parse` accepts the record, redaction
  leaves it byte for byte, and `micro_batch_samples` gives the pending sample FeedbackSample
  gives. Enough of them match for the check to mean something, and enough do not.
- The same payloads through Flink SQL's REGEXP (java.util.regex, in a local mini-cluster)
  get the verdicts Python's `re` gives: the job runs the pattern in the JVM.
- The trainer: a model's samples in micro-batches give the versions they give one by one,
  and samples a checkpoint of an earlier version holds (the ValueState `pending`) train on.
- The equality of whole runs (fast path against the Python path, versions sample for sample
  and byte for byte, at parallelism 1 and 4) is in tests/test_scale.py.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.errors import InvalidMessage
from core.messages import FeedbackSample, FinetuneSpec, VersionRecord
from core.redaction import redact
from operators.micro_batches import (ENTRY_SEPARATOR, FAST_SAMPLE, MICRO_BATCH_TOPIC, fast_condition,
                                     micro_batch_samples, pack_entry, split_input_sql)
from operators.validate import parse, redact_sample
from operators.windowing import Pending
from pyflink.datastream import TimeDomain
from streamtune.testing import KeyedTimers, trainer_function
from test_trainer_windows import window_spec

pytestmark = pytest.mark.ingest
FAST = re.compile(FAST_SAMPLE)
T0 = 1_777_000_000_000

# Text that is near a rule's edge: digits in runs and groups, e-mail-ish, escapes, controls.
plain_text = st.from_regex(r"[a-zA-Z =;,.é✓]{0,20}", fullmatch=True)
edgy_text = st.one_of(
    plain_text, plain_text, plain_text,
    st.text(max_size=30),
    st.text(alphabet="0123456789 .-()+x=;y", max_size=30),
    st.from_regex(r"[a-z]{1,5}@[a-z]{1,5}\.(io|com)", fullmatch=True),
    st.sampled_from(["x=1234;y=", "4111 1111 1111 1111", "call 020 7946 0958", "12345678", "123456789",
                     "a\\b", 'q"uote', "tab\there", "\x01", "é✓😀", "", " ", "1 2 3 4 5 6 7 8 9"]),
)


@st.composite
def canonical_payloads(draw) -> str:
    """A sample's fields in FeedbackSample's order; a hostile one's each possibly out of its contract."""
    if not draw(st.booleans()):
        return json.dumps({"model_id": draw(st.from_regex(r"[a-z][a-z0-9.-]{0,9}", fullmatch=True)),
                           "sample_id": draw(st.from_regex(r"[a-z0-9-]{1,12}", fullmatch=True)),
                           "prompt": draw(plain_text), "completion": draw(plain_text.filter(bool)),
                           "ts": draw(st.integers(0, 2**53))}, ensure_ascii=False)
    fields = {"model_id": draw(st.one_of(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True),
                                         st.sampled_from(["", "-x", "a" * 129, "a b", "m1"]))),
              "sample_id": draw(st.one_of(st.from_regex(r"[a-z0-9-]{1,12}", fullmatch=True), st.text(max_size=12),
                                          st.sampled_from(["s" * 256, "s" * 257]))),
              "prompt": draw(edgy_text),
              "completion": draw(edgy_text)}
    if draw(st.booleans()):
        fields["label"] = draw(st.sampled_from(["accepted", "corrected", "rejected", "maybe", None]))
    if draw(st.booleans()):
        fields["weight"] = draw(st.one_of(st.sampled_from([0, 1, 1.0, 0.5, 10, 10.0, 10.5, 11, -1, 9.99]),
                                          st.floats(allow_nan=False, allow_infinity=False)))
    fields["ts"] = draw(st.one_of(st.integers(0, 2**53), st.integers(0, 2**53), st.integers(-5, -1), st.just(1.5)))
    if draw(st.integers(0, 9)) == 0:
        fields[draw(st.sampled_from(["origin", "extra", "request_id"]))] = draw(st.sampled_from([None, "x", 1]))
    separators = draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]))
    return json.dumps(fields, separators=separators, ensure_ascii=draw(st.integers(0, 3)) == 0)


def check_fast_is_sound(payload: str) -> bool:
    """True if the fast path takes the payload; raises if it takes one the Python path would change."""
    if not FAST.fullmatch(payload):
        return False
    try:
        assert parse("sample", payload, 65536, frozenset()) == ("sample", json.loads(payload)["model_id"])
    except InvalidMessage as e:
        raise AssertionError(f"the fast path takes a record validate refuses ({e.code}): {payload!r}") from e
    assert redact_sample(payload, "pii") == (payload, {}), f"redaction would change {payload!r}"
    sample = FeedbackSample.from_json(payload)
    [pending] = micro_batch_samples(pack_entry(sample.ts, "t", 2, 9, payload))
    assert (pending.sample_id, pending.prompt, pending.completion, pending.weight, pending.payload) == \
        (sample.sample_id, sample.prompt, sample.completion, sample.effective_weight, payload)
    return True


def test_what_the_fast_path_takes_validate_accepts_unchanged():
    taken = []

    @settings(max_examples=3000, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(canonical_payloads())
    def run(payload):
        taken.append(check_fast_is_sound(payload))

    run()
    assert 0.1 * len(taken) < sum(taken) < 0.9 * len(taken), f"{sum(taken)} of {len(taken)} taken: not a test"


@pytest.mark.parametrize("payload", [
    '{"model_id":"m","sample_id":"s","prompt":"mail jane@example.com","completion":"c","ts":1}',
    '{"model_id":"m","sample_id":"s","prompt":"call 020 7946 0958","completion":"c","ts":1}',
    '{"model_id":"m","sample_id":"s","prompt":"p","completion":"4111111111111111","ts":1}',
])
def test_personal_data_never_takes_the_fast_path(payload):
    fields = json.loads(payload)
    assert any(redact(fields[name])[1] for name in ("prompt", "completion")), "the case holds personal data"
    assert not FAST.fullmatch(payload)


def test_the_check_above_fails_when_the_fast_path_takes_too_much(monkeypatch):
    """A pattern that lets digits through takes a phone number the Python path redacts."""
    loose = re.compile(FAST_SAMPLE.replace("{0,8}", "{0,99}"))
    monkeypatch.setitem(globals(), "FAST", loose)
    with pytest.raises(AssertionError, match="redaction would change"):
        check_fast_is_sound('{"model_id":"m","sample_id":"s","prompt":"call 020 7946 0958","completion":"c","ts":1}')


def test_java_regex_gives_python_verdicts():
    """Flink SQL's REGEXP over the generated payloads agrees with `re` on every one."""
    from pyflink.table import EnvironmentSettings, TableEnvironment

    found: list[str] = []

    @settings(max_examples=400, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(canonical_payloads())
    def collect(payload):
        found.append(payload)

    collect()
    t_env = TableEnvironment.create(EnvironmentSettings.in_batch_mode())
    t_env.get_config().set("parallelism.default", "1")
    table = t_env.from_elements([(i, p) for i, p in enumerate(found)], ["id", "payload"])
    t_env.create_temporary_view("payloads", table)
    condition = f"REGEXP(`payload`, '^{FAST_SAMPLE.replace(chr(39), chr(39) * 2)}$')"
    with t_env.execute_sql(f"SELECT id, ({condition}) IS TRUE FROM payloads").collect() as rows:
        java = {row[0]: row[1] for row in rows}
    python = {i: bool(FAST.fullmatch(p)) for i, p in enumerate(found)}
    differ = [found[i] for i in python if java.get(i) != python[i]]
    assert not differ, f"{len(differ)} verdicts differ, e.g. {differ[:3]}"
    assert 0 < sum(python.values()) < len(python)


@pytest.mark.parametrize("micro_batch_ms", [300, 1500, 0])
def test_micro_batches_divide_a_second_or_are_whole_seconds(micro_batch_ms):
    with pytest.raises(ValueError, match="must divide 1000 or be whole seconds"):
        split_input_sql("t", fast_condition(["f"], 65536, 0, 0), micro_batch_ms)


@pytest.mark.parametrize("micro_batch_ms, interval", [(250, "0.250"), (2000, "2.000"), (60_000, "60.000")])
def test_micro_batches_of_whole_seconds_are_tumbling_windows_of_that_length(micro_batch_ms, interval):
    _, query = split_input_sql("t", fast_condition(["f"], 65536, 0, 0), micro_batch_ms)
    assert f"INTERVAL '{interval}' SECOND" in query


def _config(window_seconds: int) -> str:
    spec = json.loads(window_spec("m").to_json())
    return json.dumps({**spec, "trigger_policy": {**spec["trigger_policy"], "window_seconds": window_seconds}})


def test_a_config_whose_window_would_split_a_micro_batch_is_refused():
    """Micro-batches of a minute fit windows of whole minutes only: a 90 s window would close
    while the micro-batch holding its last samples is still open in SQL."""
    served = frozenset({"kafka:feedback"})
    with pytest.raises(InvalidMessage) as refused:
        parse("config", _config(90), 65536, served, micro_batch_ms=60_000)
    assert refused.value.code == "schema" and "90 s is not a whole number" in refused.value.detail
    assert parse("config", _config(120), 65536, served, micro_batch_ms=60_000) == ("config", "m")
    assert parse("config", _config(7), 65536, served, micro_batch_ms=250) == ("config", "m")
    assert parse("config", _config(90), 65536, served) == ("config", "m"), "no micro-batches: any window"


# -- the trainer: a micro-batch trains as its samples would, one by one ---------------------

def _records(model_id: str, n: int, span_ms: int) -> list[tuple]:
    """The job's input tuples of `n` samples over `span_ms`, in event-time order, two partitions."""
    from streamtune.tinymodel import digit_pairs

    out = []
    for i, (prompt, completion) in enumerate(digit_pairs(n, seed=8)):
        ts = T0 + i * span_ms // n
        sample = FeedbackSample(model_id=model_id, sample_id=f"s{i}", prompt=prompt, completion=completion, ts=ts)
        out.append(("sample", model_id, sample.to_json(), "feedback", i % 2, i // 2, ts))
    return out


def _drive(fn, ctx, spec: FinetuneSpec, rows: list[tuple]) -> list[VersionRecord]:
    """Each row, then the watermark to its timestamp less one (a micro-batch's row carries its
    last millisecond: the watermark has reached it when the JVM emits it)."""
    out = list(fn.process_element(("config", spec.model_id, spec.to_json(), "configs", 0, 0, T0 - 1), ctx))
    for row in rows:
        out += fn.process_element(row, ctx)
        ctx.domain = TimeDomain.EVENT_TIME
        for t in ctx.due_event_timers(row[6] - (0 if row[0] == "batch" else 1)):
            out += fn.on_timer(t, ctx)
    return [VersionRecord.from_json(r) for r in out if isinstance(r, str)]


def _micro_batches(records: list[tuple], size_ms: int) -> list[tuple]:
    """The rows the JVM would emit for `records`: one per micro-batch, at its last millisecond."""
    groups: dict[int, list[tuple]] = {}
    for r in records:
        groups.setdefault(r[6] // size_ms, []).append(r)
    return [("batch", rs[0][1], ENTRY_SEPARATOR.join(pack_entry(r[6], r[3], r[4], r[5], r[2]) for r in rs),
             MICRO_BATCH_TOPIC, len(rs), 0, (k + 1) * size_ms - 1) for k, rs in sorted(groups.items())]


@pytest.mark.parametrize("micro_batch_ms", [250, 1000])  # 1000: as long as window_spec's window
def test_a_micro_batch_trains_as_its_samples_would(base, tmp_path, micro_batch_ms):
    records = _records("mb", 40, span_ms=3500)
    one_by_one = _drive(trainer_function(base, tmp_path / "one"), KeyedTimers("mb"), window_spec("mb"), records)
    batches = _micro_batches(records, micro_batch_ms)
    assert len(batches) < len(records) and max(b[4] for b in batches) > 1
    fn = trainer_function(base, tmp_path / "batched")
    batched = _drive(fn, KeyedTimers("mb"), window_spec("mb"), batches)
    assert len(one_by_one) >= 3
    assert [(v.version_id, v.sha256, v.lineage.sample_ids, v.trigger) for v in batched] == \
        [(v.version_id, v.sha256, v.lineage.sample_ids, v.trigger) for v in one_by_one]
    assert fn.counters.counts["samples_late"] == 0


def test_pending_samples_of_an_earlier_version_train_with_the_next_window(base, tmp_path):
    """A checkpoint of an earlier version holds the samples in the ValueState `pending`."""
    records = _records("old", 12, span_ms=900)  # one window, closed by the next one's sample
    closer = ("sample", "old", FeedbackSample(model_id="old", sample_id="next", prompt="x=1;y=", completion="2",
                                              ts=T0 + 1500).to_json(), "feedback", 0, 99, T0 + 1500)
    reference = _drive(trainer_function(base, tmp_path / "ref"), KeyedTimers("old"), window_spec("old"),
                       records + [closer])
    assert sorted(i for v in reference for i in v.lineage.sample_ids) == sorted(f"s{i}" for i in range(12))
    fn, ctx = trainer_function(base, tmp_path / "restored"), KeyedTimers("old")
    fn.config.update({"spec": window_spec("old").to_json(), "version": 1, "hash": window_spec("old").spec_hash()})
    fn.pending.before.update([Pending(FeedbackSample.from_json(r[2]).sample_id, FeedbackSample.from_json(r[2]).prompt,
                                      FeedbackSample.from_json(r[2]).completion, 1.0, r[6], r[3], r[4], r[5], r[2])
                              for r in records[:5]])
    versions = _drive(fn, ctx, window_spec("old"), records[5:] + [closer])
    assert [(v.version_id, v.sha256, v.lineage.sample_ids) for v in versions] == \
        [(v.version_id, v.sha256, v.lineage.sample_ids) for v in reference]
    assert fn.pending.before.value() is None, "moved out of the old state"


def test_the_command_line_refuses_a_micro_batch_that_could_straddle_a_window(capsys):
    import argparse

    from jobs.wiring import add_job_arguments

    parser = argparse.ArgumentParser()
    add_job_arguments(parser)
    assert parser.parse_args(["--micro-batch-ms", "60000"]).micro_batch_ms == 60_000
    with pytest.raises(SystemExit):
        parser.parse_args(["--micro-batch-ms", "1500"])
    assert "must divide 1000 or be whole seconds" in capsys.readouterr().err
