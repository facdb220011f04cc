"""`confidence(logprob, tokens)`: how sure a model was of a completion, in [0, 1].

`logprob` is the completion's total log-probability (natural log, the sum over its tokens,
as inference servers report it) and `tokens` how many tokens it has; the result is the
geometric-mean per-token probability ``exp(logprob / tokens)``. With `tokens` NULL,
`logprob` is taken as already per token (``exp(logprob)``).

NULL when `logprob` is NULL or NaN, `tokens` < 1, or `logprob` > 0 beyond rounding
(1e-9): a log-probability cannot be positive.

    SELECT pseudo_label(confidence(logprob, token_count(completion, 'm')), 0.8, 0.5) ...

>>> round(confidence_of(-2.0, 4), 4)   # exp(-0.5)
0.6065
>>> confidence_of(-0.0, None)
1.0
>>> confidence_of(3.0, 2) is None
True
"""

from __future__ import annotations

import math

from pyflink.table import DataTypes
from pyflink.table.udf import udf

ROUNDING = 1e-9


def confidence_of(logprob: float | None, tokens: int | None = None) -> float | None:
    if logprob is None or math.isnan(logprob) or logprob > ROUNDING:
        return None
    if tokens is None:
        tokens = 1
    if tokens < 1:
        return None
    return min(1.0, math.exp(min(0.0, logprob) / tokens))


confidence = udf(confidence_of, input_types=[DataTypes.DOUBLE(), DataTypes.INT()],
                 result_type=DataTypes.DOUBLE(), name="confidence")
