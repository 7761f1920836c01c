"""The `draftsmith` command: one subcommand per stage, each flag a field of that stage's config.

    draftsmith demo                       # the whole pipeline on the embedded SmolLM2 target
    draftsmith generate|extract|train|export|bench --help

The CLI only parses arguments into the stage's frozen config dataclass and calls run(config);
everything a stage can do is reachable from Python the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
import types
import typing

from draftsmith import bench, check, cost, demo, export, extract, generate, interop, train

STAGES = {
    "generate": (generate.GenerateConfig, generate.run, "the target answers the training prompts itself"),
    "extract": (extract.ExtractConfig, extract.run, "capture the target's aux + final hidden states to shards"),
    "train": (train.TrainConfig, train.run, "train the EAGLE-3 drafter with training-time test"),
    "export": (export.ExportConfig, export.run, "write a folder SGLang (and vLLM) can serve"),
    "import": (interop.ImportConfig, interop.run, "read an EAGLE/SpecForge/speculators drafter into a trained folder"),
    "check": (check.CheckConfig, check.run, "check a draft checkpoint against its target before serving"),
    "bench": (bench.BenchConfig, bench.run, "speculative vs plain decoding: accept length, tok/s, speedup"),
    "cost": (cost.CostConfig, cost.run, "the accept length a deployment needs to break even, and what one buys"),
    "demo": (demo.DemoConfig, demo.run, "every stage at small scale on the embedded default target"),
}


def field_comments(cls) -> dict[str, str]:
    """The comment on each field's line of a config dataclass (and comment lines right after it),
    which is what the flag does."""
    comments, last = {}, None
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+)\s*:[^#]*#\s*(.+)$", line)
        more = re.match(r"\s+#\s*(.+)$", line)
        if m and m.group(1) not in comments:
            last = m.group(1)
            comments[last] = m.group(2).strip()
        elif more and last:
            comments[last] += " " + more.group(1).strip()
        else:
            last = None
    return comments


def add_field(parser: argparse.ArgumentParser, f: dataclasses.Field, hint, comment: str = ""):
    flag = "--" + f.name.replace("_", "-")
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    default = None if required else f.default
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    kw = {"required": required, "default": default,
          "help": " ".join(filter(None, [comment, "(required)" if required else f"(default: {default})"]))}
    if hint is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
    elif typing.get_origin(hint) is tuple:
        parser.add_argument(flag, nargs="+", type=args[0], **kw)
    elif hint is dict:
        parser.add_argument(flag, type=json.loads, **kw)
    else:
        parser.add_argument(flag, type=hint, **kw)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="stage", required=True)
    for name, (cls, _, help_text) in STAGES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        hints, comments = typing.get_type_hints(cls), field_comments(cls)
        for f in dataclasses.fields(cls):
            add_field(p, f, hints[f.name], comments.get(f.name, ""))
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = vars(build_parser().parse_args(argv))
    cls, run, _ = STAGES[ns.pop("stage")]
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in ns.items()}
    try:
        config = cls(**values)
    except (ValueError, TypeError) as e:
        print(f"draftsmith: {e}", file=sys.stderr)
        return 2
    try:
        result = run(config)
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"draftsmith: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: rerun the same command to resume where it stopped", file=sys.stderr)
        return 130
    if isinstance(result, bench.BenchResult):
        print(bench.table(result))
    summary = dataclasses.asdict(result) if dataclasses.is_dataclass(result) else result
    if isinstance(summary, dict):
        summary.pop("per_prompt", None)
    print(json.dumps(summary, default=str))
    return 0
