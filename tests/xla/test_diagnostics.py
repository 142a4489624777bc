"""lit_gpt.xla.diagnostics pieces that need no XLA runtime."""

import sys

import pytest

from lit_gpt.xla.diagnostics import AnonMemorySampler

NEEDS_XLA = False  # plain Python: runs without torch_xla


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RssAnon is read from /proc (Linux)")
def test_memory_sampler_sees_a_peak_while_this_thread_holds_the_gil():
    """256 MiB made and freed inside one C call that never releases the GIL (as torch_xla's host-to-device transfer
    calls copy their shards): a sampling thread in this process could not run until it was gone."""
    size = 256 << 20
    with AnonMemorySampler(interval=0.001) as mem:
        assert len(b"x" * size) == size
    assert mem.peak - mem.start >= 0.9 * size, (mem.start, mem.peak)
    assert mem.end - mem.start < 0.5 * size  # and it was freed: the peak is not what stayed
