"""The keyed heart of the job: per-model config, window buffer and LoRA adapter state.

Keyed by model_id. Configs and samples arrive on one stream (see operators/validate.py).
Everything a restore needs lives in keyed state: the config in force, the pending samples,
the adapter and optimizer state, the version sequence. A fired window yields one version
record; the job sends it through an exactly-once Kafka sink, so it becomes visible only
when the checkpoint holding the matching state completes.

Learning quality (operators/quality.py), in keyed state too: the champion the trainer last
promoted (a reference to its artifact), and with the spec's sections the eval sets and the
replay buffer. With `evaluation`, a window's held-out samples join the eval sets instead of
training, and the new version and the champion are scored on the same eval sets before the
record goes out with the decision (`gate`), so a replay decides the same.
"""

from __future__ import annotations

import functools
import hashlib
import time
from dataclasses import dataclass, replace
from pathlib import Path

from pyflink.common import Types
from pyflink.datastream import KeyedProcessFunction, TimeDomain
from pyflink.datastream.state import ListStateDescriptor, ValueStateDescriptor

from core.messages import (AdapterConfig, ChangeOrigin, EvalScore, FeedbackSample, FinetuneSpec, Lineage,
                           RetrainTrigger, Retraction, VersionMetrics, VersionRecord)
from operators.arbiter import Arbiter, ArbiterSettings, lower_cpu_priority
from operators.counters import FunctionCounters
from operators.granularity import GranularityState, next_state
from operators.micro_batches import PendingBatch, expand
from operators.quality import (Kept, QualityState, SetScores, decide, draw_replay, eval_roots, is_held_out,
                               load_fixed)
from operators.timers import ArmedHere
from operators.tracing import span
from operators.validate import DLQ_TAG, dead_letter
from operators.windowing import Pending, due_batch, offset_ranges, steps, window_end, window_start


@dataclass(frozen=True)
class TrainerSettings:
    default_base_model: str
    artifact_store: str                  # URI (connectors/artifact_store.py)
    unknown_model_grace_ms: int
    lateness_ms: int = 0
    idle_close_ms: int = 5000            # a model's windows close this long after window_seconds without a sample
    max_live_adapters: int = 64          # adapters a worker holds in its model; the rest wait in keyed state
    tracking_uri: str | None = None      # for an mlflow-artifacts:// store
    checkpoint_on_version: str | None = None  # the JobManager's REST URL: ask it for a checkpoint per version
    arbitration: ArbiterSettings | None = None  # yield to a co-located server's SLO (operators/arbiter.py)


JOB_ID_PARAMETER = "streamtune.job-id"  # a global job parameter (jobs/wiring.py fixes the job's id)


# How stale the last_seen in state may be (it is also kept exactly in memory): an idle close
# after a restore can come this much early, never late.
LAST_SEEN_WRITE_MS = 250


@functools.lru_cache(maxsize=4096)
def spec_of(body: str) -> FinetuneSpec:
    """The config in force, parsed once per worker, not once per sample (specs are frozen)."""
    return FinetuneSpec.from_json(body)


def version_id_for(model_id: str, end: int, batch: list[Pending]) -> str:
    first, last = batch[0], batch[-1]
    return f"{model_id}@{end}#{first.partition}:{first.offset}-{last.partition}:{last.offset}"


def _lineage_origin(p: Pending) -> ChangeOrigin:
    """The CDC origin of a pending sample (row, op, LSNs or resume token) and its sample id."""
    return FeedbackSample.from_json(p.payload).origin.model_copy(update={"sample_id": p.sample_id})


class PendingSamples:
    """A model's pending samples: a ListState a record's sample or a micro-batch is appended to
    (one element, pickled once, one append when the bundle ends) instead of a list rewritten
    whole at every bundle, which made a window's cost grow with the square of its size. A
    window's close reads them all (`value`, micro-batches unpacked) and writes back what
    carries over (`update`).

    Keeps in memory each model's pending count (gauge pending_samples: this subtask's models;
    after a restore a model counts from its next record or timer). `key` is the model whose
    record or timer is being processed. Checkpoints of earlier versions hold the samples in the
    ValueState `pending` (`before`): a model's are moved over the first time this worker
    touches it."""

    def __init__(self, samples, before, sizes: dict):
        self.samples, self.before, self.sizes, self.key = samples, before, sizes, None
        self.moved: set = set()  # models whose `before` this worker has emptied

    def _move_before(self) -> None:
        if self.key in self.moved:
            return
        self.moved.add(self.key)
        earlier = self.before.value()
        if earlier:
            self.samples.add_all(earlier)
            self.before.clear()

    def value(self) -> list[Pending]:
        self._move_before()
        return expand(self.samples.get() or [])

    def add_all(self, arrived: list) -> None:
        self._move_before()
        self.samples.add_all(arrived)
        self.sizes[self.key] = self.sizes.get(self.key, 0) + sum(a.count for a in arrived)

    def update(self, pending: list[Pending]) -> None:
        self._move_before()
        if not pending:
            self.clear()
            return
        self.samples.update(pending)
        self.sizes[self.key] = len(pending)

    def clear(self) -> None:
        self._move_before()
        self.samples.clear()
        self.sizes.pop(self.key, None)


class FinetuneFunction(KeyedProcessFunction):
    # Keyed state, attribute -> state name (the names are in checkpoints: keep them):
    # config       {"spec": json, "version": int, "hash": str}, the config in force
    # pending      list[Pending] of earlier versions, moved to the list state `pending_samples` (PendingSamples)
    # timer        end of the next window to close, or None
    # idle         processing time the model's windows close if no sample comes, or None
    # last_seen    processing time the model's last sample arrived (up to LAST_SEEN_WRITE_MS old)
    # grace        processing time the unknown-model grace ends, or None
    # adapter      LoraTrainer state dict
    # seq          versions emitted so far
    # last_trigger window_end of the last retrain trigger applied
    # retracted    origins of CDC rows retracted since the last version
    # quality      QualityState: champion, eval sets, replay buffer
    # granularity  GranularityState (trigger_policy.mode adaptive): the next step's size, running statistics
    KEYED_STATE = {"config": "config", "pending": "pending", "timer": "window_end", "idle": "idle_timer",
                   "last_seen": "last_seen", "grace": "grace_timer", "adapter": "adapter", "seq": "seq",
                   "last_trigger": "last_trigger", "retracted": "retracted", "quality": "quality",
                   "granularity": "granularity"}

    checkpoints = None  # a CheckpointRequester with --checkpoint-on-version (set in open)
    arbiter = None      # an Arbiter (operators/arbiter.py) with the deployment's SLO settings
    background = False  # whether the last step's thread ran at idle CPU priority (claim_cpu_priority)
    last_version_at = 0  # wall-clock ms the last version left the step (gauge last_version_at_ms)

    def __init__(self, settings: TrainerSettings):
        self.settings = settings

    def open(self, runtime_context):
        began = int(time.time() * 1000)  # gauge open_ms: imports, the base model's load
        from connectors.artifact_store import ArtifactStore
        from operators.lora_trainer import LoraTrainer, place_on_gpu, threads_from_env

        self.store = ArtifactStore(self.settings.artifact_store, self.settings.tracking_uri)
        threads_from_env()
        place_on_gpu(runtime_context.get_index_of_this_subtask())
        # Before the model loads: the threads torch starts from here inherit the priority.
        self.background = self.claim_cpu_priority()
        if Path(self.settings.default_base_model, "config.json").exists():
            LoraTrainer.for_base(self.settings.default_base_model)  # load once, before the first window
        # A restore fires past-due processing-time timers at once, before the backlog (which
        # may hold the config) is read: grace periods and idle timers count running time from
        # here, once the base model is loaded (seconds on a loaded machine).
        self.opened_at = int(time.time() * 1000)
        self.start_worker_memory()

        for attribute, name in self.KEYED_STATE.items():
            setattr(self, attribute, runtime_context.get_state(ValueStateDescriptor(name, Types.PICKLED_BYTE_ARRAY())))
        # Samples (Pending) and micro-batches (PendingBatch) waiting for their window to close.
        self.pending_samples = runtime_context.get_list_state(
            ListStateDescriptor("pending_samples", Types.PICKLED_BYTE_ARRAY()))
        self.champion_files: dict[str, bytes] = {}  # sha256 -> adapter weights, read once from the store
        metrics = runtime_context.get_metrics_group()
        self.counters = FunctionCounters(metrics, (
            "windows_fired", "samples_trained", "unknown_model_dead_lettered", "triggers_ignored",
            "samples_superseded", "samples_retracted", "samples_late", "windows_closed_idle", "samples_held_out",
            "kept_samples_dropped", "versions_promoted", "versions_refused", "checkpoint_requests",
            "checkpoint_request_failures"), histograms=("step_ms", "freshness_ms"))
        metrics.gauge("live_adapters", lambda: LoraTrainer.live_totals()["adapters"])
        metrics.gauge("live_adapter_bytes", lambda: LoraTrainer.live_totals()["bytes"])
        self.watch_pending()
        if self.settings.checkpoint_on_version:
            from connectors.flink_checkpoints import CheckpointRequester

            job_id = runtime_context.get_job_parameter(JOB_ID_PARAMETER, "")
            if not job_id:
                raise ValueError(f"checkpoint_on_version needs the job parameter {JOB_ID_PARAMETER} (jobs/wiring.py)")
            self.checkpoints = CheckpointRequester(self.settings.checkpoint_on_version, job_id)
            self.checkpoint_failures = 0
        # Flink's Python gauges are integers: the loss in millionths.
        metrics.gauge("last_loss_micro", lambda: round(self.last_step["loss_after"] * 1e6))
        metrics.gauge("adapter_state_bytes", lambda: self.last_step["state_bytes"])
        metrics.gauge("pending_samples", lambda: sum(self.pending.sizes.values()))
        # Start-up and liveness, in wall-clock ms (bench/submit.py splits a submit's time with them).
        metrics.gauge("open_ms", lambda: self.opened_at - began)
        metrics.gauge("opened_at_ms", lambda: self.opened_at)
        metrics.gauge("last_version_at_ms", lambda: self.last_version_at)
        if self.settings.arbitration is not None:
            self.start_arbiter()
            metrics.gauge("arbiter_yielded_ms", lambda: round(self.arbiter.yielded_s * 1000))
            metrics.gauge("arbiter_yields", lambda: self.arbiter.yields)
            metrics.gauge("arbiter_headroom_failures", lambda: self.arbiter.headroom_failures)
            metrics.gauge("arbiter_idle_priority", lambda: int(self.background))
            # Flink's Python gauges are integers: the headroom in thousandths (-1000: p99 twice the target).
            metrics.gauge("slo_headroom_permille",
                          lambda: round((self.arbiter.last_headroom if self.arbiter.last_headroom is not None
                                         else 1.0) * 1000))

    def claim_cpu_priority(self) -> bool:
        """With arbitration on a CPU and `cpu_priority` "idle": the calling thread (the one that
        trains) yields the CPU to the co-located server (operators/arbiter.py). True if it runs
        at idle priority."""
        import torch

        arbitration = self.settings.arbitration
        if arbitration is None or arbitration.cpu_priority != "idle" or torch.cuda.is_available():
            return False
        return lower_cpu_priority()

    def start_arbiter(self, **overrides) -> None:
        """The arbiter of the deployment's SLO settings (`overrides`: a test's clock or reader)."""
        self.arbiter = Arbiter(self.settings.arbitration, **overrides)

    def close(self):
        if self.checkpoints is not None:
            self.checkpoints.close()
        if self.arbiter is not None:
            self.arbiter.close()

    def _request_checkpoint(self) -> None:
        """The version just emitted commits with the next checkpoint: ask for it now
        (connectors/flink_checkpoints.py). Counted here, on the operator's thread: the
        requests, and the REST calls that failed since the last one."""
        self.checkpoints.request()
        self.counters.inc("checkpoint_requests")
        failures = self.checkpoints.failures
        if failures > self.checkpoint_failures:
            self.counters.inc("checkpoint_request_failures", failures - self.checkpoint_failures)
            self.checkpoint_failures = failures

    def start_worker_memory(self) -> None:
        """What this worker remembers beside its keyed state, empty after a restore or rescale.
        Each keyed-state write is a round trip to the JVM when a bundle ends, so what changes
        with every sample is written as rarely as its reader allows."""
        self.armed_here = ArmedHere()  # grace and idle timers: one restored may be lost (operators/timers.py)
        self.window_timers_here: dict[str, int] = {}  # model -> the last window end it registered here
        self.last_seen_here: dict[str, int] = {}  # model -> processing time of its last sample, exact
        self.last_seen_saved: dict[str, int] = {}  # model -> the last_seen this worker last wrote to state

    def watch_pending(self) -> None:
        """The gauges' in-memory side: pending counts per model, the last step's loss and state size."""
        self.pending = PendingSamples(self.pending_samples, self.pending, {})
        self.last_step = {"loss_after": 0.0, "state_bytes": 0}

    # -- input --------------------------------------------------------------------------
    def process_element(self, value, ctx):
        self.counters.enter_element()
        self.pending.key = ctx.get_current_key()
        kind, model_id, body, topic, partition, offset, ts = value
        if kind == "config":
            self._on_config(body, ctx)
            return
        if kind == "trigger":
            yield from self._on_trigger(body, ctx)
            return
        if kind == "retract":
            self._on_retract(Retraction.from_json(body))
            return
        cfg = self.config.value()
        if kind == "batch":  # samples the JVM proved valid (operators/micro_batches.py): never a CDC row
            arrived = [PendingBatch(ts, partition, body)]
        else:
            sample = FeedbackSample.from_json(body)
            row_key = sample.origin.row_key if sample.origin else ""
            if row_key:  # a newer change of the same row supersedes its untrained sample and its kept copies
                self.pending.update(self._without_row(self.pending.value(), row_key, "samples_superseded"))
                self._forget_row(row_key)
            arrived = [Pending(sample.sample_id, sample.prompt, sample.completion, sample.effective_weight, ts, topic,
                               partition, offset, body, row_key)]
        self.pending.add_all(arrived)
        now = ctx.timer_service().current_processing_time()
        key = ctx.get_current_key()
        self.last_seen_here[key] = now
        if now - self.last_seen_saved.get(key, now - LAST_SEEN_WRITE_MS) >= LAST_SEEN_WRITE_MS:
            self.last_seen.update(now)  # for a restore, whose own opened_at mostly counts anyway
            self.last_seen_saved[key] = now
        if cfg is None:
            if not self.armed_here.holds(self.grace, "grace", key):
                # Wall-clock grace: a config sent moments after the first samples always wins,
                # even when a backlog moves event time far ahead within those moments.
                deadline = now + self.settings.unknown_model_grace_ms
                self.grace.update(deadline)
                ctx.timer_service().register_processing_time_timer(deadline)
                self.armed_here.add("grace", key)
            return
        spec = spec_of(cfg["spec"])
        watermark = ctx.timer_service().current_watermark()
        late = sum(a.count for a in arrived if window_end(a.ts, spec.trigger_policy.window_seconds) <= watermark)
        if late:
            # Its window has closed: it trains with the next one. A delay upstream longer than
            # the sources' idle timeout causes this (docs/concepts/guarantees.md, "Known limits").
            self.counters.inc("samples_late", late)
        # Only the watermark closes this sample's window (on_timer): how the partitions of
        # the input interleave never changes which samples a window holds.
        self._ensure_window_timer(ctx, spec, arrived)

    def _on_config(self, body: str, ctx):
        spec = FinetuneSpec.from_json(body)
        cfg = self.config.value()
        if cfg is None or cfg["hash"] != spec.spec_hash():
            version = (cfg["version"] if cfg else 0) + 1
            cfg = {"spec": body, "version": version, "hash": spec.spec_hash()}
            self.config.update(cfg)
        # Samples that waited for this config: the watermark closes their windows, at once
        # for those it has passed already (a timer at or below it fires with the next one).
        self._ensure_window_timer(ctx, spec, self.pending.value() or [])

    def _on_trigger(self, body: str, ctx):
        """Train every pending sample now, below min_samples_per_window if need be."""
        trigger = RetrainTrigger.from_json(body)
        cfg, pending = self.config.value(), self.pending.value() or []
        last = self.last_trigger.value()
        if trigger.window_end is not None and last is not None and trigger.window_end <= last:
            self.counters.inc("triggers_ignored")  # a redelivered trigger (they are sent at least once)
            return
        if trigger.window_end is not None:
            self.last_trigger.update(trigger.window_end)
        if cfg is None or not pending:
            self.counters.inc("triggers_ignored")  # nothing to train: a trigger is not a sample
            return
        spec = spec_of(cfg["spec"])
        batch = sorted(pending, key=lambda s: s.order)
        end = trigger.window_end or window_end(batch[-1].ts, spec.trigger_policy.window_seconds)
        self.pending.clear()
        self.timer.clear()
        yield from self._fire(ctx.get_current_key(), spec, cfg, batch, max(end, batch[-1].ts + 1), "forced")

    def _on_retract(self, retraction: Retraction) -> None:
        """A deleted (or no longer matching) row: drop its untrained sample, and the row from
        the eval sets and the replay buffer; name it in the next version's lineage."""
        self.pending.update(self._without_row(self.pending.value() or [], retraction.row_key,
                                              "samples_retracted"))
        self._forget_row(retraction.row_key)
        self.retracted.update((self.retracted.value() or []) + [retraction.origin.to_dict()])

    def _forget_row(self, row_key: str) -> None:
        """The row's samples leave the eval sets and the replay buffer (retracted or changed)."""
        quality = self.quality.value()
        if quality is not None:
            quality, dropped = quality.without_row(row_key)
            if dropped:
                self.quality.update(quality)
                self.counters.inc("kept_samples_dropped", dropped)

    def _without_row(self, pending: list[Pending], row_key: str, counter: str) -> list[Pending]:
        kept = [p for p in pending if p.row_key != row_key]
        self.counters.inc(counter, len(pending) - len(kept))
        return kept

    def _ensure_window_timer(self, ctx, spec: FinetuneSpec, pending: list[Pending]) -> None:
        """The watermark closes the window of each pending sample; the idle timer closes them
        all when the model's data stops and nothing moves the watermark past them."""
        size = spec.trigger_policy.window_seconds
        # The earliest window first, whatever arrived before it: a later window's sample from a
        # faster partition must not move the next window to close past an earlier one.
        if pending:
            first, current = window_end(min(s.ts for s in pending), size), self.timer.value()
            if current is None or first < current:
                self.timer.update(first)
        key = ctx.get_current_key()
        for end in {window_end(s.ts, size) for s in pending}:
            # Idempotent per (key, time) in Flink, but each call is a message to the JVM: once
            # per window, not per sample. A restored worker starts with none, so registers again.
            if self.window_timers_here.get(key) != end:
                ctx.timer_service().register_event_time_timer(end)
                self.window_timers_here[key] = end
        if pending and not self.armed_here.holds(self.idle, "idle", key):
            self._arm_idle_timer(ctx, ctx.timer_service().current_processing_time(), spec)

    def _arm_idle_timer(self, ctx, since: int, spec: FinetuneSpec) -> None:
        deadline = since + spec.trigger_policy.window_seconds * 1000 + self.settings.idle_close_ms
        self.idle.update(deadline)
        ctx.timer_service().register_processing_time_timer(deadline)
        self.armed_here.add("idle", ctx.get_current_key())

    # -- time ---------------------------------------------------------------------------
    def on_timer(self, timestamp, ctx):
        self.pending.key = ctx.get_current_key()
        if ctx.time_domain() == TimeDomain.PROCESSING_TIME:
            if self.grace.value() == timestamp:
                yield from self._on_grace_end(timestamp, ctx)
            if self.idle.value() == timestamp:
                yield from self._on_idle(timestamp, ctx)
            return
        self.window_timers_here.pop(ctx.get_current_key(), None)  # a late sample registers its window again
        cfg = self.config.value()
        if cfg is not None:
            yield from self._close_windows(ctx, spec_of(cfg["spec"]), cfg, timestamp)

    def _on_grace_end(self, timestamp: int, ctx):
        """No config came within the grace period: the model's samples go to the DLQ."""
        model_id = ctx.get_current_key()
        resumed_deadline = self.opened_at + self.settings.unknown_model_grace_ms
        if timestamp - self.settings.unknown_model_grace_ms < self.opened_at:
            # Set before this run began: the downtime does not count against the config.
            self.grace.update(resumed_deadline)
            ctx.timer_service().register_processing_time_timer(resumed_deadline)
            return
        self.grace.clear()
        if self.config.value() is None:
            for s in self.pending.value() or []:
                self.counters.inc("unknown_model_dead_lettered")
                yield DLQ_TAG, dead_letter(
                    "unknown_model", f"no config for model_id {model_id} within the "
                    f"{self.settings.unknown_model_grace_ms} ms grace period",
                    s.payload, s.topic, s.partition, s.offset, s.ts, "sample", model_id)
            self.pending.clear()

    def _on_idle(self, timestamp: int, ctx):
        """No sample of this model for window_seconds + idle_close_ms of wall time: close its
        pending windows, which a watermark held by quiet partitions might never pass."""
        self.idle.clear()
        cfg, pending = self.config.value(), self.pending.value() or []
        if cfg is None or not pending:
            return
        spec = spec_of(cfg["spec"])
        # A restore's downtime does not count: the backlog of this model may be on its way.
        last = max(self.last_seen.value() or 0, self.last_seen_here.get(ctx.get_current_key(), 0), self.opened_at)
        if last + spec.trigger_policy.window_seconds * 1000 + self.settings.idle_close_ms > timestamp:
            self._arm_idle_timer(ctx, last, spec)
            return
        self.counters.inc("windows_closed_idle")
        yield from self._close_windows(ctx, spec, cfg, window_end(max(s.ts for s in pending),
                                                                  spec.trigger_policy.window_seconds), idle=True)

    def _close_windows(self, ctx, spec: FinetuneSpec, cfg: dict, up_to: int, idle: bool = False):
        """Close every window ending at or before `up_to`: fire it, or carry its samples over.

        Windows holding no pending sample are skipped, and once only carried-over samples
        remain the loop stops: nothing can change for them until new samples arrive. The idle
        timer (`idle`) closes the last window only if it fires: one too small to train stays
        open (the watermark has not passed it), so its later samples still join it rather
        than arriving late for a window that trained nothing.
        """
        model_id, size = ctx.get_current_key(), spec.trigger_policy.window_seconds
        pending, end = self.pending.value() or [], self.timer.value()
        while pending and end is not None and end <= up_to:
            if spec.trigger_policy.is_adaptive:
                fired, pending = yield from self._fire_adaptive(model_id, spec, cfg, pending, end)
            else:
                batch, pending = due_batch(pending, end, spec.trigger_policy.min_samples_per_window)
                fired = bool(batch)
                if batch:
                    chunks = steps(batch, spec.trigger_policy.max_samples_per_step)
                    for chunk in chunks:
                        yield from self._fire(model_id, spec, cfg, chunk, end,
                                              "max_samples" if len(chunks) > 1 else "window")
            newer = [s.ts for s in pending if s.ts >= end]
            if not newer:
                if fired or not idle:
                    end = window_end(end, size)
                break
            end = window_end(min(newer), size)
        self.pending.update(pending)
        if pending:
            self.timer.update(end)
        else:
            self.timer.clear()

    def _fire_adaptive(self, model_id: str, spec: FinetuneSpec, cfg: dict, pending: list[Pending], end: int):
        """trigger_policy.mode adaptive: the due samples train in steps of the size the last
        step chose (operators/granularity.py), each step choosing the next; a remainder below
        that size carries over, as a window below min_samples_per_window does. Returns
        (whether a step fired, the pending samples left)."""
        size = self._granularity(spec).size
        batch, pending = due_batch(pending, end, size)
        if not batch:
            return False, pending
        while len(batch) >= size:
            chunk, batch = batch[:size], batch[size:]
            yield from self._fire(model_id, spec, cfg, chunk, end, "window")
            size = self._granularity(spec).size
        return True, batch + pending

    def _granularity(self, spec: FinetuneSpec) -> GranularityState:
        """The adaptive state in force, its size within the bounds of the spec in force."""
        policy = spec.trigger_policy
        state = self.granularity.value() or GranularityState.initial(policy.min_samples_per_window)
        low, high = policy.adaptive.min_samples_low, policy.adaptive.min_samples_high
        return state if low <= state.size <= high else replace(state, size=min(high, max(low, state.size)))

    # -- a training step ------------------------------------------------------------------
    def _fire(self, model_id: str, spec: FinetuneSpec, cfg: dict, batch: list[Pending], end: int, trigger: str):
        """Train the window's samples (less those held out) into a version record, yielded;
        nothing when every sample was held out (they wait in the eval sets)."""
        from operators.lora_trainer import LoraTrainer

        started = time.perf_counter()
        quality: QualityState = self.quality.value() or QualityState()
        evaluation, replay = spec.evaluation, spec.replay
        held = [s for s in batch if evaluation and is_held_out(s.sample_id, s.row_key, evaluation.holdout_fraction)]
        if held:
            quality = quality.with_held_out([_kept(s) for s in held], evaluation.recent_size, evaluation.retained_size)
            self.counters.inc("samples_held_out", len(held))
            held_ids = {s.sample_id for s in held}
            batch = [s for s in batch if s.sample_id not in held_ids]
            if not batch:
                self.quality.update(quality)
                return
        start = min(window_start(end, spec.trigger_policy.window_seconds), batch[0].ts)
        version_id = version_id_for(model_id, end, batch)
        seed = (int(hashlib.sha256(version_id.encode()).hexdigest()[:8], 16) + spec.seed) % (2 ** 31)
        base = spec.base_model or self.settings.default_base_model
        trainer = LoraTrainer.for_base(base, self.settings.max_live_adapters)
        replayed = draw_replay(quality.replay, len(batch), replay.ratio, seed) if replay else []
        with span("streamtune.train_step", model_id=model_id, version_id=version_id, samples=len(batch),
                  trigger=trigger, replayed=len(replayed)) as traced:
            adaptive = spec.trigger_policy.is_adaptive
            if self.arbiter is not None:
                # Again here: Beam may run a bundle on another thread of its pool than open's.
                self.background = self.claim_cpu_priority()
                self.arbiter.begin_step()
            result = trainer.step(model_id, spec.adapter_config, spec.training, self.adapter.value(), batch, seed,
                                  replay=replayed, ewc=spec.ewc, measure_noise=adaptive,
                                  between=self.arbiter.between if self.arbiter is not None else None)
            # Written before the state moves on; a replay writes the same bytes under the same name.
            artifact = self.store.put(result.files, result.sha256)
            gate = self._gate(trainer, model_id, spec, quality, result.metrics["loss_after"]) if evaluation else None
            traced.set_attribute("loss_after", result.metrics["loss_after"])
            if gate:
                traced.set_attribute("promote", gate.promote)
        if gate.promote if gate else _loss_rule(quality.champion, result.metrics["loss_after"]):
            quality = replace(quality, champion={
                "version_id": version_id, "artifact_uri": artifact, "sha256": result.sha256,
                "adapter": spec.adapter_config.to_json(), "loss_after": result.metrics["loss_after"]})
        if gate:
            self.counters.inc("versions_promoted" if gate.promote else "versions_refused")
        if replay:
            quality = quality.with_trained(batch, replay.buffer_size)
        held_out = list(quality.held_out_ids)
        self.quality.update(replace(quality, held_out_ids=()))
        granularity = None
        if adaptive:  # this step's size and why; the statistics it measured size the next one
            bounds, used = spec.trigger_policy.adaptive, self._granularity(spec)
            following = next_state(used, bounds, result.noise, result.metrics["loss_before"])
            granularity = used.decision(bounds, following.measured, following.loss_z)
            self.granularity.update(following)
        seq = (self.seq.value() or 0) + 1
        self.adapter.update(result.state)
        self.seq.update(seq)
        retracted = [ChangeOrigin.from_dict(o) for o in self.retracted.value() or []]
        self.retracted.clear()
        origins = [_lineage_origin(s) for s in batch if s.row_key]
        self.counters.inc("windows_fired")
        self.counters.inc("samples_trained", len(batch))
        self.last_step = {"loss_after": result.metrics["loss_after"],
                          "state_bytes": sum(len(v) for v in result.state.values() if isinstance(v, bytes))}
        operator_seconds = time.perf_counter() - started
        self.counters.observe("step_ms", operator_seconds * 1000)
        # Freshness: from the newest sample's Kafka timestamp to this version leaving the step.
        self.last_version_at = int(time.time() * 1000)
        self.counters.observe("freshness_ms", max(0, self.last_version_at - max(s.ts for s in batch)))
        if self.checkpoints is not None:
            self._request_checkpoint()
        # operator_seconds: the whole operator step, state in, training, artifact out (the bench's numerator).
        yield VersionRecord(
            version_id=version_id, model_id=model_id, seq=seq, window_start=start, window_end=end,
            artifact_uri=artifact, sha256=result.sha256, base_model=trainer.base_dir,
            config_version=cfg["version"], fresh_adapter=result.fresh_adapter,
            adapter=spec.adapter_config, trigger_policy=spec.trigger_policy,
            metrics=VersionMetrics(**result.metrics, operator_seconds=round(operator_seconds, 4)),
            lineage=Lineage(sample_ids=[s.sample_id for s in batch], offsets=offset_ranges(batch),
                            origins=origins or None, retracted=retracted or None, held_out=held_out or None),
            trigger=trigger, gate=gate, retention=spec.retention, granularity=granularity,
        ).to_json()

    def _gate(self, trainer, model_id: str, spec: FinetuneSpec, quality: QualityState, loss_after: float):
        """Score the new version (the trainer's live adapter) and the champion on the same eval sets."""
        evaluation, problems = spec.evaluation, []
        sets = {"recent": list(quality.recent), "retained": list(quality.retained)}
        if evaluation.eval_uri:
            try:
                sets["fixed"] = load_fixed(evaluation.eval_uri, evaluation.fixed_size,
                                             roots=eval_roots(self.settings.artifact_store))
            except (OSError, ValueError) as e:
                problems.append(f"fixed eval set {evaluation.eval_uri} unreadable ({type(e).__name__}: {e})")
        sets = {name: samples for name, samples in sets.items() if samples}
        scores = []
        for name, samples in sets.items():
            score = trainer.evaluate(model_id, spec.adapter_config, spec.training, samples)
            scores.append(SetScores(name, len(samples), EvalScore(exact_match=score["exact_match"], loss=score["loss"]),
                                    candidate_correct=score["correct"]))
        champion = quality.champion
        if champion is not None and scores and not problems:
            try:
                lora = self._champion_weights(champion)
            except Exception as e:  # noqa: BLE001 - a lost artifact refuses, visibly, rather than crash-loop the job
                problems.append(f"champion {champion['version_id']} unreadable from the store ({type(e).__name__}: {e})")
                return decide(evaluation, scores, champion, loss_after, problems)
            adapter = AdapterConfig.from_json(champion["adapter"])
            for s in scores:
                score = trainer.evaluate(model_id, adapter, spec.training, sets[s.name], lora)
                s.champion = EvalScore(exact_match=score["exact_match"], loss=score["loss"])
                s.champion_correct = score["correct"]
        return decide(evaluation, scores, champion, loss_after, problems)

    def _champion_weights(self, champion: dict) -> bytes:
        sha = champion["sha256"]
        if sha not in self.champion_files:
            if len(self.champion_files) >= 64:  # one per model is what is read again
                self.champion_files.pop(next(iter(self.champion_files)))
            self.champion_files[sha] = self.store.get(champion["artifact_uri"], sha)["adapter_model.safetensors"]
        return self.champion_files[sha]


def _kept(p: Pending) -> Kept:
    return Kept(p.sample_id, p.prompt, p.completion, p.weight, p.row_key)


def _loss_rule(champion: dict | None, loss_after: float) -> bool:
    """Without evaluation the registrar promotes by this rule; the trainer follows it to know the champion."""
    return champion is None or loss_after <= champion["loss_after"]
