"""The control plane: a FastAPI service for stream fine-tune specs, jobs, versions and feedback.

`routes` holds the endpoints, `models` their bodies, `gateway` the calls to Flink, Kafka and
MLflow, `jobs_file` the API's own files, `app` the settings that wire them; `cli` the
command line.
"""

__all__ = ["ApiSettings", "create_app"]


def __getattr__(name: str):
    # Imported on first use: `app` pulls in FastAPI and MLflow, which the client commands
    # of `cli` (and `streamtune --help`) do without.
    if name in __all__:
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
