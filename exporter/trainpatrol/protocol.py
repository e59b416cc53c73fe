"""Wire format between a rank's Patrol and its agent: the pushed snapshot and the reply's commands.

Cumulative values travel as totals, so an agent restart loses nothing: the next push restores them.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from .actions import Action
from .catalogue import RANK_METRICS, STEP_DURATION_BUCKETS

RUN_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
"""For pydantic (whose ``$`` is the end of the text); Python code tests names with ``valid_run``."""
_RUN = re.compile(RUN_PATTERN)


def valid_run(run: str) -> bool:
    """Is ``run`` a run name? A full match: Python's ``$`` also matches before a final newline."""
    return _RUN.fullmatch(run) is not None


NOT_PRINTABLE = ("is not printable UTF-8: control characters, line separators, direction overrides and lone "
                 "surrogates are refused")


def printable(value: str) -> str:
    """``value`` if it prints as it reads: no terminal escapes, newlines, bidi overrides or lone surrogates
    (which no UTF-8 writer can encode, so every later answer that holds them would fail)."""
    if not value.isprintable():
        raise ValueError(f"{value[:64]!r} {NOT_PRINTABLE}.")
    return value


Text = Annotated[str, AfterValidator(printable)]
"""A name, path or label value that the agent stores, serves and a terminal prints."""
DNS_LABEL = r"^([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)?$"
"""A Kubernetes namespace or container name (RFC 1123 label), or empty off Kubernetes."""
DNS_NAME = r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?)?$"
"""A Kubernetes pod or node name (RFC 1123 subdomain), or empty."""
JOB_ID = r"^[A-Za-z0-9_.:/@+=-]{0,253}$"
"""A launcher's job id or name: printable, no spaces or quotes."""
RankState = Literal["running", "pausing", "paused", "stopping", "stopped", "closed"]
_LABELS = {m.name: frozenset(m.labels) for m in RANK_METRICS if m.kind != "histogram"}
"""Each pushable rank metric's own label names (the histogram travels apart)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One series of a rank metric. A plain dataclass, which pydantic validates as it would a model,
    cheaper than a model for the hundred samples of every push."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # strict per field: a strict dataclass refuses dicts
    name: Annotated[str, Field(max_length=128, strict=True)]
    labels: Annotated[dict[str, Annotated[str, Field(max_length=256, strict=True)]], Field(max_length=16)] = \
        field(default_factory=dict)
    value: Annotated[float, Field(strict=True)]


class Histogram(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: Literal["trainpatrol_step_duration_seconds"] = "trainpatrol_step_duration_seconds"
    counts: list[float] = Field(description="Cumulative counts per bucket bound, the +Inf bucket last.")
    sum: float = Field(ge=0, allow_inf_nan=False)  # +Inf passes ge=0 and would be exported

    @field_validator("counts")
    @classmethod
    def _shape(cls, v: list[float]) -> list[float]:
        if not all(map(math.isfinite, v)):  # NaN passes every comparison below
            raise ValueError("Histogram counts must be finite numbers (no NaN or Infinity).")
        if len(v) != len(STEP_DURATION_BUCKETS) + 1:
            raise ValueError(f"Histogram needs {len(STEP_DURATION_BUCKETS) + 1} cumulative counts, got {len(v)}.")
        if any(map(operator.lt, v[1:], v)) or (v and v[0] < 0):  # some count below the one before it
            raise ValueError("Histogram counts must be cumulative (non-decreasing, non-negative).")
        return v


class ActionRecord(BaseModel):
    """What a rank did about one command."""

    model_config = ConfigDict(strict=True)
    id: int
    action: Action
    outcome: Literal["ok", "failed", "skipped"]
    step: int
    time: float
    detail: Text = Field(default="", max_length=4096)
    checkpoint: Text = Field(default="", max_length=4096)
    evidence: Text = Field(default="", max_length=4096)


class RankSnapshot(BaseModel):
    """One rank's state as pushed about once a second."""

    model_config = ConfigDict(extra="forbid", strict=True)
    run: str = Field(pattern=RUN_PATTERN)
    rank: int = Field(ge=0, le=1_000_000)
    local_rank: int = Field(default=0, ge=0, le=100_000)
    world_size: int = Field(default=1, ge=1, le=1_000_001)
    host: Text = Field(default="", max_length=253)
    pid: int = Field(default=0, ge=0)
    instance: Text = Field(default="", max_length=64)
    """Random per Patrol object: a new Patrol in the same process is a new sequence of pushes."""
    gpu_uuid: Text = Field(default="", max_length=128)
    namespace: str = Field(default="", pattern=DNS_LABEL)
    """The workload's identity on Kubernetes (probe.workload): on every series of the rank."""
    pod: str = Field(default="", pattern=DNS_NAME)
    container: str = Field(default="", pattern=DNS_LABEL)
    node: str = Field(default="", pattern=DNS_NAME)
    launcher: str = Field(default="", pattern=r"^[a-z0-9-]{0,32}$")
    """What started the job (``slurm``, ``torchrun``, ``jobset``, ...) and its job id: on ``rank_info``."""
    launcher_job: str = Field(default="", pattern=JOB_ID)
    restart_count: int = Field(default=0, ge=0, le=1_000_000)
    """torchrun's ``TORCHELASTIC_RESTART_COUNT``: how often the job was restarted before this incarnation."""
    model_flops_per_token: float = Field(default=0.0, ge=0, le=1e24)
    """The model's training FLOPs (forward and backward) per token, as given to Patrol; 0: not known."""
    model_flops_per_step: float = Field(default=0.0, ge=0, le=1e30)
    """Or per optimizer step, given or measured; 0: not known."""
    peak_flops: float = Field(default=0.0, ge=0, le=1e20)
    """The rank's device's dense peak FLOP/s in ``compute_dtype`` (probe.peak_flops); 0: not known."""
    compute_dtype: str = Field(default="", pattern=r"^[a-z0-9_]{0,16}$")
    seq: int = Field(default=0, ge=0)
    time: float = 0.0
    step: int = Field(default=0, ge=0)
    step_time: float = Field(default=0.0, ge=0)
    """The rank's wall clock when its last step ended (0 before the first), for the agent's last-step time."""
    state: RankState = "running"
    samples: list[Sample] = Field(default_factory=list, max_length=4096)
    histogram: Histogram | None = None
    actions: list[ActionRecord] = Field(default_factory=list, max_length=64)
    """The latest action records, newest last."""
    done_commands: list[int] = Field(default_factory=list, max_length=1024)
    last_checkpoint: Text = Field(default="", max_length=4096)
    evidence_dir: Text = Field(default="", max_length=4096)

    @field_validator("samples")
    @classmethod
    def _known(cls, samples: list[Sample]) -> list[Sample]:
        """Every sample is a catalogue metric with its own labels: one loop, not a validator per sample (the
        agent's busiest code)."""
        for i, s in enumerate(samples):
            expected = _LABELS.get(s.name)
            if expected is None:
                raise ValueError(f"samples.{i}: Unknown rank metric {s.name!r}: not in the catalogue.")
            if s.labels.keys() != expected:
                raise ValueError(f"samples.{i}: Metric {s.name!r} has labels {sorted(s.labels)}; "
                                 f"expected {sorted(expected)}.")
        if "".join([v for s in samples for v in s.labels.values()]).isprintable():  # one C call for all
            return samples
        for i, s in enumerate(samples):
            for name, value in s.labels.items():
                if not value.isprintable():
                    raise ValueError(f"samples.{i}: Label {name!r} {value[:64]!r} {NOT_PRINTABLE}.")
        return samples

    @model_validator(mode="after")
    def _rank_in_world(self) -> RankSnapshot:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}.")
        return self


class Command(BaseModel):
    """An action for a run, as carried to ranks in push replies."""

    id: int = Field(ge=1, lt=2**31)
    """Same on every agent for the same request (derived from the alert), so ranks dedupe."""
    run: str = Field(pattern=RUN_PATTERN)
    namespace: str = Field(default="", pattern=DNS_LABEL)
    """The run's namespace: (namespace, run) names a run."""
    action: Action
    reason: str = ""
    source: str = "api"
    created: float = 0.0
    alert: dict[str, object] | None = None


class PushReply(BaseModel):
    accepted: bool = True
    commands: list[Command] = Field(default_factory=list)


class ActionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    action: Action
    reason: Text = Field(default="", max_length=1024)
