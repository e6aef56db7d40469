"""fleet._queries.split_counter: the split of a counter's growth among a GPU's label sets, done on the rows of
counter_parts' queries (the tiles' raw edges). Its agreement with counter_expr on a real server is in
test_fleet_tiles (tiles and raw path equal); here, each of its cases on rows made by hand."""

from __future__ import annotations

import pytest

from gpuscope.fleet._queries import split_counter

GPU = {"hostname": "n1", "gpu": "0"}


def _row(v: float, **labels: str) -> dict:
    return {"metric": {**GPU, **labels}, "value": [0, str(v)]}


def _split(own: dict[str, float], known: dict[str, float], single: dict[str, float], short: float | None,
           bridged: float | None, name: str = "energy") -> dict[str, float]:
    parts = {"own": [_row(v, pod=p) for p, v in own.items()],
             "known": [_row(known.get(p, 0), pod=p) for p in own],
             "single": [_row(single.get(p, 0), pod=p) for p in own],
             "short": [] if short is None else [_row(short)],
             "bridged": [] if bridged is None else [_row(bridged)]}
    return {lab.get("pod", ""): v for lab, v in split_counter(name, parts)}


def test_one_label_set_with_a_single_sample_takes_the_step_before_it() -> None:
    # a ran on (50 exactly); b began with one sample (own 0): the GPU's 60 less 50 is b's step
    assert _split({"a": 50, "b": 0}, {}, {"b": 1}, 60, 60) == pytest.approx({"a": 50, "b": 10})


def test_a_known_rate_is_kept_and_single_samples_share_what_is_left() -> None:
    # c began with samples at 5 per step; d and e began with one each: 60 - 30 own - 5 = 25, 12.5 each
    got = _split({"a": 30, "c": 0, "d": 0, "e": 0}, {"c": 5}, {"d": 1, "e": 1}, 60, 60)
    assert got == pytest.approx({"a": 30, "c": 5, "d": 12.5, "e": 12.5})


def test_a_rest_larger_than_the_known_rates_goes_to_them_whole() -> None:
    # one began with samples (its mean rate 2 a step, a bursty counter's) and none with a single one: the rest,
    # 60 - 50 = 10, is its step before its first sample whatever its mean rate says
    assert _split({"a": 50, "c": 0}, {"c": 2}, {}, 60, 60) == pytest.approx({"a": 50, "c": 10})
    got = _split({"a": 48, "c": 0, "d": 0}, {"c": 2, "d": 1}, {}, 60, 60)
    assert got == pytest.approx({"a": 48, "c": 8, "d": 4})


def test_a_rest_smaller_than_the_known_rates_is_split_among_them() -> None:
    got = _split({"a": 52, "c": 0, "d": 0}, {"c": 6, "d": 2}, {}, 60, 60)
    assert got == pytest.approx({"a": 52, "c": 6, "d": 2})
    got = _split({"a": 56, "c": 0, "d": 0}, {"c": 6, "d": 2}, {}, 60, 60)
    assert got == pytest.approx({"a": 56, "c": 3, "d": 1})


def test_own_growth_beyond_the_gpus_is_split_in_proportion() -> None:
    # a label set that left and came back spans the others' growth: 90 + 30 of own for 60 of the GPU's
    assert _split({"a": 90, "b": 30}, {}, {}, 60, 60) == pytest.approx({"a": 45, "b": 15})


def test_across_a_gap_the_bridged_growth_is_split_by_own() -> None:
    # no sample a tile before (a gap): no rest to give out; the growth across the gap, 200, in proportion
    assert _split({"a": 30, "b": 10}, {"b": 2}, {}, None, 200) == pytest.approx({"a": 150, "b": 50})


def test_a_gpu_without_a_sample_before_has_no_growth() -> None:
    assert _split({"a": 30}, {}, {}, None, None) == {}


def test_rows_that_are_not_numbers_are_left_out() -> None:
    parts = {"own": [_row(10, pod="a"), {"metric": {**GPU, "pod": "b"}, "value": [0, "NaN"]},
                     {"metric": GPU, "value": "x"}],
             "known": [], "single": [], "short": [_row(10)], "bridged": [_row(10)]}
    assert {lab["pod"]: v for lab, v in split_counter("energy", parts)} == pytest.approx({"a": 10})


def test_throttling_is_split_per_reason() -> None:
    parts = {"own": [_row(5, pod="a", reason="hw"), _row(0, pod="b", reason="hw"), _row(7, pod="a", reason="sw")],
             "known": [], "single": [_row(1, pod="b", reason="hw")],
             "short": [_row(8, reason="hw"), _row(7, reason="sw")], "bridged": [_row(8, reason="hw"), _row(7, reason="sw")]}
    got = {(lab["pod"], lab["reason"]): v for lab, v in split_counter("throttle", parts)}
    assert got == pytest.approx({("a", "hw"): 5, ("b", "hw"): 3, ("a", "sw"): 7})
