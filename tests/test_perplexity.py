"""eval/perplexity.py and lit_gpt/perplexity.py: the strided sliding window of transformers' perplexity guide, equal
to transformers (AutoModelForCausalLM on the same weights, the guide's loop with exact token weights) on a tiny
random model for several (window, stride) and on the real SmolLM2; a base + LoRA / adapter file equal to the model
it describes (LoRA: also the merged checkpoint and its transformers export); bad input as one `error:` line with
nothing written; the CLI once as a subprocess. XLA: tests/xla/test_xla_perplexity.py."""

import json
import math
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_gpt.perplexity import make_windows, score
from lit_gpt.recipes.evaluate import load_eval_model, perplexity_request
from tiny import tiny_llama_config, write_checkpoint
from variants import randomize_, randomize_own_, run_recipe
from words import WORDS

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
REL = 1e-4


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


# ---------------------------------------------------------------------------------------------------------------
# the reference: transformers' perplexity guide, token-weighted exactly
# ---------------------------------------------------------------------------------------------------------------
def guide_windows(length: int, window: int, stride: int):
    """(begin, end, trg_len) as the guide's loop makes them."""
    out, prev_end = [], 0
    for begin in range(0, length, stride):
        end = min(begin + window, length)
        out.append((begin, end, end - prev_end))
        prev_end = end
        if end == length:
            break
    return out


def hf_perplexity(model, docs, window: int, stride: int):
    """(perplexity, tokens scored): the guide's loop per document, each window's mean loss weighted by the labels
    transformers really scores (those after its internal shift), summed over windows and documents."""
    nll, n = 0.0, 0
    with torch.no_grad():
        for ids in docs:
            for begin, end, trg_len in guide_windows(ids.numel(), window, stride):
                input_ids = ids[begin:end].unsqueeze(0)
                labels = input_ids.clone()
                labels[:, :-trg_len] = -100
                count = int((labels[:, 1:] != -100).sum())
                if count:
                    nll += float(model(input_ids, labels=labels).loss.double()) * count
                    n += count
    return math.exp(nll / n), n


@pytest.mark.parametrize("length, window, stride", [(10, 4, 4), (10, 4, 2), (10, 4, 1), (11, 4, 3), (3, 8, 8),
                                                    (1, 4, 4), (2, 2, 1), (64, 64, 64), (65, 64, 64)])
def test_windows_are_the_guides(length, window, stride):
    ours = make_windows(length, window, stride)
    guide = guide_windows(length, window, stride)
    # the same forwards (the ones that score nothing left out), each scoring what transformers' shifted labels score
    expected = []
    for begin, end, trg_len in guide:
        scored = end - max(end - trg_len, begin + 1)
        if scored > 0:
            expected.append((begin, end, scored))
    assert [(w.begin, w.end, w.scored) for w in ours] == expected
    # every token but the first is scored at most once; all of them when windows overlap
    assert sum(w.scored for w in ours) <= max(length - 1, 0)
    if stride < window:
        assert sum(w.scored for w in ours) == length - 1


# ---------------------------------------------------------------------------------------------------------------
# fixtures: a tiny random model whose logits depend on the context, its transformers export, a text
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tiny_dir, tmp_path_factory):
    """{"lit": checkpoint dir, "hf": transformers folder of the same weights}: a tiny Llama with the SmolLM2
    tokenizer, its weights drawn so that logits are O(1) (the context changes the perplexity), context 64."""
    from lit_gpt import GPT
    from lit_gpt.convert import convert_lit_checkpoint

    root = tmp_path_factory.mktemp("ppl")
    torch.manual_seed(0)
    model = GPT(tiny_llama_config(block_size=64, vocab_size=49152))
    randomize_(model, seed=5)
    lit = write_checkpoint(model, root / "lit")
    for name in TOKENIZER_FILES:
        shutil.copy(tiny_dir / name, lit / name)
    hf = convert_lit_checkpoint(lit, root / "hf")
    return {"lit": lit, "hf": hf, "root": root}


@pytest.fixture(scope="module")
def text_file(models):
    path = models["root"] / "text.txt"
    path.write_text(words(120, seed=1))  # ~120 tokens: several windows of 64
    return path


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def ours(checkpoint_dir, data_path, window=None, stride=None, batch_size=3, **model_flags):
    request = perplexity_request(data_path, checkpoint_dir, window=window, stride=stride, batch_size=batch_size,
                                 accelerator="cpu", **model_flags)
    loaded = load_eval_model(checkpoint_dir, accelerator="cpu", **model_flags)
    return score(loaded.model, request.tokens, request.windows, loaded.runtime, batch_size), request


# ---------------------------------------------------------------------------------------------------------------
# equal to transformers
# ---------------------------------------------------------------------------------------------------------------
CASES = [(None, None), (32, 8), (40, 13), (64, 5)]  # (window, stride); None: the context (64)


@pytest.mark.parametrize("window, stride", CASES)
def test_equals_transformers_on_the_same_weights(models, text_file, window, stride):
    got, request = ours(models["lit"], text_file, window, stride)
    expected, n = hf_perplexity(hf_model(models["hf"]), request.tokens, request.window, request.stride)
    assert request.window == (window or 64) and request.stride == (stride or request.window)
    assert got.tokens_scored == n
    assert got.perplexity == pytest.approx(expected, rel=REL)
    # the test can fail: the context a window gives changes the perplexity by far more than the tolerance
    other, _ = ours(models["lit"], text_file, 8, 8)
    assert abs(other.perplexity / got.perplexity - 1) > 100 * REL


def test_json_rows_are_separate_documents(models):
    rows = [words(40, seed=2), words(1, seed=3), words(90, seed=4)]
    path = models["root"] / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(rows)))
    got, request = ours(models["lit"], path, 32, 16, batch_size=4)
    assert len(request.tokens) == 3 and got.documents == 3
    assert {w.doc for w in request.windows} == {0, 2}  # a one-token row has nothing to score
    assert all(w.end <= request.tokens[w.doc].numel() for w in request.windows)  # no window crosses a row
    expected, n = hf_perplexity(hf_model(models["hf"]), request.tokens, 32, 16)
    assert got.tokens_scored == n == sum(t.numel() - 1 for t in request.tokens)
    assert got.perplexity == pytest.approx(expected, rel=REL)
    # one text of the three rows together is another computation (windows across the joins)
    joined = models["root"] / "joined.txt"
    joined.write_text(" ".join(rows))
    assert ours(models["lit"], joined, 32, 16)[0].tokens_scored != got.tokens_scored


def test_real_smollm2_equals_transformers(smollm2_dir, tmp_path):
    path = tmp_path / "paris.txt"
    path.write_text("The capital of France is Paris. It is known for the Eiffel Tower, the Louvre museum and its"
                    " cafes. Every year millions of tourists visit the city to see its monuments and to walk along"
                    " the river Seine.")
    got, request = ours(smollm2_dir, path, 24, 10, batch_size=2)
    expected, n = hf_perplexity(hf_model(smollm2_dir), request.tokens, 24, 10)
    assert got.tokens_scored == n
    assert got.perplexity == pytest.approx(expected, rel=REL)
    assert 1 < got.perplexity < 100  # a real model on plain English


# ---------------------------------------------------------------------------------------------------------------
# finetuned weights: the file on its base equals the model it describes
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["lora", "adapter_v2"])
def test_finetuned_file_equals_its_model(models, text_file, method, tmp_path):
    import importlib

    import lightning as L

    from lit_gpt.fingerprint import base_record
    from lit_gpt.peft import save_finetuned
    from lit_gpt.runtime import Runtime
    from lit_gpt.weights import load_weights

    variant = importlib.import_module(f"lit_gpt.{method}")
    extra = dict(lora_r=2, lora_alpha=4, lora_dropout=0.0, lora_mlp=True) if method == "lora" else \
        dict(adapter_start_layer=0)
    torch.manual_seed(0)
    model = variant.GPT(variant.Config.from_checkpoint(models["lit"], **extra))
    model.load_state_dict(load_weights(models["lit"] / "lit_model.safetensors"), strict=False)
    randomize_own_(model)
    path = save_finetuned(model, tmp_path / "final", base=base_record(models["lit"]))
    flag = "lora_path" if method == "lora" else "adapter_path"

    got, request = ours(models["lit"], text_file, 32, 8, **{flag: path})
    base, _ = ours(models["lit"], text_file, 32, 8)
    in_memory = score(model.eval(), request.tokens, request.windows, Runtime(L.Fabric(accelerator="cpu", devices=1)))
    assert got.perplexity == pytest.approx(in_memory.perplexity, rel=REL)
    assert abs(got.perplexity / base.perplexity - 1) > 100 * REL  # the finetuned weights do change it
    if method == "lora":  # the merged checkpoint ("full") and its transformers export give the same
        from lit_gpt.convert import convert_lit_checkpoint
        from lit_gpt.lora import merge_lora_checkpoint

        merged = merge_lora_checkpoint(models["lit"], path, tmp_path / "merged").parent
        full, _ = ours(merged, text_file, 32, 8)
        assert full.perplexity == pytest.approx(got.perplexity, rel=REL)
        expected, _ = hf_perplexity(hf_model(convert_lit_checkpoint(merged, tmp_path / "hf")), request.tokens, 32, 8)
        assert got.perplexity == pytest.approx(expected, rel=REL)


# ---------------------------------------------------------------------------------------------------------------
# bad input: one line, nothing written
# ---------------------------------------------------------------------------------------------------------------
BAD = [  # (case, file name -> content (None: no file), extra flags, expected substring of the one line)
    ("missing file", ("none.txt", None), [], "not found"),
    ("directory", ("folder", "DIR"), [], "is a directory"),
    ("empty text", ("empty.txt", "  \n"), [], "holds no text"),
    ("unknown suffix", ("data.csv", "text\nhello"), [], "unknown file type '.csv'"),
    ("json without text", ("rows.json", '[{"text": "a b c"}, {"content": "d e"}]'), [],
     "row 2 (line 1): missing field 'text'"),
    ("jsonl empty text", ("rows.jsonl", '{"text": "a b"}\n{"text": ""}\n'), [], "line 2: field 'text' is empty"),
    ("jsonl broken line", ("rows.jsonl", '{"text": "a b"}\n{"text": \n'), [], "the first at line 2: invalid JSON"),
    ("json no rows", ("rows.json", "[]"), [], "holds no rows"),
    ("one token", ("one.txt", "red"), [], "too short"),
    ("no data path", None, [], "pass --data_path"),
    ("stride > window", ("ok.txt", "red green blue"), ["--window", "8", "--stride", "9"],
     "--stride 9 exceeds --window 8"),
    ("window > context", ("ok.txt", "red green blue"), ["--window", "65"],
     "--window 65 exceeds the model's context of 64"),
    ("window 1", ("ok.txt", "red green blue"), ["--window", "1"], "--window must be at least 2"),
    ("batch size 0", ("ok.txt", "red green blue"), ["--batch_size", "0"], "--batch_size must be at least 1"),
    ("unknown accelerator", ("ok.txt", "red green blue"), ["--accelerator", "tpu"], "--accelerator must be auto, cpu"),
    ("precision", ("ok.txt", "red green blue"), ["--precision", "bf16-mixed"], "--precision must be 32-true"),
    ("both weights", ("ok.txt", "red green blue"), ["--lora_path", "LORA", "--adapter_path", "LORA"], "not both"),
    ("lora as adapter", ("ok.txt", "red green blue"), ["--adapter_path", "LORA"], "pass it with --lora_path"),
    ("missing lora", ("ok.txt", "red green blue"), ["--lora_path", "nope.safetensors"], "--lora_path"),
    ("whole model as lora", ("ok.txt", "red green blue"), ["--lora_path", "BASE"], "not a finetuned-weights file"),
    ("other base", ("ok.txt", "red green blue"), ["--lora_path", "OTHER"], "records the base"),
    ("missing checkpoint", ("ok.txt", "red green blue"), ["--checkpoint_dir", "nowhere"], "does not exist"),
    ("out_dir is a file", ("ok.txt", "red green blue"), ["--out_dir", "FILE"], "is a file"),
]


@pytest.fixture(scope="module")
def lora_files(models, tiny_dir):
    """A LoRA file of the test model, and one of another base (the tiny_dir model)."""
    from lit_gpt import lora
    from lit_gpt.fingerprint import base_record
    from lit_gpt.peft import save_finetuned

    out = {}
    for name, base in (("LORA", models["lit"]), ("OTHER", tiny_dir)):
        model = lora.GPT(lora.Config.from_checkpoint(base, lora_r=2, lora_alpha=4))
        out[name] = save_finetuned(model, models["root"] / f"lora-{name}", base=base_record(base))
    return out


@pytest.mark.parametrize("case, data, extra, expected", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_one_line_and_writes_nothing(models, lora_files, tmp_path, capsys, case, data, extra, expected):
    flags = []
    if data is not None:
        name, content = data
        path = tmp_path / name
        if content == "DIR":
            path.mkdir()
        elif content is not None:
            path.write_text(content)
        flags = ["--data_path", str(path)]
    (tmp_path / "FILE").write_text("x")
    subst = {"LORA": str(lora_files["LORA"]), "OTHER": str(lora_files["OTHER"]), "FILE": str(tmp_path / "FILE"),
             "BASE": str(models["lit"] / "lit_model.safetensors"), "nowhere": str(tmp_path / "nowhere")}
    extra = [subst.get(a, a) for a in extra]
    out_flag = [] if "--out_dir" in extra else ["--out_dir", str(tmp_path / "out")]
    before = sorted(p.name for p in models["lit"].iterdir())
    with pytest.raises(SystemExit) as exit_info:
        run_recipe("eval/perplexity.py", "--checkpoint_dir", str(models["lit"]), *flags, *extra, *out_flag)
    assert exit_info.value.code == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in models["lit"].iterdir()) == before  # no eval/ folder in the checkpoint
    assert not (lora_files["OTHER"].parent / "eval").exists()  # (LORA's is the background CLI run's)


# ---------------------------------------------------------------------------------------------------------------
# the command line: started in the background with the module's first test (its interpreter start and imports
# overlap the other tests), checked by the last one
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def cli_run(models, lora_files, text_file):
    cmd = [sys.executable, str(REPO / "eval/perplexity.py"), "--data_path", str(text_file), "--checkpoint_dir",
           str(models["lit"]), "--lora_path", str(lora_files["LORA"]), "--window", "40", "--stride", "20",
           "--batch_size", "2", "--accelerator", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def test_cli_prints_the_table_and_writes_json_beside_the_weights(models, lora_files, text_file, cli_run):
    lora = lora_files["LORA"]
    try:
        stdout, stderr = cli_run.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        cli_run.kill()
        pytest.fail("eval/perplexity.py timed out")
    assert cli_run.returncode == 0, stderr[-3000:]
    out_file = lora.parent / "eval" / "perplexity.json"  # the default: next to the finetuned weights
    results = json.loads(out_file.read_text())
    got, request = ours(models["lit"], text_file, 40, 20, batch_size=2, lora_path=lora)
    assert results["perplexity"] == pytest.approx(got.perplexity, rel=1e-9)
    assert results["tokens_scored"] == got.tokens_scored and results["windows"] == len(request.windows)
    assert (results["window"], results["stride"], results["method"]) == (40, 20, "lora")
    header, rule, row = stdout.strip().splitlines()
    assert header.split() == ["model", "data", "tokens", "scored", "nll/token", "perplexity"]
    assert row.split()[-3:] == [str(got.tokens_scored), f"{got.nll_per_token:.4f}", f"{got.perplexity:.4f}"]
    assert "perplexity: 100%" in stderr and f"Wrote {out_file}" in stderr  # the progress bar, the file
    assert "Traceback" not in stderr
