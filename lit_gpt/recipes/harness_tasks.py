"""eval/lm_eval.py's steps around the harness: the tasks named on the command line (checked before the model loads),
the harness's `simple_evaluate` on our model (`lit_gpt.recipes.harness.LitLM`) with the chat flags, and what is
written: the results JSON, its table, the per-sample files."""

from typing import Any, Dict, Iterator, List, Optional, Tuple

from lm_eval import utils as lm_utils

from lit_gpt.utils import LitError

# ---------------------------------------------------------------------------------------------------------------
# the recipe's steps (eval/lm_eval.py)
# ---------------------------------------------------------------------------------------------------------------
RESULTS_FILE = "lm_eval.json"
LIST_HINT = "list them with `python eval/lm_eval.py --tasks list` (tasks of your own: --include_path DIR)"


def task_names(tasks: str) -> List[str]:
    names = [t.strip() for t in str(tasks or "").split(",") if t.strip()]
    if not names:
        raise LitError(f"--tasks is empty: name harness tasks, e.g. --tasks hellaswag,arc_easy ({LIST_HINT})")
    return names


def resolve_tasks(tasks: str, include_path: Optional[Any] = None,
                  include_defaults: bool = True) -> Tuple[Any, List[str]]:
    """(TaskManager, task names) for `--tasks a,b` and `--include_path DIR`; a name the harness does not know is one
    LitError line, before any model is loaded. The harness's own ~14,000 task files take half a minute to index:
    they are read only when a name is not among the `--include_path` tasks."""
    from lm_eval.tasks import TaskManager

    names = task_names(tasks)
    if include_path is not None:
        from pathlib import Path

        if not Path(include_path).is_dir():
            raise LitError(f"--include_path {str(include_path)!r} is not a folder: pass the folder of your task YAMLs")
        manager = TaskManager(include_path=str(include_path), include_defaults=False)
        if set(manager.match_tasks(names)) >= set(names) or not include_defaults:
            return _checked(manager, names, include_path)
        # a name missing from --include_path because its own file there does not parse: said now, before the
        # harness's task files are indexed (which would only end in "unknown task")
        missing = [n for n in names if n not in manager.match_tasks(names)]
        broken = _broken_yaml(include_path, missing)
        if broken is not None:
            raise _yaml_error(broken, missing)
    manager = TaskManager(include_path=None if include_path is None else str(include_path),
                          include_defaults=include_defaults)
    return _checked(manager, names, include_path)


def _checked(manager: Any, names: List[str], include_path: Optional[Any] = None) -> Tuple[Any, List[str]]:
    known = set(manager.all_tasks)
    unknown = [n for n in names if n not in known and not manager.match_tasks([n])]
    if unknown:
        # the harness skips a task file it cannot parse (a log line): its task is then "unknown", the wrong cause
        broken = _broken_yaml(include_path) if include_path is not None else None
        if broken is not None:
            raise _yaml_error(broken, unknown)
        raise LitError(f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: {LIST_HINT}")
    return manager, [m for n in names for m in ([n] if n in known else manager.match_tasks([n]))]


def _yaml_error(broken: Tuple[str, str], unknown: List[str]) -> LitError:
    return LitError(f"task file {broken[0]!r} is not valid YAML ({broken[1]}): fix it (the harness skips it, so"
                    f" {', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} unknown)")


def _broken_yaml(include_path: Any, names: Optional[List[str]] = None) -> Optional[Tuple[str, str]]:
    """The first task file under `include_path` that is not valid YAML, and why (line and column); with `names`,
    only a file named after one of them or whose text says `task: NAME`."""
    import re
    from pathlib import Path

    import yaml

    class Loader(yaml.SafeLoader):  # the harness's tags (!function ...) are not syntax errors
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    for path in sorted(Path(include_path).rglob("*.yaml")):
        try:
            text = path.read_text(encoding="utf-8")
            if names is not None and path.stem not in names and not any(
                    re.search(rf"^task:\s*['\"]?{re.escape(n)}['\"]?\s*$", text, re.MULTILINE) for n in names):
                continue
            yaml.load(text, Loader=Loader)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            return str(path), f"{getattr(e, 'problem', None) or e}{where}"
        except (OSError, UnicodeDecodeError) as e:
            return str(path), f"cannot read it: {e}"
    return None


def check_task_data(manager: Any, names: List[str], num_fewshot: Optional[int]) -> None:
    """Every task's data loads and holds enough examples for its few-shot prompts: found before the model is
    loaded (one LitError line), not as a traceback after it. The datasets library caches what is read here."""
    from lm_eval.tasks import get_task_dict

    try:
        tasks = get_task_dict(names, manager)
    except (OSError, ValueError) as e:  # a data file not found (FileNotFoundError), a dataset not cached offline
        raise LitError(f"cannot load the data of task(s) {', '.join(map(repr, names))}: {str(e).splitlines()[0]}"
                       " (check dataset_path / dataset_kwargs in the task's YAML)") from None

    def leaves(d: Any) -> Iterator[Any]:
        for value in d.values():
            if isinstance(value, dict):
                yield from leaves(value)
            else:
                yield value

    for task in leaves(tasks):
        shots = num_fewshot if num_fewshot is not None else getattr(task.config, "num_fewshot", None)
        if not shots:
            continue
        docs = task.fewshot_docs()
        available = len(docs) if docs is not None else 0
        # the harness draws shots + 1 examples and drops the one being evaluated
        if shots >= available:
            name = getattr(task.config, "task", "?")
            raise LitError(f"task {name!r} has {available} example(s) to draw few-shot prompts from, fewer than"
                           f" {shots} + 1 (the one evaluated is left out): pass --num_fewshot {max(available - 1, 0)}"
                           " or less")


def list_tasks(include_path: Optional[Any] = None) -> str:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=None if include_path is None else str(include_path)).list_all_tasks()


def evaluate(lm: Any, manager: Any, names: List[str], num_fewshot: Optional[int] = None,
             limit: Optional[float] = None, seed: int = 1234, bootstrap_iters: int = 100000,
             apply_chat_template: Any = False, system_instruction: Optional[str] = None,
             fewshot_as_multiturn: Optional[bool] = None, log_samples: bool = False) -> Optional[Dict[str, Any]]:
    """The harness's `simple_evaluate` on `lm`: its results dict (with `samples` only if `log_samples`), plus the
    seconds of model time each task took (`task_seconds`: `LitLM.task_seconds`). The chat flags mean what the
    harness's CLI means: `apply_chat_template` True (the model's template) or a prompt style's name;
    `fewshot_as_multiturn` None: on with a chat template (an error without one)."""
    from lm_eval import simple_evaluate

    if limit is not None and float(limit) == int(limit):
        limit = int(limit)
    fewshot_as_multiturn = resolve_multiturn(apply_chat_template, fewshot_as_multiturn)
    if isinstance(apply_chat_template, str):
        lm.prompt_style = apply_chat_template
    lm.task_seconds = {}
    results = simple_evaluate(model=lm, tasks=names, num_fewshot=num_fewshot, batch_size=lm.batch_size, limit=limit,
                              task_manager=manager, log_samples=log_samples, bootstrap_iters=bootstrap_iters,
                              random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                              fewshot_random_seed=seed, apply_chat_template=bool(apply_chat_template),
                              system_instruction=system_instruction, fewshot_as_multiturn=fewshot_as_multiturn)
    spent = lm.gather_object(lm.task_seconds)  # every rank's seconds per task: the slowest rank's are the task's
    if results is None:  # a rank other than 0 (--devices N): its results were gathered on rank 0
        return None
    if not log_samples:
        results.pop("samples", None)
    results["config"]["model"] = lm.name
    tasks = sorted({k for s in spent for k in s})
    results["task_seconds"] = {k: round(max(s.get(k, 0.0) for s in spent), 3) for k in tasks}
    if apply_chat_template:
        style = lm.style()
        results["chat_template"] = lm.chat_template(True)
        results["chat_template_sha"] = lm_utils.hash_string(results["chat_template"])
        results["prompt_style"] = style.name
    else:
        results["chat_template"], results["prompt_style"] = None, "raw (each task's own prompt format)"
    results["system_instruction"] = system_instruction
    results["fewshot_as_multiturn"] = fewshot_as_multiturn
    return results


def resolve_multiturn(apply_chat_template: Any, fewshot_as_multiturn: Optional[bool]) -> bool:
    """--fewshot_as_multiturn as the harness's CLI resolves it: on by default with a chat template, refused
    without one."""
    if fewshot_as_multiturn is None:
        return bool(apply_chat_template)
    if fewshot_as_multiturn and not apply_chat_template:
        raise LitError("--fewshot_as_multiturn true needs --apply_chat_template (few-shot examples become turns of"
                       " the chat)")
    return bool(fewshot_as_multiturn)


def write_samples(results: Dict[str, Any], results_path: Any) -> List[str]:
    """The harness's per-sample files (`samples_TASK_DATE.jsonl`, written by its `EvaluationTracker`) beside the
    results file; returns their paths."""
    from pathlib import Path

    from lm_eval.loggers import EvaluationTracker

    from datetime import datetime

    tracker = EvaluationTracker(output_path=str(results_path))
    # the harness's own file stamp (its `save_results_aggregated` sets it; the aggregated results are ours)
    tracker.date_id = datetime.now().isoformat().replace(":", "-")
    for task, samples in results.get("samples", {}).items():
        tracker.save_results_samples(task_name=task, samples=samples)
    return sorted(str(p) for p in Path(results_path).parent.glob(f"samples_*_{tracker.date_id}.jsonl"))


def results_json(results: Dict[str, Any]) -> str:
    """The harness's results dict as the JSON text of lm_eval.json (eval/lm_eval.py writes it with
    `lit_gpt.recipes.outputs.write_results`: atomically, kept elsewhere if that fails)."""
    import json

    return json.dumps(results, indent=2, default=lm_utils.handle_non_serializable, ensure_ascii=False)


def results_table(results: Dict[str, Any]) -> str:
    table = lm_utils.make_table(results)
    if results.get("groups"):
        table += "\n" + lm_utils.make_table(results, "groups")
    return table
