"""The rollback guard cannot be steered by strangers, nor turned back by restarts.

Each test runs `streamtune serve` as a process against the real stack (Kafka, MLflow), with
tiny LoRA versions registered by the test, and talks to it over HTTP; feedback goes to the
feedback topic as the API would write it (the guard is the defence behind the API's own
checks, so it must hold for an event that got past them). Each defence's test runs with the
defence on (the attack fails) and off (the attack succeeds):

| defence                | off switch                            | attack                                      |
|------------------------|---------------------------------------|---------------------------------------------|
| distinct users         | `--rollback-min-users 1`              | one user removes a candidate / rolls back    |
| signed response ids    | no signing key                        | records forged on the topics remove a candidate |
| decisions kept durably | `STREAMTUNE_GUARD_STATELESS=1`        | kill -9 and restart: replays re-apply decisions |

The restart test kills -9 and restarts the server five times during a judged rollout.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import requests

from core import defaults
from core.messages import FeedbackSample, InferenceRecord
from streamtune.local_job import kill_group, spawn_logged
from streamtune.testing import free_port, random_adapter_files, wait_for

pytestmark = [pytest.mark.security]
KEY = "guard-test-signing-key-0123456789"
PROMPT = "x=12;y="


@functools.lru_cache(maxsize=None)
def adapter_files(base_model: str, seed: int) -> tuple[tuple, str]:
    """A random adapter per seed, built once (several rollouts share seeds)."""
    files, sha256 = random_adapter_files(base_model, seed)
    return tuple(files.items()), sha256


class Rollout:
    """A model with `versions` registered versions (MLflow 1..n) and their broadcasts."""

    def __init__(self, stack_config, base_model, tmp: Path, versions: int):
        from kafka import KafkaProducer

        from connectors.artifact_store import ArtifactStore
        from connectors.kafka import create_topic
        from connectors.mlflow_registry import broadcast_for, make_client, register_version
        from core.messages import VersionRecord

        unique = uuid.uuid4().hex[:10]
        self.boot, self.model_id, self.tmp = stack_config.kafka_bootstrap, f"guard-{unique}", tmp
        self.topics = {t: f"test.guard-{unique}.{t}" for t in ("adapter-versions", "inference-log", "feedback")}
        for t in self.topics.values():
            create_topic(self.boot, t)
        self.store = tmp / "adapters"
        self.client = make_client(stack_config.mlflow_uri)
        self.producer = KafkaProducer(bootstrap_servers=self.boot, acks="all", linger_ms=5)
        t0 = int(time.time() * 1000) // 2000 * 2000 - 100_000
        for seq in range(1, versions + 1):
            items, sha256 = adapter_files(str(base_model), seq)
            record = VersionRecord.model_validate({
                "version_id": f"{self.model_id}@{seq}", "model_id": self.model_id, "seq": seq,
                "window_start": t0 + 2_000 * seq, "window_end": t0 + 2_000 * seq + 1_999,
                "artifact_uri": ArtifactStore(str(self.store)).put(dict(items), sha256), "sha256": sha256,
                "base_model": str(base_model), "config_version": 1, "fresh_adapter": seq == 1,
                "adapter": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0},
                "trigger_policy": {"min_samples_per_window": 8, "window_seconds": 2},
                "metrics": {"loss_before": 3.0, "loss_after": 2.0, "samples": 8, "tokens": 96, "step_seconds": 0.1},
                "lineage": {"sample_ids": [f"s{seq}"], "offsets": [{"topic": "t", "partition": 0, "first": seq,
                                                                   "last": seq}]},
                "trigger": "window"})
            mv, _ = register_version(self.client, record, ArtifactStore(str(self.store)))
            self.producer.send(self.topics["adapter-versions"], key=self.model_id.encode(),
                               value=broadcast_for(record, mv).to_json().encode())
        self.producer.flush()

    def set_aliases(self, **aliases) -> None:
        """As an admin would: point (or delete, None) aliases in MLflow."""
        for alias, version in aliases.items():
            if version is None:
                self.client.delete_registered_model_alias(self.model_id, alias)
            else:
                self.client.set_registered_model_alias(self.model_id, alias, str(version))

    def aliases(self) -> dict:
        return {a: int(v) for a, v in self.client.get_registered_model(self.model_id).aliases.items()}

    def feedback(self, answers: list[dict], verdict) -> Counter:
        """One feedback sample citing each answer, labelled `verdict(answer)`, as POST /v1/feedback writes it."""
        labels = Counter()
        for a in answers:
            label = verdict(a)
            sample = FeedbackSample(model_id=self.model_id, sample_id=f"fb-{a['id']}", prompt=PROMPT,
                                    completion="23", label=label, ts=int(time.time() * 1000), request_id=a["id"])
            self.producer.send(self.topics["feedback"], key=self.model_id.encode(), value=sample.to_json().encode(),
                               timestamp_ms=sample.ts)
            labels[(a["streamtune"]["arm"], label)] += 1
        self.producer.flush()
        return labels

    def close(self) -> None:
        self.producer.close(5)


class Serve:
    """`streamtune serve` for a rollout, as a process; restartable on the same port."""

    def __init__(self, stack_config, base_model, rollout: Rollout, *, min_users: int, min_events: int,
                 signing_key: str | None = None, fraction: float = 0.5, stateless: bool = False):
        self.port, self.rollout = free_port(), rollout
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = rollout.tmp / f"serve-{self.port}.log"
        self.promotion_log = rollout.tmp / "promotions.jsonl"
        self.cmd = [sys.executable, "-m", "streamtune.cli", "serve", "--port", str(self.port),
                    "--base-model", str(base_model), "--artifact-store", str(rollout.store),
                    "--bootstrap-server", stack_config.kafka_bootstrap, "--tracking-uri", stack_config.mlflow_uri,
                    "--broadcast-topics", re.escape(rollout.topics["adapter-versions"]),
                    "--inference-log-topic", rollout.topics["inference-log"],
                    "--feedback-topics", re.escape(rollout.topics["feedback"]),
                    "--promotion-log", str(self.promotion_log), "--candidate-fraction", str(fraction),
                    "--rollback-min-events", str(min_events), "--rollback-min-users", str(min_users),
                    "--rollback-margin", "0.2", "--slots", "4", "--no-webhook"]
        # The off switch of the signature check is no key: make sure none comes from the environment.
        self.env = {"STREAMTUNE_RESPONSE_SIGNING_KEY": signing_key or "", "STREAMTUNE_RESPONSE_SIGNING_KEY_FILE": ""}
        # The off switch of the restart defence (tests only): the guard as before it kept its decisions.
        self.env["STREAMTUNE_GUARD_STATELESS"] = "1" if stateless else ""
        self.proc = None

    def start(self) -> "Serve":
        self.proc = spawn_logged(self.cmd, self.log_file, extra_env=self.env)
        wait_for(self.ready, 120, f"streamtune serve to start ({self.log_file})", interval=0.2)
        return self

    def ready(self) -> bool:
        assert self.proc.poll() is None, self.log_file.read_text()[-3000:]
        try:
            return requests.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def kill(self) -> None:
        kill_group(self.proc)

    def guard(self) -> dict:
        return requests.get(f"{self.url}/v1/guard", timeout=10).json()

    def routes(self) -> dict:
        data = requests.get(f"{self.url}/v1/models", timeout=10).json()["data"]
        return next((m["aliases"] for m in data if m["id"] == self.rollout.model_id), {})

    def complete(self, n: int, users=None) -> list[dict]:
        """n completions (user None: no `user`, so each request is routed by its own id)."""
        out = []
        for i in range(n):
            r = requests.post(f"{self.url}/v1/completions", timeout=60, json={
                "model": self.rollout.model_id, "prompt": PROMPT, "max_tokens": 2,
                "user": users(i) if users else None})
            assert r.status_code == 200, r.text
            out.append(r.json())
        return out

    def decisions(self, kind: str) -> list[dict]:
        return [d for d in self.guard()["decisions"] if d["decision"] == kind]


@pytest.fixture
def rollout(stack_config, base_model, tmp_path):
    made = []

    def make(versions: int) -> Rollout:
        made.append(Rollout(stack_config, base_model, tmp_path, versions))
        return made[-1]
    yield make
    for r in made:
        r.close()


@pytest.fixture
def serve(stack_config, base_model):
    started = []

    def make(rollout: Rollout, **options) -> Serve:
        started.append(Serve(stack_config, base_model, rollout, **options))
        return started[-1].start()
    yield make
    for s in started:
        if s.proc is not None:
            s.kill()


def judged_all(server: Serve, n: int) -> dict:
    g = server.guard()
    return g if g["counts"]["judged"] >= n else None


@pytest.mark.parametrize("defence", ["on", "off"])
def test_one_user_cannot_remove_a_candidate(rollout, serve, defence):
    """(b) Holding the inference and feedback tokens only: anonymous completions (one user,
    routed half/half by request id), corrections citing the candidate's ids, acceptances
    citing the champion's. Off (min users 1): the candidate is deleted. On: it stays."""
    r = rollout(2)
    r.set_aliases(champion=1, candidate=2)
    server = serve(r, min_users=3 if defence == "on" else 1, min_events=6)
    wait_for(lambda: server.routes() == {"champion": 1, "candidate": 2}, 30, "champion and candidate routes", 0.2)
    answers = server.complete(30)
    arms = Counter(a["streamtune"]["arm"] for a in answers)
    assert arms["champion"] >= 6 and arms["candidate"] >= 6, arms
    r.feedback(answers, lambda a: "corrected" if a["streamtune"]["arm"] == "candidate" else "accepted")
    if defence == "off":
        wait_for(lambda: server.decisions("candidate_removed"), 30, "the guard to remove the candidate", 0.2)
        assert "candidate" not in r.aliases()
        return
    g = wait_for(lambda: judged_all(server, len(answers)), 30, "the guard to judge every response", 0.2)
    assert g["counts"]["too_few_users"] > 0 and g["decisions"] == [], g
    assert r.aliases() == {"champion": 1, "candidate": 2}


@pytest.mark.parametrize("defence", ["on", "off"])
def test_one_user_cannot_roll_back_a_champion(rollout, serve, defence):
    """(a) The same attacker accepts the champion's answers, an admin promotes v2, the attacker
    rejects v2's answers. Off (min users 1): champion goes back to v1. On: v2 stays."""
    r = rollout(2)
    r.set_aliases(champion=1, candidate=None)  # registration points candidate at the newest
    server = serve(r, min_users=3 if defence == "on" else 1, min_events=6)
    wait_for(lambda: server.routes() == {"champion": 1}, 30, "the champion route", 0.2)
    before = server.complete(8)
    r.feedback(before, lambda a: "accepted")
    wait_for(lambda: judged_all(server, len(before)), 30, "the guard to judge v1", 0.2)
    r.set_aliases(champion=2)
    wait_for(lambda: server.routes() == {"champion": 2}, 30, "the promotion of v2", 0.2)
    after = server.complete(8)
    assert {a["streamtune"]["version"] for a in after} == {2}
    r.feedback(after, lambda a: "rejected")
    if defence == "off":
        wait_for(lambda: server.decisions("champion_rolled_back"), 30, "the guard to roll back", 0.2)
        assert r.aliases() == {"champion": 1}
        return
    g = wait_for(lambda: judged_all(server, len(before) + len(after)), 30, "the guard to judge v2", 0.2)
    assert g["counts"]["too_few_users"] > 0 and g["decisions"] == [], g
    assert r.aliases() == {"champion": 2}


@pytest.mark.parametrize("defence", ["on", "off"])
def test_responses_no_server_signed_are_not_judged(rollout, serve, defence):
    """Defence in depth: someone who can write to the inference log and feedback topics but
    holds no signing key forges responses (from many users) and feedback citing them. With the
    key (on), the guard judges none of them; without (off), it removes the candidate."""
    r = rollout(2)
    r.set_aliases(champion=1, candidate=2)
    server = serve(r, min_users=1, min_events=6, signing_key=KEY if defence == "on" else None)
    wait_for(lambda: server.routes() == {"champion": 1, "candidate": 2}, 30, "champion and candidate routes", 0.2)
    forged = []
    for i in range(16):
        arm, version = ("candidate", 2) if i % 2 else ("champion", 1)
        record = InferenceRecord(request_id=f"cmpl-{uuid.uuid4().hex}", model_id=r.model_id, version=version,
                                 alias=arm, arm=arm, user=f"user-{i}", prompt=PROMPT, completion="2",
                                 mean_logprob=-1.0, latency_ms=1.0, ts=int(time.time() * 1000))
        r.producer.send(r.topics["inference-log"], key=r.model_id.encode(), value=record.to_json().encode())
        forged.append({"id": record.request_id, "streamtune": {"arm": arm}})
    r.feedback(forged, lambda a: "corrected" if a["streamtune"]["arm"] == "candidate" else "accepted")
    if defence == "off":
        wait_for(lambda: server.decisions("candidate_removed"), 30, "the guard to remove the candidate", 0.2)
        assert "candidate" not in r.aliases()
        return
    # The guard reads the two topics side by side: wait for both counts, not one.
    g = wait_for(lambda: (g := server.guard())["counts"]["unsigned"] >= len(forged)
                 and g["counts"]["unsigned_responses"] >= len(forged) and g, 30,
                 "the guard to read every forged record and feedback event", 0.2)
    assert g["counts"]["unsigned_responses"] == len(forged) and g["counts"]["judged"] == 0, g
    assert g["decisions"] == [] and r.aliases() == {"champion": 1, "candidate": 2}


@pytest.mark.parametrize("defence", ["on", "off"])
def test_five_kill_restarts_during_a_judged_rollout_apply_each_decision_once(rollout, serve, defence):
    """kill -9 and restart `streamtune serve` five times, each while the guard has feedback it
    has not read, during: a worse candidate (v2) taken out, a regressing promotion (v3) rolled
    back to v1, then a good promotion (v4) after which replays pass both decisions. On: the
    champion never returns to a version a logged decision left, each decision is applied once
    (alias-moves topic, promotion log), and the per-arm counters equal what was served and
    judged (an uninterrupted run's). Off (STREAMTUNE_GUARD_STATELESS=1: recorded decisions
    ignored, moves without compare-and-set): the replays after the restarts apply the
    decisions again."""
    from connectors.kafka import read_topic
    from core.messages import AliasMove

    r = rollout(4)
    r.set_aliases(champion=1, candidate=2)
    server = serve(r, min_users=3, min_events=8, stateless=defence == "off")
    wait_for(lambda: server.routes() == {"champion": 1, "candidate": 2}, 30, "champion and candidate routes", 0.2)
    expected: dict[str, Counter] = {}   # arm -> responses, judged and labels, as an uninterrupted guard counts
    made, produced, kills, user = 0, 0, [], [0]

    history, stop, seen = [r.aliases()["champion"]], threading.Event(), threading.Lock()

    def saw(champion) -> None:
        if champion != history[-1]:
            history.append(champion)

    def watch_champion() -> None:
        while not stop.wait(0.1):
            with seen:  # a look is never interleaved with the admin's move below
                try:
                    saw(r.aliases().get("champion"))
                except Exception:
                    continue
    watcher = threading.Thread(target=watch_champion, daemon=True)
    watcher.start()

    def round_(n: int, verdict, kill: bool) -> None:
        """n completions from new users, read by the guard; feedback on them; a kill -9 (and
        restart) if asked and the guard still has some of that feedback unread."""
        nonlocal made, produced
        answers = server.complete(n, users=lambda i: f"user-{user[0] + i}")
        user[0] += n
        made += n
        for a in answers:
            expected.setdefault(a["streamtune"]["arm"], Counter())["responses"] += 1
        wait_for(lambda: server.guard()["counts"]["responses"] >= made, 30, "the guard to read the responses", 0.1)
        labels = r.feedback(answers, verdict)
        produced += n
        for (arm, label), count in labels.items():
            expected[arm]["judged"] += count
            expected[arm][label] += count
        if kill:
            read = server.guard()["counts"]["feedback"]
            if read < produced:  # the guard is behind: the kill lands on unread records
                server.kill()
                kills.append({"unread": produced - read, "aliases": r.aliases()})
                server.start()

    def caught_up() -> dict:
        g = server.guard()
        return g if g["counts"]["responses"] >= made and g["counts"]["feedback"] >= produced else None

    # 1. The candidate answers worse: taken out, with kills before and after the decision.
    worse = lambda a: "corrected" if a["streamtune"]["arm"] == "candidate" else "accepted"  # noqa: E731
    for i in range(8):
        round_(10, worse, kill=len(kills) < 2)
        if "candidate" not in r.aliases() and len(kills) >= 2:
            break
    wait_for(lambda: "candidate" not in r.aliases(), 30, "the candidate to be removed", 0.2)
    wait_for(lambda: "candidate" not in server.routes(), 30, "the server to drop the candidate", 0.2)

    # 2. v3 promoted, regresses: rolled back to v1.
    with seen:
        r.set_aliases(champion=3)
        saw(3)
    wait_for(lambda: server.routes().get("champion") == 3, 30, "the promotion of v3", 0.2)
    for i in range(8):
        round_(5, lambda a: "rejected" if a["streamtune"]["version"] == 3 else "accepted", kill=len(kills) < 4)
        if r.aliases().get("champion") == 1 and len(kills) >= 4:
            break
    wait_for(lambda: r.aliases().get("champion") == 1, 30, "the rollback to v1", 0.2)
    wait_for(lambda: server.routes().get("champion") == 1, 30, "the server to follow the rollback", 0.2)
    with seen:  # the watcher's looks can fail while MLflow is busy: the rollback this test saw is history too
        saw(r.aliases()["champion"])

    # 3. v4 promoted by an admin: replays after the last kills pass both decisions again.
    with seen:  # the admin's move is in the history, whether or not the watcher's next look still finds it
        r.set_aliases(champion=4)
        saw(4)
    if defence == "on":
        wait_for(lambda: server.routes().get("champion") == 4, 30, "the promotion of v4", 0.2)
    # Off: the stateless guard may take the rollback of v3 again at once, on feedback it still
    # holds, before the server ever routes to v4: the fault this arm exists to show.
    for i in range(8):
        if len(kills) >= 5:
            break
        round_(5, lambda a: "accepted", kill=True)
    assert len(kills) == 5, kills
    g = wait_for(caught_up, 60, "the guard to read everything after the last restart", 0.2)
    time.sleep(0.5)  # a last look at the champion's history
    stop.set()
    watcher.join(5)
    print(f"kills {kills}; champion history {history}; guard counts {g['counts']}")
    assert all(k["unread"] > 0 for k in kills)
    if defence == "off":
        assert_replays_reapplied(r, server, history)
        return

    # The champion went 1 -> 3 (admin) -> 1 (guard) -> 4 (admin), and never back.
    assert history == [1, 3, 1, 4], history
    assert r.aliases() == {"champion": 4}
    moves = [m for m in (AliasMove.from_json(rec.value) for rec in read_topic(r.boot, defaults.ALIAS_MOVES_TOPIC,
                                                                                timeout=30, idle=1.0))
             if m.model_id == r.model_id and m.actor == "guard"]
    assert sorted((m.alias, m.from_version, m.version) for m in moves) == [("candidate", 2, None),
                                                                           ("champion", 3, 1)], moves
    guard_lines = [e for e in (json.loads(line) for line in server.promotion_log.read_text().splitlines())
                   if e["model_id"] == r.model_id and e["actor"].startswith("guard:")]
    assert len(guard_lines) == 2, guard_lines
    tags = r.client.get_model_version(r.model_id, "3").tags
    assert json.loads(tags["streamtune.guard.champion_rolled_back"])["state"] == "applied"

    status = requests.get(f"{server.url}/v1/models/{r.model_id}/serving", timeout=10).json()
    counted = {a["arm"]: {k: a[k] for k in ("responses", "judged", "accepted", "corrected", "rejected")}
               for a in status["arms"] if a["responses"]}
    assert counted == {arm: {k: c[k] for k in ("responses", "judged", "accepted", "corrected", "rejected")}
                       for arm, c in expected.items()}, (counted, expected)


def assert_replays_reapplied(r: Rollout, server: Serve, history: list) -> None:
    """The restart test's off arm: the same five restarts without the recorded decisions and
    the compare-and-set break what the on arm asserts (so its assertions can fail)."""
    from connectors.kafka import read_topic
    from core.messages import AliasMove

    moves = Counter((m.alias, m.from_version, m.version)
                    for m in (AliasMove.from_json(rec.value) for rec in read_topic(r.boot, defaults.ALIAS_MOVES_TOPIC,
                                                                                     timeout=30, idle=1.0))
                    if m.model_id == r.model_id and m.actor == "guard")
    guard_lines = [e for e in (json.loads(line) for line in server.promotion_log.read_text().splitlines())
                   if e["model_id"] == r.model_id and e["actor"].startswith("guard:")]
    print(f"off: guard moves {dict(moves)}; guard lines in the promotion log {len(guard_lines)}; "
          f"champion history {history}; aliases {r.aliases()}")
    # The decisions themselves were taken (the scenario ran as on) ...
    assert set(moves) == {("candidate", 2, None), ("champion", 3, 1)}, moves
    # ... and applied again by the replays after the restarts: more than once each on the
    # alias-moves topic and in the promotion log (on: once each) ...
    assert all(n > 1 for n in moves.values()) and len(guard_lines) == sum(moves.values()), (moves, guard_lines)
    # ... and the replay after the last restart (v4 champion) took the rollback of v3 again:
    # champion went back from v4 to v1, a version it had left (on: 1 -> 3 -> 1 -> 4 only).
    assert history[:5] == [1, 3, 1, 4, 1], history
