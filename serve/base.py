"""Serve a model over HTTP with the OpenAI API: a base checkpoint, a full finetune, or a base with LoRA or adapter
weights, on the CPU, a GPU or XLA (a TPU), with continuous batching.

    python serve/base.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python serve/base.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/lora/alpaca/final/lit_model.lora.safetensors --port 8000 --slots 16
    PJRT_DEVICE=TPU python serve/base.py --checkpoint_dir ... --accelerator xla --max_seq_length 2048

Then any OpenAI client talks to it: `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")`;
`curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": ..., "messages":
[{"role": "user", "content": "Hi"}]}'`. Endpoints: POST /v1/chat/completions, POST /v1/completions (both with
`stream`; completions also `logprobs`, `echo`, token-id prompts), GET /v1/models, GET /health, GET /metrics
(Prometheus); see lit_gpt/recipes/openai_api.py.

Concurrent requests share one batched KV cache of `--slots` rows of `--max_seq_length` positions: a request joins
at the next decode step in a free slot and leaves when it ends, and each step decodes a token for every request in
flight (lit_gpt/recipes/serving.py, on the generation recipes' loop). Prompts are prefilled in chunks of
`--prefill_chunk` tokens between decode steps, several prompts together; prompt prefixes the slots already hold
are reused (`--prefix_cache`). More requests than slots wait in a queue of
`--max_queue`; past it they get HTTP 429. On XLA the warm-up compiles every graph before the port opens (the prefill
chunk, the decode step, the prefix copy): no request waits for a compilation.

Ctrl-C (or SIGTERM) stops accepting connections, finishes the requests in flight and queued, and exits 0; a
second Ctrl-C exits at once.
"""

from typing import Any, List, Optional

from lit_gpt.recipes.evaluate import EVAL_FLAGS, load_eval_model
from lit_gpt.recipes.flags import ROPE_SCALING, Flag, command, values
from lit_gpt.utils import run_cli

FLAGS: List[Flag] = [
    *EVAL_FLAGS,
    Flag("host", str, "127.0.0.1", "Address to listen on (0.0.0.0: every interface; mind who can reach it)."),
    Flag("port", int, 8000, "Port to listen on."),
    Flag("model_name", Optional[str], None,
         'The model id clients send as "model" (default: the checkpoint folder\'s name).'),
    Flag("slots", int, 8, "Requests decoded together (rows of the batched KV cache)."),
    Flag("max_seq_length", Optional[int], None,
         "Positions per slot: the longest prompt + max_tokens a request may have (default: the model's context,\n"
         "at most 2048). The KV cache holds slots x max_seq_length positions per layer, allocated at the start."),
    Flag("prefill_chunk", int, 32,
         "Prompt tokens per prefill call while requests decode (0: whole prompts): a long prompt is prefilled in\n"
         "chunks between decode steps, so the streams in flight wait one chunk per token, not its whole prefill."),
    Flag("prefix_cache", bool, True,
         "Reuse the KV cache of prompt prefixes the slots hold (a shared system prompt, n > 1, few-shot examples)."),
    Flag("max_queue", int, 64, "Requests that may wait for a free slot; past that they get HTTP 429."),
    Flag("prompt_style", Optional[str], None,
         'How chat messages become the prompt: "chat" (the checkpoint\'s chat template), "alpaca" or "raw"\n'
         "(default: the checkpoint's template when the model stops on the token that ends its turns, else raw)."),
    ROPE_SCALING,
]


def main(**flags: Any) -> None:
    from lit_gpt.recipes.serve import check_serve_args, serve

    rope_scaling = flags.pop("rope_scaling")
    check_serve_args(**flags)  # one line for bad flags, before any weights are read
    loaded = load_eval_model(**values(flags, EVAL_FLAGS), rope_scaling=rope_scaling)  # its context: --max_seq_length
    serve(loaded, **{k: v for k, v in flags.items() if k not in {f.name for f in EVAL_FLAGS}})


setup = command("Serve a model (base, LoRA, adapter or full finetune) with the OpenAI API and continuous batching.",
                FLAGS, main)

if __name__ == "__main__":
    run_cli(setup)
