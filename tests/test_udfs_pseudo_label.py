"""pseudo_label (udfs/pseudo_label.py), in Python."""

from __future__ import annotations

import pytest

from udfs.pseudo_label import label_for

pytestmark = pytest.mark.sql


@pytest.mark.parametrize("score, expected", [
    (1.0, "accepted"), (0.8, "accepted"), (0.79, "corrected"), (0.5, "corrected"), (0.49, "rejected"), (0.0, "rejected"),
])
def test_bands(score, expected):
    assert label_for(score, 0.8, 0.5) == expected


def test_labels_are_the_feedback_sample_labels():
    from typing import get_args

    from core.messages import FeedbackSample

    labels = {label_for(score, 0.8, 0.5) for score in (0.1, 0.6, 0.9)}
    [literal, _none] = get_args(FeedbackSample.model_fields["label"].annotation)
    assert labels == set(get_args(literal))
    for label in labels:
        FeedbackSample(model_id="m", sample_id="s", prompt="p", completion="c", ts=0, label=label)


def test_equal_thresholds_leave_no_corrected_band():
    assert [label_for(s, 0.5, 0.5) for s in (0.4, 0.5, 0.6)] == ["rejected", "accepted", "accepted"]


@pytest.mark.parametrize("args", [(None, 0.8, 0.5), (0.5, None, 0.5), (0.5, 0.8, None), (float("nan"), 0.8, 0.5),
                                  (0.5, 0.4, 0.6)])
def test_invalid_inputs_are_null(args):
    assert label_for(*args) is None
