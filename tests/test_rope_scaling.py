"""--rope_scaling (lit_gpt.config.with_rope_scaling, through load_config): a checkpoint's context extended by RoPE
scaling the user names. Each type's tables equal transformers' rotary embedding (rope_init_functions) for the same
config; greedy generation past the checkpoint's context equals transformers' model configured with the same scaling;
what cannot extend is refused in one line."""

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_hf import VOCAB, randomize_  # noqa: E402

from lit_gpt import GPT  # noqa: E402
from lit_gpt.config import Config, load_config, with_rope_scaling  # noqa: E402
from lit_gpt.convert import convert_hf_checkpoint  # noqa: E402
from lit_gpt.generate import generate  # noqa: E402
from lit_gpt.model import build_rope_cache  # noqa: E402
from lit_gpt.utils import LitError  # noqa: E402
from lit_gpt.weights import find_weights, load_weights  # noqa: E402

ORIGINAL = 16  # the tiny checkpoint's context
USER = {
    "linear": {"type": "linear", "factor": 4},
    "yarn": {"type": "yarn", "factor": 4},
    "llama3": {"type": "llama3", "factor": 4, "low_freq_factor": 1.0, "high_freq_factor": 2.0},
}


def hf_rope(kind: str) -> dict:
    """transformers' rope parameters for the same scaling: the original context named, the extended one the model's."""
    user = dict(USER[kind])
    return {"rope_type": user.pop("type"), **user, "original_max_position_embeddings": ORIGINAL}


def hf_llama(rope_scaling=None, max_position_embeddings=ORIGINAL):
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=96, rope_theta=10000.0,
                                    max_position_embeddings=max_position_embeddings, rope_scaling=rope_scaling)


@pytest.mark.parametrize("kind", list(USER))
def test_each_type_equals_transformers_rotary_embedding(kind):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = with_rope_scaling(Config(n_layer=1, n_head=4, n_embd=64, block_size=ORIGINAL, vocab_size=VOCAB),
                               USER[kind], 4 * ORIGINAL)
    assert config.block_size == 4 * ORIGINAL
    hf = hf_llama(hf_rope(kind), 4 * ORIGINAL)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    freqs = torch.outer(torch.arange(4 * ORIGINAL).float(), inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = build_rope_cache(4 * ORIGINAL, config)
    torch.testing.assert_close(cos, emb.cos() * attention_factor)
    torch.testing.assert_close(sin, emb.sin() * attention_factor)
    assert (kind == "yarn") == (attention_factor != 1.0)  # yarn's attention factor is part of what is compared


@pytest.mark.parametrize("kind", ["yarn", "llama3"])
@torch.no_grad()
def test_generation_past_the_checkpoints_context_equals_transformers(kind, tmp_path):
    """A checkpoint of context 16, extended x4: a 20-token prompt and 12 new tokens (32 positions)."""
    hf = transformers.AutoModelForCausalLM.from_config(hf_llama(), attn_implementation="eager", dtype=torch.float32)
    randomize_(hf, seed=4)
    hf.eval().save_pretrained(tmp_path)
    convert_hf_checkpoint(tmp_path)
    config = load_config(tmp_path, rope_scaling=USER[kind], max_seq_length=32)
    assert (config.block_size, config.rope_scaling["type"]) == (4 * ORIGINAL, kind)
    ours = GPT(config)
    ours.load_state_dict(load_weights(find_weights(tmp_path)))
    theirs = transformers.AutoModelForCausalLM.from_config(hf_llama(hf_rope(kind), 4 * ORIGINAL),
                                                            attn_implementation="eager", dtype=torch.float32)
    theirs.load_state_dict(hf.state_dict())
    prompt = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1))
    expected = theirs.eval().generate(prompt.view(1, -1), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                      pad_token_id=0)[0, 20:]
    assert generate(ours.eval(), prompt, 12).tolist() == expected.tolist()
    # the scaling changes the tokens: the comparison above would see a table left unscaled
    unscaled = transformers.AutoModelForCausalLM.from_config(hf_llama(None, 4 * ORIGINAL), attn_implementation="eager",
                                                              dtype=torch.float32)
    unscaled.load_state_dict(hf.state_dict())
    assert unscaled.eval().generate(prompt.view(1, -1), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                    pad_token_id=0)[0, 20:].tolist() != expected.tolist()


def test_what_cannot_extend_is_refused_in_one_line(tmp_path):
    Config(n_layer=1, n_head=4, n_embd=64, block_size=ORIGINAL, vocab_size=VOCAB).save(tmp_path)
    cases = {
        "exceeds what --rope_scaling gives (16 x 4 = 64)": dict(rope_scaling={"type": "yarn", "factor": 4},
                                                                max_seq_length=65),
        "type 'dynamic' cannot extend the context exactly": dict(rope_scaling={"type": "dynamic", "factor": 4}),
        'needs a "factor" > 1': dict(rope_scaling={"type": "linear"}),
        "does not take beta_fast": dict(rope_scaling={"type": "linear", "factor": 2, "beta_fast": 8}),
    }
    for message, kwargs in cases.items():
        with pytest.raises(LitError, match=re.escape(message)) as e:
            load_config(tmp_path, **kwargs)
        assert "\n" not in str(e.value)
    own = Config.from_name("Llama-3.1-8B")  # a family that extends with its own scaling already
    with pytest.raises(ValueError, match="has its own RoPE scaling .'llama3'. up to its context 131072"):
        with_rope_scaling(own, {"type": "yarn", "factor": 2})
    nope = Config(n_layer=2, n_head=4, n_embd=64, block_size=ORIGINAL, layers_without_rope=[0, 1])
    with pytest.raises(ValueError, match="has no RoPE to scale"):
        with_rope_scaling(nope, {"type": "yarn", "factor": 2})


@pytest.mark.slow  # the recipe end to end, 4 runs in process (~8 s on a loaded 2-core machine)
def test_generate_recipe_extends_the_context_with_the_flag(smollm2_dir, tmp_path, capsys, monkeypatch):
    """generate/base.py --rope_scaling: 24 new tokens past a tiny checkpoint's context (16) with the context doubled,
    the text the library gives for the scaled model; without enough factor (or with a type that cannot extend
    exactly) one error line."""
    from test_generate_recipes import assert_one_line_error, run_in_process
    from tiny import make_tiny_checkpoint

    from lit_gpt.loading import load_model, scale_rope
    from lit_gpt.recipes.generate import GenerationArgs, check_request

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", smollm2_dir, block_size=ORIGINAL)
    prompt = "The capital of France is"  # 5 tokens: 5 + 24 > 16
    base = ["--checkpoint_dir", str(ckpt), "--prompt", prompt, "--prompt_style", "raw", "--temperature", "0",
            "--max_new_tokens", "24", "--compile", "none"]
    linear = {"type": "linear", "factor": 2}
    proc = run_in_process(capsys, monkeypatch, *base, "--rope_scaling", json.dumps(linear))
    assert proc.returncode == 0, proc.stderr
    request = check_request(GenerationArgs(prompt, ckpt, max_new_tokens=24, temperature=0.0, prompt_style="raw",
                                           rope_scaling=linear))
    model = scale_rope(load_model(ckpt), linear)
    assert model.config.block_size == 2 * ORIGINAL
    new = generate(model, request.encoded, 24, temperature=0.0, stop_ids=request.stop_ids)
    assert request.encoded.numel() + new.numel() > ORIGINAL  # past the checkpoint's own context
    assert request.text(new.tolist()) in proc.stdout
    assert_one_line_error(run_in_process(capsys, monkeypatch, *base), "block_size 16")
    assert_one_line_error(run_in_process(capsys, monkeypatch, *base, "--rope_scaling", '{"type": "linear", "factor": 1.1}'),
                          "block_size 17")
    assert_one_line_error(run_in_process(capsys, monkeypatch, *base, "--rope_scaling", '{"type": "dynamic", "factor": 2}'),
                          "type 'dynamic' cannot extend the context exactly")


# --- finetune and serve: the same flag ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def short_context(smollm2_dir, tmp_path_factory):
    """A tiny checkpoint with a 32-token context and prepared rows of up to 64 tokens (the real tokenizer)."""
    from test_finetune import alpaca_rows
    from tiny import make_tiny_checkpoint

    from lit_gpt import data

    root = tmp_path_factory.mktemp("rope_ft")
    checkpoint = make_tiny_checkpoint(root / "ckpt", smollm2_dir, block_size=32)
    src = root / "alpaca.json"
    src.write_text(json.dumps(alpaca_rows(16)))
    records, bad = data.read_records(src)
    rows, bad2 = data.records_to_rows(records, data.instruction_rows())
    data.prepare(rows, bad + bad2, checkpoint_dir=checkpoint, destination=root / "prepared", source=str(src),
                 max_seq_length=64, val_split_fraction=0.25, seed=1)
    return checkpoint, root / "prepared"


def test_finetune_trains_past_the_checkpoints_context_with_the_flag_only(short_context, tmp_path):
    """finetune/lora.py --train.max_seq_length 64 on a 32-token checkpoint: refused in one line without
    --rope_scaling and past what it gives; trains with a factor of 2 (the same flag as generate and serve)."""
    from test_finetune import load_recipe, run_args

    checkpoint, data_dir = short_context
    recipe = load_recipe("lora")
    args = dict(steps=2, micro=2, global_batch=2, save_interval=2, eval_interval=2)

    def train(length, scaling, out, resume=False):
        base = run_args("lora", checkpoint, data_dir, tmp_path / out, **args)
        base["train"].max_seq_length = length
        return recipe.setup(**base, rope_scaling=scaling, resume=resume)

    with pytest.raises(LitError, match="exceeds the model's context length 32"):
        train(64, None, "plain")
    with pytest.raises(LitError, match=re.escape("exceeds what --rope_scaling gives (32 x 2 = 64)")):
        train(96, {"type": "linear", "factor": 2}, "too_long")
    train(64, {"type": "linear", "factor": 2}, "scaled")
    assert (tmp_path / "scaled" / "final" / "lit_model.lora.safetensors").is_file()
    # a resumed run must give the flag the run started with (recorded in its finetune.json): one line naming both
    with pytest.raises(LitError, match=re.escape('started with --rope_scaling {"type": "linear", "factor": 2}, this'
                                                 ' one has --rope_scaling {"type": "linear", "factor": 3}')):
        train(64, {"type": "linear", "factor": 3}, "scaled", resume="auto")
    train(64, {"type": "linear", "factor": 2}, "scaled", resume="auto")  # the same flag: it resumes (at its end)


def test_a_resumed_run_checks_the_rope_scaling_it_started_with(tmp_path):
    """check_same_run: --rope_scaling given, changed or left out on resume is refused in one line naming both; runs
    that recorded none (without the flag, or from before it was recorded) resume without it."""
    from lit_gpt.checkpoints import check_same_run

    linear = {"type": "linear", "factor": 2.0}
    run = {"method": "lora", "train": {"max_seq_length": 64}}
    check_same_run({**run, "rope_scaling": linear}, {**run, "rope_scaling": dict(linear)}, tmp_path)
    check_same_run(run, dict(run), tmp_path)
    for saved, current in (({**run, "rope_scaling": linear}, run), (run, {**run, "rope_scaling": linear}),
                           ({**run, "rope_scaling": linear}, {**run, "rope_scaling": {"type": "yarn", "factor": 2.0}})):
        with pytest.raises(LitError) as e:
            check_same_run(saved, current, tmp_path)
        message = str(e.value)
        assert "\n" not in message and message.count("--rope_scaling") == 3
        for side in (saved, current):
            assert json.dumps(side.get("rope_scaling")) in message


def test_serve_loads_the_model_with_the_scaled_rope(short_context):
    """serve/base.py --rope_scaling: the loaded model's context and RoPE tables are the scaled config's."""
    from lit_gpt.recipes.evaluate import load_eval_model

    checkpoint, _ = short_context
    linear = {"type": "linear", "factor": 2}
    loaded = load_eval_model(checkpoint, accelerator="cpu", precision="32-true", rope_scaling=linear)
    assert loaded.block_size == 64
    expected = GPT(load_config(checkpoint, rope_scaling=linear))
    n = loaded.gpt.cos.size(0)  # the tables are as long as the runtime sets them (the KV cache's length)
    torch.testing.assert_close(loaded.gpt.cos, expected.cos[:n])
    assert not torch.allclose(loaded.gpt.cos, GPT(load_config(checkpoint)).cos[:n])  # the scaling is in them
    with pytest.raises(LitError, match="cannot extend the context exactly"):
        load_eval_model(checkpoint, accelerator="cpu", rope_scaling={"type": "dynamic", "factor": 2})
