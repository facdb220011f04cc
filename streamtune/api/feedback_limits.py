"""What POST /v1/feedback lets through: feedback that cannot steer production.

Whoever holds a feedback token (it is embedded in public pages) may post events, so every
event is checked at the edge before it becomes a sample:

| check             | setting (ApiSettings / environment)                                | outcome                        |
|-------------------|---------------------------------------------------------------------|--------------------------------|
| signed response   | response_signing_key ($STREAMTUNE_RESPONSE_SIGNING_KEY[_FILE])       | dead letter `unsigned_response` |
| event time        | feedback_max_skew_ms (300000), feedback_max_age_ms (7 days)         | dead letter `timestamp`        |
| rate per token    | feedback_rate (events/s, 50), feedback_burst (1000)                 | 429 with Retry-After           |
| weight cap        | feedback_max_weight (1.0)                                           | weight clamped to the cap      |

- An event citing a `request_id` that does not verify with the deployment's key (made up,
  from another deployment, unsigned) was never served by this deployment: judging it would let a
  stranger move the guard's statistics, so it is dead-lettered to the model's job DLQ
  topic with reason `unsigned_response`. Events that cite no response are plain samples.
  Without a key nothing is verified (development mode: servers then issue unsigned ids).
- `ts` further in the future than the skew, or older than the retention, is dead-lettered
  with reason `timestamp`, never produced: a far-future record timestamp would move the
  job's watermark.
- A token bucket per bearer token (its SHA-256, never the token) counts events, not
  requests: a request whose events exceed what the bucket holds is answered 429 and
  nothing of it is produced; Retry-After says when it would fit.
- Weights are clamped, not refused: a dwell of 30 s is a real signal, it just may not count
  more than `max_weight` samples (a click or correction weighs 1).

0 turns a check off (for tests and demos only): `rate=0` no rate limit, `max_weight=0`
no cap, `max_skew_ms=0` / `max_age_ms=0` no time bound; no signing key, no verification.

>>> limits = FeedbackLimits(max_skew_ms=1000, max_age_ms=5000)
>>> limits.timestamp_problem(10_500, now_ms=10_000) is None, limits.timestamp_problem(20_000, now_ms=10_000)
(True, 'ts 20000 is 10000 ms in the future (the limit is 1000 ms)')
>>> limits.response_problem("cmpl-forged") is None  # no key: nothing verified
True
>>> FeedbackLimits(signing_key=b"k" * 16).response_problem("cmpl-forged")
'request_id does not verify: no server of this deployment issued it'
>>> bucket = TokenBucket(rate=2, burst=4, clock=lambda: 0.0)
>>> bucket.take(3), bucket.take(2), bucket.take(1)
(0.0, 0.5, 0.0)
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from core.response_ids import verify_response_id

DAY_MS = 86_400_000


class TokenBucket:
    """`rate` tokens a second up to `burst`; `take(n)` answers 0.0 and takes them, or the
    seconds until `n` would be there and takes nothing (inf when n > burst)."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.level, self.at = float(burst), clock()

    def take(self, n: float) -> float:
        now = self.clock()
        self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now
        if n <= self.level:
            self.level -= n
            return 0.0
        return math.inf if n > self.burst else (n - self.level) / self.rate


@dataclass
class FeedbackLimits:
    """The checks of POST /v1/feedback (module docstring); one per control plane."""

    signing_key: Optional[bytes] = None
    rate: float = 50.0
    burst: float = 1000.0
    max_weight: float = 1.0
    max_skew_ms: int = 300_000
    max_age_ms: int = 7 * DAY_MS
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, TokenBucket] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def admit(self, credentials: str, events: int) -> float:
        """0.0 when the caller's bucket holds `events` (taken), else the seconds to wait."""
        if self.rate <= 0:
            return 0.0
        caller = hashlib.sha256(credentials.encode()).hexdigest()
        with self._lock:
            bucket = self._buckets.get(caller)
            if bucket is None:
                bucket = self._buckets[caller] = TokenBucket(self.rate, self.burst, self.clock)
            return bucket.take(events)

    def response_problem(self, request_id: Optional[str]) -> Optional[str]:
        """Why a cited response id is not one of this deployment's; None when it is (or no key)."""
        if request_id is None or self.signing_key is None or verify_response_id(self.signing_key, request_id):
            return None
        return "request_id does not verify: no server of this deployment issued it"

    def timestamp_problem(self, ts: int, now_ms: Optional[int] = None) -> Optional[str]:
        """Why `ts` (epoch ms) is outside the skew or the retention; None when it is inside."""
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        if self.max_skew_ms > 0 and ts > now_ms + self.max_skew_ms:
            return f"ts {ts} is {ts - now_ms} ms in the future (the limit is {self.max_skew_ms} ms)"
        if self.max_age_ms > 0 and ts < now_ms - self.max_age_ms:
            return f"ts {ts} is {now_ms - ts} ms old (the retention is {self.max_age_ms} ms)"
        return None

    def cap(self, weight: float) -> float:
        """`weight` clamped to the cap (unchanged when the cap is off)."""
        return min(weight, self.max_weight) if self.max_weight > 0 else weight
