"""MLflow tracking and registry server on the stack's PostgreSQL, artifacts on local disk."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import requests

from .component import Component
from .process import spawn


# `streamtune serve` registers a webhook for alias moves (connectors/mlflow_webhook.py):
# plain http on this machine, the webhook list looked up every second. No retries and a short
# timeout: a killed server's webhook must not hold MLflow's ten delivery threads for seconds
# on every event; a push that fails is caught by the server's registry poll.
WEBHOOKS = {"MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https", "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
            "MLFLOW_WEBHOOK_CACHE_TTL": "1", "MLFLOW_WEBHOOK_REQUEST_MAX_RETRIES": "0",
            "MLFLOW_WEBHOOK_REQUEST_TIMEOUT": "5"}


class MLflow(Component):
    name = "mlflow"
    startup_timeout = 90.0

    @property
    def address(self) -> str:
        return self.config.mlflow_uri

    def healthy(self) -> bool:
        return requests.get(f"{self.config.mlflow_uri}/health", timeout=3).status_code == 200

    def launch(self) -> None:
        artifacts = self.config.data_dir / "mlflow-artifacts"
        artifacts.mkdir(parents=True, exist_ok=True)
        backend = self.config.postgres_dsn_for("mlflow").replace("postgresql://", "postgresql+psycopg2://", 1)
        mlflow = str(Path(sys.executable).parent / "mlflow")
        spawn([mlflow, "server", "--host", self.config.host, "--port", str(self.config.mlflow_port),
               "--workers", "1", "--backend-store-uri", backend,
               "--artifacts-destination", str(artifacts), "--serve-artifacts"],
              self.log_file, self.pid_file,
              # The job runner (for GenAI evaluation jobs) forks ~8 workers of ~270 MB each.
              env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", **WEBHOOKS,
                       MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY=self.webhook_key()))

    def webhook_key(self) -> str:
        """The key MLflow encrypts webhook secrets with, kept with the stack's data: a restarted
        server still reads the secrets of the webhooks it holds."""
        path = self.config.data_dir / "mlflow-webhook.key"
        if not path.exists():
            from cryptography.fernet import Fernet
            path.write_bytes(Fernet.generate_key())
            path.chmod(0o600)
        return path.read_text().strip()
