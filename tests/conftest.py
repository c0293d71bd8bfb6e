import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # tests/oracles.py

# Without a GPU, generated kernels can only run under the Triton interpreter, and
# triton decides that when it is first imported: set it before any test module loads.
import os  # noqa: E402

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
