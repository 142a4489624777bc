"""Every host of a multi-host run must train the same thing: the same resolved arguments, the same prepared data, the
same base weights and the same point to resume from. A host that differs (an older checkout of the repository, a
data folder prepared again on one worker, a stale copy of the weights, a relative --resume path read from another
folder) would otherwise hang in a collective, or train on a mix without a word.

    check_hosts_agree(run, data)     in every XLA finetune recipe, after the data is read and before the weights load:
                                     the same one `error:` line on every host when the hosts disagree
    host_facts(run, data) -> dict    what this host compares (small: the arguments and a few fingerprints)
    disagreement(facts) -> str|None  the pure comparison of every host's facts, and the line (tested without
                                     collectives, which hang on XLA:CPU)

The facts travel over the run's host process group (the gloo group `lit_gpt.xla.strategy` opens on a multi-host
slice; none with one host). `--resume auto` needs no identity here: host 0 picks the newest step every host holds and
tells the others (`agreed_latest_checkpoint`); an explicit step folder is compared by its marker's save time.
"""

import datetime
import json
import socket
from typing import Any, Dict, List, Mapping, Optional, Sequence

from lit_gpt.data import prepared_record
from lit_gpt.storage import location
from lit_gpt.utils import LitError

# the groups of facts, in the order the line names them, and how the line calls each
GROUPS = (("config", "the config"), ("data", "the data"), ("checkpoint", "the checkpoint"))
# run-config entries compared by what they hold (the data and base fingerprints), not where the files are
BY_CONTENT = ("checkpoint_dir", "data.data_dir", "base")
_ABSENT = "(not set)"
SHOWN_KEYS = 3  # the config entries the line names (then "and N more")


def _flatten(d: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resume_point(resume: Any) -> str:
    """What this host resumes from, as far as it can tell alone: a fresh start, `--resume auto`/`true` (agreed by
    host 0 later), or an explicit step folder with its marker's save time (the same on every host that holds that
    checkpoint, also on per-host disks, where each host keeps a copy of host 0's marker)."""
    if resume is False or resume is None or resume == "false":
        return "a fresh start (--resume false)"
    if resume in (True, "auto", "true"):
        return f"--resume {str(resume).lower()}"
    from lit_gpt.xla.checkpoint import MARKER

    path = location(resume)
    if path.is_file():  # a file of a step folder
        path = path.parent
    try:
        saved = json.loads((path / MARKER).read_text()).get("saved_at")
        when = datetime.datetime.fromtimestamp(float(saved), datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OSError, ValueError, TypeError, AttributeError):
        return f"{path.name} (no readable {MARKER} on this host)"
    return f"{path.name} (saved {when})"


def host_facts(run: Any, data: Any) -> Dict[str, Any]:
    """This host's facts: `run` a recipe's FinetuneRun (its resolved arguments, model config with the method's
    settings, base record, --resume, --out_dir), `data` the run data it read (its prepared fingerprint)."""
    arguments = json.loads(json.dumps(run.run_config, default=str))
    config = {k: v for k, v in _flatten(arguments).items()
              if not any(k == p or k.startswith(p + ".") for p in BY_CONTENT)}
    model = json.loads(json.dumps(vars(run.config), default=str))  # the model's config, with lora_r, MoE settings...
    config.update({f"model.{k}": v for k, v in model.items()})
    config["out_dir"] = str(run.out_dir)
    prepared = prepared_record(data.prepared.meta, run.data.data_dir, run.data.packing)
    base = (run.base or {}).get("fingerprint") or _ABSENT
    return {
        "host": socket.gethostname(),
        "config": config,
        "data": {"prepared data": f"{prepared['fingerprint']} ({prepared['samples']} samples from"
                                  f" {prepared['source']!r})"},
        "checkpoint": {"base weights": base, "resume": resume_point(run.resume)},
    }


def _ranks(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "hosts 0-2, 5"; [3] -> "host 3"."""
    spans: List[str] = []
    start = prev = ranks[0]
    for r in list(ranks[1:]) + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return f"host{'s' if len(ranks) > 1 else ''} {', '.join(spans)}"


def _shown(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) and value in (_ABSENT,) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def disagreement(facts: Sequence[Mapping[str, Any]]) -> Optional[str]:
    """The one line naming what every host's facts (`host_facts`, in rank order) disagree on, with the hosts that
    hold each value (the largest group first; the others also by host name), or None when they all agree."""
    if len(facts) < 2:
        return None
    names = [str(f.get("host") or "") for f in facts]
    named = len(set(names)) == len(names) and all(names)  # host names help only when they tell the hosts apart
    differ_in: List[str] = []
    details: List[str] = []
    for group, label in GROUPS:
        values = [dict(f.get(group) or {}) for f in facts]
        keys = sorted(set().union(*values))
        differing = []
        for key in keys:
            by_value: Dict[str, List[int]] = {}
            for rank, v in enumerate(values):
                by_value.setdefault(_shown(v.get(key, _ABSENT)), []).append(rank)
            if len(by_value) > 1:
                differing.append((key, sorted(by_value.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))))
        if not differing:
            continue
        differ_in.append(label)
        for key, groups in differing[:SHOWN_KEYS]:
            held = []
            for i, (value, ranks) in enumerate(groups):
                who = _ranks(ranks)
                if i > 0 and named and len(ranks) <= 2:
                    who += f" ({', '.join(names[r] for r in ranks)})"
                held.append(f"{value} on {who}")
            details.append(f"{key} is {held[0]} but {' and '.join(held[1:])}")
        if len(differing) > SHOWN_KEYS:
            details.append(f"and {len(differing) - SHOWN_KEYS} more {group} entries")
    if not differ_in:
        return None
    what = ", ".join(differ_in[:-1]) + (" and " if len(differ_in) > 1 else "") + differ_in[-1]
    return (f"the {len(facts)} hosts disagree on {what}: {'; '.join(details)}. Start the same command on every host"
            " (gcloud compute tpus tpu-vm ssh NAME --worker=all --command ...) from the same checkout, with the same"
            " data and base weights on each (copied from one bucket)")


def check_hosts_agree(run: Any, data: Any) -> None:
    """Compare this host's facts with every other host's (nothing to do with one host); when they differ, every host
    raises the same LitError: the same one line on every host's stderr, and no host goes on to wait for the others
    in a collective that would never match."""
    from lit_gpt.xla.integrity import _all_gather, _barrier, _rank_world  # the hosts' group, when there are several

    problem = disagreement(_all_gather(host_facts(run, data)))
    if problem is None:
        return
    if _rank_world()[1] > 1:
        # every host ends here: leave the group together, so that no host's exit tears a connection another host's
        # gloo still uses (which aborts it with "terminate called without an active exception" after the line)
        import torch.distributed as dist

        _barrier()
        dist.destroy_process_group()
    raise LitError(problem)
