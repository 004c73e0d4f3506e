"""`python -m mlaserve.bench_serving ...`: the same as `mlaserve bench serving ...` (SGLang's habit)."""

import sys

from mlaserve.bench.serving import main

if __name__ == "__main__":
    sys.exit(main())
