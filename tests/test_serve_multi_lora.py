"""Many LoRAs on one base (serve/base.py --lora NAME=PATH, lit_gpt/lora_bank.py, lit_gpt/recipes/serve_loras.py):
the per-row gather equals each adapter merged into the base; a real server (tiny random model, real `openai`
client) answers a mix of base and adapter requests in flight together with each one's own merged model's greedy
tokens; `/v1/models` lists the adapters; an unknown model is a 404; the prefix cache never shares blocks across
adapters; adapters load and unload at run time, and bad files are refused in one line (at start-up and over HTTP)
while the server keeps serving.

One server for the module (started when the module starts, killed when it ends: tests/serve_client.py)."""

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict

import httpx
import openai
import pytest
import torch

from serve_client import ServerProcess
from tolerance import fp32_tolerance, logits_tolerance

# the adapters: different ranks, alphas and adapted layers (a fused qkv part each, the MLP, the projection)
ADAPTERS: Dict[str, Dict[str, Any]] = {
    "alpha": dict(lora_r=4, lora_alpha=8, lora_query=True, lora_value=True, lora_mlp=True),
    "beta": dict(lora_r=2, lora_alpha=16, lora_query=False, lora_key=True, lora_value=False, lora_projection=True),
    "gamma": dict(lora_r=8, lora_alpha=8, lora_query=True, lora_value=True),  # loaded at run time
}
PROMPTS = ["The capital of France is", "Once upon a time, there was a fox who", "def fibonacci(n):"]


def lora_file(base_dir: Path, out: Path, seed: int, base: Any = "record", **variant: Any) -> Path:
    """A LoRA of the checkpoint in `base_dir` with large random A and B (the tiny model's text changes), written by
    the project's export with its base's fingerprint (`base`: "record", None for none, or a record to write)."""
    from lit_gpt import lora
    from lit_gpt.fingerprint import base_record
    from lit_gpt.peft import save_finetuned
    from lit_gpt.weights import load_weights

    model = lora.GPT(lora.Config.from_checkpoint(base_dir, lora_dropout=0.0, **variant))
    model.load_state_dict(load_weights(base_dir / "lit_model.safetensors"), strict=False)
    lora.mark_only_lora_as_trainable(model)  # the file holds A and B only, as finetune/lora.py's does
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if model.peft_filter(n):
                p.copy_(4.0 * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return save_finetuned(model, out, base=base_record(base_dir) if base == "record" else base)


@pytest.fixture(scope="module")
def files(tiny_dir, tmp_path_factory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    out = {name: lora_file(tiny_dir, root / name, seed, **v) for seed, (name, v) in enumerate(ADAPTERS.items())}
    out["foreign"] = lora_file(tiny_dir, root / "foreign", 9, base={"fingerprint": "sha256:00000000deadbeef",
                                                                    "checkpoint_dir": "checkpoints/other"})
    from lit_gpt import adapter
    from lit_gpt.peft import save_finetuned

    out["adapter"] = save_finetuned(adapter.GPT(adapter.Config.from_checkpoint(tiny_dir, adapter_start_layer=0)),
                                    root / "adapter")
    return out


@pytest.fixture(scope="module")
def server(tiny_dir, files):
    process = ServerProcess(tiny_dir, "--lora", f"alpha={files['alpha']}", "--lora", f"beta={files['beta']}",
                            "--max_loras", "3", "--max_lora_rank", "8", "--slots", "4", "--max_seq_length", "96")
    process.start()
    try:
        yield process.ready()
    finally:
        process.stop()


@pytest.fixture(scope="module")
def reference(tiny_dir, files):
    """`reference(name, prompt, n)`: the greedy text of the model a --lora_path server of adapter `name` serves
    (the file merged into the base; None: the base), as the server's completions decode it."""
    from lit_gpt import lora
    from lit_gpt.generate import generate
    from lit_gpt.loading import load_model
    from lit_gpt.peft import load_variant_model
    from lit_gpt.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny_dir)
    models: Dict[Any, Any] = {}

    def get(name: Any, prompt: str, n: int) -> str:
        if name not in models:
            if name is None:
                models[name] = load_model(tiny_dir).eval()
            else:
                merged = load_variant_model(lora.GPT, lora.Config, tiny_dir, files[name])
                lora.merge_lora_weights(merged)
                models[name] = merged.eval()
        ids = generate(models[name], tokenizer.encode(prompt), n, stop_ids=sorted(tokenizer.stop_ids))
        return tokenizer.decode(ids, skip_special_tokens=True)

    return get


def complete(server: ServerProcess, model: str, prompt: str, n: int = 8) -> str:
    r = server.client().completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0.0)
    assert r.model == model
    return r.choices[0].text


# ---------------------------------------------------------------------------------------------- the bank in-process
def test_the_gather_equals_each_adapter_merged(tiny_dir, files):
    """Rows [base, alpha, beta, alpha] in one forward: each row's logits are those of its adapter merged into the
    base (and the base's); an all-base batch takes no update at all."""
    from lit_gpt import lora
    from lit_gpt.loading import load_model
    from lit_gpt.lora_bank import LoRABank
    from lit_gpt.peft import load_finetuned, load_variant_model

    model = load_model(tiny_dir).eval()
    bank = LoRABank.install(model, capacity=2, rank=4, static=False, to_device=lambda t: t)
    for adapter_id, name in ((11, "alpha"), (12, "beta")):
        state, fields = load_finetuned(files[name], "lora")
        bank.write(bank.free_row(), adapter_id, bank.stage(state, lora.Config.from_checkpoint(tiny_dir, **fields)))
    x = torch.randint(0, 49152, (4, 7), generator=torch.Generator().manual_seed(0))
    bank.select([0, 11, 12, 11])
    with torch.no_grad():
        got = model(x)
        expected = [load_model(tiny_dir).eval()(x[:1])]
        for name, row in (("alpha", 1), ("beta", 2), ("alpha", 3)):
            merged = load_variant_model(lora.GPT, lora.Config, tiny_dir, files[name])
            lora.merge_lora_weights(merged)
            expected.append(merged.eval()(x[row: row + 1]))
        for row, e in enumerate(expected):
            # fp32 bound: eps x the longest reduction x the logits' magnitude (tests/tolerance.py)
            torch.testing.assert_close(got[row: row + 1], e, atol=logits_tolerance(model.config, e), rtol=0)
        assert not torch.allclose(expected[0], expected[1]), "the adapter changes nothing: the test would not see it"
        bank.select([0, 0, 0, 0])
        assert bank.index is None  # eager: the base rows skip the update
        assert torch.equal(model(x), load_model(tiny_dir).eval()(x))
        # a ragged forward (a decode step with prompt chunks riding along): sequences of 1, 5, 3 and 1 tokens end to
        # end in one row, each its adapter's, give every banked layer's output of each sequence alone
        ids, lengths = [11, 0, 12, 11], [1, 5, 3, 1]
        for name, layer in bank.layers.items():
            h = torch.randn(1, sum(lengths), layer.in_features, generator=torch.Generator().manual_seed(1))
            bank.select(ids, tokens=lengths)
            got = layer(h)
            alone = []
            for i, part in zip(ids, h.split(lengths, dim=1)):
                bank.select([i])
                alone.append(layer(part))
            alone = torch.cat(alone, dim=1)
            torch.testing.assert_close(got, alone, atol=fp32_tolerance(layer.in_features, alone.abs().max()), rtol=0)
            if layer.live:  # the update is there to see
                assert not torch.allclose(got, layer.base(h), atol=1e-3), name
        assert any(layer.live for layer in bank.layers.values())


def test_the_bank_refuses_what_it_cannot_serve(tiny_dir, files):
    from lit_gpt import lora
    from lit_gpt.loading import load_model
    from lit_gpt.lora_bank import LoRABank
    from lit_gpt.peft import load_finetuned
    from lit_gpt.utils import LitError

    bank = LoRABank.install(load_model(tiny_dir).eval(), capacity=1, rank=2, static=False, to_device=lambda t: t)
    state, fields = load_finetuned(files["alpha"], "lora")
    with pytest.raises(LitError, match="has rank 4, above this server's --max_lora_rank 2"):
        bank.stage(state, lora.Config.from_checkpoint(tiny_dir, **fields))
    state, fields = load_finetuned(files["beta"], "lora")
    config = lora.Config.from_checkpoint(tiny_dir, **fields)
    with pytest.raises(LitError, match="trained biases"):
        bank.stage({**state, "transformer.h.0.attn.qkv.bias": torch.zeros(128)}, config)
    with pytest.raises(LitError, match="do not fit this model's layer"):
        bank.stage({k: v[:, :-1] if k.endswith("lora_A") else v for k, v in state.items()}, config)


def test_block_hashes_are_keyed_by_the_adapter():
    from lit_gpt.recipes.prefix_cache import block_hashes

    ids = list(range(40))
    assert block_hashes(ids) == block_hashes(ids, 0) and len(block_hashes(ids)) == 2
    assert not set(block_hashes(ids, 1)) & set(block_hashes(ids)) and block_hashes(ids, 1) != block_hashes(ids, 2)


def test_repeated_lora_flags_all_count():
    from lit_gpt.recipes.serve_loras import repeatable_lora

    assert repeatable_lora(["--lora", "a=x", "--lora_path", "p", "--lora=b=y"]) == [
        "--lora+", "a=x", "--lora_path", "p", "--lora+=b=y"]


# ---------------------------------------------------------------------------------------------- start-up checks
@pytest.mark.parametrize("case", ["foreign", "adapter", "missing", "no-name", "twice", "base-name", "with-lora-path",
                                  "no-room", "rank"])
def test_bad_lora_flags_are_one_line(tiny_dir, files, case):
    """Refused before any weights are read, in one line that names the adapter, as --lora_path's file is."""
    from lit_gpt.recipes.serve import check_serve_args
    from lit_gpt.utils import LitError

    a, b = f"alpha={files['alpha']}", f"beta={files['beta']}"
    flags, match = {
        "foreign": ({"lora": [f"x={files['foreign']}"]}, "records the base 'checkpoints/other'"),
        "adapter": ({"lora": [f"x={files['adapter']}"]}, "holds adapter weights, not LoRA"),
        "missing": ({"lora": ["x=nowhere/lit_model.lora.safetensors"]}, "not found"),
        "no-name": ({"lora": [str(files["alpha"])]}, "--lora takes NAME=PATH"),
        "twice": ({"lora": [a, a]}, "is given twice"),
        "base-name": ({"lora": [f"tiny-llama={files['alpha']}"]}, "is the base model's name"),
        "with-lora-path": ({"lora": [a], "lora_path": files["beta"]}, "pass one or the other"),
        "no-room": ({"lora": [a, b], "max_loras": 1}, "raise --max_loras"),
        "rank": ({"lora": [a], "max_lora_rank": 2}, "above --max_lora_rank 2"),
    }[case]
    with pytest.raises(LitError, match=match) as caught:
        check_serve_args(checkpoint_dir=tiny_dir, **flags)
    assert "\n" not in str(caught.value)


def test_good_lora_flags_plan(tiny_dir, files):
    from lit_gpt.recipes.serve import check_serve_args

    plan = check_serve_args(checkpoint_dir=tiny_dir, lora=[f"alpha={files['alpha']}", f"beta={files['beta']}"])
    assert (plan.capacity, plan.rank, [n for n, _ in plan.adapters]) == (2, 4, ["alpha", "beta"])
    assert check_serve_args(checkpoint_dir=tiny_dir) is None  # no adapters: no bank, the model as it was


# ---------------------------------------------------------------------------------------------- the server
def test_models_lists_the_adapters(server, files):
    listed = {m.id: m for m in server.client().models.list().data}
    assert set(listed) == {"tiny-llama", "alpha", "beta"}
    assert listed["alpha"].model_extra["parent"] == "tiny-llama"
    assert listed["alpha"].model_extra["root"] == str(files["alpha"])


def test_a_mix_of_base_and_adapters_in_flight_equals_each_alone(server, reference):
    """Base, alpha and beta requests at once (streamed and not, chat's prompt style aside: completions), so that
    their rows share decode steps: each answer is its own merged model's greedy text."""
    asks = [(model, prompt) for prompt in PROMPTS for model in ("tiny-llama", "alpha", "beta")]

    def ask(i: int) -> str:
        model, prompt = asks[i]
        if i % 2:
            return complete(server, model, prompt)
        text = ""
        for chunk in server.client().completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.0,
                                                        stream=True):
            text += chunk.choices[0].text if chunk.choices else ""
        return text

    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(ask, range(len(asks))))
    expected = [reference(None if m == "tiny-llama" else m, p, 8) for m, p in asks]
    assert got == expected
    assert len({got[0], got[1], got[2]}) == 3, "the adapters change nothing: the test would not see them mixed up"


def test_an_unknown_model_is_a_404(server):
    with pytest.raises(openai.NotFoundError) as caught:
        server.client().chat.completions.create(model="gamma", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=2)
    error = caught.value.response.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "'gamma' does not exist" in error["message"] and "'alpha'" in error["message"]


def test_the_prefix_cache_keeps_adapters_apart(server, reference):
    """One long prompt for the base, then for alpha (nothing reused: alpha's keys differ), then for alpha again
    (its blocks reused), each answer its own model's."""
    prompt = "Record 7: " + " ".join(["the dragon and the baker"] * 12)  # > 3 blocks of 16 tokens

    def cached() -> int:
        return server.health()["cached_prompt_tokens"]

    first = cached()
    assert complete(server, "tiny-llama", prompt, 4) == reference(None, prompt, 4)
    base_cached = cached()
    assert complete(server, "alpha", prompt, 4) == reference("alpha", prompt, 4)
    assert cached() == base_cached, "alpha reused the base model's keys and values"
    assert complete(server, "alpha", prompt, 4) == reference("alpha", prompt, 4)
    assert cached() >= base_cached + 48, "alpha's own blocks were not reused"
    assert base_cached >= first


def test_load_and_unload_at_run_time(server, files, reference):
    """vLLM's endpoints: gamma loads (200, listed, answers as its merged model), unloads (then a 404), and loads
    again into the freed place; the other adapters answer as before throughout."""
    root = server.root

    def post(path: str, body: Dict[str, Any]) -> httpx.Response:
        return httpx.post(root + path, json=body, timeout=60, trust_env=False)

    r = post("/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": str(files["gamma"])})
    assert r.status_code == 200 and "gamma" in r.text, r.text
    assert "gamma" in {m.id for m in server.client().models.list().data}
    assert complete(server, "gamma", PROMPTS[0]) == reference("gamma", PROMPTS[0], 8)
    r = post("/v1/unload_lora_adapter", {"lora_name": "gamma"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        complete(server, "gamma", PROMPTS[0])
    r = post("/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": str(files["gamma"])})
    assert r.status_code == 200, r.text
    assert complete(server, "gamma", PROMPTS[1]) == reference("gamma", PROMPTS[1], 8)
    assert complete(server, "beta", PROMPTS[1]) == reference("beta", PROMPTS[1], 8)
    assert post("/v1/unload_lora_adapter", {"lora_name": "gamma"}).status_code == 200


@pytest.mark.parametrize("case", ["foreign", "adapter", "missing", "taken", "base-name", "unload-unknown"])
def test_bad_loads_are_refused_in_one_line(server, files, case):
    """A 4xx with OpenAI's error body and one line; the server goes on serving."""
    body, status, match = {
        "foreign": ({"lora_name": "x", "lora_path": str(files["foreign"])}, 400, "LoRA weights of another base model"),
        "adapter": ({"lora_name": "x", "lora_path": str(files["adapter"])}, 400, "holds adapter weights, not LoRA"),
        "missing": ({"lora_name": "x", "lora_path": "/nowhere/lit_model.lora.safetensors"}, 400, "not found"),
        "taken": ({"lora_name": "alpha", "lora_path": str(files["beta"])}, 400, "is loaded already"),
        "base-name": ({"lora_name": "tiny-llama", "lora_path": str(files["beta"])}, 400, "the base model's name"),
        "unload-unknown": ({"lora_name": "nobody"}, 404, "is not loaded"),
    }[case]
    path = "/v1/unload_lora_adapter" if case.startswith("unload") else "/v1/load_lora_adapter"
    r = httpx.post(server.root + path, json=body, timeout=60, trust_env=False)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert match in message and "\n" not in message, message
    assert "x" not in {m.id for m in server.client().models.list().data}
    assert complete(server, "alpha", PROMPTS[2], 2)  # still serving


@pytest.mark.slow  # two more server processes: ~15 s
def test_equal_to_servers_of_each_adapter_merged(tiny_dir, files, server):
    """The same requests to the multi-LoRA server (in flight together) and to `--lora_path` servers of each
    adapter (merged): the same greedy texts."""
    alone = {name: ServerProcess(tiny_dir, "--lora_path", str(files[name]), "--slots", "2", "--max_seq_length", "96")
             for name in ("alpha", "beta")}
    try:
        for process in alone.values():
            process.start()
        expected = {(name, p): complete(alone[name].ready(), "tiny-llama", p) for name in alone for p in PROMPTS}
        with ThreadPoolExecutor(len(expected)) as pool:
            got = dict(zip(expected, pool.map(lambda k: complete(server, *k), expected)))
    finally:
        for process in alone.values():
            process.stop()
    assert got == expected


@pytest.mark.slow  # an XLA:CPU server: ~60 s of warm-up compilations on 2 cores
def test_on_xla_one_graph_serves_every_mix(tiny_dir, files, reference):
    """--accelerator xla (1 XLA:CPU device): the mix of base and adapter requests in flight together, and an adapter
    loaded at run time, get their merged models' greedy texts, and nothing compiles after the warm-up (the stacks'
    shapes are fixed: a mix or a load changes values only)."""
    process = ServerProcess(tiny_dir, "--lora", f"alpha={files['alpha']}", "--lora", f"beta={files['beta']}",
                            "--max_loras", "3", "--max_lora_rank", "8", "--slots", "4", "--max_seq_length", "64",
                            accelerator="xla", env={"PJRT_DEVICE": "CPU", "TF_CPP_MIN_LOG_LEVEL": "2"})
    asks = [(model, prompt) for prompt in PROMPTS for model in ("tiny-llama", "alpha", "beta")]
    try:
        process.start().ready(600)
        with ThreadPoolExecutor(len(asks)) as pool:
            got = list(pool.map(lambda k: complete(process, k[0], k[1], 8), asks))
        r = httpx.post(process.root + "/v1/load_lora_adapter", timeout=600, trust_env=False,
                       json={"lora_name": "gamma", "lora_path": str(files["gamma"])})
        assert r.status_code == 200, r.text
        gamma = complete(process, "gamma", PROMPTS[0], 8)
        compiles = process.health()["compilations_after_warm_up"]
    finally:
        process.stop()
    assert got == [reference(None if m == "tiny-llama" else m, p, 8) for m, p in asks]
    assert gamma == reference("gamma", PROMPTS[0], 8)
    assert compiles == 0
