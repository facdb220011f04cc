"""Two digit tasks that conflict on purpose, for forgetting experiments (bench/forgetting.py,
tests/test_quality.py).

Task A is the tiny model's digit task (each digit plus one); task B asks the opposite of
the same digits (each digit minus one), its prompt prefixed with `b:`. A model tuned on B
alone subtracts whatever the prompt, and so forgets A; both can be held at once only by
reading the prefix. (The prefix comes first on purpose: in a causal model the digits can
see it. With a marker after the digits, "x=1234;z=", the tiny Llama learned the two
tasks together far more slowly.)

>>> task_a(1, seed=0), task_b(1, seed=0)
([('x=6311;y=', '7422')], [('b:x=6311;y=', '5200')])
"""

from __future__ import annotations

from typing import Iterable

from streamtune.tinymodel import digit_pairs


def _minus_one(digits: str) -> str:
    return "".join(str((int(d) - 1) % 10) for d in digits)


def task_a(n: int, seed: int, exclude: Iterable[str] = frozenset()) -> list[tuple[str, str]]:
    """``x=1234;y=`` -> ``2345``: the digit task of streamtune.tinymodel."""
    return digit_pairs(n, seed, exclude)


def task_b(n: int, seed: int, exclude: Iterable[str] = frozenset()) -> list[tuple[str, str]]:
    """``b:x=1234;y=`` -> ``0123``: each digit minus one, mod 10."""
    return [(f"b:x={p[2:6]};y=", _minus_one(p[2:6])) for p, _ in digit_pairs(n, seed, exclude)]


def digits_of(pairs: Iterable[tuple[str, str]]) -> set[str]:
    """The digit strings of prompts (to keep held-out sets disjoint from training sets)."""
    return {p.removeprefix("b:")[2:6] for p, _ in pairs}
