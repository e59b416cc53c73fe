"""Hugging Face ``Trainer`` callback: ``Trainer(..., callbacks=[TrainPatrolCallback(run="my-run")])``.

The Patrol is stepped once per optimizer step and acts at the step's end, through the Trainer's own control
flags where they fit; what it reads (without a host-device sync of its own) and how each action maps onto the
Trainer is in docs/integrations.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..actions import STOP_EXIT_CODE
from ..probe.config import PatrolConfig
from ..probe.patrol import Patrol
from ._common import boundary, patrol_or_config

log = logging.getLogger("trainpatrol")

__all__ = ["TrainPatrolCallback"]


class TrainPatrolCallback(TrainerCallback):  # type: ignore[misc,unused-ignore]  # Any without transformers
    """Feeds a Patrol from the Trainer and carries out its agreed actions at step ends.

    Pass a ``Patrol``, a ``PatrolConfig`` and/or ``PatrolConfig`` fields as keywords. Built from a config,
    the Patrol is created at ``on_train_begin`` (after ``torch.distributed`` is up, so ranks agree) with
    the Trainer's model, optimizer and scheduler, and closed at ``on_train_end``.
    """

    def __init__(self, patrol: Patrol | PatrolConfig | None = None, **config: Any) -> None:
        self.patrol, self._config = patrol_or_config(patrol, config, "the Trainer")
        self._owned = self.patrol is None
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._micro: list[torch.Tensor] = []
        self._forwards = 0
        """Training forward passes of this step: one per micro-batch, so one per backward pass."""
        self._scaled = False
        self._loss_scale = 1
        self._samples = self._tokens = 0
        self._step_loss: torch.Tensor | None = None
        self._learning_rates: list[float] = []
        self._due = False
        self._stopping = False
        self._warned_no_loss = False
        self._last_hook = time.perf_counter()

    # --- hooks -------------------------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: torch.nn.Module | None = None, optimizer: Any = None, lr_scheduler: Any = None,
                       **kwargs: Any) -> None:
        """Build (or complete) the Patrol, align it to the Trainer's step and hook the model's loss."""
        if self._owned:  # a new one for every train() call: the last one was closed
            assert self._config is not None
            # built without the model, so Patrol computes no grad norm of its own from zeroed grads
            self.patrol = Patrol(optimizer=optimizer, scheduler=lr_scheduler, device=args.device, config=self._config)
        assert self.patrol is not None
        # the Trainer's own count (PreTrainedModel.floating_point_ops): 6 x the non-embedding parameters a token
        count = getattr(model, "num_parameters", None)
        per_token = 6.0 * count(exclude_embeddings=True) if callable(count) else 0.0
        self.patrol._attach(state.global_step, model, optimizer, lr_scheduler, flops_per_token=per_token)
        self._stopping = self._due = False
        average_tokens = getattr(args, "average_tokens_across_devices", False)  # transformers >= 4.46
        self._loss_scale = args.world_size if average_tokens and args.world_size > 1 else 1
        if model is not None:
            self._hook = model.register_forward_hook(self._on_forward, with_kwargs=True)
        self._last_hook = time.perf_counter()

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        """Start timing the loader wait (the epoch's first fetch builds the iterator)."""
        self._last_hook = time.perf_counter()

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        """Count the batch fetch that just happened as loader wait; start a new step."""
        if self._due:  # the Trainer did not log the step it said it would: finish it without its values
            self._finish(state, control, None, None)
        if self.patrol is not None:
            self.patrol._waited(time.perf_counter() - self._last_hook)
        self._micro, self._samples, self._tokens, self._scaled = [], 0, 0, False
        self._forwards = 0

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                          optimizer: Any = None, **kwargs: Any) -> None:
        """Read the learning rates of this step (the scheduler steps after this hook)."""
        opt = optimizer or (self.patrol.optimizer if self.patrol else None)
        if opt is not None:
            self._learning_rates = [float(g["lr"]) for g in opt.param_groups if isinstance(g.get("lr"), float | int)]

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        """Step the Patrol and act, unless the Trainer logs this step: then ``on_log`` does both."""
        self._step_loss = self._reduce()
        self._due = True
        if control.should_log:  # set by DefaultFlowCallback, which runs before user callbacks
            return
        self._finish(state, control, None, None)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        """Step the Patrol with the Trainer's logged grad norm, then act (before the Trainer saves)."""
        if self._due and logs is not None and "loss" in logs:
            self._finish(state, control, logs.get("grad_norm"), logs["loss"])

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    metrics: dict[str, float] | None = None, **kwargs: Any) -> None:
        """Record ``eval_loss`` as the validation loss."""
        if self.patrol is not None and metrics and "eval_loss" in metrics:
            self.patrol.evaluate(metrics["eval_loss"])
        self._last_hook = time.perf_counter()

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        """After an agreed ``stop``, exit with ``STOP_EXIT_CODE`` once the Trainer's checkpoint is written."""
        self._last_hook = time.perf_counter()
        if self._stopping:
            self._close()
            raise SystemExit(STOP_EXIT_CODE)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        """Unhook the model and close a Patrol this callback built (a final push)."""
        self._close()
        if self._stopping:
            raise SystemExit(STOP_EXIT_CODE)

    # --- internals ---------------------------------------------------------------------------
    def _on_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    output: Any) -> None:
        if not module.training:
            return
        self._forwards += 1
        loss = output.get("loss") if isinstance(output, Mapping) else None
        if loss is None and isinstance(output, tuple | list) and output and "labels" in kwargs:
            loss = output[0]
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._micro.append(loss.detach())
            # the Trainer passes num_items_in_batch only when the model normalises over the whole step
            self._scaled = kwargs.get("num_items_in_batch") is not None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.dim() >= 1:
            self._samples += ids.shape[0]
            self._tokens += ids.numel() if ids.dim() >= 2 else 0

    def _reduce(self) -> torch.Tensor | None:
        """The step's loss as the Trainer computes its ``tr_loss`` (same operations, same order)."""
        if not self._micro:
            return None
        if not self._scaled:  # a per-batch mean: the Trainer divides it by the number of micro-batches
            parts = [m / len(self._micro) for m in self._micro]
        elif self._loss_scale != 1:  # normalised over all ranks' tokens: the Trainer scales it back up
            parts = [m * self._loss_scale for m in self._micro]
        else:
            parts = self._micro
        return sum(parts[1:], parts[0])

    def _finish(self, state: TrainerState, control: TrainerControl, grad_norm: float | None,
                logged_loss: float | None) -> None:
        self._due = False
        patrol = self.patrol
        if patrol is None:
            return
        loss = self._step_loss
        if loss is None and logged_loss is not None:
            loss = torch.tensor(logged_loss, dtype=torch.float64)
        if loss is None and not self._warned_no_loss:
            self._warned_no_loss = True
            log.warning("trainpatrol: the model returned no loss (a custom compute_loss?); steps are counted "
                        "and actions work, but the loss is seen only on steps the Trainer logs")
        patrol._framework_step(state.global_step, self._forwards, loss, grad_norm=grad_norm, batch_size=self._samples,
                               tokens=self._tokens, learning_rates=self._learning_rates or None)
        self._step_loss = None
        self._boundary(control)
        self._last_hook = time.perf_counter()

    def _boundary(self, control: TrainerControl) -> None:
        assert self.patrol is not None
        stopping, checkpointed = boundary(self.patrol)
        self._stopping |= stopping
        control.should_save |= stopping or checkpointed
        control.should_training_stop |= stopping

    def _close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._owned and self.patrol is not None:
            self.patrol.close()
