"""One base class for every error streamtune reports, and the exit codes of its commands.

| exit code | meaning                                                                 |
|-----------|-------------------------------------------------------------------------|
| 0         | success                                                                 |
| 1         | the command ran and reports a failed check (e.g. an unhealthy stack)    |
| 2         | bad usage, configuration or input (a clear one-line error on stderr)    |
| 3         | a service the command needs is unreachable or failing                   |
| 130       | interrupted (Ctrl-C)                                                    |

>>> err = ConfigError("--mapping: no such file")
>>> isinstance(err, StreamtuneError), err.exit_code
(True, 2)
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_INTERRUPTED = 130

# Every command's errors start with this, one line on stderr (docs/guides/cli.md).
ERROR_PREFIX = "streamtune: "


def report(message: object) -> None:
    """Print one error line on stderr with the command's prefix."""
    import sys

    print(f"{ERROR_PREFIX}{message}", file=sys.stderr)


class StreamtuneError(Exception):
    """Base of every error streamtune raises on purpose; its message is one line for a user."""

    exit_code = EXIT_USAGE


class ConfigError(StreamtuneError):
    """A setting, file or argument that cannot work as given."""


class InvalidMessage(StreamtuneError, ValueError):
    """A wire message that does not follow its contract (core.messages).

    `code` is the dead-letter reason (e.g. `schema`, `bad_json`).
    """

    def __init__(self, code: str, detail: str):
        super().__init__(detail)
        self.code, self.detail = code, detail


class ArtifactIntegrityError(StreamtuneError, ValueError):
    """An adapter artifact missing, or not matching the sha256 its version record names."""


class ServiceUnavailable(StreamtuneError):
    """A service (Kafka, MLflow, Flink, a database) is unreachable or failing."""

    exit_code = EXIT_UNAVAILABLE


class CaptureError(StreamtuneError):
    """A change capture cannot run as configured (missing table, lost resume token, ...)."""
