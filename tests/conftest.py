import os

# The fused kernel runs in Triton's interpreter on machines without CUDA; this must be set before
# anything imports triton.
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))
