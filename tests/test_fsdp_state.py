"""The FSDP paths of the CPU/CUDA recipes, which run on GPUs only in the recipes (Fabric has no FSDP on the CPU):
the final export gathers the full state dict (`lit_gpt.runtime.full_state_dict`) and the base weights load into the
sharded model (`lit_gpt.recipes.finetune._load_into_sharded`), both through torch's public
`torch.distributed.checkpoint.state_dict` API. Here torch's FSDP wraps the tiny model per block on the CPU (one gloo
process), inside a stand-in for Fabric's wrapper, in a subprocess (a process group would outlive the test)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from tiny import random_model, tiny_llama_config
from lit_gpt.model import Block
from lit_gpt.recipes.finetune import _load_into_sharded
from lit_gpt.runtime import full_state_dict

model = random_model(tiny_llama_config(tie_embeddings=False))
reference = {k: v.clone() for k, v in model.state_dict().items()}
fsdp = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"), use_orig_params=True)

class FabricModule(torch.nn.Module):  # what Fabric's _FabricModule exposes: the FSDP root, and `.module` = the model
    def __init__(self, forward_module, original):
        super().__init__()
        self._forward_module = forward_module
        self._original = [original]

    @property
    def module(self):
        return self._original[0]

wrapped = FabricModule(fsdp, model)
state = full_state_dict(wrapped)
assert sorted(state) == sorted(reference), sorted(set(state) ^ set(reference))
assert all(torch.equal(state[k], reference[k]) for k in reference)
changed = {k: v + 1 for k, v in reference.items()}
_load_into_sharded(wrapped, changed, strict=True)
again = full_state_dict(wrapped)
assert all(torch.equal(again[k], changed[k]) for k in changed)
print("ok")
dist.destroy_process_group()
"""


def test_fsdp_full_state_dict_and_sharded_load_round_trip(tmp_path):
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # tests/ on PYTHONPATH: the script imports the tests' tiny-model helper (tests/tiny.py)
    path = [str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(port)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
