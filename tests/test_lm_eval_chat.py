"""eval/lm_eval.py's chat flags (`--apply_chat_template`, `--system_instruction`, `--fewshot_as_multiturn`), the
results people compare (fingerprints, prompt style, time per task, `--log_samples`): chat histories render as
transformers' `apply_chat_template` renders them (what HFLM sends), to the token, on the tiny model; (slow) on the
real SmolLM2-135M-Instruct the prompts, scores and texts equal `lm_eval --model hf --apply_chat_template`'s; the
command line writes the harness's results layout and per-sample files."""

import json
from pathlib import Path

import pytest
from harness_tasks import write_tasks
from test_lm_eval import OFFLINE, assert_same_scores, hflm, ours
from variants import run_recipe

REPO = Path(__file__).resolve().parents[1]
CHAT = dict(apply_chat_template=True, system_instruction="Answer in one word.", fewshot_as_multiturn=True)


@pytest.fixture(scope="module", autouse=True)
def offline():
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

    return TaskManager(include_path=str(tasks_dir), include_defaults=False)


def chat_run(lm, manager, tasks, limit=3, num_fewshot=1, **chat):
    from lm_eval import simple_evaluate

    return simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                           bootstrap_iters=0, log_samples=True, **{**CHAT, **chat})


def assert_same_prompts(got, expected, ours_lm, their_lm, tasks):
    """Every request's prompt text identical, and tokenized to the same ids by both models."""
    for task in tasks:
        for sa, sb in zip(got["samples"][task], expected["samples"][task], strict=True):
            assert sa["arguments"] == sb["arguments"], (task, sa["arguments"], sb["arguments"])
            for args in sa["arguments"]:
                assert ours_lm.tok_encode(args[0]) == their_lm.tok_encode(args[0]), (task, args[0])
        first = got["samples"][task][0]["arguments"][0][0]
        assert first.startswith("<|im_start|>system\nAnswer in one word.<|im_end|>")  # the template, the system
        assert first.count("<|im_start|>user") == 2 and first.endswith("<|im_start|>assistant\n")  # 1 shot as a turn


def test_chat_histories_render_as_transformers_apply_chat_template(tiny_dir, manager, tmp_path):
    """What HFLM's `apply_chat_template` gives (transformers' tokenizer of the HF export, with and without the
    generation prompt, `continue_final_message` for a prefilled answer), to the text and to the token."""
    from transformers import AutoTokenizer

    from lit_gpt.convert import convert_lit_checkpoint

    hf = AutoTokenizer.from_pretrained(str(convert_lit_checkpoint(tiny_dir, tmp_path / "hf")))
    lm = ours(tiny_dir, manager)
    shots = [{"role": "user", "content": "Q: 2+2?"}, {"role": "assistant", "content": " 4"}]
    for history, gen in (([{"role": "system", "content": "Be brief."}, *shots, {"role": "user", "content": "Q?"}],
                          True), ([*shots, {"role": "user", "content": "Q?"}], True),
                         ([*shots, {"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A:"}], False)):
        expected = hf.apply_chat_template(history, tokenize=False, add_generation_prompt=gen,
                                          continue_final_message=not gen)
        text = lm.apply_chat_template(history, add_generation_prompt=gen)
        assert text == expected
        assert lm.tok_encode(text) == hf(text, add_special_tokens=False)["input_ids"]


@pytest.mark.slow
def test_real_smollm2_chat_template_equals_the_hf_backend(smollm2_dir, manager, tmp_path):
    """The real SmolLM2-135M-Instruct through its chat template: the prompts, the scores and the generated texts of
    `lm_eval --model hf --apply_chat_template` (multiple choice and generation, one shot as a turn)."""
    from lit_gpt.convert import convert_lit_checkpoint

    tasks = ["lit_mc", "lit_gen"]
    lm, theirs = ours(smollm2_dir, manager, batch_size=4), hflm(convert_lit_checkpoint(smollm2_dir, tmp_path / "hf"))
    got, expected = chat_run(lm, manager, tasks, limit=4), chat_run(theirs, manager, tasks, limit=4)
    assert_same_prompts(got, expected, lm, theirs, tasks)
    assert_same_scores(got, expected, tasks=tasks)
    assert any(s["resps"][0][0].strip() for s in got["samples"]["lit_gen"])  # the instruct model answers


def test_named_prompt_style_renders_the_chat_history(tiny_dir, manager):
    """`--apply_chat_template alpaca`: a named prompt style of lit_gpt/prompts.py renders the harness's chat
    history (few-shot turns as earlier instruction/response pairs)."""
    lm = ours(tiny_dir, manager)
    lm.prompt_style = "alpaca"
    text = lm.apply_chat_template([{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                                   {"role": "user", "content": "Q2"}])
    assert text.endswith("### Instruction:\nQ1\n\n### Response:\nA1\n\n### Instruction:\nQ2\n\n### Response:\n")
    assert lm.chat_template("alpaca") == "alpaca"


def test_cli_chat_flags_results_and_samples(tiny_dir, tasks_dir, tmp_path, capsys):
    """The command line with the chat flags and --log_samples: the harness's results layout (read back by the
    harness's own tooling), plus the fingerprints, the adapter path, the prompt style and seconds per task; the
    harness's per-sample files beside it."""
    from lm_eval.utils import get_results_filenames, get_sample_results_filenames

    out = tmp_path / "out"
    run_recipe("eval/lm_eval.py", "--tasks", "lit_mc,lit_gen", "--include_path", str(tasks_dir), "--checkpoint_dir",
               str(tiny_dir), "--limit", "2", "--bootstrap_iters", "0", "--accelerator", "cpu", "--out_dir", str(out),
               "--apply_chat_template", "true", "--system_instruction", "Be brief.", "--log_samples", "true")
    err = capsys.readouterr().err
    assert "Prompt style: chat (the checkpoint's chat template)" in err
    results = json.loads((out / "lm_eval.json").read_text())
    for key in ("results", "configs", "versions", "n-shot", "higher_is_better", "n-samples", "config"):
        assert key in results, key
    from lit_gpt.fingerprint import fingerprint

    config = results["config"]
    assert config["base_fingerprint"] == config["checkpoint_fingerprint"] == fingerprint(tiny_dir)
    assert config["finetuned_path"] is None and config["method"] == "base"
    assert results["prompt_style"] == "chat" and results["fewshot_as_multiturn"] is True
    assert results["system_instruction"] == "Be brief." and "<|im_start|>" in results["chat_template"]
    assert sorted(results["task_seconds"]) == ["lit_gen", "lit_mc"] and all(v > 0 for v in
                                                                           results["task_seconds"].values())
    files = sorted(str(p) for p in out.iterdir())
    samples = get_sample_results_filenames(files)
    assert len(samples) == 2 and not get_results_filenames(files), files
    rows = [json.loads(line) for line in Path(next(s for s in samples if "lit_gen" in s)).read_text().splitlines()]
    assert len(rows) == 2 and "Be brief." in rows[0]["arguments"]["gen_args_0"]["arg_0"]
