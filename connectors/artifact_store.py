"""Adapter artifacts in a store every machine reaches: immutable, content-addressed by sha256.

The store is a URI: a local or shared directory (`/path` or `file:///path`), any fsspec
filesystem (`s3://bucket/prefix`, `gs://…`, `hdfs://…`, with its fsspec package installed),
or MLflow's artifact proxy (`mlflow-artifacts://host:port/prefix`). An adapter version lives
at `<store>/<sha256 of adapter_model.safetensors>/`, holding the PEFT files
(`adapter_config.json`, `adapter_model.safetensors`). It is written once; a replay that
produces the same weights finds it there, and one that produces other weights under the same
name is an error. Readers check the weights' sha256: a missing or altered artifact raises
ArtifactIntegrityError and is never used.

>>> import tempfile
>>> store = ArtifactStore(tempfile.mkdtemp())
>>> files = {"adapter_config.json": b"{}", WEIGHTS: b"w"}
>>> uri = store.put(files, sha256_hex(b"w"))
>>> uri.startswith("file://") and uri.endswith(sha256_hex(b"w")), store.get(uri, sha256_hex(b"w")) == files
(True, True)
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from core.errors import ArtifactIntegrityError, ConfigError

WEIGHTS = "adapter_model.safetensors"
FILES = ("adapter_config.json", WEIGHTS)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def store_uri(location: str) -> str:
    """A plain path is a local directory: file:///absolute/path.

    >>> store_uri("/data/adapters"), store_uri("s3://b/adapters/")
    ('file:///data/adapters', 's3://b/adapters')
    """
    if "://" not in location:
        return "file://" + str(Path(location).expanduser().resolve())
    return location.rstrip("/")


class ArtifactStore:
    def __init__(self, location: str, tracking_uri: str | None = None):
        self.uri = store_uri(location)
        self.tracking_uri = tracking_uri
        self.scheme = self.uri.split("://", 1)[0]

    def uri_for(self, sha256: str) -> str:
        return f"{self.uri}/{sha256}"

    # -- writing ------------------------------------------------------------------------
    def put(self, files: dict[str, bytes], sha256: str) -> str:
        """Write a version's files once under its sha256; returns the artifact URI."""
        if sha256_hex(files[WEIGHTS]) != sha256:
            raise ArtifactIntegrityError(f"{WEIGHTS} does not hash to {sha256}")
        uri = self.uri_for(sha256)
        try:
            self.get(uri, sha256)
            return uri  # a replay: the same weights are already there
        except ArtifactIntegrityError as e:
            if "sha256 mismatch" in str(e):  # same name, other weights: the step was not deterministic
                raise
        if self.scheme == "file":
            self._put_local(Path(uri[len("file://"):]), files)
        elif self.scheme == "mlflow-artifacts":
            with tempfile.TemporaryDirectory() as tmp:
                for name, data in files.items():
                    Path(tmp, name).write_bytes(data)
                self._mlflow_repo(uri).log_artifacts(tmp)
        else:
            fs, path = self._fs(uri)
            # The weights last: a reader checks their hash, so a half-written version reads as missing.
            for name in sorted(files, key=lambda n: n == WEIGHTS):
                fs.pipe_file(f"{path}/{name}", files[name])
        return uri

    @staticmethod
    def _put_local(target: Path, files: dict[str, bytes]) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        try:
            os.rename(tmp, target)  # atomic: readers see all files or none
        except OSError:  # a concurrent writer won with the same content
            shutil.rmtree(tmp, ignore_errors=True)

    # -- reading ------------------------------------------------------------------------
    def get(self, uri: str, sha256: str) -> dict[str, bytes]:
        """The version's files, checked against `sha256`; ArtifactIntegrityError otherwise."""
        try:
            files = self._read(uri)
        except (FileNotFoundError, OSError) as e:
            if isinstance(e, FileNotFoundError) or "not found" in str(e).lower() or "404" in str(e):
                raise ArtifactIntegrityError(f"artifact {uri} does not exist") from None
            raise
        if not files:
            raise ArtifactIntegrityError(f"artifact {uri} does not exist")
        missing = [n for n in FILES if n not in files]
        if missing:
            raise ArtifactIntegrityError(f"artifact {uri} lacks {', '.join(missing)}")
        actual = sha256_hex(files[WEIGHTS])
        if actual != sha256:
            raise ArtifactIntegrityError(f"artifact {uri}: sha256 mismatch for {WEIGHTS}: "
                                         f"the record says {sha256}, the store holds {actual}")
        return files

    def _read(self, uri: str) -> dict[str, bytes]:
        if uri.startswith("file://"):
            folder = Path(uri[len("file://"):])
            if not folder.is_dir():
                raise FileNotFoundError(uri)
            return {p.name: p.read_bytes() for p in folder.iterdir() if p.name in FILES}
        if uri.startswith("mlflow-artifacts:"):
            from mlflow.exceptions import MlflowException

            with tempfile.TemporaryDirectory() as tmp:
                try:
                    local = self._mlflow_repo(uri).download_artifacts("", tmp)
                except MlflowException as e:
                    raise FileNotFoundError(f"{uri}: {e}") from None
                return {p.name: p.read_bytes() for p in Path(local).iterdir() if p.name in FILES}
        fs, path = self._fs(uri)
        found = {}
        for name in FILES:
            try:
                found[name] = fs.cat_file(f"{path}/{name}")
            except FileNotFoundError:
                pass
        if not found:
            raise FileNotFoundError(uri)
        return found

    def _fs(self, uri: str):
        import fsspec

        try:
            return fsspec.core.url_to_fs(uri)
        except (ImportError, ValueError) as e:
            raise ConfigError(f"artifact store {self.uri}: {e}") from None

    def _mlflow_repo(self, uri: str):
        from urllib.parse import urlsplit

        from mlflow.store.artifact.mlflow_artifacts_repo import MlflowArtifactsRepository

        # mlflow-artifacts://host:port/… names its server; mlflow-artifacts:/… uses the tracking URI.
        netloc = urlsplit(uri).netloc
        return MlflowArtifactsRepository(uri, tracking_uri=f"http://{netloc}" if netloc else self.tracking_uri)
