"""`pseudo_label(score, accept_at, reject_below)`: a feedback label for an unlabelled sample.

Labels follow the feedback sample's `label` (core.messages.FeedbackSample):

| score                          | label       | meaning for training                        |
|--------------------------------|-------------|---------------------------------------------|
| score >= accept_at             | `accepted`  | keep the completion as a target             |
| reject_below <= score < accept_at | `corrected` | uncertain: needs a correction before use  |
| score < reject_below           | `rejected`  | weight 0 (not trained on)                   |

`score` is any confidence in [0, 1], e.g. `confidence(logprob, tokens)`. NULL when an
argument is NULL or NaN, or when reject_below > accept_at.

    SELECT sample_id, pseudo_label(confidence(logprob, n), 0.8, 0.5) AS label FROM scored;

>>> label_for(0.9, 0.8, 0.5), label_for(0.6, 0.8, 0.5), label_for(0.1, 0.8, 0.5)
('accepted', 'corrected', 'rejected')
"""

from __future__ import annotations

import math

from pyflink.table import DataTypes
from pyflink.table.udf import udf


def label_for(score: float | None, accept_at: float | None, reject_below: float | None) -> str | None:
    values = (score, accept_at, reject_below)
    if any(v is None or math.isnan(v) for v in values) or reject_below > accept_at:
        return None
    if score >= accept_at:
        return "accepted"
    if score < reject_below:
        return "rejected"
    return "corrected"


pseudo_label = udf(label_for, input_types=[DataTypes.DOUBLE(), DataTypes.DOUBLE(), DataTypes.DOUBLE()],
                   result_type=DataTypes.STRING(), name="pseudo_label")
