"""Where the training process runs: its Kubernetes namespace, pod, container and node, and the job that
launched it. The agent puts the first four on every series of the rank, so rules and Alertmanager group
by the workload's namespace, not the agent pod's.

The process runs on Kubernetes when ``KUBERNETES_SERVICE_HOST`` is set (every pod has it) or the service
account's namespace file exists; ``TRAINPATROL_KUBERNETES=0`` or ``1`` says so explicitly. Each value comes
from the first of these that is set (``TRAINPATROL_*`` overrides everything, on Kubernetes or not; the
generic names count only on Kubernetes, since other environments set them for their own purposes):

- namespace: ``TRAINPATROL_NAMESPACE``, ``POD_NAMESPACE`` (downward API), else the namespace file;
- pod: ``TRAINPATROL_POD``, ``POD_NAME``, else ``HOSTNAME`` (a pod's hostname is its name);
- container: ``TRAINPATROL_CONTAINER``, ``CONTAINER_NAME``;
- node: ``TRAINPATROL_NODE``, ``NODE_NAME`` (downward API ``spec.nodeName``);
- launcher and its job: ``TRAINPATROL_LAUNCHER`` with ``TRAINPATROL_LAUNCHER_JOB``, else SLURM
  (``SLURM_JOB_ID``), JobSet (``JOBSET_NAME``), Kubeflow's PyTorchJob (``PYTORCHJOB_NAME``, as the chart's
  example sets from the pod label), torchrun (``TORCHELASTIC_RUN_ID``).

A value that is not a valid name is left out with a warning, never sent: the agent would refuse the push.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from ..protocol import DNS_LABEL, DNS_NAME, JOB_ID

log = logging.getLogger("trainpatrol")
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
LAUNCHERS = (("slurm", "SLURM_JOB_ID"), ("jobset", "JOBSET_NAME"), ("pytorchjob", "PYTORCHJOB_NAME"),
             ("torchrun", "TORCHELASTIC_RUN_ID"))
_PATTERNS = {"namespace": DNS_LABEL, "pod": DNS_NAME, "container": DNS_LABEL, "node": DNS_NAME,
             "launcher": r"^[a-z0-9-]{0,32}$", "launcher_job": JOB_ID}


@dataclass(frozen=True)
class Workload:
    namespace: str = ""
    pod: str = ""
    container: str = ""
    node: str = ""
    launcher: str = ""
    launcher_job: str = ""

    def fields(self) -> dict[str, str]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _first(env: Mapping[str, str], *names: str) -> str:
    return next((env[n].strip() for n in names if env.get(n, "").strip()), "")


def _launcher(env: Mapping[str, str]) -> tuple[str, str]:
    if launcher := _first(env, "TRAINPATROL_LAUNCHER"):
        return launcher, _first(env, "TRAINPATROL_LAUNCHER_JOB")
    return next(((name, job) for name, variable in LAUNCHERS if (job := _first(env, variable))), ("", ""))


def _on_kubernetes(env: Mapping[str, str], namespace_file: Path) -> bool:
    said = env.get("TRAINPATROL_KUBERNETES", "").strip().lower()
    if said in ("0", "false", "no", "off"):
        return False
    return said in ("1", "true", "yes", "on") or bool(env.get("KUBERNETES_SERVICE_HOST")) or namespace_file.is_file()


def detect(env: Mapping[str, str] | None = None, namespace_file: Path = SERVICE_ACCOUNT_NAMESPACE) -> Workload:
    env = os.environ if env is None else env
    pod_env = env if _on_kubernetes(env, namespace_file) else {}
    namespace = _first(env, "TRAINPATROL_NAMESPACE") or _first(pod_env, "POD_NAMESPACE")
    if not namespace and pod_env:
        try:
            namespace = namespace_file.read_text().strip()
        except OSError:
            namespace = ""
    launcher, job = _launcher(env)
    values = {"namespace": namespace,
              "pod": _first(env, "TRAINPATROL_POD") or _first(pod_env, "POD_NAME", "HOSTNAME"),
              "container": _first(env, "TRAINPATROL_CONTAINER") or _first(pod_env, "CONTAINER_NAME"),
              "node": _first(env, "TRAINPATROL_NODE") or _first(pod_env, "NODE_NAME"),
              "launcher": launcher, "launcher_job": job}
    for key, value in values.items():
        if value and not re.match(_PATTERNS[key], value):
            log.warning("trainpatrol: workload %s %r is not a valid name; it is left out of the metrics", key, value)
            values[key] = ""
    return Workload(**values)
