"""Adapter artifacts in a store every machine reaches: immutable, content-addressed by a manifest.

The store is a URI: a local or shared directory (`/path` or `file:///path`), any fsspec
filesystem (`s3://bucket/prefix`, `gs://…`, `hdfs://…`, with its fsspec package installed),
or MLflow's artifact proxy (`mlflow-artifacts://host:port/prefix`).

A version's address and its recorded sha256 cover the WHOLE artifact, not its weights only:
`manifest.json` lists every file with its own sha256 (canonical JSON: names sorted, no
spaces), and the address is the sha256 of those manifest bytes. A version lives at
`<store>/<address>/`, holding the PEFT files (`adapter_config.json`,
`adapter_model.safetensors`, any future file) and `manifest.json` beside them. Equal weights
with another config (alpha, rank, targets) get another address, and a changed config is as
visible as changed weights. It is written once; a replay that produces the same files finds
it there, and one that produces other files under the same name is an error.

Every reader goes through `verify_artifact` (the store's `get` does): the manifest must hash
to the recorded sha256, every file it lists must be there with its sha256, and nothing else
may be in the directory. Anything else raises ArtifactIntegrityError naming the file, and
the version is never used. `get` returns the files with `manifest.json` among them, so
whoever copies the artifact on (MLflow's run, a vLLM directory) copies its proof too.

`STREAMTUNE_ARTIFACT_ADDRESS=weights` brings back the old rule (address = sha256 of the
weights; config and extra files unchecked, no manifest). For tests/demo only: it lets the
security tests show a changed config passing without this defence.

>>> import json, tempfile
>>> store = ArtifactStore(tempfile.mkdtemp())
>>> files = {"adapter_config.json": b"{}", WEIGHTS: b"w"}
>>> sorted(json.loads(manifest_bytes(files))["files"])
['adapter_config.json', 'adapter_model.safetensors']
>>> address = artifact_sha256(files)
>>> uri = store.put(files, address)
>>> uri.endswith(address), sorted(store.get(uri, address))
(True, ['adapter_config.json', 'adapter_model.safetensors', 'manifest.json'])
>>> artifact_sha256({**files, "adapter_config.json": b'{"lora_alpha": 64}'}) != address  # same weights
True
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from core.errors import ArtifactIntegrityError, ConfigError

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
MANIFEST = "manifest.json"
FILES = (CONFIG, WEIGHTS)  # what every adapter version holds; its manifest may list more
ADDRESS_RULE_ENV = "STREAMTUNE_ARTIFACT_ADDRESS"  # "weights": the old rule, for tests/demo only


class ArtifactMissing(ArtifactIntegrityError):
    """The artifact, or one of its files, is not (yet) in the store: a writer may (re)write it."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def weights_only() -> bool:
    """Whether the old weights-only address rule is switched on (tests/demo only)."""
    return os.environ.get(ADDRESS_RULE_ENV, "").strip().lower() == "weights"


def content_files(files: dict[str, bytes]) -> dict[str, bytes]:
    """The files a manifest lists: all but the manifest itself."""
    return {name: data for name, data in files.items() if name != MANIFEST}


def manifest_bytes(files: dict[str, bytes]) -> bytes:
    """The canonical manifest of `files` (a `manifest.json` among them is left out).

    >>> manifest_bytes({"b": b"", "a": b""}).startswith(b'{"files":{"a":"e3b0c442')
    True
    """
    listing = {name: sha256_hex(data) for name, data in sorted(content_files(files).items())}
    return json.dumps({"files": listing}, sort_keys=True, separators=(",", ":")).encode()


def artifact_sha256(files: dict[str, bytes]) -> str:
    """The version's address and recorded sha256: of its manifest (of its weights under the old rule)."""
    if weights_only():
        return sha256_hex(files[WEIGHTS])
    return sha256_hex(manifest_bytes(files))


def with_manifest(files: dict[str, bytes]) -> dict[str, bytes]:
    """`files` and their manifest, as they are stored (the manifest alone under the old rule is left out)."""
    content = content_files(files)
    return content if weights_only() else {**content, MANIFEST: manifest_bytes(content)}


def verify_artifact(files: dict[str, bytes], sha256: str, where: str) -> dict[str, bytes]:
    """`files` (all of a version's directory, manifest included) if they are the version
    recorded as `sha256`; ArtifactIntegrityError naming the first file that is not.

    >>> files = with_manifest({"adapter_config.json": b'{"r": 4}', WEIGHTS: b"w"})
    >>> good = artifact_sha256(files)
    >>> verify_artifact(files, good, "v1") == files
    True
    >>> verify_artifact({**files, "adapter_config.json": b'{"r": 64}'}, good, "v1")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    core.errors.ArtifactIntegrityError: artifact v1: sha256 mismatch for adapter_config.json: the manifest says 9006e6...
    """
    if weights_only():  # the old rule: weights checked, everything else taken as found
        missing = [n for n in FILES if n not in files]
        if missing:
            raise ArtifactMissing(f"artifact {where} lacks {', '.join(missing)}")
        if sha256_hex(files[WEIGHTS]) != sha256:
            raise ArtifactIntegrityError(f"artifact {where}: sha256 mismatch for {WEIGHTS}: the record says "
                                         f"{sha256}, the store holds {sha256_hex(files[WEIGHTS])}")
        return {n: files[n] for n in FILES}
    if MANIFEST not in files:
        raise ArtifactMissing(f"artifact {where} lacks {MANIFEST}")
    actual = sha256_hex(files[MANIFEST])
    if actual != sha256:
        raise ArtifactIntegrityError(f"artifact {where}: sha256 mismatch for {MANIFEST} (the list of "
                                     f"{', '.join(sorted(content_files(files)))}): the record says {sha256}, "
                                     f"the store holds {actual}")
    try:
        listed = json.loads(files[MANIFEST])["files"]
        assert isinstance(listed, dict) and all(isinstance(v, str) for v in listed.values())
    except (ValueError, KeyError, TypeError, AssertionError):
        raise ArtifactIntegrityError(f"artifact {where}: {MANIFEST} is not a manifest") from None
    for name in sorted(set(FILES) | set(listed)):
        if name not in files:
            raise ArtifactMissing(f"artifact {where} lacks {name}")
        if name not in listed:
            raise ArtifactIntegrityError(f"artifact {where}: {MANIFEST} does not list {name}")
        found = sha256_hex(files[name])
        if found != listed[name]:
            raise ArtifactIntegrityError(f"artifact {where}: sha256 mismatch for {name}: the manifest says "
                                         f"{listed[name]}, the store holds {found}")
    extra = sorted(set(content_files(files)) - set(listed))
    if extra:
        raise ArtifactIntegrityError(f"artifact {where} holds {', '.join(extra)}, which its {MANIFEST} "
                                     "does not list")
    return files


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
        """Write a version's files and their manifest once under `sha256` (artifact_sha256 of
        the files); returns the artifact URI."""
        stored = with_manifest(files)
        if MANIFEST in files and files[MANIFEST] != stored.get(MANIFEST):
            raise ArtifactIntegrityError(f"the {MANIFEST} given does not list the files given")
        if artifact_sha256(stored) != sha256:
            raise ArtifactIntegrityError(f"the artifact ({', '.join(sorted(stored))}) does not hash to {sha256}")
        uri = self.uri_for(sha256)
        try:
            self.get(uri, sha256)
            return uri  # a replay: the same files are already there
        except ArtifactMissing:
            pass  # not there, or half written by a writer that died: (re)write
        # Anything else under this name (other bytes, an unlisted file): the step was not
        # deterministic, or the store was tampered with. Raised, never papered over.
        if self.scheme == "file":
            if not self._put_local(Path(uri[len("file://"):]), stored):
                self.get(uri, sha256)  # another writer's directory is there: it must be this version
        elif self.scheme == "mlflow-artifacts":
            with tempfile.TemporaryDirectory() as tmp:
                for name, data in stored.items():
                    Path(tmp, name).write_bytes(data)
                self._mlflow_repo(uri).log_artifacts(tmp)
        else:
            fs, path = self._fs(uri)
            # The manifest (weights, under the old rule) last: a half-written version reads as missing.
            last = WEIGHTS if weights_only() else MANIFEST
            for name in sorted(stored, key=lambda n: n == last):
                fs.pipe_file(f"{path}/{name}", stored[name])
        return uri

    @staticmethod
    def _put_local(target: Path, files: dict[str, bytes]) -> bool:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        try:
            os.rename(tmp, target)  # atomic: readers see all files or none
            return True
        except OSError:  # a concurrent writer won (or a broken directory is in the way)
            shutil.rmtree(tmp, ignore_errors=True)
            return False

    # -- deleting -----------------------------------------------------------------------
    def delete(self, uri: str) -> bool:
        """Remove a version's directory (the registry's retention policy); whether it was there.
        Only URIs under this store: a record naming another place is not ours to delete."""
        if not uri.startswith(self.uri + "/") or "/" in uri[len(self.uri) + 1:].strip("/"):
            raise ArtifactIntegrityError(f"artifact {uri} is not a version directory of the store {self.uri}")
        if self.scheme == "file":
            folder = Path(uri[len("file://"):])
            if not folder.is_dir():
                return False
            # Renamed away first: a reader sees the whole version or nothing, never half of it.
            doomed = folder.parent / f".deleted-{uuid.uuid4().hex}"
            try:
                os.rename(folder, doomed)
            except FileNotFoundError:
                return False
            shutil.rmtree(doomed, ignore_errors=True)
            return True
        if self.scheme == "mlflow-artifacts":
            from mlflow.exceptions import MlflowException

            try:
                self._mlflow_repo(uri).delete_artifacts()
            except MlflowException:
                return False
            return True
        fs, path = self._fs(uri)
        if not fs.exists(path):
            return False
        fs.rm(path, recursive=True)
        return True

    # -- reading ------------------------------------------------------------------------
    def get(self, uri: str, sha256: str) -> dict[str, bytes]:
        """The version's files (manifest.json among them), each checked against the manifest
        that `sha256` names (verify_artifact); ArtifactIntegrityError otherwise."""
        try:
            files = self._read(uri)
        except (FileNotFoundError, OSError) as e:
            if isinstance(e, FileNotFoundError) or "not found" in str(e).lower() or "404" in str(e):
                raise ArtifactMissing(f"artifact {uri} does not exist") from None
            raise
        if not files:
            raise ArtifactMissing(f"artifact {uri} does not exist")
        return verify_artifact(files, sha256, uri)

    def _read(self, uri: str) -> dict[str, bytes]:
        """Every entry of the version's directory (a subdirectory too: it is not in any manifest)."""
        if uri.startswith("file://"):
            folder = Path(uri[len("file://"):])
            if not folder.is_dir():
                raise FileNotFoundError(uri)
            return {p.name: p.read_bytes() if p.is_file() else b"" for p in folder.iterdir()}
        if uri.startswith("mlflow-artifacts:"):
            from mlflow.exceptions import MlflowException

            with tempfile.TemporaryDirectory() as tmp:
                try:
                    local = self._mlflow_repo(uri).download_artifacts("", tmp)
                except MlflowException as e:
                    raise FileNotFoundError(f"{uri}: {e}") from None
                return {p.name: p.read_bytes() if p.is_file() else b"" for p in Path(local).iterdir()}
        fs, path = self._fs(uri)
        try:
            entries = fs.ls(path, detail=True)
        except FileNotFoundError:
            raise FileNotFoundError(uri) from None
        found = {}
        for entry in entries:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            found[name] = fs.cat_file(entry["name"]) if entry.get("type") == "file" else b""
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
