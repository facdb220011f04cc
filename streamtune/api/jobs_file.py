"""The API's own state: the jobs file (jobs.json) and the promotion log (promotions.jsonl).

The jobs file: which spec is in force for each model, and which Flink job serves each topic:

    {"models": {model_id: {"topic", "spec", "spec_hash", "job_id", "response", "registered_at"}},
     "jobs":   {topic: {"job_id", "job_name", "topics": {feedback, configs, versions, dlq},
                        "submitted_at"}},
     "pipelines": {name: {"pipeline", "hash", "kind", …}}}   (streamtune/api/pipelines.py)

Writes go to a temporary file that is renamed over the old one, under a process-wide lock;
one API process per home is assumed.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path


class JobsFile:
    """The jobs file; `load()` answers `{"models": {}, "jobs": {}}` before the first save."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lock = threading.RLock()

    def load(self) -> dict:
        with self.lock:
            try:
                data = json.loads(self.path.read_text())
            except FileNotFoundError:
                data = {}
            data.setdefault("models", {})
            data.setdefault("jobs", {})
            data.setdefault("pipelines", {})
            return data

    def save(self, data: dict) -> None:
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, self.path)


class PromotionLog:
    """promotions.jsonl: one line per alias move (MLflow keeps no alias history)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lock = threading.Lock()

    def append(self, model_id: str, alias: str, from_version: int | None, to_version: int, actor: str) -> dict:
        entry = {"ts": int(time.time() * 1000), "model_id": model_id, "alias": alias,
                 "from": from_version, "to": to_version, "actor": actor}
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")
        return entry

    def entries(self, model_id: str) -> list[dict]:
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("model_id") == model_id:
                out.append(e)
        return out
