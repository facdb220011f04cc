"""Pseudo-labels without a stack: the decision at the threshold, and the keyed function's
paths (specs first or late, no section, the grace period) with its counters reconciling.

The job on the stack is tested in tests/test_quality.py (marker quality).
"""

from __future__ import annotations

import json
import math

import pytest
from pyflink.datastream import TimeDomain

from core.messages import DeadLetter, FeedbackSample, InferenceRecord, PseudoLabelConfig, ReviewRecord
from operators.counters import FunctionCounters
from operators.pseudo_labels import COUNTERS, REVIEW_TAG, PseudoLabelFunction, decide
from operators.validate import DLQ_TAG
from streamtune.testing import CountingCounter, InMemoryValue, spec_fields

THRESHOLD = 0.8
AT = math.log(THRESHOLD)


def record(request_id: str, mean_logprob: float, model_id: str = "bot", **fields) -> InferenceRecord:
    return InferenceRecord.model_validate({
        "request_id": request_id, "model_id": model_id, "arm": "champion", "prompt": "x=1;y=", "completion": "2",
        "mean_logprob": mean_logprob, "latency_ms": 1.0, "ts": 1000, **fields})


@pytest.mark.parametrize("mean_logprob, path", [
    (math.log(0.99), "labeled"),
    (math.nextafter(AT, 0.0), "labeled"),          # one ulp above the threshold
    (AT, "labeled"),                               # at it: included
    (math.nextafter(AT, -math.inf), "held_for_review"),  # one ulp below
    (math.log(0.1), "held_for_review"),
    (-math.inf, "held_for_review"),                # confidence 0
    (0.0, "labeled"),
    (1e-12, "labeled"),                            # rounding above 0 is still a log-probability
    (0.5, "dead_lettered"),                        # > 0: not a log-probability
    (math.nan, "dead_lettered"),
])
def test_decision_at_the_threshold(mean_logprob, path):
    verdict = decide(record("r1", mean_logprob), PseudoLabelConfig(threshold=THRESHOLD, weight=0.5))
    assert verdict.path == path
    if path == "labeled":
        s = verdict.sample
        assert (s.sample_id, s.request_id, s.completion, s.weight, s.label) == ("pseudo:r1", "r1", "2", 0.5, None)
        assert s.pseudo_confidence == pytest.approx(math.exp(min(0.0, mean_logprob)))
        assert FeedbackSample.from_json(s.to_json()) == s
    if path == "dead_lettered":
        assert verdict.reason == "schema" and "log-probability" in verdict.detail


def test_threshold_one_takes_only_certain_answers():
    config = PseudoLabelConfig(threshold=1.0)
    assert decide(record("r", 0.0), config).path == "labeled"
    assert decide(record("r", -1e-12), config).path == "held_for_review"


def test_no_section_or_no_sample_is_a_dead_letter_with_its_reason():
    assert decide(record("r", AT), None).reason == "no_pseudo_labels"
    empty = decide(record("r", AT, completion=""), PseudoLabelConfig(threshold=THRESHOLD))
    assert (empty.path, empty.reason) == ("dead_lettered", "schema") and "completion" in empty.detail
    long_id = decide(record("r" * 300, AT), PseudoLabelConfig(threshold=THRESHOLD))
    assert (long_id.path, long_id.reason) == ("dead_lettered", "schema") and "sample_id" in long_id.detail


@pytest.mark.parametrize("bad", [{"threshold": 0.0}, {"threshold": 1.5}, {"threshold": 0.8, "weight": -1},
                                 {"threshold": 0.8, "source": "x"}])
def test_the_spec_section_is_validated(bad):
    with pytest.raises(Exception):
        PseudoLabelConfig.from_dict(bad)


# --------------------------------------------------------------- the keyed function, no Flink

class Metrics:
    def __init__(self):
        self.counters: dict[str, CountingCounter] = {}

    def counter(self, name: str) -> CountingCounter:
        return self.counters.setdefault(name, CountingCounter())


class Timers:
    def __init__(self):
        self.now, self.registered = 1_000, []

    def current_processing_time(self) -> int:
        return self.now

    def register_processing_time_timer(self, t: int) -> None:
        self.registered.append(t)


class Ctx:
    def __init__(self):
        self.timers = Timers()

    def timer_service(self) -> Timers:
        return self.timers

    def time_domain(self):
        return TimeDomain.PROCESSING_TIME


def function(grace_ms: int = 5000) -> tuple[PseudoLabelFunction, Metrics]:
    fn, metrics = PseudoLabelFunction(grace_ms), Metrics()
    fn.config, fn.waiting, fn.grace = InMemoryValue(), InMemoryValue(), InMemoryValue()
    fn.opened_at = 0
    fn.counters = FunctionCounters(metrics, COUNTERS)
    return fn, metrics


def config_row(model_id: str = "bot", **sections):
    body = json.dumps(spec_fields(model_id, "kafka://topic=fb", **sections))
    return ("config", model_id, body, "configs", 0, 0, 1000)


def inference_row(r: InferenceRecord, offset: int):
    return ("inference", r.model_id, r.to_json(), "log", 0, offset, r.ts)


def run(fn, ctx, rows) -> list:
    return [out for row in rows for out in fn.process_element(row, ctx)]


def counts(metrics: Metrics) -> dict[str, int]:
    return {name: metrics.counter(name).count for name in COUNTERS}


def test_each_path_is_counted_and_the_counters_reconcile():
    fn, metrics = function()
    ctx = Ctx()
    records = [record("hi", math.log(0.9)), record("at", AT), record("lo", math.log(0.5)), record("pos", 0.5)]
    out = run(fn, ctx, [config_row(pseudo_labels={"threshold": THRESHOLD, "weight": 2.0}),
                        ("sample", "bot", "{}", "fb", 0, 0, 1000),
                        *[inference_row(r, i) for i, r in enumerate(records)]])
    assert [o[0] for o in out] == ["config", "sample", "sample", "sample", REVIEW_TAG, DLQ_TAG]
    trained = [FeedbackSample.from_json(o[2]) for o in out[2:4]]
    assert [(s.sample_id, s.weight) for s in trained] == [("pseudo:hi", 2.0), ("pseudo:at", 2.0)]
    assert [o[5] for o in out[2:4]] == [0, 1], "a pseudo-label keeps its inference record's offset"
    review = ReviewRecord.from_json(out[4][1])
    assert (review.inference.request_id, review.threshold, review.source.offset) == ("lo", THRESHOLD, 2)
    assert review.confidence == pytest.approx(0.5)
    assert DeadLetter.from_json(out[5][1]).kind == "inference"
    assert counts(metrics) == {"pseudo_records_in": 4, "pseudo_labeled": 2, "pseudo_held_for_review": 1,
                               "pseudo_dead_lettered": 1}


def test_a_spec_without_the_section_dead_letters_and_an_update_turns_it_on_and_off():
    fn, metrics = function()
    ctx = Ctx()
    out = run(fn, ctx, [config_row(), inference_row(record("a", AT), 0)])
    assert out[1][0] == DLQ_TAG and DeadLetter.from_json(out[1][1]).reason == "no_pseudo_labels"
    out = run(fn, ctx, [config_row(pseudo_labels={"threshold": THRESHOLD}), inference_row(record("b", AT), 1),
                        config_row(), inference_row(record("c", AT), 2)])
    assert [o[0] for o in out] == ["config", "sample", "config", DLQ_TAG]
    assert counts(metrics)["pseudo_labeled"] == 1 and counts(metrics)["pseudo_dead_lettered"] == 2


def test_records_before_the_spec_wait_for_it_within_the_grace_period():
    fn, metrics = function(grace_ms=5000)
    ctx = Ctx()
    assert run(fn, ctx, [inference_row(record("early", AT), 0), inference_row(record("low", -5.0), 1)]) == []
    assert ctx.timers.registered == [6000]
    out = run(fn, ctx, [config_row(pseudo_labels={"threshold": THRESHOLD})])
    assert [o[0] for o in out] == ["config", "sample", REVIEW_TAG], "the spec reaches the trainer first"
    assert list(fn.on_timer(6000, ctx)) == [], "the spec came: the timer finds nothing waiting"
    assert counts(metrics) == {"pseudo_records_in": 2, "pseudo_labeled": 1, "pseudo_held_for_review": 1,
                               "pseudo_dead_lettered": 0}


def test_records_of_a_model_whose_spec_never_comes_are_dead_lettered_after_the_grace_period():
    fn, metrics = function(grace_ms=5000)
    ctx = Ctx()
    run(fn, ctx, [inference_row(record("ghost", AT, model_id="ghost"), 0)])
    out = list(fn.on_timer(6000, ctx))
    assert [o[0] for o in out] == [DLQ_TAG]
    dead = DeadLetter.from_json(out[0][1])
    assert (dead.reason, dead.model_id, dead.kind) == ("no_pseudo_labels", "ghost", "inference")
    assert "grace" in dead.detail and InferenceRecord.from_json(dead.payload).request_id == "ghost"
    assert counts(metrics)["pseudo_records_in"] == counts(metrics)["pseudo_dead_lettered"] == 1
