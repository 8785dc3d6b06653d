"""Build the CPU attention kernel ahead of time: ``python -m jaxserve.attention.cpu.build``.

Warns and exits 0 if it cannot be built (the engine then falls back to the
reference attention); ``--strict`` exits 1 instead. See `loader` for the cache.
"""

import sys

from jaxserve.attention.cpu.loader import main

if __name__ == "__main__":
    sys.exit(main())
