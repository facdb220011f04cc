"""`streamtune config`: the effective STREAMTUNE_* settings and where each value comes from.

Values come from the one settings object every command, job, the stack and the API read
(core.settings.Settings), so this shows what a command started in the same environment would
use. A source is `env` (and which variables) or `default`. Secrets (tokens, keys) are never
printed: only whether they are set.
"""

from __future__ import annotations

import argparse
import os
from typing import Mapping

# Row -> (the value, as a Settings attribute; the fields it is derived from).
ROWS = [
    ("home", "home_path", ("home",)),
    ("data dir", "data_path", ("home", "data_dir")),
    ("kafka", "kafka_address", ("kafka_bootstrap", "host", "kafka_port")),
    ("mlflow", "tracking_uri", ("mlflow_uri", "host", "mlflow_port")),
    ("flink rest", "flink_rest_address", ("flink_rest_url", "host", "flink_rest_port")),
    ("flink rpc port", "flink_rpc_port", ("flink_rpc_port",)),
    ("postgres", None, ("host", "postgres_port")),
    ("mongo", None, ("host", "mongo_port")),
    ("artifact store", "artifact_store_uri", ("artifact_store", "home", "data_dir")),
    ("tokenizer catalogue", "tokenizer_catalogue_path", ("tokenizer_catalogue", "home", "data_dir")),
    ("api url", "api_url", ("api_url",)),
    ("serve url", "serve_address", ("serve_url", "host")),
    ("api cors origins", "api_cors_origins", ("api_cors_origins",)),
    ("feedback rate", "feedback_rate", ("feedback_rate",)),
    ("feedback burst", "feedback_burst", ("feedback_burst",)),
    ("feedback max weight", "feedback_max_weight", ("feedback_max_weight",)),
    ("feedback max skew ms", "feedback_max_skew_ms", ("feedback_max_skew_ms",)),
    ("feedback max age ms", "feedback_max_age_ms", ("feedback_max_age_ms",)),
]


def settings(env: Mapping[str, str] | None = None) -> list[dict[str, str]]:
    """One row per setting: name, value, source.

    >>> rows = {r["setting"]: r for r in settings({"STREAMTUNE_KAFKA_PORT": "19092", "STREAMTUNE_API_TOKEN": "x"})}
    >>> rows["kafka"]["value"], rows["kafka"]["source"]
    ('127.0.0.1:19092', 'env STREAMTUNE_KAFKA_PORT')
    >>> rows["mlflow"]["source"], rows["api token"]["value"]
    ('default', 'set')
    """
    from core.settings import Settings

    env = dict(os.environ if env is None else env)
    shared = Settings.read(env)

    def source(*variables: str) -> str:
        given = [v for v in variables if env.get(v)]
        return f"env {', '.join(given)}" if given else "default"

    rows = []
    for name, attribute, fields in ROWS:
        if attribute is None:  # a server the stack runs on host:port
            value = f"{shared.host}:{getattr(shared, fields[1])}"
        else:
            value = getattr(shared, attribute)
        rows.append({"setting": name, "value": str(value),
                     "source": source(*(v for f in fields for v in Settings.variables(f)))})
    secrets = [("api token", ("STREAMTUNE_API_TOKEN", "STREAMTUNE_TOKENS_FILE", "STREAMTUNE_TOKENS_DIR",
                              *sorted(v for v in env if v.startswith("STREAMTUNE_TOKENS_") and v not in (
                                  "STREAMTUNE_TOKENS_FILE", "STREAMTUNE_TOKENS_DIR")))),
               ("response signing key", ("STREAMTUNE_RESPONSE_SIGNING_KEY", "STREAMTUNE_RESPONSE_SIGNING_KEY_FILE"))]
    for name, variables in secrets:
        given = source(*variables)
        rows.append({"setting": name, "value": "set" if given != "default" else "not set", "source": given})
    known = {v for f in Settings.model_fields for v in Settings.variables(f)} | {v for _, vs in secrets for v in vs}
    # Variables the settings do not cover are still shown: a typo in a name is then visible.
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
