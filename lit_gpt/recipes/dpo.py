"""The DPO recipes' own steps (finetune/dpo.py on CPU/CUDA, xla/finetune/dpo.py on XLA devices). DPO is an
objective of the one training loop (`lit_gpt.objectives.DPO`, `lit_gpt.training.fit`), not a second loop: what is
here is only what a preference run adds to a LoRA or full finetune.

    run = finish(flags, run)                     # --method lora|full and --dpo.* -> the run's method and objective
    data = load_run_data(runtime, run)           # prepared preference pairs (scripts/prepare_preferences.py)
    model ...                                    # LoRA on the frozen base, or every weight (as the SFT recipes)
    with_reference(runtime, model, data, run)    # --dpo.reference precomputed: one pass before training
    fit(...)                                     # the loop; checkpoints, resume and export as for SFT
"""

import io
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Literal

import torch
import torch.nn as nn

from lit_gpt.args import DPOArgs
from lit_gpt.objectives import DPO, check_dpo, reference_logps
from lit_gpt.peft import base_config
from lit_gpt.recipes.finetune import FinetuneRun
from lit_gpt.recipes.flags import Flag
from lit_gpt.storage import location
from lit_gpt.training import RunData
from lit_gpt.utils import LitError

REFERENCE_FILE = "reference_logps.pt"

METHOD = Flag("method", Literal["lora", "full"], "lora",
              '"lora": LoRA adapters on the frozen base (the --lora_* flags); "full": every weight trains.')
DPO_FLAG = Flag("dpo", DPOArgs, DPOArgs(), "The preference loss (TRL's names) and the reference model.")
DPO_FLAGS = [METHOD, DPO_FLAG]


def check(flags: Dict[str, Any]) -> None:
    """The DPO settings, before anything loads."""
    dpo: DPOArgs = flags["dpo"]
    if flags["method"] not in ("lora", "full"):
        raise LitError(f"--method must be 'lora' or 'full', got {flags['method']!r}")
    check_dpo(dpo.beta, dpo.loss, dpo.label_smoothing, dpo.reference)
    dpo.resolve(flags["method"])


def finish(flags: Dict[str, Any], run: FinetuneRun) -> FinetuneRun:
    """The run with the chosen method (a full finetune's config without the LoRA fields: its export is a plain
    checkpoint) and the DPO objective."""
    dpo: DPOArgs = flags["dpo"]
    method = flags["method"]
    objective = DPO(beta=dpo.beta, loss_type=dpo.loss, label_smoothing=dpo.label_smoothing,
                    reference=dpo.resolve(method))
    config = run.config if method == "lora" else base_config(run.config)
    return replace(run, method=method, config=config, objective=objective)


def _key(run: FinetuneRun, data: RunData, model: nn.Module) -> Dict[str, Any]:
    dtype = next((str(p.dtype) for p in model.parameters()), "")
    return {"base": (run.base or {}).get("fingerprint"), "data_dir": str(run.data.data_dir),
            "tokenizer": data.prepared.meta.get("tokenizer", {}).get("sha256"), "max_seq_length": data.max_seq_length,
            "data": data.prepared.meta.get("fingerprint"),  # other pairs of the same counts get their own values
            "dtype": dtype, "train": len(data.prepared.train), "val": len(data.prepared.val)}


def with_reference(runtime: Any, model: nn.Module, data: RunData, run: FinetuneRun) -> None:
    """For `--dpo.reference precomputed`: the base model's log-probabilities of every pair's two replies, computed
    once before training (nothing for adapters_off), added to the samples (so every batch carries them) and kept in
    out_dir/reference_logps.pt: a resumed or repeated run with the same base, data, length and dtype reads them
    instead of computing them again. Memory: two floats per pair; time: one forward pass over the data, split over
    the processes (each computes its chunks of `rows` pairs, all gather the rest; rank 0 writes the file)."""
    objective = run.objective
    if not isinstance(objective, DPO) or objective.reference != "precomputed":
        return
    fabric = runtime.fabric
    samples: List[Dict[str, torch.Tensor]] = list(data.prepared.train) + list(data.prepared.val)
    key = _key(run, data, model)
    path = location(run.out_dir) / REFERENCE_FILE
    values = _read(path, key)
    if values is None:
        from tqdm import tqdm

        from lit_gpt.training import gather_objects

        # DDP/FSDP processes each compute a share of the pairs and gather the rest; under SPMD (XLA, grad_scale 1)
        # one process feeds all its devices: the mesh's data axis already splits each forward's pairs over them
        split = fabric.world_size > 1 and runtime.grad_scale != 1.0
        rank, processes = (fabric.global_rank, fabric.world_size) if split else (0, 1)
        computed = [0]  # pairs this process ran through the model

        def progress(k: int) -> None:
            computed[0] += k
            bar.update(k)

        bar = tqdm(total=-(-len(samples) // processes), desc="reference log-probabilities",
                   disable=fabric.global_rank != 0, dynamic_ncols=True, file=sys.stdout)
        values = reference_logps(
            model, objective, samples, data.rows, data.max_seq_length, runtime.place, runtime.end_step,
            pad_multiple=data.val_args["pad_multiple"], pad_pow2=data.val_args["pad_pow2"], progress=progress,
            targets_only=runtime.targets_only, rank=rank, world_size=processes,
            gather=lambda obj: gather_objects(fabric, obj))
        bar.close()
        if split:  # every process says its share (a test reads these lines)
            print(f"Process {rank} of {processes} computed the reference log-probabilities of {computed[0]} of"
                  f" {len(samples)} pairs", flush=True)
        if fabric.global_rank == 0:
            buffer = io.BytesIO()
            torch.save({"key": key, "logps": torch.stack(values)}, buffer)
            path.write_bytes(buffer.getvalue())
        fabric.print(f"Reference log-probabilities of {len(samples)} pairs saved to {path}")
    else:
        fabric.print(f"Reference log-probabilities of {len(samples)} pairs read from {path}")
    for sample, value in zip(samples, values):
        sample["ref_logps"] = value
    data.rebatch_val()


def _read(path: Path, key: Dict[str, Any]) -> Any:
    """The stored values if the file is there and was computed for `key`; else None (computed again)."""
    try:
        if not path.is_file():
            return None
        stored = torch.load(io.BytesIO(path.read_bytes()), weights_only=True)
    except Exception:  # an unreadable file is computed again and overwritten
        return None
    if not isinstance(stored, dict) or stored.get("key") != key:
        return None
    logps = stored.get("logps")
    if not isinstance(logps, torch.Tensor) or logps.shape != (key["train"] + key["val"], 2):
        return None
    return list(logps.unbind(0))
