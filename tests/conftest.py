import os

import torch

# Keep tests deterministic and light on the 2-core CI machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))

