"""Issue 9: the Lightning callback with a real Trainer and a real agent; a 2-process DDP pause on CPU (gloo)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from framework_helpers import exposed, patrol_config, run_value

from servers import free_port, http_json, python_env, wait_for
from trainpatrol import STOP_EXIT_CODE

pl = pytest.importorskip("lightning.pytorch")

from lightning_tiny import FEATURES, RequestAt, Tiny, data, trainer  # noqa: E402

from trainpatrol.integrations.lightning import TrainPatrolCallback  # noqa: E402

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("accum", [1, 2])
def test_exported_values_equal_the_modules_own_records(tmp_path: Path, agent_url: str, accum: int) -> None:
    run = f"pl-exact-{accum}"
    cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, run))
    module = Tiny()
    t = trainer(tmp_path, [cb], max_steps=12, accumulate_grad_batches=accum, gradient_clip_val=0.5)
    t.fit(module, train_dataloaders=data(n=512))
    patrol = cb.patrol
    assert patrol is not None and patrol.state == "closed"
    assert t.global_step == patrol.step_count == len(module.losses) == 12
    for step in range(1, 13):
        rec = patrol._history.get(step)
        assert rec is not None
        # loss: Lightning's own per-step value; grad norm: before clipping (clip is 0.5; the norms are larger)
        assert (rec.loss, rec.grad_norm) == (module.losses[step - 1], module.grad_norms[step - 1]), step
    assert max(module.grad_norms) > 0.5
    assert patrol._totals.micro_steps == 12 * accum and patrol._totals.samples == 12 * accum * 8
    assert exposed(agent_url, "trainpatrol_step_total", run) == 12
    assert exposed(agent_url, "trainpatrol_loss", run) == module.losses[-1]
    assert exposed(agent_url, "trainpatrol_grad_norm", run) == module.grad_norms[-1]
    assert exposed(agent_url, "trainpatrol_learning_rate", run, 'param_group="0",') == module.learning_rates[-1]


def test_the_modules_flops_per_batch_gives_the_run_its_flops_per_step(tmp_path: Path, agent_url: str) -> None:
    from lightning.fabric.utilities import measure_flops

    run = "pl-flops"
    with torch.device("meta"):  # as Lightning's ThroughputMonitor documents it: counted on a meta-device copy
        meta, x = Tiny(), torch.randn(8, FEATURES)
    module = Tiny()
    module.flops_per_batch = measure_flops(meta, lambda: meta.net(x), loss_fn=torch.Tensor.sum)
    assert module.flops_per_batch > 0
    cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, run))
    t = trainer(tmp_path, [cb], max_steps=4, accumulate_grad_batches=2)
    t.fit(module, train_dataloaders=data(n=512))
    assert run_value(agent_url, "trainpatrol_run_model_flops_per_step", run) == 2 * module.flops_per_batch


def test_pause_via_agent_blocks_until_resume(tmp_path: Path, agent_url: str) -> None:
    run = "pl-pause"
    finish = threading.Event()

    class StopWhenTold(pl.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            trainer.should_stop = trainer.should_stop or finish.is_set()

    cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, run))
    t = trainer(tmp_path, [cb, StopWhenTold()], max_steps=100_000, max_epochs=-1)
    errors: list[BaseException] = []

    def fit() -> None:
        try:
            t.fit(Tiny(), train_dataloaders=data(n=512))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    try:
        wait_for(lambda: t.global_step >= 3, 30, what="training to start")
        http_json(f"{agent_url}/v1/runs/{run}/actions", {"action": "pause", "reason": "test"})
        status = wait_for(lambda: (s := http_json(f"{agent_url}/v1/runs/{run}"))["state"] == "paused" and s,
                          15, what="run paused")
        assert cb.patrol is not None and cb.patrol.state == "paused"
        paused_at = t.global_step
        assert status["ranks"][0]["step"] == paused_at == cb.patrol.step_count
        assert [(a.action, a.step) for a in cb.patrol.actions] == [("pause", paused_at)]
        threading.Event().wait(1.0)
        assert t.global_step == paused_at and thread.is_alive()
        http_json(f"{agent_url}/v1/runs/{run}/actions", {"action": "resume"})
        wait_for(lambda: t.global_step >= paused_at + 5, 15, what="steps after resume")
        assert http_json(f"{agent_url}/v1/runs/{run}")["state"] == "running"
    finally:
        finish.set()
        thread.join(30)
    assert not thread.is_alive() and not errors
    assert [a.action for a in cb.patrol.actions] == ["pause", "resume"]


def test_stop_saves_a_checkpoint_lightning_resumes_from(tmp_path: Path, agent_url: str) -> None:
    reference = Tiny()
    trainer(tmp_path / "ref", [], max_steps=8).fit(reference, train_dataloaders=data(n=32))  # 4 batches an epoch

    cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, "pl-stop"))
    module = Tiny()
    t = trainer(tmp_path / "run", [cb, RequestAt(cb, 3, "stop")], max_steps=8)
    with pytest.raises(SystemExit) as exc:
        t.fit(module, train_dataloaders=data(n=32))
    assert exc.value.code == STOP_EXIT_CODE == 86
    assert cb.patrol is not None and cb.patrol.state == "stopped"
    assert [(a.action, a.step, a.outcome) for a in cb.patrol.actions] == [("stop", 4, "ok")]
    ckpt = Path(cb.last_trainer_checkpoint)
    assert ckpt.name == "trainpatrol-stop-step=4.ckpt" and ckpt.is_file()
    # the module's own on_train_batch_end runs after the callbacks', so it never saw step 4; Patrol did
    assert module.losses == reference.losses[:3]
    assert [cb.patrol._history.get(s).loss for s in range(1, 5)] == reference.losses[:4]  # type: ignore[union-attr]

    resumed_cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, "pl-stop"))  # same run, same process
    resumed = Tiny()
    t2 = trainer(tmp_path / "run", [resumed_cb], max_steps=8)
    t2.fit(resumed, train_dataloaders=data(n=32), ckpt_path=str(ckpt))
    assert t2.global_step == 8 and resumed_cb.patrol is not None and resumed_cb.patrol.step_count == 8
    # steps 5-8 continue the stopped run exactly: weights, momentum and the scheduler came back
    assert resumed.losses == reference.losses[4:]
    assert resumed.learning_rates == reference.learning_rates[4:]
    assert exposed(agent_url, "trainpatrol_step_total", "pl-stop") == 8


def test_ddp_two_ranks_pause_at_the_same_step(tmp_path: Path, agent_url: str) -> None:
    run = "pl-ddp"
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = python_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK="0", LOCAL_RANK=str(rank),
                         WORLD_SIZE="2", OMP_NUM_THREADS="1")
        log = open(tmp_path / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([sys.executable, str(HERE / "lightning_tiny.py"), str(tmp_path), agent_url,
                                        run], env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        def both_paused() -> Any:
            s = http_json(f"{agent_url}/v1/runs/{run}")
            return len(s["ranks"]) == 2 and all(r["state"] == "paused" for r in s["ranks"]) and s

        # a hang guard: two processes importing lightning share 2 cores with the other test workers
        status = wait_for(both_paused, 120, interval=0.2, what="both ranks paused")
        steps = {r["rank"]: r["step"] for r in status["ranks"]}
        threading.Event().wait(1.0)
        again = http_json(f"{agent_url}/v1/runs/{run}")
        assert {r["rank"]: r["step"] for r in again["ranks"]} == steps  # paused: no rank advances
        http_json(f"{agent_url}/v1/runs/{run}/actions", {"action": "resume"})
        for proc, _ in procs:
            proc.wait(timeout=120)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    logs = {r: (tmp_path / f"rank{r}.log").read_text() for r in (0, 1)}
    assert [p.returncode for p, _ in procs] == [0, 0], logs
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in results] == [0, 1] and all(r["world_size"] == 2 for r in results)
    pauses = [[a for a in r["actions"] if a["action"] == "pause"] for r in results]
    assert all(len(p) == 1 and p[0]["outcome"] == "ok" for p in pauses), pauses
    pause_step = pauses[0][0]["step"]
    # each rank's own records: the agreed step, the trainer's step seen while paused, the agent's view
    assert pauses[1][0]["step"] == pause_step > 3  # rank 0 asked after step 3; rank 1 never asked
    assert [r["paused_at"] for r in results] == [pause_step, pause_step]
    assert [r["module_steps_at_pause"] for r in results] == [pause_step, pause_step]
    assert steps == {0: pause_step, 1: pause_step}
    assert [r["final_step"] for r in results] == [40, 40]
    assert all([a["action"] for a in r["actions"]] == ["pause", "resume"] for r in results)


def test_checkpoint_action_writes_a_lightning_checkpoint(tmp_path: Path, agent_url: str) -> None:
    cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, "pl-ckpt"))
    t = trainer(tmp_path, [cb, RequestAt(cb, 2, "checkpoint")], max_steps=5)
    t.fit(Tiny(), train_dataloaders=data())
    assert t.global_step == 5 and cb.patrol is not None
    assert [(a.action, a.step, a.outcome) for a in cb.patrol.actions] == [("checkpoint", 3, "ok")]
    assert Path(cb.last_trainer_checkpoint) == tmp_path / "checkpoints" / "trainpatrol-checkpoint-step=3.ckpt"
    assert Path(cb.last_trainer_checkpoint).is_file()


def shuffled(n: int = 64) -> Any:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8,
                                       shuffle=True)


@pytest.mark.parametrize("stop_at", [5, 11], ids=["first-epoch", "second-epoch"])
def test_a_stopped_fit_resumes_a_shuffled_loader_mid_epoch_exactly(tmp_path: Path, agent_url: str,
                                                                   stop_at: int) -> None:
    torch.manual_seed(5)
    ref_cb = TrainPatrolCallback(patrol_config(tmp_path / "ref", agent_url, "pl-exact-ref"))
    reference = Tiny()
    trainer(tmp_path / "ref", [ref_cb], max_steps=20).fit(reference, train_dataloaders=ref_cb.loader(shuffled()))

    torch.manual_seed(5)
    cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, "pl-exact"))
    module = Tiny()
    with pytest.raises(SystemExit):
        trainer(tmp_path / "run", [cb, RequestAt(cb, stop_at, "stop")], max_steps=20).fit(
            module, train_dataloaders=cb.loader(shuffled()))
    assert module.losses == reference.losses[:stop_at]

    torch.manual_seed(99)  # a new process: the checkpoint must bring back the RNG and the loader's order
    resumed_cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, "pl-exact"))
    resumed = Tiny()
    trainer(tmp_path / "run", [resumed_cb], max_steps=20).fit(
        resumed, train_dataloaders=resumed_cb.loader(shuffled()), ckpt_path=cb.last_trainer_checkpoint)
    assert resumed.losses == reference.losses[stop_at + 1:]  # exact float equality


class NanAt(Tiny):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.nan_step = step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step + 1 == self.nan_step else loss


def test_a_nan_step_pauses_with_finite_weights_and_a_finite_checkpoint(tmp_path: Path, agent_url: str) -> None:
    cb = TrainPatrolCallback(patrol_config(tmp_path, agent_url, "pl-nan"))
    module = NanAt(6)
    t = trainer(tmp_path, [cb], max_steps=40)
    errors: list[BaseException] = []

    def fit() -> None:
        try:
            t.fit(module, train_dataloaders=data(n=512))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    wait_for(lambda: cb.patrol is not None and cb.patrol.state == "paused", 30, what="paused by the guard")
    assert cb.patrol is not None
    pause = next(a for a in cb.patrol.actions if a.action == "pause")
    assert pause.step == 6
    assert json.loads((Path(pause.checkpoint) / "meta.json").read_text())["finite"] is True
    assert all(torch.isfinite(p).all() for p in module.parameters())
    cb.patrol.request("stop", "end")
    thread.join(30)
    assert [type(e) for e in errors] == [SystemExit]
