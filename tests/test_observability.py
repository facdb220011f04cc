"""The job's metrics as Prometheus sees them: scraped over HTTP from the Flink
cluster's Prometheus reporter (flink-conf/config.yaml, ports 9249-9260) while the job runs,
and checked against what the test sent and what the versions topic holds.

records_in == valid + dead_lettered == samples + malformed + configs; dead_lettered == malformed;
windows_fired == the versions a read_committed reader sees (by version_id) == the versions the
registrar read (versions_in) == registered; each histogram counted once per window; the
gauges present and sane once every sample is trained.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from core.messages import VersionRecord
from streamtune.feedback import digit_samples, producer, send_config, send_samples
from streamtune.stack.flink import cancel_job, submit_detached
from streamtune.testing import job_args, job_report, job_topics, scrape_prometheus, spec, wait_for, wait_for_records
from streamtune.tinymodel import digit_pairs

pytestmark = pytest.mark.observability
REPO = Path(__file__).resolve().parents[1]
def total(values, operator: str, metric: str, maybe_zero: bool = False) -> float:
    """Summed over subtasks; a metric no subtask reports is missing, not zero (a counter shows
    up once incremented: `maybe_zero` for those that may never be)."""
    if maybe_zero and (operator, metric) not in values:
        return 0
    assert (operator, metric) in values, f"{operator}.{metric} not exported (have: {sorted(values)})"
    return sum(values[(operator, metric)])


MALFORMED = [
    b'{"model_id": "m", "broken',
    json.dumps({"model_id": "m", "sample_id": "x", "prompt": "p", "completion": "", "ts": 0}).encode(),
    json.dumps([1, 2, 3]).encode(),
    b"\x00\x01 binary",
]


def test_counters_gauges_and_histograms_scraped_from_prometheus_match_what_was_sent(stack_config, base_model,
                                                                                    tmp_path, unique):
    host, bootstrap = stack_config.host, stack_config.kafka_bootstrap
    topics = job_topics(bootstrap, f"test.obs-{unique}")
    models = [f"obs-a-{unique}", f"obs-b-{unique}"]
    job_name = f"observability-{unique}"
    # Event time one minute back, aligned to the 2 s windows: 3 windows of each model, each
    # at or above min_samples (a window below it would carry over and wait for more samples).
    t0 = (int(time.time() * 1000) // 10_000) * 10_000 - 60_000
    pairs = digit_pairs(36, seed=11)
    samples = (digit_samples(models[0], pairs[:24], t0, 250, id_prefix="a")      # 8 per window
               + digit_samples(models[1], pairs[24:], t0, 500, id_prefix="b"))  # 4 per window
    samples.sort(key=lambda s: s.ts)
    malformed = [MALFORMED[i % len(MALFORMED)] for i in range(20)]
    configs = 2

    submitted_ms = time.time() * 1000
    job = submit_detached(stack_config, REPO / "jobs" / "stream_finetune.py", job_args(
        topics, base_model, tmp_path / "adapters", "--bootstrap-server", bootstrap, "--checkpoint-interval-ms", "1000",
        "--idle-close-ms", "2000", "--unknown-model-grace-seconds", "60", "--job-name", job_name))
    try:
        for model_id in models:
            send_config(bootstrap, topics["configs"], spec(model_id, topics, min_samples=4, window_seconds=2), t0)
        # Samples read before their model's config wait for it (the grace period, 60 s here).
        # The malformed records between the samples, in event time among them.
        bad = producer(bootstrap)
        for i, payload in enumerate(malformed):
            bad.send(topics["feedback"], payload, timestamp_ms=t0 + i * 250)
        bad.flush()
        bad.close()
        send_samples(bootstrap, topics["feedback"], samples)
        sample_ids = {s.sample_id for s in samples}

        # A small backlog read at once: the windows close on the trainer's idle timer.
        def all_trained():
            versions = wait_for_records(bootstrap, topics["versions"], VersionRecord, 1, timeout=5)
            trained = {sid for v in versions for sid in v.lineage.sample_ids}
            return versions if trained >= sample_ids else None

        versions = wait_for(all_trained, 300, "every sample to reach a committed version")
        committed = {v.version_id for v in versions}

        expected_in = len(samples) + len(malformed) + configs
        last: dict = {}

        def settled():
            m = last["m"] = scrape_prometheus(host, job_name)
            get = lambda op, name: sum(m.get((op, name), [0]))  # noqa: E731
            return (get("validate", "records_in") == expected_in
                    and get("lora_trainer", "windows_fired") >= len(committed)
                    and get("register_versions", "registered") + get("register_versions", "already_registered")
                    >= len(committed)
                    and (("lora_trainer", "pending_samples") in m and get("lora_trainer", "pending_samples") == 0))

        try:
            wait_for(settled, 120, "the scraped metrics to reach what was sent", interval=2)
        except AssertionError:
            m = last.get("m", {})
            seen = {f"{op}.{name}": m.get((op, name), "missing") for op, name in (
                ("validate", "records_in"), ("lora_trainer", "windows_fired"), ("lora_trainer", "pending_samples"),
                ("register_versions", "versions_in"), ("register_versions", "registered"),
                ("register_versions", "already_registered"))}
            raise AssertionError(f"metrics never settled: expected records_in {expected_in} and {len(committed)} "
                                 f"versions fired, registered and nothing pending; last scrape: {seen}; "
                                 f"{job_report(stack_config, job)}") from None
        m = last["m"]

        # validate: every record counted once, valid or dead-lettered
        records_in, valid, dead = (total(m, "validate", n) for n in ("records_in", "valid", "dead_lettered"))
        assert records_in == valid + dead == expected_in
        assert dead == len(malformed)
        assert valid == len(samples) + configs

        # the trainer: one window fired per committed version, the registrar read each once
        fired = total(m, "lora_trainer", "windows_fired")
        assert fired == len(committed) == len(versions), "a version duplicated or missing on the versions topic"
        assert total(m, "lora_trainer", "samples_trained") == len(samples)
        assert total(m, "register_versions", "versions_in") == fired
        assert total(m, "register_versions", "registered") \
            + total(m, "register_versions", "already_registered", maybe_zero=True) == fired
        assert total(m, "register_versions", "integrity_failures", maybe_zero=True) == 0

        # histograms: one observation per window; sums and maxima in milliseconds
        for h in ("step_ms", "freshness_ms"):
            assert total(m, "lora_trainer", f"{h}_count") == fired, h
            assert total(m, "lora_trainer", f"{h}_sum") >= 0
        assert max(m[("lora_trainer", "step_ms_max")]) > 0
        # the newest sample of a window is at least (60 s - 6 s) older than its version
        assert max(m[("lora_trainer", "freshness_ms_max")]) >= 50_000
        assert total(m, "lora_trainer", "freshness_ms_sum") >= fired * 50_000

        # gauges: nothing pending once every sample is trained; the last step's loss and state
        assert total(m, "lora_trainer", "pending_samples") == 0
        assert max(m[("lora_trainer", "last_loss_micro")]) > 0
        losses = {round(v.metrics.loss_after * 1e6) for v in versions}
        assert set(m[("lora_trainer", "last_loss_micro")]) - {0} <= losses, "last_loss is some version's loss_after"
        assert max(m[("lora_trainer", "adapter_state_bytes")]) > 0
        assert total(m, "lora_trainer", "live_adapters") >= 1
        # start-up and liveness, wall-clock ms: opened after the submit, the last version after that
        opened, last_version = max(m[("lora_trainer", "opened_at_ms")]), max(m[("lora_trainer", "last_version_at_ms")])
        assert max(m[("lora_trainer", "open_ms")]) > 0
        assert submitted_ms < opened < last_version <= time.time() * 1000
    finally:
        cancel_job(stack_config, job)

