"""Moved to streamtune.sqlclient. Only streamtune/cli.py still imports this name: delete this
file when cli.py imports `from .sqlclient.command import add_parser as add_sql_parser`."""

from streamtune.sqlclient.command import add_parser

__all__ = ["add_parser"]
