"""`streamtune serve`: an OpenAI-compatible inference server that follows adapter versions.

| method | path                                  | scope     | what                                          |
|--------|---------------------------------------|-----------|-----------------------------------------------|
| POST   | /v1/completions                       | inference | greedy completion by the routed version       |
| POST   | /v1/chat/completions                  | inference | the same through the base's chat template     |
| GET    | /v1/models                            | inference | served models, aliases, hot and refused versions |
| PUT    | /v1/models/{model_id}/split           | admin     | the fraction of traffic sent to `candidate`   |
| GET    | /v1/models/{model_id}/serving         | read      | the split, per-arm counters, online metrics, decisions |
| GET    | /v1/guard                             | read      | online metrics per version, rollback decisions |
| POST   | /v1/hooks/mlflow                      | HMAC      | MLflow's alias-move webhook: read that model now |
| GET    | /healthz, /readyz                     | none      | alive; caught up on the broadcasts            |
| GET    | /metrics                              | read      | Prometheus: requests, latency, swaps, refusals |

Scopes and tokens are streamtune.auth's (an admin token passes every check). OpenAI clients
pass the inference token as `api_key`. The MLflow webhook carries no bearer token (MLflow
cannot send one): each delivery is signed with the secret this server registered, and an
unsigned one answers 401. Every error answers OpenAI's error object,
`{"error": {"message", "type", "param", "code"}}`, so OpenAI clients raise the matching
exception (401 AuthenticationError, 403 PermissionDeniedError, 404 NotFoundError, ...).

Each response names the version that produced it (`system_fingerprint` is
`<model_id>/<version>`, or `base`) and carries `streamtune.audit_trace`: routing, adapter
version (with sha256), base model.
"""

from __future__ import annotations

import contextlib
import time
from typing import Optional

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.errors import ArtifactIntegrityError, ConfigError
from streamtune.auth import AccessPolicy, AuthMiddleware, RequireScope, TokenStore, route_table

from .served import Answer, ModelNotFound, ServedModels


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we do not use

    model: str
    prompt: str
    max_tokens: int = 16
    user: Optional[str] = None


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int = 16
    user: Optional[str] = None


class SplitRequest(BaseModel):
    candidate_fraction: float = Field(ge=0.0, le=1.0)


def _extra(answer: Answer) -> dict:
    return {"model_id": answer.model_id, "version": answer.version, "alias": answer.alias, "arm": answer.arm,
            "mean_logprob": answer.generation.mean_logprob, "latency_ms": answer.latency_ms,
            "audit_trace": answer.audit_trace}


def _usage(answer: Answer) -> dict:
    return {"prompt_tokens": 0, "completion_tokens": answer.generation.tokens,
            "total_tokens": answer.generation.tokens}


def _fingerprint(answer: Answer) -> str:
    return "base" if answer.version is None else f"{answer.model_id}/{answer.version}"


# Routes without a token: health checks, and the webhook MLflow signs (HMAC) instead.
PUBLIC_PATHS = ("/healthz", "/readyz", "/v1/hooks/mlflow")
DOC_PATHS = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
               413: "invalid_request_error", 422: "invalid_request_error"}
ERROR_CODES = {401: "invalid_api_key", 403: "insufficient_scope"}


def openai_error(status: int, message: str, type: Optional[str] = None, param: Optional[str] = None,
                 code: Optional[str] = None) -> dict:
    """OpenAI's error object, the one shape of every error this server answers.

    >>> openai_error(401, "missing or wrong bearer token")["error"]["code"]
    'invalid_api_key'
    """
    return {"error": {"message": message, "type": type or ERROR_TYPES.get(status, "api_error"), "param": param,
                      "code": code or ERROR_CODES.get(status)}}


def create_app(served: ServedModels, access: AccessPolicy | Optional[str] = None) -> FastAPI:
    """The server's app; `access` is its policy (or, as older callers pass it, one admin
    token on loopback)."""
    if not isinstance(access, AccessPolicy):
        access = AccessPolicy(TokenStore(env={}, static=[("admin", access)] if access else []),
                              service="streamtune serve")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        served.start()
        yield
        served.close()

    app = FastAPI(title="streamtune serve", lifespan=lifespan)
    app.state.access = access
    inference, read, admin = (Depends(RequireScope(s)) for s in ("inference", "read", "admin"))

    @app.exception_handler(ConfigError)
    async def bad_request(request: Request, e: ConfigError):
        return JSONResponse(openai_error(400, str(e)), 400)

    @app.exception_handler(ModelNotFound)
    async def not_found(request: Request, e: ModelNotFound):
        return JSONResponse(openai_error(404, str(e), code="model_not_found", param="model"), 404)

    @app.exception_handler(ArtifactIntegrityError)
    async def refused(request: Request, e: ArtifactIntegrityError):
        return JSONResponse(openai_error(409, f"version refused: {e}", type="version_refused", param="model"), 409)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(openai_error(e.status_code, str(e.detail)), e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        message = "; ".join(f"{'.'.join(str(p) for p in d.get('loc', ()))}: {d.get('msg')}" for d in e.errors())
        return JSONResponse(openai_error(422, message[:1000], param=".".join(where) or None), 422)

    @app.post("/v1/completions", dependencies=[inference])
    def completions(body: CompletionRequest):
        answer = served.complete(body.model, body.prompt, body.max_tokens, body.user)
        return {"id": answer.request_id, "object": "text_completion", "created": int(time.time()),
                "model": body.model, "system_fingerprint": _fingerprint(answer),
                "choices": [{"index": 0, "text": answer.generation.text, "logprobs": None,
                             "finish_reason": "length" if answer.generation.tokens >= body.max_tokens else "stop"}],
                "usage": _usage(answer), "streamtune": _extra(answer)}

    @app.post("/v1/chat/completions", dependencies=[inference])
    def chat_completions(body: ChatRequest):
        tokenizer = served.pool.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("this base model has no chat template: use /v1/completions")
        prompt = tokenizer.apply_chat_template([m.model_dump() for m in body.messages], tokenize=False,
                                               add_generation_prompt=True)
        answer = served.complete(body.model, prompt, body.max_tokens, body.user)
        return {"id": answer.request_id.replace("cmpl-", "chatcmpl-"), "object": "chat.completion",
                "created": int(time.time()), "model": body.model, "system_fingerprint": _fingerprint(answer),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.generation.text},
                             "finish_reason": "length" if answer.generation.tokens >= body.max_tokens else "stop"}],
                "usage": _usage(answer), "streamtune": _extra(answer)}

    @app.get("/v1/models", dependencies=[inference])
    def models():
        # The fingerprint names the base; its path on this machine is nobody's business.
        base = {"id": "base", "object": "model", "owned_by": "streamtune", "version": served.pool.base_fingerprint}
        return {"object": "list", "data": [base, *served.describe()]}

    @app.put("/v1/models/{model_id}/split", dependencies=[admin])
    def set_split(model_id: str, body: SplitRequest):
        served.fractions[model_id] = body.candidate_fraction
        return {"model_id": model_id, "candidate_fraction": body.candidate_fraction}

    @app.get("/v1/models/{model_id}/serving", dependencies=[read])
    def serving(model_id: str):
        return served.serving(model_id)

    @app.get("/v1/guard", dependencies=[read])
    def guard():
        g = served.guard
        if g is None:
            return {"enabled": False}
        stats = [{"model_id": m, "version": v, "events": st.events, "acceptance": round(st.acceptance, 4)}
                 for (m, v), st in sorted(g.stats.items())]
        return {"enabled": True, "counts": g.counts, "versions": stats, "decisions": g.decisions}

    @app.post("/v1/hooks/mlflow")
    async def mlflow_webhook(request: Request):
        # No bearer token: MLflow signs each delivery with the secret this run registered.
        from starlette.concurrency import run_in_threadpool

        from connectors.mlflow_webhook import WebhookRejected, alias_event, verify
        try:
            payload = verify(served.webhook_secret, request.headers, await request.body(), time.time())
        except WebhookRejected as e:
            return JSONResponse(openai_error(401, str(e), type="webhook_rejected"), 401)
        model_id = alias_event(payload)
        if model_id is not None:
            await run_in_threadpool(served.follower.hint, model_id)  # reads MLflow, may swap an adapter
        return {"model_id": model_id}

    @app.get("/healthz")
    def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz():
        if not served.follower.caught_up:
            return JSONResponse({"status": "catching up on adapter versions",
                                 "errors": served.follower.errors[-3:]}, 503)
        return {"status": "ready", "models": len(served.follower.models()), "hot": len(served.pool.hot())}

    @app.get("/metrics", dependencies=[read])
    def metrics():
        return PlainTextResponse(generate_latest(served.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    route_table(app, PUBLIC_PATHS, DOC_PATHS)  # ConfigError now for a route that declares no scope
    app.add_middleware(AuthMiddleware, policy=access, table_of=lambda: route_table(app, PUBLIC_PATHS, DOC_PATHS),
                       reject=openai_error)
    return app
