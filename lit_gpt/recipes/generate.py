"""The generate recipes' shared part (generate/*.py, xla/generate/*.py; chat/base.py takes their flags): one set of
flags with one help text each, the typed object the flags become (`GenerationArgs`), and the steps every recipe's
`main` calls in this order:

    steps = generation_steps(args, fabric.device.type)       # --compile: the loop's steps, eager or compiled
    request = check_request(args)                             # every input checked, the prompt encoded
    with loading(fabric, args.checkpoint_dir):                # "Loaded ... in ... s"
        model = quantize_weights(fabric, load_model(args.checkpoint_dir), args.quantize)
        model = prepare_for_device(fabric, model, steps)     # precision dtype, CPU layout, Fabric
    print_style(fabric, request)                              # "Prompt style: chat (...)" on stderr
    runtime = Runtime(fabric)                                 # XLARuntime(fabric) on XLA
    runtime.seed(args.seed)
    for i in range(args.num_samples):
        result = generate_sample(model, request, runtime, steps)
        print_sample(fabric, request, result, i, steps, runtime)  # the text to stdout, speed to stderr
        results.append(result)
    report(fabric, runtime, results)                          # compilations (XLA), memory

Every check on the user's input runs before any weights are read. The XLA recipes' loading is in
`lit_gpt.recipes.xla_generate`.
"""

import inspect
import sys
import textwrap
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple, TypeVar, Union

import torch

from lit_gpt.compile_policy import Steps, resolve_compile
from lit_gpt.config import load_config
from lit_gpt.cpu_layout import prepare_for_generation
from lit_gpt.fingerprint import ALLOW_OTHER_BASE_HELP
from lit_gpt.generate import GenerationResult, check_lengths, compile_steps, timed_generate, unwrap
from lit_gpt.loading import check_model_dir, scale_rope
from lit_gpt.quantize import check_quantize, loader
from lit_gpt.recipes.flags import ROPE_SCALING, Flag, command
from lit_gpt.runtime import Runtime, param_dtype, resolve_accelerator
from lit_gpt.sampling import check_sampling_args
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError

F = TypeVar("F", bound=Callable[..., Any])

# ---------------------------------------------------------------------------------------------------------------
# The flags
# ---------------------------------------------------------------------------------------------------------------
FLAG_HELP = {
    "prompt": "The text to continue (or the instruction, with a chat or alpaca template).",
    "checkpoint_dir": (
        "A converted checkpoint folder (lit_model.safetensors, lit_config.json, tokenizer files); with finetuned"
        " weights (--lora_path, --adapter_path, --checkpoint_path), the base model they were finetuned from."
    ),
    "num_samples": "How many samples to draw, one after the other.",
    "max_new_tokens": (
        "The most tokens to generate per sample; generation also stops at the model's stop tokens."
    ),
    "temperature": "Sampling temperature; 0 is greedy decoding (top_k and top_p then do nothing).",
    "top_k": "Sample among the k most likely tokens only (null: all).",
    "top_p": "Nucleus sampling: among the most likely tokens whose probabilities add up to top_p (1.0: all).",
    "precision": '"32-true", "bf16-true", "16-true" (default: bf16-true on GPUs that support it, else 32-true).',
    "prompt_style": (
        '"chat" (the checkpoint\'s chat template), "alpaca" or "raw": the style the model was finetuned with;'
        " default: chat when the checkpoint's template ends replies with a token the model stops on (an instruct"
        " model, known by its files, not its folder's name), else raw. The style used is printed on stderr."
    ),
    "seed": "Seeds the sampling.",
    "compile": (
        '"auto" (default): `torch.compile` the steps when num_samples * max_new_tokens pays for the compilation'
        " (`lit_gpt.compile_policy.resolve_compile`: CUDA graphs of the decode step on a GPU, eager on the CPU);"
        ' "none"; or a torch.compile mode: "default", "reduce-overhead" (CUDA graphs, GPUs only), "max-autotune".'
        " The compilation time is printed; Inductor caches it in TORCHINDUCTOR_CACHE_DIR."
    ),
    "accelerator": '"cpu", "cuda" or "auto".',
    "quantize": (
        'Weight-only quantization of the block linear layers (see lit_gpt/quantize.py): "torchao.int8wo",'
        ' "torchao.int4wo", or on CUDA "bnb.int8", "bnb.nf4" (needs bitsandbytes); "mxfp4": gpt-oss\'s experts'
        " kept packed in MXFP4 (lossless); finetuned weights are quantized after they are loaded (LoRA: merged)."
        " Default: none."
    ),
}
"""The help text of every flag the generate recipes share (the method's own flags bring theirs)."""

XLA_FLAG_HELP = {
    **{name: text for name, text in FLAG_HELP.items() if name not in ("compile", "quantize")},
    "precision": '"32-true" or "bf16-true" (default: bf16-true on TPUs, else 32-true).',
    "devices": '"auto" (all devices of the XLA runtime) or their number: the SPMD mesh spans all of them.',
    "compile_cache_dir": "Persistent XLA compilation cache: a second run skips compiling (TPU/GPU).",
    "accelerator": 'The PJRT device: "auto" (the TPU when there is one, else the CPU), "tpu", "cpu" or "cuda".',
    "quantize": ('"mxfp4": gpt-oss\'s experts kept packed in MXFP4 on the devices (lossless; the other modes are'
                 " torchao / bitsandbytes kernels of the CPU and CUDA recipes). Default: none."),
}
"""The XLA generate recipes' flags: no --compile (XLA compiles the loop's graphs itself); --quantize mxfp4 only."""


def flag_help(help_texts: Mapping[str, str], **own: str) -> Callable[[F], F]:
    """Give a recipe's `setup` the Args section that jsonargparse shows in --help: for each parameter its `own`
    text (the method's flags) or the shared one from `help_texts`, so that the same flag reads the same in every
    recipe. The function's own docstring is the summary above it."""

    def document(fn: F) -> F:
        names = list(inspect.signature(fn).parameters)
        undocumented = [n for n in names if n not in own and n not in help_texts]
        if undocumented:
            raise TypeError(f"{fn.__qualname__}: no help text for {', '.join(undocumented)}")
        entries = [
            textwrap.fill(f"{n}: {own.get(n, help_texts.get(n))}", 112, initial_indent="    ",
                          subsequent_indent="        ", break_on_hyphens=False)
            for n in names
        ]
        fn.__doc__ = inspect.cleandoc(fn.__doc__ or "") + "\n\nArgs:\n" + "\n".join(entries) + "\n"
        return fn

    return document


@dataclass(frozen=True)
class GenerationArgs:
    """A generation request as the recipe's flags gave it (the defaults are the flags': the recipes' signature test
    holds them equal). The flags that choose the Fabric (--precision, --accelerator, --devices) are used up by
    `setup`; what `main` needs travels here."""

    prompt: str
    checkpoint_dir: Path
    finetuned_path: Optional[Path] = None
    """The method's weights: --lora_path, --adapter_path, or full.py's --checkpoint_path (None: the base model)."""
    num_samples: int = 1
    max_new_tokens: int = 100
    temperature: float = 0.8
    top_k: Optional[int] = 50
    top_p: float = 1.0
    prompt_style: Optional[str] = None
    seed: int = 1234
    compile: Union[bool, str] = "auto"
    quantize: Optional[str] = None
    allow_other_base: bool = False
    """Apply the finetuned weights although they record another base than --checkpoint_dir holds (a warning line)."""
    rope_scaling: Optional[Dict[str, Any]] = None
    """--rope_scaling: the checkpoint's context extended (`lit_gpt.loading.scale_rope`; checked in `check_request`)."""


def check_file(path: Path, flag: str, writer: str) -> None:
    """A method's weights file (--lora_path, ...) must exist: checked before the model or a runtime is set up."""
    if not Path(path).is_file():
        raise LitError(f"{flag} {str(path)!r} not found: pass the weights file that {writer} wrote")


# ---------------------------------------------------------------------------------------------------------------
# The steps
# ---------------------------------------------------------------------------------------------------------------
def generation_fabric(accelerator: str = "auto", precision: Optional[str] = None, quantize: Optional[str] = None):
    """A one-device Fabric for generation: bf16-true on GPUs that support it, else 32-true, unless given; a
    LitError when `quantize` cannot run on its device in its precision (before any weights are read)."""
    import lightning as L  # here: only the generation recipes need Lightning

    accelerator = resolve_accelerator(accelerator)
    if precision is None:
        precision = "bf16-true" if accelerator == "cuda" and torch.cuda.is_bf16_supported() else "32-true"
    if precision not in ("32-true", "bf16-true", "16-true"):
        raise LitError(f"--precision must be 32-true, bf16-true or 16-true for generation (got {precision!r})")
    fabric = L.Fabric(devices=1, accelerator=accelerator, precision=precision)
    check_quantize(quantize, fabric.device, param_dtype(precision))
    return fabric


def generation_steps(args: GenerationArgs, device_type: str) -> Steps:
    """The loop's two steps as --compile asks (`resolve_compile`: checked here, before any weights are read). The
    prefill is compiled on GPUs only: on the CPU it runs once per sample and its compilation would not pay."""
    mode = resolve_compile(args.compile, device_type, args.num_samples * args.max_new_tokens)
    return compile_steps(mode, compile_prefill=device_type == "cuda")


class Request(NamedTuple):
    """A checked generation request: the arguments, and what checking them produced."""

    args: GenerationArgs
    tokenizer: Any
    style: Any
    encoded: torch.Tensor
    """The prompt with its template applied, encoded (1-D, on the CPU unless a device was given)."""
    stop_ids: List[int]
    """The single-token stop sequences of the style: generation ends on the device at any of them."""

    def text(self, new_ids: List[int]) -> str:
        """What the recipes print: with a raw prompt, the prompt and its continuation; with a template, the reply."""
        from lit_gpt.prompts import Raw

        raw = isinstance(self.style, Raw)
        return self.tokenizer.decode(self.encoded.tolist() + new_ids if raw else new_ids)


def check_request(args: GenerationArgs, device: Optional[torch.device] = None) -> Request:
    """Every check on the user's input (folder, sampling arguments, prompt length against the context), run before
    any weights are read, and the encoded prompt (on `device`, default the CPU: the loop pads it there for XLA and
    moves it)."""
    from lit_gpt.prompts import PromptStyle  # here: only the generation recipes need prompts and tokenizer
    from lit_gpt.tokenizer import Tokenizer

    if args.num_samples < 1:
        raise LitError(f"--num_samples must be >= 1 (got {args.num_samples})")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # bytes that are not UTF-8 reach Python as lone surrogates
        raise LitError(
            f"--prompt is not valid UTF-8 text (byte {e.start} of it): pass the prompt in UTF-8, e.g. convert the"
            " file with iconv -t UTF-8"
        ) from None
    check_sampling_args(args.temperature, args.top_k, args.top_p)
    check_model_dir(args.checkpoint_dir)
    config = load_config(args.checkpoint_dir, rope_scaling=args.rope_scaling)  # the context --rope_scaling gives
    tokenizer = Tokenizer(args.checkpoint_dir)
    style = PromptStyle.from_checkpoint(args.checkpoint_dir, args.prompt_style)
    encoded = tokenizer.encode(style.apply(args.prompt), bos=style.bos, device=device)
    check_lengths(encoded.numel(), args.max_new_tokens, config.block_size)
    # the styles here have single-token stop sequences only
    stop_ids = [ids[0] for ids in style.stop_tokens(tokenizer) if len(ids) == 1]
    return Request(args, tokenizer, style, encoded, stop_ids)


def print_style(fabric: Any, request: Request) -> None:
    """The prompt style the request uses and why, in one stderr line (`lit_gpt.prompts.describe_style`)."""
    from lit_gpt.prompts import describe_style

    fabric.print(describe_style(request.style, request.args.checkpoint_dir, request.args.prompt_style),
                 file=sys.stderr)


@contextmanager
def loading(fabric: Any, what: Path) -> Iterator[None]:
    """Time the loading and preparing of the model (printed to stderr as "Loaded <what> in <s> s")."""
    t0 = time.perf_counter()
    yield
    fabric.print(f"Loaded {what} in {time.perf_counter() - t0:.2f} s", file=sys.stderr)


def quantize_weights(fabric: Any, model: torch.nn.Module, mode: Optional[str]) -> torch.nn.Module:
    """--quantize: the loaded model cast to the precision's dtype and its block linear layers quantized on the
    device (`lit_gpt.quantize.loader`); the model as it is for None."""
    dtype = param_dtype(fabric.strategy.precision.precision)
    return loader(lambda: model, mode, fabric.device, dtype)()


def prepare_for_device(fabric: Any, model: torch.nn.Module, steps: Steps) -> torch.nn.Module:
    """The loaded model in eval mode, its floating weights in the precision's dtype and, on the CPU in 32-true, in the
    fastest layout for `steps` (`lit_gpt.cpu_layout.prepare_for_generation`), then set up by Fabric."""
    model.eval()
    prepare_for_generation(model, fabric.device.type, fabric.strategy.precision.precision, steps.mode)
    return fabric.setup_module(model)


def generate_sample(model: torch.nn.Module, request: Request, runtime: Runtime, steps: Steps) -> GenerationResult:
    """One sample of the request through the loop, timed. Compiled steps get the prompt padded to its bucket and
    the KV cache length they were compiled for (`Steps.shapes`)."""
    args = request.args
    pad_to, max_seq_length = steps.shapes(request.encoded.numel(), args.max_new_tokens, unwrap(model).config.block_size)
    # inference mode (eager): nothing here needs autograd afterwards, and each small op dispatches faster
    with runtime.inference_context():
        return timed_generate(
            model, request.encoded, args.max_new_tokens, runtime, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, stop_ids=request.stop_ids, decode_fn=steps.decode, prefill_fn=steps.prefill,
            pad_to=pad_to, max_seq_length=max_seq_length,
        )


def print_sample(fabric: Any, request: Request, result: GenerationResult, index: int, steps: Steps,
                 runtime: Runtime) -> str:
    """The sample's text to stdout; to stderr its tokens, time, time to first token, steady decode speed (and on
    XLA its compilations), and after the first sample of compiled steps, about how long they took to compile.
    Returns the text."""
    xla = runtime.name == "xla"
    new_ids = result.tokens.tolist()
    text = request.text(new_ids)
    fabric.print(text, flush=True)
    compiling = xla or (steps.compile_prefill and index == 0)
    speed = f"{result.decode_tokens_per_sec:.2f} tokens/s" if result.decode_tokens_per_sec else "n/a (< 3 tokens)"
    fabric.print(
        f"Sample {index + 1}: {len(new_ids)} tokens in {result.seconds:.02f} s;"
        f" time to first token {result.time_to_first_token:.2f} s{' (compilation included)' if compiling else ''};"
        f" steady decode {speed}" + (f"; XLA compilations {result.compiles}" if xla else ""),
        file=sys.stderr,
    )
    if not new_ids:
        # an empty answer is never silent: the model's first token was one it stops on
        stops = ", ".join(str(request.tokenizer.id_to_token(i)) for i in request.stop_ids)
        other = "raw" if request.style.name == "chat" else "chat"
        fabric.print(
            f"Sample {index + 1} is empty: the model's first token was a stop token ({stops}) with prompt style"
            f" {request.style.name}; try --prompt_style {other}", file=sys.stderr,
        )
    if steps.mode is not None and index == 0:
        # what the first two steps took beyond two steady steps: the compilation (with a warm cache, loading it)
        first_steps = result.first_steps_seconds if result.first_steps_seconds is not None else result.seconds
        steady_steps = 2 / result.decode_tokens_per_sec if result.decode_tokens_per_sec else 0.0
        compile_s = max(first_steps - steady_steps, 0.0)
        fabric.print(
            f"torch.compile ({steps.mode}{', prefill per prompt bucket' if steps.compile_prefill else ''}):"
            f" ~{compile_s:.1f} s of compilation in sample 1; the compiled graphs are cached in"
            " TORCHINDUCTOR_CACHE_DIR for later runs", file=sys.stderr,
        )
    return text


def report(fabric: Any, runtime: Runtime, results: Sequence[GenerationResult]) -> None:
    """To stderr after the samples: on XLA the compilations of the run, then the memory used."""
    import resource

    if runtime.name == "xla":
        fabric.print(
            f"XLA compilations: {sum(r.compiles for r in results)} (prefill + decode: 2 per prompt-length bucket,"
            " whatever max_new_tokens is)", file=sys.stderr,
        )
    memory = runtime.memory_report()
    if memory is not None:
        fabric.print(memory, file=sys.stderr)
    elif fabric.device.type == "cpu":
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        fabric.print(f"Memory used: {peak_rss / 1e9:.02f} GB (peak RSS, includes the mapped weights)", file=sys.stderr)


# ---------------------------------------------------------------------------------------------------------------
# The recipes' `setup` and the method recipes' `main`, written once
# ---------------------------------------------------------------------------------------------------------------
def _flag(name: str, annotation: Any, default: Any, help_texts: Mapping[str, str] = FLAG_HELP) -> Flag:
    return Flag(name, annotation, default, help_texts[name])


GENERATE: List[Flag] = [
    _flag("prompt", str, "What food do llamas eat?"),
    _flag("checkpoint_dir", Path, DEFAULT_CHECKPOINT_DIR),
    _flag("num_samples", int, 1),
    _flag("max_new_tokens", int, 100),
    _flag("temperature", float, 0.8),
    _flag("top_k", Optional[int], 50),
    _flag("top_p", float, 1.0),
    _flag("precision", Optional[str], None),
    _flag("prompt_style", Optional[str], None),
    _flag("seed", int, 1234),
    _flag("compile", Union[bool, str], "auto"),
    _flag("accelerator", str, "auto"),
    _flag("quantize", Optional[str], None),
    ROPE_SCALING,
]
"""The flags of every generate recipe on the CPU/GPU (generate/*.py); a method recipe adds its weights file."""

XLA_GENERATE: List[Flag] = [
    *[_flag(f.name, f.annotation, f.default, XLA_FLAG_HELP) for f in GENERATE[:10]],
    _flag("devices", Union[int, str], "auto", XLA_FLAG_HELP),
    _flag("compile_cache_dir", Optional[Path], None, XLA_FLAG_HELP),
    _flag("accelerator", str, "auto", XLA_FLAG_HELP),
    _flag("quantize", Optional[str], None, XLA_FLAG_HELP),
    ROPE_SCALING,
]
"""The flags of every generate recipe on XLA devices (xla/generate/*.py)."""

ALLOW_OTHER_BASE = Flag("allow_other_base", bool, False, ALLOW_OTHER_BASE_HELP)
"""The method recipes' (finetuned weights on a base: lora, adapter, adapter_v2, CPU and XLA) override of the check
that the base is the one the weights were finetuned on (`lit_gpt.fingerprint.check_base`); after the weights flag."""


def with_weights_flag(flags: Sequence[Flag], own: Sequence[Flag]) -> List[Flag]:
    """A method recipe's weights file flag goes after --checkpoint_dir (the base model it belongs to)."""
    return [*flags[:2], *own, *flags[2:]]


def generation_args(flags: Mapping[str, Any], finetuned: Optional[str] = None) -> GenerationArgs:
    """The typed object that `main` receives, from the flag values (`finetuned`: the name of the method's
    weights flag)."""
    names = [f for f in GenerationArgs.__dataclass_fields__ if f not in ("finetuned_path",) and f in flags]
    return GenerationArgs(finetuned_path=flags[finetuned] if finetuned else None, **{n: flags[n] for n in names})


def generate_command(summary: str, main: Callable[[Any, GenerationArgs], None], own: Sequence[Flag] = ()
                     ) -> Callable[..., None]:
    """The `setup` of a CPU/GPU generate recipe: the shared flags (`GENERATE`) plus the method's weights flag, a
    one-device Fabric (checked against --quantize before any weights are read), then `main(fabric, args)`."""

    def setup(**flags: Any) -> None:
        fabric = generation_fabric(flags["accelerator"], flags["precision"], flags["quantize"])
        main(fabric, generation_args(flags, own[0].name if own else None))

    return command(summary, with_weights_flag(GENERATE, own), setup)


def run(fabric: Any, args: GenerationArgs, load: Callable[[GenerationArgs], torch.nn.Module],
        weights: Optional[Tuple[str, str]] = None, runtime: Optional[Runtime] = None, steps: Optional[Steps] = None
        ) -> List[GenerationResult]:
    """generate/base.py's steps with another `load(args)` (the method recipes: base model plus finetuned weights;
    XLA: staged onto the devices, with `XLARuntime` and the eager steps that XLA traces). `weights`: (the method's
    weights flag, the recipe that writes the file), checked after the request (whose folder check names the right
    recipe for a folder of another method's weights) and before anything is loaded."""
    steps = steps or generation_steps(args, fabric.device.type)
    request = check_request(args)
    if weights is not None:
        check_file(args.finetuned_path, *weights)
    with loading(fabric, args.finetuned_path or args.checkpoint_dir):
        model = scale_rope(load(args), args.rope_scaling)  # --rope_scaling: a longer context
        model = prepare_for_device(fabric, quantize_weights(fabric, model, args.quantize), steps)
    print_style(fabric, request)  # after loading: a bad weights file stays the run's only stderr line
    runtime = runtime or Runtime(fabric)
    runtime.seed(args.seed)
    results = []
    for i in range(args.num_samples):
        results.append(generate_sample(model, request, runtime, steps))
        print_sample(fabric, request, results[-1], i, steps, runtime)
    report(fabric, runtime, results)
    return results
