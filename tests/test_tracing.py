"""Tracing (operators/tracing.py) at the operator level, no Flink, no stack: a trainer step
produces one `streamtune.train_step` span naming the model, the version and its samples; off
by default; the console exporter is switched on by its environment variable.

The trainer is driven as tests/test_trainer_windows.py drives it (streamtune.testing).
"""

from __future__ import annotations

import json

import pytest

from core.messages import FeedbackSample, FinetuneSpec, VersionRecord
from operators import tracing
from pyflink.datastream import TimeDomain
from streamtune.testing import KeyedTimers, trainer_function
from streamtune.tinymodel import digit_pairs

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402


@pytest.fixture
def tracing_from_env(monkeypatch):
    """Tracing configured afresh from the environment the test sets; off again afterwards."""
    monkeypatch.delenv("STREAMTUNE_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("STREAMTUNE_TRACE_CONSOLE", raising=False)
    monkeypatch.setattr(tracing, "_tracer", tracing._UNSET)
    yield monkeypatch
    tracing.configure(None)


T0 = 1_777_000_000_000


def one_window(fn, model_id: str) -> list[VersionRecord]:
    """Eight samples of one model in one 1 s window; the watermark passes its end."""
    ctx = KeyedTimers(model_id, now_ms=10_000)
    spec = FinetuneSpec.model_validate({
        "model_id": model_id, "stream_source": "kafka://topic=feedback",
        "adapter_config": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "trigger_policy": {"min_samples_per_window": 4, "window_seconds": 1},
        "training": {"lr": 0.01, "micro_batch_size": 4}, "seed": 3})
    out = list(fn.process_element(("config", model_id, spec.to_json(), "configs", 0, 0, T0 - 1), ctx))
    for i, (prompt, completion) in enumerate(digit_pairs(8, seed=8)):
        ts = T0 + i * 100
        sample = FeedbackSample(model_id=model_id, sample_id=f"s{i}", prompt=prompt, completion=completion, ts=ts)
        record = ("sample", model_id, sample.to_json(), "feedback", 0, i, ts)
        out += fn.process_element(record, ctx)
    ctx.domain = TimeDomain.EVENT_TIME
    for t in ctx.due_event_timers(T0 + 10_000):
        out += fn.on_timer(t, ctx)
    return [VersionRecord.from_json(r) for r in out if isinstance(r, str)]


def test_a_training_step_is_one_span_with_model_version_and_samples(base, tmp_path, tracing_from_env):
    exporter = InMemorySpanExporter()
    tracing.configure(exporter)
    fn = trainer_function(base, tmp_path)
    versions = one_window(fn, "traced")
    assert len(versions) == 1
    spans = [s for s in exporter.get_finished_spans() if s.name == "streamtune.train_step"]
    assert len(spans) == 1
    attrs = dict(spans[0].attributes)
    assert attrs["model_id"] == "traced"
    assert attrs["version_id"] == versions[0].version_id
    assert attrs["samples"] == 8 == len(versions[0].lineage.sample_ids)
    assert attrs["trigger"] == "window"
    assert attrs["loss_after"] == pytest.approx(versions[0].metrics.loss_after)
    assert spans[0].end_time > spans[0].start_time
    # The step's metrics: one observation per version, the gauges' in-memory side.
    assert fn.counters.counts["step_ms_count"] == fn.counters.counts["freshness_ms_count"] == 1
    assert fn.last_step["loss_after"] == versions[0].metrics.loss_after and fn.last_step["state_bytes"] > 0
    assert fn.pending.sizes == {}  # the window took every pending sample


def test_tracing_is_off_by_default(base, tmp_path, tracing_from_env, capsys):
    fn = trainer_function(base, tmp_path)
    assert len(one_window(fn, "untraced")) == 1
    assert tracing._tracer is None
    assert "streamtune.train_step" not in capsys.readouterr().out


def test_the_console_exporter_prints_the_span_when_its_variable_is_set(base, tmp_path, tracing_from_env, capsys):
    tracing_from_env.setenv("STREAMTUNE_TRACE_CONSOLE", "1")
    fn = trainer_function(base, tmp_path)
    version = one_window(fn, "printed")[0]
    printed = capsys.readouterr().out
    start = printed.index("{")
    span = json.JSONDecoder().raw_decode(printed[start:])[0]
    assert span["name"] == "streamtune.train_step"
    assert span["attributes"]["version_id"] == version.version_id and span["attributes"]["samples"] == 8
