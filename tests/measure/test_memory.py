import gc

import pytest
import torch
import torch.utils.checkpoint
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from revckpt import InvalidArgumentError, MemoryMeter, checkpoint_sequential, peak_memory
from revckpt.measure import MeasurementError
from revckpt.measure.allocator import peak_and_end
from revckpt.models import mlp_chain


def test_exact_bytes_of_known_tensors():
    with MemoryMeter("cpu") as m:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes
        b = torch.zeros(10, 10, dtype=torch.float64)  # 800 bytes
        c = torch.ones(7, dtype=torch.int8)  # 7 bytes
        del b  # peak 4807, then 4007 live
        d = torch.empty(3, dtype=torch.bfloat16)  # 6 bytes
    assert m.peak_bytes == 4807
    assert m.end_bytes == 4013
    del a, c, d


def test_aliases_counted_once():
    with MemoryMeter("cpu") as m:
        a = torch.randn(64, 64)
        views = [a.t(), a[3:], a.view(-1), a.detach(), a.reshape(4096)]
        a.mul_(2)  # in place: no new storage
    assert m.end_bytes == m.peak_bytes == 64 * 64 * 4
    del views, a


def test_views_of_preexisting_tensors_are_free_and_frees_are_seen():
    base = torch.randn(100)
    with MemoryMeter("cpu") as m:
        v = base[10:]
        tmp = base * 2
        del tmp
        gc.collect()
    assert m.peak_bytes == 400 and m.end_bytes == 0
    del v


def test_tensor_from_python_data_is_counted():
    with MemoryMeter("cpu") as m:
        t = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    assert m.end_bytes == 24
    del t


def test_nested_meters_measure_their_own_block():
    with MemoryMeter("cpu") as outer:
        a = torch.empty(100)
        with MemoryMeter("cpu") as inner:
            b = torch.empty(50)
    assert inner.end_bytes == 200 and outer.end_bytes == 600
    del a, b


def test_function_form():
    stats = peak_memory(lambda n: torch.empty(n).sum(), 256, meter_device="cpu")
    assert stats.peak_bytes == 256 * 4 + 4 and stats.end_bytes == 0


B, W, H, DEPTH = 64, 128, 256, 32


def test_mlp_chain_retained_bytes_match_hand_computed_sizes():
    """32 residual blocks ``x + fc2(relu(fc1(x)))``.

    Plain autograd keeps, per block, the ReLU output (B x H, saved by ReLU and by fc2: one
    storage) and the block output (B x W, the next block's fc1 input, or the final output).
    Per-block checkpoint keeps only the block outputs (each the next block's input).
    """
    model = mlp_chain(DEPTH, W, H)
    x = torch.randn(B, W, requires_grad=True)
    with MemoryMeter("cpu") as plain:
        y = model(x)
    del y
    with MemoryMeter("cpu") as ckpt:
        z = checkpoint_sequential(model, DEPTH, x)
    del z
    plain_expected = DEPTH * (B * H + B * W) * 4
    ckpt_expected = DEPTH * B * W * 4
    assert abs(plain.end_bytes - plain_expected) <= 0.01 * plain_expected
    assert abs(ckpt.end_bytes - ckpt_expected) <= 0.01 * ckpt_expected
    assert plain.peak_bytes >= plain.end_bytes


def test_backward_peak_with_checkpoint_is_lower():
    model = mlp_chain(16, W, H)
    x = torch.randn(16 * B, W, requires_grad=True)  # activations outweigh parameter gradients

    def step(run):
        run(model, x).sum().backward()
        model.zero_grad(set_to_none=True)
        x.grad = None

    plain = peak_memory(step, lambda m, x: m(x), meter_device="cpu")
    ckpt = peak_memory(step, lambda m, x: checkpoint_sequential(m, 16, x), meter_device="cpu")
    assert ckpt.peak_bytes < plain.peak_bytes / 2


def test_figures_only_after_exit_and_bad_device():
    m = MemoryMeter("cpu")
    with pytest.raises(InvalidArgumentError, match="after the `with` block"):
        _ = m.peak_bytes
    with pytest.raises(InvalidArgumentError, match="not a device"):
        MemoryMeter("gpu0")
    with pytest.raises(InvalidArgumentError, match="'cpu' or 'cuda'"):
        MemoryMeter("meta")


def test_module_parameters_created_inside_are_counted():
    with MemoryMeter("cpu") as m:
        lin = nn.Linear(10, 20)  # 200 weights + 20 bias, float32
    assert m.end_bytes == 220 * 4
    del lin


_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int64]


@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("alloc"), st.integers(0, 5000), st.sampled_from(_DTYPES)),
            st.tuples(st.just("drop"), st.integers(0, 50)),
            st.tuples(st.just("view"), st.integers(0, 50)),
        ),
        max_size=40,
    )
)
def test_random_allocation_sequences_are_byte_exact(steps):
    """Oracle: the bytes of the distinct storages still referenced from Python."""
    held: list[torch.Tensor] = []

    def referenced() -> int:
        return sum(
            {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in held}.values()
        )

    peak = 0
    with MemoryMeter("cpu") as m:
        for step in steps:
            if step[0] == "alloc":
                held.append(torch.zeros(step[1], dtype=step[2]))
                peak = max(peak, referenced())
            elif held and step[0] == "drop":
                del held[step[1] % len(held)]
            elif held and step[0] == "view":
                held.append(held[step[1] % len(held)][1:])
        end = referenced()
    assert m.end_bytes == end
    assert m.peak_bytes == peak


def test_garbage_collection_inside_the_meter_does_not_deadlock():
    class Node:
        pass

    gc.collect()
    with MemoryMeter("cpu") as m:
        for _ in range(3000):
            n = Node()
            n.self = n
            n.t = torch.empty(10)
            del n
            torch.empty(10)
        gc.collect()
    assert m.end_bytes == 0 and m.peak_bytes >= 40


def test_growth_of_a_preexisting_tensor_is_counted():
    out = torch.empty(0)
    a = torch.randn(256, 256)
    with MemoryMeter("cpu") as m:
        torch.mul(a, 2, out=out)  # out grows from 0 to 256 KiB
    assert m.end_bytes == 256 * 256 * 4
    del out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_meter_without_cuda_says_so():
    with pytest.raises(InvalidArgumentError, match="CUDA is not available"):
        MemoryMeter("cuda")


def test_reset_peak_measures_a_phase():
    with MemoryMeter("cpu") as m:
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(1000)
        del a
        assert m.live_bytes == 4000
        m.reset_peak()
        c = torch.empty(100)
        del b, c
    assert m.peak_bytes == 8000  # the whole block
    assert m.since_reset_peak_bytes == 4400  # from the reset on, frees of earlier tensors seen
    assert m.end_bytes == 0


def test_reset_peak_outside_the_block_and_without_reset():
    m = MemoryMeter("cpu")
    with pytest.raises(InvalidArgumentError, match="inside the `with` block"):
        m.reset_peak()
    with m:
        torch.empty(10)
    with pytest.raises(InvalidArgumentError, match="inside the `with` block"):
        _ = m.live_bytes
    with pytest.raises(InvalidArgumentError, match="reset_peak"):
        _ = m.since_reset_peak_bytes


def test_allocator_method_gives_the_same_bytes_for_known_tensors():
    with MemoryMeter("cpu", method="allocator") as m:
        a = torch.empty(1000, dtype=torch.float32)
        b = torch.zeros(10, 10, dtype=torch.float64)
        c = torch.ones(7, dtype=torch.int8)
        del b
        d = torch.empty(3, dtype=torch.bfloat16)
    assert (m.peak_bytes, m.end_bytes) == (4807, 4013)
    assert m.stats.method == "allocator" and "RNG" not in str(m.stats)
    del a, c, d


def test_rng_states_are_seen_by_the_allocator_method_only():
    with MemoryMeter("cpu") as storages:
        s = torch.get_rng_state()
    with MemoryMeter("cpu", method="allocator") as allocator:
        t = torch.get_rng_state()
    assert storages.end_bytes == 0 and "RNG states not counted" in str(storages.stats)
    assert allocator.end_bytes == t.nbytes == s.nbytes > 0


def test_peak_and_end_count_only_frees_of_allocations_made_in_the_block():
    events = [
        (30, 0xA, -100),  # frees an allocation made before the block: ignored
        (10, 0xA, 100),  # out of order in the list: events are taken in time order
        (20, 0xB, 50),
        (40, 0xB, -50),
        (50, 0xC, 70),
        (60, 0xD, -999),  # a free of memory the block never allocated
    ]
    assert peak_and_end(events) == (150, 70)
    assert peak_and_end([]) == (0, 0)


def test_allocator_method_refuses_what_it_cannot_do():
    with MemoryMeter("cpu", method="allocator") as m:
        with pytest.raises(InvalidArgumentError, match="method='allocator' on CPU"):
            _ = m.live_bytes
        with pytest.raises(InvalidArgumentError, match="method='allocator' on CPU"):
            m.reset_peak()
        nested = MemoryMeter("cpu", method="allocator")
        with pytest.raises(InvalidArgumentError, match="a profiler is already running"):
            nested.__enter__()
        with MemoryMeter("cpu") as inner:  # the storage tracker nests inside it
            x = torch.empty(10)
    assert inner.end_bytes == 40 and m.end_bytes == 40
    with pytest.raises(InvalidArgumentError, match="use 'storages'"):
        MemoryMeter("cpu", method="profiler")
    del x


@pytest.fixture
def dynamo_reset():
    """torch 2.13 keeps code that ran under a dispatch mode eager (pytorch/pytorch#190286):
    reset Dynamo afterwards so later tests compile again."""
    yield
    torch._dynamo.reset()


def test_compiled_forward_inside_the_storage_tracker_raises(dynamo_reset):
    compiled = torch.compile(lambda x: (x * 2).sin(), backend="eager")
    x = torch.randn(8)
    compiled(x)
    m = MemoryMeter("cpu")
    with pytest.raises(MeasurementError, match="method='allocator'") as info, m:
        y = compiled(x)
    assert "ran torch.compile'd code" in str(info.value)
    assert (m.peak_bytes, m.end_bytes) == (64, 32)  # the eager figures stay readable
    with MemoryMeter("cpu", method="allocator") as allocator:
        z = compiled(x)
    assert allocator.end_bytes == 32
    del y, z


def test_compiled_backward_inside_the_storage_tracker_raises(dynamo_reset):
    lin = nn.Linear(8, 8)
    y = torch.compile(lin, backend="aot_eager")(torch.randn(4, 8))
    with (
        pytest.raises(MeasurementError, match=r"backward of a torch\.compile'd"),
        MemoryMeter("cpu"),
    ):
        y.sum().backward()


def test_eager_code_under_dynamo_disable_is_not_taken_for_compiled_code():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with MemoryMeter("cpu") as m:  # torch's checkpoint runs under torch._dynamo.disable
        torch.utils.checkpoint.checkpoint(lin, x, use_reentrant=False).sum().backward()
        torch.compiler.disable(lin)(x)
    assert m.peak_bytes > 0


def test_a_meter_entered_again_while_measuring_is_refused_and_leaves_no_mode():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    meter = MemoryMeter("cpu")
    with meter, pytest.raises(InvalidArgumentError, match="measuring already"):
        meter.__enter__()
    assert _get_current_dispatch_mode_stack() == []


def test_meters_exited_out_of_order_count_right_and_leave_torchs_mode_state_as_it_was():
    from torch.utils._python_dispatch import (
        _get_current_dispatch_mode_stack,
        is_in_torch_dispatch_mode,
    )

    a, b = MemoryMeter("cpu"), MemoryMeter("cpu")
    a.__enter__()
    x = torch.ones(1000)
    b.__enter__()
    y = torch.ones(1000)
    a.__exit__(None, None, None)
    z = torch.ones(1000)
    b.__exit__(None, None, None)
    assert (a.end_bytes, b.end_bytes) == (8000, 8000)
    assert _get_current_dispatch_mode_stack() == [] and not is_in_torch_dispatch_mode()
    del x, y, z


def test_a_storage_grown_outside_the_dispatcher_counts_in_the_peak_too():
    t = torch.empty(0)
    with MemoryMeter("cpu") as m:
        u = torch.empty(0)
        u.untyped_storage().resize_(4000)
    assert m.end_bytes == 4000 and m.peak_bytes >= m.end_bytes
    del t, u


def test_a_meter_whose_tracker_another_modes_exit_took_leaves_the_stack_empty():
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    other, meter = Passing(), MemoryMeter("cpu")
    other.__enter__()
    meter.__enter__()
    other.__exit__(None, None, None)  # out of order: torch pops the meter's tracker
    meter.__exit__(None, None, None)
    assert _get_current_dispatch_mode_stack() == []


def test_a_meter_exited_on_another_thread_is_refused():
    import threading

    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    meter, raised = MemoryMeter("cpu"), []
    meter.__enter__()

    def leave():
        try:
            meter.__exit__(None, None, None)
        except MeasurementError as e:
            raised.append(e)

    worker = threading.Thread(target=leave)
    worker.start()
    worker.join()
    assert raised and "another thread" in str(raised[0])
    _get_current_dispatch_mode_stack()[-1].__exit__(None, None, None)  # this test's cleanup
    assert _get_current_dispatch_mode_stack() == []
