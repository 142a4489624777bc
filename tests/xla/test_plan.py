"""The TPU planner (xla/scripts/plan.py, lit_gpt/recipes/xla_plan.py, lit_gpt/xla/plan.py, lit_gpt/xla/plan_report.py).

Fast: the pure-Python parts (topologies, argument checks, the recipes' flags, roofline and its model-FLOPs floor,
HLO collective counting, per-layer extrapolation from the default depths and its check against a full-depth compile,
the buffer assignment's bytes, libtpu's out-of-memory message, the one-line install hint). Slow (libtpu's compiler
installed from requirements-tpu-plan.txt if missing; ~95 s of CPU for the three on 2 cores at load 6, 260 s before
they were trimmed): a small model's LoRA step traced at 1, 2 and 4 layers in one XLA:CPU process and compiled for
v5e-8 up to libtpu's buffer assignment: per-chip weight bytes = parameters x 2 bytes / 8 (FSDP over 8 chips), the
1+2-layer extrapolation within 5% of the 4-layer compile on peak HBM and FLOPs, a model too big for the slice
reported as not fitting (from the same compiles), a checkpointed block's frozen weights out of the step's outputs;
torch_xla's Pallas flash attention and grouped matmul traced on XLA:CPU and compiled for v5e-8 through libtpu's code
generator; the strategy's checkpoint against torch_xla's on 1 device. (An oversized batch's compile is not tested:
libtpu's compiler spends many minutes and many GB of host memory rematerializing before it gives up; the
out-of-memory message's parsing is tested on its text.)"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lit_gpt.utils import LitError
from lit_gpt.xla import plan, plan_report

NEEDS_XLA = False  # the fast tests need neither torch_xla nor libtpu; the slow one checks for itself

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "xla" / "scripts" / "plan.py"


def _script():
    spec = importlib.util.spec_from_file_location("plan_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_topologies():
    v5e = plan.parse_topology("v5e-8")
    assert (v5e.chips, v5e.topology_name, v5e.chip_config_name) == (8, "v5e:2x4", "default")
    v5p = plan.parse_topology("v5p-8")  # v5p names count TensorCores: 4 chips, one megacore device each
    assert (v5p.chips, v5p.topology_name, v5p.chip_config_name) == (4, "v5:2x2x1", "megacore")
    assert plan.parse_topology("V6E-64").chips == 64
    assert plan.parse_topology("v5e-32").topology_name == "v5e:4x8"
    for bad in ("v5e-7", "v7-8", "tpu", ""):
        with pytest.raises(LitError, match="is not one of .*v5e-8"):
            plan.parse_topology(bad)
    assert all(plan.parse_topology(name).name == name for name in plan.topologies())


def test_roofline():
    chip = plan.CHIPS["v5e"]
    # one second of compute at peak, half a second of HBM traffic: compute-bound, and the compiled FLOPs all count
    r = plan.roofline(chip.peak_flops, chip.hbm_bandwidth / 2, chip)
    assert r["bound"] == "compute" and r["step_s"] == pytest.approx(1.0) and r["mfu_bound"] == pytest.approx(1.0)
    # memory-bound: two seconds of traffic; useful FLOPs are half of the compiled ones (e.g. recomputation)
    r = plan.roofline(chip.peak_flops, 2 * chip.hbm_bandwidth, chip, model_flops=chip.peak_flops / 2)
    assert r["bound"] == "memory" and r["step_s"] == pytest.approx(2.0) and r["mfu_bound"] == pytest.approx(0.25)
    assert r["compute_from"] == "compiled" and r["flops_counted_ratio"] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        plan.roofline(-1.0, 0.0, chip)


def test_roofline_where_the_cost_analysis_counts_fewer_flops_than_the_model():
    """XLA's cost analysis counted 0.6-1.0x the model's analytic FLOPs on Llama-3.1-70B's steps (the MFU bound came
    out at 136% on one): compute is then timed on the model's FLOPs, the bound stays at most 100%, and the plan says
    so in one line."""
    chip = plan.CHIPS["v5p"]
    # compiled: 0.6 s of compute at peak, 0.8 s of HBM traffic; the model: 1.2 s of compute
    r = plan.roofline(0.6 * chip.peak_flops, 0.8 * chip.hbm_bandwidth, chip, model_flops=1.2 * chip.peak_flops)
    assert r["compute_from"] == "model" and r["flops_counted_ratio"] == pytest.approx(0.5)
    assert r["bound"] == "compute" and r["step_s"] == pytest.approx(1.2) and r["mfu_bound"] == pytest.approx(1.0)
    # still memory-bound when the traffic is slower than the model's FLOPs
    r = plan.roofline(0.6 * chip.peak_flops, 2.4 * chip.hbm_bandwidth, chip, model_flops=1.2 * chip.peak_flops)
    assert r["bound"] == "memory" and r["mfu_bound"] == pytest.approx(0.5)
    script = _script()
    config = script.model_config("Llama-3.2-1B", None, "lora", {"lora_r": 8})
    job = {"model_name": "Llama-3.2-1B", "checkpoint_dir": None, "micro_batch_size": 1, "max_seq_length": 2048,
           "precision": "bf16-true", "optimizer": "adamw", "activation_checkpointing": False, "scan_layers": False,
           "lora": {"lora_r": 8}}
    model = 2 * config.flops_per_token(2048) * 2048  # per chip per step
    compiled = {"fits": True, "argument_bytes": 1, "output_bytes": 0, "alias_bytes": 0, "temp_bytes": 1,
                "peak_bytes": 2, "bytes_accessed": 1e6, "collectives": {}}
    short = script.summarise(config, plan.parse_topology("v5e-8"), job,
                             {config.n_layer: {**compiled, "flops": 0.7 * model}}, "lora")
    assert short["roofline"]["compute_from"] == "model" and short["roofline"]["mfu_bound"] == pytest.approx(1.0)
    assert sum("counts 0.70x the model's analytic FLOPs" in line for line in script.report(short).splitlines()) == 1
    enough = script.summarise(config, plan.parse_topology("v5e-8"), job,
                              {config.n_layer: {**compiled, "flops": 1.1 * model}}, "lora")
    assert enough["roofline"]["compute_from"] == "compiled" and "analytic" not in script.report(enough)


def test_collectives_that_do_not_grow_per_layer_are_not_extrapolated_below_the_compiles():
    """A collective whose count falls with depth (Llama-3.1-8B LoRA's all-reduces: 4 at 2 layers, 3 at 3, which the
    compiler combined differently) keeps the deepest compile's figure at the model's depth, not a negative count."""
    script = _script()
    config = script.model_config("Llama-3.2-1B", None, "lora", {"lora_r": 8})
    job = {"model_name": "Llama-3.2-1B", "checkpoint_dir": None, "micro_batch_size": 1, "max_seq_length": 2048,
           "precision": "bf16-true", "optimizer": "adamw", "activation_checkpointing": False, "scan_layers": False,
           "lora": {"lora_r": 8}}

    def point(layers, reduces):
        collectives = {op: {"count": 0, "bytes": 0} for op in plan.COLLECTIVES}
        collectives["all-reduce"] = {"count": reduces, "bytes": 100 * reduces}
        collectives["all-gather"] = {"count": 10 * layers, "bytes": 1000 * layers}
        return {"fits": True, "argument_bytes": layers, "output_bytes": 0, "alias_bytes": 0, "temp_bytes": layers,
                "peak_bytes": 2 * layers, "flops": 1e12 * layers, "bytes_accessed": 1e9 * layers,
                "collectives": collectives}

    p = script.summarise(config, plan.parse_topology("v5e-8"), job, {2: point(2, 4), 3: point(3, 3)}, "lora")
    assert p["collectives"]["all-reduce"] == {"count": 3, "bytes": 300}
    assert p["collectives"]["all-gather"] == {"count": 10 * config.n_layer, "bytes": 1000 * config.n_layer}


HLO = """
ENTRY %main {
  %p0 = bf16[6144,576]{1,0:T(8,128)(2,1)} parameter(0), sharding={devices=[8,1]<=[8]}
  %all-gather = bf16[49152,576]{0,1:T(8,128)(2,1)S(1)} all-gather(%p0), channel_id=1, dimensions={0}
  %all-gather.1 = bf16[1536,576]{1,0} all-gather(%x), channel_id=2
  %reduce-scatter = f32[192,576]{1,0} reduce-scatter(%g), channel_id=3, to_apply=%add
  %all-reduce = (f32[], f32[4]{0}) all-reduce(%a, %b), channel_id=4, to_apply=%add
  %all-gather-start = (bf16[8,64]{1,0}, bf16[64,64]{1,0}) all-gather-start(%y), channel_id=5
  %all-gather-done = bf16[64,64]{1,0} all-gather-done(%all-gather-start)
  %fusion = f32[8]{0} fusion(%all-reduce), kind=kLoop, calls=%all-reduce-fusion
}
"""


def test_count_collectives():
    c = plan.count_collectives(HLO)
    assert c["all-gather"] == {"count": 3, "bytes": (49152 * 576 + 1536 * 576 + 64 * 64) * 2}
    assert c["reduce-scatter"] == {"count": 1, "bytes": 192 * 576 * 4}
    assert c["all-reduce"] == {"count": 1, "bytes": 4 + 16}
    assert c["all-to-all"] == {"count": 0, "bytes": 0}
    assert plan.shape_bytes("pred[3]") == 3 and plan.shape_bytes("(s32[2], f64[])") == 16


def test_extrapolate():
    # embedding/head part 10, 3 per layer: exact from any two depths, and least squares through more
    assert plan.extrapolate({1: 13, 2: 16}, 80) == pytest.approx(250)
    assert plan.extrapolate({1: 13, 2: 16, 4: 22}, 32) == pytest.approx(106)
    assert plan.extrapolate({2: 5.0, 4: 9.0}, 2) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="two or more"):
        plan.extrapolate({1: 3.0}, 8)


def test_oom_message_and_dump():
    text = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 20.50G"
            " of 15.75G hbm. Exceeded hbm capacity by 4.75G.")
    got = plan._oom_bytes(text)
    assert got["peak_bytes"] == int(20.5 * plan.GIB) and got["over_bytes"] == int(4.75 * plan.GIB)
    module = b"\x0a\x02\x08\x01rest"  # HloModuleProto bytes start with its own field 1 too: an HloProto wraps it
    assert plan.module_from_dump(b"\x0a" + bytes([len(module)]) + module) == module


ASSIGNMENT = """BufferAssignment:
allocation 0: size 512, thread-local:
 value: <239 maximum.18 @0> (size=512,offset=0): bf16[]{:T(256)}
allocation 1: size 131334144, parameter 16, shape |bf16[16032,4096]| at ShapeIndex {}:
 value: <6700 param.19 @0> (size=131334144,offset=0): bf16[16032,4096]{1,0:T(8,128)(2,1)}
allocation 12: size 16384, parameter 10, shape |bf16[16,512]| at ShapeIndex {}, maybe-live-out:
allocation 15: size 16384, maybe-live-out:
allocation 20: size 4096, constant:
allocation 30: size 8, output:
allocation 438: size 7557235200, preallocated-temp:
allocation 442: size 117440512, color 1, preallocated-temp:
"""


def test_buffer_assignment_memory():
    """Per-chip bytes read off XLA's dumped buffer assignment (the memory compile stops libtpu's compiler there)."""
    got = plan.buffer_assignment_memory(ASSIGNMENT, "Total bytes used: 7994729592 (7.45GiB)\n")
    assert got == {"argument_bytes": 131334144 + 16384, "output_bytes": 16384 * 2 + 8, "alias_bytes": 16384,
                   "temp_bytes": 7557235200 + 117440512, "peak_bytes": 7994729592}
    # without the report's total: arguments + outputs - aliased + temporaries
    assert plan.buffer_assignment_memory(ASSIGNMENT, "")["peak_bytes"] == (
        131334144 + 16384 + 16384 * 2 + 8 - 16384 + 7557235200 + 117440512)


def test_install_hint(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    line = plan.tpu_compiler_missing()
    assert line.startswith(plan.INSTALL_LINE) and "\n" not in line
    script = _script()
    monkeypatch.setattr(script, "tpu_compiler_missing", lambda: line)
    with pytest.raises(LitError, match="pip install -r requirements-tpu-plan.txt"):
        script.setup(model_name="Llama-3.2-1B")


@pytest.mark.parametrize("flags, message", [
    (dict(model_name="Llama-3.2-1B", topology="v5e-9"), "is not one of"),
    (dict(model_name="Llama-3.2-1B", method="adapter_v3"), "--method must be one of"),
    (dict(), "give one of --model_name"),
    (dict(model_name="no-such-model"), "Unknown model name"),
    (dict(model_name="Llama-3.2-1B", layers=[2]), "two or more depths"),
    (dict(model_name="Llama-3.2-1B", optimizer="lion"), "--optimizer"),
])
def test_bad_arguments(flags, message):
    with pytest.raises(LitError, match=message):
        _script().setup(**flags)


def test_the_per_layer_line_starts_after_the_first_block(monkeypatch, tmp_path):
    """By default the plan traces 2 and 3 layers, not 1: the first block is unlike the others (under LoRA its input
    needs no gradient, so activation checkpointing leaves it plain), and the 1-layer program peaks elsewhere
    (Llama-3.1-70B LoRA with checkpointing on v5p-32: 13.7, 15.9, 16.1, 16.4 GiB at 1-4 layers; 186 GiB at 80 from
    1 and 2 layers, 34 GiB from 2, 3 and 4). A model of at most 3 layers is compiled whole; --layers still chooses."""
    script = _script()
    traced = []

    class Stop(Exception):
        pass

    def trace(job, depths, cache):
        traced.append(depths)
        raise Stop

    monkeypatch.setattr(script, "tpu_compiler_missing", lambda: None)
    monkeypatch.setattr(script, "trace_in_child", trace)
    for flags in (dict(model_name="Llama-3.2-1B"), dict(model_name="Llama-3.2-1B", activation_checkpointing=True),
                  dict(model_name="Llama-3.2-1B", layers=[1, 2])):
        with pytest.raises(Stop):
            script.setup(**flags)
    from lit_gpt import lora

    lora.Config.from_name("Llama-3.2-1B", n_layer=3).save(tmp_path)
    with pytest.raises(Stop):
        script.setup(checkpoint_dir=tmp_path)
    assert traced == [[2, 3], [2, 3], [1, 2], [3]]


def test_summary_extrapolates_per_layer():
    """The plan at the model's depth from 1- and 2-layer compiles: every byte and FLOP figure on the line."""
    script = _script()
    config = script.model_config("Llama-3.2-1B", None, "lora", {"lora_r": 8})
    topo = plan.parse_topology("v5e-8")
    gib = plan.GIB
    zero = {op: {"count": 0, "bytes": 0} for op in plan.COLLECTIVES}

    def point(layers):
        return {"fits": True, "argument_bytes": (1 + 0.1 * layers) * gib, "output_bytes": 0.01 * layers * gib,
                "alias_bytes": 0.01 * layers * gib, "temp_bytes": (2 + 0.5 * layers) * gib,
                "peak_bytes": (3 + 0.6 * layers) * gib, "flops": 1e12 * (1 + layers), "bytes_accessed": 1e9 * layers,
                "collectives": {**zero, "all-gather": {"count": 2 * layers, "bytes": 100 * layers}}}

    job = {"model_name": "Llama-3.2-1B", "checkpoint_dir": None, "micro_batch_size": 1, "max_seq_length": 2048,
           "precision": "bf16-true", "optimizer": "adamw", "activation_checkpointing": False, "scan_layers": False,
           "lora": {"lora_r": 8}}
    p = script.summarise(config, topo, job, {1: point(1), 2: point(2)}, "lora")
    assert p["per_chip"]["peak_bytes"] == pytest.approx((3 + 0.6 * 16) * gib)  # 12.6 GiB of 15.75: fits
    assert p["fits"] and p["collectives"]["all-gather"] == {"count": 32, "bytes": 1600}
    assert p["roofline"]["step_s"] == pytest.approx(max(17e12 / 197e12, 16e9 / 819e9))
    assert p["tokens_per_step"] == 8 * 2048
    assert p["model_flops_per_token"] == pytest.approx(2 * config.flops_per_token(2048))
    many = script.summarise(config, topo, {**job, "micro_batch_size": 2},
                            {1: {**point(1), "peak_bytes": 10 * gib}, 2: {**point(2), "peak_bytes": 11 * gib}},
                            "lora")
    assert not many["fits"] and many["over_by_bytes"] == pytest.approx(25 * gib - topo.chip.hbm_bytes)
    assert "does NOT fit" in script.report(many)
    # 12.6 GiB peak of which 10 GiB temporaries for 1 row: 2.6 GiB fixed, 13.15 GiB left = 1 row; none when over
    assert p["largest_micro_batch_estimate"] == 1 and many["largest_micro_batch_estimate"] == 0
    # the full depth compiled beside 1 and 2 layers: the plan is the full compile, with the line's error against it
    deep = config.n_layer
    compiled = {1: point(1), 2: point(2), deep: {**point(deep), "peak_bytes": 12 * gib}}
    checked = script.summarise(config, topo, job, compiled, "lora")
    assert checked["how"] == "compiled at full depth" and checked["per_chip"]["peak_bytes"] == 12 * gib
    c = checked["extrapolation_check"]
    assert c["from_depths"] == [1, 2] and c["peak_bytes"]["extrapolated"] == pytest.approx((3 + 0.6 * 16) * gib)
    assert c["peak_bytes"]["error"] == pytest.approx(12.6 / 12 - 1) and c["flops"]["error"] == pytest.approx(0)
    assert plan_report.largest_micro_batch({"temp_bytes": 4.0, "peak_bytes": 10.0}, 26, 2) == 10
    # a peak that falls with depth (the compiler's choices differ near the chip's HBM) gives no line and no verdict,
    # not a negative peak that "fits"; HBM bytes that fall with depth give no roofline, not a negative one
    falling = script.summarise(config, topo, job, {1: {**point(1), "peak_bytes": 16 * gib},
                                                   2: {**point(2), "peak_bytes": 14.5 * gib, "bytes_accessed": 0.5e9}},
                               "lora")
    assert falling["fits"] is None and "peak_bytes" not in falling["per_chip"]
    assert falling["how"].startswith("not extrapolated") and "roofline" not in falling
    assert "falls with depth" in falling["cost_not_counted"]["reason"] and "not given" in script.report(falling)
    # falling, but every compiled depth is already over the chip (topo: 16 GiB chips): the model does not fit, and
    # its peak is at least the least of them (Gemma-3-12B full finetuning on v5e-8)
    over = script.summarise(config, topo, job, {1: {**point(1), "peak_bytes": 17 * gib},
                                                2: {**point(2), "peak_bytes": 16.5 * gib}}, "lora")
    assert over["fits"] is False and over["per_chip"]["peak_bytes"] == 16.5 * gib
    assert over["how"].startswith("over the chip's HBM at every compiled depth")
    assert over["over_by_bytes"] == pytest.approx(16.5 * gib - topo.chip.hbm_bytes) and over["over_by_bytes"] > 0


# ---------------------------------------------------------------------------------------------------------------
# slow: the real TPU compiler
# ---------------------------------------------------------------------------------------------------------------
SMALL = dict(name="plan-small", block_size=2048, vocab_size=8192, n_layer=4, n_head=8,
             n_query_groups=4, n_embd=512, intermediate_size=1536, norm_class_name="RMSNorm",
             mlp_class_name="LLaMAMLP", tie_embeddings=False, rotary_percentage=1.0, parallel_residual=False,
             bias=False)


def _plan(checkpoint_dir, tmp_path, name, *flags):
    out = tmp_path / f"{name}.json"
    from child_env import python_path

    env = {**os.environ, "PYTHONPATH": python_path()}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--checkpoint_dir", str(checkpoint_dir), "--method", "lora",
                           "--topology", "v5e-8", "--train.max_seq_length", "128", "--results_file", str(out),
                           *flags], capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # long work shows progress: each phase's time and host memory
    assert "[plan" in proc.stderr and "compile:" in proc.stderr, proc.stderr[-3000:]
    record = json.loads(out.read_text())  # a bench result file (bench/result_files.py): the plan is its results
    assert record["bench"] == "tpu_plan" and record["settings"]["topology"] == "v5e-8"
    return record["results"]


@pytest.mark.slow
def test_plan_compiles_for_v5e_8(tmp_path):
    """One plan traces the 1-, 2- and 4-layer steps in one XLA:CPU process and compiles each for v5e-8 up to libtpu's
    buffer assignment; a second plan of a far deeper model reuses those compiles (--trace_cache); a third plans a
    2-layer model's step with activation checkpointing. ~60 s of CPU in all (2 cores, load ~5)."""
    if importlib.util.find_spec("torch_xla") is None:
        pytest.skip("torch_xla is not installed (pip install torch_xla==2.9.0)")
    if plan.tpu_compiler_missing():  # the optional requirements, installed as a user would
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "-r", str(ROOT / "requirements-tpu-plan.txt")],
                             capture_output=True, text=True, timeout=1800)
        if pip.returncode != 0:
            pytest.skip("the TPU compiler is not installed and `pip install -r requirements-tpu-plan.txt` failed"
                        f" (offline?): {(pip.stderr or pip.stdout).strip().splitlines()[-1:]}")
    from lit_gpt import lora

    lora.Config(**SMALL).save(tmp_path)  # lit_config.json only: the plan reads no weights
    cache = tmp_path / "traces"  # the 1- and 2-layer steps and their compiles: the deep plan below reuses them
    full = _plan(tmp_path, tmp_path, "full", "--layers", "[1, 2]", "--full_depth", "true",
                 "--train.micro_batch_size", "1", "--trace_cache", str(cache))
    assert full["how"] == "compiled at full depth" and full["fits"]
    assert sorted(full["depths"]) == ["1", "2", "4"] and full["compiled_to"] == ["buffer assignment"]
    one, two, four = (full["depths"][d] for d in ("1", "2", "4"))
    # FSDP over 8 chips: each chip holds 1/8 of the bf16 weights. One more block adds exactly its parameters' share
    # (its LoRA matrices and their AdamW state included, small); the batch, RoPE tables and scalars are the same.
    layer = two["parameters"] - one["parameters"]
    assert two["argument_bytes"] - one["argument_bytes"] == pytest.approx(layer * 2 / 8, rel=0.05)
    assert full["per_chip"]["argument_bytes"] == pytest.approx(four["parameters"] * 2 / 8, rel=0.05)
    assert 0 < full["per_chip"]["alias_bytes"] < 0.05 * full["per_chip"]["argument_bytes"]  # LoRA + state, donated
    # the per-layer line through 1 and 2 layers lands within 5% of the 4-layer compile
    check = full["extrapolation_check"]
    assert check["from_depths"] == [1, 2]
    assert check["peak_bytes"]["compiled"] == full["per_chip"]["peak_bytes"] == four["peak_bytes"]
    assert check["peak_bytes"]["extrapolated"] == pytest.approx(four["peak_bytes"], rel=0.05)
    assert check["flops"]["extrapolated"] == pytest.approx(four["flops"], rel=0.05)
    assert plan.extrapolate({1: one["peak_bytes"], 2: two["peak_bytes"]}, 4) == check["peak_bytes"]["extrapolated"]
    assert full["host"]["max_rss_gib"] > 0 and four["compile_max_rss_gib"] > 0
    for d in (one, two, four):  # all the step writes out: the donated LoRA matrices, their AdamW state, the loss
        assert 0 < d["alias_bytes"] and d["output_bytes"] - d["alias_bytes"] < 64 * 1024, d
    # a model too deep for v5e-8 (the same blocks, 30,000 of them: ~90B parameters, 1/8 of their bf16 weights alone
    # is ~23 GiB per chip) is reported as not fitting, by how much, and with no micro batch that fits. Its 1- and
    # 2-layer steps are the ones traced and compiled above (the trace cache): seconds. (A program that is too big
    # is not compiled here: libtpu's compiler spent >10 minutes and up to 22 GB of host memory rematerializing a
    # 4-layer step with 64 x 2048 tokens per chip before giving up, on this 2-core host.)
    lora.Config(**{**SMALL, "n_layer": 30_000}).save(tmp_path)
    deep = _plan(tmp_path, tmp_path, "deep", "--layers", "[1, 2]", "--train.micro_batch_size", "1",
                 "--trace_cache", str(cache))
    assert not deep["fits"] and deep["how"].startswith("extrapolated")
    assert deep["depths"]["1"]["peak_bytes"] == one["peak_bytes"]  # the same program, the same answer
    hbm = deep["hbm_per_chip_bytes"]
    assert deep["over_by_bytes"] == pytest.approx(deep["per_chip"]["peak_bytes"] - hbm) and deep["over_by_bytes"] > 0
    assert deep["per_chip"]["argument_bytes"] > hbm and deep["largest_micro_batch_estimate"] == 0
    # with activation checkpointing (lit_gpt.xla.scan.checkpoint_block) the 2-layer step's second block is
    # checkpointed (the first is not: under LoRA its input needs no gradient, so its step is the one checked above),
    # and its frozen weights stay out of the step: all it writes out is the donated LoRA matrices and their AdamW
    # state (and the loss). Under torch_xla's checkpoint the outputs also held that block's frozen weight shards
    # (+0.05 GiB per block per chip on Llama-3.1-70B, v5e-32; here ~0.8 MB). A 2-layer model: one trace, one compile.
    # Its rows are packed (--packing true): attention within documents by the TPU's Pallas flash attention with
    # segment ids, as the strategy installs it on a TPU, lowered and compiled with the step (int64 segment ids made
    # the TPU compiler refuse it: lit_gpt.xla.flash passes int32): per layer its forward, and dq and dkv backward;
    # the checkpointed second block runs its forward again in the backward: 2 + 1 + 2 x 2 = 7 kernels
    lora.Config(**{**SMALL, "n_layer": 2}).save(tmp_path)
    ckpt = _plan(tmp_path, tmp_path, "ckpt", "--train.micro_batch_size", "1", "--activation_checkpointing", "true",
                 "--packing", "true")
    assert sorted(ckpt["depths"]) == ["2"] and ckpt["settings"]["activation_checkpointing"]
    assert ckpt["settings"]["packing"] and ckpt["tpu_kernels"] == {"2": 7} and ckpt["fits"]
    d = ckpt["depths"]["2"]
    assert 0 < d["alias_bytes"] and d["output_bytes"] - d["alias_bytes"] < 64 * 1024, d
    assert full["tpu_kernels"] == {"1": 0, "2": 0, "4": 0}  # unpacked rows, no MoE: XLA's own attention


@pytest.mark.slow
def test_a_dropless_moe_plan_compiles_the_tpu_grouped_matmul(tmp_path):
    """An MoE model's step with the dropless dispatch (--moe.capacity_factor none) traced as a TPU runs it: each
    expert projection through torch_xla's Pallas grouped matmul (lit_gpt.xla.moe_gmm), lowered and compiled for
    v5e-8 with the step: per layer gmm for fc_1, fc_2 and proj forward and for their input gradients (the experts are
    frozen under LoRA: no tgmm): 2 x 6 = 12. ~25 s of CPU."""
    if importlib.util.find_spec("torch_xla") is None:
        pytest.skip("torch_xla is not installed (pip install torch_xla==2.9.0)")
    if plan.tpu_compiler_missing():
        pytest.skip(plan.tpu_compiler_missing())  # test_plan_compiles_for_v5e_8 installs it
    from lit_gpt import lora

    lora.Config(**{**SMALL, "n_layer": 2, "mlp_class_name": "LLaMAMoE", "n_expert": 8, "n_expert_per_token": 2,
                   "moe_intermediate_size": 512}).save(tmp_path)
    moe = _plan(tmp_path, tmp_path, "moe", "--train.micro_batch_size", "1", "--moe.capacity_factor", "none")
    assert moe["tpu_kernels"] == {"2": 12} and moe["fits"]


def test_flags_are_the_recipes():
    """The plan takes the XLA finetune recipes' flags (--precision, --scan_layers, --train.*, --lora_r, ...) with
    their names, types, defaults and help; only --train's default differs: a sequence length (the plan has no data
    to take the longest row from) on the lora recipe's defaults."""
    from lit_gpt.recipes.flags import LORA, XLA_FINETUNE

    script = _script()
    ours = {f.name: f for f in script.FLAGS}
    recipe = {f.name: f for f in XLA_FINETUNE + LORA}
    shared = sorted(set(ours) & set(recipe))
    assert {"precision", "activation_checkpointing", "scan_layers", "optimizer", "train", "moe", "lora_r",
            "lora_alpha", "lora_mlp", "checkpoint_dir"} <= set(shared)
    for name in shared:
        if name == "checkpoint_dir":  # no default: one of --model_name or --checkpoint_dir
            assert ours[name].annotation == recipe[name].annotation and ours[name].default is None
            continue
        if name == "train":
            lora_recipe = importlib.util.spec_from_file_location("xla_lora", ROOT / "xla" / "finetune" / "lora.py")
            module = importlib.util.module_from_spec(lora_recipe)
            lora_recipe.loader.exec_module(module)
            import inspect
            from dataclasses import replace

            default = inspect.signature(module.setup).parameters["train"].default
            assert ours[name].default == replace(default, max_seq_length=2048)
            continue
        assert ours[name] == recipe[name], name
    # the command line spells them as the recipes do (what jsonargparse makes of the signature: run_cli's parser)
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_function_arguments(script.setup)
    options = {o for a in parser._actions for o in a.option_strings}
    assert {"--lora_r", "--lora_dropout", "--train.micro_batch_size", "--scan_layers"} <= options
    assert "--lora.r" not in options


_FLASH = """
import sys, torch, torch_xla
from lit_gpt.xla.plan import pallas_for_tpu
import torch_xla.experimental.custom_kernel as ck
pallas_for_tpu()
dev = torch_xla.device()
q, k, v = (torch.randn(1, 4, 256, 128, dtype=torch.bfloat16).to(dev).requires_grad_() for _ in range(3))
segments = torch.tensor([[0] * 100 + [1] * 156], dtype=torch.int32).to(dev)  # two packed documents
out = ck.flash_attention(q, k, v, causal=True, q_segment_ids=segments, kv_segment_ids=segments, sm_scale=0.1)
out.float().sum().backward()
open(sys.argv[1], "wb").write(torch_xla._XLAC._get_xla_tensors_hlo_proto([out, q.grad, k.grad, v.grad]))
# the grouped matmul of an MoE layer's dropless dispatch (lit_gpt.xla.moe_gmm: gmm forward, gmm and tgmm backward)
from lit_gpt.xla.moe_gmm import pallas_gmm
# 600 rows sorted by expert: not a whole number of the kernels' 512-row tiles (pallas_gmm pads them)
x = torch.randn(600, 256, dtype=torch.bfloat16).to(dev).requires_grad_()
w = torch.randn(4, 384, 256, dtype=torch.bfloat16).to(dev).requires_grad_()  # 4 experts, (out, in)
sizes = torch.tensor([128, 0, 344, 128], dtype=torch.int32).to(dev)  # one expert gets no rows
y = pallas_gmm(x, w, sizes)
y.float().sum().backward()
open(sys.argv[2], "wb").write(torch_xla._XLAC._get_xla_tensors_hlo_proto([y, x.grad, w.grad]))
"""


@pytest.mark.slow
def test_pallas_kernels_compile_for_v5e(tmp_path):
    """torch_xla's Pallas kernels, forward and backward, traced on XLA:CPU devices for the TPU (`pallas_for_tpu`) in
    one process and compiled by libtpu for v5e-8: flash attention with segment ids (packed rows' kernel on a TPU: its
    three Mosaic kernels, forward, dq and dkv) and the MoE dispatch's grouped matmul (`lit_gpt.xla.moe_gmm`: gmm
    forward, gmm and tgmm backward, through torch_xla's call_jax), each in its program and lowered. Seconds."""
    if importlib.util.find_spec("torch_xla") is None:
        pytest.skip("torch_xla is not installed (pip install torch_xla==2.9.0)")
    if plan.tpu_compiler_missing():
        pytest.skip(plan.tpu_compiler_missing())  # test_plan_compiles_for_v5e_8 installs it
    flash, gmm = tmp_path / "flash.pb", tmp_path / "gmm.pb"
    from child_env import python_path

    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": python_path()}
    proc = subprocess.run([sys.executable, "-c", _FLASH, str(flash), str(gmm)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = flash.read_bytes()
    assert data.count(b"tpu_custom_call") == 3
    result = plan.compile_for_topology(data, plan.parse_topology("v5e-8"))
    assert result["fits"] and result["flops"] > 0 and result["peak_bytes"] > 0
    data = gmm.read_bytes()
    assert data.count(b"tpu_custom_call") == 3  # gmm forward; gmm (dx) and tgmm (dW) backward
    result = plan.compile_for_topology(data, plan.parse_topology("v5e-8"))
    assert result["fits"] and result["peak_bytes"] > 0


_CHECKPOINT = """
import json, sys, torch, torch_xla
import lit_gpt.xla as lx
import lit_gpt.xla.scan as scan_module
from lit_gpt import lora
from lit_gpt.utils import chunked_cross_entropy
from torch_xla.distributed.fsdp import checkpoint_module

CONFIG = lora.Config(block_size=32, vocab_size=128, n_layer=3, n_head=4, n_query_groups=2, n_embd=32,
                     intermediate_size=64, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", lora_r=2,
                     lora_alpha=4, lora_dropout=0.0, lora_query=True, lora_value=True, lora_mlp=True)

def run(fabric, wrap):
    torch.manual_seed(0)
    model = lora.GPT(CONFIG)
    model.apply(model._init_weights)
    for name, p in model.named_parameters():  # LoRA's B starts at zero: give it values that matter
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.3)
    lora.mark_only_lora_as_trainable(model)
    model = model.to(fabric.device)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    fabric.strategy.activation_checkpointing = wrap is not None
    saved = scan_module.checkpoint_block  # the strategy's wrapper, or torch_xla's own (the unchanged path)
    scan_module.checkpoint_block = {"torch_xla": checkpoint_module}.get(wrap, saved)
    try:
        wrapped, opt = fabric.setup(model, opt)
    finally:
        scan_module.checkpoint_block = saved
    x = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    inp, tgt = lx.shard_batch(fabric, (x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    loss = chunked_cross_entropy(wrapped(inp), tgt)
    fabric.backward(loss)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    # frozen weights that the step would write out (their value is no longer their own data)
    pending = sum(torch_xla._XLAC._check_tensor_need_materialization(frozen))
    # one graph for the loss and all the gradients (reading each alone compiles a graph per tensor: minutes)
    torch_xla.sync()
    grads = {n: p.grad.detach().cpu().flatten().tolist() for n, p in model.named_parameters() if p.requires_grad}
    return {"loss": loss.item(), "grads": grads, "frozen_written": pending, "frozen": len(frozen)}

fabric = lx.make_fabric()
out = fabric.launch(lambda fabric: {w: run(fabric, w) for w in ("none", "torch_xla", "block")})
open(sys.argv[1], "w").write(json.dumps(out))
"""


@pytest.mark.slow
def test_checkpoint_block_leaves_frozen_weights_out_of_the_step(tmp_path):
    """Activation checkpointing under LoRA (`lit_gpt.xla.scan.checkpoint_block`): torch_xla's checkpoint puts its
    optimization barrier on all of a block's weights in place, so every frozen weight of a checkpointed block becomes
    a new value the step writes out (an undonated buffer per weight: ~0.05 GiB per chip per block on Llama-3.1-70B);
    the strategy's wrapper leaves the frozen weights as they were, with the same loss and gradients as torch_xla's
    checkpoint and as no checkpointing (1 XLA:CPU device). The plan's drop: test_plan_compiles_for_v5e_8."""
    if importlib.util.find_spec("torch_xla") is None:
        pytest.skip("torch_xla is not installed (pip install torch_xla==2.9.0)")
    from child_env import python_path
    from tolerance import fp32_tolerance, longest_reduction

    out = tmp_path / "checkpoint.json"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": python_path()}
    proc = subprocess.run([sys.executable, "-c", _CHECKPOINT, str(out)], env=env, capture_output=True, text=True,
                          timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(out.read_text())
    none, torch_xla, block = r["none"], r["torch_xla"], r["block"]
    # blocks 2 and 3 are checkpointed (block 1's input, the frozen embedding's, needs no gradient): their frozen
    # tensors (5 matrices, 2 norms each) come back as new values under torch_xla's checkpoint, none under the strategy's
    assert none["frozen_written"] == 0 and torch_xla["frozen_written"] == 14
    assert block["frozen_written"] == 0
    n = longest_reduction(_checkpoint_config(), 16)
    for other in (torch_xla, block):
        assert other["loss"] == pytest.approx(none["loss"], abs=fp32_tolerance(n, abs(none["loss"])))
        for name, g in none["grads"].items():
            bound = fp32_tolerance(n, max(map(abs, g)))
            assert max(abs(a - b) for a, b in zip(other["grads"][name], g)) <= bound, name
    assert any(max(map(abs, g)) > 1e-3 for g in none["grads"].values())  # the gradients are not all ~zero


def _checkpoint_config():
    """The worker's model config (for the tolerance: its longest reduction)."""
    from lit_gpt import lora

    return lora.Config(block_size=32, vocab_size=128, n_layer=3, n_head=4, n_query_groups=2, n_embd=32,
                       intermediate_size=64, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", lora_r=2)
