"""LoRA to and from Hugging Face PEFT adapter folders (lit_gpt.peft_io), checked against the real `peft` and
`transformers`: an adapter exported from a LoRA trained here gives, in `PeftModel.from_pretrained(transformers model,
folder)`, the logits (1e-4 relative, fp32) and greedy tokens of generate/lora.py's model; export -> import is
bit-exact.

PEFT 0.21 refuses to build LoRA layers when it finds torchao older than 0.16 ("only versions above 0.16.0"); the
project pins torchao 0.14.1 (torch 2.9.0). `peft_without_torchao` hides torchao from PEFT while an adapter loads:
`sys.modules["torchao"] = None` makes `importlib.util.find_spec("torchao")` (PEFT's `is_torchao_available`) answer
None, and PEFT's cached answer is cleared before and after; torchao is back (or absent, as it was) afterwards.
"""

import csv
import importlib.util
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Tuple

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lit_gpt import lora  # noqa: E402
from lit_gpt.convert import convert_hf_checkpoint  # noqa: E402
from lit_gpt.fingerprint import base_record, fingerprint  # noqa: E402
from lit_gpt.generate import generate  # noqa: E402
from lit_gpt.peft import (check_init_from, export_finetuned, load_finetuned, load_variant_model,  # noqa: E402
                          variant_fields)
from lit_gpt.peft_io import export_peft, import_peft  # noqa: E402
from lit_gpt.utils import LitError  # noqa: E402
from lit_gpt.weights import read_finetuned_metadata  # noqa: E402
from tiny_hf import SEQ, VOCAB, build_hf_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# one tiny model per HF model type our LoRA exports to, and which layers the LoRA adapts there (a mix of q/k/v subsets,
# so that the fused modules' disabled parts are covered)
ALL = dict(lora_query=True, lora_key=True, lora_value=True, lora_projection=True, lora_mlp=True)
QV = dict(lora_query=True, lora_key=False, lora_value=True)
CASES = {
    "smollm2": dict(ALL, lora_head=True),  # llama, tied embeddings: the LoRA head leaves the embeddings alone
    "llama-3.1": QV,
    "mistral-v0.1": dict(QV, lora_mlp=True),
    "qwen2.5": ALL,
    "qwen3": dict(QV, lora_projection=True),
    "gemma-2b": ALL,
    "gemma2": dict(ALL, lora_head=True),
    "gemma3": QV,
    "phi3": ALL,  # fused qkv_proj and gate_up_proj
    "phi4-mini": dict(QV, lora_mlp=True),  # fused, with a disabled part
    "olmo2": ALL,
    "smollm3": ALL,
    "pythia": ALL,  # fused query_key_value, interleaved per head
    "stablelm-2": ALL,
    "falcon-7b": dict(QV, lora_projection=True, lora_mlp=True),  # fused, multi-query
    "falcon-40b": ALL,  # fused, grouped
    "phi-2": dict(ALL, lora_head=True),
    "mixtral": dict(ALL, lora_mlp=False),  # attention only: the experts are refused (test below)
    "qwen3_moe": dict(ALL, lora_mlp=False),  # its dense layer's MLP is refused (test below)
    "gpt_oss": dict(QV, lora_projection=True),
}
R, ALPHA = 4, 8


@contextmanager
def peft_without_torchao():
    """Hide torchao from PEFT's version check while it builds LoRA layers (module docstring)."""
    from peft import import_utils

    missing = object()
    saved = sys.modules.get("torchao", missing)
    sys.modules["torchao"] = None
    import_utils.is_torchao_available.cache_clear()
    try:
        yield
    finally:
        if saved is missing:
            del sys.modules["torchao"]
        else:
            sys.modules["torchao"] = saved
        import_utils.is_torchao_available.cache_clear()


def lit_lora(base: Path, out: Path, seed: int = 1, scale: float = 1.0, **flags) -> Path:
    """A LoRA trained here, as finetune/lora.py saves it, with random A and B (B zero would test nothing)."""
    config = lora.Config.from_checkpoint(base, **{**dict(lora_r=R, lora_alpha=ALPHA, lora_dropout=0.05), **flags})
    with torch.device("meta"):
        model = lora.GPT(config)
    gen = torch.Generator().manual_seed(seed)
    state = {n: scale * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5 for n, p in model.named_parameters()
             if lora.lora_filter(n)}
    return export_finetuned(state, out, "lora", variant_fields(config), base=base_record(base))


def base_checkpoint(family: str, root: Path):
    hf_model = build_hf_model(family)
    base = root / "checkpoints" / "org" / family
    hf_model.save_pretrained(base)
    convert_hf_checkpoint(base)
    return hf_model, base


def generate_lora_model(base: Path, lora_path: Path) -> lora.GPT:
    """As generate/lora.py loads it (32-true): base + LoRA on the meta device, assigned, merged."""
    model = load_variant_model(lora.GPT, lora.Config, base, lora_path)
    lora.merge_lora_weights(model, dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("family", list(CASES))
@torch.no_grad()
def test_exported_adapter_equals_ours_in_peft_and_imports_back_bit_exact(family, tmp_path):
    hf_model, base = base_checkpoint(family, tmp_path)
    lora_path = lit_lora(base, tmp_path / "lora", **CASES[family])
    adapter = export_peft(base, lora_path, tmp_path / "adapter")

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"]) == ("LORA", R, ALPHA, 0.05)
    assert cfg["base_model_name_or_path"] == f"org/{family}"  # checkpoints/ORG/NAME, as scripts/download.py writes
    with peft_without_torchao():
        peft_model = peft.PeftModel.from_pretrained(hf_model, adapter).eval()
    ours = generate_lora_model(base, lora_path)
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    theirs_logits, our_logits = peft_model(idx).logits, ours(idx)
    with peft_model.disable_adapter():
        base_logits = peft_model(idx).logits
    assert (base_logits - theirs_logits).abs().max() > 1e-2  # the adapter really changes the outputs
    err = (our_logits - theirs_logits).abs().max() / theirs_logits.abs().max()
    assert err <= 1e-4, f"relative logits difference {err:.2e}"

    prompt = idx[0, :5]
    want = peft_model.generate(prompt[None], max_new_tokens=8, do_sample=False, min_new_tokens=8, pad_token_id=0)
    got = generate(ours, prompt, 8, temperature=0.0)
    assert got.tolist() == want[0, 5:].tolist()

    lit_back = import_peft(adapter, base, tmp_path / "back")
    state, fields = load_finetuned(lit_back, "lora")
    orig_state, orig_fields = load_finetuned(lora_path, "lora")
    assert fields == orig_fields
    assert sorted(state) == sorted(orig_state)
    for k in state:
        assert state[k].dtype == orig_state[k].dtype and torch.equal(state[k], orig_state[k]), k
    assert read_finetuned_metadata(lit_back)["base"]["fingerprint"] == fingerprint(base)


def peft_adapter(hf_model, out: Path, **lora_config) -> Path:
    """An adapter trained elsewhere: PEFT's own LoRA on the transformers model, random B."""
    with peft_without_torchao():
        model = peft.get_peft_model(hf_model, peft.LoraConfig(**lora_config))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("family, targets", [
    ("phi3", ["qkv_proj", "gate_up_proj"]),  # fused modules with one shared A: our per-part pairs repeat it
    ("pythia", ["query_key_value", "dense_4h_to_h"]),
    ("llama-3.1", ["q_proj", "v_proj", "down_proj"]),  # up/gate left out: zero pairs there
])
@torch.no_grad()
def test_imported_peft_adapter_equals_peft(family, targets, tmp_path):
    hf_model, base = base_checkpoint(family, tmp_path)
    adapter = peft_adapter(build_hf_model(family), tmp_path / "adapter", r=R, lora_alpha=16, target_modules=targets)
    lora_path = import_peft(adapter, base)
    assert lora_path.parent == adapter  # beside the adapter by default
    with peft_without_torchao():
        peft_model = peft.PeftModel.from_pretrained(hf_model, adapter).eval()
    ours = generate_lora_model(base, lora_path)
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    theirs = peft_model(idx).logits
    assert ((ours(idx) - theirs).abs().max() / theirs.abs().max()) <= 1e-4


def test_what_peft_cannot_express_is_refused_in_one_line(tmp_path):
    _, base = base_checkpoint("mixtral", tmp_path)
    experts = lit_lora(base, tmp_path / "experts", lora_experts=True)
    with pytest.raises(LitError, match=r"experts.*cannot express.*target_parameters.*merge_lora\.py"):
        export_peft(base, experts, tmp_path / "adapter")
    _, moe_base = base_checkpoint("qwen3_moe", tmp_path)
    with pytest.raises(LitError, match=r"dense MLP.*qwen3_moe.*experts"):
        export_peft(moe_base, lit_lora(moe_base, tmp_path / "dense", lora_mlp=True), tmp_path / "adapter")
    qv = lit_lora(base, tmp_path / "qv", **QV)
    export_peft(base, qv, tmp_path / "adapter")
    with pytest.raises(LitError, match="refusing to overwrite"):
        export_peft(base, qv, tmp_path / "adapter")

    adapter = tmp_path / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    for change, message in ((dict(use_dora=True), "DoRA"), (dict(use_rslora=True), "rsLoRA"),
                            (dict(bias="all"), "trains biases"), (dict(peft_type="IA3"), "only LoRA"),
                            (dict(alpha_pattern={"q_proj": 3}), "one scaling")):
        (adapter / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(LitError, match=message):
            import_peft(adapter, base, tmp_path / "back", overwrite=True)
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    _, other = base_checkpoint("llama-2", tmp_path)  # multi-head, 64 wide: the adapter's k/v do not fit
    with pytest.raises(LitError, match="is it an adapter of"):
        import_peft(adapter, other, tmp_path / "other")


@torch.no_grad()
def test_generate_lora_folds_after_the_cast_on_a_bf16_base(tmp_path):
    """generate/lora.py's load in 32-true on a bf16 checkpoint (as the Hub serves them): the LoRA is folded into the
    weights after their cast to fp32, so the 1e-4 against transformers + PEFT in fp32 holds; folded into the bf16
    weights first (as before), the merged weights are rounded to bf16 and the logits move by far more. The eval
    recipes' loader holds the 1e-4 too."""
    import runpy

    from lit_gpt.recipes.generate import GenerationArgs

    hf_model = build_hf_model("smollm2").to(torch.bfloat16)
    base = tmp_path / "checkpoints" / "org" / "smollm2-bf16"
    hf_model.save_pretrained(base)
    convert_hf_checkpoint(base)
    lora_path = lit_lora(base, tmp_path / "lora", **ALL)
    adapter = export_peft(base, lora_path, tmp_path / "adapter")
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    with peft_without_torchao():
        theirs_model = peft.PeftModel.from_pretrained(hf32, adapter).eval()
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    theirs = theirs_model(idx).logits

    load = runpy.run_path(str(Path(__file__).resolve().parents[1] / "generate" / "lora.py"))["load"]
    args = GenerationArgs(prompt="", checkpoint_dir=base, finetuned_path=lora_path)
    ours = load(args, torch.float32)
    assert ours.transformer.h[0].attn.qkv.weight.dtype == torch.float32
    rel = lambda m: ((m.float().eval()(idx) - theirs).abs().max() / theirs.abs().max()).item()  # noqa: E731
    assert rel(ours) <= 1e-4
    folded_in_bf16 = load(args)  # no dtype: folded in the stored bf16, then cast
    assert folded_in_bf16.transformer.h[0].attn.qkv.weight.dtype == torch.bfloat16
    assert rel(folded_in_bf16) > 1e-4

    # the eval recipes' model loading (eval/perplexity.py, eval/lm_eval.py: `load_eval_model`, whose eager part is
    # called here because this tiny model has no tokenizer) folds after the cast too, here given the adapter back
    # from PEFT's folder (an imported LoRA is what they take as --lora_path)
    from lit_gpt.recipes.evaluate import _load_eager

    imported = import_peft(adapter, base, tmp_path / "imported")
    _, evaluated, _ = _load_eager(base, "lora", imported, "32-true", "cpu", allow_other_base=False)
    assert rel(evaluated) <= 1e-4


@pytest.mark.slow
@torch.no_grad()
def test_generate_lora_folds_after_the_cast_on_the_real_smollm2_in_bf16(smollm2_bf16_dir, tmp_path):
    """The same on a bf16 checkpoint users bring (the real SmolLM2-135M-Instruct as the Hub serves it, bf16
    safetensors): generate/lora.py's load under --precision 32-true gives the logits of transformers + PEFT in fp32
    within 1e-4 relative; folded in bf16 first, it would not."""
    import runpy

    from lit_gpt.recipes.generate import GenerationArgs
    from lit_gpt.runtime import param_dtype
    from lit_gpt.tokenizer import Tokenizer
    from lit_gpt.weights import find_weights, load_weights

    base = smollm2_bf16_dir
    assert load_weights(find_weights(base))["transformer.h.0.attn.qkv.weight"].dtype == torch.bfloat16
    lora_path = lit_lora(base, tmp_path / "lora", seed=2, scale=0.1, lora_r=8, lora_alpha=16, lora_projection=True,
                         lora_mlp=True)
    adapter = export_peft(base, lora_path, tmp_path / "adapter")
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with peft_without_torchao():
        theirs_model = peft.PeftModel.from_pretrained(hf32, adapter).eval()
    prompt = Tokenizer(base).encode("The capital of France is Paris, and the capital of Italy is")[None]
    theirs = theirs_model(prompt).logits
    with theirs_model.disable_adapter():
        assert (theirs_model(prompt).logits - theirs).abs().max() > 1e-2  # the LoRA changes the outputs

    load = runpy.run_path(str(ROOT / "generate" / "lora.py"))["load"]
    args = GenerationArgs(prompt="", checkpoint_dir=base, finetuned_path=lora_path)
    ours = load(args, param_dtype("32-true"))  # as generate/lora.py's main calls it under --precision 32-true
    assert ours.transformer.h[0].attn.qkv.weight.dtype == torch.float32
    # the rest of the model (norms, embeddings) is cast by Fabric's 32-true, as .float() does here
    rel = lambda m: ((m.float().eval()(prompt) - theirs).abs().max() / theirs.abs().max()).item()  # noqa: E731
    err = rel(ours)
    assert err <= 1e-4, f"relative logits difference {err:.2e}"
    del ours
    folded_in_bf16 = rel(load(args))  # folded into the stored bf16 weights, then cast: this test tells them apart
    assert folded_in_bf16 > 1e-4, folded_in_bf16


def test_scripts_export_import_and_generate_lora_uses_the_import(tiny_dir, tmp_path, capsys):
    """scripts/convert_lit_checkpoint.py --lora_path and scripts/convert_hf_checkpoint.py --peft_path as a user runs
    them; generate/lora.py takes the imported file (its recorded base is tiny_dir) and prints the original's text."""
    from variants import greedy_text, run_recipe

    original = lit_lora(tiny_dir, tmp_path / "lora", lora_key=True, lora_mlp=True)
    adapter, back = tmp_path / "adapter", tmp_path / "back"
    run_recipe("scripts/convert_lit_checkpoint.py", "--checkpoint_dir", str(tiny_dir), "--output_dir", str(adapter),
               "--lora_path", str(original), "--base_model_name_or_path", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        "HuggingFaceTB/SmolLM2-135M-Instruct")
    run_recipe("scripts/convert_hf_checkpoint.py", "--checkpoint_dir", str(tiny_dir), "--peft_path", str(adapter),
               "--out_dir", str(back))
    imported = back / "lit_model.lora.safetensors"
    assert read_finetuned_metadata(imported)["base"]["fingerprint"] == fingerprint(tiny_dir)
    capsys.readouterr()

    run_recipe("generate/lora.py", "--checkpoint_dir", str(tiny_dir), "--lora_path", str(imported), "--prompt",
               "Hello there", "--prompt_style", "raw", "--max_new_tokens", "6", "--temperature", "0", "--compile",
               "false")
    expected = greedy_text(generate_lora_model(tiny_dir, original), tiny_dir, "Hello there", 6)
    assert capsys.readouterr().out.strip() == expected.strip()

    with pytest.raises(SystemExit) as e:  # a folder that is no adapter: one error line
        run_recipe("scripts/convert_hf_checkpoint.py", "--checkpoint_dir", str(tiny_dir), "--peft_path",
                   str(tmp_path / "lora"), "--out_dir", str(tmp_path / "x"))
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "adapter_config.json" in err[-1] and len(err) == 1, err


@pytest.mark.slow
def test_a_lora_trained_here_on_the_real_smollm2_equals_peft(smollm2_dir, tmp_path, capsys):
    """A LoRA trained here (finetune/lora.py, 2 steps on the real SmolLM2-135M-Instruct, q, v, the projection and
    the MLP), exported: PEFT on transformers gives the logits and the greedy text of generate/lora.py."""
    from lit_gpt.convert import convert_lit_checkpoint
    from lit_gpt.tokenizer import Tokenizer
    from variants import run_recipe

    out = tmp_path / "out"
    # as cheap as a real run gets: 2 steps of 1 row of at most 64 tokens, no validation
    run_recipe("finetune/lora.py", "--checkpoint_dir", str(smollm2_dir), "--data.data_dir",
               str(lora_run_data(smollm2_dir, tmp_path)), "--out_dir", str(out), "--precision", "32-true",
               "--accelerator", "cpu", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.05",
               "--lora_projection", "true", "--lora_mlp", "true", "--train.global_batch_size", "1",
               "--train.micro_batch_size", "1", "--train.max_seq_length", "64", "--train.max_steps", "2",
               "--train.learning_rate", "0.01", "--train.lr_warmup_steps", "0", "--eval.interval", "100",
               "--eval.max_iters", "1", "--eval.max_new_tokens", "0", "--eval.initial_validation", "false",
               "--eval.final_validation", "false")
    lora_path = out / "final" / "lit_model.lora.safetensors"
    trained, _ = load_finetuned(lora_path, "lora")
    assert any(k.endswith("lora_B") and k.startswith("transformer.h.0.mlp") for k in trained), sorted(trained)[:8]
    assert all(trained[k].abs().max() > 0 for k in trained if k.endswith("lora_B"))  # trained: B left its zero init

    adapter = export_peft(smollm2_dir, lora_path, tmp_path / "adapter")
    assert json.loads((adapter / "adapter_config.json").read_text())["lora_dropout"] == 0.05
    hf_dir = convert_lit_checkpoint(smollm2_dir, tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with peft_without_torchao():
        peft_model = peft.PeftModel.from_pretrained(hf_model, adapter).eval()
    tokenizer = Tokenizer(smollm2_dir)
    prompt = tokenizer.encode("The capital of France is")
    with torch.no_grad():
        theirs = peft_model(prompt[None]).logits
        ours = generate_lora_model(smollm2_dir, lora_path)(prompt[None])
        err = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        assert err <= 1e-4, f"relative logits difference {err:.2e}"
        with peft_model.disable_adapter():
            assert (peft_model(prompt[None]).logits - theirs).abs().max() > 1e-2  # the LoRA changes the outputs
        want = peft_model.generate(prompt[None], max_new_tokens=12, do_sample=False)[0, len(prompt):]

    capsys.readouterr()
    run_recipe("generate/lora.py", "--checkpoint_dir", str(smollm2_dir), "--lora_path", str(lora_path), "--prompt",
               "The capital of France is", "--prompt_style", "raw", "--max_new_tokens", "12", "--temperature", "0",
               "--precision", "32-true", "--compile", "false")
    printed = capsys.readouterr().out
    expected = tokenizer.decode(prompt.tolist() + want.tolist())  # a raw prompt prints the prompt and its continuation
    assert expected in printed, (expected, printed)


def lora_run_data(checkpoint_dir: Path, root: Path) -> Path:
    """Instruction data prepared for `checkpoint_dir`: 4 training rows (one optimizer step covers them all, in any
    order) and 2 validation rows."""
    from lit_gpt import data

    words = "the cat runs over a lazy river on blue mountains".split()
    src = root / "rows.json"
    src.write_text(json.dumps([{"instruction": f"Say {i} words", "input": "", "output": " ".join(words[: 3 + i])}
                               for i in range(6)]))
    records, bad = data.read_records(src)
    rows, bad2 = data.records_to_rows(records, data.instruction_rows())
    data.prepare(rows, bad + bad2, checkpoint_dir=checkpoint_dir, destination=root / "prepared", source=str(src),
                 max_seq_length=64, val_split_fraction=0.34, seed=1)
    return root / "prepared"


@torch.no_grad()
def mean_train_loss(model, data_dir: Path) -> float:
    """The loss of one optimizer step over every training row, as the loop computes it: summed next-token
    cross-entropy over the labelled positions divided by their count."""
    from lit_gpt.batches import collate
    from lit_gpt.losses import cross_entropy_sum

    total, count = 0.0, 0
    for sample in torch.load(data_dir / "train.pt", weights_only=True):
        batch = collate([sample], 64)
        total += float(cross_entropy_sum(model.eval()(batch["input_ids"]), batch["labels"]))
        count += int((batch["labels"] != -100).sum())
    return total / count


LORA_RUN = ["--precision", "32-true", "--accelerator", "cpu", "--lora_r", str(R), "--lora_alpha", "16",
            "--lora_dropout", "0", "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
            "--train.max_seq_length", "64", "--train.max_steps", "2", "--train.learning_rate", "0.01",
            "--train.lr_warmup_steps", "0", "--train.log_interval", "1", "--eval.interval", "100",
            "--eval.max_iters", "1", "--eval.max_new_tokens", "0"]


def community_lora(tiny_dir: Path, root: Path):
    """(PEFT adapter folder, its import for `tiny_dir`, prepared data): a LoRA trained elsewhere (PEFT's own on the
    transformers model of `tiny_dir`, r 4 on q and v, random A and B), imported here."""
    from lit_gpt.convert import convert_lit_checkpoint

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(convert_lit_checkpoint(tiny_dir, root / "hf"),
                                                                 dtype=torch.float32)
    adapter = peft_adapter(hf_model, root / "adapter", r=R, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    return adapter, import_peft(adapter, tiny_dir, root / "imported"), lora_run_data(tiny_dir, root)


def first_loss_and_start(tiny_dir: Path, imported: Path, data_dir: Path, out: Path) -> Tuple[float, float, float]:
    """(the run's logged loss of step 1, the imported adapter's loss on the step's rows, the base's loss on them)."""
    from lit_gpt.config import Config
    from lit_gpt.model import GPT
    from lit_gpt.weights import find_weights, load_weights

    (log,) = (out / "logs" / "csv").glob("version_*/metrics.csv")
    with open(log) as f:
        first = next(float(row["loss"]) for row in csv.DictReader(f) if row.get("loss") and row["step"] == "1")
    start = mean_train_loss(load_variant_model(lora.GPT, lora.Config, tiny_dir, imported), data_dir)
    base = GPT(Config.from_checkpoint(tiny_dir))
    base.load_state_dict(load_weights(find_weights(tiny_dir)))
    return first, start, mean_train_loss(base, data_dir)


def assert_trained_further(imported: Path, final: Path, base_dir: Path) -> None:
    """The LoRA written at the end has the import's settings and tensors, moved by training, on the same base."""
    trained, fields = load_finetuned(final, "lora")
    start, start_fields = load_finetuned(imported, "lora")
    assert fields == start_fields and sorted(trained) == sorted(start)
    assert any(not torch.equal(trained[k], start[k]) for k in start)
    assert read_finetuned_metadata(final)["base"]["fingerprint"] == fingerprint(base_dir)


def test_finetune_lora_continues_an_imported_peft_adapter(tiny_dir, tmp_path, capsys):
    """A community LoRA imported for the converted base trains further with finetune/lora.py --lora_init_from: the
    first step's loss is the imported adapter's own loss on the step's rows (evaluated here, and not the base's:
    training starts from it, not from B = 0), and the weights written after 2 steps have moved from it. Another
    base, other LoRA settings, or a PEFT folder not imported yet: one error line each, before anything loads."""
    from tiny import make_tiny_checkpoint
    from variants import run_recipe

    adapter, imported, data_dir = community_lora(tiny_dir, tmp_path)
    out = tmp_path / "out"
    run_recipe("finetune/lora.py", "--checkpoint_dir", str(tiny_dir), "--data.data_dir", str(data_dir), "--out_dir",
               str(out), "--lora_init_from", str(imported), *LORA_RUN)
    first, start, base = first_loss_and_start(tiny_dir, imported, data_dir, out)
    assert abs(base - start) > 1e-2  # the adapter changes this loss: the equality below tells them apart
    assert abs(first - start) <= 1e-5 * start, (first, start, base)
    assert_trained_further(imported, out / "final" / "lit_model.lora.safetensors", tiny_dir)
    capsys.readouterr()

    other_base = make_tiny_checkpoint(tmp_path / "other-base", tiny_dir, seed=1)
    for base_dir, extra, message in (
        (tiny_dir, ["--lora_r", "8"], "holds a lora of other settings than this run's (--lora_r 8): pass --lora_r 4"
                                      " to continue it"),
        (other_base, [], "records the base"),
    ):
        with pytest.raises(SystemExit) as e:
            run_recipe("finetune/lora.py", "--checkpoint_dir", str(base_dir), "--data.data_dir", str(data_dir),
                       "--out_dir", str(tmp_path / "refused"), "--lora_init_from", str(imported), *LORA_RUN, *extra)
        assert e.value.code == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    with pytest.raises(LitError, match="is a PEFT adapter folder: import it first with python"
                                       " scripts/convert_hf_checkpoint.py"):
        check_init_from(adapter, lora.Config.from_checkpoint(tiny_dir, lora_r=R, lora_alpha=16), tiny_dir, False,
                        "lora", "--lora_init_from")


@pytest.mark.slow  # an XLA:CPU recipe run in its own process (torch_xla imported, its train step compiled)
@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="needs torch_xla")
def test_xla_finetune_lora_continues_an_imported_peft_adapter(tiny_dir, tmp_path, xla_forks):
    """The same on XLA:CPU (1 device): xla/finetune/lora.py --lora_init_from stages the import after the base."""
    from child_env import python_path
    from fork_server import run_captured

    _, imported, data_dir = community_lora(tiny_dir, tmp_path)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "XLA_", "TPU_"))}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=python_path(),
               XLA_FLAGS="--xla_backend_optimization_level=0")  # compiles faster: the loss is what is checked
    # a process of its own, forked from the XLA fork server (tests/conftest.py `xla_forks`: the imports done)
    proc = run_captured(xla_forks, ["xla/finetune/lora.py", "--checkpoint_dir", str(tiny_dir), "--data.data_dir",
                                    str(data_dir), "--out_dir", str(out), "--lora_init_from", str(imported), *LORA_RUN],
                        ROOT, env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, start, base = first_loss_and_start(tiny_dir, imported, data_dir, out)
    assert abs(base - start) > 1e-2
    assert abs(first - start) <= 1e-4 * start, (first, start, base)
    assert_trained_further(imported, out / "final" / "lit_model.lora.safetensors", tiny_dir)
