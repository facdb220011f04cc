"""The CDC captures the control plane runs for its pipelines: started, restarted, stopped.

Each capture is `streamtune cdc` as a child process in a session of its own, logging to
`<dir>/<name>.log`. A watcher thread restarts one that exits unasked (1 s, doubling to
30 s between attempts; its log says why it exited). A capture resumes from its durable
position (the replication slot and the offsets topic), so a restart repeats at most what
was in flight, which the retrain job drops. The API stops its captures when it exits and
starts them again for the pipelines on record when it starts. Each capture's pid is kept in
`<dir>/<name>.pid`: a capture left running by an API that was killed is stopped before a
new one starts (two captures would fight over one replication slot).

Credentials reach a capture through its environment, never its command line (`ps` shows
every process's arguments to every user): the argv holds the source URI, which carries at
most a secret reference (`password_env=VAR`, `password_file=PATH`; core/sources/base.py), and
the environment is chosen per capture by `env_for(source)` (streamtune/api/app.py
capture_env: the stack's PostgreSQL password only for a source on the stack's own server).
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

from core.sources import SourceKind
from streamtune.stack.process import terminate

log = logging.getLogger("streamtune.api.captures")
BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 30.0
STOP_TIMEOUT_S = 15.0


@dataclass
class _Capture:
    argv: list[str]
    log_file: Path
    env: dict[str, str]
    proc: Optional[subprocess.Popen] = None
    restarts: int = 0
    next_start: float = 0.0
    backoff_s: float = BACKOFF_FIRST_S
    started_at: float = field(default_factory=time.monotonic)


EnvFor = Callable[[Optional[SourceKind]], dict[str, str]]


def _credentials(env: dict[str, str], source: Optional[SourceKind]) -> dict[str, str]:
    """What of a capture's environment reaches its database: libpq's PG* variables and the
    source's own secret reference. The rest of the API's environment may change while it runs
    (libraries set variables) and must not restart a capture."""
    secret = getattr(source, "password_env", None)
    return {k: v for k, v in env.items() if k.startswith("PG") or k == secret}


class CaptureSupervisor:
    """`env`: one environment for every capture, or `env_for(source)`, the environment of a
    capture of `source` (None: no particular source)."""

    def __init__(self, log_dir: Path, env: Union[dict[str, str], EnvFor], poll_s: float = 0.5):
        self.log_dir, self.poll_s = Path(log_dir), poll_s
        self.env_for: EnvFor = env if callable(env) else (lambda source, fixed=dict(env): dict(fixed))
        self._captures: dict[str, _Capture] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="capture-supervisor", daemon=True)
        self._watcher.start()

    def ensure(self, name: str, argv: list[str], source: Optional[SourceKind] = None) -> int:
        """Run `argv` as capture `name` of `source` (restarting it when its arguments or
        environment changed); its pid."""
        env = self.env_for(source)
        with self._lock:
            current = self._captures.get(name)
            if (current is not None and current.argv == argv and _credentials(current.env, source) == _credentials(env, source)
                    and _alive(current.proc)):
                return current.proc.pid
            if current is not None:
                _terminate(current.proc)
            else:
                self._stop_orphan(name)
            capture = _Capture(argv, self.log_dir / f"{name}.log", env)
            self._spawn(name, capture)
            self._captures[name] = capture
            return capture.proc.pid

    def stop(self, name: str) -> bool:
        """SIGTERM (a clean stop: flush, confirm), SIGKILL after 15 s; False when none ran."""
        with self._lock:
            capture = self._captures.pop(name, None)
        if capture is None:
            return self._stop_orphan(name)
        _terminate(capture.proc)
        self._pid_file(name).unlink(missing_ok=True)
        return True

    def status(self, name: str) -> Optional[dict]:
        with self._lock:
            capture = self._captures.get(name)
            if capture is None:
                return None
            return {"pid": capture.proc.pid if _alive(capture.proc) else None, "running": _alive(capture.proc),
                    "restarts": capture.restarts, "log": str(capture.log_file)}

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            names = list(self._captures)
        for name in names:
            self.stop(name)

    def _spawn(self, name: str, capture: _Capture) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(capture.log_file, "ab") as out:
            capture.proc = subprocess.Popen(capture.argv, stdout=out, stderr=subprocess.STDOUT, env=capture.env,
                                            start_new_session=True)
        capture.started_at = time.monotonic()
        self._pid_file(name).write_text(str(capture.proc.pid))
        log.info("capture %s started (pid %d)", name, capture.proc.pid)

    def _pid_file(self, name: str) -> Path:
        return self.log_dir / f"{name}.pid"

    def _stop_orphan(self, name: str) -> bool:
        """Stop a capture `name` that an earlier API process started and left running."""
        try:
            pid = int(self._pid_file(name).read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return False
        if name.encode() not in cmdline:
            return False  # the pid belongs to some other process by now
        log.warning("stopping capture %s (pid %d) left running by an earlier API process", name, pid)
        terminate(pid, timeout=STOP_TIMEOUT_S)
        self._pid_file(name).unlink(missing_ok=True)
        return True

    def _watch(self) -> None:
        while not self._closed.wait(self.poll_s):
            with self._lock:
                for name, capture in self._captures.items():
                    if _alive(capture.proc):
                        if time.monotonic() - capture.started_at > BACKOFF_MAX_S:
                            capture.backoff_s = BACKOFF_FIRST_S  # healthy a while: the next failure is new
                        continue
                    now = time.monotonic()
                    if capture.next_start == 0.0:
                        capture.next_start = now + capture.backoff_s
                        log.warning("capture %s exited with %s; restarting in %.0f s (log: %s)", name,
                                    capture.proc.returncode, capture.backoff_s, capture.log_file)
                    elif now >= capture.next_start:
                        capture.restarts += 1
                        capture.next_start = 0.0
                        capture.backoff_s = min(capture.backoff_s * 2, BACKOFF_MAX_S)
                        self._spawn(name, capture)


def _alive(proc: Optional[subprocess.Popen]) -> bool:
    return proc is not None and proc.poll() is None


def _terminate(proc: Optional[subprocess.Popen]) -> None:
    """SIGTERM (a clean stop: flush, confirm), SIGKILL after STOP_TIMEOUT_S; then reap it."""
    if _alive(proc):
        terminate(proc.pid, timeout=STOP_TIMEOUT_S)
        proc.wait()
