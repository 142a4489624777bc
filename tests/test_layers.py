"""The layers of lit_gpt (`.importlinter`), checked with import-linter: recipes -> loops -> core, lit_gpt.xla ->
core, nothing in core imports a loop, a recipe step or lit_gpt.xla, and no import cycles. Also: every module is in
exactly one layer (a new module cannot slip past the contract), the contract does catch a forbidden import, and no
module outgrows what one reader can hold."""

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOOPS = {"lit_gpt.training", "lit_gpt.generate", "lit_gpt.checkpoints"}
# the module sizes the structure issue set (~600 lines); the named configs are data, not code
MAX_LINES = 620
DATA_MODULES = {"lit_gpt/config_registry.py"}


def lint(cwd: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "importlinter.cli"]
    return subprocess.run([*cmd, ".importlinter", "--no-cache"], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"})


def modules(root: Path) -> set:
    out = set()
    for p in (root / "lit_gpt").rglob("*.py"):
        parts = p.relative_to(root).with_suffix("").parts
        out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def core_modules() -> set:
    parser = configparser.ConfigParser()
    parser.read(ROOT / ".importlinter")
    return set(parser["importlinter:contract:core"]["source_modules"].split())


def test_import_contract_is_kept():
    proc = lint(ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout.split("Contracts:")[-1], proc.stdout[-2000:]


def test_every_module_is_in_exactly_one_layer():
    layer_of = {}
    for m in sorted(modules(ROOT) - {"lit_gpt"}):
        layers = [name for name, inside in (
            ("recipes", m == "lit_gpt.recipes" or m.startswith("lit_gpt.recipes.")),
            ("loops", m in LOOPS),
            ("xla", m == "lit_gpt.xla" or m.startswith("lit_gpt.xla.")),
            ("core", m in core_modules()),
        ) if inside]
        layer_of[m] = layers
    missing = sorted(m for m, layers in layer_of.items() if len(layers) != 1)
    assert not missing, f"add these modules to one layer of .importlinter (core: the 'core' contract): {missing}"
    stale = sorted(core_modules() - modules(ROOT))
    assert not stale, f".importlinter names modules that do not exist: {stale}"


def test_the_contract_catches_a_forbidden_import(tmp_path):
    """A copy of the package in which the model imports the training loop: the contract must break."""
    shutil.copytree(ROOT / "lit_gpt", tmp_path / "lit_gpt", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    model = tmp_path / "lit_gpt" / "model.py"
    model.write_text(model.read_text() + "\n\ndef _bad():\n    from lit_gpt.training import fit  # noqa\n")
    proc = lint(tmp_path)
    assert proc.returncode != 0
    assert "lit_gpt.model -> lit_gpt.training" in proc.stdout


@pytest.mark.parametrize("folder", ["lit_gpt", "lit_gpt/xla", "lit_gpt/recipes"])
def test_modules_stay_readable(folder):
    too_long = {}
    for p in sorted((ROOT / folder).glob("*.py")):
        rel = str(p.relative_to(ROOT))
        n = len(p.read_text().splitlines())
        if n > MAX_LINES and rel not in DATA_MODULES:
            too_long[rel] = n
    assert not too_long, f"split these modules (at most ~{MAX_LINES} lines of code each): {too_long}"
