"""MLflow tracking and registry server on the stack's PostgreSQL, artifacts on local disk."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import requests

from .component import Component
from .process import spawn


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
              env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"))
