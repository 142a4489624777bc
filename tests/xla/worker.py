"""Scenarios for tests/xla, each run in its own process (the XLA runtime reads PJRT_DEVICE / CPU_NUM_DEVICES once,
and SPMD mode is process-wide and irreversible). Results go to OUT/SCENARIO.json for the tests to check.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 python tests/xla/worker.py main OUT
"""

import json
import os
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Dict, List

import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS.parent)]  # a script: tests/tiny.py and bench/instruments.py from here too

import lit_gpt.xla as lx  # noqa: E402
from bench.instruments import AnonMemorySampler, CompileCounter, RecompilationWarning, rss_anon_bytes  # noqa: E402
from lit_gpt import GPT, Config  # noqa: E402
from lit_gpt.utils import LitError, chunked_cross_entropy  # noqa: E402
from tiny import TINY, random_model  # noqa: E402

STEPS = 5
SAVE_AFTER = 3
BATCH = 8


def tiny_checkpoint(out: Path) -> Path:
    """The same random tiny model in every process (written once by whoever comes first, atomically)."""
    path = out / "tiny" / "lit_model.safetensors"
    if not path.is_file():
        from lit_gpt.weights import save_weights

        save_weights(random_model(Config(**TINY)).state_dict(), path.parent)  # staged, then renamed: atomic
    return path


def batch(step: int):
    """Counting sequences from random starts: the next token is learnable, so a few steps lower the loss."""
    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, TINY["vocab_size"], (BATCH, 1), generator=g)
    x = (starts + torch.arange(17)) % TINY["vocab_size"]
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def train_step(fabric, model, optimizer, step: int) -> float:
    inputs, targets = lx.shard_batch(fabric, batch(step))
    loss = chunked_cross_entropy(model(inputs), targets)
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def setup_tiny(fabric, out: Path):
    model = lx.load_staged(Config(**TINY), tiny_checkpoint(out), fabric, progress=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return fabric.setup(model, optimizer)


def to_cpu(t: torch.Tensor) -> torch.Tensor:
    """The full value of a (possibly sharded) device tensor, assembled from its local shards on the host.
    (`.cpu()` of a sharded tensor compiles a gather graph per tensor: slow on XLA:CPU, and not what is tested.)"""
    import torch_xla
    import torch_xla.distributed.spmd as xs

    if t.device.type != "xla" or torch_xla._XLAC._get_xla_sharding_spec(t) in ("", "{replicated}"):
        return t.detach().cpu()
    full = torch.empty(t.shape, dtype=t.dtype)
    for shard in xs.wrap_if_sharded(t.detach()).local_shards:
        full[tuple(shard.indices)] = shard.unpadded_data
    return full


def shardings(model) -> Dict[str, str]:
    import torch_xla

    from lit_gpt.xla.checkpoint import module_state_dict

    state, _ = module_state_dict(model)
    return {name: torch_xla._XLAC._get_xla_sharding_spec(t) for name, t in state.items()}


def cpu_state(model, optimizer) -> Dict[str, Any]:
    from lit_gpt.xla.checkpoint import module_state_dict

    state, _ = module_state_dict(model)
    opt = {f"{pid}.{k}": to_cpu(v) for pid, s in optimizer.state_dict()["state"].items() for k, v in s.items()}
    return {"model": {k: to_cpu(v) for k, v in state.items()}, "optimizer": opt}


# ---------------------------------------------------------------------------------------------------------------
def scenario_train(out: Path, result: Dict[str, Any], save: bool, **fabric_kwargs: Any) -> None:
    """fp32 FSDP: 5 steps; optionally a sharded save after step 3 (+ CPU reference tensors)."""
    fabric = lx.make_fabric(**fabric_kwargs)
    fabric.launch()
    model, optimizer = setup_tiny(fabric, out)
    counter = CompileCounter(warmup_steps=2)
    losses: List[float] = []
    for step in range(STEPS):
        losses.append(train_step(fabric, model, optimizer, step))
        counter.step()
        if save and step + 1 == SAVE_AFTER:
            with counter.pause():
                torch.save(cpu_state(model, optimizer), out / "reference.pt")
                fabric.save(out / "ckpt" / f"step-{SAVE_AFTER:06d}", {"model": model, "optimizer": optimizer,
                                                                     "step": SAVE_AFTER, "data": {"position": 24}})
    result.update(losses=losses, shardings=shardings(model), compiles_per_step=counter.per_step,
                  report=counter.report(), devices=lx.get_strategy(fabric).num_devices)


MEMORY = dict(name="mem", block_size=256, vocab_size=8192, n_layer=4, n_head=6, n_embd=768, intermediate_size=2048,
              norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP")


def memory_sizes():
    with torch.device("meta"):
        meta = GPT(Config(**MEMORY))
    block = sum(p.numel() for p in meta.transformer.h[0].parameters()) * 4
    return block, sum(p.numel() for p in meta.parameters()) * 4


def scenario_memory(out: Path, result: Dict[str, Any], mode: str) -> None:
    """Host memory of loading the ~160 MB checkpoint conftest wrote: staged, or naive (bench/load.py: >= 1 GB)."""
    import torch_xla

    from lit_gpt.xla.loader import _release_host_memory

    config = Config(**MEMORY)
    path = out / "mem" / "lit_model.pth"
    block, model_bytes = memory_sizes()
    fabric = lx.make_fabric()
    fabric.launch()
    # the runtime's one-time imports out of the measurement: torch_xla's first mark_sharding imports jax (through
    # its bundled torchax, when jax is installed), tens of MB that belong to start-up, not to loading
    import torch_xla.distributed.spmd as xs

    xs.mark_sharding(torch.zeros(8, 1, device=torch_xla.device()), fabric.strategy.mesh, ("fsdp", None))
    torch_xla.sync(wait=True)
    _release_host_memory()  # start from memory that is really in use
    with AnonMemorySampler(interval=0.001) as mem:
        if mode == "staged":
            model = lx.load_staged(config, path, fabric, progress=False)
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
            model = GPT(config)
            model.load_state_dict(sd)
            del sd
            model = fabric.setup(model)  # .to(xla) and FSDPv2 sharding
            torch_xla.sync(wait=True)
            _release_host_memory()
    final = mem.end
    spec = torch_xla._XLAC._get_xla_sharding_spec(next(iter(model.parameters())))
    result.update(block=block, model=model_bytes, spec=spec, peak_minus_final=mem.peak - final,
                  above_model=mem.peak - mem.start - model_bytes, resident_added=final - mem.start)
    del model
    torch_xla.sync(wait=True)


# a SmolLM2-style tied embedding (49152 x 1024) that dominates one small block: the tensor the loader stages alone
CAST = dict(name="cast", block_size=256, vocab_size=49152, n_layer=1, n_head=8, n_embd=1024, intermediate_size=2816,
            norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", tie_embeddings=True)


def scenario_cast_memory(out: Path, result: Dict[str, Any]) -> None:
    """Host memory of a staged load that casts (fp32 file -> bf16 parameters), measured like bench/load.py: the peak
    above the final resident size and above start + model bytes, against the larger of the largest block and the
    largest tensor in bf16. Runs after scenario_memory in the same process: the XLA runtime's one-time allocations
    are already made, so a ~100 MB tensor measures the loader, not the runtime's start-up."""
    import torch_xla

    from lit_gpt.xla.loader import _release_host_memory

    config = Config(**CAST)
    path = out / "cast" / "lit_model.pth"
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = GPT(config)
    state = {k: torch.randn(t.shape) * 0.02 for k, t in meta.state_dict().items() if k != "lm_head.weight"}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)  # tied: one tensor, under the embedding's name (the loader assigns it to both)
    del state
    params = list(meta.parameters())
    block = sum(p.numel() for p in meta.transformer.h[0].parameters()) * 2
    tensor = max(p.numel() for p in params) * 2
    model_bytes = sum(p.numel() for p in params) * 2
    fabric = lx.make_fabric()  # 32-true: the bf16 comes from load_staged's dtype
    fabric.launch()
    # what the loader hands torch_xla's direct sharded transfer: the host bytes of the shards (distinct tensors)
    # and this process's anonymous memory at that moment, before torch_xla copies anything (deterministic, unlike
    # the peak, which depends on how torch_xla's transfer threads overlap their copies)
    handovers: List[Dict[str, int]] = []
    direct = torch_xla._XLAC._global_tensor_from_cpu_shards

    def recording(shards, *args, **kwargs):
        distinct = {id(t): t for t in shards}.values()
        handovers.append({"shard_bytes": sum(t.numel() * t.element_size() for t in distinct),
                          "rss_anon": rss_anon_bytes()})
        return direct(shards, *args, **kwargs)

    torch_xla.sync(wait=True)
    _release_host_memory()
    torch_xla._XLAC._global_tensor_from_cpu_shards = recording
    try:
        with AnonMemorySampler(interval=0.001) as mem:
            model = lx.load_staged(config, path, fabric, progress=False, dtype=torch.bfloat16)
    finally:
        torch_xla._XLAC._global_tensor_from_cpu_shards = direct
    final = mem.end
    largest = max(handovers, key=lambda h: h["shard_bytes"], default={"shard_bytes": 0, "rss_anon": mem.start})
    source = torch.load(path, mmap=True, weights_only=True)
    equal = all(torch.equal(p.cpu(), source[n if n in source else "transformer.wte.weight"].to(torch.bfloat16))
                for n, p in model.named_parameters(remove_duplicate=False))
    result.update(block=block, tensor=tensor, model=model_bytes, peak_minus_final=mem.peak - final,
                  handed_shard_bytes=largest["shard_bytes"], above_start_at_handover=largest["rss_anon"] - mem.start,
                  above_model=mem.peak - mem.start - model_bytes, resident_added=final - mem.start, bit_equal=equal,
                  dtypes=sorted({str(p.dtype) for p in model.parameters()}), tied=model.lm_head.weight is
                  model.transformer.wte.weight, spec=torch_xla._XLAC._get_xla_sharding_spec(model.lm_head.weight))
    del model, source
    torch_xla.sync(wait=True)

def scenario_adapter(out: Path, result: Dict[str, Any]) -> None:
    """Frozen base + trainable adapter, sharded; adapter-only save for consolidation."""
    from lit_gpt import adapter

    fabric = lx.make_fabric()
    fabric.launch()
    config = adapter.Config(**TINY, adapter_prompt_length=4, adapter_start_layer=1)
    model = lx.load_staged(lambda: adapter.GPT(config), tiny_checkpoint(out), fabric, progress=False,
                           allow_missing=adapter.adapter_filter)
    adapter.mark_only_adapter_as_trainable(model)
    from lit_gpt.xla.checkpoint import module_state_dict

    before = {n: to_cpu(t).clone() for n, t in module_state_dict(model)[0].items()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    losses = [train_step(fabric, model, optimizer, 0)]
    after, _ = module_state_dict(model)
    changed = sorted(n for n, t in after.items() if not torch.equal(to_cpu(t), before[n]))
    frozen = sorted(n for n, p in before.items() if not adapter.adapter_filter(n))
    fabric.save(out / "ckpt" / "adapter", {"model": model, "method": "adapter",
                                          "config": {"adapter_prompt_length": 4, "adapter_start_layer": 1}},
                filter={"model": lambda name, value: adapter.adapter_filter(name)})
    torch.save({n: to_cpu(t) for n, t in after.items() if adapter.adapter_filter(n)}, out / "adapter_reference.pt")
    result.update(losses=losses, changed=changed, frozen=frozen, shardings=shardings(model))


def scenario_precision(out: Path, result: Dict[str, Any]) -> None:
    for precision in ("bf16-true", "bf16-mixed"):
        fabric = lx.make_fabric(precision=precision)
        fabric.launch()
        model, optimizer = setup_tiny(fabric, out)
        loss = train_step(fabric, model, optimizer, 0)
        result[precision] = {"loss": loss, "dtype": str(next(model.parameters()).dtype),
                             "xla_use_bf16": os.environ.get("XLA_USE_BF16")}


def scenario_compile_counter(out: Path, result: Dict[str, Any]) -> None:
    import torch_xla

    fabric = lx.make_fabric()
    fabric.launch()
    device = torch_xla.device()
    w = torch.randn(16, 16).to(device)
    counter = CompileCounter(warmup_steps=1)
    for _ in range(4):
        x = torch.randn(8, 16).to(device)
        (x @ w).relu().sum().item()
        counter.step()
    fixed = list(counter.per_step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.randn(12, 16).to(device)  # a new batch shape
        (x @ w).relu().sum().item()
        counter.step()
    result.update(fixed=fixed, recompiles=counter.recompiles, report=counter.report(),
                  warnings=[str(w.message) for w in caught if issubclass(w.category, RecompilationWarning)])


def scenario_checkpointed_two_slices(out: Path, result: Dict[str, Any]) -> None:
    """Activation checkpointing per block, on a ("dcn", "fsdp") = (2, 4) mesh: 2 steps."""
    fabric = lx.make_fabric(activation_checkpointing=True, num_slices=2)
    fabric.launch()
    model, optimizer = setup_tiny(fabric, out)
    result["losses"] = [train_step(fabric, model, optimizer, step) for step in range(2)]
    result["mesh"] = dict(lx.get_strategy(fabric).mesh.shape())
    result["shardings"] = shardings(model)
    block = model.module.transformer.h[0]
    # wrapped by the strategy's checkpoint (lit_gpt.xla.scan.checkpoint_block binds its own forward to the block)
    forward = getattr(block.module.forward, "__func__", None)
    result["checkpointed"] = getattr(forward, "__qualname__", "") == "checkpoint_block.<locals>.forward"


def scenario_errors(out: Path, result: Dict[str, Any]) -> None:
    fabric = lx.make_fabric()
    fabric.launch()
    import torch_xla

    x = torch.arange(8.0).to(torch_xla.device())
    # SPMD semantics: a device tensor is one global value; host values pass through with a single host
    result["collectives"] = {
        "all_reduce": fabric.all_reduce(x, reduce_op="mean").cpu().tolist(),
        "broadcast": fabric.broadcast({"a": 1}),
        "world_size": fabric.world_size,
        "global_rank": fabric.global_rank,
        "host_value": float(fabric.all_reduce(3.0, reduce_op="sum")),
    }
    fabric.barrier()
    errors = {}
    try:
        lx.shard_batch(fabric, torch.zeros(6, 4, dtype=torch.long))
    except LitError as e:
        errors["batch"] = str(e)
    try:
        lx.make_fabric(devices=3)
    except LitError as e:
        errors["devices"] = str(e)
    # the staged loader refuses a base checkpoint that lacks a weight of the model (never random values), like the
    # CPU/GPU path; only a variant's own new parameters may be missing
    from lit_gpt.weights import load_weights

    state = load_weights(tiny_checkpoint(out))
    without_layer = out / "missing" / "no_layer.pth"
    without_layer.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v for k, v in state.items() if k != "transformer.h.1.attn.proj.weight"}, without_layer)
    without_head = out / "missing" / "no_head.pth"
    torch.save({k: v for k, v in state.items() if k != "lm_head.weight"}, without_head)
    for name, path, config in (("layer", without_layer, Config(**TINY)),
                               ("head", without_head, Config(**{**TINY, "tie_embeddings": False}))):
        try:
            lx.load_staged(config, path, fabric, progress=False)
        except LitError as e:
            errors[f"missing_{name}"] = str(e)
    from lit_gpt import lora

    lora_config = lora.Config(**TINY, lora_r=2, lora_alpha=4)
    model = lx.load_staged(lambda: lora.GPT(lora_config), tiny_checkpoint(out), fabric, progress=False,
                           allow_missing=lora.lora_filter)
    result["lora_loaded"] = sorted(n for n, _ in model.named_parameters() if lora.lora_filter(n))[:2]
    result["errors"] = errors


def _run(out: Path, result: Dict[str, Any], parts) -> None:
    for name, fn in parts:
        result[name] = {}
        t0 = time.time()
        fn(out, result[name])
        result[name]["seconds"] = time.time() - t0


def train8_scenario(out: Path, result: Dict[str, Any]) -> None:
    _run(out, result, [("memory", lambda o, r: scenario_memory(o, r, "staged")),  # first: a fresh process
                       ("cast_memory", scenario_cast_memory),
                       ("train", lambda o, r: scenario_train(o, r, save=True)),
                       ("compile_counter", scenario_compile_counter), ("errors", scenario_errors)])


def scenario_device_choice(out: Path, result: Dict[str, Any]) -> None:
    """PJRT_DEVICE unset, then PJRT_DEVICE=TPU without a TPU: both decided before the runtime starts, so this
    process goes on (with PJRT_DEVICE=CPU) afterwards."""
    import contextlib
    import io

    del os.environ["PJRT_DEVICE"]
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        result["unset_choice"] = lx.configure_pjrt_device()
    result["unset_message"] = stderr.getvalue()
    os.environ["PJRT_DEVICE"] = "TPU"
    try:
        lx.make_fabric()
    except LitError as e:
        result["error"] = str(e)
    finally:
        os.environ["PJRT_DEVICE"] = "CPU"


def ref1_scenario(out: Path, result: Dict[str, Any]) -> None:
    """The one-device reference (and checks that do not depend on the device count, where compiling is cheap)."""
    _run(out, result, [("device_choice", scenario_device_choice),
                       ("train", lambda o, r: scenario_train(o, r, save=False, compile_cache_dir=str(o / "cache"))),
                       ("precision", scenario_precision)])


def reshard_scenario(out: Path, result: Dict[str, Any]) -> None:
    """Load the 8-device checkpoint on this process's devices, compare, and train the remaining steps."""
    result["memory"] = {}
    scenario_memory(out, result["memory"], "naive")  # first: a fresh process
    ckpt = out / "ckpt" / f"step-{SAVE_AFTER:06d}"
    fabric = lx.make_fabric()
    fabric.launch()
    model, optimizer = setup_tiny(fabric, out)
    deadline = time.time() + 900
    while lx.latest_checkpoint(ckpt.parent) != ckpt:  # written by the concurrent 8-device process
        if time.time() > deadline or ((out / "train8.json").exists() and lx.latest_checkpoint(ckpt.parent) != ckpt):
            raise RuntimeError(f"{ckpt} did not appear (see train8.log)")
        time.sleep(0.5)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(ckpt, state)
    reference = torch.load(out / "reference.pt", weights_only=True)
    loaded = cpu_state(model, optimizer)
    result["model_equal"] = sorted(loaded["model"]) == sorted(reference["model"]) and all(
        torch.equal(loaded["model"][k], v) for k, v in reference["model"].items())
    result["optimizer_equal"] = sorted(loaded["optimizer"]) == sorted(reference["optimizer"]) and all(
        torch.equal(loaded["optimizer"][k], v) for k, v in reference["optimizer"].items())
    result["step"] = state["step"]
    result["remainder"] = remainder
    result["losses_after"] = [train_step(fabric, model, optimizer, s) for s in range(SAVE_AFTER, STEPS)]
    result["shardings"] = shardings(model)


def extra8_scenario(out: Path, result: Dict[str, Any]) -> None:
    """Frozen-parameter (adapter) training, activation checkpointing on two slices, then (last: it ends with
    SIGKILL) the killed save."""
    _run(out, result, [("adapter", scenario_adapter), ("checkpointed", scenario_checkpointed_two_slices)])
    (out / "extra8.json").write_text(json.dumps(result, default=str))
    kill_scenario(out)


def kill_scenario(out: Path) -> None:
    """A complete save, then a save killed (SIGKILL) after its data and DCP metadata are written but before its
    completion marker: the most finished a partial checkpoint can look."""
    import lit_gpt.xla.checkpoint as ck

    fabric = lx.make_fabric()
    fabric.launch()
    model, optimizer = setup_tiny(fabric, out)
    first = out / "kill" / "step-000001"
    fabric.save(first, {"model": model, "optimizer": optimizer, "step": 1})
    torch.save(cpu_state(model, optimizer), out / "kill_reference.pt")
    train_step(fabric, model, optimizer, 0)

    def die(path, obj):
        os.kill(os.getpid(), signal.SIGKILL)

    ck.write_json_synced = die  # the marker (the commit) is written by lit_gpt.manifest's writer
    fabric.save(out / "kill" / "step-000002", {"model": model, "optimizer": optimizer, "step": 2})
    raise AssertionError("the process should have been killed")


SCENARIOS = {"train8": train8_scenario, "extra8": extra8_scenario, "reshard": reshard_scenario, "ref1": ref1_scenario}

if __name__ == "__main__":
    name, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    result: Dict[str, Any] = {}
    try:
        SCENARIOS[name](out, result)
    except BaseException:
        result["error"] = traceback.format_exc()
        raise
    finally:
        (out / f"{name}.json").write_text(json.dumps(result, default=str))
