"""A bit flip inside a sharded XLA checkpoint is found, not loaded: the CRC32s recorded at save time are checked by
`load_sharded` (on the devices) and by the consolidators, each failing with one line that names the file; and the
consolidated safetensors file is whole: an independent reader (safetensors' own) reads every tensor bit for bit.

The save and the damaged load run in one XLA:CPU worker with 8 devices under SPMD (this file run as a script);
the consolidation checks run here in plain torch, as on a machine without torch_xla.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 python tests/xla/test_checkpoint_integrity.py OUT
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fork_server import popen

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# an 8-device save, then loads of it: 8-device runs are in the slow suite (tests/README.md); the default suite checks
# the CRC32C manifests in tests/test_checksums.py and tests/test_faults.py
pytestmark = pytest.mark.slow
CONSOLIDATE = REPO / "xla" / "scripts" / "consolidate_checkpoint.py"


def flip_one_bit(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x04
    path.write_bytes(bytes(data))


def worker(out: Path) -> None:
    import worker as w  # tests/xla/worker.py (this file runs as a script: its folder is on sys.path)

    import lit_gpt.xla as lx
    from lit_gpt.utils import LitError

    result = {}
    fabric = lx.make_fabric()
    fabric.launch()
    model, optimizer = w.setup_tiny(fabric, out)
    w.train_step(fabric, model, optimizer, 0)
    ckpt = out / "ckpt" / "step-000001"
    fabric.save(ckpt, {"model": model, "optimizer": optimizer, "step": 1})
    torch.save(w.cpu_state(model, optimizer), out / "reference.pt")
    result["devices"] = lx.get_strategy(fabric).num_devices

    bad = out / "bad" / "step-000001"
    shutil.copytree(ckpt, bad)
    flip_one_bit(bad / "__0_0.distcp")
    fresh, fresh_opt = w.setup_tiny(fabric, out)
    try:
        fabric.load(bad, {"model": fresh, "optimizer": fresh_opt, "step": 0})
        result["damaged_load"] = "loaded"
    except LitError as e:
        result["damaged_load"] = str(e)
    state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
    fabric.load(ckpt, state)  # the intact checkpoint still loads
    result["clean_step"] = state["step"]
    (out / "integrity.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, xla_env, xla_forks):
    out = tmp_path_factory.mktemp("integrity")
    log = out / "worker.log"
    with open(log, "w") as f:
        # a process of its own, forked from the XLA fork server (tests/conftest.py `xla_forks`: the imports done)
        proc = popen(xla_forks, [__file__, str(out)], REPO, xla_env(8), stdout=f, stderr=f)
        proc.wait(timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"worker failed (exit {proc.returncode}):\n{log.read_text()[-6000:]}")
    return out, json.loads((out / "integrity.json").read_text())


def test_load_on_8_devices_refuses_a_flipped_bit_naming_the_file(saved):
    out, result = saved
    assert result["devices"] == 8
    message = result["damaged_load"]
    assert message.startswith("sharded checkpoint file ") and "bad/step-000001/__0_0.distcp' is damaged" in message
    assert "CRC32" in message and "\n" not in message
    assert result["clean_step"] == 1


def test_consolidation_refuses_a_flipped_bit_and_writes_a_whole_safetensors_file(saved, tmp_path):
    from safetensors import safe_open

    from lit_gpt.utils import LitError
    from lit_gpt.xla.consolidation import consolidate, iter_consolidated

    out, _ = saved
    ckpt = out / "ckpt" / "step-000001"
    reference = torch.load(out / "reference.pt", weights_only=True)["model"]
    output = consolidate(ckpt, tmp_path / "final", progress=False)
    assert output == tmp_path / "final" / "lit_model.safetensors"
    with safe_open(str(output), framework="pt") as f:  # header, offsets and sizes consistent: every tensor reads
        state = {name: f.get_tensor(name) for name in f.keys()}
    assert all(torch.equal(state[name], t) for name, t in reference.items())

    for damaged_file, at in (("__0_0.distcp", 0.5), ("__0_0.distcp", 0.99), (".metadata", 0.5)):
        bad = tmp_path / f"bad-{damaged_file}-{at}"
        shutil.copytree(ckpt, bad)
        flip_one_bit(bad / damaged_file, at)
        name = str(bad / damaged_file)
        with pytest.raises(LitError, match=rf"sharded checkpoint file '{name}' is damaged \(CRC32"):
            consolidate(bad, tmp_path / "never", progress=False)
        with pytest.raises(LitError, match=rf"sharded checkpoint file '{name}' is damaged \(CRC32"):
            next(iter_consolidated(bad))
        proc = subprocess.run([sys.executable, str(CONSOLIDATE), "--checkpoint_dir", str(bad), "--output_dir",
                               str(tmp_path / "never")], capture_output=True, text=True, timeout=300, cwd=REPO)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert lines[-1].startswith("error: ") and name in lines[-1] and "damaged" in lines[-1], proc.stderr
        assert not (tmp_path / "never").exists()


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
