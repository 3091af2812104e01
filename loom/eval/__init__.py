"""`loom eval`: how well a configuration predicts text, and how far it is from a reference.

    windows.py   the text cut into overlapping windows (context, stride), the tokens each scores
    sources.py   who computes the log-probabilities: loom in any configuration, llama.cpp over the
                 same tokens, or a reference run saved to disk (a registry, like the drafters)
    run.py       one pass over the windows: perplexity, and against a reference the per-token KL
                 divergence, top-1 agreement and probability shift
    report.py    statistics (quantiles as llama-perplexity prints them), the table, JSON, the plot

The default reference is loom's float32 mode, which matches the reference implementation
bit for bit on the same GGUF.
"""

from loom.eval.run import EvalResult, evaluate
from loom.eval.sources import SOURCES, LogprobSource, open_source
from loom.eval.windows import Windows

__all__ = ["SOURCES", "EvalResult", "LogprobSource", "Windows", "evaluate", "open_source"]
