"""Paths, addresses and topic names used when nothing else is given.

The same rules as the local stack (`streamtune stack`, docs/guides/local-stack.md),
so a job started with no options finds what `streamtune stack up` started:

| value            | environment variable                      | default                          |
|------------------|-------------------------------------------|----------------------------------|
| home             | STREAMTUNE_HOME                           | /var/lib/streamtune as root, else ~/.local/state/streamtune |
| data dir         | STREAMTUNE_DATA_DIR                       | <home>/data                      |
| Kafka bootstrap  | STREAMTUNE_KAFKA_BOOTSTRAP, else STREAMTUNE_HOST:STREAMTUNE_KAFKA_PORT | 127.0.0.1:9092 |
| base model       |                                           | <data dir>/models/tiny-llama     |
| artifact store   | STREAMTUNE_ARTIFACT_STORE                 | file://<data dir>/adapters       |
| MLflow tracking  | STREAMTUNE_MLFLOW_URI, else MLFLOW_TRACKING_URI, else http://STREAMTUNE_HOST:STREAMTUNE_MLFLOW_PORT | http://127.0.0.1:5000 |
| tokenizer catalogue | STREAMTUNE_TOKENIZER_CATALOGUE         | <data dir>/tokenizers            |

>>> kafka_bootstrap({"STREAMTUNE_HOST": "10.0.0.5", "STREAMTUNE_KAFKA_PORT": "19092"})
'10.0.0.5:19092'
>>> str(data_dir({"STREAMTUNE_HOME": "/srv/st"}))
'/srv/st/data'

The MLflow tracking URI honours MLFLOW_TRACKING_URI, the variable MLflow's own tools read,
so one setting points streamtune and `mlflow` at the same server; STREAMTUNE_MLFLOW_URI,
the narrower one, wins over it. Every default goes through `tracking_uri_override` (jobs'
and `serve`'s --tracking-uri, the registrar, the API through StackConfig.tracking_uri):

>>> mlflow_uri({"MLFLOW_TRACKING_URI": "http://mlflow.internal:5000"})
'http://mlflow.internal:5000'
>>> mlflow_uri({"MLFLOW_TRACKING_URI": "http://a:5000", "STREAMTUNE_MLFLOW_URI": "http://b:5000"})
'http://b:5000'
>>> mlflow_uri({"STREAMTUNE_MLFLOW_PORT": "5001"})
'http://127.0.0.1:5001'
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

FEEDBACK_TOPIC = "streamtune.feedback"
CONFIG_TOPIC = "streamtune.configs"
VERSIONS_TOPIC = "streamtune.versions"
DLQ_TOPIC = "streamtune.dlq"
ADAPTER_VERSIONS_TOPIC = "streamtune.adapter-versions"
CDC_OFFSETS_TOPIC = "streamtune.cdc-offsets"
INFERENCE_LOG_TOPIC = "streamtune.inference-log"
REVIEW_TOPIC = "streamtune.review"  # pseudo-label candidates below the threshold (core/messages/review.py)
ALIAS_MOVES_TOPIC = "streamtune.alias-moves"
# Every job's broadcast topic (`<topic>.adapter-versions` from the API, and the default).
BROADCAST_TOPIC_PATTERN = r".*adapter-versions"


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def home(env: Mapping[str, str] | None = None) -> Path:
    value = _env(env).get("STREAMTUNE_HOME")
    if value:
        return Path(value).expanduser().resolve()
    # PostgreSQL runs as `postgres` and must reach its data directory: not under /root.
    if os.geteuid() == 0:
        return Path("/var/lib/streamtune")
    return Path.home() / ".local" / "state" / "streamtune"


def data_dir(env: Mapping[str, str] | None = None) -> Path:
    value = _env(env).get("STREAMTUNE_DATA_DIR")
    return Path(value).expanduser().resolve() if value else home(env) / "data"


def kafka_bootstrap(env: Mapping[str, str] | None = None) -> str:
    e = _env(env)
    return e.get("STREAMTUNE_KAFKA_BOOTSTRAP") or \
        f"{e.get('STREAMTUNE_HOST', '127.0.0.1')}:{e.get('STREAMTUNE_KAFKA_PORT', '9092')}"


def base_model_dir(env: Mapping[str, str] | None = None) -> Path:
    return data_dir(env) / "models" / "tiny-llama"


def artifact_store(env: Mapping[str, str] | None = None) -> str:
    """Where trainers write adapters and registrars read them: a URI every machine reaches."""
    return _env(env).get("STREAMTUNE_ARTIFACT_STORE") or f"file://{data_dir(env) / 'adapters'}"


def tracking_uri_override(env: Mapping[str, str] | None = None) -> str | None:
    """The MLflow tracking URI the environment names, if any: STREAMTUNE_MLFLOW_URI, else MLFLOW_TRACKING_URI."""
    e = _env(env)
    return e.get("STREAMTUNE_MLFLOW_URI") or e.get("MLFLOW_TRACKING_URI") or None


def mlflow_uri(env: Mapping[str, str] | None = None) -> str:
    e = _env(env)
    return tracking_uri_override(e) or \
        f"http://{e.get('STREAMTUNE_HOST', '127.0.0.1')}:{e.get('STREAMTUNE_MLFLOW_PORT', '5000')}"


def flink_rest_url(env: Mapping[str, str] | None = None) -> str:
    """The JobManager's REST API, as the TaskManagers reach it."""
    e = _env(env)
    return e.get("STREAMTUNE_FLINK_REST_URL") or \
        f"http://{e.get('STREAMTUNE_HOST', '127.0.0.1')}:{e.get('STREAMTUNE_FLINK_REST_PORT', '8081')}"


def tokenizer_catalogue_dir(env: Mapping[str, str] | None = None) -> Path:
    value = _env(env).get("STREAMTUNE_TOKENIZER_CATALOGUE")
    return Path(value).expanduser() if value else data_dir(env) / "tokenizers"
