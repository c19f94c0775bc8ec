import pytest
import torch

from revckpt import InvalidArgumentError, time_ratio


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
