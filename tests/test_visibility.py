"""Exactly-once, shown so that it can fail: a version record is invisible to `read_committed`
readers until the checkpoint holding its training state completes, and visible right after.

The same test against the at-least-once sink configuration must report violations: that
is what proves it tells the two apart. Times come from two consumers polling the versions
topic (read_uncommitted sees a record when it is written) and from Flink's REST checkpoint
history.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests

from core.messages import VersionRecord
from streamtune.feedback import digit_samples, send_config, send_samples
from streamtune.stack.flink import cancel_job, job_state, submit_detached
from streamtune.testing import job_args, job_topics, spec
from streamtune.tinymodel import digit_pairs

pytestmark = [pytest.mark.guarantees, pytest.mark.exactly_once]
REPO = Path(__file__).resolve().parents[1]
CHECKPOINT_MS = 8000
POLL_SLACK_MS = 300     # how late a poller can see a record it could already have seen
VISIBLE_WITHIN_MS = 3000


def visibility_violations(written: dict[str, int], visible: dict[str, int],
                          completed: list[int]) -> list[str]:
    """Each version must turn visible no earlier than the first checkpoint completing after it
    was written, and at most VISIBLE_WITHIN_MS after it.

    >>> visibility_violations({"v": 1000}, {"v": 8100}, [4000, 9000])
    ['v: visible at 8100, 4100 ms after checkpoint completion at 4000 (limit 3000)']
    >>> visibility_violations({"v": 1000}, {"v": 4500}, [4000])
    []
    >>> visibility_violations({"v": 1000}, {"v": 1200}, [4000])
    ['v: visible at 1200, before the checkpoint holding it completed at 4000']
    """
    problems = []
    for version_id, written_at in written.items():
        seen = visible.get(version_id)
        after = [c for c in completed if c >= written_at - POLL_SLACK_MS]
        if seen is None or not after:
            problems.append(f"{version_id}: never committed by a completed checkpoint")
            continue
        if seen < after[0] - POLL_SLACK_MS:
            problems.append(f"{version_id}: visible at {seen}, before the checkpoint holding it completed at {after[0]}")
        elif seen > after[0] + VISIBLE_WITHIN_MS:
            problems.append(f"{version_id}: visible at {seen}, {seen - after[0]} ms after checkpoint completion at "
                            f"{after[0]} (limit {VISIBLE_WITHIN_MS})")
    return problems


def first_seen(bootstrap: str, topic: str, isolation: str, seen: dict[str, int]) -> None:
    """Poll once more; note when each version_id was first readable at this isolation level."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = first_seen.consumers.get((topic, isolation))
    if consumer is None:
        from connectors.kafka import seek_to_first

        consumer = KafkaConsumer(bootstrap_servers=bootstrap, isolation_level=isolation, enable_auto_commit=False,
                                 fetch_max_wait_ms=20, auto_offset_reset="earliest")
        consumer.assign([TopicPartition(topic, 0)])
        seek_to_first(consumer, [TopicPartition(topic, 0)])
        first_seen.consumers[(topic, isolation)] = consumer
    now = int(time.time() * 1000)
    for records in consumer.poll(timeout_ms=50).values():
        for r in records:
            seen.setdefault(VersionRecord.from_json(r.value).version_id, now)


first_seen.consumers = {}


def completed_checkpoints(stack_config, job_id: str, after: int, timeout: float) -> list[int]:
    """Completion times (ms) of the job's checkpoints, once one completed after `after`."""
    deadline = time.monotonic() + timeout
    while True:
        history = requests.get(f"{stack_config.flink_rest_url}/jobs/{job_id}/checkpoints", timeout=10).json()
        completed = sorted(c["latest_ack_timestamp"] for c in history.get("history", []) if c["status"] == "COMPLETED")
        if completed and completed[-1] >= after:
            return completed
        assert time.monotonic() < deadline, f"no checkpoint completed after {after}: {history}"
        time.sleep(0.2)


# The at-least-once run shows the check can fail: needed once per change to it, not on every CI run.
@pytest.mark.parametrize("guarantee", ["exactly-once", "at-least-once"])
def test_versions_become_visible_only_when_their_checkpoint_completes(
        stack_config, base_model, unique, tmp_path, guarantee):
    boot = stack_config.kafka_bootstrap
    topics = job_topics(boot, f"test.visible-{guarantee}-{unique}")
    job = submit_detached(stack_config, REPO / "jobs" / "stream_finetune.py", job_args(
        topics, base_model, tmp_path / "store", "--bootstrap-server", boot, "--no-register",
        "--checkpoint-interval-ms", str(CHECKPOINT_MS), "--versions-delivery", guarantee,
        "--unknown-model-grace-seconds", "3600",
        # Periodic checkpoints only: by default the job asks for a checkpoint as soon as a version
        # is written, which commits it within a few hundred ms, too soon after the write for an
        # at-least-once sink to show itself. What is under test is the sink's commit on checkpoint
        # completion, whatever triggered the checkpoint (tests/test_checkpoint_on_version.py
        # covers the trigger).
        "--no-checkpoint-on-version",
        "--job-name", f"visible-{unique}"))
    written: dict[str, int] = {}
    visible: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 60
        while job_state(stack_config, job) != "RUNNING":
            assert time.monotonic() < deadline, "the job never ran"
            time.sleep(0.5)
        model_id, t0 = f"vis-{unique}", 1_774_000_000_000
        send_config(boot, topics["configs"], spec(model_id, topics, min_samples=8, window_seconds=2), t0)
        pairs = digit_pairs(41, seed=4)
        # A Python operator's output leaves when its bundle finishes (flink-conf: 100 records),
        # at the latest with the next checkpoint barrier. Samples of a model with no config
        # (held, never trained) fill the bundles, so versions are written as soon as trained.
        idle = digit_samples(f"idle-{unique}", digit_pairs(500, seed=9), t0, 1, "idle")
        # Warm-up: the first version (torch's first step is slow) is not measured.
        send_samples(boot, topics["feedback"], digit_samples(model_id, pairs[:11], t0, 200) + idle[:250])
        deadline = time.monotonic() + 120
        while not visible:
            assert time.monotonic() < deadline, "the first version never became visible"
            first_seen(boot, topics["versions"], "read_uncommitted", written)
            first_seen(boot, topics["versions"], "read_committed", visible)
        warm = set(visible)
        # Send right after a checkpoint completed, so the versions are written mid-interval: an
        # at-least-once sink then shows them seconds before the next checkpoint could commit them.
        done = completed_checkpoints(stack_config, job, after=0, timeout=60)
        done = completed_checkpoints(stack_config, job, after=done[-1] + 1, timeout=CHECKPOINT_MS / 1000 + 30)
        # ... and well past the pollers' slack after it: versions first seen within POLL_SLACK_MS
        # of a completion may have been in that checkpoint, and the check must allow it (CI once
        # trained all three 218 ms after one, and the at-least-once arm could not be told apart).
        time.sleep(max(0.0, (done[-1] + 4 * POLL_SLACK_MS) / 1000 - time.time()))
        send_samples(boot, topics["feedback"], digit_samples(model_id, pairs[11:40], t0 + 2200, 200, "m")
                     + digit_samples(model_id, pairs[40:], t0 + 10_000, 1, "closer") + idle[250:])
        deadline = time.monotonic() + 3 * CHECKPOINT_MS / 1000 + 60
        # Three versions: the warm-up, then 2-6 s and 6-8 s. The idle timer closed the warm-up
        # window with its 2 s sample alone (carried: below min_samples), so the samples of
        # 2-4 s arrive late for their window and train with 4-6 s; the closer moves the
        # watermark past 8 s.
        while len(visible) < 3 or len(written) < 3:
            assert time.monotonic() < deadline, f"written {written}, visible {visible}"
            first_seen(boot, topics["versions"], "read_uncommitted", written)
            first_seen(boot, topics["versions"], "read_committed", visible)
        for version_id in warm:
            written.pop(version_id, None)
            visible.pop(version_id, None)
        # Until a checkpoint has completed after the last write (at-least-once readers never wait for one).
        completed = completed_checkpoints(stack_config, job, after=max(written.values()),
                                          timeout=2 * CHECKPOINT_MS / 1000 + 30)
    finally:
        cancel_job(stack_config, job)
        for consumer in first_seen.consumers.values():
            consumer.close()
        first_seen.consumers.clear()
    problems = visibility_violations(written, visible, completed)
    print(f"{guarantee}: written {written}\nvisible {visible}\ncheckpoints completed {completed}\n{problems}")
    if guarantee == "exactly-once":
        assert not problems, problems
        # Not a coincidence of timing: the records existed, uncommitted and unseen, for a while.
        assert max(visible[v] - written[v] for v in written) >= 1000, (written, visible)
    else:  # the same check must catch an at-least-once sink: records visible before any commit
        assert any("before the checkpoint" in p for p in problems), "the check cannot tell at-least-once apart"
