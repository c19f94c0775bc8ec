"""Off the happy path, every recompute strategy is as safe as plain autograd (issue 13).

Each test runs the same chain of blocks with every strategy that recomputes: checkpoint (per
block and a multi-block segment), selective recompute, approx (exact and bf16), offload
(copies forced), a reversible stack and a scheduled plan that mixes them. Where plain autograd
raises, the strategy raises a RevckptError naming the cause; where plain autograd is right, the
strategy gives the gradients of its own run without the disturbance, bitwise (and, for the
exact strategies, plain autograd's).
"""

from __future__ import annotations

import copy
import sys
import threading

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

import revckpt
from revckpt import (
    DoubleBackwardError,
    InvalidArgumentError,
    ModifiedParameterError,
    ReplayError,
    RevckptError,
    checkpoint_sequential,
)
from revckpt import offload as rv_offload
from revckpt.approx import Approx
from revckpt.layers import ReversibleBlock, ReversibleSequential
from revckpt.schedule import Plan, Segment, apply

D = 8
ROWS = 6

STRATEGIES = (
    "checkpoint",
    "checkpoint-segment",
    "selective",
    "approx-exact",
    "approx-bf16",
    "offload",
    "reversible",
    "scheduled",
)
# strategies whose backward recomputes without a graph of the gradient
ONCE_DIFFERENTIABLE = ("approx-exact", "approx-bf16", "offload", "reversible", "scheduled")
# strategies with nothing approximate: gradients equal plain autograd's
EXACT = ("checkpoint", "checkpoint-segment", "selective", "approx-exact", "offload", "reversible")


def _plan(n: int) -> Plan:
    kinds = ("checkpoint", "selective:matmul", "offload", "approx:bf16")
    segments = tuple(Segment(i, i + 1, kinds[i % len(kinds)]) for i in range(n))
    return Plan(segments, 0, 0.0, 0.0, None, 0.0, 1, 1.0, name="mixed")


class Model(nn.Module):
    """Four width-``D`` blocks run with ``strategy`` (``"plain"``: plain autograd). The
    reversible strategy pairs them as the branches of two reversible blocks (input ``2 * D``)."""

    def __init__(self, blocks: list[nn.Module], strategy: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.strategy = strategy
        if strategy in ("reversible", "reversible-plain"):
            pairs = [ReversibleBlock(blocks[i], blocks[i + 1]) for i in range(0, len(blocks), 2)]
            self.stack = ReversibleSequential(*pairs)
        if strategy == "scheduled":
            self.scheduled = apply(self.blocks, _plan(len(blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, blocks = self.strategy, self.blocks
        if s == "plain":
            for b in blocks:
                x = b(x)
            return x
        if s == "reversible":
            return self.stack(x)
        if s == "reversible-plain":
            x1, x2 = x.chunk(2, dim=-1)
            for block in self.stack.blocks:
                x1, x2 = block(x1, x2)
            return torch.cat([x1, x2], dim=-1)
        if s == "scheduled":
            with rv_offload.force_copies():
                return self.scheduled(x)
        if s == "offload":
            with rv_offload.force_copies():
                return revckpt.checkpoint_sequential(blocks, len(blocks), x, strategy="offload")
        options = {
            "checkpoint": {"segments": len(blocks)},
            "checkpoint-segment": {"segments": 2},
            "selective": {"segments": len(blocks), "policy": "matmul"},
            "approx-exact": {"segments": 2, "approx": Approx(store=None)},
            "approx-bf16": {"segments": len(blocks), "approx": Approx(store="bf16")},
        }[s]
        segments = options.pop("segments")
        return checkpoint_sequential(blocks, segments, x, **options)


def _reference(strategy: str) -> str:
    return "reversible-plain" if strategy == "reversible" else "plain"


def _width(strategy: str) -> int:
    return 2 * D if strategy.startswith("reversible") else D


def _linear_blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(4)]


def _build(strategy: str, blocks: list[nn.Module]) -> Model:
    return Model(copy.deepcopy(blocks), strategy).double()


def _input(strategy: str, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, _width(strategy), generator=g, dtype=torch.float64)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _step(model: Model, x: torch.Tensor, between=None, seed: int = 3) -> list[torch.Tensor]:
    """Forward, ``between(model)``, backward; the parameter gradients."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    y = model(x)
    if between is not None:
        between(model)
    (y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).sum().backward()
    return _grads(model)


def _assert_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x - y).abs().max().item()


def _assert_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


# --- 1. weights changed in place between forward and backward --------------------------------


def _scale_a_weight(model: nn.Module) -> None:
    with torch.no_grad():
        model.blocks[1][0].weight.mul_(3.0)


def _optimizer_step(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # e.g. gradients of an earlier micro-batch
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    model.zero_grad(set_to_none=True)


def _load_other_weights(model: nn.Module) -> None:
    other = {k: v * 2 for k, v in model.state_dict().items()}
    model.load_state_dict(other)


@pytest.mark.parametrize("change", [_scale_a_weight, _optimizer_step, _load_other_weights])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_weights_changed_before_backward_raise(strategy, change):
    blocks = _linear_blocks()
    plain, model = _build(_reference(strategy), blocks), _build(strategy, blocks)
    x = _input(strategy)
    _step(model, x)  # a first step: what the forward writes is known (nothing here)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _step(plain, x, between=change)  # plain autograd refuses: so must every strategy
    with pytest.raises(ModifiedParameterError, match=r"between the forward and its backward"):
        _step(model, x, between=change)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_parameter_replaced_before_backward_gets_plain_autograds_gradient(strategy):
    """Rebinding a parameter (or torch.func.functional_call during the forward) leaves the
    forward's tensor in the graph: plain autograd differentiates that one, and so does the
    recompute (it swaps the forward's tensor back in)."""
    blocks = _linear_blocks()
    x = _input(strategy)
    grads = []
    for kind in (_reference(strategy), strategy):
        model = _build(kind, blocks)
        old = model.blocks[2][0].weight

        def replace(m, old=old):
            m.blocks[2][0].weight = nn.Parameter(old.detach() * 2)

        _step(model, x, between=replace)
        assert model.blocks[2][0].weight.grad is None  # the new tensor took no part
        grads.append(old.grad)
    if strategy in EXACT:
        _assert_close([grads[1]], [grads[0]])
    else:
        torch.testing.assert_close(grads[1], grads[0], rtol=0.05, atol=0.05)


# --- 2. train() / eval() switched between forward and backward -------------------------------


def _norm_dropout_blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Dropout(0.3), nn.Tanh())
        for _ in range(4)
    ]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_eval_between_forward_and_backward_keeps_the_forward_mode(strategy):
    blocks = _norm_dropout_blocks()
    x = _input(strategy)
    undisturbed = _build(strategy, blocks)
    switched = _build(strategy, blocks)
    expected = _step(undisturbed, x)
    got = _step(switched, x, between=lambda m: m.eval())
    _assert_equal(got, expected)
    assert not any(m.training for m in switched.modules())  # the caller's mode is kept
    for a, b in zip(undisturbed.buffers(), switched.buffers(), strict=True):
        assert torch.equal(a, b)  # running statistics updated once, as by one forward
    if strategy in EXACT:
        plain = _build(_reference(strategy), blocks)
        _assert_close(got, _step(plain, x))


def _norm_blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Tanh()) for _ in range(4)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_eval_pass_then_a_train_pass_in_one_step(strategy):
    """The train pass updates the running statistics the eval pass read, without moving their
    version counters: the eval pass's recompute must still use the statistics it read. (Plain
    autograd gets this wrong: its eval-mode BatchNorm backward reads the updated statistics. The
    reference is each pass on its own copy of the model.)"""
    blocks = _norm_blocks()
    x1, x2 = _input(strategy, seed=1), _input(strategy, seed=2)
    model = _build(strategy, blocks)
    model.eval()
    a = model(x1)
    model.train()
    (a.square().sum() + model(x2).square().sum()).backward()
    expected = []
    for x, train in ((x1, False), (x2, True)):
        alone = _build(strategy, blocks).train(train)
        alone(x).square().sum().backward()
        expected.append(_grads(alone))
    for got, e1, e2 in zip(_grads(model), *expected, strict=True):
        torch.testing.assert_close(got, e1 + e2, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("strategy", ["checkpoint", "approx-exact", "reversible"])
def test_other_module_flags_are_those_of_the_forward(strategy):
    blocks = _norm_dropout_blocks()
    x = _input(strategy)
    expected = _step(_build(strategy, blocks), x)

    def change_p(m):
        for d in m.modules():
            if isinstance(d, nn.Dropout):
                d.p = 0.9

    _assert_equal(_step(_build(strategy, blocks), x, between=change_p), expected)


# --- 3. double backward -------------------------------------------------------------------


def _gradient_penalty(model: Model, x: torch.Tensor, other_path: bool) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = model(x).pow(2).sum()
    if other_path:
        y = y + x.pow(3).sum()
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    g.pow(2).sum().backward()
    return _grads(model)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_forward_mode_ad_is_exact_or_refused(strategy):
    """Dual tensors (torch.autograd.forward_ad) through nodes without a forward-mode rule:
    torch's raw NotImplementedError ('implement the jvp function'); now InvalidArgumentError
    naming the strategies that run it, which give plain autograd's tangent."""
    import torch.autograd.forward_ad as fwAD

    blocks = _linear_blocks()
    x = _input(strategy)
    tangent = torch.randn_like(x)
    model, plain = _build(strategy, blocks), _build(_reference(strategy), blocks)

    def jvp(m: nn.Module) -> torch.Tensor:
        with fwAD.dual_level():
            return fwAD.unpack_dual(m(fwAD.make_dual(x, tangent))).tangent

    if strategy in ONCE_DIFFERENTIABLE:
        with pytest.raises(InvalidArgumentError, match="forward-mode"):
            jvp(model)
        return
    torch.testing.assert_close(jvp(model), jvp(plain), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("other_path", [True, False], ids=["other-path", "only-path"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_double_backward_is_exact_or_refused(strategy, other_path):
    blocks = _linear_blocks()
    x = _input(strategy)
    model = _build(strategy, blocks)
    if strategy in ONCE_DIFFERENTIABLE:
        with pytest.raises(DoubleBackwardError, match=r"revckpt\.checkpoint.*supports"):
            _gradient_penalty(model, x, other_path)
        return
    if strategy == "selective":
        with pytest.raises(DoubleBackwardError, match=r"convert\(model, .checkpoint.\)"):
            _gradient_penalty(model, x, other_path)
        return
    plain = _build(_reference(strategy), blocks)
    _assert_close(_gradient_penalty(model, x, other_path), _gradient_penalty(plain, x, other_path))


# --- 4. threads drawing random numbers meanwhile --------------------------------------------


class _LoggedDropout(nn.Module):
    """Dropout that logs the masks it draws, in the forward and in the recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.log: dict[str, list[bytes]] = {"forward": [], "recompute": []}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.rand_like(x) < 0.5
        self.log["recompute" if revckpt.replay.is_replaying() else "forward"].append(
            mask.numpy().tobytes()
        )
        return x * mask * 2


def _dropout_model(strategy: str) -> Model:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(D, D), _LoggedDropout(), nn.Tanh()) for _ in range(4)]
    return Model(blocks, strategy).double()


def _train_and_compare_masks(model: Model, steps: int, outcome: list[str]) -> None:
    g = torch.Generator().manual_seed(0)  # not the global generator the dropout draws from
    x = torch.randn(256, _width(model.strategy), dtype=torch.float64, generator=g)
    logs = [m for m in model.modules() if isinstance(m, _LoggedDropout)]
    for _ in range(steps):
        for m in logs:
            m.log = {"forward": [], "recompute": []}
        try:
            model(x).sum().backward()
        except ReplayError:
            outcome.append("refused")
            continue
        same = all(sorted(m.log["forward"]) == sorted(m.log["recompute"]) for m in logs)
        outcome.append("same masks" if same else "other masks")


def _race(target_a, target_b) -> None:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=target_a), threading.Thread(target=target_b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_models_in_two_threads_replay_their_own_masks(strategy):
    if strategy == "selective":
        pytest.skip("the 'matmul' policy recomputes dropout: covered by 'checkpoint'")
    a, b = _dropout_model(strategy), _dropout_model(strategy)
    seen_a: list[str] = []
    seen_b: list[str] = []
    _race(
        lambda: _train_and_compare_masks(a, 12, seen_a),
        lambda: _train_and_compare_masks(b, 12, seen_b),
    )
    assert seen_a == seen_b == ["same masks"] * 12


@pytest.mark.parametrize("strategy", ["checkpoint", "approx-exact", "offload", "reversible"])
def test_random_draws_outside_revckpt_in_another_thread_are_caught(strategy):
    model = _dropout_model(strategy)
    seen: list[str] = []
    stop = threading.Event()

    def draw_elsewhere() -> None:
        while not stop.is_set():
            torch.rand(64)

    def train() -> None:
        try:
            _train_and_compare_masks(model, 12, seen)
        finally:
            stop.set()

    _race(train, draw_elsewhere)
    assert "other masks" not in seen  # each step replays its masks or refuses
    assert len(seen) == 12


# --- 8. modules whose forward updates their own state -----------------------------------------


class _Counter(nn.Module):
    """Scales by a step counter kept in a buffer and advanced by every training forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps += 1
        return x * (1 + 0.1 * self.steps)


def _stateful_blocks(kind: str) -> list[nn.Module]:
    torch.manual_seed(0)
    if kind == "spectral_norm":
        make = lambda: nn.Sequential(torch.nn.utils.spectral_norm(nn.Linear(D, D)), nn.Tanh())  # noqa: E731
    elif kind == "parametrized":
        make = lambda: nn.Sequential(parametrizations.spectral_norm(nn.Linear(D, D)), nn.Tanh())  # noqa: E731
    else:
        make = lambda: nn.Sequential(nn.Linear(D, D), _Counter(), nn.Tanh())  # noqa: E731
    return [make() for _ in range(4)]


@pytest.mark.parametrize("kind", ["spectral_norm", "parametrized", "counter"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_buffers_the_forward_writes_are_replayed_from_before_it(strategy, kind):
    blocks = _stateful_blocks(kind)
    x = _input(strategy)
    plain, model = _build(_reference(strategy), blocks), _build(strategy, blocks)
    for _ in range(2):  # the first call learns what the forward writes; both must be exact
        expected, got = _step(plain, x), _step(model, x)
        if strategy in EXACT:
            _assert_close(got, expected)
        else:
            for a, b in zip(got, expected, strict=True):
                torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)
        for a, b in zip(plain.buffers(), model.buffers(), strict=True):
            assert torch.equal(a, b)  # advanced once per step, as by plain autograd


def test_errors_are_revckpt_errors():
    for error in (ModifiedParameterError, ReplayError, DoubleBackwardError):
        assert issubclass(error, RevckptError) and issubclass(error, RuntimeError)


class _FailsOnce(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.fail = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            self.fail = False
            raise ValueError("a block that fails")
        return torch.dropout(self.lin(x), 0.5, True)


@pytest.mark.parametrize("strategy", ["checkpoint", "approx-exact", "offload", "reversible"])
def test_a_forward_that_raises_leaves_no_lock_held(strategy):
    torch.manual_seed(0)
    model = Model([_FailsOnce() for _ in range(4)], strategy).double()
    x = _input(strategy)
    with pytest.raises(ValueError, match="a block that fails"):
        model(x)
    done = threading.Event()

    def other_thread() -> None:
        for b in model.blocks:
            b.fail = False
        model(x).sum().backward()
        done.set()

    t = threading.Thread(target=other_thread, daemon=True)
    t.start()
    t.join(timeout=60)
    assert done.is_set(), "another thread could not run a forward: a lock was left held"


def _in_threads(calls: list) -> list[torch.Tensor]:
    """Run each call in a daemon thread of its own (a hang cannot block the test process)."""
    results: list = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(r is not None for r in results), "a worker thread did not finish"
    return results


class _Experts(nn.Module):
    """A block whose forward runs sub-blocks in threads of its own (branch or expert
    parallelism); ``checkpointed``: the block and its sub-blocks are checkpointed, so the
    sub-blocks' forwards start in other threads while the outer block's forward runs."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(D, D) for _ in range(2)])
        self.checkpointed = checkpointed

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        call = revckpt.checkpoint if self.checkpointed else (lambda m, t: m(t))
        return sum(_in_threads([lambda e=e: call(e, x) for e in self.experts]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return revckpt.checkpoint(self._experts, x) if self.checkpointed else self._experts(x)


def test_sub_blocks_in_worker_threads_do_not_hang():
    torch.manual_seed(0)
    model = _Experts(checkpointed=True).double()
    torch.manual_seed(0)
    plain = _Experts(checkpointed=False).double()
    x = _input("checkpoint")
    done = threading.Event()

    def steps() -> None:
        for _ in range(2):  # the first call learns that nothing draws random numbers
            _assert_close(_step(model, x), _step(plain, x))
        done.set()

    t = threading.Thread(target=steps, daemon=True)
    t.start()
    t.join(timeout=90)
    assert done.is_set(), "the outer block's forward waited for its own sub-blocks"


# --- a node's first forward runs with grad mode on, as plain autograd's does -----------------


def _encoder_step(strategy: str, enc: nn.Module, x: torch.Tensor, mask: torch.Tensor):
    x = x.clone().requires_grad_(True)
    enc.zero_grad(set_to_none=True)
    if strategy == "plain":
        y = enc(x, src_key_padding_mask=mask)
    elif strategy == "approx-exact":
        y = revckpt.checkpoint(enc, x, strategy=Approx(store=None), src_key_padding_mask=mask)
    elif strategy == "offload":
        with rv_offload.force_copies():
            y = revckpt.checkpoint(enc, x, strategy="offload", src_key_padding_mask=mask)
    else:
        y = revckpt.checkpoint(enc, x, src_key_padding_mask=mask)
    y.square().sum().backward()
    return [y.detach(), x.grad, *_grads(enc)]


@pytest.mark.parametrize("strategy", ["checkpoint", "approx-exact", "offload"])
def test_an_eval_mode_encoder_takes_the_path_plain_autograd_takes(strategy):
    """Under no_grad nn.TransformerEncoder in eval() mode takes its inference fast path (nested
    tensors with a padding mask: other values at padded positions)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2).eval()
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[False] * 5, [False, False, False, True, True]])
    _assert_equal(_encoder_step(strategy, enc, x, mask), _encoder_step("plain", enc, x, mask))


@pytest.mark.parametrize("strategy", ["approx-exact", "offload", "reversible"])
def test_a_cached_parametrization_keeps_its_gradient(strategy):
    """parametrize.cached() caches the parametrized weight at the first forward: with its
    graph only if that forward runs with grad mode on."""
    from torch.nn.utils import parametrize

    class _Symmetric(nn.Module):
        def forward(self, w):
            return (w + w.T) / 2

    blocks = _linear_blocks()
    for b in blocks:
        parametrize.register_parametrization(b[0], "weight", _Symmetric())
    x = _input(strategy)
    plain, model = _build(_reference(strategy), blocks), _build(strategy, blocks)
    with parametrize.cached():
        expected = _step(plain, x)
    with parametrize.cached():
        got = _step(model, x)
    _assert_close(got, expected)


# --- a block that changes its input in place --------------------------------------------------


def _starts_in_place() -> list[nn.Module]:
    """Blocks whose first operation changes their input in place (``nn.ReLU(inplace=True)``)."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.ReLU(inplace=True), nn.Linear(D, D)) for _ in range(4)]


def _ends_in_place() -> list[nn.Module]:
    """Blocks that change only tensors they made in place."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(D, D), nn.ReLU(inplace=True)) for _ in range(4)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_recomputed_block_that_changes_its_input_in_place_raises_in_its_forward(strategy):
    """Its recompute would start from the changed input: torch raises a version error in
    backward (or, for an input without grad, gives other gradients); revckpt names it at once."""
    model = _build(strategy, _starts_in_place())
    with pytest.raises(revckpt.ModifiedInputError, match=r"in place.*inplace=False"):
        model(_input(strategy))


@pytest.mark.parametrize("strategy", [s for s in EXACT if s != "selective"])
def test_in_place_operations_on_what_a_block_made_are_plain_autograds(strategy):
    blocks = _ends_in_place()
    x = _input(strategy)
    expected = _step(_build(_reference(strategy), blocks), x.clone())
    _assert_close(_step(_build(strategy, blocks), x.clone()), expected)


def test_a_kept_output_changed_in_place_and_read_by_the_recompute_raises():
    """The 'matmul' policy keeps the Linear's output, which the ReLU then overwrites, and the
    recompute reads it: torch's selective checkpoint raises a bare RuntimeError in backward;
    revckpt names the operation."""
    model = _build("selective", _ends_in_place())
    with pytest.raises(revckpt.ModifiedInputError, match=r"keeps the output of aten\.addmm"):
        _step(model, _input("selective"))


class _ResidualMLP(nn.Module):
    """Its last kept output (fc2's) is changed in place, but no recompute reads it (the
    recompute stops after the last tensor autograd saved, fc2's input)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        out += x
        return out


def test_a_kept_output_changed_in_place_that_no_recompute_reads_is_plain_autograds():
    torch.manual_seed(0)
    blocks = [_ResidualMLP() for _ in range(4)]
    x = _input("selective")
    _assert_close(_step(_build("selective", blocks), x), _step(_build("plain", blocks), x))


class _ShiftedProjection(nn.Module):
    """A bias-free Linear on a 3-D input is ``mm`` then ``_unsafe_view``, whose version counter
    is not the ``mm`` output's: the in-place add changes the kept ``mm`` output unseen by
    torch's version check (torch's own selective checkpoint gives wrong gradients here)."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        y.add_(1.0)
        return y.sin()


class _BiasedScores(nn.Module):
    """T5's attention scores: ``matmul`` of two 3-D projections (``bmm`` then
    ``_unsafe_view``), then ``scores += bias`` in place."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(D, D), nn.Linear(D, D)
        self.bias = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(self.q(x), self.k(x).transpose(-1, -2))
        scores += self.bias
        return scores.softmax(-1)


@pytest.mark.parametrize(
    ("block", "op"), [(_ShiftedProjection, r"aten\.mm"), (_BiasedScores, r"aten\.bmm")]
)
@pytest.mark.parametrize("policy", ["matmul", "matmul+attention"])
def test_a_kept_output_changed_through_an_alias_raises(block, op, policy):
    """Before, these gave gradients 4.2 and 0.50 away from autograd's (max abs, float64),
    silently."""
    torch.manual_seed(0)
    model = block().double()
    x = torch.randn(2, 4, D, dtype=torch.float64, requires_grad=True)
    y = revckpt.checkpoint(model, x, strategy=f"selective:{policy}")
    with pytest.raises(revckpt.ModifiedInputError, match=rf"keeps the output of {op}"):
        y.mul(torch.randn_like(y)).sum().backward()


def test_a_kept_output_changed_through_the_blocks_output_raises():
    """The block returns a bias-free Linear's output (``_unsafe_view`` of the kept ``mm``) and
    GELU of it; its caller then adds into the first in place. Plain autograd raises (GELU saved
    it); revckpt used to recompute GELU's input from the changed ``mm`` output (gradients 2.6
    away, silently)."""

    class _Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D, bias=False)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.lin(x)
            return y, torch.nn.functional.gelu(y)

    torch.manual_seed(0)
    model = _Both().double()
    x = torch.randn(2, 4, D, dtype=torch.float64, requires_grad=True)
    y, z = revckpt.checkpoint(model, x, strategy="selective:matmul")
    y.add_(1.0)
    with pytest.raises(revckpt.ModifiedInputError, match=r"through the block's output"):
        z.mul(torch.randn_like(z)).sum().backward()


def _masked_scores(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """XLM / Flaubert attention: 4-D scores (``bmm`` then ``_unsafe_view``) masked in place."""
    b, t, _ = x.shape
    q = m.q(x).view(b, t, 2, D // 2).transpose(1, 2)
    k = m.k(x).view(b, t, 2, D // 2).transpose(1, 2)
    scores = q @ k.transpose(-1, -2)
    scores.masked_fill_(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ q).transpose(1, 2).reshape(b, t, D)


def _relu_in_place(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m.k(torch.relu_(m.q(x)))  # a bias-free Linear's output, then ReLU(inplace=True)


def _unsqueezed(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = m.q(x)
    y.unsqueeze_(0)  # metadata only
    return y.sin() * m.k(x)


def _read_then_masked(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    scores = m.q(x) @ m.k(x).transpose(-1, -2)
    first = scores.exp()  # reads the kept bmm output before the write below
    scores.masked_fill_(torch.ones(4, 4, dtype=torch.bool).triu(1), 0.0)
    return first * scores.sin()


class _Pair(nn.Module):
    def __init__(self, forward) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.run = forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self, x)


@pytest.mark.parametrize("forward", [_masked_scores, _relu_in_place, _unsqueezed])
def test_writes_the_recompute_makes_again_exactly_are_plain_autograds(forward):
    """A first write into a kept output nothing has read, by an operation that gives the same
    result applied twice (masked_fill_, relu_), and writes of metadata only: the recompute reads
    the written value and writes it again, so gradients are exact (torch's own selective
    checkpoint too) and nothing is raised."""
    torch.manual_seed(0)
    model = _Pair(forward).double()
    x = torch.randn(2, 4, D, dtype=torch.float64, requires_grad=True)
    ct = torch.randn_like(forward(model, x.detach()))
    expected = torch.autograd.grad((forward(model, x) * ct).sum(), [x, *model.parameters()])
    for policy in ("matmul", "matmul+attention"):
        y = revckpt.checkpoint(model, x, strategy=f"selective:{policy}")
        got = torch.autograd.grad((y * ct).sum(), [x, *model.parameters()])
        _assert_equal(list(got), list(expected))


def test_an_idempotent_write_after_a_read_raises():
    """The kept scores are read (exp) before masked_fill_ changes them: the recompute's exp
    would read the masked values."""
    torch.manual_seed(0)
    model = _Pair(_read_then_masked).double()
    x = torch.randn(2, 4, D, dtype=torch.float64, requires_grad=True)
    y = revckpt.checkpoint(model, x, strategy="selective:matmul")
    with pytest.raises(revckpt.ModifiedInputError, match=r"keeps the output of aten\.bmm"):
        y.mul(torch.randn_like(y)).sum().backward()


def test_in_place_operations_on_sparse_tensors_inside_a_selective_block():
    """The guard looks at strided tensors only (a sparse one has no storage to compare)."""

    class _Sparse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            idx = torch.tensor([[0, 1], [1, 2]])
            sp = torch.sparse_coo_tensor(idx, torch.ones(2, dtype=x.dtype), (D, D))
            sp.mul_(2.0)
            return self.lin(x) @ sp.to_dense()

    torch.manual_seed(0)
    model = _Sparse().double()
    x = torch.randn(ROWS, D, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
    y = revckpt.checkpoint(model, x, strategy="selective:matmul")
    _assert_equal(list(torch.autograd.grad(y.sum(), [x, *model.parameters()])), list(expected))


@pytest.mark.parametrize("bias", [True, False])
def test_writes_that_no_kept_output_overlaps_are_plain_autograds(bias):
    """A bias-free (or biased) Linear's output scaled out of place, then changed in place: the
    kept ``mm`` output is not touched, and nothing is raised."""

    class _Scaled(_ShiftedProjection):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x) * 2.0
            y.add_(1.0)
            return y.sin()

    torch.manual_seed(0)
    model = _Scaled(bias).double()
    x = torch.randn(2, 4, D, dtype=torch.float64, requires_grad=True)
    ct = torch.randn(2, 4, D, dtype=torch.float64)
    expected = torch.autograd.grad((model(x) * ct).sum(), [x, *model.parameters()])
    y = revckpt.checkpoint(model, x, strategy="selective:matmul")
    got = torch.autograd.grad((y * ct).sum(), [x, *model.parameters()])
    _assert_equal(list(got), list(expected))


def test_inference_tensors_and_containers_given_to_a_block():
    """An inference-mode mask has no version counter (it is not checked); a tensor in a list
    the block is given, changed in place, is named."""
    lin = nn.Linear(D, D).double()
    with torch.inference_mode():
        mask = torch.ones(D, dtype=torch.float64)
    x = _input("checkpoint")
    y = revckpt.checkpoint(lambda h, *, mask: lin(h) + mask, x, mask=mask)
    expected = lin(x) + mask.clone()
    torch.testing.assert_close(y, expected)

    def scales_the_second(xs):
        xs[1].mul_(2.0)
        return lin(xs[0] + xs[1])

    with pytest.raises(revckpt.ModifiedInputError, match="changed a tensor it was given"):
        revckpt.checkpoint(scales_the_second, [x, x.clone()])


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + mask  # not saved by autograd: plain autograd takes it


@pytest.mark.parametrize("strategy", ["checkpoint", "selective", "approx:bf16", "offload"])
def test_an_inference_mode_keyword_tensor_is_used_as_it_is(strategy):
    """Approx and offload nodes save their keyword tensors; an inference tensor cannot be
    saved (torch raised 'Inference tensors cannot be saved for backward'): it is kept as given."""
    torch.manual_seed(0)
    block = _Masked().double()
    with torch.inference_mode():
        mask = torch.rand(D, dtype=torch.float64)
    x = torch.randn(ROWS, D, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(block(x, mask=mask).sum(), [x, *block.parameters()])
    strat = {"approx:bf16": Approx(store="bf16"), "selective": "selective:matmul"}.get(
        strategy, strategy
    )
    y = revckpt.checkpoint(block, x, mask=mask, strategy=strat)
    got = torch.autograd.grad(y.sum(), [x, *block.parameters()])
    if strategy == "approx:bf16":  # the input went through bf16
        torch.testing.assert_close(list(got), list(expected), rtol=1e-2, atol=1e-2)
    else:
        _assert_equal(list(got), list(expected))


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload"])
@pytest.mark.parametrize("as_keyword", [True, False])
def test_a_kept_mask_changed_after_the_forward_is_named(strategy, as_keyword):
    """Approx and offload nodes keep a keyword tensor (and a further positional one without
    grad) exactly; changed in place before backward, torch raised its bare version error."""

    class _Add(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + mask

    block = _Add().double()
    x = torch.randn(ROWS, D, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(D, dtype=torch.float64)
    strat = Approx(store="bf16") if strategy == "approx:bf16" else strategy
    if as_keyword:
        y = revckpt.checkpoint(block, x, mask=mask, strategy=strat)
    else:
        y = revckpt.checkpoint(block, x, mask, strategy=strat)
    mask.add_(1.0)
    with pytest.raises(revckpt.ModifiedInputError, match=r"(changed|modified) in place"):
        y.sum().backward()


def test_a_reversible_branch_that_changes_a_keyword_tensor_raises():
    class _Shifts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x, *, bias):
            bias.add_(1.0)
            return self.lin(x) + bias

    torch.manual_seed(0)
    stack = ReversibleSequential(ReversibleBlock(_Shifts(), _Shifts()), check_inverse=None)
    x = torch.randn(ROWS, 2 * D, requires_grad=True)
    with pytest.raises(revckpt.ModifiedInputError, match="branch f of a reversible block"):
        stack(x, bias=torch.zeros(D))


def test_a_changed_input_without_grad_raises_rather_than_recomputing_from_it():
    class _Scales(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x.mul_(2.0))

    x = torch.randn(ROWS, D)
    with pytest.raises(revckpt.ModifiedInputError, match="_Scales changed a tensor"):
        revckpt.checkpoint(_Scales(), x)


class _CountsItsCalls(nn.Module):
    """Sets a plain attribute on its first call (absent before it) and computes with it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        return torch.tanh(self.lin(x) * (1 + 0.1 * self.calls))


def test_an_attribute_made_by_the_first_checkpointed_forward_is_absent_in_its_recompute():
    """A first checkpointed call scans the block's attributes before its forward made them: the
    recompute found the counter the forward left (2 where the forward computed with 1), and the
    gradients differed from plain autograd's by 0.05, silently."""
    from revckpt import checkpoint

    torch.manual_seed(0)
    block = _CountsItsCalls().double()
    plain = copy.deepcopy(block)
    x = torch.randn(4, 6, dtype=torch.float64)
    for _ in range(2):  # the first call, then a later one
        h, hp = x.clone().requires_grad_(), x.clone().requires_grad_()
        checkpoint(block, h).pow(2).sum().backward()
        plain(hp).pow(2).sum().backward()
        assert torch.equal(h.grad, hp.grad)
        assert torch.equal(block.lin.weight.grad, plain.lin.weight.grad)
        assert block.calls == plain.calls


class _TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c(torch.tanh(self.a(x)))


@pytest.mark.parametrize("strategy", ["checkpoint", "selective:matmul+attention", "offload"])
@pytest.mark.parametrize("change", ["unfreeze", "freeze"])
def test_requires_grad_changed_between_forward_and_backward_gives_plain_gradients(strategy, change):
    """A callback that unfreezes (or freezes) a weight after the loss is computed: plain
    autograd differentiates the graph the forward recorded. The recompute ran with the new
    flag and saved other tensors: of the same shapes here (8 rows, 8 features), so torch's
    metadata check passed and every other gradient came out 1.7x wrong; frozen, a raw
    CheckpointError."""
    torch.manual_seed(0)
    plain = nn.Sequential(_TwoLinear(), _TwoLinear()).double()
    model = copy.deepcopy(plain)
    revckpt.convert(model, strategy)
    x = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    grads = []
    for m in (plain, model):
        for block in m:
            block.c.weight.requires_grad_(change == "freeze")
        loss = (m(x) ** 2).sum()
        for block in m:
            block.c.weight.requires_grad_(change == "unfreeze")
        loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
        assert all(b.c.weight.requires_grad == (change == "unfreeze") for b in m)
    for name, ref in grads[0].items():
        got = grads[1][name]
        assert (got is None) == (ref is None), name
        if ref is not None:
            torch.testing.assert_close(got, ref, rtol=0, atol=0)


class _FreezesAfterUse(_TwoLinear):
    """A forward hook that sets ``a.weight.requires_grad`` once ``a`` ran (progressive
    freezing done from a hook)."""

    def __init__(self, flag: bool) -> None:
        super().__init__()

        def hook(module: nn.Module, inputs: object, output: object) -> None:
            module.weight.requires_grad_(flag)

        self.a.register_forward_hook(hook)


@pytest.mark.parametrize("strategy", ["checkpoint", "selective:matmul+attention", "offload"])
@pytest.mark.parametrize("start", [True, False])
def test_requires_grad_changed_by_a_hook_during_the_forward_gives_plain_gradients(strategy, start):
    """Recorded at the forward's end, the flags replayed the hook's, not the ones the weight
    was used with: other gradients 2-7x wrong silently (unfrozen), or a raw error (frozen;
    offload: the hook froze the rerun's own alias)."""
    grads = []
    for convert in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(_FreezesAfterUse(not start), _FreezesAfterUse(not start)).double()
        if convert:
            revckpt.convert(model, strategy)
        for block in model:
            block.a.weight.requires_grad_(start)
        x = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
        (model(x) ** 2).sum().backward()
        grads.append({"x": x.grad, **{n: p.grad for n, p in model.named_parameters()}})
    for name, ref in grads[0].items():
        got = grads[1][name]
        assert (got is None) == (ref is None), name
        if ref is not None:
            torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("strategy", ["approx:bf16", "offload"])
def test_a_dual_frozen_weight_is_refused_not_dropped(strategy):
    """functional_call with a dual frozen weight (a JVP with respect to weights that do not
    train): the node took only the trainable parameters, and the tangent came back None."""
    import torch.autograd.forward_ad as fwAD
    from torch.func import functional_call

    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 8))
    model.requires_grad_(False)
    model[1].weight.requires_grad_(True)
    revckpt.convert(model, strategy, module_filter_fn=lambda m, fqn: fqn == "0")
    x = torch.randn(4, 8, requires_grad=True)  # as in training: the node runs
    with fwAD.dual_level(), pytest.raises(InvalidArgumentError, match="forward-mode"):
        weight = fwAD.make_dual(model[0][0].weight.detach(), torch.randn(8, 8))
        functional_call(model, {"0.0.weight": weight}, (x,))
