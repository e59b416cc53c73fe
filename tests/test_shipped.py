"""What the package ships besides code: each file is its source (data/ links to it), and `export` writes it out."""

from __future__ import annotations

from pathlib import Path

import pytest

from servers import REPO
from trainpatrol import shipped
from trainpatrol.cli import main

DATA = REPO / "exporter" / "trainpatrol" / "data"
SOURCES = {
    "rules": ["alerting/rules.yml", "alerting/rules-dcgm.yml", "alerting/rules-fast.yml"],
    "dashboards": sorted(f"dashboards/{p.name}" for p in (REPO / "dashboards").glob("*.json")),
    "alertmanager": ["alerting/alertmanager.yml"],
    "runbooks": ["docs/runbooks.md"],
    "values": ["docs/kubernetes.md"],
}


def test_every_shipped_file_is_a_link_to_its_source() -> None:
    links = sorted(str(p.relative_to(DATA)) for p in DATA.rglob("*") if p.is_symlink())
    shipped_names = sorted(name for kind in shipped.KINDS for name in shipped.names(kind))
    assert links == shipped_names
    for kind, sources in SOURCES.items():
        targets = [str((DATA / name).resolve().relative_to(REPO)) for name in shipped.names(kind)]
        assert targets == sources, kind


@pytest.mark.parametrize("kind", list(SOURCES))
def test_export_writes_each_file_equal_to_its_source(kind: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", kind, str(tmp_path / "out")]) == 0
    written = capsys.readouterr().out.split()
    assert written == [str(tmp_path / "out" / Path(s).name) for s in SOURCES[kind]]
    for source, path in zip(SOURCES[kind], written, strict=True):
        assert Path(path).read_bytes() == (REPO / source).read_bytes()
