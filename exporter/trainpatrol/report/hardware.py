"""The machine's side: the GPU readings (nvml.json), the allocator's state and summary, and the stacks."""

from __future__ import annotations

import json
from typing import Any

from ._html import details, esc, gib, note, num, pre, table
from .bundle import Bundle, RankPart, ranks_text

SUMMARY_LINES = 40
STATS = (("allocated_bytes.all.current", "allocated"), ("reserved_bytes.all.current", "reserved"),
         ("active_bytes.all.current", "active"), ("inactive_split_bytes.all.current", "inactive split"),
         ("allocated_bytes.all.peak", "peak allocated"), ("num_alloc_retries", "alloc retries"),
         ("num_ooms", "OOMs"), ("num_device_alloc", "device allocs"))


def _reading(series: dict[str, Any], name: str, label: str | None = None) -> float | None:
    """One value of a GPU's series: ``name`` -> [[label values], value], picked by its first label value."""
    for entry in series.get(name) or []:
        if isinstance(entry, list) and len(entry) == 2 and (label is None or (entry[0] or [None])[0] == label):
            value = entry[1]
            return float(value) if isinstance(value, int | float) else None
    return None


def _gpu_row(gpu: dict[str, Any]) -> list[str]:
    s: dict[str, Any] = gpu["series"] if isinstance(gpu.get("series"), dict) else {}

    def r(name: str, label: str | None = None) -> float | None:
        return _reading(s, name, label)

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v * 100:.0f} %"

    power, limit = r("gpu_power_watts"), r("gpu_power_limit_watts")
    used, total = r("gpu_memory_used_bytes"), r("gpu_memory_total_bytes")
    sm = r("gpu_clock_hertz", "sm")
    events = [e[0][0] for e in s.get("gpu_clock_event_active") or []
              if isinstance(e, list) and len(e) == 2 and e[1] and e[0] and e[0][0] != "gpu_idle"]
    ecc = (r("gpu_ecc_errors_total", "corrected"), r("gpu_ecc_errors_total", "uncorrected"))
    return [str(gpu.get("gpu", "?")), str(gpu.get("name", "")), str(gpu.get("uuid", "")),
            pct(r("gpu_utilization_ratio")), f"{gib(used)} / {gib(total)}",
            "-" if power is None else f"{power:.0f} / {num(limit, 4)} W",
            "/".join(num(r("gpu_temperature_celsius", k), 3) for k in ("gpu", "memory")) + " °C",
            "-" if sm is None else f"{sm / 1e6:.0f} MHz", num(r("gpu_performance_state")),
            ", ".join(events) or "none", "/".join(num(v) for v in ecc)]


def gpus(bundle: Bundle) -> str:
    """One table per distinct NVML snapshot (ranks of one node read the same agent)."""
    groups: dict[str, tuple[Any, list[int]]] = {}
    for part in bundle.ranks:
        missing = {"available": False, "reason": "nvml.json is missing"}
        nv: dict[str, Any] = part.nvml if isinstance(part.nvml, dict) else missing
        key = (json.dumps(sorted(str(g.get("uuid")) for g in nv.get("gpus", []) if isinstance(g, dict)))
               if nv.get("available") else "unavailable:" + str(nv.get("reason", "")))
        groups.setdefault(key, (nv, []))[1].append(part.rank)
    out = []
    for nv, ranks in groups.values():
        who = f"read by {ranks_text(ranks)}"
        if not nv.get("available"):
            out.append(note(f"No GPU readings ({esc(who)}): {esc(nv.get('reason', 'unknown reason'))}.", "warn"))
            continue
        if not any(isinstance(g, dict) for g in nv.get("gpus", [])):
            # the agent answered but saw no GPU: a CPU host, or NVML could not be loaded
            why = f"NVML reported {nv['error']}" if nv.get("error") else "NVML saw no GPU"
            out.append(note(f"No GPU readings ({esc(who)}): {esc(why)}.", "warn"))
            continue
        driver = nv.get("driver_version")
        head = f"<h3>{'Driver ' + esc(driver) if driver else 'Driver version not read'}, {esc(who)}</h3>"
        if nv.get("error"):
            head += note(f"The NVML sampler reported: {esc(nv['error'])}", "bad")
        rows = [_gpu_row(g) for g in nv.get("gpus", []) if isinstance(g, dict)]
        out.append(head + table(("GPU", "name", "uuid", "util", "memory used / total", "power / limit",
                                 "temp gpu/mem", "SM clock", "P-state", "clock events", "ECC corr/uncorr"),
                                rows, cls="nums"))
        xids = [x for x in nv.get("xid", []) if isinstance(x, dict)]
        if xids:
            out.append("<h4>XID errors</h4>" + table(("GPU", "uuid", "XID", "count", "last seen"), [
                (str(x.get("gpu")), str(x.get("uuid")), str(x.get("xid")), str(x.get("count")),
                 num(x.get("last_timestamp_seconds"), 12)) for x in xids]))
        out.append(details("Every reading", pre(_flat(nv))))
    return "".join(out) or note("No rank carries an nvml.json.", "warn")


def _flat(nv: dict[str, Any]) -> str:
    lines = []
    for g in nv.get("gpus", []):
        series: dict[str, Any] = g["series"] if isinstance(g, dict) and isinstance(g.get("series"), dict) else {}
        for name, entries in sorted(series.items()):
            for entry in entries or []:
                if isinstance(entry, list) and len(entry) == 2:
                    labels = ",".join(map(str, entry[0] or []))
                    lines.append(f"gpu {g.get('gpu')}  {name}{'{' + labels + '}' if labels else ''} = {entry[1]}")
    return "\n".join(lines)


def memory(bundle: Bundle) -> str:
    out = []
    for i, part in enumerate(bundle.ranks):
        body = _stats(part)
        lines = part.memory_summary.splitlines()
        top = "\n".join(lines[:SUMMARY_LINES])
        if len(lines) > SUMMARY_LINES:
            top += f"\n… {len(lines) - SUMMARY_LINES} more lines in {part.path.name}/memory_summary.txt"
        body += pre(top or "(memory_summary.txt is empty or missing)")
        if part.simulated_memory:
            body += note("This rank has no CUDA allocator: the memory figures in the timeline are simulated "
                         f"(PatrolConfig.memory_reader = {esc(part.memory_reader)}).", "warn")
        if part.has_snapshot:
            body += note(f"<code>{esc(part.path.name)}/memory_snapshot.pickle</code> holds the allocation history: "
                         "open it in PyTorch's memory visualiser (pytorch.org/memory_viz, runs locally).")
        out.append(details(f"Rank {part.rank}", body, open_=i == 0, ident=f"memory-rank{part.rank}"))
    return "".join(out) or note("No rank part in this bundle.", "warn")


def _stats(part: RankPart) -> str:
    st = part.memory_stats
    rows = [(label, gib(st[key]) if key.endswith("bytes.all.current") or key.endswith(".peak") else num(st[key]))
            for key, label in STATS if key in st]
    return table(("allocator", "value"), rows) if rows else ""


def stacks(bundle: Bundle) -> str:
    out = []
    for i, part in enumerate(bundle.ranks):
        threads = part.stacks.count("Thread 0x") + part.stacks.count("Current thread")
        out.append(details(f"Rank {part.rank} <span class=\"muted\">({threads} threads)</span>",
                           pre(part.stacks or "(stacks.txt is empty or missing)", "stacks"),
                           open_=i == 0, ident=f"stacks-rank{part.rank}"))
    return "".join(out) or note("No rank part in this bundle.", "warn")


def files(bundle: Bundle) -> str:
    rows = [(name, f"{(bundle.path / name).stat().st_size:,} B") for name in bundle.files()]
    return details(f"{len(rows)} files in <code>{esc(bundle.path)}</code>", table(("file", "size"), rows))
