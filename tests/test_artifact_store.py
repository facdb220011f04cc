"""The artifact store: written once under the sha256 of its manifest (every file), checked file
by file on every read, the same through a shared directory and through MLflow's artifact proxy
(the stack's MLflow server)."""

from __future__ import annotations

import pytest

from connectors.artifact_store import MANIFEST, WEIGHTS, ArtifactStore, artifact_sha256, manifest_bytes
from core.errors import ArtifactIntegrityError

pytestmark = pytest.mark.deploy


@pytest.fixture(params=["file", "mlflow-artifacts"])
def store(request, stack_config, tmp_path, unique) -> ArtifactStore:
    if request.param == "file":
        return ArtifactStore(str(tmp_path / "adapters"))
    host = stack_config.mlflow_uri.split("://", 1)[1]
    return ArtifactStore(f"mlflow-artifacts://{host}/test-adapters-{unique}")


def test_put_is_content_addressed_and_idempotent(store, unique):
    weights = f"weights {unique}".encode() * 100
    files = {"adapter_config.json": b'{"r": 4}', WEIGHTS: weights}
    sha256 = artifact_sha256(files)
    uri = store.put(files, sha256)
    assert uri == f"{store.uri}/{sha256}"
    assert store.put(files, sha256) == uri  # a replay finds it
    assert store.get(uri, sha256) == {**files, MANIFEST: manifest_bytes(files)}
    # Equal weights, another config: another version, never the first one's config.
    other = {**files, "adapter_config.json": b'{"r": 4, "lora_alpha": 64}'}
    assert artifact_sha256(other) != sha256
    assert store.get(store.put(other, artifact_sha256(other)), artifact_sha256(other))["adapter_config.json"] \
        == other["adapter_config.json"]


def test_missing_and_altered_artifacts_are_detected(store, unique):
    files = {"adapter_config.json": b"{}", WEIGHTS: f"weights {unique}".encode()}
    sha256 = artifact_sha256(files)
    with pytest.raises(ArtifactIntegrityError, match="does not exist"):
        store.get(store.uri_for(sha256), sha256)
    uri = store.put(files, sha256)
    with pytest.raises(ArtifactIntegrityError, match="sha256 mismatch for manifest.json"):
        store.get(uri, "0" * 64)
    with pytest.raises(ArtifactIntegrityError, match="does not hash to"):
        store.put({"adapter_config.json": b"{}", WEIGHTS: b"other"}, sha256)
