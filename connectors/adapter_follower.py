"""Follow registered adapter versions and their aliases, for any inference process.

Two sources, each for what it is the truth of:
- the durable broadcast topics (every job's `*adapter-versions`, read from the beginning):
  which versions exist, with their artifact URI and sha256 (of the artifact's manifest). A process that starts late or
  restarts catches up on all of them before it calls itself ready;
- MLflow's registered-model aliases, polled every `alias_poll_s` (0.25 s) on a thread of
  their own: where `champion` and `candidate` point, whoever moved them (the job's
  registration, the control plane, or a person in the MLflow UI). A move announced on the
  alias-moves topic (core.messages.AliasMove, sent by the control plane and the rollback
  guard) makes it read that model at once. With hundreds of registered models one full poll
  takes a good part of a second: broadcasts and announced moves never wait behind it.

The follower calls `on_alias(model_id, alias, version)` when an alias moves to a version it
knows (or, later, when the version's broadcast arrives), with version None when the alias
is deleted, and loads artifacts on request with
`fetch`, checking every file against the manifest their sha256 names (ArtifactIntegrityError
naming the file otherwise: connectors/artifact_store.verify_artifact). It never serves anything
itself: the server (streamtune/serve) and the Flink inference job embed it.

    follower = AdapterFollower(FollowerSettings(bootstrap, tracking_uri, store_location),
                               on_alias=lambda m, a, v: print(m, a, v))
    follower.start()
    follower.wait_caught_up(60)
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from core import defaults, transport
from core.errors import InvalidMessage
from core.messages import AdapterVersionBroadcast, AliasMove

log = logging.getLogger("streamtune.follower")

FOLLOWED_ALIASES = ("champion", "candidate")


@dataclass(frozen=True)
class FollowerSettings:
    bootstrap: str
    tracking_uri: Optional[str]                 # None: aliases from the broadcasts only
    artifact_store: str
    topic_pattern: str = defaults.BROADCAST_TOPIC_PATTERN
    alias_topic: Optional[str] = defaults.ALIAS_MOVES_TOPIC   # hints that an alias moved
    alias_poll_s: float = 0.25
    topic_refresh_s: float = 2.0


class AdapterFollower:
    def __init__(self, settings: FollowerSettings,
                 on_alias: Callable[[str, str, Optional[int]], None] = lambda model_id, alias, version: None):
        from connectors.artifact_store import ArtifactStore

        self.settings = settings
        self.on_alias = on_alias
        self.store = ArtifactStore(settings.artifact_store, settings.tracking_uri)
        self._lock = threading.Lock()
        self._apply_lock = threading.Lock()  # two threads apply moves: acknowledged in order
        self._versions: dict[str, dict[int, AdapterVersionBroadcast]] = {}
        self._aliases: dict[str, dict[str, int]] = {}        # as last applied
        self._wanted: dict[str, dict[str, int]] = {}         # as MLflow says, maybe not yet broadcast
        self._read_at: dict[str, float] = {}                 # when the read behind _wanted began
        self._caught_up = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._poller: Optional[threading.Thread] = None
        self.alias_poll_s = settings.alias_poll_s  # slower once a registry webhook pushes the moves
        self.errors: list[str] = []                          # the last few, for /readyz and logs

    # -- what is known ------------------------------------------------------------------
    def version(self, model_id: str, version: int) -> Optional[AdapterVersionBroadcast]:
        with self._lock:
            return self._versions.get(model_id, {}).get(version)

    def alias(self, model_id: str, alias: str) -> Optional[int]:
        with self._lock:
            return self._aliases.get(model_id, {}).get(alias)

    def models(self) -> dict[str, dict]:
        """{model_id: {"versions": [..], "aliases": {alias: version}}} of every known model."""
        with self._lock:
            return {m: {"versions": sorted(vs), "aliases": dict(self._aliases.get(m, {}))}
                    for m, vs in self._versions.items()}

    def fetch(self, broadcast: AdapterVersionBroadcast) -> dict[str, bytes]:
        """The version's artifact files with their manifest.json, every one checked against the
        manifest the broadcast's sha256 names (ArtifactIntegrityError naming the file otherwise)."""
        return self.store.get(broadcast.artifact_uri, broadcast.sha256)

    @property
    def caught_up(self) -> bool:
        return self._caught_up.is_set()

    def wait_caught_up(self, timeout: float) -> bool:
        return self._caught_up.wait(timeout)

    # -- running ------------------------------------------------------------------------
    def start(self) -> "AdapterFollower":
        self._thread = threading.Thread(target=self._run, name="adapter-follower", daemon=True)
        self._thread.start()
        if self.settings.tracking_uri:
            self._poller = threading.Thread(target=self._poll_loop, name="alias-poller", daemon=True)
            self._poller.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in (self._thread, self._poller):
            if thread is not None:
                thread.join(timeout=10)

    def _poll_loop(self) -> None:
        """Moves made in MLflow directly (no hint on the topic): the registry read in full."""
        while not self._stop.wait(self.alias_poll_s):
            if not self._caught_up.is_set():
                continue  # the catch-up reads the registry itself before it says ready
            try:
                self._poll_aliases()
            except Exception as e:  # the registry is down a while: keep serving what is applied
                self._error(f"follower: alias poll: {e}")

    def _run(self) -> None:
        from connectors.kafka import create_topic, follow_topics

        pattern = re.compile(self.settings.topic_pattern)
        idle_since: list[Optional[float]] = [None]

        def wanted(topic: str) -> bool:
            return bool(pattern.fullmatch(topic)) or topic == self.settings.alias_topic

        def on_record(topic: str, raw: bytes) -> None:
            idle_since[0] = None
            if topic == self.settings.alias_topic:
                self._on_alias_move(raw)
            else:
                self._on_broadcast(raw)

        def on_poll(got_records: bool) -> None:
            now = time.monotonic()
            if not got_records and idle_since[0] is None:
                idle_since[0] = now
            if not self._caught_up.is_set() and idle_since[0] is not None and now - idle_since[0] >= 0.5:
                if self.settings.tracking_uri:
                    self._poll_aliases()  # the registry's word, not the broadcasts', before ready
                self._caught_up.set()
                log.info("caught up: %d models, %d versions", len(self._versions),
                         sum(len(v) for v in self._versions.values()))

        if self.settings.alias_topic:  # exists before the first move, so no move waits for a refresh
            try:
                create_topic(self.settings.bootstrap, self.settings.alias_topic)
            except Exception as e:
                self._error(f"follower: creating {self.settings.alias_topic}: {e}")
        follow_topics(self.settings.bootstrap, wanted, on_record, self._stop, on_poll,
                      on_error=lambda message: self._error(f"follower: {message}"),
                      refresh_s=self.settings.topic_refresh_s)

    def _on_broadcast(self, raw: bytes) -> None:
        try:
            b = AdapterVersionBroadcast.from_json(raw)
        except InvalidMessage as e:
            self._error(f"unreadable broadcast skipped: {e}")
            return
        with self._lock:
            self._versions.setdefault(b.model_id, {})[b.mlflow_version] = b
            if not self.settings.tracking_uri:  # no registry: the broadcast's aliases rule
                for alias in b.aliases:
                    self._wanted.setdefault(b.model_id, {})[alias] = b.mlflow_version
        if self.settings.tracking_uri and b.aliases and self._caught_up.is_set():
            self._read_registry(b.model_id)  # a new version named by an alias: no need to wait for the poll
        else:
            self._apply(b.model_id)

    def _on_alias_move(self, raw: bytes) -> None:
        try:
            move = AliasMove.from_json(raw)
        except InvalidMessage as e:
            self._error(f"unreadable alias move skipped: {e}")
            return
        if self.settings.tracking_uri:
            self.hint(move.model_id)
            return
        wanted = dict(self._wanted.get(move.model_id, {}))  # no registry: the announced move itself
        if move.version is None:
            wanted.pop(move.alias, None)
        else:
            wanted[move.alias] = move.version
        with self._lock:
            self._wanted[move.model_id] = wanted
        self._apply(move.model_id)

    def hint(self, model_id: str) -> None:
        """Someone says `model_id`'s aliases moved (an alias-move record, a registry webhook):
        read that model from the registry now. Models not served here, and hints before the
        catch-up (which reads the registry itself), are ignored."""
        if self.settings.tracking_uri and model_id in self._versions and self._caught_up.is_set():
            self._read_registry(model_id)

    def _read_registry(self, model_id: str) -> None:
        """One model's aliases from the registry, now (after a hint: a move or a new version)."""
        from mlflow import MlflowClient

        transport.apply_mlflow_env()
        client = MlflowClient(self.settings.tracking_uri, self.settings.tracking_uri)
        started = time.monotonic()
        aliases = client.get_registered_model(model_id).aliases or {}
        with self._lock:
            if started < self._read_at.get(model_id, 0.0):
                return  # a read begun later has been applied already
            self._read_at[model_id] = started
            self._wanted[model_id] = {a: int(v) for a, v in aliases.items() if a in FOLLOWED_ALIASES}
        self._apply(model_id)

    def _poll_aliases(self) -> None:
        from mlflow import MlflowClient

        transport.apply_mlflow_env()
        client = MlflowClient(self.settings.tracking_uri, self.settings.tracking_uri)
        found: dict[str, dict[str, int]] = {}
        started, token = time.monotonic(), None
        while True:
            page = client.search_registered_models(max_results=1000, page_token=token)
            for rm in page:
                found[rm.name] = {a: int(v) for a, v in (rm.aliases or {}).items() if a in FOLLOWED_ALIASES}
            token = page.token
            if not token:
                break
        with self._lock:
            # A model read after this poll began (on a hint) keeps that newer read: applying
            # this one would move its alias back until the next poll.
            changed = [m for m in set(found) | set(self._wanted) if found.get(m, {}) != self._wanted.get(m, {})
                       and started >= self._read_at.get(m, 0.0)]
            for m in changed:
                self._read_at[m] = started
                self._wanted[m] = found.get(m, {})
        for m in changed:
            self._apply(m)

    def _apply(self, model_id: str) -> None:
        """Move the applied aliases to where they are wanted, once the version is known."""
        with self._apply_lock:
            self._apply_locked(model_id)

    def _apply_locked(self, model_id: str) -> None:
        moves = []
        with self._lock:
            applied = self._aliases.setdefault(model_id, {})
            known = self._versions.get(model_id, {})
            for alias, version in self._wanted.get(model_id, {}).items():
                if applied.get(alias) != version and version in known:
                    applied[alias] = version
                    moves.append((alias, version))
            for alias in [a for a in applied if a not in self._wanted.get(model_id, {})]:
                del applied[alias]  # the alias was deleted in the registry
                moves.append((alias, None))
        for alias, version in moves:
            try:
                self.on_alias(model_id, alias, version)
            except Exception as e:  # the server reports its own refusals; keep following
                self._error(f"{model_id}@{alias} -> {version}: {e}")

    def _error(self, message: str) -> None:
        log.warning(message)
        self.errors = (self.errors + [message])[-20:]
