"""remote_write of trainpatrol's series from an edge Prometheus to a central store (issue "Fleet scale").

A real agent (fake NVML) takes the pushes of a real rank; an edge Prometheus scrapes it, evaluates the shipped
rules (alerting/rules-fast.yml: the recording rules of rules.yml, alerts with ``for: 0s``) and remote-writes with
the configuration of docs/kubernetes.md, "remote_write" (its ``external_labels`` and ``write_relabel_configs``, read
from the doc) to a second real Prometheus started with ``--web.enable-remote-write-receiver``, standing in for
Thanos, Mimir or VictoriaMetrics. The edge also scrapes the receiver's own /metrics and fires a non-trainpatrol
alert, so it holds series that must not be sent.

The receiver must hold exactly the edge's samples of trainpatrol's raw and recorded series and of its alerts, with
the cluster label, and nothing else; every dashboard query with data on the edge must return the same there, with
the dashboards' ``cluster`` variable set to the edge's cluster as a central Grafana would.
"""
from __future__ import annotations

import contextlib
import json
import math
import re
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from loops import scripted_patrol
from markers import needs_prometheus
from nvml_fake import FIXTURE
from rank_client import GpuRank
from servers import REPO, agent, http_get, http_json, prometheus, query, query_value, wait_for
from trainpatrol import Patrol

pytestmark = pytest.mark.timeout(120)

TARGET_LABELS = {"namespace": "ml-team", "node": "gpu-node-1"}  # as the chart's monitors add them
RUN, GPU_RUN = "rw", "rw-gpu"
RULES = REPO / "alerting" / "rules-fast.yml"
ALERT = "TrainPatrolDataLoaderBound"  # a shipped alert on a recorded series, which this run fires

# What must reach the store: the agent's series, what the shipped rules record (level:trainpatrol_metric:operation)
# and trainpatrol's alerts (ALERTS, checked apart).
KEEP = r"trainpatrol_.*|[a-z_]+:trainpatrol_.*"


def documented_config() -> dict[str, Any]:
    """The Prometheus configuration of docs/kubernetes.md, "remote_write": the edge runs it as written."""
    doc = (REPO / "docs" / "kubernetes.md").read_text()
    section = doc[doc.index("\n## remote_write\n"):]
    section = section[:section.index("\n## ", 1)]
    m = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert m, "docs/kubernetes.md: no yaml block in the remote_write section"
    return dict(yaml.safe_load(m.group(1)))


DOCUMENTED = documented_config()
CLUSTER = DOCUMENTED["global"]["external_labels"]["cluster"]
RECORDED = re.compile(r"^\s*- record: (\S+)", re.M)

# A non-trainpatrol alert firing on the edge: its ALERTS series must stay there.
OTHER_RULES = {"groups": [{"name": "not-trainpatrol", "rules": [
    {"alert": "Watchdog", "expr": "vector(1)", "labels": {"severity": "none"}}]}]}

VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")
# The dashboards' variables: on the edge the cluster label is absent ("All" matches that); the receiver has
# the edge's external label, so a central Grafana picks the cluster.
EDGE_VALUES = {"cluster": ".*", "namespace": TARGET_LABELS["namespace"], "run": f"{RUN}|{GPU_RUN}", "rank": ".*",
               "node": TARGET_LABELS["node"], "datasource": "prometheus",
               "__rate_interval": "5s", "__interval": "1s", "__range": "5m"}
CENTRAL_VALUES = {**EDGE_VALUES, "cluster": CLUSTER}


def substitute(expr: str, values: dict[str, str]) -> str:
    """Dashboard variables replaced as Grafana would; ``$1`` (a label_replace group) stays."""
    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return m.group(0) if name.isdigit() else values[name]
    return VARIABLE.sub(repl, expr)


def dashboard_queries() -> Iterator[tuple[str, str]]:
    """(where, expr) of every panel target and annotation query of the shipped dashboards."""
    for path in sorted((REPO / "dashboards").glob("*.json")):
        dash = json.loads(path.read_text())
        for panel in dash["panels"]:
            for p in [panel, *panel.get("panels", [])]:
                for t in p.get("targets", []):
                    yield f"{path.name} / {p['title']} / {t['refId']}", t["expr"]
        for a in dash["annotations"]["list"]:
            if "expr" in a:
                yield f"{path.name} / annotation {a['name']}", a["expr"]


def dashboard_variables() -> Iterator[tuple[str, str, str]]:
    """(where, selector, label) of every label_values() variable of the shipped dashboards."""
    for path in sorted((REPO / "dashboards").glob("*.json")):
        for v in json.loads(path.read_text())["templating"]["list"]:
            if m := LABEL_VALUES.match(v.get("query") or ""):
                yield f"{path.name} / ${v['name']}", m["selector"], m["label"]


class Training:
    """A rank training in a thread. It waits for its batches through ``patrol.loader`` three times as long as
    it computes, so the shipped TrainPatrolDataLoaderBound fires (from a recorded series), and evaluates every
    10 steps."""

    def __init__(self, patrol: Patrol) -> None:
        self.patrol, self.stop = patrol, threading.Event()
        self.thread = threading.Thread(target=self._loop, name="rank", daemon=True)
        self.thread.start()

    def _batches(self) -> Iterator[int]:
        n = 0
        while not self.stop.is_set():
            time.sleep(0.03)
            n += 1
            yield n

    def _loop(self) -> None:
        for n in self.patrol.loader(self._batches()):
            self.patrol.step(torch.tensor(2.0 - n / 1000), grad_norm=1.0 + n % 5 / 10, batch_size=8, tokens=8 * 128,
                              learning_rates=[1e-3])
            if n % 10 == 0:
                self.patrol.evaluate(2.1 - n / 1000)
            time.sleep(0.01)

    def end(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


def first_gpu_uuid(agent_url: str) -> str:
    m = re.search(r'trainpatrol_gpu_info\{[^}]*uuid="([^"]+)"', http_get(f"{agent_url}/metrics").decode())
    assert m, "the agent serves no trainpatrol_gpu_info"
    return m.group(1)


def names(prom: str, start: float, end: float) -> set[str]:
    params = {"match[]": '{__name__=~".+"}', "start": f"{start:.3f}", "end": f"{end:.3f}"}
    body = http_json(f"{prom}/api/v1/label/__name__/values?{urllib.parse.urlencode(params)}")
    return set(body["data"])


def forwarded(name: str) -> bool:
    return re.fullmatch(KEEP, name) is not None


def query_range(prom: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": "1"}
    body = http_json(f"{prom}/api/v1/query_range?{urllib.parse.urlencode(params)}", timeout=30)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def samples(prom: str, seconds: float, at: float) -> dict[tuple[tuple[str, str], ...], list[Any]]:
    """Every sample of the forwarded series (trainpatrol's and its alerts) in the ``seconds`` up to ``at``,
    by label set, but for the cluster label."""
    found = {}
    for selector in (f'{{__name__=~"{KEEP}"}}', 'ALERTS{alertname=~"TrainPatrol.*"}'):
        for series in query(prom, f"{selector}[{seconds:.0f}s]", at=at):
            found[tuple(sorted((k, v) for k, v in series["metric"].items() if k != "cluster"))] = series["values"]
    return found


def without_cluster(result: list[dict[str, Any]]) -> list[tuple[list[tuple[str, str]], list[Any]]]:
    return sorted((sorted((k, v) for k, v in series["metric"].items() if k != "cluster"), series["values"])
                  for series in result)


def has_data(result: list[dict[str, Any]]) -> bool:
    return any(not math.isnan(float(v)) for series in result for _, v in series["values"])


def test_the_documented_relabeling_keeps_what_the_shipped_rules_record_and_their_alerts() -> None:
    (relabel,) = DOCUMENTED["remote_write"][0]["write_relabel_configs"]
    assert relabel["source_labels"] == ["__name__", "alertname"] and relabel["action"] == "keep"
    kept = re.compile(relabel["regex"])  # Prometheus anchors it; RE2 and re agree on this one
    rules = [REPO / "alerting" / name for name in ("rules.yml", "rules-fast.yml", "rules-dcgm.yml")]
    recorded = {name for path in rules for name in RECORDED.findall(path.read_text())}
    alerts = {name for path in rules for name in re.findall(r"^\s*- alert: (\S+)", path.read_text(), re.M)}
    assert len(recorded) >= 15 and len(alerts) >= 15
    assert [n for n in sorted(recorded) if not (kept.fullmatch(f"{n};") and forwarded(n))] == []
    assert [a for a in sorted(alerts) if not kept.fullmatch(f"ALERTS;{a}")] == []
    for dropped in ("up;", "go_goroutines;", "prometheus_build_info;", "ALERTS_FOR_STATE;TrainPatrolRankDown",
                    "ALERTS;Watchdog", "node_cpu_seconds_total;"):
        assert not kept.fullmatch(dropped), dropped


@needs_prometheus
def test_remote_write_forwards_the_trainpatrol_series_and_every_dashboard_reads_them_centrally(
        tmp_path: Path) -> None:
    t0 = time.monotonic()
    other_rules = tmp_path / "other-rules.yml"
    other_rules.write_text(json.dumps(OTHER_RULES))
    (tmp_path / "central").mkdir()
    (tmp_path / "edge").mkdir()
    with agent(tmp_path, "--nvml-fake", str(FIXTURE), "--nvml-interval", "0.5") as agent_url, \
            prometheus(tmp_path / "central", [], flags=("--web.enable-remote-write-receiver",)) as central:
        (documented,) = DOCUMENTED["remote_write"]
        remote_write = [{**documented, "url": f"{central}/api/v1/write", "queue_config": {"batch_send_deadline": "1s"}}]
        with prometheus(tmp_path / "edge", [agent_url.removeprefix("http://")], [RULES, other_rules],
                        labels=TARGET_LABELS, other_jobs={"prometheus": [central.removeprefix("http://")]},
                        extra_config={**DOCUMENTED, "remote_write": remote_write}) as edge:
            gpu = GpuRank(agent_url, first_gpu_uuid(agent_url), GPU_RUN).__enter__()
            training = Training(scripted_patrol(tmp_path / "rank", agent_url, run=RUN, push_interval_seconds=0.25,
                                                keep_best_checkpoint=False))
            try:
                # Prometheus applies new targets after its discovery delay (about 5 s)
                wait_for(lambda: query_value(edge, f'trainpatrol_step_total{{run="{RUN}"}}'), 30,
                         what="the edge scrapes the rank's series")
                start = time.time()
                wait_for(lambda: query(edge, f'ALERTS{{alertname="{ALERT}",alertstate="firing"}}'), 20,
                         what=f"{ALERT} firing on the edge")
                time.sleep(max(0.0, start + 8 - time.time()))  # enough samples for the panels' [5s] rates
            finally:
                training.end()
                training.patrol.close()
                gpu.__exit__()
            end = time.time()
            # the edge has scraped and evaluated after the run; then the receiver has caught up
            latest = (f'trainpatrol_rank_up{{run="{RUN}"}}', "run:trainpatrol_step:max_rate5m")
            wait_for(lambda: min(query_value(edge, f"max(timestamp({x}))") or 0 for x in latest) > end, 30,
                     what="the edge scraped and evaluated after the run")
            # the series recorded last (a closed rank's halted mark) exist on the edge, then reach the receiver too
            wait_for(lambda: query(edge, f'run_rank:trainpatrol_rank_state:halted{{run="{RUN}"}}'), 30,
                     what="the closed rank's halted mark on the edge")
            wait_for(lambda: {n for n in names(edge, start, end) if forwarded(n)} <= names(central, start, end), 30,
                     what="every forwarded series at the receiver")
            window = end - start + 600  # every sample of the run, and before
            with contextlib.suppress(TimeoutError):  # (a late rule evaluation adds to the edge's too)
                wait_for(lambda: samples(central, window, end) == samples(edge, window, end), 30,
                         what="the receiver caught up")
            sent, received = samples(edge, window, end), samples(central, window, end)
            lost = sorted({dict(k)["__name__"] for k in sent if k not in received})
            differ = sorted({dict(k)["__name__"] for k in sent if k in received and sent[k] != received[k]})
            assert received == sent, f"not received: {lost}; received otherwise: {differ}"
            check(edge, central, start, end)
    print(f"\n[remote-write] {time.monotonic() - t0:.1f} s")


def check(edge: str, central: str, start: float, end: float) -> None:
    edge_names, central_names = names(edge, start, end), names(central, start, end)

    # (a) the raw and recorded trainpatrol series and trainpatrol's alerts arrive, with the external label
    expected = {n for n in edge_names if forwarded(n)} | {"ALERTS"}
    assert central_names == expected, (sorted(expected - central_names), sorted(central_names - expected))
    for name in ("trainpatrol_rank_up", "trainpatrol_step_total", "trainpatrol_gpu_utilization_ratio",
                 "run:trainpatrol_step:max_rate5m", "run_rank:trainpatrol_step_duration_seconds:mean5m",
                 "run:trainpatrol_loader_wait_ratio:max",
                 "instance_uuid_rank:trainpatrol_rank_info:live", "run:trainpatrol_gpu_utilization_ratio:avg",
                 "run:trainpatrol_validation_loss:avg"):
        assert name in central_names, name
    recorded = set(RECORDED.findall(RULES.read_text()))
    assert recorded & edge_names <= central_names, sorted(recorded & edge_names - central_names)
    print(f"\n[remote-write] recorded series received: {len(recorded & central_names)} of {len(recorded)}; "
          f"not recorded by this run: {sorted(recorded - central_names)}")
    # firing during the run (the closed run's alert has resolved by now)
    assert query(central, f'max_over_time(ALERTS{{alertname="{ALERT}",alertstate="firing",run="{RUN}"}}[10m])')
    assert query(central, f'count({{__name__=~".+",cluster!="{CLUSTER}"}})') == []
    assert query_value(central, f'count(trainpatrol_rank_up{{cluster="{CLUSTER}",namespace="ml-team",run="{RUN}"}})') \
        == 1

    # (b) nothing else does: the receiver's own series that the edge scraped, up, ALERTS_FOR_STATE, other alerts
    for name in ("prometheus_build_info", "go_goroutines", "up", "ALERTS_FOR_STATE"):
        assert name in edge_names and name not in central_names, name
    assert query(edge, 'ALERTS{alertname="Watchdog"}') and query(central, 'ALERTS{alertname="Watchdog"}') == []
    assert [n for n in central_names if not forwarded(n) and n != "ALERTS"] == []

    # (c) every dashboard query with data on the edge has data on the receiver (the cluster picked there): the
    # same series, but for the cluster label, with the same values
    shown: dict[str, int] = {}
    missing, differ = [], []
    for where, expr in dashboard_queries():
        at_edge = query_range(edge, substitute(expr, EDGE_VALUES), start, end)
        if not has_data(at_edge):
            continue
        dashboard = where.split(" / ")[0]
        shown[dashboard] = shown.get(dashboard, 0) + 1
        central_expr = substitute(expr, CENTRAL_VALUES)
        at_central = query_range(central, central_expr, start, end)
        if not has_data(at_central):
            missing.append(f"{where}: {central_expr}")
        elif without_cluster(at_central) != without_cluster(at_edge):
            differ.append(f"{where}: {central_expr}")
    assert not missing, "dashboard queries with data on the edge but not on the receiver:\n" + "\n".join(missing)
    assert not differ, "dashboard queries that differ on the receiver:\n" + "\n".join(differ)
    print(f"[remote-write] dashboard queries with data on the edge, and on the receiver: {shown}")
    for dashboard in ("training-checklist.json", "run-timeline.json", "gpu-node.json"):  # the DCGM one has none
        assert shown.get(dashboard, 0) >= 10, shown
    for where, selector, label in dashboard_variables():  # the variables list the edge's values centrally
        if "dcgm" in where:
            continue
        params = {"match[]": substitute(selector, {**CENTRAL_VALUES, "run": ".*", "rank": ".*"}),
                  "start": f"{start:.3f}", "end": f"{end:.3f}"}
        listed = http_json(f"{central}/api/v1/label/{label}/values?{urllib.parse.urlencode(params)}")["data"]
        assert listed, (where, params)
        if label == "cluster":
            assert listed == [CLUSTER], (where, listed)
