"""Turns a rank's successive snapshots into push-stream lines, whole or as deltas.

The first line on a stream is the whole snapshot. Later ones name only the sample values that
changed (protocol.SnapshotDelta), as long as the samples are the same series in the same order and
the step histogram is there on both or on neither (it travels whole on every line); otherwise the
line is whole again. ``reset`` after a new stream or a refused line.
"""

from __future__ import annotations

import json
from typing import Any

from ..protocol import same_value


class DeltaEncoder:
    def __init__(self) -> None:
        self._series: tuple[list[tuple[str, dict[str, str]]], bool] | None = None
        self._values: list[float] = []

    def reset(self) -> None:
        self._series = None

    def encode(self, snapshot: dict[str, Any]) -> bytes:
        """One NDJSON line (with its newline) for ``snapshot``, a ``RankSnapshot`` as a dict."""
        samples = snapshot.get("samples", [])
        series = ([(s["name"], s["labels"]) for s in samples], snapshot.get("histogram") is not None)
        values = [s["value"] for s in samples]
        if series != self._series:
            line = snapshot
        else:
            changed = [[i, v] for i, (v, old) in enumerate(zip(values, self._values, strict=True))
                       if not same_value(v, old)]
            line = {"changed": changed, **{k: v for k, v in snapshot.items() if k != "samples"}}
        self._series, self._values = series, values
        return json.dumps(line).encode() + b"\n"
