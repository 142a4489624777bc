"""When and how the generation loop's two steps are compiled with `torch.compile` (CPU and CUDA; XLA compiles its
graphs itself): the `--compile` choices of the generate and chat recipes (`resolve_compile`), and the compiled
steps with the shapes they were compiled for (`Steps`, `build_steps`). The steps themselves are the loop's
(`lit_gpt.generate.prefill` and `decode_one_token`; `lit_gpt.generate.compile_steps` passes them in)."""

from typing import Any, Callable, NamedTuple, Optional, Tuple, Union

import torch

from lit_gpt.runtime import bucket_length
from lit_gpt.utils import LitError

COMPILE_MODES = ("auto", "none", "default", "reduce-overhead", "max-autotune")
"""The choices of `--compile` (`resolve_compile`); `True` / `False` are also accepted (the former bool flag)."""


def compile_pays_after(device_type: str) -> Optional[int]:
    """Generated tokens (all samples of a run) from which `--compile auto` compiles; None: never.

    CUDA: compiling costs ~20-30 s with a cold cache and a few seconds with a warm one (see `build_steps`); a step
    replayed as a CUDA graph saves the per-op launches of the eager one, most of a small model's step (the issue
    measured 196 -> 481 tokens/s with CUDA graphs on SmolLM2-1.7B's architecture, ~3 ms per token; more for smaller
    models): about a thousand tokens pay for a cold compile. An estimate, not a measurement on this code (no GPU was
    available).
    CPU: never. On the 2-core development machine (2026-11-23, shared with other jobs) the compiled decode step of
    SmolLM2-135M in fp32 was mostly slower than the eager one after ~40-80 s of compilation, one thread: 14.5 vs 21.5
    tokens/s for 40 tokens, 15.0 vs 12.9 for 32 tokens (KV cache 64), but 2.8 vs 14.1 for 128 (KV cache 160, no
    recompilation: Inductor's CPU code for that step is slow, not yet understood) in bench/generate.py's
    interleaved runs; an earlier quiet session measured it 1.45x faster. With no reliable gain, the default stays
    eager; `--compile default` compiles anyway."""
    return 1024 if device_type == "cuda" else None


def resolve_compile(compile: Union[bool, str], device_type: str, tokens: int) -> Optional[str]:
    """The `torch.compile` mode for generating `tokens` tokens in all on `device_type` ("cpu", "cuda", "xla"),
    None for eager. "auto" compiles when `tokens >= compile_pays_after(device_type)`: on CUDA with CUDA graphs
    ("reduce-overhead"); not on the CPU (see `compile_pays_after`); never on XLA, which compiles graphs itself."""
    if isinstance(compile, bool):  # the former --compile true/false
        compile = "auto" if compile else "none"
        if device_type != "xla" and compile == "auto":
            compile = "reduce-overhead" if device_type == "cuda" else "default"
    if compile not in COMPILE_MODES:
        raise LitError(f"--compile must be one of {', '.join(COMPILE_MODES)} (got {compile!r})")
    if device_type == "xla":
        if compile not in ("auto", "none"):
            raise LitError(
                f"--compile {compile} is for CPUs and CUDA GPUs: on XLA the loop's graphs are compiled by XLA"
                " already; leave --compile at auto"
            )
        return None
    if compile == "none":
        return None
    if compile == "auto":
        pays_after = compile_pays_after(device_type)
        if pays_after is None or tokens < pays_after:
            return None
        return "reduce-overhead" if device_type == "cuda" else "default"
    if device_type != "cuda" and compile == "reduce-overhead":
        raise LitError(
            f"--compile {compile} records CUDA graphs and needs a CUDA GPU: use --compile default on the {device_type}"
        )
    return compile


class Steps(NamedTuple):
    """The two steps `generate_stream` runs (its `prefill_fn` and `decode_fn`), eager or compiled."""

    prefill: Callable[..., torch.Tensor]
    decode: Callable[..., torch.Tensor]
    mode: Optional[str]
    """The torch.compile mode of the decode step, None when eager."""
    compile_prefill: bool

    def shapes(self, prompt_length: int, max_new_tokens: int, block_size: int) -> Tuple[Optional[int], Optional[int]]:
        """`generate_stream`'s `pad_to` and `max_seq_length` for these steps: eager steps run the exact lengths
        (None, None); compiled ones take the prompt right-padded to a power-of-two bucket (`bucket_length`) and a KV
        cache of bucket + max_new_tokens positions, so that every prompt of a bucket gives the prefill and the
        decode step the shapes they were compiled (and their CUDA graphs recorded) for."""
        if self.mode is None:
            return None, None
        bucket = bucket_length(prompt_length, block_size)
        return bucket, min(bucket + max_new_tokens, block_size)


def _graph_safe(compiled: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A compiled step whose CUDA graph is replayed: each call starts a new graph step and returns a copy, since the
    next replay overwrites the graph's output memory while the loop still holds that token (in the chunk it has
    not read yet). Without the copy: "accessing tensor output of CUDAGraphs that has been overwritten"."""

    def step(*args: Any, **kwargs: Any) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs).clone()

    return step


def build_steps(
    prefill: Callable[..., torch.Tensor],
    decode: Callable[..., torch.Tensor],
    mode: Optional[str],
    compile_prefill: bool = True,
) -> Steps:
    """The loop's two steps for a `resolve_compile` mode: as given for None; else the decode step compiled once for
    its fixed shapes in `mode` ("reduce-overhead" and "max-autotune" record a CUDA graph of it over the static KV
    cache and replay it each token), and, with `compile_prefill`, the prefill compiled (default mode, no CUDA
    graphs) once per prompt bucket (see `Steps.shapes`). Compilation happens in the first call of each; it is
    counted in that generation's time.

    Persistent cache: Inductor keeps its compiled kernels and graphs on disk (the FX graph cache and, for
    max-autotune, the autotuning results), in TORCHINDUCTOR_CACHE_DIR (default /tmp/torchinductor_$USER), so a
    second process with the same model, shapes and mode compiles in a fraction of the first's time. Point it at a
    directory that survives reboots (TORCHINDUCTOR_CACHE_DIR=~/.cache/torchinductor); to ship a warm cache to
    another machine, see torch.compiler.save_cache_artifacts / load_cache_artifacts."""
    if mode is None:
        return Steps(prefill, decode, None, False)
    compiled_decode = torch.compile(decode, mode=mode, dynamic=False, fullgraph=True)
    if mode in ("reduce-overhead", "max-autotune"):  # both replay CUDA graphs
        compiled_decode = _graph_safe(compiled_decode)
    prefill_fn = torch.compile(prefill, dynamic=False, fullgraph=True) if compile_prefill else prefill
    return Steps(prefill_fn, compiled_decode, mode, compile_prefill)
