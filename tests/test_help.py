"""Every recipe's and script's `--help` shows its docstring and a help text for every argument.

All scripts are checked in one child process (importing a recipe is cheap once torch and Lightning are loaded, and
the XLA recipes stay out of the test process): for each script the child runs it as `python SCRIPT --help` would
(`runpy`, `sys.argv = [SCRIPT, "--help"]`, stdout captured, SystemExit expected), and also takes the parser it builds
(`jsonargparse.capture_parser`) to read each argument's own help, which the formatted text mixes with the type and
default.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT_GLOBS = ("finetune/*.py", "generate/*.py", "chat/base.py", "eval/*.py", "serve/*.py", "xla/finetune/*.py", "xla/generate/*.py",
                "scripts/*.py", "xla/scripts/*.py")
SCRIPTS = sorted({str(p.relative_to(ROOT)) for pattern in SCRIPT_GLOBS for p in ROOT.glob(pattern)})
# the actions jsonargparse adds by itself; their help is jsonargparse's own
BUILTIN = {"--help", "--config", "--print_config"}

CHILD = r"""
import contextlib, io, json, runpy, sys, traceback
import jsonargparse

def arguments(parser):
    for action in parser._actions:
        names = [o for o in action.option_strings if o.startswith("--")]
        if not names or names[0] in BUILTIN:
            continue
        # `--data` / `--train` group config loaders: their help is jsonargparse's "Path to a configuration file."
        if type(action).__name__ == "_ActionConfigLoad":
            continue
        yield names[0], (action.help or "").strip()

BUILTIN = set(json.loads(sys.argv[1]))
report = {}
for script in json.loads(sys.argv[2]):
    entry = report[script] = {}
    out = io.StringIO()
    sys.argv = [script, "--help"]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
        entry["exit"] = "returned without exiting"
    except SystemExit as e:
        entry["exit"] = e.code
    except BaseException:
        entry["exit"] = traceback.format_exc()
    entry["help"] = out.getvalue()
    sys.argv = [script]
    try:
        parser = jsonargparse.capture_parser(lambda: runpy.run_path(script, run_name="__main__"))
        entry["description"] = (parser.description or "").strip()
        entry["arguments"] = dict(arguments(parser))
    except BaseException:
        entry["parser_error"] = traceback.format_exc()
print("JSON" + json.dumps(report))
"""


@pytest.fixture(scope="module")
def report():
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(sorted(BUILTIN)), json.dumps(SCRIPTS)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PJRT_DEVICE": "CPU"},
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("JSON")), None)
    assert line is not None, f"the --help child failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(line[4:])


def test_there_are_scripts():
    assert len(SCRIPTS) >= 25, SCRIPTS
    for expected in ("finetune/lora.py", "generate/base.py", "chat/base.py", "xla/finetune/full.py",
                     "xla/generate/base.py", "scripts/download.py", "xla/scripts/consolidate_checkpoint.py"):
        assert expected in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_shows_docstring_and_every_argument(script: str, report):
    entry = report[script]
    assert entry["exit"] == 0, f"`python {script} --help` did not exit 0: {entry['exit']}"
    assert "parser_error" not in entry, entry.get("parser_error")
    help_text = " ".join(entry["help"].split())  # the formatter wraps lines
    description = " ".join(entry["description"].split())
    assert description, f"{script}: its entry point has no docstring (--help shows no description)"
    assert description in help_text, f"{script}: --help does not show the docstring {description!r}"
    assert entry["arguments"], f"{script}: no arguments found"
    missing = sorted(name for name, text in entry["arguments"].items() if not text)
    assert not missing, f"{script}: --help shows no help text for {', '.join(missing)}"
    for name, text in entry["arguments"].items():
        assert name in entry["help"], f"{script}: {name} is not in --help"
        words = " ".join(text.split())[:40]
        assert words in help_text, f"{script}: the help of {name} ({words!r}) is not in --help"
