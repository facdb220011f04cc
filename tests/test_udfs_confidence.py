"""confidence (udfs/confidence.py), in Python."""

from __future__ import annotations

import math

import pytest

from udfs.confidence import confidence_of

pytestmark = pytest.mark.sql


def test_geometric_mean_token_probability():
    probs = [0.9, 0.5, 0.8]
    logprob = sum(math.log(p) for p in probs)
    assert confidence_of(logprob, len(probs)) == pytest.approx((0.9 * 0.5 * 0.8) ** (1 / 3))


def test_per_token_logprob_when_tokens_is_null():
    assert confidence_of(math.log(0.25), None) == pytest.approx(0.25)
    assert confidence_of(math.log(0.25)) == pytest.approx(0.25)


def test_bounds():
    assert confidence_of(0.0, 5) == 1.0
    assert confidence_of(1e-12, 5) == 1.0            # rounding above 0 is clamped
    assert confidence_of(-1e6, 1) == 0.0
    assert 0.0 <= confidence_of(-3.0, 2) <= 1.0


@pytest.mark.parametrize("logprob, tokens", [(None, 3), (float("nan"), 3), (0.5, 3), (-1.0, 0), (-1.0, -2)])
def test_invalid_inputs_are_null(logprob, tokens):
    assert confidence_of(logprob, tokens) is None
