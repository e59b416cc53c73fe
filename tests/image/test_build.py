"""helm/image/build.py's definition of the image: Dockerfile, lock file and chart agree with it."""

from __future__ import annotations

import json
import re
import tomllib

import yaml
from image_build import build

from trainpatrol.agent.config import DEFAULT_PORT

DOCKERFILE = build.HERE / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m.group(1), m.group(2).strip()) for m in re.finditer(r"^([A-Z]+)\s+(.*)$", text, re.M)]


def _one(name: str) -> str:
    (value,) = [args for instr, args in _instructions() if instr == name]
    return value


def _locked() -> dict[str, str]:
    return dict(re.findall(r"^([a-z0-9._-]+)==(\S+)", build.LOCK.read_text(), re.M))


def test_dockerfile_uses_the_build_suite() -> None:
    (arg,) = [args for instr, args in _instructions() if instr == "ARG"]
    assert arg == f"DEBIAN_SUITE={build.SUITE}"
    assert next(args for instr, args in _instructions() if instr == "FROM") == "debian:${DEBIAN_SUITE}-slim AS base"


def test_dockerfile_installs_the_pinned_packages() -> None:
    (install,) = [args for instr, args in _instructions() if instr == "RUN" and "apt-get install" in args]
    assert sorted(re.findall(r"\S+=\d\S*", install)) == sorted(build.PACKAGES)


def test_dockerfile_installs_the_lock_with_hashes_and_the_project_wheel_without_deps() -> None:
    copies = [args for instr, args in _instructions() if instr == "COPY"]
    assert "helm/image/requirements.lock /tmp/wheels/requirements.lock" in copies
    (install,) = [args for instr, args in _instructions() if instr == "RUN" and "venv " + build.VENV in args]
    assert f"{build.VENV}/bin/pip install --no-cache-dir --require-hashes -r /tmp/wheels/requirements.lock" in install
    assert f"{build.VENV}/bin/pip install --no-cache-dir --no-deps /tmp/wheels/project/*.whl" in install


def test_dockerfile_has_the_build_user_entrypoint_command_env_and_port() -> None:
    assert _one("USER") == build.USER
    uid, gid = build.USER.split(":")
    (useradd,) = [args for instr, args in _instructions() if instr == "RUN" and "useradd" in args]
    assert f"groupadd --gid {gid} {build.USER_NAME}" in useradd
    assert f"useradd --uid {uid} --gid {gid} " in useradd
    assert json.loads(_one("ENTRYPOINT")) == list(build.ENTRYPOINT)
    assert json.loads(_one("CMD")) == list(build.CMD)
    assert dict(kv.split("=", 1) for kv in _one("ENV").split()) == build.ENV
    assert _one("EXPOSE") == str(build.PORT) == str(DEFAULT_PORT)  # the agent's own default, not dcgm-exporter's


def test_lock_pins_every_runtime_dependency_but_torch_with_hashes() -> None:
    deps = tomllib.loads((build.ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=;\s\[]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps} - {"torch"}
    locked = _locked()
    assert names <= locked.keys(), names - locked.keys()
    assert "torch" not in locked
    hashed = re.findall(r"^([a-z0-9._-]+)==\S+ \\\n\s+--hash=sha256:[0-9a-f]{64}", build.LOCK.read_text(), re.M)
    assert sorted(hashed) == sorted(locked)


def test_image_reference_is_the_charts_default_image() -> None:
    values = yaml.safe_load((build.ROOT / "helm/trainpatrol/values.yaml").read_text())["image"]
    chart = yaml.safe_load((build.ROOT / "helm/trainpatrol/Chart.yaml").read_text())
    tag = values["tag"] or chart["appVersion"]
    assert build.reference() == f"{values['registry']}/{values['repository']}:{tag}" == \
        "ghcr.io/trainpatrol/trainpatrol:0.1.0"


def test_python_version_comes_from_the_pinned_interpreter() -> None:
    assert build.python_version() == "3.11.2"


def test_platforms_are_every_manylinux_tag_up_to_the_suites_glibc() -> None:
    tags = build.platforms("x86_64")
    assert tags[0] == "manylinux_2_5_x86_64"
    assert tags[31] == "manylinux_2_36_x86_64"
    assert tags[32:] == ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"]
    assert len(tags) == 35


def test_clean_env_reads_no_host_pip_config() -> None:
    env = build.clean_env(build.OUT / "home")
    assert env["PIP_CONFIG_FILE"] == "/dev/null"
    pip_vars = {k for k in env if k.startswith("PIP_")}
    assert pip_vars - {"PIP_CERT"} == {"PIP_CONFIG_FILE", "PIP_DISABLE_PIP_VERSION_CHECK"}
