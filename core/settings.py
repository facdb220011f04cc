"""The one settings object: every STREAMTUNE_* variable that the stack, the API, `serve`
and the jobs share, read by pydantic-settings.

Each value has one rule, here; `core.defaults` answers from it, `streamtune stack` builds
its StackConfig from it, the API its ApiSettings, and `streamtune config` prints it with
the variable each value came from. An empty variable counts as unset.

| setting          | variable                                         | default                           |
|------------------|--------------------------------------------------|-----------------------------------|
| home             | STREAMTUNE_HOME                                  | /var/lib/streamtune as root, else ~/.local/state/streamtune |
| data_dir         | STREAMTUNE_DATA_DIR                              | <home>/data                       |
| host             | STREAMTUNE_HOST                                  | 127.0.0.1                         |
| *_port           | STREAMTUNE_KAFKA_PORT, _POSTGRES_PORT, _MONGO_PORT, _MLFLOW_PORT, _FLINK_REST_PORT, _FLINK_RPC_PORT | 9092, 5432, 27017, 5000, 8081, 6123 |
| kafka_bootstrap  | STREAMTUNE_KAFKA_BOOTSTRAP                       | <host>:<kafka_port>               |
| mlflow_uri       | STREAMTUNE_MLFLOW_URI, else MLFLOW_TRACKING_URI  | http://<host>:<mlflow_port>       |
| flink_rest_url   | STREAMTUNE_FLINK_REST_URL                        | http://<host>:<flink_rest_port>   |
| artifact_store   | STREAMTUNE_ARTIFACT_STORE                        | file://<data_dir>/adapters        |
| tokenizer_catalogue | STREAMTUNE_TOKENIZER_CATALOGUE                | <data_dir>/tokenizers             |
| api_url          | STREAMTUNE_API_URL                               | http://127.0.0.1:8000             |
| serve_url        | STREAMTUNE_SERVE_URL                             | http://<host>:8100                |
| api_cors_origins | STREAMTUNE_API_CORS_ORIGINS (comma-separated)    | none                              |
| feedback_*       | STREAMTUNE_FEEDBACK_RATE, _BURST, _MAX_WEIGHT, _MAX_SKEW_MS, _MAX_AGE_MS | 50, 1000, 1.0, 300000, 604800000 |

Secrets (tokens, signing keys, passwords) are not settings: streamtune.auth and
core.response_ids read them from files or their own variables, and nothing prints them.

>>> s = Settings.read({"STREAMTUNE_HOST": "10.0.0.5", "STREAMTUNE_KAFKA_PORT": "19092"})
>>> s.kafka_address, s.tracking_uri
('10.0.0.5:19092', 'http://10.0.0.5:5000')
>>> Settings.read({"MLFLOW_TRACKING_URI": "http://a:5000", "STREAMTUNE_MLFLOW_URI": "http://b:5000"}).tracking_uri
'http://b:5000'
>>> Settings.read({"STREAMTUNE_HOME": "/srv/st"}).data_path
PosixPath('/srv/st/data')
>>> Settings.read({"STREAMTUNE_KAFKA_PORT": "kafka"})
Traceback (most recent call last):
...
core.errors.ConfigError: STREAMTUNE_KAFKA_PORT: Input should be a valid integer, unable to parse string as an integer
"""

from __future__ import annotations

import contextvars
import os
from pathlib import Path
from typing import Mapping, Optional

from pydantic import AliasChoices, Field, ValidationError
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from core.errors import ConfigError

PREFIX = "STREAMTUNE_"
# The environment `Settings.read` was given (None: the process's own).
_ENV: contextvars.ContextVar[Optional[Mapping[str, str]]] = contextvars.ContextVar("streamtune_env", default=None)


class _EnvSource(EnvSettingsSource):
    """pydantic-settings' environment source over the mapping `Settings.read` was given."""

    def _load_env_vars(self) -> Mapping[str, Optional[str]]:
        env = _ENV.get()
        env = os.environ if env is None else env
        return {k.lower(): v for k, v in env.items() if v != ""}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="ignore", frozen=True, env_ignore_empty=True,
                                      populate_by_name=True)

    home: Optional[Path] = None
    data_dir: Optional[Path] = None
    host: str = "127.0.0.1"
    kafka_port: int = Field(9092, gt=0, lt=65536)
    postgres_port: int = Field(5432, gt=0, lt=65536)
    mongo_port: int = Field(27017, gt=0, lt=65536)
    mlflow_port: int = Field(5000, gt=0, lt=65536)
    flink_rest_port: int = Field(8081, gt=0, lt=65536)
    flink_rpc_port: int = Field(6123, gt=0, lt=65536)
    kafka_bootstrap: Optional[str] = None
    # MLflow's own variable too, so one setting points streamtune and `mlflow` at the same
    # server; STREAMTUNE_MLFLOW_URI, the narrower one, wins.
    mlflow_uri: Optional[str] = Field(None, validation_alias=AliasChoices("STREAMTUNE_MLFLOW_URI",
                                                                          "MLFLOW_TRACKING_URI"))
    flink_rest_url: Optional[str] = None
    artifact_store: Optional[str] = None
    tokenizer_catalogue: Optional[Path] = None
    api_url: str = "http://127.0.0.1:8000"
    serve_url: Optional[str] = None
    api_cors_origins: str = ""
    feedback_rate: float = Field(50.0, ge=0)
    feedback_burst: float = Field(1000.0, ge=0)
    feedback_max_weight: float = Field(1.0, ge=0)
    feedback_max_skew_ms: int = Field(300_000, ge=0)
    feedback_max_age_ms: int = Field(7 * 86_400_000, ge=0)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return init_settings, _EnvSource(settings_cls)

    @classmethod
    def read(cls, env: Optional[Mapping[str, str]] = None, **overrides) -> "Settings":
        """The settings from `env` (default: the process's environment); keyword overrides
        (command-line flags) win. A bad value raises ConfigError naming its variable."""
        token = _ENV.set(env)
        try:
            return cls(**{k: v for k, v in overrides.items() if v is not None})
        except ValidationError as e:
            first = e.errors()[0]
            field = str(first["loc"][0]) if first.get("loc") else "?"
            raise ConfigError(f"{cls.variables(field)[0] if field in cls.model_fields else field}: "
                              f"{first['msg']}") from None
        finally:
            _ENV.reset(token)

    @classmethod
    def variables(cls, field: str) -> tuple[str, ...]:
        """The variables a field is read from, the first one winning.

        >>> Settings.variables("mlflow_uri")
        ('STREAMTUNE_MLFLOW_URI', 'MLFLOW_TRACKING_URI')
        """
        alias = cls.model_fields[field].validation_alias
        if isinstance(alias, AliasChoices):
            return tuple(str(c) for c in alias.choices)
        return (f"{PREFIX}{field.upper()}",)

    # -- derived values: one rule each --------------------------------------------------
    @property
    def home_path(self) -> Path:
        if self.home is not None:
            return self.home.expanduser().resolve()
        # PostgreSQL runs as `postgres` and must reach its data directory: not under /root.
        if os.geteuid() == 0:
            return Path("/var/lib/streamtune")
        return Path.home() / ".local" / "state" / "streamtune"

    @property
    def data_path(self) -> Path:
        return self.data_dir.expanduser().resolve() if self.data_dir is not None else self.home_path / "data"

    @property
    def kafka_address(self) -> str:
        return self.kafka_bootstrap or f"{self.host}:{self.kafka_port}"

    @property
    def tracking_uri(self) -> str:
        return self.mlflow_uri or f"http://{self.host}:{self.mlflow_port}"

    @property
    def flink_rest_address(self) -> str:
        return self.flink_rest_url or f"http://{self.host}:{self.flink_rest_port}"

    @property
    def artifact_store_uri(self) -> str:
        return self.artifact_store or f"file://{self.data_path / 'adapters'}"

    @property
    def tokenizer_catalogue_path(self) -> Path:
        return self.tokenizer_catalogue.expanduser() if self.tokenizer_catalogue else self.data_path / "tokenizers"

    @property
    def serve_address(self) -> str:
        return self.serve_url or f"http://{self.host}:8100"

    @property
    def cors_origins(self) -> list[str]:
        return [o.strip() for o in self.api_cors_origins.split(",") if o.strip()]
