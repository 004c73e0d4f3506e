import os

import torch

# Without a GPU, Triton kernels run through its CPU interpreter; the variable must be set
# before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist runs one worker process per core; torch's default of one intra-op thread per core in
# each worker oversubscribes the CPU, and OpenMP's spin-waiting then slows small ops by 10x and more
# (the model tests: 1 min with one thread per worker, 8 min without, on 2 cores).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
