"""The trainer's windows at the operator level (no Flink, no stack): a window holds the same
samples however the partitions interleave, a quiet model's windows close on the idle timer,
and adapters evicted from a worker's bounded cache train on to the same bytes.

The operator's process_element and on_timer are driven directly, timers fired as Flink fires
them (streamtune.testing.KeyedTimers): event-time timers when the watermark passes them.
"""

from __future__ import annotations


from core.messages import AdapterConfig, FeedbackSample, FinetuneSpec, TrainingConfig, VersionRecord
from operators.lora_trainer import LoraTrainer
from operators.quality import Kept
from pyflink.datastream import TimeDomain
from streamtune.testing import KeyedTimers, trainer_function
from streamtune.tinymodel import digit_pairs

T0 = 1_777_000_000_000
PARTITIONS = 4


def window_spec(model_id: str) -> FinetuneSpec:
    return FinetuneSpec.model_validate({
        "model_id": model_id, "stream_source": "kafka://topic=feedback",
        "adapter_config": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "trigger_policy": {"min_samples_per_window": 4, "window_seconds": 1, "max_samples_per_step": 6},
        "training": {"lr": 0.01, "micro_batch_size": 4}, "seed": 3})


def partitioned_records(model_id: str, n: int, span_ms: int = 3000) -> list[list[tuple]]:
    """The model's samples over `span_ms` of event time, dealt round-robin over 4 partitions:
    each partition's records (the job's input tuples), in offset order."""
    pairs = digit_pairs(n, seed=8)
    parts: list[list[tuple]] = [[] for _ in range(PARTITIONS)]
    for i, (prompt, completion) in enumerate(pairs):
        ts = T0 + i * span_ms // n
        sample = FeedbackSample(model_id=model_id, sample_id=f"s{i}", prompt=prompt, completion=completion, ts=ts)
        part = parts[i % PARTITIONS]
        part.append(("sample", model_id, sample.to_json(), "feedback", i % PARTITIONS, len(part), ts))
    return parts


def run(fn, ctx: KeyedTimers, spec: FinetuneSpec, arrival: list[tuple]) -> list[VersionRecord]:
    """Feed the records in `arrival` order; after each, the watermark moves to the minimum over
    partitions of the newest timestamp each has delivered (Flink's per-partition watermarks)."""
    out = list(fn.process_element(("config", spec.model_id, spec.to_json(), "configs", 0, 0, T0 - 1), ctx))
    newest = [T0 - 1] * PARTITIONS
    for record in arrival:
        out += fn.process_element(record, ctx)
        newest[record[4]] = record[6]
        ctx.domain = TimeDomain.EVENT_TIME
        for t in ctx.due_event_timers(min(newest) - 1):
            out += fn.on_timer(t, ctx)
    return [VersionRecord.from_json(r) for r in out if isinstance(r, str)]


def interleavings(parts: list[list[tuple]]) -> dict[str, list[tuple]]:
    """Round-robin (the partitions in step), and each partition read far ahead of the others."""
    robin = [r for group in zip(*parts) for r in group]
    ahead = [r for i in range(0, len(parts[0]), 8) for part in parts for r in part[i:i + 8]]
    return {"round_robin": robin, "read_ahead": ahead}


def fingerprint(versions: list[VersionRecord]) -> list[tuple]:
    return [(v.version_id, v.sha256, tuple(v.lineage.sample_ids), v.trigger) for v in versions]


def test_a_window_holds_the_same_samples_however_the_partitions_interleave(base, tmp_path):
    parts = partitioned_records("inter", 48)
    runs = {}
    for name, arrival in interleavings(parts).items():
        LoraTrainer.for_base(base)._live.clear()  # each run its own worker
        runs[name] = run(trainer_function(base, tmp_path / name), KeyedTimers("inter"), window_spec("inter"), arrival)
    assert fingerprint(runs["round_robin"]) == fingerprint(runs["read_ahead"])
    versions = runs["round_robin"]
    # Windows 0 and 1 closed (16 samples each: steps of 6, 6, 4); window 2 waits for the watermark.
    assert [len(v.lineage.sample_ids) for v in versions] == [6, 6, 4, 6, 6, 4]
    assert [v.window_end for v in versions] == [T0 + 1000] * 3 + [T0 + 2000] * 3
    assert [v.trigger for v in versions] == ["max_samples"] * 6


def test_an_earlier_window_arriving_after_a_later_one_still_closes_on_its_own(base, tmp_path):
    """A fast partition delivers a window-1 sample before a slow one delivers window 0's (on a
    restore's backlog, or once a partition was idle): window 0 still closes alone when the
    watermark passes it, as it does when the samples come in order. Seen at parallelism 4 after
    a TaskManager kill: window 0 merged into window 1, unlike parallelism 1."""
    spec = window_spec("order")  # windows of 1 s, at least 4 samples
    fn, ctx = trainer_function(base, tmp_path), KeyedTimers("order")
    out = list(fn.process_element(("config", "order", spec.to_json(), "configs", 0, 0, T0 - 1), ctx))
    pairs = digit_pairs(8, seed=9)

    def record(i: int, ts: int, partition: int) -> tuple:
        prompt, completion = pairs[i]
        body = FeedbackSample(model_id="order", sample_id=f"s{i}", prompt=prompt, completion=completion, ts=ts)
        return ("sample", "order", body.to_json(), "feedback", partition, i, ts)

    def feed(records: list[tuple], watermark: int) -> None:
        for r in records:
            out.extend(fn.process_element(r, ctx))
        ctx.domain = TimeDomain.EVENT_TIME
        for t in ctx.due_event_timers(watermark):
            out.extend(fn.on_timer(t, ctx))

    feed([record(0, T0 + 1500, 0)], T0 - 1)                                # window 1, from the fast partition
    feed([record(i, T0 + 100 * i, 1) for i in range(1, 5)], T0 - 1)        # window 0, from the slow one
    feed([record(i, T0 + 1500 + 10 * i, 0) for i in range(5, 8)], T0 + 1000)  # the watermark passes window 0
    versions = [VersionRecord.from_json(r) for r in out if isinstance(r, str)]
    assert [(v.window_end, sorted(v.lineage.sample_ids)) for v in versions] == [(T0 + 1000, ["s1", "s2", "s3", "s4"])]


def test_a_quiet_models_windows_close_on_the_idle_timer(base, tmp_path):
    fn, ctx = trainer_function(base, tmp_path, idle_close_ms=5000), KeyedTimers("quiet", now_ms=10_000)
    spec = window_spec("quiet")
    records = [r for part in partitioned_records("quiet", 12, span_ms=900) for r in part]  # one window
    assert run(fn, ctx, spec, records) == []  # the watermark held below the first window's end
    ctx.domain = TimeDomain.PROCESSING_TIME
    ctx.now_ms += 1000 + 5000 - 1  # window_seconds + idle_close_ms after the last sample: not yet
    assert [r for t in ctx.due_processing_timers() for r in fn.on_timer(t, ctx)] == []
    ctx.now_ms += 1
    out = [VersionRecord.from_json(r) for t in ctx.due_processing_timers() for r in fn.on_timer(t, ctx)]
    assert sorted(i for v in out for i in v.lineage.sample_ids) == sorted(f"s{i}" for i in range(12))
    assert fn.counters.counts["windows_closed_idle"] == 1 and fn.pending.value() == []


def test_an_idle_close_that_trains_nothing_leaves_the_window_open(base, tmp_path):
    """One sample (below min_samples) when the model goes quiet: the idle close carries it and
    keeps its window open, so the window's later samples join it, not a later window."""
    fn, ctx = trainer_function(base, tmp_path, idle_close_ms=5000), KeyedTimers("late", now_ms=10_000)
    spec = window_spec("late")
    first, *rest = [r for part in partitioned_records("late", 6, span_ms=900) for r in part]
    first = first[:4] + (0,) + first[5:]  # all on partition 0, in timestamp order
    assert run(fn, ctx, spec, [first]) == []
    ctx.domain = TimeDomain.PROCESSING_TIME
    ctx.now_ms += 1000 + 5000
    assert [r for t in ctx.due_processing_timers() for r in fn.on_timer(t, ctx)] == []
    assert fn.counters.counts["windows_closed_idle"] == 1 and len(fn.pending.value()) == 1
    later = sorted(rest, key=lambda r: r[6])
    moved = FeedbackSample(model_id="late", sample_id="next", prompt="x=1;y=", completion="1", ts=T0 + 1500)
    mover = ("sample", "late", moved.to_json(), "feedback", 0, 99, T0 + 1500)  # the next window's: the watermark moves
    out = []
    for record in later + [mover]:
        out += fn.process_element(record[:4] + (0,) + record[5:], ctx)
        ctx.domain = TimeDomain.EVENT_TIME
        for t in ctx.due_event_timers(record[6] - 1):
            out += fn.on_timer(t, ctx)
    versions = [VersionRecord.from_json(r) for r in out if isinstance(r, str)]
    assert [(v.window_end, sorted(v.lineage.sample_ids)) for v in versions] == [
        (T0 + 1000, [f"s{i}" for i in range(6)])]


def test_a_sample_arriving_rearms_the_idle_timer(base, tmp_path):
    fn, ctx = trainer_function(base, tmp_path, idle_close_ms=5000), KeyedTimers("busy", now_ms=10_000)
    spec = window_spec("busy")
    first, second = partitioned_records("busy", 8, span_ms=900)[:2]
    run(fn, ctx, spec, first)
    ctx.now_ms += 4000
    list(fn.process_element(second[0], ctx))  # the model is not quiet: the deadline moves
    ctx.domain = TimeDomain.PROCESSING_TIME
    ctx.now_ms += 2500  # past the first deadline, not the second
    assert [r for t in ctx.due_processing_timers() for r in fn.on_timer(t, ctx)] == []
    assert fn.counters.counts["windows_closed_idle"] == 0 and len(fn.pending.value()) == 3


def test_an_idle_timer_lost_in_a_restore_is_armed_again_by_the_next_sample(base, tmp_path):
    """A restore that brings back the idle timer's state but not the timer (seen with PyFlink
    2.0.2): the model's next sample arms it again, and the quiet model's window still closes."""
    from operators.finetune_function import FinetuneFunction

    fn, ctx = trainer_function(base, tmp_path, idle_close_ms=5000), KeyedTimers("lost", now_ms=10_000)
    records = [r for part in partitioned_records("lost", 12, span_ms=900) for r in part]  # one window
    assert run(fn, ctx, window_spec("lost"), records[:8]) == []
    assert fn.idle.value() and ctx.processing_timers, "the idle timer armed"
    restored = trainer_function(base, tmp_path, idle_close_ms=5000)
    for attribute in FinetuneFunction.KEYED_STATE:  # the checkpointed state, and no timer
        setattr(restored, attribute, getattr(fn, attribute))
    restored.opened_at, after = 20_000, KeyedTimers("lost", now_ms=20_000)
    out = [r for record in records[8:] for r in restored.process_element(record, after)]
    assert after.processing_timers, "the next sample armed the idle timer again"
    after.domain, after.now_ms = TimeDomain.PROCESSING_TIME, 20_000 + 1000 + 5000
    out += [r for t in after.due_processing_timers() for r in restored.on_timer(t, after)]
    versions = [VersionRecord.from_json(r) for r in out if isinstance(r, str)]
    assert sorted(i for v in versions for i in v.lineage.sample_ids) == sorted(f"s{i}" for i in range(12))


def test_adapters_evicted_from_a_bounded_worker_train_on_to_the_same_bytes(base):
    adapter = AdapterConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    training = TrainingConfig(lr=0.01, micro_batch_size=4)
    pairs = digit_pairs(6 * 3 * 4, seed=12)
    windows = {f"lru{m}": [[Kept(f"{m}-{w}-{i}", *pairs[(m * 3 + w) * 4 + i], 1.0, "") for i in range(4)]
                           for w in range(3)] for m in range(6)}

    def train_all(max_live: int) -> tuple[list[str], int]:
        trainer = LoraTrainer.for_base(base, max_live_adapters=max_live)
        trainer._evict(keep=0)
        states, shas, most = {}, [], 0
        for w in range(3):
            for model_id, steps in windows.items():  # round-robin: every model evicted between its steps
                result = trainer.step(model_id, adapter, training, states.get(model_id), steps[w], seed=w)
                states[model_id] = result.state
                shas.append(result.sha256)
                most = max(most, trainer.live_adapters()["adapters"])
        return shas, most

    bounded, most_bounded = train_all(max_live=2)
    unbounded, most_unbounded = train_all(max_live=64)
    assert bounded == unbounded
    assert most_bounded == 2 and most_unbounded == 6
    LoraTrainer.for_base(base, max_live_adapters=64)


def test_a_windows_timer_is_registered_once_and_again_when_a_late_sample_or_a_restore_needs_it(base, tmp_path):
    """Each timer registration is a message to the JVM, so a window's timer is registered by
    its first sample only; a sample of a window whose timer has fired, and the first sample a
    restored worker sees, register it again (the timer may be gone). The late one is counted
    (samples_late)."""
    spec = window_spec("once")  # windows of 1 s, at least 4 samples
    fn, ctx = trainer_function(base, tmp_path), KeyedTimers("once")
    out = list(fn.process_element(("config", "once", spec.to_json(), "configs", 0, 0, T0 - 1), ctx))
    pairs = digit_pairs(8, seed=4)

    def record(i: int, ts: int) -> tuple:
        prompt, completion = pairs[i]
        body = FeedbackSample(model_id="once", sample_id=f"s{i}", prompt=prompt, completion=completion, ts=ts)
        return ("sample", "once", body.to_json(), "feedback", 0, i, ts)

    for i in range(4):
        out += fn.process_element(record(i, T0 + 100 * i), ctx)
    assert ctx.event_registrations == [T0 + 1000]
    ctx.domain = TimeDomain.EVENT_TIME
    for t in ctx.due_event_timers(T0 + 1000):
        out += fn.on_timer(t, ctx)
    assert [sorted(v.lineage.sample_ids) for v in map(VersionRecord.from_json, out)] == [["s0", "s1", "s2", "s3"]]
    assert fn.counters.counts["samples_late"] == 0
    out += fn.process_element(record(4, T0 + 500), ctx)  # late: its window's timer has fired
    assert ctx.event_registrations == [T0 + 1000, T0 + 1000]
    assert fn.counters.counts["samples_late"] == 1  # counted: it trains with a later window

    restored = trainer_function(base, tmp_path)
    for attribute in restored.KEYED_STATE:
        setattr(restored, attribute, getattr(fn, attribute))
    for i in (5, 6):
        out += restored.process_element(record(i, T0 + 1100 + i), ctx)
    assert ctx.event_registrations == [T0 + 1000, T0 + 1000, T0 + 2000]
