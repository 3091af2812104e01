"""`python -m loom.kernels`: build the compiled kernels now (make install runs this)."""

import sys

from loom import kernels

if kernels.load(verbose="-v" in sys.argv) is None:
    print(f"loom kernels not built ({kernels.unavailable_reason()}); loom will use its torch fallback")
else:
    print(f"loom kernels ready ({kernels.variant()})")
