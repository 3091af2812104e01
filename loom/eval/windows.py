"""A tokenized text cut into windows for sliding-window perplexity.

Window k covers text tokens [k * stride, k * stride + context). A model that wants BOS gets it
as the window's first input token, in place of the window's first text token (as
llama-perplexity does). Each text token is scored once, by the first window whose input holds
it with context before it: the first window scores all its tokens, a later one only those
past the previous window (its last `stride` tokens).

    text     t0 t1 t2 t3 t4 t5 t6 t7 t8 t9         context 6, stride 3
    window 0 [B  t1 t2 t3 t4 t5]                   scores t1 .. t5 (B predicts t1)
    window 1          [B  t4 t5 t6 t7 t8]          scores t6 .. t8
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.errors import InvalidRequestError


@dataclass(frozen=True)
class Window:
    tokens: tuple[int, ...]    # model input
    first: int                 # first position whose next token is scored (position i predicts tokens[i + 1])

    @property
    def targets(self) -> tuple[int, ...]:
        return self.tokens[self.first + 1:]


@dataclass(frozen=True)
class Windows:
    windows: tuple[Window, ...]
    context: int
    stride: int
    text_tokens: int

    @classmethod
    def build(cls, ids: list[int], context: int, stride: int | None = None, bos: int | None = None,
              max_windows: int | None = None) -> "Windows":
        stride = context // 2 if stride is None else stride
        if context < 2:
            raise InvalidRequestError(f"context must be at least 2 tokens, got {context}")
        if not 1 <= stride <= context - 1:
            raise InvalidRequestError(f"stride must be in [1, context - 1] = [1, {context - 1}], got {stride}")
        if max_windows is not None and max_windows < 1:
            raise InvalidRequestError(f"chunks must be a positive number of windows, got {max_windows}")
        if len(ids) < context:
            raise InvalidRequestError(f"the text has {len(ids)} tokens, fewer than one window of {context}; "
                                      "use a longer text or a smaller --context")
        count = 1 + (len(ids) - context) // stride
        if max_windows is not None:
            count = min(count, max_windows)
        out = []
        for k in range(count):
            s = k * stride
            toks = list(ids[s:s + context])
            if bos is not None:
                toks[0] = bos
            # text index of input position i is s + i; targets past the previous window's end
            first = 0 if k == 0 else context - stride - 1
            out.append(Window(tuple(toks), first))
        return cls(tuple(out), context, stride, len(ids))

    @property
    def num_scored(self) -> int:
        return sum(len(w.targets) for w in self.windows)

    def __len__(self) -> int:
        return len(self.windows)
