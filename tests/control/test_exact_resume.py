"""A restored run continues the trajectory of an uninterrupted one bit for bit, shuffled DataLoader included."""

from __future__ import annotations

from pathlib import Path

import pytest
from resume_loops import char_loader, char_model, config, run_until_stopped, train_chars

from trainpatrol import STOP_EXIT_CODE, Patrol

STEPS = 150  # an epoch is 112 batches: the run crosses into the second epoch


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop_at", [40, 130], ids=["first-epoch", "second-epoch"])
def test_restore_after_a_stop_replays_the_uninterrupted_losses_exactly(tmp_path: Path, workers: int,
                                                                       stop_at: int) -> None:
    model, opt = char_model()
    reference: list[float] = []
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path / "ref", "ref"))
    train_chars(patrol, model, opt, char_loader(workers), STEPS, reference)
    patrol.close()
    assert len(reference) == STEPS

    model, opt = char_model()
    first: list[float] = []
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path / "run", "run"))
    code = run_until_stopped(lambda: train_chars(patrol, model, opt, char_loader(workers), STEPS, first,
                                                 stop_at=stop_at))
    patrol.close()
    assert code == STOP_EXIT_CODE and first == reference[:stop_at]

    model, opt = char_model(seed=77)  # a fresh process: other weights, another RNG
    resumed: list[float] = []
    patrol = Patrol(model=model, optimizer=opt, config=config(tmp_path / "run", "run"))
    restored = patrol.restore("latest")
    assert restored.step == stop_at and restored.epoch == stop_at // 112
    train_chars(patrol, model, opt, char_loader(workers), STEPS, resumed, epochs_from=restored.epoch)
    patrol.close()
    assert resumed == reference[stop_at:]  # exact float equality, every step
