"""Helpers for CDC tests and benchmarks: capture processes, psql, specs for CDC sources."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from streamtune.local_job import kill_group, spawn_logged


class CaptureProcess:
    """`streamtune cdc` as a child process that a test can SIGKILL and start again."""

    def __init__(self, source: str, name: str, topic: str, log_file: Path, bootstrap: str,
                 offsets_topic: str, *extra: str):
        self.cmd = [sys.executable, "-m", "streamtune.cli", "cdc", "--source", source, "--name", name,
                    "--topic", topic, "--bootstrap", bootstrap, "--offsets-topic", offsets_topic, *extra]
        self.log_file = Path(log_file)
        self.proc: subprocess.Popen | None = None

    def start(self) -> "CaptureProcess":
        self.proc = spawn_logged(self.cmd, self.log_file)
        return self

    def kill(self) -> None:
        """SIGKILL: no flush, no confirmation, no goodbye to the server."""
        if self.proc is not None and self.proc.poll() is None:
            kill_group(self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def wait_for_log(self, text: str, timeout: float = 30.0, times: int = 1) -> None:
        deadline = time.monotonic() + timeout
        while self.log().count(text) < times:
            assert time.monotonic() < deadline, f"capture never logged {text!r}:\n{self.log()[-3000:]}"
            assert self.alive(), f"capture exited:\n{self.log()[-3000:]}"
            time.sleep(0.2)


def psql(dsn: str, sql: str) -> str:
    """Run SQL with the real psql client, as a user would."""
    result = subprocess.run(["psql", dsn, "-v", "ON_ERROR_STOP=1", "-qAt", "-c", sql],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"psql failed: {result.stderr}"
    return result.stdout


def cdc_spec(model_id: str, stream_source: str, *, min_samples: int, window_seconds: int = 2,
             rank: int = 4) -> dict:
    return {"model_id": model_id, "stream_source": stream_source,
            "adapter_config": {"rank": rank, "alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"]},
            "trigger_policy": {"min_samples_per_window": min_samples, "window_seconds": window_seconds},
            "training": {"lr": 0.01, "micro_batch_size": 8}}
