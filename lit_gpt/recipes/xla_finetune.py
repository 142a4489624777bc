"""Set-up of the XLA finetuning recipes (xla/finetune/{adapter,lora,full}.py). The loop is `lit_gpt.training.fit`,
the same as on the CPU and on GPUs; `lit_gpt.xla.runtime.XLARuntime` carries what XLA does differently (batches
split over the SPMD mesh, a graph cut per micro-batch, the whole padded batch in the loss, sharded checkpoints
consolidated at the end, compilations counted). What is here: the Fabric over every PJRT device, the staged
loading of the base weights (block by block onto the devices, host RAM low), and `fit`, the loop with XLA's
runtime and its closing metrics report.
"""

from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Type, Union

import torch.nn as nn

from lit_gpt.fingerprint import base_record
from lit_gpt import training
from lit_gpt.args import TrainArgs
from lit_gpt.config import Config
from lit_gpt.recipes.finetune import FinetuneRun, check_out_dir, load_config, make_logger
from lit_gpt.recipes.flags import XLA_FINETUNE, Flag, command, finetune_flags, values
from lit_gpt.utils import LitError


def setup_fabric(
    devices: Union[int, str],
    precision: Optional[str],
    train: TrainArgs,
    out_dir: Path,
    logger_name: str = "csv",
    activation_checkpointing: bool = False,
    compile_cache_dir: Optional[Path] = None,
    resume: Union[bool, str, Path] = False,
    accelerator: str = "auto",
    scan_layers: Union[bool, str] = False,
) -> Any:
    """Fabric for an XLA finetuning run (FSDP over SPMD on every device; bf16-true on TPUs, else 32-true, unless
    given), logging like the GPU/CPU recipes; `out_dir` and `train` are checked before the runtime starts work."""
    from lit_gpt.xla.accelerator import select_pjrt_device

    select_pjrt_device(accelerator)
    check_out_dir(out_dir, resume)
    check_scan_layers(scan_layers)
    if getattr(train, "compile", False):
        raise LitError("--train.compile (torch.compile) is for the GPU/CPU recipes: XLA compiles every step already")
    from lit_gpt.xla.accelerator import default_precision, pjrt_device_count
    from lit_gpt.xla.strategy import make_fabric

    fabric = make_fabric(
        devices, default_precision(precision), activation_checkpointing=activation_checkpointing,
        compile_cache_dir=compile_cache_dir, loggers=make_logger(out_dir, logger_name),
        scan_layers=scan_layers,
    )
    n = pjrt_device_count()
    if train.global_batch_size < train.micro_batch_size * n:
        # a slice with more chips than the default global batch: one micro-batch per chip is the smallest step
        fabric.print(
            f"note: --train.global_batch_size {train.global_batch_size} < micro_batch_size x devices"
            f" ({train.micro_batch_size} x {n}): using {train.micro_batch_size * n} (the learning rate is not rescaled)"
        )
        train.global_batch_size = train.micro_batch_size * n
    train.validate(n)
    return fabric


def check_scan_layers(scan_layers: Union[bool, str]) -> None:
    """--scan_layers true where torch_xla's scan cannot train is refused before anything loads ("auto" then runs
    the loop)."""
    from lit_gpt.xla.scan import scan_unavailable

    if scan_layers not in (True, False, "auto"):
        raise LitError(f"--scan_layers must be true, false or auto, got {scan_layers!r}")
    reason = scan_unavailable() if scan_layers is True else None
    if reason:
        raise LitError(f"--scan_layers: {reason} (or run without --scan_layers)")


def packing_scan_layers(scan_layers: Union[bool, str], packing: bool) -> Union[bool, str]:
    """Packed rows need each block's document mask, which the scanned blocks do not carry: with --data.packing,
    "auto" runs the loop and --scan_layers true is refused in one line."""
    if not packing:
        return scan_layers
    if scan_layers is True:
        raise LitError("--data.packing runs the blocks as a loop (the scanned layer takes no document masks):"
                       " use --scan_layers auto or false with packing")
    return False


def check_moe(config: Config, scan_layers: Union[bool, str], activation_checkpointing: bool) -> None:
    """Settings that cannot train a mixture-of-experts model on XLA, refused before anything loads (`config` with
    the --moe settings applied). None today: --scan_layers and --activation_checkpointing return the MoE layers'
    routing (the load-balancing loss's input) through the scan and through the checkpoint (lit_gpt.xla.scan), and
    give the unscanned, unwrapped run's losses (tests/xla/test_scan.py)."""
    return None


def load_model(fabric: Any, build: Callable[[], nn.Module], checkpoint_dir: Path,
               own_filter: Optional[Callable[[str, Any], bool]] = None, init_from: Optional[Path] = None,
               quantize: Optional[str] = None) -> nn.Module:
    """`build()` (a GPT or a PEFT variant) with the base checkpoint loaded block by block onto the devices
    (`lit_gpt.xla.load_staged`). Only the variant's own parameters (`own_filter`) may be missing from the
    checkpoint; they are initialised by their modules, like on the CPU/GPU, or taken from `init_from`
    (--lora_init_from, checked by `lit_gpt.recipes.finetune.lora_init_from`), a file staged after the base.
    `quantize="mxfp4"`: gpt-oss's experts placed packed, frozen (xla/finetune/lora.py --quantize mxfp4)."""
    from lit_gpt.weights import check_checkpoint_dir
    from lit_gpt.xla.loader import load_staged

    allow = (lambda name: bool(own_filter(name, None))) if own_filter is not None else None
    files = [check_checkpoint_dir(checkpoint_dir)] + ([init_from] if init_from is not None else [])
    return load_staged(build, files, fabric, allow_missing=allow, quantize=quantize)



def fit(fabric: Any, runtime: Any, model: nn.Module, raw_model: nn.Module, optimizer: Any, data: Any,
        method: "training.Method", run: FinetuneRun) -> dict:
    """`lit_gpt.recipes.finetune.fit` (the one loop) with `XLARuntime`, then torch_xla's metrics report when
    `run.options["xla_metrics"]`."""
    from lit_gpt.recipes.finetune import fit as fit_run

    summary = fit_run(fabric, runtime, model, raw_model, optimizer, data, method, run)
    if run.options.get("xla_metrics"):
        from lit_gpt.xla.diagnostics import metrics_report

        fabric.print(metrics_report())
    return summary


def xla_finetune_command(
    method: str,
    main: Callable[[Any, FinetuneRun], Dict[str, Any]],
    config_cls: Optional[Type[Config]],
    summary: str,
    own: Sequence[Flag] = (),
    tail: Sequence[Flag] = (),
    check: Optional[Callable[[Dict[str, Any]], None]] = None,
    finish: Optional[Callable[[Dict[str, Any], FinetuneRun], FinetuneRun]] = None,
    **defaults: Any,
) -> Callable[..., Dict[str, Any]]:
    """The `setup` of an XLA finetune recipe: the shared flags (`lit_gpt.recipes.flags.XLA_FINETUNE`) plus the
    method's `own` ones, with the recipe's `defaults`. It reads the config with the method's settings, builds the
    Fabric over every PJRT device (checking the settings first) and launches `main(fabric, run)`."""

    def setup(**flags: Any) -> Dict[str, Any]:
        if check is not None:
            check(flags)
        flags["scan_layers"] = packing_scan_layers(flags["scan_layers"], flags["data"].packing)
        # --rope_scaling: the checkpoint's context extended, refused in one line where it cannot reach the rows' length
        config = flags["moe"].apply(load_config(flags["checkpoint_dir"], config_cls, rope_scaling=flags["rope_scaling"],
                                                max_seq_length=flags["train"].max_seq_length, **values(flags, own)))
        check_moe(config, flags["scan_layers"], flags["activation_checkpointing"])
        fabric = setup_fabric(
            flags["devices"], flags["precision"], flags["train"], flags["out_dir"], flags["logger_name"],
            flags["activation_checkpointing"], flags["compile_cache_dir"], resume=flags["resume"],
            accelerator=flags["accelerator"], scan_layers=flags["scan_layers"],
        )
        run = FinetuneRun(method, flags["checkpoint_dir"], flags["out_dir"], config, flags["data"], flags["train"],
                          flags["eval"], flags["resume"], flags["optimizer"], quantize=flags.get("quantize"),
                          platform="xla",
                          options={"xla_metrics": flags["xla_metrics"]},
                          base=base_record(flags["checkpoint_dir"]), allow_other_base=flags["allow_other_base"],
                          allow_other_data=flags["allow_other_data"], rope_scaling=flags["rope_scaling"])
        run = finish(flags, run) if finish is not None else run
        return fabric.launch(main, run)

    return command(summary, finetune_flags(XLA_FINETUNE, own, tail, **defaults), setup)
