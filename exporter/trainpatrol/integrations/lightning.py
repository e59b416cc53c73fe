"""Lightning callback: ``Trainer(..., callbacks=[TrainPatrolCallback(run="my-run")])``, DDP included.

The Patrol is stepped once per optimizer step, in ``on_train_batch_end``, and acts right after; what it reads
(without a host-device sync of its own), how each action maps onto Lightning and how to resume exactly
(``callback.loader``) is in docs/integrations.md. Under DDP, pass a config (not a Patrol built before ``fit``):
the Patrol is built in ``on_train_start``, once ``torch.distributed`` is up, so every rank acts at the same step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from ..actions import STOP_EXIT_CODE
from ..probe import device_values as dv
from ..probe.config import PatrolConfig
from ..probe.loader import TimedLoader
from ..probe.patrol import Patrol
from ._common import boundary, patrol_or_config

log = logging.getLogger("trainpatrol")

__all__ = ["TrainPatrolCallback"]


class TrainPatrolCallback(pl.Callback):  # type: ignore[misc,unused-ignore]  # Any without lightning
    """Feeds a Patrol from Lightning's hooks and carries out its agreed actions after each optimizer step.

    Pass a ``Patrol``, a ``PatrolConfig`` and/or ``PatrolConfig`` fields as keywords. Built from a config,
    the Patrol gets the LightningModule, the optimizer and its scheduler, and is closed when training ends.
    """

    def __init__(self, patrol: Patrol | PatrolConfig | None = None, *, val_loss_key: str = "val_loss",
                 **config: Any) -> None:
        self.patrol, self._config = patrol_or_config(patrol, config, "Lightning")
        self.val_loss_key = val_loss_key
        self.last_trainer_checkpoint = ""
        """Path of the last checkpoint this callback had Lightning write (for ``fit(ckpt_path=...)``)."""
        self._owned = self.patrol is None
        self._seen_step = 0
        self._loss: torch.Tensor | None = None
        self._micro = self._samples = self._tokens = 0
        self._grad_norm: torch.Tensor | None = None
        self._grad_norm_step = -1
        self._learning_rates: list[float] = []
        self._warned_no_loss = False
        self._last_hook = time.perf_counter()
        self._loader: TimedLoader[Any] | None = None

    def loader(self, dataloader: Any) -> TimedLoader[Any]:
        """``dataloader`` as a resumable loader: its position and RNG go into Lightning's checkpoints."""
        self._loader = TimedLoader(dataloader)
        return self._loader

    # --- hooks -------------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Build (or complete) the Patrol once the process group is up; align it to the global step."""
        optimizer = trainer.optimizers[0] if len(trainer.optimizers) == 1 else None
        configs = trainer.lr_scheduler_configs
        scheduler = configs[0].scheduler if len(configs) == 1 else None
        if self._owned:  # a new one for every fit() call: the last one was closed
            assert self._config is not None
            scaler = getattr(trainer.precision_plugin, "scaler", None)  # fp16 AMP: Patrol exports the loss scale
            self.patrol = Patrol(model=pl_module, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                                 config=self._config)
        assert self.patrol is not None
        # Lightning's convention (ThroughputMonitor): the module's flops_per_batch, forward and backward of a batch
        per_batch = getattr(pl_module, "flops_per_batch", None)
        per_step = float(per_batch) * trainer.accumulate_grad_batches if isinstance(per_batch, int | float) else 0.0
        distributed = self.patrol._attach(trainer.global_step, pl_module, optimizer, scheduler, flops_per_step=per_step)
        if not self._owned and trainer.world_size > 1 and not distributed:
            log.warning("trainpatrol: this Patrol was built before torch.distributed was initialised, so ranks "
                        "will not agree on actions; give TrainPatrolCallback a PatrolConfig instead")
        self._seen_step = trainer.global_step
        self._reset_step()
        self._last_hook = time.perf_counter()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start timing the loader wait (the epoch's first fetch builds the iterator)."""
        self._last_hook = time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """Count the fetch of this batch as loader wait."""
        if self.patrol is not None:
            self.patrol._waited(time.perf_counter() - self._last_hook)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        """Take the pre-clip grad norm (on the device) and the learning rates this step uses."""
        if self._grad_norm_step != trainer.global_step:
            self._grad_norm_step = trainer.global_step
            self._grad_norm = dv.total_grad_norm(pl_module.parameters())
            if self.patrol is not None:  # Lightning's closure ran backward inside optimizer.step(): judge it now
                self.patrol._judge_update(self._grad_norm)
            self._learning_rates = [float(g["lr"]) for opt in trainer.optimizers for g in opt.param_groups
                                    if isinstance(g.get("lr"), float | int)]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Accumulate the batch; after an optimizer step, step the Patrol and carry out agreed actions."""
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss = loss.detach()
            self._loss = loss if self._loss is None else self._loss + loss
        self._micro += 1
        if self._loader is not None:  # Lightning fetches a batch ahead: what was trained is the position to save
            self._loader.trained = batch_idx + 1
        samples, tokens = _batch_size(batch)
        self._samples += samples
        self._tokens += tokens
        if trainer.global_step > self._seen_step and self.patrol is not None:
            self._seen_step = trainer.global_step
            self._record(trainer.global_step)
            self._boundary(trainer)
        self._last_hook = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Record ``callback_metrics[val_loss_key]`` as the validation loss (off the hot path)."""
        value = trainer.callback_metrics.get(self.val_loss_key)
        if self.patrol is not None and value is not None and not trainer.sanity_checking:
            self.patrol.evaluate(value)
        self._last_hook = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Close a Patrol this callback built (a final push)."""
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Close a Patrol this callback built, ``stop``'s ``SystemExit`` included."""
        self._close()

    # --- internals ---------------------------------------------------------------------------
    def _record(self, step: int) -> None:
        patrol = self.patrol
        assert patrol is not None
        if self._loss is None and not self._warned_no_loss:
            self._warned_no_loss = True
            log.warning("trainpatrol: training_step returned no loss; steps are counted and actions work, "
                        "but no loss, grad norm or step time is recorded")
        patrol._framework_step(step, self._micro, self._loss, grad_norm=self._grad_norm, batch_size=self._samples,
                               tokens=self._tokens, learning_rates=self._learning_rates or None)
        self._reset_step()

    def _boundary(self, trainer: pl.Trainer) -> None:
        assert self.patrol is not None
        stopping, checkpointed = boundary(self.patrol)
        if stopping:
            self._save(trainer, "stop")
            raise SystemExit(STOP_EXIT_CODE)
        if checkpointed:
            self._save(trainer, "checkpoint")

    def _save(self, trainer: pl.Trainer, action: str) -> None:
        """Lightning's own resumable checkpoint; every rank calls it (it synchronises the ranks)."""
        ckpt = trainer.checkpoint_callback
        dirpath = ckpt.dirpath if isinstance(ckpt, ModelCheckpoint) and ckpt.dirpath else None
        directory = Path(dirpath or Path(trainer.default_root_dir) / "checkpoints")
        path = directory / f"trainpatrol-{action}-step={trainer.global_step}.ckpt"
        trainer.save_checkpoint(path)
        self.last_trainer_checkpoint = str(path)
        log.warning("trainpatrol: %s: Lightning checkpoint %s", action, path)

    def _reset_step(self) -> None:
        self._loss, self._micro, self._samples, self._tokens = None, 0, 0, 0
        self._grad_norm = None

    def _close(self) -> None:
        if self._owned and self.patrol is not None:
            self.patrol.close()


def _batch_size(batch: Any) -> tuple[int, int]:
    """(samples, tokens) from the batch's shapes only: ``input_ids`` of a dict, else the first tensor."""
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
            return ids.shape[0], ids.numel()
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        batch = next((b for b in batch if isinstance(b, torch.Tensor)), None)
    return (batch.shape[0], 0) if isinstance(batch, torch.Tensor) and batch.dim() >= 1 else (0, 0)
