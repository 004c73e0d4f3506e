"""`python -m mlaserve.bench_one_batch_server ...`: the same as `mlaserve bench one-batch ...` (SGLang's habit)."""

import sys

from mlaserve.bench.one_batch import main

if __name__ == "__main__":
    sys.exit(main())
