"""Paths, addresses and topic names used when nothing else is given.

Each address and path comes from the one settings object, core.settings.Settings (its table
lists every variable and default), so a job started with no options finds what `streamtune
stack up` started. These functions answer from it for an environment mapping (default: the
process's own):

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


def _settings(env: Mapping[str, str] | None):
    from core.settings import Settings  # pydantic-settings: imported when an address is needed

    return Settings.read(env)


def home(env: Mapping[str, str] | None = None) -> Path:
    return _settings(env).home_path


def data_dir(env: Mapping[str, str] | None = None) -> Path:
    return _settings(env).data_path


def kafka_bootstrap(env: Mapping[str, str] | None = None) -> str:
    return _settings(env).kafka_address


def base_model_dir(env: Mapping[str, str] | None = None) -> Path:
    return data_dir(env) / "models" / "tiny-llama"


def artifact_store(env: Mapping[str, str] | None = None) -> str:
    """Where trainers write adapters and registrars read them: a URI every machine reaches."""
    return _settings(env).artifact_store_uri


def tracking_uri_override(env: Mapping[str, str] | None = None) -> str | None:
    """The MLflow tracking URI the environment names, if any: STREAMTUNE_MLFLOW_URI, else MLFLOW_TRACKING_URI."""
    return _settings(env).mlflow_uri


def mlflow_uri(env: Mapping[str, str] | None = None) -> str:
    return _settings(env).tracking_uri


def flink_rest_url(env: Mapping[str, str] | None = None) -> str:
    """The JobManager's REST API, as the TaskManagers reach it."""
    return _settings(env).flink_rest_address


def tokenizer_catalogue_dir(env: Mapping[str, str] | None = None) -> Path:
    return _settings(env).tokenizer_catalogue_path
