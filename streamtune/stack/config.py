"""Typed settings of the local default stack, read once from flags and the shared settings
(core.settings.Settings, the one reader of the STREAMTUNE_* variables).

| setting         | env var                      | default                                      |
|-----------------|------------------------------|----------------------------------------------|
| home            | STREAMTUNE_HOME              | /var/lib/streamtune (root), else ~/.local/state/streamtune |
| data_dir        | STREAMTUNE_DATA_DIR          | <home>/data                                  |
| host            | STREAMTUNE_HOST              | 127.0.0.1                                    |
| kafka_port      | STREAMTUNE_KAFKA_PORT        | 9092                                         |
| postgres_port   | STREAMTUNE_POSTGRES_PORT     | 5432                                         |
| mongo_port      | STREAMTUNE_MONGO_PORT        | 27017                                        |
| mlflow_port     | STREAMTUNE_MLFLOW_PORT       | 5000                                         |
| flink_rest_port | STREAMTUNE_FLINK_REST_PORT   | 8081                                         |
| flink_rpc_port  | STREAMTUNE_FLINK_RPC_PORT    | 6123                                         |
| kafka_address   | STREAMTUNE_KAFKA_BOOTSTRAP   | <host>:<kafka_port>                          |
| tracking_address| STREAMTUNE_MLFLOW_URI, else MLFLOW_TRACKING_URI | http://<host>:<mlflow_port> |

The home holds pid files, logs and the rendered Flink configuration; the data dir holds
PostgreSQL, MongoDB, MLflow artifacts and Flink checkpoints. The home defaults outside
the user's home for root because PostgreSQL runs as the `postgres` user and must be able
to reach its data directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from core.settings import Settings


@dataclass(frozen=True)
class StackConfig:
    home: Path
    data_dir: Path
    host: str = "127.0.0.1"
    kafka_port: int = 9092
    postgres_port: int = 5432
    mongo_port: int = 27017
    mlflow_port: int = 5000
    flink_rest_port: int = 8081
    flink_rpc_port: int = 6123
    postgres_user: str = "streamtune"
    postgres_password: str = "streamtune"
    # Kafka where it is not on `host` (a Kubernetes Service of its own): what clients connect to.
    kafka_address: str = ""
    # MLflow where versions are registered, when not the stack's own (STREAMTUNE_MLFLOW_URI,
    # else MLFLOW_TRACKING_URI: core.settings).
    tracking_address: str = ""

    def __post_init__(self) -> None:
        ports = [self.kafka_port, self.postgres_port, self.mongo_port, self.mlflow_port,
                 self.flink_rest_port, self.flink_rpc_port]
        for port in ports:
            if not 0 < port < 65536:
                raise ValueError(f"port {port} is outside 1..65535")
        if len(set(ports)) != len(ports):
            raise ValueError(f"stack ports must be distinct, got {ports}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides) -> "StackConfig":
        """Build from the shared settings (core.settings.Settings: the STREAMTUNE_* variables);
        keyword overrides (e.g. CLI flags) win."""
        renamed = {"kafka_address": "kafka_bootstrap", "tracking_address": "mlflow_uri"}
        s = Settings.read(env, **{renamed.get(k, k): v for k, v in overrides.items()
                                  if renamed.get(k, k) in Settings.model_fields})
        values: dict = {f: getattr(s, f) for f in ("host", "kafka_port", "postgres_port", "mongo_port", "mlflow_port",
                                                   "flink_rest_port", "flink_rpc_port")}
        values.update(kafka_address=s.kafka_bootstrap or "", tracking_address=s.mlflow_uri or "")
        # The stack's own database login: the stack's business, not a shared setting.
        environ = os.environ if env is None else env
        for name in ("postgres_user", "postgres_password"):
            raw = overrides.get(name) or environ.get(f"STREAMTUNE_{name.upper()}")
            if raw:
                values[name] = raw
        return cls(home=s.home_path, data_dir=s.data_path, **values)

    # Addresses other code (jobs, tests, the CLI) connects to.
    @property
    def kafka_bootstrap(self) -> str:
        """Kafka as clients reach it: STREAMTUNE_KAFKA_BOOTSTRAP (the name jobs and commands
        read too, core/defaults.py), else the stack's own broker on host:kafka_port.

        >>> StackConfig.from_env({"STREAMTUNE_HOME": "/tmp/h"}).kafka_bootstrap
        '127.0.0.1:9092'
        >>> StackConfig.from_env({"STREAMTUNE_HOME": "/tmp/h", "STREAMTUNE_HOST": "flink-rest",
        ...                       "STREAMTUNE_KAFKA_BOOTSTRAP": "kafka:9092"}).kafka_bootstrap
        'kafka:9092'
        """
        return self.kafka_address or f"{self.host}:{self.kafka_port}"

    @property
    def postgres_dsn(self) -> str:
        return self.postgres_dsn_for("streamtune")

    def postgres_dsn_for(self, database: str) -> str:
        return (f"postgresql://{self.postgres_user}:{self.postgres_password}"
                f"@{self.host}:{self.postgres_port}/{database}")

    @property
    def mongo_uri(self) -> str:
        return f"mongodb://{self.host}:{self.mongo_port}/?directConnection=true"

    @property
    def mlflow_uri(self) -> str:
        """The stack's own MLflow server (what `stack up` starts and checks)."""
        return f"http://{self.host}:{self.mlflow_port}"

    @property
    def tracking_uri(self) -> str:
        """Where streamtune registers and reads versions: the stack's MLflow unless the
        environment names another (core/defaults.py tracking_uri_override)."""
        return self.tracking_address or self.mlflow_uri

    @property
    def flink_rest_url(self) -> str:
        return f"http://{self.host}:{self.flink_rest_port}"

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def log_dir(self) -> Path:
        return self.home / "logs"

    def to_json(self) -> str:
        d = asdict(self)
        d.update(home=str(self.home), data_dir=str(self.data_dir))
        return json.dumps(d, indent=2)
