"""Issue 9: the Hugging Face Trainer callback with a real Trainer, a tiny GPT-2 built from a config, a real agent."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from framework_helpers import exposed, patrol_config, run_value

from servers import http_json, wait_for
from trainpatrol import STOP_EXIT_CODE

transformers = pytest.importorskip("transformers")

from trainpatrol.integrations.huggingface import TrainPatrolCallback  # noqa: E402

VOCAB, SEQ = 64, 16


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(cfg)


def make_trainer(out: Path, callbacks: list[Any], max_steps: int, **args: Any) -> Any:
    settings: dict[str, Any] = {
        "per_device_train_batch_size": 4, "learning_rate": 1e-2, "lr_scheduler_type": "linear", "warmup_steps": 2,
        "logging_steps": 1, "save_strategy": "no", "report_to": "none", "use_cpu": True, "disable_tqdm": True,
        "seed": 0, "dataloader_num_workers": 0, **args}
    targs = transformers.TrainingArguments(output_dir=str(out), max_steps=max_steps, **settings)
    return transformers.Trainer(model=tiny_gpt2(), args=targs, train_dataset=RandomTokens(), callbacks=callbacks)


def train_in_thread(trainer: Any) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.train()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    return thread, errors


class When(transformers.TrainerCallback):  # type: ignore[misc]
    """Runs ``fn(state, control)`` as every step begins (``state.global_step`` steps are done)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.fn(state, control)


@pytest.mark.parametrize("accum", [1, 2])
def test_exported_values_equal_the_trainers_logs(tmp_path: Path, agent_url: str, accum: int) -> None:
    run = f"hf-exact-{accum}"
    cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, run))
    trainer = make_trainer(tmp_path / "out", [cb], max_steps=12, gradient_accumulation_steps=accum)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in logs] == list(range(1, 13))
    patrol = cb.patrol
    assert patrol is not None and patrol.state == "closed"
    # every step: Patrol's own record equals the Trainer's log_history entry bit for bit
    for e in logs:
        rec = patrol._history.get(e["step"])
        assert rec is not None
        assert (rec.loss, rec.grad_norm) == (e["loss"], e["grad_norm"]), e
    assert patrol._totals.samples == 12 * 4 * accum and patrol._totals.tokens == 12 * 4 * accum * SEQ
    assert exposed(agent_url, "trainpatrol_micro_step_total", run) == 12 * accum  # backward passes
    # the agent's /metrics after the final push: step count and the last step's values, exactly
    last = logs[-1]
    assert exposed(agent_url, "trainpatrol_step_total", run) == trainer.state.global_step == 12
    assert exposed(agent_url, "trainpatrol_loss", run) == last["loss"]
    assert exposed(agent_url, "trainpatrol_grad_norm", run) == last["grad_norm"]
    assert exposed(agent_url, "trainpatrol_learning_rate", run, 'param_group="0",') == last["learning_rate"]
    # the model's FLOPs as the Trainer counts them (floating_point_ops, total_flos), for the run's FLOP/s and MFU
    per_token = run_value(agent_url, "trainpatrol_run_model_flops_per_token", run)
    assert per_token * patrol._totals.tokens == trainer.state.total_flos > 0


def test_pause_via_agent_blocks_until_resume(tmp_path: Path, agent_url: str) -> None:
    run = "hf-pause"
    finish = threading.Event()

    def stop_when_told(state: Any, control: Any) -> None:
        if finish.is_set():
            control.should_training_stop = True

    cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, run))
    trainer = make_trainer(tmp_path / "out", [cb, When(stop_when_told)], max_steps=100_000, logging_steps=50)
    thread, errors = train_in_thread(trainer)
    try:
        wait_for(lambda: trainer.state.global_step >= 3, 30, what="training to start")
        http_json(f"{agent_url}/v1/runs/{run}/actions", {"action": "pause", "reason": "test"})
        status = wait_for(lambda: (s := http_json(f"{agent_url}/v1/runs/{run}"))["state"] == "paused" and s,
                          15, what="run paused")
        assert cb.patrol is not None and cb.patrol.state == "paused"
        paused_at = trainer.state.global_step
        assert status["ranks"][0]["step"] == paused_at == cb.patrol.step_count
        pause = [a for a in cb.patrol.actions if a.action == "pause"]
        assert [(a.step, a.outcome) for a in pause] == [(paused_at, "ok")]
        assert (Path(pause[0].checkpoint) / "meta.json").is_file()  # a pause writes Patrol's checkpoint
        threading.Event().wait(1.0)
        assert trainer.state.global_step == paused_at and thread.is_alive()

        http_json(f"{agent_url}/v1/runs/{run}/actions", {"action": "resume"})
        wait_for(lambda: trainer.state.global_step >= paused_at + 5, 15, what="steps after resume")
        assert http_json(f"{agent_url}/v1/runs/{run}")["state"] == "running"
    finally:
        finish.set()
        thread.join(30)
    assert not thread.is_alive() and not errors
    assert [a.action for a in cb.patrol.actions] == ["pause", "resume"]


def test_stop_saves_a_checkpoint_the_trainer_resumes_from(tmp_path: Path, agent_url: str) -> None:
    run = "hf-stop"
    reference = make_trainer(tmp_path / "ref", [], max_steps=8)
    reference.train()
    ref_loss = {e["step"]: e["loss"] for e in reference.state.log_history if "loss" in e}

    cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, run))

    def request_stop(state: Any, control: Any) -> None:
        if state.global_step == 3:
            assert cb.patrol is not None
            cb.patrol.request("stop", "test")

    out = tmp_path / "out"
    trainer = make_trainer(out, [cb, When(request_stop)], max_steps=8)
    with pytest.raises(SystemExit) as exc:
        trainer.train()
    assert exc.value.code == STOP_EXIT_CODE == 86
    assert cb.patrol is not None and cb.patrol.state == "stopped"
    [stop] = [a for a in cb.patrol.actions if a.action == "stop"]
    assert (stop.step, stop.outcome) == (4, "ok")
    ckpt = out / "checkpoint-4"
    assert (ckpt / "trainer_state.json").is_file() and (ckpt / "optimizer.pt").is_file()
    status = wait_for(lambda: (s := http_json(f"{agent_url}/v1/runs/{run}"))["state"] == "stopped" and s,
                      10, what="run stopped")
    assert status["last_action"]["action"] == "stop" and status["last_action"]["step"] == 4

    # the same run name: the agent tells the resumed Patrol from the stopped one in this process by its instance
    resumed_cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, run))
    resumed = make_trainer(out, [resumed_cb], max_steps=8)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 8
    after = {e["step"]: e["loss"] for e in resumed.state.log_history if "loss" in e and e["step"] > 4}
    assert sorted(after) == [5, 6, 7, 8]
    # the resumed run continues the interrupted one exactly: same data order, weights and optimizer state
    assert after == {s: ref_loss[s] for s in after}
    assert resumed_cb.patrol is not None and resumed_cb.patrol.step_count == 8
    assert exposed(agent_url, "trainpatrol_step_total", run) == 8


def test_construction_errors_quote_the_call() -> None:
    with pytest.raises(ValueError, match=r"grad_accum_steps=2"):
        TrainPatrolCallback(grad_accum_steps=2, embedded_agent=False)


def test_logging_every_n_steps_keeps_per_step_loss(tmp_path: Path, agent_url: str) -> None:
    cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, "hf-every-4"))
    trainer = make_trainer(tmp_path / "out", [cb], max_steps=8, logging_steps=4)
    trainer.train()
    logs = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    assert sorted(logs) == [4, 8]
    patrol = cb.patrol
    assert patrol is not None and patrol.step_count == 8
    records = [patrol._history.get(s) for s in range(1, 9)]
    losses = [r.loss for r in records if r is not None]
    for end in (4, 8):
        # the Trainer logs the mean over its logging window; Patrol holds each step's loss
        assert sum(losses[end - 4:end]) / 4 == pytest.approx(logs[end]["loss"], rel=1e-6)
        assert patrol._history.get(end).grad_norm == logs[end]["grad_norm"]  # type: ignore[union-attr]
    assert all(r is not None and r.grad_norm != r.grad_norm for r in records[:3])  # NaN: no norm on unlogged steps


def test_nan_hidden_by_the_trainers_filter_trips_the_guard(tmp_path: Path, agent_url: str) -> None:
    cfg = replace(patrol_config(tmp_path, agent_url, "hf-nan"), guard_actions={"nonfinite_loss": "stop"})
    cb = TrainPatrolCallback(cfg)

    def poison(state: Any, control: Any) -> None:
        if state.global_step == 4:  # step 5's loss is NaN
            with torch.no_grad():
                trainer.model.transformer.ln_f.weight[0] = float("nan")

    out = tmp_path / "out"
    trainer = make_trainer(out, [cb, When(poison)], max_steps=20)
    with pytest.raises(SystemExit) as exc:
        trainer.train()
    assert exc.value.code == STOP_EXIT_CODE
    logged = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    assert logged[5] == logged[5] and logged[5] < 10  # logging_nan_inf_filter logged a finite stand-in
    assert cb.patrol is not None and cb.patrol._totals.nonfinite_loss == 1
    assert [(a.action, a.step) for a in cb.patrol.actions] == [("stop", 5)]
    assert (out / "checkpoint-5" / "trainer_state.json").is_file()


def test_checkpoint_action_makes_the_trainer_save(tmp_path: Path, agent_url: str) -> None:
    cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, "hf-ckpt"))

    def ask(state: Any, control: Any) -> None:
        if state.global_step == 2:
            assert cb.patrol is not None
            cb.patrol.request("checkpoint", "test")

    out = tmp_path / "out"
    make_trainer(out, [cb, When(ask)], max_steps=5).train()
    assert cb.patrol is not None
    assert [(a.action, a.step, a.outcome) for a in cb.patrol.actions] == [("checkpoint", 3, "ok")]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]  # save_strategy="no" otherwise
    assert (Path(cb.patrol.last_checkpoint) / "meta.json").is_file()


def test_without_a_model_loss_steps_still_count(tmp_path: Path, agent_url: str) -> None:
    def loss_fn(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
        logits = outputs["logits"][:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1))

    cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, "hf-custom-loss"))
    trainer = make_trainer(tmp_path / "out", [cb], max_steps=6, logging_steps=3)
    trainer.compute_loss_func = loss_fn  # labels no longer reach the model, so it returns no loss
    trainer.train()
    logs = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    patrol = cb.patrol
    assert patrol is not None and patrol.step_count == trainer.state.global_step == 6
    assert [patrol._history.get(s) is not None for s in range(1, 7)] == [False, False, True, False, False, True]
    assert patrol._history.get(6).loss == logs[6]["loss"]  # type: ignore[union-attr]


def nan_loss_from(trainer: Any, first: int, last: int) -> Any:
    """A forward hook that makes the training loss NaN on steps ``first``..``last`` (1-based)."""

    def hook(module: Any, args: Any, kwargs: Any, output: Any) -> Any:
        step = trainer.state.global_step + 1
        if module.training and first <= step <= last:
            output["loss"] = output["loss"] * float("nan")
        return output

    return trainer.model.register_forward_hook(hook, with_kwargs=True)


def test_a_nan_step_pauses_with_finite_weights_and_a_finite_checkpoint(tmp_path: Path, agent_url: str) -> None:
    cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, "hf-nan-pause"))
    out = tmp_path / "out"
    trainer = make_trainer(out, [cb], max_steps=40)
    nan_loss_from(trainer, 10, 10)
    thread, errors = train_in_thread(trainer)
    wait_for(lambda: cb.patrol is not None and cb.patrol.state == "paused", 60, what="paused by the guard")
    assert cb.patrol is not None
    pause = next(a for a in cb.patrol.actions if a.action == "pause")
    assert pause.step == 10
    assert json.loads((Path(pause.checkpoint) / "meta.json").read_text())["finite"] is True
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    cb.patrol.request("stop", "end")
    thread.join(60)
    assert [type(e) for e in errors] == [SystemExit] and errors[0].args == (STOP_EXIT_CODE,)
    hf = torch.load(out / "checkpoint-10" / "optimizer.pt", weights_only=False)
    assert all(torch.isfinite(v).all() for s in hf["state"].values() for v in s.values() if v.is_floating_point())


def test_a_resumed_run_that_is_still_nan_pauses_again(tmp_path: Path, agent_url: str) -> None:
    cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, "hf-sick"))
    trainer = make_trainer(tmp_path / "out", [cb], max_steps=60)
    nan_loss_from(trainer, 10, 10**6)  # every step from 10 on: the fault persists
    thread, errors = train_in_thread(trainer)
    wait_for(lambda: cb.patrol is not None and cb.patrol.state == "paused", 60, what="first pause")
    assert cb.patrol is not None
    for expected in (11, 12):
        cb.patrol.request("resume", "a person")
        wait_for(lambda at=expected: [a.step for a in cb.patrol.actions if a.action == "pause"][-1:] == [at],  # type: ignore[union-attr]
                 60, what=f"pause again at step {expected}")
    cb.patrol.request("stop", "end")
    thread.join(60)
    assert [type(e) for e in errors] == [SystemExit]
    assert [(a.action, a.step) for a in cb.patrol.actions] == [
        ("pause", 10), ("resume", 10), ("pause", 11), ("resume", 11), ("pause", 12), ("stop", 12)]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_learning_rate_blow_up_pauses_within_five_steps_by_default(tmp_path: Path, agent_url: str) -> None:
    cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, "hf-lr-blowup"))
    out = tmp_path / "out"
    trainer = make_trainer(out, [cb], max_steps=200)

    def blow_up(state: Any, control: Any) -> None:
        if state.global_step == 60:  # step 61 on runs at 1e4 times the learning rate, as the run did
            trainer.lr_scheduler.base_lrs = [lr * 1e4 for lr in trainer.lr_scheduler.base_lrs]
            for group in trainer.optimizer.param_groups:
                group["lr"] *= 1e4

    trainer.add_callback(When(blow_up))
    thread, errors = train_in_thread(trainer)
    wait_for(lambda: cb.patrol is not None and cb.patrol.state == "paused", 60, what="paused by a guard")
    assert cb.patrol is not None
    pause = next(a for a in cb.patrol.actions if a.action == "pause")
    assert 61 <= pause.step <= 65, pause
    trips = {g: n for g, n in cb.patrol._guards.trips.items() if n}
    assert set(trips) <= {"loss_spike", "grad_norm_explosion", "nonfinite_loss", "nonfinite_grad"} and trips
    cb.patrol.request("stop", "end")
    thread.join(60)
    assert [type(e) for e in errors] == [SystemExit]


def test_a_healthy_trainer_run_keeps_every_guard_quiet(tmp_path: Path, agent_url: str) -> None:
    cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, "hf-healthy"))
    make_trainer(tmp_path / "out", [cb], max_steps=150).train()
    assert cb.patrol is not None and cb.patrol.step_count == 150
    assert {g: n for g, n in cb.patrol._guards.trips.items() if n} == {}
    assert [a.action for a in cb.patrol.actions] == []
