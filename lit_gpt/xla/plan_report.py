"""The TPU planner's summary and report (xla/scripts/plan.py): the plan at the model's depth from the compiled
depths (compiled whole, or extrapolated per layer), the largest micro batch estimate, the printed report, and the
host's time and memory of each phase. Pure Python: no torch_xla, no TPU compiler."""

import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

from lit_gpt.xla.plan import COLLECTIVES, extrapolate, roofline

_START = time.perf_counter()


def _rss_gib() -> Any:
    """(resident, peak resident) memory of this process in GiB, from /proc (Linux)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return tuple(int(fields[k].split()[0]) / 1024 ** 2 for k in ("VmRSS", "VmHWM"))
    except (OSError, KeyError, ValueError):
        return (0.0, 0.0)


def progress(what: str) -> None:
    """One line per finished phase on stderr: seconds since the process started, its memory now and at its peak."""
    rss, peak = _rss_gib()
    print(f"[plan {time.perf_counter() - _START:7.1f} s, host RSS {rss:5.2f} GiB (peak {peak:5.2f})] {what}",
          file=sys.stderr, flush=True)


def host_memory() -> Dict[str, float]:
    """Peak resident memory of this process, in GiB (the tracing and compiling children report their own)."""
    gib = 1024 ** 2  # ru_maxrss is in KiB on Linux
    return {"plan_process_max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / gib, 2)}


def machine() -> Dict[str, Any]:
    """Where and with what the plan was made (the TPU compiler's version decides the numbers)."""
    import datetime
    import importlib.metadata
    import platform

    versions = {}
    for package in ("torch", "torch_xla", "jax", "jaxlib", "libtpu"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu_cores_usable": len(os.sched_getaffinity(0)), "machine": platform.machine(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024 ** 3, 1),
            "versions": versions}


_EXTRAPOLATED = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes", "flops",
                 "bytes_accessed")


def summarise(config: Any, topo: Any, job: Dict[str, Any], compiled: Dict[int, Dict[str, Any]],
              method: str) -> Dict[str, Any]:
    """The plan at the model's depth (compiled, or extrapolated per layer from the compiled depths)."""
    n = config.n_layer
    per_chip: Dict[str, Any] = {}
    extrapolation_check = None
    failed = {d: r for d, r in compiled.items() if "argument_bytes" not in r}
    if n in compiled:
        per_chip = {k: compiled[n].get(k) for k in _EXTRAPOLATED + ("over_bytes",) if k in compiled[n]}
        collectives = compiled[n].get("collectives")
        fits = bool(compiled[n]["fits"])
        how = "compiled at full depth"
        shallow = {d: r for d, r in compiled.items() if d != n and "argument_bytes" in r}
        if len(shallow) >= 2:  # --layers with --full_depth: how far the per-layer line lands from the compile
            check = {}
            for k in ("peak_bytes", "argument_bytes", "temp_bytes", "flops"):
                line = extrapolate({d: r[k] for d, r in shallow.items()}, n)
                check[k] = {"extrapolated": line, "compiled": compiled[n][k],
                            "error": line / compiled[n][k] - 1 if compiled[n][k] else None}
            extrapolation_check = {"from_depths": sorted(shallow), **check}
    elif failed:
        d = min(failed)
        per_chip = {k: failed[d][k] for k in ("peak_bytes", "over_bytes") if k in failed[d]}
        collectives, fits, how = None, False, f"already out of HBM at {d} layers"
    else:
        for k in _EXTRAPOLATED:
            per_chip[k] = extrapolate({d: r[k] for d, r in compiled.items()}, n)
        collectives = {op: {f: _collective_at(n, {d: r["collectives"][op][f] for d, r in compiled.items()})
                            for f in ("count", "bytes")} for op in COLLECTIVES}
        fits = per_chip["peak_bytes"] <= topo.chip.hbm_bytes
        how = f"extrapolated per layer from {', '.join(str(d) for d in compiled)} layers"
        deepest = compiled[max(compiled)]["peak_bytes"]
        if per_chip["peak_bytes"] < deepest:
            # the peak falls with depth: the compiler chose differently at each depth (Gemma-3-12B LoRA with
            # activation checkpointing on v5e-8: its 1-layer step is over the chip's HBM and rematerialized, the
            # 2-layer one less so, and the line went below zero). No per-layer line, no verdict.
            per_chip.pop("peak_bytes"), per_chip.pop("temp_bytes")
            fits = None
            how = (f"not extrapolated: the peak falls from {', '.join(str(d) for d in sorted(compiled))} layers"
                   " (the compiler's choices differ between the depths, e.g. near the chip's HBM); compile other"
                   " depths (--layers) or the whole model")
            least = min(r["peak_bytes"] for r in compiled.values())
            if least > topo.chip.hbm_bytes:
                # every compiled depth is already over the chip: the whole model, with more layers' weights and
                # optimizer state, is too (Gemma-3-12B full finetuning on v5e-8: 16.5 and 16.3 GiB at 2 and 3 layers)
                per_chip["peak_bytes"], fits = least, False
                how = (f"over the chip's HBM at every compiled depth ({', '.join(str(d) for d in sorted(compiled))}"
                       " layers; the peak shown is the least of them, a floor for the whole model)")
    uncounted = None
    if job.get("scan_layers") and "flops" in per_chip:
        # a scan is an HLO while loop, whose body XLA's cost analysis counts once whatever the trip count: the
        # compiled FLOPs and bytes do not grow with the layers (an 8B step's came out at a third of the model's)
        uncounted = {"reason": "scan_layers: the loop body is counted once by the cost analysis",
                     **{k: per_chip.pop(k) for k in ("flops", "bytes_accessed")}}
    elif min(per_chip.get("flops", 0), per_chip.get("bytes_accessed", 0)) < 0:
        # the per-layer line falls with depth: the compiler chose differently at each depth (e.g. rematerialized
        # more of a 2-layer step over the chip's HBM than of the 1-layer one, Gemma-3-12B on v5e-8): no cost figure
        uncounted = {"reason": "the per-layer line of the compiled FLOPs or HBM bytes falls with depth (the"
                               " compiler's choices differ between the compiled depths, e.g. rematerialization over"
                               " the chip's HBM)", **{k: per_chip.pop(k) for k in ("flops", "bytes_accessed")}}
    tokens = job["micro_batch_size"] * job["max_seq_length"]  # per chip per step
    factor = 3 if method == "full" else 2  # forward + backward (+ the weights' gradients when all train)
    model_flops_per_token = config.flops_per_token(job["max_seq_length"]) * factor
    plan: Dict[str, Any] = {
        "model": job["model_name"] or job["checkpoint_dir"], "method": method, "topology": topo.name,
        "chips": topo.chips, "chip": topo.chip.name, "hbm_per_chip_bytes": topo.chip.hbm_bytes,
        "settings": {k: job[k] for k in ("micro_batch_size", "max_seq_length", "precision", "optimizer",
                                         "activation_checkpointing", "scan_layers")}
        | {"packing": job.get("packing", False)} | ({"lora": job["lora"]} if method == "lora" else {}),
        "n_layer": n, "how": how, "fits": fits, "per_chip": per_chip, "collectives": collectives,
        # "buffer assignment" (the memory compile) or "executable" (libtpu's code generator ran too)
        "compiled_to": sorted({r.get("compiled_to", "executable") for r in compiled.values()}),
        "tokens_per_step": tokens * topo.chips, "model_flops_per_token": model_flops_per_token,
        "depths": {str(d): {k: v for k, v in r.items()} for d, r in compiled.items()},
    }
    if extrapolation_check:
        plan["extrapolation_check"] = extrapolation_check
    if uncounted:
        plan["cost_not_counted"] = uncounted
    if not fits and "peak_bytes" in per_chip:
        plan["over_by_bytes"] = max(0, per_chip["peak_bytes"] - topo.chip.hbm_bytes)
    plan["largest_micro_batch_estimate"] = largest_micro_batch(per_chip, topo.chip.hbm_bytes, job["micro_batch_size"])
    if "flops" in per_chip:
        plan["roofline"] = roofline(per_chip["flops"], per_chip["bytes_accessed"], topo.chip,
                                    model_flops=model_flops_per_token * tokens)
        plan["compiled_flops_per_token"] = per_chip["flops"] / tokens
    return plan


def _collective_at(n_layer: int, points: Dict[int, float]) -> int:
    """A collective's count or bytes at the model's depth: the per-layer line, or the deepest compile's figure where
    the line falls (the compiler combined some collectives differently at each depth: Llama-3.1-8B's all-reduces,
    4 at 2 layers and 3 at 3, would come out at -26 at 32 layers)."""
    line = extrapolate(points, n_layer)
    deepest = points[max(points)]
    return round(line if line >= deepest else deepest)


def largest_micro_batch(per_chip: Dict[str, Any], hbm_bytes: int, micro_batch_size: int) -> Optional[int]:
    """An estimate, not a compile: the micro batch whose temporaries (taken as proportional to the rows) still fit
    beside what does not grow with the batch (weights, optimizer state, outputs). 0: not even one row."""
    temp, peak = per_chip.get("temp_bytes"), per_chip.get("peak_bytes")
    if not temp or peak is None or temp <= 0:
        return None
    per_row = temp / micro_batch_size
    return max(0, int((hbm_bytes - (peak - temp)) // per_row))


def report(plan: Dict[str, Any]) -> str:
    gib = lambda b: f"{b / 1024 ** 3:.2f} GiB"  # noqa: E731
    pc = plan["per_chip"]
    s = plan["settings"]
    lines = [f"{plan['model']} {plan['method']} on {plan['topology']} ({plan['chips']} x {plan['chip']}),"
             f" micro batch {s['micro_batch_size']} x {s['max_seq_length']} tokens per chip"
             + (" (packed rows)" if s.get("packing") else "") + f", {s['precision']}"
             f" ({plan['how']})"]
    if "argument_bytes" in pc:
        lines.append(f"  per chip: arguments (weights, optimizer state, batch) {gib(pc['argument_bytes'])},"
                     f" outputs {gib(pc['output_bytes'])} (aliased {gib(pc['alias_bytes'])})"
                     + (f", temporaries {gib(pc['temp_bytes'])}" if "temp_bytes" in pc else ""))
    if "peak_bytes" in pc:
        verdict = "fits" if plan["fits"] else f"does NOT fit (over by {gib(plan.get('over_by_bytes', 0))})"
        lines.append(f"  peak HBM per chip {gib(pc['peak_bytes'])} of {gib(plan['hbm_per_chip_bytes'])}: {verdict}")
    if plan.get("largest_micro_batch_estimate") is not None:
        lines.append(f"  largest micro batch that would fit (estimate: temporaries taken as proportional to the"
                     f" rows): {plan['largest_micro_batch_estimate']}")
    if plan.get("cost_not_counted"):
        lines.append(f"  per chip FLOPs and HBM bytes: not given ({plan['cost_not_counted']['reason']})")
    if "roofline" in plan:
        r = plan["roofline"]
        lines.append(f"  per chip: {pc['flops']:.3g} FLOPs, {pc['bytes_accessed']:.3g} HBM bytes per step;"
                     f" roofline step {r['step_s'] * 1e3:.1f} ms ({r['bound']}-bound), MFU bound"
                     f" {100 * r['mfu_bound']:.1f}%; model FLOPs/token {plan['model_flops_per_token']:.3g}")
        if r.get("compute_from") == "model":
            lines.append(f"  XLA's cost analysis counts {r['flops_counted_ratio']:.2f}x the model's analytic FLOPs"
                         " (2 or 3 x the forward's, attention included): the roofline's compute time is the"
                         " model FLOPs'")
    if plan.get("collectives"):
        lines.append("  collectives per step: " + ", ".join(
            f"{op} {c['count']} ({gib(c['bytes'])})" for op, c in plan["collectives"].items() if c["count"]))
    h = plan.get("host", {})
    if h:
        lines.append(f"  this plan: {h['wall_s']:.0f} s, host RSS at most {h['max_rss_gib']} GiB (trace"
                     f" {h['trace_process_max_rss_gib']}, compile {h['compile_process_max_rss_gib']}, this process"
                     f" {h['plan_process_max_rss_gib']})")
    return "\n".join(lines)
