"""Batched next-token sampling with vLLM's semantics.

The runner computes logits only for the positions it samples, one row per row of a
`SamplingBatch`, and calls `Sampler` once per step. Per row, in this order:

1. logprobs (when asked) are the log-softmax of the raw logits as passed in;
2. a row with allowed ids (`allowed_token_ids`) keeps only those; banned ids (stop ids and EOS
   of rows below `min_tokens`, the last token of a bad word whose other tokens end the output)
   are set to -inf; a row's logit bias is added to its ids;
3. penalties: repetition over prompt + output tokens (positive logits divided by it,
   negative ones multiplied), then frequency and presence over output tokens only:
   ``logit -= frequency * count + presence * (count > 0)``;
4. greedy rows take the argmax of these logits (ties go to the lowest id);
5. other rows divide by their temperature, then keep the top-k logits (ties with the
   k-th are kept), then the tokens at least min_p times as probable as the most probable
   one, then the top-p nucleus of what is left (vLLM v1's order), and draw by inversion: one uniform u per row, the
   token where the running sum of the probabilities first exceeds u times their total
   (block sums first, then the sum inside one block; a zero-probability token is never
   picked). One random number per row instead of one per vocabulary entry: drawing 49k
   exponentials cost ~1.3 ms a row.

Where loom's kernels run, step 5 and the draw are their `sample_rows` (loom_kernels_sample.h):
the same stages and tie rules in a few passes over each row, its sums in float64, top-p sorting
only the entries near the nucleus' end instead of the whole row. It agrees with the torch ops
here up to rounding (tests/test_sampler.py runs every test on both); on Gemma 3's 262k-token
rows it made a 32-row top-p step ~40x cheaper than torch's full sort (500 ms -> 12 ms).
Without the kernels, top-p sorts only a row's TOP_P_CANDIDATES most probable tokens where
the rest weigh at most 1 - p (the same tokens kept; 32 peaked 262k-token rows: 478 -> 75 ms),
else the whole row.

Every stage works on whole rows at once, and only on the rows that use it. The uniform
of a row with its own generator is drawn from that generator alone, one per step, and
every stage computes each row independently of the others, so a seeded request samples
the same tokens whatever else is in the batch and wherever its row is. Rows without a
generator share one draw from the sampler's generator.
"""

from __future__ import annotations

import math

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain

import torch
import torch.nn.functional as F

from loom.sampling_params import SamplingParams


ARGMAX_CHUNK = 1024
_CHUNK_IDS = torch.arange(ARGMAX_CHUNK)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of [R, V] logits, ties to the lowest id, as `x.argmax(dim=1)` gives,
    in ~1/10 of its time over a large vocabulary: torch's CPU argmax is a scalar loop, its max
    is vectorised. Row maxima of 1024-wide chunks find the first chunk holding the row's max;
    an argmax inside that one chunk finds the token.

        row     | chunk 0 | chunk 1 | ... | chunk c* | ... | tail |
        amax       m0        m1               M                      -> c* = first chunk with M
        argmax inside chunk c* -> id = c* * 1024 + j
    """
    R, V = x.shape
    if V < 4 * ARGMAX_CHUNK:
        return x.argmax(dim=1)
    full = V - V % ARGMAX_CHUNK
    chunk_max = x[:, :full].reshape(R, -1, ARGMAX_CHUNK).amax(dim=2)        # [R, V // 1024]
    if full < V:
        chunk_max = torch.cat([chunk_max, x[:, full:].amax(dim=1, keepdim=True)], dim=1)
    best = chunk_max.argmax(dim=1)                                           # [R]
    if R == 1:
        start = int(best) * ARGMAX_CHUNK
        return (x[0, start:start + ARGMAX_CHUNK].argmax() + start).view(1)
    # ids of the chosen chunk; the tail chunk repeats its last id, which keeps the first max first
    ids = (best[:, None] * ARGMAX_CHUNK + _CHUNK_IDS).clamp_(max=V - 1)     # [R, 1024]
    return ids.gather(1, x.gather(1, ids).argmax(dim=1, keepdim=True)).squeeze(1)


def _column(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


@dataclass(frozen=True)
class SamplingBatch:
    """The sampling settings of one step, one row per sampled position.

    Greedy rows carry temperature 0, top_k 0, top_p 1 and min_p 0, so they never make a
    filtering stage run. `generators[i]` is the row's own generator (None: the
    sampler's shared one). The id lists are per row and may be None when no row needs
    them: prompt ids for the repetition penalty, output ids for every penalty, banned
    ids for rows that must not end yet or must not finish a bad word, allowed ids [k] int64
    and logit biases (ids [k] int64, values [k] float32) of the rows that have them. The flags
    after `logit_bias` are derived.
    """

    temperature: torch.Tensor         # [S] float32, 0 for greedy rows
    top_k: torch.Tensor               # [S] int64, 0 = disabled
    top_p: torch.Tensor               # [S] float32, 1 = disabled
    min_p: torch.Tensor               # [S] float32, 0 = disabled
    presence_penalty: torch.Tensor    # [S] float32, 0 = disabled
    frequency_penalty: torch.Tensor   # [S] float32, 0 = disabled
    repetition_penalty: torch.Tensor  # [S] float32, 1 = disabled
    generators: list[torch.Generator | None]
    prompt_token_ids: list[Sequence[int]] | None
    output_token_ids: list[Sequence[int]] | None
    banned_token_ids: list[Sequence[int]] | None
    num_logprobs: list[int | None]
    allowed_token_ids: list[torch.Tensor | None] | None = None
    logit_bias: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None

    greedy: torch.Tensor = field(init=False)  # [S] bool
    all_greedy: bool = field(init=False)
    all_random: bool = field(init=False)
    no_penalties: bool = field(init=False)
    no_top_k: bool = field(init=False)
    no_top_p: bool = field(init=False)
    no_min_p: bool = field(init=False)
    max_num_logprobs: int | None = field(init=False)  # None: no row asked

    def __post_init__(self) -> None:
        rows = self.temperature.shape[0]
        for name in ("temperature", "top_k", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            if getattr(self, name).shape != (rows,):
                raise ValueError(f"SamplingBatch.{name} has shape {tuple(getattr(self, name).shape)}, "
                                 f"expected ({rows},)")
        for name in ("generators", "num_logprobs", "prompt_token_ids", "output_token_ids",
                     "banned_token_ids", "allowed_token_ids", "logit_bias"):
            value = getattr(self, name)
            if value is not None and len(value) != rows:
                raise ValueError(f"SamplingBatch.{name} has {len(value)} rows, expected {rows}")

        greedy = self.temperature == 0
        penalised = ((self.presence_penalty != 0) | (self.frequency_penalty != 0)
                     | (self.repetition_penalty != 1)).any().item()
        if penalised and self.output_token_ids is None:
            raise ValueError("SamplingBatch uses penalties but has no output_token_ids")
        if (self.repetition_penalty != 1).any().item() and self.prompt_token_ids is None:
            raise ValueError("SamplingBatch uses repetition_penalty but has no prompt_token_ids")
        asked = [k for k in self.num_logprobs if k is not None]

        derived = {
            "greedy": greedy,
            "all_greedy": bool(greedy.all().item()),
            "all_random": not bool(greedy.any().item()),
            "no_penalties": not penalised,
            "no_top_k": not bool((self.top_k > 0).any().item()),
            "no_top_p": not bool((self.top_p < 1).any().item()),
            "no_min_p": not bool((self.min_p > 0).any().item()),
            "max_num_logprobs": max(asked) if asked else None,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        prompt_ids: Sequence[Sequence[int]] | None = None,
        output_ids: Sequence[Sequence[int]] | None = None,
        banned: Sequence[Sequence[int]] | None = None,
        allowed: Sequence[torch.Tensor | None] | None = None,
        bias: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
    ) -> SamplingBatch:
        """The batch for rows sampled with `params[i]`.

        `generators` defaults to none (every row uses the shared generator). The id
        lists are kept only when some row needs them: prompt ids when a row has a
        repetition penalty, output ids when a row has any penalty; allowed ids and biases
        when a row has them.
        """
        greedy = [p.is_greedy for p in params]
        temperature = [0.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = [0 if g or p.top_k < 0 else p.top_k for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        repetition = any(p.repetition_penalty != 1 for p in params)
        penalised = repetition or any(p.presence_penalty != 0 or p.frequency_penalty != 0
                                      for p in params)
        return cls(
            temperature=_column(temperature, torch.float32),
            top_k=_column(top_k, torch.int64),
            top_p=_column(top_p, torch.float32),
            min_p=_column(min_p, torch.float32),
            presence_penalty=_column([p.presence_penalty for p in params], torch.float32),
            frequency_penalty=_column([p.frequency_penalty for p in params], torch.float32),
            repetition_penalty=_column([p.repetition_penalty for p in params], torch.float32),
            generators=list(generators) if generators is not None else [None] * len(params),
            prompt_token_ids=list(prompt_ids) if repetition and prompt_ids is not None else None,
            output_token_ids=list(output_ids) if penalised and output_ids is not None else None,
            banned_token_ids=list(banned) if banned is not None else None,
            num_logprobs=[p.logprobs for p in params],
            allowed_token_ids=list(allowed) if allowed is not None and any(a is not None for a in allowed) else None,
            logit_bias=list(bias) if bias is not None and any(b is not None for b in bias) else None,
        )


@dataclass(frozen=True)
class SamplerOutput:
    """The tokens of one step and, when any row asked, their logprobs.

    Logprobs are of the raw logits. Rows that did not ask hold NaN logprobs and -1 ids;
    a row that asked for k alternatives reads the first k columns of `top_*`, which are
    sorted most probable first.
    """

    token_ids: torch.Tensor              # [S] int64
    logprobs: torch.Tensor | None        # [S] float32, of the sampled token
    top_logprobs: torch.Tensor | None    # [S, K] float32, K = max_num_logprobs
    top_token_ids: torch.Tensor | None   # [S, K] int64
    # [S] the sampled token's rank: 1 + the number of tokens with a higher logprob (vLLM gives
    # it even when the token is outside the top K); 0 where the row did not ask
    ranks: torch.Tensor | None = None


def request_generator(params: SamplingParams) -> torch.Generator | None:
    """A fresh generator for a seeded request (None when unseeded); keep it for its life."""
    if params.seed is None:
        return None
    return torch.Generator().manual_seed(params.seed)


def _flatten(rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, id) pairs of every id in `rows`, as two int64 tensors."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    ids = torch.tensor(list(chain.from_iterable(rows)), dtype=torch.int64)
    return torch.repeat_interleave(torch.arange(len(rows)), lengths), ids


def apply_banned(logits: torch.Tensor, banned: Sequence[Sequence[int]]) -> None:
    """Set `logits[i, t]` to -inf for every id t in `banned[i]`; ids >= V are ignored."""
    row, ids = _flatten(banned)
    keep = ids < logits.shape[1]
    logits[row[keep], ids[keep]] = float("-inf")


def apply_allowed(logits: torch.Tensor, allowed: Sequence[torch.Tensor | None]) -> None:
    """Row i of `logits` keeps only the ids `allowed[i]` (None: every id), the rest -inf."""
    for i, ids in enumerate(allowed):
        if ids is not None:
            keep = logits[i, ids]
            logits[i].fill_(float("-inf"))
            logits[i, ids] = keep


def apply_logit_bias(logits: torch.Tensor, bias: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
    """Adds `bias[i]` = (ids, values), distinct ids, to row i of `logits` (None: nothing)."""
    for i, b in enumerate(bias):
        if b is not None:
            logits[i].index_add_(0, b[0], b[1])


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: Sequence[Sequence[int]] | None,
    output_ids: Sequence[Sequence[int]],
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> None:
    """Apply vLLM's three penalties to `logits` [R, V] in place, row i with row i's values.

    Repetition: a token seen in the prompt or the output has a positive logit divided
    by the penalty and a negative one multiplied by it. Then
    ``logit -= frequency * count + presence * (count > 0)``, counting output tokens only.
    `prompt_ids` may be None only when every repetition penalty is 1.

    Only the (row, id) entries that occur are touched, through the flat index row * V + id
    (ids outside the vocabulary have no logit and are skipped): dense [R, V] counts and masks
    cost 77 ms (presence and frequency) and 176 ms (repetition) on 32 of Gemma 3's 262k-token
    rows, against a 41 ms decode step. Each entry gets the float operations the dense formulas
    give it.
    """
    R, V = logits.shape
    flat = logits.view(-1) if logits.is_contiguous() else logits.contiguous().view(-1)
    keys, counts = torch.unique(_flat_keys(output_ids, V), return_counts=True)   # each (row, id) once
    if (repetition != 1).any():
        if prompt_ids is None:
            raise ValueError("a repetition penalty needs the prompt token ids")
        seen = torch.unique(torch.cat([keys, _flat_keys(prompt_ids, V)]))
        penalty, values = repetition[seen // V], flat[seen]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    rows = keys // V
    flat[keys] -= frequency[rows] * counts + presence[rows]
    if flat.data_ptr() != logits.data_ptr():
        logits.copy_(flat.view(R, V))


def _flat_keys(rows: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """row * V + id of every id below V in `rows`."""
    row, ids = _flatten(rows)
    keep = (ids >= 0) & (ids < vocab_size)
    return row[keep] * vocab_size + ids[keep]


# top-p without a whole-row sort: a row's TOP_P_CANDIDATES most probable tokens hold the nucleus'
# end wherever the rest weigh at most 1 - p; only they are sorted. Rows whose nucleus is wider, or
# with a token outside tied with the last of them, take the whole sort.
TOP_P_CANDIDATES = 1024


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None) -> None:
    """Mask to -inf, in place, the logits outside each row's top-k and top-p sets.

    top_k [R] int64: k <= 0 or k >= V keeps every token; otherwise tokens below the k-th
    largest logit are dropped (ties with it are kept). top_p [R] float32 or None: on the
    softmax of what top-k kept, drop the least probable tokens while their total stays
    <= 1 - p; the most probable token is always kept. Tokens of equal probability are taken in
    a stable ascending sort (the lower id is dropped first).
    """
    vocab = logits.shape[1]
    k_on = (top_k > 0) & (top_k < vocab)
    if k_on.any():
        k = torch.where(k_on, top_k, 1)
        largest = logits.topk(int(k.max()), dim=1).values
        threshold = largest.gather(1, (k - 1).unsqueeze(1))
        threshold.masked_fill_(~k_on.unsqueeze(1), float("-inf"))
        logits.masked_fill_(logits < threshold, float("-inf"))
    if top_p is None:
        return
    on = top_p < 1                            # rows of a top-p batch with top-k alone skip this stage
    if bool(on.any()):
        _on_rows(logits, _rows_where(on), _apply_top_p, top_p)


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """apply_top_k_top_p's top-p stage on rows that all have p < 1."""
    if logits.shape[1] <= TOP_P_CANDIDATES:
        _top_p_sorted(logits, top_p)
        return
    rest = _top_p_candidates(logits, top_p)   # the rows whose nucleus the candidates do not hold
    if rest.numel():
        sub = logits[rest]
        _top_p_sorted(sub, top_p[rest])
        logits[rest] = sub


def _top_p_sorted(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """Top-p over whole rows: one stable ascending sort each."""
    ascending, order = logits.sort(dim=1, stable=True)
    below = ascending.softmax(dim=1).cumsum(dim=1) <= (1 - top_p).unsqueeze(1)
    below[:, -1] = False
    drop = ascending.isneginf() | below
    logits.masked_fill_(torch.empty_like(drop).scatter_(1, order, drop), float("-inf"))


def _top_p_candidates(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p, in place, on the rows whose TOP_P_CANDIDATES most probable tokens hold the
    nucleus' end (the rest weigh at most 1 - p: all of them are dropped, and the candidates'
    ascending sums start from their weight); returns the other rows, left to the full sort."""
    m = TOP_P_CANDIDATES
    probs = logits.softmax(dim=1)                                         # [R, V]
    top, ids = probs.topk(m, dim=1)                                       # [R, m] most probable first
    edge = top[:, -1:]                                                    # [R, 1] the m-th largest
    outside = probs < edge                                                # [R, V]
    rest = probs.sum(dim=1) - top.sum(dim=1)                              # [R] the others' weight
    # no token outside ties with the edge (a tie across it leaves the choice to the sort)
    ok = (outside.sum(dim=1) == probs.shape[1] - m) & (edge.squeeze(1) > 0) & (rest <= 1 - top_p)
    done = ok.nonzero().squeeze(1)
    if done.numel():
        ids = ids[done].sort(dim=1).values                                # [D, m] ascending ids
        p_sorted, by = probs[done].gather(1, ids).sort(dim=1, stable=True)   # ties: the lower id first
        below = rest[done].unsqueeze(1) + p_sorted.cumsum(dim=1) <= (1 - top_p[done]).unsqueeze(1)
        below[:, -1] = False
        logits.masked_fill_(outside & ok.unsqueeze(1), float("-inf"))
        dropped = ids.gather(1, by)[below]
        logits[done.unsqueeze(1).expand_as(below)[below], dropped] = float("-inf")
    return (~ok).nonzero().squeeze(1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask to -inf, in place, the logits whose probability is below min_p times their row's
    largest: exp(logit - max) < min_p, as the kernel compares."""
    top = logits.amax(dim=1, keepdim=True)
    logits.masked_fill_((logits - top).exp_() < min_p.unsqueeze(1), float("-inf"))


DRAW_BLOCK = 1024   # ids per block of the two-level running sum


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token per row of `probs` [R, V] (non-negative, any positive total) by inversion with the
    uniforms `u` [R]: the first id whose running sum exceeds u * total.

    Two levels, so that only one block per row is summed id by id: block sums -> the block
    where their running sum crosses the target -> the running sum inside that block."""
    R, V = probs.shape
    nb = -(-V // DRAW_BLOCK)
    p = probs if V == nb * DRAW_BLOCK else F.pad(probs, (0, nb * DRAW_BLOCK - V))
    p = p.view(R, nb, DRAW_BLOCK)
    # block sums in float32 (torch sums pairwise: error ~1e-7 relative, the probabilities' own
    # rounding), accumulated across blocks in float64
    bcdf = p.sum(dim=2).to(torch.float64).cumsum_(dim=1)                       # [R, nb]
    total = bcdf[:, -1:]
    target = torch.minimum(u.to(torch.float64).unsqueeze(1) * total,
                           torch.nextafter(total, torch.zeros_like(total)))   # [R, 1], < total
    b = torch.searchsorted(bcdf, target, right=True).clamp_(max=nb - 1)        # [R, 1]
    before = torch.where(b > 0, bcdf.gather(1, (b - 1).clamp_(min=0)), torch.zeros_like(target))
    rows = torch.arange(R)
    block = p[rows, b.squeeze(1)]                                               # [R, DRAW_BLOCK]
    inner = block.to(torch.float64).cumsum_(dim=1).add_(before)
    j = torch.searchsorted(inner, target, right=True).squeeze(1)
    # summation order can leave the target a rounding above the block's end: its last positive id
    last = torch.where(block > 0, torch.arange(DRAW_BLOCK), -1).amax(dim=1)
    j = torch.where(j >= DRAW_BLOCK, last, j)
    return b.squeeze(1) * DRAW_BLOCK + j


def _rows_where(mask: torch.Tensor) -> torch.Tensor | None:
    """Indices of the true rows of `mask`, or None when all are true."""
    return None if bool(mask.all()) else mask.nonzero().squeeze(1)


def _on_rows(x: torch.Tensor, rows: torch.Tensor | None, fn: Callable[..., None],
             *row_args: torch.Tensor | None) -> None:
    """Run `fn(x[rows], *row_args[rows])` in place on the chosen rows (all when None)."""
    if rows is None:
        fn(x, *row_args)
        return
    part = x[rows]
    fn(part, *(a[rows] if a is not None else None for a in row_args))
    x[rows] = part


class Sampler:
    """Chooses the next token of every row of a batch; see the module docstring.

    `seed` seeds the generator shared by rows without their own (None: seeded from
    system entropy). `kernels`: loom's compiled kernel module, whose `sample_rows` then
    runs step 5 and the draw (the same stages in a few passes over each row; see
    loom_kernels_sample.h); without it, torch ops do.
    """

    def __init__(self, seed: int | None = None, kernels=None):
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.kernels = kernels if kernels is not None and hasattr(kernels, "sample_rows") else None
        self._raw: torch.Tensor | None = None   # the raw logits of the rows that ask for logprobs

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, raw: torch.Tensor | None = None) -> SamplerOutput:
        """Sample one token per row of `logits` [S, V]; float32 logits are modified in place.
        raw: the same rows before a grammar masked them (the logprobs are of these), if it did."""
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits have shape {tuple(logits.shape)}, expected ({batch.num_rows}, V)")
        if logits.dtype != torch.float32:
            logits = logits.float()

        lp_rows = None
        if batch.max_num_logprobs is None:
            raw = None
        else:   # the raw logits of the rows that asked: the stages below modify logits
            lp_rows = torch.tensor([k is not None for k in batch.num_logprobs])
            raw = self._raw_copy(logits if raw is None else raw.float(), lp_rows.nonzero().squeeze(1))

        if batch.allowed_token_ids is not None:
            apply_allowed(logits, batch.allowed_token_ids)
        if batch.banned_token_ids is not None:
            apply_banned(logits, batch.banned_token_ids)
        if batch.logit_bias is not None:
            apply_logit_bias(logits, batch.logit_bias)
        if not batch.no_penalties:
            self._penalise(logits, batch)

        if batch.all_greedy:
            token_ids = argmax_rows(logits)
        else:
            token_ids = torch.empty(batch.num_rows, dtype=torch.int64)
            if not batch.all_random:
                token_ids[batch.greedy] = argmax_rows(logits[batch.greedy])
            random_rows = _rows_where(~batch.greedy)
            if random_rows is None:
                token_ids[:] = self._sample(logits, batch, torch.arange(batch.num_rows))
            else:
                token_ids[random_rows] = self._sample(logits[random_rows], batch, random_rows)

        if raw is None:
            return SamplerOutput(token_ids, None, None, None)
        return self._logprobs(raw, lp_rows, token_ids, batch.max_num_logprobs)

    @staticmethod
    def _penalise(logits: torch.Tensor, batch: SamplingBatch) -> None:
        """Apply the penalties on the rows that have any, leaving the others untouched."""
        on = ((batch.presence_penalty != 0) | (batch.frequency_penalty != 0)
              | (batch.repetition_penalty != 1))
        rows = _rows_where(on)
        if rows is None:
            apply_penalties(logits, batch.prompt_token_ids, batch.output_token_ids,
                            batch.presence_penalty, batch.frequency_penalty, batch.repetition_penalty)
            return
        picked = rows.tolist()
        prompt = batch.prompt_token_ids
        part = logits[rows]
        apply_penalties(part, None if prompt is None else [prompt[i] for i in picked],
                        [batch.output_token_ids[i] for i in picked], batch.presence_penalty[rows],
                        batch.frequency_penalty[rows], batch.repetition_penalty[rows])
        logits[rows] = part

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor) -> torch.Tensor:
        """Draw one token for each row of `logits`, which are the batch's `rows`."""
        u = self._uniforms([batch.generators[i] for i in rows.tolist()])
        if self._native(logits):
            return self.kernels.sample_rows(logits, *self._filters(batch, rows), u, True)
        return draw(self.probs(logits, batch, rows), u)

    def distribution(self, logits: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor) -> torch.Tensor:
        """`probs` normalised to sum to 1 (after the filters), from the kernels where they run
        (`logits` modified in place)."""
        if self._native(logits):
            self.kernels.sample_rows(logits, *self._filters(batch, rows), torch.zeros(len(rows), dtype=torch.float64),
                                     False)
            return logits
        probs = self.probs(logits, batch, rows)
        return probs.div_(probs.sum(dim=1, keepdim=True))

    def _native(self, logits: torch.Tensor) -> bool:
        return (self.kernels is not None and logits.dtype == torch.float32 and logits.dim() == 2
                and logits.stride(1) == 1)

    @staticmethod
    def _filters(batch: SamplingBatch, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The rows' temperature, top_k, top_p, min_p, as the kernel takes them."""
        return tuple(getattr(batch, name)[rows].contiguous() for name in ("temperature", "top_k", "top_p", "min_p"))

    @staticmethod
    def probs(logits: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor) -> torch.Tensor:
        """The distribution each non-greedy row draws from (step 5 of the module doc, without the
        draw); `logits` are the batch's `rows`, modified in place."""
        logits.div_(batch.temperature[rows].unsqueeze(1))
        # extreme parameters (a repetition penalty of 5e-324 is 0 in float32) can leave +inf or
        # NaN here; +inf is the largest finite logit and NaN none, so softmax stays a distribution
        torch.nan_to_num_(logits, nan=-math.inf, posinf=torch.finfo(logits.dtype).max)

        if not batch.no_top_k:
            top_k = batch.top_k[rows]
            if bool((on := top_k > 0).any()):
                _on_rows(logits, _rows_where(on), apply_top_k_top_p, top_k, None)
        if not batch.no_min_p:
            min_p = batch.min_p[rows]
            if bool((on := min_p > 0).any()):
                _on_rows(logits, _rows_where(on), apply_min_p, min_p)
        if not batch.no_top_p:
            top_p = batch.top_p[rows]
            if bool((on := top_p < 1).any()):
                _on_rows(logits, _rows_where(on), _apply_top_p, top_p)
        return logits.softmax(dim=1)

    def _uniforms(self, generators: list[torch.Generator | None]) -> torch.Tensor:
        """U[0, 1) float64 [R]: row i from generators[i], or from the shared generator."""
        u = torch.empty(len(generators), dtype=torch.float64)
        shared = [i for i, g in enumerate(generators) if g is None]
        for i, g in enumerate(generators):
            if g is not None:
                u[i] = torch.rand(1, generator=g, dtype=torch.float64)
        if shared:
            u[shared] = torch.rand(len(shared), generator=self.generator, dtype=torch.float64)
        return u

    def _raw_copy(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """logits[rows], into a buffer the sampler keeps: 32 of Gemma 3's rows are 33.5 MB, which a
        fresh tensor maps page by page each step (~10 ms)."""
        shape = (len(rows), logits.shape[1])
        if self._raw is None or self._raw.shape[0] < shape[0] or self._raw.shape[1] != shape[1]:
            self._raw = torch.empty(shape, dtype=logits.dtype)
        return torch.index_select(logits, 0, rows, out=self._raw[:shape[0]])

    def _logprobs(self, raw: torch.Tensor, lp_rows: torch.Tensor, token_ids: torch.Tensor, k: int) -> SamplerOutput:
        """The logprobs and ranks of the rows `lp_rows` that asked (raw logits `raw`): NaN, -1 and
        0 elsewhere."""
        rows = token_ids.shape[0]
        chosen = torch.full((rows,), float("nan"))
        top_lp = torch.full((rows, k), float("nan"))
        top_ids = torch.full((rows, k), -1, dtype=torch.int64)
        ranks = torch.zeros(rows, dtype=torch.int64)
        chosen[lp_rows], asked_ranks, ids, values = self.token_logprobs(raw, token_ids[lp_rows], k, ranks=True)
        ranks[lp_rows] = torch.tensor(asked_ranks, dtype=torch.int64)
        if k > 0:
            top_lp[lp_rows], top_ids[lp_rows] = values, ids
        return SamplerOutput(token_ids, chosen, top_lp, top_ids, ranks)

    def token_logprobs(self, logits: torch.Tensor, targets: torch.Tensor, k: int, ranks: bool = False):
        """Log-softmax of raw `logits` [r, V] at `targets` [r], the targets' ranks (a list, when
        asked: 1 + the number of logits above) and the k most probable (ids [r, k], logprobs
        [r, k]). On the kernels from each row's log-sum-exp, with no [r, V] log-softmax or
        comparison (32 of Gemma 3's rows: ~30 ms in torch); sampled tokens and prompt tokens alike."""
        if self._native(logits):
            lse, ids, rank = self.kernels.logprob_rows(logits, k, targets.contiguous() if ranks else None)
            lse = lse.unsqueeze(1)
            chosen = (logits.gather(1, targets.unsqueeze(1)) - lse).squeeze(1)
            return chosen, rank.tolist() if ranks else None, ids, logits.gather(1, ids) - lse
        lp = logits.log_softmax(dim=1)
        chosen = lp.gather(1, targets.unsqueeze(1))
        values, ids = lp.topk(k, dim=1) if k else (lp[:, :0], lp[:, :0].long())
        return chosen.squeeze(1), ((lp > chosen).sum(dim=1) + 1).tolist() if ranks else None, ids, values
