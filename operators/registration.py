"""Registration inside the training job: committed versions → MLflow model registry → broadcast.

The job reads its own versions topic (`read_committed`, so only versions whose checkpoint
completed), keyed by model_id, and registers each version in order, idempotently by
version_id (connectors/mlflow_registry.py): the cluster supervises, restarts and scales it
with the job, and no process has to be started by hand.

An MLflow outage never blocks training or checkpoints: a version that cannot be registered
stays queued in this operator's keyed state, with the model's later versions behind it, and
a processing-time timer retries with backoff (1 s doubling to 30 s). Nothing blocks a
checkpoint barrier here. After a restore the source replays from the checkpointed offset;
versions registered since are found by their version_id and only broadcast again
(broadcast readers are idempotent by version_id).

A version whose artifact is missing or does not match its sha256 is never registered: it
goes to the DLQ (`artifact_integrity`, kind `version`), is logged and counted, and the next
versions register. The sha256 covers the whole artifact through its manifest
(connectors/artifact_store.py): a changed config, changed weights, a missing or an unlisted
file each refuse the version, and the dead letter's detail names the file. Counters: versions_in = registered + already_registered + integrity_failures
+ queued (in state); registration_retries counts failed attempts. A version's run gets its
params and metrics after its broadcast is handed on (run_finish_failures counts runs MLflow
refused to finish).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from pyflink.common import Types
from pyflink.datastream import KeyedProcessFunction, ProcessFunction, TimeDomain
from pyflink.datastream.state import ValueStateDescriptor

from core.errors import ArtifactIntegrityError, InvalidMessage
from core.messages import VersionRecord
from operators.counters import FunctionCounters
from operators.timers import ArmedHere
from operators.tracing import span
from operators.validate import DLQ_TAG, dead_letter

log = logging.getLogger("streamtune.registration")

RETRY_FIRST_MS, RETRY_MAX_MS = 1000, 30_000
POLL_MS = 20  # how often a model's pending registration is looked at
# (model_id, version record JSON, topic, partition, offset, ts)
VERSION_TYPE = Types.TUPLE([Types.STRING(), Types.STRING(), Types.STRING(), Types.INT(), Types.LONG(), Types.LONG()])


class VersionReader(ProcessFunction):
    """A committed version record → (model_id, …) for key_by; one that breaks the contract
    (a foreign producer on the topic) → the DLQ with the reason."""

    def process_element(self, row, ctx):
        payload, topic, partition, offset = row["payload"], row["topic"], row["partition"], row["offset"]
        try:
            record = VersionRecord.from_json(payload)
        except InvalidMessage as e:
            yield DLQ_TAG, dead_letter(e.code, e.detail, payload, topic, partition, offset, ctx.timestamp(), "version")
            return
        yield record.model_id, payload, topic, partition, offset, ctx.timestamp()


class RegistrationFunction(KeyedProcessFunction):
    """Input: (model_id, version record JSON, topic, partition, offset, ts); output: broadcasts.

    MLflow is called from one background thread of this worker, never from process_element or
    on_timer: a checkpoint barrier then passes this operator at once instead of waiting behind
    each queued registration (it did: 2-3 s of start delay under load, which held the commit of
    the next versions). A per-model processing-time timer polls the model's queue head every
    POLL_MS and emits its broadcast when its registration is done; the queue and the timer are
    keyed state, so after a restore the head is registered again (idempotent by version_id).

    A restore can bring back a pending timer's state without the timer (operators/timers.py):
    a poll or retry armed before the restore does not hold back the model's next version,
    which starts the queue again. Until that version comes, a queue whose timer was lost waits.
    """

    def __init__(self, tracking_uri: str, artifact_store: str):
        self.tracking_uri, self.artifact_store = tracking_uri, artifact_store

    def open(self, runtime_context):
        # Fail fast and retry on our own timer: MLflow's client would otherwise retry one call
        # for minutes.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        from connectors.artifact_store import ArtifactStore
        from connectors.mlflow_registry import RegistryCache, make_client

        self.client = make_client(self.tracking_uri)
        self.registry_cache = RegistryCache()
        self.store = ArtifactStore(self.artifact_store, self.tracking_uri)
        # One thread: registrations stay in order, and MLflow sees one writer per worker.
        self.registrar = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamtune-register")
        self.inflight: dict[tuple, Future] = {}  # (topic, partition, offset) -> its registration
        self.unfinished_runs: deque[str] = deque()  # appended by the registration thread
        self.closed = False
        self.queue = runtime_context.get_state(ValueStateDescriptor("queue", Types.PICKLED_BYTE_ARRAY()))
        # (due ms, backoff ms): the one pending timer of this model, a poll (backoff 0) or a retry
        self.timer = runtime_context.get_state(ValueStateDescriptor("timer", Types.PICKLED_BYTE_ARRAY()))
        self.armed_here = ArmedHere()
        self.counters = FunctionCounters(runtime_context.get_metrics_group(), (
            "versions_in", "registered", "already_registered", "integrity_failures", "registration_retries",
            "run_finish_failures"))

    def close(self):
        self.closed = True
        self.registrar.shutdown(wait=False, cancel_futures=True)

    def process_element(self, value, ctx):
        self.counters.enter_element()
        self.counters.inc("versions_in")
        queue = (self.queue.value() or []) + [tuple(value[1:])]
        self.queue.update(queue)
        # A poll or a retry this worker armed is pending: it keeps the model's order. One armed
        # before a restore may be lost: the queue's head starts again.
        if not self.armed_here.holds(self.timer, "poll", ctx.get_current_key()):
            timer = self.timer.value()
            self._submit(queue[0])
            self._arm(ctx, POLL_MS, backoff_ms=timer[1] if timer else 0)
        return iter(())

    def on_timer(self, timestamp, ctx):
        timer = self.timer.value()
        if ctx.time_domain() != TimeDomain.PROCESSING_TIME or timer is None or timer[0] != timestamp:
            return
        self.timer.clear()
        while self.unfinished_runs:
            self.unfinished_runs.popleft()
            self.counters.inc("run_finish_failures")
        backoff_ms = timer[1]
        queue = self.queue.value() or []
        while queue:
            entry = queue[0]  # (payload, topic, partition, offset, ts)
            future = self._submit(entry)
            if not future.done():
                self._arm(ctx, POLL_MS, backoff_ms)
                return
            del self.inflight[entry[1:4]]
            try:
                created, broadcast = future.result()
            except ArtifactIntegrityError as e:
                record = VersionRecord.from_json(entry[0])  # checked before it was queued
                self.counters.inc("integrity_failures")
                log.error("version %s not registered: %s", record.version_id, e)
                yield DLQ_TAG, dead_letter("artifact_integrity", str(e), *entry, "version", record.model_id)
            except Exception as e:  # MLflow or the store unreachable: retry later, in order
                self.counters.inc("registration_retries")
                wait = min(max(backoff_ms * 2, RETRY_FIRST_MS), RETRY_MAX_MS)
                log.warning("registering %s failed (%s: %s); retrying in %d ms",
                            VersionRecord.from_json(entry[0]).version_id, type(e).__name__,
                            str(e).splitlines()[0][:300] if str(e) else "", wait)
                self._arm(ctx, wait, backoff_ms=wait)  # the retry submits the head again
                return
            else:
                self.counters.inc("registered" if created else "already_registered")
                backoff_ms = 0
                yield broadcast
            queue = queue[1:]
            self.queue.update(queue)
            if queue:
                self._submit(queue[0])
        self.queue.clear()

    def _arm(self, ctx, delay_ms: int, backoff_ms: int) -> None:
        due = ctx.timer_service().current_processing_time() + delay_ms
        self.timer.update((due, backoff_ms))
        ctx.timer_service().register_processing_time_timer(due)
        self.armed_here.add("poll", ctx.get_current_key())

    def _submit(self, entry: tuple) -> Future:
        """The registration of queue entry `entry`, started if it is not running: keyed by its
        source position, so a poll does not parse the record again."""
        key = entry[1:4]  # (topic, partition, offset)
        if key not in self.inflight:
            self.inflight[key] = self.registrar.submit(self._register, entry[0])
        return self.inflight[key]

    def _register(self, payload: str) -> tuple[bool, str]:
        """In the registration thread: (created, the broadcast's JSON). The version's run is
        finished by the next task of this thread, after the broadcast can go out."""
        from connectors.mlflow_registry import broadcast_for, publish_version

        record = VersionRecord.from_json(payload)
        with span("streamtune.register", model_id=record.model_id, version_id=record.version_id,
                  samples=len(record.lineage.sample_ids)) as traced:
            mv, created = publish_version(self.client, record, self.store, self.registry_cache)
            traced.set_attribute("mlflow_version", int(mv.version))
            traced.set_attribute("created", created)
        self.registrar.submit(self._finish_run, record, mv.run_id, not created)
        return created, broadcast_for(record, mv).to_json()

    def _finish_run(self, record: VersionRecord, run_id: str, check: bool) -> None:
        """In the registration thread, after _register: the run's params and metrics
        (connectors/mlflow_registry.finish_run). MLflow unreachable: retried with the
        registration's backoff, ahead of the next registrations (they would fail too), so no
        run is left unfinished by an outage. Refused by MLflow (a 4xx answer will not change):
        logged and counted, and the run stays RUNNING; the version, its tags and its
        broadcast are out already."""
        from mlflow.exceptions import RestException

        from connectors.mlflow_registry import finish_run

        wait_ms = 0
        while not self.closed:
            try:
                finish_run(self.client, record, run_id, self.registry_cache, check=check or wait_ms > 0,
                           store=self.store)
                return
            except RestException as e:
                if 400 <= e.get_http_status_code() < 500:
                    self.unfinished_runs.append(run_id)  # counted by the operator's thread (operators/counters.py)
                    log.error("version %s: MLflow refused to finish its run %s, left RUNNING: %s",
                              record.version_id, run_id, e)
                    return
                failed = e
            except Exception as e:
                failed = e
            wait_ms = min(max(wait_ms * 2, RETRY_FIRST_MS), RETRY_MAX_MS)
            log.warning("finishing the run of %s failed (%s: %s); retrying in %d ms", record.version_id,
                        type(failed).__name__, str(failed).splitlines()[0][:300] if str(failed) else "", wait_ms)
            time.sleep(wait_ms / 1000)
