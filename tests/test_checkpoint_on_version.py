"""`--checkpoint-on-version` (the default): an exactly-once version commits as soon as it is
trained, not at the next periodic checkpoint (connectors/flink_checkpoints.py).

Both jobs run with a 300 s checkpoint interval: Flink's first periodic checkpoint comes at a
random delay between the minimum pause and the interval. The cluster's minimum pause (2 s,
flink-conf/config.yaml) would let it come at any time, so the jobs are submitted with a longer
one, which the job caps at half its interval (jobs/wiring.py): no periodic checkpoint can
commit anything in the first 150 s of either job.

- By default, the version is visible to a read_committed reader within seconds of being
  written, long before any periodic checkpoint, and the trainer counted the request.
- With --no-checkpoint-on-version (the control, which shows the test can fail), the same version is written (a
  read_uncommitted reader sees it) and stays invisible to read_committed for 30 s, on a job
  that completed no checkpoint and never restarted.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import pytest
import requests

from core.messages import VersionRecord
from streamtune.feedback import digit_samples, send_config, send_samples
from streamtune.stack.flink import cancel_job, job_counters, submit_detached
from streamtune.testing import job_args, job_topics, spec, wait_for, wait_for_records
from streamtune.tinymodel import digit_pairs

pytestmark = [pytest.mark.finetune, pytest.mark.guarantees]
REPO = Path(__file__).resolve().parents[1]
INTERVAL_MS = 300_000
NO_PERIODIC_CHECKPOINT_S = INTERVAL_MS / 2000  # the first one comes no earlier


def restarts_and_checkpoints(rest_url: str, job_id: str) -> tuple[list[str], int]:
    """The failures the job restarted after (Flink's exception history) and its completed checkpoints."""
    history = requests.get(f"{rest_url}/jobs/{job_id}/exceptions", timeout=5).json().get("exceptionHistory", {})
    counts = requests.get(f"{rest_url}/jobs/{job_id}/checkpoints", timeout=5).json().get("counts", {})
    return ([e.get("exceptionName", "?") for e in history.get("entries", [])], int(counts.get("completed", 0)))


FIXED_JOB_ID = "$internal.pipeline.job-id"  # Flink's PipelineOptionsInternal.PIPELINE_FIXED_JOB_ID
LONG_MIN_PAUSE = {"execution.checkpointing.min-pause": f"{INTERVAL_MS} ms"}


# Application mode (the Kubernetes operator's FlinkDeployment) fixes the job id in the
# cluster's configuration before the driver runs; `flink run -D` puts it in the same place.
@pytest.mark.parametrize("on_version,fixed_by_cluster", [(True, False), (True, True), (False, False)],
                         ids=["default", "cluster-fixed-job-id", "periodic-only"])
def test_a_version_commits_at_once_unless_checkpoint_on_version_is_off(stack_config, base_model, tmp_path, unique,
                                                                       on_version, fixed_by_cluster):
    # A job that restarted aborts its open transaction, and the local broker shows aborted
    # records to read_committed readers: either arm proves something only on a job that did
    # not restart, so a restarted run is repeated once on a fresh job.
    for attempt in range(2):
        restarted = commits_at_once(stack_config, base_model, tmp_path / f"run{attempt}", f"{unique}{attempt}",
                                    on_version, {**LONG_MIN_PAUSE, **({FIXED_JOB_ID: secrets.token_hex(16)}
                                                                      if fixed_by_cluster else {})})
        if not restarted:
            return
    pytest.fail(f"the job restarted in both runs ({restarted}): neither shows what it is for")


def commits_at_once(stack_config, base_model, tmp_path: Path, unique: str, on_version: bool,
                    properties: dict[str, str]) -> list[str]:
    """One run; [] when the job never restarted (the assertions then all held), else the
    failures it restarted after (the control's visible records prove nothing then).
    `properties`: the cluster's configuration for this job (`flink run -D`)."""
    bootstrap = stack_config.kafka_bootstrap
    topics = job_topics(bootstrap, f"test.cov-{unique}")
    model_id = f"cov-{unique}"
    job = submit_detached(stack_config, REPO / "jobs" / "stream_finetune.py", job_args(
        topics, base_model, tmp_path / "adapters", "--bootstrap-server", bootstrap,
        "--checkpoint-interval-ms", str(INTERVAL_MS), "--idle-close-ms", "1000", "--no-register",
        "--job-name", f"cov-{unique}", *(() if on_version else ("--no-checkpoint-on-version",))), properties)
    submitted = time.monotonic()
    try:
        if FIXED_JOB_ID in properties:  # the job kept the id the cluster gave it: its trainer asks about that one
            assert job == properties[FIXED_JOB_ID]
        t0 = (int(time.time() * 1000) // 10_000) * 10_000 - 60_000
        send_config(bootstrap, topics["configs"], spec(model_id, topics, min_samples=4, window_seconds=2), t0)
        send_samples(bootstrap, topics["feedback"], digit_samples(model_id, digit_pairs(4, seed=3), t0, 250))

        written = wait_for_records(bootstrap, topics["versions"], VersionRecord, 1, timeout=120, read_committed=False)
        assert len(written) == 1, "the trainer wrote no version in 120 s"
        written_at = time.monotonic()
        assert written_at - submitted < NO_PERIODIC_CHECKPOINT_S - 40, "the job started too slowly to tell"

        if on_version:
            committed = wait_for_records(bootstrap, topics["versions"], VersionRecord, 1, timeout=20)
            assert [v.version_id for v in committed] == [written[0].version_id]
            assert time.monotonic() - submitted < NO_PERIODIC_CHECKPOINT_S, "a periodic checkpoint may have done it"
            counters = wait_for(lambda: (c := job_counters(stack_config.flink_rest_url, job)).get(
                "lora-trainer.checkpoint_requests") and c, 30, "the trainer's request counter")
            assert counters["lora-trainer.checkpoint_requests"] >= 1
            assert counters.get("lora-trainer.checkpoint_request_failures", 0) == 0
            return restarts_and_checkpoints(stack_config.flink_rest_url, job)[0]
        committed = wait_for_records(bootstrap, topics["versions"], VersionRecord, 1, timeout=30)
        restarts, checkpoints = restarts_and_checkpoints(stack_config.flink_rest_url, job)
        if restarts:
            return restarts
        assert committed == [], f"committed without a checkpoint ({checkpoints} completed): the control is broken"
        assert checkpoints == 0 and time.monotonic() - submitted < NO_PERIODIC_CHECKPOINT_S
        return []
    finally:
        cancel_job(stack_config, job)
