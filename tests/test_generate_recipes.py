"""The generate recipes end to end on small checkpoints: loading (pickles of earlier versions and safetensors
folders), `generate/base.py`'s output and its bad inputs as one-line errors, the method recipes (`--quantize` after
the finetuned weights are loaded), a bf16 Hub checkpoint on the CPU, and the real SmolLM2 answering "Paris". The loop
itself: tests/test_generate.py (whose tiny models these tests reuse)."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_gpt.cpu_layout import onednn_available
from lit_gpt.generate import generate
from lit_gpt.loading import load_model
from lit_gpt.utils import LitError
from lit_gpt.weights import find_weights, load_weights
from test_generate import naive_greedy, tiny_model
from tiny import write_checkpoint

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "generate" / "base.py"


def test_a_bf16_hub_checkpoint_generates_in_fp32_with_the_cpu_layout(smollm2_bf16_dir, capsys, monkeypatch):
    """What users bring (the Hub's bf16 SmolLM2) at the CPU's default precision (32-true): the weights are cast to
    fp32 and laid out for the eager loop, as an fp32 checkpoint is, and the answer is what the cast model gives."""
    import lit_gpt.cpu_layout
    from lit_gpt.cpu_layout import prepare_for_generation
    from lit_gpt.tokenizer import Tokenizer

    monkeypatch.setattr(lit_gpt.cpu_layout, "meminfo_bytes", lambda field: 2**40)  # plenty: the tied head is packed
    tokenizer = Tokenizer(smollm2_bf16_dir)
    prompt = tokenizer.encode("The capital of France is")
    reference = load_model(smollm2_bf16_dir).float()
    expected = naive_greedy(reference, prompt, 4)
    model = load_model(smollm2_bf16_dir)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    prepare_for_generation(model, "cpu", "32-true", None)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.transformer.wte.weight.dtype == torch.float32
    if onednn_available():
        assert type(model.lm_head).__name__ == "PackedLinear"
        assert type(model.transformer.h[0].mlp.fc_1).__name__ == "PackedLinear"
    with torch.inference_mode():
        assert torch.equal(generate(model, prompt, 4), expected)
    assert tokenizer.decode(expected.tolist()).startswith(" Paris")

    proc = run_in_process(capsys, monkeypatch, "--checkpoint_dir", str(smollm2_bf16_dir), "--prompt",
                          "The capital of France is", "--prompt_style", "raw", "--temperature", "0",
                          "--max_new_tokens", "2", "--accelerator", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The capital of France is Paris"), proc.stdout


# ---------------------------------------------------------------------------------------------------------------
# loading and the recipe
# ---------------------------------------------------------------------------------------------------------------
def write_tokenizer(directory: Path) -> None:
    """A small byte-level BPE tokenizer (vocab < 320) with SmolLM2's special tokens, so that the CLI tests do not
    need the real model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["The capital of France is Paris. What food do llamas eat?"] * 20, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False})
    )
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("gen") / "tiny-llama"
    directory.mkdir()
    write_checkpoint(tiny_model(block_size=32), directory)
    write_tokenizer(directory)
    return directory


def test_load_model_keeps_tied_embeddings_one_tensor(tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert not any(p.is_meta for p in model.parameters())
    saved = load_weights(find_weights(tiny_checkpoint))
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name


def run_script(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the machine is shared: do not oversubscribe its cores
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env
    )


def run_in_process(capsys, monkeypatch, *args: str) -> subprocess.CompletedProcess:
    """The script's `__main__` block in this process (a subprocess costs seconds of imports per case); the exit
    status and output are what a shell would see."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    code = 0
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == errors[0]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def test_cli_runs_on_a_tiny_checkpoint(tiny_checkpoint):
    proc = run_script("--checkpoint_dir", str(tiny_checkpoint), "--prompt", "The capital", "--max_new_tokens", "5",
                      "--prompt_style", "raw", "--num_samples", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("The capital") == 2
    assert proc.stderr.count("tokens/s") == 2
    assert "Memory used" in proc.stderr


def test_cli_error_in_a_subprocess(tmp_path):
    """One bad input through a real process: exit status 1 and a single `error:` line, no traceback."""
    proc = run_script("--checkpoint_dir", str(tmp_path / "nowhere" / "SmolLM2-135M-Instruct"))
    assert proc.returncode == 1
    assert_one_line_error(proc, "does not exist", "download.py --repo_id nowhere/SmolLM2-135M-Instruct")


@pytest.mark.parametrize(
    "make_args, fragments",
    [
        (lambda d: ["--checkpoint_dir", str(d.parent / "missing" / "SmolLM2-135M-Instruct")],
         ["does not exist", "download.py"]),
        (lambda d: ["--checkpoint_dir", str(d.parent / "HuggingFaceTB" / "SmolLM2-135M-Instrukt")],
         ["not a known model name", "SmolLM2-135M-Instruct"]),
        (lambda d: ["--checkpoint_dir", str(d), "--prompt", "The capital of France is Paris. " * 8],
         ["the prompt has", "block_size", "shorten the prompt"]),
        (lambda d: ["--checkpoint_dir", str(d), "--max_new_tokens", "30"], ["exceeds", "max_new_tokens <="]),
        (lambda d: ["--checkpoint_dir", str(d), "--max_new_tokens", "0"], ["max_new_tokens must be > 0"]),
        (lambda d: ["--checkpoint_dir", str(d), "--temperature", "-1"], ["temperature must be >= 0"]),
        (lambda d: ["--checkpoint_dir", str(d), "--num_samples", "0"], ["num_samples must be >= 1"]),
    ],
    ids=["missing-dir", "unknown-model-name", "prompt-too-long", "too-many-new-tokens", "zero-new-tokens",
         "negative-temperature", "zero-samples"],
)
def test_cli_bad_input(tiny_checkpoint, capsys, monkeypatch, make_args, fragments):
    proc = run_in_process(capsys, monkeypatch, *make_args(tiny_checkpoint), "--prompt_style", "raw")
    assert_one_line_error(proc, *fragments)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_cli_bad_checkpoint_file(tiny_checkpoint, tmp_path, capsys, monkeypatch, damage):
    directory = tmp_path / "tiny-llama"
    directory.mkdir()
    for f in tiny_checkpoint.iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    weights = find_weights(directory)
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else os.urandom(len(data)))
    proc = run_in_process(capsys, monkeypatch, "--checkpoint_dir", str(directory), "--max_new_tokens", "3",
                          "--prompt_style", "raw")
    # the reader's wording names the format: "weights" for safetensors, "checkpoint" for an earlier version's .pth
    what = "cannot read weights" if weights.suffix == ".safetensors" else "cannot read checkpoint"
    assert_one_line_error(proc, what, "corrupt or truncated")


@pytest.mark.slow
def test_real_model_knows_the_capital_of_france(smollm2_dir):
    proc = run_script("--checkpoint_dir", str(smollm2_dir), "--prompt", "The capital of France is",
                      "--prompt_style", "raw", "--temperature", "0", "--max_new_tokens", "8", timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The capital of France is")
    assert "Paris" in proc.stdout


@pytest.mark.parametrize("name", ["lit_model.lora.safetensors", "lit_model.pth.lora"])
def test_a_folder_of_lora_weights_names_the_lora_recipe(tmp_path, name):
    from lit_gpt.loading import check_model_dir

    folder = tmp_path / "final"
    folder.mkdir()
    (folder / name).write_bytes(b"weights")
    message = rf"holds lora .*not a (whole|full) model.*generate/lora\.py --lora_path .*{name}"
    with pytest.raises(LitError, match=message):
        check_model_dir(folder)


def test_load_model_reads_a_safetensors_folder(tiny_checkpoint, tmp_path):
    from lit_gpt.weights import save_weights

    directory = tmp_path / "tiny-llama"
    directory.mkdir()
    model = load_model(tiny_checkpoint)
    save_weights(model.state_dict(), directory)
    model.config.save(directory)
    loaded = load_model(directory)
    assert find_weights(directory).name == "lit_model.safetensors"
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name


@pytest.mark.parametrize("method", ["lora", "adapter_v2"])
def test_method_recipes_quantize_the_finetuned_model(tiny_checkpoint, tmp_path, capsys, monkeypatch, method):
    """`--quantize` on a method recipe: the finetuned weights are loaded (LoRA: merged) and then the block linear
    layers quantized; greedy tokens stay those of the unquantized finetuned model on this small model."""
    import importlib

    from lit_gpt.peft import load_variant_model, save_finetuned

    variant = importlib.import_module(f"lit_gpt.{method}")
    overrides = dict(lora_r=4, lora_alpha=8, lora_mlp=True) if method == "lora" else dict(adapter_start_layer=0)
    config = variant.Config.from_checkpoint(tiny_checkpoint, **overrides)
    torch.manual_seed(1)
    model = variant.GPT(config)
    model.load_state_dict(load_model(tiny_checkpoint).state_dict(), strict=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if model.peft_filter(name, p):
                p.normal_(std=0.2)  # a finetuned-looking update, not the initial zeros
    path = save_finetuned(model, tmp_path / "final")
    flag = "--lora_path" if method == "lora" else "--adapter_path"
    script = REPO / "generate" / f"{method}.py"
    args = ["--checkpoint_dir", str(tiny_checkpoint), flag, str(path), "--prompt", "The capital", "--prompt_style",
            "raw", "--temperature", "0", "--max_new_tokens", "4", "--accelerator", "cpu"]
    monkeypatch.setattr(sys, "argv", [str(script), *args, "--quantize", "torchao.int8wo"])
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None), capsys.readouterr().err
    out, err = capsys.readouterr()
    n_linear = 5 * config.n_layer
    assert f"Quantized {n_linear} of {n_linear} block linear layers with torchao.int8wo" in err, err
    reference = load_variant_model(variant.GPT, variant.Config, tiny_checkpoint, path)
    if method == "lora":
        variant.merge_lora_weights(reference)
    from lit_gpt.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny_checkpoint)
    prompt = tokenizer.encode("The capital")
    expected = tokenizer.decode(prompt.tolist() + generate(reference.eval(), prompt, 4).tolist())
    assert out.strip() == expected.strip()


def test_a_missing_method_weights_file_names_its_flag(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    script = REPO / "generate" / "lora.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--checkpoint_dir", str(tiny_checkpoint), "--lora_path",
                                      str(tmp_path / "lit_model.lora.safetensors"), "--max_new_tokens", "3"])
    with pytest.raises(SystemExit):
        runpy.run_path(str(script), run_name="__main__")
    proc = subprocess.CompletedProcess([], 1, *capsys.readouterr())
    assert_one_line_error(proc, "--lora_path", "not found", "finetune/lora.py")
