"""C kernels for the CPU path, float32 or bfloat16 weights (docs/kernels.md). Importing the package imports every
kernel module, so each has registered its C source with build.py before the library is first built."""
from . import fused, gemm, layers  # noqa: F401
