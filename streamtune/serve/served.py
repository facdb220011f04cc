"""The server's state: acknowledged routes, the adapter pool, refusals, the inference log.

A route (model_id, alias) -> version moves only once the version's files are checked and
in the pool, under the pool's lock: that move is the swap's acknowledgement. A request
resolves its route under the same lock and generates before releasing it, so once a move
is acknowledged no response comes from the version it replaced, and none mixes two.

Requests are decoded in batches (operators.batched_decoding.BatchScheduler): the scheduler
thread gathers concurrent requests for `batch_window_ms`, then, holding the pool's lock,
resolves each one's route (`submit`'s `resolve`), activates each distinct version into a
slot and decodes all rows in one loop. Resolution and generation still share one lock hold,
so the guarantee above holds for every row of a batch; all rows of one request (its prompts
× n choices) come from the one version its route named, which `system_fingerprint` names.
`streamtune_serve_batch_size` (Prometheus) counts the rows of each batch.

Response ids. With a signing key (ServeSettings.response_signing_key: $STREAMTUNE_RESPONSE_SIGNING_KEY,
the file named by $STREAMTUNE_RESPONSE_SIGNING_KEY_FILE or --response-signing-key-file) each
request id is `cmpl-<uuid hex>.<HMAC tag>` (core.response_ids): the id answered to the
client and the one in the inference log record are the same signed id, so feedback citing
it verifies at the control plane. Without a key ids are plain `cmpl-<uuid hex>`.
"""

from __future__ import annotations

import logging
import queue
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from connectors.adapter_follower import AdapterFollower, FollowerSettings
from core import transport
from core.errors import ArtifactIntegrityError, ConfigError, StreamtuneError
from core.messages import InferenceRecord
from core.response_ids import new_response_id
from core.routing import BASE
from operators.adapter_pool import AdapterPool, Generation, generation_of
from operators.batched_decoding import Group, NotReady, Row, RowResult, SamplingParams
from operators.tracing import span

from .decision import CostModel
from .guard import GuardSettings, OnlineGuard
from core.routing import ModelName, arm_for, parse_model_name, pinned_name

log = logging.getLogger("streamtune.serve")


class ModelNotFound(StreamtuneError):
    exit_code = 2


EVENT_TIMEOUT_S = 600.0  # a batch that says nothing this long: the scheduler is stuck


def _next_event(group: Group) -> tuple:
    try:
        return group.events.get(timeout=EVENT_TIMEOUT_S)
    except queue.Empty:
        raise TimeoutError("no answer from the batch scheduler") from None


@dataclass(frozen=True)
class ServeSettings:
    base_model: str
    follower: FollowerSettings
    slots: int = 8
    cpu_cache: int = 1024
    max_rank: int = 16
    candidate_fraction: float = 0.0
    inference_log_topic: Optional[str] = None
    max_tokens_limit: int = 256
    guard: Optional[GuardSettings] = None   # automatic rollback (needs the inference log)
    webhook_url: Optional[str] = None       # where MLflow pushes alias moves (connectors.mlflow_webhook)
    webhook_poll_s: float = 5.0             # the registry poll, once the webhook is registered
    response_signing_key: Optional[bytes] = None  # signs response ids (core.response_ids); None: unsigned
    batch_window_ms: float = 5.0            # how long the scheduler gathers requests into one batch
    batch_max_wait_ms: float = 50.0         # right after a batch: how long it waits for the rows then in flight
    max_batch: int = 16                     # rows (prompts × n) decoded together at most
    # The decision layer (streamtune/serve/decision.py): model id (or "*") -> the mean
    # log-probability below which a request with a latency budget may take the accurate path.
    confidence_thresholds: Optional[dict] = None
    # The vLLM engine (vllm_engine.py): decoding by a vLLM server, versions loaded into it by name.
    vllm_url: Optional[str] = None
    vllm_artifact_dir: Optional[str] = None  # where vLLM reads version files (a volume both mount)
    vllm_api_key: Optional[str] = None


@dataclass
class Answer:
    generation: Generation
    request_id: str
    model_id: str
    version: Optional[int]
    alias: Optional[str]
    arm: str
    latency_ms: float
    audit_trace: list = field(default_factory=list)
    choices: list = field(default_factory=list)   # every row's Generation (prompts × n), in OpenAI's order
    n: int = 1                                    # choices per prompt

    @property
    def prompt_tokens(self) -> int:  # each prompt once (its n choices share it)
        choices = self.choices or [self.generation]
        return sum(g.prompt_tokens for g in choices[::self.n])

    @property
    def completion_tokens(self) -> int:
        return sum(g.tokens for g in (self.choices or [self.generation]))


class Pending:
    """A request whose route is resolved and whose rows are decoding in a batch.

    `events()` yields ("delta", choice, text) (streamed rows only) and ("row", choice,
    RowResult) until every row is done; `answer()` waits for all and returns the Answer. The
    inference log record is written once, when the last row is done, with the whole text (of
    the first prompt's first choice, when a request has several prompts or n > 1)."""

    def __init__(self, served: "ServedModels", group: Group, request_id: str, model_id: str, version: Optional[int],
                 alias: Optional[str], arm: str, prompts: list[str], user: Optional[str], started: float):
        self.served, self.group, self.request_id = served, group, request_id
        self.model_id, self.version, self.alias, self.arm = model_id, version, alias, arm
        self.prompts, self.user, self.started = prompts, user, started
        self.n = len(group.rows) // max(1, len(prompts))
        self.result: Optional[Answer] = None

    @property
    def fingerprint(self) -> str:
        return "base" if self.version is None else pinned_name(self.model_id, self.version)

    def events(self):
        results: list = [None] * len(self.group.rows)
        left = len(results)
        while left:
            event = _next_event(self.group)
            if event[0] == "error":
                self.served.requests.labels(self.model_id, self.arm, type(event[1]).__name__).inc()
                raise event[1]
            if event[0] == "row":
                results[event[1]] = event[2]
                left -= 1
            yield event
        self.result = self.served.finish(self, results)

    def answer(self) -> Answer:
        for _ in self.events():
            pass
        return self.result


class ServedModels:
    def __init__(self, settings: ServeSettings):
        self.settings = settings
        if settings.vllm_url:
            from connectors.vllm_target import VllmTarget

            from .vllm_engine import VllmPool
            target = VllmTarget(settings.vllm_url, settings.vllm_artifact_dir, settings.vllm_api_key)
            self.pool = VllmPool(settings.base_model, target, slots=settings.slots)
        else:
            self.pool = AdapterPool(settings.base_model, slots=settings.slots, cpu_cache=settings.cpu_cache,
                                    max_rank=settings.max_rank)
        self.routes: dict[str, dict[str, int]] = {}          # acknowledged: model_id -> alias -> version
        self.refused: dict[tuple[str, int], str] = {}
        self.draining = False  # told to stop: /readyz answers 503 while requests are still served
        self.fractions: dict[str, float] = {}
        self.registry = CollectorRegistry()
        self.requests = Counter("streamtune_serve_requests", "Requests by model, arm and outcome",
                                ["model_id", "arm", "status"], registry=self.registry)
        self.latency = Histogram("streamtune_serve_request_seconds", "Request latency", ["arm"],
                                 buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10), registry=self.registry)
        self.swaps = Counter("streamtune_serve_swaps", "Acknowledged alias moves (swaps)", ["alias"],
                             registry=self.registry)
        self.refusals = Counter("streamtune_serve_refused_versions", "Versions refused (integrity)",
                                registry=self.registry)
        self.swap_seconds = Gauge("streamtune_serve_last_swap_seconds", "Last in-memory adapter copy",
                                  registry=self.registry)
        self.path_decisions = Counter("streamtune_serve_path_decisions",
                                      "Decision layer: the path each answer took, and why",
                                      ["model_id", "path", "reason"], registry=self.registry)
        self.costs = CostModel()
        self.batch_size = Histogram("streamtune_serve_batch_size", "Rows decoded together in one batch",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry)
        self.scheduler = self.pool.scheduler(settings.batch_window_ms, settings.max_batch,
                                             on_batch=lambda rows, versions: self.batch_size.observe(rows),
                                             max_wait_ms=settings.batch_max_wait_ms)
        self.log_producer = None
        if settings.inference_log_topic:
            from kafka import KafkaProducer

            from connectors.kafka import create_topic
            create_topic(settings.follower.bootstrap, settings.inference_log_topic)
            self.log_producer = KafkaProducer(bootstrap_servers=settings.follower.bootstrap, acks=1, linger_ms=5,
                                              **transport.kafka_python_kwargs())
        self.follower = AdapterFollower(settings.follower, on_alias=self.on_alias)
        # The guard verifies the ids it judges with the key this server signs them with.
        self.guard = OnlineGuard(settings.guard, signing_key=settings.response_signing_key) if settings.guard else None
        self.webhook_secret = secrets.token_urlsafe(32)  # made for this run, given to MLflow only
        self.webhook_id: Optional[str] = None

    def _register_webhook(self) -> None:
        """Ask MLflow to push alias moves here; polling every follower.alias_poll_s stays the
        fallback (a file store, a server that refuses private http URLs, an old MLflow)."""
        url, tracking_uri = self.settings.webhook_url, self.settings.follower.tracking_uri
        if not url or not tracking_uri:
            return
        from connectors.mlflow_webhook import register
        try:
            self.webhook_id = register(tracking_uri, url, self.webhook_secret)
        except Exception as e:
            log.warning("no registry webhook (%s): alias moves made in MLflow directly are polled every %.2f s",
                        e, self.follower.alias_poll_s)
            return
        self.follower.alias_poll_s = self.settings.webhook_poll_s
        log.info("registry webhook %s -> %s: alias moves pushed, polled every %.0f s as a fallback",
                 self.webhook_id, url, self.settings.webhook_poll_s)

    def start(self) -> "ServedModels":
        self._register_webhook()
        self.follower.start()
        if self.guard is not None:
            self.guard.start()
        return self

    def close(self) -> None:
        if self.webhook_id is not None:
            from connectors.mlflow_webhook import unregister
            try:
                unregister(self.settings.follower.tracking_uri, self.webhook_id)
            except Exception as e:  # MLflow gone first: the next start replaces it by name
                log.warning("could not remove the registry webhook %s: %s", self.webhook_id, e)
        self.follower.stop()
        self.scheduler.stop()
        if self.guard is not None:
            self.guard.stop()
        if self.log_producer is not None:
            self.log_producer.flush(5)
            self.log_producer.close(5)

    # -- following ----------------------------------------------------------------------
    def _ensure_loaded(self, model_id: str, version: int) -> str:
        """The version's pool key, its files fetched, checked and parsed if need be."""
        key = f"{model_id}/{version}"
        if self.pool.has(key):
            return key
        reason = self.refused.get((model_id, version))
        if reason:
            raise ArtifactIntegrityError(reason)
        broadcast = self.follower.version(model_id, version)
        if broadcast is None:
            raise ModelNotFound(f"{model_id} has no version {version} known to this server")
        try:
            # Every file against the manifest the broadcast's sha256 names: fetched, then as parsed.
            self.pool.put(key, self.follower.fetch(broadcast), broadcast.sha256)
        except ArtifactIntegrityError as e:
            self.refused[(model_id, version)] = str(e)
            self.refusals.inc()
            log.error("refused %s v%d: %s", model_id, version, e)
            raise
        return key

    def on_alias(self, model_id: str, alias: str, version: Optional[int]) -> None:
        """The follower saw `alias` move: load the version, then acknowledge the move."""
        if version is None:  # deleted in the registry (a rolled-back candidate): no more traffic
            with self.pool.lock:
                self.routes.get(model_id, {}).pop(alias, None)
            log.info("%s@%s removed", model_id, alias)
            return
        with span("streamtune.swap", model_id=model_id, alias=alias, mlflow_version=version):
            key = self._ensure_loaded(model_id, version)  # raises: the route stays where it was
            with self.pool.lock:
                self.routes.setdefault(model_id, {})[alias] = version
                if alias == "champion":
                    self.pool.activate(key)  # hot before the first request that needs it
                    self.swap_seconds.set(self.pool.last_swap_seconds)
        self.swaps.labels(alias).inc()
        log.info("%s@%s -> v%d acknowledged", model_id, alias, version)

    # -- requests -----------------------------------------------------------------------
    def fraction(self, model_id: str) -> float:
        return self.fractions.get(model_id, self.settings.candidate_fraction)

    def _route(self, name: ModelName, key: str) -> tuple[Optional[int], Optional[str], str]:
        """(version, alias, arm) for a request, from the acknowledged routes (hold pool.lock)."""
        if name.model_id == BASE:
            return None, None, "base"
        if name.version is not None:
            return name.version, None, "pinned"
        routes = self.routes.get(name.model_id, {})
        if name.alias is not None:
            if name.alias not in routes:
                raise ModelNotFound(f"{name.model_id} has no alias {name.alias!r} on this server")
            return routes[name.alias], name.alias, name.alias if name.alias in ("champion", "candidate") else "pinned"
        if "champion" not in routes:
            raise ModelNotFound(f"{name.model_id} has no champion version yet (known models: GET /v1/models)")
        arm = "champion"
        if "candidate" in routes and routes["candidate"] != routes["champion"]:
            arm = arm_for(name.model_id, key, self.fraction(name.model_id))
        return routes[arm], arm, arm

    def complete(self, model: str, prompt: str, max_tokens: int, user: Optional[str] = None) -> Answer:
        """One greedy completion (through the batch scheduler), answered whole."""
        pending = self.submit(model, [prompt], SamplingParams(max_tokens=max_tokens), user=user)
        return pending.answer()

    def submit(self, model: str, prompts: list[str], params: SamplingParams, n: int = 1,
               user: Optional[str] = None, stream: bool = False,
               pin: Optional[tuple[Optional[int], Optional[str], str]] = None) -> "Pending":
        """Route the request and queue its rows (prompts × n choices) for the batch scheduler;
        returns once decoding has started, i.e. once the route is resolved under the pool's
        lock (ModelNotFound, ConfigError, ArtifactIntegrityError raised here, before any text)."""
        started = time.perf_counter()
        request_id = new_response_id(self.settings.response_signing_key)
        name = parse_model_name(model)
        if not 1 <= params.max_tokens <= self.settings.max_tokens_limit:
            raise ConfigError(f"max_tokens must be between 1 and {self.settings.max_tokens_limit}")
        if not prompts:
            raise ConfigError("prompt: at least one prompt is needed")
        try:
            prompt_ids = [self.pool.tokenize(p) for p in prompts]
        except ValueError as e:
            raise ConfigError(f"prompt: {e}") from None
        sticky = user or request_id
        route: dict = {"arm": "base"}

        def resolve() -> tuple[str, tuple]:  # the scheduler calls it holding pool.lock
            # `pin`: the route of an earlier answer to the same request (the decision layer's
            # accurate path), so both paths are one version and one arm.
            version, alias, arm = pin if pin is not None else self._route(name, sticky)
            route["arm"] = arm
            key = BASE if version is None else f"{name.model_id}/{version}"
            if not self.pool.has(key):
                raise NotReady(version)
            return key, (version, alias, arm)

        try:
            for _ in range(5):  # a route may move between the fetch and the lock: look again
                group = Group([], resolve)
                for ids in prompt_ids:
                    for c in range(n):
                        row_params = params if params.seed is None or c == 0 else replace(params, seed=params.seed + c)
                        on_delta = None
                        if stream:
                            on_delta = (lambda text, i=len(group.rows), q=group.events: q.put(("delta", i, text)))
                        group.rows.append(Row(ids, row_params, on_delta))
                self.scheduler.submit(group)
                event = _next_event(group)
                if event[0] == "start":
                    break
                if event[0] == "error":
                    raise event[1]
                self._ensure_loaded(name.model_id, event[1].payload)  # cold: fetch outside the lock
            else:
                raise ModelNotFound(f"{model}: its route kept moving; try again")
        except Exception as e:
            self.requests.labels(name.model_id, route["arm"], type(e).__name__).inc()
            raise
        version, alias, arm = event[2]
        return Pending(self, group, request_id, name.model_id, version, alias, arm, list(prompts), user, started)

    def finish(self, pending: "Pending", results: list[RowResult]) -> Answer:
        """A request's rows all decoded: metrics, the audit trail, the inference log record."""
        latency = time.perf_counter() - pending.started
        model_id, version, arm = pending.model_id, pending.version, pending.arm
        self.requests.labels(model_id, arm, "ok").inc()
        self.latency.labels(arm).observe(latency)
        broadcast = self.follower.version(model_id, version) if version is not None else None
        key = BASE if version is None else f"{model_id}/{version}"
        choices = [generation_of(r, key) for r in results]
        answer = Answer(choices[0], pending.request_id, model_id, version, pending.alias, arm,
                        round(latency * 1000, 3), choices=choices, n=pending.n)
        answer.audit_trace = [
            {"stage": "routing", "arm": arm, "alias": pending.alias, "candidate_fraction": self.fraction(model_id),
             "sticky_key": "user" if pending.user else "request_id"},
            {"stage": "adapter", "model_id": model_id, "version": version,
             "version_id": broadcast.version_id if broadcast else None,
             "sha256": broadcast.sha256 if broadcast else None},
            {"stage": "base_model", "version": self.pool.base_fingerprint},
        ]
        self._log(answer, pending.prompts[0], pending.user)
        return answer

    def refine(self, answer: Answer, prompt: str, params: SamplingParams, budget_ms: Optional[float],
               user: Optional[str] = None) -> Answer:
        """The decision layer (streamtune/serve/decision.py) on a one-prompt, one-choice answer:
        the fast answer, or the most confident of it and the accurate path's, from the same
        version; the decision goes in the audit trace and the metrics either way."""
        from .decision import ACCURATE_TEMPERATURE, BEST_OF, Decision, threshold_for

        threshold = threshold_for(self.settings.confidence_thresholds or {}, answer.model_id)
        decision = Decision.make(answer.generation.mean_logprob, threshold, budget_ms, answer.latency_ms,
                                 self.costs.expected_ms(answer.model_id, answer.latency_ms))
        self.path_decisions.labels(answer.model_id, decision.path, decision.reason).inc()
        if decision.path == "fast":
            answer.audit_trace.append(decision.trace())
            return answer
        started = time.perf_counter()
        model = BASE if answer.version is None else pinned_name(answer.model_id, answer.version)
        route = (answer.version, answer.alias, answer.arm)
        # Submitted together, decoded in one batch: each is its own response (id, log record).
        pending = [self.submit(model, [prompt], replace(params, temperature=ACCURATE_TEMPERATURE, seed=seed),
                               user=user, pin=route) for seed in range(1, BEST_OF + 1)]
        candidates = [answer, *(p.answer() for p in pending)]
        accurate_ms = (time.perf_counter() - started) * 1000
        self.costs.observe(answer.model_id, answer.latency_ms, accurate_ms)
        best = max(candidates, key=lambda a: a.generation.mean_logprob)
        best.latency_ms = round(answer.latency_ms + accurate_ms, 3)
        best.audit_trace = [*answer.audit_trace, {**decision.trace(), "accurate_ms": round(accurate_ms, 3),
                                                  "candidates": len(candidates),
                                                  "chosen_mean_logprob": best.generation.mean_logprob}]
        return best

    def _log(self, answer: Answer, prompt: str, user: Optional[str]) -> None:
        if self.log_producer is None:
            return
        record = InferenceRecord(request_id=answer.request_id, model_id=answer.model_id, version=answer.version,
                                 alias=answer.alias, arm=answer.arm, user=user, prompt=prompt,
                                 completion=answer.generation.text, mean_logprob=answer.generation.mean_logprob,
                                 latency_ms=answer.latency_ms, ts=int(time.time() * 1000))
        try:
            self.log_producer.send(self.settings.inference_log_topic, key=answer.model_id.encode(),
                                   value=record.to_json().encode())
        except Exception as e:  # the answer is served either way; the gap is counted
            self.requests.labels(answer.model_id, answer.arm, "log_failed").inc()
            log.warning("inference log: %s", e)

    # -- what is served -----------------------------------------------------------------
    def serving(self, model_id: str) -> dict:
        """The model's split and online metrics per arm: requests (this process, since it
        started), responses and judged feedback (the guard, from the inference log and the
        feedback topics), the acceptance over the guard's window per version, and the
        rollback decisions taken for the model. ModelNotFound when the server knows nothing of it.
        """
        known = self.follower.models().get(model_id)
        with self.pool.lock:
            routes = dict(self.routes.get(model_id, {}))
        if known is None and not routes:
            raise ModelNotFound(f"{model_id} is not served here (known models: GET /v1/models)")
        requests: dict[str, dict[str, int]] = {}  # arm -> requests (answered or not), errors
        for metric in self.requests.collect():
            for sample in metric.samples:
                labels, n = sample.labels, int(sample.value)
                # log_failed is counted besides the request's `ok`: the answer was served
                if not sample.name.endswith("_total") or labels.get("model_id") != model_id or \
                        labels["status"] == "log_failed":
                    continue
                counts = requests.setdefault(labels["arm"], {"requests": 0, "errors": 0})
                counts["requests"] += n
                counts["errors"] += 0 if labels["status"] == "ok" else n
        g = self.guard
        judged = {arm: dict(c) for (m, arm), c in dict(g.arms).items() if m == model_id} if g else {}
        window = {v: st for (m, v), st in dict(g.stats).items() if m == model_id} if g else {}
        arms = []
        order = ["champion", "candidate", "pinned", "base"]
        for arm in sorted(set(requests) | set(judged) | set(routes) & {"champion", "candidate"},
                          key=lambda a: (order.index(a) if a in order else len(order), a)):
            version = routes.get(arm)
            row = {"arm": arm, "version": version, **requests.get(arm, {"requests": 0, "errors": 0})}
            if g is not None:
                c = judged.get(arm, {})
                row.update({k: c.get(k, 0) for k in ("responses", "judged", "accepted", "corrected", "rejected")})
                n = row["judged"]
                row["acceptance"] = round(row["accepted"] / n, 4) if n else None
                row["correction_rate"] = round(row["corrected"] / n, 4) if n else None
                st = window.get(version) if version is not None else None
                row["window_events"] = st.events if st else 0
                row["window_acceptance"] = round(st.acceptance, 4) if st and st.events else None
            arms.append(row)
        guard = {"enabled": g is not None}
        if g is not None:
            guard.update(margin=g.settings.margin, min_events=g.settings.min_events, window=g.settings.window,
                         min_distinct_users=g.settings.min_distinct_users)
        return {"model_id": model_id, "candidate_fraction": self.fraction(model_id), "aliases": routes,
                "registry_aliases": (known or {}).get("aliases", {}), "arms": arms, "guard": guard,
                "decisions": [d for d in list(g.decisions) if d["model_id"] == model_id] if g else []}
    def describe(self) -> list[dict]:
        known = self.follower.models()
        hot = set(self.pool.hot())
        with self.pool.lock:
            routes = {m: dict(r) for m, r in self.routes.items()}
        out = []
        for model_id in sorted(set(known) | set(routes)):
            refused = [{"version": v, "reason": r} for (m, v), r in sorted(self.refused.items()) if m == model_id]
            out.append({"id": model_id, "object": "model", "owned_by": "streamtune",
                        "aliases": routes.get(model_id, {}),
                        "registry_aliases": known.get(model_id, {}).get("aliases", {}),
                        "versions": known.get(model_id, {}).get("versions", []),
                        "hot": sorted(int(k.split("/")[1]) for k in hot if k.split("/")[0] == model_id),
                        "candidate_fraction": self.fraction(model_id), "refused": refused})
        return out
