"""scripts/merge_lora.py: base + LoRA file -> a standalone checkpoint folder whose model (ours, and `transformers`
after the HF export) gives the LoRA model's logits."""

import json

import pytest
import torch
from variants import base_and_variant, finetuned_on, randomize_own_, run_recipe, tokens

from lit_gpt import GPT, Config, lora
from lit_gpt.peft import load_full_finetuned, save_finetuned
from lit_gpt.utils import LitError
from lit_gpt.weights import load_checkpoint
from lit_gpt.weights import load_weights, save_weights

ALL_ON = dict(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_query=True, lora_key=True, lora_value=True,
              lora_projection=True, lora_mlp=True, lora_head=True)


def lora_checkpoint(tmp_path, name: str, **lora_kwargs):
    """(trained LoRA model, base checkpoint dir with tokenizer side files, LoRA file)."""
    base, model = base_and_variant(name, lora, **lora_kwargs)
    randomize_own_(model)
    base_dir = tmp_path / "base"
    save_weights(base.state_dict(), base_dir)  # as converted: lit_model.safetensors + lit_config.json
    base.config.save(base_dir)
    (base_dir / "tokenizer.json").write_text('{"stand-in": true}')
    (base_dir / "config.json").write_text(json.dumps({"tie_word_embeddings": base.config.tie_embeddings}))
    lora.mark_only_lora_as_trainable(model)
    lora_path = save_finetuned(model, tmp_path / "finetune")  # lit_model.lora.safetensors + lit_model.lora.json
    return model.eval(), base_dir, lora_path


def run_script(*args: str) -> None:
    run_recipe("scripts/merge_lora.py", *args)


@pytest.mark.parametrize("name", ["Llama-3.2-1B", "pythia-70m", "falcon-7b", "phi-2", "Qwen2.5-0.5B"])
def test_merged_checkpoint_and_hf_export_match_the_lora_model(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    from lit_gpt.convert import convert_lit_checkpoint

    model, base_dir, lora_path = lora_checkpoint(tmp_path, name, **ALL_ON)
    idx = tokens()
    with torch.no_grad():
        expected = model(idx)

    out_dir = tmp_path / "merged"
    run_script("--checkpoint_dir", str(base_dir), "--lora_path", str(lora_path), "--out_dir", str(out_dir))
    state = load_weights(out_dir / "lit_model.safetensors")
    assert not any("lora_" in k for k in state)
    assert (out_dir / "tokenizer.json").read_text() == '{"stand-in": true}'
    config = Config.from_checkpoint(out_dir)
    assert type(config) is Config and not config.tie_embeddings  # the LoRA head untied a tied model
    assert json.loads((out_dir / "config.json").read_text())["tie_word_embeddings"] is False
    merged = GPT(config).eval()
    load_checkpoint(merged, out_dir / "lit_model.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(merged(idx), expected, atol=1e-4, rtol=0)

    hf_dir = convert_lit_checkpoint(out_dir, tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        torch.testing.assert_close(hf_model.eval()(idx).logits, expected, atol=1e-4, rtol=0)


@torch.no_grad()
def test_default_out_dir_is_the_lora_folder_and_tied_embeddings_stay_tied_without_a_lora_head(tmp_path):
    model, base_dir, lora_path = lora_checkpoint(tmp_path, "Qwen2.5-0.5B", lora_r=2, lora_key=True)
    run_script("--checkpoint_dir", str(base_dir), "--lora_path", str(lora_path))
    out_dir = lora_path.parent
    config = Config.from_checkpoint(out_dir)
    assert config.tie_embeddings
    merged = GPT(config).eval()
    load_checkpoint(merged, out_dir / "lit_model.safetensors")
    torch.testing.assert_close(merged(tokens()), model(tokens()), atol=1e-4, rtol=0)
    assert lora_path.is_file()  # the LoRA file is kept


def test_bad_input_is_one_line_and_exit_1(tmp_path, capsys):
    model, base_dir, lora_path = lora_checkpoint(tmp_path, "Llama-2-7b-hf", lora_r=2)
    cases = [
        (["--lora_path", str(tmp_path / "nope.lora")], "not found"),
        (["--lora_path", str(base_dir / "lit_model.safetensors"), "--out_dir", str(tmp_path / "o")],
         "not a finetuned-weights"),
        (["--lora_path", str(base_dir / "lit_model.safetensors")], "would overwrite the LoRA file"),
        (["--lora_path", str(lora_path), "--out_dir", str(base_dir)], "is the base checkpoint"),
    ]
    adapter_file = tmp_path / "a.pth"  # an earlier version's adapter file
    torch.save({"method": "adapter", "config": {}, "model": {}}, adapter_file)
    cases.append((["--lora_path", str(adapter_file)], "holds adapter weights, not lora"))
    adapter_dir = tmp_path / "adapter_run"
    adapter_dir.mkdir()
    (adapter_dir / "lit_model.adapter.safetensors").write_bytes(lora_path.read_bytes())
    (adapter_dir / "lit_model.adapter.json").write_text(json.dumps(
        {"format": "lit_gpt.finetuned", "version": 1, "method": "adapter", "config": {}}))
    cases.append((["--lora_path", str(adapter_dir / "lit_model.adapter.safetensors")],
                  "holds adapter weights, not lora: use generate/adapter.py"))
    lora_path.with_name("lit_model.lora.json").unlink()
    cases.append((["--lora_path", str(lora_path), "--out_dir", str(tmp_path / "o")],
                  "has no lit_model.lora.json beside it"))
    for args, message in cases:
        with pytest.raises(SystemExit) as exc:
            run_script("--checkpoint_dir", str(base_dir), *args)
        assert exc.value.code == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err, err


def test_generate_full_and_base_on_the_merged_checkpoint_equal_generate_lora(tiny_dir, tmp_path, capsys):
    lora_path = tmp_path / "lit_model.lora.safetensors"
    finetuned_on(tiny_dir, lora, lora_path, lora_r=4, lora_projection=True, lora_mlp=True)
    merged = tmp_path / "merged"
    args = ["--prompt", "The capital of France is", "--max_new_tokens", "8", "--temperature", "0",
            "--prompt_style", "raw", "--accelerator", "cpu"]
    run_recipe("generate/lora.py", "--checkpoint_dir", str(tiny_dir), "--lora_path", str(lora_path), *args)
    expected = capsys.readouterr().out
    assert expected.startswith("The capital of France is") and len(expected) > len("The capital of France is") + 3
    run_script("--checkpoint_dir", str(tiny_dir), "--lora_path", str(lora_path), "--out_dir", str(merged))
    run_recipe("generate/full.py", "--checkpoint_dir", str(tiny_dir), "--checkpoint_path",
               str(merged / "lit_model.safetensors"), *args)
    assert capsys.readouterr().out == expected
    # the merged folder is a checkpoint of its own (config, tokenizer)
    run_recipe("generate/base.py", "--checkpoint_dir", str(merged), *args)
    assert capsys.readouterr().out == expected


def test_full_weights_with_an_untied_head_on_a_tied_config_are_refused(tmp_path):
    model, base_dir, lora_path = lora_checkpoint(tmp_path, "Qwen2.5-0.5B", lora_r=2, lora_head=True)
    merged = tmp_path / "merged"
    run_script("--checkpoint_dir", str(base_dir), "--lora_path", str(lora_path), "--out_dir", str(merged))
    with pytest.raises(LitError, match="has an lm_head of its own"):
        load_full_finetuned(base_dir, merged / "lit_model.safetensors")
    loaded = load_full_finetuned(merged, merged / "lit_model.safetensors")  # with its own config it loads
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens()), model(tokens()), atol=1e-4, rtol=0)


def test_an_existing_merged_checkpoint_is_not_overwritten_without_overwrite(tmp_path, capsys):
    model, base_dir, lora_path = lora_checkpoint(tmp_path, "Llama-2-7b-hf", lora_r=2)
    out = tmp_path / "merged"
    run_script("--checkpoint_dir", str(base_dir), "--lora_path", str(lora_path), "--out_dir", str(out))
    before = (out / "lit_model.safetensors").read_bytes()
    with pytest.raises(SystemExit) as exc:
        run_script("--checkpoint_dir", str(base_dir), "--lora_path", str(lora_path), "--out_dir", str(out))
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and str(out) in err and "--out_dir" in err and "--overwrite true" in err, err
    assert (out / "lit_model.safetensors").read_bytes() == before
    run_script("--checkpoint_dir", str(base_dir), "--lora_path", str(lora_path), "--out_dir", str(out),
               "--overwrite", "true")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


# A merge that SIGKILLs itself once the weights file is completely written, before it is moved to its name.
_KILLED_MERGE = """
import os, runpy, signal, sys
import safetensors.torch
real_save = safetensors.torch.save_file
def save_then_die(*args, **kwargs):
    real_save(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)  # the file is fully written, not yet moved in
safetensors.torch.save_file = save_then_die
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_merge_killed_mid_write_leaves_no_weights_behind(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from child_env import python_path
    from variants import ROOT

    from lit_gpt.weights import find_weights

    _, base_dir, lora_path = lora_checkpoint(tmp_path, "Llama-2-7b-hf", lora_r=2)
    out = tmp_path / "merged"
    args = ["--checkpoint_dir", str(base_dir), "--lora_path", str(lora_path), "--out_dir", str(out)]
    env = {**os.environ, "PYTHONPATH": python_path()}
    proc = subprocess.run([sys.executable, "-c", _KILLED_MERGE, str(ROOT / "scripts/merge_lora.py"), *args],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    # what the kill left is hidden (the staging folder), never weights under a name that loads ...
    assert find_weights(out) is None
    assert all(p.name.startswith(".") for p in out.iterdir() if "lit_model" in p.name)
    # ... and the next run removes it before it writes
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/merge_lora.py"), *args], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir() if "lit_model" in p.name) == ["lit_model.safetensors"]


@torch.no_grad()
def test_legacy_pth_base_and_lora_files_still_merge(tmp_path):
    """Earlier versions wrote `lit_model.pth` (the base) and `lit_model.pth.lora` (torch.save pickles): they merge
    into the same weights as the new files."""
    from lit_gpt.peft import finetuned_state_dict, variant_fields

    model, base_dir, lora_path = lora_checkpoint(tmp_path, "Qwen2.5-0.5B", lora_r=2, lora_key=True)
    run_script("--checkpoint_dir", str(base_dir), "--lora_path", str(lora_path), "--out_dir", str(tmp_path / "new"))
    legacy_base = tmp_path / "legacy_base"
    legacy_base.mkdir()
    torch.save(load_weights(base_dir / "lit_model.safetensors"), legacy_base / "lit_model.pth")
    (legacy_base / "lit_config.json").write_bytes((base_dir / "lit_config.json").read_bytes())
    legacy_lora = tmp_path / "old_run" / "lit_model.pth.lora"
    legacy_lora.parent.mkdir()
    torch.save({"method": "lora", "config": variant_fields(model.config), "model": finetuned_state_dict(model)},
               legacy_lora)
    run_script("--checkpoint_dir", str(legacy_base), "--lora_path", str(legacy_lora))
    old = load_weights(legacy_lora.parent / "lit_model.safetensors")
    new = load_weights(tmp_path / "new" / "lit_model.safetensors")
    assert sorted(old) == sorted(new) and all(torch.equal(old[k], new[k]) for k in new)


def test_atomic_save_falls_back_where_unnamed_files_cannot_be_linked(tmp_path, monkeypatch):
    import lit_gpt.utils as utils

    def no_link(fd, target):
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(utils, "_link_fd", no_link)
    path = tmp_path / "lit_model.pth"
    utils.save_atomic({"w": torch.arange(3)}, path)
    utils.save_atomic({"w": torch.arange(4)}, path)  # replaces, through a named temporary file
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lit_model.pth"]
