"""The report of a real NaN incident, opened in headless Chromium: it loads with no request
leaving the page, every plot panel holds every rank's line, and the NaN is marked."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from cdp_pipe import CHROMIUM, Chromium, png_size
from report_run import NAN_AT, NAN_RANK, WORLD, heard_guard

from trainpatrol.report import write_report
from trainpatrol.report.bundle import ALERT_FOR_GUARD
from trainpatrol.report.timeline import PANELS

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
LEAD_COPY = Path("/tmp/trainpatrol-report-screenshot.png")

PROBE = """(() => {
  const box = (el) => { const r = el.getBoundingClientRect(); return {w: r.width, h: r.height}; };
  const bbox = (el) => { const b = el.getBBox(); return {w: b.width, h: b.height}; };
  const panels = [...document.querySelectorAll('#timeline svg g[id^="panel-"]')].map(g => ({
    id: g.id, ...box(g),
    lines: [...g.querySelectorAll('g[id^="line-"]')].map(l => ({id: l.id, ...bbox(l),
      d: [...l.querySelectorAll('path')].map(p => (p.getAttribute('d') || '').length).reduce((a, b) => a + b, 0)})),
    marks: [...g.querySelectorAll('g[id^="nonfinite-"]')].map(m => ({id: m.id, ...bbox(m)})),
  }));
  return {
    panels,
    svgs: [...document.querySelectorAll('svg')].map(s => ({id: s.id, ...box(s)})),
    imgs: [...document.images].map(i => ({id: i.id, w: i.naturalWidth, ok: i.complete})),
    sections: [...document.querySelectorAll('main > section')].map(s => s.id),
    text: document.body.innerText,
    plotText: document.querySelector('#timeline svg').textContent,
    timeline: (() => { const r = document.querySelector('#timeline').getBoundingClientRect();
                       return {x: r.left + scrollX, y: r.top + scrollY, width: r.width, height: r.height}; })(),
  };
})()"""


def test_report_of_a_real_nan_run_in_chromium(bundle_copy: Path, tmp_path: Path) -> None:
    page = write_report(bundle_copy)
    with Chromium(tmp_path / "profile") as browser:
        sid = browser.open(page.as_uri())
        found: dict[str, Any] = browser.evaluate(sid, PROBE)
        shot = browser.screenshot(sid, tmp_path / "report.png")
        browser.screenshot(sid, tmp_path / "timeline.png", clip=found["timeline"])
        requests = [e["request"]["url"] for e in browser.session_events(sid, "Network.requestWillBeSent")]
        failed = browser.session_events(sid, "Network.loadingFailed")
        bad_status = [e["response"]["url"] for e in browser.session_events(sid, "Network.responseReceived")
                      if e["response"].get("status", 200) >= 400]
        errors = browser.session_events(sid, "Runtime.exceptionThrown") + [
            e for e in browser.session_events(sid, "Log.entryAdded") if e["entry"]["level"] == "error"]
    shutil.copyfile(tmp_path / "report.png", LEAD_COPY)
    shutil.copyfile(tmp_path / "timeline.png", LEAD_COPY.with_name("trainpatrol-report-timeline.png"))

    # loaded, and nothing left the page: the document itself is the only non-data: request
    assert requests and requests[0] == page.as_uri()
    assert [u for u in requests[1:] if not u.startswith("data:")] == []
    assert failed == [] and bad_status == [] and errors == []
    assert found["sections"] == ["happened", "next", "timeline", "loader", "gpu", "memory", "stacks", "files"]

    # every plot element is present and drawn, with a line per rank in every panel
    assert [p["id"] for p in found["panels"]] == [f"panel-{p.key}" for p in PANELS]
    for panel in found["panels"]:
        assert panel["w"] > 100 and panel["h"] > 50, panel["id"]
        lines = {line["id"]: line for line in panel["lines"]}
        key = panel["id"].removeprefix("panel-")
        assert sorted(lines) == sorted(f"line-{key}-rank{r}" for r in range(WORLD)), panel["id"]
        for line in lines.values():
            assert line["d"] > 0 and line["w"] > 0, line
    assert all(s["w"] > 0 and s["h"] > 0 for s in found["svgs"]) and found["svgs"]
    assert all(i["ok"] and i["w"] > 0 for i in found["imgs"])

    # the NaN is marked where it happened: loss on the injected rank, grad norm on every rank (DDP)
    marks = {m["id"]: m for p in found["panels"] for m in p["marks"]}
    assert set(marks) == {f"nonfinite-loss-rank{NAN_RANK}"} | {f"nonfinite-grad_norm-rank{r}" for r in range(WORLD)}
    assert all(m["w"] > 0 and m["h"] > 0 for m in marks.values())
    assert f"NaN at step {NAN_AT}, rank {NAN_RANK}" in found["plotText"]
    assert f"NaN at step {NAN_AT}, ranks {', '.join(map(str, range(WORLD)))}" in found["plotText"]
    text = found["text"]
    # ranks agree on one of the guards' requests; the rank that heard it names the guard: its runbook section
    assert ALERT_FOR_GUARD[heard_guard(bundle_copy)] in text
    assert "pause at step" in text and "done on every rank" in text
    assert "NVIDIA H200" in text  # the agent's NVML snapshot, as a table
    assert "train_ranks.py" in text  # the stacks
    assert "Measured wait for batches" in text

    width, height = png_size(shot)
    assert width == 1280 and height > 2000

