"""``trainpatrol demo``: a small model trains with Patrol, a fault is injected, the run pauses with a
checkpoint and evidence, and resumes on command.

On CPU there is no CUDA caching allocator, so the demo feeds Patrol a simulated allocator reading
(``SimulatedAllocator``), said so on start; on a GPU the real allocator is read.

With ``--stack`` the demo also runs Prometheus and Alertmanager on 127.0.0.1 (``trainpatrol.stack``)
with the shipped rules, so the real loop acts: metric, alert, webhook, pause. The default fault is
then a gradient spike, which no local guard acts on, so the Prometheus alert is what pauses the run.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .agent.config import DEFAULT_PORT
from .faults import FAULTS
from .probe.memory import MemoryReading
from .report import REPORT_NAME

if TYPE_CHECKING:
    from .probe.patrol import Patrol

DEFAULT_INJECT = "nan@150"
STACK_INJECT = "grad_spike@200"
FALLBACK_GUARD_ACTIONS = {"nonfinite_loss": "pause", "nonfinite_grad": "pause", "grad_norm_explosion": "pause",
                          "memory_fragmentation": "empty_cache"}
"""Without Prometheus, the local guards act on the faults the stack's alerts would have caught."""
STACK_GUARD_ACTIONS = {"nonfinite_loss": "pause", "nonfinite_grad": "pause"}
"""With the stack, the explosion guards only record (by default they pause), so that the injected grad spike
is paused by the Prometheus alert through Alertmanager: what the stack demo is there to show."""
STACK_NOTES = {
    "grad_spike": "; no local guard acts on it, so the Prometheus alert TrainPatrolGradNormExplosion is what pauses "
                  "the run.",
    "fragmentation": "; no local guard acts on it, so the Prometheus alert TrainPatrolMemoryFragmentationHigh is "
                     "what acts: it empties the allocator cache and the run goes on.",
    "nan": "; the local NaN guard pauses the run within two steps, before Prometheus can; the "
           "TrainPatrolNonFiniteLoss alert arrives while it is paused.",
}
EXPECTED_ALERTS = {"grad_spike": "TrainPatrolGradNormExplosion", "fragmentation": "TrainPatrolMemoryFragmentationHigh",
                   "nan": "TrainPatrolNonFiniteLoss"}
"""With the stack, the alert each fault must fire; the demo fails when the agent's webhook never receives it."""
GRAD_SPIKE_STEPS = 30
"""A gradient explosion lasts this many steps, then the loss scale returns to normal (a transient burst). It
ends sooner if the run pauses: the demo's operator fixes the cause before resuming, since a fault that
persists after a resume pauses the run again."""


def _say(text: str) -> None:
    print(f"[demo] {text}", flush=True)


class SimulatedAllocator:
    """A CPU stand-in for the CUDA allocator reading: steady use, plus injected fragmentation."""

    def __init__(self) -> None:
        self.fragmented = False
        self.calls = 0

    def __repr__(self) -> str:  # the evidence's config.json records it, and the report names it
        return "SimulatedAllocator()"

    def __call__(self) -> MemoryReading:
        self.calls += 1
        gib = 2.0**30
        allocated = 6 * gib + (self.calls % 7) * 0.05 * gib
        reserved = allocated / (0.4 if self.fragmented else 0.9)
        return MemoryReading(allocated=allocated, reserved=reserved, active=allocated * 1.02,
                             inactive_split=reserved - allocated if self.fragmented else 0.05 * gib,
                             peak_allocated=allocated + 0.4 * gib, alloc_retries=3.0 if self.fragmented else 0.0,
                             ooms=0.0, capacity=80 * gib)


class StallingLoader:
    """Wraps a DataLoader; sleeps before each batch once ``stall`` is set (a starved pipeline)."""

    def __init__(self, loader: DataLoader[Any], stall_seconds: float) -> None:
        self.loader, self.stall, self.stall_seconds = loader, False, stall_seconds
        self.num_workers, self.pin_memory = loader.num_workers, loader.pin_memory
        self.persistent_workers, self.prefetch_factor = loader.persistent_workers, loader.prefetch_factor
        self.batch_size = loader.batch_size

    def __iter__(self) -> Any:
        for batch in self.loader:
            if self.stall:
                time.sleep(self.stall_seconds)
            yield batch


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1)).to(device)


def _data(n: int = 4096, seed: int = 1) -> TensorDataset:
    """A noisy regression (unit signal, unit noise): the loss falls from about 2 to about 0.9 and the
    gradient norm stays within 3x of its median. A clean target would make the warm-up itself (loss
    26 -> 0.01, grad norm 25 -> 1) trip the relative LossSpike and GradNormExplosion rules, whose
    100-step window maxima still hold the first steps, and the demo would act before its fault."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(32, 1, generator=torch.Generator().manual_seed(1))
    x = torch.randn(n, 32, generator=g)
    return TensorDataset(x, x @ w / 32**0.5 + torch.randn(n, 1, generator=g))


def _validate(model: nn.Module, data: TensorDataset, device: torch.device) -> float:
    model.eval()
    with torch.no_grad():
        x, y = (t.to(device) for t in data.tensors)
        loss = float(nn.functional.mse_loss(model(x), y))
    model.train()
    return loss


def _call(agent_url: str, path: str, token: str = "", body: dict[str, Any] | None = None) -> Any:
    """GET ``path`` from the agent, or POST ``body`` to it; read routes need the token whenever the agent has one."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data, timeout = None, 2
    if body is not None:
        data, timeout = json.dumps(body).encode(), 5
        headers["Content-Type"] = "application/json"
    with urllib.request.urlopen(urllib.request.Request(agent_url + path, data, headers), timeout=timeout) as r:
        return json.loads(r.read())


MISSION = ("loss", "grad_norm", "cuda_memory_used_ratio", "cuda_memory_fragmentation_ratio", "cuda_alloc_retries_total",
           "cuda_ooms_total", "loader_wait_ratio", "step_total", "step_duration_seconds_count", "nonfinite_steps_total",
           "samples_total")


def _print_mission_metrics(agent_url: str, run: str) -> None:
    """What a newcomer should look at on /metrics, as the agent serves it now."""
    try:
        with urllib.request.urlopen(agent_url + "/metrics", timeout=2) as r:
            lines = r.read().decode().splitlines()
    except OSError as exc:
        _say(f"could not read {agent_url}/metrics: {exc}")
        return
    _say(f"the mission metrics on {agent_url}/metrics:")
    for line in lines:
        name = line.split("{", 1)[0]
        if name.removeprefix("trainpatrol_") in MISSION and f'run="{run}"' in line:
            _say(f"  {line}")
    gpus = sum(line.startswith("trainpatrol_gpu_info{") for line in lines)
    _say(f"  {gpus} GPU(s) on /metrics: the trainpatrol_gpu_* series" if gpus else
         "  no GPU metrics: the agent reads no NVML here (no NVIDIA driver, or --no-nvml); `make demo` "
         "in the repository serves recorded H200 readings instead")


def _run_state(agent_url: str, run: str, token: str = "") -> str:
    try:
        return str(_call(agent_url, f"/v1/runs/{run}", token)["state"])
    except Exception:
        return "unknown"


def _describe_pause(agent_url: str, run: str, fault_time: float | None, token: str = "") -> str:
    """Where, when and why the run paused, from the agent and the pause's evidence bundle."""
    seen = time.time()  # polled every 0.25 s: at most that late
    try:
        status = _call(agent_url, f"/v1/runs/{run}", token)
        last = status["last_action"] or {}
        trigger = json.loads((Path(last["evidence"]) / "trigger.json").read_text())
    except Exception:
        return "by an unknown trigger (no evidence bundle found)"
    after = f", about {seen - fault_time:.1f} s after the fault," if fault_time else ""
    source = str(trigger.get("source", ""))
    kind, _, name = source.partition(":")
    if kind == "alertmanager":
        by = f"Prometheus alert {name} (Prometheus -> Alertmanager -> agent webhook)"
    elif kind == "guard":
        by = f"local guard {name} (in the training process, no Prometheus involved)"
    else:
        by = source or "an unknown trigger"
    return (f"at step {last.get('step')}{after} by {by}; checkpoint: {status.get('last_checkpoint') or 'none'}; "
            f"evidence: {last['evidence']}")


def _auto_resume(agent_url: str, run: str, after: float, stop: threading.Event, token: str = "",
                 token_file: str = "", fault: dict[str, float] | None = None) -> None:
    """Acts like the operator: once the run is paused, wait, then ask the agent to resume it."""
    resume = f"trainpatrol resume {run} --agent {agent_url}" + (f" --token-file {token_file}" if token_file else "")
    while not stop.wait(0.25):
        if _run_state(agent_url, run, token) != "paused":
            continue
        where = _describe_pause(agent_url, run, (fault or {}).get("time"), token)
        _say(f"run {run} is paused {where}")
        if after <= 0:
            _say(f"inspect it (`trainpatrol status --agent {agent_url}`), then run `{resume}`.")
        else:
            _say(f"inspect it, e.g. `trainpatrol status --agent {agent_url}`. Resuming in {after:g} s "
                 f"as if you ran `{resume}`.")
            if stop.wait(after):
                return
            _call(agent_url, f"/v1/runs/{run}/actions", token, {"action": "resume", "reason": "demo auto-resume"})
        while not stop.wait(0.25) and _run_state(agent_url, run, token) == "paused":
            pass


def run_demo(args: argparse.Namespace) -> int:
    if not args.stack:
        return _train(args, args.inject or DEFAULT_INJECT, args.agent_url)
    return _run_with_stack(args)


def _run_with_stack(args: argparse.Namespace) -> int:
    from .stack import Binaries, Stack, StackConfig, StackError

    inject = args.inject or STACK_INJECT
    fault = inject.partition("@")[0]
    expected = EXPECTED_ALERTS.get(fault)
    binaries = Binaries.find()
    if binaries is None:
        _say("--stack: prometheus, prometheus-alertmanager, promtool or amtool is not on PATH (Debian: "
             "`apt-get install --no-install-recommends prometheus prometheus-alertmanager`, or `make system-deps`). "
             "Falling back to the local guards: Patrol acts by itself, without Prometheus or Alertmanager.")
        return _train(args, inject, args.agent_url, guard_actions=FALLBACK_GUARD_ACTIONS)
    port = urllib.parse.urlparse(args.agent_url).port or DEFAULT_PORT
    config = StackConfig(workdir=Path(args.workdir), agent_port=port, prometheus_port=args.prometheus_port,
                         alertmanager_port=args.alertmanager_port)
    stack = Stack(config, binaries)
    try:
        stack.start()
        loaded = stack.loaded_alerts()
    except (StackError, OSError) as exc:
        stack.stop()
        _say(f"--stack: the stack did not start: {exc}")
        return 1
    with stack:
        if expected and expected not in loaded:
            # the alert loop could not act: say so now rather than train and wait for an alert that never comes
            _say(f"--stack: Prometheus loaded no alerting rule {expected} from {stack.rules_file} "
                 f"({len(loaded)} alerting rules in all), so the injected {fault} would go unseen; see "
                 f"{stack.prometheus_url}/rules and {stack.dir / 'prometheus.log'}.")
            return 1
        _say(f"--stack: Prometheus    {stack.prometheus_url}  (alerts: {stack.prometheus_url}/alerts)")
        _say(f"--stack: Alertmanager  {stack.alertmanager_url}")
        _say(f"--stack: agent         {stack.agent_url}  (webhook {stack.agent_url}/v1/alertmanager, "
             f"bearer token in {stack.token_file})")
        _say(f"--stack: rules: the shipped rules of the FAST profile ({stack.rules_file}, {len(loaded)} "
             "alerting rules loaded): the same thresholds with short windows and `for:` of seconds, scraped and "
             "evaluated every 1 s, so you see an alert act within seconds. Production uses rules.yml "
             "(`trainpatrol export rules DIR`), whose alerts wait minutes.")
        _say(f"--stack: injecting {inject}{STACK_NOTES.get(fault, '.')}")
        rc = _train(args, inject, stack.agent_url, token=stack.token, token_file=str(stack.token_file),
                    guard_actions=STACK_GUARD_ACTIONS, push_interval=0.5)
        try:
            alerts = _alerts_after(stack.alerts, expected)
        except OSError as exc:
            _say(f"--stack: could not read the agent's alerts: {exc}")
            alerts = []
        _print_alerts(alerts)
        if rc == 0 and expected and not _fired(alerts, expected):
            _say(f"--stack: FAILED: the injected {fault} should have fired {expected}, but the agent's "
                 f"webhook never received it; see {stack.prometheus_url}/alerts, {stack.alertmanager_url} and the "
                 f"logs in {stack.dir}.")
            rc = 1
        _say(f"--stack: stopping Prometheus, Alertmanager and the agent (configs and logs: {stack.dir}).")
    return rc


def _fired(alerts: list[dict[str, Any]], name: str) -> bool:
    return any(a["alertname"] == name and a["status"] == "firing" for a in alerts)


def _alerts_after(read: Callable[[], list[dict[str, Any]]], expected: str | None,
                  wait_seconds: float = 20.0) -> list[dict[str, Any]]:
    """What the webhook received; a run shorter than the alert's path (scrape, rule, group_wait) waits for it."""
    deadline = time.monotonic() + wait_seconds
    alerts = read()
    while expected and not _fired(alerts, expected) and time.monotonic() < deadline:
        time.sleep(0.5)
        alerts = read()
    return alerts


def _print_alerts(alerts: list[dict[str, Any]]) -> None:
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for a in alerts:
        seen.setdefault((a["alertname"], a["status"]), a)
    if not seen:
        _say("--stack: the agent's webhook received no alert.")
        return
    for (name, status), a in seen.items():
        action = f"action {a['action']}" if a["action"] else "no action"
        _say(f"--stack: alert fired: {name} ({status}, run {a['run'] or '-'}, {action}, agent: {a['outcome']})")


def _train(args: argparse.Namespace, inject: str, agent_url: str, *, token: str = "", token_file: str = "",
           guard_actions: dict[str, str] | None = None, push_interval: float = 1.0) -> int:
    from .probe.config import PatrolConfig
    from .probe.patrol import Patrol

    fault, _, at = inject.partition("@")
    if fault not in FAULTS:
        raise SystemExit(f"`--inject {inject}` is not valid. Expected FAULT@STEP with FAULT in {FAULTS}.")
    fault_step = int(at or 0)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    work = Path(args.workdir)
    allocator = None if use_cuda else SimulatedAllocator()
    if allocator is not None:
        _say("CPU run: allocator metrics come from a simulated allocator (no CUDA here).")
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(args.steps, 1))
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    loader = StallingLoader(DataLoader(_data(), batch_size=64, shuffle=True), stall_seconds=0.05)
    held_out = _data(512, seed=2)
    config = PatrolConfig(run=args.run, agent_url=agent_url, checkpoint_dir=str(work / "checkpoints"),
                          evidence_dir=str(work / "evidence"), memory_reader=allocator,
                          memory_interval_seconds=0.2, push_interval_seconds=push_interval,
                          embedded_agent=not token, checkpoint_every_steps=args.checkpoint_every)
    if token:
        config.token = token
    if guard_actions is not None:
        config.guard_actions = dict(guard_actions)
    stop = threading.Event()
    fault_at: dict[str, float] = {}  # wall clock of the injection, for the pause message
    threading.Thread(target=_auto_resume, args=(agent_url, args.run, args.auto_resume, stop, token, token_file,
                                                fault_at), daemon=True).start()
    _say(f"metrics: {agent_url}/metrics   status: trainpatrol status --agent {agent_url}")
    last_print = 0.0
    with Patrol(model=model, optimizer=opt, scheduler=sched, scaler=scaler, config=config) as patrol:
        while patrol.step_count < args.steps:
            for x, y in patrol.loader(loader):
                step = patrol.step_count + 1
                if step > args.steps:
                    break
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = nn.functional.mse_loss(model(x), y)
                if step == fault_step and fault != "none":
                    fault_at["time"] = time.time()
                    _say(f"step {step}: injecting {fault}")
                if fault == "nan" and step == fault_step:
                    loss = loss * math.nan
                if fault == "grad_spike" and fault_step <= step < fault_step + GRAD_SPIKE_STEPS and \
                        not any(a.action == "pause" for a in patrol.actions):
                    loss = loss * 1e4
                if allocator is not None and fault == "fragmentation" and step == fault_step:
                    allocator.fragmented = True
                if fault == "loader_stall" and step == fault_step:
                    loader.stall = True
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                patrol.step(loss, grad_norm=total, batch_size=x.shape[0])
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                sched.step()
                if step % args.eval_every == 0:
                    patrol.evaluate(_validate(model, held_out, device))
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                if not args.quiet and time.monotonic() - last_print > 1.0:
                    last_print = time.monotonic()
                    lt = patrol._latest
                    _say(f"step {step:5d}  loss {lt.loss:9.4f}  grad_norm {lt.grad_norm:9.3f}  state {patrol.state}")
        patrol._publisher.push_now()
        _print_mission_metrics(agent_url, args.run)
    stop.set()
    _say(f"done: {patrol.step_count} steps. {_evidence_line(patrol)}; "
         f"last checkpoint: {patrol.last_checkpoint or 'none'}")
    return 0


def _evidence_line(patrol: Patrol) -> str:
    """Points at the pause's bundle, the incident the demo is about, rather than whatever came last
    (a periodic checkpoint writes a bundle too)."""
    pause = next((a for a in reversed(patrol.actions) if a.action == "pause" and a.evidence), None)
    if pause is None:
        return f"Evidence: {patrol.last_evidence or 'none'}"
    return f"The pause's evidence: {pause.evidence} (open {Path(pause.evidence) / REPORT_NAME})"
