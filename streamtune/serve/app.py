"""`streamtune serve`: an OpenAI-compatible inference server that follows adapter versions.

| method | path                                  | scope     | what                                          |
|--------|---------------------------------------|-----------|-----------------------------------------------|
| POST   | /v1/completions                       | inference | completion(s) by the routed version, or SSE   |
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
`<model_id>@v<version>`, or `base`) and carries `streamtune.audit_trace`: routing, adapter
version (with sha256), base model.

Completions as the official `openai` client knows them: `prompt` a string or a list of up to
16 strings (one set of `n` choices per prompt, choice `index` = prompt × n + choice), `n`
(1..8), `max_tokens` (chat: or `max_completion_tokens`), `temperature` (0..2), `top_p`
(0..1], `seed` (choice c samples with seed + c), `stop` (a string or up to 4), `user`;
`usage` counts the prompt's tokens (by the base's tokenizer) and the generated ones;
`finish_reason` is "stop" (end token or a stop string, which is cut off) or "length"
(max_tokens). Out-of-range values answer 422 with OpenAI's error object.

One deliberate difference from OpenAI: without `temperature` the answer is greedy
(temperature 0), not sampled at 1.0. A server of fine-tuned adapters answers reproducibly
unless asked to sample: the same request to the same version gives the same text (what
exact-match checks and the guarantees' tests rely on). Send `temperature` to sample.

`stream: true` answers `text/event-stream`: `data: <chunk>` lines in OpenAI's chunk shape
(`text_completion`, or `chat.completion.chunk` with `delta`, the first carrying the role),
text sent as it is decoded (never text a stop string may still take back), a chunk with each
choice's `finish_reason`, with `stream_options.include_usage` a last chunk with `usage` and no
choices, then `data: [DONE]`. Every chunk carries `system_fingerprint`. The inference log
record is written once per response, with the whole text.

A request may carry a latency budget (`X-Streamtune-SLO-Ms`, or `streamtune.slo_ms`): with a
confidence threshold set for its model, an answer below it takes the accurate path when the
budget allows (decision.py). The decision is in `streamtune.audit_trace`.

Concurrent requests are decoded together: the pool's batch scheduler (served.py,
operators/batched_decoding.py) gathers them for `--batch-window-ms` and decodes up to
`--max-batch` rows, across versions, in one loop.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import replace
from typing import Optional, Union

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.errors import ArtifactIntegrityError, ConfigError, ServiceUnavailable
from core.routing import pinned_name
from streamtune.auth import AccessPolicy, AuthMiddleware, RequireScope, TokenStore, route_table

from operators.batched_decoding import SamplingParams

from .decision import SLO_HEADER, slo_ms
from .served import Answer, ModelNotFound, Pending, ServedModels

# Greedy unless the request sets `temperature` (OpenAI's default is 1.0): see the docstring.
DEFAULT_TEMPERATURE = 0.0


MAX_PROMPTS = 16  # prompts in one completions request
MAX_ROWS = 64     # prompts × n


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What both endpoints take besides the prompt: OpenAI's names and ranges."""

    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we do not use

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)  # None: greedy (see above)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    seed: Optional[int] = Field(default=None, ge=0, lt=2**63)
    stop: Optional[Union[str, list[str]]] = None
    n: int = Field(default=1, ge=1, le=8)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("a stop sequence must not be empty")
        return stops

    def sampling(self, default_max_tokens: int = 16) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
                              temperature=self.temperature if self.temperature is not None else DEFAULT_TEMPERATURE,
                              top_p=self.top_p if self.top_p is not None else 1.0, seed=self.seed,
                              stop=tuple(self.stop or ()))


class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[str]]

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value):
        if isinstance(value, list) and not 1 <= len(value) <= MAX_PROMPTS:
            raise ValueError(f"between 1 and {MAX_PROMPTS} prompts")
        return value

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)  # newer clients' name of max_tokens


class SplitRequest(BaseModel):
    candidate_fraction: float = Field(ge=0.0, le=1.0)


def _extra(answer: Answer) -> dict:
    return {"model_id": answer.model_id, "version": answer.version, "alias": answer.alias, "arm": answer.arm,
            "mean_logprob": answer.generation.mean_logprob, "latency_ms": answer.latency_ms,
            "audit_trace": answer.audit_trace}


def _usage(answer: Answer) -> dict:
    prompt, completion = answer.prompt_tokens, answer.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _fingerprint(answer: Answer) -> str:
    return "base" if answer.version is None else pinned_name(answer.model_id, answer.version)


def _sse(data) -> str:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


def _stream(pending: Pending, chat: bool, model: str, include_usage: bool):
    """OpenAI's server-sent events for a request decoding in a batch: text deltas as they are
    decoded, each choice's finish_reason, the usage chunk if asked for, then [DONE].

    A plain generator (Starlette iterates it in its threadpool): it only waits on the
    request's event queue and holds no lock across a yield."""
    rid = pending.request_id.replace("cmpl-", "chatcmpl-") if chat else pending.request_id
    head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "system_fingerprint": pending.fingerprint}
    tail = {"usage": None} if include_usage else {}

    def chunk(index: int, text: str, finish: Optional[str], first: bool = False) -> str:
        if chat:
            delta = ({"role": "assistant", "content": text} if first else {"content": text}) if finish is None else {}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        return _sse({**head, "choices": [choice], **tail})

    try:
        if chat:  # the role first, for each choice, as OpenAI sends it
            for i in range(len(pending.group.rows)):
                yield chunk(i, "", None, first=True)
        for event in pending.events():
            if event[0] == "delta" and event[2]:
                yield chunk(event[1], event[2], None)
            elif event[0] == "row":
                yield chunk(event[1], "", event[2].finish_reason)
    except Exception as e:  # the status line is sent: the error goes in the stream
        yield _sse(openai_error(500, f"{type(e).__name__}: {e}"))
        return
    if include_usage:
        yield _sse({**head, "choices": [], "usage": _usage(pending.result), "streamtune": _extra(pending.result)})
    yield _sse("[DONE]")


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

    @app.exception_handler(ServiceUnavailable)
    async def unavailable(request: Request, e: ServiceUnavailable):
        return JSONResponse(openai_error(503, str(e), type="service_unavailable"), 503)

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

    def start(body: SamplingRequest, prompts: list[str], params: SamplingParams) -> Pending:
        if len(prompts) * body.n > MAX_ROWS:
            raise ConfigError(f"prompts × n is {len(prompts) * body.n}: at most {MAX_ROWS}")
        return served.submit(body.model, prompts, params, n=body.n, user=body.user, stream=body.stream)

    def streamed(pending: Pending, body: SamplingRequest, chat: bool) -> StreamingResponse:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(pending, chat, body.model, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def decided(answer: Answer, body: SamplingRequest, prompts: list[str], params: SamplingParams,
                request: Request) -> Answer:
        """The decision layer (decision.py) for a one-prompt, one-choice answer with a budget."""
        budget = slo_ms(request.headers.get(SLO_HEADER), body.model_extra)
        if len(prompts) != 1 or body.n != 1:
            return answer
        return served.refine(answer, prompts[0], params, budget, body.user)

    @app.post("/v1/completions", dependencies=[inference])
    def completions(body: CompletionRequest, request: Request):
        prompts, params = body.prompts(), body.sampling()
        pending = start(body, prompts, params)
        if body.stream:
            return streamed(pending, body, chat=False)
        answer = decided(pending.answer(), body, prompts, params, request)
        return {"id": answer.request_id, "object": "text_completion", "created": int(time.time()),
                "model": body.model, "system_fingerprint": _fingerprint(answer),
                "choices": [{"index": i, "text": g.text, "logprobs": None, "finish_reason": g.finish_reason}
                            for i, g in enumerate(answer.choices)],
                "usage": _usage(answer), "streamtune": _extra(answer)}

    @app.post("/v1/chat/completions", dependencies=[inference])
    def chat_completions(body: ChatRequest, request: Request):
        tokenizer = served.pool.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("this base model has no chat template: use /v1/completions")
        prompt = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in body.messages],
                                               tokenize=False, add_generation_prompt=True)
        params = body.sampling()
        if body.max_tokens is None and body.max_completion_tokens is not None:
            params = replace(params, max_tokens=body.max_completion_tokens)
        pending = start(body, [prompt], params)
        if body.stream:
            return streamed(pending, body, chat=True)
        answer = decided(pending.answer(), body, [prompt], params, request)
        return {"id": answer.request_id.replace("cmpl-", "chatcmpl-"), "object": "chat.completion",
                "created": int(time.time()), "model": body.model, "system_fingerprint": _fingerprint(answer),
                "choices": [{"index": i, "message": {"role": "assistant", "content": g.text}, "logprobs": None,
                             "finish_reason": g.finish_reason} for i, g in enumerate(answer.choices)],
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
        if served.draining:
            return JSONResponse({"status": "draining: shutting down soon"}, 503)
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
