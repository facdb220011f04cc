"""The source-kind base class and its registry (one entry per URI scheme), and secret references.

Secrets never go in a source URI: the URI is stored in the jobs file, answered by the API,
published to the config topic and passed to the capture on its command line (`ps`). A URI
with a password (`user:PASSWORD@`, or a `password=`-like query option) is refused, with a
message that names the alternative and never repeats the password. The alternative is a
secret reference, resolved only where a connection is made (the capture, the control plane
dropping a slot):

- `?password_env=NAME`: the password is the value of environment variable NAME (on
  Kubernetes, `streamtune render` maps it to key NAME of the Secret `<name>-source`);
  names of the stack's own credentials (STREAMTUNE_*, PGPASSWORD, MLFLOW_*, AWS_*) are refused,
  so a pipeline cannot send them to a host it names.
- `?password_file=/PATH`: the password is the file's content (trailing newline dropped), a
  file under one of the secret directories (STREAMTUNE_SECRET_DIRS, os.pathsep-separated;
  default /run/secrets), e.g. a mounted Kubernetes Secret.

>>> source_for("postgres://u:hunter2@db/app?table=t")
Traceback (most recent call last):
...
ValueError: a password in a source URI is refused (it would be stored, published and shown): name a secret reference instead, ?password_env=VAR or ?password_file=/run/secrets/FILE
>>> redact_uri("postgres://u:hunter2@db/app?table=t&sslpassword=x")
'postgres://u:***@db/app?table=t&sslpassword=***'
>>> source_for("postgres://u@db/app?table=t&password_env=PG_PASSWORD").secret_password({"PG_PASSWORD": "pw"})
'pw'
>>> source_for("postgres://u@db/app?table=t&password_env=STREAMTUNE_API_TOKEN")
Traceback (most recent call last):
...
ValueError: password_env STREAMTUNE_API_TOKEN names one of the stack's own credentials (STREAMTUNE_*, PGPASSWORD, MLFLOW_*, AWS_*): give the source a variable of its own

STREAMTUNE_ALLOW_URI_PASSWORDS=1 turns the refusal off: for tests and demos only (the
security tests show with it that the secret then leaks everywhere).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, ClassVar, Mapping
from urllib.parse import parse_qs, quote, urlencode, urlsplit, urlunsplit

from core.errors import ConfigError

REFUSED = ("a password in a source URI is refused (it would be stored, published and shown): name a secret "
           "reference instead, ?password_env=VAR or ?password_file=/run/secrets/FILE")
SECRET_OPTIONS = ("password_env", "password_file")   # streamtune's own: never passed to a driver
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
# The stack's own credentials: a pipeline naming one could send it to a host of its choosing.
STACK_ENV = re.compile(r"(STREAMTUNE_|MLFLOW_|AWS_).*|PGPASSWORD", re.IGNORECASE)
DEFAULT_SECRET_DIRS = ("/run/secrets",)
MAX_SECRET_BYTES = 4096


def allow_uri_passwords(env: Mapping[str, str] | None = None) -> bool:
    """STREAMTUNE_ALLOW_URI_PASSWORDS=1: accept passwords in URIs (tests and demos only)."""
    return (os.environ if env is None else env).get("STREAMTUNE_ALLOW_URI_PASSWORDS", "") in ("1", "true", "yes")


def _secret_option(key: str) -> bool:
    """A driver option that carries a secret (password=, sslpassword=, …Password=, …token=)."""
    k = key.lower()
    return k not in SECRET_OPTIONS and any(word in k for word in ("password", "secret", "token"))


def uri_has_secret(uri: str) -> bool:
    """A password in the userinfo or a secret-bearing query option."""
    try:
        parts = urlsplit(uri)
        password = parts.password
    except ValueError:
        return False
    return bool(password) or any(_secret_option(k) for k in parse_qs(parts.query, keep_blank_values=True))


def redact_uri(uri: str) -> str:
    """`uri` with its password and secret query values replaced by ***; safe to show."""
    try:
        parts = urlsplit(uri)
        if parts.password:
            host = parts.netloc.rsplit("@", 1)[1]
            user = parts.netloc.rsplit("@", 1)[0].split(":", 1)[0]
            parts = parts._replace(netloc=f"{user}:***@{host}")
        query = [(k, "***" if _secret_option(k) else v) for k, vs in parse_qs(parts.query, keep_blank_values=True).items()
                 for v in vs]
        return urlunsplit(parts._replace(query=urlencode(query, safe="*/", quote_via=quote)))
    except ValueError:
        return "<unparseable URI>"


def secret_dirs(env: Mapping[str, str] | None = None) -> list[Path]:
    """Where password_file may point: STREAMTUNE_SECRET_DIRS (os.pathsep-separated), default /run/secrets."""
    raw = (os.environ if env is None else env).get("STREAMTUNE_SECRET_DIRS", "")
    return [Path(d) for d in (raw.split(os.pathsep) if raw else DEFAULT_SECRET_DIRS) if d]

_BY_SCHEME: dict[str, type["SourceKind"]] = {}
_BY_CONNECTOR: dict[str, type["SourceKind"]] = {}


class SourceKind:
    """One parsed source URI; subclasses set the class attributes and parse their options."""

    scheme: ClassVar[str]                      # the canonical URI scheme
    aliases: ClassVar[tuple[str, ...]] = ()    # other schemes accepted for it
    example: ClassVar[str]                     # shown in errors: the URI's shape
    connector: ClassVar[str | None] = None     # Debezium `source.connector` of its change events
    change_fields: ClassVar[tuple[str, ...]] = ()  # what such an event's `source` must carry
    snapshots: ClassVar[bool] = False          # its capture can read existing rows first (--snapshot)
    # "module:Class" of its capture (`streamtune cdc`); imported only by the capture command.
    capture: ClassVar[str | None] = None

    def __init__(self, uri: str, name: str | None = None):
        self.uri = uri
        parts = urlsplit(uri)
        if uri_has_secret(uri) and not allow_uri_passwords():
            raise ValueError(REFUSED)
        self.query = {k: v for k, v in parse_qs(parts.query).items()}
        self.password_env, self.password_file = self._one("password_env"), self._one("password_file")
        if self.password_env is not None and self.password_file is not None:
            raise ValueError("name one secret reference: password_env or password_file, not both")
        if self.password_env is not None:
            if not ENV_NAME.fullmatch(self.password_env):
                raise ValueError("password_env must be an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
            if STACK_ENV.fullmatch(self.password_env):
                raise ValueError(f"password_env {self.password_env} names one of the stack's own credentials "
                                 "(STREAMTUNE_*, PGPASSWORD, MLFLOW_*, AWS_*): give the source a variable of its own")
        if self.password_file is not None and (not self.password_file.startswith("/") or "\0" in self.password_file
                                               or ".." in self.password_file.split("/")):
            raise ValueError("password_file must be an absolute path without '..' (a file under the secret "
                             "directories, STREAMTUNE_SECRET_DIRS)")
        self._parse(parts, name)

    @property
    def has_secret_reference(self) -> bool:
        return self.password_env is not None or self.password_file is not None

    def secret_password(self, env: Mapping[str, str] | None = None) -> str | None:
        """The password the source's secret reference names (None without one), read now.

        Called where a connection is made, never stored. ConfigError says which reference
        could not be resolved, never its value.
        """
        env = os.environ if env is None else env
        if self.password_env is not None:
            value = env.get(self.password_env)
            if not value:
                raise ConfigError(f"password_env {self.password_env} is not set in this process's environment")
            return value
        if self.password_file is not None:
            path = Path(self.password_file).resolve()
            if not any(path.is_relative_to(d.resolve()) for d in secret_dirs(env)):
                raise ConfigError(f"password_file {self.password_file} is outside the secret directories "
                                 f"({os.pathsep.join(map(str, secret_dirs(env)))}; STREAMTUNE_SECRET_DIRS)")
            try:
                with open(path, "rb") as f:
                    data = f.read(MAX_SECRET_BYTES + 1)
            except OSError as e:
                raise ConfigError(f"password_file {self.password_file}: {e.strerror}") from None
            if len(data) > MAX_SECRET_BYTES:
                raise ConfigError(f"password_file {self.password_file} is over {MAX_SECRET_BYTES} bytes")
            return data.decode().rstrip("\r\n")
        return None

    @property
    def user(self) -> str | None:
        """The user the URI names (None: the driver's default)."""
        return urlsplit(self.uri).username

    @property
    def host_port(self) -> tuple[str | None, int | None]:
        """The server the URI names: (hostname or None, port or None)."""
        parts = urlsplit(self.uri)
        return parts.hostname, parts.port

    def _parse(self, parts, name: str | None) -> None:
        raise NotImplementedError

    @property
    def source_ids(self) -> tuple[str, ...]:
        """What this source feeds, as matched against FinetuneSpec.source_id."""
        raise NotImplementedError

    @property
    def source_id(self) -> str:
        """The source id of a fine-tune spec's stream_source (its first, usually only, one)."""
        return self.source_ids[0]

    @property
    def default_topic(self) -> str:
        """The Kafka topic a capture of this source writes when none is given."""
        return "streamtune.cdc." + re.sub(r"[^A-Za-z0-9._-]", "_", self.name)

    # -- helpers for subclasses -----------------------------------------------------------
    def _one(self, key: str) -> str | None:
        return self.query[key][0] if key in self.query else None

    def _connection_uri(self, parts, drop: tuple[str, ...], scheme: str | None = None) -> str:
        """The URI a driver gets: this one without streamtune's own query options (nor the secret references)."""
        drop = (*drop, *SECRET_OPTIONS)
        rest = urlencode({k: v for k, v in self.query.items() if k not in drop}, doseq=True)
        return urlunsplit((scheme or parts.scheme, parts.netloc, parts.path, rest, ""))

    # Kinds with a `connector` also answer, as classmethods over a change event's `source`
    # (core.messages.ChangeSource): table_of -> "db.schema.table" or "db.collection";
    # change_source_id -> the spec source id it feeds; position -> a tuple that orders one
    # source's changes; position_text -> the same for people; lineage -> what version lineage
    # records (LSNs, resume token). See core/sources/postgres.py.


def register_source_kind(cls: type[SourceKind]) -> type[SourceKind]:
    """Class decorator: make `cls` the source kind of its scheme(s) and connector."""
    for scheme in (cls.scheme, *cls.aliases):
        if scheme in _BY_SCHEME and _BY_SCHEME[scheme] is not cls:
            raise ValueError(f"scheme {scheme!r} is already registered to {_BY_SCHEME[scheme].__name__}")
        _BY_SCHEME[scheme] = cls
    if cls.connector:
        _BY_CONNECTOR[cls.connector] = cls
    return cls


def source_kinds() -> list[type[SourceKind]]:
    return list(dict.fromkeys(_BY_SCHEME.values()))


def source_for(uri: str, name: str | None = None) -> SourceKind:
    """Parse a source URI by its scheme; ValueError says what a valid one looks like."""
    scheme = urlsplit(uri).scheme
    cls = _BY_SCHEME.get(scheme)
    if cls is None:
        shapes = ", ".join(k.example for k in source_kinds())
        raise ValueError(f"unsupported source {redact_uri(uri)!r}: use {shapes}")
    return cls(uri, name)


def kind_for_connector(connector: str) -> type[SourceKind]:
    """The source kind whose change events carry `source.connector == connector` (KeyError)."""
    return _BY_CONNECTOR[connector]
