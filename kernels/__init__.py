"""rewind.kernels: fused training losses, with a torch reference.

On a machine without CUDA the Triton kernel runs in Triton's interpreter, which is chosen when triton
is first imported (by this package's kernel or by another library: bitsandbytes and peft import it
too). So it is asked for here, when rewind's engine or kernels are first imported, before anything can
import triton: setting TRITON_INTERPRET yourself overrides it either way.

Python run from the clone root (`python -c`, `python -m`, pytest put the working directory first on
sys.path) also finds this folder as a top-level `kernels`: the name of Hugging Face's kernel-hub package,
which bitsandbytes imports and transformers probes for. Imported under that name, this file stands
aside: it loads in its place the `kernels` the rest of sys.path holds, or where there is none an empty
namespace package (what transformers reads as not installed; `from kernels import x` is an ImportError),
so no probe takes rewind's losses for that package, and the folder itself need not be renamed.
"""

from __future__ import annotations

import os
import sys


def _interpret_triton_without_cuda() -> None:
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    import torch  # (not triton: importing torch does not import it)

    # Compiled Triton kernels need a GPU; the interpreter runs on CPU tensors.
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _stand_aside() -> None:
    from importlib.machinery import ModuleSpec, PathFinder
    from importlib.util import module_from_spec

    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    elsewhere = [p for p in sys.path if isinstance(p, str) and os.path.realpath(p or os.curdir) != root]
    spec = PathFinder.find_spec("kernels", elsewhere) or ModuleSpec("kernels", None, is_package=True)
    module = module_from_spec(spec)
    # The import that is running this file hands out whatever sys.modules holds once it has run.
    sys.modules["kernels"] = module
    if spec.loader is not None:
        spec.loader.exec_module(module)


if __name__ == "kernels":
    _stand_aside()
else:
    _interpret_triton_without_cuda()
