"""time_ratio / time_ratios with a fake clock: the arithmetic is checked exactly, no real time."""

import statistics

import numpy
import pytest
import torch

from revckpt import InvalidArgumentError, time_ratio, time_ratios
from revckpt.measure.timing import wall_time


class FakeClock:
    """A clock that only moves when a timed function advances it."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def timed(self, name: str, seconds: list[float], calls: list[str]):
        """A callable that logs ``name`` and advances the clock by the next of ``seconds``."""
        script = iter(seconds)

        def run() -> None:
            calls.append(name)
            self.now += next(script)

        return run


def test_wall_time_reads_the_clock_around_the_call():
    clock, calls = FakeClock(), []
    assert wall_time(clock.timed("f", [0.25], calls), clock=clock) == 0.25
    assert calls == ["f"]


def test_time_ratio_median_iqr_warmup_and_alternating_order():
    clock, calls = FakeClock(), []
    # one warmup call each (huge, must be ignored), then five timed rounds
    cand = clock.timed("c", [50.0, 2.0, 3.0, 8.0, 4.0, 6.0], calls)
    base = clock.timed("b", [50.0, 1.0, 1.0, 2.0, 2.0, 2.0], calls)
    r = time_ratio(cand, base, repeats=5, warmup=1, clock=clock)
    # per-round ratios 2, 3, 4, 2, 3 -> sorted 2, 2, 3, 3, 4
    assert r.ratio == 3.0 and (r.q25, r.q75) == (2.0, 3.0) and r.spread == 1.0
    assert r.candidate_seconds == 4.0 and r.baseline_seconds == 2.0 and r.repeats == 5
    assert calls == ["c", "b", "c", "b", "b", "c", "c", "b", "b", "c", "c", "b"]
    assert str(r) == "3.000x (IQR 2.000-3.000, n=5)"


def test_time_ratio_of_one_round_has_no_spread():
    clock, calls = FakeClock(), []
    r = time_ratio(
        clock.timed("c", [3.0], calls),
        clock.timed("b", [2.0], calls),
        repeats=1,
        warmup=0,
        clock=clock,
    )
    assert (r.ratio, r.q25, r.q75) == (1.5, 1.5, 1.5)


def test_time_ratios_share_baseline_rounds_and_rotate_order():
    clock, calls = FakeClock(), []
    base = [9.0, 1.0, 2.0, 1.0, 4.0]  # warmup, then rounds 0..3
    fns = {
        "one": clock.timed("one", base, calls),
        "two": clock.timed("two", [9.0, 2.0, 6.0, 2.0, 4.0], calls),
        "three": clock.timed("three", [9.0, 3.0, 2.0, 5.0, 12.0], calls),
    }
    r = time_ratios(fns, baseline="one", repeats=4, warmup=1, clock=clock)
    assert list(r) == ["one", "two", "three"]
    assert r["one"].ratio == 1.0 and r["one"].spread == 0.0
    # each divided by the baseline of the same round: two 2, 3, 2, 1; three 3, 1, 5, 3
    two = [2.0, 3.0, 2.0, 1.0]
    three = [3.0, 1.0, 5.0, 3.0]
    q_two = statistics.quantiles(two, n=4, method="inclusive")
    q_three = statistics.quantiles(three, n=4, method="inclusive")
    assert (r["two"].ratio, r["two"].q25, r["two"].q75) == (2.0, q_two[0], q_two[2])
    assert (r["three"].ratio, r["three"].q25, r["three"].q75) == (3.0, q_three[0], q_three[2])
    assert r["two"].baseline_seconds == r["three"].baseline_seconds == 1.5
    rounds = [calls[i : i + 3] for i in range(0, len(calls), 3)]
    assert rounds == [
        ["one", "two", "three"],  # warmup, in the order of fns
        ["one", "two", "three"],
        ["two", "three", "one"],
        ["three", "one", "two"],
        ["one", "two", "three"],
    ]


def test_bad_arguments():
    with pytest.raises(InvalidArgumentError, match="repeats >= 1"):
        time_ratio(lambda: None, lambda: None, repeats=0)
    with pytest.raises(InvalidArgumentError, match="warmup >= 0"):
        time_ratios({"a": lambda: None}, baseline="a", warmup=-1)
    for bad in ({"repeats": 2.5}, {"warmup": 1.0}, {"repeats": "3"}, {"repeats": True}):
        with pytest.raises(InvalidArgumentError, match="whole numbers"):  # raw TypeErrors before
            time_ratio(lambda: None, lambda: None, **bad)
    clock, calls = FakeClock(), []
    for whole in (numpy.int64(3), torch.tensor(3)):  # anything with __index__ is a whole number
        one = clock.timed("a", [1.0] * 5, calls)
        other = clock.timed("b", [2.0] * 5, calls)
        assert time_ratio(one, other, repeats=whole, warmup=0, clock=clock).ratio == 0.5


def test_a_baseline_that_takes_no_time_is_refused():
    clock = FakeClock()
    with pytest.raises(InvalidArgumentError, match="baseline took 0 s"):
        time_ratio(lambda: None, lambda: None, repeats=3, clock=clock)


def test_time_ratios_unknown_baseline():
    with pytest.raises(InvalidArgumentError, match="baseline 'plain' is not one of"):
        time_ratios({"a": lambda: None}, baseline="plain")
