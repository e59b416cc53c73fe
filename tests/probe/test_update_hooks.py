"""The non-finite skip's verdict and its hand-over to torch's optimizers."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from trainpatrol.probe.device_values import DeviceValues, nonfinite_flag
from trainpatrol.probe.update_hooks import UpdateHooks, skip_mode


@pytest.mark.parametrize(("loss", "extra", "flag"), [
    (1.5, 0.3, 0.0), (-2.0, None, 0.0), (0.0, 0.0, 0.0), (math.nan, 0.3, 1.0), (math.inf, 0.3, 1.0),
    (-math.inf, None, 1.0), (1.5, math.nan, 1.0), (1.5, -math.inf, 1.0), (1.5, float("inf"), 1.0),
])
def test_the_flag_is_one_exactly_when_a_value_is_not_finite(loss: float, extra: float | None, flag: float) -> None:
    out = torch.full((), 7.0)
    for extra_value in (extra, None if extra is None else torch.tensor(extra)):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            got = nonfinite_flag(torch.tensor(loss, dtype=dtype), extra_value, out)
            assert got is out and got.dtype == torch.float32 and got.item() == flag, (loss, extra_value, dtype)


def fused_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.Adam(model.parameters(), lr=0.1, fused=True)


def test_a_verdict_to_skip_leaves_a_fused_optimizer_untouched_and_the_flag_is_handed_back() -> None:
    model, opt = fused_adam()
    hooks = UpdateHooks(opt, skip=True, after_step=lambda: None)
    assert hooks.mode == "found_inf"
    model(torch.ones(2, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    hooks.judge(hooks.flag(torch.tensor(math.nan)))
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert [float(s["step"]) for s in opt.state.values()] == [0.0, 0.0]
    assert not hasattr(opt, "found_inf")
    hooks.judge(hooks.flag(torch.tensor(1.0)))
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert [float(s["step"]) for s in opt.state.values()] == [1.0, 1.0]


def test_beside_a_grad_scaler_its_flag_is_combined_and_left_for_it_to_delete() -> None:
    model, opt = fused_adam()
    hooks = UpdateHooks(opt, skip=True, after_step=lambda: None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    hooks.judge(hooks.flag(torch.tensor(math.nan)))  # the scaler finds the grads finite; Patrol does not
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not hasattr(opt, "found_inf")
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    hooks.judge(hooks.flag(torch.tensor(1.0)))
    scaler.step(opt)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_optimizers_that_cannot_skip_without_a_sync_are_named_off() -> None:
    model = torch.nn.Linear(4, 1)
    assert skip_mode(torch.optim.SGD(model.parameters(), lr=0.1)) == "hide_grads"  # CPU: reading is free
    assert skip_mode(torch.optim.SGD(model.parameters(), lr=0.1, fused=True)) == "found_inf"
    meta = torch.nn.Linear(4, 1, device="meta")
    assert skip_mode(torch.optim.SGD(meta.parameters(), lr=0.1)) == "off"


@pytest.mark.parametrize(("row", "flag"), [
    ([1.5, 0.3, 1.0], 0.0), ([1.5, -1.0, 1.0], 0.0), ([math.nan, 0.3, 1.0], 1.0), ([1.5, math.inf, 1.0], 1.0),
    ([-math.inf, -1.0, 65536.0], 1.0),
])
def test_the_flag_of_a_row_of_step_values_is_one_exactly_when_one_is_not_finite(row: list[float],
                                                                                flag: float) -> None:
    values = DeviceValues(torch.device("cpu"))
    loss, norm, scale = (torch.tensor(v) for v in row)
    for _ in range(3):  # across a flush: the flags are reused, a verdict never sticks
        assert values.record(loss, norm, scale, judge=True).item() == flag  # type: ignore[union-attr]
        assert values.record(torch.tensor(1.0), torch.tensor(2.0), None, judge=True).item() == 0.0  # type: ignore[union-attr]
        rows, written = values.flush()
        assert rows == 2  # the check left the row as it was
        torch.testing.assert_close(written[:3], torch.tensor(row), equal_nan=True)


def test_each_row_keeps_its_own_flag_until_the_next_batch_starts() -> None:
    """The optimizer step of a row reads its flag after later rows were judged, so a NaN row's flag must
    stay set while the batch lasts, and a new batch must start from zero."""
    values = DeviceValues(torch.device("cpu"))
    bad = values.record(torch.tensor(math.nan), None, None, judge=True)
    good = values.record(torch.tensor(1.0), None, None, judge=True)
    assert bad is not None and good is not None and (bad.item(), good.item()) == (1.0, 0.0)
    values.flush()
    assert values.record(torch.tensor(1.0), None, None, judge=True).item() == 0.0 and bad.item() == 0.0  # type: ignore[union-attr]


def test_the_verdict_leaves_the_loss_as_it_was_for_autograd_too() -> None:
    """The check runs on the caller's own loss tensor: its value and version stay, so a graph that saved the loss
    (exp saves its output) still runs backward after patrol.step(), and the loss is read back exactly."""
    values = DeviceValues(torch.device("cpu"))
    x = torch.tensor([0.1, 0.2], requires_grad=True)
    loss = x.exp().sum().exp()
    before, version = loss.item(), loss._version
    assert values.record(loss, None, None, judge=True).item() == 0.0  # type: ignore[union-attr]
    assert (loss.item(), loss._version) == (before, version)
    loss.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    _, read = values.flush()
    assert read[0].item() == before


def test_a_loss_changed_in_place_before_it_was_read_is_said_once_and_later_steps_are_copied_at_once(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="trainpatrol")
    values = DeviceValues(torch.device("cpu"))
    loss, norm = torch.tensor(2.0), torch.tensor(3.0)
    values.record(loss, norm, None, judge=True)
    loss.mul_(10)  # e.g. scaled for a log line, after patrol.step()
    values.flush()
    assert values.copy_each_step and caplog.text.count("modified in place") == 1
    values.record(loss, norm, None, judge=True)
    loss.mul_(10)
    values.record(torch.tensor(5.0), None, None, judge=False)
    rows, read = values.flush()
    assert rows == 2 and read[:6].tolist() == [20.0, 3.0, 1.0, 5.0, -1.0, 1.0]  # as they were at each step
    assert caplog.text.count("modified in place") == 1


def test_values_made_in_inference_mode_are_read_as_given() -> None:
    values = DeviceValues(torch.device("cpu"))
    with torch.inference_mode():
        loss, norm = torch.tensor(1.5), torch.tensor(0.5)
    assert values.record(loss, norm, None, judge=True).item() == 0.0  # type: ignore[union-attr]
    assert values.record(torch.tensor(math.nan), torch.tensor(0.5), torch.tensor(8.0),
                         judge=True).item() == 1.0  # type: ignore[union-attr]
    rows, read = values.flush()
    assert rows == 2 and read[:3].tolist() == [1.5, 0.5, 1.0] and read[4:6].tolist() == [0.5, 8.0]
    assert not values.copy_each_step


def test_values_a_cuda_graph_overwrote_are_dropped_with_a_warning_and_later_steps_copied_at_once(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``torch.compile(mode="reduce-overhead")`` a loss may be a CUDA graph's output, which the next replay
    overwrites, and reading it then raises. The stack that reads the batch raises here as it would there (no CUDA
    graphs on this machine): the flush loses that batch, says so, and never fails the step."""
    caplog.set_level(logging.WARNING, logger="trainpatrol")
    values = DeviceValues(torch.device("cpu"))
    values.record(torch.tensor(1.0), torch.tensor(2.0), None, judge=True)

    def overwritten(*args: object, **kwargs: object) -> None:
        raise RuntimeError("accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run")
    with monkeypatch.context() as patched:
        patched.setattr(torch, "stack", overwritten)
        rows, _ = values.flush()
    assert rows == 0 and values.copy_each_step and "this batch's values are lost" in caplog.text
    values.record(torch.tensor(3.0), torch.tensor(4.0), None, judge=True)
    rows, read = values.flush()
    assert rows == 1 and read[:3].tolist() == [3.0, 4.0, 1.0]


def test_a_loss_whose_memory_the_next_step_overwrites_is_read_as_its_step_had_it_or_not_at_all(
        caplog: pytest.LogCaptureFixture) -> None:
    """Under ``torch.compile(mode="reduce-overhead")`` the loss is a CUDA graph's static output: each replay writes
    the next step's loss into the same memory, outside autograd (its version stays), and hands the same tensor back.
    Here numpy writes into a tensor's memory as the replay does (no CUDA graphs on this machine). The values held
    since the last read-back are lost, with one warning, and each later step is copied at once: a step reads back
    as it was, never as a later step."""
    caplog.set_level(logging.WARNING, logger="trainpatrol")
    values = DeviceValues(torch.device("cpu"))
    static = torch.zeros(())
    for step in (1.0, 2.0, 3.0):
        static.numpy()[...] = step  # the replay
        values.record(static, torch.tensor(0.5), None, judge=True)
    rows, read = values.flush()
    assert rows == 2 and read[:6].tolist() == [2.0, 0.5, 1.0, 3.0, 0.5, 1.0]  # the last two steps, as they were
    assert values.copy_each_step and caplog.text.count("overwrote") == 1
    static.numpy()[...] = 4.0
    values.record(static, None, None, judge=True)
    static.numpy()[...] = 5.0
    values.record(static, None, None, judge=True)
    rows, read = values.flush()
    assert rows == 2 and read[:6].tolist() == [4.0, -1.0, 1.0, 5.0, -1.0, 1.0]
    assert caplog.text.count("overwrote") == 1


def test_fresh_values_each_step_are_held_until_the_read_back() -> None:
    """An eager loop: each step's loss and grad norm are new tensors (a norm left out is Patrol's own constant).
    Once a batch is read, its memory is the allocator's again, and the next batches' values may lie there."""
    values = DeviceValues(torch.device("cpu"))
    first = torch.zeros(())
    for batch in range(3):
        first.fill_(1.0)  # each batch's first loss lies where the last batch's did
        values.record(first, torch.tensor(0.5), None, judge=True)
        for step in range(2, 5):
            values.record(torch.tensor(float(step)), torch.tensor(0.5) if step % 2 else None, None, judge=True)
        rows, read = values.flush()
        assert rows == 4 and read[:12].tolist() == [1.0, 0.5, 1.0, 2.0, -1.0, 1.0, 3.0, 0.5, 1.0, 4.0, -1.0, 1.0]
        assert not values.copy_each_step, batch


def test_an_inference_tensor_refilled_while_held_is_caught_as_a_graph_output_is(
        caplog: pytest.LogCaptureFixture) -> None:
    # an inference tensor's version does not move when it is written in place: its memory tells
    caplog.set_level(logging.WARNING, logger="trainpatrol")
    values = DeviceValues(torch.device("cpu"))
    with torch.inference_mode():
        loss = torch.zeros(())
    for step in (1.0, 2.0, 3.0):
        with torch.inference_mode():
            loss.fill_(step)
        values.record(loss, None, None, judge=True)
    rows, read = values.flush()
    assert rows == 2 and read[:6].tolist() == [2.0, -1.0, 1.0, 3.0, -1.0, 1.0]
    assert values.copy_each_step and caplog.text.count("overwrote") == 1


def test_values_recorded_inside_inference_mode_are_copied_and_read_as_each_step_had_them() -> None:
    # there a tensor keeps no version at all, so each step's values are copied (and their copies' memory is held)
    values = DeviceValues(torch.device("cpu"))
    with torch.inference_mode():
        loss = torch.zeros(())
        for step in (1.0, 2.0, 3.0):
            loss.fill_(step)
            values.record(loss, torch.tensor(0.5), torch.tensor(4.0), judge=True)
    rows, read = values.flush()
    assert rows == 3 and read[:9].tolist() == [1.0, 0.5, 4.0, 2.0, 0.5, 4.0, 3.0, 0.5, 4.0]
    assert not values.copy_each_step
