"""SLO arbitration: a trainer that shares its device with `streamtune serve` yields to it.

The server publishes its SLO headroom (streamtune/serve/headroom.py: (target − p99)/target
over a short window, on `GET /headroom`). Between two micro-batches of a step the trainer
asks the arbiter whether to go on; while the headroom is at or below `yield_below` it waits,
polling every `poll_s`, and resumes once the headroom is back above `resume_above`. It never
waits so long that training falls below `min_training_share` of the step's wall time, and
the first micro-batch of a step always runs: training always progresses.

Arbitration changes when a version is produced, never what: it only waits between
micro-batches (operators/lora_trainer.py `between`), so the same samples in the same order
give the same weights with it or without it.

On a CPU, waits between micro-batches are coarse: a micro-batch already running keeps the
core until it ends, and a request arriving meanwhile queues behind it. So a trainer that
arbitrates on a CPU also runs its thread at idle priority (`cpu_priority` "idle", Linux's
SCHED_IDLE): the kernel then runs it only when the serving process has nothing to run, and
takes the core back within a scheduler tick when a request comes. The pauses still apply;
`min_training_share` bounds them, not the kernel (a fully loaded server leaves an idle-priority
trainer only the kernel's small share for that class).

An unreachable or malformed endpoint reads as no headroom figure: the trainer goes on (a
server that is down has no SLO to protect) and counts the failure.

The decision itself is pure:

>>> core = ArbiterCore(ArbiterSettings("http://127.0.0.1:8790/headroom", min_training_share=0.5, poll_s=0.1))
>>> core.wait_s(headroom=-0.2, trained_s=1.0, yielded_s=0.0)    # the SLO is missed: one poll
0.1
>>> core.wait_s(headroom=0.05, trained_s=1.0, yielded_s=0.1)    # not yet above resume_above
0.1
>>> core.wait_s(headroom=0.5, trained_s=1.0, yielded_s=0.2)     # resumed
0.0
>>> round(core.wait_s(headroom=-0.2, trained_s=1.0, yielded_s=0.95), 6)  # training's half: 0.05 s left
0.05
>>> core.wait_s(headroom=-0.2, trained_s=1.0, yielded_s=1.0), core.wait_s(None, 1.0, 0.0)  # none left; no figure
(0.0, 0.0)
>>> ArbiterSettings("http://h/headroom", min_training_share=0)
Traceback (most recent call last):
...
ValueError: min_training_share 0 must be in (0, 1]: training must keep some share of the device to progress
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass


@dataclass(frozen=True)
class ArbiterSettings:
    """Per deployment (`--slo-headroom-url` and friends, jobs/wiring.py)."""

    headroom_url: str
    min_training_share: float = 0.25  # of a step's wall time, at least
    yield_below: float = 0.0          # headroom at or below which training waits (0: the SLO is met exactly)
    resume_above: float = 0.1         # headroom above which it resumes (hysteresis: no flapping at the edge)
    poll_s: float = 0.05              # how often a waiting trainer reads the headroom again
    timeout_s: float = 0.5            # of one read
    cpu_priority: str = "idle"        # the training thread's CPU priority on a CPU: "idle" or "normal"

    def __post_init__(self):
        if not self.headroom_url.startswith(("http://", "https://")):
            raise ValueError(f"slo headroom url {self.headroom_url!r} must be an http(s) URL")
        if not 0.0 < self.min_training_share <= 1.0:
            raise ValueError(f"min_training_share {self.min_training_share} must be in (0, 1]: "
                             "training must keep some share of the device to progress")
        if not self.resume_above >= self.yield_below:
            raise ValueError(f"resume_above ({self.resume_above}) must be >= yield_below ({self.yield_below})")
        if not (self.poll_s > 0 and self.timeout_s > 0 and math.isfinite(self.poll_s)):
            raise ValueError("poll_s and timeout_s must be positive")
        if self.cpu_priority not in CPU_PRIORITIES:
            raise ValueError(f"cpu_priority {self.cpu_priority!r} must be one of {', '.join(CPU_PRIORITIES)}")


CPU_PRIORITIES = ("idle", "normal")


def lower_cpu_priority() -> bool:
    """The calling thread, and the threads it starts from now on, run only when the CPU has
    nothing else to run (Linux SCHED_IDLE; a thread may always lower its own priority, but only
    a privileged one may raise it again). False where the platform refuses or lacks it."""
    try:
        if os.sched_getscheduler(0) != os.SCHED_IDLE:  # 0: this thread, on Linux
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return True
    except (AttributeError, OSError):
        return False


class ArbiterCore:
    """How long to wait now, given the headroom seen and the step's time so far."""

    MIN_WAIT_S = 0.001  # shorter waits cost more in polls than they give back

    def __init__(self, settings: ArbiterSettings):
        self.settings = settings
        self.yielding = False

    def wait_s(self, headroom: float | None, trained_s: float, yielded_s: float) -> float:
        """0: go on. Otherwise wait at most one poll, and never past the point where training
        would fall below its share of the step's wall time."""
        s = self.settings
        if headroom is None:
            self.yielding = False
            return 0.0
        self.yielding = headroom <= (s.resume_above if self.yielding else s.yield_below)
        if not self.yielding:
            return 0.0
        budget = trained_s * (1 - s.min_training_share) / s.min_training_share - yielded_s
        return min(s.poll_s, budget) if budget >= self.MIN_WAIT_S else 0.0


class HeadroomReader:
    """The server's headroom over HTTP; None when it cannot be read.

    A reading is reused for `max_age_s`: the trainer asks between every micro-batch (hundreds
    a second on a small model), and each answer costs the serving process CPU time, which
    on a shared device is the latency being protected (bench/colocation.py measured a p99 2.4x
    serving alone's at 90% load with a read per micro-batch)."""

    def __init__(self, url: str, timeout_s: float, max_age_s: float = 0.0, clock=time.monotonic):
        self.url, self.timeout_s, self.max_age_s, self.clock = url, timeout_s, max_age_s, clock
        self.failures = self.reads = 0
        self._last: tuple[float, float | None] | None = None  # (when, value) of the last read

    def read(self) -> float | None:
        now = self.clock()
        if self._last is not None and now - self._last[0] < self.max_age_s:
            return self._last[1]
        value = self._read()
        self._last = (now, value)
        return value

    def _read(self) -> float | None:
        self.reads += 1
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as response:  # noqa: S310 - http(s) only
                value = json.loads(response.read(65536))["headroom"]
            return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else self._failed()
        except (OSError, ValueError, KeyError, TypeError, urllib.error.URLError):
            return self._failed()

    def _failed(self) -> None:
        self.failures += 1
        return None


class Arbiter:
    """The trainer's side: `begin_step()` before a step, `between()` between its micro-batches.

    Counts what it did (the job's gauges): time yielded, yields, the last headroom seen, reads
    that failed. `waiting` is set while it waits (what a test can observe)."""

    def __init__(self, settings: ArbiterSettings, reader: HeadroomReader | None = None,
                 clock=time.monotonic, wait=None):
        self.settings = settings
        self.core = ArbiterCore(settings)
        self.reader = reader or HeadroomReader(settings.headroom_url, settings.timeout_s, max_age_s=settings.poll_s)
        self.clock = clock
        self._stop = threading.Event()
        self.wait = wait or self._stop.wait  # sleeping; a test may pass its own
        self.waiting = threading.Event()
        self.yielded_s, self.yields, self.last_headroom = 0.0, 0, None
        self._trained_s = self._step_yielded_s = 0.0
        self._mark = clock()

    def begin_step(self) -> None:
        self._trained_s = self._step_yielded_s = 0.0
        self._mark = self.clock()

    def between(self) -> None:
        now = self.clock()
        self._trained_s += now - self._mark
        started = now
        while True:
            headroom = self.reader.read()
            self.last_headroom = headroom if headroom is not None else self.last_headroom
            pause = self.core.wait_s(headroom, self._trained_s, self._step_yielded_s + self.clock() - started)
            if pause <= 0:
                break
            if not self.waiting.is_set():
                self.yields += 1
                self.waiting.set()
            self.wait(pause)
        self.waiting.clear()
        waited = self.clock() - started
        self._step_yielded_s += waited
        self.yielded_s += waited
        self._mark = self.clock()

    @property
    def headroom_failures(self) -> int:
        return self.reader.failures

    def close(self) -> None:
        self._stop.set()  # a wait in progress ends: the job is stopping
