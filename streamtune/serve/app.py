"""`streamtune serve`: an OpenAI-compatible inference server that follows adapter versions.

| method | path                                  | auth   | what                                          |
|--------|---------------------------------------|--------|-----------------------------------------------|
| POST   | /v1/completions                       |        | greedy completion by the routed version       |
| POST   | /v1/chat/completions                  |        | the same through the base's chat template     |
| GET    | /v1/models                            |        | served models, aliases, hot and refused versions |
| PUT    | /v1/models/{model_id}/split           | bearer | the fraction of traffic sent to `candidate`   |
| GET    | /v1/models/{model_id}/serving         |        | the split, per-arm counters, online metrics, decisions |
| GET    | /v1/guard                             |        | online metrics per version, rollback decisions |
| POST   | /v1/hooks/mlflow                      | HMAC   | MLflow's alias-move webhook: read that model now |
| GET    | /healthz, /readyz                     |        | alive; caught up on the broadcasts            |
| GET    | /metrics                              |        | Prometheus: requests, latency, swaps, refusals |

Each response names the version that produced it (`system_fingerprint` is
`<model_id>/<version>`, or `base`) and carries `streamtune.audit_trace`: routing, adapter
version (with sha256), base model.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from typing import Annotated, Optional

from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, Field

from core.errors import ArtifactIntegrityError, ConfigError

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


def create_app(served: ServedModels, token: Optional[str]) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        served.start()
        yield
        served.close()

    app = FastAPI(title="streamtune serve", lifespan=lifespan)

    def writer(authorization: Annotated[Optional[str], Header()] = None) -> None:
        expected = f"Bearer {token}" if token else None
        if expected is None or authorization is None or not secrets.compare_digest(authorization.encode(),
                                                                                     expected.encode()):
            raise HTTPException(401, "a bearer token is required", headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(ConfigError)
    async def bad_request(request: Request, e: ConfigError):
        return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error"}}, 400)

    @app.exception_handler(ModelNotFound)
    async def not_found(request: Request, e: ModelNotFound):
        return JSONResponse({"error": {"message": str(e), "type": "model_not_found"}}, 404)

    @app.exception_handler(ArtifactIntegrityError)
    async def refused(request: Request, e: ArtifactIntegrityError):
        return JSONResponse({"error": {"message": f"version refused: {e}", "type": "version_refused"}}, 409)

    @app.post("/v1/completions")
    def completions(body: CompletionRequest):
        answer = served.complete(body.model, body.prompt, body.max_tokens, body.user)
        return {"id": answer.request_id, "object": "text_completion", "created": int(time.time()),
                "model": body.model, "system_fingerprint": _fingerprint(answer),
                "choices": [{"index": 0, "text": answer.generation.text, "logprobs": None,
                             "finish_reason": "length" if answer.generation.tokens >= body.max_tokens else "stop"}],
                "usage": _usage(answer), "streamtune": _extra(answer)}

    @app.post("/v1/chat/completions")
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

    @app.get("/v1/models")
    def models():
        base = {"id": "base", "object": "model", "owned_by": "streamtune", "path": served.pool.base_dir,
                "version": served.pool.base_fingerprint}
        return {"object": "list", "data": [base, *served.describe()]}

    @app.put("/v1/models/{model_id}/split", dependencies=[Depends(writer)])
    def set_split(model_id: str, body: SplitRequest):
        served.fractions[model_id] = body.candidate_fraction
        return {"model_id": model_id, "candidate_fraction": body.candidate_fraction}

    @app.get("/v1/models/{model_id}/serving")
    def serving(model_id: str):
        return served.serving(model_id)

    @app.get("/v1/guard")
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
            return JSONResponse({"error": {"message": str(e), "type": "webhook_rejected"}}, 401)
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

    @app.get("/metrics")
    def metrics():
        return PlainTextResponse(generate_latest(served.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    return app
