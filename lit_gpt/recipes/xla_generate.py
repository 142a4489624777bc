"""The XLA generate recipes' own steps (xla/generate/*.py): their precision and the loading of a model block by block
onto the devices, sharded over the SPMD mesh. Everything else they share with the CPU/GPU recipes
(`lit_gpt.recipes.generate`), with `XLARuntime(fabric)` as the loop's runtime: prompts padded on the host to
power-of-two buckets, caches built on the host and transferred replicated, a graph cut per step, host reads as
transfers, hence two compilations per prompt-length bucket (prefill + decode), whatever max_new_tokens is.

    runtime = XLARuntime(fabric)
    model = fabric.setup_module(load_base_staged(fabric, checkpoint_dir))
    result = timed_generate(model, tokenizer.encode(prompt), 50, runtime, stop_ids=tokenizer.stop_ids)
    result.tokens, result.time_to_first_token, result.decode_tokens_per_sec, result.compiles

torch_xla is imported when a function here runs, not with the module (so `--help` and the checks stay fast).
"""

from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Type

from lit_gpt.config import Config, load_config
from lit_gpt.loading import check_model_dir
from lit_gpt.model import GPT


def default_precision(precision: Optional[str]) -> str:
    """The generation recipes' precision: bf16-true on TPUs, else 32-true (no mixed precision: no training)."""
    from lit_gpt.xla.accelerator import default_precision as choose

    return choose(precision, ("32-true", "bf16-true"), "for generation on XLA")


def load_base_staged(fabric: Any, checkpoint_dir: Path, quantize: Optional[str] = None) -> GPT:
    """The model of a checkpoint folder (`lit_gpt.loading.check_model_dir` finds its weights file) loaded block by
    block onto the devices; `quantize="mxfp4"`: gpt-oss's experts placed packed (`lit_gpt.xla.loader.load_staged`)."""
    from lit_gpt.xla.loader import load_staged

    return load_staged(load_config(checkpoint_dir), check_model_dir(checkpoint_dir), fabric, quantize=quantize)


def check_xla_quantize(quantize: Optional[str]) -> None:
    """--quantize on XLA: "mxfp4" (gpt-oss's experts placed packed by the staged loader) or nothing; the other modes
    are CPU / CUDA kernels (one LitError line, before the runtime starts)."""
    from lit_gpt.utils import LitError

    if quantize not in (None, "mxfp4"):
        raise LitError(f"--quantize {quantize} runs on the CPU and CUDA, not on XLA (there only mxfp4, gpt-oss's"
                       " experts kept packed): run without it")


def load_variant_staged(
    fabric: Any, model_cls: Type[GPT], config_cls: Type[Config], checkpoint_dir: Path, finetuned_path: Path,
    allow_other_base: bool = False, quantize: Optional[str] = None,
) -> GPT:
    """An Adapter / LoRA model (`lit_gpt.adapter.GPT`, `lit_gpt.lora.GPT`, ...) with the base weights and the
    finetuned-weights file (`lit_gpt.peft` format) loaded block by block onto the devices. The variant's settings
    (e.g. lora_r) come from the file; nothing may be missing from the two files together. A file that records another
    base than `checkpoint_dir` is refused in one line before anything is loaded, unless `allow_other_base`
    (`lit_gpt.peft.check_finetuned_base`). LoRA updates are merged into the weights, as on the CPU/GPU: generation
    runs at the base model's cost."""
    from lit_gpt.lora import GPT as LoRAGPT
    from lit_gpt.lora import merge_lora_weights
    from lit_gpt.peft import check_finetuned_base, load_finetuned
    from lit_gpt.xla.loader import load_staged

    base_path = check_model_dir(checkpoint_dir)
    _, fields = load_finetuned(finetuned_path, model_cls.peft_method)  # also checks the file's method
    check_finetuned_base(finetuned_path, checkpoint_dir, allow_other_base, model_cls.peft_method)
    config = config_cls.from_checkpoint(checkpoint_dir, **fields)
    # the later file overrides: the finetuned weights on top of the base checkpoint
    model = load_staged(lambda: model_cls(config), [base_path, finetuned_path], fabric, quantize=quantize)
    if isinstance(model, LoRAGPT):
        merge_lora_weights(model)
    return model


def xla_generate_command(summary: str, main: Callable[[Any, Any], None], own: Sequence[Any] = (),
                         writer: str = "") -> Callable[..., None]:
    """The `setup` of an XLA generate recipe: the shared flags (`lit_gpt.recipes.generate.XLA_GENERATE`) plus the
    method's weights flag; the request (and the weights file, written by `writer`) checked before the XLA runtime
    starts, then a Fabric over every PJRT device that launches `main(fabric, args)`."""
    from lit_gpt.recipes.flags import command
    from lit_gpt.recipes.generate import XLA_GENERATE, check_file, check_request, generation_args, with_weights_flag

    def setup(**flags: Any) -> None:
        from lit_gpt.xla import make_fabric
        from lit_gpt.xla.accelerator import select_pjrt_device

        args = generation_args(flags, own[0].name if own else None)
        check_request(args)  # before the XLA runtime starts: bad input fails fast
        check_xla_quantize(args.quantize)
        if own:
            check_file(args.finetuned_path, f"--{own[0].name}", writer)
        select_pjrt_device(flags["accelerator"])
        fabric = make_fabric(flags["devices"], default_precision(flags["precision"]),
                             compile_cache_dir=flags["compile_cache_dir"])
        fabric.launch(main, args)

    return command(summary, with_weights_flag(XLA_GENERATE, own), setup)
