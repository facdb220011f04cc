"""`streamtune serve`: arguments parsed here, plain settings passed down."""

from __future__ import annotations

import argparse
import logging
import os
import re
from dataclasses import replace
from pathlib import Path

from core import defaults
from core.errors import ConfigError
from core.options import add_bootstrap_option


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from streamtune.auth import AccessPolicy, TokenStore

    from .app import create_app
    from .guard import GuardSettings
    from .decision import parse_thresholds
    from .served import ServedModels, ServeSettings

    if not 0.0 <= args.candidate_fraction <= 1.0:
        raise ConfigError("--candidate-fraction must be between 0 and 1")
    if args.slots < 1 or args.cpu_cache < 1:
        raise ConfigError("--slots and --cpu-cache must be at least 1")
    if args.max_batch < 1 or args.batch_window_ms < 0 or args.batch_max_wait_ms < 0:
        raise ConfigError("--max-batch must be at least 1, --batch-window-ms and --batch-max-wait-ms at least 0")
    # Tokens and who may call what: streamtune.auth (ConfigError: no token beyond loopback).
    access = AccessPolicy(TokenStore(tokens_file=args.tokens_file, token_file=args.token_file), args.host,
                          args.insecure, "streamtune serve")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    access.announce()
    follower = follower_settings(args)
    log_topic = None if args.no_inference_log else args.inference_log_topic
    guard = None
    if not args.no_auto_rollback:
        import socket

        if args.rollback_min_users < 1:
            raise ConfigError("--rollback-min-users must be at least 1")
        if log_topic is None or args.no_registry:
            raise ConfigError("automatic rollback needs the inference log and the registry "
                              "(or pass --no-auto-rollback)")
        guard = GuardSettings(bootstrap=args.bootstrap, tracking_uri=args.tracking_uri, inference_log_topic=log_topic,
                              feedback_topics=args.feedback_topics, promotion_log=args.promotion_log,
                              margin=args.rollback_margin, min_events=args.rollback_min_events,
                              window=args.rollback_window, min_distinct_users=args.rollback_min_users,
                              owner=f"{socket.gethostname()}:{args.port}")
    settings = ServeSettings(base_model=args.base_model, follower=follower, slots=args.slots,
                             cpu_cache=args.cpu_cache, max_rank=args.max_rank,
                             candidate_fraction=args.candidate_fraction,
                             inference_log_topic=log_topic, guard=guard,
                             webhook_url=None if args.no_registry or args.no_webhook else webhook_url(args),
                             response_signing_key=response_signing_key(args),
                             batch_window_ms=args.batch_window_ms, batch_max_wait_ms=args.batch_max_wait_ms,
                             max_batch=args.max_batch,
                             confidence_thresholds=parse_thresholds(args.confidence_threshold))
    if args.drain_seconds < 0:
        raise ConfigError("--drain-seconds must be at least 0")
    if args.engine == "vllm":
        from streamtune.auth import read_single_token

        if not args.vllm_url or not args.vllm_artifact_dir:
            raise ConfigError("--engine vllm needs --vllm-url and --vllm-artifact-dir")
        settings = replace(settings, vllm_url=args.vllm_url, vllm_artifact_dir=args.vllm_artifact_dir,
                           vllm_api_key=read_single_token(args.vllm_api_key_file, "VLLM_API_KEY"))
    served = ServedModels(settings)
    from .headroom import install_headroom

    app = create_app(served, access)
    install_headroom(app, args)  # with --slo-p99-ms: GET /headroom for a trainer on the same device
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info")
    draining_server(config, served, args.drain_seconds).run()
    return 0


def draining_server(config, served, drain_s: float):
    """uvicorn's Server, whose first SIGTERM (or SIGINT) only marks the replica not ready for
    `drain_s` seconds, still serving, before the graceful shutdown begins (which finishes the
    requests in flight). A balancer probing /readyz stops sending here within that time, so no
    request is sent to a closed port. A second signal shuts down at once."""
    import threading

    import uvicorn  # here, not at the top: `streamtune --help` stays fast

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if drain_s > 0 and not served.draining:
                served.draining = True
                logging.getLogger("streamtune.serve").info(
                    "signal %s: /readyz answers 503 now, shutting down in %.1f s", sig, drain_s)
                timer = threading.Timer(drain_s, super().handle_exit, (sig, frame))
                timer.daemon = True
                timer.start()
                return
            super().handle_exit(sig, frame)

    return DrainingServer(config)


def response_signing_key(args: argparse.Namespace):
    """The key that signs response ids: --response-signing-key-file, else the environment
    (core.response_ids.signing_key); None leaves ids unsigned, which a control plane holding
    the key dead-letters as `unsigned_response` when feedback cites them. Bound beyond
    loopback, no key is refused (ConfigError) unless --insecure (tests and demos only)."""
    from core.response_ids import SIGNING_KEY_FILE_ENV, signing_key
    from streamtune.auth import is_loopback

    env = dict(os.environ)
    if args.response_signing_key_file:
        env[SIGNING_KEY_FILE_ENV] = args.response_signing_key_file
    key = signing_key(env)
    if key is None and not is_loopback(args.host) and not args.insecure:
        raise ConfigError(f"--host {args.host} without a response signing key: pass --response-signing-key-file "
                          "or set STREAMTUNE_RESPONSE_SIGNING_KEY[_FILE] (--insecure for tests and demos only)")
    if key is None:
        logging.getLogger("streamtune.serve").warning(
            "no response signing key (--response-signing-key-file, STREAMTUNE_RESPONSE_SIGNING_KEY): "
            "response ids are unsigned, and feedback citing them cannot be told from forged")
    return key


def webhook_url(args: argparse.Namespace) -> str:
    """Where MLflow should POST alias moves: given, or this server's own address."""
    import socket

    if args.webhook_url:
        return args.webhook_url
    host = socket.gethostname() if args.host in ("0.0.0.0", "::", "") else args.host
    return f"http://{host}:{args.port}/v1/hooks/mlflow"


def add_follower_options(p: argparse.ArgumentParser) -> None:
    """Where versions and aliases come from: what `serve` and `follow` both follow."""
    p.add_argument("--artifact-store", default=defaults.artifact_store())
    p.add_argument("--tracking-uri", default=defaults.mlflow_uri(), help="MLflow: where aliases point")
    p.add_argument("--no-registry", action="store_true", help="take aliases from the broadcasts only")
    add_bootstrap_option(p, default=defaults.kafka_bootstrap())
    p.add_argument("--broadcast-topics", default=defaults.BROADCAST_TOPIC_PATTERN,
                   help="regex of the adapter-versions topics to follow (default: every job's)")


def follower_settings(args: argparse.Namespace):
    """The follower's settings from `add_follower_options`' arguments."""
    from connectors.adapter_follower import FollowerSettings

    return FollowerSettings(bootstrap=args.bootstrap, tracking_uri=None if args.no_registry else args.tracking_uri,
                            artifact_store=args.artifact_store, topic_pattern=args.broadcast_topics)


def add_parser(subparsers) -> None:
    from streamtune.api.cli import add_token_arguments, reporting_errors

    p = subparsers.add_parser("serve", help="OpenAI-compatible inference that follows adapter versions")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--base-model", default=str(defaults.base_model_dir()))
    add_follower_options(p)
    p.add_argument("--slots", type=int, default=8, help="adapters held in device memory")
    p.add_argument("--cpu-cache", type=int, default=1024, help="more adapters held in CPU memory (LRU)")
    p.add_argument("--max-rank", type=int, default=16, help="largest LoRA rank served")
    p.add_argument("--confidence-threshold", action="append", default=[], metavar="MODEL=VALUE",
                   help="mean log-probability below which a request with a latency budget may take the "
                        "accurate path (best-of-k on the same version); MODEL * for every model; repeatable")
    p.add_argument("--batch-window-ms", type=float, default=5.0,
                   help="how long concurrent requests are gathered into one decoding batch")
    p.add_argument("--batch-max-wait-ms", type=float, default=50.0,
                   help="right after a batch, how long to wait for as many rows as were then in flight (clients "
                        "that send again as their answer comes back); a lone client waits only the window")
    p.add_argument("--max-batch", type=int, default=16, help="rows (prompts × n) decoded together at most")
    p.add_argument("--engine", choices=("builtin", "vllm"), default="builtin",
                   help="who decodes: this process (CPUs, small deployments) or a vLLM server, with routing, "
                        "split, guard and inference log kept here")
    p.add_argument("--vllm-url", default=None, help="--engine vllm: the vLLM OpenAI server")
    p.add_argument("--vllm-artifact-dir", default=None,
                   help="--engine vllm: where version files are written for vLLM to read (a volume both mount)")
    p.add_argument("--vllm-api-key-file", default=None, help="--engine vllm: vLLM's API key (else $VLLM_API_KEY)")
    p.add_argument("--drain-seconds", type=float, default=0.0,
                   help="on SIGTERM, answer /readyz 503 but keep serving this long before shutting down "
                        "(for a balancer that probes /readyz; Kubernetes' preStop pause does the same)")
    p.add_argument("--candidate-fraction", type=float, default=0.0,
                   help="share of traffic for `candidate` when it differs from `champion`")
    p.add_argument("--inference-log-topic", default=defaults.INFERENCE_LOG_TOPIC)
    p.add_argument("--no-inference-log", action="store_true")
    p.add_argument("--feedback-topics", default=re.escape(defaults.FEEDBACK_TOPIC),
                   help="regex of the feedback topics whose events cite served responses (request_id)")
    p.add_argument("--rollback-margin", type=float, default=0.1,
                   help="acceptance-rate gap that takes a candidate out (or rolls a champion back)")
    p.add_argument("--rollback-min-events", type=int, default=30, help="judged responses needed on each side")
    p.add_argument("--rollback-window", type=int, default=200, help="judged responses kept per version")
    p.add_argument("--rollback-min-users", type=int, default=5,
                   help="distinct users (the inference `user` of the judged responses) needed on each side "
                        "before the guard acts; 1 turns this defence off (tests and demos only)")
    p.add_argument("--promotion-log", type=Path, default=defaults.home() / "api" / "promotions.jsonl")
    p.add_argument("--no-auto-rollback", action="store_true")
    p.add_argument("--webhook-url", default=None,
                   help="URL at which MLflow reaches this server, to push alias moves "
                        "(default: http://<host>:<port>/v1/hooks/mlflow; this machine's name for 0.0.0.0)")
    p.add_argument("--no-webhook", action="store_true",
                   help="only poll the registry for alias moves made in MLflow directly")
    add_token_arguments(p)
    p.add_argument("--response-signing-key-file", default=None,
                   help="the key (shared by the deployment's servers and the control plane) that signs "
                        "response ids (else $STREAMTUNE_RESPONSE_SIGNING_KEY_FILE, "
                        "$STREAMTUNE_RESPONSE_SIGNING_KEY)")
    from .headroom import add_headroom_arguments

    add_headroom_arguments(p)
    p.set_defaults(func=reporting_errors(cmd_serve))
