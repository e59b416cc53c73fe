"""The agent image, built by helm/image/build.py and run with podman as the chart runs it.

Builds once per set of inputs (a rebuild of the same inputs reuses build/image/); needs root and the
tools of `make image-deps`.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from image_build import build

TOOLS = ("mmdebstrap", "buildah", "podman", "runc", "skopeo")
REGISTRY = build.ROOT / "build" / "image" / "tools" / "usr" / "bin" / "docker-registry"
TOKEN = "image-test-token"
Info = Any  # build.BuildInfo: build.py is loaded from its path, which mypy does not follow


def _missing() -> list[str]:
    missing = [t for t in TOOLS if shutil.which(t) is None]
    return missing + ([] if REGISTRY.is_file() else [str(REGISTRY.relative_to(build.ROOT))])


pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="building the image needs root (mmdebstrap --mode=root)"),
    pytest.mark.skipif(bool(os.geteuid() == 0 and _missing()),
                       reason=f"image tools missing: {' '.join(_missing())} (run `make image-deps`)"),
    pytest.mark.timeout(600),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _ulimits() -> list[str]:
    """Explicit limits: podman's default asks for more than the machine allows (runc then refuses)."""
    flags = []
    for name, which, want in (("nofile", resource.RLIMIT_NOFILE, 4096), ("nproc", resource.RLIMIT_NPROC, 1024)):
        hard = resource.getrlimit(which)[1]
        value = want if hard == resource.RLIM_INFINITY else min(want, hard)
        flags += ["--ulimit", f"{name}={value}:{value}"]
    return flags


class Podman:
    """podman with its own vfs storage, runc and cgroupfs (crun fails on this machine's cgroups)."""

    def __init__(self, root: Path) -> None:
        self.base = ["podman", "--root", str(root / "root"), "--runroot", str(root / "run"), "--storage-driver",
                     "vfs", "--runtime", "runc", "--cgroup-manager", "cgroupfs", "--events-backend", "file"]

    def __call__(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:  # what podman said, not only its exit code
            pytest.fail(f"podman {' '.join(args)} exited {result.returncode}:\n{result.stdout}{result.stderr}")
        return result

    def run_args(self) -> list[str]:
        # as the chart runs it: read-only root without podman's extra tmpfs mounts
        return ["--read-only", "--read-only-tmpfs=false", *_ulimits()]


@pytest.fixture(scope="module")
def image() -> Info:
    return build.build()


@pytest.fixture(scope="module")
def podman(image: Info) -> Iterator[Podman]:
    # podman refuses a runroot of more than 50 characters, which a parallel worker's tmp_path is
    root = Path(tempfile.mkdtemp(prefix="trainpatrol-podman-"))
    p = Podman(root)
    p("load", "--quiet", "--input", str(build.ARCHIVE))
    try:
        yield p
    finally:
        p("rm", "--all", "--force", "--time", "2", check=False)
        p("rmi", "--all", "--force", check=False)
        shutil.rmtree(root, ignore_errors=True)  # vfs keeps a full copy per container


@pytest.fixture(scope="module")
def agent(podman: Podman, image: Info) -> Iterator[tuple[str, int]]:
    """A running agent container with a token, its port published on loopback."""
    port = _free_port()
    out = podman("run", "--detach", *podman.run_args(), "--env", f"TRAINPATROL_TOKEN={TOKEN}",
                 "--publish", f"127.0.0.1:{port}:{build.PORT}", image.reference)
    container = out.stdout.strip()
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                break
        except OSError:
            if time.monotonic() > deadline:
                logs = podman("logs", container, check=False)
                pytest.fail(f"agent did not answer on port {port} within 60 s:\n{logs.stdout}{logs.stderr}")
            time.sleep(0.5)
    yield container, port
    podman("rm", "--force", "--time", "2", container, check=False)


def test_agent_serves_metrics_on_the_published_port(agent: tuple[str, int]) -> None:
    _, port = agent
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        # CONTENT_TYPE_LATEST of the locked prometheus-client (0.26.0)
        assert resp.headers["Content-Type"] == "text/plain; version=1.0.0; charset=utf-8"
        body = resp.read().decode()
    lines = body.splitlines()  # no rank pushed: the agent's own families, and its collectors' health
    assert "# TYPE trainpatrol_agent_info gauge" in lines
    assert 'trainpatrol_collector_success{collector="ranks"} 1.0' in lines
    assert 'trainpatrol_collector_success{collector="process"} 1.0' in lines


def test_agent_process_runs_as_non_root(agent: tuple[str, int], podman: Podman) -> None:
    container, _ = agent
    status = podman("exec", container, "cat", "/proc/1/status").stdout
    uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
    assert uid_line.split()[1:] == ["65532"] * 4
    assert podman("exec", container, "id", "-un").stdout.strip() == build.USER_NAME


def test_image_has_no_torch(agent: tuple[str, int], podman: Podman) -> None:
    container, _ = agent
    result = podman("exec", container, "python", "-c", "import torch", check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == "ModuleNotFoundError: No module named 'torch'"


def test_default_command_refuses_0_0_0_0_without_a_token(podman: Podman, image: Info) -> None:
    result = podman("run", "--rm", *podman.run_args(), image.reference, check=False)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "trainpatrol agent: Config 'host' has value '0.0.0.0', which is not loopback, and no token is set. "
        "Set TRAINPATROL_TOKEN or --token-file: the control API fails closed.")


def test_image_config_has_the_user_entrypoint_and_command(image: Info) -> None:
    raw = subprocess.run(["skopeo", "inspect", "--config", f"oci-archive:{build.ARCHIVE}"], capture_output=True,
                         text=True, check=True).stdout
    config = json.loads(raw)["config"]
    assert config["User"] == build.USER
    assert config["Entrypoint"] == list(build.ENTRYPOINT)
    assert config["Cmd"] == list(build.CMD)
    assert config["ExposedPorts"] == {f"{build.PORT}/tcp": {}}


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    """Debian's docker-registry binary on a loopback port, storing under tmp_path."""
    port = _free_port()
    config = tmp_path / "config.yml"
    config.write_text(f"version: 0.1\nlog:\n  level: warn\n"
                      f"storage:\n  filesystem:\n    rootdirectory: {tmp_path}/data\n"
                      f"http:\n  addr: 127.0.0.1:{port}\n")
    proc = subprocess.Popen([str(REGISTRY), "serve", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"docker-registry did not answer on port {port}")
                time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(tmp_path / "data", ignore_errors=True)  # the pushed image: 74 MB


def _skopeo_digest(ref: str) -> str:
    out = subprocess.run(["skopeo", "inspect", "--tls-verify=false", ref], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    digest: str = json.loads(out)["Digest"]
    return digest


def test_push_to_a_registry_and_pull_back_keeps_the_digest(image: Info, registry: str,
                                                             tmp_path: Path) -> None:
    remote = f"docker://{registry}/trainpatrol/trainpatrol:{build.app_version()}"
    pulled = tmp_path / "pulled.oci.tar"
    subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci-archive:{build.ARCHIVE}", remote],
                   check=True, timeout=120)
    assert _skopeo_digest(remote) == image.manifest_digest
    try:
        subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", remote, f"oci-archive:{pulled}"],
                       check=True, timeout=120)
        assert _skopeo_digest(f"oci-archive:{pulled}") == image.manifest_digest
    finally:
        pulled.unlink(missing_ok=True)
