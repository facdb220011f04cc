"""Options several commands and jobs share, spelled the same everywhere."""

from __future__ import annotations

import argparse


def add_bootstrap_option(p: argparse.ArgumentParser, default: str | None = None, help: str | None = None) -> None:
    """Kafka's address as --bootstrap-server, the name Kafka's own tools use. --bootstrap, the
    older name, still works and is left out of --help. Both set `args.bootstrap`.

    >>> p = argparse.ArgumentParser()
    >>> add_bootstrap_option(p, default="127.0.0.1:9092")
    >>> [p.parse_args(a).bootstrap for a in ([], ["--bootstrap-server", "k:1"], ["--bootstrap", "k:2"])]
    ['127.0.0.1:9092', 'k:1', 'k:2']
    """
    p.add_argument("--bootstrap-server", dest="bootstrap", default=default, metavar="HOST:PORT",
                   help=help or "Kafka bootstrap servers")
    p.add_argument("--bootstrap", dest="bootstrap", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
