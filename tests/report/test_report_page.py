"""report.html from real bundles, and from copies edited to hold what a real incident may hold
(an alert, Inf values, a DataLoader audit, missing parts, hostile text)."""

from __future__ import annotations

import json
import math
import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch
from report_run import NAN_AT, NAN_RANK, WORLD, heard_guard

from loops import run_scripted, scripted_patrol
from trainpatrol.cli import main
from trainpatrol.loader_audit import ADVICE
from trainpatrol.report import write_report
from trainpatrol.report.runbook import BUILTIN, RUNBOOK_URL, anchor, lookup, markdown_html, sections

RUNBOOK = """# Runbooks

## TrainPatrolNonFiniteLoss

**Meaning.** The loss was NaN or Inf.

- check `trainpatrol_nonfinite_steps_total`
  on every rank
- look at the <bundle>

```sh
# not a heading
trainpatrol resume RUN
```

| action | effect |
| --- | --- |
| pause | waits |

### Detail inside the section

Still this section.

## TrainPatrolNextAlert

Not this one.
"""


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.style = ""
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.style += data


def _edit_json(path: Path, change: Any) -> None:
    data = json.loads(path.read_text())
    path.write_text(json.dumps(change(data) or data))


def _svg(page: str) -> str:
    return page[page.index("<svg"):page.index("</svg>")]


def test_the_run_wrote_its_report(real_bundle: Path) -> None:
    """Rank 0 writes report.html after the manifest, so a fresh bundle holds a whole page."""
    page = (real_bundle / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.endswith("</html>\n")
    assert "is missing" not in page and "could not be read" not in page  # every part was on disk
    assert f"local guard <strong>{heard_guard(real_bundle)}</strong>" in page
    assert "does not name its cause" not in page
    assert f'id="line-loss-rank{NAN_RANK}"' in _svg(page)
    loader = page[page.index('<section id="loader">'):page.index('<section id="gpu">')]
    assert f"<h3>Ranks {', '.join(map(str, range(WORLD)))}</h3>" in loader  # the run's DataLoader, on every rank
    assert "<td>num_workers</td><td>0</td>" in loader and ADVICE["num_workers_zero"] in loader
    # what the pause's checkpoint cost the run, as its manifest measured it
    held = json.loads((real_bundle / "manifest.json").read_text())["training_held_seconds"]
    assert held > 0 and f"<dt>Training held</dt><dd>{held:.3f} s by this checkpoint (written at once)" in page


def test_page_is_self_contained(bundle_copy: Path) -> None:
    page = write_report(bundle_copy).read_text()
    parser = _Tags()
    parser.feed(page)
    names = {t for t, _ in parser.tags}
    assert not names & {"script", "link", "iframe", "object", "embed", "base", "img"}
    for tag, attrs in parser.tags:
        for key in ("src", "srcset", "data", "poster", "background"):
            assert attrs.get(key) is None or str(attrs[key]).startswith("data:"), (tag, attrs)
        href = attrs.get("href") or attrs.get("xlink:href")
        if tag != "a" and href is not None:
            assert href.startswith("#"), (tag, attrs)  # SVG glyph and clip references stay in the page
    assert "url(" not in parser.style and "@import" not in parser.style and "@font-face" not in parser.style
    assert "default-src 'none'" in page  # and a CSP that would block any fetch that slipped in


def test_nan_breaks_the_line_and_is_listed(bundle_copy: Path) -> None:
    page = write_report(bundle_copy).read_text()
    svg = _svg(page)
    line = re.search(rf'<g id="line-loss-rank{NAN_RANK}">\s*<path d="([^"]+)"', svg)
    assert line is not None
    assert line.group(1).count("M") == 2  # one gap, at the NaN step
    assert f'id="nonfinite-loss-rank{NAN_RANK}"' in svg
    assert f"NaN at step {NAN_AT}, rank {NAN_RANK}" in svg
    assert "<td>loss</td><td>1</td><td>NaN</td><td>30</td>" in page
    # the rank that heard the winning request records it in its extra.json; the page names that guard
    assert f"local guard <strong>{heard_guard(bundle_copy)}</strong>" in page
    assert "does not name its cause" not in page


def test_cli_regenerates_the_page(bundle_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = bundle_copy / "report.html"
    target.write_text("stale")
    assert main(["report", str(bundle_copy)]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    assert target.read_text().startswith("<!DOCTYPE html>")
    assert not list(bundle_copy.glob(".report.html.*"))  # written through a temp file, renamed


def test_alert_trigger_and_its_runbook_section(bundle_copy: Path, tmp_path: Path) -> None:
    alert = {"status": "firing", "startsAt": "2026-11-30T00:00:00Z", "fingerprint": "abc123",
             "labels": {"alertname": "TrainPatrolNonFiniteLoss", "run": "report-test", "action": "pause",
                        "severity": "critical"},
             "annotations": {"summary": "Training loss is not finite.",
                             "runbook_url": "https://example.invalid/runbooks.md#trainpatrolnonfiniteloss"}}
    (bundle_copy / "trigger.json").write_text(json.dumps(
        {"id": 7, "action": "pause", "reason": "Training loss is not finite.",
         "source": "alertmanager:TrainPatrolNonFiniteLoss", "alert": alert}))
    runbooks = tmp_path / "runbooks.md"
    runbooks.write_text(RUNBOOK)
    page = write_report(bundle_copy, runbooks=runbooks).read_text()
    assert "Alertmanager alert <strong>TrainPatrolNonFiniteLoss</strong> (firing)" in page
    assert "<td>label severity</td><td>critical</td>" in page
    assert "does not name its cause" not in page
    next_steps = page[page.index('<section id="next">'):page.index('<section id="timeline">')]
    assert "<strong>Meaning.</strong> The loss was NaN or Inf." in next_steps
    assert "<li>check <code>trainpatrol_nonfinite_steps_total</code> on every rank</li>" in next_steps
    assert "<li>look at the &lt;bundle&gt;</li>" in next_steps
    assert "# not a heading\ntrainpatrol resume RUN" in next_steps
    assert "<th>action</th>" in next_steps and "<td>pause</td>" in next_steps
    assert "Still this section." in next_steps and "Not this one." not in next_steps
    assert f"From {runbooks}, section “TrainPatrolNonFiniteLoss”" in next_steps


@pytest.mark.parametrize("heard_by", [0, NAN_RANK])
def test_a_ranks_own_trigger_record_names_the_guard(bundle_copy: Path, tmp_path: Path, heard_by: int) -> None:
    """One rank heard the request (its guard's record), the others only the agreed word; trigger.json is
    rank 0's view. The guard's record wins wherever it is."""
    trigger = {"id": 9, "action": "pause", "source": "guard:nonfinite_loss",
               "reason": f"local guard nonfinite_loss: loss nan at step {NAN_AT}", "alert": None}
    agreed = {"id": 9, "action": "pause", "source": "agreed with another rank"}
    for rank in range(WORLD):
        view = trigger if rank == heard_by else agreed
        _edit_json(bundle_copy / f"rank-{rank:05d}" / "extra.json", lambda d, v=view: {**d, "trigger": v})
        if rank == 0:
            (bundle_copy / "trigger.json").write_text(json.dumps(view))
    runbooks = tmp_path / "runbooks.md"
    runbooks.write_text("## TrainPatrolSomethingElse\n\nNo.\n")
    page = write_report(bundle_copy, runbooks=runbooks).read_text()
    assert "local guard <strong>nonfinite_loss</strong>" in page
    assert "does not name its cause" not in page
    assert f"{runbooks} has no section TrainPatrolNonFiniteLoss or nonfinite_loss" in page
    assert "bad data" in page  # the built-in hint for the guard stands in
    assert f"local guard nonfinite_loss: loss nan at step {NAN_AT}" in page  # the record's reason


def test_inf_values_are_marked(bundle_copy: Path) -> None:
    def poison(history: list[dict[str, Any]]) -> None:
        for rec in history:
            if rec["step"] == 10:
                rec["grad_norm"] = "inf"
            if rec["step"] == 12:
                rec["loss"] = "-inf"

    _edit_json(bundle_copy / "rank-00000" / "history.json", poison)
    page = write_report(bundle_copy).read_text()
    svg = _svg(page)
    assert "+Inf at step 10, rank 0" in svg and "-Inf at step 12, rank 0" in svg
    assert 'id="nonfinite-grad_norm-rank0"' in svg and 'id="nonfinite-loss-rank0"' in svg
    assert "<td>grad norm</td><td>0</td><td>+Inf</td><td>10, 30</td>" in page


def test_loader_audit_with_its_advice(bundle_copy: Path) -> None:
    # rank 0 keeps the run's own audit (num_workers=0); rank 1's differs, its advice left for the page to fill
    audit = {"info": {"num_workers": "4", "pin_memory": "false", "batch_size": "16"},
             "warnings": {"pin_memory_off": ""}}
    _edit_json(bundle_copy / "rank-00001" / "extra.json", lambda d: {**d, "loader_audit": audit})
    page = write_report(bundle_copy).read_text()
    loader = page[page.index('<section id="loader">'):page.index('<section id="gpu">')]
    assert "<h3>Rank 0</h3>" in loader and "<h3>Rank 1</h3>" in loader
    assert "<td>num_workers</td><td>0</td>" in loader and "<td>num_workers</td><td>4</td>" in loader
    assert ADVICE["num_workers_zero"] in loader and ADVICE["pin_memory_off"] in loader
    assert "carries no DataLoader audit" not in loader


def test_missing_audit_and_non_dataloader_are_said(bundle_copy: Path) -> None:
    # rank 0's part has no audit at all (an older bundle); rank 1's audit is null (not a torch DataLoader)
    _edit_json(bundle_copy / "rank-00000" / "extra.json", lambda d: {k: v for k, v in d.items() if k != "loader_audit"})
    _edit_json(bundle_copy / "rank-00001" / "extra.json", lambda d: {**d, "loader_audit": None})
    page = write_report(bundle_copy).read_text()
    assert "did not come from a torch DataLoader" in page
    assert "This bundle carries no DataLoader audit for rank 0 " in page
    assert "Measured wait for batches" in page


def test_missing_parts_are_noted_not_fatal(bundle_copy: Path) -> None:
    for f in (bundle_copy / "rank-00001").iterdir():
        f.unlink()
    (bundle_copy / "rank-00001").rmdir()
    (bundle_copy / "trigger.json").unlink()
    (bundle_copy / "rank-00000" / "nvml.json").write_text("{not json")
    page = write_report(bundle_copy).read_text()
    assert "1 of 2 ranks wrote no part: rank 1." in page
    assert "trigger.json is missing." in page
    assert "rank-00000/nvml.json could not be read" in page
    assert 'id="line-loss-rank0"' in page and "rank1" not in _svg(page)


def test_unavailable_gpu_readings_say_why(bundle_copy: Path) -> None:
    unavailable = json.dumps({"available": False, "reason": "agent did not answer"})
    for part in ("rank-00000", "rank-00001"):
        (bundle_copy / part / "nvml.json").write_text(unavailable)
    page = write_report(bundle_copy).read_text()
    assert "No GPU readings (read by ranks 0, 1): agent did not answer." in page


def test_hostile_text_is_escaped(bundle_copy: Path) -> None:
    (bundle_copy / "rank-00000" / "stacks.txt").write_text('File "<script>alert(1)</script>", line 1\n')
    page = write_report(bundle_copy).read_text()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script" not in page


def test_without_matplotlib_the_page_says_how_to_get_plots(bundle_copy: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    page = write_report(bundle_copy).read_text()
    assert "The plots need matplotlib" in page and "<svg" not in page


def test_panels_without_values_say_so(bundle_copy: Path) -> None:
    def unsampled(history: list[dict[str, Any]]) -> None:
        for rec in history:
            rec.update(allocated_bytes="nan", reserved_bytes="nan", fragmentation_ratio="nan")

    for part in ("rank-00000", "rank-00001"):
        _edit_json(bundle_copy / part / "history.json", unsampled)
    page = write_report(bundle_copy).read_text()
    assert 'id="empty-allocated"' in page and 'id="empty-fragmentation"' in page
    assert "No values in this bundle for: allocated, reserved, fragmentation." in page
    assert "nonfinite-allocated" not in page  # an unsampled allocator is a gap, not a fault


def test_oom_bundle_from_patrol(tmp_path: Path) -> None:
    patrol = scripted_patrol(tmp_path, guard_actions={})
    run_scripted(patrol, [1.0, 0.9, 0.8, math.inf, 0.7], grad_norms=[1.0] * 5)
    bundle = patrol._oom_forensics(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    patrol.close()
    page = write_report(bundle, runbooks=tmp_path / "none.md").read_text()
    assert "oom at step 5" in page
    assert "an exception raised in the training loop" in page
    assert "Tried to allocate 2.00 GiB" in page
    assert "+Inf at step 4, rank 0" in _svg(page)
    assert "section “TrainPatrolOOMRisk”" in page  # the runbook of the checkout (none.md does not exist)
    assert "raised an out-of-memory error" in page


def test_runbook_parsing() -> None:
    secs = sections(RUNBOOK)
    assert anchor("TrainPatrolNonFiniteLoss") == "trainpatrolnonfiniteloss"
    assert set(secs) == {"runbooks", "trainpatrolnonfiniteloss", "detail-inside-the-section", "trainpatrolnextalert"}
    title, body = secs["trainpatrolnonfiniteloss"]
    assert title == "TrainPatrolNonFiniteLoss" and "Still this section." in body and "Not this one." not in body
    assert "# not a heading" in body
    assert markdown_html("1. one\n2. two") == "<ol>\n<li>one</li>\n<li>two</li>\n</ol>"
    assert lookup([], None).title == "A request by hand"
    assert "built-in hint (no runbook file was found" in lookup(["nonfinite_grad"], None).origin
    assert all(guard in BUILTIN for guard in ("nonfinite_loss", "nonfinite_grad", "oom_risk", "memory_fragmentation"))


REPO = Path(__file__).resolve().parents[2]
SHIPPED_RUNBOOKS = REPO / "docs" / "runbooks.md"


def _section(page: str, name: str) -> str:
    start = page.index(f'<section id="{name}">')
    return page[start:page.index("</section>", start)]


def test_runbook_references_become_links_and_emphasis_is_rendered(tmp_path: Path) -> None:
    runbooks = tmp_path / "runbooks.md"
    runbooks.write_text("# Runbooks\n\n## Counters and new series\n\nHow counters start.\n\n"
                        "## TrainPatrolNonFiniteLoss\n\nA new series fires too (see *Counters and new series* "
                        "above). Also [the counters](#counters-and-new-series), *really* new, and `a*b*c`.\n")
    link = f'<a href="{RUNBOOK_URL}#counters-and-new-series">'
    assert lookup(["TrainPatrolNonFiniteLoss"], runbooks).body_html == (
        f"<p>A new series fires too (see {link}Counters and new series</a> in the runbooks). "
        f"Also {link}the counters</a>, <em>really</em> new, and <code>a*b*c</code>.</p>")


def test_the_shipped_runbooks_have_no_dangling_reference_or_stray_asterisk() -> None:
    secs = sections(SHIPPED_RUNBOOKS.read_text())
    for title, _ in secs.values():
        body = lookup([title], SHIPPED_RUNBOOKS).body_html
        text = re.sub(r"<code>.*?</code>|<pre>.*?</pre>", "", body, flags=re.S)
        assert "*" not in text, title
        assert re.findall(r"see [^.()]*\babove\b", text) == [], title
        for target in re.findall(r'href="([^"]+)"', body):
            assert not target.startswith("#"), (title, target)  # a page anchor would point into the report
            if target.startswith(RUNBOOK_URL + "#"):
                assert target.split("#", 1)[1] in secs, (title, target)


def test_runbook_links_point_where_the_shipped_alerts_do() -> None:
    urls = re.findall(r"runbook_url: (\S+)", (REPO / "alerting" / "rules.yml").read_text())
    assert urls and {u.split("#", 1)[0] for u in urls} == {RUNBOOK_URL}


def test_a_driver_version_that_was_not_read_is_said(bundle_copy: Path) -> None:
    for part in ("rank-00000", "rank-00001"):
        _edit_json(bundle_copy / part / "nvml.json", lambda d: {**d, "driver_version": ""})
    gpu = _section(write_report(bundle_copy).read_text(), "gpu")
    assert "<h3>Driver version not read, read by ranks 0, 1</h3>" in gpu
    assert "Driver ," not in gpu


def test_nvml_without_gpus_says_there_are_no_readings(bundle_copy: Path) -> None:
    cpu = {"available": True, "error": "NVMLError_LibraryNotFound: NVML Shared Library Not Found",
           "timestamp": None, "driver_version": "", "gpus": [], "xid": []}
    (bundle_copy / "rank-00000" / "nvml.json").write_text(json.dumps(cpu))
    gpu = _section(write_report(bundle_copy).read_text(), "gpu")
    assert ("No GPU readings (read by rank 0): NVML reported NVMLError_LibraryNotFound: "
            "NVML Shared Library Not Found.") in gpu
    assert "<h3>Driver" in gpu  # rank 1's readings are still there


def test_rank_headings_say_rank_for_one_and_ranks_for_several(bundle_copy: Path) -> None:
    loader = _section(write_report(bundle_copy).read_text(), "loader")
    assert "<h3>Ranks 0, 1</h3>" in loader
    _edit_json(bundle_copy / "rank-00001" / "extra.json",
               lambda d: {**d, "loader_audit": {**d["loader_audit"], "num_workers": 4}})
    loader = _section(write_report(bundle_copy).read_text(), "loader")
    assert "<h3>Rank 0</h3>" in loader and "<h3>Rank 1</h3>" in loader
    assert "Ranks 0<" not in loader


def test_simulated_memory_figures_say_they_are_simulated(bundle_copy: Path) -> None:
    page = write_report(bundle_copy).read_text()
    simulated = ("The allocated, reserved and fragmentation panels plot simulated values for ranks 0, 1: "
                 "their memory readings came from PatrolConfig.memory_reader = SimulatedAllocator(), "
                 "not from a CUDA allocator.")
    assert simulated in _section(page, "timeline")
    assert 'id="simulated-allocated"' in _svg(page) and 'id="simulated-fragmentation"' in _svg(page)
    memory = _section(page, "memory")
    assert memory.count("This rank has no CUDA allocator: the memory figures in the timeline are simulated "
                        "(PatrolConfig.memory_reader = SimulatedAllocator()).") == 2


def test_memory_from_the_cuda_allocator_is_not_called_simulated(bundle_copy: Path) -> None:
    for part in ("rank-00000", "rank-00001"):
        _edit_json(bundle_copy / part / "config.json", lambda d: {**d, "memory_reader": "None"})
    page = write_report(bundle_copy).read_text()
    assert "simulated" not in page


def test_an_oom_report_uses_the_oom_runbook_section(tmp_path: Path) -> None:
    patrol = scripted_patrol(tmp_path, guard_actions={})
    run_scripted(patrol, [1.0, 0.9], grad_norms=[1.0] * 2)
    bundle = patrol._oom_forensics(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    patrol.close()
    nxt = _section(write_report(bundle, runbooks=SHIPPED_RUNBOOKS).read_text(), "next")
    assert nxt.startswith('<section id="next"><h2>What to do next</h2><h3>TrainPatrolOOMRisk</h3>')
    assert f"From {SHIPPED_RUNBOOKS}, section “TrainPatrolOOMRisk”." in nxt
    assert "has no section" not in nxt
