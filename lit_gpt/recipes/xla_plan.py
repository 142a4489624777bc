"""The TPU planner's tracing (xla/scripts/plan.py): a child process with as many XLA:CPU devices as the slice has
chips runs the XLA finetune recipes' own loop, `lit_gpt.training.fit`, on the recipe's model whose weights and
optimizer state are torch_xla placeholders (device data of the real shape and dtype without a buffer: no host
memory), wrapped by the recipe's Fabric strategy (FSDP over SPMD), up to the step's graph cut (`torch_xla.sync()` in
the optimizer step). There the pending graph is taken instead of run: its HLO with the sharding annotations, which
arguments are the weights' and optimizer state's buffers (donated, as torch_xla donates them) and the FSDP sharding
of the placeholders. One child traces every depth (torch_xla is imported once); `trace_in_child` is the parent's
side, with the trace cache.

    LIT_GPT_PLAN_TRACE=job.json PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 python -m lit_gpt.recipes.xla_plan
"""

import gc
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from lit_gpt.args import EvalArgs, MoEArgs, TrainArgs
from lit_gpt.utils import LitError
from lit_gpt.xla.plan_report import progress

CHILD_ENV = "LIT_GPT_PLAN_TRACE"  # set in the tracing child: the path of its job file
# part of the trace cache's key: a trace cached by an older tracer is traced again (2: the scanned weights' shardings)
TRACER_VERSION = 4  # 3: MoE layers traced with the TPU's grouped matmul; 4: the Pallas kernels counted


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




# ---------------------------------------------------------------------------------------------------------------
# the parent's side: one child traces every depth
# ---------------------------------------------------------------------------------------------------------------
def trace_in_child(job: Dict[str, Any], depths: List[int], cache: Optional[Path] = None) -> Dict[int, Dict[str, Any]]:
    """Run this module as a tracing child with `job["devices"]` XLA:CPU devices that traces the step at each of
    `depths` in turn (torch_xla is imported once); per depth: the step's HLO module, the donated argument numbers
    and the placeholder arguments' shardings. Depths `cache` holds are read from it, the others added to it."""
    def where(depth: int) -> Optional[Path]:
        keyed = {**job, "n_layer": depth, "tracer": TRACER_VERSION}
        key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]
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
        env = {**os.environ, CHILD_ENV: str(job_file), "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(job["devices"]),
               "JAX_PLATFORMS": "cpu"}  # jax only lowers kernels for the TPU here: no TPU backend to look for
        env.pop("TPU_SKIP_MDS_QUERY", None)
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "lit_gpt.recipes.xla_plan"], env=env, stdout=subprocess.PIPE,
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
    key = hashlib.sha256(traced["module"])
    key.update(json.dumps([traced["donors"], traced["shardings"], topology, compile_to]).encode())
    return Path(cache) / f"compiled-{key.hexdigest()[:16]}.json"


# ---------------------------------------------------------------------------------------------------------------
# the child: the recipe's step, traced with placeholder weights
# ---------------------------------------------------------------------------------------------------------------
class _Captured(Exception):
    """Raised at the step's graph cut once its graph is taken: it ends the loop before anything runs."""


def trace_child(job: Dict[str, Any]) -> None:
    import lit_gpt.xla.moe_gmm as moe_gmm
    from lit_gpt.xla.plan import pallas_for_tpu
    from lit_gpt.xla.strategy import make_fabric

    progress(f"imported torch_xla; {job['devices']} XLA:CPU devices")
    moe = getattr(model_config(job["model_name"], job["checkpoint_dir"], job["method"], job["lora"]), "n_expert", 0)
    if moe or job.get("packing"):
        # the step as a TPU runs it: the strategy gives MoE layers the Pallas grouped matmul on a TPU (for their
        # dropless dispatch, --moe.capacity_factor none) and packed rows the Pallas flash attention with segment ids
        # (`_trace_depth`), lowered here for the TPU (traced, not run)
        pallas_for_tpu()
    if moe:
        moe_gmm.device_type = lambda: "TPU"
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
    if job.get("packing"):  # what the strategy installs for packed rows on a TPU (lit_gpt.xla.flash)
        from torch_xla.experimental.custom_kernel import flash_attention

        from lit_gpt.xla.flash import segment_attention

        model.segment_attention = segment_attention(flash_attention, strategy.mesh, strategy.batch_axes)
    placeholders.prime_optimizer(opt)  # the steady step: the state exists (as placeholders) before it runs
    progress("wrapped by the recipe's strategy; optimizer state as placeholders")
    donated = {k for p in model.parameters() if p.requires_grad for k in _keys(p)} | placeholders.state_ids

    # the data: rows of max_seq_length tokens, every position a target (the head runs on all of them); packed: each
    # row two documents (their segment ids go to the attention), collated as the recipe collates packed rows
    t = job["max_seq_length"]
    rows = job["micro_batch_size"] * runtime.local_devices
    tokens = torch.randint(0, config.vocab_size, (rows, 2, t))
    samples = [{"input_ids": row[0], "labels": row[1]} for row in tokens]
    if job.get("packing"):
        from lit_gpt.packing import collate_packed

        half = t // 2  # a document of `half` positions holds half + 1 tokens (its inputs and its last target)
        docs = [[{"input_ids": row[0][:half + 1], "labels": row[1][:half + 1]},
                 {"input_ids": row[0][half:], "labels": row[1][half:]}] for row in tokens]
        batches = TrainBatches(docs, rows, t, shuffle=False, batches_per_epoch=1, collate_fn=collate_packed,
                               packed=True)
    else:
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
        # each argument by its tensor id and by its data's id: under --scan_layers the data of the weights (not of the
        # optimizer state) comes back under another tensor id (torch_xla's scan wraps them again), and by tensor id
        # alone the weights were compiled replicated and not donated (3.7x the arguments of an 8B full step)
        keys = [{("tensor", tid), ("data", X._unique_id_for_ir_and_data(v))} for tid, v in zip(ids, values)]
        shardings = {i: next(placeholders.sharding_of[k] for k in ks if k in placeholders.sharding_of)
                     for i, ks in enumerate(keys) if ks & placeholders.sharding_of.keys()}
        meta = {"donors": [i for i, ks in enumerate(keys) if ks & donated], "shardings": shardings,
                "arguments": [list(v.shape) for v in values], "outputs": len(pending),
                "n_layer": job["n_layer"], "parameters": sum(p.numel() for p in model.parameters()),
                "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "tpu_kernels": module.count(b"tpu_custom_call"),
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


def _keys(t: torch.Tensor) -> set:
    """How a graph argument is recognised: its tensor id, and the id of its data (device data shared by tensors)."""
    import torch_xla

    X = torch_xla._XLAC
    return {("tensor", X._xla_get_tensor_id(t)), ("data", X._unique_id_for_ir_and_data(t))}


@dataclass
class _Placeholders:
    """Weights and optimizer state as torch_xla placeholders (device data of the real shape and dtype that hold no
    buffer), with the FSDP sharding each would get recorded per tensor id for the compiler."""

    mesh: Any
    dtype: torch.dtype
    sharding_of: Dict[Any, str] = field(default_factory=dict)
    state_ids: set = field(default_factory=set)
    _texts: Dict[Any, str] = field(default_factory=dict)

    def make(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        import torch_xla
        import torch_xla.core.xla_builder as xb
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import _prepare_spmd_partition_spec

        t = xb.create_placeholder_tensor(tuple(shape), dtype)
        spec = _prepare_spmd_partition_spec(t, shard_maximal=True)
        for key in _keys(t):
            self.sharding_of[key] = self.text(len(shape), spec)
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
            if ("tensor", torch_xla._XLAC._xla_get_tensor_id(t)) in self.sharding_of:
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
                    self.state_ids.update(_keys(state[k]))


if __name__ == "__main__":  # the tracing child (started by `trace_in_child`)
    trace_child(json.loads(Path(os.environ[CHILD_ENV]).read_text()))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the step is written: skip torch_xla's teardown of the 8 devices (15 s for an 8B step's graph)
