"""Aggregators: merge the children of one fanned-out request into one answer.

One interface, `Aggregator.aggregate(children) -> AggregateResult`, and one optional hook,
`should_stop(children)`, which the fan-out asks after each step (early stopping; the default
waits for every child). Children are `CompletionOutput`s; an aborted child (finish_reason
"abort") never wins or votes. A registry maps names to factories:

    name               chooses                                                  stops early
    best_of            highest score: mean or total token logprob, or a scorer  no
    majority           most frequent extracted answer (self-consistency)        no
    weighted_majority  answer with most exp(mean logprob) weight, after pruning   no
                       paths far less probable than the best (RPC-style)
    first_finish       the first child to finish                                 at the first finish
    short_m_at_k       majority over the first m children to finish              at the m-th finish

"First to finish" is measured in tokens: children forked together decode one token per step
in lockstep, so the one with the fewest tokens finished first (ties: lowest index).

Answer extractors (`EXTRACTORS`: regex, gsm8k, last_number, choice) turn a completion's text
into a comparable answer string, or None when it holds no answer.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from loom.contracts import FanOutOptions
from loom.errors import InvalidRequestError
from loom.outputs import CompletionOutput, FinalOutputs

# -- answer extractors -------------------------------------------------------------------------------

Extractor = Callable[[str], "str | None"]
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def normalize_number(text: str) -> str | None:
    """'1,234.50' -> '1234.5', '$72' -> '72', '72.0' -> '72'; None if not a number."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = float(cleaned)
    except ValueError:
        return None
    if not math.isfinite(value):
        return None
    return str(int(value)) if value == int(value) else repr(value)


# Extractors are small frozen objects, not closures: a fan-out's options travel pickled to the
# engine process.


@dataclass(frozen=True)
class RegexExtractor:
    """The last match of `pattern` in the text, its `group` (0: the whole match), stripped."""

    pattern: str
    group: int = 1
    flags: int = 0

    def __call__(self, text: str) -> str | None:
        compiled = re.compile(self.pattern, self.flags)   # re caches compiled patterns
        matches = list(compiled.finditer(text))
        if not matches:
            return None
        value = matches[-1].group(self.group if compiled.groups >= self.group else 0)
        return value.strip() if value is not None else None


@dataclass(frozen=True)
class LastNumberExtractor:
    """The last number in the text, normalised (`normalize_number`)."""

    def __call__(self, text: str) -> str | None:
        found = _NUMBER.findall(text)
        return normalize_number(found[-1]) if found else None


@dataclass(frozen=True)
class Gsm8kExtractor:
    """GSM8K's answer line ``#### N`` (normalised); without one, the last number in the text
    unless `fallback_last_number` is False."""

    fallback_last_number: bool = True

    def __call__(self, text: str) -> str | None:
        marked = re.findall(r"####\s*(-?\$?\d[\d,]*(?:\.\d+)?)", text)
        if marked:
            return normalize_number(marked[-1])
        return LastNumberExtractor()(text) if self.fallback_last_number else None


@dataclass(frozen=True)
class ChoiceExtractor:
    """A multiple-choice letter: 'answer is (B)' / 'Answer: B' first, else the last standalone
    letter among `letters` in the text."""

    letters: str = "ABCDE"

    def __call__(self, text: str) -> str | None:
        stated = re.compile(rf"answer\s*(?:is|:)?\s*\(?([{self.letters}])\)?\b", re.IGNORECASE)
        alone = re.compile(rf"(?<![A-Za-z])\(?([{self.letters}])\)?(?![A-Za-z])")
        found = stated.findall(text) or alone.findall(text)
        return found[-1].upper() if found else None


def regex_extractor(pattern: str, group: int = 1, flags: int = 0) -> Extractor:
    return RegexExtractor(pattern, group, flags)


def last_number_extractor() -> Extractor:
    return LastNumberExtractor()


def gsm8k_extractor(fallback_last_number: bool = True) -> Extractor:
    return Gsm8kExtractor(fallback_last_number)


def choice_extractor(letters: str = "ABCDE") -> Extractor:
    return ChoiceExtractor(letters)


EXTRACTORS: dict[str, Callable[..., Extractor]] = {
    "regex": regex_extractor,
    "gsm8k": gsm8k_extractor,
    "last_number": last_number_extractor,
    "choice": choice_extractor,
}


def create_extractor(spec: str | Extractor, **options: Any) -> Extractor:
    """An extractor by registry name (with its options), or `spec` itself when callable."""
    if callable(spec):
        return spec
    factory = EXTRACTORS.get(spec)
    if factory is None:
        raise InvalidRequestError(f"unknown answer extractor '{spec}' (known: {', '.join(EXTRACTORS)})")
    return factory(**options)


# -- the interface ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AggregateResult:
    """What an aggregator chose.

    index: position in the children list of the chosen child (None: no child qualified);
    answer: the chosen answer (extracted, or the chosen child's text for best-of);
    scores: one per child (None where it did not take part);
    votes: answer -> votes (weighted for weighted voting); empty for best-of.
    """

    index: int | None
    answer: str | None
    scores: list[float | None] = field(default_factory=list)
    votes: dict[str, float] = field(default_factory=dict)


class Aggregator(ABC):
    """Merges children into one answer; may also end their generation early."""

    name: str = ""

    def should_stop(self, children: Sequence[CompletionOutput]) -> bool:
        """True once enough children finished; the unfinished ones are then aborted."""
        return False

    @abstractmethod
    def aggregate(self, children: Sequence[CompletionOutput]) -> AggregateResult:
        """The choice among `children` (aborted or unfinished ones never win)."""


def finished(c: CompletionOutput) -> bool:
    """A child that ended by itself (stop or length), not aborted and not running."""
    return c.finish_reason is not None and c.finish_reason != "abort"


def mean_logprob(c: CompletionOutput) -> float | None:
    if c.cumulative_logprob is None:
        return None
    return c.cumulative_logprob / max(1, len(c.token_ids))


def _vote(children: Sequence[CompletionOutput], extract: Extractor, candidates: Sequence[int],
          weights: Sequence[float] | None = None) -> AggregateResult:
    """Sums the weight (1 each by default) of every candidate's answer; the best answer wins,
    ties going to the answer of the child with the fewest tokens, then the lowest index. The
    chosen child is that answer's shortest child."""
    answers: dict[int, str] = {}
    for i in candidates:
        answer = extract(children[i].text)
        if answer is not None:
            answers[i] = answer
    votes: dict[str, float] = {}
    for i, answer in answers.items():
        votes[answer] = votes.get(answer, 0.0) + (1.0 if weights is None else weights[i])
    scores: list[float | None] = [None] * len(children)
    for i in answers:
        scores[i] = 1.0 if weights is None else weights[i]
    if not votes:
        return AggregateResult(None, None, scores, votes)
    order = sorted(answers, key=lambda i: (-votes[answers[i]], len(children[i].token_ids), i))
    best = order[0]
    return AggregateResult(best, answers[best], scores, votes)


def _by_finish(children: Sequence[CompletionOutput]) -> list[int]:
    """Indices of the finished children, first to finish first (fewest tokens, then index)."""
    return sorted((i for i, c in enumerate(children) if finished(c)), key=lambda i: (len(children[i].token_ids), i))


# -- aggregators ------------------------------------------------------------------------------------


class BestOfN(Aggregator):
    """The finished child with the highest score: "mean" token logprob (default), "total"
    (cumulative) logprob, or `scorer(child) -> float` (a reward model, a verifier...)."""

    name = "best_of"

    def __init__(self, score: str = "mean", scorer: Callable[[CompletionOutput], float] | None = None):
        if scorer is None and score not in ("mean", "total"):
            raise InvalidRequestError(f"best_of score must be 'mean' or 'total', got {score!r}")
        self.score, self.scorer = score, scorer

    def _score(self, c: CompletionOutput) -> float | None:
        if self.scorer is not None:
            return float(self.scorer(c))
        return mean_logprob(c) if self.score == "mean" else c.cumulative_logprob

    def aggregate(self, children: Sequence[CompletionOutput]) -> AggregateResult:
        scores = [self._score(c) if finished(c) else None for c in children]
        ranked = [i for i in range(len(children)) if scores[i] is not None]
        if not ranked:
            return AggregateResult(None, None, scores)
        best = max(ranked, key=lambda i: (scores[i], -i))
        return AggregateResult(best, children[best].text, scores)


class MajorityVote(Aggregator):
    """Self-consistency (Wang et al., 2023): the most frequent extracted answer among the
    finished children."""

    name = "majority"

    def __init__(self, extract: str | Extractor = "last_number", **extract_options: Any):
        self.extract = create_extractor(extract, **extract_options)

    def aggregate(self, children: Sequence[CompletionOutput]) -> AggregateResult:
        return _vote(children, self.extract, [i for i, c in enumerate(children) if finished(c)])


class WeightedMajorityVote(Aggregator):
    """Probability-weighted voting with pruning, in the spirit of RPC (perplexity consistency
    plus reasoning pruning): each finished path weighs w = exp(mean token logprob); paths with
    w < prune_ratio * max(w) are dropped; the answer with the largest total weight wins."""

    name = "weighted_majority"

    def __init__(self, extract: str | Extractor = "last_number", prune_ratio: float = 0.5, **extract_options: Any):
        if not 0.0 <= prune_ratio <= 1.0:
            raise InvalidRequestError(f"prune_ratio must be in [0, 1], got {prune_ratio!r}")
        self.extract = create_extractor(extract, **extract_options)
        self.prune_ratio = prune_ratio

    def aggregate(self, children: Sequence[CompletionOutput]) -> AggregateResult:
        weights = [math.exp(m) if finished(c) and (m := mean_logprob(c)) is not None else 0.0 for c in children]
        top = max(weights, default=0.0)
        kept = [i for i, w in enumerate(weights) if w > 0.0 and w >= self.prune_ratio * top]
        return _vote(children, self.extract, kept, weights)


class FirstFinish(Aggregator):
    """Stops at the first child to finish and returns it; the others are aborted."""

    name = "first_finish"

    def should_stop(self, children: Sequence[CompletionOutput]) -> bool:
        return any(finished(c) for c in children)

    def aggregate(self, children: Sequence[CompletionOutput]) -> AggregateResult:
        order = _by_finish(children)
        if not order:
            return AggregateResult(None, None, [None] * len(children))
        scores: list[float | None] = [None] * len(children)
        scores[order[0]] = 1.0
        return AggregateResult(order[0], children[order[0]].text, scores)


class ShortMAtK(Aggregator):
    """short-m@k (Hassid et al., 2025): of k children, stop once m have finished and take the
    majority answer among those m (ties: the shortest); the rest are aborted."""

    name = "short_m_at_k"

    def __init__(self, m: int = 3, extract: str | Extractor = "last_number", **extract_options: Any):
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise InvalidRequestError(f"m must be an integer >= 1, got {m!r}")
        self.m = m
        self.extract = create_extractor(extract, **extract_options)

    def should_stop(self, children: Sequence[CompletionOutput]) -> bool:
        return sum(finished(c) for c in children) >= min(self.m, len(children))

    def aggregate(self, children: Sequence[CompletionOutput]) -> AggregateResult:
        return _vote(children, self.extract, _by_finish(children)[:self.m])


AGGREGATORS: dict[str, Callable[..., Aggregator]] = {
    cls.name: cls for cls in (BestOfN, MajorityVote, WeightedMajorityVote, FirstFinish, ShortMAtK)
}


def register_aggregator(name: str, factory: Callable[..., Aggregator]) -> None:
    """Adds an aggregator under `name` (a new technique is one class and this call)."""
    AGGREGATORS[name] = factory


def create_aggregator(name: str, **options: Any) -> Aggregator:
    """The aggregator registered as `name`, built with `options`; InvalidRequestError if unknown
    or if an option is not one it takes."""
    factory = AGGREGATORS.get(name)
    if factory is None:
        raise InvalidRequestError(f"unknown aggregator '{name}' (known: {', '.join(AGGREGATORS)})")
    try:
        return factory(**options)
    except TypeError as e:
        raise InvalidRequestError(f"aggregator '{name}': {e}") from None


# -- running prompts through an aggregator --------------------------------------------------------------


@dataclass(frozen=True)
class AggregatedOutput:
    """One prompt's fanned-out output (every child, aborted ones included) and the choice."""

    output: Any  # RequestOutput
    result: AggregateResult

    @property
    def answer(self) -> str | None:
        return self.result.answer


def sample_and_aggregate(llm_or_engine: Any, prompts: Sequence[Any], params: Any,
                         aggregator: Aggregator | str, **options: Any) -> list[AggregatedOutput]:
    """Runs each prompt with `params` (n children, or best_of) on an `LLM` or `Engine`, lets
    `aggregator` stop the children early where it does, and aggregates each prompt's children.
    Results come back in prompt order."""

    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    agg = create_aggregator(aggregator, **options) if isinstance(aggregator, str) else aggregator
    fan = FanOutOptions(stop_policy=agg)
    ids: list[str] = []
    try:
        for prompt in prompts:
            ids.append(engine.add_request(prompt, params, fanout=fan))
    except BaseException:
        for rid in ids:
            engine.abort(rid)
        raise
    final: dict[str, Any] = {}
    gather = FinalOutputs()
    while len(final) < len(ids) and engine.has_unfinished_requests():
        for out in gather.add_all(engine.step()):
            if out.request_id in ids:
                final[out.request_id] = out
    return [AggregatedOutput(final[rid], agg.aggregate(final[rid].outputs)) for rid in ids]
