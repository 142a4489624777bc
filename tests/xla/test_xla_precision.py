"""Every XLA finetuning method on checkpoints stored in fp32, bf16 and fp16, under every precision the XLA recipes
accept (32-true, bf16-true, bf16-mixed), on XLA:CPU (one device: the dtype handling is the staged loader's and
the precision plugin's, the same on any mesh; tests/xla/test_xla_finetune.py covers 8 devices): it trains (finite loss) and exports its trained
weights in the precision's dtype. The Hub serves bf16 checkpoints; the GGUF converter writes fp32. The 27 runs (-m slow;
the default suite runs 3 that cover every method, dtype and precision) go through the recipes' `setup` in one
process (the XLA runtime starts once)."""

import json
from pathlib import Path

import pytest
from fork_server import run_captured
from words import alpaca_rows, make_word_checkpoint

REPO = Path(__file__).resolve().parents[2]

DRIVER = r"""
import importlib.util, json, math, shutil, sys
from pathlib import Path
import torch
from lit_gpt.args import DataArgs, EvalArgs, TrainArgs

repo, src, data_dir, out = (Path(a) for a in sys.argv[1:5])
combinations = json.loads(sys.argv[5])  # [method, stored dtype, precision]
from lit_gpt.weights import find_weights, load_weights, save_weights
state = load_weights(find_weights(src))
stored = {}
for name, dtype in {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.items():
    d = out / f"ckpt_{name}" / src.name
    shutil.copytree(src, d)
    find_weights(d).unlink()
    save_weights({k: v.to(dtype) for k, v in state.items()}, d)
    stored[name] = d
methods = {"full": {}, "lora": dict(lora_r=2, lora_alpha=4), "adapter": dict(adapter_start_layer=0)}
results = {}
for method, kwargs in methods.items():
    spec = importlib.util.spec_from_file_location(f"xla_{method}", repo / "xla/finetune" / f"{method}.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    for dtype, checkpoint_dir in stored.items():
        for precision in ("32-true", "bf16-true", "bf16-mixed"):
            if [method, dtype, precision] not in combinations:
                continue
            run = out / f"{method}-{dtype}-{precision}"
            recipe.setup(checkpoint_dir=checkpoint_dir, out_dir=run, precision=precision, accelerator="cpu",
                         data=DataArgs(data_dir=data_dir, pad_pow2=True),
                         train=TrainArgs(global_batch_size=8, micro_batch_size=1, max_steps=1, save_interval=None,
                                         log_interval=1),
                         eval=EvalArgs(interval=1000, final_validation=False, max_new_tokens=0), **kwargs)
            from lit_gpt.weights import load_weights

            weights = load_weights(next((run / "final").glob("lit_model*.safetensors")))
            import csv
            with open(run / "logs" / "csv" / "version_0" / "metrics.csv") as f:
                losses = [float(r["loss"]) for r in csv.DictReader(f) if r.get("loss")]
            results[run.name] = {"dtypes": sorted({str(t.dtype) for t in weights.values()}), "losses": losses}
(out / "results.json").write_text(json.dumps(results))
"""


METHODS, DTYPES = ("full", "lora", "adapter"), ("fp32", "bf16", "fp16")
PRECISIONS = ("32-true", "bf16-true", "bf16-mixed")
EVERY = [[m, d, p] for m in METHODS for d in DTYPES for p in PRECISIONS]
# the default suite's covering subset: every method, every stored dtype and every precision once (a Latin square's
# diagonal: the Hub's bf16 file under the CPU and XLA default 32-true, with LoRA); -m slow runs all 27
COVERING = [["full", "fp32", "bf16-true"], ["lora", "bf16", "32-true"], ["adapter", "fp16", "bf16-mixed"]]


@pytest.mark.parametrize("combinations", [pytest.param(COVERING, id="covering"),
                                          pytest.param(EVERY, id="every", marks=pytest.mark.slow)])
def test_every_method_on_every_stored_dtype_and_precision(xla_env, tmp_path, combinations, forks, xla_forks):
    tiny_dir = make_word_checkpoint(tmp_path / "tiny-words")
    (tmp_path / "alpaca.json").write_text(json.dumps(alpaca_rows()[:20]))
    # processes of their own, forked from the fork servers (tests/conftest.py `forks`, `xla_forks`: the imports done)
    prep = run_captured(
        forks, [str(REPO / "scripts/prepare_alpaca.py"), "--checkpoint_dir", str(tiny_dir),
                "--data_file", str(tmp_path / "alpaca.json"), "--destination_path", str(tmp_path / "data"),
                "--val_split_fraction", "0.2"], REPO, xla_env(1),
    )
    assert prep.returncode == 0, prep.stderr
    proc = run_captured(xla_forks, ["-c", DRIVER, str(REPO), str(tiny_dir), str(tmp_path / "data"), str(tmp_path),
                                    json.dumps(combinations)], REPO, xla_env(1), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted(results) == sorted("-".join(c) for c in combinations)
    for name, r in results.items():
        precision = name.split("-", 2)[2]
        assert r["dtypes"] == (["torch.bfloat16"] if precision == "bf16-true" else ["torch.float32"]), name
        assert len(r["losses"]) == 1 and all(l == l and abs(l) < 1e4 for l in r["losses"]), (name, r)
