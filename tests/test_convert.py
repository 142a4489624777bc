"""HF <-> lit checkpoint conversion: bit-exact round trips, every input layout, exports transformers loads, errors."""

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from lit_gpt import GPT, Config  # noqa: E402
from lit_gpt.convert import (  # noqa: E402
    convert_hf_checkpoint,
    convert_lit_checkpoint,
    hf_config_dict,
    hf_model_type,
)
from lit_gpt.utils import LitError  # noqa: E402
from lit_gpt.weights import find_weights, load_weights, save_weights  # noqa: E402
from tiny_hf import FAMILIES, VOCAB, build_hf_model  # noqa: E402  (the tiny HF configs of every family)

REPO = Path(__file__).resolve().parents[1]


def read_safetensors(directory: Path) -> dict:
    """The HF weights of a folder (a converted folder also holds the lit weights: lit_model*.safetensors)."""
    out = {}
    for path in sorted(directory.glob("model*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def lit_state(directory: Path) -> dict:
    return load_weights(find_weights(directory))


def assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


@pytest.fixture
def llama_dir(tmp_path) -> Path:
    """A tiny HF Llama (GQA) saved by transformers as one model.safetensors, plus a tokenizer side file."""
    d = tmp_path / "hf" / "tiny-llama"
    build_hf_model("tinyllama").save_pretrained(d)
    (d / "tokenizer_config.json").write_text('{"model_max_length": 2048}')
    return d


@pytest.mark.parametrize("family", list(FAMILIES))
@torch.no_grad()
def test_hf_to_lit_to_hf_is_bit_exact_and_loads_in_transformers(family, tmp_path):
    hf_model = build_hf_model(family)
    src = tmp_path / "src"
    hf_model.save_pretrained(src)
    convert_hf_checkpoint(src)
    out = convert_lit_checkpoint(src, tmp_path / "out")

    assert_same_tensors(read_safetensors(out), read_safetensors(src))
    exported_config = json.loads((out / "config.json").read_text())
    assert exported_config["model_type"] == json.loads((src / "config.json").read_text())["model_type"]

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    idx = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(reloaded(idx).logits, hf_model(idx).logits, atol=1e-6, rtol=0)
    # and the config read back from the export describes the same lit model
    again = Config.from_hf_config(exported_config, name=src.name)
    assert again == Config.from_checkpoint(src)


def test_lit_checkpoint_matches_model_state_dict_and_ties(llama_dir, tmp_path):
    path = convert_hf_checkpoint(llama_dir)
    assert path == llama_dir / "lit_model.safetensors"
    with safe_open(str(path), framework="pt") as f:  # a plain safetensors file with lit_gpt's tensor names
        assert "transformer.h.1.attn.qkv.weight" in f.keys()
    config = Config.from_checkpoint(llama_dir)
    assert config.name == "tiny-llama" and config.hf_model_type == "llama"
    state = lit_state(llama_dir)
    assert sorted(state) == sorted(GPT(config).state_dict())
    # q/k/v are fused as [q heads | k heads | v heads]
    with safe_open(str(llama_dir / "model.safetensors"), framework="pt") as f:
        q, k, v = (f.get_tensor(f"model.layers.1.self_attn.{p}_proj.weight") for p in "qkv")
    assert torch.equal(state["transformer.h.1.attn.qkv.weight"], torch.cat((q, k, v)))

    tied = tmp_path / "tied"
    build_hf_model("smollm2").save_pretrained(tied)
    with safe_open(str(tied / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # HF drops the tied head
    convert_hf_checkpoint(tied)
    state = lit_state(tied)
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()


def test_sharded_safetensors_and_bin_inputs_give_the_same_checkpoint(tmp_path):
    hf_model = build_hf_model("falcon-40b")
    single = tmp_path / "single"
    hf_model.save_pretrained(single)
    convert_hf_checkpoint(single)
    reference = lit_state(single)

    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    convert_hf_checkpoint(sharded)
    assert_same_tensors(lit_state(sharded), reference)

    # pytorch_model.bin, single and sharded with an index, as older checkpoints ship
    tensors = read_safetensors(single)
    for name, split in (("bin", False), ("bin_sharded", True)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((single / "config.json").read_text())
        if not split:
            torch.save(tensors, d / "pytorch_model.bin", _use_new_zipfile_serialization=False)  # pre-2020 format
        else:
            keys = sorted(tensors)
            halves = {"pytorch_model-00001-of-00002.bin": keys[::2], "pytorch_model-00002-of-00002.bin": keys[1::2]}
            for fname, ks in halves.items():
                torch.save({k: tensors[k] for k in ks}, d / fname)
            weight_map = {k: fname for fname, ks in halves.items() for k in ks}
            (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
        convert_hf_checkpoint(d)
        assert_same_tensors(lit_state(d), reference)


def test_dtype_cast(llama_dir):
    reference = {k: v.to(torch.bfloat16) for k, v in read_safetensors(llama_dir).items()}
    convert_hf_checkpoint(llama_dir, dtype="bfloat16")
    state = lit_state(llama_dir)
    assert {v.dtype for v in state.values()} == {torch.bfloat16}
    assert torch.equal(state["transformer.wte.weight"], reference["model.embed_tokens.weight"])
    with pytest.raises(LitError, match="unknown dtype"):
        convert_hf_checkpoint(llama_dir, dtype="float8")


def test_export_finetuned_weights_sharded_with_side_files(llama_dir, tmp_path):
    convert_hf_checkpoint(llama_dir)
    config = Config.from_checkpoint(llama_dir)
    state = lit_state(llama_dir)
    state["transformer.h.0.mlp.proj.weight"] = state["transformer.h.0.mlp.proj.weight"] + 1.0
    # what finetune/full.py leaves in final/ (an earlier version's wrapped .pth: test_legacy_lit_model_pth_...)
    finetuned = save_weights(state, tmp_path / "finetune")[-1]

    out = convert_lit_checkpoint(llama_dir, tmp_path / "export", checkpoint_path=finetuned, max_shard_size="30KB")
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    exported = read_safetensors(out)
    assert set(index["weight_map"]) == set(exported)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in exported.values())
    assert torch.equal(exported["model.layers.0.mlp.down_proj.weight"], state["transformer.h.0.mlp.proj.weight"])
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 2048}'

    model = GPT(config).eval()
    model.load_state_dict(state)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    idx = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(idx).logits, model(idx), atol=1e-4, rtol=0)

    # exporting into a folder that holds a model is refused, leaving it as it was ...
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    refused = r"already holds config\.json.*refusing to overwrite.*--output_dir.*--overwrite true"
    with pytest.raises(LitError, match=refused):
        convert_lit_checkpoint(llama_dir, out, checkpoint_path=finetuned, dtype="bfloat16")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # ... and with overwrite, exporting again unsharded into the same folder leaves no stale shards behind
    convert_lit_checkpoint(llama_dir, out, checkpoint_path=finetuned, dtype="bfloat16", overwrite=True)
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_sharded_lit_weights_load_bit_identical_and_export_the_same(llama_dir, tmp_path):
    convert_hf_checkpoint(llama_dir)
    reference = lit_state(llama_dir)
    single_export = read_safetensors(convert_lit_checkpoint(llama_dir, tmp_path / "single"))

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        (sharded / name).write_bytes((llama_dir / name).read_bytes())
    path = convert_hf_checkpoint(sharded, max_shard_size="20KB")
    assert path == sharded / "lit_model.safetensors.index.json"
    shards = sorted(p.name for p in sharded.glob("lit_model-*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"lit_model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads(path.read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert not (sharded / "lit_model.safetensors").exists()
    assert_same_tensors(lit_state(sharded), reference)
    assert_same_tensors(read_safetensors(convert_lit_checkpoint(sharded, tmp_path / "from_shards")), single_export)
    # the HF weights beside the lit shards are still the only HF input of a conversion
    convert_hf_checkpoint(sharded, overwrite=True)
    assert sorted(p.name for p in sharded.glob("lit_model*")) == ["lit_model.safetensors"]  # no stale shards
    assert_same_tensors(lit_state(sharded), reference)


def test_legacy_lit_model_pth_still_loads_and_exports(llama_dir, tmp_path):
    """Folders converted by earlier versions hold `lit_model.pth` (torch.save): read, never written."""
    from lit_gpt.weights import check_checkpoint_dir

    convert_hf_checkpoint(llama_dir)
    state = lit_state(llama_dir)
    expected = read_safetensors(convert_lit_checkpoint(llama_dir, tmp_path / "new"))
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "lit_config.json").write_bytes((llama_dir / "lit_config.json").read_bytes())
    torch.save(state, legacy / "lit_model.pth")
    assert check_checkpoint_dir(legacy) == legacy / "lit_model.pth"
    assert_same_tensors(lit_state(legacy), state)
    assert_same_tensors(read_safetensors(convert_lit_checkpoint(legacy, tmp_path / "old")), expected)
    # an earlier full finetune's training checkpoint: the weights wrapped with the step
    torch.save({"model": state, "step": 3}, tmp_path / "wrapped.pth")
    out = convert_lit_checkpoint(legacy, tmp_path / "wrapped", checkpoint_path=tmp_path / "wrapped.pth")
    assert_same_tensors(read_safetensors(out), expected)
    # converting again over a legacy folder is refused without --overwrite, and replaces the .pth with it
    (legacy / "model.safetensors").write_bytes((llama_dir / "model.safetensors").read_bytes())
    (legacy / "config.json").write_bytes((llama_dir / "config.json").read_bytes())
    with pytest.raises(LitError, match=r"already holds lit_model\.pth, lit_config\.json: refusing to overwrite"):
        convert_hf_checkpoint(legacy)
    convert_hf_checkpoint(legacy, overwrite=True)
    assert not (legacy / "lit_model.pth").exists() and check_checkpoint_dir(legacy) == legacy / "lit_model.safetensors"
    assert_same_tensors(lit_state(legacy), state)


def test_damaged_lit_weights_are_one_line(llama_dir, tmp_path):
    path = convert_hf_checkpoint(llama_dir)
    data = path.read_bytes()
    for name, content in (("truncated", data[: len(data) // 2]), ("header", data[:6]), ("garbage", b"\xff" * 64)):
        bad = tmp_path / name / "lit_model.safetensors"
        bad.parent.mkdir()
        bad.write_bytes(content)
        damaged = r"cannot read weights .*lit_model\.safetensors' \(corrupt or truncated"
        with pytest.raises(LitError, match=damaged) as e:
            convert_lit_checkpoint(llama_dir, tmp_path / f"out_{name}", checkpoint_path=bad)
        assert "\n" not in str(e.value)
    # an index whose shard is gone
    sharded = tmp_path / "sharded"
    index = save_weights(lit_state(llama_dir), sharded, max_shard_size="20KB")[-1]
    sorted(sharded.glob("lit_model-*.safetensors"))[0].unlink()
    with pytest.raises(LitError, match=r"names the shard 'lit_model-00001-of-.*', which is missing") as e:
        convert_lit_checkpoint(llama_dir, tmp_path / "out_index", checkpoint_path=index)
    assert "\n" not in str(e.value)


def test_export_of_a_registry_config_without_hf_model_type(tmp_path):
    """A checkpoint whose lit_config.json came from the registry (no hf_model_type) exports by derived family."""
    config = Config(
        name="Mistral-tiny", vocab_size=VOCAB, n_layer=1, n_head=4, n_query_groups=2, n_embd=32, intermediate_size=48,
        norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", sliding_window_size=4,
    )
    assert config.hf_model_type is None and hf_model_type(config) == "mistral"
    d = tmp_path / "lit"
    d.mkdir()
    config.save(d)
    torch.manual_seed(0)
    save_weights(GPT(config).state_dict(), d)
    out = convert_lit_checkpoint(d, tmp_path / "hf")
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "mistral" and hf["sliding_window"] == 4 and hf["num_key_value_heads"] == 2
    assert transformers.AutoConfig.from_pretrained(out).sliding_window == 4


def test_export_refuses_unmerged_lora_and_mismatched_weights(llama_dir, tmp_path):
    convert_hf_checkpoint(llama_dir)
    state = lit_state(llama_dir)
    lora = dict(state, **{"transformer.h.0.attn.qkv.lora_A": torch.zeros(2, 2)})
    save_weights(lora, tmp_path, stem="lora")
    with pytest.raises(LitError, match="merge_lora"):
        convert_lit_checkpoint(llama_dir, tmp_path / "out", checkpoint_path=tmp_path / "lora.safetensors")
    del state["transformer.h.1.mlp.fc_1.weight"]
    save_weights(state, tmp_path, stem="partial")
    with pytest.raises(LitError, match="1 missing tensor.*transformer.h.1.mlp.fc_1.weight"):
        convert_lit_checkpoint(llama_dir, tmp_path / "out", checkpoint_path=tmp_path / "partial.safetensors")
    with pytest.raises(LitError, match="does not exist"):
        convert_lit_checkpoint(tmp_path / "nothing-here", tmp_path / "out")
    (llama_dir / "lit_model.safetensors").unlink()
    with pytest.raises(LitError, match="convert_hf_checkpoint.py"):
        convert_lit_checkpoint(llama_dir, tmp_path / "out")


def test_hf_conversion_errors(llama_dir, tmp_path):
    with pytest.raises(LitError, match="does not exist"):
        convert_hf_checkpoint(tmp_path / "missing")

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(LitError, match="no weights found"):
        convert_hf_checkpoint(no_weights)

    no_config = tmp_path / "no_config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes((llama_dir / "model.safetensors").read_bytes())
    with pytest.raises(LitError, match="no config.json.*--model_name"):
        convert_hf_checkpoint(no_config)
    # a registry name whose shapes are not the checkpoint's
    with pytest.raises(LitError, match="missing tensor.*--model_name SmolLM2-135M"):
        convert_hf_checkpoint(no_config, model_name="SmolLM2-135M")
    neox = tmp_path / "neox"
    build_hf_model("pythia").save_pretrained(neox)
    (neox / "config.json").unlink()
    with pytest.raises(LitError, match="does not fit the config.*--model_name pythia-70m"):
        convert_hf_checkpoint(neox, model_name="pythia-70m")
    with pytest.raises(LitError, match="Did you mean.*SmolLM2-135M"):
        convert_hf_checkpoint(no_config, model_name="SmolLM2-135")

    gpt2 = json.loads((llama_dir / "config.json").read_text())
    gpt2["model_type"] = "gpt2"
    (no_weights / "config.json").write_text(json.dumps(gpt2))
    with pytest.raises(LitError, match="Unsupported model_type 'gpt2'"):
        convert_hf_checkpoint(no_weights)

    # the config says falcon, the weights are llama's
    falcon = tmp_path / "falcon"
    falcon.mkdir()
    (falcon / "model.safetensors").write_bytes((llama_dir / "model.safetensors").read_bytes())
    cfg = build_hf_model("falcon-7b").config.to_dict()
    (falcon / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LitError, match="unexpected tensor 'model.embed_tokens.weight' for model_type 'falcon'"):
        convert_hf_checkpoint(falcon)

    # a shard named by the index is missing; a file is corrupt; a layer lacks its value projection
    sharded = tmp_path / "sharded"
    build_hf_model("tinyllama").save_pretrained(sharded, max_shard_size="40KB")
    sorted(sharded.glob("model-*.safetensors"))[-1].unlink()
    with pytest.raises(LitError, match="missing"):
        convert_hf_checkpoint(sharded)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((llama_dir / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes((llama_dir / "model.safetensors").read_bytes()[:200])
    with pytest.raises(LitError, match="cannot read"):
        convert_hf_checkpoint(corrupt)
    tensors = read_safetensors(llama_dir)
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, str(corrupt / "model.safetensors"))
    with pytest.raises(LitError, match="layer 1 has only .* of q/k/v weights"):
        convert_hf_checkpoint(corrupt)


def test_hf_config_dict_refuses_what_the_family_cannot_express():
    config = Config.from_name("pythia-70m", n_query_groups=2)
    with pytest.raises(LitError, match="multi-head attention only"):
        hf_config_dict(config)
    config = Config.from_name("SmolLM2-135M", hf_model_type="gemma")
    with pytest.raises(LitError, match="'gemma'"):
        hf_config_dict(config)


def run_script_setup(script: str, *args: str) -> None:
    """Run a script's CLI in this process (its real argument parsing, without another torch import)."""
    from lit_gpt.utils import run_cli

    setup = runpy.run_path(str(REPO / "scripts" / script), run_name="as_module")["setup"]
    run_cli(setup, as_positional=False, args=list(args))


def test_cli_scripts(llama_dir, tmp_path):
    run_script_setup("convert_hf_checkpoint.py", "--checkpoint_dir", str(llama_dir), "--dtype", "float16")
    assert {v.dtype for v in lit_state(llama_dir).values()} == {torch.float16}
    out = tmp_path / "export"
    run_script_setup(
        "convert_lit_checkpoint.py", "--checkpoint_dir", str(llama_dir), "--output_dir", str(out),
        "--checkpoint_path", str(llama_dir / "lit_model.safetensors"), "--max_shard_size", "20KB",
    )
    assert (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file()
    run_script_setup("convert_hf_checkpoint.py", "--checkpoint_dir", str(llama_dir), "--max_shard_size", "20KB",
                     "--overwrite", "true")
    assert (llama_dir / "lit_model.safetensors.index.json").is_file()
    assert not (llama_dir / "lit_model.safetensors").exists()
    with pytest.raises(SystemExit):
        run_script_setup("convert_hf_checkpoint.py", "--checkpoint_dir", str(llama_dir), "--dtype", "float8")

    # a user error is one `error: ...` line on stderr and exit code 1, no traceback
    res = subprocess.run(
        [sys.executable, "scripts/convert_lit_checkpoint.py", "--checkpoint_dir", str(tmp_path / "nope"),
         "--output_dir", str(tmp_path / "out")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "does not exist" in lines[0], res.stderr


def test_export_keeps_a_chat_template_file(tmp_path):
    """SmolLM3 (and transformers 5 saves) keep the chat template in chat_template.jinja: the export copies it."""
    src = tmp_path / "src"
    build_hf_model("smollm3").save_pretrained(src)
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    convert_hf_checkpoint(src)
    out = convert_lit_checkpoint(src, tmp_path / "out")
    assert (out / "chat_template.jinja").read_text() == (src / "chat_template.jinja").read_text()
