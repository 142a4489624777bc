"""--rope_scaling on the XLA generate recipe (xla/generate/base.py, 1 XLA:CPU device): greedy text past a tiny
checkpoint's context (16 positions) with the context doubled equals what the CPU loop generates with the same
scaling; without the flag, one error line."""

import json
from pathlib import Path

import pytest
from fork_server import run_captured

REPO = Path(__file__).resolve().parents[2]
ORIGINAL = 16  # the tiny checkpoint's context
NEW = 24  # new tokens: 5 + 24 > 16
TIMEOUT = 600


@pytest.mark.slow  # one XLA process (imports, 2 compilations) and one that fails before loading: ~30 s on 2 cores
def test_xla_generate_extends_the_context_like_the_cpu_loop(smollm2_dir, tmp_path, xla_env, xla_forks):
    import torch
    from tiny import make_tiny_checkpoint

    from lit_gpt.generate import generate
    from lit_gpt.loading import load_model, scale_rope
    from lit_gpt.recipes.generate import GenerationArgs, check_request

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", smollm2_dir, block_size=ORIGINAL)
    linear = {"type": "linear", "factor": 2}
    base = [str(REPO / "xla" / "generate" / "base.py"), "--checkpoint_dir", str(ckpt), "--prompt",
            "The capital of France is", "--prompt_style", "raw", "--temperature", "0", "--max_new_tokens", str(NEW)]
    # a process of its own, forked from the XLA fork server (tests/conftest.py `xla_forks`: the imports done)
    proc = run_captured(xla_forks, [*base, "--rope_scaling", json.dumps(linear)], REPO, xla_env(1), timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    request = check_request(GenerationArgs("The capital of France is", ckpt, max_new_tokens=NEW, temperature=0.0,
                                           prompt_style="raw", rope_scaling=linear))
    model = scale_rope(load_model(ckpt), linear)
    with torch.no_grad():
        new = generate(model, request.encoded, NEW, temperature=0.0, stop_ids=request.stop_ids)
    assert request.encoded.numel() + new.numel() > ORIGINAL  # past the checkpoint's own context
    assert request.text(new.tolist()) in proc.stdout
    refused = run_captured(xla_forks, base, REPO, xla_env(1), timeout=TIMEOUT)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode != 0 and lines[-1].startswith("error:") and "block_size 16" in lines[-1], refused.stderr
