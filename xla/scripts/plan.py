"""Plan a TPU run before renting one: compile a finetune recipe's real training step for a TPU slice on this host
(no TPU, no weights) and report per-chip HBM, FLOPs, the roofline step time and MFU bound, and the collectives.

    pip install -r requirements-tpu-plan.txt      # the TPU compiler (libtpu), once
    python xla/scripts/plan.py --method lora --model_name Llama-3.1-8B --topology v5e-8 \\
        --train.micro_batch_size 1 --train.max_seq_length 2048 --lora_r 8 --results_file plan.json

The flags are the XLA finetune recipes' own (lit_gpt.recipes.flags: --precision, --activation_checkpointing,
--scan_layers, --optimizer, --train.*, --moe.*, --lora_*), with their defaults; --scan_layers auto resolves as the
recipe would for the whole model.

How: a child process with as many XLA:CPU devices as the slice has chips (PJRT_DEVICE=CPU CPU_NUM_DEVICES=N, set
before torch_xla is imported) builds the recipe's model on the meta device, gives every weight and optimizer state
a placeholder of its real shape and dtype (torch_xla device data without a buffer: no host memory), wraps it with
the recipe's Fabric strategy (FSDP over SPMD) and runs the recipe's own loop, `lit_gpt.training.fit`, up to the
step's graph cut (`torch_xla.sync()` in the optimizer step). There the pending graph is taken instead of run: its
HLO with the sharding annotations, plus which arguments are the weights' and optimizer state's buffers (donated,
as torch_xla donates them) and the FSDP sharding of the placeholders; one child traces every depth. Each is
compiled with libtpu's compiler for the topology's compile-only devices (`lit_gpt.xla.plan`), by default only up
to its buffer assignment (`--compile_to`). Big models are compiled at 1 and 2 layers (real width and vocabulary;
`--layers`) and extrapolated per layer to the model's depth; models with at most `max(--layers)` layers (or with
`--full_depth true`) are compiled whole. Each phase prints its time and host memory as it ends.

Where a plan's time and memory went (Llama-3.1-8B LoRA, v5e-8, 2 cores): libtpu's code generator, 9 minutes and
5-7 GiB per depth, after 15 s of HLO passes and buffer assignment that already settle the memory (now skipped);
the RoPE tables built for the model's whole context (131,072 positions, 1 GiB over 8 devices; now the step's
length); one torch_xla import and teardown per depth (now one child for all depths, ended without teardown).

Not covered: the real device order of a slice, the TPU runtime's own flags (e.g. LIBTPU_INIT_ARGS), the input
pipeline and host work between steps, and packed rows (no --data.packing: the Pallas flash attention that packed rows
use on a TPU is not in the planned step; `lit_gpt.xla.plan.pallas_for_tpu` makes such kernels trace and compile for the
TPU, tests/xla/test_plan.py).
"""

import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional

import torch

from lit_gpt.args import EvalArgs, MoEArgs, TrainArgs
from lit_gpt.recipes.flags import LORA, XLA_FINETUNE, Flag, command
from lit_gpt.utils import LitError, run_cli
from lit_gpt.xla.plan import (
    COLLECTIVES, compile_for_topology, compile_memory, extrapolate, parse_topology, roofline, tpu_compiler_missing,
)

ROOT = Path(__file__).resolve().parents[2]
CHILD_ENV = "LIT_GPT_PLAN_TRACE"  # set in the tracing child: the path of its job file
METHODS = ("lora", "full")


_RECIPE = {f.name: f for f in XLA_FINETUNE}  # the XLA finetune recipes' flags: the plan takes theirs as they are
FLAGS = [
    Flag("model_name", Optional[str], None,
         "A name from the config registry (e.g. Llama-3.1-8B); no weights are needed."),
    replace(_RECIPE["checkpoint_dir"], default=None,
            doc="Or the recipe's base model folder: its lit_config.json describes the model (its weights are not\n"
                "read)."),
    Flag("method", Literal["lora", "full"], "lora",
         '"lora" or "full": the step of xla/finetune/lora.py or xla/finetune/full.py.'),
    Flag("topology", str, "v5e-8",
         "The TPU slice: v5e-8, v5e-16, v5e-32, v6e-8, v6e-64, v5p-8, ... (v5p/v4 names count TensorCores)."),
    *(_RECIPE[name] for name in ("precision", "activation_checkpointing", "scan_layers", "optimizer")),
    # the lora recipe's --train defaults, with a sequence length: a plan has no data to take the longest row from
    replace(_RECIPE["train"], default=TrainArgs(global_batch_size=16, micro_batch_size=1, learning_rate=3e-4,
                                                max_seq_length=2048),
            doc="The recipe's --train flags: the step has --train.micro_batch_size rows per chip of\n"
                "--train.max_seq_length tokens (one micro-batch: gradient accumulation repeats the same graph)."),
    _RECIPE["moe"],
    *LORA,  # the LoRA recipes' own flags (--lora_r, --lora_mlp, ...), used with --method lora
    Flag("layers", Optional[List[int]], None,
         "The depths compiled to extrapolate from (default 1 and 2)."),
    Flag("full_depth", bool, False, "Compile the whole model instead of extrapolating (needs a small model)."),
    Flag("compile_to", Literal["buffer_assignment", "executable"], "buffer_assignment",
         '"buffer_assignment": stop libtpu\'s compiler once the per-chip memory is assigned (seconds to a minute\n'
         'per depth; FLOPs and bytes by XLA\'s HLO cost analysis of the optimized program). "executable": run its\n'
         'code generator too and read the executable\'s own figures (about 9 minutes per layer of an 8B model\n'
         'on 2 cores, ~4% higher peak: the generated code\'s scratch).'),
    Flag("results_file", Optional[Path], None, "Write the plan as JSON here."),
    Flag("hlo_dir", Optional[Path], None,
         "Write each compiled (partitioned, per-chip) program here as HLO text, one file per depth."),
    Flag("trace_cache", Optional[Path], None,
         "Keep the traced steps in this folder, so that plans of the same step for other topologies with as\n"
         "many chips (v5e-8 and v6e-8) compile it without tracing it again."),
]


def plan_run(model_name: Optional[str], checkpoint_dir: Optional[Path], method: str, topology: str,
             precision: Optional[str], activation_checkpointing: bool, scan_layers: Any, optimizer: str,
             train: TrainArgs, moe: Any, layers: Optional[List[int]], full_depth: bool, compile_to: str,
             results_file: Optional[Path],
             hlo_dir: Optional[Path], trace_cache: Optional[Path], **lora: Any) -> Dict[str, Any]:
    """Compile a finetune recipe's training step for a TPU topology and report what it needs per chip."""
    precision = precision or "bf16-true"  # the XLA recipes' default on a TPU
    t0 = time.perf_counter()
    load_start = list(os.getloadavg())
    topo = parse_topology(topology)
    if method not in METHODS:
        raise LitError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    if (model_name is None) == (checkpoint_dir is None):
        raise LitError("give one of --model_name (a registry name) or --checkpoint_dir (a folder with lit_config.json)")
    if train.micro_batch_size < 1 or not train.max_seq_length or train.max_seq_length < 1:
        raise LitError("--train.micro_batch_size and --train.max_seq_length must be positive")
    if optimizer not in ("adamw", "sgd"):
        raise LitError(f"--optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
    if precision not in ("bf16-true", "32-true", "bf16-mixed"):
        raise LitError(f"--precision must be bf16-true, 32-true or bf16-mixed, got {precision!r}")
    config = moe.apply(model_config(model_name, checkpoint_dir, method, lora))
    if train.max_seq_length > config.block_size:
        raise LitError(f"--train.max_seq_length {train.max_seq_length} exceeds the model's context length"
                       f" {config.block_size}")
    depths = sorted(set(layers or [1, 2]))
    if any(d < 1 for d in depths):
        raise LitError(f"--layers must be positive depths, got {depths}")
    if full_depth and layers and len([d for d in depths if d < config.n_layer]) >= 2:
        # both: the full depth is the plan, and the per-layer line's error against it is reported
        depths = sorted({d for d in depths if d < config.n_layer} | {config.n_layer})
    elif full_depth or config.n_layer <= max(depths):
        depths = [config.n_layer]
    elif len(depths) < 2:
        raise LitError("--layers needs two or more depths to extrapolate from (or --full_depth true)")
    if results_file is not None:  # before minutes of work, not after
        from lit_gpt.recipes.outputs import check_output_file

        check_output_file(results_file, "--results_file")
    missing = tpu_compiler_missing()
    if missing:
        raise LitError(missing)
    scan = resolve_scan(config, method, scan_layers, activation_checkpointing)

    job = {"model_name": model_name, "checkpoint_dir": str(checkpoint_dir) if checkpoint_dir else None,
           "method": method, "devices": topo.chips, "micro_batch_size": train.micro_batch_size,
           "max_seq_length": train.max_seq_length, "precision": precision, "optimizer": optimizer,
           "activation_checkpointing": activation_checkpointing, "scan_layers": scan, "lora": lora,
           "moe": asdict(moe),
           "learning_rate": train.learning_rate, "weight_decay": train.weight_decay, "max_norm": train.max_norm}
    compiled: Dict[int, Dict[str, Any]] = {}
    progress(f"tracing the {method} step with {', '.join(map(str, depths))} of {config.n_layer} layers on"
             f" {topo.chips} XLA:CPU devices")
    steps = trace_in_child(job, depths, trace_cache)
    for depth in depths:
        traced = steps[depth]
        progress(f"compiling the {depth}-layer step for {topo.name} ({topo.topology_name}) with libtpu's compiler")
        t1 = time.perf_counter()
        compile = compile_for_topology if compile_to == "executable" else compile_memory
        cached = compiled_cache(trace_cache, traced, topo.name, compile_to) if hlo_dir is None else None
        if cached is not None and cached.is_file():  # the same program for the same slice: the same answer
            result = json.loads(cached.read_text())
            progress("  compile: the same program was compiled for this slice before (--trace_cache)")
        else:
            result = compile(traced["module"], topo, traced["donors"], traced["shardings"],
                             keep_text=hlo_dir is not None, progress=lambda what: progress("  compile: " + what))
            if cached is not None:
                cached.write_text(json.dumps(result))
        if hlo_dir is not None:
            Path(hlo_dir).mkdir(parents=True, exist_ok=True)
            (Path(hlo_dir) / f"{method}-{topo.name}-{depth}-layers.hlo.txt").write_text(result.pop("hlo_text"))
        result["compile_s"] = time.perf_counter() - t1
        result["trace_s"] = traced["seconds"]
        result["trace_max_rss_gib"] = traced["trace_max_rss_gib"]
        result["parameters"], result["trainable"] = traced["parameters"], traced["trainable"]
        compiled[depth] = result
    plan = summarise(config, topo, job, compiled, method)
    own = host_memory()["plan_process_max_rss_gib"]  # this process (the executable compile runs here)
    trace_rss = max(r["trace_max_rss_gib"] for r in compiled.values())
    compile_rss = max(r.get("compile_max_rss_gib", own) for r in compiled.values())
    plan["host"] = {"wall_s": round(time.perf_counter() - t0, 1), "plan_process_max_rss_gib": own,
                    "trace_process_max_rss_gib": trace_rss, "compile_process_max_rss_gib": compile_rss,
                    # the children run one at a time beside this process: the most the plan held at once
                    "max_rss_gib": round(own + max(trace_rss, compile_rss), 2),
                    **machine(), "load_average_start": load_start, "load_average_end": list(os.getloadavg())}
    plan["command"] = "python xla/scripts/plan.py " + " ".join(sys.argv[1:])
    print(report(plan))
    if results_file is not None:  # a bench result file: the plan as its results, with the machine and versions
        import importlib.util

        spec = importlib.util.spec_from_file_location("result_files", ROOT / "bench" / "result_files.py")
        result_files = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(result_files)
        result_files.write(Path(results_file), "tpu_plan", {"topology": topo.name, **job}, plan)
    return plan


def model_config(model_name: Optional[str], checkpoint_dir: Optional[Path], method: str, lora: Dict[str, Any],
                 n_layer: Optional[int] = None) -> Any:
    """The model's config with the method's settings (and a truncated depth), as the recipe reads it."""
    from lit_gpt import lora as lora_module
    from lit_gpt.config import Config

    cls = lora_module.Config if method == "lora" else Config
    kwargs = dict(lora) if method == "lora" else {}
    if n_layer is not None:
        kwargs["n_layer"] = n_layer
    if checkpoint_dir is not None:
        from lit_gpt.config import load_config

        return load_config(Path(checkpoint_dir), cls, **kwargs)
    try:
        return cls.from_name(model_name, **kwargs)
    except (ValueError, KeyError) as e:
        raise LitError(f"--model_name {model_name!r}: {e}") from None


def resolve_scan(config: Any, method: str, scan_layers: Any, activation_checkpointing: bool) -> bool:
    """--scan_layers as the recipe resolves it for the whole model (a truncated model is traced with the same
    setting): "auto" scans from 32 blocks on, not with dropout in the blocks (LoRA's) nor for MoE models."""
    from lit_gpt import lora as lora_module
    from lit_gpt.model import GPT
    from lit_gpt.recipes.xla_finetune import check_moe
    from lit_gpt.xla.scan import AUTO_MIN_LAYERS, resolve_scan_layers

    check_moe(config, scan_layers, activation_checkpointing)
    # as many blocks as "auto" needs to decide (the same answer as the whole model's: a model of 30,000 blocks took
    # a minute to build even on the meta device)
    n = min(config.n_layer, AUTO_MIN_LAYERS)
    per_layer = {k: v[:n] for k, v in vars(config).items() if k == "layer_types" and v is not None}
    probe = replace(config, n_layer=n, **per_layer)
    with torch.device("meta"):  # no memory: only the blocks' structure is read
        model = lora_module.GPT(probe) if method == "lora" else GPT(probe)
    return resolve_scan_layers(scan_layers, model)


# ---------------------------------------------------------------------------------------------------------------
# the parent: one child per depth, then the summary
# ---------------------------------------------------------------------------------------------------------------
def trace_in_child(job: Dict[str, Any], depths: List[int], cache: Optional[Path] = None) -> Dict[int, Dict[str, Any]]:
    """Run this script as a tracing child with `job["devices"]` XLA:CPU devices that traces the step at each of
    `depths` in turn (torch_xla is imported once); per depth: the step's HLO module, the donated argument numbers
    and the placeholder arguments' shardings. Depths `cache` holds are read from it, the others added to it."""
    import hashlib

    def where(depth: int) -> Optional[Path]:
        key = hashlib.sha256(json.dumps({**job, "n_layer": depth}, sort_keys=True).encode()).hexdigest()[:16]
        return Path(cache) / key if cache is not None else None

    def read(folder: Path) -> Dict[str, Any]:
        return {**json.loads((folder / "meta.json").read_text()), "module": (folder / "module.pb").read_bytes()}

    traced = {d: read(where(d)) for d in depths if cache is not None and (where(d) / "meta.json").is_file()}
    todo = [d for d in depths if d not in traced]
    if not todo:
        return traced
    with tempfile.TemporaryDirectory(prefix="lit-gpt-plan-") as tmp:
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps({**job, "n_layers": todo, "out": tmp}))
        env = {**os.environ, CHILD_ENV: str(job_file), "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(job["devices"])}
        env.pop("TPU_SKIP_MDS_QUERY", None)
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in proc.stdout:  # the child's progress lines go on to the user; the rest only if it fails
            lines.append(line.rstrip())
            if line.startswith("[plan"):
                print("  trace " + line.rstrip(), file=sys.stderr, flush=True)
        proc.wait()
        if proc.returncode != 0 or not all((Path(tmp) / str(d) / "meta.json").is_file() for d in todo):
            tail = "\n".join(lines[-15:])
            raise LitError(f"tracing the step failed (exit {proc.returncode}):\n{tail}")
        seconds = (time.perf_counter() - t0) / len(todo)  # the child's time, shared by its depths
        for d in todo:
            traced[d] = {**read(Path(tmp) / str(d)), "seconds": seconds}
            if cache is not None:
                where(d).mkdir(parents=True, exist_ok=True)
                (where(d) / "module.pb").write_bytes(traced[d]["module"])
                (where(d) / "meta.json").write_text(json.dumps({k: v for k, v in traced[d].items() if k != "module"}))
    return traced


def compiled_cache(cache: Optional[Path], traced: Dict[str, Any], topology: str, compile_to: str) -> Optional[Path]:
    """Where `--trace_cache` keeps a traced step's compile for a slice (keyed by the program itself)."""
    if cache is None:
        return None
    import hashlib

    key = hashlib.sha256(traced["module"])
    key.update(json.dumps([traced["donors"], traced["shardings"], topology, compile_to]).encode())
    return Path(cache) / f"compiled-{key.hexdigest()[:16]}.json"


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
        collectives = {op: {f: round(extrapolate({d: r["collectives"][op][f] for d, r in compiled.items()}, n))
                            for f in ("count", "bytes")} for op in COLLECTIVES}
        fits = per_chip["peak_bytes"] <= topo.chip.hbm_bytes
        how = f"extrapolated per layer from {', '.join(str(d) for d in compiled)} layers"
    uncounted = None
    if job.get("scan_layers") and "flops" in per_chip:
        # a scan is an HLO while loop, whose body XLA's cost analysis counts once whatever the trip count: the
        # compiled FLOPs and bytes do not grow with the layers (an 8B step's came out at a third of the model's)
        uncounted = {k: per_chip.pop(k) for k in ("flops", "bytes_accessed")}
    tokens = job["micro_batch_size"] * job["max_seq_length"]  # per chip per step
    factor = 3 if method == "full" else 2  # forward + backward (+ the weights' gradients when all train)
    model_flops_per_token = config.flops_per_token(job["max_seq_length"]) * factor
    plan: Dict[str, Any] = {
        "model": job["model_name"] or job["checkpoint_dir"], "method": method, "topology": topo.name,
        "chips": topo.chips, "chip": topo.chip.name, "hbm_per_chip_bytes": topo.chip.hbm_bytes,
        "settings": {k: job[k] for k in ("micro_batch_size", "max_seq_length", "precision", "optimizer",
                                         "activation_checkpointing", "scan_layers")}
        | ({"lora": job["lora"]} if method == "lora" else {}),
        "n_layer": n, "how": how, "fits": fits, "per_chip": per_chip, "collectives": collectives,
        # "buffer assignment" (the memory compile) or "executable" (libtpu's code generator ran too)
        "compiled_to": sorted({r.get("compiled_to", "executable") for r in compiled.values()}),
        "tokens_per_step": tokens * topo.chips, "model_flops_per_token": model_flops_per_token,
        "depths": {str(d): {k: v for k, v in r.items()} for d, r in compiled.items()},
    }
    if extrapolation_check:
        plan["extrapolation_check"] = extrapolation_check
    if uncounted:
        plan["cost_not_counted"] = {"reason": "scan_layers: the loop body is counted once by the cost analysis",
                                    **uncounted}
    if not fits and "peak_bytes" in per_chip:
        plan["over_by_bytes"] = max(0, per_chip["peak_bytes"] - topo.chip.hbm_bytes)
    plan["largest_micro_batch_estimate"] = largest_micro_batch(per_chip, topo.chip.hbm_bytes, job["micro_batch_size"])
    if "flops" in per_chip:
        plan["roofline"] = roofline(per_chip["flops"], per_chip["bytes_accessed"], topo.chip,
                                    model_flops=model_flops_per_token * tokens)
        plan["compiled_flops_per_token"] = per_chip["flops"] / tokens
    return plan


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
             f" micro batch {s['micro_batch_size']} x {s['max_seq_length']} tokens per chip, {s['precision']}"
             f" ({plan['how']})"]
    if "argument_bytes" in pc:
        lines.append(f"  per chip: arguments (weights, optimizer state, batch) {gib(pc['argument_bytes'])},"
                     f" outputs {gib(pc['output_bytes'])} (aliased {gib(pc['alias_bytes'])}),"
                     f" temporaries {gib(pc['temp_bytes'])}")
    if "peak_bytes" in pc:
        verdict = "fits" if plan["fits"] else f"does NOT fit (over by {gib(plan.get('over_by_bytes', 0))})"
        lines.append(f"  peak HBM per chip {gib(pc['peak_bytes'])} of {gib(plan['hbm_per_chip_bytes'])}: {verdict}")
    if plan.get("largest_micro_batch_estimate") is not None:
        lines.append(f"  largest micro batch that would fit (estimate: temporaries taken as proportional to the"
                     f" rows): {plan['largest_micro_batch_estimate']}")
    if plan.get("cost_not_counted"):
        lines.append("  per chip FLOPs and HBM bytes: not counted (--scan_layers: XLA's cost analysis counts a loop's"
                     " body once)")
    if "roofline" in plan:
        r = plan["roofline"]
        lines.append(f"  per chip: {pc['flops']:.3g} FLOPs, {pc['bytes_accessed']:.3g} HBM bytes per step;"
                     f" roofline step {r['step_s'] * 1e3:.1f} ms ({r['bound']}-bound), MFU bound"
                     f" {100 * r['mfu_bound']:.1f}%; model FLOPs/token {plan['model_flops_per_token']:.3g}")
    if plan.get("collectives"):
        lines.append("  collectives per step: " + ", ".join(
            f"{op} {c['count']} ({gib(c['bytes'])})" for op, c in plan["collectives"].items() if c["count"]))
    h = plan.get("host", {})
    if h:
        lines.append(f"  this plan: {h['wall_s']:.0f} s, host RSS at most {h['max_rss_gib']} GiB (trace"
                     f" {h['trace_process_max_rss_gib']}, compile {h['compile_process_max_rss_gib']}, this process"
                     f" {h['plan_process_max_rss_gib']})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# the child: the recipe's step, traced with placeholder weights
# ---------------------------------------------------------------------------------------------------------------
class _Captured(Exception):
    """Raised at the step's graph cut once its graph is taken: it ends the loop before anything runs."""


def trace_child(job: Dict[str, Any]) -> None:
    from lit_gpt.xla.strategy import make_fabric

    progress(f"imported torch_xla; {job['devices']} XLA:CPU devices")
    fabric = make_fabric("auto", job["precision"], activation_checkpointing=job["activation_checkpointing"],
                         scan_layers=job["scan_layers"])
    fabric.launch(_trace_main, job)


def _trace_main(fabric: Any, job: Dict[str, Any]) -> None:
    for depth in job["n_layers"]:
        out = Path(job["out"]) / str(depth)
        out.mkdir()
        _trace_depth(fabric, {**job, "n_layer": depth, "out": str(out)})
        gc.collect()  # the last depth's model and graph
    progress("done tracing")


def _trace_depth(fabric: Any, job: Dict[str, Any]) -> None:
    import torch_xla
    import torch_xla.distributed.spmd as xs

    from lit_gpt import lora
    from lit_gpt.batches import TrainBatches
    from lit_gpt.data import PreparedData
    from lit_gpt.model import GPT
    from lit_gpt.peft import finetuned_filter, finetuned_metadata
    from lit_gpt.recipes.finetune import build_optimizer
    from lit_gpt.training import Method, RunData, fit
    from lit_gpt.xla.runtime import XLARuntime

    X = torch_xla._XLAC
    runtime = XLARuntime(fabric)
    config = MoEArgs(**job["moe"]).apply(
        model_config(job["model_name"], job["checkpoint_dir"], job["method"], job["lora"], job["n_layer"]))
    with torch.device("meta"):
        model = lora.GPT(config) if job["method"] == "lora" else GPT(config)
    strategy = fabric.strategy
    placeholders = _Placeholders(strategy.mesh, strategy.precision.param_dtype)
    placeholders.place_model(model, job["max_seq_length"])
    progress(f"placed the {job['n_layer']}-layer model's weights as placeholders")
    if job["method"] == "lora":
        lora.mark_only_lora_as_trainable(model)
        method = Method(name="lora", save_filter=finetuned_filter(model), metadata=finetuned_metadata(model))
    else:
        method = Method(name="full")
    train = TrainArgs(global_batch_size=job["micro_batch_size"] * job["devices"],
                      micro_batch_size=job["micro_batch_size"], max_steps=1, max_seq_length=job["max_seq_length"],
                      learning_rate=job["learning_rate"], weight_decay=job["weight_decay"],
                      max_norm=job["max_norm"], lr_warmup_steps=0, save_interval=None)
    opt = build_optimizer(model, train, job["optimizer"])
    # FSDPv2 marks every parameter's sharding: for a placeholder that is recorded (it has no data to reshard)
    original_mark = xs.mark_sharding
    xs.mark_sharding = placeholders.mark_sharding(original_mark)
    try:
        wrapped, opt = fabric.setup(model, opt)
    finally:
        xs.mark_sharding = original_mark
    placeholders.prime_optimizer(opt)  # the steady step: the state exists (as placeholders) before it runs
    progress("wrapped by the recipe's strategy; optimizer state as placeholders")
    donated = {X._xla_get_tensor_id(p) for p in model.parameters() if p.requires_grad} | placeholders.state_ids

    # the data: rows of max_seq_length tokens, every position a target (the head runs on all of them)
    t = job["max_seq_length"]
    rows = job["micro_batch_size"] * runtime.local_devices
    tokens = torch.randint(0, config.vocab_size, (rows, 2, t))
    samples = [{"input_ids": row[0], "labels": row[1]} for row in tokens]
    batches = TrainBatches(samples, rows, t, shuffle=False, batches_per_epoch=1)
    data = RunData(batches, [], t, PreparedData(samples, []), None, steps_per_epoch=1, rows=rows)

    out = Path(job["out"])
    original_sync = torch_xla.sync

    def capture(*args: Any, **kwargs: Any) -> None:
        progress("ran the recipe's loop to the step's graph cut (the step traced)")
        live = _live_xla_tensors(model, opt)
        need = X._check_tensor_need_materialization(live)
        pending = [x for x, n in zip(live, need) if n]
        module = X._get_xla_tensors_hlo_proto(pending)
        ids, values = X._get_tensors_xla_device_data_node(pending)
        shardings = {i: placeholders.sharding_of[tid] for i, tid in enumerate(ids) if tid in placeholders.sharding_of}
        meta = {"donors": [i for i, tid in enumerate(ids) if tid in donated], "shardings": shardings,
                "arguments": [list(v.shape) for v in values], "outputs": len(pending),
                "n_layer": job["n_layer"], "parameters": sum(p.numel() for p in model.parameters()),
                "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "trace_max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2, 2)}
        (out / "module.pb").write_bytes(module)
        (out / "meta.json").write_text(json.dumps(meta))
        progress(f"took the pending graph's HLO ({len(module) / 1e6:.1f} MB, {len(values)} arguments)")
        raise _Captured()

    torch_xla.sync = capture
    try:
        fit(fabric, wrapped, model, opt, data, method, checkpoint_dir=out, out_dir=out / "run", train=train,
            eval=EvalArgs(interval=10 ** 9, max_new_tokens=0, final_validation=False), runtime=runtime)
    except _Captured:
        return
    finally:
        torch_xla.sync = original_sync
    raise RuntimeError("the training loop ended without reaching the optimizer step's graph cut")


def _live_xla_tensors(model: Any, opt: Any) -> List[torch.Tensor]:
    """Every live tensor on the XLA device (what `torch_xla.sync()` would materialise), each once."""
    import torch_xla

    seen, out = set(), []
    candidates = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    candidates += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    candidates += [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for t in candidates:
        if t.device.type != "xla":
            continue
        try:
            tid = torch_xla._XLAC._xla_get_tensor_id(t)
        except RuntimeError:  # "Expected XLA tensor": a wrapper on the device (e.g. a functional view), not data
            continue
        if tid not in seen:
            seen.add(tid)
            out.append(t)
    return out


@dataclass
class _Placeholders:
    """Weights and optimizer state as torch_xla placeholders (device data of the real shape and dtype that hold no
    buffer), with the FSDP sharding each would get recorded per tensor id for the compiler."""

    mesh: Any
    dtype: torch.dtype
    sharding_of: Dict[int, str] = field(default_factory=dict)
    state_ids: set = field(default_factory=set)
    _texts: Dict[Any, str] = field(default_factory=dict)

    def make(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        import torch_xla
        import torch_xla.core.xla_builder as xb
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import _prepare_spmd_partition_spec

        t = xb.create_placeholder_tensor(tuple(shape), dtype)
        spec = _prepare_spmd_partition_spec(t, shard_maximal=True)
        self.sharding_of[torch_xla._XLAC._xla_get_tensor_id(t)] = self.text(len(shape), spec)
        return t

    def text(self, rank: int, spec: Any) -> str:
        """The HLO sharding torch_xla writes for `spec` on a tensor of this rank (read off a small real tensor)."""
        key = (rank, tuple(spec))
        if key not in self._texts:
            import torch_xla
            import torch_xla.distributed.spmd as xs

            n = self.mesh.size()
            probe = torch.zeros((n,) * rank).to(torch_xla.device())
            xs.mark_sharding(probe, self.mesh, spec)
            self._texts[key] = torch_xla._XLAC._get_xla_sharding_spec(probe)
        return self._texts[key]

    def place_model(self, model: Any, rope_length: int) -> None:
        """Matrices become placeholders; vectors (norms, biases) and buffers are small: real zeros, placed as the
        staged loader places them. The RoPE tables get the step's length (as `fit` sets them): at the model's
        context length (131,072 positions for Llama 3.1) they were a GiB of host memory over 8 XLA:CPU devices."""
        import torch.nn as nn
        import torch_xla

        from lit_gpt.xla.loader import _to_device
        from lit_gpt.xla.runtime import set_rope_length

        device = torch_xla.device()
        if hasattr(model, "reset_rope_cache"):
            model.max_seq_length = rope_length  # on the meta device: no memory yet
        for name, p in list(model.named_parameters()):
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            dtype = self.dtype if p.is_floating_point() else p.dtype
            if p.dim() >= 2:
                new = self.make(p.shape, dtype)
            else:
                new = _to_device(torch.zeros(p.shape, dtype=dtype), device, self.mesh, dtype)
            param = nn.Parameter(new, requires_grad=p.requires_grad)
            for mod in model.modules():  # tied weights: every owner of this parameter gets the placed one
                for k, v in list(mod._parameters.items()):
                    if v is p:
                        mod._parameters[k] = param
            setattr(owner, attr, param)
        for name, b in list(model.named_buffers()):
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            owner._buffers[attr] = torch.zeros(b.shape, dtype=b.dtype).to(device)
        if hasattr(model, "reset_rope_cache"):
            set_rope_length(model, rope_length)

    def mark_sharding(self, original: Any) -> Any:
        import torch_xla

        def mark(t: torch.Tensor, mesh: Any, spec: Any, *args: Any, **kwargs: Any) -> Any:
            if torch_xla._XLAC._xla_get_tensor_id(t) in self.sharding_of:
                return None  # already recorded with the FSDP spec it was made with
            return original(t, mesh, spec, *args, **kwargs)

        return mark

    def prime_optimizer(self, opt: Any) -> None:
        """The state AdamW / SGD create at their first step, as placeholders (a step counter already at 1), so that
        the traced step is a steady one: the state is read and written, not created."""
        import torch_xla

        for group in opt.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                state = opt.state[p]
                if isinstance(opt, torch.optim.SGD):
                    names = ["momentum_buffer"]
                else:
                    state["step"] = torch.tensor(1.0)
                    names = ["exp_avg", "exp_avg_sq"]
                for k in names:
                    state[k] = self.make(p.shape, p.dtype)
                    self.state_ids.add(torch_xla._XLAC._xla_get_tensor_id(state[k]))


setup = command("Compile a finetune recipe's training step for a TPU topology and report what it needs per chip.",
                FLAGS, plan_run)

if __name__ == "__main__":
    if os.environ.get(CHILD_ENV):
        trace_child(json.loads(Path(os.environ[CHILD_ENV]).read_text()))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the step is written: skip torch_xla's teardown of the 8 devices (15 s for an 8B step's graph)
    else:
        run_cli(setup)
