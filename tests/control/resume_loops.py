"""Real small training loops (an MLP, a char-level model with a shuffled DataLoader) for stop/resume tests."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import torch

from servers import wait_for
from trainpatrol import Patrol, PatrolConfig
from trainpatrol.control import state_file

TEXT = ("the quick brown fox jumps over the lazy dog while a patrol watches every step of the run; " * 40)
VOCAB = sorted(set(TEXT))
CONTEXT = 8


def config(tmp: Path, run: str, **overrides: Any) -> PatrolConfig:
    return PatrolConfig(run=run, agent_url="http://127.0.0.1:9", embedded_agent=False,
                        checkpoint_dir=str(tmp / "ckpt"), evidence_dir=str(tmp / "evidence"),
                        push_interval_seconds=3600.0, pause_poll_seconds=0.02, **overrides)


def mlp(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def mlp_loss(model: torch.nn.Module) -> torch.Tensor:
    x = torch.randn(16, 8)
    return ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()


class CharWindows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Next-character prediction over a fixed text; a random crop jitter uses torch's RNG in __getitem__."""

    def __init__(self) -> None:
        self.ids = torch.tensor([VOCAB.index(c) for c in TEXT])

    def __len__(self) -> int:
        return len(self.ids) - CONTEXT - 2

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = i + int(torch.randint(0, 2, ()))  # augmentation that consumes the (worker's) RNG
        return self.ids[j:j + CONTEXT], self.ids[j + CONTEXT]


def char_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(len(VOCAB), 16), torch.nn.Flatten(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16 * CONTEXT, 64), torch.nn.ReLU(), torch.nn.Linear(64, len(VOCAB)))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def char_loader(num_workers: int) -> torch.utils.data.DataLoader[Any]:
    return torch.utils.data.DataLoader(CharWindows(), batch_size=32, shuffle=True, num_workers=num_workers)


def train_chars(patrol: Patrol, model: torch.nn.Module, opt: torch.optim.Optimizer,
                loader: torch.utils.data.DataLoader[Any], until: int, losses: list[float], epochs_from: int = 0,
                stop_at: int = 0) -> None:
    """The README loop over epochs, appending every loss, to ``until`` steps; ``stop_at``: ask for a stop there
    (as `trainpatrol stop` would), carried out at the next boundary."""
    for _epoch in range(epochs_from, 100):
        for x, y in patrol.loader(loader):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            patrol.step(loss, batch_size=len(y))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if patrol.step_count == stop_at:
                patrol.request("stop", "operator stop")
            if patrol.step_count >= until:
                return


def run_until_stopped(fn: Any) -> int | None:
    try:
        fn()
    except SystemExit as exc:
        return int(exc.code) if exc.code is not None else 0
    return None



def pause_then_stop(patrol: Patrol, fn: Any) -> int | None:
    """Run the loop ``fn`` in a thread until the run pauses, then stop it; returns the loop's exit code."""
    result: list[int | None] = []
    t = threading.Thread(target=lambda: result.append(run_until_stopped(fn)), daemon=True)
    t.start()
    wait_for(lambda: patrol.state == "paused", 30, what="paused")
    patrol.request("stop", "test over")
    t.join(30)
    return result[0]


def nonfinite_tensors(checkpoint: Path) -> list[str]:
    state = state_file.read(checkpoint / "state.bin")
    bad = [f"model:{k}" for k, v in state["model"].items() if not torch.isfinite(v).all()]
    for pid, s in state["optimizer"]["state"].items():
        bad += [f"optimizer:{pid}.{k}" for k, v in s.items()
                if isinstance(v, torch.Tensor) and v.is_floating_point() and not torch.isfinite(v).all()]
    return bad


def meta(checkpoint: Path) -> dict[str, Any]:
    return dict(json.loads((checkpoint / "meta.json").read_text()))

