"""MLflow registry webhooks for alias moves: a push where a poll would be late.

A poll of every registered model's aliases takes a good part of a second once the registry
holds hundreds of models, so a move made in MLflow directly (the UI, a script) would reach
inference processes seconds late. MLflow 3 (SQL backend) POSTs `model_version_alias.created`
and `.deleted` events to a URL instead, signed with HMAC-SHA256 over
`<delivery id>.<timestamp>.<body>` (header `X-MLflow-Signature: v1,<base64>`).

An inference process registers itself at start (`register`, under a name of its own, with a
secret made for the run), checks every delivery (`verify`) and reads the named model from the
registry: the event is a hint, the registry stays the truth. The MLflow server must accept an
http URL on a private address and look its webhooks up often:
`MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https`, `MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true`,
`MLFLOW_WEBHOOK_CACHE_TTL=1` (the local stack and docker-compose.yml set them).

>>> body = b'{"entity": "model_version_alias", "action": "created", "data": {"name": "bot", "alias": "champion", "version": "3"}}'
>>> headers = signed_headers("s3cret", "d-1", 1000, body)
>>> alias_event(verify("s3cret", headers, body, now=1010))
'bot'
>>> verify("other", headers, body, now=1010)
Traceback (most recent call last):
...
connectors.mlflow_webhook.WebhookRejected: bad signature
>>> verify("s3cret", headers, body, now=1000 + MAX_AGE_S + 1)
Traceback (most recent call last):
...
connectors.mlflow_webhook.WebhookRejected: stale delivery: sent 301 s ago (limit 300 s)
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from typing import Mapping, Optional

from core import transport
from core.errors import StreamtuneError

EVENTS = ("model_version_alias.created", "model_version_alias.deleted")
MAX_AGE_S = 300  # a replayed delivery older than this is refused
SIGNATURE, TIMESTAMP, DELIVERY_ID = "X-MLflow-Signature", "X-MLflow-Timestamp", "X-MLflow-Delivery-Id"
NAME_PREFIX = "streamtune-serve-"  # + a hash of the server's webhook URL


def webhook_name(url: str) -> str:
    """A server's webhook name, from its URL (MLflow allows letters, digits, `._-`, < 63).

    >>> webhook_name("http://serve:8100/v1/hooks/mlflow")
    'streamtune-serve-5f4cc768b64d0f0f'
    """
    return NAME_PREFIX + hashlib.sha256(url.encode()).hexdigest()[:16]


def _refuses(url: str) -> bool:
    """Nothing listens at the URL's address any more (a timeout is not taken as proof)."""
    import requests

    try:
        requests.get(url, timeout=2)
    except requests.ConnectionError:
        return True
    except requests.RequestException:
        pass
    return False


class WebhookRejected(StreamtuneError):
    exit_code = 2


def signature(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    """MLflow's `v1` signature of a delivery."""
    signed = f"{delivery_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(secret.encode(), signed, hashlib.sha256).digest()).decode()


def signed_headers(secret: str, delivery_id: str, sent_at: int, body: bytes) -> dict[str, str]:
    """The headers MLflow sends with a delivery (for tests and tools that replay one)."""
    return {DELIVERY_ID: delivery_id, TIMESTAMP: str(sent_at),
            SIGNATURE: signature(secret, delivery_id, str(sent_at), body)}


def verify(secret: str, headers: Mapping[str, str], body: bytes, now: float) -> dict:
    """The delivery's payload, if MLflow signed it with `secret` less than MAX_AGE_S ago."""
    lower = {k.lower(): v for k, v in headers.items()}
    delivery_id, sent_at, given = (lower.get(h.lower()) for h in (DELIVERY_ID, TIMESTAMP, SIGNATURE))
    if not (delivery_id and sent_at and given):
        raise WebhookRejected(f"unsigned delivery: {SIGNATURE}, {TIMESTAMP} and {DELIVERY_ID} are required")
    if not hmac.compare_digest(given, signature(secret, delivery_id, sent_at, body)):
        raise WebhookRejected("bad signature")
    try:
        age = now - int(sent_at)
    except ValueError:
        raise WebhookRejected(f"bad {TIMESTAMP}: {sent_at!r}") from None
    if abs(age) > MAX_AGE_S:
        raise WebhookRejected(f"stale delivery: sent {age:.0f} s ago (limit {MAX_AGE_S} s)")
    try:
        return json.loads(body)
    except ValueError as e:
        raise WebhookRejected(f"body is not JSON: {e}") from None


def alias_event(payload: dict) -> Optional[str]:
    """The registered model whose alias moved, or None for any other event (MLflow's test ping)."""
    if payload.get("entity") != "model_version_alias":
        return None
    name = (payload.get("data") or {}).get("name")
    return name if isinstance(name, str) and name else None


def register(tracking_uri: str, url: str, secret: str) -> str:
    """(Re)create this URL's webhook for alias events; its id. Webhooks left by killed servers
    (never unregistered) go first: this URL's, and any other server's whose address refuses
    connections (that server is gone)."""
    from mlflow import MlflowClient

    transport.apply_mlflow_env()
    client, name = MlflowClient(tracking_uri, tracking_uri), webhook_name(url)
    token = None
    while True:
        page = client.list_webhooks(max_results=100, page_token=token)
        for old in page:
            if old.name == name or (old.name.startswith(NAME_PREFIX) and _refuses(old.url)):
                client.delete_webhook(old.webhook_id)
        token = page.token
        if not token:
            break
    return client.create_webhook(name=name, url=url, events=list(EVENTS), secret=secret,
                                 description="streamtune serve: alias moves, pushed").webhook_id


def unregister(tracking_uri: str, webhook_id: str) -> None:
    from mlflow import MlflowClient

    MlflowClient(tracking_uri, tracking_uri).delete_webhook(webhook_id)
