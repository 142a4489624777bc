"""Runs several XLA recipe commands in one process (tests/xla/test_xla_families.py): the XLA runtime starts once and
each run pays only for its own compilations. Each job is a recipe (`xla/finetune/<method>.py` or
`xla/generate/base.py`) called through jsonargparse like its command line, its stdout kept in <name>.out and its
stderr in <name>.log beside OUT.json; a job that fails is recorded and the next one runs.

    python tests/xla/families_worker.py JOBS.json OUT.json

JOBS.json: [{"name": ..., "script": "xla/finetune/lora.py", "args": [...], "copy_checkpoint": [from, to]}, ...]
(`copy_checkpoint`: before the job, copy step folder `from` to `to`, e.g. a run "stopped" after that step's
checkpoint). OUT.json: {name: {"ok": bool, "seconds": float, "error": traceback or None}}.
"""

import contextlib
import importlib.util
import json
import shutil
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# its jobs import the test helpers (tests/words.py) as pytest would: the launcher (tests/xla/test_xla_families.py)
# puts tests/ on PYTHONPATH


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    from jsonargparse import CLI

    modules = {}
    results = {}
    for job in jobs:
        script = job["script"]
        if script not in modules:
            spec = importlib.util.spec_from_file_location(f"recipe_{len(modules)}", REPO / script)
            modules[script] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(modules[script])
        t0 = time.time()
        error = None
        with open(out.parent / f"{job['name']}.out", "w") as stdout, \
                open(out.parent / f"{job['name']}.log", "w") as log, \
                contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(log):
            try:
                if job.get("copy_checkpoint"):
                    src, dst = job["copy_checkpoint"]
                    shutil.copytree(src, dst)
                CLI(modules[script].setup, args=job["args"])
            except BaseException:  # SystemExit from a refused argument included
                error = traceback.format_exc()
                print(error, file=sys.stderr)
        results[job["name"]] = {"ok": error is None, "seconds": time.time() - t0, "error": error}
        out.write_text(json.dumps(results))  # after each job: a test can read what is done


if __name__ == "__main__":
    main()
