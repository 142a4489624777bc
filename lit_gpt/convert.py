"""Convert checkpoints between the Hugging Face layout and ours (`lit_model.safetensors` + `lit_config.json`).

HF -> lit (`convert_hf_checkpoint`) streams the HF weights tensor by tensor (safetensors headers or memory-mapped
`.bin` files), renames them, and fuses each layer's query/key/value projections into one `attn.qkv` matrix whose
rows are [all q heads | all k heads | all v heads] (the layouts: `lit_gpt.convert_layouts`); the result is written
in the project's weights format (`lit_gpt.weights`: safetensors, sharded with an index above a size limit).
lit -> HF (`convert_lit_checkpoint`) is the exact inverse: it reads any lit weights (`lit_gpt.weights.load_weights`)
and writes `model.safetensors` (sharded above a size limit) plus a `config.json` that `transformers` loads.
"""

import json
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from tqdm import tqdm

from lit_gpt.config import Config
from lit_gpt.convert_layouts import FUSED_MLP, LAYOUTS, group_qkv, layer_map, qkv_grouping, split_qkv, ungroup_qkv
from lit_gpt.convert_moe import MOE_MODEL_TYPES, MoEImport, moe_export
from lit_gpt.hf_write import SUPPORTED_MODEL_TYPES, hf_config_dict, hf_model_type
from lit_gpt.model import GPT
from lit_gpt.mxfp4 import packed_prefixes
from lit_gpt.utils import (
    LitError,
    cannot_write,
    copy_file_atomic,
    error_reason,
    refuse_overwrite,
    write_text_atomic,
)
from lit_gpt.weights import (
    DEFAULT_MAX_SHARD_SIZE,
    LEGACY,
    STEM,
    check_checkpoint_dir,
    index_name,
    load_state_dict,
    load_weights,
    save_weights,
    save_weights_streaming,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# files copied next to exported weights so that the output folder is a complete HF model
HF_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",  # transformers 5 and newer Hub repos (SmolLM3) keep the template in its own file
)


# ---------------------------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------------------------
def _parse_dtype(dtype: Optional[Union[str, torch.dtype]]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.removeprefix("torch.")
    if name not in DTYPES:
        raise LitError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _expected_state(config: Config, packed: bool = False) -> Dict[str, torch.Size]:
    """Names and shapes of `GPT(config).state_dict()`, from a model on the meta device (no memory); `packed`: with
    the experts packed in MXFP4 (`lit_gpt.mxfp4.packed_shells`: their `.blocks` / `.scales` instead of `.weight`)."""
    with torch.device("meta"):
        model = GPT(config)
    if packed:
        from lit_gpt.mxfp4 import packed_shells

        packed_shells(model)
    return {k: v.shape for k, v in model.state_dict().items()}


def _check_state(state: Dict[str, torch.Tensor], expected: Dict[str, torch.Size], what: str, hint: str) -> None:
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    wrong = [
        f"{k} {tuple(state[k].shape)} != {tuple(s)}" for k, s in expected.items() if k in state and state[k].shape != s
    ]
    for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
        if items:
            shown = ", ".join(items[:3]) + (f" (+{len(items) - 3} more)" if len(items) > 3 else "")
            raise LitError(f"{what}: {len(items)} {label} tensor(s): {shown}. {hint}")


def _read_json(path: Path) -> Dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise LitError(f"cannot read {str(path)!r}: {error_reason(e)}") from e


def _write_text_atomic(path: Path, text: str) -> None:
    write_text_atomic(path, text)


# ---------------------------------------------------------------------------------------------------------------
# HF -> lit
# ---------------------------------------------------------------------------------------------------------------
def _weight_files(checkpoint_dir: Path) -> List[Path]:
    """The HF weight files: the shards an index names, else every `*.safetensors`, else `pytorch_model*.bin`."""
    kinds = (("model.safetensors.index.json", "*.safetensors"), ("pytorch_model.bin.index.json", "pytorch_model*.bin"))
    for index_file, pattern in kinds:
        index = checkpoint_dir / index_file
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise LitError(f"{str(index)!r} has no weight_map; download the checkpoint again")
            files = [checkpoint_dir / f for f in sorted(set(weight_map.values()))]
            absent = [f.name for f in files if not f.is_file()]
            if absent:
                raise LitError(
                    f"{str(index)!r} names shards that are missing: {', '.join(absent[:3])}. Download the checkpoint again"
                )
            return files
        # Mistral repos also ship `consolidated.safetensors` in Mistral's own layout, and a converted folder holds
        # the lit weights (`lit_model*.safetensors`) beside the HF ones: never mix them in
        files = sorted(f for f in checkpoint_dir.glob(pattern) if not f.name.startswith(("consolidated", STEM)))
        if files:
            return files
    raise LitError(
        f"no weights found in {str(checkpoint_dir)!r}: expected *.safetensors or pytorch_model*.bin files."
        " Download them with: python scripts/download.py --repo_id ORG/NAME"
    )


@contextmanager
def _open_weights(path: Path) -> Iterator[Tuple[List[str], Callable[[str], torch.Tensor]]]:
    """The tensor names of one weight file and a getter that reads one tensor at a time."""
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                yield list(f.keys()), f.get_tensor
        except SafetensorError as e:
            raise LitError(f"cannot read {str(path)!r} ({e}); download it again") from e
    else:
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError as e:
            if "mmap can only be used" not in str(e):
                state = load_state_dict(path)  # raises the LitError for a corrupt file
            # the pre-2020 (non-zip) format cannot be memory-mapped: read it whole, once
            state = load_state_dict(path, mmap=False)
        # `.clone()`: a mmapped tensor may be a view of a larger storage that torch.save would write whole
        yield list(state), lambda name: state[name].clone()
        del state


class _HFToLit:
    """Maps HF tensor names to lit names, fusing each layer's q/k/v as soon as all three have been read."""

    def __init__(self, model_type: str, config: Config, dtype: Optional[torch.dtype] = None,
                 dequantize_mxfp4: bool = False) -> None:
        self.model_type = model_type
        self.config = config
        self.layout = LAYOUTS[model_type]
        self.skip = [re.compile(p) for p in self.layout.skip]
        self.layer_re = re.compile(rf"^{re.escape(self.layout.layers)}\.(\d+)\.(.+)\.(weight|bias)$")
        self.pending: Dict[Tuple[int, str], Dict[str, torch.Tensor]] = {}
        # the experts (stacked per layer; MXFP4 kept packed, or decoded to `dtype` or bf16) and gpt-oss's sinks
        self.moe = (MoEImport(model_type, config, dtype, keep_mxfp4=not dequantize_mxfp4)
                    if model_type in MOE_MODEL_TYPES else None)
        self.any_layer_re = re.compile(rf"^{re.escape(self.layout.layers)}\.(\d+)\.(.+)$")

    def __call__(self, name: str, tensor: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
        """The lit tensors one HF tensor gives: none (skipped, or q/k/v waiting for the rest), one, or two (a
        fused gate/up projection)."""
        if any(p.search(name) for p in self.skip):
            return []
        for pattern, replacement in self.layout.rename:
            name = re.sub(pattern, replacement, name)
        module, _, param = name.rpartition(".")
        if module in self.layout.top:
            return [(f"{self.layout.top[module]}.{param}", tensor)]
        if self.moe is not None:
            m = self.any_layer_re.match(name)
            out = None if m is None else self.moe.take(int(m.group(1)), m.group(2), tensor)
            if out is not None:
                return out
        m = self.layer_re.match(name)
        if m is None:
            raise self._unexpected(name)
        i, sub, param = int(m.group(1)), m.group(2), m.group(3)
        lit_prefix = f"transformer.h.{i}"
        if sub in self.layout.layer:
            return [(f"{lit_prefix}.{self.layout.layer[sub]}.{param}", tensor)]
        fused = FUSED_MLP.get(self.model_type)
        if fused is not None and sub == fused[0]:
            gate, up = tensor.chunk(2, dim=0)
            return [(f"{lit_prefix}.{fused[1][0]}.{param}", gate), (f"{lit_prefix}.{fused[1][1]}.{param}", up)]
        if sub not in self.layout.qkv:
            raise self._unexpected(name)
        target = f"{lit_prefix}.attn.qkv.{param}"
        c = self.config
        if len(self.layout.qkv) == 1:
            return [(target, ungroup_qkv(tensor, *qkv_grouping(self.model_type, c), c.head_size))]
        parts = self.pending.setdefault((i, param), {})
        parts[sub] = tensor
        if len(parts) < 3:
            return []
        del self.pending[(i, param)]
        return [(target, torch.cat([parts[p] for p in self.layout.qkv]))]

    def _unexpected(self, name: str) -> LitError:
        return LitError(
            f"unexpected tensor {name!r} for model_type {self.model_type!r}: the weights do not match config.json"
            " (or --model_name)"
        )

    def finish(self) -> None:
        if self.moe is not None:
            self.moe.finish()
        if self.pending:
            (i, param), parts = next(iter(self.pending.items()))
            raise LitError(f"layer {i} has only {sorted(parts)} of q/k/v {param}s: the checkpoint is incomplete")


def _mismatch_hint(model_name: Optional[str]) -> str:
    return "Does the checkpoint match" + (f" --model_name {model_name}?" if model_name else " its config.json?")


def convert_hf_checkpoint(
    checkpoint_dir: Path,
    model_name: Optional[str] = None,
    dtype: Optional[str] = None,
    overwrite: bool = False,
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
    dequantize_mxfp4: bool = False,
) -> Path:
    """Convert the HF checkpoint in `checkpoint_dir` into `lit_model.safetensors` + `lit_config.json` in the same
    folder (above `max_shard_size` the weights are sharded: `lit_model-0000k-of-0000n.safetensors` and
    `lit_model.safetensors.index.json`; see `lit_gpt.weights`).

    The config comes from the registry entry `model_name` when given, else from `config.json` (named like the
    folder). `dtype` casts floating-point weights (float32, bfloat16 or float16). Existing lit weights (also an
    earlier version's `lit_model.pth`) or `lit_config.json` are replaced only with `overwrite`. gpt-oss's MXFP4
    experts are written packed as the Hub has them (`lit_gpt.mxfp4`: every loader decodes them, or keeps them packed
    for --quantize mxfp4); `dequantize_mxfp4` writes them decoded (to `dtype`, else bf16). Returns the path that
    `lit_gpt.weights.load_weights` reads: the weights file, or the index of the shards.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise LitError(
            f"checkpoint directory {str(checkpoint_dir)!r} does not exist. Download it with:"
            " python scripts/download.py --repo_id ORG/NAME"
        )
    target_dtype = _parse_dtype(dtype)
    shard_limit = _parse_size(max_shard_size)
    refuse_overwrite(
        checkpoint_dir,
        ("lit_model.safetensors", index_name(), LEGACY, "lit_config.json"),
        overwrite,
        "It is converted already: use it as it is, or pass --overwrite true to convert again",
    )
    hf_path = checkpoint_dir / "config.json"
    hf = _read_json(hf_path) if hf_path.exists() else None
    try:
        if model_name:
            config = Config.from_name(model_name)
        elif hf is None:
            raise LitError(
                f"no config.json in {str(checkpoint_dir)!r}: download it with the weights, or pass --model_name"
                " NAME (a registry entry, see `Config.names()`)"
            )
        else:
            config = Config.from_hf_config(hf, name=checkpoint_dir.name)
    except ValueError as e:
        raise LitError(str(e)) from e
    model_type = hf.get("model_type") if hf is not None else hf_model_type(config)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise LitError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == "gemma3":
        print("Gemma 3 multimodal checkpoint: converting its text model; the vision tower is left out", file=sys.stderr)
    # the text tower exports as a text-only model
    config.hf_model_type = "gemma3_text" if model_type == "gemma3" else model_type

    files = _weight_files(checkpoint_dir)
    mapper = _HFToLit(model_type, config, target_dtype, dequantize_mxfp4)
    state: Dict[str, torch.Tensor] = {}
    with tqdm(total=0, desc="Converting", unit="tensor", file=sys.stderr) as bar:
        for path in files:
            with _open_weights(path) as (names, get):
                bar.total += len(names)
                bar.refresh()
                for name in names:
                    tensor = get(name)
                    try:
                        out = mapper(name, tensor)
                    except RuntimeError as e:  # a fused qkv whose size does not fit the config's heads
                        raise LitError(
                            f"tensor {name!r} of shape {tuple(tensor.shape)} does not fit the config ({e})."
                            f" {_mismatch_hint(model_name)}"
                        ) from e
                    bar.update()
                    for lit_name, tensor in out:
                        if target_dtype is not None and tensor.is_floating_point():
                            tensor = tensor.to(target_dtype)
                        if tensor.untyped_storage().nbytes() != tensor.nbytes:
                            # half of a fused tensor (a view): safetensors stores a tensor's own bytes only
                            tensor = tensor.clone()
                        state[lit_name] = tensor
    mapper.finish()
    if config.tie_embeddings and "transformer.wte.weight" in state:
        # one tensor for both names, as in the model (the weights file stores it once, under the embedding's name)
        state["lm_head.weight"] = state["transformer.wte.weight"]
    expected = _expected_state(config, packed=bool(packed_prefixes(state)))
    _check_state(state, expected, f"converting {str(checkpoint_dir)!r}", _mismatch_hint(model_name))

    try:
        written = save_weights(state, checkpoint_dir, max_shard_size=shard_limit)
    except OSError as e:  # a full disk, a read-only folder: one line (the staging folder is removed)
        raise cannot_write(e, checkpoint_dir, "lit_model.safetensors") from None
    # an earlier version's conversion in this folder (reached only with `overwrite`): it would disagree with the new
    # weights, so it goes (the new file is complete by now)
    (checkpoint_dir / LEGACY).unlink(missing_ok=True)
    config.save(checkpoint_dir)
    out_path = written[-1]  # the single file, or the index (written last)
    shards = f", {len(written) - 1} shards" if len(written) > 1 else ""
    print(f"Saved {out_path} ({len(state)} tensors{shards}) and {checkpoint_dir / 'lit_config.json'}", file=sys.stderr)
    return out_path


# ---------------------------------------------------------------------------------------------------------------
# lit -> HF
# ---------------------------------------------------------------------------------------------------------------
def _lit_to_hf(
    name: str, config: Config, model_type: str, layer_map: Dict[str, str], state: Dict[str, torch.Tensor]
) -> List[Tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    """HF names for one lit tensor, each with the function that makes that HF tensor from the lit one (a third of a
    fused qkv, a gate with its up projection appended from `state`); on meta tensors it gives the HF shapes."""
    layout = LAYOUTS[model_type]
    module, _, param = name.rpartition(".")
    ident = lambda t: t  # noqa: E731
    for hf_module, lit_module in layout.top.items():
        if module == lit_module:
            return [(f"{hf_module}.{param}", ident)]
    m = re.match(r"^transformer\.h\.(\d+)\.(.+)$", module)
    if m is None:
        raise LitError(f"unexpected tensor {name!r} in the lit checkpoint")
    i, sub = m.group(1), m.group(2)
    prefix = f"{layout.layers}.{i}"
    moe = moe_export(name, config, model_type, layout.layers, state)
    if moe is not None:
        return moe
    if sub == "attn.qkv" and layout.qkv:
        if len(layout.qkv) == 1:
            groups = qkv_grouping(model_type, config)
            return [(f"{prefix}.{layout.qkv[0]}.{param}", lambda t: group_qkv(t, *groups, config.head_size))]
        return [
            (f"{prefix}.{hf_sub}.{param}", lambda t, j=j: split_qkv(t, config)[j])
            for j, hf_sub in enumerate(layout.qkv)
        ]
    fused = FUSED_MLP.get(model_type)
    if fused is not None and sub in fused[1]:
        if sub == fused[1][1]:
            return []  # written with the gate, below
        up = state[f"transformer.h.{i}.{fused[1][1]}.{param}"]
        return [(f"{prefix}.{fused[0]}.{param}", lambda t: torch.cat((t, up.to(t.dtype))))]
    for hf_sub, lit_sub in layer_map.items():
        if sub == lit_sub:
            return [(f"{prefix}.{hf_sub}.{param}", ident)]
    raise LitError(f"unexpected tensor {name!r} in the lit checkpoint")


def _parse_size(size: Union[int, str]) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)i?B?\s*", size, re.IGNORECASE)
    if m is None:
        raise LitError(f"cannot parse size {size!r}; write e.g. 5GB or 500MB")
    return int(float(m.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}[m.group(2).upper()])


def convert_lit_checkpoint(
    checkpoint_dir: Path,
    output_dir: Path,
    checkpoint_path: Optional[Path] = None,
    dtype: Optional[str] = None,
    max_shard_size: Union[int, str] = "5GB",
    overwrite: bool = False,
) -> Path:
    """Export a lit checkpoint as an HF model folder that `transformers.AutoModelForCausalLM` loads.

    `checkpoint_dir` holds `lit_config.json` (and the tokenizer files, copied along); `checkpoint_path` picks other
    weights than its own (`lit_model.safetensors`, the index of its shards, or an earlier version's `lit_model.pth`),
    e.g. a finetuned or LoRA-merged file. Writes `model.safetensors` (sharded
    with an index above `max_shard_size`) and `config.json` into `output_dir`, which it returns. An `output_dir`
    that already holds an HF model (`config.json`, `model*.safetensors`) is refused unless `overwrite`.
    """
    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    if output_dir.is_dir():
        existing = ["config.json", "model.safetensors.index.json", "pytorch_model.bin"]
        existing += sorted(p.name for p in output_dir.glob("model*.safetensors"))
        refuse_overwrite(
            output_dir, existing, overwrite, "Pass --output_dir NEW_FOLDER, or --overwrite true to replace that model"
        )
    elif output_dir.exists():
        raise LitError(f"--output_dir {str(output_dir)!r} is a file, not a folder: pass a folder")
    target_dtype = _parse_dtype(dtype)
    shard_limit = _parse_size(max_shard_size)
    path = Path(checkpoint_path) if checkpoint_path is not None else check_checkpoint_dir(checkpoint_dir)
    try:
        config = Config.from_checkpoint(checkpoint_dir)
    except (FileNotFoundError, ValueError) as e:
        raise LitError(str(e)) from e
    model_type = hf_model_type(config)
    hf_config = hf_config_dict(config, model_type)

    state = load_weights(path)  # memory-mapped: read tensor by tensor as the shards are written
    if isinstance(state.get("model"), dict):  # training checkpoints wrap the weights with optimizer state
        state = state["model"]
    if any("lora_" in k for k in state):
        raise LitError(
            f"{str(path)!r} holds LoRA weights: merge them first with scripts/merge_lora.py and pass the merged"
            " lit_model.safetensors as --checkpoint_path"
        )
    if config.tie_embeddings and "lm_head.weight" not in state and "transformer.wte.weight" in state:
        state = {**state, "lm_head.weight": state["transformer.wte.weight"]}
    _check_state(state, _expected_state(config), f"{str(path)!r}", "Does it belong to this lit_config.json?")

    # every HF tensor's name, shape and dtype, from the lit tensors on the meta device (nothing is computed): the
    # writer plans the shards from them (huggingface_hub's planning) and asks for the tensors one shard at a time
    layers = layer_map(model_type, config)
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}
    specs: Dict[str, torch.Tensor] = {}
    source: Dict[str, str] = {}  # HF name -> the lit tensor it comes from
    for name in state:
        if name == "lm_head.weight" and config.tie_embeddings:
            continue  # transformers ties lm_head to the embeddings itself
        for hf_name, fn in _lit_to_hf(name, config, model_type, layers, meta):
            spec = fn(meta[name])
            dtype = target_dtype if target_dtype is not None and spec.is_floating_point() else spec.dtype
            specs[hf_name], source[hf_name] = torch.empty(spec.shape, dtype=dtype, device="meta"), name
    out_dtype = next((s.dtype for s in specs.values() if s.is_floating_point()), None)

    def materialize(names: List[str]) -> Dict[str, torch.Tensor]:
        tensors: Dict[str, torch.Tensor] = {}
        for lit_name in dict.fromkeys(source[n] for n in names):
            for hf_name, fn in _lit_to_hf(lit_name, config, model_type, layers, state):
                if hf_name in names:
                    t = fn(state[lit_name]).to(specs[hf_name].dtype).contiguous()
                    # a view (q/k/v rows of qkv) would make safetensors write, or refuse, the whole storage
                    tensors[hf_name] = t.clone() if t.untyped_storage().nbytes() != t.nbytes else t
        bar.update(len(tensors))
        return tensors

    with tqdm(total=len(specs), desc="Exporting", unit="tensor", file=sys.stderr) as bar:
        try:
            # model.safetensors, or model-0000k-of-0000n.safetensors + model.safetensors.index.json as transformers
            # writes them; the files of an earlier export here (another shard count) are replaced
            written = save_weights_streaming(specs, materialize, output_dir, stem="model", max_shard_size=shard_limit)
        except OSError as e:  # a full disk, a read-only folder: one line, and no partial file
            raise cannot_write(e, output_dir, "model.safetensors") from None
    n = max(len(written) - 1, 1)  # the shards (the index is the last file), or the one file

    if out_dtype is not None:
        hf_config["torch_dtype"] = str(out_dtype).removeprefix("torch.")
    original = checkpoint_dir / "config.json"
    if original.is_file():
        orig = _read_json(original)
        if orig.get("model_type") == "gemma3" and model_type == "gemma3_text":  # the text tower of a multimodal one
            orig = {**(orig.get("text_config") or {}), **orig, "model_type": model_type}
        if orig.get("model_type") == model_type:
            # keep what the lit config does not model (special token ids)
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if key in orig:
                    hf_config[key] = orig[key]
    _write_text_atomic(output_dir / "config.json", json.dumps(hf_config, indent=2))
    if checkpoint_dir.resolve() != output_dir.resolve():
        for name in HF_SIDE_FILES:
            if (checkpoint_dir / name).is_file():
                copy_file_atomic(checkpoint_dir / name, output_dir / name)
    print(f"Saved {n} safetensors file(s) and config.json to {output_dir}", file=sys.stderr)
    return output_dir
