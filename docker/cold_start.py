"""Cold start to first token of a built image, here (buildah; see image_harness.py).

A fresh container and a fresh volume per run: launch `jaxserve serve`, poll /health, send one
streamed chat completion; the number is the seconds from launch to its first token. With
--seed-volume the volume starts as a copy of the image's /data, as Docker fills a new named
volume (that is where a baked image keeps its compilation cache).

    python docker/cold_start.py jaxserve:cpu jaxserve:cpu-baked:seed
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from image_harness import Container, Server, stream_chat  # noqa: E402


def cold_start(image: str, seed: bool) -> dict:
    with Container(image) as container:
        if seed:
            container.seed_volume_from_image()
        server = Server(container)
        try:
            ready = server.wait_healthy(1800)
            result = stream_chat(server.base_url, "Hello!", max_tokens=8)
            first_token = time.monotonic() - server.started
        finally:
            code = server.stop()
        return {"image": image, "seeded_volume": seed, "ready_s": round(ready, 1),
                "first_token_s": round(first_token, 1), "exit_code": code,
                "text": result["text"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("images", nargs="+", help="IMAGE or IMAGE:seed (seed the volume)")
    args = parser.parse_args()
    for spec in args.images:
        seed = spec.endswith(":seed")
        print(json.dumps(cold_start(spec.removesuffix(":seed"), seed)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
