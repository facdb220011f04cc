"""MLflow model registry helpers for adapter version records (see streamtune/registrar.py).

One registered model per model_id; one MLflow model version per version record, found again
by its tag `streamtune.version_id`, so registering the same record twice is a no-op. Each
version gets its own run (params, metrics, `adapter/` artifacts, `lineage.json`, and `model/`:
the MLflow pyfunc model over the adapter, streamtune/pyfunc_model.py, which is the version's
source, so `mlflow.pyfunc.load_model("models:/<model_id>@champion")` loads it); the same
metrics also go, with step=seq, to a long-lived run `<model_id>-training` in the experiment
`streamtune/<model_id>`: that run holds the loss curve across versions.

Aliases: `candidate` always points at the newest registered version. `champion` moves as
the trainer's promotion gate decided when the record carries one (`gate`, from the spec's
`evaluation` section: operators/quality.py); the decision, its reason and the eval scores go
on the version's tags (`streamtune.gate`, `streamtune.gate_reason`, `streamtune.eval.<set>.*`)
and its run's metrics (`eval_<set>_<metric>`, `champion_eval_<set>_<metric>`). Without a gate,
the fallback loss rule: champion moves when there is none yet or when the new version's
loss_after <= the champion's tag `streamtune.loss_after` (two versions' losses are measured
on their own windows, so this rule cannot see forgetting). MLflow has no compare-and-set on
aliases: two registrars racing on one model could each move champion; only one registrar per
model (Kafka key = model_id) is assumed.

Retention: after each version's run is finished, the record's policy (the spec's
`retention`, default: the newest 50 and every aliased version) deletes older versions, their
runs and their store artifacts (connectors/registry_retention.py).
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

# Before mlflow is imported: when its usage telemetry's thread fails to fetch its config
# (offline), it pops an environment variable there, and a request iterating os.environ at that
# moment fails with KeyError '_MLFLOW_TELEMETRY_SESSION_ID' (seen: a job's first registration
# failed and waited 1 s for its retry). Off unless set: a registering job has nothing to report.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

from mlflow import MlflowClient  # noqa: E402
from mlflow.entities import Metric, Param  # noqa: E402
from mlflow.entities.model_registry import ModelVersion, ModelVersionTag  # noqa: E402
from mlflow.exceptions import MlflowException, RestException  # noqa: E402
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository  # noqa: E402

from connectors.artifact_store import ArtifactStore  # noqa: E402
from connectors.registry_retention import RetentionState, apply_retention  # noqa: E402
from core import transport  # noqa: E402
from core.messages import AdapterVersionBroadcast, VersionRecord  # noqa: E402

log = logging.getLogger(__name__)

TAG = "streamtune."
METRICS = ("loss_before", "loss_after", "samples", "tokens", "step_seconds")
# Each version's run: `adapter/` (the store's files, as streamtune's readers copy them) and
# `model/`, the MLflow pyfunc model over the same files that the version's source names.
PYFUNC_PATH = "model"
PYFUNC_CODE = Path(__file__).resolve().parents[1] / "streamtune" / "pyfunc_model.py"
PYFUNC_PACKAGES = ("mlflow", "torch", "transformers", "peft", "safetensors", "accelerate")


def pyfunc_requirements() -> list[str]:
    """What loading the pyfunc model needs, pinned to what this process runs (a CPU torch's
    local tag dropped: `2.13.0+cpu` is not on the default index)."""
    from importlib.metadata import PackageNotFoundError, version

    pins = []
    for package in PYFUNC_PACKAGES:
        try:
            pins.append(f"{package}=={version(package).split('+')[0]}")
        except PackageNotFoundError:
            pins.append(package)
    return pins


def save_pyfunc_model(model_dir: str, adapter_dir: str, base_model: str) -> None:
    """The MLflow pyfunc model of one version into `model_dir` (streamtune/pyfunc_model.py):
    the adapter's files copied in, the base model named by path or id, not copied."""
    import warnings

    import mlflow.pyfunc

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "add type hints to predict": prompts come in several shapes
        mlflow.pyfunc.save_model(model_dir, python_model=str(PYFUNC_CODE), artifacts={"adapter": adapter_dir},
                                 model_config={"base_model": base_model}, pip_requirements=pyfunc_requirements())


def make_client(tracking_uri: str) -> MlflowClient:
    transport.apply_mlflow_env()  # an https tracking server: the CA bundle to verify it with
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def find_version(client: MlflowClient, model_id: str, version_id: str) -> ModelVersion | None:
    """The model version of `model_id` tagged with this version_id, or None."""
    # Dotted tag keys need backticks in MLflow's filter syntax.
    found = client.search_model_versions(
        f"name = '{_quote(model_id)}' and tags.`{TAG}version_id` = '{_quote(version_id)}'")
    if not found:
        return None
    return min(found, key=lambda v: int(v.version))  # a racing duplicate: the first one wins


def highest_registered_seq(client: MlflowClient, model_id: str) -> int:
    """The highest seq among the registered versions of `model_id` (0: none). The maximum over
    every version, not the newest one's: a registrar that came late, or two that raced, can
    register versions out of seq order."""
    highest, token = 0, None
    while True:
        try:
            page = client.search_model_versions(f"name = '{_quote(model_id)}'", max_results=1000, page_token=token)
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return 0
            raise
        highest = max([highest, *(int(v.tags.get(f"{TAG}seq", 0)) for v in page)])
        token = getattr(page, "token", None)
        if not token:
            return highest


@dataclass
class RegistryCache:
    """What one registering process learned of the registry, so that a steady stream of
    versions costs 6-7 MLflow requests on its way to the broadcast: registered models and
    experiments known to exist, each model's training run, and the highest seq registered per
    model.

    The highest seq starts, for each model, at the registry's own (`highest_registered_seq`):
    a restored job replays records its killed run registered after the last checkpoint, and
    each of those, at or below it, is searched for by version_id; a record above it is new and
    skips the search. This rests on the registration contract: one registrar per model (Kafka
    key = model_id), versions in seq order.
    """
    models: set[str] = field(default_factory=set)
    experiments: dict[str, str] = field(default_factory=dict)
    training_runs: dict[str, str] = field(default_factory=dict)
    last_seq: dict[str, int] = field(default_factory=dict)
    newest_version: dict[str, int] = field(default_factory=dict)  # MLflow version number, per model
    retention: RetentionState = field(default_factory=RetentionState)

    def seen(self, model_id: str, seq: int) -> None:
        self.last_seq[model_id] = max(seq, self.last_seq.get(model_id, 0))

    def registered(self, model_id: str, version: str | int) -> None:
        self.newest_version[model_id] = max(int(version), self.newest_version.get(model_id, 0))


def register_version(client: MlflowClient, record: VersionRecord, store: ArtifactStore,
                     cache: RegistryCache | None = None) -> tuple[ModelVersion, bool]:
    """Register one version record, all of it: publish_version, then finish_run. Returns
    (model version, created). Idempotent by version_id."""
    cache = cache if cache is not None else RegistryCache()
    mv, created = publish_version(client, record, store, cache)
    finish_run(client, record, mv.run_id, cache, check=not created, store=store)
    return mv, created


def publish_version(client: MlflowClient, record: VersionRecord, store: ArtifactStore,
                    cache: RegistryCache | None = None) -> tuple[ModelVersion, bool]:
    """What a broadcast waits for: the adapter's files in a new run, the model version, its
    aliases. Returns (model version, created); idempotent by version_id. The run stays
    RUNNING, without params and metrics, until finish_run: those are read by people, not by
    inference, so they are logged after the broadcast (16 MLflow requests in a row
    per version before; now 6-7, in four rounds).

    The adapter is read from the artifact store and checked against the record's sha256
    first: ArtifactIntegrityError (never registered) when it is missing or altered.
    """
    cache = cache if cache is not None else RegistryCache()
    model_id, version_id = record.model_id, record.version_id
    if model_id not in cache.last_seq:
        cache.seen(model_id, highest_registered_seq(client, model_id))
    if record.seq <= cache.last_seq[model_id]:
        existing = find_version(client, model_id, version_id)
        if existing is not None:
            cache.seen(model_id, record.seq)
            cache.registered(model_id, existing.version)
            return existing, False
    files = store.get(record.artifact_uri, record.sha256)
    if model_id not in cache.models:
        _ensure_registered_model(client, model_id)
        cache.models.add(model_id)
    pool = _request_pool()
    # Requests that do not wait on each other go out together: the critical path is four
    # round trips (run, uploads, version, aliases) instead of seven. The champion's loss is
    # read while the run is created: this model's previous version set its aliases before
    # this call began (one registrar per model, in seq order).
    champion_loss = pool.submit(_champion_loss_after, client, model_id) if record.gate is None else None
    seq, metrics, adapter = record.seq, record.metrics, record.adapter
    run = client.create_run(_experiment_id(client, model_id, cache), run_name=version_id, tags={
        f"{TAG}version_id": version_id, f"{TAG}model_id": model_id, f"{TAG}seq": str(seq)})
    run_id = run.info.run_id
    try:
        with tempfile.TemporaryDirectory() as tmp:
            # The run's artifact repository straight from create_run's answer: the client's
            # log_artifacts(run_id) would first fetch the run again to find it.
            repository = get_artifact_repository(run.info.artifact_uri, tracking_uri=client.tracking_uri)
            adapter_dir = os.path.join(tmp, "adapter")
            os.makedirs(adapter_dir)
            uploads = []
            for name, data in files.items():
                path = os.path.join(adapter_dir, name)
                with open(path, "wb") as f:
                    f.write(data)
                uploads.append(pool.submit(repository.log_artifact, path, "adapter"))
            model_dir = os.path.join(tmp, "model")
            save_pyfunc_model(model_dir, adapter_dir, record.base_model)
            # File by file, like the adapter's: log_artifacts would upload the model's files one after another.
            for folder, _, names in os.walk(model_dir):
                where = os.path.join(PYFUNC_PATH, os.path.relpath(folder, model_dir)).rstrip("/.")
                uploads += [pool.submit(repository.log_artifact, os.path.join(folder, name), where) for name in names]
            for upload in uploads:
                upload.result()
    except Exception:
        client.set_terminated(run_id, "FAILED")
        raise

    tags = {
        "version_id": version_id, "sha256": record.sha256, "artifact_uri": record.artifact_uri,
        "base_model": record.base_model,
        "window_start": record.window_start, "window_end": record.window_end,
        "samples": metrics.samples, "seq": seq, "config_version": record.config_version,
        "fresh_adapter": record.fresh_adapter, "rank": adapter.rank,
        "target_modules": ",".join(adapter.target_modules), "loss_after": metrics.loss_after,
        **gate_tags(record),
    }
    # create_model_version waits (await_creation_for=300 s) until the status is READY.
    mv = client.create_model_version(model_id, f"runs:/{run_id}/{PYFUNC_PATH}", run_id,
                                     tags={TAG + k: str(v) for k, v in tags.items()})
    if mv.status != "READY":
        raise RuntimeError(f"model version {model_id} v{mv.version} ended in status {mv.status}")
    cache.seen(model_id, seq)
    cache.registered(model_id, mv.version)

    # The gate was decided in the trainer, on the same eval data for both versions; without
    # one, the champion's loss is read each time, not cached: a rollback elsewhere moves it.
    promote = record.gate.promote if record.gate is not None else metrics.loss_after <= champion_loss.result()
    aliases = [pool.submit(_set_alias, client, model_id, alias, mv.version)
               for alias in (("candidate", "champion") if promote else ("candidate",))]
    for alias in aliases:
        alias.result()
    # A new version holds just the aliases set here (no read back: one call less).
    return ModelVersion(mv.name, mv.version, mv.creation_timestamp, mv.last_updated_timestamp,
                        source=mv.source, run_id=mv.run_id, status=mv.status,
                        tags=[ModelVersionTag(k, v) for k, v in mv.tags.items()],
                        aliases=["candidate", "champion"] if promote else ["candidate"]), True


def finish_run(client: MlflowClient, record: VersionRecord, run_id: str, cache: RegistryCache | None = None,
               check: bool = False, store: ArtifactStore | None = None) -> None:
    """The rest of a published version's run: params, metrics, `lineage.json`, the same
    metrics on the model's training run (its loss curve), then FINISHED. With `check` (a
    version found again after a restore) it does nothing when the run has FINISHED already;
    a crash inside this function, between the training run's metrics and FINISHED, leaves one
    duplicate point on that curve. With `store`, then the record's retention policy
    (connectors/registry_retention.py): off the broadcast's path, like the rest of this."""
    cache = cache if cache is not None else RegistryCache()
    if check and client.get_run(run_id).info.status == "FINISHED":
        if store is not None:
            retain(client, record, store, cache)
        return
    model_id, seq, metrics, adapter = record.model_id, record.seq, record.metrics, record.adapter
    now = int(time.time() * 1000)
    metric_rows = [Metric(k, float(getattr(metrics, k)), now, seq) for k in METRICS]
    metric_rows += [Metric(k, v, now, seq) for k, v in gate_metrics(record).items()]
    client.log_batch(run_id, metrics=metric_rows, params=[
        Param("adapter.rank", str(adapter.rank)),
        Param("adapter.alpha", str(adapter.alpha)),
        Param("adapter.target_modules", ",".join(adapter.target_modules)),
        Param("adapter.dropout", str(adapter.dropout)),
        Param("config_version", str(record.config_version)),
        Param("fresh_adapter", str(record.fresh_adapter)),
        Param("trigger", record.trigger),
        Param("base_model", record.base_model),
    ])
    client.log_dict(run_id, {"version_id": record.version_id, "window_start": record.window_start,
                             "window_end": record.window_end, **record.lineage.to_dict()}, "lineage.json")
    if model_id not in cache.training_runs:
        cache.training_runs[model_id] = _ensure_training_run(client, _experiment_id(client, model_id, cache), model_id)
    client.log_batch(cache.training_runs[model_id], metrics=metric_rows)
    client.set_terminated(run_id, "FINISHED")
    if store is not None:
        retain(client, record, store, cache)


def retain(client: MlflowClient, record: VersionRecord, store: ArtifactStore, cache: RegistryCache) -> None:
    """The record's retention policy, swept when due. A failed sweep is logged, never raised:
    the version is registered, and the next registration's sweep deletes what this one left."""
    newest = cache.newest_version.get(record.model_id)
    if newest is None:
        return
    try:
        apply_retention(client, record.model_id, newest, record.retention, store, cache.retention)
    except Exception:
        log.warning("retention sweep of %s failed; the next registration retries it", record.model_id, exc_info=True)


def gate_tags(record: VersionRecord) -> dict[str, str]:
    """The gate's decision and numbers as version tags (without the `streamtune.` prefix).

    >>> from core.messages.version import EXAMPLE, GATE_EXAMPLE
    >>> tags = gate_tags(VersionRecord.model_validate({**EXAMPLE, "gate": GATE_EXAMPLE}))
    >>> tags["gate"], tags["eval.retained.forgotten"], tags["eval.retained.champion_exact_match"]
    ('refused', '0.8', '1.0')
    """
    gate = record.gate
    if gate is None:
        return {}
    tags = {"gate": "promoted" if gate.promote else "refused", "gate_rule": gate.rule,
            "gate_reason": gate.reason[:4000], "gate_metric": gate.metric}  # MLflow caps tag values at 5000
    if gate.champion_version_id:
        tags["gate_champion"] = gate.champion_version_id
    for s in gate.sets:
        prefix = f"eval.{s.name}."
        tags.update({prefix + "size": str(s.size), prefix + "tolerance": str(s.tolerance), prefix + "passed": str(s.passed),
                     prefix + "exact_match": str(s.candidate.exact_match), prefix + "loss": str(s.candidate.loss)})
        if s.champion is not None:
            tags.update({prefix + "champion_exact_match": str(s.champion.exact_match),
                         prefix + "champion_loss": str(s.champion.loss)})
        if s.candidate.forgotten is not None:
            tags[prefix + "forgotten"] = str(s.candidate.forgotten)
    return tags


def gate_metrics(record: VersionRecord) -> dict[str, float]:
    """Eval scores as run metrics (step = seq): curves of the versions and of their champions."""
    rows = {}
    for s in record.gate.sets if record.gate else ():
        for who, score in (("", s.candidate), ("champion_", s.champion)):
            if score is not None:
                rows[f"{who}eval_{s.name}_exact_match"] = score.exact_match
                rows[f"{who}eval_{s.name}_loss"] = score.loss
        if s.candidate.forgotten is not None:
            rows[f"eval_{s.name}_forgotten"] = s.candidate.forgotten
    if record.gate is not None:
        rows["promoted"] = float(record.gate.promote)
    return rows


def broadcast_for(record: VersionRecord, mv: ModelVersion) -> AdapterVersionBroadcast:
    """What inference processes hear about a registered version."""
    return AdapterVersionBroadcast(
        version_id=record.version_id, model_id=record.model_id, seq=record.seq, mlflow_version=int(mv.version),
        model_uri=f"models:/{record.model_id}/{mv.version}", sha256=record.sha256,
        artifact_uri=record.artifact_uri, aliases=sorted(mv.aliases), registered_at=mv.creation_timestamp)


def _quote(value: str) -> str:
    return str(value).replace("'", "\\'")


def _already_exists(e: RestException) -> bool:
    return e.error_code == "RESOURCE_ALREADY_EXISTS"


def _ensure_registered_model(client: MlflowClient, name: str) -> None:
    try:
        client.create_registered_model(name, tags={f"{TAG}managed": "true"})
    except RestException as e:
        if not _already_exists(e):
            raise


def _ensure_experiment(client: MlflowClient, name: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except RestException as e:
        if not _already_exists(e):
            raise
        return client.get_experiment_by_name(name).experiment_id


def _ensure_training_run(client: MlflowClient, experiment_id: str, model_id: str) -> str:
    name = f"{model_id}-training"
    runs = client.search_runs([experiment_id], f"attributes.run_name = '{_quote(name)}'",
                              order_by=["attributes.start_time ASC"], max_results=1)
    if runs:
        return runs[0].info.run_id
    run = client.create_run(experiment_id, run_name=name, tags={f"{TAG}model_id": model_id})
    # Finished right away: MLflow accepts metrics on finished runs, and the UI does not show
    # a run that is "running" forever.
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def _experiment_id(client: MlflowClient, model_id: str, cache: RegistryCache) -> str:
    name = f"streamtune/{model_id}"
    if name not in cache.experiments:
        cache.experiments[name] = _ensure_experiment(client, name)
    return cache.experiments[name]


@functools.cache
def _request_pool() -> ThreadPoolExecutor:
    """Threads for a registration's independent MLflow requests (at most three at once per
    registration; shared by every registration in the process, none of them waits on another)."""
    return ThreadPoolExecutor(max_workers=4, thread_name_prefix="streamtune-mlflow")


def _champion_loss_after(client: MlflowClient, model_id: str) -> float:
    """The champion's loss_after tag; infinite when there is no champion (or no tag)."""
    try:
        champion = client.get_model_version_by_alias(model_id, "champion")
    except RestException as e:
        # MLflow 3.17 answers a missing alias with INVALID_PARAMETER_VALUE "... not found".
        if e.error_code != "INVALID_PARAMETER_VALUE" or "not found" not in e.message:
            raise
        return float("inf")
    value = champion.tags.get(f"{TAG}loss_after")
    return float(value) if value is not None else float("inf")


def _set_alias(client: MlflowClient, model_id: str, alias: str, version: str,
               attempts: int = 5) -> None:
    """Set an alias; two writers creating the same alias at once can hit UniqueViolation."""
    for attempt in range(attempts):
        try:
            # The registry client, not MlflowClient.set_registered_model_alias: that one
            # first fetches the whole registered model to refuse prompts (a request more per
            # alias; ours are never prompts). mlflow is pinned in pyproject.toml.
            client._get_registry_client().set_registered_model_alias(model_id, alias, version)
            return
        except MlflowException as e:
            if "UniqueViolation" not in str(e) or attempt == attempts - 1:
                raise
            log.info("alias %s on %s raced another writer; retrying", alias, model_id)
            time.sleep(0.05 * (attempt + 1))


def alias_version(client: MlflowClient, model_id: str, alias: str) -> int | None:
    """The version `alias` of `model_id` points at, or None when it is not set."""
    version = client.get_registered_model(model_id).aliases.get(alias)
    return int(version) if version is not None else None


def move_alias_if(client: MlflowClient, model_id: str, alias: str, expected_version: int | None,
                  new_version: int | None) -> bool:
    """Compare-and-set: point `alias` at `new_version` (None deletes it) only while it points at
    `expected_version`. Returns whether it moved; a stale move (the alias is elsewhere) is
    logged and skipped.

    MLflow has no compare-and-set on aliases, so this reads, compares, sets, and reads again:
    another writer between the read and the set is not prevented, only logged (the one
    decision-maker per alias is the guard, whose decisions are recorded before they move
    anything: streamtune/serve/guard.py).
    """
    current = alias_version(client, model_id, alias)
    if current != expected_version:
        log.warning("stale move of %s@%s skipped: expected v%s, it points at %s", model_id, alias, expected_version,
                    f"v{current}" if current is not None else "nothing")
        return False
    if new_version is None:
        client.delete_registered_model_alias(model_id, alias)
    else:
        _set_alias(client, model_id, alias, str(new_version))
    after = alias_version(client, model_id, alias)
    if after != new_version:
        log.warning("%s@%s moved by another writer during a compare-and-set from v%s to %s: it points at %s",
                    model_id, alias, expected_version, new_version, after)
    return True
