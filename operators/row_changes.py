"""Keyed by changed row: drop repeated changes, then map each change to trainer input.

The capture delivers changes at least once (a crash re-sends what Kafka had not
acknowledged), so every row keeps the source position of the last change applied to it:
a change at or below it is a repeat and is dropped (PostgreSQL: commit LSN, change LSN,
index in the transaction; MongoDB: clusterTime, token). A snapshot row read again after an
interrupted snapshot is recognised by its content.

Output tuples have the trainer's input shape (operators/validate.py VALID_TYPE):
("sample", model, FeedbackSample JSON, …), ("retract", model, {row_key, …}, …) and
("trigger", model, RetrainTrigger JSON, …). Counters: changes_in = duplicates + mapped +
unmapped + dead_lettered.
"""

from __future__ import annotations

import hashlib
import json

from pyflink.common import Types
from pyflink.datastream import KeyedProcessFunction
from pyflink.datastream.state import ValueStateDescriptor

from connectors.debezium import position, source_position_text, table_of
from operators.cdc_mapping import CdcMapping, content_hash, event_source, field, position_text
from operators.validate import DLQ_TAG, dead_letter
from streamtune.specs import FeedbackSample, ValidationError, describe_error


def sample_id_for(row_key: str, pos_text: str) -> str:
    key = row_key if len(row_key) <= 200 else hashlib.sha256(row_key.encode()).hexdigest()[:32]
    return f"{key}@{pos_text}"


def _text(value) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, default=str)


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
        event = json.loads(payload)
        self.counters["changes_in"].inc()
        pos, state = position(event), self.row.value() or {}
        image = event["after"]
        if "pos" in state and tuple(state["pos"]) >= pos or (
                event["op"] == "r" and state.get("hash") == content_hash(image)):
            self.counters["duplicates"].inc()
            return
        source, out, models = event_source(event), [], set()
        origin = {"row_key": row_key, "op": event["op"], "table": table_of(event), **source_position_text(event)}
        where = (topic, partition, offset, ts)
        try:
            for m in self.mapping.mappings:
                if m.source != source or event["op"] == "d" or not m.applies(image):
                    continue
                sample = self._sample(m, image, row_key, event, origin)
                models.add(sample.model_id)
                out.append(("sample", sample.model_id, sample.model_dump_json(exclude_none=True), *where))
        except (ValidationError, ValueError) as e:
            detail = describe_error(e) if isinstance(e, ValidationError) else str(e)
            self.counters["dead_lettered"].inc()
            yield DLQ_TAG, dead_letter("unmappable", f"{row_key}: {detail}", payload, topic, partition, offset, ts,
                                       "change")
            return
        for model in sorted(set(state.get("models", [])) - models):
            body = json.dumps({"row_key": row_key, "origin": origin}, sort_keys=True)
            out.append(("retract", model, body, *where))
        for rule in self.mapping.triggers:
            if rule.source == source:
                for model in rule.models:
                    reason = f"{rule.reason} ({event['op']} on {table_of(event)} at {position_text(event)})"
                    out.append(("trigger", model, json.dumps({"model_id": model, "trigger": "retrain",
                                                              "reason": reason[:1024]}), *where))
        self.row.update({"pos": pos, "hash": content_hash(image), "models": sorted(models)})
        self.counters["mapped" if out else "unmapped"].inc()
        for record in out:
            self.counters[{"sample": "samples", "retract": "retractions", "trigger": "triggers"}[record[0]]].inc()
            yield record

    @staticmethod
    def _sample(m, image: dict, row_key: str, event: dict, origin: dict) -> FeedbackSample:
        prompt, completion = _text(field(image, m.prompt)), _text(field(image, m.completion))
        if prompt is None or completion is None:
            missing = m.prompt if prompt is None else m.completion
            raise ValueError(f"field {missing!r} is missing or null")
        weight = field(image, m.weight) if m.weight else 1.0
        return FeedbackSample.model_validate({
            "model_id": _text(m.model_for(image)), "sample_id": sample_id_for(row_key, position_text(event)),
            "prompt": prompt, "completion": completion, "weight": weight,
            "ts": int(event["source"]["ts_ms"]), "origin": origin})
