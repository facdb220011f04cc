"""Run a job (`jobs/stream_finetune.py` by default) on an embedded mini-cluster as a child process.

Tests and benchmarks use it to kill a job with SIGKILL and restart it from its latest
retained checkpoint, exactly as an operator would with `execution.state-recovery.path`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def latest_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The newest completed checkpoint (a chk-N folder holding _metadata) under any job id."""
    done = [m.parent for m in Path(checkpoint_dir).glob("*/chk-*/_metadata")]
    return max(done, key=lambda p: (p.stat().st_mtime, int(p.name.split("-")[1])), default=None)


def spawn_logged(cmd: list[str], log_file: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `cmd` from the repository in a session of its own, appending its output to `log_file`."""
    log_file = Path(log_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        log.write(f"\n=== {' '.join(cmd)}\n".encode())
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, **(extra_env or {})})


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process and everything it started (a JVM, Python workers): a crash."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


class LocalJob:
    def __init__(self, args: list[str], checkpoint_dir: Path, log_file: Path, module: str = "jobs.stream_finetune"):
        self.args, self.checkpoint_dir, self.log_file = args, Path(checkpoint_dir), Path(log_file)
        self.module = module
        self.proc: subprocess.Popen | None = None

    def start(self, restore_from: Path | None = None) -> None:
        cmd = [sys.executable, "-m", self.module, *self.args,
               "--checkpoint-dir", f"file://{self.checkpoint_dir}"]
        if restore_from:
            cmd += ["--restore-from", f"file://{restore_from}"]
        self.proc = spawn_logged(cmd, self.log_file)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def flink_rest_url(self) -> str | None:
        """The REST API of the job's mini-cluster, from the line the job prints (the latest
        start's), or None before it did."""
        from jobs.wiring import MINI_CLUSTER_LINE

        text = self.log_file.read_text(errors="replace") if self.log_file.exists() else ""
        urls = [line.split(MINI_CLUSTER_LINE, 1)[1].strip() for line in text.splitlines() if MINI_CLUSTER_LINE in line]
        return urls[-1] if urls else None

    def job_id(self) -> str | None:
        """The id of the job running on the mini-cluster, or None before it runs."""
        import requests

        if not (rest := self.flink_rest_url):
            return None
        try:
            jobs = requests.get(f"{rest}/jobs", timeout=5).json().get("jobs", [])
        except requests.RequestException:
            return None  # the mini-cluster is starting
        return next((j["id"] for j in jobs if j["status"] == "RUNNING"), None)

    def freeze(self) -> None:
        """SIGSTOP the whole mini-cluster: nothing it does (a checkpoint, a transaction's commit)
        can happen until `thaw` or `kill`; a test freezes first to check where a kill will land."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the whole mini-cluster (JVM, Python workers): a crash, not a shutdown."""
        if self.proc is not None:
            kill_group(self.proc)

    def restart_from_latest(self) -> Path | None:
        chk = latest_checkpoint(self.checkpoint_dir)
        self.start(restore_from=chk)
        return chk
