"""Fast or accurate: confidence-threshold path switching under a request's latency budget.

Every request takes the fast path first: the routed version's answer as asked (greedy by
default). When the request carries a latency budget (header `X-Streamtune-SLO-Ms`, or
`"streamtune": {"slo_ms": N}` in the body) and the answer's confidence (its mean token
log-probability) is below the model's threshold (`--confidence-threshold MODEL=VALUE`, `*`
for every model), the server takes the accurate path if the budget still allows it:

- the accurate path is best-of-k on the same version: k sampled answers (temperature 0.7,
  seeds 1..k, decoded together in one batch) beside the fast one, and the answer with the
  highest mean log-probability is returned. One version answers; the response names it.
- the budget allows it when the time spent so far plus the accurate path's expected cost
  (the fast answer's latency × the model's measured accurate/fast ratio, 2 until measured)
  fits in it.

Each decision (path, reason, confidence, threshold, budget, expected cost) is counted in
`streamtune_serve_path_decisions` and carried in the response's audit trace. Streamed
requests, several prompts and n > 1 take the fast path only.

>>> thresholds = parse_thresholds(["*=-1.5", "bot=-0.5"])
>>> threshold_for(thresholds, "bot"), threshold_for(thresholds, "other")
(-0.5, -1.5)
>>> Decision.make(confidence=-2.0, threshold=-1.5, budget_ms=1000, spent_ms=100, expected_ms=300).path
'accurate'
>>> Decision.make(confidence=-2.0, threshold=-1.5, budget_ms=300, spent_ms=100, expected_ms=300).reason
'no budget'
>>> Decision.make(confidence=-1.0, threshold=-1.5, budget_ms=1000, spent_ms=100, expected_ms=300).reason
'confident'
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Optional

from core.errors import ConfigError

SLO_HEADER = "x-streamtune-slo-ms"
BEST_OF = 4                 # sampled answers beside the fast one
ACCURATE_TEMPERATURE = 0.7
INITIAL_COST_RATIO = 2.0    # accurate ÷ fast latency until measured
COST_SMOOTHING = 0.2        # weight of the newest measure in the moving average


def parse_thresholds(items: Iterable[str]) -> dict[str, float]:
    """`MODEL=VALUE` items (`*` for every model) → {model: mean log-probability threshold}."""
    out = {}
    for item in items:
        model, sep, value = item.partition("=")
        try:
            out[model.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not model.strip():
            raise ConfigError(f"--confidence-threshold {item!r}: expected MODEL=VALUE (a mean log-probability, "
                              "e.g. '*=-1.0')")
    return out


def threshold_for(thresholds: dict[str, float], model_id: str) -> Optional[float]:
    return thresholds.get(model_id, thresholds.get("*"))


@dataclass(frozen=True)
class Decision:
    path: str                    # "fast" or "accurate"
    reason: str                  # "no slo", "no threshold", "confident", "no budget", "below threshold"
    confidence: float            # the fast answer's mean log-probability
    threshold: Optional[float]
    budget_ms: Optional[float]
    spent_ms: float
    expected_ms: Optional[float]  # the accurate path's expected cost

    @classmethod
    def make(cls, confidence: float, threshold: Optional[float], budget_ms: Optional[float], spent_ms: float,
             expected_ms: float) -> "Decision":
        if budget_ms is None:
            path, reason = "fast", "no slo"
        elif threshold is None:
            path, reason = "fast", "no threshold"
        elif confidence >= threshold:
            path, reason = "fast", "confident"
        elif spent_ms + expected_ms > budget_ms:
            path, reason = "fast", "no budget"
        else:
            path, reason = "accurate", "below threshold"
        return cls(path, reason, round(confidence, 6), threshold, budget_ms, round(spent_ms, 3),
                   round(expected_ms, 3))

    def trace(self) -> dict:
        return {"stage": "decision", **asdict(self)}


class CostModel:
    """The accurate path's cost as a multiple of the fast one's, per model (moving average)."""

    def __init__(self) -> None:
        self.ratios: dict[str, float] = {}

    def expected_ms(self, model_id: str, fast_ms: float) -> float:
        return fast_ms * self.ratios.get(model_id, INITIAL_COST_RATIO)

    def observe(self, model_id: str, fast_ms: float, accurate_ms: float) -> None:
        if fast_ms <= 0:
            return
        ratio = accurate_ms / fast_ms
        old = self.ratios.get(model_id)
        self.ratios[model_id] = ratio if old is None else (1 - COST_SMOOTHING) * old + COST_SMOOTHING * ratio


def slo_ms(header: Optional[str], body_extra: Optional[dict]) -> Optional[float]:
    """The request's latency budget in ms: the header, else `streamtune.slo_ms`; None without one.

    >>> slo_ms("250", None), slo_ms(None, {"streamtune": {"slo_ms": 80}}), slo_ms(None, {})
    (250.0, 80.0, None)
    """
    raw = header if header is not None else ((body_extra or {}).get("streamtune") or {}).get("slo_ms")
    if raw is None:
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"latency budget {raw!r}: expected milliseconds") from None
    if not value > 0:
        raise ConfigError(f"latency budget {raw!r}: must be > 0 ms")
    return value
