import os

import torch

# Keep benchmarks honest on small machines: one fixed thread count for every method.
torch.set_num_threads(int(os.environ.get("FASTDIAG_BENCH_THREADS", min(2, os.cpu_count() or 1))))
