"""Patrol's public surface is the one its docstrings document, and each user method documents what it takes,
returns and raises. Adding a public name means adding it here and documenting it."""

from __future__ import annotations

import builtins
import inspect
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from loops import scripted_patrol
from trainpatrol import Patrol

ROOT = Path(__file__).resolve().parents[2]
METHODS = ["loader", "step", "boundary", "evaluate", "restore", "request", "close"]
ATTRIBUTES = ["config", "optimizer", "step_count", "state", "actions", "last_checkpoint", "last_evidence"]


def section(doc: str, title: str) -> list[str]:
    """The lines of a Google-style section (``title:``), up to the next unindented line."""
    lines = doc.splitlines()
    if title + ":" not in lines:
        return []
    body: list[str] = []
    for line in lines[lines.index(title + ":") + 1:]:
        if line and not line.startswith(" "):
            break
        body.append(line)
    return body


def entries(doc: str, title: str) -> list[str]:
    """The names a section documents: ``name:`` or ``name (type):`` at its first indentation."""
    return [m.group(1) for line in section(doc, title) if (m := re.match(r" {4}(\**\w+)(?: \(.*\))?:", line))]


def doc_of(obj: Any) -> str:
    return inspect.getdoc(obj) or ""


@pytest.fixture
def patrol(tmp_path: Path) -> Any:
    p = scripted_patrol(tmp_path)
    yield p
    p.close()


def test_the_public_surface_is_the_documented_one(patrol: Patrol) -> None:
    public = {name for name in dir(patrol) if not name.startswith("_")}
    assert public == set(METHODS) | set(ATTRIBUTES)
    assert entries(doc_of(Patrol), "Attributes") == ATTRIBUTES
    for name in METHODS:
        assert callable(getattr(patrol, name)) and doc_of(getattr(Patrol, name)), name
    assert doc_of(Patrol.__exit__), "the context manager says what leaving it does"


def test_every_constructor_parameter_is_documented_in_order() -> None:
    params = inspect.signature(Patrol.__init__).parameters.values()
    expected = [("**" if p.kind is p.VAR_KEYWORD else "") + p.name for p in params if p.name != "self"]
    assert entries(doc_of(Patrol), "Args") == expected


@pytest.mark.parametrize("name", METHODS)
def test_each_method_documents_its_arguments_return_and_exceptions(name: str) -> None:
    method = getattr(Patrol, name)
    doc, signature = doc_of(method), inspect.signature(method)
    assert entries(doc, "Args") == [p for p in signature.parameters if p != "self"]
    assert bool(section(doc, "Returns")) == (signature.return_annotation != "None")
    for exc in entries(doc, "Raises"):
        assert issubclass(getattr(builtins, exc), BaseException), exc


def test_the_example_is_the_readme_loop() -> None:
    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"^## Integrate.*?```python\n(.*?)```", readme, re.S | re.M)
    assert snippet is not None
    example = textwrap.dedent("\n".join(section(doc_of(Patrol), "Example:"))).strip()
    assert example == snippet.group(1).strip()


def test_every_environment_variable_it_reads_is_documented() -> None:
    probe = ROOT / "exporter" / "trainpatrol" / "probe"
    reads = re.compile(r"(?:environ\.get\(|environ\[|_env_seconds\()\"(\w+)\"")
    read = {name for module in ("config.py", "identity.py", "host_memory.py", "run_key.py")
            for name in reads.findall((probe / module).read_text())}
    assert {"TRAINPATROL_RUN", "TRAINPATROL_EMBEDDED_AGENT_IDLE_SECONDS", "LOCAL_RANK"} <= read
    doc = doc_of(Patrol)
    assert [name for name in sorted(read) if f"``{name}``" not in doc] == []


def test_what_the_docstrings_say_is_raised_is_raised(patrol: Patrol, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not an action"):
        patrol.request("reboot")
    with pytest.raises(FileNotFoundError, match=r"no meta\.json"):
        patrol.restore(tmp_path / "no-such-checkpoint")
    with pytest.raises(TypeError):
        Patrol(device="cpu", no_such_field=1)
    with pytest.raises(ValueError, match="window"):
        Patrol(device="cpu", window=1)
    assert not patrol.restore("latest")  # nothing there: a fresh run, not an error
