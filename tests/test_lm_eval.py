"""eval/lm_eval.py and lit_gpt/recipes/harness.py: our model as an lm-evaluation-harness model.

Its scores equal the harness's `--model hf` backend (HFLM, float32) on the same weights, on the three local tasks of
tests/harness_tasks.py (multiple choice, generation, rolling log-likelihood; no network): accuracies and exact match
identical, every per-request log-likelihood and greedy flag alike, every generated text the same, perplexities
within 1e-4 relative; on the tiny random model (its HF export), and (slow) on the real SmolLM2. A LoRA file gives
the merged model's scores; `--model lit_gpt` works inside the harness; bad input is one line and writes nothing;
the command line writes the harness's results JSON.
"""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness_tasks import TASKS, write_tasks
from variants import randomize_own_, run_recipe

REPO = Path(__file__).resolve().parents[1]
REL = 1e-4
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module", autouse=True)
def offline():
    """The harness reads the tasks' data through `datasets`, offline (as in the CLI run below)."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in OFFLINE.items():
            mp.setenv(k, v)
        import datasets.config

        mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
        yield


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("harness_tasks"))


@pytest.fixture(scope="module")
def manager(tasks_dir):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tasks_dir), include_defaults=False)  # the built-in index takes ~30 s


def run(lm, manager, tasks=TASKS, limit=None, num_fewshot=None):
    from unittest import mock

    from lm_eval import simple_evaluate

    # left out: the harness's report of this machine (torch's collect_env runs pip, conda, nvidia-smi, ... as
    # subprocesses: ~3 s a call), which no comparison here reads; the CLI runs below keep it
    with mock.patch("lm_eval.evaluator.add_env_info", lambda results: None):
        return simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                               num_fewshot=num_fewshot, bootstrap_iters=0, log_samples=True)


def ours(checkpoint_dir, manager, batch_size=4, **kwargs):
    from lit_gpt.recipes.evaluate import load_eval_model
    from lit_gpt.recipes.harness import LitLM

    loaded = load_eval_model(checkpoint_dir, accelerator="cpu", **kwargs)
    return LitLM(loaded.model, loaded.tokenizer, loaded.runtime, batch_size=batch_size, progress=False)


def hflm(hf_dir, batch_size=4):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(hf_dir), dtype="float32", device="cpu", batch_size=batch_size)


def assert_same_scores(got, expected, tasks=TASKS):
    """Accuracies and exact match identical, perplexities within REL; per request: log-likelihoods within REL and
    the same greedy flags, the same generated texts."""
    for task in tasks:
        a, b = got["results"][task], expected["results"][task]
        for metric in ("acc,none", "acc_norm,none", "exact_match,none"):
            if metric in b:
                assert a[metric] == b[metric], (task, metric, a[metric], b[metric])
        for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
            if metric in b:
                assert a[metric] == pytest.approx(b[metric], rel=REL), (task, metric)
        for sa, sb in zip(got["samples"][task], expected["samples"][task], strict=True):
            assert sa["doc_id"] == sb["doc_id"]
            if task == "lit_gen":
                assert sa["resps"] == sb["resps"], (sa["resps"], sb["resps"])
                continue
            for ra, rb in zip(sa["resps"], sb["resps"], strict=True):
                ra, rb = ra[0], rb[0]
                if isinstance(rb, (tuple, list)):  # (log-likelihood, is greedy)
                    assert ra[0] == pytest.approx(rb[0], rel=REL) and ra[1] == rb[1], (task, ra, rb)
                else:  # a rolling log-likelihood
                    assert ra == pytest.approx(rb, rel=REL), (task, ra, rb)


@pytest.fixture(scope="module")
def tiny_hf(tiny_dir, tmp_path_factory):
    from lit_gpt.convert import convert_lit_checkpoint

    return convert_lit_checkpoint(tiny_dir, tmp_path_factory.mktemp("tiny_hf") / "hf")


@pytest.fixture(scope="module")
def tiny_hflm(tiny_hf):
    return hflm(tiny_hf)


@pytest.fixture(scope="module")
def tiny_reference(tiny_hflm, manager):
    return run(tiny_hflm, manager)


# ---------------------------------------------------------------------------------------------------------------
# equal to the harness's HF backend
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch_size", [1, 3])
def test_tiny_scores_equal_the_hf_backend(tiny_dir, manager, tiny_reference, batch_size):
    got = run(ours(tiny_dir, manager, batch_size), manager)
    assert_same_scores(got, tiny_reference)
    # the cases are exercised: several rolling windows (the long text > 256 tokens), multi-token choices, texts
    long_text = max(got["samples"]["lit_ppl"], key=lambda s: len(s["doc"]["text"]))
    from lit_gpt.tokenizer import Tokenizer

    assert len(Tokenizer(tiny_dir).encode(long_text["doc"]["text"])) > 256
    assert any(r[0][0] for s in got["samples"]["lit_gen"] for r in [s["resps"]])  # some non-empty generations


def test_model_lit_gpt_inside_the_harness(tiny_dir, manager, tiny_reference):
    """`--model lit_gpt --model_args checkpoint_dir=...` (lm_eval's registry) gives the same scores."""
    import lit_gpt.recipes.harness  # noqa: F401  (registers "lit_gpt")
    from lm_eval import simple_evaluate

    got = simple_evaluate(model="lit_gpt", model_args=f"checkpoint_dir={tiny_dir},accelerator=cpu,batch_size=2",
                          tasks=["lit_mc"], task_manager=manager, bootstrap_iters=0, log_samples=True)
    assert_same_scores(got, tiny_reference, tasks=["lit_mc"])


@pytest.fixture(scope="module")
def lora_file(tiny_dir, tmp_path_factory):
    from lit_gpt import lora
    from lit_gpt.fingerprint import base_record
    from lit_gpt.peft import save_finetuned
    from lit_gpt.weights import load_weights

    model = lora.GPT(lora.Config.from_checkpoint(tiny_dir, lora_r=2, lora_alpha=4, lora_dropout=0.0, lora_mlp=True))
    model.load_state_dict(load_weights(tiny_dir / "lit_model.safetensors"), strict=False)
    randomize_own_(model)
    return save_finetuned(model, tmp_path_factory.mktemp("lora") / "final", base=base_record(tiny_dir))


def test_lora_file_scores_equal_the_merged_model_in_the_hf_backend(tiny_dir, lora_file, manager, tiny_reference,
                                                                   tmp_path):
    from lit_gpt.convert import convert_lit_checkpoint
    from lit_gpt.lora import merge_lora_checkpoint

    merged = merge_lora_checkpoint(tiny_dir, lora_file, tmp_path / "merged").parent
    expected = run(hflm(convert_lit_checkpoint(merged, tmp_path / "hf")), manager, tasks=["lit_mc", "lit_ppl"])
    got = run(ours(tiny_dir, manager, lora_path=lora_file), manager, tasks=["lit_mc", "lit_ppl"])
    assert_same_scores(got, expected, tasks=["lit_mc", "lit_ppl"])
    base = tiny_reference["results"]["lit_ppl"]["byte_perplexity,none"]
    assert abs(got["results"]["lit_ppl"]["byte_perplexity,none"] / base - 1) > 10 * REL  # LoRA changes them


@pytest.mark.slow
def test_real_smollm2_scores_equal_the_hf_backend(smollm2_dir, manager, tmp_path):
    """The real SmolLM2-135M-Instruct, 4 examples per task, the generation task with one few-shot example."""
    from lit_gpt.convert import convert_lit_checkpoint

    hf = convert_lit_checkpoint(smollm2_dir, tmp_path / "hf")
    reference, model = hflm(hf), ours(smollm2_dir, manager)  # each loaded once, for both runs of the harness
    for tasks, shots in ((["lit_mc", "lit_ppl"], None), (["lit_gen"], 1)):
        expected = run(reference, manager, tasks=tasks, limit=4, num_fewshot=shots)
        got = run(model, manager, tasks=tasks, limit=4, num_fewshot=shots)
        assert_same_scores(got, expected, tasks=tasks)
        if "lit_mc" in tasks:
            assert got["results"]["lit_mc"]["acc,none"] >= 0.5  # a real model: above chance on these facts


# ---------------------------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def cli_run(request, tiny_dir, tasks_dir, tmp_path_factory):
    """The CLI once, as a user runs it (its start overlaps the tests in between: started first, checked last); not
    started when no selected test of this module reads it (`-m slow` selects none: a whole process for nothing)."""
    if not any(getattr(item, "module", None) is request.module
               and "cli_run" in inspect.signature(item.function).parameters for item in request.session.items):
        yield None
        return
    out = tmp_path_factory.mktemp("cli") / "results"
    cmd = [sys.executable, str(REPO / "eval/lm_eval.py"), "--tasks", "lit_mc,lit_ppl", "--include_path",
           str(tasks_dir), "--checkpoint_dir", str(tiny_dir), "--out_dir", str(out), "--batch_size", "2",
           "--limit", "5", "--accelerator", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1"})
    yield proc, out
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


BAD = [  # (case, flags, expected substring of the one line)
    ("unknown task", ["--tasks", "lit_mc,no_such_task"], "unknown task 'no_such_task': list them with"),
    ("empty tasks", ["--tasks", " , "], "--tasks is empty"),
    ("include_path missing", ["--tasks", "lit_mc", "--include_path", "NOWHERE"], "is not a folder"),
    ("batch size 0", ["--tasks", "lit_mc", "--batch_size", "0"], "--batch_size must be >= 1"),
    ("limit 0", ["--tasks", "lit_mc", "--limit", "0"], "--limit must be > 0"),
    ("negative fewshot", ["--tasks", "lit_mc", "--num_fewshot", "-1"], "--num_fewshot must be >= 0"),
    ("both weights", ["--tasks", "lit_mc", "--lora_path", "LORA", "--adapter_path", "LORA"], "not both"),
    ("missing checkpoint", ["--tasks", "lit_mc", "--checkpoint_dir", "NOWHERE"], "does not exist"),
    ("unknown accelerator", ["--tasks", "lit_mc", "--accelerator", "tpu"], "--accelerator must be"),
    ("devices 0", ["--tasks", "lit_mc", "--devices", "0"], "--devices must be >= 1"),
    ("multiturn without a template", ["--tasks", "lit_mc", "--fewshot_as_multiturn", "true"],
     "--fewshot_as_multiturn true needs --apply_chat_template"),
    ("unknown prompt style", ["--tasks", "lit_mc", "--apply_chat_template", "nosuchstyle"], "unknown prompt style"),
]


@pytest.mark.parametrize("case, flags, expected", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_one_line_and_writes_nothing(cli_run, tiny_dir, tasks_dir, lora_file, tmp_path, capsys,
                                                   monkeypatch, case, flags, expected):
    from lm_eval.tasks import TaskManager

    # the harness's ~14,000 built-in task files are not indexed here (30 s); the slow test below does that
    original = TaskManager.__init__
    monkeypatch.setattr(TaskManager, "__init__", lambda self, *a, include_defaults=True, **k: original(
        self, *a, include_defaults=False, **k))
    subst = {"LORA": str(lora_file), "NOWHERE": str(tmp_path / "nowhere")}
    flags = [subst.get(a, a) for a in flags]
    defaults = {"--checkpoint_dir": str(tiny_dir), "--include_path": str(tasks_dir)}
    extra = [x for k, v in defaults.items() if k not in flags for x in (k, v)]
    before = sorted(p.name for p in tiny_dir.iterdir())
    with pytest.raises(SystemExit) as exit_info:
        run_recipe("eval/lm_eval.py", *flags, *extra, "--out_dir", str(tmp_path / "out"))
    assert exit_info.value.code == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tiny_dir.iterdir()) == before  # no eval/ folder in the checkpoint


def test_default_out_dir_is_beside_the_lora_file(tiny_dir, tasks_dir, lora_file, capsys):
    run_recipe("eval/lm_eval.py", "--tasks", "lit_mc", "--include_path", str(tasks_dir), "--checkpoint_dir",
               str(tiny_dir), "--lora_path", str(lora_file), "--limit", "3", "--bootstrap_iters", "0",
               "--accelerator", "cpu")
    written = lora_file.parent / "eval" / "lm_eval.json"
    results = json.loads(written.read_text())
    assert results["results"]["lit_mc"]["sample_len"] == 3
    assert results["config"]["finetuned_path"] == str(lora_file) and "lit_mc" in capsys.readouterr().out


def test_cli_prints_the_table_and_writes_the_results_json(cli_run, tiny_dir, manager, tiny_reference):
    proc, out = cli_run
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert "|lit_mc |" in stdout and "acc_norm" in stdout and "byte_perplexity" in stdout  # the harness's table
    assert "Running loglikelihood requests" in stderr  # progress bars
    results = json.loads((out / "lm_eval.json").read_text())
    assert sorted(results["results"]) == ["lit_mc", "lit_ppl"]
    assert results["config"]["model"] == str(tiny_dir) and results["config"]["limit"] == 5
    assert results["n-samples"]["lit_mc"] == {"original": 10, "effective": 5}
    expected = run(ours(tiny_dir, manager, batch_size=2), manager, tasks=["lit_mc", "lit_ppl"], limit=5)
    for task in ("lit_mc", "lit_ppl"):
        for k, v in expected["results"][task].items():
            if isinstance(v, float):
                assert results["results"][task][k] == pytest.approx(v, rel=REL), (task, k)
    assert sorted(p.name for p in out.iterdir()) == ["lm_eval.json"]


@pytest.mark.slow
def test_cli_unknown_task_against_the_harness_index(tiny_dir, tmp_path):
    """Without --include_path: the harness's own index (every built-in task) is what the name is checked against."""
    proc = subprocess.run([sys.executable, str(REPO / "eval/lm_eval.py"), "--tasks", "hellaswag,no_such_task",
                           "--checkpoint_dir", str(tiny_dir), "--out_dir", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=REPO, env={**os.environ, **OFFLINE}, timeout=600)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: unknown task 'no_such_task'") and "--include_path" in lines[0]
    assert not (tmp_path / "out").exists()


def test_loglikelihood_batches_are_one_forward_each(tiny_dir, manager, monkeypatch):
    """Batched: requests sorted longest first (the harness's Collator), one forward per batch of `batch_size`."""
    from lm_eval.api.instance import Instance

    from lit_gpt.recipes import harness

    lm = ours(tiny_dir, manager, batch_size=4)
    calls = []
    step = harness.score_step

    def counting(model, inputs, *args, **kwargs):
        calls.append(tuple(inputs.shape))
        return step(model, inputs, *args, **kwargs)

    monkeypatch.setattr(harness, "score_step", counting)
    pairs = [("The capital of France is", " Paris"), ("A week has", " seven days"), ("Bees make", " honey"),
             ("Two plus two", " equals four"), ("The sun", " rises"), ("Water", " is wet and cold")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    batched = lm.loglikelihood(requests, disable_tqdm=True)
    assert [c[0] for c in calls] == [4, 2] and calls[0][1] >= calls[1][1]  # longest first
    one_by_one = [lm.loglikelihood([r], disable_tqdm=True)[0] for r in requests]
    for (a, ga), (b, gb) in zip(batched, one_by_one):
        assert a == pytest.approx(b, rel=REL) and ga == gb


MIXED_PROMPTS = ["one two three", "Question: what is the capital of France?\nAnswer:", "a",
                 "A much longer prompt than the other ones, about rivers, mountains and the weather in the valley",
                 "four five six", "Bees make honey and", "x y"]


def mixed_requests(prompts=MIXED_PROMPTS):
    """generate_until requests of mixed prompt lengths, with two settings of stop strings and new-token budgets."""
    from lm_eval.api.instance import Instance

    settings = [{"until": ["\n", "."], "max_gen_toks": 12, "do_sample": False},
                {"until": [","], "max_gen_toks": 5, "do_sample": False}]
    return [Instance("generate_until", {}, (p, settings[i % 2]), i) for i, p in enumerate(prompts)]


def test_generation_batches_mixed_lengths_in_one_batch_as_the_hf_backend(tiny_dir, tiny_hflm, manager, monkeypatch):
    """generate_until: requests of mixed prompt lengths, each with its own stop strings and max_gen_toks, are rows of
    one continuous `Batch` (fewer rows than requests: rows are reused as requests end); the greedy texts are the
    harness's `--model hf` texts (left-padded batches of its own) and those of one request at a time."""
    from lit_gpt.recipes import harness

    lm = ours(tiny_dir, manager, batch_size=3)
    requests = mixed_requests()
    lengths = {len(lm.tok_encode(r.args[0])) for r in requests}
    assert len(lengths) >= 5  # mixed lengths
    batches, joins = [], []
    real = harness.Batch

    class Spy(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            batches.append(self.rows)

        def join(self, rows, prompt, *args, **kwargs):
            joins.append(prompt.size(1))
            return super().join(rows, prompt, *args, **kwargs)

    monkeypatch.setattr(harness, "Batch", Spy)
    batched = lm.generate_until(requests, disable_tqdm=True)
    assert batches == [3] and sorted(joins) == sorted(len(lm.tok_encode(r.args[0])) for r in requests)
    assert joins == sorted(joins, reverse=True)  # longest first, as the harness orders them
    expected = tiny_hflm.generate_until(mixed_requests(), disable_tqdm=True)  # its batches of 4, left-padded
    assert batched == expected and sum(bool(t) for t in batched) >= 4
    assert not any("\n" in t or "." in t for t in batched[::2]) and not any("," in t for t in batched[1::2])
    assert all(len(lm.tok_encode(t)) <= 5 for t in batched[1::2])  # each request's own budget
    monkeypatch.setattr(harness, "Batch", real)
    assert [lm.generate_until([r], disable_tqdm=True)[0] for r in requests] == batched
