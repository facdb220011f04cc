"""Batch/stream scoring inside Flink: requests keyed by model, adapter versions as broadcast state.

The broadcast side reads the adapter-versions topic (core.messages.AdapterVersionBroadcast:
a version exists, and where its aliases pointed when it was registered) and the alias-moves
topic (core.messages.AliasMove: a promotion, a rollback, a deleted alias). The broadcast state
holds, per model, the versions known and each alias with the time of the message that set
it (a broadcast's `registered_at`, a move's `ts`: wall clocks both); the newest wins, so the
two topics may be read in any interleaving (a restore reads them again) and end in the same
routes. Record timestamps are no clock for this: versions carry event time, or wall time
when a model's idle timer closed their window. A request
(core.messages request JSON: request_id, model, prompt, max_tokens) is answered by the
version its `model` names (`<model_id>`, `<model_id>@<alias>`, `<model_id>@v<version>`, or
`base`) with the same adapter pool as `streamtune serve`, in this worker's memory.

A request that names no known version, or whose artifact fails its sha256 check, gets a
response with `error` set, never silence. Broadcast state is checkpointed with the job, so a
restored job answers with the versions it knew.
"""

from __future__ import annotations

import json
import time

from pyflink.common import Types
from pyflink.datastream.functions import KeyedBroadcastProcessFunction
from pyflink.datastream.state import MapStateDescriptor

from core.errors import StreamtuneError
from core.messages import AdapterVersionBroadcast, AliasMove
from core.routing import BASE, ModelName, parse_model_name

ROUTES = MapStateDescriptor("adapter_routes", Types.STRING(), Types.STRING())  # model_id -> json
_POOLS: dict[str, object] = {}


def _pool(base_dir: str, slots: int):
    from operators.adapter_pool import AdapterPool  # torch: imported in the worker, not at submission

    if base_dir not in _POOLS:  # one base per worker process, shared by its subtasks
        _POOLS[base_dir] = AdapterPool(base_dir, slots=slots)
    return _POOLS[base_dir]


class InferenceFunction(KeyedBroadcastProcessFunction):
    def __init__(self, base_model: str, artifact_store: str, slots: int = 8):
        self.base_model, self.artifact_store, self.slots = base_model, artifact_store, slots

    def open(self, runtime_context):
        from connectors.artifact_store import ArtifactStore

        self.store = ArtifactStore(self.artifact_store)
        self.pool = _pool(self.base_model, self.slots)
        metrics = runtime_context.get_metrics_group()
        self.answered = metrics.counter("requests_answered")
        self.failed = metrics.counter("requests_failed")

    def process_broadcast_element(self, value, ctx):
        payload, ts = value[0], value[1]
        update = _route_update(payload)
        if update is None:
            return  # neither message: the registrar's DLQ has the bad broadcasts
        state = ctx.get_broadcast_state(ROUTES)
        raw = state.get(update.model_id)
        routes = json.loads(raw) if raw else {"versions": {}, "aliases": {}, "alias_ts": {}}
        if isinstance(update, AdapterVersionBroadcast):
            routes["versions"][str(update.mlflow_version)] = {
                "artifact_uri": update.artifact_uri, "sha256": update.sha256, "version_id": update.version_id}
            moves = [(alias, update.mlflow_version) for alias in update.aliases]
            ts = update.registered_at if update.registered_at is not None else ts  # older broadcasts: the record's
        else:
            moves, ts = [(update.alias, update.version)], update.ts
        for alias, version in moves:
            if ts >= routes["alias_ts"].get(alias, -1):  # the newest record that sets an alias wins
                routes["alias_ts"][alias] = ts
                if version is None:
                    routes["aliases"].pop(alias, None)
                else:
                    routes["aliases"][alias] = version
        state.put(update.model_id, json.dumps(routes))

    def process_element(self, value, ctx):
        model_id, payload = value[0], value[1]
        started = time.perf_counter()
        try:
            request = json.loads(payload)
            name = parse_model_name(request["model"])
            raw = ctx.get_broadcast_state(ROUTES).get(name.model_id)
            routes = json.loads(raw) if raw else {"versions": {}, "aliases": {}, "alias_ts": {}}
            version, alias = self._route(name, routes)
            key, entry = BASE, None
            if version is not None:
                entry = routes["versions"][str(version)]
                key = f"{name.model_id}/{version}"
                if not self.pool.has(key):
                    self.pool.put(key, self.store.get(entry["artifact_uri"], entry["sha256"]))
            generation = self.pool.generate(key, str(request["prompt"]), int(request.get("max_tokens", 16)))
        except (StreamtuneError, KeyError, TypeError, ValueError) as e:
            self.failed.inc()
            yield json.dumps({"request_id": _request_id(payload), "model_id": model_id,
                              "error": f"{type(e).__name__}: {e}"})
            return
        self.answered.inc()
        yield json.dumps({
            "request_id": request.get("request_id"), "model_id": name.model_id, "version": version, "alias": alias,
            "completion": generation.text, "mean_logprob": generation.mean_logprob,
            "latency_ms": round((time.perf_counter() - started) * 1000, 3),
            "audit_trace": [
                {"stage": "routing", "alias": alias, "version": version},
                {"stage": "adapter", "version": version, "version_id": entry and entry["version_id"],
                 "sha256": entry and entry["sha256"]},
                {"stage": "base_model", "path": self.pool.base_dir, "version": self.pool.base_fingerprint}]})

    @staticmethod
    def _route(name: ModelName, routes: dict) -> tuple[int | None, str | None]:
        if name.model_id == BASE:
            return None, None
        if name.version is not None:
            if str(name.version) not in routes["versions"]:
                raise ModelNotKnown(f"{name.model_id} has no version {name.version} in the broadcast state")
            return name.version, None
        alias = name.alias or "champion"
        if alias not in routes["aliases"]:
            raise ModelNotKnown(f"{name.model_id} has no {alias} version in the broadcast state yet")
        return routes["aliases"][alias], alias


class ModelNotKnown(StreamtuneError):
    pass


def _route_update(payload: str):
    """The broadcast or alias move a route-update record holds; None for anything else."""
    for message in (AdapterVersionBroadcast, AliasMove):
        try:
            return message.from_json(payload)
        except Exception:
            continue
    return None


def _request_id(payload: str):
    try:
        return json.loads(payload).get("request_id")
    except (ValueError, AttributeError):
        return None


def model_of(payload: str) -> str:
    """The model_id a request is keyed by ("" when unreadable: it still gets its error response)."""
    try:
        return parse_model_name(json.loads(payload)["model"]).model_id
    except (StreamtuneError, KeyError, TypeError, ValueError, AttributeError):
        return ""
