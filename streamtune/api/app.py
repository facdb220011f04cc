"""The REST control plane (FastAPI). Start it with `streamtune api --host H --port P`.

The endpoints are in `streamtune.api.routes` and `streamtune.api.pipelines`, their bodies in
`streamtune.api.models`, the calls to Flink, Kafka and MLflow in `streamtune.api.gateway`,
the jobs file and promotion log in `streamtune.api.jobs_file`, the CDC captures it runs in
`streamtune.api.captures`.

Every route but /healthz and the console's static files needs a bearer token of its scope
(`streamtune.auth`: admin, read, feedback): checked by `AuthMiddleware` before the request
reaches routing's handlers, answered in the API's one error shape `{"detail": "..."}` with
401 (no or unknown token, `WWW-Authenticate: Bearer`) or 403 (a token of another scope).
The API asks `streamtune serve` for serving stats with STREAMTUNE_SERVE_TOKEN, else with a
read (or admin) token of its own.
"""

import contextlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse

from core import defaults
from core.errors import ConfigError
from core.settings import Settings
from core.response_ids import signing_key
from streamtune.auth import AccessPolicy, AuthMiddleware, TokenStore, read_single_token, route_table
from streamtune.stack.config import StackConfig

from .captures import CaptureSupervisor
from .feedback_limits import FeedbackLimits
from .gateway import StackGateway
from .jobs_file import JobsFile, PromotionLog
from .pipelines import resume_captures
from .pipelines import router as pipelines_router
from .preview import router as preview_router
from .routes import EXCEPTION_HANDLERS, ControlPlane, router

log = logging.getLogger("streamtune.api")

JOB_SCRIPT = Path(__file__).resolve().parents[2] / "jobs" / "stream_finetune.py"


def read_token(token_file: Optional[str], env_var: str = "STREAMTUNE_API_TOKEN") -> Optional[str]:
    """The bearer token: the content of `token_file` when given, else $STREAMTUNE_API_TOKEN
    (or `env_var`).

    A token must be visible ASCII: HTTP headers carry nothing else, so any other token could
    never be sent (the client would crash encoding it).
    """
    return read_single_token(token_file, env_var)


@dataclass
class ApiSettings:
    """How the control plane runs: its stack, auth, request limits, files and submitted job.

    Auth (streamtune.auth): `tokens` holds every scope's tokens; when it is not given, the
    store is made of `token` (admin) and `feedback_token` (feedback), as tests build it.
    `host` is the address the server binds: beyond loopback, no token means ConfigError
    unless `insecure`.
    """

    stack: StackConfig
    token: Optional[str] = None
    feedback_token: Optional[str] = None       # STREAMTUNE_API_FEEDBACK_TOKEN: POST /v1/feedback only
    tokens: Optional[TokenStore] = None
    host: str = "127.0.0.1"
    insecure: bool = False                     # --insecure: no token beyond loopback (tests and demos only)
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
    serve_token: Optional[str] = None          # STREAMTUNE_SERVE_TOKEN; default: a read token of `tokens`
    # POST /v1/feedback's checks (streamtune.api.feedback_limits; 0 = off, tests and demos only).
    response_signing_key: Optional[bytes] = None  # STREAMTUNE_RESPONSE_SIGNING_KEY[_FILE]: verify cited ids
    feedback_rate: float = 50.0                # STREAMTUNE_FEEDBACK_RATE: events/s per token
    feedback_burst: float = 1000.0             # STREAMTUNE_FEEDBACK_BURST
    feedback_max_weight: float = 1.0           # STREAMTUNE_FEEDBACK_MAX_WEIGHT: weights clamped to it
    feedback_max_skew_ms: int = 300_000        # STREAMTUNE_FEEDBACK_MAX_SKEW_MS: ts this far ahead at most
    feedback_max_age_ms: int = 7 * 86_400_000  # STREAMTUNE_FEEDBACK_MAX_AGE_MS: ts this old at most

    def __post_init__(self) -> None:
        s = self.stack
        self.base_model = Path(self.base_model or s.data_dir / "models" / "tiny-llama")
        self.artifact_store = self.artifact_store or defaults.artifact_store({**os.environ,
                                                                              "STREAMTUNE_DATA_DIR": str(s.data_dir)})
        self.jobs_file = Path(self.jobs_file or s.home / "api" / "jobs.json")
        self.promotion_log = Path(self.promotion_log or s.home / "api" / "promotions.jsonl")
        if self.feedback_token is not None and self.feedback_token == self.token:
            raise ConfigError("STREAMTUNE_API_FEEDBACK_TOKEN must differ from the write token")
        if self.tokens is None:
            self.tokens = TokenStore(env={}, static=[(scope, t) for scope, t in (("admin", self.token),
                                                                                ("feedback", self.feedback_token)) if t])
        if self.max_body_bytes < 1 or self.max_feedback_batch < 1:
            raise ConfigError("max_body_bytes and max_feedback_batch must be >= 1")

    @classmethod
    def from_env(cls, token_file: Optional[str] = None, tokens_file: Optional[str] = None,
                 **kwargs) -> "ApiSettings":
        """Stack from STREAMTUNE_*; tokens as streamtune.auth reads them (--tokens-file or
        STREAMTUNE_TOKENS_FILE, STREAMTUNE_TOKENS_DIR, STREAMTUNE_TOKENS_<SCOPE>, and the
        older --token-file / STREAMTUNE_API_TOKEN = admin, STREAMTUNE_API_FEEDBACK_TOKEN =
        feedback); the inference server at STREAMTUNE_SERVE_URL."""
        shared = Settings.read()
        kwargs.setdefault("stack", StackConfig.from_env())
        kwargs.setdefault("cors_origins", shared.cors_origins)
        kwargs.setdefault("serve_url", shared.serve_url)
        kwargs.setdefault("serve_token", read_single_token(None, "STREAMTUNE_SERVE_TOKEN"))
        kwargs.setdefault("response_signing_key", signing_key())
        for name in ("rate", "burst", "max_weight", "max_skew_ms", "max_age_ms"):
            kwargs.setdefault(f"feedback_{name}", getattr(shared, f"feedback_{name}"))
        kwargs.setdefault("tokens", TokenStore(tokens_file=tokens_file, token_file=token_file))
        return cls(**kwargs)


CONSOLE = Path(__file__).resolve().parent / "console"


def add_console(app: FastAPI) -> None:
    """The web console (GET /console) and the front-end feedback hook (GET /feedback.js):
    static files; every action they take is a call to this API with the user's token."""
    def static(name: str, media_type: str):
        return lambda: FileResponse(CONSOLE / name, media_type=media_type, headers={"Cache-Control": "no-cache"})

    app.add_api_route("/console", static("index.html", "text/html"), methods=["GET"], include_in_schema=False)
    app.add_api_route("/console/console.js", static("console.js", "text/javascript"), methods=["GET"],
                      include_in_schema=False)
    app.add_api_route("/console/editor.js", static("editor.js", "text/javascript"), methods=["GET"],
                      include_in_schema=False)
    app.add_api_route("/feedback.js", static("feedback.js", "text/javascript"), methods=["GET"],
                      include_in_schema=False)
    app.add_api_route("/healthz", lambda: {"status": "ok"}, methods=["GET"], include_in_schema=False)


# Routes no token guards: they hold no data (streamtune.auth). The OpenAPI document and its
# pages describe the API: `read`.
PUBLIC_PATHS = ("/console", "/console/console.js", "/console/editor.js", "/feedback.js", "/healthz")
DOC_PATHS = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")


def api_error(status: int, message: str) -> dict:
    """The API's one error shape, 401 and 403 included: {"detail": "..."}."""
    return {"detail": message}


def capture_env(stack: StackConfig, source=None) -> dict[str, str]:
    """The environment of a capture of `source` (a core.sources.SourceKind): the API's own,
    plus the stack's PostgreSQL user and password as libpq defaults (where PGUSER / PGPASSWORD
    are not set) only when the source is the stack's own PostgreSQL server. Any other server
    gets no PGPASSWORD at all: it uses its own secret reference (`password_env`,
    `password_file`). STREAMTUNE_STACK_CREDENTIALS_ANY_HOST=1 hands them to every host, as
    before: for tests and demos only."""
    env = dict(os.environ)
    if on_stack_postgres(stack, source, env) or env.get("STREAMTUNE_STACK_CREDENTIALS_ANY_HOST") == "1":
        env.setdefault("PGUSER", stack.postgres_user)
        env.setdefault("PGPASSWORD", stack.postgres_password)
    else:
        env.pop("PGPASSWORD", None)
    return env


def on_stack_postgres(stack: StackConfig, source, env: dict[str, str]) -> bool:
    """`source` names the stack's PostgreSQL server (host and port; the loopback names are one host)."""
    from core.sources.postgres import PostgresSource

    if not isinstance(source, PostgresSource):
        return False
    host, port = source.host_port
    loopback = {"localhost", "127.0.0.1", "::1"}

    def same(name: str) -> str:
        return "loopback" if name.lower() in loopback else name.lower()

    return (same(host or env.get("PGHOST") or "localhost") == same(stack.host)
            and (port or int(env.get("PGPORT") or 5432)) == stack.postgres_port)


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
    """The app for `settings`: every route behind its scope (streamtune.auth; ConfigError when
    the policy refuses to start), the body limit, one gateway to the stack, the jobs file and
    the promotion log."""
    access = AccessPolicy(settings.tokens, settings.host, settings.insecure, "streamtune api")
    gateway = StackGateway(settings.stack, settings.job_script,
                           ["--base-model", str(settings.base_model), "--artifact-store", settings.artifact_store,
                            "--tracking-uri", settings.stack.tracking_uri, *settings.extra_job_args],
                           settings.flink_timeout_s, serve_url=settings.serve_url,
                           serve_token=lambda: settings.serve_token or settings.tokens.outbound("read"))

    captures = CaptureSupervisor(settings.stack.home / "api" / "captures",
                                 lambda source: capture_env(settings.stack, source))

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
    app.state.access = access
    app.state.control_plane = ControlPlane(gateway=gateway, jobs=JobsFile(settings.jobs_file),
                                           promotions=PromotionLog(settings.promotion_log),
                                           max_feedback_batch=settings.max_feedback_batch,
                                           feedback_limits=FeedbackLimits(
                                               signing_key=settings.response_signing_key,
                                               rate=settings.feedback_rate, burst=settings.feedback_burst,
                                               max_weight=settings.feedback_max_weight,
                                               max_skew_ms=settings.feedback_max_skew_ms,
                                               max_age_ms=settings.feedback_max_age_ms),
                                           captures=captures, pipelines_dir=settings.stack.home / "api" / "pipelines")
    app.include_router(router)
    app.include_router(pipelines_router)
    app.include_router(preview_router)
    add_console(app)
    route_table(app, PUBLIC_PATHS, DOC_PATHS)  # ConfigError now for a route that declares no scope
    # Outermost last: CORS (answers preflights), then auth (before the body is even read), then the body limit.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(AuthMiddleware, policy=access, table_of=lambda: route_table(app, PUBLIC_PATHS, DOC_PATHS),
                       reject=api_error)
    if settings.cors_origins:  # pages on these origins may post feedback (feedback.js)
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    return app
