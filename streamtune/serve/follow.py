"""`streamtune follow`: keep a running vLLM OpenAI server in step with streamtune's versions.

The production serving path: vLLM serves, this sidecar follows. It reads the adapter-version
broadcasts and the registry's aliases (connectors/adapter_follower.py), fetches each version's
files checked against their sha256, writes them where vLLM reads them (`--artifact-dir`, a
volume both containers mount) and loads them into vLLM over its runtime LoRA API
(connectors/vllm_target.py). OpenAI clients then call vLLM with

- `<model_id>` or `<model_id>@champion`: the champion; `<model_id>@candidate`: the candidate;
  each moved in place when its alias moves;
- `<model_id>@v<version>`: one version, pinned (the newest two unaliased ones stay loaded).

vLLM must run with `--enable-lora`, `--max-lora-rank` at least the adapters' rank and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`. Its API key, when it has one, is read from
`--vllm-api-key-file` or $VLLM_API_KEY, never from the command line.

A vLLM server that restarts forgets every adapter: the sidecar checks every `--check-seconds`
that each alias it applied is still listed, and applies them all again when one is missing.

`GET /healthz` answers while the process runs; `GET /readyz` answers 200 once the follower has
caught up with the broadcasts and the registry and vLLM lists every alias, 503 otherwise
(with the reason). Those two are the listener's only routes, so it needs no token.

    streamtune follow --vllm-url http://127.0.0.1:8000 --artifact-dir /shared/adapters
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from core.errors import ConfigError

log = logging.getLogger("streamtune.follow")


class VllmFollower:
    """The follower applying alias moves to vLLM, and the check that heals a vLLM restart."""

    def __init__(self, follower_settings, target, check_s: float = 5.0):
        from connectors.vllm_target import follow_into_vllm

        self.target, self.check_s = target, check_s
        self.follower = follow_into_vllm(follower_settings, target, on_error=self._on_error)
        self.resyncs = 0
        self.problem: Optional[str] = "starting"  # why not ready; None when ready
        self._stop = threading.Event()
        self._checker: Optional[threading.Thread] = None

    def _on_error(self, model_id: str, alias: str, version, error: Exception) -> None:
        log.error("%s@%s -> v%s not applied to vLLM: %s", model_id, alias, version, error)

    def start(self) -> "VllmFollower":
        self.follower.start()
        self._checker = threading.Thread(target=self._check_loop, name="vllm-check", daemon=True)
        self._checker.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.follower.stop()
        if self._checker is not None:
            self._checker.join(timeout=10)

    def missing_aliases(self) -> list[str]:
        """Alias names the follower applied that vLLM does not list (all of them after a restart)."""
        from connectors.vllm_target import lora_names

        listed = set(self.target.models())
        wanted = [name for m, known in self.follower.models().items() for a, v in known["aliases"].items()
                  for name in ((lora_names(m, v, a)[1], m) if a == "champion" else (lora_names(m, v, a)[1],))]
        return [name for name in wanted if name not in listed]

    def check_once(self) -> None:
        from connectors.vllm_target import resync

        if not self.follower.caught_up:
            self.problem = "catching up with the broadcasts and the registry"
            return
        if not self.target.healthy():
            self.problem = f"vLLM at {self.target.base_url} does not answer /health"
            return
        missing = self.missing_aliases()
        if missing:
            log.warning("vLLM lists none of %s (restarted?): applying every alias again", missing[:5])
            errors = resync(self.follower, self.target)
            self.resyncs += 1
            for e in errors:
                log.error("resync: %s", e)
            missing = self.missing_aliases()
        self.problem = f"vLLM does not list {missing[:5]}" if missing else None

    def _check_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.check_once()
            except Exception as e:  # vLLM or the registry down a while: say so, try again
                self.problem = f"{type(e).__name__}: {e}"
                log.warning("check: %s", self.problem)
            self._stop.wait(0.5 if self.problem else self.check_s)


def status_server(host: str, port: int, follower: VllmFollower) -> ThreadingHTTPServer:
    """/healthz and /readyz (no other route: nothing here needs a token)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path == "/healthz":
                code, body = 200, {"status": "ok"}
            elif self.path == "/readyz":
                problem = follower.problem
                code = 503 if problem else 200
                body = {"ready": problem is None, "reason": problem, "resyncs": follower.resyncs,
                        "models": follower.follower.models()}
            else:
                code, body = 404, {"detail": "only /healthz and /readyz"}
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt, *args):  # probes every few seconds: not worth a log line
            pass

    return ThreadingHTTPServer((host, port), Handler)


def cmd_follow(args: argparse.Namespace) -> int:
    from connectors.vllm_target import VllmTarget
    from streamtune.auth import read_single_token

    from .cli import follower_settings

    if args.check_seconds <= 0 or args.keep_versions < 0:
        raise ConfigError("--check-seconds must be > 0 and --keep-versions >= 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    target = VllmTarget(args.vllm_url, args.artifact_dir, read_single_token(args.vllm_api_key_file, "VLLM_API_KEY"),
                        keep_versions=args.keep_versions)
    settings = follower_settings(args)
    follower = VllmFollower(settings, target, check_s=args.check_seconds).start()
    server = status_server(args.host, args.port, follower)
    threading.Thread(target=server.serve_forever, name="status", daemon=True).start()
    log.info("following into vLLM at %s (adapters under %s); /readyz on %s:%d", args.vllm_url,
             target.artifact_dir, args.host, args.port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    server.shutdown()
    follower.stop()
    return 0


def add_parser(subparsers) -> None:
    from streamtune.api.cli import reporting_errors

    from .cli import add_follower_options

    p = subparsers.add_parser("follow", help="keep a vLLM server's LoRA adapters in step with the versions (sidecar)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-url", required=True, help="the vLLM OpenAI server, e.g. http://127.0.0.1:8000")
    p.add_argument("--artifact-dir", required=True,
                   help="where version files are written for vLLM to read (a volume both mount)")
    p.add_argument("--vllm-api-key-file", default=None, help="vLLM's API key (else $VLLM_API_KEY)")
    p.add_argument("--keep-versions", type=int, default=2,
                   help="unaliased `<model_id>@v<version>` names kept loaded per model (newest first)")
    p.add_argument("--check-seconds", type=float, default=5.0,
                   help="how often vLLM is checked for every alias (a restarted vLLM gets them again)")
    p.add_argument("--host", default="127.0.0.1", help="the /healthz and /readyz listener")
    p.add_argument("--port", type=int, default=8102)
    add_follower_options(p)
    p.set_defaults(func=reporting_errors(cmd_follow))
