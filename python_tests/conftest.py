import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter; it must be switched on before
# triton is first imported (specdec_kernels imports it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
