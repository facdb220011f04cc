"""The artifact store: written once under the weights' sha256, checked on every read, the same
through a shared directory and through MLflow's artifact proxy (the stack's MLflow server)."""

from __future__ import annotations

import pytest

from connectors.artifact_store import WEIGHTS, ArtifactStore, sha256_hex
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
    uri = store.put(files, sha256_hex(weights))
    assert uri == f"{store.uri}/{sha256_hex(weights)}"
    assert store.put(files, sha256_hex(weights)) == uri  # a replay finds it
    assert store.get(uri, sha256_hex(weights)) == files


def test_missing_and_altered_artifacts_are_detected(store, unique):
    weights = f"weights {unique}".encode()
    with pytest.raises(ArtifactIntegrityError, match="does not exist"):
        store.get(store.uri_for(sha256_hex(weights)), sha256_hex(weights))
    uri = store.put({"adapter_config.json": b"{}", WEIGHTS: weights}, sha256_hex(weights))
    with pytest.raises(ArtifactIntegrityError, match="sha256 mismatch"):
        store.get(uri, "0" * 64)
    with pytest.raises(ArtifactIntegrityError, match="does not hash to"):
        store.put({"adapter_config.json": b"{}", WEIGHTS: b"other"}, sha256_hex(weights))
