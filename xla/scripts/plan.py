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
to its buffer assignment (`--compile_to`). Big models are compiled at 2 and 3 layers (real width and vocabulary;
`--layers`) and extrapolated per layer to the model's depth; models with at most `max(--layers)` layers (or with
`--full_depth true`) are compiled whole. Not from 1 layer: the first block is unlike the others (under LoRA its
input needs no gradient, so activation checkpointing leaves it as it is), and the 1-layer program's peak falls at
another point of the step. Llama-3.1-70B LoRA with activation checkpointing on v5p-32: 13.7, 15.9, 16.1, 16.4 GiB
at 1-4 layers; the line through 1 and 2 layers said 186 GiB at 80 layers, through 2, 3 and 4 it says 34 GiB (the
2-layer peak is at the head's matmul, with the head's all-gathered 2 GiB weight live: not a per-layer cost).
Each phase prints its time and host memory as it ends.

Where a plan's time and memory went (Llama-3.1-8B LoRA, v5e-8, 2 cores): libtpu's code generator, 9 minutes and
5-7 GiB per depth, after 15 s of HLO passes and buffer assignment that already settle the memory (now skipped);
the RoPE tables built for the model's whole context (131,072 positions, 1 GiB over 8 devices; now the step's
length); one torch_xla import and teardown per depth (now one child for all depths, ended without teardown).

Not covered: the real device order of a slice, the TPU runtime's own flags (e.g. LIBTPU_INIT_ARGS), the input
pipeline and host work between steps. Packed rows (`--packing true`, the recipe's --data.packing) are traced with the
TPU's Pallas flash attention with segment ids, as the strategy installs it on a TPU (`lit_gpt.xla.plan.pallas_for_tpu`
makes torch_xla's Pallas kernels trace and compile for the TPU, tests/xla/test_plan.py). Mixture-of-experts models are traced with the TPU's grouped matmul (lit_gpt.xla.moe_gmm,
used by their dropless dispatch, --moe.capacity_factor none), as the strategy installs it on a TPU (megablox needs
whole 512-row tiles: `pallas_gmm` pads the dispatch's rows to them; a 2-layer Qwen3-MoE-shaped plan at 8 x 128 tokens,
3048 rows, stopped in tracing with the kernel's ValueError before it did, as the recipe's step would have on a TPU).

Where each part is: this script (the flags, their checks and the order of the phases); `lit_gpt.recipes.xla_plan`
(the tracing child and the trace cache); `lit_gpt.xla.plan` (the chips and slices with their sources, the compile
for a topology and the buffer assignment's bytes, collectives, roofline, per-layer extrapolation);
`lit_gpt.xla.plan_report` (the plan at the model's depth, the printed report, the host's time and memory).
"""

import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional

import torch

from lit_gpt.args import TrainArgs
from lit_gpt.recipes.flags import LORA, XLA_FINETUNE, Flag, command
from lit_gpt.recipes.xla_plan import compiled_cache, model_config, trace_in_child
from lit_gpt.utils import LitError, run_cli
from lit_gpt.xla.plan import compile_for_topology, compile_memory, parse_topology, tpu_compiler_missing
from lit_gpt.xla.plan_report import host_memory, machine, progress, report, summarise

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("lora", "full")
DEFAULT_DEPTHS = [2, 3]  # the per-layer line starts after the first block (the module docstring says why)


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
    Flag("packing", bool, False,
         "Rows packed with several documents (the recipe's --data.packing true): the step attends within each\n"
         "document through the TPU's Pallas flash attention with segment ids, traced and compiled for the TPU."),
    *LORA,  # the LoRA recipes' own flags (--lora_r, --lora_mlp, ...), used with --method lora
    Flag("layers", Optional[List[int]], None,
         "The depths compiled to extrapolate from (default 2 and 3: a step's first block is unlike the others)."),
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
             train: TrainArgs, moe: Any, packing: bool, layers: Optional[List[int]], full_depth: bool, compile_to: str,
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
    depths = sorted(set(layers or DEFAULT_DEPTHS))
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
           "moe": asdict(moe), "packing": packing,
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
    # the TPU's Pallas kernels in the step (flash attention of packed rows: forward, dq, dkv per layer; the MoE
    # dispatch's grouped matmuls), lowered for the TPU and compiled with it
    plan["tpu_kernels"] = {str(d): steps[d].get("tpu_kernels", 0) for d in depths}
    if any(plan["tpu_kernels"].values()):
        progress(f"TPU Pallas kernels in the compiled step: {plan['tpu_kernels'][str(depths[-1])]}"
                 f" at {depths[-1]} layers")
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


setup = command("Compile a finetune recipe's training step for a TPU topology and report what it needs per chip.",
                FLAGS, plan_run)

if __name__ == "__main__":
    run_cli(setup)
