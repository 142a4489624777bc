"""Weight-only quantization (lit_gpt/quantize.py): the quantized real SmolLM2 still answers "Paris" greedily,
`--quantize` runs end to end through generate/base.py, bad choices are one line; on a CUDA GPU also bitsandbytes
generation and QLoRA (finetune/lora.py --quantize bnb.nf4) with its memory target. (gpt-oss's experts in MXFP4 under
generation, LoRA, evaluation and serving: tests/test_moe_mxfp4.py.)"""

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_gpt.utils import LitError

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="bitsandbytes / GPU kernels need a CUDA GPU")


def run_script(capsys, monkeypatch, script: str, *args: str) -> subprocess.CompletedProcess:
    """A recipe's `__main__` block in this process (a subprocess costs seconds of imports)."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / script), *args])
    code = 0
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)  # sys.exit() is success
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("error:")] == [lines[-1]], proc.stderr
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]


def greedy(model, tokenizer, n: int):
    from lit_gpt.generate import generate

    with torch.inference_mode():
        return generate(model, tokenizer.encode(PROMPT), n).tolist()


def test_int8_smollm2_answers_like_the_unquantized_model(smollm2_dir):
    from lit_gpt.generate import load_model
    from lit_gpt.quantize import describe, is_quantized, quantize_model
    from lit_gpt.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2_dir)
    model = load_model(smollm2_dir)
    reference = greedy(model, tokenizer, 3)
    assert tokenizer.decode(reference).startswith(" Paris")
    float_bytes = sum(m.weight.nbytes for n, m in model.named_modules() if n.startswith("transformer.h.")
                      and isinstance(m, torch.nn.Linear))

    assert quantize_model(model, "torchao.int8wo") == 150  # 30 blocks x (qkv, proj, fc_1, fc_2, mlp proj)
    assert describe(model) == {"AffineQuantizedTensor": 150}
    # the head is the embedding matrix (tied): it stays one float tensor
    assert model.lm_head.weight is model.transformer.wte.weight and not is_quantized(model.lm_head.weight)
    int8_bytes = sum(m.weight.tensor_impl.int_data.nbytes for n, m in model.named_modules()
                     if n.startswith("transformer.h.") and isinstance(m, torch.nn.Linear))
    assert int8_bytes * 4 == float_bytes
    assert greedy(model, tokenizer, 3) == reference


def test_int4_smollm2_still_says_paris(smollm2_dir):
    from lit_gpt.generate import load_model
    from lit_gpt.quantize import quantize_model
    from lit_gpt.tokenizer import Tokenizer

    tokenizer = Tokenizer(smollm2_dir)
    model = load_model(smollm2_dir).to(torch.bfloat16)  # the CPU int4 kernel's usual dtype
    assert quantize_model(model, "torchao.int4wo") == 150
    assert type(model.transformer.h[0].mlp.fc_1.weight).__name__ == "Int4OpaqueTensor"
    # int4 rounds more: only the answer's first word is asked for
    assert tokenizer.decode(greedy(model, tokenizer, 1)) == " Paris"


def test_generate_recipe_quantize_end_to_end(smollm2_dir, capsys, monkeypatch):
    proc = run_script(capsys, monkeypatch, "generate/base.py", "--checkpoint_dir", str(smollm2_dir), "--prompt", PROMPT,
                      "--prompt_style", "raw", "--temperature", "0", "--max_new_tokens", "2",
                      "--quantize", "torchao.int8wo")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The capital of France is Paris"), proc.stdout
    assert "Quantized 150 of 150 block linear layers with torchao.int8wo" in proc.stderr


GPU = torch.cuda.is_available()
# the choices a line suggests are the ones that run here: bitsandbytes (bnb.*) only where a CUDA GPU is
# (LoRA's choices: bnb.nf4, and mxfp4 for gpt-oss's experts, which a line names as fitting some models only)
QLORA_LINE = (["--quantize bnb.int8 is not available here: use bnb.nf4 or mxfp4 (gpt-oss's experts)"] if GPU else
              ["--quantize bnb.int8 is not available here: use mxfp4 (gpt-oss's experts) or run without --quantize",
               "(bnb.nf4 needs a CUDA GPU)"])


@pytest.mark.parametrize(
    "script, args, fragments, absent",
    [
        ("generate/base.py", ["--quantize", "int8"], ["--quantize must be one of", "torchao.int8wo"]
         + (["bnb.nf4"] if GPU else []), [] if GPU else ["bnb."]),
        ("chat/base.py", ["--quantize", "nf4"], ["--quantize must be one of", "torchao.int4wo"], []),
        ("finetune/lora.py", ["--quantize", "bnb.int8"], QLORA_LINE, []),
        ("finetune/lora.py", ["--quantize", "torchao.int8wo"],
         ["is not available", "bnb.nf4", "mxfp4"] if GPU else ["needs a CUDA GPU", "run without --quantize"], []),
        ("finetune/lora.py", ["--quantize", "mxfp4"],
         ["--quantize mxfp4 packs the experts of a mixture-of-experts model", "has none", "without --quantize"], []),
        ("generate/base.py", ["--quantize", "torchao.int4wo", "--accelerator", "cpu", "--precision", "32-true"],
         ["torchao.int4wo on the CPU is fast in bfloat16 only", "--precision bf16-true"], []),
    ],
    ids=["generate-unknown", "chat-unknown", "qlora-int8", "qlora-torchao", "lora-mxfp4-dense", "int4-cpu-fp32"],
)
def test_bad_choice_is_one_line(tiny_dir, capsys, monkeypatch, script, args, fragments, absent):
    proc = run_script(capsys, monkeypatch, script, "--checkpoint_dir", str(tiny_dir), *args)
    assert_one_line_error(proc, *fragments)
    assert not any(word in proc.stderr for word in absent), proc.stderr  # nothing that cannot run here


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the line a machine without a CUDA GPU gives")
@pytest.mark.parametrize(
    "script, fragments",
    [("generate/base.py", ["needs a CUDA GPU", "torchao.int8wo"]), ("chat/base.py", ["needs a CUDA GPU"]),
     ("finetune/lora.py", ["needs a CUDA GPU", "use --quantize mxfp4 (gpt-oss's experts) or run without --quantize"])],
    ids=["generate", "chat", "qlora"],
)
def test_bitsandbytes_without_cuda_is_one_line(tiny_dir, capsys, monkeypatch, script, fragments):
    proc = run_script(capsys, monkeypatch, script, "--checkpoint_dir", str(tiny_dir), "--quantize", "bnb.nf4")
    assert_one_line_error(proc, *fragments)


def test_missing_bitsandbytes_names_the_install_command(monkeypatch):
    from lit_gpt.quantize import check_quantize

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as if it were not installed
    with pytest.raises(LitError, match=r"needs bitsandbytes: pip install bitsandbytes$"):
        check_quantize("bnb.int8", torch.device("cuda"), torch.bfloat16)


def test_int4_needs_bf16():
    from lit_gpt.quantize import check_quantize

    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("this GPU has no tinygemm int4 kernel")
    check_quantize("torchao.int4wo", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(LitError, match="fast in bfloat16 only: add --precision bf16-true"):
        check_quantize("torchao.int4wo", torch.device("cpu"), torch.float32)
    with pytest.raises(LitError, match="bfloat16 only: add --precision bf16-true"):
        # the dtype is checked before the GPU is asked about (no GPU needed to reach this line)
        check_quantize("torchao.int4wo", torch.device("cuda"), torch.float16)


# ---------------------------------------------------------------------------------------------------------------
# CUDA only
# ---------------------------------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("mode", ["torchao.int8wo", "torchao.int4wo", "bnb.int8", "bnb.nf4"])
def test_cuda_quantized_generation_says_paris(smollm2_dir, capsys, monkeypatch, mode):
    if mode.startswith("bnb."):
        pytest.importorskip("bitsandbytes", reason="bitsandbytes is an optional extra (pip install bitsandbytes)")
    if mode == "torchao.int4wo" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("tinygemm int4 needs compute capability >= 8.0")
    proc = run_script(capsys, monkeypatch, "generate/base.py", "--checkpoint_dir", str(smollm2_dir), "--prompt", PROMPT,
                      "--prompt_style", "raw", "--temperature", "0", "--max_new_tokens", "2", "--quantize", mode,
                      "--accelerator", "cuda", "--precision", "bf16-true")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The capital of France is Paris"), proc.stdout
    assert f"Quantized 150 of 150 block linear layers with {mode}" in proc.stderr


def _lora_training_peak(quantize: bool, steps: int = 3) -> tuple:
    """Peak CUDA memory of LoRA training steps on a small bf16 model whose block weights dominate (16 blocks of
    width 1024, a 4k vocabulary), base weights frozen, optionally quantized to nf4: (peak bytes, losses)."""
    from lit_gpt import lora
    from lit_gpt.quantize import quantize_model

    torch.manual_seed(0)
    config = lora.Config(name="qlora-mem", block_size=128, vocab_size=4096, n_layer=16, n_head=16, n_query_groups=4,
                         n_embd=1024, intermediate_size=2816, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
                         tie_embeddings=True, lora_r=8, lora_mlp=True, lora_projection=True, lora_dropout=0.0)
    device = torch.device("cuda")
    with device:
        model = lora.GPT(config)
    model.apply(model._init_weights)
    for m in model.modules():
        if isinstance(m, lora.LoRALinear):
            m.reset_lora_parameters()
    model.to(torch.bfloat16)
    lora.mark_only_lora_as_trainable(model)
    if quantize:
        assert quantize_model(model, "bnb.nf4", device) == 16 * 5
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randint(0, config.vocab_size, (2, 128), device=device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    losses = []
    for _ in range(steps):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated()
    del model, optimizer
    torch.cuda.empty_cache()
    return peak, losses


@needs_cuda
def test_qlora_nf4_training_peak_memory_at_most_half_of_bf16_lora():
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is an optional extra (pip install bitsandbytes)")
    bf16_peak, bf16_losses = _lora_training_peak(quantize=False)
    nf4_peak, nf4_losses = _lora_training_peak(quantize=True)
    assert all(torch.isfinite(torch.tensor(nf4_losses))) and nf4_losses[-1] < nf4_losses[0]
    assert nf4_peak <= 0.5 * bf16_peak, (nf4_peak, bf16_peak)


@needs_cuda
def test_qlora_recipe_saves_a_plain_lora_file_that_merges(tiny_dir, tmp_path):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is an optional extra (pip install bitsandbytes)")
    import importlib.util

    from lit_gpt import data
    from lit_gpt.args import DataArgs, EvalArgs, TrainArgs
    from lit_gpt.lora import merge_lora_checkpoint

    words = "the cat sat on a mat and the dog ran over it".split()
    rows = [{"instruction": " ".join(words[i % 5:i % 5 + 4]), "input": "", "output": " ".join(words[i % 7:])}
            for i in range(24)]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    records, bad = data.read_records(tmp_path / "rows.json")
    prepared, bad2 = data.records_to_rows(records, data.instruction_rows())
    data.prepare(prepared, bad + bad2, checkpoint_dir=tiny_dir, destination=tmp_path / "data", source="rows.json",
                 max_seq_length=64, val_split_fraction=0.25, seed=1)
    spec = importlib.util.spec_from_file_location("recipe_finetune_lora_q", ROOT / "finetune" / "lora.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    summaries = {}
    for quantize in (None, "bnb.nf4"):
        out = tmp_path / f"out_{quantize}"
        summaries[quantize] = recipe.setup(
            checkpoint_dir=tiny_dir, out_dir=str(out), precision="bf16-true", accelerator="cuda", quantize=quantize,
            lora_mlp=True, data=DataArgs(data_dir=tmp_path / "data"),
            train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=4, learning_rate=1e-2,
                            save_interval=4, log_interval=1),
            eval=EvalArgs(interval=4, max_iters=1, max_new_tokens=2),
        )
    from lit_gpt.weights import load_weights, read_finetuned_metadata

    plain_path = tmp_path / "out_None" / "final" / "lit_model.lora.safetensors"
    qlora_path = tmp_path / "out_bnb.nf4" / "final" / "lit_model.lora.safetensors"
    plain, qlora = load_weights(plain_path), load_weights(qlora_path)
    plain_meta, qlora_meta = read_finetuned_metadata(plain_path), read_finetuned_metadata(qlora_path)
    assert qlora_meta["method"] == "lora" and qlora_meta["config"] == plain_meta["config"]
    assert {k: v.shape for k, v in qlora.items()} == {k: v.shape for k, v in plain.items()}
    assert all("lora_" in k for k in qlora)
    merged = merge_lora_checkpoint(tiny_dir, qlora_path, tmp_path / "merged")
    assert merged.is_file()
