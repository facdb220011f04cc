"""The one error `streamtune sql` reports on purpose."""

from __future__ import annotations

from core.errors import StreamtuneError


class SqlError(StreamtuneError):
    """A statement could not be parsed, substituted or run (exit code 2, core.errors)."""
