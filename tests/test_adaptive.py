"""Adaptive update granularity and SLO arbitration at the operator level (no Flink, no stack).

The trainer's process_element and on_timer are driven directly (streamtune.testing), as in
tests/test_trainer_windows.py: event-time timers fire when the watermark passes them.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import threading

import pytest

from core.messages import FeedbackSample, FinetuneSpec, VersionRecord
from core.errors import InvalidMessage
from operators.lora_trainer import LoraTrainer
from pyflink.datastream import TimeDomain
from streamtune.testing import KeyedTimers, trainer_function

pytestmark = pytest.mark.adaptive
T0 = 1_777_000_000_000


def spec_for(model_id: str, **policy) -> FinetuneSpec:
    return FinetuneSpec.model_validate({
        "model_id": model_id, "stream_source": "kafka://topic=feedback",
        "adapter_config": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "trigger_policy": {"min_samples_per_window": 8, "window_seconds": 1, "max_samples_per_step": 32, **policy},
        "training": {"lr": 0.01, "micro_batch_size": 2}, "seed": 5})


ADAPTIVE = {"mode": "adaptive", "adaptive": {"min_samples_low": 4, "min_samples_high": 32}}


def records(model_id: str, pairs: list[tuple[str, str]], per_window: int = 16, start: int = 0) -> list[tuple]:
    """The job's input tuples, one partition, `per_window` samples per 1 s window."""
    out = []
    for i, (prompt, completion) in enumerate(pairs, start):
        ts = T0 + i * 1000 // per_window
        sample = FeedbackSample(model_id=model_id, sample_id=f"s{i}", prompt=prompt, completion=completion, ts=ts)
        out.append(("sample", model_id, sample.to_json(), "feedback", 0, i, ts))
    return out


def run(fn, ctx: KeyedTimers, spec: FinetuneSpec, stream: list[tuple]) -> list[VersionRecord]:
    out = list(fn.process_element(("config", spec.model_id, spec.to_json(), "configs", 0, 0, T0 - 1), ctx))
    for record in stream:
        out += fn.process_element(record, ctx)
        ctx.domain = TimeDomain.EVENT_TIME
        for t in ctx.due_event_timers(record[6] - 1):
            out += fn.on_timer(t, ctx)
    return [VersionRecord.from_json(r) for r in out if isinstance(r, str)]


def steady(n: int) -> list[tuple[str, str]]:
    """One sample over and over: every micro-batch has the same gradient (no noise)."""
    return [("x=1234;y=", "2345")] * n


def noisy(n: int, seed: int) -> list[tuple[str, str]]:
    """Random prompts and random targets of random lengths: gradients that disagree."""
    rng = random.Random(seed)
    text = lambda k: "".join(rng.choice("abcdefghij0123456789 ;=") for _ in range(k))  # noqa: E731
    return [(text(rng.randrange(3, 12)), text(rng.randrange(1, 10))) for _ in range(n)]


def step_sizes(versions: list[VersionRecord], ids: range) -> list[int]:
    """The sizes of the steps whose samples all lie in `ids` (not the first: it has no statistic)."""
    return [v.granularity.size for v in versions[1:]
            if all(int(sid[1:]) in ids for sid in v.lineage.sample_ids)]


def test_adaptive_steps_grow_when_the_stream_turns_noisy(base, tmp_path):
    spec = spec_for("ada", **ADAPTIVE)
    stream = records("ada", steady(64) + noisy(160, seed=3))
    versions = run(trainer_function(base, tmp_path), KeyedTimers("ada"), spec, stream)
    low, high = 4, 32
    first = versions[0].granularity
    assert (first.rule, first.size, first.statistic) == ("initial", 8, None)
    for v in versions:
        g = v.granularity
        assert g.size == len(v.lineage.sample_ids) and g.bounds == (low, high)  # each step trained the size it names
        if g.rule == "noise_scale":  # the size is the statistic it names, within the bounds
            assert g.size == (high if g.statistic is None else min(high, max(low, round(g.statistic))))
            assert f"{g.size} samples" in g.reason
    calm, rough = step_sizes(versions, range(0, 64)), step_sizes(versions, range(64, 224))
    assert len(calm) >= 8 and len(rough) >= 3, [v.granularity for v in versions]
    # One sample over and over: micro-batches agree, small steps; random targets: larger ones.
    assert sorted(calm)[len(calm) // 2] == low, calm
    assert min(rough) > 2 * low and sum(rough) / len(rough) > 4 * sum(calm) / len(calm), (calm, rough)
    # Measured on the same stream, the fixed policy never moves: every 1 s window (16 samples) is one step.
    LoraTrainer.for_base(base)._live.clear()
    fixed = run(trainer_function(base, tmp_path / "fixed"), KeyedTimers("ada"), spec_for("ada"), stream)
    assert {len(v.lineage.sample_ids) for v in fixed} == {16} and all(v.granularity is None for v in fixed)


def test_a_replay_of_an_adaptive_stream_makes_the_same_versions(base, tmp_path):
    """The sizes come from statistics of the steps before: a replay cuts and trains the same."""
    stream = records("again", steady(24) + noisy(40, seed=4))
    runs = []
    for name in ("first", "replay"):
        LoraTrainer.for_base(base)._live.clear()  # each run its own worker
        versions = run(trainer_function(base, tmp_path / name), KeyedTimers("again"), spec_for("again", **ADAPTIVE),
                       stream)
        runs.append([(v.version_id, v.sha256, v.granularity) for v in versions])
    assert runs[0] == runs[1] and len(runs[0]) >= 4


def test_a_loss_shift_drops_to_the_smallest_step():
    """Pure core: a window whose loss jumps shift_z deviations above the running mean."""
    from core.messages import AdaptiveGranularity
    from operators.granularity import GranularityState, NoiseSample, next_state

    bounds = AdaptiveGranularity(min_samples_low=4, min_samples_high=64, warmup_steps=3)
    noisy_sample = NoiseSample(micro_batch_sq=5.0, step_sq=1.5, micro_batch_size=4, step_size=32)
    state = GranularityState.initial(16)
    for loss in (2.0, 2.1, 1.9, 2.0, 2.05):
        state = next_state(state, bounds, noisy_sample, loss)
    assert state.rule == "noise_scale" and state.size > bounds.min_samples_low
    shifted = next_state(state, bounds, noisy_sample, 4.0)
    assert (shifted.rule, shifted.size, shifted.threshold) == ("loss_shift", 4, bounds.shift_z)
    assert shifted.statistic > bounds.shift_z and shifted.signal is None  # the noise means restart
    # The same jump before warmup_steps is no shift: there is no running variance yet.
    early = next_state(next_state(GranularityState.initial(16), bounds, noisy_sample, 2.0), bounds, noisy_sample, 4.0)
    assert early.rule == "noise_scale"


@pytest.mark.parametrize("policy, message", [
    ({"mode": "adaptive"}, "mode adaptive needs trigger_policy.adaptive"),
    ({"adaptive": {"min_samples_low": 4, "min_samples_high": 32}}, "set mode: adaptive or drop it"),
    ({"mode": "adaptive", "adaptive": {"min_samples_low": 16, "min_samples_high": 32}},
     "the first step's size, must lie within adaptive [16, 32]"),
    ({"mode": "adaptive", "adaptive": {"min_samples_low": 4, "min_samples_high": 64}},
     "min_samples_high (64) must be <= max_samples_per_step (32)"),
    ({"mode": "adaptive", "adaptive": {"min_samples_low": 2, "min_samples_high": 32}},
     "must be at least 2 x training.micro_batch_size (2)"),
    ({"mode": "sometimes"}, "mode: Input should be 'fixed' or 'adaptive'"),
])
def test_bad_adaptive_policies_are_refused_with_the_reason(policy, message):
    with pytest.raises(InvalidMessage, match=re.escape(message)):
        FinetuneSpec.from_json(spec_for("bad").model_copy(
            update={"trigger_policy": None}).model_dump_json().replace(
            '"trigger_policy":null', '"trigger_policy":' + json.dumps(
                {"min_samples_per_window": 8, "window_seconds": 1, "max_samples_per_step": 32, **policy})))


def test_the_fixed_mode_keeps_the_spec_hash_of_older_specs():
    """A spec without mode hashes as before the field existed (its config version stays)."""
    spec = spec_for("hash")
    explicit = spec.model_copy(update={"trigger_policy": spec.trigger_policy.model_copy(update={"mode": "fixed"})})
    assert '"mode"' not in spec.to_json() and '"adaptive"' not in spec.to_json()
    assert explicit.spec_hash() != spec.spec_hash()  # a field that is set counts
    assert spec_for("hash", **ADAPTIVE).spec_hash() != spec.spec_hash()


# ------------------------------------------------------------------------ SLO arbitration

class Clock:
    """The serving side's clock, moved by the test: which requests are inside the SLO window."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def headroom():
    """A real headroom endpoint (streamtune/serve/headroom.py) on a loopback socket."""
    from streamtune.serve.headroom import HeadroomServer, SloHeadroom

    clock = Clock()
    slo = SloHeadroom(target_p99_ms=100, window_s=5, clock=clock)
    server = HeadroomServer(slo).start()
    yield slo, clock, server
    server.close()


def arbitrated(base, store, url: str, share: float, cpu_priority: str = "normal"):
    """A trainer arbitrating against `url`. At cpu_priority "idle" the thread that trains keeps
    SCHED_IDLE for good: run it in a thread of its own (in_thread), never pytest's."""
    from operators.arbiter import ArbiterSettings

    fn = trainer_function(base, store, arbitration=ArbiterSettings(url, min_training_share=share, poll_s=0.01,
                                                                   cpu_priority=cpu_priority))
    fn.start_arbiter()
    return fn


def in_thread(work):
    """work() in a new thread: (its result, that thread's scheduling policy when it ended)."""
    out: dict = {}

    def target():
        out["result"] = work()
        out["policy"] = os.sched_getscheduler(0)

    worker = threading.Thread(target=target)
    worker.start()
    worker.join(timeout=600)
    assert "policy" in out, "the work failed or did not finish (see the thread's exception above)"
    return out["result"], out["policy"]


def adapter_digests(fn, versions: list[VersionRecord]) -> list[str]:
    """sha256 of each version's adapter weights, as the artifact store holds them."""
    return [hashlib.sha256(fn.store.get(v.artifact_uri, v.sha256)["adapter_model.safetensors"]).hexdigest()
            for v in versions]


def test_arbitration_changes_when_a_version_comes_never_what_it_is(base, tmp_path, headroom):
    slo, _, server = headroom
    slo.observe(0.5)  # p99 five times the target: the trainer yields whenever its share allows
    stream = records("same", steady(16) + noisy(48, seed=5))
    results = {}
    for name in ("alone", "arbitrated"):
        LoraTrainer.for_base(base)._live.clear()  # each run its own worker
        # Arbitrated as deployed on a CPU: pauses, and the training thread at idle priority.
        fn = arbitrated(base, tmp_path / name, server.url, share=0.5, cpu_priority="idle") \
            if name == "arbitrated" else trainer_function(base, tmp_path / name)
        versions, policy = in_thread(lambda: run(fn, KeyedTimers("same"), spec_for("same", **ADAPTIVE), stream))
        results[name] = ([(v.version_id, v.sha256, v.granularity) for v in versions], adapter_digests(fn, versions))
        if name == "arbitrated":
            assert fn.arbiter.yields >= len(versions) and fn.arbiter.yielded_s > 0  # it did yield, every step
            assert fn.arbiter.last_headroom == pytest.approx(-4.0)
            assert policy == os.SCHED_IDLE and fn.background, "the arbitrated steps ran at normal priority"
        else:
            assert policy == os.SCHED_OTHER and not fn.background
    assert len(results["alone"][0]) >= 4
    assert results["arbitrated"] == results["alone"]


def test_a_normal_cpu_priority_leaves_the_training_thread_as_it_was(base, tmp_path, headroom):
    _, _, server = headroom  # no request observed: full headroom, nothing to wait for
    fn = arbitrated(base, tmp_path, server.url, share=0.5, cpu_priority="normal")
    versions, policy = in_thread(lambda: run(fn, KeyedTimers("normal"), spec_for("normal"),
                                             records("normal", steady(18))))
    assert len(versions) == 1 and policy == os.SCHED_OTHER and not fn.background
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # nor pytest's own thread


def test_the_trainer_yields_while_the_slo_is_missed_and_resumes_when_it_is_met(base, tmp_path, headroom):
    slo, clock, server = headroom
    slo.observe(0.3)  # a slow request: headroom -2
    fn = arbitrated(base, tmp_path, server.url, share=1e-6)  # the share alone would let it wait for hours
    out: list = []
    worker = threading.Thread(target=lambda: out.extend(
        run(fn, KeyedTimers("yield"), spec_for("yield"), records("yield", steady(18)))))
    worker.start()
    assert fn.arbiter.waiting.wait(timeout=120), "the trainer never yielded"
    assert worker.is_alive() and out == [] and fn.arbiter.last_headroom == pytest.approx(-2.0)
    clock.now += 6  # the slow request leaves the SLO window: the headroom is back
    worker.join(timeout=120)
    assert not worker.is_alive() and len(out) == 1 and len(out[0].lineage.sample_ids) == 16
    assert fn.arbiter.yields == 1 and fn.arbiter.yielded_s > 0 and fn.arbiter.last_headroom == 1.0
    assert fn.arbiter.headroom_failures == 0


def test_training_keeps_its_share_however_long_the_slo_is_missed(base, tmp_path, headroom):
    slo, _, server = headroom
    slo.observe(1.0)
    fn = arbitrated(base, tmp_path, server.url, share=0.5)
    versions = run(fn, KeyedTimers("share"), spec_for("share"), records("share", steady(34)))
    assert len(versions) == 2 and fn.arbiter.yielded_s > 0  # both windows trained, with yields between
    wall = sum(v.metrics.step_seconds for v in versions)
    # Yielded at most half of the steps' wall time, give or take one poll per step.
    assert fn.arbiter.yielded_s <= 0.5 * wall + 2 * 0.01 * len(versions) + 0.05, (fn.arbiter.yielded_s, wall)


def test_an_unreachable_headroom_endpoint_lets_training_run(base, tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/headroom"
    fn = arbitrated(base, tmp_path, url, share=0.1)
    versions = run(fn, KeyedTimers("down"), spec_for("down"), records("down", steady(18)))
    # A failed read is reused for a poll, as a good one is: at least one, none hammering the port.
    assert len(versions) == 1 and fn.arbiter.yields == 0 and fn.arbiter.headroom_failures >= 1


def test_a_headroom_reading_is_reused_for_one_poll(headroom):
    """The trainer asks between every micro-batch; the serving process answers at most once a
    poll (each answer is CPU time the SLO's requests need)."""
    from operators.arbiter import HeadroomReader

    slo, _, server = headroom
    slo.observe(0.3)
    now = [0.0]
    reader = HeadroomReader(server.url, timeout_s=1.0, max_age_s=0.05, clock=lambda: now[0])
    readings = []
    for _ in range(100):  # 100 asks within 50 ms: one request to the server
        readings.append(reader.read())
        now[0] += 0.0004
    assert reader.reads == 1 and readings == [pytest.approx(-2.0)] * 100
    now[0] += 0.05
    assert reader.read() == pytest.approx(-2.0) and reader.reads == 2
    fresh = HeadroomReader(server.url, timeout_s=1.0)  # no max age: every ask is a request
    for _ in range(3):
        fresh.read()
    assert fresh.reads == 3


def test_the_server_times_its_inference_requests_into_the_headroom():
    """HeadroomMiddleware on an ASGI app: /v1/ requests count until their last byte, others not."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, StreamingResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from streamtune.serve.headroom import HeadroomMiddleware, SloHeadroom

    async def slow_stream(request):
        async def chunks():
            for _ in range(3):
                await asyncio.sleep(0.05)
                yield b"x"
        return StreamingResponse(chunks())

    async def fast(request):
        return PlainTextResponse("ok")

    slo = SloHeadroom(target_p99_ms=100, window_s=60)
    app = Starlette(routes=[Route("/v1/stream", slow_stream), Route("/healthz", fast)])
    app.add_middleware(HeadroomMiddleware, slo=slo)
    with TestClient(app) as client:
        assert client.get("/healthz").text == "ok"
        assert slo.snapshot()["requests"] == 0  # not an inference request
        assert client.get("/v1/stream").content == b"xxx"
    snapshot = slo.snapshot()
    # The streamed answer counted until its last chunk: three 50 ms waits, past the 100 ms target.
    assert snapshot["requests"] == 1 and snapshot["p99_ms"] >= 150 and snapshot["headroom"] < -0.4
