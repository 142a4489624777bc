"""The recipes' command-line flags, written once.

Sibling recipes take the same flags with the same defaults and the same help: every finetune recipe on CPU/CUDA
takes `FINETUNE`, every XLA one `XLA_FINETUNE`, plus its method's own flags (`LORA`, `ADAPTER`, or none). A recipe's
`setup` is built by `command` from such a list: its signature and docstring are what jsonargparse turns into the
command line and `--help`, and a call checks its arguments as a written-out signature would (unknown names raise
TypeError). What a recipe may set differently is only a default (`with_defaults`: the output folder, the learning
rate), and tests/test_recipe_signatures.py names each difference.
"""

from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Sequence, Union

from lit_gpt.args import DataArgs, EvalArgs, MoEArgs, TrainArgs
from lit_gpt.cli import Flag, command, with_defaults  # noqa: F401  (the recipes import them from here)
from lit_gpt.utils import DEFAULT_CHECKPOINT_DIR

Precision = Literal["32-true", "bf16-true", "bf16-mixed", "16-true", "16-mixed"]


def values(flags: Dict[str, Any], group: Sequence[Flag]) -> Dict[str, Any]:
    """The values of one group's flags (e.g. a method's settings for its Config)."""
    return {f.name: flags[f.name] for f in group}


_OUT_DIR_DOC = ("Where checkpoints (step-XXXXXX/, final/) and logs go:\n"
                "a folder, or an fsspec URL such as gs://bucket/run (needs gcsfs) or s3://bucket/run (needs s3fs).")
_RESUME_DOC = ('Continue from a checkpoint: a step directory, True (the newest complete one in out_dir), or "auto"\n'
               "(the newest if there is one, else start fresh).")
_TRAIN_DOC = "Optimisation and checkpointing (micro_batch_size is per device)."
_ALLOW_OTHER_BASE_DOC = ("Resume although --checkpoint_dir holds other base weights than the run was started on (their\n"
                         "fingerprints differ): for experts who know the two bases are interchangeable.")
_ALLOW_OTHER_DATA_DOC = ("Resume although --data.data_dir holds other prepared data than the run trained on (their\n"
                         "fingerprints differ, e.g. it was prepared again from another file): the run continues on it.")
_MOE_DOC = ("Mixture-of-experts models only (Mixtral, Qwen3-MoE, gpt-oss): the experts' capacity in training and the\n"
            "weight of the router's load-balancing loss (default: the checkpoint's).")
_LOGGER_DOC = ('"csv", "tensorboard" or "wandb" (under out_dir/logs; W&B: project from WANDB_PROJECT,\n'
               "offline with WANDB_MODE=offline).")

# ---------------------------------------------------------------------------------------------------------------
# long context: the one definition of --rope_scaling (lit_gpt.config.with_rope_scaling; load_config takes it)
# ---------------------------------------------------------------------------------------------------------------
ROPE_SCALING = Flag(
    "rope_scaling", Optional[Dict[str, Any]], None,
    'Extend the checkpoint\'s context: RoPE scaled as transformers scales it, e.g. \'{"type": "yarn", "factor": 4}\'\n'
    '("linear", "yarn" or "llama3"; the context becomes factor x the checkpoint\'s). Refused for a model\n'
    "without RoPE or with its own scaling (it already reaches its context).")

# ---------------------------------------------------------------------------------------------------------------
# finetuning, CPU / CUDA (finetune/*.py)
# ---------------------------------------------------------------------------------------------------------------
FINETUNE: List[Flag] = [
    Flag("checkpoint_dir", Path, DEFAULT_CHECKPOINT_DIR, "The base model (a converted lit checkpoint directory)."),
    Flag("out_dir", str, "out/METHOD/alpaca", _OUT_DIR_DOC, url="output"),
    Flag("precision", Optional[Precision], None,
         '"32-true", "bf16-true", "bf16-mixed", "16-true" or "16-mixed" (default: bf16-true on GPUs\n'
         "that support it, else 32-true)."),
    Flag("devices", int, 1, "How many devices (GPUs, or CPU processes) to train on."),
    Flag("strategy", Literal["auto", "ddp", "fsdp"], "auto",
         '"auto" = FSDP on several GPUs, DDP on several CPU processes.'),
    Flag("resume", Union[bool, Literal["auto"], str], False, _RESUME_DOC, url="input"),
    Flag("optimizer", Literal["adamw", "sgd"], "adamw", '"adamw" or "sgd" (with momentum 0.9).'),
    Flag("data", DataArgs, DataArgs(), "Where the prepared data is and how it is batched."),
    Flag("train", TrainArgs, TrainArgs(), _TRAIN_DOC),
    Flag("eval", EvalArgs, EvalArgs(), "Validation."),
    Flag("moe", MoEArgs, MoEArgs(), _MOE_DOC),
    Flag("logger_name", Literal["csv", "tensorboard", "wandb"], "csv", _LOGGER_DOC),
    Flag("accelerator", Literal["auto", "cpu", "cuda"], "auto",
         '"cpu", "cuda" or "auto" (a GPU when one is visible, else the CPU).'),
    Flag("num_nodes", int, 1,
         "Machines to train on, `devices` processes each (launched by torchrun or SLURM on every node)."),
    Flag("peer_timeout", float, 1800.0,
         "Seconds to wait for the other processes: to join at start-up, and at each collective (rank 0's\n"
         "checkpoint save makes the others wait at a barrier: keep it above your longest save)."),
    Flag("allow_other_base", bool, False, _ALLOW_OTHER_BASE_DOC),
    Flag("allow_other_data", bool, False, _ALLOW_OTHER_DATA_DOC),
    ROPE_SCALING,
]

# ---------------------------------------------------------------------------------------------------------------
# finetuning on XLA devices (xla/finetune/*.py): the same run, plus the mesh and compilation settings
# ---------------------------------------------------------------------------------------------------------------
XLA_FINETUNE: List[Flag] = [
    Flag("checkpoint_dir", Path, DEFAULT_CHECKPOINT_DIR, "The base model (a converted lit checkpoint directory)."),
    Flag("out_dir", str, "out/xla/METHOD/alpaca",
         "Where sharded checkpoints (step-XXXXXX/), the final weights (final/) and logs go:\n"
         "a folder, or an fsspec URL such as gs://bucket/run (needs gcsfs) or s3://bucket/run (needs s3fs).",
         url="output"),
    Flag("precision", Optional[str], None,
         '"32-true", "bf16-true" or "bf16-mixed" (default: bf16-true on TPUs, else 32-true).'),
    Flag("devices", Union[int, str], "auto",
         '"auto" (all devices of the XLA runtime) or their number: the SPMD mesh spans all of them.'),
    Flag("resume", Union[bool, Literal["auto"], str], False, _RESUME_DOC, url="input"),
    Flag("activation_checkpointing", bool, False,
         "Recompute each block's activations in the backward pass (less memory, ~1/3\nmore compute)."),
    Flag("scan_layers", Union[bool, Literal["auto"]], "auto",
         "Run the blocks as one scanned layer (torch_xla's scan): the train step compiles in about the\n"
         'same time at any depth; steady steps are slower on XLA:CPU. "auto": from 32 blocks on (see\n'
         "bench/xla_scan.py), where jax and flax are installed (torch_xla's scan needs them under SPMD)."),
    Flag("optimizer", Literal["adamw", "sgd"], "adamw", '"adamw" or "sgd" (with momentum 0.9).'),
    Flag("data", DataArgs, DataArgs(pad_pow2=True),
         "Where the prepared data is and how it is batched (pad_pow2: batches padded to powers of two, so\n"
         "the train step compiles once per length bucket)."),
    Flag("train", TrainArgs, TrainArgs(), _TRAIN_DOC),
    Flag("eval", EvalArgs, EvalArgs(), "Validation."),
    Flag("moe", MoEArgs, MoEArgs(), _MOE_DOC),
    Flag("logger_name", Literal["csv", "tensorboard", "wandb"], "csv", _LOGGER_DOC),
    Flag("compile_cache_dir", Optional[Path], None,
         "Persistent XLA compilation cache: a second run skips compiling (TPU/GPU)."),
    Flag("xla_metrics", bool, False,
         "Print torch_xla's metrics report (compilations, transfers, timings) at the end."),
    Flag("accelerator", str, "auto",
         'The PJRT device: "auto" (the TPU when there is one, else the CPU), "tpu", "cpu" or "cuda".'),
    Flag("allow_other_base", bool, False, _ALLOW_OTHER_BASE_DOC),
    Flag("allow_other_data", bool, False, _ALLOW_OTHER_DATA_DOC),
    ROPE_SCALING,
]

# ---------------------------------------------------------------------------------------------------------------
# the methods' own flags (the same on every backend)
# ---------------------------------------------------------------------------------------------------------------
LORA: List[Flag] = [
    Flag("lora_r", int, 8, "Rank of the updates."),
    Flag("lora_alpha", int, 16, "The updates are scaled by alpha / r."),
    Flag("lora_dropout", float, 0.05, "Dropout on the input of the updates."),
    Flag("lora_query", bool, True, "Update the query projection (part of the fused qkv layer)."),
    Flag("lora_key", bool, False, "Update the key projection."),
    Flag("lora_value", bool, True, "Update the value projection."),
    Flag("lora_projection", bool, False, "Update the attention output projection."),
    Flag("lora_mlp", bool, False,
         "Update the MLP's linear layers (of a mixture-of-experts model: its dense layers; the router stays\n"
         "frozen)."),
    Flag("lora_experts", bool, False,
         "Update the experts' linear layers (a rank-r pair per expert; mixture-of-experts models only)."),
    Flag("lora_head", bool, False, "Update the output head."),
]
LORA_INIT: List[Flag] = [  # finetune/lora.py and xla/finetune/lora.py (not in LORA: DPO does not take it)
    Flag("lora_init_from", Optional[Path], None,
         "Start the LoRA matrices from this lit_model.lora.safetensors (a LoRA run's, or a PEFT adapter\n"
         "imported with scripts/convert_hf_checkpoint.py --peft_path) instead of afresh (B zero): it must\n"
         "record this --checkpoint_dir's base and this run's r, alpha and adapted layers."),
]
ADAPTER: List[Flag] = [
    Flag("adapter_prompt_length", int, 10, "Learned prompt vectors per adapted layer."),
    Flag("adapter_start_layer", int, 2, "The first layer that gets an adapter."),
]
QLORA: List[Flag] = [
    Flag("quantize", Optional[str], None,
         '"bnb.nf4": QLoRA, the frozen base linear layers of the blocks in 4-bit NormalFloat (bitsandbytes,\n'
         'CUDA only); "mxfp4": gpt-oss\'s experts frozen in MXFP4 (packed after loading, lossless; not with\n'
         "--lora_experts). The saved LoRA weights merge into the unquantized base as usual."),
]

XLA_QLORA = [
    Flag("quantize", Optional[str], None,
         '"mxfp4": gpt-oss\'s experts frozen in MXFP4, placed packed by the staged loader (lossless; not with\n'
         "--lora_experts). The saved LoRA weights merge into the unquantized base as usual."),
]


def finetune_flags(base: Sequence[Flag], own: Sequence[Flag], tail: Sequence[Flag] = (), **defaults: Any) -> List[Flag]:
    """A finetune recipe's flags: the backend's run flags with the method's own after `optimizer` (where they
    always stood), then `tail` (QLoRA's --quantize), with the recipe's defaults."""
    at = [f.name for f in base].index("optimizer") + 1
    return with_defaults([*base[:at], *own, *base[at:], *tail], **defaults)
