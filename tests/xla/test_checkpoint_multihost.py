"""Checkpoint files of a two-host run, with two CPU processes over gloo standing in for two hosts (DTensor shards
play the part of each host's XLA shards; the file layout, atomic rename and consolidation are the same code).

Both layouts: a directory both hosts share, and per-host local disks (each host keeps its own shards and a copy of
the marker and index), where each host resumes from its own disk, all hosts agree on the step to resume from, and
consolidation names the missing host until its files are copied over."""

import shutil
import socket

import pytest
import torch
import torch.multiprocessing as mp

from lit_gpt.utils import LitError
from lit_gpt.weights import load_weights
from lit_gpt.xla.checkpoint import latest_checkpoint, read_marker, verify_files
from lit_gpt.xla.consolidation import consolidate

NEEDS_XLA = False  # plain torch: runs without torch_xla
# two hosts emulated by two processes each: multi-process runs are in the slow suite (tests/README.md)
pytestmark = pytest.mark.slow
WEIGHT = torch.arange(48, dtype=torch.float32).reshape(8, 6) / 10
BIAS = torch.arange(8, dtype=torch.float32)


def _read_whole(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharded_linear(mesh, weight, bias):
    from torch.distributed.tensor import Shard, distribute_tensor

    module = torch.nn.Linear(6, 8)
    module.weight = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
    module.bias = torch.nn.Parameter(distribute_tensor(bias, mesh, [Shard(0)]))
    return module


def _host(rank: int, port: int, shared: str, local: str, errors) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lit_gpt.xla.checkpoint import load_sharded, read_values, save_sharded

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        module = _sharded_linear(mesh, WEIGHT, BIAS)
        save_sharded(f"{shared}/step-000001", {"model": module, "step": 1})
        # per-host local disks: the same checkpoint name, but each host writes under its own directory
        save_sharded(f"{local}{rank}/step-000002", {"model": module, "step": 2})
        fresh = _sharded_linear(mesh, torch.zeros(8, 6), torch.zeros(8))
        state = {"model": fresh, "step": 0}
        load_sharded(f"{shared}/step-000001", state)
        assert state["step"] == 1
        assert torch.equal(fresh.weight.full_tensor(), WEIGHT) and torch.equal(fresh.bias.full_tensor(), BIAS)
        # per-host local disks: each host loads from its own directory (its own shards, the marker and index)
        fresh = _sharded_linear(mesh, torch.zeros(8, 6), torch.zeros(8))
        state = {"model": fresh, "step": 0}
        load_sharded(f"{local}{rank}/step-000002", state)
        assert state["step"] == 2
        assert read_values(f"{local}{rank}/step-000002") == {"step": 2}  # from this host's own shard file
        assert torch.equal(fresh.weight.full_tensor(), WEIGHT) and torch.equal(fresh.bias.full_tensor(), BIAS)
        # a bucket both hosts see, through fsspec (file:// takes the same path as gs://): shards written in place,
        # the marker last; both hosts agree on it and load it
        from lit_gpt.xla.checkpoint import agreed_latest_checkpoint

        bucket = f"file://{shared}-bucket"
        save_sharded(f"{bucket}/step-000003", {"model": module, "step": 3})
        assert str(agreed_latest_checkpoint(bucket, "step-*")) == f"{bucket}/step-000003"
        fresh = _sharded_linear(mesh, torch.zeros(8, 6), torch.zeros(8))
        state = {"model": fresh, "step": 0}
        load_sharded(f"{bucket}/step-000003", state)
        assert state["step"] == 3
        assert torch.equal(fresh.weight.full_tensor(), WEIGHT) and torch.equal(fresh.bias.full_tensor(), BIAS)
        dist.destroy_process_group()
    except BaseException as e:  # reported to the test, which runs in another process
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


def test_two_host_checkpoint_layouts(tmp_path):
    shared, local = tmp_path / "shared", tmp_path / "host"
    errors = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_host, args=(_free_port(), str(shared), str(local), errors), nprocs=2, start_method="spawn")
    assert errors.empty(), errors.get()

    # shared directory: one complete checkpoint holding both hosts' shards
    ckpt = shared / "step-000001"
    assert latest_checkpoint(shared) == ckpt
    assert read_marker(ckpt)["files"] == {"0": ["__0_0.distcp"], "1": ["__1_0.distcp"]}
    assert not list(shared.glob(".*"))  # no temporary directory left behind
    output = consolidate(ckpt, tmp_path / "shared", progress=False)
    assert output == tmp_path / "shared" / "lit_model.safetensors"
    state = _read_whole(output)  # safetensors' own reader: the file is whole
    assert torch.equal(state["weight"], WEIGHT) and torch.equal(state["bias"], BIAS)

    # local disks: host 0's directory lacks host 1's shards until they are copied over
    host0, host1 = local.with_name("host0") / "step-000002", local.with_name("host1") / "step-000002"
    # host 1 keeps its own shards with copies of the marker and index: a checkpoint for host 1 only
    assert sorted(p.name for p in host1.iterdir()) == [".metadata", "__1_0.distcp", "lit_checkpoint.json"]
    assert read_marker(host1) == read_marker(host0)
    assert latest_checkpoint(host1.parent) is None
    verify_files(host1, ["__1_0.distcp", ".metadata"])  # its checksums were recorded by host 1 itself
    with pytest.raises(LitError, match=r"missing the files of host/rank 1: __1_0\.distcp"):
        consolidate(host0, tmp_path / "local")
    shutil.copy(host1 / "__1_0.distcp", host0)
    state = load_weights(consolidate(host0, tmp_path / "local", progress=False))
    assert torch.equal(state["weight"], WEIGHT) and torch.equal(state["bias"], BIAS)

    # the bucket: one checkpoint with both hosts' shards and no temporary names; consolidated from and into it
    bucket = tmp_path / "shared-bucket"
    assert sorted(p.name for p in (bucket / "step-000003").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "lit_checkpoint.json"]
    assert not [p for p in bucket.iterdir() if p.name.startswith(".")]
    assert str(latest_checkpoint(f"file://{bucket}")) == f"file://{bucket}/step-000003"
    verify_files(f"file://{bucket}/step-000003")  # every host's checksums, of what the bucket holds
    output = consolidate(f"file://{bucket}/step-000003", f"file://{bucket}/final", progress=False)
    assert str(output) == f"file://{bucket}/final/lit_model.safetensors"
    assert sorted(p.name for p in (bucket / "final").iterdir()) == ["lit_model.safetensors"]  # nothing staged there
    state = _read_whole(bucket / "final" / "lit_model.safetensors")
    assert torch.equal(state["weight"], WEIGHT) and torch.equal(state["bias"], BIAS)


def _agreeing_host(rank: int, port: int, root: str, results) -> None:
    """Each host saves steps 1-3 to its own disk; then disks lose files in three ways and each host records
    what `agreed_latest_checkpoint` and `load_sharded` answered."""
    import os
    import shutil
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lit_gpt.xla.checkpoint import agreed_latest_checkpoint, load_sharded, save_sharded

    def attempt(fn):
        try:
            out = fn()
            return ("ok", None if out is None else Path(out).name)
        except LitError as e:
            return ("error", str(e))

    answers = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        module = _sharded_linear(mesh, WEIGHT, BIAS)
        out = Path(root) / f"host{rank}"
        answers["empty"] = attempt(lambda: agreed_latest_checkpoint(out, "step-*"))
        for step in (1, 2, 3):
            save_sharded(out / f"step-{step:06d}", {"model": module, "step": step})
        answers["all"] = attempt(lambda: agreed_latest_checkpoint(out, "step-*"))
        dist.barrier()
        # a save killed after host 0 renamed step 3 but before host 1 did: host 1 still has it under the temp name
        if rank == 1:
            os.rename(out / "step-000003", out / ".step-000003.tmp-killed")
        dist.barrier()
        answers["fallback"] = attempt(lambda: agreed_latest_checkpoint(out, "step-*"))
        # a flipped bit in host 1's shard of the agreed step: both hosts refuse to load (neither waits forever)
        if rank == 1:
            shard = out / "step-000002" / "__1_0.distcp"
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0x10
            shard.write_bytes(bytes(data))
        dist.barrier()
        fresh = _sharded_linear(mesh, torch.zeros(8, 6), torch.zeros(8))
        answers["corrupt_load"] = attempt(lambda: load_sharded(out / "step-000002", {"model": fresh, "step": 0}))
        dist.barrier()
        # host 1's disk lost every checkpoint: no step is held by all, and starting over is not silent
        if rank == 1:
            for d in out.glob("step-*"):
                shutil.rmtree(d)
        dist.barrier()
        answers["none_common"] = attempt(lambda: agreed_latest_checkpoint(out, "step-*"))
        dist.destroy_process_group()
    except BaseException as e:  # reported to the test, which runs in another process
        answers["crash"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        results.put((rank, answers))


def test_hosts_with_local_disks_agree_on_the_checkpoint_to_resume(tmp_path, capfd):
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_agreeing_host, args=(_free_port(), str(tmp_path), results), nprocs=2, start_method="spawn")
    answers = dict(results.get() for _ in range(2))
    assert "crash" not in answers[0] and "crash" not in answers[1], answers
    for key in ("empty", "all", "fallback", "corrupt_load", "none_common"):
        assert answers[0][key] == answers[1][key], (key, answers)  # every host got the same answer
    a = answers[0]
    assert a["empty"] == ("ok", None)
    assert a["all"] == ("ok", "step-000003")
    assert a["fallback"] == ("ok", "step-000002")
    err = capfd.readouterr().err
    assert "warning: resuming from step-000002, the newest checkpoint every host holds: step-000003 is missing on" \
           " host 1 (no such directory)" in err
    kind, message = a["corrupt_load"]
    assert kind == "error" and message.startswith("host 1: sharded checkpoint file")
    assert "host1/step-000002/__1_0.distcp' is damaged (CRC32" in message and "\n" not in message
    kind, message = a["none_common"]
    assert kind == "error" and "no checkpoint in" in message and "is held by every host" in message
    assert "the newest, step-000003, is missing on host 1 (no such directory)" in message and "new --out_dir" in message


def _replicated_host(rank: int, port: int, root: str, results) -> None:
    """A replicated (unsharded) tensor is written once, into one host's file: on per-host local disks the other
    host does not hold it, so no checkpoint is complete everywhere until that file is copied over."""
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lit_gpt.xla.checkpoint import agreed_latest_checkpoint, save_sharded

    answer = None
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        module = torch.nn.Linear(6, 8)
        module.weight = torch.nn.Parameter(distribute_tensor(WEIGHT, mesh, [Shard(0)]))
        module.bias = torch.nn.Parameter(distribute_tensor(BIAS, mesh, [Replicate()]))
        out = Path(root) / f"host{rank}"
        save_sharded(out / "step-000001", {"model": module, "step": 1})
        try:
            answer = ("ok", str(agreed_latest_checkpoint(out, "step-*")))
        except LitError as e:
            answer = ("error", str(e))
        dist.destroy_process_group()
    finally:
        results.put((rank, answer))


def test_a_host_without_the_replicated_tensors_file_does_not_hold_the_checkpoint(tmp_path):
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_replicated_host, args=(_free_port(), str(tmp_path), results), nprocs=2, start_method="spawn")
    answers = dict(results.get() for _ in range(2))
    assert answers[0] == answers[1] and answers[0][0] == "error", answers
    marker = read_marker(tmp_path / "host0" / "step-000001")
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(tmp_path / "host0" / "step-000001")).read_metadata()
    bias_file = next(info.relative_path for index, info in md.storage_data.items() if index.fqn == "model.bias")
    lacking = 1 - int(bias_file[2])  # the host that did not write the bias
    assert f"missing on host {lacking} (missing {bias_file})" in answers[0][1], answers
    assert marker["files"][str(1 - lacking)] == [bias_file]
