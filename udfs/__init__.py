"""Python UDFs for streamtune's Flink SQL (sql/).

| function                            | returns | module                |
|-------------------------------------|---------|-----------------------|
| token_count(text, tokenizer_name)   | INT     | udfs/token_count.py (tokenizers: udfs/tokenizer_catalogue.py) |
| json_path(json_str, path)           | STRING  | udfs/json_path.py     |
| confidence(logprob, tokens)         | DOUBLE  | udfs/confidence.py    |
| pseudo_label(score, accept_at, reject_below) | STRING | udfs/pseudo_label.py |

From Python: ``udfs.register_all(t_env)``. From a SQL client (sql-client.sh, where ``udfs``
is installed, or shipped with ``core`` as ``-pyfs udfs.zip``; see sql/README.md), the statements
``udfs.create_statements()`` returns, also in sql/functions.sql:

    CREATE TEMPORARY SYSTEM FUNCTION IF NOT EXISTS token_count
        AS 'udfs.token_count.token_count' LANGUAGE PYTHON;
"""

from __future__ import annotations

import importlib

FUNCTIONS = {
    "token_count": "udfs.token_count.token_count",
    "json_path": "udfs.json_path.json_path",
    "confidence": "udfs.confidence.confidence",
    "pseudo_label": "udfs.pseudo_label.pseudo_label",
}


def load(qualified: str):
    module, _, attr = qualified.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def register_all(t_env) -> list[str]:
    """Register every UDF in `t_env`; returns their names. Idempotent.

    Temporary *system* functions (``create_temporary_system_function``): they resolve in any
    catalog and database, like sql/functions.sql's CREATE TEMPORARY SYSTEM FUNCTION.
    """
    for name, qualified in FUNCTIONS.items():
        try:
            t_env.create_temporary_system_function(name, load(qualified))
        except Exception as e:  # registered before, e.g. by sql/functions.sql
            if "already exist" not in str(e):
                raise
    return list(FUNCTIONS)


def create_statements() -> list[str]:
    """The SQL that registers the same functions (LANGUAGE PYTHON) in a SQL client."""
    return [f"CREATE TEMPORARY SYSTEM FUNCTION IF NOT EXISTS {name} AS '{qualified}' LANGUAGE PYTHON"
            for name, qualified in FUNCTIONS.items()]
