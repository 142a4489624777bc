"""The fork servers' contract with torch_xla (tests/fork_server.py `_xla_child_setup`): an XLA command forked from a
server that imported torch_xla redoes, in its new environment, what `import torch_xla` does to the environment at a
fresh process's start. It calls two private functions of torch_xla/__init__.py for that; this test fails when they
are renamed or stop being called at import, so that the XLA tests' processes do not silently run with other flags."""

import importlib.util
import re
from pathlib import Path

import pytest


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="torch_xla is not installed")
def test_torch_xla_sets_its_environment_at_import_with_the_functions_the_fork_server_calls():
    # read, not imported: importing torch_xla costs seconds and the contract is in its source
    source = (Path(importlib.util.find_spec("torch_xla").origin)).read_text()
    for name in ("_setup_default_env", "_setup_xla_flags"):
        assert re.search(rf"^def {name}\(\):", source, re.M), f"torch_xla.{name} is gone: update tests/fork_server.py"
        assert re.search(rf"^{name}\(\)$", source, re.M), f"torch_xla no longer calls {name} at import"
    # what _setup_xla_flags adds when XLA_FLAGS does not set it (the XLA tests' numerics depend on it)
    assert "xla_cpu_enable_fast_math" in source
