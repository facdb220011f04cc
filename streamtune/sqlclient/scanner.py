"""The one reading of Flink SQL text: what is quoted, what is a comment, where statements end.

Splitting a file into statements, telling the prompt whether its input is complete and
finding a file's `-- var` comments (runner.file_variables) all go through `pieces`, so they
agree on every quote and comment. Quotes are '...', `...` and "...", a doubled quote
escaping itself; comments are `-- ...` (to the end of the line) and `/* ... */`; an
optimizer hint `/*+ ... */` is part of its statement.

>>> split_statements("SET 'a' = ';'; -- a comment; not a statement\\nSELECT 1 /* c */ FROM t;")
["SET 'a' = ';'", 'SELECT 1   FROM t']
>>> is_complete("SELECT ';'"), is_complete("SELECT 1; -- done")
(False, True)
"""

from __future__ import annotations

import re
from typing import Iterator

from streamtune.sqlclient.errors import SqlError

# Kinds of piece, in the order they are tried at each position.
LINE_COMMENT, HINT, BLOCK_COMMENT, QUOTED, END, UNTERMINATED, CODE = (
    "line_comment", "hint", "block_comment", "quoted", "end", "unterminated", "code")
COMMENTS = (LINE_COMMENT, BLOCK_COMMENT)

_PIECE = re.compile(r"""
    (?P<line_comment>--[^\n]*)                  # the newline stays code: it ends a `--` comment
  | (?P<hint>/\*\+.*?\*/)
  | (?P<block_comment>/\*.*?\*/)
  | (?P<quoted>'(?:[^']|'')*'|`(?:[^`]|``)*`|"(?:[^"]|"")*")
  | (?P<end>;)
  | (?P<unterminated>/\*|['`"])
  | (?P<code>[^-/'`";]+|[-/])
""", re.VERBOSE | re.DOTALL)

# Statement sets span several ';': `EXECUTE STATEMENT SET BEGIN ...; ...; END;` or
# `BEGIN STATEMENT SET; ...; END;`.
STATEMENT_SET_BEGIN = re.compile(r"^\s*(?:EXECUTE\s+STATEMENT\s+SET\s+BEGIN|BEGIN\s+STATEMENT\s+SET)\b\s*",
                                 re.IGNORECASE)
STATEMENT_SET_END = re.compile(r"^\s*END\s*$", re.IGNORECASE)


def pieces(text: str) -> Iterator[tuple[str, str]]:
    """(kind, text) pieces that join back into `text`; SqlError at an unterminated quote or comment.

    >>> [kind for kind, _ in pieces("SELECT 'a;b' -- c\\n;")]
    ['code', 'quoted', 'code', 'line_comment', 'code', 'end']
    """
    pos = 0
    while pos < len(text):
        m = _PIECE.match(text, pos)
        if m.lastgroup == UNTERMINATED:
            opening = "/* comment" if m.group() == "/*" else f"{m.group()} quote"
            raise SqlError(f"unterminated {opening}: {text[pos:pos + 40]!r}")
        yield m.lastgroup, m.group()
        pos = m.end()


def split_statements(text: str) -> list[str]:
    """The statements of `text`, split on ';' outside quotes and comments; comments dropped
    (a `/* */` comment leaves a space), quotes and hints kept verbatim."""
    statements, current = [], []
    for kind, piece in pieces(text):
        if kind == END:
            statements.append("".join(current).strip())
            current = []
        elif kind == BLOCK_COMMENT:
            current.append(" ")
        elif kind != LINE_COMMENT:
            current.append(piece)
    statements.append("".join(current).strip())
    return [s for s in statements if s]


def is_complete(text: str) -> bool:
    """Whether `text` ends in a ';' outside quotes and comments and closes every statement set
    it opens: the prompt runs its input then."""
    try:
        significant = [kind for kind, piece in pieces(text)
                       if kind not in COMMENTS and not (kind == CODE and not piece.strip())]
    except SqlError:  # an open quote or comment: more is coming
        return False
    if not significant or significant[-1] != END:
        return False
    open_set = False
    for statement in split_statements(text):
        if STATEMENT_SET_BEGIN.match(statement):
            open_set = True
        elif STATEMENT_SET_END.match(statement):
            open_set = False
    return not open_set

