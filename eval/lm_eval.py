"""Evaluate a checkpoint on lm-evaluation-harness tasks (the `lm-eval` package), without converting it to
transformers: a base model, a full finetune, or a base with LoRA or adapter weights.

    python eval/lm_eval.py --tasks hellaswag,arc_easy --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python eval/lm_eval.py --tasks arc_easy --lora_path out/lora/alpaca/final/lit_model.lora.safetensors \\
        --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct --num_fewshot 5 --batch_size 8
    python eval/lm_eval.py --tasks my_task --include_path my_tasks/ --checkpoint_dir out/full/alpaca/final
    PJRT_DEVICE=CPU python eval/lm_eval.py --tasks my_task --include_path my_tasks/ --accelerator xla   # XLA / TPU
    python eval/lm_eval.py --tasks list                                                                # every task

The flags mean what the harness's own CLI (`lm-eval run`) means by them: `--tasks a,b` (names or glob patterns),
`--include_path DIR` (task YAMLs of your own), `--num_fewshot`, `--batch_size`, `--limit` (examples per task, or a
fraction below 1), `--seed`, `--bootstrap_iters`; the model flags are those of every eval recipe (`--checkpoint_dir`,
`--lora_path`, `--adapter_path`, `--precision`, `--accelerator`: lit_gpt/recipes/evaluate.py). The model is
lit_gpt/recipes/harness.py's `LitLM` (also usable inside the harness as `--model lit_gpt`); its scores are those of
the harness's `--model hf` backend on the same weights.

Output: progress bars (stderr), the harness's results table on stdout, and its results dict as JSON in
`--out_dir`/lm_eval.json (default: an eval/ folder beside the finetuned weights file, else in the checkpoint folder,
where eval/perplexity.py writes too), written atomically; should that fail after the work, the results are kept in a
temporary file that the error line names. Found before the model is loaded, each in one `error:` line, with nothing
written: an --out_dir that is a file or cannot be created, a task name the harness does not know, a task file that
is not valid YAML, a task whose data does not load, a --num_fewshot larger than the task's examples. Harness tasks read their data through `datasets`: offline, a task's
`dataset_path` must be local (`dataset_path: json` with `dataset_kwargs: {data_files: ...}`; see
tutorials/evaluate.md).
"""

import sys
from pathlib import Path

# this file is named like the harness's package: its folder must not shadow `import lm_eval`
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from typing import Any, List, Optional  # noqa: E402

from lit_gpt.recipes.evaluate import EVAL_FLAGS, check_eval_args, load_eval_model  # noqa: E402
from lit_gpt.recipes.flags import Flag, command, values  # noqa: E402
from lit_gpt.utils import LitError, run_cli  # noqa: E402

FLAGS: List[Flag] = [
    Flag("tasks", str, "", 'Harness task names or glob patterns, comma-separated ("list": print every task and exit).'),
    *EVAL_FLAGS,
    Flag("include_path", Optional[Path], None, "A folder of task YAMLs of your own (searched before the harness's)."),
    Flag("num_fewshot", Optional[int], None, "Examples in each prompt (default: the task's own, else 0)."),
    Flag("batch_size", int, 1,
         "Requests per forward (loglikelihood) and prompts per generation batch (on XLA every batch is padded to\n"
         "this many rows)."),
    Flag("limit", Optional[float], None, "Examples per task (a number), or a fraction of each task (below 1)."),
    Flag("out_dir", Optional[Path], None,
         "Where lm_eval.json goes (default: an eval/ folder beside the finetuned weights file, else in the\n"
         "checkpoint folder)."),
    Flag("seed", int, 1234, "Seed of the harness's choice of examples and few-shot prompts, and of sampling."),
    Flag("bootstrap_iters", int, 100000, "Bootstrap resamples for the stderr of metrics that need one (0: none)."),
]


def main(**flags: Any) -> None:
    from lit_gpt.recipes.evaluate import default_out_dir
    from lit_gpt.recipes.harness import (
        RESULTS_FILE, LitLM, check_task_data, evaluate, list_tasks, resolve_tasks, results_json, results_table,
    )
    from lit_gpt.recipes.outputs import check_output_dir, write_results

    if str(flags["tasks"]).strip() == "list":
        print(list_tasks(flags["include_path"]))
        return
    model_flags = values(flags, EVAL_FLAGS)
    _, finetuned = check_eval_args(**{k: v for k, v in model_flags.items() if k != "allow_other_base"})  # no weights
    if flags["batch_size"] < 1:
        raise LitError(f"--batch_size must be >= 1, got {flags['batch_size']}")
    if flags["num_fewshot"] is not None and flags["num_fewshot"] < 0:
        raise LitError(f"--num_fewshot must be >= 0, got {flags['num_fewshot']}")
    if flags["limit"] is not None and flags["limit"] <= 0:
        raise LitError(f"--limit must be > 0, got {flags['limit']}")
    out_dir = Path(flags["out_dir"] or default_out_dir(flags["checkpoint_dir"], finetuned))
    check_output_dir(out_dir, "--out_dir")  # where the results go: before the work, not after it
    manager, names = resolve_tasks(flags["tasks"], flags["include_path"])  # unknown tasks: before the model loads
    check_task_data(manager, names, flags["num_fewshot"])  # each task's data loads, and has enough few-shot examples

    loaded = load_eval_model(**model_flags)
    print("Prompt style: raw (each task's own prompt format, no chat template)", file=sys.stderr)
    loaded.runtime.seed(flags["seed"])
    lm = LitLM(loaded.model, loaded.tokenizer, loaded.runtime, batch_size=flags["batch_size"], name=loaded.name,
               seed=flags["seed"])
    compiles = loaded.runtime.compile_count()
    results = evaluate(lm, manager, names, flags["num_fewshot"], flags["limit"], flags["seed"],
                       flags["bootstrap_iters"])
    results["config"].update(precision=loaded.precision, accelerator=loaded.device.type,
                             checkpoint_dir=str(loaded.checkpoint_dir),
                             finetuned_path=None if loaded.finetuned_path is None else str(loaded.finetuned_path))
    if loaded.runtime.compiles_graphs:
        results["config"]["xla_compilations"] = loaded.runtime.compile_count() - compiles
        results["config"]["xla_compilations_per_bucket"] = {f"{step} {length}": n for (step, length), n in
                                                            sorted(lm.compiles_per_bucket.items())}
        print(f"XLA compilations: {results['config']['xla_compilations']}", file=sys.stderr)
    print(results_table(results))
    path = write_results(out_dir / RESULTS_FILE, results_json(results))  # if that fails: kept elsewhere, named
    print(f"Results written to {path}", file=sys.stderr)


setup = command("Evaluate a checkpoint (base, LoRA, adapter or full finetune) on tasks of the LM Evaluation Harness.",
                FLAGS, main)

if __name__ == "__main__":
    run_cli(setup)
