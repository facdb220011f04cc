"""The tiny interface each stack component implements."""

from __future__ import annotations

from pathlib import Path

from .config import StackConfig
from .process import StackError, alive, log_tail, read_pids, terminate, wait_until


class Component:
    """One service of the local stack: probe it, start it, stop it.

    Subclasses implement `address`, `healthy` (a probe over the service's own protocol)
    and `launch` (start the daemon, write the pid file). `start` waits for health.
    """

    name: str = ""
    startup_timeout: float = 60.0

    def __init__(self, config: StackConfig):
        self.config = config

    # -- to implement -------------------------------------------------------------
    @property
    def address(self) -> str:
        raise NotImplementedError

    def healthy(self) -> bool:
        raise NotImplementedError

    def launch(self) -> None:
        raise NotImplementedError

    # -- shared behaviour -----------------------------------------------------------
    @property
    def pid_file(self) -> Path:
        return self.config.run_dir / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        return self.config.log_dir / f"{self.name}.log"

    def pids(self) -> list[int]:
        """Processes this stack started for the component (empty when it started none)."""
        return read_pids(self.pid_file)

    def owned(self) -> bool:
        return any(alive(pid) for pid in self.pids())

    def start(self) -> None:
        self.launch()
        if not wait_until(self.healthy, self.startup_timeout, interval=0.5):
            pids = self.pids()
            state = "running" if any(alive(p) for p in pids) else "exited"
            raise StackError(
                f"{self.name} did not become healthy at {self.address} within "
                f"{self.startup_timeout:.0f}s (process {state}); log {self.log_file}:\n"
                f"{log_tail(self.log_file)}")

    def stop(self) -> None:
        for pid in self.pids():
            terminate(pid)
        self.pid_file.unlink(missing_ok=True)

    def safe_healthy(self) -> bool:
        try:
            return bool(self.healthy())
        except Exception:
            return False
