"""Automatic rollback: online metrics per arm from served responses and the feedback citing them.

The guard reads the inference log (which version answered each request, in which arm) and
the feedback topics (events with a `request_id`), and keeps, per model and version, the
outcomes of the last `window` judged responses: accepted, or corrected / rejected. The
online metric is the acceptance rate.

Two rules, each needing `min_events` judged responses on both sides:
- a candidate whose acceptance is below the champion's by more than `margin` is taken out
  of traffic: its `candidate` alias is deleted in MLflow, so every server stops routing to it;
- a champion promoted while the guard watched, whose acceptance falls below its
  predecessor's (as measured while that one was champion) by more than `margin`, is rolled
  back: `champion` moves back to the predecessor.

Each decision, with its numbers, goes on the version as the MLflow tag `streamtune.rollback`,
to the promotion log (actor `guard`), and to the server log.

>>> stats = ArmStats(window=4)
>>> for outcome in (True, True, False, True, True):
...     stats.add(outcome)
>>> stats.events, stats.acceptance
(4, 0.75)
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from core import defaults
from core.errors import InvalidMessage
from core.messages import AliasMove, FeedbackSample, InferenceRecord

log = logging.getLogger("streamtune.guard")

# What the guard counts per (model, arm): responses in the inference log, judged feedback, by label.
ARM_COUNTS = ("responses", "judged", "accepted", "corrected", "rejected", "unlabeled")


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
    remembered_requests: int = 200_000   # request_id -> (model, version, arm), oldest forgotten


@dataclass
class ArmStats:
    window: int
    outcomes: deque = field(default_factory=deque)

    def add(self, accepted: bool) -> None:
        self.outcomes.append(accepted)
        while len(self.outcomes) > self.window:
            self.outcomes.popleft()

    @property
    def events(self) -> int:
        return len(self.outcomes)

    @property
    def acceptance(self) -> float:
        return sum(self.outcomes) / len(self.outcomes) if self.outcomes else 0.0


class OnlineGuard:
    def __init__(self, settings: GuardSettings):
        self.settings = settings
        self.requests: OrderedDict[str, tuple[str, Optional[int], str]] = OrderedDict()
        self.stats: dict[tuple[str, int], ArmStats] = {}
        self.champions: dict[str, list[int]] = {}      # model_id -> champion versions seen, in order
        self.candidates: dict[str, int] = {}            # model_id -> last version answering as candidate
        # Feedback read before the response it cites (two topics, read side by side).
        self.waiting: OrderedDict[str, FeedbackSample] = OrderedDict()
        self.decided: set[tuple[str, int, str]] = set()
        self.decisions: list[dict] = []
        self.counts = {"responses": 0, "feedback": 0, "judged": 0, "uncited": 0, "unknown_request": 0}
        # (model_id, arm) -> responses logged and judged feedback by label, since the guard started
        # reading (all time, unlike `stats`, which keeps the last `window` per version).
        self.arms: dict[tuple[str, str], dict[str, int]] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- input --------------------------------------------------------------------------
    def on_response(self, record: InferenceRecord) -> None:
        self.counts["responses"] += 1
        self._arm(record.model_id, record.arm)["responses"] += 1
        self.requests[record.request_id] = (record.model_id, record.version, record.arm)
        while len(self.requests) > self.settings.remembered_requests:
            self.requests.popitem(last=False)
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
        self.counts["feedback"] += 1
        if sample.request_id is None:
            self.counts["uncited"] += 1
            return None
        if sample.request_id not in self.requests:
            self.waiting[sample.request_id] = sample
            while len(self.waiting) > self.settings.remembered_requests:
                self.waiting.popitem(last=False)
                self.counts["unknown_request"] += 1
            return None
        return self._judge(sample)

    def _judge(self, sample: FeedbackSample) -> Optional[dict]:
        model_id, version, arm = self.requests[sample.request_id]
        counts = self._arm(model_id, arm)
        counts["judged"] += 1
        counts[sample.label or "unlabeled"] += 1
        if version is None:  # the base model answered: nothing to roll back
            self.counts["base"] = self.counts.get("base", 0) + 1
            return None
        self.counts["judged"] += 1
        self.stats.setdefault((model_id, version), ArmStats(self.settings.window)).add(sample.label == "accepted")
        return self.evaluate(model_id)

    def _arm(self, model_id: str, arm: str) -> dict[str, int]:
        return self.arms.setdefault((model_id, arm), dict.fromkeys(ARM_COUNTS, 0))

    # -- rules --------------------------------------------------------------------------
    def evaluate(self, model_id: str) -> Optional[dict]:
        """Apply both rules to the model's current aliases (as the responses show them)."""
        champions = self.champions.get(model_id, [])
        if not champions:
            return None
        champion = champions[-1]
        candidate = self.candidates.get(model_id)
        s, margin = self.settings, self.settings.margin
        champ = self.stats.get((model_id, champion))
        if candidate is not None and candidate != champion:
            cand = self.stats.get((model_id, candidate))
            if (champ and cand and champ.events >= s.min_events and cand.events >= s.min_events
                    and cand.acceptance < champ.acceptance - margin):
                return self._decide(model_id, candidate, "candidate_removed", {
                    "candidate": candidate, "candidate_acceptance": round(cand.acceptance, 4),
                    "candidate_events": cand.events, "champion": champion,
                    "champion_acceptance": round(champ.acceptance, 4), "champion_events": champ.events,
                    "margin": margin})
        if len(champions) >= 2 and champ is not None:
            previous = champions[-2]
            before = self.stats.get((model_id, previous))
            if (before and before.events >= s.min_events and champ.events >= s.min_events
                    and champ.acceptance < before.acceptance - margin):
                return self._decide(model_id, champion, "champion_rolled_back", {
                    "champion": champion, "champion_acceptance": round(champ.acceptance, 4),
                    "champion_events": champ.events, "previous": previous,
                    "previous_acceptance": round(before.acceptance, 4), "previous_events": before.events,
                    "margin": margin})
        return None

    def _decide(self, model_id: str, version: int, kind: str, numbers: dict) -> Optional[dict]:
        if (model_id, version, kind) in self.decided:
            return None
        from mlflow import MlflowClient

        client = MlflowClient(self.settings.tracking_uri, self.settings.tracking_uri)
        aliases = client.get_registered_model(model_id).aliases
        decision = {"ts": int(time.time() * 1000), "model_id": model_id, "version": version, "decision": kind,
                    **numbers}
        if kind == "candidate_removed":
            if int(aliases.get("candidate", -1)) == version:
                client.delete_registered_model_alias(model_id, "candidate")
            from_version, to_version, alias = version, None, "candidate"
        else:
            previous = numbers["previous"]
            client.set_registered_model_alias(model_id, "champion", previous)
            from_version, to_version, alias = version, previous, "champion"
            self.champions[model_id].append(previous)
        client.set_model_version_tag(model_id, str(version), "streamtune.rollback", json.dumps(decision))
        if self.settings.promotion_log is not None:
            from streamtune.api.jobs_file import PromotionLog
            PromotionLog(self.settings.promotion_log).append(model_id, alias, from_version, to_version,
                                                             f"guard: {kind} {json.dumps(numbers)}")
        self._announce(AliasMove(model_id=model_id, alias=alias, version=to_version, from_version=from_version,
                                 actor="guard", ts=decision["ts"]))
        self.decided.add((model_id, version, kind))
        self.decisions.append(decision)
        log.warning("%s v%d: %s %s", model_id, version, kind, json.dumps(numbers))
        return decision

    def _announce(self, move: AliasMove) -> None:
        """Followers read the registry at once (a hint: they would see the move at their next poll)."""
        from kafka import KafkaProducer

        from connectors.kafka import create_topic
        try:
            create_topic(self.settings.bootstrap, defaults.ALIAS_MOVES_TOPIC)
            producer = KafkaProducer(bootstrap_servers=self.settings.bootstrap, acks="all")
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
                      self._on_record, self._stop, on_error=lambda message: log.warning("guard: %s", message))

    def _on_record(self, topic: str, raw: bytes) -> None:
        try:
            if topic == self.settings.inference_log_topic:
                self.on_response(InferenceRecord.from_json(raw))
            else:
                self.on_feedback(FeedbackSample.from_json(raw))
        except InvalidMessage:
            pass  # not ours to judge: the job's validation dead-letters bad feedback
