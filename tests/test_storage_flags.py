"""Every path a user types goes through one storage layer (`lit_gpt.storage.check_path_flags`, run by `run_cli` before
an entry point runs): a URL is taken only by the flags that support it end to end (then resolved, with the missing
filesystem package named), refused in one line anywhere else, and never written as a local folder named after its
scheme; `memory://` given to an output is warned about (its files vanish with the process).

Each case runs an entry point's real command line (its `run_cli` with `args=`, in this process; the first cases of
the table also as real subprocesses) in an empty working directory, and asserts the exit code, the one line, and
that nothing was created there (no "gs:", "s3:" or "memory:" folder, nothing at all: the refusal comes first)."""

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from child_env import ROOT, python_path
from lit_gpt.utils import run_cli

HAS = {name: importlib.util.find_spec(name) is not None for name in ("gcsfs", "s3fs", "adlfs")}

# how each entry point calls run_cli (the function it passes and its arguments)
ENTRY: Dict[str, Tuple[str, dict]] = {
    "scripts/prepare_alpaca.py": ("prepare", {}),
    "scripts/prepare_csv.py": ("prepare", {}),
    "scripts/convert_hf_checkpoint.py": ("setup", {"as_positional": False}),
    "scripts/convert_lit_checkpoint.py": ("setup", {"as_positional": False}),
    "scripts/convert_gguf_checkpoint.py": ("setup", {"as_positional": False}),
    "scripts/download.py": ("setup", {"as_positional": False}),
    "xla/scripts/consolidate_checkpoint.py": ("setup", {"as_positional": False}),
    "finetune/lora.py": ("setup", {}),
    "generate/lora.py": ("setup", {}),
}


@dataclass
class Case:
    id: str
    script: str
    args: List[str]
    line: str
    """A substring of the last stderr line."""
    code: int = 1
    warning: Optional[str] = None
    """A substring of a `warning:` line that must come before it."""
    needs_missing: Optional[str] = None
    """The package that must NOT be installed for the case to apply (gcsfs, s3fs, adlfs)."""
    subprocess: bool = False
    """Also run as a real `python SCRIPT ...` process."""


CASES = [
    # --- a URL given to a flag that takes local paths only: refused, with what to do instead ----------------
    Case("prepare-destination-gs", "scripts/prepare_alpaca.py", ["--destination_path", "gs://b/data"],
         "--destination_path takes a local path (got 'gs://b/data'): write to a local folder, then copy that to"
         " gs://b/data (gcloud storage cp -r LOCAL_FOLDER gs://b/data)", subprocess=True),
    Case("prepare-destination-memory", "scripts/prepare_alpaca.py", ["--destination_path", "memory://data"],
         "--destination_path takes a local path (got 'memory://data'): memory:// exists only inside one process"),
    Case("prepare-checkpoint-s3", "scripts/prepare_alpaca.py", ["--checkpoint_dir", "s3://b/ckpt"],
         "--checkpoint_dir takes a local path (got 's3://b/ckpt'): copy it to this machine first (aws s3 cp"
         " --recursive s3://b/ckpt LOCAL_FOLDER)"),
    Case("prepare-csv-data-file-https", "scripts/prepare_csv.py", ["--data_file", "https://host/x.csv"],
         "--data_file takes a local path (got 'https://host/x.csv'): download it to a local file first"),
    Case("convert-hf-checkpoint-az", "scripts/convert_hf_checkpoint.py", ["--checkpoint_dir", "az://c/ckpt"],
         "--checkpoint_dir takes a local path (got 'az://c/ckpt'): copy it to this machine first (azcopy copy"),
    Case("convert-lit-output-gs", "scripts/convert_lit_checkpoint.py",
         ["--checkpoint_dir", "ck", "--output_dir", "gs://b/hf"],
         "--output_dir takes a local path (got 'gs://b/hf'): write to a local folder, then copy that to gs://b/hf"),
    Case("convert-lit-weights-s3", "scripts/convert_lit_checkpoint.py",
         ["--checkpoint_dir", "ck", "--output_dir", "out", "--checkpoint_path", "s3://b/w.safetensors"],
         "--checkpoint_path takes a local path (got 's3://b/w.safetensors'): copy it to this machine first"),
    Case("gguf-file-https", "scripts/convert_gguf_checkpoint.py", ["--gguf_path", "https://host/m.gguf"],
         "--gguf_path takes a local path (got 'https://host/m.gguf'): download it to a local file first"),
    Case("gguf-output-gs", "scripts/convert_gguf_checkpoint.py", ["--checkpoint_dir", "gs://b/ck"],
         "--checkpoint_dir takes a local path (got 'gs://b/ck'): write to a local folder, then copy that to gs://b/ck"),
    Case("download-output-s3", "scripts/download.py", ["--repo_id", "org/name", "--checkpoint_dir", "s3://b/ck"],
         "--checkpoint_dir takes a local path (got 's3://b/ck'): write to a local folder, then copy that to s3://b/ck"),
    Case("finetune-checkpoint-gs", "finetune/lora.py", ["--checkpoint_dir", "gs://b/ck"],
         "--checkpoint_dir takes a local path (got 'gs://b/ck'): copy it to this machine first (gcloud storage cp -r"
         " gs://b/ck LOCAL_FOLDER)"),
    Case("finetune-data-dir-s3", "finetune/lora.py", ["--data.data_dir", "s3://b/alpaca"],
         "--data.data_dir takes a local path (got 's3://b/alpaca'): copy it to this machine first"),
    Case("generate-lora-path-gs", "generate/lora.py",
         ["--prompt", "hi", "--lora_path", "gs://b/lit_model.lora.safetensors"],
         "--lora_path takes a local path (got 'gs://b/lit_model.lora.safetensors'): copy it to this machine first"),
    # --- a URL with a "/" lost (or a folder named like a scheme): never a local folder "gs:" ----------------------
    Case("convert-lit-output-mangled", "scripts/convert_lit_checkpoint.py",
         ["--checkpoint_dir", "ck", "--output_dir", "gs:/b/hf"],
         "--output_dir 'gs:/b/hf' reads as a gs:// URL with a '/' missing, not a folder", subprocess=True),
    Case("prepare-destination-scheme-folder", "scripts/prepare_alpaca.py", ["--destination_path", "s3:"],
         "--destination_path 's3:' reads as a s3:// URL with a '/' missing"),
    Case("finetune-resume-mangled", "finetune/lora.py", ["--resume", "gs:/b/run/step-000002"],
         "--resume 'gs:/b/run/step-000002' reads as a gs:// URL with a '/' missing, not a folder: write the URL as"
         " gs://BUCKET/PATH"),
    # --- URL-capable flags: resolved here; a missing package or an unknown scheme is one line --------------------
    Case("consolidate-input-s3-missing", "xla/scripts/consolidate_checkpoint.py",
         ["--checkpoint_dir", "s3://b/run/step-000002"],
         "--checkpoint_dir 's3://b/run/step-000002' needs the s3fs package: pip install s3fs", needs_missing="s3fs",
         subprocess=True),
    Case("consolidate-output-abfs-missing", "xla/scripts/consolidate_checkpoint.py",
         ["--checkpoint_dir", "ck", "--output_dir", "abfs://c/out"],
         "--output_dir 'abfs://c/out' needs the adlfs package: pip install adlfs", needs_missing="adlfs"),
    Case("consolidate-unknown-scheme", "xla/scripts/consolidate_checkpoint.py", ["--checkpoint_dir", "nosuch://b/x"],
         "--checkpoint_dir 'nosuch://b/x': Unsupported filesystem: 'nosuch'"),
    Case("consolidate-output-https", "xla/scripts/consolidate_checkpoint.py",
         ["--checkpoint_dir", "ck", "--output_dir", "https://host/out"],
         "--output_dir cannot write to https:// URLs (read-only)"),
    Case("consolidate-output-memory-warns", "xla/scripts/consolidate_checkpoint.py",
         ["--checkpoint_dir", "no-such-checkpoint", "--output_dir", "memory://consolidated"],
         "'no-such-checkpoint' does not exist",
         warning="--output_dir 'memory://consolidated' is this process's memory (memory:// is for tests): its files"
                 " vanish when the process exits"),
    # --- the finetune recipes' --out_dir and --resume take URLs (declared in lit_gpt.recipes.flags) --------------
    Case("finetune-out-dir-gs-missing", "finetune/lora.py", ["--out_dir", "gs://b/run"],
         "--out_dir 'gs://b/run' needs the gcsfs package: pip install gcsfs", needs_missing="gcsfs"),
    Case("finetune-resume-s3-missing", "finetune/lora.py", ["--resume", "s3://b/run/step-000002"],
         "--resume 's3://b/run/step-000002' needs the s3fs package: pip install s3fs", needs_missing="s3fs"),
    Case("finetune-out-dir-unreachable-host", "finetune/lora.py", ["--out_dir", "ftp://no-such-host.invalid/run"],
         "--out_dir 'ftp://no-such-host.invalid/run': cannot reach its host"),
    Case("finetune-out-dir-memory-warns", "finetune/lora.py",
         ["--out_dir", "memory://run", "--checkpoint_dir", "no-such-checkpoint"],
         "no-such-checkpoint", warning="--out_dir 'memory://run' is this process's memory"),
]
IDS = [c.id for c in CASES]


def _entry(script: str):
    name, kwargs = ENTRY[script]
    spec = importlib.util.spec_from_file_location("entry_" + script.replace("/", "_")[:-3], ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name), kwargs


def _skip_if_installed(case: Case) -> None:
    if case.needs_missing and HAS[case.needs_missing]:
        pytest.skip(f"{case.needs_missing} is installed: the missing-package line cannot appear")


def _check(case: Case, code: int, stderr: str, cwd: Path) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == case.code, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    assert lines and lines[-1].startswith("error: "), stderr[-2000:]
    assert case.line in lines[-1], f"{case.line!r} not in {lines[-1]!r}"
    warnings = [line for line in lines if line.startswith("warning: ")]
    if case.warning is None:
        assert not warnings, warnings
    else:
        assert len(warnings) == 1 and case.warning in warnings[0], lines
    # nothing written where the command ran: no folder named after a scheme, and no other file either
    assert sorted(p.name for p in cwd.iterdir()) == [], sorted(p.name for p in cwd.iterdir())


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_path_flag(case, tmp_path, monkeypatch, capsys):
    """The entry point's command line (parsing included), in this process."""
    _skip_if_installed(case)
    fn, kwargs = _entry(case.script)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(fn, args=case.args, **kwargs)
    _check(case, exit_info.value.code, capsys.readouterr().err, tmp_path)


SUBPROCESS = [c for c in CASES if c.subprocess]


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """The subprocess cases, started together (each imports torch: in parallel they take the time of one)."""
    env = {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1"}
    started = {}
    for case in SUBPROCESS:
        if case.needs_missing and HAS[case.needs_missing]:
            continue
        cwd = tmp_path_factory.mktemp(case.id)
        started[case.id] = (cwd, subprocess.Popen([sys.executable, str(ROOT / case.script), *case.args], cwd=cwd,
                                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = {}
    for name, (cwd, proc) in started.items():
        _, err = proc.communicate(timeout=300)
        done[name] = (proc.returncode, err, cwd)
    return done


@pytest.mark.parametrize("case", SUBPROCESS, ids=[c.id for c in SUBPROCESS])
def test_path_flag_subprocess(case, processes):
    """The same refusal from a real `python SCRIPT ...` command, in an empty working directory."""
    _skip_if_installed(case)
    code, err, cwd = processes[case.id]
    _check(case, code, err, cwd)


def test_file_url_to_a_local_flag_is_its_path(tmp_path, monkeypatch, capsys):
    """A file:// URL given to a local-only flag is the local path it names (not a folder "file:")."""
    fn, kwargs = _entry("scripts/convert_hf_checkpoint.py")
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "elsewhere" / "ckpt"
    with pytest.raises(SystemExit) as exit_info:
        run_cli(fn, args=["--checkpoint_dir", f"file://{missing}"], **kwargs)
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" not in err
    assert str(missing) in err.splitlines()[-1] and "file:" not in err.splitlines()[-1], err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
