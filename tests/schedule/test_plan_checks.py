"""A malformed plan (constructor, from_dict, JSON) raises a RevckptError naming what is wrong,
instead of running blocks twice or not at all."""

import dataclasses
import json

import pytest
import torch

from revckpt import InvalidArgumentError, InvalidInputTypeError, RevckptError
from revckpt.models import mlp_chain
from revckpt.schedule import Plan, Segment, apply, baseline, profile


@pytest.fixture(scope="module")
def good():
    chain = mlp_chain(4, 8, 16)
    prof = profile(chain, torch.randn(2, 8), repeats=1, codecs=(), policies=())
    return chain, baseline(prof, "per-block")


def _with_segments(plan, segments):
    return {**plan.to_dict(), "segments": segments}


SEGMENTS = {
    "gap": ([[0, 1, "checkpoint"], [2, 4, "checkpoint"]], r"\[2, 4, 'checkpoint'\] leaves a gap"),
    "overlap": ([[0, 2, "checkpoint"], [1, 4, "store"]], r"\[1, 4, 'store'\] overlaps"),
    "unknown strategy": ([[0, 4, "checkpointt"]], r"'checkpointt'\]: unknown strategy; use"),
    "unknown codec": ([[0, 4, "approx:fp4"]], r"'approx:fp4'\]: unknown strategy"),
    "unknown policy": ([[0, 1, "selective:all"], [1, 4, "store"]], r"unknown strategy"),
    "multi-block selective": (
        [[0, 2, "selective:matmul"], [2, 4, "store"]],
        r"\[0, 2, 'selective:matmul'\]: a selective segment covers one block",
    ),
    "out of order": ([[2, 4, "store"], [0, 2, "store"]], r"\[0, 2, 'store'\] comes after"),
    "negative range": (
        [[0, 2, "store"], [2, 1, "store"], [1, 4, "store"]],
        r"\[2, 1, 'store'\] is an empty or negative range",
    ),
    "empty range": ([[0, 0, "store"], [0, 4, "store"]], r"\[0, 0, 'store'\] is an empty"),
    "not from block 0": ([[1, 4, "store"]], r"does not start at block 0"),
    "no segments": ([], r"at least one segment"),
}


@pytest.mark.parametrize("kind", SEGMENTS)
def test_malformed_segments_raise_from_dict_and_json(good, kind):
    _, plan = good
    segments, message = SEGMENTS[kind]
    with pytest.raises(InvalidArgumentError, match=message):
        Plan.from_dict(_with_segments(plan, segments))
    with pytest.raises(InvalidArgumentError, match=message):
        Plan.from_json(json.dumps(_with_segments(plan, segments)))


def test_malformed_segments_raise_in_the_constructor(good):
    _, plan = good
    with pytest.raises(InvalidArgumentError, match="overlaps"):
        Plan(
            (Segment(0, 3, "checkpoint"), Segment(2, 4, "store")),
            *(plan.predicted_peak_bytes, 0.0, 0.0, None, 0.0, plan.store_all_peak_bytes, 1.0),
        )
    with pytest.raises(InvalidInputTypeError, match=r"not a revckpt\.schedule\.Segment"):
        Plan(((0, 4, "store"),), 0, 0.0, 0.0, None, 0.0, 1, 1.0)


@pytest.mark.parametrize(
    ("segments", "message"),
    [
        ([[0, "4", "store"]], r"start and stop are ints"),
        ([[0, 4]], r"segment 0 in plan JSON is \[0, 4\]"),
        ([[0, 4, 7]], r"strategy a string"),
        ("0-4 store", r"segments in plan JSON must be a list"),
    ],
    ids=["str bound", "two items", "int strategy", "not a list"],
)
def test_segments_of_the_wrong_type(good, segments, message):
    _, plan = good
    with pytest.raises(InvalidInputTypeError, match=message):
        Plan.from_dict(_with_segments(plan, segments))


def test_bad_json_syntax():
    with pytest.raises(InvalidArgumentError, match=r"not valid JSON \(.* line 1, column \d+\)"):
        Plan.from_json('{"format": ')


def test_missing_and_unknown_keys(good):
    _, plan = good
    d = plan.to_dict()
    del d["predicted_peak_bytes"]
    with pytest.raises(InvalidArgumentError, match=r"missing keys \['predicted_peak_bytes'\]"):
        Plan.from_dict(d)
    with pytest.raises(InvalidArgumentError, match=r"unknown keys \['peak'\]"):
        Plan.from_dict({**plan.to_dict(), "peak": 1})


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        ("predicted_peak_bytes", "big", InvalidInputTypeError),
        ("predicted_peak_bytes", -1, InvalidArgumentError),
        ("store_all_peak_bytes", 0, InvalidArgumentError),
        ("error_budget", None, InvalidInputTypeError),
        ("block_names", ["a"], InvalidArgumentError),
        ("block_names", "abcd", InvalidInputTypeError),
        ("input_signature", [4, "float32", "cpu"], InvalidInputTypeError),
        ("name", 3, InvalidInputTypeError),
    ],
)
def test_fields_of_the_wrong_type_or_range(good, key, value, error):
    _, plan = good
    with pytest.raises(error, match=key):
        Plan.from_dict({**plan.to_dict(), key: value})


def test_json_that_is_no_plan(tmp_path):
    with pytest.raises(InvalidInputTypeError, match="a plan is a JSON object"):
        Plan.from_json("[1, 2]")
    with pytest.raises(InvalidArgumentError, match="cannot read a plan from"):
        Plan.from_json(tmp_path / "missing.json")


def test_apply_refuses_a_plan_of_another_length(good):
    chain, plan = good
    for n in (3, 5):
        with pytest.raises(InvalidArgumentError, match=f"covers 4 blocks but the chain has {n}"):
            apply(mlp_chain(n, 8, 16), plan)
    assert isinstance(apply(chain, plan), torch.nn.Module)


def test_every_error_is_a_revckpt_error(good):
    _, plan = good
    for text in ("{", "[]", json.dumps({**plan.to_dict(), "segments": [[0, 4, None]]})):
        with pytest.raises(RevckptError):
            Plan.from_json(text)


@pytest.mark.parametrize(
    ("dtypes", "error", "message"),
    [
        (["float32"] * 3, InvalidArgumentError, "block_dtypes has 3 entries but the segments"),
        (["float32", "float99", "float32", "float32"], InvalidArgumentError, "'float99'"),
        (["float32", "Tensor", "float32", "float32"], InvalidArgumentError, "not torch dtypes"),
        ([32] * 4, InvalidInputTypeError, "block_dtypes must be a list of strings"),
        ("float32", InvalidInputTypeError, "block_dtypes in plan JSON must be a list"),
    ],
)
def test_malformed_block_dtypes_raise(good, dtypes, error, message):
    _, plan = good
    with pytest.raises(error, match=message):
        Plan.from_json(json.dumps({**plan.to_dict(), "block_dtypes": dtypes}))
    fine = Plan.from_json(json.dumps({**plan.to_dict(), "block_dtypes": ["bfloat16"] * 4}))
    assert fine.block_dtypes == ("bfloat16",) * 4
    spelt = dataclasses.replace(plan, block_dtypes=["torch.float32"] * 4)  # a list, torch's name
    assert spelt.block_dtypes == ("torch.float32",) * 4


def test_block_shapes_of_another_length_raise(good):
    # a hand-edited plan passed validation and raised a raw IndexError when fit applied it
    _, plan = good
    with pytest.raises(InvalidArgumentError, match="block_shapes has 1 shapes but the segments"):
        Plan.from_json(json.dumps({**plan.to_dict(), "block_shapes": [[2, 8]]}))
    fine = Plan.from_json(json.dumps({**plan.to_dict(), "block_shapes": [[2, 8]] * 4}))
    assert fine.block_shapes == ((2, 8),) * 4
