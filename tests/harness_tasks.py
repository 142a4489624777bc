"""Local lm-evaluation-harness tasks for the tests (no network: `dataset_path: json` with `data_files`), one per
request type of the harness:

* `lit_mc`   (multiple_choice: loglikelihood; acc, acc_norm): facts with one-token and several-token choices;
* `lit_gen`  (generate_until: exact_match, until a newline);
* `lit_ppl`  (loglikelihood_rolling: word_perplexity, byte_perplexity, bits_per_byte): texts, one longer than the
  tiny test model's context (256 tokens), so it is scored in several windows.

    from harness_tasks import write_tasks
    include_path = write_tasks(tmp_path)          # a folder for --include_path / TaskManager(include_path=...)
    python tests/harness_tasks.py DIR             # the same from the command line
"""

import json
import sys
from pathlib import Path
from typing import Dict, List

TASKS = ("lit_mc", "lit_gen", "lit_ppl")

MC_ROWS: List[Dict] = [
    {"question": "The capital of France is", "choices": [" Paris", " London", " Berlin", " Madrid"], "answer": 0},
    {"question": "The largest planet in the solar system is", "choices": [" Mars", " Jupiter", " Venus"], "answer": 1},
    {"question": "Water freezes at a temperature of zero degrees", "choices": [" Celsius", " Fahrenheit"], "answer": 0},
    {"question": "A week has seven", "choices": [" days", " months", " years", " hours"], "answer": 0},
    {"question": "The opposite of hot is", "choices": [" cold", " warm", " very bright and loud"], "answer": 0},
    {"question": "Bees make", "choices": [" honey", " milk", " steel wire"], "answer": 0},
    {"question": "The sun rises in the", "choices": [" east", " west", " north"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five", " three"], "answer": 0},
    {"question": "Cats are animals that often chase", "choices": [" mice", " clouds", " airplanes"], "answer": 0},
    {"question": "The color of grass is", "choices": [" green", " purple", " orange"], "answer": 0},
]
GEN_ROWS: List[Dict] = [
    {"question": "What is the capital of France?", "answer": " Paris"},
    {"question": "What is two plus two?", "answer": " 4"},
    {"question": "What color is the sky on a clear day?", "answer": " Blue"},
    {"question": "How many days are in a week?", "answer": " 7"},
    {"question": "What do bees make?", "answer": " Honey"},
    {"question": "Which animal says meow?", "answer": " A cat"},
]
_LONG = " ".join(
    f"Sentence number {i} of a long text about rivers, mountains and the weather in the valley below."
    for i in range(30)
)
PPL_ROWS: List[Dict] = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"text": "Paris is the capital and largest city of France, on the river Seine."},
    {"text": "A language model assigns probabilities to sequences of words."},
    {"text": _LONG},  # several windows of a 256-token model
]

MC_YAML = """\
task: lit_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
fewshot_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
GEN_YAML = """\
task: lit_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
fewshot_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
PPL_YAML = """\
task: lit_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
"""


def _jsonl(path: Path, rows: List[Dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_tasks(directory: Path) -> Path:
    """Write the three tasks (YAML + JSONL data) into `directory` (created); returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, yaml, rows in (("lit_mc", MC_YAML, MC_ROWS), ("lit_gen", GEN_YAML, GEN_ROWS),
                             ("lit_ppl", PPL_YAML, PPL_ROWS)):
        data = _jsonl(directory / f"{name}.jsonl", rows)
        (directory / f"{name}.yaml").write_text(yaml.format(data=data.resolve()), encoding="utf-8")
    return directory


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/harness_tasks.py DIR")
    print(write_tasks(Path(sys.argv[1])))
