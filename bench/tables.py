"""Write the results tables of README.md, xla/README.md and tutorials/resources.md from bench/results/*.json.

    python bench/tables.py           # rewrite the tables in place
    python bench/tables.py --check   # exit 1 if a page differs from what would be written

A table sits between `<!-- bench-table: NAME -->` and `<!-- /bench-table -->` in a page; everything between the
two markers is replaced. Each number in a table comes from a result file (written by `bench/*.py --results_file`),
and each table names its files, so a reader can see the machine, the versions, the date and the exact command. A
bench without a result file shows "not measured". The memory estimates of `resources` are computed here from the
model configs (bytes per parameter; labelled "estimate"), not measured.
"""

import argparse
import math
import json
import re
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGES = (ROOT / "README.md", ROOT / "xla" / "README.md", ROOT / "tutorials" / "resources.md", ROOT / "tutorials" / "moe.md",
         ROOT / "tutorials" / "finetune_dpo.md")
_TABLE = re.compile(r"(<!-- bench-table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /bench-table -->)", re.S)


def load(name: str) -> Optional[dict]:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _f(value: Optional[float], fmt: str = ".2f", missing: str = "n/a") -> str:
    return missing if value is None else format(value, fmt)


def _source(*records: Optional[dict]) -> str:
    """The line under a table: which files, machine, versions, date."""
    found = [r for r in records if r]
    if not found:
        return ""
    first = found[0]
    m, v = first["machine"], first["versions"]
    files = ", ".join(f"`bench/results/{r['_file']}`" for r in found)
    dates = sorted({r["date"][:10] for r in found})
    commits = sorted({(r.get("commit") or "unknown")[:10] for r in found})
    line = (f"\nFrom {files} ({m['cpu']}, {m['cpu_cores_usable']} cores, {m['memory_gib']} GiB"
            f"{', ' + m['gpu'] if m.get('gpu') else ''}; torch {v['torch']}"
            f"{', torch_xla ' + v['torch_xla'] if v.get('torch_xla') else ''}, transformers {v['transformers']};"
            f" {', '.join(dates)}; commit {', '.join(commits)}).")
    loads = [x for r in found for x in (r["load_average"]["start"][0], r["load_average"]["end"][0])]
    line += (f" 1-minute load average {min(loads):.1f}-{max(loads):.1f} at the starts and ends of the runs, on"
             f" {m['cpu_cores_usable']} cores.")
    notes = sorted({r["note"] for r in found if r.get("note")})
    if notes:
        line += " " + " ".join(f"Note: {n}." if not n.endswith(".") else f"Note: {n}" for n in notes)
    return line + "\n"


def _not_measured(head: List[str], command: str) -> str:
    """A table of `head` (its header and separator rows) whose one row says how to produce its result file."""
    empty_cells = head[0].count("|") - 2
    return "\n".join(head + [f"| not measured (run `{command}`) |" + " |" * empty_cells]) + "\n"


def _load_all(*names: str) -> List[Optional[dict]]:
    out = []
    for name in names:
        r = load(name)
        if r is not None:
            r["_file"] = f"{name}.json"
        out.append(r)
    return out


# ---------------------------------------------------------------------------------------------------------------
# the tables
# ---------------------------------------------------------------------------------------------------------------
def cpu_generate() -> str:
    (r,) = _load_all("generate_cpu")
    lines = ["| implementation (CPU, fp32, batch 1, greedy) | tokens/s | ratio to transformers |", "| --- | --- | --- |"]
    if r is None:
        return _not_measured(lines, "python bench/generate.py --results_file bench/results/generate_cpu.json")
    res, s = r["results"], r["settings"]
    lines.append(f"| `generate/base.py` (eager) | {_f(res['ours_tokens_per_s'])} | {_f(res['ours_ratio'])}x |")
    if "ours_compiled_tokens_per_s" in res:
        compile_s = res.get("ours_compiled_first_run_s")
        first = (f"; first run (compiling) {_f(compile_s, '.0f')} s = {_f(res['ours_compiled_first_run_ratio'])}x"
                 if compile_s else "")
        lines.append(f"| `generate/base.py --compile default` | {_f(res['ours_compiled_tokens_per_s'])}"
                     f" | {_f(res['ours_compiled_ratio'])}x{first} |")
    lines.append(f"| transformers `generate` | {_f(res['transformers_tokens_per_s'])} | 1.00x |")
    if "transformers_static_tokens_per_s" in res:
        lines.append(f"| transformers `generate`, static cache | {_f(res['transformers_static_tokens_per_s'])}"
                     f" | {_f(res['transformers_static_tokens_per_s'] / res['transformers_tokens_per_s'])}x |")
    same = all(res.get("tokens_equal_to_transformers", {}).values())
    text = "\n".join(lines) + "\n"
    text += (f"\n{s['checkpoint']}, {s['prompt_tokens']}-token prompt, {s['max_new_tokens']} new tokens,"
             f" {s['threads']} threads; medians of {s['runs']} interleaved runs"
             + (f"; our weights: {s['cpu_layout']}" if s.get("cpu_layout") else "") + "; greedy tokens"
             f" {'identical to' if same else 'NOT identical to'} transformers'.\n")
    return text + _source(r)


def cpu_generate_gemma3() -> str:
    (r,) = _load_all("generate_gemma3_cpu")
    lines = ["| implementation (CPU, fp32, batch 1, greedy) | steady decode tokens/s | decode vs transformers"
             " | whole call tokens/s | whole call vs transformers | memory growth during generate | peak RSS"
             " | KV cache | greedy tokens equal to transformers' |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    if r is None:
        return _not_measured(lines, "python bench/generate.py --setting gemma3 --results_file"
                                   " bench/results/generate_gemma3_cpu.json")
    res, s, a = r["results"], r["settings"], r["settings"]["architecture"]
    n = s["max_new_tokens"]
    matching = res.get("tokens_matching_transformers", {})

    def memory(name: str) -> List[str]:
        if f"{name}_peak_growth_mib" not in res:
            return ["not measured"] * 3
        kv, file_backed = res.get(f"{name}_kv_cache_mib"), res.get(f"{name}_rss_file_backed_gib")
        return [f"{_f(res[f'{name}_peak_growth_mib'], '.0f')} MiB",
                f"{_f(res[f'{name}_peak_rss_gib'])} GiB"
                + ("" if file_backed is None else f" ({_f(file_backed)} file-backed)"),
                "n/a" if kv is None else f"{_f(kv, '.1f')} MiB"]

    dyn, dyn_decode = res["transformers_tokens_per_s"], res["transformers_decode_tokens_per_s"]
    rows = [("`generate/base.py` (eager)", "ours", _f(res["ours_decode_ratio"]) + "x", _f(res["ours_ratio"]) + "x"),
            ("transformers `generate`", "transformers", "1.00x", "1.00x")]
    if "transformers_static_tokens_per_s" in res:
        st_decode = res["transformers_static_decode_tokens_per_s"]
        rows.append(("transformers `generate`, static cache", "transformers_static",
                     "n/a" if not (st_decode and dyn_decode) else _f(st_decode / dyn_decode) + "x",
                     _f(res["transformers_static_tokens_per_s"] / dyn) + "x"))
    for label, name, decode_ratio, ratio in rows:
        same = "-" if name == "transformers" else f"{matching[name]} of {n}" if name in matching else "n/a"
        lines.append("| " + " | ".join([label, _f(res[f"{name}_decode_tokens_per_s"]), decode_ratio,
                                         _f(res[f"{name}_tokens_per_s"]), ratio, *memory(name), same]) + " |")
    text = "\n".join(lines) + "\n"
    text += (f"\n{a['base']}'s layout shrunk to {a['n_layer']} layers ({a['sliding_layers']} with a"
             f" {a['sliding_window_size']}-token sliding window, {a['full_layers']} global: 5 to 1), width {a['n_embd']},"
             f" {a['n_head']} query heads on {a['n_query_groups']} KV head of {a['head_size']}, MLP"
             f" {a['intermediate_size']}, vocabulary {a['vocab_size']}: {a['parameters'] / 1e6:.0f}M parameters, random"
             f" weights (transformers `Gemma3ForCausalLM`, converted with `lit_gpt.convert`). A {s['prompt_tokens']}-token"
             f" random prompt (longer than the window), {n} new tokens, {s['threads']}"
             f" thread{'' if s['threads'] == 1 else 's'}; medians of {s['runs']}"
             f" interleaved runs after one warm-up each; ratios are medians of per-run ratios (the static cache's: of"
             f" the medians); our weights: {s['cpu_layout']}; transformers attention: {s['transformers_attention']}."
             " Memory: each contender generates once more in a fresh process, after a short warm-up generation;"
             " growth = the RSS high-water mark during the call minus the RSS before it (KV cache, activations,"
             " workspace); peak RSS = that high-water mark, weights and runtime included; in parentheses its part"
             " that was file-backed before the call: pages of the memory-mapped weight files (our `lit_model.pth`,"
             " transformers' `model.safetensors`), which the kernel can drop. Our anonymous part also holds the"
             " copies `use_cpu_inference_layout` makes at load, as generate/base.py does (the linear weights in"
             " oneDNN's packed layout, the tied head column-major), while the mapped originals stay resident. KV cache"
             " = the bytes of the cache the call leaves (sliding layers hold their window: ours a ring of"
             " `sliding_window_size` entries, `lit_gpt.kv_cache`; transformers' its sliding-window cache layers).\n")
    return text + _source(r)


def cpu_finetune() -> str:
    (r,) = _load_all("finetune_cpu")
    head = ["| method (CPU, fp32) | s / step | tokens/s (padded) | peak RSS | CPU time, whole run | litgpt 0.5.13 s / step"
            " | litgpt peak RSS | litgpt CPU time | speed vs litgpt |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    if r is None:
        return _not_measured(head, "python bench/finetune.py --results_file bench/results/finetune_cpu.json")
    res, s = r["results"], r["settings"]
    for method in s["methods"]:
        o, lg = res.get(f"{method}/ours"), res.get(f"{method}/litgpt")
        if o is None:
            continue
        cells = [method, _f(o["s_per_iteration"]), _f(o["padded_tokens_per_s"], ".0f"), f"{_f(o['peak_rss_gib'])} GiB",
                 f"{_f(o['cpu_s'], '.0f')} s"]
        if lg:
            cells += [_f(lg["s_per_iteration"]), f"{_f(lg['peak_rss_gib'])} GiB", f"{_f(lg['cpu_s'], '.0f')} s",
                      f"{_f(lg['s_per_iteration'] / o['s_per_iteration'])}x"]
        else:
            cells += ["not measured"] * 4
        head.append("| " + " | ".join(cells) + " |")
    text = "\n".join(head) + "\n"
    text += (f"\n{s['checkpoint']}, micro batch {s['micro_batch_size']} = one optimizer step, max length"
             f" {s['max_seq_length']}, synthetic Alpaca-style rows; {s['steps']} steps per run, timed from step"
             f" {s['timed_from_step']}; medians of {s['repeats']} run(s); each recipe in its own process. \"CPU time\" is the"
             f" process's user + system CPU seconds for the whole run (start-up included): on a loaded machine it"
             f" varies less than the wall-clock step times.\n")
    return text + _source(r)


GPU_COMMANDS = (
    "`python bench/generate.py --setting random --compile '[reduce-overhead]' --quantize '[torchao.int8wo]'"
    " --results_file bench/results/generate_gpu.json`",
    "`python bench/finetune.py --setting gpu --litgpt_path /tmp/litgpt_pkg --results_file"
    " bench/results/finetune_gpu.json`",
    "`python bench/quantize.py --dtypes '[bfloat16]' --results_file bench/results/quantize_gpu.json`",
)


def gpu() -> str:
    gen, ft, qz = _load_all("generate_gpu", "finetune_gpu", "quantize_gpu")
    if not any((gen, ft, qz)):
        return ("GPU: not measured (no result files `bench/results/*_gpu.json`; on a GPU machine run "
                + ", ".join(GPU_COMMANDS) + ").\n")
    parts = []
    if gen is not None:
        res, s = gen["results"], gen["settings"]
        lines = ["| decode (GPU, batch 1, greedy) | steady decode tokens/s | vs transformers static cache"
                 " | vs our unquantized, same mode | first run (compiling) |", "| --- | --- | --- | --- | --- |"]
        names = [k[: -len("_decode_tokens_per_s")] for k in res if k.endswith("_decode_tokens_per_s")]
        for name in names:
            ratio = res.get(f"{name}_decode_ratio_static")
            unquantized = res.get(f"{name}_decode_ratio_unquantized")
            lines.append(f"| {name} | {_f(res[f'{name}_decode_tokens_per_s'], '.1f')}"
                         f" | {'-' if name == 'transformers_static' else _f(ratio) + 'x'}"
                         f" | {'-' if unquantized is None else _f(unquantized) + 'x'}"
                         f" | {_f(res.get(f'{name}_first_run_s'), '.1f')} s |")
        parts.append("\n".join(lines) + f"\n\n{s['checkpoint']} on {s['device']}, {s['precision']},"
                     f" {s['prompt_tokens']}-token prompt, {s['max_new_tokens']} new tokens; medians of {s['runs']}"
                     f" interleaved runs after one warm-up each (targets: >= 2.2x the static cache; int8 weight-only >= 1.6x"
                     " our bf16 decode).\n" + _source(gen))
    if ft is not None:
        res, s = ft["results"], ft["settings"]
        lines = ["| finetune (GPU) | steady padded tokens/s | MFU | whole-loop padded tokens/s | peak memory"
                 " | whole loop vs litgpt | peak memory vs litgpt |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for key, r in res.items():
            method, who = key.split("/")
            lg = res.get(f"{method}/litgpt")
            mfu = r.get("mfu")
            vs = (_f(r["whole_loop_padded_tokens_per_s"] / lg["whole_loop_padded_tokens_per_s"]) + "x"
                  if lg and who != "litgpt" and r.get("whole_loop_padded_tokens_per_s") else "-")
            mem = (_f(r["peak_memory_gb"] / lg["peak_memory_gb"]) + "x"
                   if lg and who != "litgpt" and r.get("peak_memory_gb") and lg.get("peak_memory_gb") else "-")
            lines.append(f"| {method} {who} | {_f(r.get('recipe_padded_tokens_per_s') or r['padded_tokens_per_s'], '.0f')}"
                         f" | {'n/a' if mfu is None else _f(mfu * 100, '.1f') + '%'}"
                         f" | {_f(r.get('whole_loop_padded_tokens_per_s'), '.0f')}"
                         f" | {_f(r.get('peak_memory_gb'))} GB | {vs} | {mem} |")
        text = "\n".join(lines) + "\n"
        q, base = res.get("lora/ours_qlora"), res.get("lora/ours")
        if q and base and q.get("peak_memory_gb") and base.get("peak_memory_gb"):
            text += f"\nQLoRA (nf4) peak memory: {_f(q['peak_memory_gb'] / base['peak_memory_gb'])}x bf16 LoRA's.\n"
        text += (f"\n{s['checkpoint']} (random weights), {s['precision']}, micro batch {s['micro_batch_size']}, global"
                 f" batch {s['global_batch_size']}, max length {s['max_seq_length']}, samples of"
                 f" {s['sample_tokens'][0]}-{s['sample_tokens'][1]} tokens, {s['steps']} steps, medians of"
                 f" {s['repeats']} run(s); steady = the recipe's own count, compiling and first steps apart"
                 " (targets: MFU >= 30%, whole loop >= 1.5x litgpt 0.5.13, peak memory <= litgpt's, QLoRA <= 0.5x).\n")
        parts.append(text + _source(ft))
    if qz is not None:
        parts.append("GPU quantization quality, `bench/quantize.py` (the real SmolLM2-135M: at this size and batch 1 the"
                     " decode is bound by kernel launches, not by weight bytes, so its speed column says little about"
                     " bandwidth; the int8 speed target, >= 1.6x our bf16 decode at 1.7B, is `bench/generate.py"
                     " --quantize`'s `_decode_ratio_unquantized`).\n\n" + quantize_table(qz))
    missing = [c for c, r in zip(GPU_COMMANDS, (gen, ft, qz)) if r is None]
    if missing:
        parts.append("Not measured yet: " + ", ".join(missing) + ".\n")
    return "\n".join(parts)


def xla_generate() -> str:
    one, eight = _load_all("xla_generate_cpu1", "xla_generate_cpu8")
    lines = ["| devices | prompt tokens (bucket) | new tokens | compilations | time to first token | steady XLA tokens/s"
             " | steady eager tokens/s | XLA / eager | same tokens |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in (one, eight):
        if r is None:
            continue
        n = r["settings"]["devices"]
        for row in r["results"]:
            equal = row["tokens_equal"]
            lines.append(
                f"| {n} | {row['prompt_tokens']} ({row['bucket']}) | {row['new_tokens']} | {row['compiles']}"
                f" | {_f(row['time_to_first_token_s'])} s | {_f(row['xla_tokens_per_s'])}"
                f" | {_f(row['eager_tokens_per_s'], missing='')} | {_f(row['xla_over_eager'], missing='')}"
                f" | {'' if equal is None else ('yes' if equal else 'no')} |")
    if len(lines) == 2:
        lines.append("| not measured | | | | | | | | |")
    return "\n".join(lines) + "\n" + _source(one, eight)


def xla_finetune() -> str:
    names = ("xla_finetune_lora_cpu1", "xla_finetune_lora_cpu8", "xla_finetune_full_cpu8")
    records = _load_all(*names)
    lines = ["| method | devices | train-step compilations | steady step | tokens/s | MFU | eager step (same batch)"
             " | XLA / eager |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        if r is None or r["results"] is None:
            continue
        s, res = r["settings"], r["results"]
        lines.append(
            f"| {s['method']} | {s['devices']} | {res['train_compiles']} | {_f(res['step_s'])} s"
            f" | {_f(res['tokens_per_s'], '.0f')}"
            f" | {_f(100 * res['mfu'], '.1f') + '%' if res['peak_name'].startswith('TPU') else 'n/a (CPU)'}"
            f" | {_f(res.get('eager_step_s'), missing='')}{' s' if res.get('eager_step_s') else ''}"
            f" | {_f(res.get('xla_over_eager_step_time'), missing='')} |")
    if len(lines) == 2:
        lines.append("| not measured | | | | | | | |")
    first = next((r for r in records if r), None)
    text = "\n".join(lines) + "\n"
    if first:
        s = first["settings"]
        text += (f"\n{s['model_name']} architecture cut to {s['n_layer']} layers, random weights, {s['micro_batch_size']} x"
                 f" {s['seq_len']} tokens per device per step, AdamW, {s['precision']}, {s['steps']} steps (steady"
                 f" steps timed: those that compiled nothing). MFU is given for TPUs only: on the CPU the bench"
                 f" divides by the torch.mm throughput it measures at that moment, which on a shared machine is"
                 f" no peak (the result files keep it).\n")
    return text + _source(*records)


def xla_load() -> str:
    records = _load_all("xla_load_cpu", "xla_load_tied_cpu")
    lines = ["| model | file | loaded as | devices | cast | peak - final | x largest block | x largest tensor"
             " | peak - (start + model), x bound | bit-equal |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        if r is None:
            continue
        c = r["settings"]["config"]
        name = (f"{c['n_layer']} x {c['n_embd']}, vocab {c['vocab_size']}{', tied' if c['tie_embeddings'] else ''}")
        for row in r["results"]:
            lines.append(
                f"| {name} | {row['file']} | {row['precision']} | {row['devices']} | {'yes' if row['cast'] else 'no'}"
                f" | {row['mode']}: {_f(1024 * row['overhead_gib'], '.0f')} MiB | {_f(row['x_block'])}"
                f" | {_f(row['x_tensor'])} | {_f(row['above_model_x_bound'])}"
                f" | {'' if row['bit_equal'] is None else ('yes' if row['bit_equal'] else 'NO')} |")
    if len(lines) == 2:
        lines.append("| not measured (run `python bench/load.py --sweep true --results_file bench/results/xla_load_cpu.json`)"
                     " | | | | | | | | | |")
    text = "\n".join(lines) + "\n"
    text += ("\nHost anonymous memory (RssAnon, sampled every 1 ms) of loading a random checkpoint onto XLA:CPU, each load"
             " in a fresh process; staged = `load_staged`, naive = `torch.load` + `load_state_dict` + `fabric.setup`."
             " \"x bound\" divides by the larger of the largest block and the host copies of the largest tensor in the"
             " loaded dtype: the loader places one tensor at a time, and torch_xla 2.9 copies every shard it is handed,"
             " so that tensor is in host memory once without a cast and twice with one (the loader's cast shards and"
             " torch_xla's copies); the target is 1.2x. Memory is sampled from a helper process, which also sees the"
             " peaks inside torch_xla's transfer calls (they hold the GIL).\n")
    return text + _source(*records)


def quantize() -> str:
    (r,) = _load_all("quantize_cpu")
    return quantize_table(r)


def quantize_table(r: Optional[dict]) -> str:
    where = "CPU" if r is None or r["settings"].get("device", "cpu") == "cpu" else r["machine"].get("gpu") or "GPU"
    head = [f"| variant ({where}, batch 1, greedy) | perplexity | vs unquantized | decode tokens/s | vs unquantized"
            " | block weights | same greedy tokens |", "| --- | --- | --- | --- | --- | --- | --- |"]
    if r is None:
        return _not_measured(head, "python bench/quantize.py --results_file"
                                 " bench/results/quantize_cpu.json")
    s = r["settings"]
    lines = list(head)
    for name, v in r["results"]["variants"].items():
        ref = "none" in name
        lines.append(
            f"| {name} | {_f(v['perplexity'], '.3f')} | {'-' if ref else _f(v.get('perplexity_ratio'), '.3f') + 'x'}"
            f" | {_f(v['decode_tokens_per_s'])} | {'-' if ref else _f(v.get('speed_ratio')) + 'x'}"
            f" | {v['weight_bytes'] / 1e6:.0f} MB | {'-' if ref else str(v.get('greedy_same_tokens', 'n/a')) + '/' + str(s['max_new_tokens'])} |"
        )
    text = "\n".join(lines) + "\n"
    skipped = r["results"].get("skipped", {})
    text += (f"\n{s['checkpoint']}; perplexity over `bench/{s['heldout']}` ({s['heldout_tokens']} tokens, one forward);"
             f" decode: {s['prompt_tokens']}-token prompt + {s['max_new_tokens']} new tokens, medians of {s['runs']}"
             f" interleaved rounds, {'compiled' if s['compile'] else 'eager'}; ratios per round against the"
             f" unquantized model of the same dtype; torchao {s['torchao']}."
             + (f" Not run here: {', '.join(sorted(skipped))}." if skipped else "") + "\n")
    return text + _source(r)


def xla_scan() -> str:
    (r,) = _load_all("xla_scan_cpu1")
    lines = ["| layers | compile, loop | compile, scan | scan / loop | steady step, loop | steady step, scan | scan / loop"
             " | largest loss difference |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    if r is None:
        return _not_measured(lines, "PJRT_DEVICE=CPU python bench/xla_scan.py --results_file"
                                   " bench/results/xla_scan_cpu1.json")
    s = r["settings"]
    for depth, v in sorted(r["results"].items(), key=lambda kv: int(kv[0])):
        lines.append(
            f"| {depth} | {_f(v['loop_compile_s'], '.1f')} s | {_f(v['scan_compile_s'], '.1f')} s"
            f" | {_f(v['compile_ratio_scan_over_loop'])} | {_f(v['loop_steady_step_s'])} s"
            f" | {_f(v['scan_steady_step_s'])} s | {_f(v['steady_step_ratio_scan_over_loop'])}"
            f" | {v['max_loss_difference']:.1e} |")
    text = "\n".join(lines) + "\n"
    text += (f"\n{s['method']} finetuning, width {s['n_embd']}, {s['micro_batch_size']} x {s['seq_len']} tokens, {s['steps']}"
             f" steps, {s['precision']}, 1 XLA:CPU device, {s['repeats']} repeat(s); compile = the seconds XLA spent"
             " compiling the run's graphs.\n")
    return text + _source(r)


# memory estimates per method: bytes per parameter of what scales with the model (activations not included)
_ESTIMATE_MODELS = ("SmolLM2-135M-Instruct", "SmolLM2-1.7B-Instruct", "Llama-3.2-1B-Instruct", "Llama-3.2-3B-Instruct",
                    "Llama-3.1-8B-Instruct", "Mistral-7B-Instruct-v0.3", "Llama-3.1-70B-Instruct")


def _params(name: str) -> int:
    import torch

    from lit_gpt import GPT, Config

    with torch.device("meta"):
        model = GPT(Config.from_name(name))
    return sum(p.numel() for p in model.parameters())


def resources() -> str:
    (ft,) = _load_all("finetune_cpu")
    lines = ["| model | parameters | inference, bf16 weights | LoRA / adapter, bf16-true | full, bf16-true (AdamW) |"
             " full, 32-true (AdamW) |", "| --- | --- | --- | --- | --- | --- |"]
    for name in _ESTIMATE_MODELS:
        try:
            n = _params(name)
        except (ValueError, KeyError):
            continue
        gib = lambda bytes_per: f"~{n * bytes_per / 2**30:.1f} GiB"  # noqa: E731
        lines.append(f"| {name} | {n / 1e9:.2f} B | {gib(2)} | {gib(2)} + the small trainable part | {gib(8)} | {gib(16)} |")
    text = ("**Estimate** (computed by `bench/tables.py` from each config's parameter count, not measured): weights,"
            " gradients and optimizer state only, 2 bytes per parameter per bf16 copy and 4 per fp32 copy (full"
            " finetuning keeps weights, gradients and AdamW's two moments: 4 copies). Activations, the KV cache and the"
            " framework's own memory come on top and grow with micro batch size and sequence length.\n\n")
    text += "\n".join(lines) + "\n"
    text += "\n**Measured** (CPU, SmolLM2-135M-Instruct, the whole process's peak RSS, torch's own memory"
    text += " included):\n\n"
    text += "| method | peak RSS | s / optimizer step | tokens/s | setting |\n| --- | --- | --- | --- | --- |\n"
    if ft is None:
        text += "| not measured | | | | |\n"
    else:
        s = ft["settings"]
        for method in s["methods"]:
            o = ft["results"].get(f"{method}/ours")
            if o:
                text += (f"| {method} | {_f(o['peak_rss_gib'])} GiB | {_f(o['s_per_iteration'])} |"
                         f" {_f(o['padded_tokens_per_s'], '.0f')} | micro batch {s['micro_batch_size']},"
                         f" {s['max_seq_length']} tokens max, 32-true |\n")
        text += _source(ft)
    text += "\nGPU and TPU: not measured in a result file yet (see `bench/` to produce one).\n"
    return text


def tpu_plan() -> str:
    """The TPU plans (xla/scripts/plan.py --results_file bench/results/plan_*.json): the TPU compiler's own per-chip
    figures for a recipe's step, compiled on a CPU host."""
    plans = []
    for path in sorted(RESULTS.glob("plan_*.json")):
        r = json.loads(path.read_text(encoding="utf-8"))
        r = r["results"] if "bench" in r else r  # a bench result file (bench/result_files.py) holds the plan
        r["_file"] = path.name
        plans.append(r)
    if not plans:
        return "No plan result files yet (`python xla/scripts/plan.py ... --results_file bench/results/plan_NAME.json`).\n"
    order = {"lora": 0, "full": 1}
    plans.sort(key=lambda r: (r["model"], order.get(r["method"], 9), r["chips"], r["topology"]))
    lines = ["| model | method | slice | tokens / chip / step | peak HBM / chip | fits | what fits instead |"
             " largest micro batch (est.) | model FLOPs / token | MFU bound | roofline step | plan: host RAM, time |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731

    def extras(o: dict) -> str:
        st = o["settings"]
        return ", ".join(k for k, on in (("act. ckpt", st.get("activation_checkpointing")),
                                         ("scan", st.get("scan_layers"))) if on)

    def instead(r: dict) -> str:
        """Where a plan does not fit: a plan of the same model and method that does (on the same slice with other
        flags first, else the smallest slice planned), from the result files; nothing is estimated here."""
        if r["fits"]:
            return "-"
        ok = [o for o in plans if o["fits"] and (o["model"], o["method"]) == (r["model"], r["method"])]
        here = [o for o in ok if o["topology"] == r["topology"]]
        if here:
            o = min(here, key=lambda o: o["per_chip"]["peak_bytes"])
            return f"with {extras(o) or 'other flags'} ({gib(o['per_chip']['peak_bytes'])})"
        if ok:
            o = min(ok, key=lambda o: (o["chips"] * o["hbm_per_chip_bytes"], o["per_chip"]["peak_bytes"]))
            flags = f" with {extras(o)}" if extras(o) else ""
            return f"{o['topology']}{flags} ({gib(o['per_chip']['peak_bytes'])})"
        return "none planned that fits"

    for r in plans:
        pc, h = r["per_chip"], r.get("host", {})
        peak = f"{gib(pc['peak_bytes'])} of {gib(r['hbm_per_chip_bytes'])}" if "peak_bytes" in pc else "n/a"
        fits = "yes" if r["fits"] else (f"no (over by {gib(r['over_by_bytes'])})" if "over_by_bytes" in r else "no")
        fits = "not known (see below)" if r["fits"] is None else fits
        roof = r.get("roofline")
        ram = h.get("max_rss_gib") or max(h.get("trace_process_max_rss_gib", 0), h.get("compile_process_max_rss_gib", 0))
        largest = r.get("largest_micro_batch_estimate")
        st = r["settings"]
        step = (f"{st['micro_batch_size']} x {st['max_seq_length']}"
                + (", act. ckpt" if st.get("activation_checkpointing") else "") + (", scan" if st.get("scan_layers") else ""))
        lines.append(f"| {r['model']} | {r['method']} | {r['topology']} | {step} | {peak} | {fits} | {instead(r)} |"
                     f" {'n/a' if largest is None else largest} | {r['model_flops_per_token'] / 1e9:.1f} G |"
                     + (f" {100 * roof['mfu_bound']:.0f}%{_short(roof)} | {roof['step_s'] * 1e3:.0f} ms"
                        f" ({roof['bound']}) |"
                        if roof else " n/a | n/a |") +
                     f" {ram:.1f} GiB, {h.get('wall_s', 0) / 60:.1f} min |")
    s = plans[0]["settings"]
    v = plans[0].get("host", {}).get("versions", {})
    text = (f"**Compiled** for each slice by libtpu's TPU compiler on a CPU-only host (`xla/scripts/plan.py`: the"
            f" recipe's real step, traced on XLA:CPU devices, weights as placeholders). Step: micro batch x tokens"
            f" per chip as in each row, {s['precision']}, {s['optimizer']}, the recipes' default flags otherwise"
            f" (LoRA r {s.get('lora', {}).get('lora_r', 8)} on query and value for the LoRA rows; activation"
            " checkpointing and scan only where the row says so). Depth-truncated compiles (1 and 2 layers at the real width and"
            f" vocabulary{_plan_depths(plans)}) extrapolated per layer. Peak HBM per chip is the compiler's (weights, optimizer state,"
            " gradients, activations and temporaries) at its buffer assignment (the code generator not run: its"
            " executable's peak was 3% lower for a layer of Llama-3.1-8B), against what libtpu lets a program use;"
            " FLOPs and HBM bytes are XLA's HLO cost analysis of the optimized per-chip program. The MFU bound is the"
            " model FLOPs (forward + backward, 2 or 3 x the forward's) over the chip's peak, in the roofline step"
            " time (the slower of the compiled FLOPs at peak and the compiled HBM bytes at full bandwidth; the model"
            " FLOPs at peak where the cost analysis counted fewer: marked *): an upper bound, not a prediction. The"
            " largest micro batch is an estimate from the same compile (temporaries"
            " taken as proportional to the rows; 0: not one row fits this slice: a bigger slice, or activation"
            " checkpointing where a row does not use it).\n\n")
    text += "\n".join(lines) + "\n"
    if any(r.get("cost_not_counted") and r["settings"].get("scan_layers") for r in plans):
        text += ("\nn/a: a scanned step (`scan` rows) is an HLO while loop, whose body XLA's cost analysis counts once"
                 " whatever the number of layers: its FLOPs and bytes, hence the roofline, are not given.\n")
    short = [r for r in plans if (r.get("roofline") or {}).get("compute_from") == "model"]
    if short:
        text += ("\n*: XLA's cost analysis of the compiled program counted fewer FLOPs than the model's analytic ones ("
                 + ", ".join(f"{r['roofline']['flops_counted_ratio']:.2f}x for {r['model']} {r['method']} on"
                             f" {r['topology']}{_ckpt(r)}" for r in short)
                 + "): the roofline times compute on the model's FLOPs (a step does no less arithmetic than the"
                   " model's).\n")
    for r in plans:  # a plan whose depths give no per-layer line, as it states it
        if r["fits"] is None:
            text += f"\nnot known for {r['model']} {r['method']} on {r['topology']}{_ckpt(r)}: {r['how']}.\n"
    for r in plans:  # a cost left out for another reason, as the plan states it
        if r.get("cost_not_counted") and not r["settings"].get("scan_layers"):
            text += (f"\nn/a for {r['model']} {r['method']} on {r['topology']}: "
                     f"{r['cost_not_counted']['reason']}.\n")
    files = ", ".join(f"`bench/results/{r['_file']}`" for r in plans)
    dates = sorted({r.get("host", {}).get("date", "")[:10] for r in plans} - {""})
    text += (f"\nFrom {files} (libtpu {v.get('libtpu')}, jax {v.get('jax')}, torch_xla {v.get('torch_xla')};"
             f" {', '.join(dates)}; host RAM is the plan's peak RSS (the planner and its larger child: the"
             " tracing or the compiling process), time its wall time, on a 2-core machine shared with other jobs; the"
             " v6e-8 rows reused the v5e-8 rows' traced steps, and a step compiled before for the same slice is not"
             " compiled again (`--trace_cache`): their times are shorter than a first plan's).\n")
    return text


def _short(roof: dict) -> str:
    """The MFU bound's mark where compute was timed on the model's FLOPs, not the fewer the cost analysis counted."""
    return "*" if roof.get("compute_from") == "model" else ""


def _ckpt(r: dict) -> str:
    return " with act. ckpt" if r["settings"].get("activation_checkpointing") else ""


def _plan_depths(plans: List[dict]) -> str:
    """The plans compiled at other depths than 1 and 2, named row by row (the planner's default is 2 and 3 since
    the per-layer line from 1 and 2 layers went wrong; older rows keep 1 and 2)."""
    other = {}
    for r in plans:
        depths = sorted(int(d) for d in r.get("depths", {}))
        if depths and depths != [1, 2] and r.get("n_layer") not in depths:
            other.setdefault(" and ".join(map(str, depths)), []).append(
                f"{r['model']} {r['method']} on {r['topology']}{_ckpt(r)}")
    return "".join(f"; {d} for {', '.join(rows)}" for d, rows in sorted(other.items()))


_MOE_MODELS = ("Mixtral-8x7B-v0.1", "Qwen3-30B-A3B", "Qwen3-235B-A22B", "gpt-oss-20b", "gpt-oss-120b")
# HBM per chip (GiB) of the accelerators the MoE estimate sizes for; 80% of it counted as usable
_CHIPS = (("TPU v5e", 16), ("TPU v4", 32), ("H100", 80), ("TPU v5p", 95))


def _moe_params(name: str):
    """(total parameters, parameters a token goes through, expert parameters, config) of a named MoE config."""
    import torch

    from lit_gpt import GPT, Config

    config = Config.from_name(name)
    with torch.device("meta"):
        model = GPT(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    active = total - experts + experts * config.n_expert_per_token // config.n_expert
    return total, active, experts, config


def moe_resources() -> str:
    """Memory per MoE model and method: estimates from the named configs (no MoE of these sizes runs here)."""
    lines = ["| model | parameters (total / per token) | experts | inference, bf16 | LoRA, bf16-true (+ experts' LoRA, r=8)"
             " | full, bf16-true (AdamW) | KV cache per 1k tokens, bf16 | chips for full finetuning (FSDP) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in _MOE_MODELS:
        total, active, experts, c = _moe_params(name)
        gib = lambda n_bytes: f"~{n_bytes / 2**30:.1f} GiB"  # noqa: E731
        # LoRA on the experts: r * (in + out) per expert and matrix (fc_1, fc_2: n_embd -> moe_inter; proj back)
        moe_layers = sum(c.is_moe_layer(i) for i in range(c.n_layer))
        lora_experts = moe_layers * c.n_expert * 3 * 8 * (c.n_embd + c.moe_intermediate_size)
        # bf16 LoRA weights, their gradients and fp32 AdamW moments: 2 + 2 + 8 bytes per trainable parameter
        lora = f"{gib(2 * total)} (+{gib(12 * lora_experts)})"
        kv = 2 * c.n_layer * c.n_query_groups * c.head_size * 2 * 1024
        full = 8 * total
        chips = ", ".join(f"{chip}: {math.ceil(full / (0.8 * hbm * 2**30))}" for chip, hbm in _CHIPS)
        lines.append(f"| {name} | {total / 1e9:.1f} B / {active / 1e9:.1f} B | {c.n_expert}, {c.n_expert_per_token} per"
                     f" token | {gib(2 * total)} | {lora} | {gib(full)} | {kv / 2**20:.0f} MiB | {chips} |")
    text = ("**Estimate** (computed by `bench/tables.py` from each named config, not measured: no model of these sizes"
            " runs on the machines the project is tested on). Every expert's weights are in memory whatever the"
            " routing: memory follows the total parameters, compute the per-token ones. Weights, gradients and"
            " optimizer state only, 2 bytes per bf16 copy (full finetuning: weights, gradients and AdamW's two"
            " moments, 8 bytes per parameter). Chips: how many of each accelerator hold that state sharded by FSDP"
            " with 80% of their memory usable, before activations; the KV cache keeps every position in every layer"
            " (gpt-oss's sliding layers included).\n\n")
    return text + "\n".join(lines) + "\n"


def moe_dispatch() -> str:
    (r,) = _load_all("moe_dispatch_cpu")
    head = ["| contender | decode tokens/s | decode vs ours | training step (s) | step vs ours |",
            "| --- | --- | --- | --- | --- |"]
    if r is None:
        return _not_measured(head, "python bench/moe_dispatch.py --results_file"
                                   " bench/results/moe_dispatch_cpu.json")
    res, s = r["results"], r["settings"]
    labels = {"ours": "ours (`moe_dispatch` auto: decode as generate/base.py runs it on the CPU, views of the chosen"
                      " experts; training step: rows grouped by expert, one `torch._grouped_mm` per projection)",
              "ours_loop": "ours, training step by the loop over the experts (the reference; what auto ran before)",
              "ours_gather": "ours, decode by the static gather (what XLA and CUDA run)",
              "ours_capacity": "ours, training step with capacity buffers, factor 2.0 (what XLA runs)",
              "ours_dense": "ours, dense (every expert on every token)",
              "transformers": f"transformers ({s['transformers_experts_implementation']})",
              "transformers_eager": "transformers (eager loop over the experts hit)"}
    for name, label in labels.items():
        d = res.get(f"decode_{name}_tokens_per_s")
        t = res.get(f"train_{name}_s_per_step")
        cells = [label, _f(d, ".1f", "-"), "-" if d is None else _f(res[f"decode_{name}_ratio_to_ours"]) + "x",
                 _f(t, ".3f", "-"), "-" if t is None else _f(res[f"train_{name}_ratio_to_ours"]) + "x"]
        head.append("| " + " | ".join(cells) + " |")
    sh = s["shape"]
    same = [n for n in labels if res.get(f"tokens_{n}_equal_to_transformers") is False]
    text = "\n".join(head) + "\n"
    text += (f"\nRandom weights in a Qwen3-MoE layout: {sh['n_layer']} layers, width {sh['n_embd']}, {sh['n_expert']}"
             f" experts of width {sh['moe_intermediate_size']}, {sh['n_expert_per_token']} per token, vocabulary"
             f" {sh['vocab_size']}; {s['dtype']}, {s['threads']} threads. Decode: batch 1, greedy, {s['prompt_tokens']}-token"
             f" prompt, {s['new_tokens']} new tokens, steady decode speed. Training step: forward and backward of"
             f" {s['batch']} x {s['seq']} tokens, every weight trainable. Medians of {s['runs']} interleaved runs after"
             f" a warm-up; ratios of medians to ours (decode: higher is faster; step: lower is faster). Greedy tokens "
             + ("identical to transformers' for every contender." if not same else f"DIFFER from transformers' for {same}.")
             + "\n")
    if "xla_eval_flops_routed" in res:
        text += (f"\nEvaluation on XLA (XLA's cost analysis of the traced eval forward of the same model on {s['batch']}"
                 f" x {s['seq']} tokens, XLA:CPU): the dropless tiles (what auto runs) cost"
                 f" {_f(res['xla_eval_flops_auto_ratio_to_routed'])}x the routed forward's FLOPs (each token through its"
                 f" k experts only, {res['xla_eval_flops_routed'] / 1e9:.1f} GFLOP), the capacity buffers of C = N"
                 f" (what evaluation ran before) {_f(res['xla_eval_flops_capacity_ratio_to_routed'])}x.\n")
    if "mxfp4_expert_mib_packed" in res:
        text += (f"\ngpt-oss's experts kept in MXFP4 (`lit_gpt.mxfp4.pack_experts_mxfp4`, decoded per matmul), on the same"
                 f" model's experts as MXFP4 values: {_f(res['mxfp4_expert_mib_packed'], '.1f')} MiB instead of"
                 f" {_f(res['mxfp4_expert_mib_bf16'], '.1f')} MiB in bf16; 16 greedy tokens "
                 + ("equal to bf16's" if res.get("mxfp4_tokens_equal_to_bf16") else "DIFFERENT from bf16's") + ".\n")
        if "mxfp4_file_mib_packed" in res:  # on disk: conversion keeps the experts packed (issue 38)
            text += (f"On disk the weights file is {_f(res['mxfp4_file_mib_packed'], '.1f')} MiB with the experts"
                     f" packed instead of {_f(res['mxfp4_file_mib_bf16'], '.1f')} MiB in bf16; loaded packed"
                     " (`--quantize mxfp4`), 16 greedy tokens "
                     + ("equal to bf16's" if res.get("mxfp4_file_tokens_equal_to_bf16") else "DIFFERENT from bf16's")
                     + ".\n")
    text += "\nGPU: not measured (no GPU on the machines this table was made on; `--device cuda` measures one).\n"
    return text + _source(r)


def xla_moe_memory() -> str:
    (r,) = _load_all("xla_moe_memory_cpu")
    head = ["| checkpoint | path | precision | host memory above the baseline (median) | x largest block"
            " | x the path's bound (worst run) | x the dense checkpoint's |", "| --- | --- | --- | --- | --- | --- | --- |"]
    if r is None:
        return _not_measured(head, "python bench/xla_moe_memory.py"
                                   " --results_file bench/results/xla_moe_memory_cpu.json")
    s = r["settings"]
    names = {"load": "staged load", "save": "sharded save", "consolidate": "consolidation"}
    for row in r["results"]:
        bound = "-" if "x_bound_max" not in row else _f(row["x_bound_max"])
        vs = "-" if "x_block_vs_dense" not in row else _f(row["x_block_vs_dense"]) + "x"
        head.append(f"| {row['model']} | {names.get(row['path'], row['path'])} | {row['precision']} |"
                    f" {_f(row['overhead_mib'], '.0f')} MiB | {_f(row['x_block'])} | {bound} | {vs} |")
    sizes = s["sizes_fp32_mib"]
    models = ", ".join(f"{name} {_f(sizes[name]['model'], '.0f')} MiB (largest block {_f(sizes[name]['block'], '.0f')} MiB)"
                       for name in s["models"])
    text = "\n".join(head) + "\n"
    text += (f"\nRandom fp32 checkpoints of about one size: {models}; {s['devices']} XLA:CPU devices (FSDP over SPMD);"
             f" peak anonymous memory (RssAnon, sampled every 1 ms) above the process's baseline, medians of"
             f" {s['repeats']} runs. Bounds: staged load {s['load_bound']}; consolidation {s['consolidate_bound']};"
             " the sharded save has none (it holds about 0.6x the model at once, dense or MoE alike). Every load is"
             " bit-equal to the file. Load overheads of tens of MiB are within the sampling noise; they are held to"
             " their bound only.\n")
    return text + _source(r)


DPO_FILES = (("dpo_cpu", "CPU, eager (`finetune/*.py`)"), ("xla_dpo_cpu1", "XLA:CPU, 1 device (`xla/finetune/*.py`)"),
             ("xla_dpo_cpu8", "XLA:CPU, 8 devices (`xla/finetune/*.py`)"))
DPO_VARIANTS = (("sft", "SFT (`lora.py`: the chosen replies)"), ("dpo_adapters_off", "DPO, reference: adapters off"),
                ("dpo_precomputed", "DPO, reference: precomputed"))


def dpo_step() -> str:
    """bench/dpo.py: the DPO step (LoRA reference and precomputed reference) against the SFT step, same data."""
    records = _load_all(*(name for name, _ in DPO_FILES))
    head = ["| backend | run | s / step | vs SFT per step (expected) | padded tokens / step | vs SFT per padded token"
            " | one-off reference pass |", "| --- | --- | --- | --- | --- | --- | --- |"]
    if not any(records):
        return _not_measured(head, "python bench/dpo.py --results_file bench/results/dpo_cpu.json")
    for (name, label), r in zip(DPO_FILES, records):
        if r is None:
            continue
        res, s = r["results"], r["settings"]
        for variant, run in DPO_VARIANTS:
            v = res.get(variant)
            if v is None:
                continue
            ref = "-"
            if v.get("precompute_s") is not None:
                ref = (f"{_f(v['precompute_s'])} s for {v['precompute_pairs']} pairs"
                       f" (= {_f(v['precompute_steps_equivalent'], '.1f')} steps)")
            expected = f"{_f(v['ratio_to_sft_per_step'])}x (~{_f(v['expected_ratio_per_step'], '.0f')}x)"
            where = (f"{label}, {s['rows_per_step']} samples or pairs per step, {s['steps']} steps x {s['repeats']}"
                     " round(s)" if variant == "sft" else "")
            head.append(f"| {where} | {run} | {_f(v['step_s'], '.3f')}"
                        f" | {'-' if variant == 'sft' else expected} | {_f(v['padded_tokens_per_step'], '.0f')}"
                        f" | {'-' if variant == 'sft' else _f(v['ratio_to_sft_per_padded_token']) + 'x'} | {ref} |")
    s = next(r for r in records if r)["settings"]
    text = "\n".join(head) + "\n"
    text += (f"\nLoRA (r={s['lora_r']}, attention and MLP), {s['precision']}, {s['model']} (vocabulary {s['vocab_size']},"
             f" random weights), one micro-batch per step, rows of"
             f" {s['row_tokens'][0]}-{s['row_tokens'][1]} tokens (Alpaca-style prompt + reply; chosen and rejected"
             f" replies of similar length), max length {s['max_seq_length']}; medians of the steady steps from step"
             f" {s['timed_from_step']} (the loop's own per-step clock, steps that compiled excluded), then of the"
             " interleaved rounds; each run its own process. SFT: B samples per"
             " step; DPO: B pairs = 2B rows. Expected ratios in forward units: a LoRA step ~2 (no weight gradient of"
             " the frozen base), DPO precomputed 2x that (twice the rows), adapters off one more forward of the 2B"
             " rows: 3x. The one-off pass is the precomputed reference's, over every training and validation pair,"
             " before step 1 (on XLA its graph's compilation included). On XLA every position goes through the head"
             " (static shapes), on the CPU only the replies' tokens.\n")
    return text + _source(*records)


def eval_throughput() -> str:
    """bench/eval_throughput.py: loglikelihood requests through our harness model against the harness's hf backend."""
    (r,) = _load_all("eval_throughput_cpu")
    head = ["| backend (CPU) | requests / s | tokens / s | seconds | speed vs hf | largest log-likelihood difference"
            " | greedy flags agree |", "| --- | --- | --- | --- | --- | --- | --- |"]
    if r is None:
        return _not_measured(head, "python bench/eval_throughput.py --results_file"
                                 " bench/results/eval_throughput_cpu.json")
    res, s = r["results"], r["settings"]
    head.append(f"| ours (`eval/lm_eval.py`) | {_f(res['ours_requests_per_s'])} | {_f(res['ours_tokens_per_s'], '.0f')}"
                f" | {_f(res['ours_seconds'], '.1f')} | {_f(res['ours_speedup'])}x"
                f" | {res['max_relative_loglikelihood_difference']:.1e} (relative) | {res['greedy_flags_agree']} |")
    head.append(f"| lm-eval `--model hf` | {_f(res['hflm_requests_per_s'])} | {_f(res['hflm_tokens_per_s'], '.0f')}"
                f" | {_f(res['hflm_seconds'], '.1f')} | 1x | | |")
    if "ours_gen_seconds" in res:  # the generation row (generate_until requests)
        head += ["", "| generate_until (CPU) | requests / s | new tokens / s | seconds | speed vs hf | texts equal |",
                 "| --- | --- | --- | --- | --- | --- |",
                 f"| ours (`eval/lm_eval.py`, one continuous batch) | {_f(res['ours_gen_requests_per_s'])}"
                 f" | {_f(res['ours_gen_tokens_per_s'], '.0f')} | {_f(res['ours_gen_seconds'], '.1f')}"
                 f" | {_f(res['ours_gen_speedup'])}x | {res['gen_texts_equal']} of {s['gen_requests']} |",
                 f"| lm-eval `--model hf` (left-padded batches) | {_f(res['hflm_gen_requests_per_s'])}"
                 f" | {_f(res['hflm_gen_tokens_per_s'], '.0f')} | {_f(res['hflm_gen_seconds'], '.1f')} | 1x | |"]
    text = "\n".join(head) + "\n"
    text += (f"\n{s['checkpoint']} in {s['dtype']}, {s['requests']} loglikelihood requests ({s['tokens']} tokens),"
             f" batch size {s['batch_size']}, {s['torch_threads']} torch thread(s), {s['runs']} run(s) each.\n")
    if "ours_gen_seconds" in res:
        text += (f"Generation: {s['gen_requests']} greedy requests of mixed prompt lengths, up to {s['max_gen_toks']}"
                 f" new tokens each ({s['new_tokens']} in all), the same batch size.\n")
    return text + _source(r)


def serve() -> str:
    """bench/serve.py: serve/base.py under concurrent clients against one request at a time and against
    transformers' batched generate on the same prompts (every bench/results/serve*.json, one block of rows each)."""
    records = [r for r in _load_all(*sorted(p.stem for p in RESULTS.glob("serve*.json")))
               if r is not None and "levels" in r["results"]]  # the scheduling-only files: serve_scheduling()
    head = ["| server (`serve/base.py`) | requests in flight | tokens/s | x sequential | time to first token, median"
            " (p90) | transformers batched `generate`, batch = requests in flight: tokens/s | ours vs transformers |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    if not records:
        return _not_measured(head, "python bench/serve.py --results_file bench/results/serve_cpu.json")
    for r in records:
        res, s = r["results"], r["settings"]
        seq = res["sequential"]
        ref1 = next((t for t in res["transformers"] if t["batch_size"] == 1), None)
        where = (f"{s['device'].upper()}, {s['dtype']}, {s['threads']} thread{'' if s['threads'] == 1 else 's'},"
                 f" {s['slots']} slots")
        head.append(f"| {where} | 1, one after another (not streamed) | {_f(seq['tokens_per_s'], '.1f')} | 1.00x | -"
                    f" | {'-' if ref1 is None else _f(ref1['tokens_per_s'], '.1f')}"
                    f" | {'-' if seq.get('x_transformers_batch_1') is None else _f(seq['x_transformers_batch_1']) + 'x'} |")
        for level in res["levels"]:
            head.append(f"| | {level['concurrency']} (streamed) | {_f(level['tokens_per_s'], '.1f')}"
                        f" | {_f(level['x_sequential'])}x | {_f(level['ttft_median_s'] * 1000, '.0f')} ms"
                        f" ({_f(level['ttft_p90_s'] * 1000, '.0f')} ms) | {_f(level['transformers_tokens_per_s'], '.1f')}"
                        f" | {_f(level['x_transformers'])}x |")
    s, res = records[0]["settings"], records[0]["results"]
    same = all(lv["same_text_as_sequential"] == lv["requests"] for r in records for lv in r["results"]["levels"])
    same_hf = all(t["same_text_as_server"] == r["settings"]["requests"] for r in records for t in r["results"]["transformers"])
    text = "\n".join(head) + "\n"
    text += (f"\n{s['checkpoint']}, {s['requests']} completion requests per row (\"{s['prompt']}\", a different word"
             f" each: {'-'.join(map(str, sorted(set(s['prompt_tokens']))))} prompt tokens), greedy, {s['max_tokens']} tokens"
             f" each, sent by the `openai` package's AsyncOpenAI client from the same machine; the server ran with"
             f" `--slots {s['slots']} --max_seq_length {s['max_seq_length']}`. Tokens/s: completion tokens over the"
             " row's wall time; N requests in flight: N clients, each sending its next request when its last one"
             " ended. Time to first token: from sending a request to its first non-empty streamed text. transformers:"
             " `AutoModelForCausalLM.generate` on the checkpoint's export, the same prompt tokens left-padded in"
             " batches of N, in the same run after the server stopped, same threads. Greedy answers "
             + ("identical" if same else "NOT all identical") + " at every concurrency to the sequential ones, and "
             + ("identical" if same_hf else "NOT all identical") + " to transformers'.\n")
    return text + _source(*records)


def serve_scheduling() -> str:
    """bench/serve.py's scheduling scenarios (the long-prompt burst, the shared prefix, sampled chat) on the server
    that prefills whole prompts and shares nothing and on the default one (chunked prefill, prefix cache), in one
    run: every bench/results/serve*.json with them."""
    records = [r for r in _load_all(*sorted(p.stem for p in RESULTS.glob("serve*.json")))
               if r is not None and "scheduling" in r["results"]]
    head = ["| server (`serve/base.py`) | short streams' inter-token p90: alone | during the burst (x alone) |"
            " burst run: tokens/s | shared prefix: prompt tokens computed (reused) | sampled chat: tokens/s one at"
            " a time | all in flight (x one at a time) |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    if not records:
        return _not_measured(head, "python bench/serve.py --throughput false --results_file"
                                   " bench/results/serve_scheduling_cpu.json")
    text = ""
    for r in records:
        sched, s = r["results"]["scheduling"], r["settings"]
        rows = list(head)
        for name, x in ((k, v) for k, v in sched.items() if isinstance(v, dict)):
            b, p = x["burst"], x["prefix"]
            burst_p90 = "-" if b["itl_in_burst_p90_s"] is None else (
                f"{_f(b['itl_in_burst_p90_s'] * 1000, '.0f')} ms ({_f(b['itl_in_burst_x_alone'])}x)")
            rows.append(f"| {name} | {_f(x['alone']['itl_p90_s'] * 1000, '.0f')} ms | {burst_p90}"
                        f" | {_f(b['tokens_per_s'], '.1f')} | {p['prefill_tokens']} ({p['cached_tokens']})"
                        f" | {_f(x['chat_sequential']['tokens_per_s'], '.1f')}"
                        f" | {_f(x['chat_batched']['tokens_per_s'], '.1f')} ({_f(x['chat_x_sequential'])}x) |")
        text += "\n".join(rows) + "\n"
        text += (f"\n{s['checkpoint']}, {s['dtype']}, {s['threads']} threads, `--slots {s['scenario_slots']}`."
                 f" Burst: 4 short greedy streams of {s['short_tokens']} tokens, then 4 prompts of"
                 f" {s['burst_tokens']} tokens sent once each stream has 4 tokens; inter-token p90 of the short"
                 " streams during the burst (from sending it to the last long prompt's first token) against the"
                 f" streams alone; tokens/s over the whole burst run:"
                 f" {_f(sched.get('burst_throughput_x_whole_prompts'))}x the whole-prompt server's. Shared prefix:"
                 f" {s['prefix_requests']} greedy chat requests with one"
                 f" {s['system_tokens']}-token system prompt, {s['scenario_slots']} at a time:"
                 f" {_f(sched.get('prefix_fewer_prefill_tokens_x'), '.1f')}x fewer prompt tokens computed,"
                 f" {sched.get('prefix_same_texts', 'n/a')}/{s['prefix_requests']} answers identical. Sampled chat:"
                 f" {s['chat_requests']} chat requests (temperature {s['chat_temperature']}, seeded, {s['chat_tokens']}"
                 " tokens, not streamed) one at a time and all at once; seeded answers identical both ways:"
                 f" {sched.get('chat_same_texts', 'n/a')}/{s['chat_requests']}. The `openai` client ran on the same"
                 " cores.\n")
        lora = r["results"].get("multi_lora")
        if lora:  # the many-LoRAs row of the same run
            text += (f"\nMany LoRAs on one base (`--lora` x {lora['adapters']}, rank {lora['rank']}, every layer):"
                     f" {s.get('requests', 'n/a')} greedy completions of {s.get('max_tokens', 'n/a')} tokens per run,"
                     f" up to {s.get('slots', 'n/a')} in flight: base model {_f(lora['base']['tokens_per_s'], '.1f')} tokens/s, all for one adapter"
                     f" {_f(lora['one_adapter']['tokens_per_s'], '.1f')} ({_f(lora['one_adapter_x_base'])}x the base),"
                     f" spread over all {lora['adapters']} in every step"
                     f" {_f(lora['all_adapters']['tokens_per_s'], '.1f')} ({_f(lora['all_adapters_x_one_adapter'])}x"
                     " one adapter).\n")
    return text + _source(*records)


def prefill_chunk() -> str:
    """bench/prefill_chunk.py: the serving engine's step boundaries while long prompts come in, by chunk size, with
    the chunks riding along in the decode step and in a prefill call of their own (what --prefill_chunk's default
    was chosen from)."""
    (r,) = _load_all("serve_prefill_chunk_cpu")
    head = ["| `--prefill_chunk` | decode step alone (p50) | chunks riding along: boundary p50 (x decode) | p90 (x) |"
            " prompt tokens/s | own prefill call: boundary p50 (x decode) | p90 (x) | prompt tokens/s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    if r is None:
        return _not_measured(head, "python bench/prefill_chunk.py --results_file"
                                   " bench/results/serve_prefill_chunk_cpu.json")
    rows, s = list(head), r["settings"]
    for x in r["results"]:
        cells = []
        for way in ("riding", "own_call"):
            w = x[way]
            cells += [f"{_f(w['p50_ms'], '.0f')} ms ({_f(w['p50_x_decode'])}x)",
                      f"{_f(w['p90_ms'], '.0f')} ms ({_f(w['p90_x_decode'])}x)", _f(w["prompt_tokens_per_s"], ".0f")]
        rows.append(f"| {x['chunk']} | {_f(x['decode_step_p50_ms'], '.0f')} ms | " + " | ".join(cells) + " |")
    text = "\n".join(rows) + "\n"
    text += (f"\n{s['checkpoint']}, {s['dtype']}, {s['threads']} threads, in one process (the engine's loop, no"
             f" HTTP): {s['streams']} greedy streams decode while 2 prompts of {s['prompt_tokens']} tokens are"
             " prefilled in chunks, the boundaries alternating between the two ways; a decode step alone: the"
             " median of the streams' steps before and after.\n")
    return text + _source(r)


PACKING_FILES = (("packing_cpu", "CPU (finetune/lora.py)"), ("xla_packing_cpu1", "XLA:CPU, 1 device"),
                 ("xla_packing_cpu8", "XLA:CPU, 8 devices"))


def packing() -> str:
    """bench/packing.py: packed rows against power-of-two padding, same samples: the useful-token fraction and the
    useful tokens per second, per backend."""
    records = _load_all(*(name for name, _ in PACKING_FILES))
    head = ["| backend | useful tokens / computed positions: pow2 padding | packed | useful tokens/s: pow2 padding"
            " | packed | packed / padded | train-step compilations: padded, packed |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    if not any(records):
        return _not_measured(head, "python bench/packing.py --results_file"
                                 " bench/results/packing_cpu.json")
    for (_, label), r in zip(PACKING_FILES, records):
        if r is None:
            continue
        frac, speed = r["results"]["fractions"]["useful_fraction"], r["results"]["speed"]
        compiles = ", ".join(str(max(c or 0 for c in speed[k]["train_compiles"])) for k in ("padded", "packed"))
        head.append(f"| {label} | {_f(frac['padded'], '.3f')} | {_f(frac['packed'], '.3f')}"
                    f" | {_f(speed['padded']['useful_tokens_per_s'], '.0f')}"
                    f" | {_f(speed['packed']['useful_tokens_per_s'], '.0f')} | {_f(speed['packed_over_padded'])}x"
                    f" | {compiles if r['settings']['backend'] == 'xla' else '-'} |")
    first = next(r for r in records if r)
    s, f = first["settings"], first["results"]["fractions"]
    text = "\n".join(head) + "\n"
    text += (f"\n{s['data']}: {f['samples']} samples (median {f['length_median']} tokens, 90th percentile"
             f" {f['length_p90']}, longest {f['length_max']}), packed into {f['rows']} rows of {s['max_seq_length']}"
             f" ({_f(f['samples_per_row'], '.1f')} samples per row); padded: micro-batches of {s['micro_batch_size']}"
             " samples to the next power of two. Useful tokens: the real (prompt and response) input tokens; computed"
             f" positions: rows x length. Speed: LoRA (r={s['lora_r']}), {s['precision']}, {s['model']}, the recipe"
             " unmodified in its own process, the loop's count of real tokens over its steady steps (on XLA the padded"
             " run's steps that compiled a new length bucket are not steady), median of the interleaved rounds.\n")
    att = first["results"].get("attention")
    if att:
        flex = (f"{_f(att['flex_s'] * 1000, '.1f')} ms after {_f(att['flex_forward_compile_s'], '.0f')} s of compilation"
                if att.get("flex_trains") else f"does not train here ({att.get('flex_error')})")
        text += (f"\nAttention for packed rows on the CPU, forward + backward, shape {att['shape']} with"
                 f" {att['documents_per_row']} documents per row: SDPA with the block-diagonal mask (what the model"
                 f" runs) {_f(att['sdpa_mask_s'] * 1000, '.1f')} ms, SDPA causal (an unpacked row's kernel)"
                 f" {_f(att['sdpa_causal_s'] * 1000, '.1f')} ms; FlexAttention's document mask: {flex}.\n")
    return text + _source(*records)


def long_context() -> str:
    """bench/long_context.py: (a) one packed LoRA train step at long row lengths, the dense document mask (old) against
    attention one document at a time (new), and XLA:CPU's new path (blockwise segment attention): peak memory above
    the model's, and step time; (b) prefill + 64 decode steps with the old KV cache (every position) and the new one
    (a sliding layer's cache holds its window); (b) and the XLA:CPU column from their own runs' files when there are."""
    r, d, xr = _load_all("long_context_cpu", "long_context_decode_cpu", "long_context_xla_cpu")
    head = ["| row length | old (dense mask): peak MiB | step s | new (per document): peak MiB | step s |"
            " new peak / previous length's | XLA:CPU new (blockwise): peak MiB | step s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    if r is None:
        return _not_measured(head, "python bench/long_context.py --results_file"
                                 " bench/results/long_context_cpu.json")
    res, s = r["results"], r["settings"]
    steps = {(x["path"], x["T"]): x for x in res["steps"] + res.get("decode", [])}
    xla_rows = [y for y in res["steps"] if y["path"] == "xla"]
    if xr is not None:  # the XLA:CPU column from its own run (`--train false --decode false`)
        xla_rows = [y for y in xr["results"]["steps"] if y["path"] == "xla"]
        steps = {k: v for k, v in steps.items() if k[0] != "xla"}
        steps.update({("xla", y["T"]): y for y in xla_rows})

    def cells(x: dict, peak: str, time: str, fmt: str = ".2f", scale: float = 1.0) -> Tuple[str, str]:
        if not x:
            return "-", "-"
        if "skipped" in x:
            return "skipped", "-"
        return _f(x.get(peak), ".0f"), _f(x[time] * scale if x.get(time) is not None else None, fmt)

    new_ratios = res["peak_ratios"]["documents"]
    prev = None
    for T in s["lengths"]:
        old, new, xla = (steps.get((p, T), {}) for p in ("mask", "documents", "xla"))
        ratio = new_ratios.get(f"{T}/{prev}") if prev else None
        head.append(f"| {T} | {' | '.join(cells(old, 'peak_mib', 'step_s'))} | {_f(new.get('peak_mib'), '.0f')}"
                    f" | {_f(new.get('step_s'))} | {_f(ratio) + 'x' if ratio else '-'}"
                    f" | {' | '.join(cells(xla, 'peak_mib', 'step_s'))} |")
        prev = T
    skipped = [f"{x['T']} ({x['skipped']})" for x in res["steps"] if "skipped" in x and x["path"] == "mask"]
    xla_skipped = [f"{y['T']} ({y['skipped']})" for y in xla_rows if "skipped" in y]
    xla_growth = (xr["results"]["peak_ratios"] if xr is not None else res["peak_ratios"]).get("xla", {})
    speed = next((v for k, v in res.items() if k.startswith("old_over_new_time_at_")), None)
    text = "\n".join(head) + "\n"
    text += (f"\n{s['model']}, {s['method']}, {s['precision']}, {s['rows_per_step']} row per step of documents of"
             f" {s['documents']}; {s['threads'] or 'default'} thread(s). Peak: the step's resident memory above the"
             " process's before it (activations, gradients, temporaries); time: the second step. Old over new step"
             f" time at {s['lengths'][0]}: {_f(speed)}x."
             + (f" Old path skipped at {', '.join(skipped)}." if skipped else "")
             + (f" XLA:CPU ({s['xla']}; peak over three steps, compilation included; time: the third step, which"
                " XLA:CPU does not optimise: memory is its measure here)"
                + (f" skipped at {', '.join(xla_skipped)}." if xla_skipped else ".")
                + "".join(f" Its peak {k}: {_f(v)}x." for k, v in xla_growth.items())
                + (f" Its run stopped at {max(xr['settings']['lengths'])} (its --lengths)."
                   if xr is not None and max(xr["settings"]["lengths"]) < max(s["lengths"]) else "")
                if xla_rows else "") + "\n")
    if d is not None:  # part (b) from its own run (`--train false --xla false`): its rows and settings
        res, s = {**res, "decode": d["results"].get("decode"),
                  "decode_same_tokens": d["results"].get("decode_same_tokens")}, d["settings"]
        steps.update({(x["path"], x["T"]): x for x in res["decode"] or []})
    if res.get("decode"):
        text += ("\n| prompt length | old KV cache: peak MiB | prefill s | decode ms/token | KV MiB | new KV cache:"
                 " peak MiB | prefill s | decode ms/token | KV MiB |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
                 " --- |\n")
        for T in s["lengths"]:
            row = []
            for p in ("decode_old", "decode_new"):
                x = steps.get((p, T), {})
                peak, prefill = cells(x, "peak_mib", "prefill_s")
                row += [peak, prefill, cells(x, "peak_mib", "decode_token_s", ".1f", 1000)[1],
                        "-" if not x or "skipped" in x else _f(x.get("kv_cache_mib"), ".1f")]
            text += f"| {T} | " + " | ".join(row) + " |\n"
        dec_skipped = [f"{x['T']} {x['path'][7:]} ({x['skipped']})" for x in res["decode"] if "skipped" in x]
        text += (f"\nGeneration: {s['decode']}. Peak: resident memory above the process's before the KV cache was"
                 " allocated (cache, prefill, steps). Greedy tokens equal with both caches:"
                 f" {'yes' if res.get('decode_same_tokens') else 'no'}."
                 + (f" Skipped: {', '.join(dec_skipped)}." if dec_skipped else "") + "\n")
        growth = (d or r)["results"]["peak_ratios"]  # the ratios of the run that measured these rows
        text += "\nPeak over the previous length's (one run): " + "; ".join(
            f"{p[7:]} " + ", ".join(f"{k} {_f(v)}x" for k, v in growth.get(p, {}).items())
            for p in ("decode_old", "decode_new")) + ".\n"
    return text + _source(r, d, xr)


TABLES: Dict[str, Callable[[], str]] = {
    "long-context": long_context,
    "packing": packing,
    "serve": serve,
    "serve-scheduling": serve_scheduling,
    "prefill-chunk": prefill_chunk,
    "eval-throughput": eval_throughput,
    "xla-moe-memory": xla_moe_memory,
    "moe-resources": moe_resources,
    "moe-dispatch": moe_dispatch,
    "cpu-generate": cpu_generate,
    "cpu-generate-gemma3": cpu_generate_gemma3,
    "cpu-finetune": cpu_finetune,
    "gpu": gpu,
    "xla-generate": xla_generate,
    "xla-finetune": xla_finetune,
    "xla-load": xla_load,
    "quantize": quantize,
    "xla-scan": xla_scan,
    "resources": resources,
    "tpu-plan": tpu_plan,
    "dpo-step": dpo_step,
}


def render(text: str) -> str:
    def replace(m: re.Match) -> str:
        name = m.group("name")
        if name not in TABLES:
            raise KeyError(f"unknown bench-table {name!r} (known: {', '.join(TABLES)})")
        return m.group(1) + "\n" + TABLES[name]() + "\n" + m.group(4)

    return _TABLE.sub(replace, text)


def render_all() -> Dict[Path, str]:
    return {page: render(page.read_text(encoding="utf-8")) for page in PAGES if page.is_file()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page differs; write nothing")
    args = parser.parse_args()
    differ = []
    for page, text in render_all().items():
        if page.read_text(encoding="utf-8") != text:
            differ.append(page)
            if not args.check:
                page.write_text(text, encoding="utf-8")
    for page in differ:
        print(f"{'differs' if args.check else 'updated'}: {page.relative_to(ROOT)}")
    return 1 if (args.check and differ) else 0


if __name__ == "__main__":
    sys.exit(main())
