"""Keyed by changed row: drop repeated changes, then map each change to trainer input.

The capture delivers changes at least once (a crash re-sends what Kafka had not
acknowledged), so every row keeps the source position of the last change applied to it:
a change at or below it is a repeat and is dropped (the order is the source kind's, see
core.sources). A snapshot row read again after an interrupted snapshot is recognised by its
content.

Output tuples have the trainer's input shape (operators/validate.py VALID_TYPE):
("sample", model, FeedbackSample JSON, …), ("retract", model, Retraction JSON, …) and
("trigger", model, RetrainTrigger JSON, …). Counters: changes_in = duplicates + mapped +
unmapped + dead_lettered.
"""

from __future__ import annotations

import hashlib

from pyflink.common import Types
from pyflink.datastream import KeyedProcessFunction
from pyflink.datastream.state import ValueStateDescriptor

from core.errors import InvalidMessage
from core.messages import ChangeEnvelope, ChangeOrigin, FeedbackSample, Retraction, RetrainTrigger
from operators.cdc_mapping import CdcMapping, Mapping, content_hash, text
from operators.validate import DLQ_TAG, dead_letter


def sample_id_for(row_key: str, pos_text: str) -> str:
    key = row_key if len(row_key) <= 200 else hashlib.sha256(row_key.encode()).hexdigest()[:32]
    return f"{key}@{pos_text}"


class RowChangeFunction(KeyedProcessFunction):
    def __init__(self, mapping: CdcMapping):
        self.mapping = mapping

    def open(self, runtime_context):
        self.row = runtime_context.get_state(ValueStateDescriptor("row", Types.PICKLED_BYTE_ARRAY()))
        metrics = runtime_context.get_metrics_group()
        self.counters = {name: metrics.counter(name) for name in
                         ("changes_in", "duplicates", "mapped", "unmapped", "dead_lettered",
                          "samples", "retractions", "triggers")}

    def process_element(self, value, ctx):
        row_key, payload, topic, partition, offset, ts = value
        event = ChangeEnvelope.from_json(payload)  # validated at the edge
        self.counters["changes_in"].inc()
        pos, state = event.position(), self.row.value() or {}
        if "pos" in state and tuple(state["pos"]) >= pos or (
                event.op == "r" and state.get("hash") == content_hash(event.after)):
            self.counters["duplicates"].inc()
            return
        source, out, models = event.source_id, [], set()
        origin = event.origin(row_key)
        where = (topic, partition, offset, ts)
        try:
            for m in self.mapping.mappings:
                if m.source != source or event.op == "d" or not m.applies(event.after):
                    continue
                sample = self._sample(m, event, origin)
                models.add(sample.model_id)
                out.append(("sample", sample.model_id, sample.to_json(), *where))
        except (InvalidMessage, ValueError) as e:
            self.counters["dead_lettered"].inc()
            yield DLQ_TAG, dead_letter("unmappable", f"{row_key}: {e}", payload, topic, partition, offset, ts,
                                       "change")
            return
        for model in sorted(set(state.get("models", [])) - models):
            out.append(("retract", model, Retraction(row_key=row_key, origin=origin).to_json(), *where))
        for rule in self.mapping.triggers:
            if rule.source == source:
                reason = f"{rule.reason} ({event.op} on {event.table} at {event.position_text()})"
                for model in rule.models:
                    out.append(("trigger", model, RetrainTrigger(model_id=model, reason=reason[:1024]).to_json(),
                                *where))
        self.row.update({"pos": pos, "hash": content_hash(event.after), "models": sorted(models)})
        self.counters["mapped" if out else "unmapped"].inc()
        for record in out:
            self.counters[{"sample": "samples", "retract": "retractions", "trigger": "triggers"}[record[0]]].inc()
            yield record

    @staticmethod
    def _sample(m: Mapping, event: ChangeEnvelope, origin: ChangeOrigin) -> FeedbackSample:
        image = event.after
        return FeedbackSample.from_dict({
            **m.sample_fields(image), "model_id": text(m.model_for(image)),
            "sample_id": sample_id_for(origin.row_key, event.position_text()),
            "ts": int(event.source.ts_ms), "origin": origin})
