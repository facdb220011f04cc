"""Window arithmetic, carry-over and the step-size cap (operators/windowing.py)."""

from operators.windowing import Pending, due_batch, offset_ranges, steps, window_end, window_start


def sample(ts, offset, partition=0):
    return Pending(f"s{offset}", "p", "c", 1.0, ts, "t", partition, offset)


def test_windows_are_epoch_aligned():
    assert window_end(0, 2) == 2000 and window_end(1999, 2) == 2000 and window_end(2000, 2) == 4000
    assert window_start(4000, 2) == 2000


def test_too_few_samples_carry_over_and_fire_with_the_next_window():
    pending = [sample(100, 0), sample(2100, 1), sample(2200, 2)]
    batch, rest = due_batch(pending, 2000, min_samples=2)
    assert batch is None and rest == pending
    batch, rest = due_batch(rest, 4000, min_samples=2)
    assert [s.offset for s in batch] == [0, 1, 2] and rest == []


def test_samples_after_the_window_end_stay():
    batch, rest = due_batch([sample(100, 0), sample(2500, 1)], 2000, min_samples=1)
    assert [s.offset for s in batch] == [0] and [s.offset for s in rest] == [1]


def test_a_window_above_the_cap_trains_in_steps_in_source_order():
    pending = [sample(300, 3), sample(100, 1), sample(200, 2), sample(50, 7, partition=1)]
    batch, rest = due_batch(pending, 2000, min_samples=1)
    assert [[s.offset for s in step] for step in steps(batch, 4)] == [[7, 1, 2, 3]]
    assert [[s.offset for s in step] for step in steps(batch, 3)] == [[7, 1, 2], [3]]


def test_lineage_ranges_per_partition():
    batch = [sample(1, 5), sample(2, 9), sample(3, 4, partition=1)]
    assert offset_ranges(batch) == [{"topic": "t", "partition": 0, "first": 5, "last": 9},
                                    {"topic": "t", "partition": 1, "first": 4, "last": 4}]
