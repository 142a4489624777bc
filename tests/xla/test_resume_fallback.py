"""--resume auto on sharded (XLA) step checkpoints follows the rule of every step checkpoint: the newest one is
verified (marker, every file's size and CRC32), and when it is incomplete or damaged, one line names it and the step
resumed from instead; an explicit damaged step, and the consolidation of one, are refused in one line naming the
file. Plain torch (the files and their checks are the same code with or without torch_xla); the two-host case runs
two CPU processes over gloo standing in for two hosts with per-host local disks."""

import re
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from lit_gpt.utils import LitError
from lit_gpt.xla.checkpoint import MARKER, agreed_latest_checkpoint, latest_checkpoint, save_sharded
from lit_gpt.xla.consolidation import consolidate
from lit_gpt.xla.integrity import step_problem

NEEDS_XLA = False


def save_steps(out, steps=(2, 4)):
    for step in steps:
        module = torch.nn.Linear(6, 8)
        torch.nn.init.constant_(module.weight, float(step))
        save_sharded(out / f"step-{step:06d}", {"model": module, "step": step},
                     write_files=lambda folder: (folder / "finetune.json").write_text('{"method": "full"}'))
    return out


def shard(step_dir):
    return next(step_dir.glob("__0_*.distcp"))


def truncate(path):
    path.write_bytes(path.read_bytes()[:-5])


def flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def damage_shard_truncated(step):
    truncate(shard(step))


def damage_shard_flipped(step):
    flip(shard(step))


def damage_index(step):
    flip(step / ".metadata")


def damage_run_file(step):
    (step / "finetune.json").write_text('{"method": "lora"}')


def damage_marker_cut(step):
    (step / MARKER).write_bytes((step / MARKER).read_bytes()[:30])


def damage_marker_gone(step):
    (step / MARKER).unlink()


def damage_shard_gone(step):
    shard(step).unlink()


# (damage to step 4, the line's pattern); --resume auto then takes step 2
CASES = [
    (damage_shard_truncated, r"step-000004 is damaged \(sharded checkpoint (?:'.*' has truncated files|file"
                             r" '.*__0_\d+\.distcp' is damaged \(\d+ bytes instead of \d+)"),
    (damage_shard_flipped, r"step-000004 is damaged \(sharded checkpoint file '.*__0_\d+\.distcp' is damaged \(CRC32"),
    (damage_index, r"step-000004 is damaged \(sharded checkpoint file '.*\.metadata' is damaged"),
    (damage_run_file, r"step-000004 is damaged \(sharded checkpoint file '.*finetune\.json' is damaged"),
    (damage_marker_cut, r"step-000004 is incomplete \(lit_checkpoint\.json is unreadable: its save was cut off\)"),
    (damage_marker_gone, r"step-000004 is incomplete \(no lit_checkpoint\.json: its save was interrupted\)"),
    (damage_shard_gone, r"step-000004 is incomplete \(sharded checkpoint '.*' is missing the files of host/rank 0"),
]


@pytest.mark.parametrize("damage, line", CASES, ids=[c[0].__name__ for c in CASES])
@pytest.mark.parametrize("storage", ["local", "file"])
def test_resume_auto_falls_back_past_a_damaged_sharded_step(storage, damage, line, tmp_path, capfd):
    out = save_steps(tmp_path / "run")
    damage(out / "step-000004")
    where = out if storage == "local" else f"file://{out}"
    capfd.readouterr()
    chosen = latest_checkpoint(where, "step-*")
    assert str(chosen).endswith("step-000002")
    warnings = [w for w in capfd.readouterr().err.splitlines() if w.startswith("warning:")]
    assert len(warnings) == 1 and re.search(line, warnings[0]), warnings
    assert warnings[0].endswith("resuming from step-000002, the newest intact step")
    assert agreed_latest_checkpoint(where, "step-*") == chosen  # one host: the same answer
    assert (out / "step-000004").is_dir()  # left as it is for the user to look at or restore


def test_every_step_damaged_is_refused_and_an_explicit_damaged_step_names_its_file(tmp_path):
    out = save_steps(tmp_path / "run")
    flip(shard(out / "step-000004"))
    problem = step_problem(out / "step-000004")
    assert problem.kind == "damaged" and "__0_" in problem.detail and "CRC32" in problem.detail
    assert step_problem(out / "step-000002") is None
    truncate(shard(out / "step-000002"))
    with pytest.raises(LitError, match=r"no intact step checkpoint in .*step-000004 is damaged .*; step-000002 is"
                                       r" damaged .*Restore the damaged files, or start over in a new --out_dir"):
        latest_checkpoint(out, "step-*")
    # consolidation refuses the damaged step and writes nothing
    with pytest.raises(LitError, match=r"__0_\d+\.distcp' is damaged"):
        consolidate(out / "step-000004", tmp_path / "final")
    assert not (tmp_path / "final").exists() or not any((tmp_path / "final").iterdir())


def test_only_an_interrupted_first_save_starts_fresh_with_one_line(tmp_path, capfd):
    out = save_steps(tmp_path / "run", steps=(2,))
    (out / "step-000002" / MARKER).unlink()
    capfd.readouterr()
    assert latest_checkpoint(out, "step-*") is None
    assert capfd.readouterr().err.strip() == (
        "warning: step-000002 is incomplete (no lit_checkpoint.json: its save was interrupted): no complete step to"
        " resume from, starting fresh")


def test_xla_devices_zero_is_refused_without_advising_zero_devices():
    pytest.importorskip("torch_xla")
    from lit_gpt.xla.accelerator import PJRTAccelerator

    with pytest.raises(LitError) as e:
        PJRTAccelerator.parse_devices(0)
    assert "give 'auto' or the number of devices" in str(e.value) and "CPU_NUM_DEVICES=0" not in str(e.value)


# ---------------------------------------------------------------------------------------------------------------
# two hosts with local disks: a flipped bit in host 1's shard of the newest step makes both fall back
# ---------------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _host(rank, port, root, answers):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        out = f"{root}/host{rank}"
        for step in (2, 4):
            module = torch.nn.Linear(6, 8)
            module.weight = torch.nn.Parameter(distribute_tensor(torch.full((8, 6), float(step)), mesh, [Shard(0)]))
            module.bias = torch.nn.Parameter(distribute_tensor(torch.zeros(8), mesh, [Shard(0)]))
            save_sharded(f"{out}/step-{step:06d}", {"model": module, "step": step})
        dist.barrier()
        if rank == 1:
            flip(next(Path(out, "step-000004").glob("__1_*.distcp")))
        dist.barrier()
        answers[rank] = str(agreed_latest_checkpoint(out, "step-*"))
    except BaseException as e:  # reported to the test
        answers[rank] = f"error: {type(e).__name__}: {e}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_two_hosts_fall_back_together_past_a_step_damaged_on_one(tmp_path, capfd):
    manager = mp.Manager()
    answers = manager.dict()
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_host, args=(r, port, str(tmp_path), answers)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        assert p.exitcode == 0
    assert answers[0].endswith("host0/step-000002") and answers[1].endswith("host1/step-000002"), dict(answers)
    err = capfd.readouterr().err
    assert re.search(r"warning: resuming from step-000002, the newest checkpoint every host holds: step-000004 is"
                     r" missing on host 1 \(damaged: __1_\d+\.distcp has CRC32C? \w+, \w+ recorded at save time\)", err), err
    shutil.rmtree(tmp_path, ignore_errors=True)
