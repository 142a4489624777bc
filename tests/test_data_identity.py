"""A run knows the data it trains on: meta.json of a prepared folder holds the data's fingerprint (its tokens, split,
tokenizer and prompt style; `lit_gpt.data.data_fingerprint`), every step checkpoint records it (finetune.json's
"prepared"), and `--resume` on other data is refused in one line naming both, unless `--allow_other_data true`. The
prepare scripts refuse to replace a prepared folder that holds other data unless `--overwrite true`; the same data
prepared again (from a copy of its file too) is written again without a word.

SFT (finetune/lora.py, packed and unpacked) and DPO (finetune/dpo.py) on the tiny checkpoints, in-process."""

import contextlib
import hashlib
import io
import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from lit_gpt import data
from lit_gpt.checkpoints import check_same_run
from lit_gpt.prepare import prepare_dataset
from lit_gpt.utils import LitError
from test_dpo import dpo_args, preference_rows, prepare_pairs, words_dir  # noqa: F401  (words_dir: a fixture)
from test_finetune import alpaca_rows, load_recipe, read_metrics, run_args


def hashes(folder: Path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).iterdir()) if p.is_file()}


def prepare_json(rows, destination: Path, checkpoint_dir: Path, name: str = "rows.json", **flags) -> dict:
    """`rows` through scripts/prepare_json.py, as a user prepares them; returns meta.json."""
    src = destination.parent / name
    src.write_text(json.dumps(rows))
    with contextlib.redirect_stdout(io.StringIO()):
        prepare_dataset("json", data_file=src, destination_path=destination, checkpoint_dir=checkpoint_dir,
                        **{"max_seq_length": 96, "val_split_fraction": 0.25, "seed": 1, **flags})
    return json.loads((destination / data.META_FILE).read_text())


REFUSED_PREPARE = (r"^--destination_path '.*/prepared' already holds other prepared data \(from '.*/a\.json', (\d+)"
                   r" samples, sha256:\w{16}; this is from '.*/b\.json', (\d+) samples, sha256:\w{16}\): refusing to"
                   r" overwrite \(a run that trained on it could no longer resume\)\. Pass --destination_path"
                   r" NEW_FOLDER, or --overwrite true to replace it$")


# ---------------------------------------------------------------------------------------------------------------
# preparing: the fingerprint, and no silent overwrite
# ---------------------------------------------------------------------------------------------------------------
def test_preparing_other_rows_into_a_prepared_folder_is_refused_and_the_same_rows_are_written_again(tiny_dir,
                                                                                                   tmp_path):
    dest = tmp_path / "prepared"
    first = prepare_json(alpaca_rows(12), dest, tiny_dir, "a.json")
    before = hashes(dest)
    with pytest.raises(LitError, match=REFUSED_PREPARE) as e:
        prepare_json(alpaca_rows(12, seed=1), dest, tiny_dir, "b.json")
    assert re.match(REFUSED_PREPARE, str(e.value)).groups() == ("12", "12")
    assert hashes(dest) == before  # nothing written, nothing lost
    assert re.fullmatch(r"sha256:[0-9a-f]{16}", first["fingerprint"])
    # the same rows from a copy of the file: the same data (decided by content, not by the file's path)
    (tmp_path / "copy").mkdir()
    again = prepare_json(alpaca_rows(12), dest, tiny_dir, "copy/a.json")
    assert again["fingerprint"] == first["fingerprint"] and again["source"].endswith("copy/a.json")
    assert data.load_prepared(dest).meta["fingerprint"] == first["fingerprint"]
    # one other split of the same rows is other data
    with pytest.raises(LitError, match="already holds other prepared data"):
        prepare_json(alpaca_rows(12), dest, tiny_dir, "a.json", seed=2)
    replaced = prepare_json(alpaca_rows(12, seed=1), dest, tiny_dir, "b.json", overwrite=True)
    assert replaced["fingerprint"] != first["fingerprint"]
    # a killed preparation (no meta.json: removed before the new files are written) is written over
    (dest / data.META_FILE).unlink()
    assert prepare_json(alpaca_rows(12), dest, tiny_dir, "a.json")["fingerprint"] == first["fingerprint"]


def test_a_folder_of_an_earlier_version_gets_its_fingerprint_from_its_files(tiny_dir, tmp_path):
    dest = tmp_path / "prepared"
    meta = prepare_json(alpaca_rows(8), dest, tiny_dir, "a.json")
    old = {k: v for k, v in meta.items() if k != "fingerprint"}
    (dest / data.META_FILE).write_text(json.dumps(old))
    assert data.load_prepared(dest).meta["fingerprint"] == meta["fingerprint"]
    prepare_json(alpaca_rows(8), dest, tiny_dir, "a.json")  # the same data: written again
    (dest / data.META_FILE).write_text(json.dumps(old))
    with pytest.raises(LitError, match=r"already holds other prepared data \(from '.*a\.json', 8 samples, sha256:"):
        prepare_json(alpaca_rows(8, seed=3), dest, tiny_dir, "b.json")


def test_preparing_pairs_into_a_folder_of_other_data_is_refused(words_dir, tmp_path):  # noqa: F811
    dest = tmp_path / "prepared"
    prepare_pairs(words_dir, preference_rows(12), dest, val_split_fraction=0.25, prompt_style="alpaca")
    before = hashes(dest)
    with pytest.raises(LitError, match=r"already holds other prepared data .*--overwrite true to replace it$"):
        prepare_pairs(words_dir, preference_rows(10), dest, val_split_fraction=0.25, prompt_style="alpaca")
    assert hashes(dest) == before
    prepare_pairs(words_dir, preference_rows(12), dest, val_split_fraction=0.25, prompt_style="alpaca")  # the same
    prepare_pairs(words_dir, preference_rows(10), dest, val_split_fraction=0.25, prompt_style="alpaca", overwrite=True)
    assert data.load_prepared(dest).meta["counts"]["samples"] == 10


# ---------------------------------------------------------------------------------------------------------------
# resuming: the checkpoint's data identity
# ---------------------------------------------------------------------------------------------------------------
def _record(fingerprint, data_dir="data/x", source="a.json"):
    return {"fingerprint": fingerprint, "data_dir": data_dir, "source": source, "samples": 4, "prompt_style": "alpaca",
            "packing": False}


def _run(prepared=None, data_dir="data/x"):
    run = {"method": "lora", "data": {"data_dir": data_dir, "packing": False}, "train": {"seed": 1}}
    return {**run, "prepared": prepared} if prepared is not None else run


def test_check_same_run_compares_the_data_by_its_fingerprint(capsys):
    a, b = "sha256:" + "a" * 16, "sha256:" + "b" * 16
    check_same_run(_run(_record(a)), _run(_record(a, "moved", "copy.json"), "moved"), Path("s"))  # moved: the same
    check_same_run(_run(), _run(_record(b)), Path("s"))  # a checkpoint of an earlier version recorded nothing
    with pytest.raises(LitError) as e:
        check_same_run(_run(_record(a)), _run(_record(b, source="b.json")), Path("out/step-000002"))
    assert str(e.value) == (
        f"the run in 'out/step-000002' trained on the prepared data in 'data/x' (from 'a.json', 4 samples, {a}), but"
        f" that folder now holds other data (from 'b.json', 4 samples, {b}): resume with the data it trained on, start"
        " a new run in a new --out_dir, or pass --allow_other_data true to continue on this data")
    with pytest.raises(LitError, match=r"but --data\.data_dir 'data/y' holds other data \(from 'a\.json'"):
        check_same_run(_run(_record(a)), _run(_record(b, "data/y"), "data/y"), Path("s"))
    # with a moved folder that holds other data, the data_dir is not reported as "other arguments" first
    check_same_run(_run(_record(a)), _run(_record(b)), Path("s"), allow_other_data=True)
    assert capsys.readouterr().err.strip().endswith("; continuing on it anyway (--allow_other_data true)")


@pytest.fixture(scope="module")
def sft_data(tiny_dir, tmp_path_factory):
    """A prepared folder of 24 rows (the runs below train on copies of it)."""
    prepared = tmp_path_factory.mktemp("identity_sft") / "prepared"
    prepare_json(alpaca_rows(24), prepared, tiny_dir, "a.json")
    return prepared


def sft_args(tiny_dir, data_dir, out, packing, steps=2, **overrides):
    args = run_args("lora", tiny_dir, data_dir, out, steps=steps, micro=1, global_batch=2, save_interval=1,
                    eval_interval=100, **overrides)
    if packing:
        args["data"] = replace(args["data"], packing=True)
        args["train"] = replace(args["train"], max_seq_length=160)
    return args


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_resume_on_data_prepared_again_from_other_rows_is_refused_in_one_line(sft_data, tiny_dir, tmp_path, packing,
                                                                               capsys):
    """A 2-step LoRA run stopped; its --data.data_dir was then prepared again from other rows: --resume auto refuses,
    naming both; the checkpoints stay as they were; --allow_other_data true continues with one warning."""
    prepared = Path(shutil.copytree(sft_data, tmp_path / "prepared"))
    out = tmp_path / "run"
    load_recipe("lora").setup(**sft_args(tiny_dir, prepared, out, packing))
    shutil.rmtree(prepared)  # prepared again, from other rows
    new = prepare_json(alpaca_rows(24, seed=5), prepared, tiny_dir, "b.json")
    before = {p.name for p in out.iterdir()}
    with pytest.raises(LitError) as e:
        load_recipe("lora").setup(**sft_args(tiny_dir, prepared, out, packing, steps=3, resume="auto"))
    line = str(e.value)
    recorded = json.loads((out / "step-000002" / "finetune.json").read_text())["prepared"]
    assert "\n" not in line
    assert line.startswith(f"the run in {str(out / 'step-000002')!r} trained on the prepared data in {str(prepared)!r}"
                           " (from '"), line
    assert recorded["fingerprint"] in line and new["fingerprint"] in line and "a.json" in line and "b.json" in line
    assert line.endswith("or pass --allow_other_data true to continue on this data")
    assert recorded["fingerprint"] == json.loads((sft_data / data.META_FILE).read_text())["fingerprint"]
    assert recorded["packing"] is packing and recorded["samples"] == 24
    assert {p.name for p in out.iterdir()} == before  # no step 3
    if packing:
        return  # the override is the same for packed rows (one run fewer)
    capsys.readouterr()
    load_recipe("lora").setup(**sft_args(tiny_dir, prepared, out, packing, steps=3, resume="auto",
                                         allow_other_data=True))
    assert "(--allow_other_data true)" in capsys.readouterr().err
    assert 3 in read_metrics(out)
    # from then on the run records the data it continued on: a plain --resume takes it
    continued = json.loads((out / "step-000003" / "finetune.json").read_text())["prepared"]
    assert continued["fingerprint"] == new["fingerprint"]


def test_the_same_data_in_another_folder_resumes(sft_data, tiny_dir, tmp_path):
    """What decides is the data, not its folder: a copy of the prepared folder elsewhere resumes the run."""
    out = tmp_path / "run"
    load_recipe("lora").setup(**sft_args(tiny_dir, sft_data, out, False))
    moved = Path(shutil.copytree(sft_data, tmp_path / "moved"))
    load_recipe("lora").setup(**sft_args(tiny_dir, moved, out, False, steps=3, resume="auto"))
    assert json.loads((out / "step-000003" / "finetune.json").read_text())["prepared"]["data_dir"] == str(moved)


def test_dpo_resume_on_other_pairs_is_refused_in_one_line(words_dir, tmp_path):  # noqa: F811
    """DPO: the pairs' folder prepared again from other pairs after a run was killed after its first checkpoint."""
    pairs = prepare_pairs(words_dir, preference_rows(12), tmp_path / "pairs", val_split_fraction=0.25,
                          prompt_style="alpaca")
    out = tmp_path / "run"
    args = dict(steps=1, save_interval=1, micro=2, dropout=0.0)
    load_recipe("dpo").setup(**dpo_args(words_dir, pairs, out, **args))
    shutil.rmtree(pairs)  # prepared again: the same pairs in another order (another split: other data)
    prepare_pairs(words_dir, preference_rows(12)[::-1], pairs, val_split_fraction=0.25, prompt_style="alpaca")
    refused = (r"^the run in '.*step-000001' trained on the prepared data in '.*pairs' \(from '.*pairs\.json', 12"
               r" samples, sha256:\w{16}\), but that folder now holds other data \(from '.*pairs\.json', 12 samples,"
               r" sha256:\w{16}\): .*--allow_other_data true to continue on this data$")
    with pytest.raises(LitError, match=refused):
        load_recipe("dpo").setup(**dpo_args(words_dir, pairs, out, **{**args, "steps": 2}, resume="auto"))
    assert not (out / "step-000002").exists()
