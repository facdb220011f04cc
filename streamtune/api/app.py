"""The REST control plane (FastAPI). Start it with `streamtune api --host H --port P`.

The endpoints are in `streamtune.api.routes` and `streamtune.api.pipelines`, their bodies in
`streamtune.api.models`, the calls to Flink, Kafka and MLflow in `streamtune.api.gateway`,
the jobs file and promotion log in `streamtune.api.jobs_file`, the CDC captures it runs in
`streamtune.api.captures`.
"""

import contextlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse

from core import defaults
from core.errors import ConfigError
from streamtune.stack.config import StackConfig

from .captures import CaptureSupervisor
from .gateway import StackGateway
from .jobs_file import JobsFile, PromotionLog
from .pipelines import resume_captures
from .pipelines import router as pipelines_router
from .routes import EXCEPTION_HANDLERS, ControlPlane, router

log = logging.getLogger("streamtune.api")

JOB_SCRIPT = Path(__file__).resolve().parents[2] / "jobs" / "stream_finetune.py"


def read_token(token_file: Optional[str], env_var: str = "STREAMTUNE_API_TOKEN") -> Optional[str]:
    """The bearer token: the content of `token_file` when given, else $STREAMTUNE_API_TOKEN
    (or `env_var`).

    A token must be visible ASCII: HTTP headers carry nothing else, so any other token could
    never be sent (the client would crash encoding it).
    """
    if not token_file:
        token, source = os.environ.get(env_var) or None, env_var
    else:
        source = f"--token-file {token_file}"
        try:
            token = Path(token_file).read_text().strip() or None
        except OSError as e:
            raise ConfigError(f"{source}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{source}: not a text file (UTF-8)") from None
    if token is not None and not re.fullmatch(r"[\x21-\x7e]+", token):
        raise ConfigError(f"{source}: a token must be visible ASCII characters, no spaces")
    return token


@dataclass
class ApiSettings:
    """How the control plane runs: its stack, auth, request limits, files and submitted job."""

    stack: StackConfig
    token: Optional[str] = None
    feedback_token: Optional[str] = None       # STREAMTUNE_API_FEEDBACK_TOKEN: POST /v1/feedback only
    read_auth: bool = False
    max_body_bytes: int = 1 << 20
    max_feedback_batch: int = 500
    base_model: Optional[Path] = None          # default <data_dir>/models/tiny-llama
    artifact_store: Optional[str] = None       # default STREAMTUNE_ARTIFACT_STORE, else <data_dir>/adapters
    jobs_file: Optional[Path] = None           # default <home>/api/jobs.json
    promotion_log: Optional[Path] = None       # default <home>/api/promotions.jsonl
    job_script: Path = JOB_SCRIPT
    extra_job_args: list[str] = field(default_factory=list)
    flink_timeout_s: float = 300.0
    cors_origins: list[str] = field(default_factory=list)  # STREAMTUNE_API_CORS_ORIGINS, comma-separated
    serve_url: Optional[str] = None            # STREAMTUNE_SERVE_URL, default http://<stack host>:8100

    def __post_init__(self) -> None:
        s = self.stack
        self.base_model = Path(self.base_model or s.data_dir / "models" / "tiny-llama")
        self.artifact_store = self.artifact_store or defaults.artifact_store({**os.environ,
                                                                              "STREAMTUNE_DATA_DIR": str(s.data_dir)})
        self.jobs_file = Path(self.jobs_file or s.home / "api" / "jobs.json")
        self.promotion_log = Path(self.promotion_log or s.home / "api" / "promotions.jsonl")
        if self.feedback_token is not None and self.feedback_token == self.token:
            raise ConfigError("STREAMTUNE_API_FEEDBACK_TOKEN must differ from the write token")
        if self.max_body_bytes < 1 or self.max_feedback_batch < 1:
            raise ConfigError("max_body_bytes and max_feedback_batch must be >= 1")

    @classmethod
    def from_env(cls, token_file: Optional[str] = None, **kwargs) -> "ApiSettings":
        """Stack from STREAMTUNE_*; token from --token-file, else STREAMTUNE_API_TOKEN; the
        feedback token from STREAMTUNE_API_FEEDBACK_TOKEN; the inference server at
        STREAMTUNE_SERVE_URL; read auth on when STREAMTUNE_API_READ_AUTH is 1/true/yes."""
        read_auth = os.environ.get("STREAMTUNE_API_READ_AUTH", "").lower() in ("1", "true", "yes")
        kwargs.setdefault("stack", StackConfig.from_env())
        kwargs.setdefault("read_auth", read_auth)
        kwargs.setdefault("cors_origins", [o.strip() for o in os.environ.get("STREAMTUNE_API_CORS_ORIGINS", "").split(",")
                                           if o.strip()])
        kwargs.setdefault("feedback_token", read_token(None, "STREAMTUNE_API_FEEDBACK_TOKEN"))
        kwargs.setdefault("serve_url", os.environ.get("STREAMTUNE_SERVE_URL") or None)
        return cls(token=read_token(token_file), **kwargs)


CONSOLE = Path(__file__).resolve().parent / "console"


def add_console(app: FastAPI) -> None:
    """The web console (GET /console) and the front-end feedback hook (GET /feedback.js):
    static files; every action they take is a call to this API with the user's token."""
    def static(name: str, media_type: str):
        return lambda: FileResponse(CONSOLE / name, media_type=media_type, headers={"Cache-Control": "no-cache"})

    app.add_api_route("/console", static("index.html", "text/html"), methods=["GET"], include_in_schema=False)
    app.add_api_route("/console/console.js", static("console.js", "text/javascript"), methods=["GET"],
                      include_in_schema=False)
    app.add_api_route("/feedback.js", static("feedback.js", "text/javascript"), methods=["GET"],
                      include_in_schema=False)


def capture_env(stack: StackConfig) -> dict[str, str]:
    """The environment of the captures: the API's own, with the stack's PostgreSQL user and
    password as libpq defaults where PGUSER / PGPASSWORD are not set (pipelines hold no
    credentials)."""
    env = dict(os.environ)
    env.setdefault("PGUSER", stack.postgres_user)
    env.setdefault("PGPASSWORD", stack.postgres_password)
    return env


class BodyLimit:
    """ASGI middleware: 413 for a body over `max_bytes` (declared or streamed)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def _reject(self, send) -> None:
        body = json.dumps({"detail": f"request body exceeds {self.max_bytes} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    if int(value) > self.max_bytes:
                        return await self._reject(send)
                except ValueError:
                    pass
        chunks, total, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                return await self._reject(send)
            chunks.append(chunk)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def create_app(settings: ApiSettings) -> FastAPI:
    """The app for `settings`: the routes behind the token, the body limit, one gateway to
    the stack, the jobs file and the promotion log."""
    gateway = StackGateway(settings.stack, settings.job_script,
                           ["--base-model", str(settings.base_model), "--artifact-store", settings.artifact_store,
                            "--tracking-uri", settings.stack.mlflow_uri, *settings.extra_job_args],
                           settings.flink_timeout_s, serve_url=settings.serve_url)

    captures = CaptureSupervisor(settings.stack.home / "api" / "captures", capture_env(settings.stack))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            resume_captures(app.state.control_plane)
        except Exception as e:  # a pipeline on record that no longer validates must not keep the API down
            log.error("resuming the pipelines' captures failed: %s", e)
        yield
        captures.close()
        gateway.close()

    app = FastAPI(title="streamtune control plane", version="1", lifespan=lifespan,
                  description=__doc__.split("\n\n")[0], exception_handlers=EXCEPTION_HANDLERS)
    app.state.control_plane = ControlPlane(gateway=gateway, jobs=JobsFile(settings.jobs_file),
                                           promotions=PromotionLog(settings.promotion_log), token=settings.token,
                                           feedback_token=settings.feedback_token,
                                           read_auth=settings.read_auth,
                                           max_feedback_batch=settings.max_feedback_batch,
                                           captures=captures, pipelines_dir=settings.stack.home / "api" / "pipelines")
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.include_router(router)
    app.include_router(pipelines_router)
    add_console(app)
    if settings.cors_origins:  # pages on these origins may post feedback (feedback.js)
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    return app
