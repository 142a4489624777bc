"""lit_gpt.xla.diagnostics pieces that need no XLA runtime."""

import sys

import pytest

from lit_gpt.xla.diagnostics import AnonMemorySampler

NEEDS_XLA = False  # plain Python: runs without torch_xla


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RssAnon is read from /proc (Linux)")
def test_memory_sampler_sees_a_peak_while_this_thread_holds_the_gil():
    """384 MiB made and freed inside one C call that never releases the GIL (as torch_xla's host-to-device transfer
    calls copy their shards): a sampling thread in this process could not run until it was gone. The call lasts
    about a second, so that a helper process starved of CPU by the rest of the suite still gets to sample it."""
    size = 128 << 20
    with AnonMemorySampler(interval=0.001) as mem:
        # a 128 MiB input and the 256 MiB result that bytes.replace fills: both exist only inside the call (once it
        # returns, the input is freed), so a peak above the result alone was seen while the GIL was held
        assert len((b"x" * size).replace(b"x", b"yy")) == 2 * size
    assert mem.peak - mem.start >= 2.5 * size, (mem.start, mem.peak)
    assert mem.end - mem.start < size  # and it was freed: the peak is not what stayed
