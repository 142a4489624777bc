"""The steps of the finetune recipes (finetune/*.py on CPU/CUDA; `lit_gpt.recipes.xla_finetune` adds XLA's) around
the one training loop, `lit_gpt.training.fit`:

    run = FinetuneRun(method="lora", checkpoint_dir=..., out_dir=..., config=..., data=..., train=..., eval=...)
    fabric = setup_fabric(devices, precision, out_dir, ...)          # Fabric: devices, precision, FSDP/DDP, loggers
    fabric.launch(main, run)                                        # main(fabric, run): one typed object
    runtime = Runtime(fabric)                                       # CPU/CUDA (XLA: XLARuntime)
    data = load_run_data(runtime, run)                              # checked before any weights are read
    model, raw_model = setup_model(fabric, build, run.checkpoint_dir, ...)   # build, load base weights, freeze, wrap
    optimizer = fabric.setup_optimizers(build_optimizer(model, run.train, run.optimizer))
    fit(fabric, runtime, model, raw_model, optimizer, data, method, run)    # lit_gpt.training.fit
"""

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, Literal, Optional, Sequence, Tuple, Type, Union

import lightning as L
import torch
import torch.nn as nn

from lit_gpt.args import DataArgs, EvalArgs, TrainArgs
from lit_gpt.fingerprint import base_record
from lit_gpt.launch import check_launcher, launch, strategy_timeout
from lit_gpt.config import Config, load_config  # noqa: F401  (the recipes import `load_config` from here)
from lit_gpt.data import prepared_record
from lit_gpt.runtime import FINAL_DIR, STEP_DIR, param_dtype, resolve_accelerator
from lit_gpt.storage import location, log_folder
from lit_gpt import training
from lit_gpt.model import Block
from lit_gpt.recipes.flags import FINETUNE, Flag, command, finetune_flags, values
from lit_gpt.runtime import Runtime
from lit_gpt.objectives import Objective
from lit_gpt.training import Method, RunData, uses_fsdp
from lit_gpt.utils import LitError, cast_floating, load_error_detail, num_parameters
from lit_gpt.weights import check_checkpoint_dir
from lit_gpt.weights import load_weights


@dataclass
class FinetuneRun:
    """A finetune recipe's arguments after its checks, as one typed object: what `fabric.launch(main, run)` passes
    to the recipe's `main` (no positional lists) and what `finetune.json` records."""

    method: str
    """"full", "lora", "adapter", "adapter_v2"."""
    checkpoint_dir: Path
    out_dir: Union[str, Path]
    config: Config
    """The model's config with the method's settings (e.g. lora_r)."""
    data: DataArgs
    train: TrainArgs
    eval: EvalArgs
    resume: Union[bool, str, Path] = False
    optimizer: str = "adamw"
    quantize: Optional[str] = None
    """QLoRA's "bnb.nf4", or "mxfp4" (gpt-oss's experts frozen in MXFP4); CPU/CUDA LoRA only."""
    platform: Optional[str] = None
    """"xla" for the XLA recipes (recorded: a run resumes on the backend that started it)."""
    options: Dict[str, Any] = field(default_factory=dict)
    """Backend options that do not change what is computed (e.g. xla_metrics)."""
    base: Optional[Dict[str, Any]] = None
    """The base model's record ({"fingerprint", "checkpoint_dir"}, `lit_gpt.fingerprint`): kept with every
    checkpoint and the final weights, compared on resume, generation and merging."""
    allow_other_base: bool = False
    """Resume although the base's fingerprint differs from the run's (one warning line instead of an error)."""
    allow_other_data: bool = False
    """Resume although --data.data_dir holds other prepared data than the run trained on (one warning line)."""
    objective: Optional[Objective] = None
    """What a step optimises (`lit_gpt.objectives`): None is supervised finetuning; DPO for the dpo recipes."""
    init_from: Optional[Path] = None
    """The method's weights to start from instead of its initialisation (--lora_init_from, `lora_init_from`)."""
    rope_scaling: Optional[Dict[str, Any]] = None
    """--rope_scaling as given (recorded: a resumed run must give the same, `lit_gpt.checkpoints.check_same_run`)."""

    @property
    def run_config(self) -> Dict[str, Any]:
        """The arguments that decide what the run computes, JSON-friendly (finetune.json; a resumed run must match)."""
        extra: Dict[str, Any] = {}
        if self.quantize:
            extra["quantize"] = self.quantize
        if self.platform:
            extra["platform"] = self.platform
        if self.base:
            extra["base"] = self.base
        if self.config.n_expert:  # the MoE settings in effect (--moe or the checkpoint's): part of what is computed
            extra["moe"] = moe_settings(self.config)
        if self.rope_scaling:  # the RoPE tables the run trains with (absent: the checkpoint's own, as runs before)
            extra["rope_scaling"] = self.rope_scaling
        if self.objective is not None and self.objective.settings() is not None:
            extra[self.objective.name] = self.objective.settings()  # e.g. "dpo": beta, loss, reference
        return run_config(method=self.method, checkpoint_dir=self.checkpoint_dir, data=self.data, train=self.train,
                          eval=self.eval, optimizer=self.optimizer, **extra)


def check_mxfp4_lora(flags: Dict[str, Any]) -> None:
    """`--quantize mxfp4` in the LoRA recipes (finetune/lora.py, xla/finetune/lora.py): it packs the experts of a
    mixture-of-experts model (gpt-oss) and keeps them frozen; one line for a model without experts and for
    --lora_experts (the experts' values are checked when they are packed)."""
    if not load_config(flags["checkpoint_dir"]).n_expert:
        raise LitError("--quantize mxfp4 packs the experts of a mixture-of-experts model (gpt-oss); this model has"
                       " none: run without --quantize mxfp4")
    if flags["lora_experts"]:
        raise LitError("--lora_experts does not combine with --quantize mxfp4 (the experts stay frozen in MXFP4):"
                       " drop one of the two")


def moe_settings(config: Config) -> Dict[str, Any]:
    """The training settings of a mixture-of-experts model that a run records (finetune.json; a resumed run must
    match them)."""
    return {"capacity_factor": config.moe_capacity_factor, "dispatch": config.moe_dispatch,
            "router_aux_loss_coef": config.router_aux_loss_coef}


def setup_fabric(
    devices: int,
    precision: Optional[str],
    out_dir: Path,
    logger_name: Literal["csv", "tensorboard", "wandb"] = "csv",
    strategy: Literal["auto", "ddp", "fsdp"] = "auto",
    block_cls: Optional[Type[nn.Module]] = None,
    accelerator: str = "auto",
    num_nodes: int = 1,
    resume: Union[bool, str, Path] = False,
    peer_timeout: float = 1800.0,
) -> L.Fabric:
    """Fabric for the run: one device, or several (on `num_nodes` machines) with FSDP (sharding per `block_cls`)
    on GPUs and DDP on CPU processes, where Fabric has no FSDP. `out_dir` is checked first (see `check_out_dir`)."""
    if devices < 1:
        raise LitError(f"--devices must be >= 1 (got {devices})")
    if num_nodes < 1:
        raise LitError(f"--num_nodes must be >= 1 (got {num_nodes})")
    accelerator = resolve_accelerator(accelerator)
    if accelerator == "cuda" and devices > torch.cuda.device_count():
        raise LitError(
            f"--devices {devices} but only {torch.cuda.device_count()} GPU(s) are visible: lower --devices, or"
            " train on CPU processes with --accelerator cpu"
        )
    timeout = strategy_timeout(peer_timeout)  # how long any process waits for the others (join, collectives)
    check_out_dir(out_dir, resume)
    if precision is None:
        precision = "bf16-true" if accelerator == "cuda" and torch.cuda.is_bf16_supported() else "32-true"
    if accelerator == "cpu" and precision in ("16-true", "16-mixed"):
        raise LitError(f"--precision {precision} needs a GPU: on the CPU use 32-true, bf16-true or bf16-mixed")
    parallel = devices * num_nodes > 1
    if strategy == "auto":
        strategy = "fsdp" if parallel and accelerator == "cuda" else ("ddp" if parallel else "auto")
    if strategy == "fsdp":
        if accelerator != "cuda":
            raise LitError("FSDP needs GPUs (Lightning Fabric supports it on CUDA only): use --strategy ddp on the CPU")
        from lightning.fabric.strategies import FSDPStrategy

        strategy_obj: Any = FSDPStrategy(
            auto_wrap_policy={block_cls} if block_cls is not None else None,
            state_dict_type="full",  # one consolidated file, like the single-device runs write
            sharding_strategy="FULL_SHARD",
            limit_all_gathers=True,
            cpu_offload=False,
            timeout=timeout,
        )
    elif strategy == "ddp":
        from lightning.fabric.strategies import DDPStrategy

        # the rope and KV caches are buffers computed identically on every rank: broadcasting them each forward
        # would only cost time
        strategy_obj = DDPStrategy(broadcast_buffers=False, timeout=timeout)
    else:
        strategy_obj = "auto"
    logger = make_logger(out_dir, logger_name)
    if accelerator == "cuda":
        torch.set_float32_matmul_precision("high")
    return L.Fabric(
        accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy_obj, precision=precision,
        loggers=logger,
    )


def check_out_dir(out_dir: Path, resume: Union[bool, str, Path]) -> None:
    """Before anything is loaded: `out_dir` must be a writable folder (created if missing), and a folder that holds
    a run is only continued with --resume, never overwritten."""
    out_dir = location(out_dir)  # a URL needs its fsspec filesystem (gcsfs, s3fs): named here if missing
    try:
        if out_dir.exists() and not out_dir.is_dir():
            raise LitError(f"--out_dir {str(out_dir)!r} is a file, not a folder: choose a folder for the run")
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-test-{time.time_ns()}"
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as e:
        raise LitError(f"--out_dir {str(out_dir)!r} is not writable ({e.strerror or e}): choose another folder") from e
    if resume in (False, None, "false"):
        used = sorted(d.name for d in out_dir.iterdir() if STEP_DIR.match(d.name) or d.name == FINAL_DIR)
        if used:
            shown = ", ".join(used[:3]) + (f" and {len(used) - 3} more" if len(used) > 3 else "")
            raise LitError(
                f"--out_dir {str(out_dir)!r} already holds a run ({shown}): continue it with --resume auto, or start"
                " a new run in a new --out_dir"
            )


def make_logger(out_dir: Path, name: str) -> Any:
    """The CSV, TensorBoard or Weights & Biases logger under out_dir/logs (the GPU/CPU and the XLA recipes log
    alike). W&B takes its project from WANDB_PROJECT (default "lit-gpt-xla") and runs offline with
    WANDB_MODE=offline (sync later with `wandb sync`). For a URL out_dir the logger writes to a local mirror of
    out_dir/logs that `push_logs` uploads (see lit_gpt.storage.LogMirror)."""
    logs, mirror = log_folder(out_dir)
    logger = _logger(logs, name, location(out_dir).name)
    logger._lit_mirror = mirror
    return logger


def _logger(logs: Path, name: str, run_name: str) -> Any:
    if name == "wandb":
        try:
            import wandb  # noqa: F401  (Lightning's logger imports it lazily: fail here, with the fix)
        except ImportError:
            raise LitError("--logger_name wandb needs the wandb package: pip install wandb") from None
        import os

        from lightning.pytorch.loggers import WandbLogger

        check_wandb_credentials()
        logs.mkdir(parents=True, exist_ok=True)
        return WandbLogger(save_dir=str(logs), project=os.environ.get("WANDB_PROJECT", "lit-gpt-xla"), name=run_name)
    if name == "csv":
        from lightning.fabric.loggers import CSVLogger

        return CSVLogger(root_dir=logs, name="csv", flush_logs_every_n_steps=1)
    if name == "tensorboard":
        from lightning.fabric.loggers import TensorBoardLogger

        return TensorBoardLogger(root_dir=logs, name="tensorboard")
    raise LitError(f"--logger_name must be 'csv', 'tensorboard' or 'wandb', got {name!r}")


def check_wandb_credentials() -> None:
    """W&B logging online needs an API key (WANDB_API_KEY, or the ~/.netrc entry `wandb login` writes): without one
    wandb.init fails in the first step's logging with a traceback, so it is said here, before the run starts."""
    import netrc
    import os
    from urllib.parse import urlparse

    if os.environ.get("WANDB_MODE", "online").lower() in ("offline", "disabled", "dryrun"):
        return
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        if netrc.netrc(os.environ.get("NETRC") or None).authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass  # no .netrc (or an unreadable one): no credentials there
    raise LitError("--logger_name wandb logs online but no W&B credentials were found (WANDB_API_KEY, or `wandb"
                   " login`): set WANDB_API_KEY, run `wandb login`, or log offline with WANDB_MODE=offline (then"
                   " `wandb sync`)")


def load_base_weights(
    model: nn.Module, checkpoint_dir: Path, own_filter: Optional[Callable[[str, Any], bool]], assign: bool,
    init_from: Optional[Path] = None,
) -> None:
    """Load the base `lit_model.pth` into `model` (not yet set up by Fabric). Only the method's own parameters
    may be missing from it. With `assign` (CPU), the parameters become the memory-mapped tensors of the file
    instead of copies of them: the frozen weights then exist once in memory. `init_from`: the method's own
    weights to start from (`with_init`)."""
    path = check_checkpoint_dir(checkpoint_dir)
    state = with_init(load_weights(path), init_from)
    try:
        result = model.load_state_dict(state, strict=False, assign=assign)
    except RuntimeError as e:
        raise LitError(f"checkpoint {str(path)!r} does not match the model config ({load_error_detail(e)})") from e
    if result.unexpected_keys:
        raise LitError(f"checkpoint {str(path)!r} has weights the model lacks (e.g. {result.unexpected_keys[0]!r})")
    own = own_filter or (lambda k, v: False)
    missing = [k for k in result.missing_keys if not own(k, None)]
    if missing:
        raise LitError(
            f"checkpoint {str(path)!r} lacks {len(missing)} weight(s) of the model ({', '.join(missing[:4])}): it"
            " does not match the model config, or it is not a complete base checkpoint"
        )
    _initialize_unloaded(model, set(result.missing_keys))


def with_init(state: Dict[str, Any], init_from: Optional[Path]) -> Dict[str, Any]:
    """The base `state` (a whole checkpoint's, unwrapped) plus the method's own weights in `init_from` (a finetuned
    weights file, already checked by `lora_init_from`). Those are copies: they become trained parameters (with
    `assign`, the very tensors given), which must own their memory rather than share a file's mapping."""
    state = state.get("model", state) if isinstance(state.get("model"), dict) else state
    if init_from is None:
        return state
    return {**state, **{k: v.clone() for k, v in load_weights(init_from).items()}}


def lora_init_from(flags: Dict[str, Any], run: FinetuneRun) -> FinetuneRun:
    """The LoRA recipes' `finish`: --lora_init_from, checked against the run's base and LoRA settings before
    anything loads (`lit_gpt.peft.check_init_from`, one line each), becomes `run.init_from`."""
    if flags["lora_init_from"] is None:
        return run
    from lit_gpt.peft import check_init_from

    path = check_init_from(flags["lora_init_from"], run.config, run.checkpoint_dir, run.allow_other_base, "lora",
                           "--lora_init_from")
    return replace(run, init_from=path)


def _initialize_unloaded(model: nn.Module, missing: set) -> None:
    """Initialise the modules whose own parameters all stayed out of the checkpoint (e.g. the adapter's prompt
    embedding): the model was built without running `nn.init` (Lightning's empty init), which leaves them
    uninitialised. The variants create parameters that share a module with base weights with plain tensor ops
    (`uniform_`, `zeros`), which empty init does not skip."""
    for prefix, module in model.named_modules():
        names = [f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters(recurse=False)]
        if names and all(n in missing for n in names) and hasattr(module, "reset_parameters"):
            module.reset_parameters()


def setup_model(
    fabric: L.Fabric,
    build: Callable[[], nn.Module],
    checkpoint_dir: Path,
    own_filter: Optional[Callable[[str, Any], bool]] = None,
    mark_trainable: Optional[Callable[[nn.Module], None]] = None,
    quantize: Optional[Callable[[nn.Module], Any]] = None,
    init_from: Optional[Path] = None,
) -> Tuple[nn.Module, nn.Module]:
    """Build the model, load the base weights, freeze what the method does not train (`mark_trainable`), and set
    it up with Fabric. `own_filter` names the method's own parameters, the only ones the base checkpoint lacks;
    `init_from` holds values to start them from (--lora_init_from), else they start from their initialisation.
    `quantize` (QLoRA, mxfp4) quantizes the frozen base weights in place, moving them to the device as it goes.
    Returns (the Fabric-wrapped model, the plain module)."""
    dtype = param_dtype(str(fabric.strategy.precision.precision))
    if uses_fsdp(fabric):
        from lit_gpt.model import Block

        # FSDP materialises (and shards) the meta-initialised blocks itself; the weights are loaded after sharding
        with fabric.init_module(empty_init=True):
            model = build()
        if getattr(getattr(model, "config", None), "tie_embeddings", False):
            materialize_outside(model, Block, fabric.device)  # keeps a tied head tied (see its docstring)
        if mark_trainable is not None:
            mark_trainable(model)
        wrapped = fabric.setup_module(model)
        state = with_init(load_weights(check_checkpoint_dir(checkpoint_dir)), init_from)
        _load_into_sharded(wrapped, state, strict=own_filter is None)
        return wrapped, model
    # no random init of weights that the checkpoint overwrites: faster, and on the CPU (where the weights are
    # assigned from the memory-mapped file) the never-touched empty tensors never take memory
    if quantize is None:
        with fabric.init_module(empty_init=True):
            model = build()
    else:
        # QLoRA, mxfp4: built and loaded on the host (memory-mapped); `quantize` moves the weights to the GPU one
        # layer at a time, quantizing each as it goes, so the base model never exists there in full precision
        from lightning.fabric.utilities.init import _EmptyInit

        with _EmptyInit(enabled=True):
            model = build()
    load_base_weights(model, checkpoint_dir, own_filter, assign=fabric.device.type == "cpu" or quantize is not None,
                      init_from=init_from)
    cast_floating(model, dtype)
    if mark_trainable is not None:
        mark_trainable(model)
    if quantize is not None:
        quantize(model)
    n_train, n_frozen = num_parameters(model, requires_grad=True), num_parameters(model, requires_grad=False)
    fabric.print(f"Parameters: {n_train:,} trainable, {n_frozen:,} frozen")
    if n_train == 0:
        raise LitError("the model has no trainable parameters: check the method's settings")
    return fabric.setup_module(model), model


def materialize_outside(model: nn.Module, block_cls: Type[nn.Module], device: torch.device) -> None:
    """Materialise (on `device`, with `reset_parameters()`) the meta-device tensors of every module outside the
    `block_cls` blocks, keeping tied parameters tied.

    Why: FSDP materialises a meta-initialised model module by module (`to_empty(recurse=False)`), which gives the
    head and the embedding separate tensors: a tied-embedding model (SmolLM2, Gemma, small Qwen) would then train
    and save an untied head. Materialised and re-tied before wrapping, the tie is one shared parameter that FSDP
    keeps. Only the embeddings, final norm and head are allocated in full on each rank; the blocks stay on the
    meta device until FSDP shards them."""
    inside = {id(m) for b in model.modules() if isinstance(b, block_cls) for m in b.modules()}
    for module in model.modules():
        if id(module) in inside:
            continue
        own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        if any(t.is_meta for t in own):
            module.to_empty(device=device, recurse=False)
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def build_optimizer(model: nn.Module, train: TrainArgs, name: str = "adamw") -> torch.optim.Optimizer:
    """AdamW (default) or SGD with momentum 0.9 over the trainable parameters. Norms, biases and other 1-D
    parameters get no weight decay."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=train.learning_rate, momentum=0.9)
    if name != "adamw":
        raise LitError(f"--optimizer must be 'adamw' or 'sgd', got {name!r}")
    device = (decay or no_decay)[0].device
    # fused kernels on GPU/CPU; XLA and others take the default implementation
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(
        groups, lr=train.learning_rate, betas=(train.beta1, train.beta2), fused=fused or None
    )


def run_config(**kwargs: Any) -> Dict[str, Any]:
    """The recipe's arguments as JSON-friendly data (written to finetune.json next to the weights)."""
    out = {}
    for k, v in kwargs.items():
        out[k] = asdict(v) if hasattr(v, "__dataclass_fields__") else v
    return out



def _load_into_sharded(module: nn.Module, state: Dict[str, torch.Tensor], strict: bool) -> None:
    """A full (unsharded) state dict into an FSDP-wrapped model, every rank taking its shards (torch's public
    `set_model_state_dict`; the state is memory-mapped or shared, not copied per rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # the FSDP root inside Fabric's wrapper (its `.module` is the unwrapped model, which is not the FSDP root)
    inner = getattr(module, "_forward_module", module)
    set_model_state_dict(inner, state, options=StateDictOptions(full_state_dict=True, strict=strict))



def load_run_data(runtime: Runtime, run: FinetuneRun) -> RunData:
    """The prepared data of the run, checked against the model and the batch settings (before any weights load)."""
    return training.load_data(runtime, run.data, run.train, run.eval, run.checkpoint_dir, run.config.block_size,
                              run.objective)


def fit(fabric: L.Fabric, runtime: Runtime, model: nn.Module, raw_model: nn.Module, optimizer: Any, data: RunData,
        method: Method, run: FinetuneRun) -> Dict[str, Any]:
    """The one training loop (`lit_gpt.training.fit`) with the run's arguments, and the identity of the prepared data
    it trains on (`lit_gpt.data.prepared_record`: every checkpoint records it, a resumed run must have the same)."""
    prepared = prepared_record(data.prepared.meta, run.data.data_dir, run.data.packing)
    run_config = {**run.run_config, "prepared": prepared}
    return training.fit(
        fabric, model, raw_model, optimizer, data, method, checkpoint_dir=run.checkpoint_dir, out_dir=run.out_dir,
        train=run.train, eval=run.eval, resume=run.resume, run_config=run_config, runtime=runtime,
        allow_other_base=run.allow_other_base, allow_other_data=run.allow_other_data,
    )


def finetune_command(
    method: str,
    main: Callable[[L.Fabric, FinetuneRun], Dict[str, Any]],
    config_cls: Optional[Type[Config]],
    summary: str,
    own: Sequence[Flag] = (),
    tail: Sequence[Flag] = (),
    check: Optional[Callable[[Dict[str, Any]], None]] = None,
    finish: Optional[Callable[[Dict[str, Any], FinetuneRun], FinetuneRun]] = None,
    **defaults: Any,
) -> Callable[..., Dict[str, Any]]:
    """The `setup` of a CPU/CUDA finetune recipe: the shared flags (`lit_gpt.recipes.flags.FINETUNE`) plus the
    method's `own` ones, with the recipe's `defaults`. It checks the settings (and `check(flags)`), reads the config
    with the method's settings, builds Fabric and launches `main(fabric, run)` on every process. `finish(flags,
    run)` completes the run from the recipe's own flags (DPO: the method and the objective)."""

    def setup(**flags: Any) -> Dict[str, Any]:
        flags["train"].validate(flags["devices"] * flags["num_nodes"])
        check_launcher(flags["num_nodes"], flags["devices"], flags["accelerator"])  # before anything is loaded
        if check is not None:
            check(flags)
        # --rope_scaling: the checkpoint's context extended, refused in one line where it cannot reach the rows' length
        config = flags["moe"].apply(load_config(flags["checkpoint_dir"], config_cls, rope_scaling=flags["rope_scaling"],
                                                max_seq_length=flags["train"].max_seq_length, **values(flags, own)))
        fabric = setup_fabric(
            flags["devices"], flags["precision"], flags["out_dir"], flags["logger_name"], flags["strategy"],
            block_cls=Block, accelerator=flags["accelerator"], num_nodes=flags["num_nodes"], resume=flags["resume"],
            peer_timeout=flags["peer_timeout"],
        )
        run = FinetuneRun(method, flags["checkpoint_dir"], flags["out_dir"], config, flags["data"], flags["train"],
                          flags["eval"], flags["resume"], flags["optimizer"], quantize=flags.get("quantize"),
                          base=base_record(flags["checkpoint_dir"]), allow_other_base=flags["allow_other_base"],
                          allow_other_data=flags["allow_other_data"], rope_scaling=flags["rope_scaling"])
        run = finish(flags, run) if finish is not None else run
        return launch(fabric, main, run, peer_timeout=flags["peer_timeout"])  # a wait for peers that ends

    return command(summary, finetune_flags(FINETUNE, own, tail, **defaults), setup)
