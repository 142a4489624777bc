"""The evaluation recipes' shared part (eval/perplexity.py, eval/lm_eval.py): their model flags (`EVAL_FLAGS`) and
the model they evaluate, loaded once the same way for every kind of checkpoint (`load_eval_model`):

    flags = values(flags, EVAL_FLAGS)                       # checkpoint_dir, lora_path, adapter_path, ...
    loaded = load_eval_model(**flags)                       # one LitError line for bad input, before weights are read
    loaded.model(idx)                                       # logits; the GPT set up by Fabric, eval mode, LoRA merged
    loaded.tokenizer, loaded.device, loaded.runtime, loaded.dtype, loaded.name, loaded.default_out_dir()

What can be evaluated: a base checkpoint folder (`--checkpoint_dir`); a full finetune (its `out_dir/final` folder
is itself a checkpoint folder: `--checkpoint_dir out/full/alpaca/final`); a base plus LoRA weights (`--lora_path`,
merged into the weights after loading: evaluation runs at the base model's cost) or plus adapter weights
(`--adapter_path`: adapter or adapter_v2, the method read from the file's JSON).

Backends: `--accelerator cpu|cuda|auto` loads as generate/*.py does (`lit_gpt.peft`, `lit_gpt.loading`, a
one-device Fabric); `--accelerator xla` as xla/generate/*.py does (the PJRT device from PJRT_DEVICE, else the TPU
when there is one, else the CPU; the weights loaded block by block onto the devices, sharded over the SPMD mesh of
all of them), with `XLARuntime` as the runtime. `--quantize` (generate/base.py's: torchao, bitsandbytes, gpt-oss's
experts in MXFP4) applies after loading, on the CPU and CUDA.
"""

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch

from lit_gpt.fingerprint import ALLOW_OTHER_BASE_HELP
from lit_gpt.recipes.flags import Flag
from lit_gpt.recipes.generate import FLAG_HELP
from lit_gpt.runtime import Runtime, param_dtype
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError

ACCELERATORS = ("auto", "cpu", "cuda", "xla")
PRECISIONS = ("32-true", "bf16-true", "16-true")
XLA_PRECISIONS = ("32-true", "bf16-true")

EVAL_FLAGS: List[Flag] = [
    Flag("checkpoint_dir", Path, DEFAULT_CHECKPOINT_DIR,
         "The model: a converted checkpoint folder, a full finetune's final/ folder (itself a checkpoint folder), or\n"
         "with --lora_path / --adapter_path the base model those weights were finetuned from."),
    Flag("lora_path", Optional[Path], None,
         "LoRA weights written by finetune/lora.py (lit_model.lora.safetensors): merged into the base after loading."),
    Flag("adapter_path", Optional[Path], None,
         "Adapter or adapter_v2 weights written by finetune/adapter*.py (lit_model.adapter*.safetensors; the method\n"
         "is read from the file)."),
    Flag("allow_other_base", bool, False, ALLOW_OTHER_BASE_HELP),
    Flag("precision", Optional[str], None,
         '"32-true", "bf16-true" or "16-true" (default: bf16-true on GPUs that support it and on TPUs, else 32-true).'),
    Flag("accelerator", str, "auto",
         '"auto" (a GPU when one is visible, else the CPU), "cpu", "cuda", or "xla" (the PJRT device: PJRT_DEVICE,\n'
         "else the TPU when there is one, else the CPU; the model sharded over all its devices)."),
    # generate/base.py's flag, with its help text (the same choices, checked by lit_gpt.quantize.check_quantize);
    # applied after loading (LoRA merged first), CPU/CUDA only
    Flag("quantize", Optional[str], None, FLAG_HELP["quantize"]),
]
"""The model flags of every evaluation recipe (names and defaults are `load_eval_model`'s parameters)."""


@dataclass
class EvalModel:
    """A model ready to evaluate, and what the recipes report about it."""

    model: torch.nn.Module
    """The GPT set up by Fabric on `device`, in eval mode, LoRA merged: call it like the GPT (`model(idx)`); its
    attributes are the GPT's (`model.config`); `gpt` is the GPT itself."""
    tokenizer: Any
    """`lit_gpt.tokenizer.Tokenizer` of the checkpoint folder."""
    device: torch.device
    runtime: Runtime
    """`lit_gpt.runtime.Runtime` (CPU/CUDA) or `lit_gpt.xla.runtime.XLARuntime` (XLA): `runtime.compiles_graphs`
    says whether shapes must stay static, `runtime.place(batch)` puts host tensors on the device(s)."""
    dtype: torch.dtype
    name: str
    """What the results name: the checkpoint folder, with the finetuned weights file after a "+"."""
    checkpoint_dir: Path
    finetuned_path: Optional[Path] = None
    """--lora_path or --adapter_path (None: a base checkpoint or a full finetune)."""
    method: str = "base"
    """"base" (a checkpoint folder: also a full finetune), "lora", "adapter" or "adapter_v2"."""
    precision: str = "32-true"

    @property
    def gpt(self) -> torch.nn.Module:
        from lit_gpt.generate import unwrap

        return unwrap(self.model)

    @property
    def block_size(self) -> int:
        return self.gpt.config.block_size

    def default_out_dir(self) -> Path:
        return default_out_dir(self.checkpoint_dir, self.finetuned_path)


def default_out_dir(checkpoint_dir: Union[str, Path], finetuned_path: Optional[Union[str, Path]] = None) -> Path:
    """Where the evaluation recipes write their results by default: next to what was evaluated, in an `eval/`
    folder: beside the finetuned weights file (`out/lora/alpaca/final/eval`), else in the checkpoint folder (a base
    model's or a full finetune's: `out/full/alpaca/final/eval`)."""
    return (Path(finetuned_path).parent if finetuned_path is not None else Path(checkpoint_dir)) / "eval"


def _pathish(value: Optional[Union[str, Path]]) -> Optional[Path]:
    return None if value is None else Path(value)


def check_eval_args(checkpoint_dir: Union[str, Path], lora_path: Optional[Union[str, Path]] = None,
                    adapter_path: Optional[Union[str, Path]] = None, precision: Optional[str] = None,
                    accelerator: str = "auto", quantize: Optional[str] = None) -> "tuple[str, Optional[Path]]":
    """Every check on the model flags that needs no weights (one LitError line each): the accelerator, the
    precision, --quantize, the checkpoint folder, the finetuned file and its method. Returns (method, finetuned
    path)."""
    from lit_gpt.loading import check_model_dir
    from lit_gpt.peft import finetuned_method_of

    if str(accelerator).lower() not in ACCELERATORS:
        raise LitError(f"--accelerator must be auto, cpu, cuda or xla (got {accelerator!r})")
    allowed = XLA_PRECISIONS if str(accelerator).lower() == "xla" else PRECISIONS
    if precision is not None and precision not in allowed:
        raise LitError(f"--precision must be {', '.join(allowed[:-1])} or {allowed[-1]} for evaluation"
                       f"{' on XLA' if allowed is XLA_PRECISIONS else ''} (got {precision!r})")
    _check_quantize(quantize, accelerator, precision)
    if lora_path is not None and adapter_path is not None:
        raise LitError("pass --lora_path or --adapter_path, not both: a model is evaluated with one finetuned weights"
                       " file (merge LoRA weights first with scripts/merge_lora.py to stack them)")
    check_model_dir(checkpoint_dir)
    flag, path = ("--lora_path", lora_path) if lora_path is not None else ("--adapter_path", adapter_path)
    path = _pathish(path)
    if path is None:
        return "base", None
    if not path.is_file():
        raise LitError(f"{flag} {str(path)!r} not found: pass the weights file that the finetuning recipe wrote")
    found = finetuned_method_of(path)
    if found is None:
        raise LitError(f"{flag} {str(path)!r} is not a finetuned-weights file of LoRA or an adapter (no method"
                       " recorded beside it): a fully finetuned model's folder goes to --checkpoint_dir")
    if flag == "--lora_path" and found != "lora":
        raise LitError(f"{str(path)!r} holds {found} weights, not LoRA: pass it with --adapter_path")
    if flag == "--adapter_path" and found == "lora":
        raise LitError(f"{str(path)!r} holds LoRA weights, not an adapter's: pass it with --lora_path")
    return found, path


def _check_quantize(quantize: Optional[str], accelerator: str, precision: Optional[str]) -> None:
    """--quantize: generate/base.py's check on the device it will run on; on XLA mxfp4 only (torchao / bitsandbytes
    are CPU and CUDA kernels; the XLA loader places gpt-oss's packed experts as it reads them)."""
    if quantize is None:
        return
    if str(accelerator).lower() == "xla":
        from lit_gpt.recipes.xla_generate import check_xla_quantize

        check_xla_quantize(quantize)
        return
    from lit_gpt.quantize import check_quantize
    from lit_gpt.runtime import resolve_accelerator

    device = resolve_accelerator(str(accelerator).lower())
    if precision is None:  # generation_fabric's default
        precision = "bf16-true" if device == "cuda" and torch.cuda.is_bf16_supported() else "32-true"
    check_quantize(quantize, torch.device(device), param_dtype(precision))


def load_eval_model(checkpoint_dir: Union[str, Path], lora_path: Optional[Union[str, Path]] = None,
                    adapter_path: Optional[Union[str, Path]] = None, precision: Optional[str] = None,
                    accelerator: str = "auto", allow_other_base: bool = False,
                    rope_scaling: Optional[Dict[str, Any]] = None, quantize: Optional[str] = None,
                    weights: Optional[str] = None, kv_positions: int = 0, compile: Optional[str] = None) -> EvalModel:
    """The model of the evaluation flags (`EVAL_FLAGS`), on its device, in eval mode, LoRA merged. Bad input (a
    missing checkpoint, both --lora_path and --adapter_path, a file of another method, finetuned weights of
    another base: `lit_gpt.peft.check_finetuned_base`, an unknown accelerator or precision) is one LitError line,
    raised before any weights are read. `rope_scaling` (serve/base.py's --rope_scaling): the context extended
    (`lit_gpt.loading.scale_rope`), refused in one line where the model cannot extend. `quantize`: generate/base.py's
    --quantize, applied after loading (and merging).

    Serving (serve/base.py) also passes `weights` (--weights: on XLA "auto", "replicated" or "tensor_parallel",
    `lit_gpt.xla.serve_placement`; None: the evaluation recipes' FSDP layout) with the KV cache's `kv_positions`
    (slots x length, for "auto"'s memory check), and `compile` (--compile: the decode step compiled on CPUs and
    GPUs, `compile_forward`; None: eager)."""
    checkpoint_dir = Path(checkpoint_dir)
    method, path = check_eval_args(checkpoint_dir, lora_path, adapter_path, precision, accelerator, quantize)
    if weights is not None:
        from lit_gpt.xla.serve_placement import check_weights_flag

        check_weights_flag(weights, accelerator)  # before any weights are read
    mode = serve_compile_mode(compile, accelerator)  # refused in one line where it cannot apply
    if rope_scaling:
        from lit_gpt.config import load_config

        load_config(checkpoint_dir, rope_scaling=rope_scaling)  # its refusals, before any weights are read
    if path is not None:
        from lit_gpt.peft import check_finetuned_base

        check_finetuned_base(path, checkpoint_dir, allow_other_base, method)  # before any weights are read
    if str(accelerator).lower() == "xla":
        fabric, model, precision, placement = _load_xla(checkpoint_dir, method, path, precision, allow_other_base,
                                                        rope_scaling, weights, kv_positions, quantize)
        from lit_gpt.xla.runtime import XLARuntime

        if placement is None:
            runtime: Runtime = XLARuntime(fabric)
        else:
            from lit_gpt.xla.serve_placement import serve_runtime

            runtime = serve_runtime(fabric, placement)  # tensor-parallel: KV caches split on heads
    else:
        fabric, model, precision = _load_eager(checkpoint_dir, method, path, precision, accelerator, allow_other_base,
                                               rope_scaling, quantize, mode)
        runtime = Runtime(fabric)
        if mode is not None:
            compile_forward(model, mode)
            runtime.compiles_graphs = True  # static shapes (the server's fixed rows and cache), compilations counted
    from lit_gpt.tokenizer import Tokenizer

    name = str(checkpoint_dir) if path is None else f"{checkpoint_dir} + {path}"
    return EvalModel(model=model, tokenizer=Tokenizer(checkpoint_dir), device=fabric.device, runtime=runtime,
                     dtype=param_dtype(precision), name=name, checkpoint_dir=checkpoint_dir, finetuned_path=path,
                     method=method, precision=precision)


def _variant(method: str) -> Any:
    import importlib

    return importlib.import_module(f"lit_gpt.{method}")  # lit_gpt.lora, lit_gpt.adapter, lit_gpt.adapter_v2


def _load_eager(checkpoint_dir: Path, method: str, path: Optional[Path], precision: Optional[str], accelerator: str,
                allow_other_base: bool, rope_scaling: Optional[Dict[str, Any]] = None,
                quantize: Optional[str] = None, compile_mode: Optional[str] = None) -> Any:
    """As generate/{base,lora,adapter,adapter_v2}.py load: on the meta device, the weights assigned as read, LoRA
    merged, quantized (--quantize), then cast to the precision's dtype (the CPU's inference layout in 32-true) and
    set up by Fabric."""
    from lit_gpt.generate import compile_steps
    from lit_gpt.recipes.generate import generation_fabric, loading, prepare_for_device, quantize_weights

    fabric = generation_fabric(str(accelerator).lower(), precision, quantize)
    with loading(fabric, path or checkpoint_dir):
        if path is None:
            from lit_gpt.loading import load_model

            model = load_model(checkpoint_dir, quantize)  # mxfp4: the experts loaded packed
        else:
            from lit_gpt.peft import load_variant_model

            variant = _variant(method)
            model = load_variant_model(variant.GPT, variant.Config, checkpoint_dir, path,
                                       allow_other_base=allow_other_base)
            if method == "lora":  # folded in the precision's dtype (a bf16 base under 32-true: after the cast)
                variant.merge_lora_weights(model, dtype=param_dtype(fabric.strategy.precision.precision))
        from lit_gpt.loading import scale_rope

        model = quantize_weights(fabric, scale_rope(model, rope_scaling), quantize)
        model = prepare_for_device(fabric, model, compile_steps(compile_mode, compile_prefill=False))
    return fabric, model, fabric.strategy.precision.precision


SERVING_TOKENS = 1 << 30
"""What a server generates, for `--compile auto`'s rule (`lit_gpt.compile_policy.resolve_compile`): it runs until
stopped, so compiling always pays where it ever does (CUDA graphs on a GPU; never on the CPU)."""


def serve_compile_mode(compile: Optional[str], accelerator: str) -> Optional[str]:
    """serve/base.py's --compile as a torch.compile mode (None: eager), by generate/base.py's policy
    (`resolve_compile`: one line for a mode the device cannot run, e.g. reduce-overhead off CUDA, or any mode on
    XLA, which compiles its graphs itself). None (the evaluation recipes) is eager."""
    if compile is None:
        return None
    from lit_gpt.compile_policy import resolve_compile
    from lit_gpt.runtime import resolve_accelerator

    accelerator = str(accelerator).lower()
    device = "xla" if accelerator == "xla" else resolve_accelerator(accelerator)
    return resolve_compile(compile, device, SERVING_TOKENS)


def compile_forward(model: torch.nn.Module, mode: str) -> None:
    """The GPT's forward compiled in `mode` the way generate/base.py compiles its decode step
    (`lit_gpt.compile_policy.build_steps`: static shapes, one whole graph; "reduce-overhead" and "max-autotune"
    replay it as a CUDA graph, each call a new graph step whose output is copied out before the next replay
    overwrites it). The server's engine keeps its shapes fixed on such a runtime (`compiles_graphs`), so its forward
    compiles once per kind of call: the prefill call, the prefill keeping every position's scores, the decode step."""
    from lit_gpt.compile_policy import build_steps
    from lit_gpt.generate import unwrap

    gpt = unwrap(model)
    gpt.forward = build_steps(gpt.forward, gpt.forward, mode, compile_prefill=False).decode


def _load_xla(checkpoint_dir: Path, method: str, path: Optional[Path], precision: Optional[str],
              allow_other_base: bool, rope_scaling: Optional[Dict[str, Any]] = None, weights: Optional[str] = None,
              kv_positions: int = 0, quantize: Optional[str] = None) -> Any:
    """As xla/generate/*.py load: a Fabric over every PJRT device (SPMD), the weights block by block onto the
    devices (LoRA merged), set up by Fabric. With `weights` (serving) the loaded weights are then placed
    replicated or tensor-parallel (`lit_gpt.xla.serve_placement`) instead of staying FSDP-sharded; returns that
    `Placement` too (None without `weights`)."""
    from lit_gpt.recipes.generate import loading
    from lit_gpt.recipes.xla_generate import load_base_staged, load_variant_staged
    from lit_gpt.xla import make_fabric
    from lit_gpt.xla.accelerator import default_precision

    precision = default_precision(precision, XLA_PRECISIONS, "for evaluation on XLA")
    fabric = make_fabric("auto", precision)
    fabric.launch()  # SPMD: nothing to spawn; sets up the mesh over every device in this process
    with loading(fabric, path or checkpoint_dir):
        if path is None:
            model = load_base_staged(fabric, checkpoint_dir, quantize)  # mxfp4: gpt-oss's experts placed packed
        else:
            variant = _variant(method)
            model = load_variant_staged(fabric, variant.GPT, variant.Config, checkpoint_dir, path,
                                        allow_other_base=allow_other_base, quantize=quantize)
        from lit_gpt.loading import scale_rope

        model = scale_rope(model, rope_scaling).eval()
        placement = None
        if weights is not None:
            from lit_gpt.xla.serve_placement import describe, kv_cache_bytes, place_weights

            kv_bytes = kv_cache_bytes(model.config, kv_positions, param_dtype(precision))
            placement = place_weights(model, weights, kv_bytes)
            fabric.print(describe(placement), file=sys.stderr)
        model = fabric.setup_module(model)  # FSDP-wrapped, unless placed for serving
    return fabric, model, precision, placement


def print_table(rows: List[List[Any]], header: List[str], file: Any = sys.stdout) -> None:
    """A plain aligned text table (the recipes' results on stdout): numbers right-aligned, text left-aligned."""
    cells = [[str(c) for c in header]] + [[c if isinstance(c, str) else _number(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [all(not isinstance(row[i], str) for row in rows) and bool(rows) for i in range(len(header))]

    def line(r: List[str]) -> str:
        return "  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(r, widths, numeric)).rstrip()

    print(line(cells[0]), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for r in cells[1:]:
        print(line(r), file=file)


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1e6 else f"{value:.4e}"
    return str(value)


# ---------------------------------------------------------------------------------------------------------------
# eval/perplexity.py's steps
# ---------------------------------------------------------------------------------------------------------------
PERPLEXITY_FILE = "perplexity.json"


@dataclass
class PerplexityRequest:
    """eval/perplexity.py's input, checked and tokenized before any weights are read."""

    data_path: Path
    tokens: List[torch.Tensor]
    windows: List[Any]
    window: int
    stride: int
    batch_size: int
    out_file: Path


def perplexity_request(data_path: Optional[Union[str, Path]], checkpoint_dir: Union[str, Path],
                       lora_path: Optional[Union[str, Path]] = None, adapter_path: Optional[Union[str, Path]] = None,
                       precision: Optional[str] = None, accelerator: str = "auto", window: Optional[int] = None,
                       stride: Optional[int] = None, batch_size: int = 1,
                       out_dir: Optional[Union[str, Path]] = None, quantize: Optional[str] = None) -> PerplexityRequest:
    """Every check of eval/perplexity.py's flags (one LitError line each; nothing is read but the config, the
    tokenizer and the text, nothing written): the model flags (`check_eval_args`), the data file, the window and
    stride against the model's context, the batch size, and where the results go."""
    from lit_gpt.config import load_config
    from lit_gpt.perplexity import all_windows, check_window, read_documents, tokenize
    from lit_gpt.recipes.outputs import check_output_dir
    from lit_gpt.tokenizer import Tokenizer

    _, finetuned = check_eval_args(checkpoint_dir, lora_path, adapter_path, precision, accelerator, quantize)
    if data_path is None:
        raise LitError("pass --data_path: a .txt file (the whole text) or a .json / .jsonl file of rows with a"
                       ' "text" field')
    if batch_size < 1:
        raise LitError(f"--batch_size must be at least 1, got {batch_size}")
    window, stride = check_window(window, stride, load_config(checkpoint_dir).block_size)
    docs = read_documents(Path(data_path))
    tokens = tokenize(Tokenizer(checkpoint_dir), docs)
    windows = all_windows(tokens, window, stride)
    out = Path(out_dir) if out_dir is not None else default_out_dir(checkpoint_dir, finetuned)
    check_output_dir(out, "--out_dir")  # a file, a folder under a file, not writable: before the work
    return PerplexityRequest(Path(data_path), tokens, windows, window, stride, batch_size, out / PERPLEXITY_FILE)


def run_perplexity(loaded: EvalModel, request: PerplexityRequest) -> Any:
    """Score the request's windows (a progress bar on stderr), print the table, write the results JSON. Returns the
    `lit_gpt.perplexity.PerplexityResult`."""
    import time

    from tqdm import tqdm

    from lit_gpt.perplexity import results_json, score
    from lit_gpt.recipes.outputs import write_results

    t0 = time.perf_counter()
    with tqdm(total=len(request.windows), desc="perplexity", unit="window", file=sys.stderr) as bar:
        result = score(loaded.model, request.tokens, request.windows, loaded.runtime, request.batch_size,
                       progress=bar.update)
    seconds = time.perf_counter() - t0
    print_table([[loaded.name, str(request.data_path), result.tokens_scored, result.nll_per_token,
                  result.perplexity]], ["model", "data", "tokens scored", "nll/token", "perplexity"])
    about = dict(model=loaded.name, checkpoint_dir=loaded.checkpoint_dir, method=loaded.method,
                 finetuned_path=loaded.finetuned_path, data_path=request.data_path, window=request.window,
                 stride=request.stride, batch_size=request.batch_size, precision=loaded.precision,
                 device=str(loaded.device), seconds=round(seconds, 3),
                 tokens_per_second=round(result.tokens_scored / seconds, 1) if seconds > 0 else None)
    write_results(request.out_file, results_json(result, **about))  # if that fails: kept elsewhere, and named
    print(f"Wrote {request.out_file}" + (f" (XLA compilations: {result.compiles})" if loaded.runtime.name == "xla"
                                         else ""), file=sys.stderr)
    return result
