"""`streamtune registrar`: the command line of streamtune.registrar, kept apart so that
parsing its arguments does not import Kafka and MLflow."""

from __future__ import annotations

import argparse

from core import defaults
from core.errors import EXIT_INTERRUPTED, EXIT_OK


def add_parser(sub) -> None:
    from core.options import add_bootstrap_option

    p = sub.add_parser("registrar", help="register committed versions of a versions topic in MLflow and broadcast them",
                       description="Standalone registration, for versions topics written by other producers or by "
                                   "jobs run with --no-register. Training jobs register their own versions. "
                                   "Runs until SIGTERM (exit 0) or Ctrl-C (exit 130).")
    p.add_argument("--versions-topic", default=defaults.VERSIONS_TOPIC)
    p.add_argument("--broadcast-topic", default=defaults.ADAPTER_VERSIONS_TOPIC)
    p.add_argument("--group-id", default="streamtune-registrar", help="Kafka consumer group (its committed offsets)")
    add_bootstrap_option(p, default=None, help="default: the local stack's Kafka")
    p.add_argument("--tracking-uri", default=None, help="default: the local stack's MLflow")
    p.add_argument("--artifact-store", default=None, help="default: STREAMTUNE_ARTIFACT_STORE or the stack's")
    p.set_defaults(func=cmd_registrar)


def cmd_registrar(args: argparse.Namespace) -> int:
    """Runs until SIGTERM (0) or Ctrl-C (130); one line per registered, duplicate or invalid
    version on stderr."""
    import logging
    import signal
    import sys
    import threading

    from streamtune.registrar import Registrar, RegistrarConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)
    config = RegistrarConfig(bootstrap=args.bootstrap or defaults.kafka_bootstrap(),
                             tracking_uri=args.tracking_uri or defaults.mlflow_uri(),
                             versions_topic=args.versions_topic, broadcast_topic=args.broadcast_topic,
                             group_id=args.group_id, artifact_store=args.artifact_store or defaults.artifact_store())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with Registrar(config, on_event=lambda line: print(f"registrar: {line}", file=sys.stderr, flush=True)) as reg:
            reg.run(stop)
    except KeyboardInterrupt:
        # Ctrl-C is an interruption, not a finished run: 130 like other Unix tools.
        return EXIT_INTERRUPTED
    return EXIT_OK
