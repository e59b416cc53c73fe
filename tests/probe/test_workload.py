"""Where a rank runs: its pod's namespace, name, container and node, and the job that launched it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from trainpatrol.probe.workload import Workload, detect

POD_ENV = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "POD_NAMESPACE": "team-a", "POD_NAME": "llm-7b-worker-3",
           "CONTAINER_NAME": "trainer", "NODE_NAME": "gpu-node-12.cluster.local", "HOSTNAME": "llm-7b-worker-3",
           "JOBSET_NAME": "llm-7b", "TORCHELASTIC_RUN_ID": "none"}


def test_a_pod_environment_names_namespace_pod_container_node_and_launcher(tmp_path: Path) -> None:
    assert detect(POD_ENV, tmp_path / "absent") == Workload(
        namespace="team-a", pod="llm-7b-worker-3", container="trainer", node="gpu-node-12.cluster.local",
        launcher="jobset", launcher_job="llm-7b")


def test_without_the_downward_api_the_service_account_namespace_and_hostname_name_the_pod(tmp_path: Path) -> None:
    namespace_file = tmp_path / "namespace"
    namespace_file.write_text("team-b\n")
    env = {"HOSTNAME": "job-0-abcde", "SLURM_JOB_ID": "481516"}
    assert detect(env, namespace_file) == Workload(namespace="team-b", pod="job-0-abcde", launcher="slurm",
                                                   launcher_job="481516")


def test_off_kubernetes_the_hostname_is_no_pod_and_nothing_is_guessed(tmp_path: Path) -> None:
    assert detect({"HOSTNAME": "workstation", "TORCHELASTIC_RUN_ID": "42"}, tmp_path / "absent") == Workload(
        launcher="torchrun", launcher_job="42")


def test_trainpatrol_variables_win_over_the_pod_environment(tmp_path: Path) -> None:
    env = {**POD_ENV, "TRAINPATROL_NAMESPACE": "team-c", "TRAINPATROL_POD": "p", "TRAINPATROL_CONTAINER": "c",
           "TRAINPATROL_NODE": "n", "TRAINPATROL_LAUNCHER": "pytorchjob", "TRAINPATROL_LAUNCHER_JOB": "llm-7b-run2"}
    assert detect(env, tmp_path / "absent") == Workload("team-c", "p", "c", "n", "pytorchjob", "llm-7b-run2")


@pytest.mark.parametrize(("key", "value"), [("POD_NAMESPACE", "Team_A"), ("POD_NAME", "a b"),
                                            ("NODE_NAME", "node/1"), ("SLURM_JOB_ID", 'x"y')])
def test_a_value_that_is_no_valid_name_is_left_out_with_a_warning(key: str, value: str, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "POD_NAMESPACE": "team-a", "POD_NAME": "p", "NODE_NAME": "n",
           "SLURM_JOB_ID": "7", key: value}
    with caplog.at_level(logging.WARNING, logger="trainpatrol"):
        got = detect(env, tmp_path / "absent").fields()
    field = {"POD_NAMESPACE": "namespace", "POD_NAME": "pod", "NODE_NAME": "node", "SLURM_JOB_ID": "launcher_job"}[key]
    assert got[field] == ""
    assert f"workload {field}" in caplog.text
    assert {k: v for k, v in got.items() if k != field and v} == {k: v for k, v in {
        "namespace": "team-a", "pod": "p", "node": "n", "launcher": "slurm", "launcher_job": "7"}.items() if k != field}


def test_generic_names_outside_kubernetes_are_not_taken_for_a_pod(tmp_path: Path) -> None:
    """A CI runner or a workstation may set CONTAINER_NAME or NODE_NAME for its own purposes."""
    env = {"CONTAINER_NAME": "ci-runner-7", "NODE_NAME": "builder", "POD_NAMESPACE": "x", "POD_NAME": "y"}
    assert detect(env, tmp_path / "absent") == Workload()
    assert detect({**env, "TRAINPATROL_KUBERNETES": "1"}, tmp_path / "absent") == Workload(
        namespace="x", pod="y", container="ci-runner-7", node="builder")
    assert detect({**POD_ENV, "TRAINPATROL_KUBERNETES": "0"}, tmp_path / "absent") == Workload(
        launcher="jobset", launcher_job="llm-7b")
