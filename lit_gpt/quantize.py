"""Weight-only quantization of a loaded model's linear layers, in place, through maintained libraries.

    "torchao.int8wo"  int8 weights, one scale per output channel (torchao `Int8WeightOnlyConfig`); CPU and CUDA.
                      torchao's kernel dequantizes in eager mode and is fused by inductor: use it with --compile
                      for speed (eager it saves memory only).
    "torchao.int4wo"  int4 weights, groups of 64 input channels (torchao `Int4WeightOnlyConfig`): the CPU's
                      int4 kernel and CUDA's tinygemm kernel, both in bfloat16.
    "bnb.int8"        bitsandbytes LLM.int8() (`Linear8bitLt`); CUDA only, `pip install bitsandbytes`.
    "bnb.nf4"         bitsandbytes 4-bit NormalFloat (`Linear4bit`, double-quantized statistics); CUDA only.
                      QLoRA's mode (`finetune/lora.py --quantize bnb.nf4`).
    "mxfp4"           gpt-oss: the experts of a mixture-of-experts model converted from the Hub's MXFP4 checkpoint
                      packed back into MXFP4 (`lit_gpt.mxfp4.pack_experts_mxfp4`: lossless, 4.25 bits per weight,
                      decoded per matmul), every device; the other weights stay as they are. Refused in one line for
                      a model whose experts are not MXFP4 values (or that has none). Also under LoRA
                      (`finetune/lora.py --quantize mxfp4`: the experts frozen in MXFP4, LoRA on the other layers)
                      and in evaluation and serving (`lit_gpt.recipes.evaluate` EVAL_FLAGS).

Which layers: every `nn.Linear` inside the transformer blocks (attention qkv/proj, MLP), i.e. nearly all the
weights that a decode step reads. The output head stays in the compute dtype: with tied embeddings (SmolLM2,
Gemma, small Qwen) it *is* the embedding matrix, which the input lookup needs unquantized, so quantizing the head
would add a second copy instead of saving memory; untied, it is the one layer whose rounding moves every logit
directly. Embeddings and norms stay as they are.

`check_quantize` runs before any weights are read and says in one line what cannot work here (a CPU asking for
bitsandbytes, a missing package, a dtype the kernel lacks); `quantize_model` does the work.
"""

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from lit_gpt.utils import LitError

CHOICES: Tuple[str, ...] = ("torchao.int8wo", "torchao.int4wo", "bnb.int8", "bnb.nf4", "mxfp4")
INT4_GROUP_SIZE = 64  # divides the widths of every model in lit_gpt.config (576, 960, 1536, 2048, ...)


def check_quantize(mode: Optional[str], device: torch.device, dtype: torch.dtype,
                   choices: Tuple[str, ...] = CHOICES, flag: str = "--quantize") -> None:
    """Raise a one-line LitError when `mode` cannot run on `device` in `dtype` (nothing for None)."""
    if mode is None:
        return
    device = torch.device(device)
    if mode not in choices:
        # suggest only what can run on this device: bitsandbytes needs CUDA
        usable = [c for c in choices if device.type == "cuda" or not c.startswith("bnb.")]
        if not usable:
            raise LitError(f"{flag} {mode!r} is not a choice here, and {' or '.join(choices)} needs a CUDA GPU: on"
                           f" the {device.type.upper()} run without {flag}")
        gpu_only = [c for c in choices if c not in usable]
        needs_gpu = f" ({' or '.join(gpu_only)} needs a CUDA GPU)" if gpu_only else ""
        if mode in CHOICES:  # a generation mode asked of finetuning (or the reverse)
            raise LitError(f"{flag} {mode} is not available here: use {_listed(usable, flag)}{needs_gpu}")
        raise LitError(f"{flag} must be one of {', '.join(_label(c) for c in usable)} (got {mode!r})")
    if mode == "mxfp4":  # lit_gpt's own decoder: every device and dtype (whether the model fits: quantize_model)
        return
    if mode.startswith("bnb."):
        if device.type != "cuda":
            other = [c for c in choices if not c.startswith("bnb.")]
            hint = f"use {flag} {_listed(other, flag)}" if other else f"run without {flag}"
            raise LitError(f"{flag} {mode} needs a CUDA GPU (bitsandbytes): on the {device.type.upper()} {hint}")
        _import_bitsandbytes(flag, mode)
        return
    _import_torchao(flag, mode)
    if mode == "torchao.int4wo":
        if device.type == "cuda":
            if dtype != torch.bfloat16:
                raise LitError(f"{flag} torchao.int4wo on CUDA runs in bfloat16 only: add --precision bf16-true")
            if torch.cuda.get_device_capability(device) < (8, 0):
                raise LitError(f"{flag} torchao.int4wo needs a GPU of compute capability >= 8.0: use torchao.int8wo")
        elif device.type == "cpu":
            if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
                raise LitError(
                    f"{flag} torchao.int4wo: this torch build has no CPU int4 kernel: use torchao.int8wo"
                )
            if dtype != torch.bfloat16:
                # the kernel runs other dtypes on a slow path: a 1,600-token prefill of SmolLM2-135M took 174 s in
                # float32 against 14 s in bfloat16 (torch 2.9, 2 cores)
                raise LitError(f"{flag} torchao.int4wo on the CPU is fast in bfloat16 only: add --precision bf16-true")
        else:
            raise LitError(f"{flag} torchao.int4wo runs on the CPU or CUDA, not on {device.type}")


# modes that apply to some models only: a line that suggests one also says that running without --quantize works
MODEL_SPECIFIC = {"mxfp4": "mxfp4 (gpt-oss's experts)"}


def _label(mode: str) -> str:
    return MODEL_SPECIFIC.get(mode, mode)


def _listed(modes: List[str], flag: str) -> str:
    """"a or b" for a one-line suggestion; "mxfp4 (gpt-oss's experts) or run without --quantize" where every one
    suggested fits some models only."""
    listed = " or ".join(_label(m) for m in modes)
    return listed + (f" or run without {flag}" if all(m in MODEL_SPECIFIC for m in modes) else "")


def _import_torchao(flag: str, mode: str) -> Any:
    try:
        import torchao.quantization
    except ImportError:
        raise LitError(f"{flag} {mode} needs torchao: pip install -r requirements.txt") from None
    return torchao.quantization


def _import_bitsandbytes(flag: str = "--quantize", mode: str = "bnb") -> Any:
    try:
        import bitsandbytes
    except ImportError:
        raise LitError(f"{flag} {mode} needs bitsandbytes: pip install bitsandbytes") from None
    return bitsandbytes


def in_blocks(module: nn.Module, name: str) -> bool:
    """The layers that are quantized: the linear layers of the transformer blocks (not the head)."""
    return isinstance(module, nn.Linear) and name.startswith("transformer.h.")


def quantize_model(model: nn.Module, mode: str, device: Optional[torch.device] = None) -> int:
    """Quantize the block linear layers of a loaded `GPT` in place (after `check_quantize`), on `device` (default:
    where the weights are; the model is moved there). Returns how many layers were quantized."""
    device = torch.device(device) if device is not None else model.transformer.wte.weight.device
    if mode.startswith("torchao."):
        # torchao packs for the device it quantizes on (the CPU and CUDA int4 layouts differ): move first
        model.to(device)
        q = _import_torchao("--quantize", mode)
        if mode == "torchao.int8wo":
            config = q.Int8WeightOnlyConfig()
        else:
            packing = "tile_packed_to_4d" if device.type == "cuda" else "opaque"
            config = q.Int4WeightOnlyConfig(group_size=INT4_GROUP_SIZE, int4_packing_format=packing)
        # torchao's recommended inductor settings for quantized models on CUDA; on the CPU they would also lower
        # the float32 matmul precision process-wide
        config.set_inductor_config = device.type == "cuda"
        q.quantize_(model, config, filter_fn=in_blocks)
        return sum(is_quantized(m.weight) for n, m in model.named_modules() if in_blocks(m, n))
    if mode.startswith("bnb."):
        return _bnb_replace(model, mode, device)
    if mode == "mxfp4":
        return _pack_mxfp4(model, device)
    raise LitError(f"--quantize must be one of {', '.join(CHOICES)} (got {mode!r})")


def _pack_mxfp4(model: nn.Module, device: torch.device) -> int:
    """--quantize mxfp4: the experts packed (lit_gpt.mxfp4); returns how many expert projections were packed."""
    from lit_gpt.moe import ExpertLinear
    from lit_gpt.mxfp4 import MXFP4ExpertLinear, pack_experts_mxfp4

    if not any(isinstance(m, (ExpertLinear, MXFP4ExpertLinear)) for m in model.modules()):
        raise LitError("--quantize mxfp4 packs the experts of a mixture-of-experts model (gpt-oss); this model has"
                       " none: run without --quantize mxfp4")
    try:
        # packed straight onto the device, one projection at a time: the float experts never all reach it
        pack_experts_mxfp4(model, device)
    except ValueError:
        raise LitError("--quantize mxfp4: the experts of this checkpoint are not MXFP4 values (only a gpt-oss"
                       " checkpoint converted from the Hub's MXFP4 weights packs without loss): run without it")
    model.to(device)
    return sum(isinstance(m, MXFP4ExpertLinear) for m in model.modules())


def _bnb_replace(model: nn.Module, mode: str, device: torch.device) -> int:
    """Give each block linear layer bitsandbytes weights; they are quantized as they move to the GPU, one at a time
    (the float copy of a layer is freed before the next one is made). A plain `nn.Linear` becomes bitsandbytes'
    own layer; a LoRA layer keeps its class and its LoRA matrices and gets a `Params4bit` base weight, which
    `linear` below multiplies with `bnb.matmul_4bit` (QLoRA)."""
    bnb = _import_bitsandbytes("--quantize", mode)
    count = 0
    for name, module in list(model.named_modules()):
        if not in_blocks(module, name):
            continue
        weight = module.weight.detach()
        if type(module) is nn.Linear:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            bias = module.bias is not None
            if mode == "bnb.nf4":
                new = bnb.nn.Linear4bit(module.in_features, module.out_features, bias=bias, compute_dtype=weight.dtype,
                                        quant_type="nf4", compress_statistics=True, device="meta")
                new.weight = bnb.nn.Params4bit(weight.cpu(), requires_grad=False, quant_type="nf4",
                                               compress_statistics=True)
            else:
                new = bnb.nn.Linear8bitLt(module.in_features, module.out_features, bias=bias,
                                          has_fp16_weights=False, threshold=6.0, device="meta")
                new.weight = bnb.nn.Int8Params(weight.cpu(), requires_grad=False, has_fp16_weights=False)
            if bias:
                new.bias = nn.Parameter(module.bias.detach().to(device), requires_grad=module.bias.requires_grad)
            setattr(parent, child, new.to(device))  # the move to the GPU quantizes
        else:  # a LoRA layer (an nn.Linear subclass): only its frozen base weight is quantized
            if mode != "bnb.nf4":
                raise LitError("QLoRA supports --quantize bnb.nf4 only")
            module.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4",
                                              compress_statistics=True).to(device)
            module.quant_compute_dtype = weight.dtype
        del weight
        count += 1
    model.to(device)
    return count


def is_quantized(weight: Any) -> bool:
    """True for a torchao or bitsandbytes quantized weight (anything but a plain float tensor/parameter)."""
    data = weight.data if isinstance(weight, nn.Parameter) else weight
    if type(data) is not torch.Tensor:
        return True
    return not data.is_floating_point()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """`F.linear` that also takes a bitsandbytes 4-bit weight (the frozen base of a QLoRA layer). torchao weights
    need nothing: they dispatch `F.linear` themselves."""
    quant_state = getattr(weight, "quant_state", None)
    if quant_state is None:
        return F.linear(x, weight, bias)
    import bitsandbytes as bnb

    # as bitsandbytes' Linear4bit.forward: the input in the weights' compute dtype, the product dequantizes blockwise
    out = bnb.matmul_4bit(x.to(quant_state.dtype), weight.t(), bias=None, quant_state=quant_state)
    out = out.to(x.dtype)
    return out if bias is None else out + bias


def describe(model: nn.Module) -> Dict[str, int]:
    """{type name of the weight: count} over the block linear layers (for the recipes' log line)."""
    counts: Dict[str, int] = {}
    for name, module in model.named_modules():
        if in_blocks(module, name):
            key = type(module.weight).__name__ if is_quantized(module.weight) else str(module.weight.dtype)
            counts[key] = counts.get(key, 0) + 1
    return counts


def loader(load: Callable[[], nn.Module], mode: Optional[str], device: torch.device, dtype: torch.dtype
           ) -> Callable[[], nn.Module]:
    """`load` followed by a cast to the compute `dtype` and `quantize_model` on `device` (nothing more for None):
    what the generation recipes load their model with (`lit_gpt.recipes.generate`)."""
    def load_quantized() -> nn.Module:
        model = load()
        if mode is None:
            return model
        model.to(dtype=dtype)
        n = quantize_model(model, mode, device)
        total = sum(1 for name, m in model.named_modules() if in_blocks(m, name))
        import sys

        if mode == "mxfp4":
            print(f"Packed {n} expert projections as MXFP4 (the other weights stay {dtype})", file=sys.stderr)
        else:
            print(f"Quantized {n} of {total} block linear layers with {mode} (the head and embeddings stay {dtype})",
                  file=sys.stderr)
        return model

    return load_quantized
