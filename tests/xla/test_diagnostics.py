"""bench/instruments.py pieces that need no XLA runtime (the XLA tests' worker and bench/load.py use them)."""

import json
import os
import subprocess
import sys

import pytest

from child_env import python_path

NEEDS_XLA = False  # plain Python: runs without torch_xla

# 384 MiB made and freed inside one C call that never releases the GIL, as torch_xla's host-to-device transfer calls
# copy their shards: a 128 MiB input and the 256 MiB result that bytes.replace fills exist together only inside the
# call (once it returns, the input is freed). The call lasts about a second, so that a helper process starved of CPU
# by the rest of the suite still gets to sample it. It runs in a fresh process: in one whose allocator already holds
# freed memory (the suite's own, after hundreds of tests), the bytes would reuse that and RssAnon would not move.
GIL_HELD_PEAK = """
import json
from bench.instruments import AnonMemorySampler
size = 128 << 20
with AnonMemorySampler(interval=0.001) as mem:
    assert len((b"x" * size).replace(b"x", b"yy")) == 2 * size
print(json.dumps({"size": size, "start": mem.start, "peak": mem.peak, "end": mem.end}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RssAnon is read from /proc (Linux)")
def test_memory_sampler_sees_a_peak_while_this_thread_holds_the_gil():
    proc = subprocess.run([sys.executable, "-c", GIL_HELD_PEAK], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": python_path()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    # more than the 256 MiB result alone: seen while the GIL was held (a sampling thread never sees it)
    assert r["peak"] - r["start"] >= 2.5 * r["size"], r
    assert r["end"] - r["start"] < r["size"], r  # and it was freed: the peak is not what stayed
