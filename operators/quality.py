"""Learning quality per model (pure Python): held-out selection, eval sets, the replay
buffer and the promotion gate. The trainer (operators/finetune_function.py) keeps a
`QualityState` per model in keyed state and scores versions with operators/lora_trainer.py.

Everything here is decided by hashes and seeds, never by arrival timing or a clock, so a
replay after a restore holds out, keeps, replays and promotes exactly the same samples.

Held out: a sample whose hash falls below the fraction (a CDC sample hashes its row, so a
row's successive versions stay on one side). It is never trained on:

>>> [is_held_out(f"s{i}", "", 0.25) for i in range(8)]
[False, False, False, False, False, False, True, True]

Reservoirs keep the `k` items of lowest hash priority (bottom-k sampling: a uniform sample
of everything seen, the same whatever the arrival order, with no generator to checkpoint):

>>> [s.sample_id for s in reservoir([kept(f"s{i}") for i in range(100)], 3)]
['s22', 's64', 's37']

Eval sets: the newest held-out samples (`recent`, FIFO); those pushed out of it go to the
`retained` reservoir, the forgetting guard's older data:

>>> q = QualityState().with_held_out([kept(f"a{i}") for i in range(6)], recent_size=4, retained_size=8)
>>> [s.sample_id for s in q.recent], sorted(s.sample_id for s in q.retained)
(['a2', 'a3', 'a4', 'a5'], ['a0', 'a1'])
>>> [s.sample_id for s in q.without_row("")[0].recent]  # rows: only CDC samples have one
['a2', 'a3', 'a4', 'a5']
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import stat
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Optional

from core.messages import EvalScore, EvalSetResult, EvaluationConfig, GateDecision


@dataclass(frozen=True)
class Kept:
    """A sample kept beyond its window: in an eval set or the replay buffer."""

    sample_id: str
    prompt: str
    completion: str
    weight: float = 1.0
    row_key: str = ""  # CDC samples: the row, so a retraction finds it


def kept(sample_id: str, prompt: str = "p", completion: str = "c", weight: float = 1.0, row_key: str = "") -> Kept:
    return Kept(sample_id, prompt, completion, weight, row_key)


def _unit(key: str, salt: str) -> float:
    """A hash of `key` as a number in [0, 1)."""
    return int(hashlib.sha256(f"{salt}:{key}".encode()).hexdigest()[:13], 16) / 16 ** 13


def is_held_out(sample_id: str, row_key: str, fraction: float) -> bool:
    return fraction > 0 and _unit(row_key or sample_id, "holdout") < fraction


def reservoir(items: Iterable[Kept], k: int, salt: str = "reservoir") -> list[Kept]:
    """The `k` distinct samples of lowest hash priority, lowest first (a later copy of a
    sample_id replaces the earlier one)."""
    unique = {s.sample_id: s for s in items}
    return sorted(unique.values(), key=lambda s: _unit(s.sample_id, salt))[:k]


@dataclass(frozen=True)
class QualityState:
    """What the trainer keeps per model for learning quality (pickled into keyed state)."""

    recent: tuple[Kept, ...] = ()
    retained: tuple[Kept, ...] = ()
    replay: tuple[Kept, ...] = ()
    held_out_ids: tuple[str, ...] = ()  # held out since the last version (for its lineage)
    # The version the trainer last promoted: {version_id, artifact_uri, sha256, adapter (JSON), loss_after}.
    champion: Optional[dict] = None

    def with_held_out(self, samples: list[Kept], recent_size: int, retained_size: int) -> "QualityState":
        ids = self.held_out_ids + tuple(s.sample_id for s in samples)
        scored = [s for s in samples if s.weight > 0]  # a rejected completion is no target to match
        recent = list(self.recent) + scored
        cut = max(len(recent) - recent_size, 0)
        retained = reservoir(list(self.retained) + recent[:cut], retained_size, "retained")
        return replace(self, recent=tuple(recent[cut:]), retained=tuple(retained), held_out_ids=ids)

    def with_trained(self, samples: list, buffer_size: int) -> "QualityState":
        """Trained samples join the replay buffer (a reservoir over all of them)."""
        new = [Kept(s.sample_id, s.prompt, s.completion, s.weight, s.row_key) for s in samples if s.weight > 0]
        return replace(self, replay=tuple(reservoir(list(self.replay) + new, buffer_size, "replay")))

    def without_row(self, row_key: str) -> tuple["QualityState", int]:
        """A retracted row leaves the eval sets and the replay buffer; returns how many went."""
        if not row_key:
            return self, 0
        before = len(self.recent) + len(self.retained) + len(self.replay)
        drop = lambda items: tuple(s for s in items if s.row_key != row_key)  # noqa: E731
        after = replace(self, recent=drop(self.recent), retained=drop(self.retained), replay=drop(self.replay))
        return after, before - len(after.recent) - len(after.retained) - len(after.replay)


def draw_replay(buffer: tuple[Kept, ...], new_samples: int, ratio: float, seed: int) -> list[Kept]:
    """`ratio` replayed samples per new one (fewer while the buffer is small), seeded.

    >>> buffer = tuple(kept(f"s{i}") for i in range(10))
    >>> [s.sample_id for s in draw_replay(buffer, 4, 0.5, seed=7)] == [s.sample_id for s in draw_replay(buffer, 4, 0.5, 7)]
    True
    >>> len(draw_replay(buffer, 4, 0.5, 7)), len(draw_replay(buffer, 40, 1.0, 7)), draw_replay((), 4, 1.0, 7)
    (2, 10, [])
    """
    n = min(round(new_samples * ratio), len(buffer))
    return random.Random(seed).sample(list(buffer), n) if n else []


_FIXED: dict[tuple, list[Kept] | Exception] = {}
_FIXED_LOCK = threading.Lock()
EVAL_MAX_BYTES = 64 << 20   # default cap of a fixed eval file (STREAMTUNE_EVAL_MAX_BYTES)
_CHUNK = 1 << 20


def eval_roots(artifact_store: Optional[str] = None, env: Optional[dict] = None) -> list[Path]:
    """Where a fixed eval file may be: the directories of STREAMTUNE_EVAL_ROOTS (os.pathsep-
    separated) and a local artifact store.

    >>> [str(p) for p in eval_roots("file:///data/adapters", {"STREAMTUNE_EVAL_ROOTS": "/data/eval"})]
    ['/data/eval', '/data/adapters']
    """
    env = os.environ if env is None else env
    roots = [Path(d) for d in env.get("STREAMTUNE_EVAL_ROOTS", "").split(os.pathsep) if d]
    if artifact_store and (artifact_store.startswith("file://") or "://" not in artifact_store):
        roots.append(Path(artifact_store.removeprefix("file://")))
    return roots


def eval_max_bytes(env: Optional[dict] = None) -> int:
    return int((os.environ if env is None else env).get("STREAMTUNE_EVAL_MAX_BYTES") or EVAL_MAX_BYTES)


def eval_unbounded(env: Optional[dict] = None) -> bool:
    """STREAMTUNE_EVAL_UNBOUNDED=1: no roots, no cap (the old behaviour; tests and demos only)."""
    return (os.environ if env is None else env).get("STREAMTUNE_EVAL_UNBOUNDED") == "1"


def _read_capped(path: Path, max_bytes: Optional[int]) -> str:
    """The file's text, read in chunks that stop at `max_bytes` (a device or a growing file
    never makes this allocate more); ValueError past the cap or for anything but a regular file."""
    with open(path, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError(f"{path} is not a regular file")
        chunks, total = [], 0
        while chunk := f.read(_CHUNK):
            total += len(chunk)
            if max_bytes is not None and total > max_bytes:
                raise ValueError(f"{path} is over the eval file cap of {max_bytes} bytes "
                                 "(STREAMTUNE_EVAL_MAX_BYTES); reading stopped there")
            chunks.append(chunk)
    return b"".join(chunks).decode()


def load_fixed(uri: str, size: int, roots: Optional[list[Path]] = None) -> list[Kept]:
    """A fixed eval set: JSONL of {"prompt", "completion"} (a local path or file:// URI),
    at most `size` lines (a hash sample beyond that), cached while the file is unchanged.

    Bounded: the file must be a regular file under one of `roots` (eval_roots(): the eval
    roots and the artifact store; symlinks resolved first) and at most eval_max_bytes(),
    enforced while reading. A failure is cached like a success, so replays of the same spec
    do not read the file again. OSError or ValueError when it cannot be used.

    >>> load_fixed("/dev/zero", 10, roots=[Path("/dev")])
    Traceback (most recent call last):
    ...
    ValueError: /dev/zero is not a regular file
    >>> load_fixed("/etc/hostname", 10, roots=[Path("/data/eval")])
    Traceback (most recent call last):
    ...
    ValueError: /etc/hostname is outside the eval roots (/data/eval; STREAMTUNE_EVAL_ROOTS or the artifact store)
    """
    unbounded = eval_unbounded()
    path = Path(uri.removeprefix("file://"))
    if not unbounded:
        path = path.resolve()
        allowed = [Path(r).resolve() for r in (roots if roots is not None else eval_roots())]
        if not any(path.is_relative_to(r) for r in allowed):
            raise ValueError(f"{path} is outside the eval roots ({os.pathsep.join(map(str, allowed)) or 'none set'}; "
                             "STREAMTUNE_EVAL_ROOTS or the artifact store)")
    st = os.stat(path)
    max_bytes = None if unbounded else eval_max_bytes()
    key = (str(path), st.st_ino, st.st_mtime_ns, st.st_size, size, max_bytes)
    with _FIXED_LOCK:
        if key not in _FIXED:
            try:
                _FIXED[key] = _parse_fixed(uri, _read_capped(path, max_bytes), size)
            except (OSError, ValueError) as e:
                _FIXED[key] = e
        found = _FIXED[key]
    if isinstance(found, Exception):
        raise found
    return found


def _parse_fixed(uri: str, text: str, size: int) -> list[Kept]:
    rows = []
    for n, line in enumerate(text.splitlines()):
        if line.strip():
            row = json.loads(line)
            if not isinstance(row, dict) or not row.get("prompt") or not row.get("completion"):
                raise ValueError(f"{uri} line {n + 1}: needs a prompt and a completion")
            rows.append(Kept(f"line{n + 1}", str(row["prompt"]), str(row["completion"])))
    return sorted(reservoir(rows, size, "fixed"), key=lambda s: int(s.sample_id[4:]))


@dataclass
class SetScores:
    """A set scored for the new version (`candidate`) and the champion, on the same samples;
    `*_correct`: which samples each answered exactly."""

    name: str
    size: int
    candidate: EvalScore
    champion: Optional[EvalScore] = None
    candidate_correct: tuple[bool, ...] = ()
    champion_correct: tuple[bool, ...] = ()
    tolerance: float = 0.0
    passed: bool = True
    shortfall: str = field(default="")


def forgotten(candidate_correct, champion_correct) -> Optional[float]:
    """Of the samples the champion answers exactly, the share the candidate misses (None: none).

    >>> forgotten([True, False, False, True], [True, True, False, False])
    0.5
    """
    known = [c for c, k in zip(candidate_correct, champion_correct) if k]
    return round(1 - sum(known) / len(known), 6) if known else None


def _worse(metric: str, s: SetScores) -> str:
    """'' when the candidate is within tolerance of the champion on this set, else how it fell short.

    The forgetting guard (retained, exact_match) counts answers lost, not the mean: a new
    version that learned newer data in `retained` must not buy that with older answers.
    """
    candidate, champion, tolerance = s.candidate, s.champion, s.tolerance
    if metric == "exact_match" and s.name == "retained":
        if candidate.forgotten is not None and candidate.forgotten > tolerance + 1e-9:
            known = sum(s.champion_correct)
            return f"forgot {candidate.forgotten:.3f} of the {known} answers the champion got right > {tolerance:g}"
    elif metric == "exact_match":
        if candidate.exact_match < champion.exact_match - tolerance - 1e-9:
            return f"exact_match {candidate.exact_match:.3f} < {champion.exact_match:.3f} - {tolerance:g}"
    elif candidate.loss > champion.loss + tolerance + 1e-9:
        return f"loss {candidate.loss:.4f} > {champion.loss:.4f} + {tolerance:g}"
    return ""


def decide(evaluation: EvaluationConfig, sets: list[SetScores], champion: Optional[dict], loss_after: float,
           problems: list[str] = ()) -> GateDecision:
    """The promotion decision for a new version scored beside the champion.

    >>> ev = EvaluationConfig(holdout_fraction=0.2, tolerance=0.0, forgetting_tolerance=0.05)
    >>> champ = {"version_id": "m@1#0:0-0:9", "loss_after": 0.4}
    >>> recent = SetScores("recent", 4, EvalScore(exact_match=0.75, loss=0.3), EvalScore(exact_match=0.25, loss=2.0),
    ...                    (True, True, True, False), (True, False, False, False))
    >>> old = SetScores("retained", 4, EvalScore(exact_match=0.5, loss=1.9), EvalScore(exact_match=0.5, loss=0.1),
    ...                 (False, False, True, True), (True, True, False, False))
    >>> d = decide(ev, [recent, old], champ, loss_after=0.2)
    >>> d.promote, d.rule, d.reason
    (False, 'eval', 'worse than champion m@1#0:0-0:9 on retained (forgetting guard): forgot 1.000 of the 2 answers the champion got right > 0.05')
    >>> decide(ev.model_copy(update={"forgetting_tolerance": 1.0}), [recent, old], champ, 0.2).promote
    True
    >>> d = decide(ev, [], champ, loss_after=0.5)
    >>> d.promote, d.rule, d.reason
    (False, 'loss', 'no eval data yet: loss rule, loss_after 0.5 > champion m@1#0:0-0:9 loss_after 0.4')
    >>> decide(ev, [recent], None, 0.5).rule
    'first_version'
    """
    results = []
    for s in sets:
        s.tolerance = evaluation.forgetting_tolerance if s.name == "retained" else evaluation.tolerance
        if s.champion is not None:
            if s.name == "retained":
                s.candidate = s.candidate.model_copy(update={
                    "forgotten": forgotten(s.candidate_correct, s.champion_correct)})
            s.shortfall = _worse(evaluation.metric, s)
            s.passed = not s.shortfall
        results.append(EvalSetResult(name=s.name, size=s.size, candidate=s.candidate, champion=s.champion,
                                     tolerance=s.tolerance, passed=s.passed))
    common = dict(metric=evaluation.metric, sets=results,
                  champion_version_id=champion["version_id"] if champion else None)
    if champion is None:
        return GateDecision(promote=True, rule="first_version", reason="no champion yet", **common)
    name = champion["version_id"]
    if problems:
        return GateDecision(promote=False, rule="eval", reason="not evaluated: " + "; ".join(problems), **common)
    if not sets:
        promote = loss_after <= champion["loss_after"]
        return GateDecision(promote=promote, rule="loss", reason=(
            f"no eval data yet: loss rule, loss_after {loss_after:g} {'<=' if promote else '>'} champion {name} "
            f"loss_after {champion['loss_after']:g}"), **common)
    failed = [s for s in sets if not s.passed]
    if failed:
        reason = f"worse than champion {name} on " + "; ".join(
            f"{s.name}{' (forgetting guard)' if s.name == 'retained' else ''}: {s.shortfall}" for s in failed)
        return GateDecision(promote=False, rule="eval", reason=reason, **common)
    scores = ", ".join(f"{s.name} {_metric(evaluation.metric, s.candidate)} vs {_metric(evaluation.metric, s.champion)}"
                       + (f" (forgot {s.candidate.forgotten:.3f})" if s.candidate.forgotten is not None else "")
                       for s in sets)
    return GateDecision(promote=True, rule="eval", reason=f"not worse than champion {name} on {scores}", **common)


def _metric(metric: str, score: EvalScore) -> str:
    return f"{score.exact_match:.3f}" if metric == "exact_match" else f"{score.loss:.4f}"
