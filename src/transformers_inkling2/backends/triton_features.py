"""What the installed Triton offers the kernels. Imported only where a kernel runs (triton is not a CPU dependency)."""

import triton

# the kernels written in Gluon follow it as Triton 3.6 ships it (an experimental API that still changes)
GLUON_API = tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 6)

__all__ = ["GLUON_API"]
