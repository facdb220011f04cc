"""Retention of registered versions against the real MLflow server: every aliased version and
the newest keep_last stay; the rest leave the registry, with their runs and store artifacts."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from connectors.artifact_store import ArtifactStore, artifact_sha256, with_manifest
from connectors.mlflow_registry import make_client, register_version
from connectors.registry_retention import RetentionState, apply_retention, sweep, sweep_every
from core.errors import InvalidMessage
from core.messages import FinetuneSpec, RetentionPolicy, VersionRecord

pytestmark = pytest.mark.docs

SPEC = {"model_id": "bot", "stream_source": "kafka://topic=fb",
        "adapter_config": {"rank": 4, "alpha": 8, "target_modules": ["q_proj"]},
        "trigger_policy": {"min_samples_per_window": 1, "window_seconds": 1}}


def test_spec_retention_is_validated_with_a_default():
    assert FinetuneSpec.model_validate(SPEC).retention is None  # the registration path applies RetentionPolicy()
    assert RetentionPolicy().keep_last == 50
    assert FinetuneSpec.model_validate({**SPEC, "retention": {"keep_last": 7}}).retention.keep_last == 7
    for bad in ({"keep_last": 0}, {"keep_last": 100_001}, {"keep_last": "many"}, {"keep": 5}):
        with pytest.raises(InvalidMessage):
            FinetuneSpec.from_dict({**SPEC, "retention": bad})


def _files(model_id: str, n: int) -> dict[str, bytes]:
    return with_manifest({"adapter_config.json": json.dumps({"r": 4, "n": n}).encode(),
                          "adapter_model.safetensors": f"{model_id} weights {n}".encode()})


def _store_dirs(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if not p.name.startswith(".")} if root.exists() else set()


class CountingClient:
    """The MLflow client, counting the version listings and the rows they return."""

    def __init__(self, client):
        self._client, self.listings, self.rows = client, 0, 0

    def search_model_versions(self, *args, **kwargs):
        page = self._client.search_model_versions(*args, **kwargs)
        self.listings += 1
        self.rows += len(page)
        return page

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_thousand_versions_keep_the_aliased_and_the_last_n(stack_config, unique, tmp_path):
    """1,000 versions registered straight through the registry client, retention applied
    after each as the registration path does: the aliased versions and the newest 50 stay
    (and the few fallen out since the last sweep, until the next)."""
    keep_last, total = 50, 1000
    model_id = f"retain-{unique}"
    client = make_client(stack_config.mlflow_uri)
    counting = CountingClient(client)
    store = ArtifactStore(str(tmp_path / "store"))
    client.create_registered_model(model_id)
    experiment = client.create_experiment(f"retention-test/{model_id}")
    policy, state = RetentionPolicy(keep_last=keep_last), RetentionState()
    uris, runs_with_files = {}, {}
    started = time.monotonic()
    for n in range(1, total + 1):
        files = _files(model_id, n)
        uris[n] = store.put(files, artifact_sha256(files))
        run = client.create_run(experiment)
        if n % 10 == 0:  # a tenth of the runs hold a file: enough to see run artifacts go
            client.log_text(run.info.run_id, "weights", "adapter/adapter_model.safetensors")
            runs_with_files[n] = run.info.run_id
        mv = client.create_model_version(model_id, f"runs:/{run.info.run_id}/adapter", run.info.run_id,
                                         tags={"streamtune.seq": str(n), "streamtune.artifact_uri": uris[n]})
        assert int(mv.version) == n
        if n == 100:
            client.set_registered_model_alias(model_id, "champion", "100")
        if n == 500:
            client.set_registered_model_alias(model_id, "stable", "500")
        if n == 700:  # champion moves on: v100 loses its alias and must go at a later sweep
            client.set_registered_model_alias(model_id, "champion", "700")
        client.set_registered_model_alias(model_id, "candidate", str(n))
        apply_retention(counting, model_id, n, policy, store, state)
    elapsed = time.monotonic() - started
    print(f"{total} versions registered with retention in {elapsed:.1f} s; "
          f"{counting.listings} listings, {counting.rows} rows listed")

    def kept() -> set[int]:
        return {int(v.version) for v in client.search_model_versions(f"name = '{model_id}'", max_results=2000)}

    # Sweeps come every sweep_every versions: those fallen out since the last one wait for the next.
    expected = {500, 700} | set(range(total - keep_last + 1, total + 1))
    last_cutoff = state.swept_below[model_id]
    assert kept() == expected | set(range(last_cutoff + 1, total - keep_last + 1))
    assert total - keep_last - last_cutoff < sweep_every(policy)
    sweep(client, model_id, total - keep_last, store)  # what the next due sweep does
    assert kept() == expected
    assert client.get_registered_model(model_id).aliases == {"champion": "700", "stable": "500", "candidate": "1000"}
    # Store: exactly the kept versions' directories.
    assert _store_dirs(tmp_path / "store") == {uris[n].rsplit("/", 1)[1] for n in expected}
    # Runs of deleted versions: deleted, their files gone; those of kept versions untouched.
    for n, run_id in runs_with_files.items():
        run = client.get_run(run_id)
        if n in expected:
            assert run.info.lifecycle_stage == "active" and client.list_artifacts(run_id, "adapter"), n
        else:
            assert run.info.lifecycle_stage == "deleted" and not client.list_artifacts(run_id, "adapter"), n
    # Cheap: a listing every sweep_every versions, each holding the kept versions and the few to delete.
    due = total - keep_last
    assert counting.listings <= due // sweep_every(policy) + 1
    assert counting.rows <= counting.listings * (keep_last + sweep_every(policy) + 5)
    assert elapsed < 180, f"{elapsed:.0f} s for {total} versions"


def _record(model_id: str, seq: int, store: ArtifactStore, loss_after: float, keep_last: int) -> VersionRecord:
    files = _files(model_id, seq)
    sha256 = artifact_sha256(files)
    return VersionRecord.model_validate({
        "version_id": f"{model_id}@{seq}#0:{seq}-0:{seq}", "model_id": model_id, "seq": seq,
        "window_start": 1000 * seq, "window_end": 1000 * seq + 999, "artifact_uri": store.put(files, sha256),
        "sha256": sha256, "base_model": "/models/tiny-llama", "config_version": 1, "fresh_adapter": seq == 1,
        "adapter": {"rank": 4, "alpha": 8, "target_modules": ["q_proj"]},
        "trigger_policy": {"min_samples_per_window": 1, "window_seconds": 1},
        "metrics": {"loss_before": 2.0, "loss_after": loss_after, "samples": 1, "tokens": 8, "step_seconds": 0.1},
        "lineage": {"sample_ids": [f"s{seq}"], "offsets": [{"topic": "t", "partition": 0, "first": seq, "last": seq}]},
        "trigger": "window", "retention": {"keep_last": keep_last}})


def test_registration_path_applies_the_records_policy(stack_config, unique, tmp_path):
    """register_version (what the registrar and the job's registration run) sweeps by the
    record's policy: v1 stays as champion (later versions have a higher loss), v4-v5 as the
    newest two; v2-v3 go with their runs and store artifacts."""
    model_id = f"retain-path-{unique}"
    client = make_client(stack_config.mlflow_uri)
    store = ArtifactStore(str(tmp_path / "store"))
    registered = {}
    for seq in range(1, 6):
        record = _record(model_id, seq, store, loss_after=0.5 + seq, keep_last=2)
        mv, created = register_version(client, record, store)
        assert created
        registered[seq] = (mv, record)
    kept = sorted(int(v.version) for v in client.search_model_versions(f"name = '{model_id}'"))
    assert kept == [1, 4, 5]
    assert client.get_registered_model(model_id).aliases == {"champion": "1", "candidate": "5"}
    assert _store_dirs(tmp_path / "store") == {registered[s][1].sha256 for s in (1, 4, 5)}
    for seq, (mv, _) in registered.items():
        run = client.get_run(mv.run_id)
        files = client.list_artifacts(mv.run_id)
        if seq in (1, 4, 5):
            assert run.info.lifecycle_stage == "active" and {f.path for f in files} >= {"adapter", "model"}
        else:
            assert run.info.lifecycle_stage == "deleted" and not files, seq
