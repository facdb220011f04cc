"""The control plane: a FastAPI service for stream fine-tune specs, jobs, versions and feedback.

See `streamtune.api.app` for the endpoints and `streamtune.api.cli` for the command line.
"""

from .app import ApiSettings, create_app

__all__ = ["ApiSettings", "create_app"]
