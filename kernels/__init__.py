"""rewind.kernels: fused training losses, with a torch reference.

On a machine without CUDA the Triton kernel runs in Triton's interpreter, which is chosen when triton
is first imported (by this package's kernel or by another library: bitsandbytes and peft import it
too). So it is asked for here, when rewind's engine or kernels are first imported, before anything can
import triton: setting TRITON_INTERPRET yourself overrides it either way.
"""

from __future__ import annotations

import os
import sys

import torch  # (not triton: importing torch does not import it)


def _interpret_triton_without_cuda() -> None:
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    if not torch.cuda.is_available():  # compiled Triton kernels need a GPU; the interpreter runs on CPU tensors
        os.environ["TRITON_INTERPRET"] = "1"


_interpret_triton_without_cuda()
