"""Command line of the control plane: `streamtune api` runs the service; the others call it.

    streamtune api --host 127.0.0.1 --port 8000 [--tokens-file F] [--token-file F] [--insecure]
    streamtune submit spec.json        POST /v1/stream-finetune
    streamtune status MODEL            GET  /v1/stream-finetune/MODEL
    streamtune versions MODEL          GET  /v1/models/MODEL/versions
    streamtune promote MODEL VERSION   POST /v1/models/MODEL/aliases {alias: champion, version}
    streamtune stop MODEL              DELETE /v1/stream-finetune/MODEL
    streamtune apply -f pipeline.yaml [--dry-run]   POST /v1/pipelines (YAML or JSON)
    streamtune delete -f pipeline.yaml              DELETE /v1/pipelines/NAME
    streamtune get pipelines [NAME]                 GET /v1/pipelines[/NAME]

`streamtune api` takes its tokens as streamtune.auth describes (--tokens-file with
`scope token` lines, $STREAMTUNE_TOKENS_DIR, $STREAMTUNE_TOKENS_<SCOPE>, the older
--token-file / $STREAMTUNE_API_TOKEN as admin). It refuses to start without any token, and
on an address beyond loopback without one unless --insecure (tests and demos only: anyone
may then call everything).

The client commands take --url (default $STREAMTUNE_API_URL or http://127.0.0.1:8000) and
the token from --token-file, else $STREAMTUNE_API_TOKEN, else $STREAMTUNE_TOKENS_ADMIN (or
$STREAMTUNE_TOKENS_READ for the reads: status, versions, get). They print the answer on stdout
as -o table|json|yaml says (default: a table on a terminal, JSON otherwise). `submit` waits
for the job to start and says so on stderr every few seconds.
Every error is one line on stderr, `streamtune: ...`, with an exit code from core.errors:

| exit code | when                                                                          |
|-----------|-------------------------------------------------------------------------------|
| 2         | unreadable spec or token file, no token for `api`, a 4xx or 501 answer         |
| 3         | the API cannot be reached, or answers 500, 502, 503 (its stack is down) or 504 |
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from core.errors import ConfigError, ServiceUnavailable, StreamtuneError, report

from streamtune.output import add_output_option, emit

DEFAULT_URL = "http://127.0.0.1:8000"


class RequestRejected(StreamtuneError):
    """The API answered that the request cannot work as given (4xx, or 501 for a CDC spec)."""


def _client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("STREAMTUNE_API_URL", DEFAULT_URL), help="the API's base URL")
    p.add_argument("--token-file", default=None, help="file holding the bearer token (else $STREAMTUNE_API_TOKEN)")
    add_output_option(p)


def _request(method: str, url: str, body, headers: dict, progress: str | None):
    """requests.request, with a status line on stderr every few seconds while it waits when
    `progress` names what it waits for (a spinner on a terminal, plain lines otherwise)."""
    import requests

    if progress is None:
        return requests.request(method, url, json=body, headers=headers, timeout=600)
    outcome: dict = {}

    def send() -> None:
        try:
            outcome["response"] = requests.request(method, url, json=body, headers=headers, timeout=600)
        except BaseException as e:  # re-raised in the caller's thread
            outcome["error"] = e

    worker = threading.Thread(target=send, daemon=True)
    started = time.monotonic()
    worker.start()
    if sys.stderr.isatty():
        from rich.console import Console

        with Console(stderr=True).status(progress) as status:
            while worker.is_alive():
                worker.join(0.5)
                status.update(f"{progress} ({time.monotonic() - started:.0f} s)")
    else:
        while not worker.join(5) and worker.is_alive():
            print(f"streamtune: {progress} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["response"]


def call(args, method: str, path: str, body=None, progress: str | None = None, unwrap: str | None = None) -> int:
    """Send the request and print the answer (-o); RequestRejected or ServiceUnavailable
    for an error answer."""
    import requests

    from streamtune.auth import client_token, read_single_token

    token = read_single_token(args.token_file, "STREAMTUNE_API_TOKEN") or client_token("read" if method == "GET" else "admin")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = _request(method, args.url.rstrip("/") + path, body, headers, progress)
    except requests.RequestException as e:
        raise ServiceUnavailable(f"the streamtune API is not reachable at {args.url} ({type(e).__name__}); "
                                 "start it with `streamtune api`") from None
    try:
        payload = r.json()
    except ValueError:
        payload = {"detail": r.text.strip()[:500]}
    if r.status_code >= 400:
        detail = payload.get("detail") if isinstance(payload, dict) else payload
        if isinstance(detail, list):  # FastAPI's 422: one line per field
            detail = "; ".join(f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg')}" for d in detail)
        message = f"{method} {path} -> {r.status_code}: {detail}"
        # 501 is the API declining a CDC spec: the request's fault, not a failing service.
        if r.status_code >= 500 and r.status_code != 501:
            raise ServiceUnavailable(message)
        raise RequestRejected(message)
    emit(payload[unwrap] if unwrap else payload, getattr(args, "output", None))
    return 0


def cmd_api(args) -> int:
    import uvicorn

    from streamtune.auth import AccessPolicy

    from .app import ApiSettings, create_app

    settings = ApiSettings.from_env(token_file=args.token_file, tokens_file=args.tokens_file, host=args.host,
                                    insecure=args.insecure)
    AccessPolicy(settings.tokens, args.host, args.insecure, "streamtune api")  # no token beyond loopback: refused
    if not settings.tokens.configured() and not args.insecure:
        raise ConfigError("no API token: pass --tokens-file or --token-file, or set STREAMTUNE_TOKENS_DIR, "
                          "STREAMTUNE_TOKENS_<SCOPE> or STREAMTUNE_API_TOKEN")
    app = create_app(settings)  # ConfigError: no token beyond loopback without --insecure
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app.state.access.announce()
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


def cmd_submit(args) -> int:
    try:
        spec = json.loads(Path(args.spec).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read spec {args.spec}: {e}") from None
    model = spec.get("model_id") if isinstance(spec, dict) else None
    return call(args, "POST", "/v1/stream-finetune", spec,
                progress=f"waiting for the API to start the job{f' of {model}' if model else ''}")


def read_pipeline(path: str) -> dict:
    """A pipeline file (YAML or JSON) as the API's body; ConfigError when unreadable."""
    import yaml

    try:
        body = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read pipeline {path}: {e}") from None
    if not isinstance(body, dict) or not isinstance(body.get("model_id"), str):
        raise ConfigError(f"{path}: a pipeline is a mapping with a model_id (see `streamtune.pipeline`)")
    return body


def cmd_apply(args) -> int:
    return call(args, "POST", "/v1/pipelines" + ("?dry_run=true" if args.dry_run else ""), read_pipeline(args.file))


def cmd_delete(args) -> int:
    return call(args, "DELETE", f"/v1/pipelines/{read_pipeline(args.file)['model_id']}")


def cmd_get(args) -> int:
    if args.what == "models":  # every registered model (its versions: `streamtune versions MODEL`)
        return call(args, "GET", "/v1/models", unwrap="models")
    return call(args, "GET", "/v1/pipelines" + (f"/{args.name}" if args.name else ""))


def reporting_errors(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`command`, with a StreamtuneError printed as one line on stderr and its exit code returned."""
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except StreamtuneError as e:
            report(e)
            return e.exit_code

    return run


def add_token_arguments(p) -> None:
    """The token options every listener shares (`streamtune api`, `streamtune serve`)."""
    p.add_argument("--token-file", default=None, help="file holding one admin token (else $STREAMTUNE_API_TOKEN)")
    p.add_argument("--tokens-file", default=os.environ.get("STREAMTUNE_TOKENS_FILE"),
                   help="tokens per scope, lines `SCOPE TOKEN` (admin, read, feedback, inference); re-read when "
                        "it changes (default $STREAMTUNE_TOKENS_FILE)")
    p.add_argument("--insecure", action="store_true",
                   help="start without any token even beyond loopback: anyone may call everything "
                        "(tests and demos only; logged as a WARNING)")


def add_parsers(subparsers) -> None:
    """Add api, submit, status, versions, promote, stop, apply, delete and get to a `streamtune`
    subparsers object."""
    p = subparsers.add_parser("api", help="run the REST control plane (FastAPI, uvicorn)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_token_arguments(p)
    p.set_defaults(func=reporting_errors(cmd_api))

    p = subparsers.add_parser("submit", help="POST a fine-tune spec (JSON file) to the API")
    p.add_argument("spec")
    _client_options(p)
    p.set_defaults(func=reporting_errors(cmd_submit))

    p = subparsers.add_parser("status", help="job state, config version, last version and counters of a model")
    p.add_argument("model")
    _client_options(p)
    p.set_defaults(func=reporting_errors(lambda a: call(a, "GET", f"/v1/stream-finetune/{a.model}")))

    p = subparsers.add_parser("versions", help="a model's versions in MLflow")
    p.add_argument("model")
    _client_options(p)
    p.set_defaults(func=reporting_errors(lambda a: call(a, "GET", f"/v1/models/{a.model}/versions")))

    p = subparsers.add_parser("promote", help="move a model's alias (default champion) to VERSION")
    p.add_argument("model")
    p.add_argument("version", type=int)
    p.add_argument("--alias", default="champion")
    _client_options(p)
    p.set_defaults(func=reporting_errors(lambda a: call(a, "POST", f"/v1/models/{a.model}/aliases",
                                                        {"alias": a.alias, "version": a.version})))

    p = subparsers.add_parser("stop", help="stop training a model (the job stops with a savepoint when it was the last)")
    p.add_argument("model")
    _client_options(p)
    p.set_defaults(func=reporting_errors(lambda a: call(a, "DELETE", f"/v1/stream-finetune/{a.model}")))


    p = subparsers.add_parser("apply", help="create or update a pipeline from a file (idempotent; prints the diff)")
    p.add_argument("-f", "--file", required=True, help="pipeline YAML or JSON")
    p.add_argument("--dry-run", action="store_true", help="print what would change, change nothing")
    _client_options(p)
    p.set_defaults(func=reporting_errors(cmd_apply))

    p = subparsers.add_parser("delete", help="delete the pipeline a file names: job stopped with a savepoint, "
                                             "capture stopped")
    p.add_argument("-f", "--file", required=True, help="pipeline YAML or JSON")
    _client_options(p)
    p.set_defaults(func=reporting_errors(cmd_delete))

    p = subparsers.add_parser("get", help="list pipelines (or one) with their job and capture state; "
                                          "every registered model")
    p.add_argument("what", choices=["pipelines", "models"])
    p.add_argument("name", nargs="?", help="one pipeline")
    _client_options(p)
    p.set_defaults(func=reporting_errors(cmd_get))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamtune")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
