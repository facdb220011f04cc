"""`streamtune config`: the effective STREAMTUNE_* settings and where each value comes from.

Values are computed by the loaders that use them (core.defaults for jobs and commands,
streamtune.stack.config for `streamtune stack`), so this shows what a command started in
the same environment would use, not a copy of their rules. A source is `env` (and which
variable) or `default`. Secrets (tokens, keys, the Postgres password) are never printed:
only whether they are set.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable, Mapping


def _source(env: Mapping[str, str], *variables: str) -> str:
    given = [v for v in variables if env.get(v)]
    return f"env {', '.join(given)}" if given else "default"


def settings(env: Mapping[str, str] | None = None) -> list[dict[str, str]]:
    """One row per setting: name, value, source.

    >>> rows = {r["setting"]: r for r in settings({"STREAMTUNE_KAFKA_PORT": "19092", "STREAMTUNE_API_TOKEN": "x"})}
    >>> rows["kafka"]["value"], rows["kafka"]["source"]
    ('127.0.0.1:19092', 'env STREAMTUNE_KAFKA_PORT')
    >>> rows["mlflow"]["source"], rows["api token"]["value"]
    ('default', 'set')
    """
    from core import defaults

    env = dict(os.environ if env is None else env)
    host_port = lambda port: ("STREAMTUNE_HOST", port)  # noqa: E731
    table: list[tuple[str, Callable[[Mapping[str, str]], object], tuple[str, ...]]] = [
        ("home", defaults.home, ("STREAMTUNE_HOME",)),
        ("data dir", defaults.data_dir, ("STREAMTUNE_HOME", "STREAMTUNE_DATA_DIR")),
        ("kafka", defaults.kafka_bootstrap, ("STREAMTUNE_KAFKA_BOOTSTRAP", *host_port("STREAMTUNE_KAFKA_PORT"))),
        ("mlflow", defaults.mlflow_uri, ("STREAMTUNE_MLFLOW_URI", *host_port("STREAMTUNE_MLFLOW_PORT"))),
        ("flink rest", defaults.flink_rest_url,
         ("STREAMTUNE_FLINK_REST_URL", *host_port("STREAMTUNE_FLINK_REST_PORT"))),
        ("postgres", lambda e: f"{e.get('STREAMTUNE_HOST', '127.0.0.1')}:{e.get('STREAMTUNE_POSTGRES_PORT', '5432')}",
         host_port("STREAMTUNE_POSTGRES_PORT")),
        ("mongo", lambda e: f"{e.get('STREAMTUNE_HOST', '127.0.0.1')}:{e.get('STREAMTUNE_MONGO_PORT', '27017')}",
         host_port("STREAMTUNE_MONGO_PORT")),
        ("artifact store", defaults.artifact_store,
         ("STREAMTUNE_ARTIFACT_STORE", "STREAMTUNE_HOME", "STREAMTUNE_DATA_DIR")),
        ("base model", defaults.base_model_dir, ("STREAMTUNE_HOME", "STREAMTUNE_DATA_DIR")),
        ("api url", lambda e: e.get("STREAMTUNE_API_URL") or "http://127.0.0.1:8000", ("STREAMTUNE_API_URL",)),
    ]
    rows = [{"setting": name, "value": str(value(env)), "source": _source(env, *variables)}
            for name, value, variables in table]
    secrets = [("api token", ("STREAMTUNE_API_TOKEN", "STREAMTUNE_TOKENS_FILE", "STREAMTUNE_TOKENS_DIR",
                              *sorted(v for v in env if v.startswith("STREAMTUNE_TOKENS_") and v not in (
                                  "STREAMTUNE_TOKENS_FILE", "STREAMTUNE_TOKENS_DIR")))),
               ("response signing key", ("STREAMTUNE_RESPONSE_SIGNING_KEY", "STREAMTUNE_RESPONSE_SIGNING_KEY_FILE"))]
    for name, variables in secrets:
        source = _source(env, *variables)
        rows.append({"setting": name, "value": "set" if source != "default" else "not set", "source": source})
    known = {v for _, _, variables in table for v in variables} | {v for _, vs in secrets for v in vs}
    # Variables this table does not cover are still shown: a typo in a name is then visible.
    for name in sorted(v for v in env if v.startswith("STREAMTUNE_") and v not in known):
        secret = any(word in name for word in ("TOKEN", "KEY", "PASSWORD", "SECRET"))
        rows.append({"setting": name, "value": "set" if secret else env[name], "source": f"env {name}"})
    return rows


def add_parser(sub) -> None:
    from streamtune.output import add_output_option

    p = sub.add_parser("config", help="the effective STREAMTUNE_* settings and where each comes from",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_option(p)
    p.set_defaults(func=cmd_config)


def cmd_config(args: argparse.Namespace) -> int:
    from streamtune.output import emit

    emit(settings(), args.output)
    return 0
