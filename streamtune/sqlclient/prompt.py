"""The interactive prompt of `streamtune sql`: read statements ending in ';' and run them.

Input is run once it is complete (scanner.is_complete: a ';' outside quotes and comments,
every statement set closed). A failing statement prints ``ERROR: ...`` in the session's
output and the prompt goes on; ``quit;``, ``exit;`` or the end of input leaves.

>>> import io
>>> out = io.StringIO()
>>> no_statement_runs = object()   # so no table environment is needed
>>> repl(no_statement_runs, stdin=io.StringIO("-- nothing to run\\nquit;\\n"), out=out), out.getvalue()
(0, '')
"""

from __future__ import annotations

import sys
from typing import TextIO

from streamtune.sqlclient.errors import SqlError
from streamtune.sqlclient.runner import first_line, new_table_env, run_statements
from streamtune.sqlclient.scanner import is_complete, split_statements

PROMPT, CONTINUATION = "streamtune> ", "         -> "


def _read_line(stdin: TextIO, out: TextIO, interactive: bool, prompt: str) -> str | None:
    """The next input line; None at the end of input."""
    if not interactive:
        return stdin.readline() or None
    try:
        return input(prompt) + "\n"
    except EOFError:
        print(file=out)
        return None


def _is_quit(text: str) -> bool:
    return [s.lower() for s in split_statements(text)] in (["quit"], ["exit"])


def repl(t_env=None, variables: dict[str, str] | None = None, *, max_rows: int | None = None,
         stdin: TextIO | None = None, out: TextIO | None = None) -> int:
    """Run statements from `stdin` until `quit;` or its end; returns 0.

    Raises SqlError when the input ends inside a statement (no closing ';').
    """
    stdin, out = stdin or sys.stdin, out or sys.stdout
    interactive = stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    if t_env is None:
        t_env = new_table_env()
    buffer = ""
    while True:
        try:
            line = _read_line(stdin, out, interactive, CONTINUATION if buffer.strip() else PROMPT)
        except KeyboardInterrupt:
            if not interactive:
                raise
            print(file=out)  # Ctrl-C at the prompt drops what was typed so far
            buffer = ""
            continue
        if line is None:
            break
        buffer += line
        if not is_complete(buffer):
            continue
        text, buffer = buffer, ""
        if _is_quit(text):
            break
        try:
            run_statements(text, variables, t_env, max_rows=max_rows, out=out, wait_inserts=False)
        except KeyboardInterrupt:
            print("interrupted", file=out)
        except Exception as e:  # the session goes on after a failed statement
            print(f"ERROR: {e if isinstance(e, SqlError) else first_line(e)}", file=out, flush=True)
    if split_statements(buffer):  # a comment left at the end is no statement
        raise SqlError("incomplete statement at end of input (missing ';')")
    return 0
