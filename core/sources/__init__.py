"""Source kinds, registered by URI scheme, as flink-cdc gives each connector a factory.

A source kind owns everything that differs between sources: parsing its URI into typed
options, the source id a fine-tune spec is matched by, and for change-data sources the
fields its change events carry, their order (position) and how lineage names them.
Adding a source kind is one module with one `@register_source_kind` class.

>>> src = source_for("postgres://u@db:5432/app?table=answers&table=crm.notes&password_env=APP_PG_PASSWORD")
>>> src.source_ids, src.name, src.dsn, src.password_env
(('postgres:public.answers', 'postgres:crm.notes'), 'pg-app', 'postgresql://u@db:5432/app', 'APP_PG_PASSWORD')
>>> source_for("kafka://topic=user_feedback_v3").source_id
'kafka:user_feedback_v3'
>>> source_for("ftp://x")
Traceback (most recent call last):
...
ValueError: unsupported source 'ftp://x': use kafka://topic=NAME, postgres://…?table=NAME, mongodb://…?db=NAME&collection=NAME
"""

from core.sources.base import (SourceKind, kind_for_connector, redact_uri, register_source_kind, source_for,
                               source_kinds, uri_has_secret)
from core.sources import kafka, postgres, mongodb  # noqa: F401,I001  (registers the built-in kinds, in this order)

__all__ = ["SourceKind", "kind_for_connector", "redact_uri", "register_source_kind", "source_for", "source_kinds",
           "uri_has_secret"]
