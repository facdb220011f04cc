"""The keyed processing-time timers a worker armed itself, to tell them from restored ones.

PyFlink 2.0.2 can restore a Python function's keyed state holding a pending timer's deadline
without the timer: seen after a TaskManager kill while the registration operator re-armed its
20 ms poll around a checkpoint, when the model's queue then waited for good. A function that
keeps a timer's deadline in state to avoid arming it twice asks `ArmedHere.holds` instead of
testing the state for None: a deadline restored from a checkpoint does not count, so the
model's next record arms the timer again. The restored timer, should it fire too, no longer
matches the state and is ignored by the function's own check.

>>> armed = ArmedHere()
>>> class Deadline:
...     def value(self):
...         return 1_000
>>> armed.holds(Deadline(), "idle", "m")  # in state, but armed before this worker
False
>>> armed.add("idle", "m")
>>> armed.holds(Deadline(), "idle", "m")
True
"""

from __future__ import annotations


class ArmedHere:
    """(timer, key) pairs this worker armed; a new worker (a restore, a rescale) starts empty."""

    def __init__(self):
        self._armed: set[tuple[str, str]] = set()

    def add(self, timer: str, key: str) -> None:
        self._armed.add((timer, key))

    def holds(self, deadline_state, timer: str, key: str) -> bool:
        """Whether `deadline_state` holds a deadline whose timer this worker armed."""
        return (timer, key) in self._armed and deadline_state.value() is not None  # the set first: no state read
