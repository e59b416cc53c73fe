"""The MFU trainpatrol reports for a run, against MFU counted by hand for the same run.

Each case trains a GPT-shaped model (bf16 autocast, fused AdamW) over the README loop (``patrol.loader`` over a
shuffled ``DataLoader`` with 2 workers and pinned memory) for ``--seconds``, with a Patrol given the FLOPs per
token that ``trainpatrol.measure_flops`` (torch's ``FlopCounterMode``) counted on one step. A real agent takes
its pushes, and a real Prometheus scrapes the agent every second and evaluates the shipped ``alerting/rules.yml``.

    python bench/mfu.py [--case gpt2-124m --seconds 330] [--case gpt-5ms --seconds 75]

Per case:

- ``trainpatrol``: ``run:trainpatrol_mfu:median_rate5m`` (and the tokens per second per rank) as recorded at the
  last evaluation before the last step; a 5-minute rate is right only once the run's counters span 5 minutes, so
  a shorter case also reports the same expression over ``[1m]``.
- ``by hand``: (6 · parameters + 12 · layers · width · sequence) FLOPs per token (the PaLM paper's count, the
  attention term included) times tokens per step, over the measured step time and the device's dense bf16 peak.
- The GPU's own view over the timed steps: NVML's ``utilization.gpu`` and, where the GPU supports GPM (Hopper
  and later), the SM and tensor-pipe activity that dcgm-exporter exports as ``DCGM_FI_PROF_SM_ACTIVE`` and
  ``DCGM_FI_PROF_PIPE_TENSOR_ACTIVE``.

The timed steps run under ``torch.cuda.set_sync_debug_mode("error")``: a host sync there raises. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "exporter"))
sys.path.insert(0, str(REPO / "bench"))

from overhead import CASES, GPT  # noqa: E402
from scrape import free_port, wait_until  # noqa: E402

from trainpatrol import Patrol, PatrolConfig, measure_flops  # noqa: E402
from trainpatrol.probe.flops import peak_flops  # noqa: E402
from trainpatrol.stack import prometheus_config  # noqa: E402

SHAPES = {"gpt2-124m": (12, 768, 12, 1024, 16), "gpt-10ms": (4, 512, 8, 256, 16), "gpt-5ms": (2, 256, 4, 128, 8)}
"""Case: layers, width, heads, sequence, batch (the shapes of ``bench/overhead.py``'s cases)."""


def query(prom: str, expr: str, at: float) -> float:
    url = f"{prom}/api/v1/query?{urllib.parse.urlencode({'query': expr, 'time': f'{at:.3f}'})}"
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else math.nan


class GpuActivity:
    """NVML's utilization.gpu sampled every 0.5 s, and GPM's SM and any-tensor activity between ``start`` and
    ``stop`` where the GPU supports GPM."""

    def __init__(self, index: int) -> None:
        import pynvml as nv

        nv.nvmlInit()
        self.nv, self.handle = nv, nv.nvmlDeviceGetHandleByIndex(index)
        self.util: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._gpm: list[Any] = []
        self.gpm_error = ""
        try:
            self.gpm = bool(nv.nvmlGpmQueryDeviceSupport(self.handle).isSupportedDevice)
        except nv.NVMLError as exc:
            self.gpm, self.gpm_error = False, str(exc)

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            self.util.append(float(self.nv.nvmlDeviceGetUtilizationRates(self.handle).gpu))

    def start(self) -> None:
        if self.gpm:
            first = self.nv.nvmlGpmSampleAlloc()
            self.nv.nvmlGpmSampleGet(self.handle, first)
            self._gpm.append(first)
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        out: dict[str, Any] = {"nvml_utilization_gpu_pct_mean": round(sum(self.util) / max(1, len(self.util)), 1)}
        if not self.gpm:
            out["gpm"] = f"unsupported {self.gpm_error}".strip()
            return out
        nv = self.nv
        last = nv.nvmlGpmSampleAlloc()
        nv.nvmlGpmSampleGet(self.handle, last)
        get = nv.c_nvmlGpmMetricsGet_t()
        get.version, get.numMetrics = nv.NVML_GPM_METRICS_GET_VERSION, 3
        get.sample1, get.sample2 = self._gpm[0], last
        ids = {"sm_active_pct": nv.NVML_GPM_METRIC_SM_UTIL, "sm_occupancy_pct": nv.NVML_GPM_METRIC_SM_OCCUPANCY,
               "tensor_active_pct": nv.NVML_GPM_METRIC_ANY_TENSOR_UTIL}
        for i, metric in enumerate(ids.values()):
            get.metrics[i].metricId = metric
        nv.nvmlGpmMetricsGet(get)
        for i, name in enumerate(ids):
            out[f"gpm_{name}"] = round(get.metrics[i].value, 2)
        for sample in (self._gpm[0], last):
            nv.nvmlGpmSampleFree(sample)
        return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_case(name: str, seconds: float, agent: str, prom: str, device: torch.device,
             args_peak: float) -> dict[str, Any]:
    layers, dim, heads, seq, batch = SHAPES[name]
    torch.manual_seed(0)
    model = GPT(layers, dim, heads, seq=seq).to(device)
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    data = CASES[name].data(4096)
    dl = DataLoader(data, batch_size=batch, shuffle=True, num_workers=2, pin_memory=cuda, persistent_workers=True,
                    drop_last=True)
    tokens = batch * seq

    def loss_of(sample: torch.Tensor) -> torch.Tensor:
        sample = sample.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(sample[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), sample[:, 1:].flatten())

    first = next(iter(dl))[0]
    counted = measure_flops(lambda: loss_of(first).backward())
    opt.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in model.parameters())
    by_hand_per_token = 6 * params + 12 * layers * dim * seq

    def train(loader: Any, patrol: Patrol | None, until: float, at_most: int) -> int:
        done = 0
        while done < at_most and time.perf_counter() < until:
            for (sample,) in loader:
                loss = loss_of(sample)
                loss.backward()
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if patrol is not None:
                    patrol.step(loss, grad_norm=total, batch_size=batch, tokens=tokens)
                opt.step()
                opt.zero_grad(set_to_none=True)
                done += 1
                if done >= at_most or time.perf_counter() >= until:
                    break
        return done

    train(dl, None, math.inf, 30)  # cuBLAS, the allocator and the workers warm up before the run is watched
    cfg = PatrolConfig(run=f"mfu-{name}", agent_url=agent, embedded_agent=False, push_interval_seconds=1.0,
                       checkpoint_dir="/tmp/trainpatrol-mfu/ckpt", evidence_dir="/tmp/trainpatrol-mfu/ev",
                       guard_actions={}, flops_per_token=counted / tokens, peak_flops=0.0 if cuda else args_peak)
    patrol = Patrol(model=model, optimizer=opt, config=cfg)
    activity = GpuActivity(device.index or 0) if cuda else None
    sync(device)
    if activity is not None:
        activity.start()
    start = time.perf_counter()
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    steps = train(patrol.loader(dl), patrol, start + seconds, 10**9)
    if cuda:
        torch.cuda.set_sync_debug_mode("default")
    sync(device)
    wall = time.perf_counter() - start
    end_unix = time.time()
    gpu = activity.stop() if activity is not None else {}
    time.sleep(4)  # the last push, scrape and evaluation
    patrol.close()
    step_s = wall / steps
    peak = peak_flops(torch.cuda.get_device_name(device), "bf16") if cuda else args_peak
    sel = f'{{run="mfu-{name}"}}'
    one_minute = ("rate(trainpatrol_tokens_total{run=\"RUN\"}[1m]) * on (instance, run) group_left () "
                  "trainpatrol_run_model_flops_per_token{run=\"RUN\"} / on (instance, run) group_left () "
                  "max without (dtype) (trainpatrol_run_peak_flops{run=\"RUN\"})").replace("RUN", f"mfu-{name}")
    reported = query(prom, f"run:trainpatrol_mfu:median_rate5m{sel}", end_unix - 1.5)
    by_hand = by_hand_per_token * tokens / step_s / peak
    return {
        "case": name, "layers": layers, "width": dim, "sequence": seq, "batch": batch, "parameters": params,
        "steps": steps, "seconds": round(wall, 1), "step_ms": round(step_s * 1e3, 3),
        "tokens_per_s_measured": round(tokens / step_s, 1),
        "tokens_per_s_reported": round(query(prom, f"run:trainpatrol_tokens_per_rank:median_rate5m{sel}",
                                             end_unix - 1.5), 1),
        "flops_per_token": {"flop_counter_mode": counted / tokens, "by_hand": by_hand_per_token,
                            "counter_over_hand": round(counted / tokens / by_hand_per_token, 4)},
        "peak_flops_bf16": peak,
        "mfu_pct": {"trainpatrol_rate5m": round(100 * reported, 3),
                    "trainpatrol_rate1m": round(100 * query(prom, one_minute, end_unix - 1.5), 3),
                    "by_hand": round(100 * by_hand, 3),
                    "difference_pp": round(100 * (reported - by_hand), 3)},
        "gpu": gpu, "host_syncs_in_timed_steps": 0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", choices=sorted(SHAPES))
    ap.add_argument("--seconds", type=float, action="append",
                    help="training seconds of each --case, in order (default 330: the 5-minute rate needs 5 minutes)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--cpu-peak", type=float, default=1e12,
                    help="the peak FLOP/s assumed for --device cpu (a smoke run)")
    args = ap.parse_args()
    names = args.case or ["gpt2-124m"]
    seconds = (args.seconds or []) + [330.0] * (len(names) - len(args.seconds or []))
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    work = Path(tempfile.mkdtemp(prefix="trainpatrol-mfu-"))
    agent_port, prom_port = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "exporter"), os.environ.get("PYTHONPATH", "")]))
    (work / "prometheus.yml").write_text(prometheus_config([f"127.0.0.1:{agent_port}"],
                                                           [REPO / "alerting" / "rules.yml"], "127.0.0.1:9"))
    procs = [subprocess.Popen([sys.executable, "-m", "trainpatrol", "agent", "--host", "127.0.0.1", "--port",
                               str(agent_port), "--no-nvml"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL),
             subprocess.Popen([os.environ.get("PROMETHEUS") or shutil.which("prometheus") or "prometheus",
                               f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
                               f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    agent, prom = f"http://127.0.0.1:{agent_port}", f"http://127.0.0.1:{prom_port}"
    try:
        wait_until("agent", lambda: urllib.request.urlopen(agent + "/healthz", timeout=2), 30)
        wait_until("prometheus", lambda: urllib.request.urlopen(prom + "/-/ready", timeout=2), 60)
        results = [run_case(n, s, agent, prom, device, args.cpu_peak) for n, s in zip(names, seconds, strict=True)]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
    print(json.dumps({"benchmark": "mfu", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                      else "cpu", "torch": torch.__version__,
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()
