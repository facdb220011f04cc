"""Fuzzing the edge (marker `guarantees`, pure Python, no stack): whatever a topic holds,
validation answers with a record the next operators can use or a dead letter with a reason.

Over 10,000 inputs (arbitrary text, bytes decoded as Flink's raw format decodes them,
arbitrary JSON values, valid records of each kind mutated, and a corpus of known-nasty
records) go through `operators.validate.parse` (sample and config topics),
`operators.validate.parse_change`, `ChangeEnvelope.from_json` and `VersionRecord.from_json`.
The oracle (`judge`):

- a rejection is `InvalidMessage` whose `code` is a dead-letter reason
  (core.messages.dead_letter.REASONS) with a non-empty detail, and the dead letter built
  from it (operators.validate.dead_letter) parses back as a DeadLetter with that reason,
  detail and payload: every reject lands in the DLQ;
- an acceptance survives what the job does next: the record parses again, re-serializes to
  itself (the trainer writes spec fields into version records), and an accepted change
  goes through RowChangeFunction.process_element (position, origin, mapping) without an
  exception;
- anything else escaping is a broken guarantee (`ContractBroken`).

test_the_oracle_reports_* show the oracle can fail, so a green run is not vacuous.
Deterministic (derandomize=True, no example database) so CI is stable.
"""

from __future__ import annotations

import copy
import json
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.errors import InvalidMessage
from core.messages import ChangeEnvelope, DeadLetter, VersionRecord, is_model_id
from core.messages.dead_letter import REASONS
from core.messages.version import EXAMPLE as VERSION_EXAMPLE
from streamtune.testing import row_change_function
from operators.validate import CONTRACTS, dead_letter, parse, parse_change

pytestmark = pytest.mark.guarantees

MAX_RECORD_BYTES = 65536  # the job's default --max-record-bytes
SERVED = frozenset({"kafka:t", "postgres:public.answers", "mongodb:shop.reviews"})
FUZZ_EXAMPLES = 10_000


# ---------------------------------------------------------------- valid records of each kind

SAMPLE = {"model_id": "bot", "sample_id": "s1", "prompt": "x=1;y=", "completion": "2", "label": "corrected",
          "weight": 1.5, "ts": 1_700_000_000_000}
SPEC = {"model_id": "bot", "stream_source": "kafka://topic=t",
        "adapter_config": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "dropout": 0.1},
        "trigger_policy": {"min_samples_per_window": 8, "window_seconds": 2, "max_samples_per_step": 64},
        "training": {"lr": 0.01, "micro_batch_size": 8, "precision": "bf16"}, "seed": 3}
TRIGGER = {"model_id": "bot", "trigger": "retrain", "reason": "correction rate 0.4", "window_end": 60000}
PG_CHANGE = {"op": "u", "before": {"id": 1, "q": "a", "a": "b"}, "after": {"id": 1, "q": "x=1;y=", "a": "2"},
             "ts_ms": 5, "key_fields": ["id"],
             "source": {"connector": "postgresql", "name": "pg", "db": "app", "schema": "public", "table": "answers",
                        "lsn": 90, "sequence": '["100","90"]', "tx_index": 0, "txId": 7, "ts_ms": 4,
                        "snapshot": "false"}}
MONGO_CHANGE = {"op": "c", "before": None, "after": {"_id": "r1", "text": "x=1;y=", "reply": {"body": "2"}},
                "key_fields": ["_id"],
                "source": {"connector": "mongodb", "name": "m", "db": "shop", "collection": "reviews",
                           "resume_token": "8263A1", "ord": 2, "ts_ms": 10_000, "txnNumber": None}}

BASES = {"sample": [SAMPLE, {**SAMPLE, "origin": {"row_key": "k", "op": "c", "table": "app.public.answers"}}],
         "config": [SPEC, {**SPEC, "stream_source": "postgres://h/app?table=answers&slot=s1"},
                    {**SPEC, "stream_source": "mongodb://h/?db=shop&collection=reviews"}, TRIGGER],
         "change": [PG_CHANGE, MONGO_CHANGE, {**PG_CHANGE, "op": "d", "after": None}],
         "version": [VERSION_EXAMPLE]}
BASES["envelope"] = BASES["change"]

# Values that broke, or could break, something once: limits, non-finite numbers, escapes.
NASTY_VALUES = [None, True, 0, -1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**40, 1e999, -1e999, float("nan"), 1e-320,
                "", " ", "\x00", "\n", "..", "../x", "-rf", "x" * 300, "ünï", "\u202e", "\ufeff", "1e999",
                "[]", "{}", "null", [], {}, [[[[[]]]]], {"": {"": {}}}, ["q_proj", "q_proj"], [""]]
NASTY_PAYLOADS = [
    "", " ", "\ufeff{}", "null", "true", "0", "[]", "{}", '""', "NaN", "-Infinity", "1e999",
    '{"a":1,"a":2}', '{"model_id":"bot","model_id":".."}', "[" * 60_000, "{\"a\":" * 20_000,
    "[" * 129 + "]" * 129, "[" * 128 + "]" * 128, '"\\ud800"', '{"\\ud800":1}', '{"model_id":"\\udc00"}',
    "9" * 5000, '{"ts":' + "9" * 5000 + "}", "\x00", "\u2028", '{"op":"c"}', '{"op":"c","source":[]}',
]


# ---------------------------------------------------------------- the oracle


class ContractBroken(AssertionError):
    """An input broke the edge's guarantee; the message names the target, input and failure."""


@dataclass(frozen=True)
class Case:
    target: str            # sample | config | change | envelope | version
    payload: Any           # str as Flink hands it over; bytes for the from_json targets
    key: Optional[str] = None  # the Kafka key (change events)


KIND = {"sample": "sample", "config": "config", "change": "change", "envelope": "change", "version": "version"}


def decode_case(case: Case):
    """The decoder under test for the case's target."""
    if case.target in ("sample", "config"):
        return parse(case.target, case.payload, MAX_RECORD_BYTES, SERVED)
    if case.target == "change":
        return parse_change(case.payload, MAX_RECORD_BYTES, case.key)
    if case.target == "envelope":
        return ChangeEnvelope.from_json(case.payload)
    return VersionRecord.from_json(case.payload)


def as_text(payload) -> Optional[str]:
    return payload.decode("utf-8", "replace") if isinstance(payload, bytes) else payload


def judge(case: Case) -> str:
    """'accepted' or 'rejected'; ContractBroken when the guarantee does not hold."""
    shown = f"{case.target} {as_text(case.payload)!r:.300} (key {case.key!r:.60})"
    try:
        result = decode_case(case)
    except InvalidMessage as e:
        if e.code not in REASONS or not (e.detail or "").strip():
            raise ContractBroken(f"{shown}: rejected with reason {e.code!r}, detail {e.detail!r}") from e
        try:
            letter = DeadLetter.from_json(dead_letter(e.code, e.detail, as_text(case.payload), "fuzz", 0, 7, 1,
                                                      KIND[case.target]))
        except Exception as dl:
            raise ContractBroken(f"{shown}: its dead letter is not valid: {type(dl).__name__}: {dl}") from dl
        if (letter.reason, letter.detail, letter.payload) != (e.code, e.detail, as_text(case.payload)):
            raise ContractBroken(f"{shown}: the dead letter does not carry the rejection: {letter}")
        return "rejected"
    except Exception as e:
        raise ContractBroken(f"{shown}: {type(e).__name__} escaped: {e!s:.300}") from e
    try:
        check_accepted(case, result)
    except Exception as e:
        raise ContractBroken(f"{shown}: accepted, then {type(e).__name__} downstream: {e!s:.300}") from e
    return "accepted"


def check_accepted(case: Case, result) -> None:
    """What the job does next with an accepted record must work too."""
    if case.target in ("sample", "config"):
        kind, model_id = result
        record = CONTRACTS[kind].from_json(case.payload)
        assert is_model_id(model_id) and record.model_id == model_id
        assert type(record).from_json(record.to_json()) == record, "does not re-serialize to itself"
        if kind == "config":
            assert record.source_id in SERVED and record.spec_hash()
    elif case.target in ("change", "envelope"):
        row_key = result if case.target == "change" else ChangeEnvelope.from_json(case.payload).row_key_from("k")
        run_row_change(row_key, as_text(case.payload))
    else:
        assert is_model_id(result.model_id)


def run_row_change(row_key: str, payload: str) -> None:
    """An accepted change through RowChangeFunction.process_element (in-memory state), with a
    mapping for its own table when its names allow one, so samples are built from it."""
    from operators.cdc_mapping import CdcMapping
    from operators.validate import DLQ_TAG

    event = ChangeEnvelope.from_json(payload)
    columns = [k for k in (event.image or {}) if k][:2] or ["p", "c"]
    target = ({"collection": f"{event.source.db}.{event.source.collection}"} if event.source.connector == "mongodb"
              else {"table": f"{event.source.field('schema')}.{event.source.table}"})
    entry = {"model_id": {"value": "bot"}, "prompt": columns[0], "completion": columns[-1]}
    try:
        mapping = CdcMapping.model_validate({"mappings": [{**target, **entry}]})
    except ValueError:  # names no mapping file can hold: a mapping that never matches
        mapping = CdcMapping.model_validate({"mappings": [{"table": "other", "model_id": {"value": "bot"},
                                                           "prompt": "p", "completion": "c"}]})
    fn = row_change_function(mapping)
    for out in fn.process_element((row_key, payload, "cdc", 0, 7, 1), None):
        if out[0] is DLQ_TAG:
            assert DeadLetter.from_json(out[1]).reason == "unmappable"
        else:
            assert out[0] in ("sample", "retract", "trigger") and is_model_id(out[1])


# ---------------------------------------------------------------- input strategies

json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=16)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
nasty_values = st.sampled_from(NASTY_VALUES).map(copy.deepcopy)  # mutations must not reach the list


def _slots(node, found: list) -> list:
    """Every (container, key) pair in a JSON record: where a mutation can apply."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        found.append((node, k))
        _slots(v, found)
    return found


@st.composite
def mutated_record(draw, target: str) -> str:
    """A valid record of the target's kind with 0..3 mutations: a field dropped, replaced by an
    arbitrary or a nasty value, or an extra field added."""
    record = copy.deepcopy(draw(st.sampled_from(BASES[target])))
    for _ in range(draw(st.integers(0, 3))):
        slots = _slots(record, [])
        if not slots:
            break
        container, key = draw(st.sampled_from(slots))
        action = draw(st.sampled_from(["drop", "replace", "nasty", "add"]))
        if action == "drop":
            del container[key]
        elif action == "add" and isinstance(container, dict):
            container[draw(st.text(max_size=8))] = draw(json_values)
        elif action == "add":
            container.append(draw(json_values))
        else:
            container[key] = draw(json_values if action == "replace" else nasty_values)
    return json.dumps(record)


@st.composite
def text_edit(draw, target: str) -> str:
    """A valid record's JSON text cut short, or with a character inserted or removed."""
    text = json.dumps(draw(st.sampled_from(BASES[target])))
    at = draw(st.integers(0, len(text)))
    edit = draw(st.sampled_from(["cut", "insert", "remove"]))
    if edit == "cut":
        return text[:at]
    if edit == "insert":
        return text[:at] + draw(st.characters(codec="utf-8")) + text[at:]
    return text[:at] + text[at + 1:]


def payloads(target: str):
    text = st.one_of(
        st.text(max_size=200),
        st.binary(max_size=200).map(lambda b: b.decode("utf-8", "replace")),  # Kafka bytes → Flink STRING
        json_values.map(json.dumps),
        mutated_record(target), mutated_record(target), mutated_record(target),
        text_edit(target),
        st.sampled_from(NASTY_PAYLOADS),
    )
    if target in ("envelope", "version"):  # these take bytes too
        return st.one_of(text, st.binary(max_size=200), text.map(str.encode))
    return text


# One strategy per target, built once (a flatmap would build and validate them per example).
cases = st.one_of([st.builds(Case, st.just(target), payloads(target),
                             st.none() | st.text(max_size=40) if target == "change" else st.none())
                   for target in sorted(KIND)])


def fuzz(max_examples: int) -> Counter:
    """Run `judge` over `max_examples` generated cases; the tally of (target, verdict)."""
    tally: Counter = Counter()

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None, print_blob=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example])
    @given(cases)
    def run(case: Case):
        tally[case.target, "total"] += 1
        tally[case.target, judge(case)] += 1

    run()
    return tally


# ---------------------------------------------------------------- the tests


def test_fuzz_every_record_is_a_usable_record_or_a_dead_letter_with_a_reason():
    started = time.monotonic()
    tally = fuzz(FUZZ_EXAMPLES)
    seconds = time.monotonic() - started
    total = sum(n for (_, what), n in tally.items() if what == "total")
    summary = {t: (tally[t, "accepted"], tally[t, "rejected"]) for t in sorted(KIND)}
    print(f"fuzzed {total} inputs in {seconds:.1f} s; (accepted, rejected) per target: {summary}")
    assert total >= FUZZ_EXAMPLES
    for target in KIND:
        accepted, rejected = summary[target]
        assert accepted + rejected == tally[target, "total"], target  # every input got a verdict
        # Both outcomes occur: the generator reaches past the parser, not just into its first check.
        assert accepted > 0 and rejected > 0, (target, summary[target])


@pytest.mark.parametrize("payload", NASTY_PAYLOADS, ids=lambda p: repr(p)[:30])
@pytest.mark.parametrize("target", sorted(KIND))
def test_nasty_corpus_is_a_usable_record_or_a_dead_letter(target, payload):
    judge(Case(target, payload))


REGRESSIONS = [
    # A record of 60,000 '[' (under 64 KiB): RecursionError escaped validation, every replay.
    ("sample", "[" * 60_000, "bad_json"),
    ("change", "[" * 60_000, "bad_json"),
    # An accepted spec with alpha = inf (JSON 1e999): LoRA scaling inf, and its version record
    # serialized alpha as null, so registration dead-lettered every version of the model.
    ("config", json.dumps({**SPEC, "adapter_config": {**SPEC["adapter_config"], "alpha": 1e999}}), "schema"),
    # Accepted changes whose position RowChangeFunction cannot compute (it failed the job).
    ("change", json.dumps({**PG_CHANGE, "source": {**PG_CHANGE["source"], "sequence": "garbage"}}),
     "not_a_change_event"),
    ("change", json.dumps({**PG_CHANGE, "source": {**PG_CHANGE["source"], "sequence": "[null,null]"}}),
     "not_a_change_event"),
    ("change", json.dumps({**PG_CHANGE, "source": {**PG_CHANGE["source"], "sequence": '["1e999","1"]'}}),
     "not_a_change_event"),
    ("change", json.dumps({**PG_CHANGE, "source": {**PG_CHANGE["source"], "sequence": "[" * 5000}}),
     "not_a_change_event"),
    # A PostgreSQL change without source.ts_ms: its sample's ts was int(None) (TypeError).
    ("change", json.dumps({**PG_CHANGE, "source": {k: v for k, v in PG_CHANGE["source"].items() if k != "ts_ms"}}),
     "not_a_change_event"),
]


@pytest.mark.parametrize("target, payload, reason", REGRESSIONS, ids=lambda v: repr(v)[:40])
def test_inputs_that_once_escaped_validation_are_dead_letters_now(target, payload, reason):
    assert judge(Case(target, payload)) == "rejected"
    with pytest.raises(InvalidMessage) as e:
        decode_case(Case(target, payload))
    assert e.value.code == reason, e.value.detail


def call_at_depth(depth: int, fn):
    """fn() with `depth` more Python frames under it (a consumer deeper in the job)."""
    return fn() if depth == 0 else call_at_depth(depth - 1, fn)


@pytest.mark.parametrize("levels", [100, 128, 129, 700, 990])
def test_nesting_verdict_does_not_depend_on_the_callers_stack(levels):
    """A record accepted at the edge must parse again in an operator with a deeper stack."""
    # Built as text (json.dumps itself recurses): the envelope, `after` and the innermost
    # object are three of the levels.
    doc = '{"x":' * (levels - 3) + '{"id":1}' + "}" * (levels - 3)
    payload = json.dumps({**PG_CHANGE, "after": "AFTER"}).replace('"AFTER"', '{"id":1,"doc":' + doc + "}")

    def verdict():
        try:
            return parse_change(payload, 10**7, None)
        except InvalidMessage as e:
            return e.code

    expected = "bad_json" if levels > 128 else "postgresql/pg/app.public.answers/[1]"  # a row key: accepted
    assert verdict() == call_at_depth(600, verdict) == expected


# ---------------------------------------------------------------- the oracle can fail


def test_the_oracle_reports_an_exception_escaping_a_decoder(monkeypatch):
    import operators.validate as validate

    real_decode = validate.decode

    def decode_with_a_bug(raw):
        value = real_decode(raw)
        if isinstance(value, dict) and "prompt" in value:
            return value["no such field"]  # KeyError, as a careless decoder would raise
        return value

    monkeypatch.setattr(validate, "decode", decode_with_a_bug)
    assert judge(Case("sample", "{")) == "rejected"  # inputs the bug does not touch still pass
    with pytest.raises(ContractBroken, match="KeyError escaped"):
        judge(Case("sample", json.dumps(SAMPLE)))
    # And the fuzz run as wired finds it within a few hundred inputs.
    with pytest.raises(ContractBroken, match="KeyError escaped"):
        fuzz(500)


@pytest.mark.parametrize("code, detail, message", [("no_such_reason", "d", "reason 'no_such_reason'"),
                                                    ("schema", " ", "detail ' '")])
def test_the_oracle_reports_reasons_and_details_a_dead_letter_cannot_carry(monkeypatch, code, detail, message):
    import operators.validate as validate

    class Rejecting:
        @staticmethod
        def from_dict(data):
            raise InvalidMessage(code, detail)

    monkeypatch.setitem(validate.CONTRACTS, "sample", Rejecting)
    with pytest.raises(ContractBroken, match=message):
        judge(Case("sample", "{}"))


def test_the_oracle_reports_an_accepted_record_the_job_cannot_use(monkeypatch):
    def no_origin(self, row_key):
        raise TypeError("origin unreadable")

    assert judge(Case("change", json.dumps(PG_CHANGE))) == "accepted"
    monkeypatch.setattr(ChangeEnvelope, "origin", no_origin)  # used only after the edge
    with pytest.raises(ContractBroken, match="accepted, then TypeError downstream"):
        judge(Case("change", json.dumps(PG_CHANGE)))
