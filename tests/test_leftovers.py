"""Nothing left behind: a merge killed mid-write leaves no weights file that looks complete, and the next merge into
the same folder removes the staging folder it left before it loads anything; a run with a bucket `--out_dir` removes
its local log mirror (`lit-gpt-logs-*` in the system's temporary folder) when it ends; every file a recipe writes
has the umask's permissions (safetensors creates its files owner-only, 0600)."""

import gc
import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from child_env import python_path
from test_merge_lora import lora_checkpoint

ROOT = Path(__file__).resolve().parents[1]


class Killed(BaseException):
    """What a kill leaves: the process stops where it is (not an Exception: nothing may catch it)."""


def merge_script():
    spec = importlib.util.spec_from_file_location("merge_lora_script", ROOT / "scripts" / "merge_lora.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dead_pid() -> int:
    """The id of a process that has ended (what a killed merge's staging folder is named after)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def lora_files(tmp_path):
    _, base_dir, lora_path = lora_checkpoint(tmp_path, "pythia-70m", lora_r=2, lora_alpha=4, lora_mlp=True)
    return base_dir, lora_path


# ---------------------------------------------------------------------------------------------------------------
# merge_lora.py killed mid-write
# ---------------------------------------------------------------------------------------------------------------
def test_the_next_merge_removes_a_killed_merge_s_staging_folder_before_it_loads_anything(lora_files, tmp_path,
                                                                                          monkeypatch):
    base_dir, lora_path = lora_files
    out = tmp_path / "merged"
    stale = out / f".lit_model.tmp{dead_pid()}"  # what save_weights stages in; a SIGKILL leaves it
    stale.mkdir(parents=True)
    (stale / "lit_model.safetensors").write_bytes(b"\0" * 4096)
    script = merge_script()
    merge = script.merge_lora_checkpoint
    seen = {}

    def merge_and_look(*args, **kwargs):
        seen["stale at load"] = stale.exists()  # loading the model takes minutes for a large one
        return merge(*args, **kwargs)

    monkeypatch.setattr(script, "merge_lora_checkpoint", merge_and_look)
    script.setup(checkpoint_dir=base_dir, lora_path=lora_path, out_dir=out)
    assert seen == {"stale at load": False}
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert (out / "lit_model.safetensors").is_file()


def test_a_merge_killed_before_its_weights_are_complete_leaves_no_weights_file(lora_files, tmp_path, monkeypatch):
    """The config and tokenizer files go first, the weights last (staged, moved in when complete): a merge stopped
    while writing the side files leaves no `lit_model.safetensors`, and a failed merge removes what it wrote."""
    import lit_gpt.lora

    base_dir, lora_path = lora_files
    out = tmp_path / "merged"

    def killed(src, dst):
        raise Killed

    monkeypatch.setattr(lit_gpt.lora, "copy_file_atomic", killed)
    with pytest.raises(Killed):
        merge_script().setup(checkpoint_dir=base_dir, lora_path=lora_path, out_dir=out)
    assert not out.exists()  # nothing that looks complete, and no empty folder either

    # into a folder that holds other files (the default: the LoRA file's own folder): those stay as they were
    before = {p.name: p.read_bytes() for p in lora_path.parent.iterdir()}
    with pytest.raises(Killed):
        merge_script().setup(checkpoint_dir=base_dir, lora_path=lora_path)
    assert {p.name: p.read_bytes() for p in lora_path.parent.iterdir()} == before


# ---------------------------------------------------------------------------------------------------------------
# the log mirror of a bucket out_dir
# ---------------------------------------------------------------------------------------------------------------
def test_the_log_mirror_of_a_bucket_run_is_removed_when_the_run_ends(tmp_path):
    from lit_gpt.recipes.finetune import make_logger

    logger = make_logger("memory://lit-gpt-leftovers/run", "csv")  # what setup_fabric gives Fabric
    logger.log_metrics({"loss": 1.0}, step=1)
    logger.save()
    mirror = logger._lit_mirror
    local = mirror.local
    mirror.push()
    assert local.name.startswith("lit-gpt-logs-") and any(local.rglob("metrics.csv"))
    assert mirror.remote.fs.exists((mirror.remote / "csv").path)  # the logs are in the bucket
    del logger, mirror
    gc.collect()
    assert not local.exists()

    # a process that ends (here: without dropping the mirror) removes it too. lit_gpt.storage alone, without the
    # package's __init__ (which imports torch: seconds of start-up for a test of a folder)
    code = ("import sys, types\n"
            f"package = types.ModuleType('lit_gpt'); package.__path__ = [{str(ROOT / 'lit_gpt')!r}]\n"
            "sys.modules['lit_gpt'] = package\n"
            "from lit_gpt.storage import log_folder\n"
            "local, mirror = log_folder('memory://lit-gpt-leftovers/run2')\n"
            "(local / 'x.csv').write_text('1')\n"
            "print(local)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": python_path()})
    assert proc.returncode == 0, proc.stderr
    left = Path(proc.stdout.strip())
    assert left.name.startswith("lit-gpt-logs-") and not left.exists()


# ---------------------------------------------------------------------------------------------------------------
# permissions
# ---------------------------------------------------------------------------------------------------------------
def modes(folder: Path):
    return {str(p.relative_to(folder)): oct(stat.S_IMODE(p.stat().st_mode)) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_every_file_a_recipe_writes_has_the_umask_s_permissions(lora_files, tmp_path, umask):
    """The merged folder (safetensors weights, config and tokenizer files through atomic writes), a finetuning
    run's final export (a sharded one too) and a prepared data folder: one mode, 0o666 less the umask."""
    from lit_gpt.export import export_weights
    from lit_gpt.utils import write_text_atomic
    from lit_gpt.weights import save_weights

    base_dir, lora_path = lora_files
    old = os.umask(umask)
    try:
        merge_script().setup(checkpoint_dir=base_dir, lora_path=lora_path, out_dir=tmp_path / "merged")
        state = {"a.weight": torch.randn(64, 64), "b.weight": torch.randn(64, 64)}
        export_weights(state, tmp_path / "final", "full", None,
                       lambda folder: write_text_atomic(Path(folder) / "finetune.json", "{}\n"))
        save_weights(state, tmp_path / "sharded", max_shard_size=20_000)
    finally:
        os.umask(old)
    expected = oct(0o666 & ~umask)
    for folder in ("merged", "final", "sharded"):
        found = modes(tmp_path / folder)
        assert "lit_model.safetensors" in found or "lit_model.safetensors.index.json" in found, found
        assert set(found.values()) == {expected}, (folder, found)
    from lit_gpt.state import file_mode  # what the writers that create owner-only files are given

    old = os.umask(umask)
    try:
        assert file_mode() == 0o666 & ~umask
    finally:
        os.umask(old)
