"""The XLA runtime layer on XLA:CPU: FSDP over SPMD on 8 virtual devices, staged loading, sharded checkpoints,
compile counting and errors. The XLA parts run in worker processes (see conftest.py); consolidation and the
checks of checkpoint files run here, in plain torch, as they would on a machine without torch_xla."""

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_gpt import GPT
from lit_gpt.utils import LitError
from lit_gpt.weights import load_weights

REPO = Path(__file__).resolve().parents[2]
CONSOLIDATE = REPO / "xla" / "scripts" / "consolidate_checkpoint.py"


def test_fsdp_8_devices_matches_one_device(xla_workers):
    main = xla_workers.result("train8")["train"]
    one = xla_workers.result("ref1")["train"]
    assert main["devices"] == 8 and one["devices"] == 1
    assert len(main["losses"]) == 5 and all(math.isfinite(x) for x in main["losses"])
    for a, b in zip(main["losses"], one["losses"]):
        assert abs(a - b) < 1e-5, (main["losses"], one["losses"])
    # the loss goes down: the 5 steps really train (the batches are learnable counting sequences)
    assert main["losses"][-1] < main["losses"][0]
    # every parameter is sharded over the 8 devices (FSDPv2: the largest dimension)
    specs = main["shardings"]
    assert specs and all("devices=[8" in s or "devices=[1,8" in s for s in specs.values()), specs
    assert main["shardings"]["transformer.wte.weight"].startswith("{devices=[8,1]")
    assert all(s == "{replicated}" or "devices=[1" in s for s in one["shardings"].values())
    # the step compiles during warm-up only (first step; first optimizer step with state)
    assert main["compiles_per_step"][2:] == [0, 0, 0], main["report"]


@pytest.mark.slow  # reads the 8-device extra / 4-device reshard workers (tests/xla/conftest.py)
def test_activation_checkpointing_on_a_two_slice_mesh(xla_workers):
    r = xla_workers.result("extra8", killed=True)["checkpointed"]
    one = xla_workers.result("ref1")["train"]
    assert r["mesh"] == {"dcn": 2, "fsdp": 4} and r["checkpointed"]
    for a, b in zip(r["losses"], one["losses"]):
        assert abs(a - b) < 1e-5, (r["losses"], one["losses"])
    # parameters are sharded over "fsdp" (4) and replicated over "dcn" (2)
    assert r["shardings"]["transformer.wte.weight"].endswith("last_tile_dim_replicate}"), r["shardings"]
    assert r["shardings"]["transformer.wte.weight"].startswith("{devices=[4,1,2]")


@pytest.mark.slow  # reads the 8-device extra / 4-device reshard workers (tests/xla/conftest.py)
def test_frozen_adapter_training_sharded(xla_workers):
    r = xla_workers.result("extra8", killed=True)["adapter"]
    assert all(math.isfinite(x) for x in r["losses"])
    assert r["changed"], "the adapter parameters did not train"
    assert all("adapter_wte" in n or "gating_factor" in n for n in r["changed"]), r["changed"]
    assert not set(r["changed"]) & set(r["frozen"])
    wte = [s for n, s in r["shardings"].items() if "adapter_wte" in n]
    assert wte and all("devices=[" in s and "replicated" not in s for s in wte)


def test_precision_bf16_true_casts_parameters_bf16_mixed_keeps_fp32(xla_workers):
    fp32_loss = xla_workers.result("ref1")["train"]["losses"][0]
    precision = xla_workers.result("ref1")["precision"]
    true, mixed = precision["bf16-true"], precision["bf16-mixed"]
    assert true["dtype"] == "torch.bfloat16" and mixed["dtype"] == "torch.float32"
    assert true["xla_use_bf16"] is None and mixed["xla_use_bf16"] is None  # the deprecated flag is never set
    assert abs(true["loss"] - fp32_loss) < 0.05 and abs(mixed["loss"] - fp32_loss) < 0.05


@pytest.mark.slow  # reads the 8-device extra / 4-device reshard workers (tests/xla/conftest.py)
def test_staged_loader_host_memory(xla_workers):
    staged = xla_workers.result("train8")["memory"]
    naive = xla_workers.result("reshard")["memory"]
    mib = 1024 * 1024
    summary = {m: {k: round(v / mib, 1) if isinstance(v, int) else v for k, v in r.items()} for m, r in
               (("staged", staged), ("naive", naive))}
    # staged: peak anonymous memory stays within ~1 block above the final resident size and above start + model.
    # The first device transfers of a fresh process also allocate the XLA runtime's own buffers and thread arenas,
    # a fixed cost (seen here: 0-15 MiB, varying run to run) that does not grow with the model; at this test's
    # 27 MiB blocks it is a large fraction of a block, so it gets a fixed allowance. bench/load.py checks the
    # 1.2x target on a >= 1 GB checkpoint, where that cost is noise (measured 0.49x of a 191 MiB block).
    runtime_allowance = 24 * mib
    assert staged["peak_minus_final"] <= 1.2 * staged["block"] + runtime_allowance, summary
    assert staged["above_model"] <= 1.2 * staged["block"] + runtime_allowance, summary
    assert staged["resident_added"] >= 0.9 * staged["model"], summary  # the model really is resident
    # a naive full load holds at least a second copy of the model at its peak
    assert naive["above_model"] >= 1.0 * naive["model"], summary
    assert staged["spec"].startswith("{devices=[8") and naive["spec"].startswith("{devices=[4"), summary


def test_staged_loader_cast_host_memory(xla_workers):
    """A load that casts (fp32 file -> bf16) makes one host copy of a tensor: each device's shard is sliced from the
    mapped file and cast once, and those shards go straight to torch_xla's sharded transfer. torch_xla 2.9 copies
    every shard it is handed once more (its AtenSource copies unconditionally), so the tensor is in host memory twice
    while the transfer starts; on XLA:CPU the device buffers are host memory too, and how far torch_xla's transfer
    threads overlap them with its copies varies run to run. The model is a SmolLM2-style tied 49152 x 1024 embedding
    (96 MiB in bf16, 4x the block). Measured here (anonymous memory sampled from a helper process, in units of that
    tensor): peak above start + model 1.2-2.0x; casting the whole tensor first and sharding it with torch_xla's own
    transfer (the code before the fix) 2.1-2.6x, and it never reaches the direct transfer, which the deterministic
    checks below catch every time. bench/load.py reports every file dtype x precision x devices x format."""
    r = xla_workers.result("train8")["cast_memory"]
    mib = 1024 * 1024
    summary = {k: round(v / mib, 1) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in r.items()}
    bound = max(r["block"], r["tensor"])
    runtime_allowance = 24 * mib  # as in test_staged_loader_host_memory: the XLA runtime's own allocations
    # deterministic: the embedding went to the direct sharded transfer as one bf16 copy, and at that moment the
    # process held the blocks already placed plus that copy, nothing more (no full-size cast beside the shards)
    assert r["handed_shard_bytes"] == r["tensor"], summary
    assert r["above_start_at_handover"] <= r["block"] + r["tensor"] + runtime_allowance, summary
    # the peak: the loader's copy plus torch_xla's (2x), never a third
    assert r["peak_minus_final"] <= 2.0 * bound + runtime_allowance, summary
    assert r["above_model"] <= 2.0 * bound + runtime_allowance, summary
    assert r["resident_added"] >= 0.9 * r["model"], summary  # the model really is resident
    assert r["bit_equal"] and r["dtypes"] == ["torch.bfloat16"] and r["tied"], summary  # == tensor.to(bfloat16)
    assert r["spec"].startswith("{devices=[8,1]"), summary  # sharded like FSDPv2 shards it


def test_compile_counter(xla_workers):
    r = xla_workers.result("train8")["compile_counter"]
    assert r["fixed"] == [1, 0, 0, 0], r
    assert r["recompiles"] == 1
    assert len(r["warnings"]) == 1 and "step 4" in r["warnings"][0] and "PT_XLA_DEBUG_LEVEL=2" in r["warnings"][0]
    assert "1 after" in r["report"]


def test_clear_errors(xla_workers):
    errors = xla_workers.result("train8")["errors"]["errors"]
    assert "batch size 6 is not divisible by the 8 devices" in errors["batch"]
    assert "devices=3" in errors["devices"] and "CPU_NUM_DEVICES" in errors["devices"]
    # a missing base weight is an error naming it, never a random initialisation (a variant's own may be missing)
    assert "lacks 1 weight(s) of the model (transformer.h.1.attn.proj.weight)" in errors["missing_layer"]
    assert "lacks 1 weight(s) of the model (lm_head.weight)" in errors["missing_head"]
    assert xla_workers.result("train8")["errors"]["lora_loaded"]

    # PJRT_DEVICE=TPU on a machine without TPU: a LitError (one line from a recipe) that says what to do
    choice = xla_workers.result("ref1")["device_choice"]
    tpu = choice["error"]
    assert tpu.startswith("PJRT_DEVICE=TPU but") and "PJRT_DEVICE=CPU" in tpu and "\n" not in tpu
    # PJRT_DEVICE unset: no TPU here, so CPU, and it says so
    assert choice["unset_choice"] == "CPU"
    assert "PJRT_DEVICE is not set: using PJRT_DEVICE=CPU" in choice["unset_message"]


def test_collectives_have_spmd_semantics(xla_workers):
    c = xla_workers.result("train8")["errors"]["collectives"]
    assert c["all_reduce"] == [float(i) for i in range(8)]  # a global tensor is already reduced
    assert c["broadcast"] == {"a": 1} and c["world_size"] == 1 and c["global_rank"] == 0
    assert c["host_value"] == 3.0


def test_persistent_compile_cache_is_written(xla_workers):
    one = xla_workers.result("ref1")["train"]
    cache = xla_workers.out / "cache"
    assert cache.is_dir() and any(cache.iterdir())
    assert "persistent cache" in one["report"]


def _consolidate_cli(*args):
    cmd = [sys.executable, str(CONSOLIDATE), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_save_on_8_consolidate_load_on_plain_cpu(xla_workers, tiny_config, tmp_path):
    xla_workers.result("train8")
    ckpt = xla_workers.out / "ckpt" / "step-000003"
    out = tmp_path / "lit_model.safetensors"
    proc = _consolidate_cli("--checkpoint_dir", ckpt, "--output_dir", tmp_path)
    assert proc.returncode == 0, proc.stderr
    reference = torch.load(xla_workers.out / "reference.pt", weights_only=True)["model"]
    state = load_weights(out)
    assert set(state) == set(reference) | {"lm_head.weight"}  # the tied head under its own name too
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), name
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    model = GPT(tiny_config)
    model.load_state_dict(state)  # strict: exactly the plain lit names
    assert not any(k.startswith("_") or "._orig_module" in k for k in state)


@pytest.mark.slow  # reads the 8-device extra / 4-device reshard workers (tests/xla/conftest.py)
def test_reshard_8_to_4_and_resume(xla_workers):
    r = xla_workers.result("reshard")
    main = xla_workers.result("train8")["train"]
    assert r["model_equal"] and r["optimizer_equal"]
    assert r["step"] == 3 and r["remainder"] == {"data": {"position": 24}}
    assert all("devices=[4" in s or "devices=[1,4" in s for s in r["shardings"].values()), r["shardings"]
    # training resumed on 4 devices continues exactly like the uninterrupted 8-device run
    for a, b in zip(r["losses_after"], main["losses"][3:]):
        assert abs(a - b) < 1e-5, (r["losses_after"], main["losses"])


@pytest.mark.slow  # reads the 8-device extra / 4-device reshard workers (tests/xla/conftest.py)
def test_killed_save_leaves_previous_checkpoint_and_no_valid_partial(xla_workers):
    import lit_gpt.xla.checkpoint as ck
    from lit_gpt.xla.consolidation import consolidate

    rc = xla_workers.wait("extra8")
    assert rc == -9, xla_workers.log("extra8")
    kill_dir = xla_workers.out / "kill"
    first, second = kill_dir / "step-000001", kill_dir / "step-000002"
    assert not second.exists()
    partial = list(kill_dir.glob(".step-000002.tmp-*"))
    assert len(partial) == 1 and (partial[0] / ".metadata").is_file()  # DCP had finished: only the marker is missing
    assert ck.latest_checkpoint(kill_dir) == first
    with pytest.raises(LitError, match="incomplete checkpoint"):
        ck.check_complete(partial[0])
    with pytest.raises(LitError, match="incomplete checkpoint"):
        consolidate(partial[0], xla_workers.out / "never")
    # the previous checkpoint is intact
    out = consolidate(first, xla_workers.out / "kill", progress=False)
    reference = torch.load(xla_workers.out / "kill_reference.pt", weights_only=True)["model"]
    state = load_weights(out)
    assert all(torch.equal(state[k], v) for k, v in reference.items())
    assert ck.read_values(first) == {"step": 1}
    # the adapter and precision checks of this worker ran before the kill
    assert "adapter" in xla_workers.result("extra8", killed=True)


@pytest.mark.slow  # reads the 8-device extra / 4-device reshard workers (tests/xla/conftest.py)
def test_adapter_checkpoint_consolidates_to_finetuned_file(xla_workers):
    xla_workers.result("extra8", killed=True)
    from lit_gpt.peft import load_finetuned
    from lit_gpt.xla.consolidation import consolidate

    out = consolidate(xla_workers.out / "ckpt" / "adapter", progress=False)
    assert out.name == "lit_model.adapter.safetensors" and (out.parent / "lit_model.adapter.json").is_file()
    state, config = load_finetuned(out, "adapter")
    reference = torch.load(xla_workers.out / "adapter_reference.pt", weights_only=True)
    assert set(state) == set(reference) and reference
    assert all(torch.equal(state[k], v) for k, v in reference.items())
    assert config == {"adapter_prompt_length": 4, "adapter_start_layer": 1}


def test_missing_host_files_are_named(xla_workers, tmp_path):
    xla_workers.result("train8")
    broken = tmp_path / "step-000003"
    shutil.copytree(xla_workers.out / "ckpt" / "step-000003", broken)
    (broken / "__0_0.distcp").unlink()
    proc = _consolidate_cli("--checkpoint_dir", broken)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "host/rank 0: __0_0.distcp" in lines[0], proc.stderr
