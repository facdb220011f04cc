"""A function's Flink counters, which also count what happens in `on_timer`.

PyFlink 2.0.2 runs `on_timer` outside the operator's metrics scope (`process_timer` in
pyflink/fn_execution/beam/beam_operations_*.py has no `scoped_process_state`, unlike
`process`), so a counter incremented there is silently dropped: windows closed by the
watermark and samples dead-lettered when a grace period ends never reached the job's metrics.
The scope current while an element is processed is the operator's own: `FunctionCounters`
remembers it and re-enters it for increments made from timers. Increments made before the
first element (timers fired on restore) are held and added then.

Outside a Flink worker (no Beam state tracker) the counters simply count.

Histograms (`observe`): PyFlink's `distribution()` reaches Flink as a Gauge of a Beam
DistributionResult, which the Prometheus reporter cannot export (it writes 0.0 for a gauge
that is not a number). A histogram here is two counters, `<name>_count` and `<name>_sum`
(integers, so they go through the same scope re-entry), and a gauge `<name>_max`.
"""

from __future__ import annotations

from collections import Counter as Tally
from typing import Iterable


def _current_scope():
    from apache_beam.runners.worker import statesampler

    tracker = statesampler.get_current_tracker()
    return tracker.current_state() if tracker is not None else None


class FunctionCounters:
    """Counters `names` of one function's metric group; call `enter_element()` first thing in
    `process_element`, `inc(name)` anywhere."""

    def __init__(self, metric_group, names: Iterable[str], histograms: Iterable[str] = ()):
        histograms = tuple(histograms)
        names = (*names, *(f"{h}_{part}" for h in histograms for part in ("count", "sum")))
        self._counters = {name: metric_group.counter(name) for name in names}
        self.max = {h: 0 for h in histograms}
        for h in histograms:  # gauges are read when a bundle finishes, in the operator's scope
            metric_group.gauge(f"{h}_max", lambda h=h: self.max[h])
        self._scope = None
        self._held: Tally[str] = Tally()

    def enter_element(self) -> None:
        if self._scope is None:
            self._scope = _current_scope()
            if self._scope is not None:
                for name, n in self._held.items():
                    self._counters[name].inc(n)
                self._held.clear()

    def observe(self, name: str, value: float) -> None:
        """One value of histogram `name` (rounded to an int, as Flink's Python gauges are)."""
        value = int(round(value))
        self.inc(f"{name}_count")
        self.inc(f"{name}_sum", value)
        self.max[name] = max(self.max[name], value)

    def inc(self, name: str, n: int = 1) -> None:
        counter = self._counters[name]
        if self._scope is None:
            if _current_scope() is None:  # not in a Flink worker
                counter.inc(n)
            else:
                self._held[name] += n  # a timer before the first element: counted at that element
        elif _current_scope() is self._scope:
            counter.inc(n)
        else:
            with self._scope:  # entered only from outside: it restores the state it replaced
                counter.inc(n)
