"""Checkpoints on demand: a version waiting for its commit asks the JobManager for a checkpoint.

An exactly-once version becomes visible when the checkpoint after it completes. With
periodic checkpoints only, it waits for the next trigger: anywhere between 0 and one
interval, depending on where the window's end falls against the checkpoint schedule (a
freshness benchmark run with 1 s windows and 1 s checkpoints stays near one phase, and the
phase changes from run to run). With `--checkpoint-on-version` the trainer asks for a
checkpoint through Flink's REST API (`POST /jobs/<id>/checkpoints`, Flink ≥ 1.19) as soon
as it emits a version, so the commit waits for the checkpoint's own duration only.

One request at a time per trainer subtask: versions emitted while a requested checkpoint
runs are covered by the next request, sent when it completes (the periodic checkpoints go
on as configured). A failed request is logged and counted; the periodic checkpoint still
commits the version, so nothing waits on this.

The job learns its own id by fixing it at submission (jobs/wiring.py).
"""

from __future__ import annotations

import logging
import threading
import time

import requests

log = logging.getLogger(__name__)

POLL_S = 0.025        # how often a requested checkpoint's status is read
GIVE_UP_S = 60.0      # a requested checkpoint not done by then: the next request may go
RETRY_AFTER_S = 1.0   # after a refused request (the job restarting, the JobManager away)


class CheckpointRequester:
    """`request()` from the operator's thread; the REST calls run on a daemon thread of its own.

    `failures` counts refused REST requests; the operator reads it on its own thread (Flink's
    Python metrics count only there).
    """

    def __init__(self, rest_url: str, job_id: str):
        self.rest_url, self.job_id = rest_url.rstrip("/"), job_id
        self.failures = 0
        self._wanted = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def request(self) -> None:
        """A version was emitted: ask for a checkpoint, now or when the running request completes."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="streamtune-checkpoint-requests")
            self._thread.start()
        self._wanted.set()

    def close(self) -> None:
        self._closed = True
        self._wanted.set()

    def _run(self) -> None:
        session = requests.Session()
        base = f"{self.rest_url}/jobs/{self.job_id}/checkpoints"
        while True:
            self._wanted.wait()
            if self._closed:
                return
            self._wanted.clear()
            try:
                answer = session.post(base, json={"checkpointType": "CONFIGURED"}, timeout=5)
                answer.raise_for_status()
                trigger = answer.json()["request-id"]
                deadline = time.monotonic() + GIVE_UP_S
                while not self._closed and time.monotonic() < deadline:
                    status = session.get(f"{base}/{trigger}", timeout=5).json()
                    if status.get("status", {}).get("id") == "COMPLETED":
                        break
                    time.sleep(POLL_S)
            except (requests.RequestException, KeyError, ValueError) as e:
                self.failures += 1
                log.warning("checkpoint request to %s failed (%s: %s); the periodic checkpoint commits instead",
                            base, type(e).__name__, str(e)[:300])
                time.sleep(RETRY_AFTER_S)
