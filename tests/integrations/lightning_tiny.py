"""A small LightningModule that records its own loss, pre-clip grad norm and learning rate per step.

Also the worker of the 2-process DDP test: ``python lightning_tiny.py OUT_DIR AGENT_URL RUN`` with
LOCAL_RANK/NODE_RANK/MASTER_ADDR/MASTER_PORT set, so Lightning joins processes it did not launch.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

FEATURES = 8


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.learning_rates: list[float] = []
        self._step_loss: torch.Tensor | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Lightning's own per-batch loss (divided by accumulate_grad_batches), summed per optimizer step
        part = outputs["loss"].detach()
        self._step_loss = part if self._step_loss is None else self._step_loss + part
        if not self.trainer.fit_loop.epoch_loop._should_accumulate():
            self.losses.append(float(self._step_loss))
            self._step_loss = None

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.grad_norms.append(float(torch.nn.utils.get_total_norm(grads)))
        self.learning_rates.append(float(optimizer.param_groups[0]["lr"]))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=50)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(n: int = 64, batch_size: int = 8) -> DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, FEATURES, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def trainer(root: Path, callbacks: list[Any], max_steps: int, **kwargs: Any) -> pl.Trainer:
    settings: dict[str, Any] = {
        "accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
        "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0, **kwargs}
    return pl.Trainer(default_root_dir=str(root), max_steps=max_steps, callbacks=callbacks, **settings)


class RequestAt(pl.Callback):
    """Requests ``action`` from this rank's Patrol as the batch after ``step`` optimizer steps begins."""

    def __init__(self, cb: Any, step: int, action: str) -> None:
        self.cb, self.step, self.action = cb, step, action

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == self.step and self.cb.patrol is not None:
            self.cb.patrol.request(self.action, "test", source="test")


def ddp_worker(out: Path, agent_url: str, run: str) -> None:
    from trainpatrol import PatrolConfig
    from trainpatrol.integrations.lightning import TrainPatrolCallback

    rank = int(os.environ["LOCAL_RANK"])
    cfg = PatrolConfig(run=run, agent_url=agent_url, embedded_agent=False, push_interval_seconds=0.1,
                       checkpoint_dir=str(out / "patrol-ckpt"), evidence_dir=str(out / "evidence"))
    cb = TrainPatrolCallback(cfg)
    callbacks: list[Any] = [cb]
    if rank == 0:  # only rank 0 asks: the coordinator makes rank 1 pause at the same step
        callbacks.append(RequestAt(cb, 3, "pause"))
    trainer_ = trainer(out, callbacks, max_steps=40, devices=2, strategy="ddp", use_distributed_sampler=False)
    seen: dict[str, Any] = {}

    def watch() -> None:  # this rank's own record of where it stood while paused
        while "paused_at" not in seen:
            if cb.patrol is not None and cb.patrol.state == "paused":
                seen["paused_at"] = trainer_.global_step
                seen["module_steps_at_pause"] = len(module.grad_norms)  # optimizer steps it took
            time.sleep(0.02)

    module = Tiny()
    threading.Thread(target=watch, daemon=True).start()
    trainer_.fit(module, train_dataloaders=data(n=512))
    assert cb.patrol is not None
    result = {"rank": trainer_.global_rank, "world_size": trainer_.world_size, "final_step": trainer_.global_step,
              "actions": [a.model_dump() for a in cb.patrol.actions], **seen}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    ddp_worker(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
