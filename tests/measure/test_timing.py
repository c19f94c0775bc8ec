import pytest
import torch

from revckpt import InvalidArgumentError, time_ratio, time_ratios


def test_double_work_measures_near_two():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a = torch.randn(256, 256)

    def once():
        for _ in range(4):
            a @ a

    def twice():
        for _ in range(8):
            a @ a

    r = time_ratio(twice, once, repeats=9, warmup=1)
    assert 1.3 < r.ratio < 3.0
    assert r.q25 <= r.ratio <= r.q75 and r.spread >= 0 and r.repeats == 9
    assert "x (IQR" in str(r)
    torch.set_num_threads(threads)


def test_bad_arguments():
    with pytest.raises(InvalidArgumentError, match="repeats >= 1"):
        time_ratio(lambda: None, lambda: None, repeats=0)


def test_time_ratios_share_baseline_rounds_and_rotate_order():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    calls: list[str] = []

    def work(n: int, name: str):
        def run():
            calls.append(name)
            for _ in range(n):
                a @ a

        return run

    fns = {"one": work(4, "one"), "two": work(8, "two"), "three": work(12, "three")}
    r = time_ratios(fns, baseline="one", repeats=7, warmup=1)
    torch.set_num_threads(threads)
    assert list(r) == ["one", "two", "three"]
    assert r["one"].ratio == 1.0 and r["one"].spread == 0
    assert 1.3 < r["two"].ratio < 3.0 and 2.0 < r["three"].ratio < 4.5
    assert r["two"].ratio < r["three"].ratio
    rounds = [calls[i : i + 3] for i in range(3, len(calls), 3)]  # after the warmup round
    assert [c[0] for c in rounds[:3]] == ["one", "two", "three"]  # rotated start
    assert all(sorted(c) == ["one", "three", "two"] for c in rounds)


def test_time_ratios_unknown_baseline():
    with pytest.raises(InvalidArgumentError, match="baseline 'plain' is not one of"):
        time_ratios({"a": lambda: None}, baseline="plain")
