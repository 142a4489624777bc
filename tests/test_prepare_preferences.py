"""Preference data (scripts/prepare_preferences.py, lit_gpt.preferences): every row form becomes the exact token
layout (the same masked prompt in both halves, each reply + EOS), bad rows are named by line as the other prepare
scripts name them, bad files are refused in one line with nothing written, and the folder loads for DPO and SFT."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_gpt import data
from lit_gpt.preferences import (
    KIND,
    PAIR_KEYS,
    PreferenceRow,
    check_replies_fit,
    load_preferences,
    pair_halves,
    preference_fields,
    prepare_preferences,
    prompt_length,
    tokenize_pair,
)
from lit_gpt.utils import LitError

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the template's default system turn


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from lit_gpt.tokenizer import Tokenizer

    return Tokenizer(tiny_dir)


@pytest.fixture(scope="module")
def hf_tok(tiny_dir):
    """transformers' own tokenizer and chat template of the same files: the reference for the chat prompts."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------------------------------------
# Row forms -> the exact token layout
# ---------------------------------------------------------------------------------------------------------------
ALPACA = ("Below is an instruction that describes a task, paired with an input that provides further context. "
          "Write a response that appropriately completes the request.\n\n### Instruction:\nSum\n\n### Input:\n2 3"
          "\n\n### Response:\n")
# (id, record, prompt style, the prompt as messages for transformers' chat template or as the expected text,
#  chosen, rejected)
LAYOUT_CASES = [
    ("plain-chat", {"prompt": "What color is the sky?", "chosen": "Blue.", "rejected": "Green."}, "chat",
     [user("What color is the sky?")], "Blue.", "Green."),
    ("plain-raw", {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}, "raw",
     "The sky is", " blue.", " green."),
    ("instruction-input-alpaca", {"instruction": "Sum", "input": "2 3", "chosen": "5", "rejected": "6"}, "alpaca",
     ALPACA, "5", "6"),
    ("instruction-input-chat", {"instruction": "Sum", "input": "2 3", "chosen": "5", "rejected": "6"}, "chat",
     [user("Sum\n\n2 3")], "5", "6"),
    ("messages-system-multiturn",
     {"messages": [{"role": "system", "content": "Be brief."}, user("Hi"), assistant("Hello."), user("Name?")],
      "chosen": assistant("Smol."), "rejected": "I will not say."}, "chat",
     [{"role": "system", "content": "Be brief."}, user("Hi"), assistant("Hello."), user("Name?")],
     "Smol.", "I will not say."),
    ("messages-raw", {"messages": [user("a "), assistant("b "), user("c ")], "chosen": "d", "rejected": "e"}, "raw",
     "a b c ", "d", "e"),
    ("trl-explicit", {"prompt": [user("2+2?")], "chosen": [assistant("4")], "rejected": [assistant("5")]}, "chat",
     [user("2+2?")], "4", "5"),
    ("trl-implicit", {"chosen": [user("Capital of France?"), assistant("Paris")],
                      "rejected": [user("Capital of France?"), assistant("Rome")]}, "chat",
     [user("Capital of France?")], "Paris", "Rome"),
    ("ultrafeedback", {"prompt": "Say yes", "messages": [user("Say yes"), assistant("Yes")],
                       "chosen": [user("Say yes"), assistant("Yes")], "rejected": [user("Say yes"), assistant("No")]},
     "chat", [user("Say yes")], "Yes", "No"),
]


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=[c[0] for c in LAYOUT_CASES])
def test_each_row_form_gives_the_exact_token_layout(case, tiny_dir, tok, hf_tok):
    from lit_gpt.prompts import PromptStyle

    _, record, style_name, prompt, chosen, rejected = case
    row = PreferenceRow(7, *preference_fields(record))
    assert (row.chosen, row.rejected) == (chosen, rejected)
    style = PromptStyle.from_name(style_name, tiny_dir)
    sample, cropped = tokenize_pair(row, tok, style, max_seq_length=256)
    assert not cropped and set(sample) == set(PAIR_KEYS)
    if isinstance(prompt, list):  # the chat template as transformers renders and encodes it
        text = hf_tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        ids = torch.tensor(hf_tok(text, add_special_tokens=False)["input_ids"])
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    else:
        text, ids = prompt, tok.encode(prompt, bos=style.bos)
    n = prompt_length(sample)
    assert n == ids.numel() == prompt_length(sample, "rejected_labels")
    eos = tok.decode([tok.eos_id])
    assert eos == "<|im_end|>"
    for inputs, labels, reply in ((sample["input_ids"], sample["labels"], chosen),
                                  (sample["rejected_input_ids"], sample["rejected_labels"], rejected)):
        assert inputs.dtype == labels.dtype == torch.int64 and inputs.shape == labels.shape
        assert torch.equal(inputs[:n], ids)  # the prompt: identical in both halves, as transformers encodes it
        assert (labels[:n] == data.IGNORE_INDEX).all()  # masked exactly over the prompt ...
        assert torch.equal(labels[n:], inputs[n:])  # ... and nothing else
        assert inputs[-1] == tok.eos_id
        assert torch.equal(inputs[n:], tok.encode(reply, bos=False, eos=True))
        assert tok.decode(inputs) == text + reply + eos
    # the chosen half is the SFT sample of the chosen reply
    sft, _ = data.tokenize_row(row.sft_row(chosen), tok, style, 256)
    assert all(torch.equal(a, b) for a, b in zip(pair_halves(sample)[0].values(), sft.values()))


def test_default_prompt_style_is_the_checkpoint_s_and_long_pairs_are_cropped(smollm2_dir, tmp_path, tok):
    long = " ".join(["word"] * 60)
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hi", "chosen": long, "rejected": "Short."},
                                             {"prompt": "Yo", "chosen": "A.", "rejected": "B."}])
    meta = prepare_preferences(src, checkpoint_dir=smollm2_dir, destination=tmp_path / "o", max_seq_length=48,
                               val_split_fraction=0.0)
    assert meta["prompt_style"] == "chat" and meta["prompt_bos"] is False  # an Instruct checkpoint: its template
    c = meta["counts"]
    assert (c["samples"], c["train"], c["val"], c["truncated"], c["skipped"], c["longest"]) == (2, 2, 0, 1, 0, 48)
    cut = load_preferences(tmp_path / "o", smollm2_dir).train[0]
    n = prompt_length(cut)
    assert cut["input_ids"].numel() == 48 and cut["input_ids"][-1] != tok.eos_id  # cropped as SFT rows are
    assert cut["rejected_input_ids"][-1] == tok.eos_id and torch.equal(cut["input_ids"][:n],
                                                                       cut["rejected_input_ids"][:n])


# ---------------------------------------------------------------------------------------------------------------
# Bad rows, named by line
# ---------------------------------------------------------------------------------------------------------------
GOOD = {"prompt": "Q", "chosen": "A", "rejected": "B"}
# (record, the reason in the one line) -- each on its own line after a good first line
BAD_ROWS = [
    ({"prompt": "Q", "rejected": "B"}, "missing field 'chosen'"),
    ({"prompt": "Q", "chosen": "A"}, "missing field 'rejected'"),
    ({"chosen": "A", "rejected": "B"}, "missing the prompt: a 'prompt', 'messages' or 'instruction' field"),
    ({"prompt": "Q", "chosen": 3, "rejected": "B"}, "field 'chosen' is not a string or an assistant message (got int)"),
    ({"prompt": 3, "chosen": "A", "rejected": "B"}, "field 'prompt' is not a string or a list of messages (got int)"),
    ({"prompt": "Q", "chosen": "A", "rejected": "A"}, "'chosen' and 'rejected' are the same reply"),
    ({"prompt": "Q", "chosen": "  ", "rejected": "B"}, "field 'chosen' is empty"),
    ({"prompt": "", "chosen": "A", "rejected": "B"}, "field 'prompt' is empty"),
    ({"messages": [user("x"), {"role": "bot", "content": "y"}], "chosen": "A", "rejected": "B"},
     "message 2 of 'messages' has role 'bot'; the roles are system, user, assistant"),
    ({"messages": [user("x"), assistant("y")], "chosen": "A", "rejected": "B"},
     "the prompt (field 'messages') must end with the user's message, not the assistant's"),
    ({"messages": [user("x"), {"role": "system", "content": "s"}, user("z")], "chosen": "A", "rejected": "B"},
     "message 2 of field 'messages' is a system message; only the first message may be one"),
    ({"messages": [{"role": "user", "content": ["part"]}], "chosen": "A", "rejected": "B"},
     "the content of message 1 of 'messages' is not a string (got list)"),
    ({"messages": [{"content": "x"}], "chosen": "A", "rejected": "B"}, "message 1 of 'messages' has no 'role'"),
    ({"prompt": "Q", "chosen": user("A"), "rejected": "B"}, "field 'chosen' must be the assistant's reply, not a user"),
    ({"prompt": [user("Q")], "chosen": [assistant("A"), assistant("C")], "rejected": "B"},
     "field 'chosen' must hold one assistant message after the prompt, got 2"),
    ({"chosen": [user("Q"), assistant("A")], "rejected": [user("P"), assistant("B")]},
     "missing the prompt: 'chosen' and 'rejected' share no leading messages"),
    ({"chosen": [user("Q"), assistant("A")], "rejected": [user("Q"), assistant("A")]},
     "'chosen' and 'rejected' are the same reply"),
    ("just a string", "expected an object with fields, got str"),
]


def bad_file(tmp_path):
    return write_jsonl(tmp_path / "bad.jsonl", [GOOD, *[r for r, _ in BAD_ROWS], GOOD])


def test_bad_rows_are_skipped_and_listed_by_line(tiny_dir, tmp_path, capsys):
    src = bad_file(tmp_path)
    meta = prepare_preferences(src, checkpoint_dir=tiny_dir, destination=tmp_path / "o", prompt_style="chat",
                               val_split_fraction=0.0)
    assert meta["counts"]["samples"] == 2 and meta["counts"]["skipped"] == len(BAD_ROWS)
    assert [s["line"] for s in meta["skipped_rows"]] == list(range(2, len(BAD_ROWS) + 2))
    for skipped, (_, reason) in zip(meta["skipped_rows"], BAD_ROWS):
        assert skipped["reason"].startswith(reason), (skipped, reason)
    err = capsys.readouterr().err
    assert f"skipping {len(BAD_ROWS)} bad row(s): line 2: missing field 'chosen'; line 3:" in err
    assert json.loads((tmp_path / "o" / "meta.json").read_text()) == meta


@pytest.mark.parametrize("index", range(len(BAD_ROWS)), ids=[r for _, r in BAD_ROWS])
def test_on_bad_rows_error_names_the_line_and_writes_nothing(index, tiny_dir, tmp_path):
    record, reason = BAD_ROWS[index]
    src = write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, record])
    with pytest.raises(LitError) as e:
        prepare_preferences(src, checkpoint_dir=tiny_dir, destination=tmp_path / "o", on_bad_rows="error")
    assert f"1 bad row(s): line 3: {reason}" in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).endswith("Fix them, or pass --on_bad_rows skip to leave them out")
    assert not (tmp_path / "o").exists()


# rows that only the tokenizer finds bad: (rows, max_seq_length, the reasons by line)
TOKEN_CASES = [
    ("prompt-too-long", [GOOD, {"prompt": "word " * 60, "chosen": "A", "rejected": "B"}], 48,
     {2: "no room for the response within max_seq_length 48"}),
    ("same-after-cropping", [GOOD, {"prompt": "Q", "chosen": "same start " * 10 + "A",
                                    "rejected": "same start " * 10 + "B"}], 40,
     {2: "'chosen' and 'rejected' are the same within max_seq_length 40 tokens"}),
]


@pytest.mark.parametrize("case", TOKEN_CASES, ids=[c[0] for c in TOKEN_CASES])
def test_pairs_without_room_or_difference_are_bad_rows(case, tiny_dir, tmp_path):
    _, rows, max_len, reasons = case
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    meta = prepare_preferences(src, checkpoint_dir=tiny_dir, destination=tmp_path / "o", prompt_style="chat",
                               max_seq_length=max_len, val_split_fraction=0.0)
    assert {s["line"]: s["reason"] for s in meta["skipped_rows"]}.keys() == reasons.keys()
    for s in meta["skipped_rows"]:
        assert reasons[s["line"]] in s["reason"]
    with pytest.raises(LitError) as e:
        prepare_preferences(src, checkpoint_dir=tiny_dir, destination=tmp_path / "e", prompt_style="chat",
                            max_seq_length=max_len, on_bad_rows="error")
    assert "1 bad row(s): line 2: " in str(e.value) and reasons[2] in str(e.value)
    assert not (tmp_path / "e").exists()


# ---------------------------------------------------------------------------------------------------------------
# Bad files: one line, nothing written
# ---------------------------------------------------------------------------------------------------------------
FILE_CASES = [
    ("instruction-data", "d.json", json.dumps([{"instruction": "i", "input": "", "output": "o"}]),
     "d.json: no row has 'chosen' and 'rejected' replies (its rows have the fields 'input', 'instruction', 'output')"),
    ("no-objects", "d.jsonl", "\"a\"\n2\n", "no row has 'chosen' and 'rejected' replies (its rows are not objects)"),
    ("empty", "d.jsonl", "  \n", "is empty"),
    ("all-bad", "d.jsonl", json.dumps({"prompt": "Q", "chosen": "A", "rejected": "A"}) + "\n",
     "none of the 1 rows is usable (1 bad, see above); nothing to write"),
    ("csv-all-bad", "d.csv", "prompt,chosen,rejected\nQ,A,\n", "none of the 1 rows is usable"),
    ("missing", None, None, "not found"),
]


@pytest.mark.parametrize("case", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_a_bad_file_is_one_line_and_nothing_is_written(case, tiny_dir, tmp_path):
    _, name, text, message = case
    src = tmp_path / (name or "missing.json")
    if text is not None:
        src.write_text(text)
    with pytest.raises(LitError) as e:
        prepare_preferences(src, checkpoint_dir=tiny_dir, destination=tmp_path / "out" / "prefs")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
    if name == "d.json":
        assert str(e.value).endswith("for instruction data use scripts/prepare_json.py")


# ---------------------------------------------------------------------------------------------------------------
# The prepared folder: loads for DPO (and as SFT data); the loader refuses other folders
# ---------------------------------------------------------------------------------------------------------------
def test_prepared_folder_loads_and_the_loader_checks_it(tiny_dir, tmp_path):
    csv_file = tmp_path / "p.csv"
    csv_file.write_text("prompt,chosen,rejected\n" + "".join(f"q{i},yes {i},no {i}\n" for i in range(9))
                        + "q,,x\n")
    meta = prepare_preferences(csv_file, checkpoint_dir=tiny_dir, destination=tmp_path / "p", prompt_style="raw",
                               val_split_fraction=0.25, seed=3)
    assert meta["kind"] == KIND and meta["mask_inputs"] is True and meta["max_seq_length"] == 256
    assert (meta["counts"]["train"], meta["counts"]["val"]) == (7, 2)
    assert meta["skipped_rows"] == [{"line": 11, "reason": "field 'chosen' is empty"}]
    prepared = load_preferences(tmp_path / "p", tiny_dir)
    assert len(prepared.train) == 7 and len(prepared.val) == 2
    assert len(data.load_prepared(tmp_path / "p", tiny_dir).train) == 7  # also valid SFT data of the chosen replies
    check_replies_fit(prepared.train, max_seq_length=meta["counts"]["longest_prompt"])
    with pytest.raises(LitError, match="leaves no reply within --train.max_seq_length 1: raise it to at least"):
        check_replies_fit(prepared.train, max_seq_length=1)
    again = prepare_preferences(csv_file, checkpoint_dir=tiny_dir, destination=tmp_path / "q", prompt_style="raw",
                                val_split_fraction=0.25, seed=3)
    assert again["counts"] == meta["counts"]
    assert all(torch.equal(a["rejected_input_ids"], b["rejected_input_ids"])
               for a, b in zip(prepared.val, load_preferences(tmp_path / "q").val))

    # instruction data is refused by the DPO loader, with the command that makes preference data
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"instruction": f"i{k}", "output": f"o{k}"} for k in range(4)])
    records, bad = data.read_records(sft)
    rows, bad_fields = data.records_to_rows(records, data.instruction_rows())
    data.prepare(rows, bad + bad_fields, checkpoint_dir=tiny_dir, destination=tmp_path / "sft", source=str(sft))
    with pytest.raises(LitError, match="holds instruction data, not preference pairs: .*prepare_preferences.py"):
        load_preferences(tmp_path / "sft", tiny_dir)
    # a sample whose halves do not share the prompt
    train = torch.load(tmp_path / "p" / "train.pt", weights_only=True)
    train[1]["rejected_input_ids"] = train[1]["rejected_input_ids"].flip(0)
    torch.save(train, tmp_path / "p" / "train.pt")
    with pytest.raises(LitError, match=r"train.pt'.*sample 1 is not a preference pair"):
        load_preferences(tmp_path / "p")


# ---------------------------------------------------------------------------------------------------------------
# The script
# ---------------------------------------------------------------------------------------------------------------
def test_script_runs_and_reports_errors_in_one_line(tiny_dir, tmp_path):
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("prepare_preferences", ROOT / "scripts" / "prepare_preferences.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    src = bad_file(tmp_path)
    module.prepare(data_file=src, checkpoint_dir=tiny_dir, destination_path=tmp_path / "o", val_split_fraction=0.5)
    assert load_preferences(tmp_path / "o", tiny_dir).meta["counts"]["skipped"] == len(BAD_ROWS)
    with pytest.raises(TypeError):  # the generated signature checks its arguments
        module.prepare(data_file=src, mask_inputs=False)

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_preferences.py"), "--data_file", src,
                           "--checkpoint_dir", tiny_dir, "--destination_path", tmp_path / "e", "--on_bad_rows",
                           "error"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: {src}: {len(BAD_ROWS)} bad row(s): line 2: missing field 'chosen'; line 3:")
    assert not (tmp_path / "e").exists()
