"""Build the agent image without Docker: mmdebstrap rootfs, host-downloaded wheels, buildah (vfs).

    python helm/image/build.py            # build/image/trainpatrol-agent.oci.tar, unless inputs are unchanged
    python helm/image/build.py --force    # rebuild anyway
    python helm/image/build.py --pins     # print the host's apt candidates for PACKAGES, to update them

Needs root and mmdebstrap, buildah (`make image-deps`). helm/image/Dockerfile builds the same
content for Docker users; tests/image/test_dockerfile.py keeps the two in step.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
HERE = ROOT / "helm" / "image"
LOCK = HERE / "requirements.lock"
OUT = ROOT / "build" / "image"
ARCHIVE = OUT / "trainpatrol-agent.oci.tar"
INFO = OUT / "build-info.json"

SUITE = "bookworm"
MIRRORS = (
    f"deb http://deb.debian.org/debian {SUITE} main",
    f"deb http://deb.debian.org/debian {SUITE}-updates main",
    f"deb http://deb.debian.org/debian-security {SUITE}-security main",
)
# The interpreter's packages, pinned; the rest of minbase follows the suite. The mirror keeps only a
# suite's newest versions, so a security update makes this fail loudly: refresh with --pins.
PACKAGES = (
    "python3=3.11.2-1+b1",
    "python3-venv=3.11.2-1+b1",
    "python3.11=3.11.2-6+deb12u9",
    "python3.11-minimal=3.11.2-6+deb12u9",
    "python3.11-venv=3.11.2-6+deb12u9",
    "libpython3.11-minimal=3.11.2-6+deb12u9",
    "libpython3.11-stdlib=3.11.2-6+deb12u9",
)
USER = "65532:65532"
USER_NAME = "trainpatrol"
VENV = "/opt/trainpatrol"
ENTRYPOINT = (f"{VENV}/bin/trainpatrol",)
# Fail closed: without a token, binding 0.0.0.0 is refused. The chart passes its own arguments.
CMD = ("agent", "--host", "0.0.0.0")
PORT = 9402
ENV = {"PATH": f"{VENV}/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/tmp",
       "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
DESCRIPTION = "Training-health monitor for PyTorch: agent and router"
GLIBC = (2, 36)  # bookworm's; bounds the manylinux tags a wheel may have
HOST_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
SYSTEM_CA = Path("/etc/ssl/certs/ca-certificates.crt")
# The checkout but its tests: the wheel may package any of it (rules, dashboards, runbooks). A build
# is skipped when these files' digest is the recorded one.
INPUTS = (".", ":(exclude)tests")


@dataclass(frozen=True)
class BuildInfo:
    """What build-info.json records beside the archive."""

    inputs_digest: str
    reference: str
    manifest_digest: str
    archive_bytes: int
    uncompressed_bytes: int
    build_seconds: float


def app_version() -> str:
    match = re.search(r'^appVersion:\s*"?([^"\s]+)"?\s*$', (ROOT / "helm/trainpatrol/Chart.yaml").read_text(), re.M)
    if match is None:
        raise ValueError("helm/trainpatrol/Chart.yaml has no appVersion.")
    return match.group(1)


def reference() -> str:
    """The image's name: the chart's default image.registry and image.repository at its appVersion."""
    return f"ghcr.io/trainpatrol/trainpatrol:{app_version()}"


def python_version() -> str:
    """The image's interpreter version, read from its pinned package (wheels are chosen for it)."""
    pin = next(p for p in PACKAGES if p.startswith("python3.11="))
    return pin.split("=", 1)[1].split("-", 1)[0]


def platforms(arch: str) -> list[str]:
    """Every manylinux tag the image's glibc runs: pip expands none of them by itself with --platform."""
    tags = [f"manylinux_{GLIBC[0]}_{minor}_{arch}" for minor in range(5, GLIBC[1] + 1)]
    return tags + [f"manylinux{legacy}_{arch}" for legacy in ("1", "2010", "2014")]


def clean_env(home: Path) -> dict[str, str]:
    """No host pip config (extra indexes, find-links, constraints): the wheels come from PyPI only."""
    env = {"PATH": HOST_PATH, "HOME": str(home), "PIP_CONFIG_FILE": os.devnull, "LC_ALL": "C.UTF-8",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    if SYSTEM_CA.is_file():  # a TLS-intercepting proxy's CA is in the system bundle, not in pip's certifi
        env["PIP_CERT"] = str(SYSTEM_CA)
    return env


def source_files() -> list[str]:
    """The tracked and untracked, not ignored, input files, relative to the repository."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z", "--", *INPUTS], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split("\0")
    return sorted(n for n in names if n and (ROOT / n).is_file())


def inputs_digest() -> str:
    """sha256 over the names and contents of the input files."""
    h = hashlib.sha256()
    for name in source_files():
        h.update(name.encode() + b"\0" + hashlib.sha256((ROOT / name).read_bytes()).digest())
    return h.hexdigest()


def run(cmd: list[str], env: dict[str, str]) -> str:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, env=env, check=True, text=True, stdout=subprocess.PIPE).stdout


def download_wheels(wheels: Path, env: dict[str, str]) -> None:
    """The project's wheel from this checkout, and the locked dependencies (kept between builds)."""
    project, src = wheels / "project", OUT / "src"
    for stale in (project, src):
        shutil.rmtree(stale, ignore_errors=True)
    # from a copy of the input files: setuptools reuses the checkout's build/lib, stale files and all
    for name in source_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    try:
        run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(project), str(src)], env)
    finally:
        shutil.rmtree(src, ignore_errors=True)
    tags = [a for tag in platforms(platform.machine()) for a in ("--platform", tag)]
    run([sys.executable, "-m", "pip", "download", "--quiet", "--require-hashes", "--only-binary=:all:",
         "--python-version", python_version(), "--implementation", "cp", "--abi", "cp311", "--abi", "abi3",
         "--abi", "none", *tags, "--dest", str(wheels / "deps"), "-r", str(LOCK)], env)


def rootfs(tar: Path, wheels: Path, packages_list: Path, env: dict[str, str]) -> None:
    """The Debian rootfs with the venv and the non-root user, as a tarball."""
    install = " && ".join((
        f"python3 -m venv {VENV}",
        f"{VENV}/bin/pip install --no-index --no-cache-dir --find-links /tmp/wheels/deps --require-hashes"
        " -r /tmp/wheels/requirements.lock",
        # the project wheel is built from this checkout, so it has no hash to lock; --no-deps keeps
        # pyproject's dependency list (torch among them) out: the lock is the whole closure
        f"{VENV}/bin/pip install --no-index --no-cache-dir --no-deps /tmp/wheels/project/*.whl",
        f"{VENV}/bin/pip uninstall --yes pip setuptools",  # build tools: nothing installs at run time
        f"groupadd --gid {USER.split(':')[1]} {USER_NAME}",
        f"useradd --uid {USER.split(':')[0]} --gid {USER.split(':')[1]} --no-create-home --home-dir /tmp"
        f" --shell /usr/sbin/nologin {USER_NAME}",
    ))
    shutil.copy(LOCK, wheels / "requirements.lock")
    cmd = ["mmdebstrap", "--quiet", "--mode=root", "--variant=minbase", "--format=tar",
           "--include=" + ",".join(PACKAGES),
           # documentation is dead weight in an image; the copyright files stay
           "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-include=/usr/share/doc/*/copyright",
           "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/info/*",
           "--dpkgopt=path-exclude=/usr/share/locale/*",
           f"--customize-hook=copy-in {wheels} /tmp",
           f"--customize-hook=chroot \"$1\" env -i PATH={HOST_PATH} PIP_CONFIG_FILE=/dev/null"
           f" PIP_DISABLE_PIP_VERSION_CHECK=1 sh -euc '{install}'",
           f"--customize-hook=chroot \"$1\" dpkg-query -W -f='${{Package}}=${{Version}}\\n' > {packages_list}",
           "--customize-hook=rm -rf \"$1/tmp/wheels\" \"$1/root/.cache\"",
           SUITE, str(tar), *MIRRORS]
    run(cmd, env)


def commit(tar: Path, storage: Path, env: dict[str, str]) -> None:
    """One layer from the rootfs tarball, the image config, an OCI archive; the storage is removed."""
    b = ["buildah", "--root", str(storage / "root"), "--runroot", str(storage / "run"), "--storage-driver", "vfs"]
    ctr = run([*b, "from", "--name", "trainpatrol-image-build", "scratch"], env).strip()
    try:
        run([*b, "add", ctr, str(tar), "/"], env)
        config = ["--user", USER, "--workingdir", "/tmp", "--port", f"{PORT}/tcp",
                  "--entrypoint", json.dumps(list(ENTRYPOINT)), "--cmd", json.dumps(list(CMD)),
                  "--label", "org.opencontainers.image.title=trainpatrol",
                  "--label", f"org.opencontainers.image.description={DESCRIPTION}",
                  "--label", "org.opencontainers.image.licenses=Apache-2.0",
                  "--label", f"org.opencontainers.image.version={app_version()}",
                  "--label", "org.opencontainers.image.source=https://github.com/trainpatrol/trainpatrol"]
        for key, value in ENV.items():
            config += ["--env", f"{key}={value}"]
        run([*b, "config", *config, ctr], env)
        ARCHIVE.unlink(missing_ok=True)
        # buildah commits uncompressed by default; the archive is what gets copied to a registry
        run([*b, "commit", "--quiet", "--format", "oci", "--disable-compression=false", "--rm", ctr,
             f"oci-archive:{ARCHIVE}:{reference()}"], env)
    finally:
        subprocess.run([*b, "rm", "--all"], env=env, capture_output=True)
        shutil.rmtree(storage, ignore_errors=True)


def measure(archive: Path) -> tuple[str, int]:
    """The manifest digest and the layers' uncompressed size, read from the OCI archive."""
    with tarfile.open(archive) as tar:
        def read(name: str) -> bytes:
            member = tar.extractfile(name)
            if member is None:
                raise ValueError(f"{archive} has no file {name!r}.")
            return member.read()

        def blob_name(digest: str) -> str:
            return "blobs/" + digest.replace(":", "/", 1)

        digest: str = json.loads(read("index.json"))["manifests"][0]["digest"]
        size = 0
        for layer in json.loads(read(blob_name(digest)))["layers"]:
            if not layer["mediaType"].endswith("+gzip"):
                raise ValueError(f"{archive} has an uncompressed layer ({layer['mediaType']}).")
            with gzip.open(tar.extractfile(blob_name(layer["digest"]))) as stream:  # type: ignore[arg-type]
                while chunk := stream.read(1 << 20):
                    size += len(chunk)
    return digest, size


def recorded() -> BuildInfo | None:
    try:
        return BuildInfo(**json.loads(INFO.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def build(force: bool = False) -> BuildInfo:
    """Build the archive unless one of the same inputs is there; returns what build-info.json says."""
    digest = inputs_digest()
    info = recorded()
    if not force and info is not None and info.inputs_digest == digest and ARCHIVE.is_file():
        return info
    if os.geteuid() != 0:
        raise PermissionError("helm/image/build.py needs root (mmdebstrap --mode=root, buildah with vfs).")
    start = time.monotonic()
    OUT.mkdir(parents=True, exist_ok=True)
    INFO.unlink(missing_ok=True)
    env = clean_env(OUT / "home")
    wheels, tar = OUT / "wheels", OUT / "rootfs.tar"
    try:
        download_wheels(wheels, env)
        rootfs(tar, wheels, OUT / "packages.txt", env)
        commit(tar, OUT / "storage", env)
    finally:
        tar.unlink(missing_ok=True)
    manifest_digest, size = measure(ARCHIVE)
    info = BuildInfo(digest, reference(), manifest_digest, ARCHIVE.stat().st_size, size,
                     round(time.monotonic() - start, 1))
    INFO.write_text(json.dumps(asdict(info), indent=2) + "\n")
    return info


def pins() -> list[str]:
    """PACKAGES at the host's apt candidate versions."""
    names = [p.split("=", 1)[0] for p in PACKAGES]
    out = subprocess.run(["apt-cache", "policy", *names], check=True, capture_output=True, text=True).stdout
    candidates = dict(re.findall(r"^(\S+):\n(?:.*\n)*?\s+Candidate: (\S+)", out, re.M))
    return [f"{name}={candidates[name]}" for name in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--force", action="store_true", help="rebuild even when the inputs are unchanged")
    parser.add_argument("--pins", action="store_true", help="print PACKAGES at the host's apt candidates")
    args = parser.parse_args(argv)
    if args.pins:
        print("\n".join(pins()))
        return 0
    info = build(force=args.force)
    print(json.dumps(asdict(info), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
