"""Command lines built from a list of flags: the scripts whose flags are shared (the recipes of a kind, the prepare
scripts) declare each flag once, as a `Flag`, and `command` builds the entry function whose signature and docstring
jsonargparse reads (`run_cli(command(...))`). A call checks its arguments as a written-out signature would.

A flag that takes fsspec URLs says so, and whether it is read or written: `Flag("out_dir", str, "out", doc,
url="output")`; every other path flag takes local paths only (`lit_gpt.storage.check_path_flags`, run by `run_cli`).
"""

import inspect
from dataclasses import dataclass, replace
from typing import Any, Callable, List, Literal, Optional, Sequence

from lit_gpt.storage import PathFlags


@dataclass(frozen=True)
class Flag:
    name: str
    annotation: Any
    default: Any
    doc: str
    url: Optional[Literal["input", "output"]] = None
    """"input" / "output": the flag takes fsspec URLs (gs://, s3://, file://, memory://), read / written; None: a
    local path only (or not a path)."""


def with_defaults(flags: Sequence[Flag], **defaults: Any) -> List[Flag]:
    """`flags` with other defaults for the named ones (a name the list lacks is an error: no silent new flag)."""
    names = {f.name for f in flags}
    unknown = sorted(set(defaults) - names)
    if unknown:
        raise TypeError(f"no such flag: {', '.join(unknown)}")
    return [replace(f, default=defaults[f.name]) if f.name in defaults else f for f in flags]


def command(summary: str, flags: Sequence[Flag], body: Callable[..., Any], name: str = "setup",
            returns: Any = dict) -> Callable[..., Any]:
    """A function `name(**flags)` with `flags` as its signature and its docstring's Args, that calls
    `body(**every flag's value)`: what jsonargparse turns into a command line and its `--help`."""
    names = [f.name for f in flags]
    if len(set(names)) != len(names):
        raise TypeError(f"duplicate flags: {sorted(n for n in set(names) if names.count(n) > 1)}")
    signature = inspect.Signature(
        [inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=f.default, annotation=f.annotation)
         for f in flags],
        return_annotation=returns,
    )

    def setup(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return body(**bound.arguments)

    setup.__signature__ = signature  # type: ignore[attr-defined]
    setup.__annotations__ = {**{f.name: f.annotation for f in flags}, "return": returns}
    setup.__doc__ = "\n".join([summary, "", "Args:"] + [f"    {f.name}: {_indent(f.doc)}" for f in flags])
    setup.__name__ = setup.__qualname__ = name
    setup.path_flags = PathFlags({f.name: f.url for f in flags if f.url})  # type: ignore[attr-defined]
    return setup


def _indent(doc: str) -> str:
    return doc.replace("\n", "\n        ")
