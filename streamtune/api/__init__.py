"""The control plane: a FastAPI service for stream fine-tune specs, jobs, versions and feedback.

`routes` holds the endpoints, `models` their bodies, `gateway` the calls to Flink, Kafka and
MLflow, `jobs_file` the API's own files, `app` the settings that wire them; `cli` the
command line.
"""

from .app import ApiSettings, create_app

__all__ = ["ApiSettings", "create_app"]
