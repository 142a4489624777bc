"""Planning a TPU run on any host: the TPU compiler's own per-chip memory and cost of a traced training step.

    python xla/scripts/plan.py --method lora --model_name Llama-3.1-8B --topology v5e-8 --train.micro_batch_size 1

The step is traced by torch_xla on as many XLA:CPU devices as the topology has chips (xla/scripts/plan.py runs the
recipe's own loop, `lit_gpt.training.fit`, until its graph cut and takes the pending graph instead of running it).
What is here, the part that needs no torch_xla:
  * `TOPOLOGIES` / `CHIPS`: the slices and each chip's published peak, HBM size and bandwidth (sources beside them).
  * `compile_for_topology`: the step's HLO (with its sharding annotations), turned into StableHLO and compiled by
    libtpu's compiler for compile-only devices of the topology (`jax.experimental.topologies`): no TPU is needed.
    The donated buffers and the output-sharding propagation flag are put back, or outputs come out replicated and
    nothing aliases (wrong bytes, higher peak).
  * `count_collectives`: the collectives of the compiled (partitioned) HLO text.
  * `roofline`, `extrapolate`: a step's time bound and MFU bound, and the per-layer line through depth-truncated
    compiles (a 70B model is traced with 2 and 3 layers at its real width and vocabulary, not in host memory whole).
The TPU compiler is optional (requirements-tpu-plan.txt): `tpu_compiler_missing()` says so in one line.
"""

import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from lit_gpt.utils import LitError

GIB = 1024 ** 3
INSTALL_LINE = "the TPU compiler is not installed: pip install -r requirements-tpu-plan.txt"


@dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: int
    """HBM per chip the compiler may use (what libtpu reports as available; slightly under the nominal size)."""
    peak_flops: float
    """Dense bf16 FLOP/s per chip."""
    hbm_bandwidth: float
    """HBM bytes/s per chip."""


# Per-chip figures from Google's Cloud TPU system-architecture pages (bf16 peak, HBM size, HBM bandwidth):
#   v5e: https://cloud.google.com/tpu/docs/v5e          197 TFLOP/s, 16 GiB, 819 GB/s
#   v6e: https://cloud.google.com/tpu/docs/v6e          918 TFLOP/s, 32 GiB, 1640 GB/s
#   v5p: https://cloud.google.com/tpu/docs/v5p          459 TFLOP/s, 95 GiB, 2765 GB/s
#   v4:  https://cloud.google.com/tpu/docs/v4           275 TFLOP/s, 32 GiB, 1228 GB/s
# HBM usable by a program: what libtpu 0.0.21's compiler says a chip has when a program is too big ("Used 120.00G
# of 31.25G hbm"; the nominal size less the runtime's reserve), read off an oversized compile for each generation.
CHIPS: Dict[str, Chip] = {
    "v5e": Chip("TPU v5e", int(15.75 * GIB), 197e12, 819e9),
    "v6e": Chip("TPU v6e", int(31.25 * GIB), 918e12, 1640e9),
    "v5p": Chip("TPU v5p", int(95.74 * GIB), 459e12, 2765e9),
    "v4": Chip("TPU v4", int(30.75 * GIB), 275e12, 1228e9),
}


@dataclass(frozen=True)
class Topology:
    name: str
    """e.g. "v5e-8" (the slice's accelerator type)."""
    chip: Chip
    chips: int
    topology_name: str
    """jax's name for it, e.g. "v5e:2x4"."""
    chip_config_name: str
    chips_per_host_bounds: Tuple[int, int, int]


# (generation, chips) -> jax topology name; the arguments are MaxText's (accelerator_to_spec_map.py). v5p and v4
# count TensorCores in the slice name (two per chip, one "megacore" device per chip).
_SHAPES = {
    ("v5e", 1): "v5e:1x1", ("v5e", 4): "v5e:2x2", ("v5e", 8): "v5e:2x4", ("v5e", 16): "v5e:4x4",
    ("v5e", 32): "v5e:4x8", ("v5e", 64): "v5e:8x8", ("v5e", 128): "v5e:8x16", ("v5e", 256): "v5e:16x16",
    ("v6e", 1): "v6e:1x1", ("v6e", 4): "v6e:2x2", ("v6e", 8): "v6e:2x4", ("v6e", 16): "v6e:4x4",
    ("v6e", 32): "v6e:4x8", ("v6e", 64): "v6e:8x8", ("v6e", 128): "v6e:8x16", ("v6e", 256): "v6e:16x16",
    ("v5p", 4): "v5:2x2x1", ("v5p", 8): "v5:2x2x2", ("v5p", 16): "v5:2x2x4", ("v5p", 32): "v5:2x4x4",
    ("v5p", 64): "v5:4x4x4",
    ("v4", 4): "v4:2x2x1", ("v4", 8): "v4:2x2x2", ("v4", 16): "v4:2x2x4", ("v4", 32): "v4:2x4x4",
}
_MEGACORE = ("v5p", "v4")


def topologies() -> List[str]:
    return [f"{g}-{c * 2 if g in _MEGACORE else c}" for g, c in _SHAPES]


def parse_topology(name: str) -> Topology:
    """"v5e-8" -> its chip and jax topology; an unknown name is refused with the known ones."""
    m = re.fullmatch(r"(v5e|v6e|v5p|v4)-(\d+)", str(name).strip().lower())
    gen, size = (m.group(1), int(m.group(2))) if m else (None, 0)
    chips = size // 2 if gen in _MEGACORE else size
    if (gen, chips) not in _SHAPES:
        raise LitError(f"--topology {name!r} is not one of {', '.join(topologies())}")
    shape = _SHAPES[(gen, chips)]
    config = "megacore" if gen in _MEGACORE else "default"
    return Topology(f"{gen}-{size}", CHIPS[gen], chips, shape, config, (2, 2, 1))


# ---------------------------------------------------------------------------------------------------------------
# pure arithmetic: collectives, roofline, per-layer extrapolation
# ---------------------------------------------------------------------------------------------------------------
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
# `%name = bf16[8,4096]{1,0} all-gather(...)`, `(f32[4], f32[8]) all-reduce(`, and the async `-start` forms
_OP = re.compile(r"=\s*(\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO result shape: `bf16[8,4096]{1,0}` or a tuple of them."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES.get(dtype, 4)
    return total


def count_collectives(hlo_text: str) -> Dict[str, Dict[str, int]]:
    """{op: {"count", "bytes"}} of the collectives in (partitioned, per-chip) HLO text; bytes are each op's result
    per chip. An async pair counts once (its `-start`; its result tuple holds the operand and the result, so the
    larger array is taken)."""
    out = {op: {"count": 0, "bytes": 0} for op in COLLECTIVES}
    for shape, op, start in _OP.findall(hlo_text):
        out[op]["count"] += 1
        if start and shape.startswith("("):
            out[op]["bytes"] += max((shape_bytes(m.group(0)) for m in _ARRAY.finditer(shape)), default=0)
        else:
            out[op]["bytes"] += shape_bytes(shape)
    return out


def roofline(flops: float, hbm_bytes: float, chip: Chip, model_flops: Optional[float] = None) -> Dict[str, float]:
    """Per-chip step-time bound (the slower of compute at peak and HBM traffic at full bandwidth) and the MFU that
    bound allows (`model_flops` per chip: the useful FLOPs, 6N or 4N per token; default the compiled FLOPs).

    Compute is timed on the compiled FLOPs, or on `model_flops` where XLA's cost analysis counted fewer (it did on
    Llama-3.1-70B's steps: 0.6-1.0x the model's, so the bound came out above 100%): the step cannot do less than
    the model's own arithmetic. `flops_counted_ratio` (compiled / model FLOPs) and `compute_from` ("compiled" or
    "model") say which was used."""
    if flops < 0 or hbm_bytes < 0:
        raise ValueError("flops and bytes must be non-negative")
    useful = flops if model_flops is None else model_flops
    short = model_flops is not None and flops < model_flops
    compute_s = (model_flops if short else flops) / chip.peak_flops
    memory_s = hbm_bytes / chip.hbm_bandwidth
    step_s = max(compute_s, memory_s)
    return {"compute_s": compute_s, "memory_s": memory_s, "step_s": step_s,
            "bound": "compute" if compute_s >= memory_s else "memory",
            "mfu_bound": (useful / chip.peak_flops) / step_s if step_s > 0 else 0.0,
            "compute_from": "model" if short else "compiled",
            **({"flops_counted_ratio": flops / model_flops} if model_flops else {})}


def extrapolate(points: Dict[int, float], n_layer: int) -> float:
    """The value at `n_layer` layers from values at fewer layers, on the least-squares line through them (two or
    more depths). The cost of a transformer step is an embedding/head part plus the same amount per block."""
    if len(points) < 2:
        raise ValueError("extrapolation needs values at two or more depths")
    xs, ys = list(points), [float(points[x]) for x in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        raise ValueError("extrapolation needs two different depths")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return my + slope * (n_layer - mx)


# ---------------------------------------------------------------------------------------------------------------
# the TPU compiler (optional: jax + libtpu)
# ---------------------------------------------------------------------------------------------------------------
def tpu_compiler_missing() -> Optional[str]:
    """None when jax and libtpu are importable, else the one line that says how to install them."""
    import importlib.util

    for module in ("jax", "jaxlib", "libtpu"):
        if importlib.util.find_spec(module) is None:
            return f"{INSTALL_LINE} ({module} is missing)"
    return None


def module_from_dump(data: bytes) -> bytes:
    """An `HloModuleProto` from a dumped file: XLA's `--xla_dump_hlo_as_proto` writes an `HloProto` that holds
    the module in its field 1 (a length-delimited field, tag 0x0a)."""
    if not data or data[0] != 0x0A:
        return data
    length, shift, i = 0, 0, 1
    while True:
        b = data[i]
        length |= (b & 0x7F) << shift
        i += 1
        shift += 7
        if not b & 0x80:
            break
    return data[i:i + length]


COMPILER_FLAGS: Dict[str, Any] = {}


def _topology_devices(topo: Topology) -> Any:
    import os

    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server off Google Cloud
    # compile-only devices need no chip: without this a second plan (or a test) waits on libtpu's lockfile and fails
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies as jt

    desc = jt.get_topology_desc(topology_name=topo.topology_name, platform="tpu",
                                chip_config_name=topo.chip_config_name,
                                chips_per_host_bounds=topo.chips_per_host_bounds, num_slices=1,
                                wrap=(False, False, False))
    return desc.devices


def compile_for_topology(module_proto: bytes, topo: Topology, donors: Sequence[int] = (),
                         shardings: Optional[Dict[Any, str]] = None, keep_text: bool = False,
                         compiler_flags: Optional[Dict[str, Any]] = None,
                         progress: Callable[[str], None] = lambda what: None) -> Dict[str, Any]:
    """Compile an SPMD-annotated `HloModuleProto` for `topo`'s compile-only TPU devices; `donors` are the argument
    numbers whose buffers the step may reuse, `shardings` HLO shardings for arguments the module has none for
    (placeholders, which torch_xla cannot annotate). Returns per-chip memory
    (argument/output/alias/temp/peak bytes), the cost analysis (flops, bytes accessed), the collectives and
    `fits` (False with the compiler's message when it ran out of HBM). `progress` is told as each phase ends."""
    import numpy as np
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax, xla_client as xc
    from jax._src.lib.mlir import ir

    devices = _topology_devices(topo)
    progress(f"{topo.name}: {len(devices)} compile-only TPU devices")
    if len(devices) != topo.chips:
        raise LitError(f"the TPU compiler made {len(devices)} devices for {topo.name}, expected {topo.chips}")
    with mlir.make_ir_context():
        module = ir.Module.parse(_jax.mlir.hlo_to_stablehlo(module_proto))
        shardings = {int(k): v for k, v in (shardings or {}).items()}
        if donors or shardings:
            # hlo_to_stablehlo drops the HLO's buffer donors: put them back on @main's arguments, with the
            # placeholders' shardings
            main = next(op for op in module.body.operations
                        if ir.StringAttr(op.attributes["sym_name"]).value == "main")
            n_args = len(main.regions[0].blocks[0].arguments)
            old = main.attributes["arg_attrs"] if "arg_attrs" in main.attributes else None
            donor_set = set(donors)
            attrs = []
            for i in range(n_args):
                d = {a.name: a.attr for a in ir.DictAttr(old[i])} if old is not None else {}
                if i in donor_set:
                    d["jax.buffer_donor"] = ir.BoolAttr.get(True)
                if i in shardings:
                    d["mhlo.sharding"] = ir.StringAttr.get(shardings[i])
                attrs.append(ir.DictAttr.get(d))
            main.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs)
        bytecode = mlir.module_to_bytecode(module)
    progress(f"converted to StableHLO ({len(module_proto) / 1e6:.1f} MB of HLO)")
    options = xc.CompileOptions()
    build = options.executable_build_options
    build.num_replicas = 1
    build.num_partitions = topo.chips
    build.use_spmd_partitioning = True
    build.use_shardy_partitioner = False  # torch_xla annotates with GSPMD shardings
    # without this the outputs (new weights, optimizer state) come back replicated: wrong bytes, extra all-gathers
    build.allow_spmd_sharding_propagation_to_output = [True]
    build.device_assignment = xc.DeviceAssignment.create(np.array([[d.id for d in devices]]))
    flags = {**COMPILER_FLAGS, **(compiler_flags or {})}
    options.env_option_overrides = [(k, str(v)) for k, v in flags.items()]  # XLA (not libtpu) options
    client = devices[0].client
    try:
        executable = client.compile(bytecode, xc.DeviceList(tuple(devices)), options)
    except Exception as e:  # noqa: BLE001 - the compiler's own out-of-memory message is the answer
        text = str(e)
        if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
            raise
        progress("compiled: out of HBM")
        return {"fits": False, "error": text.splitlines()[0][:500], **_oom_bytes(text)}
    progress("compiled")
    stats = executable.get_compiled_memory_stats()
    cost = executable.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    hlo_text = executable.hlo_modules()[0].to_string()
    progress(f"read the compiled program's memory, cost and collectives ({len(hlo_text) / 1e6:.1f} MB of HLO text)")
    memory = {
        "argument_bytes": int(stats.argument_size_in_bytes), "output_bytes": int(stats.output_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes), "temp_bytes": int(stats.temp_size_in_bytes),
        "generated_code_bytes": int(stats.generated_code_size_in_bytes),
    }
    peak = getattr(stats, "peak_memory_in_bytes", 0) or (
        memory["argument_bytes"] + memory["output_bytes"] - memory["alias_bytes"] + memory["temp_bytes"])
    return {"fits": peak <= topo.chip.hbm_bytes, **memory, "peak_bytes": int(peak),
            "flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "collectives": count_collectives(hlo_text), **({"hlo_text": hlo_text} if keep_text else {})}


def _oom_bytes(text: str) -> Dict[str, Any]:
    """The sizes in libtpu's out-of-memory message ("Used 20.5G of 15.75G hbm. Exceeded hbm capacity by 4.7G")."""
    units = {"K": 1024, "M": 1024 ** 2, "G": GIB, "T": 1024 ** 4}
    out: Dict[str, Any] = {}
    m = re.search(r"Used ([0-9.]+)([KMGT]) of ([0-9.]+)([KMGT]) hbm", text)
    if m:
        out["peak_bytes"] = int(float(m.group(1)) * units[m.group(2)])
    m = re.search(r"[Ee]xceeded hbm capacity by ([0-9.]+)([KMGT])", text)
    if m:
        out["over_bytes"] = int(float(m.group(1)) * units[m.group(2)])
    return out


# ---------------------------------------------------------------------------------------------------------------
# Pallas kernels traced on XLA:CPU for the TPU
# ---------------------------------------------------------------------------------------------------------------
MOSAIC_VERSION = 7
"""The newest Mosaic (Pallas TPU) serialization libtpu 0.0.21 reads ("Failed to deserialize the Mosaic module:
Unsupported version: expected <= 7 but got 8" otherwise). On a TPU, jax picks it from the runtime's libtpu; here
there is no TPU runtime to ask, and jax 0.7.1 writes its newest, 8."""


def pallas_for_tpu(mosaic_version: int = MOSAIC_VERSION) -> None:
    """Make torch_xla's Pallas kernels (flash attention, grouped matmul) trace for the TPU in an XLA:CPU process:
    torch_xla lowers a kernel with jax for the default backend, which off a TPU is the CPU ("Only interpret mode is
    supported on CPU backend"); this lowers it for the "tpu" platform instead, in the Mosaic version libtpu reads.
    Both of torch_xla's ways in are lowered so: `trace_pallas` (flash attention) and `call_jax`'s `JaxCallable`
    (the grouped matmul's gmm and tgmm).
    The step's HLO then holds the kernels' `tpu_custom_call`s, as on a TPU (XLA:CPU cannot run them: trace only)."""
    import jax
    import jax._src.tpu_custom_call as tpu_custom_call
    import torch
    import torch_xla.experimental.custom_kernel as custom_kernel

    tpu_custom_call.get_ir_version = lambda ctx: mosaic_version

    def trace_pallas(kernel: Any, *args: Any, static_argnums: Any = None, static_argnames: Any = None,
                     use_cache: bool = False, **kwargs: Any) -> Tuple[Any, List[Any]]:
        # torch_xla 2.9's trace_pallas, lowered for the TPU (its payload cache is left out: a plan traces once)
        import jax._src.pallas.mosaic.pallas_call_registration  # noqa: F401  (the Mosaic lowering; as torch_xla)

        jax_args, tensor_args = [], []
        for arg in args:
            if torch.is_tensor(arg):
                jax_args.append(custom_kernel.to_jax_shape_dtype_struct(arg))
                tensor_args.append(arg)
            else:
                jax_args.append(arg)
        lowered = jax.jit(kernel, static_argnums=static_argnums, static_argnames=static_argnames).trace(
            *jax_args, **kwargs).lower(lowering_platforms=("tpu",))
        return custom_kernel._extract_backend_config(lowered.compiler_ir()), tensor_args

    custom_kernel.trace_pallas = trace_pallas

    # the grouped matmul (gmm / tgmm, lit_gpt.xla.moe_gmm) goes another way: torch_xla's call_jax
    # (xla_builder.JaxCallable) lowers the jax function, kernel included, for jax's default backend, the CPU
    import torch_xla.core.xla_builder as xla_builder

    def specialize(self: Any, sample_flat_args: Any) -> Any:
        # torch_xla 2.9's JaxCallable.specialize, lowered for the TPU
        tx = xla_builder.maybe_get_torchax()
        sample = tuple(None if a is None else jax.ShapeDtypeStruct(a.shape, tx.ops.mappings.t2j_dtype(a.dtype))
                       for a in sample_flat_args)
        lowered = jax.jit(self._flat_input_func.flat_call, keep_unused=True).trace(sample).lower(
            lowering_platforms=("tpu",))
        module = xla_builder.computation_from_module_proto(
            "jax_callable", lowered.compiler_ir("hlo").as_serialized_hlo_module_proto())
        return xla_builder.xla_computation_as_func(module, "jax_func")

    xla_builder.JaxCallable.specialize = specialize


# ---------------------------------------------------------------------------------------------------------------
# the memory compile: libtpu's compiler up to its buffer assignment (seconds), not through its code generator
# ---------------------------------------------------------------------------------------------------------------
# Measured on 2 cores (Llama-3.1-8B LoRA, 1 layer, v5e-8): libtpu's HLO passes, SPMD partitioning, fusion,
# rematerialization and buffer assignment took 15 s; its code generator then took 9 more minutes and 5 GiB. The
# per-chip memory is settled at buffer assignment; the compiler dumps it (XLA's --xla_dump_to writes the optimized
# program, the buffer assignment and a memory-usage report) and the compile is stopped there.
_REPORT = "after_optimizations-memory-usage-report.txt"
_ASSIGNMENT = "after_optimizations-buffer-assignment.txt"
_OPTIMIZED = "after_optimizations.txt"
_LAST = "after_optimizations_after_buffer_assignment.txt"  # written after the other three
_ALLOCATION = re.compile(r"^allocation \d+: size (\d+)(.*):$", re.M)


def buffer_assignment_memory(assignment: str, report: str) -> Dict[str, int]:
    """Per-chip bytes from XLA's dumped buffer assignment: arguments (entry parameters), outputs (live-out
    buffers), the arguments they alias (donated), temporaries, and the program's total (the memory-usage report's
    "Total bytes used": every allocation, constants and scratch included)."""
    out = {"argument_bytes": 0, "output_bytes": 0, "alias_bytes": 0, "temp_bytes": 0}
    for size, kinds in _ALLOCATION.findall(assignment):
        size = int(size)
        parameter = re.search(r"\bparameter \d+", kinds) is not None
        live_out = "live-out" in kinds or re.search(r"\boutput\b", kinds) is not None
        out["argument_bytes"] += size if parameter else 0
        out["output_bytes"] += size if live_out else 0
        out["alias_bytes"] += size if parameter and live_out else 0
        out["temp_bytes"] += size if "preallocated-temp" in kinds else 0
    m = re.search(r"Total bytes used: (\d+)", report)
    out["peak_bytes"] = int(m.group(1)) if m else (
        out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"])
    return out


def hlo_cost(hlo_text: str) -> Dict[str, float]:
    """FLOPs and bytes accessed of an optimized per-chip HLO program, by XLA's HLO cost analysis (the generic one:
    FLOPs are the TPU executable's own; bytes accessed count each fusion's operands and results, ~15% above the TPU
    executable's figure for an 8B step)."""
    from jax._src.lib import _jax, xla_client as xc

    cost = _jax.hlo_module_cost_analysis(xc.make_cpu_client(), _jax.hlo_module_from_text(hlo_text))
    return {"flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0))}


def compile_memory(module_proto: bytes, topo: Topology, donors: Sequence[int] = (),
                   shardings: Optional[Dict[Any, str]] = None, keep_text: bool = False,
                   progress: Callable[[str], None] = lambda what: None, poll_s: float = 0.2) -> Dict[str, Any]:
    """`compile_for_topology`'s figures from libtpu's compiler stopped after buffer assignment: a child process
    compiles with XLA's dumps on and is ended once the buffer assignment is written. Memory is the compiler's
    (before its code generator, which adds scratch: +4% peak on an 8B step's layer); FLOPs, bytes accessed and
    collectives are read off the optimized program. An out-of-memory program ends the compile by itself."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="lit-gpt-plan-compile-") as tmp:
        work = Path(tmp)
        (work / "module.pb").write_bytes(module_proto)
        (work / "job.json").write_text(json.dumps({"topology": topo.name, "donors": list(donors),
                                                   "shardings": {str(k): v for k, v in (shardings or {}).items()}}))
        code = "import sys; from lit_gpt.xla.plan import _compile_child; _compile_child(sys.argv[1])"
        with open(work / "compile.log", "w") as log:
            proc = subprocess.Popen([sys.executable, "-c", code, tmp], stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        dump, sizes, usage = work / "dump", None, None
        try:
            while usage is None:
                pid, status, ru = os.wait4(proc.pid, os.WNOHANG)  # (not poll(): wait4 also gives its peak memory)
                if pid:
                    usage, proc.returncode = ru, os.waitstatus_to_exitcode(status)
                    break
                last = sorted(dump.glob("*" + _LAST)) if dump.is_dir() else []
                if last:  # written last of the four, after the buffer assignment: done once its size holds
                    now = last[0].stat().st_size
                    if now and now == sizes:
                        break
                    sizes = now
                time.sleep(poll_s)
        finally:
            if usage is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the compiler's code generator: minutes not needed here
                _, status, usage = os.wait4(proc.pid, 0)
                proc.returncode = os.waitstatus_to_exitcode(status)
        rss = {"compile_max_rss_gib": round(usage.ru_maxrss / 1024 ** 2, 2)}
        if (work / "result.json").is_file():  # the compile ended by itself: out of HBM (or a tiny program)
            result = json.loads((work / "result.json").read_text())
            if "argument_bytes" not in result:
                progress("compiled: out of HBM")
                return {**result, **rss}
        files = {k: sorted(dump.glob("*" + k)) for k in (_REPORT, _ASSIGNMENT, _OPTIMIZED, _LAST)}
        if not all(files.values()):
            tail = "\n".join((work / "compile.log").read_text().strip().splitlines()[-10:])
            raise LitError(f"libtpu's compiler stopped before its buffer assignment (exit {proc.returncode}):\n{tail}")
        progress("libtpu's compiler reached buffer assignment (the code generator is skipped)")
        text = files[_OPTIMIZED][-1].read_text()
        memory = buffer_assignment_memory(files[_ASSIGNMENT][-1].read_text(), files[_REPORT][-1].read_text())
        result = {"fits": memory["peak_bytes"] <= topo.chip.hbm_bytes, **memory, **hlo_cost(text),
                  "collectives": count_collectives(text), "compiled_to": "buffer assignment", **rss,
                  **({"hlo_text": text} if keep_text else {})}
        progress("read the buffer assignment, the cost analysis and the collectives")
        return result


def _compile_child(tmp: str) -> None:
    """The compile of `compile_memory`, in its own process (its parent ends it after buffer assignment)."""
    import json
    from pathlib import Path

    work = Path(tmp)
    job = json.loads((work / "job.json").read_text())
    result = compile_for_topology((work / "module.pb").read_bytes(), parse_topology(job["topology"]), job["donors"],
                                  job["shardings"], compiler_flags={"xla_dump_to": str(work / "dump")})
    (work / "result.json").write_text(json.dumps({**result, "compiled_to": "executable"}))
