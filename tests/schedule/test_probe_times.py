"""What the probe's timed steps say for groups and strategies no stretch reached
(revckpt.schedule.probe_times): priced from the groups that were, exactly by the rules."""

import pytest

from revckpt.schedule.costs import Segment
from revckpt.schedule.probe_times import chained_extras, filled, overheads

OPTIONS = ["store", "checkpoint", "reversible"]


def test_a_strategy_no_stretch_reached_on_a_group_is_priced_from_its_checkpoint_time():
    """Group 0 ran checkpoint but not reversible: reversible there is checkpoint's time times
    reversible's ratio to checkpoint on the groups that ran both (not its forward's)."""
    extra = {
        (0, "checkpoint"): 3.0,
        (1, "checkpoint"): 2.0,
        (1, "reversible"): 3.0,
        (2, "checkpoint"): 2.0,
        (2, "reversible"): 4.0,
    }
    fwd = {0: 3.0, 1: 1.0, 2: 1.0}
    assert filled(extra, fwd, 0, "reversible") == pytest.approx(3.0 * 1.75)
    got = overheads([0, 1, 2], [OPTIONS] * 3, extra, fwd)
    assert got[0] == pytest.approx({"checkpoint": 3.0, "reversible": 5.25})
    assert got[1] == {"checkpoint": 2.0, "reversible": 3.0}  # measured: as measured


def test_without_checkpoint_on_the_group_the_forward_ratio_prices_it():
    extra = {(1, "checkpoint"): 2.0, (1, "reversible"): 3.0}
    fwd = {0: 4.0, 1: 1.0}
    assert filled(extra, fwd, 0, "reversible") == pytest.approx(12.0)
    assert filled(extra, fwd, 0, "checkpoint") == pytest.approx(8.0)
    assert filled(extra, fwd, 0, "approx:bf16") is None  # measured nowhere


def test_inside_a_longer_segment_only_its_own_strategys_spans_count_and_fill_by_the_head():
    """A stack of blocks 1-3 (group 1) took 8 s over storing, its head (a stack of one) 4 s:
    each further block adds 2; group 0, which no stack reached, gets the same ratio to its
    own stack of one (its forward's is another); a checkpoint span says nothing of stacks."""
    overhead = [{"checkpoint": 2.0, "reversible": 6.0}] + [
        {"checkpoint": 1.0, "reversible": 4.0}
    ] * 3
    fwd = {0: 10.0, 1: 1.0}
    spans = [(Segment(1, 4, "reversible"), 8.0), (Segment(0, 2, "checkpoint"), 100.0)]
    got = chained_extras(spans, [0, 1, 1, 1], overhead, fwd, "reversible")
    assert got == pytest.approx([3.0, 2.0, 2.0, 2.0])
    none = chained_extras(spans[:1], [0, 1, 1, 1], [{}, *overhead[1:]], fwd, "reversible")
    assert none[0] is None  # group 0 cannot run it


def test_a_checkpoint_extra_of_zero_prices_nothing_from_it():
    """A median clamped at 0 on the group would price every unreached strategy free."""
    extra = {(0, "checkpoint"): 0.0, (1, "checkpoint"): 2.0, (1, "reversible"): 3.0}
    fwd = {0: 2.0, 1: 1.0}
    assert filled(extra, fwd, 0, "reversible") == pytest.approx(6.0)  # the forward ratio


def test_groups_are_found_by_their_first_block_whatever_their_labels():
    overhead = [{"reversible": 6.0}, {"reversible": 6.0}] + [{"reversible": 4.0}] * 3
    spans = [(Segment(2, 5, "reversible"), 8.0)]
    fwd = {"a": 10.0, "b": 1.0}
    got = chained_extras(spans, ["a", "a", "b", "b", "b"], overhead, fwd, "reversible")
    assert got == pytest.approx([3.0, 3.0, 2.0, 2.0, 2.0])
