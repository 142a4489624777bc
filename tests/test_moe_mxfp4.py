"""gpt-oss's experts kept in MXFP4 in memory (lit_gpt.mxfp4.pack_experts_mxfp4): a tiny gpt-oss whose expert
weights are MXFP4 values (as a converted Hub checkpoint's are) gives bit-equal bf16 logits and the same greedy tokens
packed, on every dispatch path, with 4.25 bits per expert weight; weights that are not MXFP4 values are refused;
LoRA on the attention trains with the packed experts frozen. Through the recipes (`--quantize mxfp4`): generate/base.py
gives the bf16 tokens; finetune/lora.py trains LoRA with the experts packed (step 1 the bf16-expert run's loss, a
LoRA file that merges), refusing --lora_experts in one line; the eval/serve model loader (EVAL_FLAGS) gives the same
logits and tokens, and the real server the same greedy completions to the `openai` client (slow)."""

import pytest
import torch

from lit_gpt import GPT, lora
from lit_gpt.generate import generate
from lit_gpt.moe import ExpertLinear, moe_layers
from lit_gpt.mxfp4 import MXFP4ExpertLinear, dequantize_mxfp4, pack_experts_mxfp4, packed_bytes, quantize_mxfp4
from tolerance import logits_tolerance
from words import MOE_FAMILIES, TINY_SHAPE, family_config

VOCAB = 64


def _mxfp4_valued(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for m in model.modules():
            if type(m) is ExpertLinear:
                m.weight.copy_(dequantize_mxfp4(*quantize_mxfp4(m.weight), torch.float32))
    return model


def tiny_gpt_oss(config=None) -> GPT:
    torch.manual_seed(0)
    config = config or family_config("gpt_oss", VOCAB)
    model = (lora.GPT if isinstance(config, lora.Config) else GPT)(config)
    model.apply(model._init_weights)
    return _mxfp4_valued(model).to(torch.bfloat16).eval()


@torch.no_grad()
def test_packed_experts_give_the_bf16_logits_and_greedy_tokens_in_a_quarter_of_the_memory():
    bf16 = tiny_gpt_oss()
    packed = tiny_gpt_oss()
    expert_bytes = sum(m.weight.numel() * 2 for m in packed.modules() if type(m) is ExpertLinear)
    freed = pack_experts_mxfp4(packed)
    assert all(isinstance(m.experts.fc_1, MXFP4ExpertLinear) for m in moe_layers(packed))
    assert not any(".experts." in n and n.endswith("weight") for n, _ in packed.named_parameters())
    assert packed_bytes(packed) / expert_bytes == pytest.approx(4.25 / 16)
    assert freed == expert_bytes - packed_bytes(packed)
    idx = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    for dispatch in ("loop", "gather", "capacity", "dropless"):
        for model in (bf16, packed):
            for m in moe_layers(model):
                m.dispatch = dispatch
        assert torch.equal(packed(idx), bf16(idx)), dispatch
    prompt = idx[0, :6]
    tokens = generate(packed, prompt, 6, temperature=0.0)
    assert torch.equal(tokens, generate(bf16, prompt, 6, temperature=0.0))


def test_weights_that_are_not_mxfp4_values_are_refused_and_left_alone():
    torch.manual_seed(0)
    model = GPT(family_config("gpt_oss", VOCAB))
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ValueError, match="not MXFP4 values"):
        pack_experts_mxfp4(model)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


def test_lora_trains_with_the_experts_frozen_in_mxfp4():
    name, overrides = MOE_FAMILIES["gpt_oss"]
    config = lora.Config.from_name(name, vocab_size=VOCAB, **TINY_SHAPE, **overrides, lora_r=4, lora_alpha=8,
                                   lora_query=True, lora_value=True)
    model = tiny_gpt_oss(config).float()
    pack_experts_mxfp4(model)
    lora.mark_only_lora_as_trainable(model)
    model.train()
    blocks = {n: b.clone() for n, b in model.named_buffers() if n.endswith("blocks")}
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.5)
    idx = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(3):
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(b, dict(model.named_buffers())[n]) for n, b in blocks.items())  # the experts: frozen


def _run_recipe(capsys, monkeypatch, script, *args):
    """A recipe's `__main__` block in this process (a subprocess costs seconds of imports): (exit code, out, err)."""
    import runpy
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setattr(sys, "argv", [str(root / script), *args])
    code = 0
    try:
        runpy.run_path(str(root / script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    """A tiny gpt-oss word checkpoint whose experts are MXFP4, stored packed (what converting the Hub's checkpoint
    gives), and 8 Alpaca rows over its words prepared for it (root/data, no validation split)."""
    import contextlib
    import io
    import json

    from lit_gpt.loading import load_model
    from lit_gpt.weights import save_weights
    from variants import run_recipe
    from words import GEN_PROMPT, WORDS, make_word_checkpoint

    root = tmp_path_factory.mktemp("mxfp4")
    ckpt = make_word_checkpoint(root / "gpt_oss", family="gpt_oss")
    model = _mxfp4_valued(load_model(ckpt))
    pack_experts_mxfp4(model)  # saved as conversion writes a gpt-oss: the experts' MXFP4 blocks and scales
    save_weights(model.state_dict(), ckpt)
    rows = [{"instruction": GEN_PROMPT, "input": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n)),
             "output": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n))} for i, n in enumerate([1, 6, 3, 9] * 2)]
    (root / "rows.json").write_text(json.dumps(rows))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        run_recipe("scripts/prepare_alpaca.py", "--checkpoint_dir", str(ckpt), "--data_file", str(root / "rows.json"),
                   "--destination_path", str(root / "data"), "--val_split_fraction", "0")
    return root


def test_generate_quantize_mxfp4_packs_the_experts_and_gives_the_bf16_tokens(oss, capsys, monkeypatch):
    """`generate/base.py --quantize mxfp4` on a gpt-oss checkpoint whose experts are MXFP4 values (what converting the
    Hub's checkpoint gives): the experts are packed at load and the greedy tokens are the unquantized run's."""
    from lit_gpt.loading import load_model
    from words import GEN_PROMPT

    ckpt = oss / "gpt_oss"
    common = ["--checkpoint_dir", str(ckpt), "--prompt", GEN_PROMPT, "--prompt_style", "raw", "--temperature", "0",
              "--max_new_tokens", "8", "--accelerator", "cpu", "--precision", "bf16-true"]
    code, plain, err = _run_recipe(capsys, monkeypatch, "generate/base.py", *common)
    assert code == 0, err
    code, packed, err = _run_recipe(capsys, monkeypatch, "generate/base.py", *common, "--quantize", "mxfp4")
    assert code == 0, err
    n = 3 * sum(map(load_model(ckpt).config.is_moe_layer, range(load_model(ckpt).config.n_layer)))
    assert f"Packed {n} expert projections as MXFP4" in err
    assert packed == plain and packed.strip()


def test_quantize_mxfp4_refuses_a_model_without_mxfp4_experts_in_one_line(tiny_dir, capsys, monkeypatch):
    code, _, err = _run_recipe(capsys, monkeypatch, "generate/base.py", "--checkpoint_dir", str(tiny_dir),
                               "--prompt", "hi", "--quantize", "mxfp4", "--accelerator", "cpu")
    lines = err.strip().splitlines()
    assert code == 1 and "Traceback" not in err, err
    assert lines[-1].startswith("error:") and "--quantize mxfp4" in lines[-1] and "has none" in lines[-1], err


# LoRA through finetune/lora.py: 2 steps of the same 8 rows (global batch 8), fp32, LoRA on the attention
LORA_ARGS = ["--train.global_batch_size", "8", "--train.micro_batch_size", "8", "--train.max_steps", "2",
             "--train.save_interval", "2", "--train.log_interval", "1", "--train.lr_warmup_steps", "1",
             "--data.shuffle", "false", "--eval.interval", "1000", "--eval.final_validation", "false",
             "--accelerator", "cpu", "--precision", "32-true", "--lora_r", "4", "--lora_alpha", "8",
             "--lora_dropout", "0", "--lora_projection", "true", "--train.learning_rate", "0.02"]


def _finetune(oss, out, *extra):
    import contextlib
    import io

    from variants import run_recipe

    with contextlib.redirect_stdout(io.StringIO()) as printed:
        run_recipe("finetune/lora.py", "--checkpoint_dir", str(oss / "gpt_oss"), "--data.data_dir", str(oss / "data"),
                   "--out_dir", str(out), *LORA_ARGS, *extra)
    return printed.getvalue()


def test_lora_recipe_quantize_mxfp4_trains_with_the_experts_packed_and_its_file_merges(oss, tmp_path, monkeypatch):
    """`finetune/lora.py --quantize mxfp4`: the experts are packed after loading (no expert weight is a parameter any
    more), step 1's loss is the bf16-expert run's within float32's bound (the packed experts decode to the same
    values), the loss goes down, and the exported LoRA file (LoRA matrices only) merges into the unquantized base
    into a model with the LoRA model's outputs."""
    from lit_gpt import lora
    from lit_gpt.loading import load_model
    from lit_gpt.peft import load_variant_model
    from lit_gpt.weights import load_weights
    from test_finetune import read_metrics
    from tolerance import fp32_tolerance, longest_reduction

    packed_modules = []
    original = lora.mark_only_lora_as_trainable

    def spy(model):  # what the recipe built: its experts after packing are checked below
        original(model)
        packed_modules.append(model)
    monkeypatch.setattr(lora, "mark_only_lora_as_trainable", spy)

    plain_out, packed_out = tmp_path / "plain", tmp_path / "packed"
    plain_log = _finetune(oss, plain_out)
    packed_log = _finetune(oss, packed_out, "--quantize", "mxfp4")
    plain, packed = read_metrics(plain_out), read_metrics(packed_out)
    assert sorted(packed) == [1, 2], packed
    # frozen parameters: the expert weights became buffers (3 projections x 4 experts x n_layer MoE layers)
    config = load_model(oss / "gpt_oss").config
    n_expert_weights = 3 * sum(map(config.is_moe_layer, range(config.n_layer)))
    model = packed_modules[-1]
    assert sum(isinstance(m, MXFP4ExpertLinear) for m in model.modules()) == n_expert_weights
    assert not any(".experts." in n for n, _ in model.named_parameters() if n.endswith("weight"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert plain_log.split("Parameters: ")[1].split(",")[0] == packed_log.split("Parameters: ")[1].split(",")[0]
    # step 1: the same computation (the packed experts decode to the values the plain run reads)
    bound = fp32_tolerance(longest_reduction(config, config.block_size), plain[1])
    assert abs(packed[1] - plain[1]) <= bound, (packed, plain)
    assert packed[2] < packed[1], packed
    # the exported file: the LoRA matrices only, loadable on the unquantized base, merging into its outputs
    lora_path = packed_out / "final" / "lit_model.lora.safetensors"
    saved = load_weights(lora_path)
    assert saved and all("lora_" in k for k in saved) and not any(".experts." in k for k in saved)
    merged_path = lora.merge_lora_checkpoint(oss / "gpt_oss", lora_path, tmp_path / "merged")
    merged = load_model(merged_path.parent).eval()
    reference = load_variant_model(lora.GPT, lora.Config, oss / "gpt_oss", lora_path).eval()
    base = load_model(oss / "gpt_oss").eval()
    x = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(x)
        # fp32 bound: eps x the longest reduction x the logits' magnitude (tests/tolerance.py)
        torch.testing.assert_close(merged(x), expected, atol=logits_tolerance(merged.config, expected), rtol=0)
        assert (base(x) - expected).abs().max() > 1e-3  # the LoRA matrices trained: the merge is seen


@pytest.mark.parametrize("flags, line", [
    (["--lora_experts", "true"], "--lora_experts does not combine with --quantize mxfp4"),
    (["--train.compile", "true"], "--train.compile is not supported with --quantize"),
])
def test_lora_recipe_quantize_mxfp4_refuses_what_cannot_apply_in_one_line(oss, tmp_path, capsys, flags, line):
    from variants import run_recipe

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        run_recipe("finetune/lora.py", "--checkpoint_dir", str(oss / "gpt_oss"), "--data.data_dir", str(oss / "data"),
                   "--out_dir", str(out), *LORA_ARGS, "--quantize", "mxfp4", *flags)
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and line in err, err
    assert not out.exists()  # refused before anything was written


def test_eval_model_quantize_mxfp4_packs_the_experts_and_gives_the_same_logits_and_tokens(oss, capsys):
    """`load_eval_model(quantize="mxfp4")`, what eval/lm_eval.py, eval/perplexity.py and serve/base.py load with
    --quantize mxfp4 (EVAL_FLAGS), on the CPU in 32-true (the CPU inference layout: experts read by views) and
    bf16-true: packed experts, the unquantized model's logits and greedy tokens."""
    from lit_gpt.generate import generate
    from lit_gpt.recipes.evaluate import load_eval_model

    x = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(4))
    for precision in ("32-true", "bf16-true"):
        plain = load_eval_model(oss / "gpt_oss", accelerator="cpu", precision=precision)
        packed = load_eval_model(oss / "gpt_oss", accelerator="cpu", precision=precision, quantize="mxfp4")
        assert not any(isinstance(m, MXFP4ExpertLinear) for m in plain.gpt.modules())
        assert sum(isinstance(m, MXFP4ExpertLinear) for m in packed.gpt.modules()) == 6
        # 32-true on the CPU: the inference layout reads the chosen experts by views (MXFP4: decodes only those)
        assert all(m.by_views == (precision == "32-true") for m in packed.gpt.modules()
                   if isinstance(m, MXFP4ExpertLinear))
        with torch.no_grad():
            assert torch.equal(packed.model(x), plain.model(x)), precision
        tokens = generate(packed.gpt, x[0, :4], 8, temperature=0.0)
        assert torch.equal(tokens, generate(plain.gpt, x[0, :4], 8, temperature=0.0)), precision
    assert "Packed 6 expert projections as MXFP4" in capsys.readouterr().err


@pytest.mark.slow  # two server processes (~12 s on 2 cores)
def test_server_quantize_mxfp4_gives_the_unquantized_servers_greedy_completions(oss, forks):
    """`serve/base.py --quantize mxfp4` (EVAL_FLAGS: eval/lm_eval.py takes the same flag) on the CPU: the experts are
    packed at load and the real `openai` client gets the unquantized server's greedy completions, streamed or not."""
    from serve_client import ServerProcess
    from words import WORDS

    servers = [ServerProcess(oss / "gpt_oss", "--slots", "2", "--max_seq_length", "64", *extra, forks=forks).start()
               for extra in ((), ("--quantize", "mxfp4"))]
    try:
        answers = []
        for server in servers:
            client = server.ready().client()
            texts = []
            for i, n in enumerate((2, 5, 9)):
                prompt = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n))
                done = client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0.0)
                streamed = "".join(c.choices[0].text for c in client.completions.create(
                    model=server.model, prompt=prompt, max_tokens=8, temperature=0.0, stream=True))
                assert streamed == done.choices[0].text and done.usage.completion_tokens > 0
                texts.append(done.choices[0].text)
            answers.append(texts)
        plain, packed = answers
        assert "Packed 6 expert projections as MXFP4" in servers[1].log(), servers[1].log()
        assert "MXFP4" not in servers[0].log()
        assert packed == plain and any(t.strip() for t in plain), (packed, plain)
    finally:
        for server in servers:
            server.stop()


def test_eval_recipes_refuse_quantize_they_cannot_run_in_one_line(oss):
    """--quantize on the eval/serve model flags: checked before any weights are read, as generate/base.py checks it."""
    from lit_gpt.recipes.evaluate import check_eval_args
    from lit_gpt.utils import LitError

    assert check_eval_args(oss / "gpt_oss", accelerator="cpu", quantize="mxfp4") == ("base", None)
    with pytest.raises(LitError, match="--quantize must be one of"):
        check_eval_args(oss / "gpt_oss", accelerator="cpu", quantize="int4")
    # on XLA mxfp4 only (tests/xla/test_xla_mxfp4.py runs it); the torchao / bitsandbytes kernels are refused
    assert check_eval_args(oss / "gpt_oss", accelerator="xla", quantize="mxfp4") == ("base", None)
    with pytest.raises(LitError, match="runs on the CPU and CUDA, not on XLA .there only mxfp4"):
        check_eval_args(oss / "gpt_oss", accelerator="xla", quantize="torchao.int8wo")


# ------------------------------------------------------------------ on disk: conversion keeps the Hub's MXFP4 bytes
@pytest.fixture(scope="module")
def converted_pair(tmp_path_factory):
    """A Hub-style gpt-oss folder (tests/test_moe_parity.py's `write_mxfp4_folder`: MXFP4 `_blocks` / `_scales` in
    their own shard, `quantization_config: mxfp4`) converted twice: packed (the default) and with
    `dequantize_mxfp4=True` (the earlier bf16-expert output). Returns (packed folder, bf16 folder, the Hub's
    tensors)."""
    import shutil

    pytest.importorskip("transformers")
    from safetensors.torch import load_file
    from test_moe_parity import write_mxfp4_folder
    from tiny_hf import build_hf_model

    from lit_gpt.convert import convert_hf_checkpoint

    root = tmp_path_factory.mktemp("mxfp4_disk")
    write_mxfp4_folder(build_hf_model("gpt_oss", seed=1), root / "packed")
    shutil.copytree(root / "packed", root / "bf16")
    hub = {k: v for f in sorted((root / "packed").glob("model-*.safetensors")) for k, v in load_file(f).items()}
    convert_hf_checkpoint(root / "packed")
    convert_hf_checkpoint(root / "bf16", dequantize_mxfp4=True)
    return root / "packed", root / "bf16", hub


def _file_tensors(folder):
    from safetensors import safe_open

    with safe_open(str(folder / "lit_model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@torch.no_grad()
def test_conversion_keeps_the_hubs_mxfp4_bytes_and_every_loader_gives_the_bf16_conversions_model(converted_pair):
    """The file holds the Hub's uint8 blocks and scales (gate_up's interleaved rows split into fc_1 / fc_2, no byte
    changed), no float expert weight, in fewer bytes; `load_weights` (every loader's reader) decodes them to the
    bf16 conversion's values, so the model's logits are bit-equal to the bf16-expert conversion's."""
    from lit_gpt.loading import load_model
    from lit_gpt.weights import load_weights

    packed_dir, bf16_dir, hub = converted_pair
    on_disk = _file_tensors(packed_dir)
    layer = "transformer.h.0.mlp.experts"
    hub_gate_up = hub["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    assert on_disk[f"{layer}.fc_1.blocks"].dtype == torch.uint8
    assert torch.equal(on_disk[f"{layer}.fc_1.blocks"], hub_gate_up[:, 0::2])
    assert torch.equal(on_disk[f"{layer}.fc_2.blocks"], hub_gate_up[:, 1::2])
    assert torch.equal(on_disk[f"{layer}.proj.scales"], hub["model.layers.0.mlp.experts.down_proj_scales"])
    assert not any(".experts." in k and k.endswith(".weight") for k in on_disk)
    assert (packed_dir / "lit_model.safetensors").stat().st_size < (bf16_dir / "lit_model.safetensors").stat().st_size

    decoded = load_weights(packed_dir / "lit_model.safetensors")
    reference = load_weights(bf16_dir / "lit_model.safetensors")
    assert decoded.keys() == reference.keys()
    # the same values; the decoded experts take the checkpoint's float dtype (its biases': float32 here)
    assert all(torch.equal(decoded[k].float(), reference[k].float()) for k in decoded)
    assert decoded[f"{layer}.fc_1.weight"].dtype == decoded[f"{layer}.fc_1.bias"].dtype == torch.float32
    x = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(5))
    assert torch.equal(load_model(packed_dir)(x), load_model(bf16_dir).float()(x))


@torch.no_grad()
def test_a_packed_run_loads_the_file_into_its_buffers_as_packing_after_loading_would(converted_pair):
    """`load_model(..., quantize="mxfp4")` (generate, chat, eval and serve with --quantize mxfp4): the experts are
    built packed and take the file's bytes as they are; the same buffers and logits as the earlier path (the bf16
    file loaded, then packed: `lit_gpt.quantize`), and a bf16 file loads into the packed model too (packed on the
    fly)."""
    from lit_gpt.loading import load_model
    from lit_gpt.quantize import quantize_model

    packed_dir, bf16_dir, _ = converted_pair
    direct = load_model(packed_dir, "mxfp4")
    pack_on_load = load_model(bf16_dir)
    quantize_model(pack_on_load.float(), "mxfp4", torch.device("cpu"))
    from_bf16_file = load_model(bf16_dir, "mxfp4")
    on_disk = _file_tensors(packed_dir)
    buffers = dict(direct.named_buffers())
    assert all(torch.equal(buffers[k], v) for k, v in on_disk.items() if k.endswith((".blocks", ".scales")))
    for model in (direct, pack_on_load, from_bf16_file):
        assert sum(isinstance(m, MXFP4ExpertLinear) for m in model.modules()) == 3 * model.config.n_layer
        # packing decoded values may pick another (equal-valued) encoding of a group whose largest code is 3: the
        # same weights, not always the same bytes
        for (name, m), ref in zip(model.named_modules(), direct.modules()):
            if isinstance(m, MXFP4ExpertLinear):
                assert torch.equal(m.weight.float(), ref.weight.float()), name
    x = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(6))
    expected = pack_on_load(x)
    assert torch.equal(direct.float()(x), expected) and torch.equal(from_bf16_file.float()(x), expected)


@torch.no_grad()
def test_packed_experts_without_a_bias_decode_in_the_dtype_the_model_is_cast_to():
    """Mixtral-like experts (no bias to carry the dtype): built packed in float32 (`packed_shells`, as a packed run
    loads), then cast with the model (`model.to(bfloat16)`, `.half()`), they decode to the model's dtype."""
    from lit_gpt.mxfp4 import packed_shells

    lin = ExpertLinear(2, 64, 8)
    lin.weight.copy_(dequantize_mxfp4(*quantize_mxfp4(lin.weight), torch.float32))
    with torch.device("meta"):
        model = torch.nn.Sequential(ExpertLinear(2, 64, 8))
    assert packed_shells(model) == 1 and model[0].dtype == torch.float32
    blocks, scales = quantize_mxfp4(lin.weight)
    model.load_state_dict({"0.blocks": blocks, "0.scales": scales}, assign=True)
    x = torch.randn(2, 3, 64)
    assert torch.equal(model(x), lin(x))
    for dtype, cast in ((torch.bfloat16, lambda m: m.to(torch.bfloat16)), (torch.float16, lambda m: m.half())):
        assert cast(model)[0].weight.dtype == dtype and torch.equal(model(x.to(dtype)), lin.to(dtype)(x.to(dtype)))


def test_a_packed_file_that_lost_its_scales_is_one_line(converted_pair, tmp_path):
    from lit_gpt.utils import LitError
    from lit_gpt.weights import load_weights, save_weights

    state = _file_tensors(converted_pair[0])
    del state["transformer.h.1.mlp.experts.proj.scales"]
    save_weights(state, tmp_path)
    for packed in (False, True):
        with pytest.raises(LitError, match=r"proj\.blocks without its \.scales: it is incomplete, convert it again"):
            load_weights(tmp_path / "lit_model.safetensors", packed=packed)


def test_the_xla_loaders_sources_give_either_file_in_the_form_either_model_takes(converted_pair):
    """The XLA staged loader reads tensor by tensor (`lit_gpt.xla.loader._Sources`, no XLA needed): a packed file
    read for a model of float experts gives `load_weights`' decoded tensors, a bf16 file read for a packed model
    gives the packed ones (tests/xla/test_xla_mxfp4.py runs both on XLA:CPU)."""
    from lit_gpt import GPT, Config
    from lit_gpt.mxfp4 import packed_shells
    from lit_gpt.weights import load_weights
    from lit_gpt.xla.loader import _Sources

    packed_dir, bf16_dir, _ = converted_pair
    for folder, packed in ((packed_dir, False), (bf16_dir, True), (packed_dir, True), (bf16_dir, False)):
        with torch.device("meta"):
            model = GPT(Config.from_checkpoint(folder))
        if packed:
            packed_shells(model)
        wanted = model.state_dict().keys()
        sources = _Sources([folder / "lit_model.safetensors"])
        sources.fit_mxfp4(wanted)
        assert set(sources.keys()) == set(wanted), (folder.name, packed)
        expected = load_weights(folder / "lit_model.safetensors", packed=packed)
        got = {k: sources.take(k) for k in sorted(wanted)}
        assert all(got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]) for k in wanted), folder


@torch.no_grad()
def test_a_bf16_hub_folder_converts_packed_and_loads_bf16_experts_either_way(tmp_path):
    """What users bring: the Hub's gpt-oss is bf16 outside its MXFP4 experts. Converted, the file keeps the uint8
    bytes; a float run decodes the experts to bf16 (the biases' dtype, not float32), and a packed run
    (`--quantize mxfp4`) gives bit-equal logits."""
    pytest.importorskip("transformers")
    from test_moe_parity import write_mxfp4_folder
    from tiny_hf import build_hf_model

    from lit_gpt.convert import convert_hf_checkpoint
    from lit_gpt.loading import load_model
    from lit_gpt.weights import load_weights

    folder = tmp_path / "gpt-oss-bf16"
    write_mxfp4_folder(build_hf_model("gpt_oss", seed=2).to(torch.bfloat16), folder)
    convert_hf_checkpoint(folder)
    layer = "transformer.h.0.mlp.experts"
    on_disk = _file_tensors(folder)
    assert on_disk[f"{layer}.fc_1.blocks"].dtype == on_disk[f"{layer}.proj.scales"].dtype == torch.uint8
    decoded = load_weights(folder / "lit_model.safetensors")
    assert decoded[f"{layer}.fc_1.weight"].dtype == decoded[f"{layer}.proj.weight"].dtype == torch.bfloat16
    float_run, packed_run = load_model(folder), load_model(folder, "mxfp4")
    assert any(isinstance(m, MXFP4ExpertLinear) for m in packed_run.modules())
    x = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(5))
    out = float_run(x)
    assert out.dtype == torch.bfloat16 and torch.equal(packed_run(x), out)
