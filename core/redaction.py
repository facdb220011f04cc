"""Personal data at the edge: replace e-mail addresses, phone numbers and card numbers in text.

The training job's validation step (operators/validate.py) redacts the prompt and completion
of every sample before it reaches a window, and the whole payload of every dead letter before
it reaches the DLQ, so what users paste into feedback never lands in a training batch, a
version record, the DLQ or MLflow. Each replacement is counted (the Flink counter
`redactions` and one `redactions_<rule>` per rule).

Rules (`BUILTIN_RULES`): `email`; `phone` (an optional +country code and 9-15 digits in groups
split by spaces, dots, dashes or parentheses, so `x=1234;y=2345` or a date is not one); `card`
(13-19 digits, optionally in groups, passing the Luhn check). When Presidio
(`presidio-analyzer`) is installed, the rule set `pii+presidio` adds its recognisers.

The job's setting is the environment variable STREAMTUNE_REDACT, read when the job is built:
`pii` (default: on is the safe side) or `off` (for tests and demos of what leaks without it).

>>> redact("mail jane.doe@example.com or call +44 20 7946 0958, card 4111 1111 1111 1111")
('mail [email] or call [phone], card [card]', {'email': 1, 'card': 1, 'phone': 1})
>>> redact("x=1234;y=2345 on 2024-01-15, order 4111 1111 1111 1112")
('x=1234;y=2345 on 2024-01-15, order 4111 1111 1111 1112', {})
>>> luhn_valid("4111111111111111"), luhn_valid("4111111111111112")
(True, False)
>>> redaction_mode({}), redaction_mode({"STREAMTUNE_REDACT": "off"})
('pii', 'off')
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Callable, Mapping, Optional

from core.errors import ConfigError

# A match starts only where a local part can start (the lookbehind) and the local part is at
# most 64 characters (RFC 5321): without both, a long run of letters with no `@` (a 64 KiB
# oversized record) is scanned from each of its positions, seconds per record.
EMAIL = re.compile(r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")
# Digit groups with separators; how many digits decides (a callback), not the pattern alone.
PHONE = re.compile(r"(?<![\w+])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{1,4}\)[\s.-]?)?\d{2,5}(?:[\s.-]\d{2,5}){1,5}(?![\w:/])")
CARD = re.compile(r"(?<!\d)\d(?:[ -]?\d){12,18}(?!\d)")
MODES = ("pii", "pii+presidio", "off")


def luhn_valid(digits: str) -> bool:
    """The card-number checksum (ISO/IEC 7812)."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _card(match: re.Match) -> Optional[str]:
    digits = re.sub(r"\D", "", match.group())
    return "[card]" if 13 <= len(digits) <= 19 and luhn_valid(digits) else None


def _phone(match: re.Match) -> Optional[str]:
    text = match.group()
    digits = re.sub(r"\D", "", text)
    return "[phone]" if 9 <= len(digits) <= 15 else None


def _email(match: re.Match) -> Optional[str]:
    return "[email]"


# Order matters: cards before phones (a card in groups of four also looks like a phone number).
BUILTIN_RULES: tuple[tuple[str, re.Pattern, Callable[[re.Match], Optional[str]]], ...] = (
    ("email", EMAIL, _email), ("card", CARD, _card), ("phone", PHONE, _phone))


def redact(text: str, mode: str = "pii") -> tuple[str, dict[str, int]]:
    """`text` with personal data replaced by `[rule]`, and how many of each rule were replaced."""
    counts: Counter[str] = Counter()
    if mode == "off" or not text:
        return text, {}
    for name, pattern, replacement in BUILTIN_RULES:
        def sub(match: re.Match, name=name, replacement=replacement) -> str:
            new = replacement(match)
            if new is None:
                return match.group()
            counts[name] += 1
            return new
        text = pattern.sub(sub, text)
    if mode == "pii+presidio":
        text = _presidio(text, counts)
    return text, dict(counts)


_analyzer = None


def _presidio(text: str, counts: Counter) -> str:
    global _analyzer
    try:
        from presidio_analyzer import AnalyzerEngine  # optional: only where installed
    except ImportError:
        return text
    if _analyzer is None:
        _analyzer = AnalyzerEngine()
    for result in sorted(_analyzer.analyze(text=text, language="en"), key=lambda r: r.start, reverse=True):
        label = result.entity_type.lower()
        text = f"{text[:result.start]}[{label}]{text[result.end:]}"
        counts[f"presidio_{label}"] += 1
    return text


# Credentials in a record that is refused for carrying them (a spec with `user:PASSWORD@` in its
# source URI, produced straight to a config topic) must not be copied into a dead letter:
# unlike personal data, these are scrubbed whatever STREAMTUNE_REDACT says.
# Like EMAIL above: a scheme starts only where one can start (the lookbehind) and every part is
# bounded, so a long run of letters (a 64 KiB oversized record) is scanned once, not from each
# of its positions.
URI_PASSWORD = re.compile(
    r"((?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]{0,31}://[^\s:/@\"'\\]{0,256}:)[^\s@/\"'\\]{1,256}@")
SECRET_QUERY_VALUE = re.compile(
    r"([?&](?!password_env=|password_file=)[A-Za-z0-9_.-]{0,64}(?:password|secret|token)[A-Za-z0-9_.-]{0,64}=)"
    r"[^&\s\"'#]+", re.IGNORECASE)


def scrub_credentials(text: str) -> tuple[str, int]:
    """`text` with URI passwords and secret-named URI options replaced by ***, and how many.

    >>> scrub_credentials('{"stream_source": "postgres://u:hunter2@db/app?table=t&sslpassword=x&password_env=PG"}')
    ('{"stream_source": "postgres://u:***@db/app?table=t&sslpassword=***&password_env=PG"}', 2)
    >>> scrub_credentials("mongodb://db:27017/app?collection=c")
    ('mongodb://db:27017/app?collection=c', 0)
    >>> scrub_credentials("x" * 1_000_000 + "?" + "y" * 1_000_000)[1]  # linear: quadratic would hang
    0
    """
    if not text:
        return text, 0
    text, uri = URI_PASSWORD.subn(r"\1***@", text)
    text, query = SECRET_QUERY_VALUE.subn(r"\1***", text)
    return text, uri + query


def redaction_mode(environ: Mapping[str, str]) -> str:
    """The job's redaction setting from STREAMTUNE_REDACT (default `pii`)."""
    mode = (environ.get("STREAMTUNE_REDACT") or "pii").strip().lower()
    if mode not in MODES:
        raise ConfigError(f"STREAMTUNE_REDACT={mode}: expected one of {', '.join(MODES)}")
    return mode


def redact_payload(text: str, mode: str = "pii") -> tuple[str, dict[str, int]]:
    """A record's payload redacted: the string values of a JSON document, else the whole text.
    Numbers are left alone (an epoch-ms timestamp passes the card rule one time in ten), and a
    payload with nothing to redact comes back byte for byte.

    >>> redact_payload('{"ts": 1773000000008, "prompt": "mail a@b.io"}')
    ('{"ts": 1773000000008, "prompt": "mail [email]"}', {'email': 1})
    >>> redact_payload('{"ts": 1773000000008}')
    ('{"ts": 1773000000008}', {})
    >>> redact_payload("not json, a@b.io")
    ('not json, [email]', {'email': 1})
    """
    if mode == "off" or not text:
        return text, {}
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser: the whole text
        return redact(text, mode)
    counts: Counter[str] = Counter()

    def walk(value):
        if isinstance(value, str):
            new, found = redact(value, mode)
            counts.update(found)
            return new
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        return value

    redacted = walk(document)
    return (json.dumps(redacted) if counts else text), dict(counts)


def redact_at_edge(text: Optional[str], environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """For writers outside the job (the API's own dead letters): `text` with its credentials
    scrubbed, and redacted as this process's STREAMTUNE_REDACT says.

    >>> redact_at_edge('{"prompt": "I am a@b.io"}', {}), redact_at_edge("a@b.io", {"STREAMTUNE_REDACT": "off"})
    ('{"prompt": "I am [email]"}', 'a@b.io')
    """
    import os

    if not text:
        return text
    return redact_payload(scrub_credentials(text)[0], redaction_mode(os.environ if environ is None else environ))[0]
