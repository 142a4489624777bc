"""LoRA weights to and from Hugging Face PEFT adapter folders (`adapter_config.json` + `adapter_model.safetensors`), the
form transformers + PEFT, vLLM (`--enable-lora --lora-modules`) and the Hub exchange adapters in.

`export_peft` writes a LoRA trained here (`lit_model.lora.safetensors` + its JSON) for the base's HF model type:
each LoRA layer becomes the LoRA module of the transformers module it maps to (`lit_gpt.convert_layouts`), with the
same r, alpha, dropout. Our fused `attn.qkv` has one rank-r pair (A_i, B_i) per enabled q/k/v part:
* where transformers has separate q/k/v projections (Llama, Gemma, Qwen, ...), each part is its own PEFT module
  (q_proj: A_q, B_q; ...);
* where transformers fuses them too (Phi-3 `qkv_proj`, GPT-NeoX and Falcon `query_key_value`), the fused module gets
  one LoRA of rank n * r (n enabled parts): A = [A_q; A_k; A_v] stacked, B block-diagonal (B_q in the q rows and the
  first r columns, ...; zero elsewhere, rows in the family's head order), with `rank_pattern` n * r and
  `alpha_pattern` n * alpha so that its scaling stays alpha / r. B A is then exactly our update.
Phi-3's fused `gate_up_proj` gets the same treatment from our fc_1 (gate) and fc_2 (up), rank 2r. The experts of a
mixture of experts (`lora_experts`) are refused: transformers 5 holds them as 3-D parameters, which PEFT adapts only
through `target_parameters` (`lora.ParamWrapper`, no dropout), a form this module does not write. So is the dense
MLP of a Qwen3-MoE model: PEFT takes gate_proj/up_proj/down_proj targets of that model type for its experts
(transformers 4 names). So are trained biases (a PEFT adapter's `bias` option trains the base's biases in place).
The file's header metadata records our LoRA config (`lit_gpt.lora_config`), which import uses to split the fused
modules back.

`import_peft` reads such a folder into our format for a converted base (`--checkpoint_dir`), recording the base's
fingerprint. A fused module without that record (an adapter trained elsewhere) has one A shared by all its parts:
it becomes our per-part pairs with that A repeated (A_q = A_k = A_v = A) and B split by rows, which is the same
update. Modules an adapter leaves out in some layers (or of the same kind, e.g. q_proj without k_proj while our
config adapts q and v) get zero pairs: a zero update. What our LoRA cannot express is refused in one line: DoRA,
rsLoRA, trained biases, `modules_to_save`, modules of different scalings, embeddings or routers.
"""

import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from lit_gpt.convert_layouts import FUSED_MLP, LAYOUTS, group_qkv, layer_map, qkv_grouping, ungroup_qkv
from lit_gpt.fingerprint import base_record
from lit_gpt.hf_write import hf_config_dict, hf_model_type
from lit_gpt.lora import GPT, Config, lora_filter
from lit_gpt.peft import check_finetuned_base, export_finetuned, load_finetuned, variant_fields
from lit_gpt.utils import LitError, error_reason, refuse_overwrite, write_atomic, write_text_atomic

PathLike = Union[str, Path]
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # what PEFT's saved keys start with (the PeftModel's `base_model.model`)
META_KEY = "lit_gpt.lora_config"
# `base_model.model.<module>.lora_A.weight`; saved files drop the adapter name, a state dict in memory has it
_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


# ---------------------------------------------------------------------------------------------------------------
# which transformers module each LoRA layer is
# ---------------------------------------------------------------------------------------------------------------
def _hf_modules(config: Config, model_type: str) -> Dict[str, Tuple[str, str]]:
    """lit module (`transformer.h.0.attn.qkv`, ...) -> (kind, HF module name): kind "linear" (one to one), "qkv"
    (our fused qkv to HF's fused projection), "q"/"k"/"v" (one part of it to HF's own projection), "gate_up" (fc_1 +
    fc_2 to Phi-3's fused projection). Only the modules our LoRA can adapt (attention, dense MLP, head)."""
    layout = LAYOUTS[model_type]
    layers = layer_map(model_type, config)
    by_lit = {lit: hf for hf, lit in layers.items()}
    fused_mlp = FUSED_MLP.get(model_type)
    out: Dict[str, Tuple[str, str]] = {}
    for i in range(config.n_layer):
        hf, lit = f"{layout.layers}.{i}", f"transformer.h.{i}"
        if len(layout.qkv) == 3:
            for part, name in zip("qkv", layout.qkv):
                out[f"{lit}.attn.qkv.{part}"] = (part, f"{hf}.{name}")
        else:
            name = layout.qkv[0] if layout.qkv else by_lit["attn.qkv"]
            out[f"{lit}.attn.qkv"] = ("qkv", f"{hf}.{name}")
        for sub in ("attn.proj", "mlp.fc", "mlp.proj", "mlp.fc_1", "mlp.fc_2"):
            if sub in by_lit:
                out[f"{lit}.{sub}"] = ("linear", f"{hf}.{by_lit[sub]}")
        if fused_mlp is not None:
            out[f"{lit}.mlp.fc_1"] = ("gate_up", f"{hf}.{fused_mlp[0]}")
    out["lm_head"] = ("linear", "lm_head")
    return out


def _short(hf_module: str) -> str:
    """The name PEFT's `target_modules` / `rank_pattern` match by suffix: the module's path inside its layer
    (`self_attn.q_proj`, `mlp.down_proj`; `lm_head`). Not the last component alone: in transformers 5 a mixture of
    experts' `mlp.experts.down_proj` is a parameter PEFT would then wrap too."""
    return re.sub(r"^.*?\.\d+\.", "", hf_module)


def _lit_config(checkpoint_dir: PathLike, fields: Dict[str, Any]) -> Config:
    try:
        return Config.from_checkpoint(Path(checkpoint_dir), **fields)
    except (FileNotFoundError, ValueError, TypeError) as e:
        raise LitError(f"cannot build the LoRA model of {str(checkpoint_dir)!r}: {e}") from e


def _qkv_sizes(config: Config) -> Tuple[int, int, int]:
    q, kv = config.n_head * config.head_size, config.n_query_groups * config.head_size
    return q, kv, kv


def _block_diagonal(bs: List[torch.Tensor], sizes: List[int], enabled: List[bool], r: int) -> torch.Tensor:
    """B of the fused module: the enabled parts' B_i on the diagonal (rows: all parts, columns: r per enabled part)."""
    n = sum(enabled)
    out = torch.zeros(sum(sizes), n * r, dtype=bs[0].dtype)
    row, col, it = 0, 0, iter(bs)
    for size, on in zip(sizes, enabled):
        if on:
            out[row:row + size, col:col + r] = next(it)
            col += r
        row += size
    return out


# ---------------------------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------------------------
def default_base_name(checkpoint_dir: PathLike) -> str:
    """`ORG/NAME` for a folder that scripts/download.py wrote (`checkpoints/ORG/NAME`), else the folder's path."""
    parts = Path(checkpoint_dir).parts
    if len(parts) >= 3 and parts[-3] == "checkpoints":
        return f"{parts[-2]}/{parts[-1]}"
    return str(checkpoint_dir)


def export_peft(checkpoint_dir: PathLike, lora_path: PathLike, output_dir: PathLike,
                base_model_name_or_path: Optional[str] = None, overwrite: bool = False,
                allow_other_base: bool = False) -> Path:
    """Write the LoRA weights `lora_path` (trained on the base in `checkpoint_dir`) as a PEFT adapter folder
    (`adapter_config.json`, `adapter_model.safetensors`) in `output_dir`, which it returns."""
    checkpoint_dir, lora_path, output_dir = Path(checkpoint_dir), Path(lora_path), Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise LitError(f"--output_dir {str(output_dir)!r} is a file, not a folder: pass a folder")
    refuse_overwrite(output_dir, (ADAPTER_CONFIG, ADAPTER_WEIGHTS), overwrite,
                     "Pass --output_dir NEW_FOLDER, or --overwrite true to replace that adapter")
    state, fields = load_finetuned(lora_path, "lora")
    check_finetuned_base(lora_path, checkpoint_dir, allow_other_base, "lora")
    config = _lit_config(checkpoint_dir, fields)
    model_type = hf_model_type(config)
    hf_config_dict(config, model_type)  # a base that cannot be exported to HF cannot have a PEFT adapter either
    if config.lora_experts:
        raise LitError("this LoRA adapts the experts (lora_experts), which this export cannot express: transformers"
                       " holds them as 3-D parameters, which PEFT adapts only through target_parameters"
                       " (lora.ParamWrapper), not written here. Merge it with scripts/merge_lora.py and export the"
                       " merged model with scripts/convert_lit_checkpoint.py instead")
    if model_type == "qwen3_moe" and any(".mlp." in k for k in state):
        raise LitError("this LoRA adapts the dense MLP layers of a qwen3_moe model (lora_mlp), which PEFT cannot"
                       " target: it takes gate_proj/up_proj/down_proj targets of such a model for its experts"
                       " (transformers 4 names). Merge it with scripts/merge_lora.py and export the merged model"
                       " instead")
    extra = [k for k in state if not lora_filter(k)]
    if extra:
        raise LitError(f"{str(lora_path)!r} holds trained weights besides LoRA's (e.g. {extra[0]!r}), which a PEFT"
                       " adapter cannot carry without changing the base: merge it with scripts/merge_lora.py and"
                       " export the merged model instead")
    r, alpha = config.lora_r, config.lora_alpha
    modules = _hf_modules(config, model_type)
    tensors: Dict[str, torch.Tensor] = {}
    targets: Dict[str, None] = {}
    rank_pattern: Dict[str, int] = {}
    alpha_pattern: Dict[str, Any] = {}

    def put(hf: str, a: torch.Tensor, b: torch.Tensor, parts: int = 1) -> None:
        tensors[f"{PREFIX}{hf}.lora_A.weight"] = a.contiguous()
        tensors[f"{PREFIX}{hf}.lora_B.weight"] = b.contiguous()
        targets[_short(hf)] = None
        if parts > 1:
            rank_pattern[_short(hf)], alpha_pattern[_short(hf)] = parts * r, parts * alpha

    qkv_on = [config.lora_query, config.lora_key, config.lora_value]
    sizes = list(_qkv_sizes(config))
    for name in sorted({k.rsplit(".", 1)[0] for k in state}):
        a, b = state[f"{name}.lora_A"], state[f"{name}.lora_B"]
        if name.endswith(".attn.qkv"):
            a_parts, b_parts = a.split(r), b.split([s for s, on in zip(sizes, qkv_on) if on])
            if modules.get(name, ("",))[0] == "qkv":
                fused = _block_diagonal(list(b_parts), sizes, qkv_on, r)
                if model_type != "phi3":  # GPT-NeoX / Falcon interleave the heads; Phi-3 keeps [q | k | v]
                    fused = group_qkv(fused, *qkv_grouping(model_type, config), config.head_size)
                put(modules[name][1], a, fused, parts=sum(qkv_on))
            else:
                for part, a_i, b_i in zip([p for p, on in zip("qkv", qkv_on) if on], a_parts, b_parts):
                    put(modules[f"{name}.{part}"][1], a_i, b_i)
        elif name.endswith(".mlp.fc_2") and model_type in FUSED_MLP:
            continue  # written with fc_1 into the fused gate_up projection
        elif name.endswith(".mlp.fc_1") and model_type in FUSED_MLP:
            up = name[: -len("fc_1")] + "fc_2"
            a2, b2 = state[f"{up}.lora_A"], state[f"{up}.lora_B"]
            put(modules[name][1], torch.cat((a, a2)), _block_diagonal([b, b2], [b.shape[0], b2.shape[0]],
                                                                       [True, True], r), parts=2)
        elif name in modules:
            put(modules[name][1], a, b)
        else:
            raise LitError(f"LoRA layer {name!r} has no transformers module to map to in {model_type!r}")
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or default_base_name(checkpoint_dir),
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": config.lora_dropout,
        "target_modules": sorted(targets),
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    from safetensors.torch import save

    metadata = {"format": "pt", META_KEY: json.dumps(variant_fields(config), sort_keys=True)}
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LitError(f"cannot write --output_dir {str(output_dir)!r}: {error_reason(e)}") from None
    write_atomic(output_dir / ADAPTER_WEIGHTS, lambda f: f.write(save(tensors, metadata=metadata)))
    write_text_atomic(output_dir / ADAPTER_CONFIG, json.dumps(adapter, indent=2) + "\n")
    return output_dir


# ---------------------------------------------------------------------------------------------------------------
# import
# ---------------------------------------------------------------------------------------------------------------
def _read_adapter(peft_dir: Path) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor], Dict[str, Any]]:
    """(adapter_config, {HF module: {"A": A, "B": B}}, our LoRA config recorded by export or {})."""
    config_path = peft_dir / ADAPTER_CONFIG
    if not config_path.is_file():
        raise LitError(f"{str(peft_dir)!r} has no {ADAPTER_CONFIG}: pass a PEFT adapter folder (adapter_config.json +"
                       f" {ADAPTER_WEIGHTS})")
    try:
        adapter = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LitError(f"cannot read {str(config_path)!r}: {error_reason(e)}") from None
    weights, recorded = peft_dir / ADAPTER_WEIGHTS, {}
    if weights.is_file():
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(weights), framework="pt", device="cpu") as f:
                recorded = json.loads((f.metadata() or {}).get(META_KEY) or "{}")
                raw = {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError, ValueError) as e:
            raise LitError(f"cannot read {str(weights)!r} ({e}): download the adapter again") from None
    elif (peft_dir / "adapter_model.bin").is_file():
        raw = torch.load(peft_dir / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise LitError(f"{str(peft_dir)!r} has no {ADAPTER_WEIGHTS}: download the adapter's weights with its config")
    pairs: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        m = _KEY.match(key)
        if m is None:
            raise LitError(f"{str(peft_dir)!r} holds {key!r}, which is not a LoRA A or B matrix: only plain LoRA"
                           " adapters (no modules_to_save, biases or embeddings) can be imported")
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    return adapter, pairs, recorded


def _check_adapter(adapter: Dict[str, Any], peft_dir: Path) -> None:
    if adapter.get("peft_type") != "LORA":
        raise LitError(f"{str(peft_dir)!r} is a {adapter.get('peft_type')!r} adapter: only LoRA can be imported")
    for key, what in (("use_dora", "DoRA"), ("use_rslora", "rsLoRA's alpha / sqrt(r) scaling"),
                      ("modules_to_save", "fully trained modules (modules_to_save)"), ("lora_bias", "LoRA biases"),
                      ("target_parameters", "LoRA on parameters (target_parameters)"),
                      ("layer_replication", "layer replication"), ("fan_in_fan_out", "fan_in_fan_out (GPT-2 Conv1D)")):
        if adapter.get(key):
            raise LitError(f"{str(peft_dir)!r} uses {what}, which this project's LoRA cannot express")
    if adapter.get("bias", "none") != "none":
        raise LitError(f"{str(peft_dir)!r} trains biases (bias={adapter['bias']!r}), which this project's LoRA file"
                       " cannot carry: merge it in transformers and convert the merged model instead")


def _pattern(patterns: Dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's `rank_pattern` / `alpha_pattern` lookup: the first key that matches the module name as a suffix."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def import_peft(peft_dir: PathLike, checkpoint_dir: PathLike, out_dir: Optional[PathLike] = None,
                overwrite: bool = False) -> Path:
    """Convert the PEFT LoRA adapter in `peft_dir` for the converted base in `checkpoint_dir` into
    `lit_model.lora.safetensors` + `lit_model.lora.json` (recording the base's fingerprint) in `out_dir` (default:
    `peft_dir`). Returns the weights path, which generate/lora.py, eval and serve take as --lora_path."""
    peft_dir, checkpoint_dir = Path(peft_dir), Path(checkpoint_dir)
    out = peft_dir if out_dir is None else Path(out_dir)
    refuse_overwrite(out, ("lit_model.lora.safetensors", "lit_model.lora.json"), overwrite,
                     "Pass --out_dir NEW_FOLDER, or --overwrite true to replace them")
    adapter, pairs, recorded = _read_adapter(peft_dir)
    _check_adapter(adapter, peft_dir)
    if not isinstance(adapter.get("r"), int) or not isinstance(adapter.get("lora_alpha"), (int, float)):
        raise LitError(f"{str(peft_dir / ADAPTER_CONFIG)!r} has no integer r or numeric lora_alpha: it is not a LoRA"
                       " adapter's config")
    r, alpha = adapter["r"], adapter["lora_alpha"]
    alpha = int(alpha) if float(alpha).is_integer() else alpha
    base = _lit_config(checkpoint_dir, {})
    model_type = hf_model_type(base)
    by_hf: Dict[str, Tuple[str, str]] = {hf: (lit, kind) for lit, (kind, hf) in _hf_modules(base, model_type).items()}
    layout = LAYOUTS[model_type]

    found: Dict[str, Tuple[str, str, Dict[str, torch.Tensor], int]] = {}  # lit -> (kind, hf, pair, rank)
    for module, pair in pairs.items():
        name = module
        for pattern, replacement in layout.rename:
            name = re.sub(pattern, replacement, name + ".")[:-1]
        if name not in by_hf:
            raise LitError(f"the adapter adapts {module!r}, which this project's LoRA cannot (it adapts the"
                           f" attention, dense MLP and head projections of {model_type!r} models)")
        if set(pair) != {"A", "B"}:
            raise LitError(f"the adapter holds only lora_{next(iter(pair))} of {module!r}: download it again")
        rank = int(_pattern(adapter.get("rank_pattern"), module, r))
        m_alpha = _pattern(adapter.get("alpha_pattern"), module, alpha)
        if m_alpha * r != alpha * rank:
            raise LitError(f"the adapter scales {module!r} by {m_alpha}/{rank}, the others by {alpha}/{r}: this"
                           " project's LoRA has one scaling for all modules")
        if tuple(pair["A"].shape[:1]) != (rank,) or pair["B"].shape[1:] != (rank,):
            raise LitError(f"lora_A/lora_B of {module!r} are not of rank {rank} as adapter_config.json says")
        lit, kind = by_hf[name]
        found[lit] = (kind, module, pair, rank)

    kinds = {kind for kind, *_ in found.values()}
    subs = {re.sub(r"^transformer\.h\.\d+\.", "", lit) for lit in found}
    fused_qkv = any(k == "qkv" for k, *_ in found.values())
    block = bool(recorded)  # exported here: the fused modules are block-diagonal pairs (module docstring)
    fields: Dict[str, Any] = dict(
        lora_r=r, lora_alpha=alpha, lora_dropout=float(adapter.get("lora_dropout") or 0.0),
        lora_query="q" in kinds or (fused_qkv and (recorded.get("lora_query", True) if block else True)),
        lora_key="k" in kinds or (fused_qkv and (recorded.get("lora_key", True) if block else True)),
        lora_value="v" in kinds or (fused_qkv and (recorded.get("lora_value", True) if block else True)),
        lora_projection="attn.proj" in subs,
        lora_mlp=bool(subs & {"mlp.fc", "mlp.proj", "mlp.fc_1", "mlp.fc_2"}),
        lora_head="lm_head" in subs,
    )
    config = _lit_config(checkpoint_dir, fields)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in GPT(config).state_dict().items() if lora_filter(k)}
    state = {k: torch.zeros(s, dtype=next(iter(pairs.values()))["A"].dtype) for k, s in shapes.items()}
    qkv_on = [config.lora_query, config.lora_key, config.lora_value]
    sizes = list(_qkv_sizes(config))
    for lit, (kind, module, pair, rank) in found.items():
        a, b = pair["A"], pair["B"]
        try:
            if kind in ("q", "k", "v"):
                if rank != r:
                    raise LitError(f"{module!r} has rank {rank}, not r={r}")
                qkv = lit[:-2]
                slot = [p for p, on in zip("qkv", qkv_on) if on].index(kind)
                rows = [s for s, on in zip(sizes, qkv_on) if on]
                state[f"{qkv}.lora_A"][slot * r:(slot + 1) * r] = a
                state[f"{qkv}.lora_B"][sum(rows[:slot]):sum(rows[:slot + 1])] = b
            elif kind == "qkv":
                if model_type != "phi3":
                    b = ungroup_qkv(b, *qkv_grouping(model_type, config), config.head_size)
                b_rows = b.split(sizes)
                n = sum(qkv_on)
                if block and rank == n * r:  # A = [A_q; A_k; A_v], B block-diagonal
                    a_parts = list(a.split(r))
                    b_parts = [rows[:, j * r:(j + 1) * r] for j, rows in enumerate(
                        [rows for rows, on in zip(b_rows, qkv_on) if on])]
                else:  # one A shared by q, k and v
                    if rank != r:
                        raise LitError(f"{module!r} has rank {rank}, not r={r}")
                    a_parts = [a] * n
                    b_parts = [rows for rows, on in zip(b_rows, qkv_on) if on]
                state[f"{lit}.lora_A"] = torch.cat(a_parts)
                state[f"{lit}.lora_B"] = torch.cat(b_parts)
            elif kind == "gate_up":
                up = lit[: -len("fc_1")] + "fc_2"
                gate_b, up_b = b.chunk(2)
                if block and rank == 2 * r:
                    pieces = ((a[:r], gate_b[:, :r]), (a[r:], up_b[:, r:]))
                elif rank == r:
                    pieces = ((a, gate_b), (a, up_b))
                else:
                    raise LitError(f"{module!r} has rank {rank}, not r={r}")
                for target, (a_i, b_i) in zip((lit, up), pieces):
                    state[f"{target}.lora_A"], state[f"{target}.lora_B"] = a_i.clone(), b_i.clone()
            else:
                if rank != r:
                    raise LitError(f"{module!r} has rank {rank}, not r={r}")
                state[f"{lit}.lora_A"], state[f"{lit}.lora_B"] = a, b
        except RuntimeError as e:  # shapes that do not fit the base's heads or widths
            raise LitError(f"the adapter's {module!r} does not fit the base in {str(checkpoint_dir)!r} ({e}): is it"
                           f" an adapter of {adapter.get('base_model_name_or_path')!r}?") from None
    wrong = [k for k, s in shapes.items() if state[k].shape != s]
    if wrong:
        raise LitError(f"the adapter's {wrong[0]!r} has shape {tuple(state[wrong[0]].shape)}, the base in"
                       f" {str(checkpoint_dir)!r} needs {tuple(shapes[wrong[0]])}: is it an adapter of"
                       f" {adapter.get('base_model_name_or_path')!r}?")
    state = {k: v.contiguous() for k, v in state.items()}
    return export_finetuned(state, out, "lora", variant_fields(config), base=base_record(checkpoint_dir))
