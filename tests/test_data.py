"""Data preparation and batching: broken files are reported by line, masking/truncation/splits are exact, the
batch stream is deterministic and resumable, and the prepare scripts work from local files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_gpt import data
from lit_gpt.utils import LitError

ROOT = Path(__file__).resolve().parents[1]


def rows_of(path: Path):
    records, bad = data.read_records(path)
    rows, bad_fields = data.records_to_rows(records, data.instruction_rows())
    return rows, bad + bad_fields


def reasons(bad):
    return {b.line: b.reason for b in bad}


# ---------------------------------------------------------------------------------------------------------------
# Reading broken files
# ---------------------------------------------------------------------------------------------------------------
def test_json_array_bad_rows_are_reported_with_their_lines(tmp_path):
    path = tmp_path / "d.json"
    # line numbers: each element starts on its own line
    path.write_bytes(
        b"[\n"
        b'{"instruction": "ok", "input": "", "output": "fine"},\n'  # 2
        b'{"instruction": "no output"},\n'  # 3
        b'{"instruction": "empty", "output": "   "},\n'  # 4
        b'{"instruction": "bad \xff\xfe bytes", "output": "x"},\n'  # 5
        b'{"instruction": 7, "output": "x"},\n'  # 6
        b'"just a string",\n'  # 7
        b'{"instruction": "lone \\udc80 surrogate", "output": "x"},\n'  # 8
        b'{"instruction": "also ok",\n "output": "multi\\nline"}\n'  # 9-10
        b"]\n"
    )
    rows, bad = rows_of(path)
    assert [r.line for r in rows] == [2, 9]
    assert rows[1].output == "multi\nline"
    r = reasons(bad)
    assert sorted(r) == [3, 4, 5, 6, 7, 8]
    assert "missing field 'output'" in r[3]
    assert "empty" in r[4]
    assert "not valid UTF-8" in r[5] and "not valid UTF-8" in r[8]
    assert "not a string" in r[6]
    assert "expected an object" in r[7]


def test_json_array_syntax_error_rejects_the_file_naming_the_line(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[\n{"instruction": "a", "output": "b"},\n{"instruction": "a" "output": "b"}\n]')
    with pytest.raises(LitError, match=r"d.json:3: invalid JSON"):
        data.read_records(path)
    path.write_text('[\n{"instruction": "a", "output": "b"}\n')
    with pytest.raises(LitError, match="not closed"):
        data.read_records(path)
    path.write_text("")
    with pytest.raises(LitError, match="is empty"):
        data.read_records(path)


def test_jsonl_bad_lines_are_skipped_by_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(
        b'{"instruction": "a", "output": "b"}\n'  # 1
        b"\n"  # 2: blank, ignored
        b'{"instruction": "a", "output": \n'  # 3: truncated JSON
        b'{"instruction": "\xc3\x28", "output": "b"}\n'  # 4: invalid UTF-8 sequence
        b'{"instruction": "c", "input": null, "output": "d"}\n'  # 5: null input is fine
        b'{"instruction": "e", "output": ""}\n'  # 6: empty output
    )
    rows, bad = rows_of(path)
    assert [r.line for r in rows] == [1, 5] and rows[1].input == ""
    r = reasons(bad)
    assert sorted(r) == [3, 4, 6]
    assert "invalid JSON" in r[3] and "UTF-8" in r[4] and "empty" in r[6]


def test_csv_bad_rows_are_reported_with_their_lines(tmp_path):
    path = tmp_path / "d.csv"
    path.write_bytes(
        b"instruction,input,output\n"  # 1
        b"a,,b\n"  # 2
        b'"multi\nline",ctx,"out"\n'  # 3-4
        b"too,many,cells,here\n"  # 5
        b"missing\n"  # 6: no output cell
        b"x,,\n"  # 7: empty output
        b"\xff,,y\n"  # 8: not UTF-8
        b"c,d,e\n"  # 9
    )
    rows, bad = rows_of(path)
    assert [(r.line, r.instruction, r.output) for r in rows] == [(2, "a", "b"), (3, "multi\nline", "out"), (9, "c", "e")]
    r = reasons(bad)
    assert sorted(r) == [5, 6, 7, 8]
    assert "4 cells" in r[5] and "missing field 'output'" in r[6] and "empty" in r[7] and "UTF-8" in r[8]


def test_csv_malformed_quote_rejects_the_file(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text('instruction,output\na,b\n"x"y,z\n')
    with pytest.raises(LitError, match=r"d.csv:3: malformed CSV"):
        data.read_csv_records(path, ",")
    with pytest.raises(LitError, match="unsupported data file"):
        data.read_records(tmp_path / "d.txt")
    with pytest.raises(LitError, match="not found"):
        data.read_records(tmp_path / "missing.json")


# ---------------------------------------------------------------------------------------------------------------
# Tokenizing, masking, truncation, split
# ---------------------------------------------------------------------------------------------------------------
def test_prompt_is_masked_and_response_ends_with_eos(tiny_dir):
    from lit_gpt.prompts import PromptStyle
    from lit_gpt.tokenizer import Tokenizer

    tok = Tokenizer(tiny_dir)
    style = PromptStyle.from_name("alpaca")
    row = data.Row(1, "Say hi", "to Bob", "Hi Bob!")
    sample, truncated = data.tokenize_row(row, tok, style, max_seq_length=1000)
    prompt = tok.encode(style.apply("Say hi", input="to Bob"))
    response = tok.encode("Hi Bob!", bos=False, eos=True)
    assert not truncated
    assert torch.equal(sample["input_ids"], torch.cat([prompt, response]))
    assert (sample["labels"][: prompt.numel()] == data.IGNORE_INDEX).all()
    assert torch.equal(sample["labels"][prompt.numel():], response)
    assert sample["input_ids"][-1] == tok.eos_id

    unmasked, _ = data.tokenize_row(row, tok, style, max_seq_length=1000, mask_inputs=False)
    assert torch.equal(unmasked["labels"], unmasked["input_ids"])

    cut, truncated = data.tokenize_row(row, tok, style, max_seq_length=prompt.numel() + 2)
    assert truncated and cut["input_ids"].numel() == prompt.numel() + 2
    with pytest.raises(data.BadRowError, match="prompt alone"):
        data.tokenize_row(row, tok, style, max_seq_length=prompt.numel())


def write_json(path: Path, rows) -> Path:
    path.write_text(json.dumps(rows))
    return path


def test_prepare_counts_truncated_and_skipped_and_splits_deterministically(tiny_dir, tmp_path):
    long_output = " ".join(["word"] * 200)
    rows = [{"instruction": f"task {i}", "input": "", "output": f"answer {i}"} for i in range(20)]
    rows += [{"instruction": "long", "output": long_output}, {"instruction": "broken"}]
    src = write_json(tmp_path / "d.json", rows)
    parsed, bad = rows_of(src)
    meta = data.prepare(parsed, bad, checkpoint_dir=tiny_dir, destination=tmp_path / "out", source=str(src),
                        max_seq_length=64, val_split_fraction=0.2, seed=7)
    c = meta["counts"]
    assert (c["samples"], c["train"], c["val"], c["truncated"], c["skipped"]) == (21, 17, 4, 1, 1)
    assert meta["skipped_rows"] == [{"line": 1, "row": 22, "reason": "missing field 'output'"}]
    assert c["longest"] == 64
    saved = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert saved == meta and saved["mask_inputs"] is True and saved["prompt_style"] == "alpaca"

    prepared = data.load_prepared(tmp_path / "out", tiny_dir)
    assert len(prepared.train) == 17 and len(prepared.val) == 4
    # same seed, same split; another seed, another split
    data.prepare(parsed, bad, checkpoint_dir=tiny_dir, destination=tmp_path / "again", source=str(src),
                 max_seq_length=64, val_split_fraction=0.2, seed=7)
    again = data.load_prepared(tmp_path / "again")
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(prepared.val, again.val))
    data.prepare(parsed, bad, checkpoint_dir=tiny_dir, destination=tmp_path / "other", source=str(src),
                 max_seq_length=64, val_split_fraction=0.2, seed=8)
    other = data.load_prepared(tmp_path / "other")
    assert any(not torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(prepared.val, other.val))


def test_on_bad_rows_error_rejects_and_all_bad_is_an_error(tiny_dir, tmp_path):
    src = write_json(tmp_path / "d.json", [{"instruction": "a", "output": "b"}, {"instruction": "c", "output": ""}])
    parsed, bad = rows_of(src)
    # a one-line JSON array: the element number finds the row, the line number alone would not
    refused = r"1 bad row\(s\): row 2 \(line 1\): field 'output' is empty.*--on_bad_rows skip"
    with pytest.raises(LitError, match=refused):
        data.prepare(parsed, bad, checkpoint_dir=tiny_dir, destination=tmp_path / "o", source=str(src),
                     on_bad_rows="error")
    assert not (tmp_path / "o" / "meta.json").exists()
    src = write_json(tmp_path / "e.json", [{"instruction": "c", "output": ""}])
    parsed, bad = rows_of(src)
    with pytest.raises(LitError, match="none of the 1 rows is usable"):
        data.prepare(parsed, bad, checkpoint_dir=tiny_dir, destination=tmp_path / "o", source=str(src))


def test_rows_of_a_one_line_array_are_numbered_and_counted_once(tiny_dir, tmp_path, capsys):
    rows = [{"instruction": f"question {i} " * 20, "output": "answer"} for i in range(37)]
    src = write_json(tmp_path / "d.json", rows)
    assert "\n" not in src.read_text().strip()
    parsed, bad = rows_of(src)
    assert [(r.line, r.element) for r in parsed[:3]] == [(1, 1), (1, 2), (1, 3)]
    # every prompt is longer than max_seq_length: 37 rows fail in tokenization, and 37 is what is reported
    with pytest.raises(LitError, match=r"none of the 37 rows is usable \(37 bad"):
        data.prepare(parsed, bad, checkpoint_dir=tiny_dir, destination=tmp_path / "o", source=str(src),
                     max_seq_length=8)
    warning = capsys.readouterr().err
    assert "skipping 37 bad row(s): row 1 (line 1): the prompt alone has" in warning and "row 2 (line 1)" in warning
    assert not (tmp_path / "o").exists()


def test_deeply_nested_json_is_one_clear_error(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    array = tmp_path / "deep.json"
    array.write_text('[{"instruction": "a", "output": "b"},\n' + deep + "]")
    with pytest.raises(LitError, match=r"deep\.json:2: row 2 of the JSON array is nested too deeply"):
        data.read_json_records(array)
    lines = tmp_path / "deep.jsonl"
    lines.write_text('{"instruction": "a", "output": "b"}\n' + deep + "\n")
    records, bad = data.read_json_records(lines)
    assert len(records) == 1 and [str(b) for b in bad] == ["line 2: JSON nested too deeply to read"]


def test_load_prepared_rejects_missing_corrupt_and_foreign_data(tiny_dir, tmp_path):
    with pytest.raises(LitError, match="no prepared data"):
        data.load_prepared(tmp_path / "nothing")
    src = write_json(tmp_path / "d.json", [{"instruction": f"t{i}", "output": "b"} for i in range(4)])
    parsed, bad = rows_of(src)
    out = tmp_path / "out"
    data.prepare(parsed, bad, checkpoint_dir=tiny_dir, destination=out, source=str(src), val_split_fraction=0.25)
    meta = json.loads((out / "meta.json").read_text())
    meta["tokenizer"]["sha256"] = "0" * 64
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(LitError, match="prepare it again with --checkpoint_dir"):
        data.load_prepared(out, tiny_dir)
    (out / "train.pt").write_bytes(b"not a torch file")
    with pytest.raises(LitError, match="cannot read"):
        data.load_prepared(out)
    torch.save([{"input_ids": torch.tensor([1, 2])}], out / "train.pt")
    with pytest.raises(LitError, match="sample 0"):
        data.load_prepared(out)


def test_chat_data_prepared_before_the_template_bos_rule_is_refused(smollm2_dir, tmp_path):
    """Chat-template prompts are encoded as transformers' apply_chat_template does (no tokenizer BOS); data prepared
    by an earlier version (no `prompt_bos` in meta.json) must be prepared again, not silently mixed."""
    src = write_json(tmp_path / "d.json", [{"instruction": f"t{i}", "output": "b"} for i in range(4)])
    parsed, bad = rows_of(src)
    out = tmp_path / "out"
    data.prepare(parsed, bad, checkpoint_dir=smollm2_dir, destination=out, source=str(src), prompt_style="chat",
                 val_split_fraction=0.25)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["prompt_style"] == "chat" and meta["prompt_bos"] is False
    assert data.load_prepared(out, smollm2_dir).meta["counts"]["samples"] == 4
    del meta["prompt_bos"]
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(LitError, match="encoded by an earlier version .* prepare it with"):
        data.load_prepared(out, smollm2_dir)


# ---------------------------------------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------------------------------------
def fake_samples(lengths):
    out = []
    for i, n in enumerate(lengths):
        ids = torch.arange(1, n + 1) + 100 * i
        labels = ids.clone()
        labels[: n // 2] = data.IGNORE_INDEX
        out.append({"input_ids": ids, "labels": labels})
    return out


def test_collate_shifts_pads_and_buckets():
    samples = fake_samples([5, 9])
    batch = data.collate(samples, max_seq_length=64)
    assert batch["input_ids"].shape == (2, 8) and batch["n_tokens"] == 4 + 8
    assert torch.equal(batch["input_ids"][1], samples[1]["input_ids"][:-1])
    assert torch.equal(batch["labels"][1], samples[1]["labels"][1:])
    assert (batch["labels"][0, 4:] == data.IGNORE_INDEX).all() and (batch["input_ids"][0, 4:] == 0).all()
    assert data.collate(samples, 64, pad_pow2=True)["input_ids"].shape == (2, 8)
    assert data.collate(fake_samples([10]), 64, pad_pow2=True)["input_ids"].shape == (1, 16)
    assert data.collate(fake_samples([10]), 12, pad_pow2=True)["input_ids"].shape == (1, 12)  # capped
    assert data.collate(fake_samples([10]), 64, pad_multiple=8)["input_ids"].shape == (1, 16)
    cropped = data.collate(fake_samples([30]), max_seq_length=16)
    assert cropped["input_ids"].shape == (1, 16) and cropped["n_tokens"] == 16
    # powers of two bound the number of distinct shapes (one compiled step per bucket on XLA)
    lengths = {data.pad_length(n, 256, pad_pow2=True) for n in range(1, 257)}
    assert lengths == {1, 2, 4, 8, 16, 32, 64, 128, 256}


def test_train_batches_deterministic_resumable_and_sharded():
    samples = fake_samples([4 + i % 7 for i in range(23)])

    def first_ids(stream, n):
        return [tuple(next(stream)["input_ids"][:, 0].tolist()) for _ in range(n)]

    a = data.TrainBatches(samples, 2, 32, seed=5)
    assert a.batches_per_epoch == 11
    seq = first_ids(a, 30)  # crosses two epoch boundaries
    assert seq == first_ids(data.TrainBatches(samples, 2, 32, seed=5), 30)
    assert seq != first_ids(data.TrainBatches(samples, 2, 32, seed=6), 30)
    # one epoch never repeats a sample; the next epoch has another order
    epoch0 = [i for b in seq[:11] for i in b]
    assert len(set(epoch0)) == 22 and seq[11:22] != seq[:11]

    b = data.TrainBatches(samples, 2, 32, seed=5)
    first_ids(b, 13)
    state = b.state_dict()
    c = data.TrainBatches(samples, 2, 32, seed=5)
    c.load_state_dict(state)
    assert first_ids(c, 17) == seq[13:]
    with pytest.raises(LitError, match="same --train.seed"):
        data.TrainBatches(samples, 2, 32, seed=9).load_state_dict(state)

    # two ranks together take the same samples per step as one rank with twice the micro-batches
    ranks = [data.TrainBatches(samples, 1, 32, seed=5, rank=r, world_size=2) for r in range(2)]
    single = data.TrainBatches(samples, 1, 32, seed=5)
    for _ in range(11):
        pair = {next(ranks[0])["input_ids"][0, 0].item(), next(ranks[1])["input_ids"][0, 0].item()}
        assert pair == {next(single)["input_ids"][0, 0].item(), next(single)["input_ids"][0, 0].item()}
    with pytest.raises(LitError, match="fewer than micro_batch_size"):
        data.TrainBatches(samples[:3], 2, 32, world_size=2)


def test_val_batches_are_the_same_set_for_any_device_count():
    samples = fake_samples([5, 6, 7, 8, 9])
    one = data.val_batches(samples, 2, 32, max_iters=2)
    two = [data.val_batches(samples, 2, 32, max_iters=2, rank=r, world_size=2) for r in range(2)]
    assert len(one) == 2 and [len(t) for t in two] == [1, 1]
    assert torch.equal(one[0]["input_ids"], two[0][0]["input_ids"])
    assert torch.equal(one[1]["input_ids"], two[1][0]["input_ids"])


# ---------------------------------------------------------------------------------------------------------------
# The prepare scripts, from local files
# ---------------------------------------------------------------------------------------------------------------
def run_script(name, *args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_prepare_scripts_from_local_files(tiny_dir, tmp_path):
    import importlib.util

    def load(name):
        spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    alpaca = write_json(tmp_path / "alpaca.json", [{"instruction": f"i{k}", "input": "", "output": f"o{k}"} for k in range(10)])
    load("prepare_alpaca").prepare(destination_path=tmp_path / "a", checkpoint_dir=tiny_dir, data_file=alpaca,
                                   val_split_fraction=0.2)
    assert data.load_prepared(tmp_path / "a", tiny_dir).meta["counts"]["train"] == 8

    dolly = tmp_path / "dolly.jsonl"
    dolly.write_text("\n".join(json.dumps({"instruction": f"q{k}", "context": "ctx" if k % 2 else "",
                                           "response": f"r{k}", "category": "qa"}) for k in range(10)))
    load("prepare_dolly").prepare(destination_path=tmp_path / "d", checkpoint_dir=tiny_dir, data_file=dolly)
    prepared = data.load_prepared(tmp_path / "d")
    assert len(prepared.train) + len(prepared.val) == 10

    lima = tmp_path / "lima.jsonl"
    lima.write_text("\n".join([
        json.dumps({"conversations": ["hello", "hi there", "how are you", "fine"], "source": "x"}),
        json.dumps({"conversations": ["q"], "source": "x"}),  # too short: a bad row
        json.dumps({"conversations": ["a", "b"], "source": "y"}),
    ]))
    module = load("prepare_lima")
    module.prepare(destination_path=tmp_path / "l1", checkpoint_dir=tiny_dir, data_file=lima, val_split_fraction=0.0)
    meta = data.load_prepared(tmp_path / "l1").meta
    assert meta["counts"]["samples"] == 2 and meta["skipped_rows"][0]["line"] == 2
    module.prepare(destination_path=tmp_path / "l2", checkpoint_dir=tiny_dir, data_file=lima, val_split_fraction=0.0,
                   include_multiturn_conversations=True)
    l2 = data.load_prepared(tmp_path / "l2")
    assert l2.meta["counts"]["samples"] == 3
    # the second exchange carries the first as history in its prompt
    from lit_gpt.tokenizer import Tokenizer

    texts = [Tokenizer(tiny_dir).decode(s["input_ids"]) for s in l2.train]
    assert any("hello" in t and "hi there" in t and "how are you" in t and t.rstrip().endswith("fine<|im_end|>")
               for t in texts), texts

    csv_file = tmp_path / "mine.csv"
    csv_file.write_text("question,answer\nq1,a1\nq2,\nq3,a3\n")
    load("prepare_csv").prepare(data_file=csv_file, destination_path=tmp_path / "c", checkpoint_dir=tiny_dir,
                                instruction_key="question", input_key=None, output_key="answer",
                                val_split_fraction=0.0)
    meta = data.load_prepared(tmp_path / "c").meta
    assert meta["counts"]["samples"] == 2 and meta["skipped_rows"] == [{"line": 3, "reason": "field 'answer' is empty"}]


def test_prepare_cli_reports_bad_rows_and_errors_in_one_line(tiny_dir, tmp_path):
    src = tmp_path / "mine.jsonl"
    src.write_bytes(b'{"instruction": "a", "output": "b"}\n{"instruction": "c"}\n{"instruction": "\xff", "output": "x"}\n'
                    b'{"instruction": "d", "output": "e"}\n')
    proc = run_script("prepare_json.py", "--data_file", src, "--destination_path", tmp_path / "o",
                      "--checkpoint_dir", tiny_dir, "--val_split_fraction", "0.25")
    assert proc.returncode == 0, proc.stderr
    assert "skipping 2 bad row(s): line 2: missing field 'output'; line 3: field 'instruction' is not valid UTF-8" in proc.stderr
    assert "Wrote 1 training and 1 validation samples" in proc.stdout

    proc = run_script("prepare_json.py", "--data_file", src, "--destination_path", tmp_path / "p",
                      "--checkpoint_dir", tiny_dir, "--on_bad_rows", "error")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "line 2: missing field 'output'" in proc.stderr

    proc = run_script("prepare_alpaca.py", "--data_file", tmp_path / "missing.json", "--checkpoint_dir", tiny_dir,
                      "--destination_path", tmp_path / "q")
    assert proc.returncode == 1 and proc.stderr.strip() == f"error: data file {str(tmp_path / 'missing.json')!r} not found"


# ---------------------------------------------------------------------------------------------------------------
# One table of datasets behind the five prepare scripts
# ---------------------------------------------------------------------------------------------------------------
def load_script(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"prepare_{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


COMMON_FLAGS = {"checkpoint_dir": "checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct", "data_file": None, "seed": 42,
                "mask_inputs": True, "max_seq_length": None, "prompt_style": "alpaca", "on_bad_rows": "skip",
                "overwrite": False}
TAIL = ["val_split_fraction", "seed", "mask_inputs", "max_seq_length", "prompt_style", "on_bad_rows", "overwrite"]
# the command lines the five scripts had before they shared one implementation: flags in --help order, and the
# defaults that differ between them
SCRIPT_FLAGS = {
    "alpaca": (["destination_path", "checkpoint_dir", "data_file", *TAIL],
               {"destination_path": "data/alpaca", "val_split_fraction": 0.03865}),
    "dolly": (["destination_path", "checkpoint_dir", "data_file", *TAIL],
              {"destination_path": "data/dolly", "val_split_fraction": 0.1}),
    "lima": (["destination_path", "checkpoint_dir", "data_file", "access_token", "include_multiturn_conversations",
              *TAIL], {"destination_path": "data/lima", "val_split_fraction": 0.1, "access_token": None,
                       "include_multiturn_conversations": False}),
    "json": (["data_file", "destination_path", "checkpoint_dir", "instruction_key", "input_key", "output_key", *TAIL],
             {"destination_path": "data/json", "val_split_fraction": 0.1, "instruction_key": "instruction",
              "input_key": "input", "output_key": "output"}),
    "csv": (["data_file", "destination_path", "checkpoint_dir", "instruction_key", "input_key", "output_key",
             "delimiter", *TAIL], {"destination_path": "data/csv", "val_split_fraction": 0.1,
                                   "instruction_key": "instruction", "input_key": "input", "output_key": "output",
                                   "delimiter": None}),
}


def test_every_dataset_has_its_script_and_every_prepare_script_is_a_dataset():
    from lit_gpt.prepare import DATASETS

    # prepare_preferences.py prepares pairs for DPO and prepare_prompts.py prompts with answers for GRPO, not
    # instruction datasets (tests/test_prepare_preferences.py, tests/test_grpo.py)
    not_instructions = ("prepare_preferences", "prepare_prompts")
    scripts = {p.stem[len("prepare_"):] for p in (ROOT / "scripts").glob("prepare_*.py") if p.stem not in not_instructions}
    assert scripts == set(DATASETS) == set(SCRIPT_FLAGS)


def script_parser(prepare):
    """The parser `python scripts/prepare_NAME.py` builds (what its --help shows), without parsing."""
    import jsonargparse

    from lit_gpt.utils import run_cli

    return jsonargparse.capture_parser(lambda: run_cli(prepare))


@pytest.mark.parametrize("name", sorted(SCRIPT_FLAGS))
def test_prepare_script_flags_defaults_and_help(name):
    prepare = load_script(name).prepare
    parser = script_parser(prepare)
    order, defaults = SCRIPT_FLAGS[name]
    actions = [a for a in parser._actions if a.dest not in ("help", "config", "print_config")]
    assert [a.dest for a in actions] == order
    defaults_now = parser.get_defaults()
    got = {k: (str(v) if isinstance(v, Path) else v) for k, v in ((k, defaults_now[k]) for k in order)}
    assert got == {**COMMON_FLAGS, **defaults}
    help_text = " ".join(parser.format_help().split())
    assert "Tokenize" in parser.description and parser.description in help_text
    for action in actions:
        assert action.help and " ".join(action.help.split()) in help_text, action.dest
    if name in ("json", "csv"):  # the user's own file: nothing to download, so --data_file is needed
        with pytest.raises(LitError, match="^pass your data file with --data_file$"):
            prepare()
    with pytest.raises(TypeError):  # a generated signature checks its arguments as a written-out one does
        prepare(data_file=None, no_such_flag=1)


def test_prepare_script_help_names_each_dataset_s_fields():
    def helps(name):
        return {a.dest: a.help for a in script_parser(load_script(name).prepare)._actions}

    assert "instruction + context" in helps("dolly")["prompt_style"]
    assert "a turn (and its history)" in helps("lima")["prompt_style"]
    assert helps("csv")["input_key"].startswith("Column") and helps("json")["input_key"].startswith("Field")
    assert "cached there" in helps("alpaca")["destination_path"]
    assert "cached there" not in helps("json")["destination_path"]
