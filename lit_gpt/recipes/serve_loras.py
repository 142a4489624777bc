"""Many LoRA adapters on one served base model (serve/base.py `--lora NAME=PATH`, repeatable): a request's `model`
picks its adapter (the base model's name: no adapter), and requests for different adapters and for the base share
one decode step through the per-row gather of `lit_gpt.lora_bank`. Adapters are also loaded and unloaded while the
server runs, through vLLM's endpoints:

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "out/lora/sql/final/lit_model.lora.safetensors"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

Both answer 200 with a line of text (as vLLM's do), or an OpenAI error body: 400 for a file that is not LoRA
weights, LoRA weights of another base model (its recorded fingerprint, `lit_gpt.fingerprint`), a name in use, no free
place (`--max_loras`); 404 for unloading a name not served. The file is read on the server's machine: mind who can
reach the server (`--host`). A load is checked and staged on an HTTP thread, written into the bank on the engine's
thread between two steps (`Engine.tasks`), and its name answers requests once it is in. An unloaded adapter's
name is refused at once; its place in the bank is reused once no request in flight or waiting uses it.

Ids: each adapter gets an id never used before (1, 2, ...; 0 is the base model). The engine keys its rows and the
prefix cache's hash chain by it (`Job.adapter`), so the keys and values computed for one adapter are never reused
for another, not even for an adapter loaded later into the same place.
"""

import asyncio
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from lit_gpt.utils import LitError

DEFAULT_MAX_LORA_RANK = 16  # vLLM's default --max-lora-rank


@dataclass
class LoRAPlan:
    """What `--lora`, `--max_loras` and `--max_lora_rank` ask for, checked (`check_lora_flags`)."""

    adapters: List[Tuple[str, Path]]
    capacity: int
    rank: int
    allow_other_base: bool = False


def repeatable_lora(argv: Sequence[str]) -> List[str]:
    """The command line with every `--lora X` as `--lora+ X`: jsonargparse appends to a list with `+`, and would
    otherwise keep the last --lora only."""
    return ["--lora+" + a[len("--lora"):] if a == "--lora" or a.startswith("--lora=") else a for a in argv]


def parse_lora_flag(value: str) -> Tuple[str, Path]:
    name, sep, path = str(value).partition("=")
    name = name.strip()
    if not sep or not name or not path:
        raise LitError(f"--lora takes NAME=PATH (the name requests send as \"model\", then the LoRA weights file),"
                       f" got {value!r}")
    return name, Path(path)


def check_lora_flags(lora: Optional[Sequence[str]], max_loras: Optional[int], max_lora_rank: Optional[int],
                     checkpoint_dir: Path, served_name: str, lora_path: Optional[Path] = None,
                     adapter_path: Optional[Path] = None, allow_other_base: bool = False) -> Optional[LoRAPlan]:
    """The adapters' flags and files, checked before any weights are read (one LitError line each); None when the
    server holds no adapters."""
    adapters = [parse_lora_flag(v) for v in lora or ()]
    if max_loras is not None and max_loras < 0:
        raise LitError(f"--max_loras must be >= 0, got {max_loras}")
    if max_lora_rank is not None and max_lora_rank < 1:
        raise LitError(f"--max_lora_rank must be >= 1, got {max_lora_rank}")
    capacity = len(adapters) if max_loras is None else max_loras
    if not capacity:
        if adapters or max_lora_rank is not None:
            raise LitError("--max_loras 0 leaves no room for the --lora adapters: raise it or leave it unset")
        return None
    if len(adapters) > capacity:
        raise LitError(f"{len(adapters)} --lora adapters but --max_loras {capacity}: raise --max_loras")
    if lora_path is not None or adapter_path is not None:
        flag = "--lora_path" if lora_path is not None else "--adapter_path"
        raise LitError(f"{flag} changes the base model itself, --lora / --max_loras serve adapters beside the base:"
                       f" pass one or the other (merge with scripts/merge_lora.py to serve adapters on a finetune)")
    names: Set[str] = set()
    configs = []
    fingerprints: Dict[str, str] = {}
    for name, path in adapters:
        if name == served_name:
            raise LitError(f"--lora {name}=...: {name!r} is the base model's name (--model_name): give the adapter"
                           " another one")
        if name in names:
            raise LitError(f"--lora {name}=... is given twice: give each adapter its own name")
        names.add(name)
        configs.append(check_lora_file(path, checkpoint_dir, allow_other_base, f"--lora {name}={path}",
                                       fingerprints))
    rank = max_lora_rank or max([c.lora_r for c in configs] + ([] if configs else [DEFAULT_MAX_LORA_RANK]))
    for (name, path), config in zip(adapters, configs):
        if config.lora_r > rank:
            raise LitError(f"--lora {name}={path} has rank {config.lora_r}, above --max_lora_rank {rank}: raise it")
    return LoRAPlan(adapters, capacity, rank, allow_other_base)


def check_lora_file(path: Path, checkpoint_dir: Path, allow_other_base: bool, what: str,
                    fingerprints: Dict[str, str], at_run_time: bool = False) -> Any:
    """A LoRA weights file for the base in `checkpoint_dir`: its method, the base it records (refused when another,
    unless `allow_other_base`) and its settings, as --lora_path's (lit_gpt.recipes.evaluate.check_eval_args).
    Returns its `lit_gpt.lora.Config`. `fingerprints` caches the base's fingerprint."""
    from lit_gpt import lora
    from lit_gpt.fingerprint import check_base, fingerprint
    from lit_gpt.peft import finetuned_method_of
    from lit_gpt.weights import read_base_record, read_finetuned_metadata

    path = Path(path)
    if not path.is_file():
        raise LitError(f"{what}: {str(path)!r} not found: pass the lit_model.lora.safetensors that finetune/lora.py"
                       " wrote")
    found = finetuned_method_of(path)
    if found is None:
        raise LitError(f"{what}: {str(path)!r} is not a finetuned-weights file of LoRA (no method recorded beside"
                       " it)")
    if found != "lora":
        raise LitError(f"{what}: {str(path)!r} holds {found} weights, not LoRA: only LoRA adapters are served per"
                       " request (serve it with --adapter_path)")
    recorded = read_base_record(path)
    if recorded is not None:
        key = str(checkpoint_dir)
        if key not in fingerprints:
            fingerprints[key] = fingerprint(checkpoint_dir)
        actual = fingerprints[key]
        expected = recorded.get("fingerprint") if isinstance(recorded, dict) else None
        if at_run_time and expected != actual and not allow_other_base:
            raise LitError(f"{what}: {str(path)!r} holds LoRA weights of another base model"
                           f" ({recorded.get('checkpoint_dir')!r}, {expected}) than this server's"
                           f" {str(checkpoint_dir)!r} ({actual}): load a LoRA finetuned from this base")
        check_base(recorded, checkpoint_dir, allow_other_base, f"{what}: the lora weights file", actual=actual)
    fields = read_finetuned_metadata(path)["config"]
    try:
        config = lora.Config.from_checkpoint(checkpoint_dir, **fields)
    except (TypeError, ValueError) as e:
        raise LitError(f"{what}: its settings do not fit this model ({e})") from None
    for flag, why in (("lora_head", "the head"), ("lora_experts", "MoE experts")):
        if getattr(config, flag):
            raise LitError(f"{what}: adapts {why} ({flag}), which is not served per request: serve it merged with"
                           " --lora_path")
    return config


@dataclass
class Served:
    name: str
    path: Path
    id: int
    rank: int


@dataclass
class ServedLoRAs:
    """The adapters of a server: their names, ids and places in the model's `LoRABank`. `id_of` and the HTTP
    routes run on the event loop's thread, `bank.write` on the engine's."""

    loaded: Any
    plan: LoRAPlan
    bank: Any = None
    by_name: Dict[str, Served] = field(default_factory=dict)
    retired: Set[int] = field(default_factory=set)  # ids unloaded whose place may still be in use
    reserved: Set[int] = field(default_factory=set)  # places a load in progress will fill
    fingerprints: Dict[str, str] = field(default_factory=dict)
    next_id: int = 1
    lock: Any = field(default_factory=threading.Lock)

    @classmethod
    def start(cls, loaded: Any, plan: LoRAPlan) -> "ServedLoRAs":
        """The bank in `loaded`'s model (before the engine's warm-up: its graphs hold the gather) with the --lora
        adapters in it; on the device's thread."""
        from lit_gpt.lora_bank import LoRABank

        runtime = loaded.runtime
        served = cls(loaded, plan)
        served.bank = LoRABank.install(loaded.gpt, plan.capacity, plan.rank, bool(runtime.compiles_graphs),
                                       runtime.to_device)
        for name, path in plan.adapters:
            staged, rank = served.stage(path, f"--lora {name}={path}")
            adapter = served.new(name, path, rank)
            served.bank.write(served.bank.free_row(), adapter.id, staged)
            runtime.end_step()
            served.by_name[name] = adapter
        free = served.bank.free_row()
        if runtime.compiles_graphs and free is not None:  # the copies of a load at run time, compiled now
            served.bank.clear(free)
            runtime.end_step()
        return served

    def new(self, name: str, path: Path, rank: int) -> Served:
        adapter = Served(name, Path(path), self.next_id, rank)
        self.next_id += 1
        return adapter

    def stage(self, path: Path, what: str, at_run_time: bool = False) -> Tuple[Any, int]:
        """Check a file (`check_lora_file`) and read it into the bank's layout (on the host)."""
        from lit_gpt.peft import load_finetuned

        config = check_lora_file(path, self.loaded.checkpoint_dir, self.plan.allow_other_base, what,
                                 self.fingerprints, at_run_time)
        state, _ = load_finetuned(path, "lora")
        try:
            return self.bank.stage(state, config), config.lora_r
        except LitError as e:
            raise LitError(f"{what}: {e}") from None

    def id_of(self, model: str) -> Optional[int]:
        adapter = self.by_name.get(model)
        return None if adapter is None else adapter.id

    def cards(self, created: int, parent: str) -> List[Dict[str, Any]]:
        """/v1/models' entries of the adapters (vLLM's fields: `root` the file, `parent` the base model)."""
        return [{"id": a.name, "object": "model", "created": created, "owned_by": "lit_gpt", "root": str(a.path),
                 "parent": parent} for a in self.by_name.values()]

    def _free_retired(self, engine: Any) -> None:
        """Give back the places of unloaded adapters that no request in flight or waiting uses any more."""
        with engine.lock:
            used = {job.adapter for job in list(engine.jobs) + list(engine.waiting) if job is not None}
        for adapter_id in sorted(self.retired - used):
            self.bank.release(adapter_id)
            self.retired.discard(adapter_id)

    async def load(self, engine: Any, name: str, path: str) -> None:
        """POST /v1/load_lora_adapter: check and stage the file off the event loop, then write it into a free place
        on the engine's thread; the name serves requests once it is in. LitError: a 400 line."""
        what = f"lora_path {path!r}"
        taken = _refusal(f"the LoRA adapter {name!r} is loaded already: unload it first, or pick another name",
                         "lora_name")
        if name in self.by_name:
            raise taken
        staged, rank = await asyncio.to_thread(self.stage, Path(path), what, True)
        if name in self.by_name:  # loaded by another request meanwhile
            raise taken
        self._free_retired(engine)
        row = self.bank.free_row(self.reserved)
        if row is None:
            raise _refusal(f"all {self.bank.capacity} places for LoRA adapters are taken (--max_loras"
                           f" {self.bank.capacity}): unload one first", None)
        self.reserved.add(row)
        adapter = self.new(name, Path(path), rank)
        loop = asyncio.get_running_loop()
        done: "asyncio.Future[Optional[BaseException]]" = loop.create_future()

        def write() -> None:  # on the engine's thread, between two steps
            error: Optional[BaseException] = None
            try:
                self.bank.write(row, adapter.id, staged)
                engine.runtime.end_step()
            except BaseException as e:  # reported to the request, the engine goes on
                error = e
            loop.call_soon_threadsafe(done.set_result, error)

        try:
            with engine.lock:  # the engine runs its tasks between two steps, on its thread (Engine.run)
                engine.tasks.append(write)
                engine.lock.notify()
            error = await done
        finally:
            self.reserved.discard(row)
        if error is not None:
            raise LitError(f"could not load {what}: {error}")
        self.by_name[name] = adapter

    def unload(self, name: str) -> None:
        """POST /v1/unload_lora_adapter: the name is refused from now on; its place is freed once unused."""
        adapter = self.by_name.pop(name, None)
        if adapter is None:
            raise KeyError(name)
        self.retired.add(adapter.id)


def _refusal(message: str, param: Optional[str]) -> LitError:
    error = LitError(message)
    error.param = param  # type: ignore[attr-defined]  # the request field the HTTP answer names
    return error


def add_lora_routes(app: Any, engine: Any, served: Optional[ServedLoRAs], base_name: str, api_error: Any) -> None:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter on `app` for the server of `base_name`
    (`api_error(status, message, param)`: the exception the app answers with OpenAI's error body)."""
    from fastapi.responses import PlainTextResponse
    from pydantic import BaseModel, ConfigDict, Field

    class LoadRequest(BaseModel):
        model_config = ConfigDict(extra="allow")  # vLLM's load_inplace, lora_int_id, ...: not used here
        lora_name: str = Field(min_length=1)
        lora_path: str = Field(min_length=1)

    class UnloadRequest(BaseModel):
        model_config = ConfigDict(extra="allow")
        lora_name: str = Field(min_length=1)

    def bank() -> ServedLoRAs:
        if served is None:
            raise api_error(400, "this server holds no LoRA adapters: start it with --max_loras N (and --lora"
                                 " NAME=PATH) to load them", None)
        return served

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadRequest) -> Any:
        loras = bank()
        if body.lora_name == base_name:
            raise api_error(400, f"{body.lora_name!r} is the base model's name: give the adapter another one",
                            "lora_name")
        try:
            await loras.load(engine, body.lora_name, body.lora_path)
        except LitError as e:
            raise api_error(400, str(e), getattr(e, "param", "lora_path"))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadRequest) -> Any:
        try:
            bank().unload(body.lora_name)
        except KeyError:
            raise api_error(404, f"the LoRA adapter {body.lora_name!r} is not loaded", "lora_name")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
