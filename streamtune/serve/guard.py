"""Automatic rollback: online metrics per arm from served responses and the feedback citing them.

The guard reads the inference log (which version answered each request, in which arm, for
which user) and the feedback topics (events with a `request_id`), and keeps, per model and
version, the outcomes of the last `window` judged responses: accepted, or corrected /
rejected, with the user each response was served to. The online metric is the acceptance rate.

Two rules, each needing `min_events` judged responses, from at least `min_distinct_users`
distinct users, on both sides:
- a candidate whose acceptance is below the champion's by more than `margin` is taken out
  of traffic: its `candidate` alias is deleted in MLflow, so every server stops routing to it;
- a champion promoted while the guard watched, whose acceptance falls below its
  predecessor's (as measured while that one was champion) by more than `margin`, is rolled
  back: `champion` moves back to the predecessor (never to a version the guard itself
  rolled back).

Who may steer it. Feedback is posted by whoever holds the public feedback token, so:
- with a response signing key (core.response_ids: the key the servers sign ids with), a
  feedback event citing an id that does not verify is ignored (counted `unsigned`), and so
  is an inference record whose id does not verify (`unsigned_responses`): only responses a
  server issued are judged, even for records that reached Kafka without the API's checks;
- a response is judged once: a second event citing the same `request_id` (or repeating a
  `sample_id`) is counted `duplicate` and ignored, so one response cannot be cited a hundred times;
- the user of a judgment is the inference record's `user` (the OpenAI `user` the response
  was served to, recorded by the server; feedback events carry none). Responses served
  without a user count as one user. Whoever names users on inference calls (the
  application holding the inference token) vouches for them; a rule that would fire with
  fewer distinct users is counted `too_few_users` and waits.

Decisions survive restarts. The guard rebuilds its statistics by reading the topics from
their beginning (at start only: after a broker error reading resumes where it stopped), and
counts idempotently (one response per `request_id`, one judgment per response), so the
counters after a restart equal those of an uninterrupted run. What it decided is durable in
MLflow, on the judged version:
- `streamtune.guard.<decision>`: the decision's state, written BEFORE the alias moves
  (`pending`, with this guard's `owner`), then `applied` (or `stale`). A replay that reaches
  a decision recorded `applied` or `stale` takes it up as it was and never applies it again;
  one left `pending` by a guard that died mid-way is finished (the move is compare-and-set,
  so it happens at most once);
- `streamtune.rollback`: the decision with its numbers (what the console shows).
Every move is compare-and-set (connectors.mlflow_registry.move_alias_if): the alias moves
only from the version that was judged; otherwise the move is stale, logged and skipped. An
MLflow error while deciding is logged, counted (`decision_errors`) and the decision retried
`retry_s` later. An applied decision also goes to the promotion log (actor `guard`), the
alias-moves topic and the server log.

`STREAMTUNE_GUARD_STATELESS=1` (tests only: the pre-durability behaviour) turns the restart
defence off, so that its test can show it fails without it: the guard ignores the decision
states it recorded in MLflow (a replay from the beginning takes every decision again) and
moves aliases without compare-and-set (whatever the alias points at now). Unset, or any
other value: the behaviour above.

>>> stats = ArmStats(window=4)
>>> for outcome, user in ((True, "a"), (True, "b"), (False, "a"), (True, None), (True, "a")):
...     stats.add(outcome, user)
>>> stats.events, stats.acceptance, stats.users
(4, 0.75, 3)
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from core import defaults, transport
from core.errors import InvalidMessage
from core.messages import AliasMove, FeedbackSample, InferenceRecord
from core.response_ids import verify_response_id

log = logging.getLogger("streamtune.guard")

# What the guard counts per (model, arm): responses in the inference log, judged feedback, by label.
ARM_COUNTS = ("responses", "judged", "accepted", "corrected", "rejected", "unlabeled")
ROLLBACK_TAG = "streamtune.rollback"
STATE_TAG = "streamtune.guard."          # + decision kind: {"state": pending|applied|stale, ...}
PENDING_GRACE_MS = 60_000                 # another live guard's pending decision is left to it this long
STATELESS_ENV = "STREAMTUNE_GUARD_STATELESS"  # "1": tests only, the pre-durability behaviour (see above)


@dataclass(frozen=True)
class GuardSettings:
    bootstrap: str
    tracking_uri: str
    inference_log_topic: str
    feedback_topics: str                 # regex of the topics whose samples may cite a request_id
    promotion_log: Optional[Path] = None
    margin: float = 0.1
    min_events: int = 30
    window: int = 200
    remembered_requests: int = 200_000   # request_id -> (model, version, arm, user), oldest forgotten
    min_distinct_users: int = 5          # 1 turns the rule off (tests/demo only)
    signing_key: Optional[bytes] = field(default=None, repr=False)  # None: ids not verified
    owner: str = field(default_factory=socket.gethostname)  # names this guard on its pending decisions
    retry_s: float = 5.0                 # a decision that failed on MLflow is tried again after this


@dataclass
class ArmStats:
    window: int
    outcomes: deque = field(default_factory=deque)   # (accepted, user)

    def add(self, accepted: bool, user: Optional[str] = None) -> None:
        self.outcomes.append((accepted, user))
        while len(self.outcomes) > self.window:
            self.outcomes.popleft()

    @property
    def events(self) -> int:
        return len(self.outcomes)

    @property
    def acceptance(self) -> float:
        return sum(a for a, _ in self.outcomes) / len(self.outcomes) if self.outcomes else 0.0

    @property
    def users(self) -> int:
        """Distinct users among the judged responses in the window (no user counts as one)."""
        return len({u for _, u in self.outcomes})


class _Bounded(OrderedDict):
    """An insertion-ordered dict that forgets its oldest entries beyond `limit`."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def remember(self, key, value=True) -> None:
        self[key] = value
        while len(self) > self.limit:
            self.popitem(last=False)


class OnlineGuard:
    def __init__(self, settings: GuardSettings, signing_key: Optional[bytes] = None):
        self.settings = settings
        self.signing_key = settings.signing_key or signing_key
        limit = settings.remembered_requests
        self.requests: _Bounded = _Bounded(limit)       # request_id -> (model_id, version, arm, user)
        self.judged_requests: _Bounded = _Bounded(limit)
        self.seen_samples: _Bounded = _Bounded(limit)   # (model_id, sample_id) of cited feedback
        self.stats: dict[tuple[str, int], ArmStats] = {}
        self.champions: dict[str, list[int]] = {}      # model_id -> champion versions seen, in order
        self.candidates: dict[str, int] = {}            # model_id -> last version answering as candidate
        # Feedback read before the response it cites (two topics, read side by side).
        self.waiting: _Bounded = _Bounded(limit)
        self.decided: dict[tuple[str, int, str], str] = {}   # (model, version, kind) -> applied | stale
        self.retry_at: dict[str, float] = {}                 # model_id -> when to evaluate it again
        self.decisions: list[dict] = []
        self.counts = {"responses": 0, "feedback": 0, "judged": 0, "uncited": 0, "unknown_request": 0,
                       "unsigned": 0, "unsigned_responses": 0, "duplicate": 0, "too_few_users": 0,
                       "decision_errors": 0, "stale_moves": 0}
        # (model_id, arm) -> responses logged and judged feedback by label, over everything the
        # topics hold (all time, unlike `stats`, which keeps the last `window` per version).
        self.arms: dict[tuple[str, str], dict[str, int]] = {}
        self.stateless = os.environ.get(STATELESS_ENV) == "1"  # tests only: the restart defence off
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _signed(self, request_id: str) -> bool:
        return self.signing_key is None or verify_response_id(self.signing_key, request_id)

    # -- input --------------------------------------------------------------------------
    def on_response(self, record: InferenceRecord) -> None:
        if record.request_id in self.requests:  # a replayed record: counted once
            self.counts["duplicate"] += 1
            return
        if not self._signed(record.request_id):
            self.counts["unsigned_responses"] += 1
            return
        self.counts["responses"] += 1
        self._arm(record.model_id, record.arm)["responses"] += 1
        self.requests.remember(record.request_id, (record.model_id, record.version, record.arm, record.user))
        if record.arm == "champion" and record.version is not None:
            seen = self.champions.setdefault(record.model_id, [])
            if not seen or seen[-1] != record.version:
                seen.append(record.version)
        elif record.arm == "candidate" and record.version is not None:
            self.candidates[record.model_id] = record.version
        early = self.waiting.pop(record.request_id, None)
        if early is not None:
            self._judge(early)

    def on_feedback(self, sample: FeedbackSample) -> Optional[dict]:
        if sample.request_id is None:
            self.counts["feedback"] += 1
            self.counts["uncited"] += 1
            return None
        if (sample.model_id, sample.sample_id) in self.seen_samples or sample.request_id in self.judged_requests \
                or sample.request_id in self.waiting:
            self.counts["duplicate"] += 1  # a replay, or a second judgment of one response
            return None
        self.counts["feedback"] += 1
        self.seen_samples.remember((sample.model_id, sample.sample_id))
        if not self._signed(sample.request_id):
            self.counts["unsigned"] += 1
            return None
        if sample.request_id not in self.requests:
            self.waiting.remember(sample.request_id, sample)
            return None
        return self._judge(sample)

    def _judge(self, sample: FeedbackSample) -> Optional[dict]:
        model_id, version, arm, user = self.requests[sample.request_id]
        self.judged_requests.remember(sample.request_id)
        counts = self._arm(model_id, arm)
        counts["judged"] += 1
        counts[sample.label or "unlabeled"] += 1
        if version is None:  # the base model answered: nothing to roll back
            self.counts["base"] = self.counts.get("base", 0) + 1
            return None
        self.counts["judged"] += 1
        self.stats.setdefault((model_id, version), ArmStats(self.settings.window)).add(sample.label == "accepted",
                                                                                        user)
        return self.evaluate(model_id)

    def _arm(self, model_id: str, arm: str) -> dict[str, int]:
        return self.arms.setdefault((model_id, arm), dict.fromkeys(ARM_COUNTS, 0))

    # -- rules --------------------------------------------------------------------------
    def _enough(self, *sides: Optional[ArmStats]) -> bool:
        return all(side is not None and side.events >= self.settings.min_events for side in sides)

    def _trusted(self, *sides: ArmStats) -> bool:
        if all(side.users >= self.settings.min_distinct_users for side in sides):
            return True
        self.counts["too_few_users"] += 1
        return False

    def evaluate(self, model_id: str) -> Optional[dict]:
        """Apply both rules to the model's current aliases (as the responses show them)."""
        champions = self.champions.get(model_id, [])
        if not champions:
            return None
        champion = champions[-1]
        candidate = self.candidates.get(model_id)
        margin = self.settings.margin
        champ = self.stats.get((model_id, champion))
        if candidate is not None and candidate != champion:
            cand = self.stats.get((model_id, candidate))
            if self._enough(champ, cand) and cand.acceptance < champ.acceptance - margin \
                    and (model_id, candidate, "candidate_removed") not in self.decided and self._trusted(champ, cand):
                return self._decide(model_id, candidate, "candidate_removed", {
                    "candidate": candidate, "candidate_acceptance": round(cand.acceptance, 4),
                    "candidate_events": cand.events, "candidate_users": cand.users, "champion": champion,
                    "champion_acceptance": round(champ.acceptance, 4), "champion_events": champ.events,
                    "champion_users": champ.users, "margin": margin})
        if len(champions) >= 2 and champ is not None:
            previous = champions[-2]
            before = self.stats.get((model_id, previous))
            if self._enough(before, champ) and champ.acceptance < before.acceptance - margin \
                    and (model_id, champion, "champion_rolled_back") not in self.decided \
                    and self.decided.get((model_id, previous, "champion_rolled_back")) != "applied" \
                    and self._trusted(before, champ):
                return self._decide(model_id, champion, "champion_rolled_back", {
                    "champion": champion, "champion_acceptance": round(champ.acceptance, 4),
                    "champion_events": champ.events, "champion_users": champ.users, "previous": previous,
                    "previous_acceptance": round(before.acceptance, 4), "previous_events": before.events,
                    "previous_users": before.users, "margin": margin})
        return None

    def _decide(self, model_id: str, version: int, kind: str, numbers: dict) -> Optional[dict]:
        """Take one decision at most once, durably; an MLflow error leaves it to a retry."""
        if (model_id, version, kind) in self.decided:
            return None
        try:
            return self._apply(model_id, version, kind, numbers)
        except Exception as e:  # MLflow (or the network) failed mid-way: the state tag says how far it got
            self.counts["decision_errors"] += 1
            self.retry_at[model_id] = time.monotonic() + self.settings.retry_s
            log.warning("%s v%d: %s not taken yet (%s: %s); retried in %.0f s", model_id, version, kind,
                        type(e).__name__, e, self.settings.retry_s)
            return None

    def _apply(self, model_id: str, version: int, kind: str, numbers: dict) -> Optional[dict]:
        from connectors.mlflow_registry import alias_version, make_client, move_alias_if

        client = make_client(self.settings.tracking_uri)
        key, state_tag = (model_id, version, kind), STATE_TAG + kind
        tags = client.get_model_version(model_id, str(version)).tags
        recorded = {} if self.stateless else _json(tags.get(state_tag))
        now = int(time.time() * 1000)
        if recorded.get("state") in ("applied", "stale"):  # taken before (by this guard before a restart, or another)
            self.decided[key] = recorded["state"]
            earlier = _json(tags.get(ROLLBACK_TAG))
            if recorded["state"] == "applied" and earlier.get("decision") == kind:
                self.decisions.append(earlier)
            log.info("%s v%d: %s already %s; not applied again", model_id, version, kind, recorded["state"])
            return None
        if recorded.get("state") == "pending" and recorded.get("owner") != self.settings.owner \
                and now - recorded.get("ts", 0) < PENDING_GRACE_MS:
            raise RuntimeError(f"guard {recorded.get('owner')} is taking this decision")
        if not recorded:  # the intent first: a guard killed after the move finds it and finishes
            client.set_model_version_tag(model_id, str(version), state_tag,
                                         json.dumps({"state": "pending", "owner": self.settings.owner, "ts": now}))
        if kind == "candidate_removed":
            alias, to_version = "candidate", None
        else:
            alias, to_version = "champion", numbers["previous"]
        if self.stateless:
            moved = _move_unchecked(client, model_id, alias, to_version)
        else:
            moved = move_alias_if(client, model_id, alias, version, to_version)
        if not moved and recorded.get("state") == "pending" and alias_version(client, model_id, alias) == to_version:
            moved = True  # this decision's own move, made before the guard that made it died
            log.info("%s v%d: %s finished (its move was made before a restart)", model_id, version, kind)
        decision = {"ts": now, "model_id": model_id, "version": version, "decision": kind, **numbers}
        if not moved:
            current = alias_version(client, model_id, alias)
            client.set_model_version_tag(model_id, str(version), state_tag, json.dumps(
                {"state": "stale", "owner": self.settings.owner, "ts": now, "alias_was": current}))
            self.decided[key] = "stale"
            self.counts["stale_moves"] += 1
            log.warning("%s v%d: %s is stale (%s points at %s, not v%d): skipped", model_id, version, kind, alias,
                        f"v{current}" if current is not None else "nothing", version)
            return None
        self._announce(AliasMove(model_id=model_id, alias=alias, version=to_version, from_version=version,
                                 actor="guard", ts=now))
        if self.settings.promotion_log is not None:
            from streamtune.api.jobs_file import PromotionLog
            PromotionLog(self.settings.promotion_log).append(model_id, alias, version, to_version,
                                                             f"guard: {kind} {json.dumps(numbers)}")
        client.set_model_version_tag(model_id, str(version), ROLLBACK_TAG, json.dumps(decision))
        client.set_model_version_tag(model_id, str(version), state_tag,
                                     json.dumps({"state": "applied", "owner": self.settings.owner, "ts": now}))
        if alias == "champion":
            self.champions[model_id].append(to_version)
        self.decided[key] = "applied"
        self.decisions.append(decision)
        log.warning("%s v%d: %s %s", model_id, version, kind, json.dumps(numbers))
        return decision

    def _announce(self, move: AliasMove) -> None:
        """Followers read the registry at once (a hint: they would see the move at their next poll)."""
        from kafka import KafkaProducer

        from connectors.kafka import create_topic
        try:
            create_topic(self.settings.bootstrap, defaults.ALIAS_MOVES_TOPIC)
            producer = KafkaProducer(bootstrap_servers=self.settings.bootstrap, acks="all", **transport.kafka_python_kwargs())
            producer.send(defaults.ALIAS_MOVES_TOPIC, key=move.model_id.encode(), value=move.to_json().encode(),
                          timestamp_ms=move.ts).get(timeout=10)
            producer.close(5)
        except Exception as e:
            log.warning("alias move of %s not announced: %s", move.model_id, e)

    # -- running ------------------------------------------------------------------------
    def start(self) -> "OnlineGuard":
        self._thread = threading.Thread(target=self._run, name="online-guard", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        from connectors.kafka import follow_topics

        pattern = re.compile(self.settings.feedback_topics)
        follow_topics(self.settings.bootstrap,
                      lambda t: t == self.settings.inference_log_topic or bool(pattern.fullmatch(t)),
                      self._on_record, self._stop, on_poll=self._on_poll,
                      on_error=lambda message: log.warning("guard: %s", message))

    def _on_record(self, topic: str, raw: bytes) -> None:
        try:
            if topic == self.settings.inference_log_topic:
                self.on_response(InferenceRecord.from_json(raw))
            else:
                self.on_feedback(FeedbackSample.from_json(raw))
        except InvalidMessage:
            pass  # not ours to judge: the job's validation dead-letters bad feedback
        except Exception:  # a bug must not stop the guard, nor make it re-read the record forever
            self.counts["errors"] = self.counts.get("errors", 0) + 1
            log.exception("guard: record of %s skipped", topic)

    def _on_poll(self, got_records: bool) -> None:
        """Decisions that failed on MLflow are tried again once due."""
        now = time.monotonic()
        for model_id, due in list(self.retry_at.items()):
            if now >= due:
                del self.retry_at[model_id]
                self.evaluate(model_id)


def _move_unchecked(client, model_id: str, alias: str, to_version: Optional[int]) -> bool:
    """STREAMTUNE_GUARD_STATELESS (tests only): the move without compare-and-set, as before it."""
    from connectors.mlflow_registry import alias_version

    if to_version is not None:
        client.set_registered_model_alias(model_id, alias, str(to_version))
    elif alias_version(client, model_id, alias) is not None:
        client.delete_registered_model_alias(model_id, alias)
    return True


def _json(value: Optional[str]) -> dict:
    try:
        parsed = json.loads(value) if value else {}
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}
