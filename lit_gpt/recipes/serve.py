"""serve/base.py's steps after loading: the engine (lit_gpt.recipes.serving), its warm-up, the HTTP application
(lit_gpt.recipes.openai_api) under uvicorn, and a clean end.

Threads: the engine runs on the main thread, the one that loaded the model (XLA and CUDA work stays on one thread,
and signals arrive there); uvicorn serves on a second thread with its own event loop. Ctrl-C / SIGTERM set a flag
that the engine reads between steps: uvicorn stops accepting connections and waits for the open ones, the engine
finishes every request in flight and queued, then the process exits 0. A second signal exits at once (130).
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, List, Optional

from lit_gpt.utils import LitError

DEFAULT_MAX_SEQ_LENGTH = 2048  # per slot: 8 slots of 2048 hold 16k positions per layer


def check_serve_args(host: str = "127.0.0.1", port: int = 8000, slots: int = 8, max_seq_length: Optional[int] = None,
                     max_queue: int = 64, prompt_style: Optional[str] = None, prefill_chunk: int = 32,
                     lora: Optional[List[str]] = None, max_loras: Optional[int] = None,
                     max_lora_rank: Optional[int] = None, checkpoint_dir: Optional[Path] = None,
                     model_name: Optional[str] = None, lora_path: Optional[Path] = None,
                     adapter_path: Optional[Path] = None, allow_other_base: bool = False,
                     kv_cache_tokens: Optional[int] = None, **_: Any) -> Any:
    """The serving flags' checks that need no weights (one LitError line each). Returns the LoRA adapters to serve
    (`serve_loras.LoRAPlan`, their files checked: LoRA weights of this base), or None."""
    from lit_gpt.prompts import PromptStyle
    from lit_gpt.recipes.serve_loras import check_lora_flags

    if not 0 <= port <= 65535:
        raise LitError(f"--port must be between 0 and 65535, got {port}")
    check_host(host)
    if slots < 1:
        raise LitError(f"--slots must be >= 1, got {slots}")
    if max_queue < 0:
        raise LitError(f"--max_queue must be >= 0, got {max_queue}")
    if prefill_chunk < 0:
        raise LitError(f"--prefill_chunk must be >= 0 (0: whole prompts), got {prefill_chunk}")
    if kv_cache_tokens is not None and kv_cache_tokens < 16:
        raise LitError(f"--kv_cache_tokens must be >= 16 (one block of the KV cache), got {kv_cache_tokens}")
    if max_seq_length is not None and max_seq_length < 2:
        raise LitError(f"--max_seq_length must be >= 2, got {max_seq_length}")
    if prompt_style is not None and prompt_style not in PromptStyle.names():
        raise LitError(f"--prompt_style must be one of {', '.join(PromptStyle.names())}, got {prompt_style!r}")
    if checkpoint_dir is None:
        return None
    checkpoint_dir = Path(checkpoint_dir)
    return check_lora_flags(lora, max_loras, max_lora_rank, checkpoint_dir, model_name or checkpoint_dir.name,
                            lora_path, adapter_path, allow_other_base)


def check_host(host: str) -> None:
    """--host must name an address of this machine: a name that does not resolve, or an address another machine
    has, is said so here (before any weights are read), not later as a port "in use"."""
    import socket

    # the family uvicorn binds with: IPv6 for an address with colons, else IPv4 ("localhost" is 127.0.0.1)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        address = socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)[0][4]
    except (socket.gaierror, UnicodeError) as e:
        reason = e.strerror if isinstance(e, socket.gaierror) else str(e)
        raise LitError(f"--host {host!r} does not resolve to an address ({reason}): pass an address of this machine,"
                       " e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address[0], 0))  # any free port: only the address is in question here
        except OSError as e:
            resolved = "" if address[0] == host else f" ({address[0]})"
            raise LitError(f"--host {host!r}{resolved} is not an address of this machine ({e.strerror}): pass one of"
                           " its addresses, e.g. 127.0.0.1 or 0.0.0.0") from None


def serve(loaded: Any, host: str = "127.0.0.1", port: int = 8000, model_name: Optional[str] = None, slots: int = 8,
          max_seq_length: Optional[int] = None, max_queue: int = 64, prompt_style: Optional[str] = None,
          prefill_chunk: int = 32, prefix_cache: bool = True, loras: Any = None,
          kv_cache_tokens: Optional[int] = None, prefill_with_decode: bool = True) -> None:
    """Serve `loaded` (recipes.evaluate.EvalModel) until Ctrl-C / SIGTERM, then drain and return; `loras`: the LoRA
    adapters to serve beside it (`check_serve_args`' plan)."""
    import uvicorn

    from lit_gpt.prompts import PromptStyle, describe_style
    from lit_gpt.recipes.openai_api import build_app
    from lit_gpt.recipes.serving import Engine

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    length = max_seq_length or min(loaded.block_size, DEFAULT_MAX_SEQ_LENGTH)
    if length > loaded.block_size:
        raise LitError(f"--max_seq_length {length} is beyond the model's context ({loaded.block_size})")
    style = PromptStyle.from_checkpoint(loaded.checkpoint_dir, prompt_style)
    log(describe_style(style, loaded.checkpoint_dir, prompt_style, "Prompt style of /v1/chat/completions"))
    name = model_name or loaded.checkpoint_dir.name
    served = None
    if loras is not None:  # the bank goes into the model before the engine's warm-up: its graphs hold the gather
        from lit_gpt.recipes.serve_loras import ServedLoRAs

        with loaded.runtime.inference_context():
            served = ServedLoRAs.start(loaded, loras)
        log(f"LoRA adapters: {', '.join(served.by_name) or 'none yet'} (room for {loras.capacity}, rank up to"
            f" {loras.rank})")
    engine = Engine(loaded, slots=slots, max_seq_length=length, max_queue=max_queue, prefill_chunk=prefill_chunk,
                    prefix_cache=prefix_cache, log=log, kv_cache_tokens=kv_cache_tokens,
                    prefill_with_decode=prefill_with_decode)
    log(f"Warming up ({engine.runtime.name}: {slots} slots x {length} positions) ...")
    warm = engine.warm_up()
    log(f"Warm-up: {warm['seconds']:.1f} s, {warm['compiles']} compilations (prefill calls of {warm['rows']} rows x"
        f" {warm['chunk']} tokens)")

    app = build_app(engine, name, style, served)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=None)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # not on its thread: the main thread owns the signals (below)
    thread = threading.Thread(target=server.run, name="http", daemon=True)

    stopping = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if stopping.is_set():  # the second one: leave now
            log("Stopped without draining.")
            os._exit(130)
        stopping.set()
        server.should_exit = True
        log(f"{signal.Signals(signum).name}: finishing the requests in flight (again to stop at once) ...")

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        thread.start()
        while not server.started and thread.is_alive():
            time.sleep(0.02)
        if not server.started:
            raise LitError(f"could not listen on {host}:{port} (the port is in use, or needs privileges):"
                           " choose another --port")
        bound = server.servers[0].sockets[0].getsockname()[1] if server.servers else port
        log(f"Serving {name!r} on http://{host}:{bound}/v1 (Ctrl-C to stop)")
        # until uvicorn is done: after a signal it waits for the open connections, which the engine finishes
        engine.run(lambda: not thread.is_alive())
        thread.join()
        log(f"Stopped after {engine.stats['admitted']} requests.")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
