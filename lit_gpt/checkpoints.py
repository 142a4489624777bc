"""Step checkpoints and resuming, for the one training loop (`lit_gpt.training.fit`).

`out_dir/step-000010/` holds the trained weights, the optimizer and the train state (step, data position, every
RNG of every process), stored by the backend's runtime (`Runtime.save_step`: Fabric's checkpoint file on CPU/CUDA,
per-host DCP shards on XLA), next to the base model's config and tokenizer files and the run's arguments
(`finetune.json`). A resumed run must be the same run: `check_same_run` compares the arguments that decide what
is computed.
"""

import json
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

import torch.nn as nn

from lit_gpt.fingerprint import check_base
from lit_gpt.manifest import MANIFEST
from lit_gpt.runtime import Runtime
from lit_gpt.storage import location
from lit_gpt.utils import LitError

COPIED_FILES = (
    "lit_config.json",
    "config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
RUN_FILE = "finetune.json"
# arguments that may change between a run and its resumption: they do not change what is computed
# (and the run's length: a resumed run may be extended or cut, which changes its schedule from then on)
RESUMABLE_CHANGES = {"train.save_interval", "train.log_interval", "train.max_steps", "train.epochs", "eval",
                     "logger_name"}


def step_dir(out_dir: Path, step: int) -> Path:
    return location(out_dir) / f"step-{step:06d}"


def copy_model_files(checkpoint_dir: Path, destination: Path) -> None:
    """The base config and tokenizer next to the weights: a checkpoint directory is then self-describing."""
    for name in COPIED_FILES:
        src = Path(checkpoint_dir) / name
        if src.is_file():
            shutil.copy2(src, Path(destination) / name)


def run_files(checkpoint_dir: Path, run_config: Optional[Dict[str, Any]]) -> Callable[[Path], None]:
    """What every checkpoint folder gets beside the weights, before it is committed."""

    def write(folder: Path) -> None:
        copy_model_files(checkpoint_dir, folder)
        if run_config is not None:
            (Path(folder) / RUN_FILE).write_text(json.dumps(run_config, indent=2, default=str) + "\n")

    return write


def _flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def check_same_run(saved: Dict[str, Any], current: Dict[str, Any], path: Path, allow_other_base: bool = False,
                   allow_other_data: bool = False) -> None:
    """A resumed run must compute what the interrupted one would have: refuse when the arguments that decide it
    differ (only logging, validation and checkpoint intervals may change), when --checkpoint_dir now holds other
    base weights than the run started from (their fingerprints differ; `allow_other_base` lets it through with one
    line), or when --data.data_dir now holds other prepared data (`check_same_data`; `allow_other_data`). The same
    base or the same data found under another path is the same run."""
    a = json.loads(json.dumps(saved, default=str))
    b = json.loads(json.dumps(current, default=str))
    if a.get("rope_scaling") != b.get("rope_scaling"):  # absent in both: the checkpoint's own RoPE (runs before)
        raise LitError(
            f"the run in {str(path)!r} started with --rope_scaling {json.dumps(a.get('rope_scaling'))}, this one has"
            f" --rope_scaling {json.dumps(b.get('rope_scaling'))}: resume with the run's --rope_scaling, or start a new"
            " run in a new --out_dir"
        )
    ignored = set(RESUMABLE_CHANGES) | {"base", "prepared"}  # runs of earlier versions recorded neither
    if isinstance(a.get("base"), dict) and isinstance(b.get("base"), dict):
        check_base(a["base"], b.get("checkpoint_dir"), allow_other_base, f"the run in {str(path)!r}",
                   actual=b["base"].get("fingerprint"))
        ignored.add("checkpoint_dir")  # compared by what it holds, not where it is
    if isinstance(a.get("prepared"), dict) and isinstance(b.get("prepared"), dict):
        check_same_data(a["prepared"], b["prepared"], path, allow_other_data)
        ignored.add("data.data_dir")  # compared by what it holds, not where it is
    fa, fb = _flatten(a), _flatten(b)
    differ = sorted(
        k for k in set(fa) | set(fb)
        if fa.get(k) != fb.get(k) and not any(k == p or k.startswith(p + ".") for p in ignored)
    )
    if differ:
        shown = "; ".join(f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in differ[:3])
        more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
        raise LitError(
            f"{str(path)!r} belongs to a run with other arguments ({shown}{more}): resume with the same arguments,"
            " or start a new run in a new --out_dir"
        )


def check_same_data(saved: Dict[str, Any], current: Dict[str, Any], path: Path, allow_other_data: bool) -> None:
    """Refuse, in one LitError line naming both, to resume a run on other prepared data than it trained on (the
    fingerprints of `lit_gpt.data.prepared_record` differ: other rows, another split, tokenizer or prompt style),
    e.g. after its --data.data_dir was prepared again from another file; `allow_other_data` makes it one warning
    line instead (the data position, epoch and index, then continues on the new data)."""
    if saved.get("fingerprint") == current.get("fingerprint"):
        return

    def details(r: Dict[str, Any]) -> str:
        return f"from {r.get('source')!r}, {r.get('samples')} samples, {r.get('fingerprint')}"

    moved = current.get("data_dir") != saved.get("data_dir")
    where = f"--data.data_dir {current.get('data_dir')!r}" if moved else "that folder now"
    mismatch = (f"the run in {str(path)!r} trained on the prepared data in {saved.get('data_dir')!r}"
                f" ({details(saved)}), but {where} holds other data ({details(current)})")
    if not allow_other_data:
        raise LitError(f"{mismatch}: resume with the data it trained on, start a new run in a new --out_dir, or pass"
                       " --allow_other_data true to continue on this data")
    print(f"warning: {mismatch}; continuing on it anyway (--allow_other_data true)", file=sys.stderr)


def resume_path(runtime: Runtime, resume: Union[bool, str, Path], out_dir: Path) -> Optional[Path]:
    """`--resume`: False = start fresh; "auto" = the newest intact checkpoint in out_dir if any (steps that are
    incomplete or damaged are skipped, with one line); True = the newest intact one, which must exist; a path = that
    step checkpoint, which must be whole (checked against its manifest)."""
    if resume is False or resume is None or resume == "false":
        return None
    if resume in (True, "auto", "true"):
        found = runtime.latest_step(out_dir)
        if found is None and resume != "auto":
            raise LitError(f"--resume: no complete checkpoint in {str(out_dir)!r}; use --resume auto to start fresh")
        return found
    path = location(resume)
    if not path.exists():
        raise LitError(f"--resume {str(path)!r} does not exist")
    if path.is_file():  # the weights file of a step folder
        path = path.parent
    if not runtime.step_file(path).is_file() and not (path / MANIFEST).is_file():
        raise LitError(
            f"--resume {str(path)!r} is not a step checkpoint of this recipe (no {runtime.step_file(path).name}):"
            " pass an out_dir/step-XXXXXX folder that it wrote"
        )
    problem = runtime.step_problem(path)
    if problem is not None:
        raise LitError(
            f"--resume {str(path)!r} is {problem}: resume from an earlier step (--resume auto picks the newest"
            " intact one)"
        )
    return path


def resume_run(
    runtime: Runtime, path: Path, model: nn.Module, optimizer: Any, method: Any, data: Any,
    run_config: Optional[Dict[str, Any]], allow_other_base: bool = False, allow_other_data: bool = False,
) -> Dict[str, Any]:
    """Restore model, optimizer, data position and every generator of every process from a step checkpoint."""
    saved_method = runtime.saved_method(path)
    if saved_method != method.name:
        raise LitError(
            f"{str(path)!r} was written by a {saved_method} finetuning run, not {method.name}: resume it with the"
            f" {saved_method} recipe, or pass a step folder of a {method.name} run"
        )
    saved_run = Path(path) / RUN_FILE
    if run_config is not None and saved_run.is_file():
        check_same_run(json.loads(saved_run.read_text()), run_config, path, allow_other_base, allow_other_data)
    state: Dict[str, Any] = {"model": model, "optimizer": optimizer, "train_state": None}
    runtime.load_step(path, state)
    train_state = state["train_state"]
    if not isinstance(train_state, dict):
        raise LitError(f"{str(path)!r} holds no training state (a final checkpoint?): resume from a step-XXXXXX one")
    rows = train_state.get("rows", data.rows)
    if rows != data.rows:
        raise LitError(
            f"{str(path)!r} was written with {rows} rows per forward (micro_batch_size x devices per process), this"
            f" run has {data.rows}: resume with the same --devices and --train.micro_batch_size"
        )
    data.train.load_state_dict(train_state["data"])
    rng = train_state["rng"]
    if len(rng) != runtime.fabric.world_size:
        raise LitError(f"{str(path)!r} was written by {len(rng)} processes: resume with as many")
    runtime.set_rng_state(rng[runtime.fabric.global_rank])
    return train_state

