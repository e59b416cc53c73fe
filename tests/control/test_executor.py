"""The executor through its collaborators: what each agreed action does and what it records."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from trainpatrol.actions import STOP_EXIT_CODE
from trainpatrol.control import state_file
from trainpatrol.control.checkpoint import Checkpointer, TrainingState, temp_path
from trainpatrol.control.commands import CommandBook, RunRecord
from trainpatrol.control.coordinator import Agreement, Coordinator
from trainpatrol.control.evidence import EvidenceWriter
from trainpatrol.control.executor import Executor, RankFacts


class OneRank:
    """The coordinator of a single rank: agreement is this rank's word; pause rounds follow a script."""

    def __init__(self, rounds: list[dict[str, int]]) -> None:
        self.rounds: Iterator[dict[str, int]] = iter(rounds)

    def all_true(self, ok: bool) -> bool:
        return ok

    def blocking_exchange(self, word: list[int], step: int) -> Agreement:
        return Agreement(step, next(self.rounds, {}), 0.0)


class Evidence:
    def __init__(self, tmp: Path) -> None:
        self.tmp, self.parts, self.indexes = tmp, [], []  # type: ignore[var-annotated]

    def bundle(self, clock: float, step: int, action: str) -> Path:
        return self.tmp / f"{action}-{step}"

    def part(self, bundle: Path, extra: dict[str, Any], nvml: Any = None) -> None:
        self.parts.append((bundle.name, extra))

    def index(self, bundle: Path, manifest: dict[str, Any], trigger: dict[str, Any]) -> None:
        self.indexes.append((bundle.name, manifest))

    def wait(self) -> None:
        pass


class Training:
    best_pending: float | None = None

    def sharded(self) -> bool:
        return False

    def replicated(self, step: int, *, sharded: bool = False) -> dict[str, Any]:
        return {"step": step, "model": {"w": torch.ones(2)}}

    def per_rank(self, step: int) -> dict[str, Any]:
        return {"step": step}


class Rig:
    def __init__(self, tmp: Path, rounds: list[dict[str, int]] | None = None) -> None:
        self.checkpointer = Checkpointer(tmp / "ckpt")
        self.commands = CommandBook("r", 0.0, on_request=lambda: None)
        self.record, self.evidence, self.announced = RunRecord(), Evidence(tmp), []  # type: ignore[var-annotated]
        self.rearmed = 0
        self.executor = Executor(
            RankFacts("r", 0, 1, torch.device("cpu"), {"nonfinite_loss": "pause"}, 0.0, 0.0),
            checkpointer=self.checkpointer, coordinator=cast(Coordinator, OneRank(rounds or [])),
            commands=self.commands, record=self.record, evidence=cast(EvidenceWriter, self.evidence),
            training=cast(TrainingState, Training()), control_word=lambda: [0],
            announce=lambda: self.announced.append(self.record.state), context=lambda: {"guard_trips": []},
            rearm_guards=self._rearm)

    def _rearm(self) -> None:
        self.rearmed += 1

    def full_disk_at(self, step: int) -> None:
        """The state written at ``step`` meets a full disk: its temporary file is a link to /dev/full."""
        target = self.checkpointer.path_for(step)
        target.mkdir(parents=True)
        temp_path(target / state_file.NAME).symlink_to("/dev/full")

    def agree(self, step: int, **commands: int) -> None:
        for action, cid in commands.items():
            self.commands.request(action, "test", command_id=cid)
        self.executor.execute(Agreement(step, commands, 0.0))

    def outcomes(self) -> list[tuple[str, str, int]]:
        return [(a.action, a.outcome, a.step) for a in self.record.actions]


def test_a_checkpoint_is_saved_recorded_and_indexed(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.agree(7, checkpoint=11)
    assert rig.outcomes() == [("checkpoint", "ok", 7)]
    assert (tmp_path / "ckpt" / "step-00000007" / "meta.json").is_file()
    assert rig.record.last_checkpoint == str(tmp_path / "ckpt" / "step-00000007")
    assert rig.record.last_checkpoint_step == 7.0 and rig.record.state == "running"
    assert rig.record.action_counts == {("checkpoint", "ok"): 1}
    assert rig.evidence.parts[0][1]["outcome"] == "ok" and rig.evidence.parts[0][1]["guard_trips"] == []
    assert rig.evidence.indexes[0][1]["finite"] is True and rig.commands.done[-1] == 11


def test_capture_writes_evidence_without_a_checkpoint(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.agree(3, capture=4)
    assert rig.outcomes() == [("capture", "ok", 3)]
    assert rig.record.last_checkpoint == "" and rig.record.last_evidence == str(tmp_path / "capture-3")


def test_a_pause_waits_until_resume_then_runs_with_guards_rearmed(tmp_path: Path) -> None:
    rig = Rig(tmp_path, rounds=[{}, {"capture": 21}, {"resume": 22}])
    rig.agree(5, pause=20)
    assert rig.outcomes() == [("pause", "ok", 5), ("capture", "ok", 5), ("resume", "ok", 5)]
    assert rig.announced == ["paused", "running"] and rig.rearmed == 1 and rig.record.state == "running"
    assert "nonfinite_loss -> pause" in rig.record.actions[-1].detail


def test_a_failed_save_leaves_the_run_paused_and_records_failed(tmp_path: Path) -> None:
    rig = Rig(tmp_path, rounds=[{"resume": 2}])
    rig.full_disk_at(9)
    rig.agree(9, checkpoint=1)
    assert rig.outcomes() == [("checkpoint", "failed", 9), ("resume", "ok", 9)]
    assert rig.announced[0] == "paused" and rig.record.checkpoint_failures == 1
    assert "No space left on device" in rig.record.actions[0].detail and rig.record.last_checkpoint == ""


def test_stop_checkpoints_then_exits_with_the_documented_code(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    with pytest.raises(SystemExit) as exited:
        rig.agree(4, stop=8)
    assert exited.value.code == STOP_EXIT_CODE == 86
    assert rig.outcomes() == [("stop", "ok", 4)] and rig.record.state == "stopped"
    assert rig.announced == ["stopped"]
    assert (tmp_path / "ckpt" / "step-00000004" / "meta.json").is_file()


def test_a_stop_asked_for_while_paused_ends_the_pause(tmp_path: Path) -> None:
    rig = Rig(tmp_path, rounds=[{"stop": 31}])
    with pytest.raises(SystemExit):
        rig.agree(2, pause=30)
    assert rig.outcomes() == [("pause", "ok", 2), ("stop", "ok", 2)]


def test_the_strongest_action_covers_the_rest_and_empty_cache_runs_first(tmp_path: Path) -> None:
    rig = Rig(tmp_path, rounds=[{"resume": 6}])
    rig.agree(10, empty_cache=2, capture=3, checkpoint=4, pause=5)
    assert rig.outcomes() == [
        ("empty_cache", "ok", 10), ("capture", "skipped", 10),
        ("checkpoint", "skipped", 10), ("pause", "ok", 10), ("resume", "ok", 10)]
    assert "covered by pause" in rig.record.actions[1].detail


def test_a_resume_alone_is_skipped_while_the_run_is_running(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.agree(3, resume=1)
    assert rig.outcomes() == [("resume", "skipped", 3)] and rig.record.state == "running"
    assert rig.record.actions[0].detail == "run was not paused"


def test_a_resume_agreed_at_the_step_of_its_pause_resumes_once_the_pause_is_saved(tmp_path: Path) -> None:
    # an operator's pause and resume that reach the ranks in one control round (a loaded host, a
    # long step): the pause is carried out, then the resume; the run does not wait for a second one
    rig = Rig(tmp_path, rounds=[{"stop": 9}])  # what a run left paused would meet next
    rig.agree(10, pause=5, resume=6)
    assert rig.outcomes() == [("pause", "ok", 10), ("resume", "ok", 10)]
    assert rig.announced == ["paused", "running"] and rig.record.state == "running" and rig.rearmed == 1
    assert (tmp_path / "ckpt" / "step-00000010" / "meta.json").exists()


def test_a_stop_agreed_with_a_pause_and_a_resume_stops(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    with pytest.raises(SystemExit):
        rig.agree(7, pause=5, resume=6, stop=8)
    assert rig.outcomes() == [("resume", "skipped", 7), ("pause", "skipped", 7), ("stop", "ok", 7)]
    assert rig.record.actions[0].detail == "covered by stop at the same step"


def test_a_command_already_done_is_not_carried_out_again(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.agree(1, capture=9)
    rig.executor.execute(Agreement(2, {"capture": 9}, 0.0))
    assert rig.outcomes() == [("capture", "ok", 1)]


def test_a_stop_whose_save_fails_still_stops_and_says_nothing_was_saved(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.agree(3, checkpoint=1)
    rig.full_disk_at(9)
    with pytest.raises(SystemExit) as exc:
        rig.agree(9, stop=2)
    assert exc.value.code == STOP_EXIT_CODE
    assert rig.record.state == "stopped" and rig.outcomes()[-1] == ("stop", "failed", 9)
    detail = rig.record.actions[-1].detail
    assert "nothing was saved at step 9" in detail and "step-00000003" in detail
    assert not (tmp_path / "ckpt" / "step-00000009").exists()
