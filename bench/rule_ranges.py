"""Alert-rule inputs on real CPU runs, as a real Prometheus scraped them from a real agent.

Each case trains for a while with a Patrol whose local guards judge but do not act
(``guard_actions={}``), so a sick run's series evolve as they would if only Prometheus watched.
A ``trainpatrol agent`` process serves the pushes; Prometheus scrapes it and evaluates the shipped
rules every second. Afterwards every rank series of the run is read back at 1 s resolution and
written to ``OUT/CASE.json`` (time rebased to the run's first scrape, timestamps in values too), and
a JSON summary of what the rules look at is printed:

- ``grad_norm_ratio`` / ``loss_ratio``: the window max over the median of the same window max over
  the last 30 minutes (what TrainPatrolGradNormExplosion and TrainPatrolLossSpike compare), healthy
  part and, for a faulty case, the sick part;
- ``loader_wait_ratio_<W>``: increase of loader wait over increase of step time within W, from the
  first scrape (what TrainPatrolDataLoaderBound compares);
- ``validation_loss``: best and last.

    python bench/rule_ranges.py --out /tmp/ranges                       # every case
    python bench/rule_ranges.py --out /tmp/ranges --case mlp-lr1e4 --seconds 120

``alerting/tests/measured.test.yml`` is built from these files (``bench/rule_ranges.py --promtool``).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "exporter"))

STEP_SECONDS = 0.05
"""Pace of every case: about 50 ms a step (the LR x 1e4 incident: 1,229 steps in 63 s)."""
CASES = {
    # name: (kind, seconds, fault second or None)
    "mlp-healthy": ("mlp", 300.0, None),
    "mlp-lr1e4": ("mlp", 180.0, 120.0),
    "mlp-loader-bound": ("mlp-loader", 360.0, 60.0),
    "hf-healthy": ("hf", 300.0, None),
    "hf-lr1e4": ("hf", 180.0, 120.0),
    "mlp-overfit": ("mlp", 900.0, None),
    "mlp-fresh": ("mlp-fresh", 900.0, None),
}
"""``mlp``: the demo's model and its 4096 samples, which it memorises: the training loss falls to
1e-6 while the validation loss rises from 1.16 to 1.96 (a real over-fit, from about step 150).
``mlp-fresh``: the same model on a fresh batch every step, which cannot over-fit."""
AFTER_CLOSE_SECONDS = 20.0
"""Prometheus keeps scraping this long after the run closed: the replay covers a closed run too."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _wait(predicate: Callable[[], Any], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(what)


@contextmanager
def stack(work: Path) -> Iterator[tuple[str, str]]:
    """An agent process and a Prometheus scraping it every second with the shipped rules."""
    agent_port, prom_port = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(args: list[str], log: str) -> None:
        with open(work / log, "wb") as out:  # the child keeps its own descriptor
            procs.append(subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT))

    try:
        spawn([sys.executable, "-m", "trainpatrol", "agent", "--host", "127.0.0.1", "--port", str(agent_port),
               "--no-nvml"], "agent.log")
        agent = f"http://127.0.0.1:{agent_port}"
        _wait(lambda: _get(agent + "/healthz"), 30, "agent ready")
        cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
               "scrape_configs": [{"job_name": "trainpatrol",
                                   "static_configs": [{"targets": [f"127.0.0.1:{agent_port}"]}]}],
               "rule_files": [str(ROOT / "alerting" / "rules.yml")]}
        (work / "prometheus.yml").write_text(json.dumps(cfg))
        prometheus = shutil.which("prometheus")
        assert prometheus, "prometheus is not installed"
        spawn([prometheus, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
               f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"], "prometheus.log")
        prom = f"http://127.0.0.1:{prom_port}"
        _wait(lambda: urllib.request.urlopen(prom + "/-/ready", timeout=2).status == 200, 30, "prometheus ready")
        yield agent, prom
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _patrol_config(run: str, agent: str, work: Path) -> Any:
    from trainpatrol import PatrolConfig

    return PatrolConfig(run=run, agent_url=agent, embedded_agent=False, push_interval_seconds=1.0,
                        guard_actions={}, checkpoint_dir=str(work / run / "ckpt"),
                        evidence_dir=str(work / run / "evidence"))


def _fresh_batches(batch: int = 64) -> Iterator[tuple[Any, Any]]:
    """The distribution of ``demo._data`` (same weights, unit noise), a new batch every time."""
    import torch

    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 1, generator=torch.Generator().manual_seed(1))
    while True:
        x = torch.randn(batch, 32, generator=g)
        yield x, x @ w / 32**0.5 + torch.randn(batch, 1, generator=g)


def train_mlp(run: str, agent: str, work: Path, seconds: float, fault: float | None, loader_bound: bool,
              fresh: bool = False) -> None:
    """The demo's model and data (a noisy regression), AdamW with a cosine schedule, paced to STEP_SECONDS.
    Fault at ``fault`` seconds: LR x 1e4, or (``loader_bound``) a pipeline that takes 0.19 s a batch."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from trainpatrol import Patrol
    from trainpatrol.demo import StallingLoader, _data, _model, _validate

    model = _model(torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=int(seconds / STEP_SECONDS))
    loader: Any = StallingLoader(DataLoader(_data(), batch_size=64, shuffle=True), stall_seconds=0.19)
    if fresh:
        loader = _fresh_batches()
    held_out = _data(512, seed=2)
    start = time.monotonic()
    faulty = False
    with Patrol(model=model, optimizer=opt, scheduler=sched, config=_patrol_config(run, agent, work)) as patrol:
        while time.monotonic() - start < seconds:
            for x, y in patrol.loader(loader):
                t0 = time.monotonic()
                if t0 - start >= seconds:
                    break
                if fault is not None and not faulty and t0 - start >= fault:
                    faulty = True
                    if loader_bound:
                        loader.stall = True
                    else:
                        for g in opt.param_groups:
                            g["lr"] *= 1e4
                        sched.base_lrs = [b * 1e4 for b in sched.base_lrs]
                    print(f"[{run}] fault at step {patrol.step_count + 1}", flush=True)
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                patrol.step(loss, grad_norm=total, batch_size=x.shape[0])
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                if patrol.step_count % 100 == 0:
                    patrol.evaluate(_validate(model, held_out, torch.device("cpu")))
                time.sleep(max(0.0, STEP_SECONDS - (time.monotonic() - t0)))


def train_hf(run: str, agent: str, work: Path, seconds: float, fault: float | None) -> None:
    """The tiny GPT-2 of tests/integrations/test_huggingface.py in a real Trainer (2 loader workers),
    paced to STEP_SECONDS; fault: LR x 1e4 at ``fault`` seconds."""
    import torch
    import transformers

    from trainpatrol.integrations.huggingface import TrainPatrolCallback

    vocab, seq = 64, 16

    class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __init__(self, n: int = 4096) -> None:
            g = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, vocab, (n, seq), generator=g)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    start = time.monotonic()

    class Pace(transformers.TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.t0 = time.monotonic()
            self.faulty = False

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t0 = time.monotonic()
            if fault is not None and not self.faulty and self.t0 - start >= fault:
                self.faulty = True
                sched, opt = kw["lr_scheduler"], kw["optimizer"]
                sched.base_lrs = [b * 1e4 for b in sched.base_lrs]
                for g in opt.param_groups:
                    g["lr"] *= 1e4
                print(f"[{run}] fault at step {state.global_step + 1}", flush=True)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            time.sleep(max(0.0, STEP_SECONDS - (time.monotonic() - self.t0)))
            if time.monotonic() - start >= seconds:
                control.should_training_stop = True

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=32,
                                                                  n_layer=1, n_head=2))
    targs = transformers.TrainingArguments(
        output_dir=str(work / run / "out"), max_steps=int(seconds / STEP_SECONDS) * 2,
        per_device_train_batch_size=4, learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=20,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
        dataloader_num_workers=2, max_grad_norm=1.0)
    cb = TrainPatrolCallback(_patrol_config(run, agent, work))
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=RandomTokens(), callbacks=[cb, Pace()])
    trainer.train()


def query_range(prom: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": "1"})
    body = _get(f"{prom}/api/v1/query_range?{q}")
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def record(prom: str, run: str, start: float, end: float) -> dict[str, Any]:
    """Every rank series of ``run`` (histogram buckets left out) at 1 s, rebased to ``start``."""
    expr = f'{{__name__=~"trainpatrol_.+",__name__!~".+_bucket",run="{run}"}}'
    n = int(end - start) + 1
    series: dict[str, list[float | None]] = {}
    for s in query_range(prom, expr, start, end):
        labels = dict(s["metric"])
        name = labels.pop("__name__")
        rebase = name.endswith("_timestamp_seconds")
        values: list[float | None] = [None] * n
        for t, v in s["values"]:
            x = float(v)
            values[round(float(t) - start)] = x - start if rebase and x > 0 else x
        key = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        series[key] = values
    return {"run": run, "start": start, "seconds": n - 1, "series": series}


def _one(data: dict[str, Any], name: str, **match: str) -> list[float | None]:
    for key, values in data["series"].items():
        if key.startswith(name + "{") and all(f'{k}="{v}"' in key for k, v in match.items()):
            return list(values)
    return []


def _trailing_ratio(values: list[float | None], window: int = 1800, min_samples: int = 10) -> list[float | None]:
    """value / median of the values within the trailing window (itself included), as the rules compute it."""
    out: list[float | None] = []
    for i, v in enumerate(values):
        past = [x for x in values[max(0, i - window + 1): i + 1] if x is not None]
        if v is None or len(past) < min_samples:
            out.append(None)
            continue
        med = statistics.median(past)
        out.append(v / med if med > 0 else None)
    return out


def _window_ratio(num: list[float | None], den: list[float | None], w: int) -> list[float | None]:
    out: list[float | None] = []
    for i in range(len(num)):
        # the oldest sample within the window, as rate() takes it (its extrapolation cancels in a ratio)
        j = next((k for k in range(max(0, i - w), i) if num[k] is not None and den[k] is not None), None)
        if j is None or num[i] is None or den[i] is None:
            out.append(None)
            continue
        a, b = num[j], den[j]
        d = den[i] - b  # type: ignore[operator]
        out.append((num[i] - a) / d if d > 0 else (math.inf if num[i] - a > 0 else None))  # type: ignore[operator]
    return out


def _stats(values: list[float | None]) -> dict[str, float] | None:
    xs = [x for x in values if x is not None]
    if not xs:
        return None
    finite = [x for x in xs if math.isfinite(x)]
    return {"max": max(xs), "min": min(xs), "median": statistics.median(finite) if finite else math.nan,
            "n": len(xs)}


def summary(data: dict[str, Any], fault: float | None) -> dict[str, Any]:
    split = int(fault) if fault is not None else len(next(iter(data["series"].values())))
    out: dict[str, Any] = {}
    for short, metric in (("grad_norm", "trainpatrol_grad_norm_window_max"), ("loss", "trainpatrol_loss_window_max")):
        raw, ratio = _one(data, metric), _trailing_ratio(_one(data, metric))
        out[f"{short}_window_max"] = {"healthy": _stats(raw[:split]), "sick": _stats(raw[split:])}
        out[f"{short}_ratio"] = {"healthy": _stats(ratio[:split]), "sick": _stats(ratio[split:])}
        limit = 10 if short == "grad_norm" else 3
        first = next((i for i, r in enumerate(ratio) if i >= split and r is not None and r > limit), None)
        out[f"{short}_ratio"]["seconds_to_threshold_after_fault"] = None if first is None else first - split
    wait = _one(data, "trainpatrol_loader_wait_seconds_total")
    step = _one(data, "trainpatrol_step_duration_seconds_sum")
    for w in (60, 120, 300):
        r = _window_ratio(wait, step, w)
        out[f"loader_wait_ratio_{w}s"] = {"healthy": _stats(r[:split]), "sick": _stats(r[split:]),
                                          "first_finite_second": next((i for i, x in enumerate(r) if x is not None
                                                                       and math.isfinite(x)), None)}
    val = [x for x in _one(data, "trainpatrol_validation_loss") if x is not None]
    out["validation_loss"] = {"best": min(val), "last": val[-1]} if val else None
    steps = [x for x in _one(data, "trainpatrol_step_total") if x is not None]
    out["steps"] = max(steps) if steps else 0
    return out


def run_case(case: str, out: Path, seconds: float | None = None) -> dict[str, Any]:
    kind, default_seconds, fault = CASES[case]
    seconds = seconds or default_seconds
    if fault is not None and seconds <= fault:
        fault = seconds / 2
    with tempfile.TemporaryDirectory(prefix=f"ranges-{case}-") as tmp:
        work = Path(tmp)
        with stack(work) as (agent, prom):
            start = math.floor(time.time()) + 1.0
            if kind == "hf":
                train_hf(case, agent, work, seconds, fault)
            else:
                train_mlp(case, agent, work, seconds, fault, loader_bound=kind == "mlp-loader",
                          fresh=kind == "mlp-fresh")
            time.sleep(AFTER_CLOSE_SECONDS)
            end = math.floor(time.time())
            data = record(prom, case, start, end)
            data["fault_second"] = fault
            alerts = query_range(prom, f'ALERTS{{run="{case}"}}', start, end)
            data["alerts_live"] = [{"labels": a["metric"], "first": float(a["values"][0][0]) - start,
                                    "last": float(a["values"][-1][0]) - start} for a in alerts]
    data["summary"] = summary(data, fault)
    (out / f"{case}.json").write_text(json.dumps(data))
    return data


def _firing(run: str, alert: str, severity: str, action: str, per_rank: bool = True) -> str:
    rank = 'instance="127.0.0.1:9400",rank="0",' if per_rank else ""  # run-level alerts have neither
    labels = (f'alertname="{alert}",alertstate="firing",{rank}job="trainpatrol",'
              f'run="{run}",severity="{severity}",action="{action}"')
    return f"          - labels: 'ALERTS{{{labels}}}'\n            value: 1"


def _end(data: dict[str, Any]) -> int:
    return int(data["seconds"]) // RESAMPLE_SECONDS * RESAMPLE_SECONDS


def _silent(case: str, data: dict[str, Any], but: str = "") -> tuple[str, int, str]:
    """No alert of the run (``but`` excepted) pending or firing at any evaluation, through its close."""
    matchers = f'run="{case}"' + (f',alertname!="{but}"' if but else "")
    return f"max_over_time(ALERTS{{{matchers}}}[{_end(data)}s])", _end(data), ""


def _never_fires(case: str, data: dict[str, Any], alert: str) -> tuple[str, int, str]:
    return (f'max_over_time(ALERTS{{run="{case}",alertname="{alert}",alertstate="firing"}}[{_end(data)}s])',
            _end(data), "")


def _sick(case: str, data: dict[str, Any], alert: str, severity: str, action: str,
          within: int, but: str = "") -> list[tuple[str, int, str]]:
    """Silent until the fault (``but`` excepted), and ``alert`` firing ``within`` seconds of it."""
    fault = int(data["fault_second"])
    matchers = f'run="{case}"' + (f',alertname!="{but}"' if but else "")
    return [(f"max_over_time(ALERTS{{{matchers}}}[{fault}s])", fault, ""),
            (f'ALERTS{{run="{case}",alertname="{alert}",alertstate="firing"}}', fault + within,
             _firing(case, alert, severity, action))]


MEASURED_CHECKS: dict[str, Callable[[str, dict[str, Any]], list[tuple[str, int, str]]]] = {
    # a fresh batch every step: nothing to over-fit. Silent on every rule through its close; its
    # validation loss (512 fixed samples) swings 3-6% above its best, so ValLossDiverging is pending
    # for up to 205 s at a time, never the 10 minutes of its for:
    "mlp-fresh": lambda c, d: [_silent(c, d, but="TrainPatrolValLossDiverging"),
                               _never_fires(c, d, "TrainPatrolValLossDiverging")],
    "hf-healthy": lambda c, d: [_silent(c, d)],
    # the demo model memorises its data: silent but for ValLossDiverging, which fires (a real over-fit)
    "mlp-overfit": lambda c, d: [_silent(c, d, but="TrainPatrolValLossDiverging"),
                                 (f'ALERTS{{run="{c}",alertname="TrainPatrolValLossDiverging",alertstate="firing"}}',
                                  690, _firing(c, "TrainPatrolValLossDiverging", "warning", "checkpoint",
                                          per_rank=False))],
    # LR x 1e4: GradNormExplosion fires within 30 s (for: 15s at a 5 s evaluation interval); the demo
    # model over-fits from its first minute, so ValLossDiverging may be pending before the fault
    "mlp-lr1e4": lambda c, d: _sick(c, d, "TrainPatrolGradNormExplosion", "critical", "pause", 30,
                                    but="TrainPatrolValLossDiverging"),
    "hf-lr1e4": lambda c, d: _sick(c, d, "TrainPatrolGradNormExplosion", "critical", "pause", 30),
    # the pipeline takes 0.19 s a batch (wait about half of each step on this loaded machine): fires
    # within 5 minutes
    "mlp-loader-bound": lambda c, d: _sick(c, d, "TrainPatrolDataLoaderBound", "warning", "capture", 300,
                                           but="TrainPatrolValLossDiverging"),
}
"""What the replay of each case must show (``write_promtool``)."""

RESAMPLE_SECONDS = 5
"""The promtool replay samples the 1 s recordings every 5 s: a 5 s scrape and evaluation interval."""


def _fmt(values: list[float | None]) -> str:
    """promtool's series notation, runs of one value folded (``1x4`` is five samples, ``_`` none)."""
    out: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        v = values[i]
        if v is None:  # promtool: ``_x3`` is three missing samples, ``1x3`` four samples of 1
            out.append("_" if j == i else f"_x{j - i + 1}")
        else:
            out.append(f"{v:.9g}" if j == i else f"{v:.9g}x{j - i}")
        i = j + 1
    return " ".join(out)


def promtool_series(data: dict[str, Any], metrics: set[str]) -> list[tuple[str, str]]:
    """The recorded series the rules read, every RESAMPLE_SECONDS, on a fixed instance label."""
    out = []
    for key, values in sorted(data["series"].items()):
        name = key.split("{", 1)[0]
        if name not in metrics:
            continue
        labels = key.split("{", 1)[1]
        labels = ",".join(p for p in labels.rstrip("}").split(",") if not p.startswith("instance="))
        out.append((f'{name}{{instance="127.0.0.1:9400",{labels}}}', _fmt(values[::RESAMPLE_SECONDS])))
    return out


def write_promtool(path: Path, sources: list[Path],
                   checks: dict[str, Callable[[str, dict[str, Any]], list[tuple[str, int, str]]]]) -> None:
    """``alerting/tests/measured.test.yml``: each case's recording replayed through the shipped rules,
    with ``checks[case](case, data)`` as (expr, eval second, expected samples as YAML, or "" for none)."""
    rules = (ROOT / "alerting" / "rules.yml").read_text()
    metrics = set(re.findall(r"(?<![:\w])(trainpatrol_[a-z0-9_]+)\b", rules))
    lines = [
        "# generated by bench/rule_ranges.py --promtool, do not edit: real CPU runs (bench/rule_ranges.py)",
        "# that a real Prometheus scraped from a real agent every second, every series the rules read,",
        f"# resampled every {RESAMPLE_SECONDS} s (a {RESAMPLE_SECONDS} s scrape and evaluation interval), time from",
        "# the run's first scrape. The measured numbers and the durations chosen from them: alerting/README.md.",
        "rule_files:",
        "  - ../rules.yml",
        "group_eval_order:  # recording rules first, as in the other tests",
        *(f"  - {name}" for name in re.findall(r"^  - name: (\S+)$", rules, flags=re.M)),
        f"evaluation_interval: {RESAMPLE_SECONDS}s",
        "",
        "tests:",
    ]
    for case, make_checks in checks.items():
        data = next(json.loads(p.read_text()) for src in sources for p in [src / f"{case}.json"] if p.exists())
        case_checks = make_checks(case, data)
        fault = data.get("fault_second")
        about = f"fault at {fault:g} s" if fault is not None else "no fault"
        lines += [f"  - name: {case} ({about}, {data['summary']['steps']:g} steps, closed at the end)",
                  f"    interval: {RESAMPLE_SECONDS}s", "    input_series:"]
        for series, values in promtool_series(data, metrics):
            lines += [f"      - series: '{series}'", f"        values: '{values}'"]
        lines.append("    promql_expr_test:")
        for expr, at, expected in case_checks:
            lines += [f"      - expr: '{expr}'", f"        eval_time: {at}s"]
            lines += [f"        exp_samples:\n{expected}" if expected else "        exp_samples: []"]
        lines.append("")
    path.write_text("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, required=True, help="where the recordings go (or come from)")
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--promtool", type=Path, help="write this promtool test from the recordings in --out "
                                                      "(and --also) instead of running cases")
    parser.add_argument("--also", type=Path, action="append", default=[])
    args = parser.parse_args()
    if args.promtool:
        write_promtool(args.promtool, [args.out, *args.also], MEASURED_CHECKS)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    report = {}
    for case in args.case or list(CASES):
        data = run_case(case, args.out, args.seconds)
        report[case] = {"summary": data["summary"], "alerts_live": data["alerts_live"]}
        print(json.dumps({case: report[case]}), flush=True)
    (args.out / "summary.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
