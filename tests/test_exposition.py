"""trainpatrol.exposition writes what prometheus_client's generate_latest writes, and promtool
finds nothing wrong with it."""

from __future__ import annotations

import pytest

from exposition_check import assert_as_generate_latest, assert_clean, promtool_problems
from markers import needs_promtool
from trainpatrol.exposition import escape_label, family, go_float, go_floats, header, line

HOSTILE = {"newline": "a\nb", "backslash": "a\\b", "quote": 'a"b', "all": 'x\\"\n\\n"\\'}


@pytest.mark.parametrize(("value", "written"), [
    (0.0, "0.0"), (-0.0, "-0.0"), (1.0, "1.0"), (0.25, "0.25"), (999_999.9, "999999.9"), (1e6, "1e+06"),
    (1_234_567.0, "1.234567e+06"), (1.5e16, "1.5e+16"), (9_999_999_999_999_998.0, "9.999999999999998e+15"),
    (1e21, "1e+21"), (1e-7, "1e-07"), (-2.5e-7, "-2.5e-07"), (-1e9, "-1000000000.0"), (1.5e300, "1.5e+300"),
    (float("nan"), "NaN"), (float("inf"), "+Inf"), (float("-inf"), "-Inf"),
    (10**20, "1e+20"), (123_456_789_012, "1.23456789012e+11"), (7, "7.0"), (-(10**20), "-1e+20"),
])
def test_go_float_writes_values_as_go_does(value: float, written: str) -> None:
    assert go_float(value) == written
    assert go_floats([float(value)]) == [written]


@pytest.mark.parametrize("value", [0.0, -0.0, 1e6, 1.5e16, 1e-7, 10**20, float("nan"), float("inf"), float("-inf")])
def test_a_sample_line_of_any_value_is_what_generate_latest_writes(value: float) -> None:
    body = header("trainpatrol_x", "gauge", "x") + line("trainpatrol_x", {"gpu": "0"}, value)
    assert_as_generate_latest(body.encode())


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_special_characters_in_label_values_are_escaped_as_generate_latest_does(name: str) -> None:
    body = family("trainpatrol_guard_trips_total", "counter", "trips", [({"guard": HOSTILE[name], "b": "1"}, 2.0)])
    assert_as_generate_latest(body.encode())


def test_each_special_character_is_escaped() -> None:
    assert [escape_label(HOSTILE[k]) for k in ("newline", "backslash", "quote", "all")] == [
        "a\\nb", "a\\\\b", 'a\\"b', 'x\\\\\\"\\n\\\\n\\"\\\\']


def test_help_with_a_backslash_and_a_newline_is_escaped() -> None:
    text = header("trainpatrol_x", "gauge", 'one \\ two\nthree "quoted"')
    assert text == '# HELP trainpatrol_x one \\\\ two\\nthree "quoted"\n# TYPE trainpatrol_x gauge\n'
    assert_as_generate_latest(text.encode())


def test_families_of_each_kind_are_named_as_generate_latest_names_them() -> None:
    body = (family("trainpatrol_step_total", "counter", "steps", [({"rank": "0"}, 3.0)])
            + family("process_cpu_seconds", "counter", "cpu", [({}, 1.5)])
            + family("trainpatrol_agent_info", "info", "who", [({"host": "h"}, 0.0)])
            + family("trainpatrol_gpu", "info", "gpu", [({"uuid": "u"}, 7.0)])
            + family("trainpatrol_loss", "gauge", "loss", []))
    assert body == (
        "# HELP trainpatrol_step_total steps\n# TYPE trainpatrol_step_total counter\n"
        'trainpatrol_step_total{rank="0"} 3.0\n'
        "# HELP process_cpu_seconds_total cpu\n# TYPE process_cpu_seconds_total counter\n"
        "process_cpu_seconds_total 1.5\n"
        "# HELP trainpatrol_agent_info who\n# TYPE trainpatrol_agent_info gauge\n"
        'trainpatrol_agent_info{host="h"} 1.0\n'
        "# HELP trainpatrol_gpu_info gpu\n# TYPE trainpatrol_gpu_info gauge\n"
        'trainpatrol_gpu_info{uuid="u"} 1.0\n'
        "# HELP trainpatrol_loss loss\n# TYPE trainpatrol_loss gauge\n")
    assert_as_generate_latest(body.encode())


def test_label_names_are_written_sorted() -> None:
    assert line("m", {"run": "r", "le": "+Inf", "rank": "0"}, 1.0) == 'm{le="+Inf",rank="0",run="r"} 1.0\n'


@needs_promtool
def test_hostile_values_and_help_pass_promtool() -> None:
    body = (family("trainpatrol_guard_trips_total", "counter", "trips \\ and\nmore",
                   [({"guard": v}, x) for v, x in zip(HOSTILE.values(), (1e6, 1.5e16, 1e-7, -0.0), strict=True)])
            + family("trainpatrol_loss", "gauge", "loss", [({"rank": str(i)}, v) for i, v in
                                                         enumerate((float("nan"), float("inf"), float("-inf")))]))
    assert_clean(body.encode())


@needs_promtool
def test_a_writer_that_leaves_a_newline_unescaped_fails_both_checks() -> None:
    broken = b'# HELP trainpatrol_x x\n# TYPE trainpatrol_x gauge\ntrainpatrol_x{guard="a\nb"} 1.0\n'
    with pytest.raises(Exception):  # noqa: B017  # prometheus_client's parser or the comparison
        assert_as_generate_latest(broken)
    assert promtool_problems(broken) != ""
