"""`python -m loom.kernels [--all] [-v]`: build the compiled kernels now: the variant loom runs
on this CPU (make install runs this), and with --all every other variant it can run too (make
test runs them all; `LOOM_KERNELS` picks one at run time)."""

import sys

from loom import kernels

verbose = "-v" in sys.argv
if kernels.load(verbose=verbose) is None:
    print(f"loom kernels not built ({kernels.unavailable_reason()}); loom will use its torch fallback")
else:
    built = [kernels.variant()]
    for other in kernels.supported_variants() if "--all" in sys.argv else ():
        if other != kernels.variant():
            try:
                kernels.build(other, verbose)
            except Exception as e:  # the preferred variant works; say why this one does not
                print(f"loom kernels: the {other} variant did not build: {str(e).strip().splitlines()[-1]}")
                continue
            built.append(other)
    print(f"loom kernels ready ({kernels.variant()}; built: {', '.join(built)})")
