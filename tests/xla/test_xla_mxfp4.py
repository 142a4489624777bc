"""gpt-oss's MXFP4 experts on XLA:CPU: the staged loader (lit_gpt.xla.loader) places a converted checkpoint's packed
experts as they are (uint8 blocks and scales, sharded as the expert weights they stand for), and
`xla/generate/base.py --quantize mxfp4` and the eval/serve model loader (`load_eval_model(accelerator="xla",
quantize="mxfp4")`) give the CPU's `--quantize mxfp4` greedy tokens; a decoded (earlier) checkpoint packs on the way,
and without --quantize a packed checkpoint decodes on the way. 1 device by default; 8 under -m slow.

Every XLA run is its own process (the runtime reads PJRT_DEVICE / CPU_NUM_DEVICES once), forked from the XLA fork
server and started together by one fixture."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from fork_server import Captured
from test_xla_generate import _finish  # a started process's stdout and log, failing the test if it failed

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 900
NEW_TOKENS = 8
RECIPE_TEST = "test_xla_generate_recipe_quantize_mxfp4_prints_the_cpu_recipes_text"

# the eval / serve loader on XLA (what eval/lm_eval.py, eval/perplexity.py and serve/base.py load with
# --accelerator xla --quantize mxfp4), then the loop with XLA's runtime, as xla/generate/base.py runs it
DRIVER = r"""
import json, sys
import torch
from lit_gpt.generate import timed_generate
from lit_gpt.mxfp4 import MXFP4ExpertLinear
from lit_gpt.recipes.evaluate import load_eval_model

packed_dir, decoded_dir, prompt, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
cases = {"packed": (packed_dir, "mxfp4"), "decoded_file": (decoded_dir, "mxfp4"), "unquantized": (packed_dir, None)}
results = {}
for name in sys.argv[5].split(","):
    folder, quantize = cases[name]
    em = load_eval_model(folder, accelerator="xla", precision="32-true", quantize=quantize)
    experts = [m for m in em.gpt.modules() if isinstance(m, MXFP4ExpertLinear)]
    import torch_xla
    # the names without FSDPv2's per-block wrapper
    tensors = [(n.replace("_orig_module.", ""), t) for n, t in [*em.gpt.named_parameters(), *em.gpt.named_buffers()]]
    shardings = {n: torch_xla._XLAC._get_xla_sharding_spec(t) for n, t in tensors
                 if n.startswith("transformer.h.0.mlp.experts.fc_1.")}
    g = timed_generate(em.model, torch.tensor(prompt), %d, em.runtime)
    results[name] = {"tokens": g.tokens.tolist(), "packed": len(experts),
                     "dtypes": sorted({str(m.blocks.dtype) + "@" + m.blocks.device.type for m in experts}),
                     "shardings": shardings}
json.dump(results, open(out, "w"))
""" % NEW_TOKENS


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny gpt-oss word checkpoint as conversion writes one (experts packed: MXFP4 blocks and scales), and the
    same model with its experts decoded (an earlier conversion's file)."""
    from test_moe_mxfp4 import _mxfp4_valued
    from words import make_word_checkpoint

    from lit_gpt.loading import load_model
    from lit_gpt.mxfp4 import pack_experts_mxfp4
    from lit_gpt.weights import load_weights, save_weights

    root = tmp_path_factory.mktemp("xla_mxfp4")
    packed = make_word_checkpoint(root / "packed", family="gpt_oss")
    decoded = make_word_checkpoint(root / "decoded", family="gpt_oss")
    model = _mxfp4_valued(load_model(packed))
    save_weights(model.state_dict(), decoded)
    pack_experts_mxfp4(model)
    save_weights(model.state_dict(), packed)
    assert any(k.endswith(".blocks") for k in load_weights(packed / "lit_model.safetensors", packed=True))
    return packed, decoded


def _cli(checkpoint_dir: Path, *extra: str) -> List[str]:
    from words import GEN_PROMPT

    return [sys.executable, str(REPO / "xla/generate/base.py"), "--checkpoint_dir", str(checkpoint_dir), "--prompt",
            GEN_PROMPT, "--prompt_style", "raw", "--temperature", "0", "--max_new_tokens", str(NEW_TOKENS), *extra]


@pytest.fixture(scope="module")
def runs(checkpoints, xla_env, tmp_path_factory, selected_devices, request, xla_forks):
    """Every XLA process the selected tests read, started at once: {name: Captured}."""
    from lit_gpt.tokenizer import Tokenizer
    from words import GEN_PROMPT

    packed, decoded = checkpoints
    out = tmp_path_factory.mktemp("xla_mxfp4_runs")
    prompt = Tokenizer(packed).encode(GEN_PROMPT).tolist()
    procs: Dict[str, Captured] = {}
    logs = {}

    def start(name: str, cmd: List[str], env: dict) -> None:
        logs[name] = out / f"{name}.log"
        procs[name] = Captured(xla_forks, cmd[1:], REPO, env, out / f"{name}.out", logs[name])

    selected = {item.name for item in request.session.items if item.module is request.module}
    for devices in selected_devices(request):
        # the default suite's run: the packed file and the decoded one, packed (one compiled pair of graphs); under
        # -m slow also the packed file decoded for a run without --quantize (its own graphs: ~5 s more), whose
        # tensors the loader's decoding gives are checked without XLA in tests/test_moe_mxfp4.py
        cases = "packed,decoded_file" + (",unquantized" if devices > 1 else "")
        start(f"driver{devices}", [sys.executable, "-c", DRIVER, str(packed), str(decoded), json.dumps(prompt),
                                   str(out / f"driver{devices}.json"), cases], xla_env(devices))
        if f"{RECIPE_TEST}[{devices}]" in selected:  # a slow test: its process only when it runs
            start(f"recipe{devices}", _cli(packed, "--quantize", "mxfp4"), xla_env(devices))
    yield {"procs": procs, "logs": logs, "out": out, "prompt": prompt}
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


def _cpu_mxfp4_tokens(checkpoint_dir: Path, prompt: List[int]) -> List[int]:
    """What generate/base.py --quantize mxfp4 computes on the CPU (its `generate` call, greedy)."""
    from lit_gpt.generate import generate
    from lit_gpt.loading import load_model

    return generate(load_model(checkpoint_dir, "mxfp4"), torch.tensor(prompt), NEW_TOKENS, temperature=0.0).tolist()


@pytest.mark.parametrize("devices", [1, 8])
def test_packed_experts_on_xla_give_the_cpu_mxfp4_greedy_tokens(runs, checkpoints, devices):
    _finish(runs, f"driver{devices}")
    got = json.loads((runs["out"] / f"driver{devices}.json").read_text())
    expected = _cpu_mxfp4_tokens(checkpoints[0], runs["prompt"])
    assert all(r["tokens"] == expected for r in got.values()), (got, expected)
    # packed on the devices: the file's uint8 bytes (3 projections x 2 MoE layers), from the packed file as it is
    # and from the decoded file packed on the way; without --quantize the packed file decodes to float experts
    assert got["packed"]["packed"] == got["decoded_file"]["packed"] == 6
    assert got["packed"]["dtypes"] == got["decoded_file"]["dtypes"] == ["torch.uint8@xla"]
    if devices > 1:
        assert got["unquantized"]["packed"] == 0  # blocks and scales sharded as the fc_1 weight of the unquantized load (FSDPv2: largest dim)
        layer = "transformer.h.0.mlp.experts.fc_1"
        weight = got["unquantized"]["shardings"][f"{layer}.weight"]
        assert weight.startswith("{devices=[") and got["packed"]["shardings"][f"{layer}.blocks"].startswith(
            weight.split("]")[0]), got
        assert got["packed"]["shardings"][f"{layer}.scales"].split("]")[0] == weight.split("]")[0], got


@pytest.mark.slow  # a recipe process of its own (~8 s); the driver above runs the same loader and loop by default
@pytest.mark.parametrize("devices", [1, 8])
def test_xla_generate_recipe_quantize_mxfp4_prints_the_cpu_recipes_text(runs, checkpoints, devices, capsys,
                                                                         monkeypatch):
    """`xla/generate/base.py --quantize mxfp4`: the CPU recipe's text with --quantize mxfp4, the experts packed."""
    from test_moe_mxfp4 import _run_recipe
    from words import GEN_PROMPT

    text, log = _finish(runs, f"recipe{devices}")
    code, cpu_text, err = _run_recipe(capsys, monkeypatch, "generate/base.py", "--checkpoint_dir", str(checkpoints[0]),
                                      "--prompt", GEN_PROMPT, "--prompt_style", "raw", "--temperature", "0",
                                      "--max_new_tokens", str(NEW_TOKENS), "--accelerator", "cpu", "--quantize",
                                      "mxfp4")
    assert code == 0, err
    assert text == cpu_text and text.strip(), (text, cpu_text)
    assert "Packed 6 expert projections as MXFP4" in log, log[-2000:]


def test_xla_generate_refuses_a_cpu_quantization_in_one_line(checkpoints, capsys, monkeypatch):
    """The torchao / bitsandbytes modes are CPU/CUDA kernels: refused before the XLA runtime starts."""
    from test_moe_mxfp4 import _run_recipe

    code, _, err = _run_recipe(capsys, monkeypatch, "xla/generate/base.py", "--checkpoint_dir", str(checkpoints[0]),
                               "--prompt", "hi", "--quantize", "torchao.int8wo")
    lines = err.strip().splitlines()
    assert code == 1 and "Traceback" not in err, err
    assert lines[-1].startswith("error: --quantize torchao.int8wo runs on the CPU and CUDA, not on XLA"), err


@pytest.mark.slow  # two training runs (XLA ~30 s with its compilations, CPU ~4 s)
def test_xla_lora_quantize_mxfp4_trains_with_the_experts_packed_as_the_cpu_recipe_does(checkpoints, tmp_path, xla_env,
                                                                                       xla_forks, capsys):
    """`xla/finetune/lora.py --quantize mxfp4` on 1 XLA:CPU device: the experts placed packed and frozen, the step
    losses of `finetune/lora.py --quantize mxfp4` on the CPU (relative 1e-4, as tests/xla/test_xla_finetune.py holds
    the two recipes), a step checkpoint with the packed buffers written (step 2), and a LoRA file of LoRA matrices
    only; --lora_experts and --scan_layers true with it are refused in one line before anything runs."""
    import contextlib
    import io

    from test_finetune import read_metrics
    from test_moe_mxfp4 import LORA_ARGS
    from variants import run_recipe
    from words import GEN_PROMPT, WORDS

    from lit_gpt.weights import load_weights

    packed = checkpoints[0]
    rows = [{"instruction": GEN_PROMPT, "input": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n)),
             "output": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n))} for i, n in enumerate([1, 6, 3, 9] * 2)]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        run_recipe("scripts/prepare_alpaca.py", "--checkpoint_dir", str(packed), "--data_file",
                   str(tmp_path / "rows.json"), "--destination_path", str(tmp_path / "data"),
                   "--val_split_fraction", "0")
    args = ["--checkpoint_dir", str(packed), "--data.data_dir", str(tmp_path / "data"), *LORA_ARGS, "--quantize",
            "mxfp4"]
    log = tmp_path / "xla.log"
    proc = Captured(xla_forks, [str(REPO / "xla/finetune/lora.py"), *args, "--out_dir", str(tmp_path / "xla")], REPO,
                    xla_env(1), tmp_path / "xla.out", log)
    with contextlib.redirect_stdout(io.StringIO()):
        run_recipe("finetune/lora.py", *args, "--out_dir", str(tmp_path / "cpu"))
    try:
        proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the XLA LoRA run timed out")
    assert proc.returncode == 0, log.read_text()[-4000:]
    cpu, xla = read_metrics(tmp_path / "cpu"), read_metrics(tmp_path / "xla")
    assert sorted(xla) == sorted(cpu) == [1, 2], (xla, cpu)
    assert all(abs(xla[s] - cpu[s]) <= 1e-4 * abs(cpu[s]) for s in cpu), (xla, cpu)
    assert any((tmp_path / "xla").glob("step-000002*")), sorted(p.name for p in (tmp_path / "xla").iterdir())
    from lit_gpt.loading import load_model
    from lit_gpt.mxfp4 import packed_bytes

    expected = f"Experts kept packed in MXFP4, frozen: {packed_bytes(load_model(packed, 'mxfp4')):,} bytes"
    assert expected in log.read_text(), log.read_text()[-3000:]
    saved = load_weights(tmp_path / "xla" / "final" / "lit_model.lora.safetensors")
    assert saved and all("lora_" in k for k in saved)

    capsys.readouterr()
    for flag in ("--lora_experts", "--scan_layers"):  # the experts frozen packed; buffers torch_xla's scan cannot take
        with pytest.raises(SystemExit) as exc:
            run_recipe("xla/finetune/lora.py", *args, flag, "true", "--out_dir", str(tmp_path / "refused"))
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 1 and not (tmp_path / "refused").exists()
        assert err.startswith(f"error: {flag}") and "does not combine with --quantize mxfp4" in err, err
