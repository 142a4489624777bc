"""Serve a model over HTTP with the OpenAI API: a base checkpoint, a full finetune, or a base with LoRA or adapter
weights, on the CPU, a GPU or XLA (a TPU), with continuous batching.

    python serve/base.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct
    python serve/base.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora_path out/lora/alpaca/final/lit_model.lora.safetensors --port 8000 --slots 16
    PJRT_DEVICE=TPU python serve/base.py --checkpoint_dir ... --accelerator xla --max_seq_length 2048
    python serve/base.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct \\
        --lora sql=out/lora/sql/final/lit_model.lora.safetensors \\
        --lora chat=out/lora/chat/final/lit_model.lora.safetensors

Then any OpenAI client talks to it: `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")`;
`curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": ..., "messages":
[{"role": "user", "content": "Hi"}]}'`. Endpoints: POST /v1/chat/completions, POST /v1/completions (both with
`stream`; completions also `logprobs`, `echo`, token-id prompts), GET /v1/models, GET /health, GET /metrics
(Prometheus); see lit_gpt/recipes/openai_api.py.

Many LoRAs on one base: each `--lora NAME=PATH` serves a LoRA file beside the base (checked like --lora_path: LoRA
weights finetuned from this base), and a request's `model` picks it (the base model's name: no adapter). Requests
for different adapters and for the base share each decode step (a per-row gather of the adapters' matrices,
lit_gpt/lora_bank.py). `--max_loras` holds room for more, which `POST /v1/load_lora_adapter {"lora_name",
"lora_path"}` loads while the server runs (`/v1/unload_lora_adapter {"lora_name"}` unloads; vLLM's endpoints:
lit_gpt/recipes/serve_loras.py). --lora_path instead merges one LoRA into the base (the base's speed, one model).

Concurrent requests share one batched KV cache of `--slots` rows of up to `--max_seq_length` positions, paged: a
pool of `--kv_cache_tokens` positions in blocks of 16 that a request takes for its prompt + max_tokens (it waits in
the queue until they are free; one that can never fit gets HTTP 400). A request joins at the next decode step in a
free slot and leaves when it ends, and each step decodes a token for every request in
flight (lit_gpt/recipes/serving.py, on the generation recipes' loop). Prompts are prefilled in chunks of
`--prefill_chunk` tokens between decode steps, several prompts together, in the decode step's forward on the CPU
and eager GPUs (`--prefill_with_decode`); the KV blocks of prompt prefixes computed
before are shared (`--prefix_cache`). More requests than slots wait in a queue of
`--max_queue`; past it they get HTTP 429. On XLA the weights are replicated on every device when they fit one,
else tensor-parallel over the devices (`--weights`; lit_gpt/xla/serve_placement.py), and the warm-up compiles
every graph before the port opens (the prefill chunk, the same keeping scores, the decode step): no request waits for a
compilation. On a GPU the forward is compiled and replayed as CUDA graphs (`--compile`, generate/base.py's policy;
`--compile none`: eager), warmed up the same way.

Ctrl-C (or SIGTERM) stops accepting connections, finishes the requests in flight and queued, and exits 0; a
second Ctrl-C exits at once.
"""

import sys
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
         "Prompt tokens per step boundary while requests decode (0: whole prompts): a long prompt is prefilled in\n"
         "chunks between decode steps, so the streams in flight wait one chunk per token, not its whole prefill."),
    Flag("prefill_with_decode", bool, True,
         "On the CPU and eager GPUs, a step boundary's prompt chunks run in the decode step's forward (the weights\n"
         "read once for both); false: in a prefill call of their own before it (as XLA and compiled servers do)."),
    Flag("prefix_cache", bool, True,
         "Reuse the KV cache of prompt prefixes the slots hold (a shared system prompt, n > 1, few-shot examples)."),
    Flag("kv_cache_tokens", Optional[int], None,
         "KV cache positions shared by all slots, in blocks of 16 taken as requests need them (default: slots x\n"
         "max_seq_length): many short requests or a few long ones. A request takes the blocks of its prompt +\n"
         "max_tokens when it starts and waits in the queue until they are free: set max_tokens to take fewer."),
    Flag("max_queue", int, 64, "Requests that may wait for a free slot or KV blocks; past that they get HTTP 429."),
    Flag("prompt_style", Optional[str], None,
         'How chat messages become the prompt: "chat" (the checkpoint\'s chat template), "alpaca" or "raw"\n'
         "(default: the checkpoint's template when the model stops on the token that ends its turns, else raw)."),
    Flag("lora", Optional[List[str]], None,
         "A LoRA adapter served beside the base, as NAME=PATH (a lit_model.lora.safetensors of this base):\n"
         'requests with "model": NAME get it. Repeatable (--lora a=... --lora b=...).'),
    Flag("max_loras", Optional[int], None,
         "LoRA adapters held at once (default: those of --lora); more leaves room for POST\n"
         "/v1/load_lora_adapter, which reads a file on this machine (mind --host)."),
    Flag("max_lora_rank", Optional[int], None,
         "The largest LoRA rank (lora_r) served (default: the largest of --lora, else 16)."),
    Flag("weights", str, "auto",
         'XLA: where the weights live: "replicated" on every device (no collective of weights in a step),\n'
         '"tensor_parallel" (split over the devices, Megatron-style), or "auto" (replicated when the weights and\n'
         "the KV cache fit one device's memory, else tensor-parallel: lit_gpt/xla/serve_placement.py). auto only\n"
         "on the CPU and GPUs."),
    Flag("compile", str, "auto",
         'The decode step compiled with torch.compile, as generate/base.py\'s --compile: "auto" (CUDA graphs on a\n'
         'GPU, eager on the CPU), "none" (eager), or a mode: "default", "reduce-overhead" (CUDA graphs, GPUs only),\n'
         '"max-autotune". On XLA (which compiles its graphs itself) auto or none.'),
    ROPE_SCALING,
]


def main(**flags: Any) -> None:
    from lit_gpt.recipes.serve import check_serve_args, serve

    rope_scaling = flags.pop("rope_scaling")
    # where the weights live (XLA), sized against the KV cache the server allocates
    placement = dict(weights=flags.pop("weights"), kv_positions=kv_positions(flags), compile=flags.pop("compile"))
    # one line for bad flags (and --lora files: LoRA weights of this base), before any weights are read
    loras = check_serve_args(**flags)
    loaded = load_eval_model(**values(flags, EVAL_FLAGS), rope_scaling=rope_scaling,  # its context: --max_seq_length
                             **placement)
    skip = {f.name for f in EVAL_FLAGS} | {"lora", "max_loras", "max_lora_rank"}
    serve(loaded, loras=loras, **{k: v for k, v in flags.items() if k not in skip})


def kv_positions(flags: Any) -> int:
    """KV cache positions the server allocates at most (`--kv_cache_tokens`, else slots x max_seq_length)."""
    from lit_gpt.recipes.serve import DEFAULT_MAX_SEQ_LENGTH

    return flags.get("kv_cache_tokens") or flags["slots"] * (flags["max_seq_length"] or DEFAULT_MAX_SEQ_LENGTH)


setup = command("Serve a model (base, LoRA, adapter or full finetune) with the OpenAI API and continuous batching.",
                FLAGS, main)

if __name__ == "__main__":
    from lit_gpt.recipes.serve_loras import repeatable_lora

    run_cli(setup, args=repeatable_lora(sys.argv[1:]))  # each --lora adds one adapter
