"""The wire format: what a push may hold, and the message that names what it may not."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from trainpatrol.protocol import RankSnapshot, valid_run

LOSS = {"name": "trainpatrol_loss", "value": 1.5}


def push(**fields: Any) -> dict[str, Any]:
    return {"run": "r1", "rank": 0, "world_size": 2, **fields}


def refusal(model: type[RankSnapshot], data: dict[str, Any]) -> str:
    """The first error's message, for the push as it comes: JSON."""
    with pytest.raises(ValidationError) as caught:
        model.model_validate_json(json.dumps(data))
    return str(caught.value.errors()[0]["msg"])


def test_a_run_name_is_matched_whole_so_a_trailing_newline_is_no_run() -> None:
    assert valid_run("gpt2-124m_v1.2:a") and not valid_run("r1\n") and not valid_run("-r1") and not valid_run("")


def test_a_sample_must_be_a_catalogue_metric_with_exactly_its_own_labels() -> None:
    assert refusal(RankSnapshot, push(samples=[{"name": "trainpatrol_nope", "value": 1.0}])) == (
        "Value error, samples.0: Unknown rank metric 'trainpatrol_nope': not in the catalogue.")
    assert refusal(RankSnapshot, push(samples=[LOSS, {"name": "trainpatrol_loss", "labels": {"x": "1"},
                                                      "value": 1.0}])) == (
        "Value error, samples.1: Metric 'trainpatrol_loss' has labels ['x']; expected [].")
    guard = {"name": "trainpatrol_guard_trips_total", "value": 0.0}
    assert refusal(RankSnapshot, push(samples=[guard])) == (
        "Value error, samples.0: Metric 'trainpatrol_guard_trips_total' has labels []; expected ['guard'].")


def test_a_label_value_that_does_not_print_as_it_reads_is_refused() -> None:
    for value in ("a\nb", "\x1b[31m", "\u202eevil"):
        sample = {"name": "trainpatrol_guard_trips_total", "labels": {"guard": value}, "value": 0.0}
        assert "is not printable UTF-8" in refusal(RankSnapshot, push(samples=[sample]))
    sample = {"name": "trainpatrol_guard_trips_total", "labels": {"guard": 'a\\b"c'}, "value": 0.0}
    assert RankSnapshot.model_validate_json(json.dumps(push(samples=[sample]))).samples[0].labels == {"guard": 'a\\b"c'}


def test_a_rank_lies_inside_its_world() -> None:
    assert refusal(RankSnapshot, push(rank=2)) == "Value error, rank 2 is outside world_size 2."


def test_the_step_histogram_is_cumulative_with_a_count_per_bound() -> None:
    counts = [0.0] * 15 + [5.0]  # 15 bounds, then +Inf
    whole = RankSnapshot.model_validate_json(json.dumps(push(histogram={"counts": counts, "sum": 1.0})))
    assert whole.histogram is not None and whole.histogram.counts == counts
    assert "cumulative" in refusal(RankSnapshot, push(histogram={"counts": [*counts[:-1], 4.0, 3.0][1:],
                                                                 "sum": 1.0}))
    assert refusal(RankSnapshot, push(histogram={"counts": [1.0, 2.0], "sum": 1.0})).endswith(
        "cumulative counts, got 2.")
