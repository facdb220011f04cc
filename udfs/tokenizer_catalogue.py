"""The tokenizer catalogue: named tokenizers for `token_count`, added at run time (e.g. one
per source topic).

The catalogue is one JSON file, ``<dir>/catalogue.json``, mapping a name to a local
tokenizer: a Hugging Face tokenizer directory (its ``tokenizer.json``, or what
``AutoTokenizer.from_pretrained(dir, local_files_only=True)`` loads) or a ``tokenizer.json``
file. ``<dir>`` is ``$STREAMTUNE_TOKENIZER_CATALOGUE``, else ``<data dir>/tokenizers``
(core.defaults.tokenizer_catalogue_dir).

Python UDF workers read the same file: a name registered by a client is seen by queries that
are already running within about a second (the file is re-read when it changes), as long as
client and workers share the directory (on the compose cluster: a volume mounted on the
jobmanager and every taskmanager, with STREAMTUNE_TOKENIZER_CATALOGUE pointing at it).
A tokenizer object (not a path) is saved under ``<dir>/store/<name>/`` so workers can load it.

Built in, needing no file: ``whitespace`` (``len(text.split())``).

Only local files are read; nothing is downloaded. Counts exclude special tokens (BOS/EOS
that a tokenizer's post-processor would add).

>>> import tempfile
>>> from tokenizers import Tokenizer, models, pre_tokenizers
>>> tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
>>> tok.pre_tokenizer = pre_tokenizers.Whitespace()       # words and runs of punctuation
>>> catalogue = tempfile.mkdtemp()
>>> stored = register("streamtune.feedback", tok, directory=catalogue)
>>> count("x=1234;y=", "streamtune.feedback", directory=catalogue)   # x = 1234 ; y =
6
>>> count("two  words", "whitespace")
2

Command line: ``python -m udfs.tokenizer_catalogue register NAME PATH [--copy] | unregister NAME | list``.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from core.defaults import tokenizer_catalogue_dir

CATALOGUE_FILE = "catalogue.json"
# Kafka topic names fit, so a tokenizer can be named after its source topic.
NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
BUILTIN: dict[str, Callable[[str], int]] = {"whitespace": lambda text: len(text.split())}
RECHECK_SECONDS = 1.0  # how often a reader looks at the catalogue file for changes

__all__ = ["register", "unregister", "registered", "names", "get", "count", "catalogue_dir"]


def catalogue_dir() -> Path:
    """$STREAMTUNE_TOKENIZER_CATALOGUE, else <data dir>/tokenizers (core.defaults)."""
    return tokenizer_catalogue_dir()


def _dir(directory) -> Path:
    return Path(directory).expanduser() if directory is not None else catalogue_dir()


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(f"tokenizer names match {NAME.pattern}, got {name!r}")


@contextmanager
def _locked(directory: Path):
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read(directory: Path) -> dict[str, str]:
    try:
        entries = json.loads((directory / CATALOGUE_FILE).read_text())
    except FileNotFoundError:
        return {}
    if not isinstance(entries, dict):
        raise ValueError(f"{directory / CATALOGUE_FILE} is not a JSON object")
    return entries


def _write(directory: Path, entries: dict[str, str]) -> None:
    """Atomic: readers see the old file or the new one, never a partial one."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".catalogue-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(entries, f, indent=1, sort_keys=True)
    os.replace(tmp, directory / CATALOGUE_FILE)
    _cache.invalidate()


def _load(path: str) -> Callable[[str], int]:
    """A token counting function for a local tokenizer directory or tokenizer.json file."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if file.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(file))
        return lambda text: len(tok.encode(text, add_special_tokens=False).ids)
    if p.is_dir():  # a slow (vocab file) tokenizer: transformers, strictly offline
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        return lambda text: len(hf(text, add_special_tokens=False)["input_ids"])
    raise FileNotFoundError(f"no tokenizer at {path}")


def register(name: str, tokenizer, *, directory=None, copy: bool = False) -> str:
    """Register `tokenizer` (a local path, or a tokenizers/transformers object) as `name`.

    Re-registering a name replaces it. The tokenizer is loaded once here, so a bad path
    fails now rather than inside a running query. `copy=True` copies a path into the
    catalogue's store first (for workers that share only the catalogue directory). Objects
    are always saved there. Returns the registered path.
    """
    _check_name(name)
    if name in BUILTIN:
        raise ValueError(f"{name!r} is a built-in tokenizer")
    d = _dir(directory)
    with _locked(d):
        if isinstance(tokenizer, (str, os.PathLike)):
            path = Path(tokenizer).expanduser().resolve()
            if copy:
                _load(str(path))  # check before copying
                store = d / "store" / name
                shutil.rmtree(store, ignore_errors=True)
                if path.is_dir():
                    shutil.copytree(path, store)
                    path = store
                else:
                    store.mkdir(parents=True)
                    path = Path(shutil.copy(path, store / "tokenizer.json"))
        elif hasattr(tokenizer, "save_pretrained"):  # transformers tokenizer
            path = d / "store" / name
            tokenizer.save_pretrained(str(path))
        elif hasattr(tokenizer, "to_str"):  # tokenizers.Tokenizer
            path = d / "store" / name / "tokenizer.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            tokenizer.save(str(path))
        else:
            raise TypeError(f"expected a path or a tokenizer object, got {type(tokenizer).__name__}")
        _load(str(path))("check")
        entries = _read(d)
        entries[name] = str(path)
        _write(d, entries)
    return str(path)


def unregister(name: str, *, directory=None) -> bool:
    """Remove `name`; returns whether it was registered."""
    d = _dir(directory)
    with _locked(d):
        entries = _read(d)
        found = entries.pop(name, None) is not None
        if found:
            _write(d, entries)
    return found


def registered(*, directory=None) -> dict[str, str]:
    """The catalogue file's entries: name -> path (built-ins excluded)."""
    return _read(_dir(directory))


def names(*, directory=None) -> list[str]:
    return sorted(set(BUILTIN) | set(registered(directory=directory)))


class _Cache:
    """Catalogue entries and loaded tokenizers, refreshed when the catalogue file changes."""

    def __init__(self):
        self.lock = threading.Lock()
        self.invalidate()

    def invalidate(self) -> None:
        self.checked: dict[Path, float] = {}
        self.stamp: dict[Path, tuple] = {}
        self.entries: dict[Path, dict[str, str]] = {}
        self.loaded: dict[tuple[Path, str], tuple[str, Callable[[str], int]]] = {}

    def get(self, name: str, directory: Path) -> Callable[[str], int]:
        with self.lock:
            now = time.monotonic()
            if now - self.checked.get(directory, -1e9) >= RECHECK_SECONDS:
                self.checked[directory] = now
                try:
                    st = (directory / CATALOGUE_FILE).stat()
                    stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
                except FileNotFoundError:
                    stamp = None
                if stamp != self.stamp.get(directory, ()):
                    self.stamp[directory] = stamp
                    self.entries[directory] = _read(directory) if stamp else {}
                    # a re-registration may have rewritten a tokenizer in place: load afresh
                    self.loaded = {k: v for k, v in self.loaded.items() if k[0] != directory}
            path = self.entries.get(directory, {}).get(name)
            if path is None:
                raise LookupError(f"unknown tokenizer {name!r} (catalogue {directory / CATALOGUE_FILE}; "
                                  f"known: {sorted(set(BUILTIN) | set(self.entries.get(directory, {})))}); "
                                  "register it with udfs.tokenizer_catalogue.register(name, path)")
            hit = self.loaded.get((directory, name))
            if hit is None or hit[0] != path:
                hit = (path, _load(path))
                self.loaded[(directory, name)] = hit
            return hit[1]


_cache = _Cache()


def get(name: str, *, directory=None) -> Callable[[str], int]:
    """The counting function of `name`; raises LookupError for an unknown name."""
    if name in BUILTIN:
        return BUILTIN[name]
    return _cache.get(name, _dir(directory))


def count(text: str, name: str, *, directory=None) -> int:
    """Tokens in `text` under tokenizer `name` (special tokens excluded)."""
    return get(name, directory=directory)(text)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m udfs.tokenizer_catalogue", description="the tokenizer catalogue")
    p.add_argument("--directory",
                   help="catalogue directory (default $STREAMTUNE_TOKENIZER_CATALOGUE or <data dir>/tokenizers)")
    sub = p.add_subparsers(dest="action", required=True)
    r = sub.add_parser("register")
    r.add_argument("name")
    r.add_argument("path")
    r.add_argument("--copy", action="store_true", help="copy it into the catalogue's store directory")
    u = sub.add_parser("unregister")
    u.add_argument("name")
    sub.add_parser("list")
    args = p.parse_args(argv)
    if args.action == "register":
        print(register(args.name, args.path, directory=args.directory, copy=args.copy))
    elif args.action == "unregister":
        return 0 if unregister(args.name, directory=args.directory) else 1
    else:
        for name in BUILTIN:
            print(f"{name}\t(built in)")
        for name, path in sorted(registered(directory=args.directory).items()):
            print(f"{name}\t{path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
