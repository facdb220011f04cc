"""Spawning and stopping the stack's daemons, tracked by pid files.

A pid file is written only for a process this stack started, which is what lets
`stack down` stop exactly what `stack up` started and nothing else.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

from core.errors import StreamtuneError


class StackError(StreamtuneError):
    """A component cannot be started or is missing; the message says what to do (exit 2)."""


def spawn(cmd: list[str], log_file: Path, pid_file: Path, env: dict | None = None,
          cwd: Path | None = None) -> int:
    """Start a daemon in its own session (so a terminal's Ctrl-C does not reach it)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=cwd, start_new_session=True)
    write_pids(pid_file, [proc.pid])
    return proc.pid


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[19]  # field 22: start time in clock ticks
    except (FileNotFoundError, IndexError):
        return None


def write_pids(pid_file: Path, pids: list[int]) -> None:
    """Record pids with their start times, so a recycled pid is never mistaken for ours."""
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.write_text("".join(f"{pid} {_start_time(pid)}\n" for pid in pids))


def read_pids(pid_file: Path) -> list[int]:
    """The recorded pids that still run the process we started."""
    try:
        lines = pid_file.read_text().splitlines()
    except FileNotFoundError:
        return []
    pids = []
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and _start_time(int(parts[0])) == parts[1]:
            pids.append(int(parts[0]))
    return pids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _signal(pid: int, sig: int) -> None:
    """Signal the process group led by `pid`, or the process alone when it leads none."""
    try:
        os.killpg(pid, sig)
        return
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def terminate(pid: int, timeout: float = 20.0) -> None:
    """SIGTERM the process (group), then SIGKILL whatever is left after `timeout`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not alive(pid):
            return
        _signal(pid, sig)
        if wait_until(lambda: not alive(pid), timeout):
            return
    raise StackError(f"process {pid} survived SIGKILL")


def wait_until(check: Callable[[], bool], timeout: float, interval: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return True
        except Exception:  # a probe that raises is simply "not yet"
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def log_tail(log_file: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log_file.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
