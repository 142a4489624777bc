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
fraction below 1), `--seed`, `--bootstrap_iters`, `--apply_chat_template` (true: the checkpoint's template; or a
prompt style's name), `--system_instruction`, `--fewshot_as_multiturn`, `--log_samples`; `--devices N` splits the
examples over N processes (CPU/GPU, gloo; on XLA the mesh's data axis splits every batch); the model flags are those of every eval recipe (`--checkpoint_dir`,
`--lora_path`, `--adapter_path`, `--precision`, `--accelerator`: lit_gpt/recipes/evaluate.py). The model is
lit_gpt/recipes/harness.py's `LitLM` (also usable inside the harness as `--model lit_gpt`); its scores are those of
the harness's `--model hf` backend on the same weights.

Output: progress bars (stderr), the harness's results table on stdout, and its results dict as JSON (plus the
checkpoint's and its base's fingerprints, the finetuned weights file, the prompt style and the seconds per task) in
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

from typing import Any, List, Optional, Union  # noqa: E402

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
    Flag("apply_chat_template", Union[bool, str], False,
         'Prompts through a chat template, as the harness\'s flag: true (the checkpoint\'s own template) or a prompt\n'
         'style\'s name ("chat", "alpaca", "raw": lit_gpt/prompts.py). Default false: each task\'s raw prompt.'),
    Flag("system_instruction", Optional[str], None, "A system message put before every prompt."),
    Flag("fewshot_as_multiturn", Optional[bool], None,
         "Few-shot examples as turns of the chat (default: true with --apply_chat_template; needs it)."),
    Flag("devices", Optional[int], None,
         "Split the requests over this many devices: processes on the CPU or GPUs (over gloo; the results gathered\n"
         "on rank 0, written once). On XLA the requests are split over the mesh's data axis, which holds every\n"
         "device (default: 1 on CPU/GPU, all devices on XLA)."),
    Flag("log_samples", bool, False,
         "Also write the harness's per-sample files (samples_TASK_DATE.jsonl: each prompt, response and score)\n"
         "beside lm_eval.json."),
]


def main(**flags: Any) -> None:
    from lit_gpt.recipes.evaluate import default_out_dir
    from lit_gpt.recipes.harness_tasks import check_task_data, list_tasks, resolve_multiturn, resolve_tasks
    from lit_gpt.recipes.outputs import check_output_dir

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
    devices = _check_devices(flags["devices"], model_flags["accelerator"])
    chat = flags["apply_chat_template"]
    resolve_multiturn(chat, flags["fewshot_as_multiturn"])  # refused without a chat template: before the work
    style = _prompt_style(chat, flags["checkpoint_dir"])  # an unknown style or no template: before the work
    out_dir = Path(flags["out_dir"] or default_out_dir(flags["checkpoint_dir"], finetuned))
    check_output_dir(out_dir, "--out_dir")  # where the results go: before the work, not after it
    manager, names = resolve_tasks(flags["tasks"], flags["include_path"])  # unknown tasks: before the model loads
    check_task_data(manager, names, flags["num_fewshot"])  # each task's data loads, and has enough few-shot examples

    if devices > 1:  # one process per device (CPU / GPU), each evaluating its share of every task's examples
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as sock:  # a free port for the processes' rendezvous
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        # forked, not spawned: nothing re-runs this script (whose path a wrapper may have changed), and nothing has
        # started a device or torch's threads yet (as Lightning's "ddp_fork" strategy does)
        mp.start_processes(_worker, args=(devices, port, flags, out_dir), nprocs=devices, join=True,
                           start_method="fork" if sys.platform == "linux" else "spawn")
        return
    _evaluate(flags, out_dir, manager, names, style)


def _worker(rank: int, world_size: int, port: int, flags: dict, out_dir: Path) -> None:
    """One of --devices processes: joins the gloo group, loads the model on its device, evaluates its share."""
    import os

    import torch.distributed as dist

    from lit_gpt.recipes.harness_tasks import resolve_tasks

    if str(flags["accelerator"]).lower() in ("cuda", "auto"):
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", str(rank))  # before CUDA starts: one GPU per process
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        manager, names = resolve_tasks(flags["tasks"], flags["include_path"])
        _evaluate(flags, out_dir, manager, names, _prompt_style(flags["apply_chat_template"], flags["checkpoint_dir"]),
                  rank=rank, world_size=world_size)
    finally:
        dist.destroy_process_group()


def _check_devices(devices: Optional[int], accelerator: str) -> int:
    if devices is None:
        return 1
    if devices < 1:
        raise LitError(f"--devices must be >= 1, got {devices}")
    if str(accelerator).lower() == "xla":
        from lit_gpt.xla import pjrt_device_count

        have = pjrt_device_count()
        if devices != have:
            raise LitError(f"--devices {devices} on XLA: the mesh holds all {have} devices (its data axis splits the"
                           " requests); leave --devices out, or set the device count (CPU_NUM_DEVICES on XLA:CPU)")
        return 1  # one process: the mesh splits the rows of every batch
    return devices


def _evaluate(flags: dict, out_dir: Path, manager: Any, names: List[str], style: Any, rank: int = 0,
              world_size: int = 1) -> None:
    """Load the model, run the tasks (this process's share of them with world_size > 1), and on rank 0 print the
    table and write the results."""
    from lit_gpt.recipes.harness import LitLM
    from lit_gpt.recipes.harness_tasks import RESULTS_FILE, evaluate, results_json, results_table, write_samples
    from lit_gpt.recipes.outputs import write_results

    chat = flags["apply_chat_template"]
    model_flags = values(flags, EVAL_FLAGS)
    loaded = load_eval_model(**model_flags)
    if rank == 0:
        print(f"Prompt style: {_describe(style, chat)}", file=sys.stderr)
    loaded.runtime.seed(flags["seed"])
    lm = LitLM(loaded.model, loaded.tokenizer, loaded.runtime, batch_size=flags["batch_size"], name=loaded.name,
               seed=flags["seed"], prompt_style=style, rank=rank, world_size=world_size, progress=rank == 0)
    compiles = loaded.runtime.compile_count()
    results = evaluate(lm, manager, names, flags["num_fewshot"], flags["limit"], flags["seed"],
                       flags["bootstrap_iters"], apply_chat_template=bool(chat), log_samples=flags["log_samples"],
                       system_instruction=flags["system_instruction"], fewshot_as_multiturn=flags["fewshot_as_multiturn"])
    if results is None:  # another rank than 0: its results were gathered there
        return
    results["config"]["devices"] = world_size if world_size > 1 else loaded.runtime.data_parallel_size
    results["config"].update(precision=loaded.precision, accelerator=loaded.device.type,
                             checkpoint_dir=str(loaded.checkpoint_dir), method=loaded.method,
                             finetuned_path=None if loaded.finetuned_path is None else str(loaded.finetuned_path),
                             **_fingerprints(loaded))
    if loaded.runtime.compiles_graphs:
        results["config"]["xla_compilations"] = loaded.runtime.compile_count() - compiles
        results["config"]["xla_compilations_per_bucket"] = {f"{step} {length}": n for (step, length), n in
                                                            sorted(lm.compiles_per_bucket.items())}
        print(f"XLA compilations: {results['config']['xla_compilations']}", file=sys.stderr)
    print(results_table(results))
    samples = results.pop("samples", None)
    path = write_results(out_dir / RESULTS_FILE, results_json(results))  # if that fails: kept elsewhere, named
    print(f"Results written to {path}", file=sys.stderr)
    if samples is not None:
        for written in write_samples({"samples": samples}, path):
            print(f"Samples written to {written}", file=sys.stderr)


def _prompt_style(chat: Union[bool, str], checkpoint_dir: Path) -> Any:
    """The prompt style of --apply_chat_template: None without it, the checkpoint's template for true, else the
    named style (one `error:` line for an unknown name or a checkpoint without a template)."""
    from lit_gpt.prompts import ChatTemplate, PromptStyle

    if chat is False or chat is None or (isinstance(chat, str) and chat.lower() == "false"):
        return None
    if chat is True or (isinstance(chat, str) and chat.lower() == "true"):
        return ChatTemplate.from_checkpoint(checkpoint_dir)
    return PromptStyle.from_name(chat, checkpoint_dir)


def _describe(style: Any, chat: Union[bool, str]) -> str:
    if style is None:
        return "raw (each task's own prompt format, no chat template; --apply_chat_template true to use one)"
    how = "the checkpoint's chat template" if chat is True or str(chat).lower() == "true" else f"--apply_chat_template {chat}"
    return f"{style.name} ({how})"


def _fingerprints(loaded: Any) -> dict:
    """What identifies the weights evaluated: the fingerprint of --checkpoint_dir's weights, and of the base they
    were finetuned from (a full finetune's recorded base; the checkpoint itself for a base model or with
    --lora_path / --adapter_path)."""
    from lit_gpt.fingerprint import fingerprint
    from lit_gpt.weights import check_checkpoint_dir, read_base_record

    own = fingerprint(loaded.checkpoint_dir)
    base = None
    if loaded.finetuned_path is None:
        record = read_base_record(check_checkpoint_dir(loaded.checkpoint_dir))
        base = record.get("fingerprint") if isinstance(record, dict) else None
    return {"checkpoint_fingerprint": own, "base_fingerprint": base or own}


setup = command("Evaluate a checkpoint (base, LoRA, adapter or full finetune) on tasks of the LM Evaluation Harness.",
                FLAGS, main)

if __name__ == "__main__":
    run_cli(setup)
