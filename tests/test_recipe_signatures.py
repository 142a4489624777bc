"""The recipes of a kind take the same flags: within each group (generate on the CPU/GPU, generate on XLA, finetune
on the CPU/GPU, finetune on XLA) every recipe's `setup` has the same parameter names, in the same order, with the
same annotations, defaults and --help texts, apart from the method's own flags listed in `OWN` with their reason;
across groups (CPU/GPU against XLA, generate against chat) the flags both have agree too, apart from `ACROSS`.

The recipes are scripts: each is loaded by path (importlib), as `python <recipe>` would, and its `setup` read with
`inspect.signature`; the help texts are what jsonargparse shows (the docstring's Args, parsed by docstring_parser).
"""

import importlib.util
import inspect
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Dict, List, Tuple

import docstring_parser
import pytest

ROOT = Path(__file__).resolve().parents[1]

GROUPS = {
    "generate": "generate/*.py",
    "xla_generate": "xla/generate/*.py",
    "finetune": "finetune/*.py",
    "xla_finetune": "xla/finetune/*.py",
    "chat": "chat/base.py",
}
EXPECTED = {
    "generate": {"base", "adapter", "adapter_v2", "lora", "full"},
    "xla_generate": {"base", "adapter", "lora"},
    "finetune": {"adapter", "adapter_v2", "lora", "full", "dpo", "grpo", "distill"},
    "xla_finetune": {"adapter", "lora", "full", "dpo", "grpo", "distill"},
    "chat": {"base"},
}

# ---------------------------------------------------------------------------------------------------------------
# The allowed differences, each with its reason
# ---------------------------------------------------------------------------------------------------------------
LORA_WEIGHTS = "the LoRA weights to load on top of the base model: only the lora recipe has them"
ADAPTER_WEIGHTS = "the adapter weights to load on top of the base model: only the adapter recipes have them"
FULL_WEIGHTS = "the finetuned weights of all layers on the base model's architecture: only generate/full.py has them"
OUT_DIR = "each method writes its own output folder (out/<method>/alpaca)"
TRAIN = "each method has its own training hyperparameters (a LoRA or an adapter takes a larger learning rate)"
LORA_SETTINGS = "the LoRA rank, scale, dropout and the layers it adapts: LoRA's own settings"
ADAPTER_SETTINGS = "the adapter prompt's length and the first adapted layer: the adapter methods' own settings"
QLORA = ("QLoRA: the frozen base weights quantized under the LoRA matrices (bitsandbytes nf4, or gpt-oss's experts"
         " kept in MXFP4); a LoRA setting")
OTHER_BASE = ("the override of the check that finetuned weights go on the base they were trained on: only the recipes"
              " that load a method's weights on a base have it (full.py's weights replace the base's)")

OWN: Dict[Tuple[str, str], str] = {
    ("generate/lora.py", "lora_path"): LORA_WEIGHTS,
    ("generate/adapter.py", "adapter_path"): ADAPTER_WEIGHTS,
    ("generate/adapter_v2.py", "adapter_path"): ADAPTER_WEIGHTS,
    ("generate/full.py", "checkpoint_path"): FULL_WEIGHTS,
    ("xla/generate/lora.py", "lora_path"): LORA_WEIGHTS,
    ("xla/generate/adapter.py", "adapter_path"): ADAPTER_WEIGHTS,
    **{(recipe, "allow_other_base"): OTHER_BASE for recipe in ("generate/lora.py", "generate/adapter.py",
                                                               "generate/adapter_v2.py", "xla/generate/lora.py",
                                                               "xla/generate/adapter.py")},
    ("chat/base.py", "system_prompt"): "a system message that starts the conversation: chat's own",
    **{(f"finetune/{m}.py", "out_dir"): OUT_DIR for m in ("adapter", "adapter_v2", "lora", "full")},
    **{(f"finetune/{m}.py", "train"): TRAIN for m in ("adapter", "adapter_v2", "lora", "full")},
    **{(f"xla/finetune/{m}.py", "out_dir"): OUT_DIR for m in ("adapter", "lora", "full")},
    **{(f"xla/finetune/{m}.py", "train"): TRAIN for m in ("adapter", "lora", "full")},
    **{(f"{d}finetune/lora.py", f"lora_{s}"): LORA_SETTINGS for d in ("", "xla/")
       for s in ("r", "alpha", "dropout", "query", "key", "value", "projection", "mlp", "head", "experts")},
    **{(recipe, s): ADAPTER_SETTINGS for recipe in ("finetune/adapter.py", "finetune/adapter_v2.py",
                                                    "xla/finetune/adapter.py")
       for s in ("adapter_prompt_length", "adapter_start_layer")},
    ("finetune/lora.py", "quantize"): QLORA,
    ("xla/finetune/lora.py", "quantize"): QLORA,
    **{(f"{d}finetune/lora.py", "lora_init_from"): "the LoRA weights a LoRA run starts from (a run's, or an imported"
       " PEFT adapter): LoRA's own" for d in ("", "xla/")},
    # DPO (finetune/dpo.py, xla/finetune/dpo.py): LoRA or full finetuning on preference pairs
    **{(f"{d}finetune/dpo.py", "out_dir"): OUT_DIR for d in ("", "xla/")},
    **{(f"{d}finetune/dpo.py", "train"): "DPO's own hyperparameters (a smaller learning rate, as TRL and the"
       " alignment handbook use)" for d in ("", "xla/")},
    **{(f"{d}finetune/dpo.py", f"lora_{s}"): LORA_SETTINGS + " (DPO with --method lora, its default)"
       for d in ("", "xla/")
       for s in ("r", "alpha", "dropout", "query", "key", "value", "projection", "mlp", "head", "experts")},
    **{(f"{d}finetune/dpo.py", f): "DPO's own: LoRA or full finetuning (--method) and the preference loss (--dpo)"
       for d in ("", "xla/") for f in ("method", "dpo")},
    # GRPO (finetune/grpo.py, xla/finetune/grpo.py): LoRA or full finetuning on rewards of sampled completions
    **{(f"{d}finetune/grpo.py", "out_dir"): OUT_DIR for d in ("", "xla/")},
    **{(f"{d}finetune/grpo.py", "train"): "GRPO's own hyperparameters (batches count prompts, each bringing a group"
       " of completions)" for d in ("", "xla/")},
    **{(f"{d}finetune/grpo.py", f"lora_{s}"): LORA_SETTINGS + " (GRPO with --method lora, its default)"
       for d in ("", "xla/")
       for s in ("r", "alpha", "dropout", "query", "key", "value", "projection", "mlp", "head", "experts")},
    **{(f"{d}finetune/grpo.py", f): "GRPO's own: LoRA or full finetuning (--method), sampling and the loss (--grpo),"
       " the reward functions (--reward)" for d in ("", "xla/") for f in ("method", "grpo", "reward")},
    # distillation (finetune/distill.py, xla/finetune/distill.py): a LoRA or full student learns a teacher's logits
    **{(f"{d}finetune/distill.py", "out_dir"): OUT_DIR for d in ("", "xla/")},
    **{(f"{d}finetune/distill.py", "train"): TRAIN + " (distillation's: LoRA's by default)" for d in ("", "xla/")},
    **{(f"{d}finetune/distill.py", f"lora_{s}"): LORA_SETTINGS + " (distillation with --method lora, its default)"
       for d in ("", "xla/")
       for s in ("r", "alpha", "dropout", "query", "key", "value", "projection", "mlp", "head", "experts")},
    **{(f"{d}finetune/distill.py", f): "distillation's own: LoRA or full student (--method), the teacher"
       " (--teacher_dir) and the divergence (--distill)" for d in ("", "xla/")
       for f in ("method", "teacher_dir", "distill")},
}
"""(recipe, flag) -> why that recipe's flag is its method's own: the other recipes of its group may lack it or
give it another default."""
OWN_DEFAULT: Dict[Tuple[str, str], str] = {
    **{(f"{d}finetune/dpo.py", "data"): "DPO reads preference pairs (scripts/prepare_preferences.py writes"
       " data/preferences), not instruction data" for d in ("", "xla/")},
    **{(f"{d}finetune/grpo.py", "data"): "GRPO reads prompts with answers (scripts/prepare_prompts.py writes"
       " data/prompts), not instruction data" for d in ("", "xla/")},
}
"""(recipe, flag) -> why that recipe gives a flag its group shares (same annotation and help) another default."""

XLA_COMPILES = "XLA traces and compiles the loop's graphs itself: there is no torch.compile to choose"
XLA_PRECISION = "XLA runs bf16 or fp32 weights only (no fp16), with bf16 as the TPU default"
XLA_ACCELERATOR = "on XLA --accelerator picks the PJRT device (tpu, cpu, cuda), on the CPU/GPU recipes Fabric's"
XLA_DEVICES = "an SPMD mesh spans every device of the XLA runtime (\"auto\" or their number)"
XLA_CACHE = "XLA's persistent compilation cache: no such thing on the eager CPU/GPU recipes"
XLA_FINETUNED = "the XLA recipes read the weights that either finetuning recipe wrote (default: the XLA one's folder)"

ACROSS: Dict[Tuple[str, str], Dict[str, Tuple[set, str]]] = {
    ("generate", "xla_generate"): {
        "compile": ({"missing"}, XLA_COMPILES),
        "quantize": ({"help"}, "weight-only quantization runs through torchao / bitsandbytes kernels for the CPU and"
                               " CUDA; on XLA only gpt-oss's MXFP4 experts, kept packed by the staged loader"),
        "precision": ({"help"}, XLA_PRECISION),
        "accelerator": ({"help"}, XLA_ACCELERATOR),
        "devices": ({"missing"}, XLA_DEVICES),
        "compile_cache_dir": ({"missing"}, XLA_CACHE),
        "lora_path": ({"default", "help"}, XLA_FINETUNED),
        "adapter_path": ({"default", "help"}, XLA_FINETUNED),
    },
    ("generate", "chat"): {
        "prompt": ({"missing"}, "chat reads its prompts from the terminal, one per turn"),
        "num_samples": ({"missing"}, "chat answers each message once"),
        "max_new_tokens": ({"default", "help"}, "the limit of one reply, which normally ends at the end-of-turn"
                                               " token; a generate sample of a base model runs to its limit"),
        "compile": ({"help"}, "--compile auto weighs one reply of max_new_tokens, not num_samples of them"),
        "checkpoint_dir": ({"help"}, "chat has no finetuned-weights flags to mention"),
    },
    ("finetune", "xla_finetune"): {
        "data": ({"default", "help"}, "XLA pads batches to powers of two (static shapes: a few compiled graphs, not"
                                      " one per length)"),
        "devices": ({"annotation", "default", "help"}, XLA_DEVICES),
        "precision": ({"annotation", "help"}, XLA_PRECISION),
        "accelerator": ({"annotation", "help"}, XLA_ACCELERATOR),
        "out_dir": ({"default", "help"}, "the XLA recipes write sharded step checkpoints, under out/xla/<method>"),
        "strategy": ({"missing"}, "DDP/FSDP are Fabric strategies of the CPU/GPU recipes; XLA shards with SPMD"),
        "num_nodes": ({"missing"}, "Lightning launches CPU/GPU nodes; on XLA the PJRT runtime finds the hosts"),
        "peer_timeout": ({"missing"}, "bounds the wait for Lightning-launched processes (torch.distributed's timeout);"
                                      " XLA's hosts are joined by the PJRT runtime"),
        "scan_layers": ({"missing"}, "torch_xla's scan over the blocks (one compiled block): XLA only"),
        "activation_checkpointing": ({"missing"}, "torch_xla's checkpoint_module per block under SPMD (XLA only: the"
                                                  " CPU/GPU recipes do not offer recomputation)"),
        "compile_cache_dir": ({"missing"}, XLA_CACHE),
        "xla_metrics": ({"missing"}, "torch_xla's metrics report: XLA only"),
        "quantize": ({"help"}, "QLoRA quantizes with bitsandbytes, a CUDA library: on XLA only gpt-oss's MXFP4"
                               " experts, kept packed by the staged loader"),
    },
}
"""(group, other group) -> {flag: (aspects that may differ: "missing" (one group lacks it), "annotation", "default",
"help"; why)} for the flags the two groups share, or that only one has."""


# ---------------------------------------------------------------------------------------------------------------
# Reading the recipes
# ---------------------------------------------------------------------------------------------------------------
class Flag:
    def __init__(self, parameter: inspect.Parameter, help_text: str) -> None:
        self.annotation = parameter.annotation
        self.default = parameter.default
        self.help = " ".join(help_text.split())  # as --help shows it: the formatter rewraps the lines

    def aspects(self) -> Dict[str, Any]:
        return {"annotation": self.annotation, "default": self.default, "help": self.help}


def load(recipe: str) -> Any:
    name = "recipe_signature_" + recipe.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, ROOT / recipe)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flags(setup: Any) -> Dict[str, Flag]:
    helps = {p.arg_name: p.description or "" for p in docstring_parser.parse(setup.__doc__ or "").params}
    signature = inspect.signature(setup, eval_str=True)
    return {name: Flag(p, helps.get(name, "")) for name, p in signature.parameters.items()}


@pytest.fixture(scope="module")
def recipes() -> Dict[str, Dict[str, Any]]:
    """{group: {recipe path: module}}"""
    found = {}
    for group, pattern in GROUPS.items():
        paths = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(pattern))
        assert {Path(p).stem for p in paths} >= EXPECTED[group], (group, paths)
        found[group] = {p: load(p) for p in paths}
    return found


def group_differences(group: str, modules: Dict[str, Any]) -> List[str]:
    """What differs among a group's recipes, apart from `OWN`."""
    shared = {r: {n: f for n, f in flags(m.setup).items() if (r, n) not in OWN} for r, m in modules.items()}
    names = sorted({n for fs in shared.values() for n in fs})
    differences = []
    for name in names:
        having = {r: fs[name] for r, fs in shared.items() if name in fs}
        lacking = sorted(set(shared) - set(having))
        if lacking:
            differences.append(f"--{name}: {', '.join(sorted(having))} take it, {', '.join(lacking)} do not")
        for aspect in ("annotation", "default", "help"):
            values = {r: f.aspects()[aspect] for r, f in having.items()
                      if aspect != "default" or (r, name) not in OWN_DEFAULT}
            if any(v != next(iter(values.values())) for v in values.values()):
                shown = "; ".join(f"{r}: {v!r}" for r, v in values.items())
                differences.append(f"--{name} {aspect} differs: {shown}")
    orders = {r: [n for n in fs if all(n in other for other in shared.values())] for r, fs in shared.items()}
    if len({tuple(o) for o in orders.values()}) > 1:
        differences.append("the flags they share come in different orders: " +
                           "; ".join(f"{r}: {' '.join(o)}" for r, o in orders.items()))
    return differences


@pytest.mark.parametrize("group", list(GROUPS))
def test_recipes_of_a_group_take_the_same_flags(recipes, group):
    differences = group_differences(group, recipes[group])
    assert not differences, f"{group} recipes differ (add a method's own flag to OWN, with its reason):\n" + "\n".join(
        differences)


def group_flags(modules: Dict[str, Any]) -> Dict[str, Flag]:
    """The flags of a group that are not a single recipe's own (one entry each: the group test holds them equal)."""
    out: Dict[str, Flag] = {}
    for recipe, module in modules.items():
        for name, flag in flags(module.setup).items():
            if (recipe, name) not in OWN:
                out.setdefault(name, flag)
    return out


def own_flags(modules: Dict[str, Any]) -> Dict[str, Flag]:
    """A group's method-own flags, by name (the first recipe's where several have one of that name)."""
    out: Dict[str, Flag] = {}
    for recipe, module in modules.items():
        for name, flag in flags(module.setup).items():
            if (recipe, name) in OWN:
                out.setdefault(name, flag)
    return out


@pytest.mark.parametrize("pair", list(ACROSS), ids=lambda pair: "-".join(pair))
def test_flags_agree_across_groups(recipes, pair):
    a, b = pair
    allowed = ACROSS[pair]
    # a method's own flag is compared where both groups have it (--lora_path); that only one group has a recipe of
    # some method (generate/full.py) is no difference in flags
    own_a, own_b = own_flags(recipes[a]), own_flags(recipes[b])
    flags_a, flags_b = {**own_a, **group_flags(recipes[a])}, {**own_b, **group_flags(recipes[b])}
    differences = []
    for name in sorted(set(flags_a) | set(flags_b)):
        may_differ = allowed.get(name, (set(), ""))[0]
        if (name in own_a) != (name in own_b) and (name not in flags_a or name not in flags_b):
            continue
        if name not in flags_a or name not in flags_b:
            if "missing" not in may_differ:
                differences.append(f"--{name}: only {a if name in flags_a else b} has it")
            continue
        for aspect in ("annotation", "default", "help"):
            va, vb = flags_a[name].aspects()[aspect], flags_b[name].aspects()[aspect]
            if va != vb and aspect not in may_differ:
                differences.append(f"--{name} {aspect}: {a} {va!r}, {b} {vb!r}")
    assert not differences, f"{a} and {b} differ (add the difference to ACROSS, with its reason):\n" + "\n".join(
        differences)


def test_every_allowed_difference_is_real(recipes):
    """An entry of OWN or ACROSS that no recipe needs any more goes: the lists say exactly what differs."""
    all_flags = {r: flags(m.setup) for group in recipes.values() for r, m in group.items()}
    stale = [f"OWN {key}" for key in OWN if key[0] in all_flags and key[1] not in all_flags[key[0]]]
    for (a, b), allowed in ACROSS.items():
        names_a = {n for r in recipes[a] for n in all_flags[r]}
        names_b = {n for r in recipes[b] for n in all_flags[r]}
        stale += [f"ACROSS {a}/{b} --{name}" for name in allowed if name not in names_a | names_b]
    assert not stale, stale
    assert all(reason.strip() for reason in OWN.values())
    assert all(reason.strip() for allowed in ACROSS.values() for _, reason in allowed.values())


def test_the_generate_recipes_pass_one_typed_object(recipes):
    """`main(fabric, args: GenerationArgs)`: the flags travel as one object whose defaults are the flags'."""
    from lit_gpt.recipes.generate import GenerationArgs

    defaults = {f.name: f.default for f in fields(GenerationArgs) if f.default is not MISSING}
    for group in ("generate", "xla_generate"):
        for recipe, module in recipes[group].items():
            parameters = list(inspect.signature(module.main, eval_str=True).parameters.values())
            assert [p.name for p in parameters] == ["fabric", "args"], recipe
            assert parameters[1].annotation is GenerationArgs, recipe
            for name, flag in flags(module.setup).items():
                if name in defaults:
                    assert flag.default == defaults[name], (recipe, name)


@pytest.mark.parametrize("recipe", ["eval/perplexity.py", "eval/lm_eval.py", "serve/base.py"])
def test_the_recipes_that_load_a_model_to_use_it_take_the_same_model_flags(recipe):
    """Evaluation and serving load what they run the same way (`lit_gpt.recipes.evaluate.EVAL_FLAGS`): the same
    names, annotations, defaults and --help texts, in that order."""
    from lit_gpt.recipes.evaluate import EVAL_FLAGS

    reference = flags(load("eval/perplexity.py").setup)
    found = flags(load(recipe).setup)
    names = [f.name for f in EVAL_FLAGS]
    assert [n for n in found if n in names] == names, recipe
    for name in names:
        assert found[name].aspects() == reference[name].aspects(), (recipe, name)
