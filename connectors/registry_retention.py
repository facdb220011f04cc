"""Retention of registered versions: every aliased version and the newest `keep_last` stay.

Every fired window becomes a registered version, so without a policy a model at 1 s windows
gains 86,400 versions a day. The spec's `retention` section (core/messages/spec.py
RetentionPolicy, default keep_last 50) says how many to keep; the registration path applies
it after each registration (connectors/mlflow_registry.finish_run). A version that goes
loses, in this order: its files in the artifact store (unless a kept version names the same
content-addressed directory), its run's artifacts (`adapter/`, `model/`, `lineage.json`)
and the run, then the model version itself. The version goes last, so a sweep that fails
half-way leaves it listed and the next sweep deletes the rest (every step tolerates what is
already gone).

"The newest" is by MLflow version number: one registrar per model registers in seq order,
so it is the seq order too.

Cheap at any rate: a sweep runs only when `sweep_every` more versions have fallen out of the
newest `keep_last` since the last one, so between sweeps up to sweep_every - 1 versions
older than the newest keep_last are still there. It lists the model's versions in one search, which
holds keep_last + sweep_every + the aliased ones, since everything older went in earlier
sweeps (the first sweep of a process lists what a restart left, once). An aliased version
is kept while it is aliased; when the alias moves on, the next sweep deletes it.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

from connectors.artifact_store import ArtifactStore
from core.messages import RetentionPolicy

log = logging.getLogger(__name__)

TAG = "streamtune."
DELETE_THREADS = 4  # deletions of one sweep in parallel: each is 3-4 requests


def sweep_every(policy: RetentionPolicy) -> int:
    """Versions to let fall out of the newest keep_last before sweeping: a tenth of it, 1 to 100.

    >>> sweep_every(RetentionPolicy()), sweep_every(RetentionPolicy(keep_last=3)), sweep_every(RetentionPolicy(keep_last=5000))
    (5, 1, 100)
    """
    return max(1, min(100, policy.keep_last // 10))


@dataclass
class RetentionState:
    """Per model: the highest version number below the kept ones at the last sweep (0: none yet)."""
    swept_below: dict[str, int] = field(default_factory=dict)


@dataclass
class SweepResult:
    deleted: list[int] = field(default_factory=list)     # version numbers
    artifacts_deleted: int = 0                            # store directories removed
    kept_aliased: list[int] = field(default_factory=list)


def apply_retention(client: MlflowClient, model_id: str, newest_version: int, policy: RetentionPolicy | None,
                    store: ArtifactStore, state: RetentionState) -> SweepResult | None:
    """After registering `newest_version` of `model_id`: sweep when due (None when not)."""
    policy = policy or RetentionPolicy()
    cutoff = newest_version - policy.keep_last  # this and older: not among the newest keep_last
    if cutoff <= 0:
        return None
    last = state.swept_below.get(model_id)
    if last is not None and cutoff - last < sweep_every(policy):
        return None
    result = sweep(client, model_id, cutoff, store)
    state.swept_below[model_id] = cutoff
    return result


def sweep(client: MlflowClient, model_id: str, cutoff: int, store: ArtifactStore) -> SweepResult:
    """Delete every version of `model_id` numbered `cutoff` or lower that no alias points at,
    with its run and its store artifact (not one a kept version shares)."""
    versions = _all_versions(client, model_id)
    aliased = {int(v) for v in client.get_registered_model(model_id).aliases.values()}
    doomed = [v for v in versions if int(v.version) <= cutoff and int(v.version) not in aliased]
    result = SweepResult(kept_aliased=sorted(a for a in aliased if a <= cutoff))
    if not doomed:
        return result
    doomed_numbers = {int(v.version) for v in doomed}
    kept_uris = {v.tags.get(f"{TAG}artifact_uri") for v in versions if int(v.version) not in doomed_numbers}
    with ThreadPoolExecutor(DELETE_THREADS, thread_name_prefix="streamtune-retention") as pool:
        outcomes = list(pool.map(lambda v: _delete_version(client, store, v, kept_uris), doomed))
    for version, removed_artifact in zip(doomed, outcomes):
        result.deleted.append(int(version.version))
        result.artifacts_deleted += removed_artifact
    result.deleted.sort()
    log.info("retention: %s: deleted %d versions up to v%d (aliased kept: %s)", model_id, len(result.deleted),
             cutoff, result.kept_aliased)
    return result


def _all_versions(client: MlflowClient, model_id: str) -> list[ModelVersion]:
    versions, token = [], None
    name = model_id.replace("'", "\\'")
    while True:
        page = client.search_model_versions(f"name = '{name}'", max_results=1000, page_token=token)
        versions.extend(page)
        token = getattr(page, "token", None)
        if not token:
            return versions


def _delete_version(client: MlflowClient, store: ArtifactStore, version: ModelVersion, kept_uris: set) -> bool:
    """One version's artifact, run and registry entry; whether the store artifact was removed."""
    removed = False
    uri = version.tags.get(f"{TAG}artifact_uri")
    if uri and uri not in kept_uris and uri.startswith(store.uri + "/"):
        removed = store.delete(uri)
    if version.run_id:
        _delete_run(client, version.run_id)
    try:
        client.delete_model_version(version.name, version.version)
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
    return removed


def _delete_run(client: MlflowClient, run_id: str) -> None:
    """The run's artifacts, then the run (deleted runs keep their artifacts until `mlflow gc`)."""
    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":
            return
        raise
    try:
        get_artifact_repository(run.info.artifact_uri, tracking_uri=client.tracking_uri).delete_artifacts()
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
    except FileNotFoundError:
        pass
    if run.info.lifecycle_stage != "deleted":
        client.delete_run(run_id)
