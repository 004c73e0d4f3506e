import os

import torch

# Without a GPU, Triton kernels run through its CPU interpreter; the variable must be set
# before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
