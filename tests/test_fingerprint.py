"""Finetuned files know their base (lit_gpt/fingerprint.py): the fingerprint of a base model's weights is the same for
every dtype-preserving copy of them (a copy, a re-shard, an earlier version's .pth, a tied head stored once or twice,
an fp32 upcast of bf16) and differs for other values; finetuned files record it (`lit_model.<method>.json`'s "base",
a full model's header metadata); and the recipes that apply finetuned weights to a base (generate lora / adapter /
adapter_v2, CPU and XLA, and scripts/merge_lora.py) refuse another base in one line unless --allow_other_base true."""

import importlib
import importlib.util
import json
import shutil
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pytest
import torch
from safetensors.torch import save_file

from lit_gpt.fingerprint import (
    ALLOW_OTHER_BASE_HELP, CHUNK, base_record, check_base, fingerprint, fingerprint_state,
)
from lit_gpt.utils import LitError
from lit_gpt.weights import (
    BASE_CHECKPOINT_DIR_KEY, BASE_FINGERPRINT_KEY, base_metadata, load_weights, read_base_record, save_weights,
)
from test_generate import tiny_model
from test_generate_recipes import write_tokenizer
from test_quantize import run_script
from tiny import write_checkpoint

REPO = Path(__file__).resolve().parents[1]
State = Dict[str, torch.Tensor]


def base_state(seed: int = 0) -> State:
    return tiny_model(seed, block_size=32).state_dict()  # tied: lm_head.weight is transformer.wte.weight


def folder(tmp_path: Path, name: str, state: State) -> Path:
    d = tmp_path / name
    save_weights(state, d)
    return d


def changed(state: State, name: str, row: int) -> State:
    out = {k: v.clone() for k, v in state.items()}
    if name == "transformer.wte.weight":
        out["lm_head.weight"] = out[name]
    out[name][row, 0] += 1.0
    return out


# ---------------------------------------------------------------------------------------------------------------
# the fingerprint: (case, two fingerprints of a base model's weights, the same?)
# ---------------------------------------------------------------------------------------------------------------
def _copy(tmp_path, s):
    a = folder(tmp_path, "a", s)
    return fingerprint(a), fingerprint(shutil.copytree(a, tmp_path / "copy"))


def _reshard(tmp_path, s):
    b = tmp_path / "sharded"
    written = save_weights(s, b, max_shard_size=20_000)
    assert written[-1].name == "lit_model.safetensors.index.json" and len(written) > 3
    return fingerprint(folder(tmp_path, "a", s)), fingerprint(b)


def _legacy_pth(tmp_path, s):
    b = tmp_path / "legacy"
    b.mkdir()
    torch.save(s, b / "lit_model.pth")
    return fingerprint(folder(tmp_path, "a", s)), fingerprint(b)


def _file_path(tmp_path, s):
    a = folder(tmp_path, "a", s)
    return fingerprint(a), fingerprint(a / "lit_model.safetensors")


def _fp32_upcast_of_bf16(tmp_path, s):
    bf16 = {k: v.to(torch.bfloat16) for k, v in s.items()}
    bf16["lm_head.weight"] = bf16["transformer.wte.weight"]
    fp32 = {k: v.float() for k, v in bf16.items()}
    fp32["lm_head.weight"] = fp32["transformer.wte.weight"]
    return fingerprint(folder(tmp_path, "bf16", bf16)), fingerprint(folder(tmp_path, "fp32", fp32))


def _tied_stored_twice(tmp_path, s):
    b = tmp_path / "twice"
    b.mkdir()
    save_file({k: v.clone().contiguous() for k, v in s.items()}, str(b / "lit_model.safetensors"))
    return fingerprint(folder(tmp_path, "a", s)), fingerprint(b)


def _tied_not_stored(tmp_path, s):
    b = tmp_path / "hf_style"  # the head left out, no alias in the header (the Hub's tied checkpoints)
    b.mkdir()
    save_file({k: v.clone() for k, v in s.items() if k != "lm_head.weight"}, str(b / "lit_model.safetensors"))
    return fingerprint(folder(tmp_path, "a", s)), fingerprint(b)


def _in_memory(tmp_path, s):
    return fingerprint_state(s), fingerprint(folder(tmp_path, "a", s))


def _in_memory_bf16(tmp_path, s):
    bf16 = {k: v.to(torch.bfloat16) for k, v in s.items()}
    return fingerprint_state(bf16), fingerprint(folder(tmp_path, "a", bf16))


def _unsampled_row(tmp_path, s):  # only a few rows are read: a value elsewhere is not seen (that is the cost model)
    return fingerprint_state(s), fingerprint(folder(tmp_path, "b", changed(s, "transformer.h.0.mlp.fc_1.weight", 1)))


def _value_in(name: str, row: Callable[[int], int]):
    def case(tmp_path, s):
        other = changed(s, name, row(len(s[name])))
        return fingerprint(folder(tmp_path, "a", s)), fingerprint(folder(tmp_path, "b", other))
    return case


def _another_model(tmp_path, s):
    return fingerprint(folder(tmp_path, "a", s)), fingerprint(folder(tmp_path, "b", base_state(seed=1)))


def _untied_head(tmp_path, s):
    untied = dict(s, **{"lm_head.weight": s["lm_head.weight"].clone() * 2})
    return fingerprint(folder(tmp_path, "a", s)), fingerprint(folder(tmp_path, "b", untied))


def _swapped_layers(tmp_path, s):  # same shapes, same values, other places
    swapped = dict(s)
    a, b = "transformer.h.0.attn.proj.weight", "transformer.h.1.attn.proj.weight"
    swapped[a], swapped[b] = s[b], s[a]
    return fingerprint_state(s), fingerprint(folder(tmp_path, "b", swapped))


def _other_shape(tmp_path, s):
    return fingerprint_state(s), fingerprint_state(tiny_model(0, block_size=32, vocab_size=384).state_dict())


def _long_row_middle_chunk(tmp_path, s):
    w = torch.randn(2, 3 * CHUNK + 500, generator=torch.Generator().manual_seed(0))
    w2 = w.clone()
    w2[0, w.shape[1] // 2] += 1.0
    return fingerprint(folder(tmp_path, "a", {"w": w})), fingerprint(folder(tmp_path, "b", {"w": w2}))


FINGERPRINT_CASES: List[Tuple[str, Callable, bool]] = [
    ("copy", _copy, True),
    ("reshard-into-shards", _reshard, True),
    ("legacy-pth", _legacy_pth, True),
    ("folder-or-its-file", _file_path, True),
    ("fp32-upcast-of-bf16", _fp32_upcast_of_bf16, True),
    ("tied-head-stored-twice", _tied_stored_twice, True),
    ("tied-head-not-stored", _tied_not_stored, True),
    ("in-memory-equals-file", _in_memory, True),
    ("in-memory-equals-file-bf16", _in_memory_bf16, True),
    ("value-off-the-sampled-rows", _unsampled_row, True),
    ("value-in-first-row", _value_in("transformer.h.0.attn.qkv.weight", lambda n: 0), False),
    ("value-in-middle-row", _value_in("transformer.h.1.mlp.proj.weight", lambda n: n // 2), False),
    ("value-in-last-row-of-tied-embedding", _value_in("transformer.wte.weight", lambda n: n - 1), False),
    ("another-model-same-shapes", _another_model, False),
    ("untied-head", _untied_head, False),
    ("swapped-layers", _swapped_layers, False),
    ("other-shape", _other_shape, False),
    ("long-row-middle-chunk", _long_row_middle_chunk, False),
]


@pytest.mark.parametrize("case, same", [(c, s) for _, c, s in FINGERPRINT_CASES],
                         ids=[name for name, _, _ in FINGERPRINT_CASES])
def test_fingerprint(tmp_path, case, same):
    a, b = case(tmp_path, base_state())
    assert a.startswith("sha256:") and len(a) == len("sha256:") + 16, a
    assert (a == b) is same, (a, b)


def test_fingerprint_of_a_damaged_or_missing_base_is_one_line(tmp_path):
    a = folder(tmp_path, "a", base_state())
    (a / "lit_model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"garbage!")
    with pytest.raises(LitError, match="cannot read weights .*corrupt or truncated"):
        fingerprint(a)
    with pytest.raises(LitError, match="does not exist"):
        fingerprint(tmp_path / "nowhere")


# ---------------------------------------------------------------------------------------------------------------
# check_base: (recorded, checkpoint dir, flag) -> the outcome and the one line
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> Dict[str, Path]:
    """Two tiny bases of the same shapes and tokenizer (a: the one the files are finetuned on, b: another), and a
    copy of a in other files (sharded, an earlier version's .pth)."""
    root = tmp_path_factory.mktemp("bases")
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        out[name] = write_checkpoint(tiny_model(seed, block_size=32), root / name)
        write_tokenizer(out[name])
    out["a_sharded"] = root / "a_sharded"
    shutil.copytree(out["a"], out["a_sharded"], ignore=lambda d, names: [n for n in names if n.startswith("lit_model")])
    save_weights(load_weights(out["a"] / "lit_model.safetensors"), out["a_sharded"], max_shard_size=20_000)
    out["a_pth"] = root / "a_pth"
    shutil.copytree(out["a"], out["a_pth"], ignore=lambda d, names: [n for n in names if n.startswith("lit_model")])
    torch.save(load_weights(out["a"] / "lit_model.safetensors"), out["a_pth"] / "lit_model.pth")
    return out


CHECK_CASES = [
    # (id, recorded: "a" | "none" | "bad", base, flag, raises, fragments of the line (error or warning))
    ("nothing-recorded", "none", "b", False, None, []),
    ("same-base", "a", "a", False, None, []),
    ("same-base-resharded", "a", "a_sharded", False, None, []),
    ("same-base-as-pth", "a", "a_pth", False, None, []),
    ("other-base", "a", "b", False, LitError, ["{a}", "{b}", "{fa}", "{fb}", "--allow_other_base true"]),
    ("other-base-allowed", "a", "b", True, None, ["warning:", "{a}", "{b}", "{fa}", "{fb}"]),
    ("malformed-record", "bad", "a", False, LitError, ["unreadably", "--allow_other_base true"]),
]


@pytest.mark.parametrize("recorded, base, flag, raises, fragments", [c[1:] for c in CHECK_CASES],
                         ids=[c[0] for c in CHECK_CASES])
def test_check_base(bases, capsys, recorded, base, flag, raises, fragments):
    names = {"a": str(bases["a"]), "b": str(bases["b"]), "fa": fingerprint(bases["a"]), "fb": fingerprint(bases["b"])}
    record = {"a": base_record(bases["a"]), "none": None, "bad": {"fingerprint": 3}}[recorded]
    if raises:
        with pytest.raises(raises) as exc:
            check_base(record, bases[base], flag, "the lora weights 'x'")
        line = str(exc.value)
    else:
        check_base(record, bases[base], flag, "the lora weights 'x'")
        line = capsys.readouterr().err.strip()
        assert bool(line) == bool(fragments), line
    assert "\n" not in line
    for fragment in fragments:
        assert fragment.format(**names) in line, line


# ---------------------------------------------------------------------------------------------------------------
# what is recorded: the JSON's "base", a full model's header metadata (single file or index)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method, base, shard", [("lora", True, False), ("lora", False, False), ("full", True, False),
                                                 ("full", True, True), ("full", False, False)],
                         ids=["lora", "lora-without-base", "full", "full-sharded", "full-without-base"])
def test_exports_record_their_base(tmp_path, method, base, shard):
    from lit_gpt.export import export_weights

    record = {"fingerprint": "sha256:0123456789abcdef", "checkpoint_dir": "checkpoints/org/base"}
    state = {"w": torch.ones(64, 64)}
    final = tmp_path / "final"
    if shard:
        path = save_weights(state, final, max_shard_size=4096, metadata=base_metadata(record))[-1]
    else:
        path = export_weights(state, final, method, {"lora_r": 2} if method == "lora" else None,
                              lambda stage: None, base=record if base else None)
    assert read_base_record(path) == (record if base else None)
    if method == "lora":
        meta = json.loads((final / "lit_model.lora.json").read_text())
        assert ("base" in meta) is base and meta["config"] == {"lora_r": 2}
        assert meta.get("base") == (record if base else None)
    elif not shard:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            header = f.metadata()
        expected = {BASE_FINGERPRINT_KEY: record["fingerprint"], BASE_CHECKPOINT_DIR_KEY: record["checkpoint_dir"]}
        assert {k: header.get(k) for k in expected} == (expected if base else dict.fromkeys(expected))
    assert torch.equal(load_weights(path)["w"], state["w"])  # the metadata does not get in the way of loading


# ---------------------------------------------------------------------------------------------------------------
# the recipes: finetuned files on the base they were trained on, on another one, with the flag, without a record
# ---------------------------------------------------------------------------------------------------------------
VARIANTS = {"lora": dict(lora_r=2, lora_alpha=4, lora_mlp=True), "adapter": dict(adapter_start_layer=0),
            "adapter_v2": dict(adapter_start_layer=0)}


@pytest.fixture(scope="module")
def finetuned(bases, tmp_path_factory) -> Dict[str, Path]:
    """{"lora": lit_model.lora.safetensors finetuned on base a (recording it), ..., "lora_old": the same without
    "base" in its JSON (an earlier version's file)}"""
    from lit_gpt.peft import save_finetuned

    root = tmp_path_factory.mktemp("finetuned")
    out = {}
    for method, variant in VARIANTS.items():
        module = importlib.import_module(f"lit_gpt.{method}")
        model = module.GPT(module.Config.from_checkpoint(bases["a"], **variant))
        model.load_state_dict(load_weights(bases["a"] / "lit_model.safetensors"), strict=False)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if model.peft_filter(n, p):
                    p.normal_(std=0.1, generator=torch.Generator().manual_seed(3))
        out[method] = save_finetuned(model, root / method, base=base_record(bases["a"]))
        if method == "lora":
            out["lora_old"] = save_finetuned(model, root / "lora_old")
    assert "base" not in json.loads((root / "lora_old" / "lit_model.lora.json").read_text())
    return out


def tree(root: Path) -> List[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


GENERATE = ["--prompt", "The capital", "--prompt_style", "raw", "--temperature", "0", "--max_new_tokens", "3",
            "--accelerator", "cpu"]
RECIPE_CASES = [
    # (id, script, finetuned file, base, flags, exit code, fragments of the one error / warning line)
    ("lora-other-base", "generate/lora.py", "lora", "b", [], 1,
     ["{a}", "{b}", "{fa}", "{fb}", "--allow_other_base true"]),
    ("lora-other-base-allowed", "generate/lora.py", "lora", "b", ["--allow_other_base", "true"], 0,
     ["warning:", "{b}"]),
    ("lora-its-base", "generate/lora.py", "lora", "a", [], 0, []),
    ("lora-its-base-as-pth", "generate/lora.py", "lora", "a_pth", [], 0, []),
    ("lora-without-record", "generate/lora.py", "lora_old", "b", [], 0, []),
    ("adapter-other-base", "generate/adapter.py", "adapter", "b", [], 1, ["{a}", "{b}", "--allow_other_base true"]),
    ("adapter-other-base-allowed", "generate/adapter.py", "adapter", "b", ["--allow_other_base", "true"], 0,
     ["warning:"]),
    ("adapter_v2-other-base", "generate/adapter_v2.py", "adapter_v2", "b", [], 1, ["{a}", "{b}", "{fb}"]),
    ("merge-other-base", "scripts/merge_lora.py", "lora", "b", [], 1, ["{a}", "{b}", "{fa}", "{fb}",
                                                                       "--allow_other_base true"]),
    ("merge-other-base-allowed", "scripts/merge_lora.py", "lora", "b", ["--allow_other_base", "true"], 0,
     ["warning:", "{a}", "{b}"]),
    ("merge-its-base-resharded", "scripts/merge_lora.py", "lora", "a_sharded", [], 0, []),
    ("merge-without-record", "scripts/merge_lora.py", "lora_old", "b", [], 0, []),
]


@pytest.mark.parametrize("script, file, base, flags, code, fragments", [c[1:] for c in RECIPE_CASES],
                         ids=[c[0] for c in RECIPE_CASES])
def test_recipes_refuse_another_base(bases, finetuned, tmp_path, capsys, monkeypatch, script, file, base, flags,
                                     code, fragments):
    names = {"a": str(bases["a"]), "b": str(bases["b"]), "fa": fingerprint(bases["a"]), "fb": fingerprint(bases["b"])}
    weights = finetuned[file]
    before = {d: tree(d) for d in (bases[base], weights.parent)}
    merged = tmp_path / "out" / "merged"
    if script == "scripts/merge_lora.py":
        args = ["--checkpoint_dir", str(bases[base]), "--lora_path", str(weights), "--out_dir", str(merged), *flags]
    else:
        flag = "--lora_path" if file.startswith("lora") else "--adapter_path"
        args = ["--checkpoint_dir", str(bases[base]), flag, str(weights), *GENERATE, *flags]
    proc = run_script(capsys, monkeypatch, script, *args)
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith(("error:", "warning:"))]
    assert len(lines) == (1 if fragments else 0), proc.stderr
    for fragment in fragments:
        assert fragment.format(**names) in lines[0], lines[0]
    if code:
        assert proc.stderr.strip().splitlines()[-1] == lines[0] and lines[0].startswith("error:")
        assert proc.stdout == ""
    # on disk: the base and the finetuned files untouched; a merge wrote its folder only when it ran
    assert {d: tree(d) for d in before} == before
    if script == "scripts/merge_lora.py":
        assert merged.is_dir() is (code == 0) and (tmp_path / "out").exists() is (code == 0)
        if code == 0:
            assert (merged / "lit_model.safetensors").is_file() and (merged / "lit_config.json").is_file()
    else:
        assert (proc.stdout.startswith("The capital")) is (code == 0), proc.stdout


def test_the_xla_loader_refuses_another_base_before_loading(bases, finetuned, monkeypatch, capsys):
    """xla/generate/{lora,adapter}.py load through `load_variant_staged`: the check runs before the staged loader."""
    pytest.importorskip("torch_xla")
    import lit_gpt.xla.loader
    from lit_gpt import lora
    from lit_gpt.recipes.xla_generate import load_variant_staged

    calls = []
    monkeypatch.setattr(lit_gpt.xla.loader, "load_staged", lambda *a, **k: calls.append(a) or lora.GPT(
        lora.Config.from_checkpoint(bases["a"], **VARIANTS["lora"])))
    with pytest.raises(LitError, match=r"records the base .* --allow_other_base true") as exc:
        load_variant_staged(None, lora.GPT, lora.Config, bases["b"], finetuned["lora"])
    assert str(bases["a"]) in str(exc.value) and str(bases["b"]) in str(exc.value) and not calls
    load_variant_staged(None, lora.GPT, lora.Config, bases["b"], finetuned["lora"], allow_other_base=True)
    assert len(calls) == 1 and capsys.readouterr().err.startswith("warning:")
    load_variant_staged(None, lora.GPT, lora.Config, bases["a"], finetuned["lora"])
    assert len(calls) == 2 and capsys.readouterr().err == ""


def test_the_flag_reads_the_same_everywhere():
    """--allow_other_base: one help text on the method generate recipes (tests/test_recipe_signatures.py holds them
    equal) and on scripts/merge_lora.py."""
    import docstring_parser

    spec = importlib.util.spec_from_file_location("merge_lora_script", REPO / "scripts" / "merge_lora.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    helps = {p.arg_name: p.description for p in docstring_parser.parse(module.setup.__doc__).params}
    assert " ".join(helps["allow_other_base"].split()) == " ".join(ALLOW_OTHER_BASE_HELP.split())
    from lit_gpt.recipes.generate import ALLOW_OTHER_BASE

    assert ALLOW_OTHER_BASE.doc == ALLOW_OTHER_BASE_HELP and ALLOW_OTHER_BASE.default is False
