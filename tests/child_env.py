"""The environment of the child processes that tests start to run the repository's scripts."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Sequence

ROOT = Path(__file__).resolve().parents[1]


def python_path() -> str:
    """PYTHONPATH for a child process that runs the repository's scripts: the repository first, then whatever the
    parent had (packages installed with `pip install --target` and carried on PYTHONPATH stay importable)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def child_result(script: str, args: Sequence[str], env: Dict[str, str], timeout: float = 900) -> Any:
    """Run `python -c script *args` in the repository (e.g. on XLA, with `env`) and return the JSON of the last line
    it printed as `RESULT <json>`; asserts that it exited 0 and printed one (its output's tail in the message)."""
    proc = subprocess.run([sys.executable, "-c", script, *args], env={**env, "PYTHONPATH": python_path()},
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])
