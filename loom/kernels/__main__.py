"""`python -m loom.kernels`: build the compiled kernels now, every variant this CPU runs
(make install runs this; `LOOM_KERNELS` then picks one at run time)."""

import sys

from loom import kernels

verbose = "-v" in sys.argv
if kernels.load(verbose=verbose) is None:
    print(f"loom kernels not built ({kernels.unavailable_reason()}); loom will use its torch fallback")
else:
    for other in kernels.supported_variants():
        if other != kernels.variant():
            try:
                kernels.build(other, verbose)
            except Exception as e:  # the preferred variant works; say why this one does not
                print(f"loom kernels: the {other} variant did not build: {str(e).strip().splitlines()[-1]}")
                continue
    print(f"loom kernels ready ({kernels.variant()}; built: {', '.join(kernels.supported_variants())})")
