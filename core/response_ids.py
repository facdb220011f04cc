"""Signed response ids: feedback may judge only responses a server really gave.

Every inference server of a deployment shares one signing key (a Kubernetes Secret, a file,
or the environment variable STREAMTUNE_RESPONSE_SIGNING_KEY). A response id is
`cmpl-<nonce>.<tag>`, where the tag is an HMAC-SHA256 over the nonce, truncated to 128 bits.
Whoever cites an id in feedback must have received it from a server: an id made up by a
client, or an id from another deployment, does not verify and its feedback is dead-lettered
(reason `unsigned_response`).

>>> key = b"k" * 32
>>> rid = sign_response_id(key, "cmpl-0123456789abcdef0123456789abcdef")
>>> verify_response_id(key, rid)
True
>>> verify_response_id(key, rid[:-1] + ("0" if rid[-1] != "0" else "1"))
False
>>> verify_response_id(key, "cmpl-0123456789abcdef0123456789abcdef")
False
>>> verify_response_id(b"x" * 32, rid)
False
>>> verify_response_id(key, new_response_id(key)), new_response_id(None).count(".")
(True, 0)
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import uuid
from pathlib import Path
from typing import Mapping, Optional

from .errors import ConfigError

SIGNING_KEY_ENV = "STREAMTUNE_RESPONSE_SIGNING_KEY"
SIGNING_KEY_FILE_ENV = "STREAMTUNE_RESPONSE_SIGNING_KEY_FILE"
MIN_KEY_BYTES = 16
_TAG_HEX = 32  # 128 bits: forging one is 2**128 work, and ids stay short in logs
_SIGNED = re.compile(r"(?P<nonce>[A-Za-z0-9_-]{1,128})\.(?P<tag>[0-9a-f]{%d})" % _TAG_HEX)


def _tag(key: bytes, nonce: str) -> str:
    return hmac.new(key, nonce.encode(), hashlib.sha256).hexdigest()[:_TAG_HEX]


def sign_response_id(key: bytes, nonce: str) -> str:
    """The id a server hands out for the response it names `nonce`."""
    return f"{nonce}.{_tag(key, nonce)}"


def verify_response_id(key: bytes, response_id: str) -> bool:
    """True when `response_id` was signed with `key` (constant-time comparison)."""
    m = _SIGNED.fullmatch(response_id or "")
    return bool(m) and hmac.compare_digest(m["tag"], _tag(key, m["nonce"]))


def new_response_id(key: Optional[bytes]) -> str:
    """A fresh response id (`cmpl-<uuid hex>`), signed when the deployment has a key."""
    nonce = f"cmpl-{uuid.uuid4().hex}"
    return sign_response_id(key, nonce) if key else nonce


def signing_key(env: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """The deployment's signing key: the file named by STREAMTUNE_RESPONSE_SIGNING_KEY_FILE,
    else STREAMTUNE_RESPONSE_SIGNING_KEY; None when neither is set. A key shorter than 16
    bytes is refused."""
    env = os.environ if env is None else env
    path = env.get(SIGNING_KEY_FILE_ENV)
    if path:
        try:
            key = Path(path).read_bytes().strip()
        except OSError as e:
            raise ConfigError(f"{SIGNING_KEY_FILE_ENV}={path}: {e.strerror}") from None
        source = SIGNING_KEY_FILE_ENV
    else:
        key = (env.get(SIGNING_KEY_ENV) or "").encode()
        source = SIGNING_KEY_ENV
    if not key:
        return None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"{source}: the response signing key needs at least {MIN_KEY_BYTES} bytes")
    return key
