"""Per-model event-time windows with carry-over and a step-size cap (pure Python).

A model's window ends at the next multiple of `window_seconds` (epoch aligned). When the
watermark passes a window's end, the samples stamped before it fire as one training step
if there are at least `min_samples_per_window` of them; otherwise they carry over to the
next window. Nothing is dropped: a late sample simply joins the next window that fires.
A window holding more than `max_samples_per_step` trains in steps of that many, in source
order. Only the watermark closes a window, never the arrival of one sample: a window holds
the same samples however the partitions of the input interleave, at any parallelism.

>>> s = [Pending("a", "p", "c", 1.0, ts, "t", 0, i) for i, ts in enumerate([100, 900, 1500])]
>>> window_end(100, 1)
1000
>>> batch, rest = due_batch(s, fire_at=1000, min_samples=3)   # 2 due: they carry over
>>> batch, len(rest)
(None, 3)
>>> batch, rest = due_batch(s, fire_at=2000, min_samples=3)
>>> [x.offset for x in batch], rest
([0, 1, 2], [])
>>> [[x.offset for x in step] for step in steps(batch, max_samples=2)]
[[0, 1], [2]]
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pending:
    """A validated sample waiting in its model's buffer, with its source position."""

    sample_id: str
    prompt: str
    completion: str
    weight: float
    ts: int
    topic: str
    partition: int
    offset: int
    payload: str = ""  # the original record, for the dead-letter topic
    row_key: str = ""  # CDC samples: the changed row (a newer change or a delete replaces it)

    @property
    def count(self) -> int:
        return 1  # a micro-batch (operators/micro_batches.py PendingBatch) holds several

    @property
    def order(self) -> tuple:
        # A total order on source positions: a window's batch is the same on every replay.
        return (self.ts, self.topic, self.partition, self.offset)


def window_end(ts_ms: int, window_seconds: int) -> int:
    size = window_seconds * 1000
    return (ts_ms // size + 1) * size


def window_start(end_ms: int, window_seconds: int) -> int:
    return end_ms - window_seconds * 1000


def due_batch(pending: list[Pending], fire_at: int, min_samples: int) -> tuple[list[Pending] | None, list[Pending]]:
    """Samples stamped before `fire_at`, if there are enough of them; the rest stays."""
    due = sorted((s for s in pending if s.ts < fire_at), key=lambda s: s.order)
    if len(due) < min_samples:
        return None, pending
    rest = [s for s in pending if s.ts >= fire_at]
    return due, rest


def steps(batch: list[Pending], max_samples: int) -> list[list[Pending]]:
    """A window's batch (in source order) cut into training steps of at most `max_samples`."""
    return [batch[i:i + max_samples] for i in range(0, len(batch), max_samples)]


def offset_ranges(batch: list[Pending]) -> list[dict]:
    """Lineage as source ranges: first and last offset per (topic, partition)."""
    ranges: dict[tuple[str, int], list[int]] = {}
    for s in batch:
        r = ranges.setdefault((s.topic, s.partition), [s.offset, s.offset])
        r[0], r[1] = min(r[0], s.offset), max(r[1], s.offset)
    return [{"topic": t, "partition": p, "first": a, "last": b} for (t, p), (a, b) in sorted(ranges.items())]
