"""Roles and tokens: `streamtune api` and `streamtune serve` started as processes on 0.0.0.0
with a tokens file, called over real sockets.

- Every route but the health checks answers 401 to an anonymous caller and to a wrong token
  (the routes come from each app's own route table, so a new route cannot escape: it fails
  `test_every_route_is_classified` until it is given a scope here).
- Each scope reaches its routes and gets 403 on the others; admin reaches all.
- The official `openai` client works with the inference token as `api_key`, and raises
  AuthenticationError carrying OpenAI's error object with a wrong one.
- Started on 0.0.0.0 without a token, both exit 2 with one clear line; with `--insecure`
  they start, log the WARNING, and anonymous calls succeed: the defence is off, and the same
  anonymous call the defence refuses goes through (`test_anonymous_read_*[insecure]`).
- Rewriting the tokens file takes effect without a restart.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from streamtune.auth import allows
from streamtune.local_job import kill_group, spawn_logged
from streamtune.testing import free_port, wait_for

pytestmark = [pytest.mark.security]
REPO = Path(__file__).resolve().parents[1]
TOKENS = {"admin": "admin-token-5c1f0e", "read": "read-token-9a8b7c", "feedback": "feedback-token-1d2e3f",
          "inference": "inference-token-4a5b6c"}
WRONG = "wrong-token-000000"
# Every token variable a server reads, emptied: only the tokens file of each test counts.
NO_TOKENS_ENV = {"STREAMTUNE_API_TOKEN": "", "STREAMTUNE_API_FEEDBACK_TOKEN": "", "STREAMTUNE_TOKENS_FILE": "",
                 "STREAMTUNE_TOKENS_DIR": "", "STREAMTUNE_SERVE_TOKEN": "",
                 **{f"STREAMTUNE_TOKENS_{s.upper()}": "" for s in TOKENS},
                 # serve beyond loopback also wants the key that signs its response ids
                 "STREAMTUNE_RESPONSE_SIGNING_KEY": "auth-test-signing-key-0123456789", "STREAMTUNE_RESPONSE_SIGNING_KEY_FILE": ""}

# (method, path) -> the scope it needs; "public" needs none. Kept in step with the apps'
# route tables by test_every_route_is_classified.
API_ROUTES = {
    ("POST", "/v1/stream-finetune"): "admin", ("GET", "/v1/stream-finetune/{model_id}"): "read",
    ("DELETE", "/v1/stream-finetune/{model_id}"): "admin", ("GET", "/v1/models"): "read",
    ("GET", "/v1/models/{model_id}/versions"): "read",
    ("POST", "/v1/models/{model_id}/aliases"): "admin", ("GET", "/v1/models/{model_id}/promotions"): "read",
    ("GET", "/v1/models/{model_id}/serving"): "read", ("POST", "/v1/feedback"): "feedback",
    ("POST", "/v1/pipelines"): "admin", ("GET", "/v1/pipelines"): "read", ("GET", "/v1/pipelines/{name}"): "read",
    ("DELETE", "/v1/pipelines/{name}"): "admin", ("POST", "/v1/pipelines/{name}/pause"): "admin",
    ("POST", "/v1/pipelines/{name}/resume"): "admin", ("GET", "/v1/pipelines/{name}/dlq"): "read",
    ("POST", "/v1/pipelines/preview"): "admin", ("POST", "/v1/pipelines/render"): "read",
    ("GET", "/openapi.json"): "read", ("GET", "/docs"): "read", ("GET", "/docs/oauth2-redirect"): "read",
    ("GET", "/redoc"): "read",
    ("GET", "/healthz"): "public", ("GET", "/console"): "public", ("GET", "/console/console.js"): "public",
    ("GET", "/console/editor.js"): "public", ("GET", "/feedback.js"): "public",
}
SERVE_ROUTES = {
    ("POST", "/v1/completions"): "inference", ("POST", "/v1/chat/completions"): "inference",
    ("GET", "/v1/models"): "inference", ("PUT", "/v1/models/{model_id}/split"): "admin",
    ("GET", "/v1/models/{model_id}/serving"): "read", ("GET", "/v1/guard"): "read", ("GET", "/metrics"): "read",
    ("GET", "/openapi.json"): "read", ("GET", "/docs"): "read", ("GET", "/docs/oauth2-redirect"): "read",
    ("GET", "/redoc"): "read",
    ("GET", "/healthz"): "public", ("GET", "/readyz"): "public",
    ("POST", "/v1/hooks/mlflow"): "hmac",  # MLflow signs it (no bearer token); unsigned: 401
}


def write_tokens(path: Path, tokens: dict[str, str]) -> None:
    """The tokens file, written beside and renamed over (as the docs advise for rotation)."""
    tmp = path.with_suffix(".new")
    tmp.write_text("# scope token\n" + "".join(f"{scope}: {token}\n" for scope, token in tokens.items()))
    tmp.replace(path)


class Process:
    def __init__(self, kind: str, url: str, proc: subprocess.Popen, log: Path):
        self.kind, self.url, self.proc, self.log = kind, url, proc, log

    def alive(self) -> bool:
        assert self.proc.poll() is None, f"{self.kind} exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
        try:
            return requests.get(f"{self.url}/healthz", timeout=2).status_code == 200
        except requests.RequestException:
            return False


def command(kind: str, port: int, base_model, stack_config, *extra: str) -> list[str]:
    args = [sys.executable, "-m", "streamtune.cli", kind, "--host", "0.0.0.0", "--port", str(port)]
    if kind == "serve":  # no registry, no guard, no inference log: what auth needs, started fast
        args += ["--base-model", str(base_model), "--bootstrap-server", stack_config.kafka_bootstrap, "--no-registry",
                 "--no-auto-rollback", "--no-inference-log", "--no-webhook",
                 "--broadcast-topics", r"test\.security-auth-none\.adapter-versions"]
    return args + list(extra)


@pytest.fixture(scope="module")
def started(stack_config, base_model, tmp_path_factory):
    """start(kind, *args, env=...) -> a running Process; all killed at the end of the module."""
    tmp = tmp_path_factory.mktemp("auth")
    processes: list[Process] = []

    def start(kind: str, *extra: str, env: dict[str, str] | None = None) -> Process:
        port = free_port()
        log = tmp / f"{kind}-{port}.log"
        # The API's own home: its jobs file and captures are nobody else's.
        proc = spawn_logged(command(kind, port, base_model, stack_config, *extra), log,
                            extra_env={**NO_TOKENS_ENV, "STREAMTUNE_HOME": str(tmp / f"home-{port}"),
                                       "STREAMTUNE_DATA_DIR": str(stack_config.data_dir), **(env or {})})
        p = Process(kind, f"http://127.0.0.1:{port}", proc, log)
        processes.append(p)
        wait_for(p.alive, 120, f"{kind} to answer /healthz", interval=0.2)
        return p

    start.tmp = tmp
    yield start
    for p in processes:
        kill_group(p.proc)


@pytest.fixture(scope="module")
def servers(started):
    """api and serve on 0.0.0.0 with one token per scope; the API asks this serve for serving stats."""
    tokens_file = started.tmp / "tokens"
    write_tokens(tokens_file, TOKENS)
    serve = started("serve", "--tokens-file", str(tokens_file))
    api = started("api", "--tokens-file", str(tokens_file), env={"STREAMTUNE_SERVE_URL": serve.url})
    return {"api": api, "serve": serve}


def call(server: Process, method: str, path: str, token: str | None) -> requests.Response:
    """The route called with a harmless request: path parameters name no model, bodies are
    empty objects (an authorized caller gets 404 / 422, an unauthorized one 401 / 403)."""
    url = server.url + re.sub(r"\{[^}]+\}", "nobody-here", path)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = {} if method in ("POST", "PUT") else None
    return requests.request(method, url, json=body, headers=headers, timeout=60)


def check_error_shape(kind: str, r: requests.Response) -> None:
    body = r.json()
    if kind == "serve":  # OpenAI's error object
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    else:  # the API's one shape
        assert set(body) == {"detail"} and isinstance(body["detail"], str), body


def test_every_route_is_classified(stack_config, tmp_path):
    """The route tables of both apps, hidden routes included, equal the tables above."""
    from streamtune.api import ApiSettings, create_app
    from streamtune.auth import route_table
    from streamtune.serve import app as serve_app

    api = create_app(ApiSettings(stack=stack_config, token=TOKENS["admin"], jobs_file=tmp_path / "jobs.json",
                                 promotion_log=tmp_path / "promotions.jsonl", artifact_store=str(tmp_path / "a")))
    serve = serve_app.create_app(served=None, access=TOKENS["admin"])  # the served models are not needed to list routes

    def table(app, public, docs) -> dict:
        out = {}
        for route, scope in route_table(app, public, docs):
            for method in sorted(route.methods - {"HEAD"}):
                out[(method, route.path)] = scope
        return out

    from streamtune.api.app import DOC_PATHS, PUBLIC_PATHS
    assert table(api, PUBLIC_PATHS, DOC_PATHS) == API_ROUTES
    expected_serve = {k: ("public" if v == "hmac" else v) for k, v in SERVE_ROUTES.items()}
    assert table(serve, serve_app.PUBLIC_PATHS, serve_app.DOC_PATHS) == expected_serve


@pytest.mark.parametrize("kind", ["api", "serve"])
def test_anonymous_and_wrong_tokens_get_401_on_every_route_but_health(kind, servers):
    server = servers[kind]
    routes = API_ROUTES if kind == "api" else SERVE_ROUTES
    spec = requests.get(f"{server.url}/openapi.json", headers={"Authorization": f"Bearer {TOKENS['read']}"},
                        timeout=30).json()
    documented = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    assert documented <= set(routes), f"routes this test does not know: {documented - set(routes)}"
    for (method, path), scope in routes.items():
        for token in (None, WRONG):
            r = call(server, method, path, token)
            if scope == "public":
                assert r.status_code not in (401, 403), (method, path, r.status_code, r.text[:300])
                continue
            assert r.status_code == 401, (kind, method, path, token, r.status_code, r.text[:300])
            check_error_shape(kind, r)
            if scope != "hmac":
                assert r.headers["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize("kind", ["api", "serve"])
def test_each_scope_reaches_its_routes_and_gets_403_elsewhere(kind, servers):
    server = servers[kind]
    routes = API_ROUTES if kind == "api" else SERVE_ROUTES
    for held, token in TOKENS.items():
        for (method, path), needed in routes.items():
            if needed in ("public", "hmac"):
                continue
            r = call(server, method, path, token)
            if allows(held, needed):
                assert r.status_code not in (401, 403), (kind, held, method, path, r.status_code, r.text[:300])
                if kind == "api" and path == "/v1/models/{model_id}/serving":
                    # The API asked serve with its own read token: serve answered (not 401 -> 503).
                    assert r.status_code == 404 and "does not serve" in r.text, r.text
            else:
                assert r.status_code == 403, (kind, held, method, path, r.status_code, r.text[:300])
                check_error_shape(kind, r)
    # An authorized but invalid body keeps the server's error shape (serve: OpenAI's object).
    r = call(server, "POST", "/v1/completions" if kind == "serve" else "/v1/feedback", TOKENS["admin"])
    assert r.status_code == 422, r.text
    if kind == "serve":
        check_error_shape(kind, r)


def test_models_list_shows_no_filesystem_path(servers, base_model):
    r = requests.get(f"{servers['serve'].url}/v1/models", headers={"Authorization": f"Bearer {TOKENS['inference']}"},
                     timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "base", r.text
    assert str(base_model) not in r.text and "path" not in r.json()["data"][0], r.text


def test_openai_client_with_the_inference_token(servers):
    import openai

    url = f"{servers['serve'].url}/v1"
    client = openai.OpenAI(base_url=url, api_key=TOKENS["inference"], max_retries=0)
    completion = client.completions.create(model="base", prompt="x=1234;y=", max_tokens=2)
    assert completion.system_fingerprint == "base" and completion.choices[0].text is not None
    assert "base" in [m.id for m in client.models.list()]
    for key in (WRONG, TOKENS["feedback"]):
        wrong = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        expected = openai.AuthenticationError if key == WRONG else openai.PermissionDeniedError
        with pytest.raises(expected) as raised:
            wrong.completions.create(model="base", prompt="x=1;y=", max_tokens=2)
        error = raised.value.response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["code"] == ("invalid_api_key" if key == WRONG else "insufficient_scope"), error


@pytest.mark.parametrize("kind", ["api", "serve"])
def test_start_beyond_loopback_without_tokens_exits_2(kind, stack_config, base_model, tmp_path):
    env = {**os.environ, **NO_TOKENS_ENV, "STREAMTUNE_HOME": str(tmp_path)}
    result = subprocess.run(command(kind, free_port(), base_model, stack_config), cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "beyond loopback" in lines[0] and "--insecure" in lines[0], result.stderr[-2000:]


@pytest.mark.parametrize("defence", ["tokens", "insecure"])
@pytest.mark.parametrize("kind", ["api", "serve"])
def test_anonymous_read_is_refused_only_while_the_defence_is_on(kind, defence, started, servers):
    """The same anonymous read: 401 with tokens; with --insecure and no token (the defence
    off) it goes through, and the server said so loudly at start."""
    path = "/v1/pipelines" if kind == "api" else "/v1/models"
    if defence == "tokens":
        server = servers[kind]
        assert requests.get(server.url + path, timeout=30).status_code == 401
        assert "INSECURE" not in server.log.read_text()
    else:
        server = started(kind, "--insecure")
        r = requests.get(server.url + path, timeout=30)
        assert r.status_code == 200, r.text
        assert re.search(r"WARNING.*INSECURE.*ANYONE", server.log.read_text()), server.log.read_text()[-3000:]


def test_rotating_the_tokens_file_takes_effect_without_restart(started):
    tokens_file = started.tmp / "rotating-tokens"
    write_tokens(tokens_file, TOKENS)
    api = started("api", "--tokens-file", str(tokens_file))

    def status(token: str) -> int:
        return requests.get(f"{api.url}/v1/pipelines", headers={"Authorization": f"Bearer {token}"},
                            timeout=30).status_code

    assert status(TOKENS["read"]) == 200
    rotated = "read-token-rotated-77aa"
    write_tokens(tokens_file, {**TOKENS, "read": rotated})
    wait_for(lambda: status(rotated) == 200, 10, "the new read token to be accepted", interval=0.2)
    assert status(TOKENS["read"]) == 401, "the retired read token still works"
    # A broken rewrite keeps the last good tokens (and says so in the log, without a token).
    tokens_file.write_text("reader: not-a-scope\n")
    # (the file is looked at when a request comes, at most once a second)
    wait_for(lambda: status(rotated) == 200 and "tokens not reloaded" in api.log.read_text(), 10,
             "the failed reload to be logged", interval=0.2)
    assert "not-a-scope" not in api.log.read_text() and rotated not in api.log.read_text()
