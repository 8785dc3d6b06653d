"""Plot bench_serving.py results: output tok/s and latencies against concurrency.

    python benchmarks/plot_serving.py benchmarks/results/jaxserve-c*.json \\
        --offline 1234.5 --out benchmarks/results/serving.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--offline", type=float, default=None,
                   help="offline LLM.generate output tok/s at the largest concurrency")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/serving.png"))
    args = p.parse_args()
    runs = sorted((json.loads(path.read_text()) for path in args.results),
                  key=lambda r: r["max_concurrency"] or 0)
    conc = [r["max_concurrency"] for r in runs]
    fig, (ax_tput, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_tput.plot(conc, [r["output_throughput"] for r in runs], "o-", label="server")
    if args.offline:
        ax_tput.axhline(args.offline, color="gray", ls="--",
                        label="offline LLM.generate (batch = largest concurrency)")
    ax_tput.set(xscale="log", xlabel="concurrent requests", ylabel="output tokens/s",
                title="Throughput")
    ax_tput.set_xticks(conc, [str(c) for c in conc])
    ax_tput.legend()
    for key, label in (("median_ttft_ms", "TTFT median"), ("median_itl_ms", "ITL median"),
                       ("p99_itl_ms", "ITL p99"), ("median_tpot_ms", "TPOT median")):
        ax_lat.plot(conc, [r[key] for r in runs], "o-", label=label)
    ax_lat.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="ms",
               title="Latency")
    ax_lat.set_xticks(conc, [str(c) for c in conc])
    ax_lat.legend()
    first = runs[0]
    fig.suptitle(f"jaxserve {first['model']}: {first['random_input_len']} in / "
                 f"{first['random_output_len']} out tokens")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
