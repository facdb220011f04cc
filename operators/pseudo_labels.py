"""Pseudo-labels: a served response the model was confident in becomes a training sample.

An inference-log record (core.messages.InferenceRecord, kind "inference" from
operators/validate.py) carries the completion the model served and its mean token
log-probability. Its confidence is the mean token probability, exp(mean_logprob)
(udfs/confidence.py, the SQL function of the same meaning). Against the model's spec
section `pseudo_labels` (core.messages.PseudoLabelConfig):

- confidence >= threshold: a sample (kind "sample") for the trainer, the completion as its
  target, sample_id `pseudo:<request_id>`, the spec's weight, `pseudo_confidence` set
  (counter `pseudo_labeled`);
- confidence < threshold: a ReviewRecord on REVIEW_TAG, for the review topic
  (`pseudo_held_for_review`);
- no spec with `pseudo_labels`, a mean_logprob that is no log-probability, or a record no
  sample can be made of: a dead letter with its reason (`pseudo_dead_lettered`).

`pseudo_records_in` = labeled + held for review + dead-lettered, once no record waits for a
spec. The threshold is a probability; the comparison is made in log space
(mean_logprob >= ln(threshold)), because exp(ln(t)) is not t for many t: a response logged
with ln(threshold) is at the threshold, exactly. (One a few ulps below it is held, though
its confidence, rounded back to a probability, may read as the threshold itself.)

Keyed by model_id, before the trainer: specs pass through and the function keeps each
model's latest `pseudo_labels` section (a spec without it turns pseudo-labels off). Records
of a model whose spec has not arrived wait for it up to the unknown-model grace (wall clock,
as the trainer's samples do), then go to the DLQ. Samples, triggers and labelled feedback
(a correction citing the request) pass through untouched.

>>> from core.messages import PseudoLabelConfig
>>> r = InferenceRecord(request_id="r1", model_id="bot", arm="champion", prompt="x=1;y=", completion="2",
...     mean_logprob=math.log(0.8), latency_ms=4.2, ts=1000)
>>> v = decide(r, PseudoLabelConfig(threshold=0.8))
>>> v.path, v.sample.sample_id, v.sample.pseudo_confidence
('labeled', 'pseudo:r1', 0.8)
>>> decide(r.model_copy(update={"mean_logprob": math.nextafter(math.log(0.8), -1)}),
...        PseudoLabelConfig(threshold=0.8)).path
'held_for_review'
>>> decide(r, None).reason
'no_pseudo_labels'
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Literal, Optional

from pyflink.common import Types
from pyflink.datastream import KeyedProcessFunction, OutputTag, TimeDomain
from pyflink.datastream.state import ValueStateDescriptor

from core.errors import InvalidMessage
from core.messages import FeedbackSample, FinetuneSpec, InferenceRecord, PseudoLabelConfig, ReviewRecord, SourcePosition
from operators.counters import FunctionCounters
from operators.validate import DLQ_TAG, dead_letter
from udfs.confidence import confidence_of

# Records held for review (ReviewRecord JSON): the job sends them to --review-topic, exactly-once.
REVIEW_TAG = OutputTag("review", Types.STRING())
COUNTERS = ("pseudo_records_in", "pseudo_labeled", "pseudo_held_for_review", "pseudo_dead_lettered")
SAMPLE_PREFIX = "pseudo:"


@dataclass(frozen=True)
class Verdict:
    path: Literal["labeled", "held_for_review", "dead_lettered"]
    confidence: Optional[float] = None
    sample: Optional[FeedbackSample] = None      # labeled
    reason: Optional[str] = None                 # dead_lettered: the DeadLetter reason
    detail: str = ""


def decide(record: InferenceRecord, config: Optional[PseudoLabelConfig]) -> Verdict:
    """What one response becomes under the model's `pseudo_labels` section (None: none)."""
    if config is None:
        return Verdict("dead_lettered", reason="no_pseudo_labels",
                       detail=f"the spec of model_id {record.model_id} has no pseudo_labels section: "
                              "its inference log is not trained on")
    confidence = confidence_of(record.mean_logprob)
    if confidence is None:
        return Verdict("dead_lettered", reason="schema",
                       detail=f"mean_logprob {record.mean_logprob} is not a log-probability (NaN or > 0)")
    if min(0.0, record.mean_logprob) < math.log(config.threshold):
        return Verdict("held_for_review", confidence)
    try:
        sample = FeedbackSample.from_dict({
            "model_id": record.model_id, "sample_id": SAMPLE_PREFIX + record.request_id, "prompt": record.prompt,
            "completion": record.completion, "weight": config.weight, "ts": record.ts,
            "request_id": record.request_id, "pseudo_confidence": confidence})
    except InvalidMessage as e:
        return Verdict("dead_lettered", confidence, reason=e.code, detail=f"no pseudo-label can be made: {e.detail}")
    return Verdict("labeled", confidence, sample=sample)


class PseudoLabelFunction(KeyedProcessFunction):
    """Keyed by model_id: (kind, model_id, payload, topic, partition, offset, ts) in and out
    (operators/validate.py VALID_TYPE); review records on REVIEW_TAG, dead letters on DLQ_TAG."""

    def __init__(self, unknown_model_grace_ms: int):
        self.grace_ms = unknown_model_grace_ms

    def open(self, runtime_context):
        def state(name):
            return runtime_context.get_state(ValueStateDescriptor(name, Types.PICKLED_BYTE_ARRAY()))

        self.config = state("pseudo_labels")  # {"pseudo_labels": JSON or None} once a spec came; None before
        self.waiting = state("waiting")       # inference records that came before any spec
        self.grace = state("grace_timer")     # processing time their wait ends, or None
        self.opened_at = int(time.time() * 1000)
        self.counters = FunctionCounters(runtime_context.get_metrics_group(), COUNTERS)

    def process_element(self, value, ctx):
        self.counters.enter_element()
        kind = value[0]
        if kind == "config":
            section = FinetuneSpec.from_json(value[2]).pseudo_labels
            self.config.update({"pseudo_labels": section.to_json() if section else None})
            yield value  # the trainer has the spec before the pseudo-labels that waited for it
            waiting = self.waiting.value() or []
            self.waiting.clear()
            self.grace.clear()
            for record in waiting:
                yield from self._decide(record, section)
            return
        if kind != "inference":
            yield value
            return
        self.counters.inc("pseudo_records_in")
        known = self.config.value()
        if known is not None:
            section = known["pseudo_labels"]
            yield from self._decide(tuple(value), PseudoLabelConfig.from_json(section) if section else None)
            return
        self.waiting.update((self.waiting.value() or []) + [tuple(value)])
        if self.grace.value() is None:
            deadline = ctx.timer_service().current_processing_time() + self.grace_ms
            self.grace.update(deadline)
            ctx.timer_service().register_processing_time_timer(deadline)

    def on_timer(self, timestamp, ctx):
        if ctx.time_domain() != TimeDomain.PROCESSING_TIME or self.grace.value() != timestamp:
            return
        if timestamp - self.grace_ms < self.opened_at:  # set before this run began: downtime does not count
            deadline = self.opened_at + self.grace_ms
            self.grace.update(deadline)
            ctx.timer_service().register_processing_time_timer(deadline)
            return
        self.grace.clear()
        waiting = self.waiting.value() or []
        self.waiting.clear()
        for _, model_id, body, topic, partition, offset, ts in waiting:
            self.counters.inc("pseudo_dead_lettered")
            yield DLQ_TAG, dead_letter("no_pseudo_labels", f"no spec for model_id {model_id} within the "
                                       f"{self.grace_ms} ms grace period: its inference log is not trained on",
                                       body, topic, partition, offset, ts, "inference", model_id)

    def _decide(self, value: tuple, config: Optional[PseudoLabelConfig]):
        _, model_id, body, topic, partition, offset, ts = value
        record = InferenceRecord.from_json(body)
        verdict = decide(record, config)
        self.counters.inc("pseudo_" + verdict.path)
        if verdict.path == "labeled":
            yield "sample", model_id, verdict.sample.to_json(), topic, partition, offset, ts
        elif verdict.path == "held_for_review":
            yield REVIEW_TAG, ReviewRecord(
                reason="below_threshold", confidence=verdict.confidence, threshold=config.threshold, inference=record,
                source=SourcePosition(topic=topic, partition=partition, offset=offset, timestamp=ts)).to_json()
        else:
            yield DLQ_TAG, dead_letter(verdict.reason, verdict.detail, body, topic, partition, offset, ts, "inference",
                                       model_id)
