"""Warm starts after an upgrade that leaves the step's HLO unchanged: does the serialized-
executable store refill (runner/executable_cache.py), or does every start compile?

For each tree given (--tree NAME=PATH, default this checkout): a copy of its `jaxserve`
package (the "old" install) and a second copy with one comment added (the "upgrade":
another source fingerprint, the same step HLO). Fresh processes on one empty compilation
cache per tree: the old tree's cold start, the upgrade's first start, then --warm more
starts of the upgrade, the trees' warm starts interleaved. Each reports seconds from
`import jaxserve` to LLM() returning, its warm-up, how many step executables it loaded
serialized, and (it waits for the background work before exiting, as a server stays up)
how many it stored since.

    python benchmarks/bench_startup_upgrade.py --tree before=/tmp/main-tree --tree after=. \\
        --out startup-upgrade-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_START = """
import json, sys, time
start = time.perf_counter()
from jaxserve import LLM
llm = LLM(None, compilation_cache_dir={cache!r})
ready = time.perf_counter() - start
setup = llm.llm_engine.engine_core.setup
runner = llm.llm_engine.engine_core.runner
done = getattr(runner, "background_done", None)      # absent before the refill existed
if done is not None:
    done.wait(900)
else:
    runner.all_compiled.wait(900)
background = time.perf_counter() - start - ready
cache = runner.executable_cache
print(json.dumps({{"ready_s": ready, "warmup_s": setup.warmup_seconds,
                  "phases_s": {{k: round(v, 2) for k, v in setup.phases.items()}},
                  "loaded": cache.hits, "compiled": cache.misses,
                  "stored_after_ready": getattr(cache, "refilled", None),
                  "background_s": background}}))
"""


def tree_copy(source: Path, target: Path, upgrade: bool) -> Path:
    shutil.copytree(source / "jaxserve", target / "jaxserve",
                    ignore=shutil.ignore_patterns("__pycache__"))
    if upgrade:      # a change in no step: only the source fingerprint moves
        with open(target / "jaxserve" / "__init__.py", "a") as f:
            f.write("# upgraded\n")
    return target


def start(tree: Path, cache: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _START.format(cache=cache)], env=env,
                         cwd=tree, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"start in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1]) | {"load": os.getloadavg()[0]}


def prepare(source: Path, root: Path) -> tuple[Path, str, dict]:
    """The old tree's cold start and the upgrade's first start on one fresh cache; returns
    (the upgraded tree, the cache, those two starts)."""
    old = tree_copy(source, root / "old", upgrade=False)
    new = tree_copy(source, root / "new", upgrade=True)
    cache = str(root / "cache")
    return new, cache, {"cold_old_tree": start(old, cache),
                        "first_after_upgrade": start(new, cache)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[],
                        help="NAME=PATH of a jaxserve checkout (repeatable; default: this one)")
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--out", default="", help="file under benchmarks/results/")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from machine import machine_info

    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(ROOT)}
    results: dict[str, dict] = {}

    def show(name: str, phase: str, run: dict) -> None:
        print(f"{name} {phase}: ready {run['ready_s']:.1f} s (warm-up {run['warmup_s']:.1f} s), "
              f"{run['loaded']} loaded, {run['compiled']} compiled, "
              f"{run['stored_after_ready']} stored after ready (in {run['background_s']:.1f} "
              f"s); load {run['load']:.1f}", flush=True)

    with tempfile.TemporaryDirectory(prefix="upgrade-") as root:
        upgraded = {}
        for name, path in trees.items():
            new, cache, first = prepare(Path(path).resolve(), Path(root) / name)
            upgraded[name] = (new, cache)
            results[name] = {**first, "warm_after_upgrade": []}
            for phase, run in first.items():
                show(name, phase, run)
        # the warm starts interleaved, alternating order: a shared box's load hits both
        for i in range(args.warm):
            for name in (list(trees) if i % 2 == 0 else list(trees)[::-1]):
                run = start(*upgraded[name])
                results[name]["warm_after_upgrade"].append(run)
                show(name, "warm_after_upgrade", run)
    summary = {name: {f"warm_after_upgrade_median_{key}": statistics.median(
        r[key] for r in result["warm_after_upgrade"]) for key in ("ready_s", "warmup_s")}
        for name, result in results.items()}
    print(json.dumps(summary, indent=1))
    if args.out:
        record = {"command": " ".join(sys.argv), "machine": machine_info(), "trees": trees,
                  "model": "SmolLM2-135M-Instruct (embedded GGUF), defaults",
                  "summary": summary, "results": results}
        path = ROOT / "benchmarks" / "results" / args.out
        path.write_text(json.dumps(record, indent=1))
        print("wrote", path)


if __name__ == "__main__":
    main()
