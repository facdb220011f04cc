"""The source-kind base class and its registry (one entry per URI scheme)."""

from __future__ import annotations

import re
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

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
        self.query = {k: v for k, v in parse_qs(parts.query).items()}
        self._parse(parts, name)

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
        """The URI a driver gets: this one without streamtune's own query options."""
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
        raise ValueError(f"unsupported source {uri!r}: use {shapes}")
    return cls(uri, name)


def kind_for_connector(connector: str) -> type[SourceKind]:
    """The source kind whose change events carry `source.connector == connector` (KeyError)."""
    return _BY_CONNECTOR[connector]
