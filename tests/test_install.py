"""The wheel as a user installs it: built from a clean clone, into fresh venvs outside the checkout.

One venv has no torch (an agent node): the agent serves, ``export`` writes what the package ships, ``report``
rebuilds a bundle's page. The other has torch: the demo runs from the wheel and pauses on its fault. The
dependencies come from the package index; when it cannot be reached the tests skip, saying so.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from servers import REPO, free_port, http_get, serving

TORCH = "torch==2.13.0"  # the CPU wheel the Makefile pins; an unpinned torch would pull a CUDA build
EXPORTED = {
    "rules": ["alerting/rules.yml", "alerting/rules-dcgm.yml", "alerting/rules-fast.yml"],
    "dashboards": ["dashboards/gpu-node-dcgm.json", "dashboards/gpu-node.json", "dashboards/run-timeline.json",
                   "dashboards/training-checklist.json"],
    "alertmanager": ["alerting/alertmanager.yml"],
    "runbooks": ["docs/runbooks.md"],
    "values": ["docs/kubernetes.md"],
}
VENV_TOOLS = ("pip", "setuptools", "pkg_resources", "_distutils_hack")
"""What ``python -m venv`` puts in every venv; left out of the install's size."""


def _env() -> dict[str, str]:
    """The environment without this checkout: nothing but the venv's own install is imported."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "PYTHONUNBUFFERED": "1"}


def _index_unreachable() -> str:
    """Why the package index cannot be reached, or "" when it can."""
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError as exc:
        return f"pypi.org:443: {exc}"
    return ""


def _pip(python: Path | str, *args: str) -> None:
    """``python -m pip ARGS``; a failure skips the test when the package index cannot be reached, else fails it."""
    cmd = [str(python), "-m", "pip", *args, "--quiet", "--disable-pip-version-check"]
    result = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    if result.returncode == 0:
        return
    tail = (result.stdout + result.stderr)[-3000:]
    why = _index_unreachable()
    if why:
        pytest.skip(f"the package index is unreachable ({why}), so `pip {' '.join(args)}` failed: {tail}")
    pytest.fail(f"`{' '.join(cmd)}` failed with code {result.returncode}:\n{tail}")


def _pip_install(venv: Path, *what: str) -> None:
    _pip(venv / "bin" / "python", "install", *what)


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    return path


def _run(venv: Path, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / args[0]), *args[1:]], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def _site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3.*/site-packages"))


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("install") / "trainpatrol"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(path)], check=True, timeout=60)
    return path


@pytest.fixture(scope="module")
def wheel(clone: Path) -> Path:
    """One wheel for both venvs, built with pip as a user or a release job would."""
    out = clone.parent / "dist"
    _pip(sys.executable, "wheel", "--no-deps", "-w", str(out), str(clone))  # setuptools comes from the index
    (found,) = out.glob("trainpatrol-*.whl")
    return found


def test_the_wheel_ships_the_package_without_the_nvml_test_double(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "trainpatrol/agent/server.py" in names  # the listing is the package's
    assert [n for n in names if "fake" in n.lower() or "nvml_h200" in n or n.startswith("tests/")] == []


@pytest.fixture(scope="module")
def demo_run(wheel: Path) -> Iterator[tuple[subprocess.CompletedProcess[str], Path]]:
    """``trainpatrol demo`` from a venv with torch and the wheel: its output and its workdir."""
    root = wheel.parent.parent
    venv = _venv(root / "venv-torch")
    # torch is the user's own: not byte-compiled up front (two thirds of its install's CPU); the wheel is, as pip does
    _pip_install(venv, "--no-compile", TORCH)
    _pip_install(venv, str(wheel))
    work = root / "demo-output"
    result = _run(venv, "trainpatrol", "demo", "--steps", "120", "--inject", "nan@40", "--step-sleep", "0",
                  "--auto-resume", "1", "--quiet", "--workdir", str(work),
                  "--agent-url", f"http://127.0.0.1:{free_port()}", cwd=root, timeout=180)
    yield result, work
    shutil.rmtree(venv, ignore_errors=True)


@pytest.mark.timeout(600)
def test_the_wheel_with_torch_runs_the_demo_and_pauses_on_the_injected_fault(
        demo_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    result, work = demo_run
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    paused = re.findall(r"\[demo\] run demo is paused at step (\d+), .*? by (local guard \w+) .*?; "
                        r"checkpoint: (\S+); evidence: (\S+)", out)
    assert paused == [("40", "local guard nonfinite_loss", f"{work}/checkpoints/step-00000040",
                       paused[0][3] if paused else "")], out[-4000:]
    assert Path(paused[0][3]).name.endswith("-step00000040-pause")
    assert "[demo] done: 120 steps." in out


@pytest.mark.timeout(600)
def test_the_wheel_without_torch_serves_metrics_exports_what_it_ships_and_writes_reports(
        wheel: Path, clone: Path, demo_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    root = wheel.parent.parent
    venv = _venv(root / "venv-agent")
    _pip_install(venv, str(wheel))
    here = root / "elsewhere"
    here.mkdir()

    assert _run(venv, "python", "-m", "pip", "show", "torch", cwd=here).returncode == 1
    where = _run(venv, "python", "-c", "import trainpatrol; print(trainpatrol.__file__)", cwd=here)
    assert where.stdout.strip() == str(_site_packages(venv) / "trainpatrol" / "__init__.py"), where.stderr
    patrol = _run(venv, "python", "-c", "from trainpatrol import Patrol", cwd=here)
    assert patrol.returncode == 1
    assert patrol.stderr.strip().splitlines()[-1] == (
        "ImportError: trainpatrol's training side (Patrol, trainpatrol.probe, the demo) needs PyTorch, which is not "
        "installed: install the torch build for your machine (https://pytorch.org/get-started/locally/), e.g. "
        "`pip install torch`. The agent, `trainpatrol export` and `trainpatrol report` run without it.")

    port = free_port()
    cmd = [str(venv / "bin" / "trainpatrol"), "agent", "--host", "127.0.0.1", "--port", str(port), "--no-nvml"]
    with serving(cmd, root / "agent.log", port, "/healthz", 30, env=_env()) as url:
        assert http_get(url + "/healthz")
        metrics = http_get(url + "/metrics").decode()
        assert re.search(r"^trainpatrol_agent_info\{.*\} 1(\.0)?$", metrics, re.M), metrics[:2000]

    for kind, sources in EXPORTED.items():
        result = _run(venv, "trainpatrol", "export", kind, str(here / kind), cwd=here)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == [str(here / kind / Path(s).name) for s in sources]
        for source in sources:
            assert (here / kind / Path(source).name).read_bytes() == (clone / source).read_bytes(), source

    result, work = demo_run
    assert result.returncode == 0, result.stdout[-4000:]
    (bundle,) = (work / "evidence").glob("*-step00000040-pause")
    (bundle / "report.html").unlink()
    report = _run(venv, "trainpatrol", "report", str(bundle), cwd=here)
    assert (report.returncode, report.stdout) == (0, f"{bundle / 'report.html'}\n"), report.stderr
    page = (bundle / "report.html").read_text()
    assert "From the runbooks of trainpatrol 0.1.0 (docs/runbooks.md), section “TrainPatrolNonFiniteLoss”" in page

    site = _site_packages(venv)
    kib = int(subprocess.run(["du", "-sk", str(site)], capture_output=True, text=True, check=True).stdout.split()[0])
    tools = sum(int(subprocess.run(["du", "-sk", str(p)], capture_output=True, text=True, check=True).stdout.split()[0])
                for p in site.iterdir() if p.name.split("-")[0] in VENV_TOOLS)
    print(f"\nagent-only install: site-packages {kib / 1024:.0f} MiB, {(kib - tools) / 1024:.0f} MiB without the "
          f"venv's own pip and setuptools")
