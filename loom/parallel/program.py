"""Fork/join generation threads (APR-style spawn and join) over one engine.

A `Thread` is one engine request. From a running generation, `spawn` forks k child threads,
each continuing the parent's context with its own appended text; they decode side by side in
the engine's batches, sharing the parent's KV blocks. `join` waits for them and appends their
results into the parent's context, and the parent goes on from there:

    parent   | prompt ... reasoning ... |--- paused ---| joined results | more reasoning ...
    child 1              fork + " Case A:" -> | child 1's tokens |      |
    child 2              fork + " Case B:" -> | child 2's tokens |  --> rendered, appended

Rules:

* a thread is paused (KV kept, nothing computed) after `run(until=...)` or `pause()`; only a
  paused thread can spawn, and `join` resumes it;
* a child's prompt is the parent's whole context plus its appended text, so a child's `text` is
  only what it generated; its `prefix` is the appended text;
* joined text becomes part of the parent's output (forced tokens; see `Engine.resume`).

Example (docs/parallel.md has more)::

    prog = Program(llm)
    main = prog.start("Q: is 91 prime? Let's check two divisors.\\n", SamplingParams(temperature=0, max_tokens=64))
    main.run(max_new_tokens=8)                       # generate a little, then pause
    kids = main.spawn([" Try 7:", " Try 13:"], SamplingParams(temperature=0, max_tokens=16))
    main.join(kids)                                  # children run together, results appended
    print(main.wait())
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from loom.errors import InvalidRequestError
from loom.outputs import RequestOutput
from loom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from loom.engine.engine import Engine


class Program:
    """Threads over one `Engine` (or `LLM`); all threads of a program step together."""

    def __init__(self, llm_or_engine: Any):
        self.engine: Engine = getattr(llm_or_engine, "engine", llm_or_engine)
        self.threads: dict[str, Thread] = {}

    def start(self, prompt: Any, params: SamplingParams | None = None) -> Thread:
        """A new running thread for `prompt` (one completion: n must be 1)."""
        params = params or SamplingParams()
        if params.effective_best_of != 1:
            raise InvalidRequestError("a thread is one completion: use n=1 (spawn makes more)")
        if params.kv_eviction is None:   # threads fork: the engine's default KV eviction does not apply
            params = params.clone(kv_eviction={"policy": "none"})
        rid = self.engine.add_request(prompt, params)
        return self._adopt(rid, None, "")

    def step(self) -> None:
        """One engine step; threads take their new outputs."""
        for out in self.engine.step():
            thread = self.threads.get(out.request_id)
            if thread is not None:
                thread.output = out

    def drive(self, threads: Sequence[Thread], done: Callable[[], bool]) -> None:
        """Steps the engine until `done()` or until none of `threads` can move (all finished
        or paused)."""
        while not done() and any(t.running for t in threads):
            self.step()

    def _adopt(self, rid: str, parent: Thread | None, prefix: str) -> Thread:
        thread = Thread(self, rid, parent, prefix)
        self.threads[rid] = thread
        return thread


class Thread:
    """One generation of a `Program`: `text` is what it generated so far (plus joined text)."""

    def __init__(self, program: Program, request_id: str, parent: Thread | None, prefix: str):
        self.program, self.request_id, self.parent, self.prefix = program, request_id, parent, prefix
        self.output: RequestOutput | None = None
        self.paused = False

    @property
    def text(self) -> str:
        return self.output.outputs[0].text if self.output else ""

    @property
    def token_ids(self) -> list[int]:
        return list(self.output.outputs[0].token_ids) if self.output else []

    @property
    def finished(self) -> bool:
        return self.output is not None and self.output.finished

    @property
    def running(self) -> bool:
        return not self.finished and not self.paused

    def run(self, until: str | None = None, max_new_tokens: int | None = None) -> Thread:
        """Generates until the thread finishes, its new text contains `until`, or it made
        `max_new_tokens` more tokens; then pauses it (unless finished). Returns self."""
        if self.paused:
            self.resume()
        start_text, start_tokens = len(self.text), len(self.token_ids)

        def reached() -> bool:
            if until is not None and until in self.text[start_text:]:
                return True
            return max_new_tokens is not None and len(self.token_ids) - start_tokens >= max_new_tokens

        # speculative steps stop where one-token steps would: at max_new_tokens, and (drafting
        # nothing) at the token that completes `until`
        engine = self.program.engine
        engine.limit_drafts(self.request_id, 0 if until is not None else max_new_tokens)
        try:
            self.program.drive([self], lambda: self.finished or reached())
        finally:
            if not self.finished:
                engine.limit_drafts(self.request_id, None)
        if not self.finished:
            self.pause()
        return self

    def pause(self) -> None:
        if not self.finished:
            self.program.engine.pause(self.request_id)
            self.paused = True

    def resume(self, text: str = "") -> None:
        """Runs again, after appending `text` (tokenized without special tokens) to the context."""
        ids = self.program.engine.tokenizer.encode(text, add_special_tokens=False) if text else []
        self.program.engine.resume(self.request_id, ids)
        self.paused = False

    def spawn(self, texts: Sequence[str], params: SamplingParams | None = None) -> list[Thread]:
        """k child threads, child i continuing this (paused) thread's context + texts[i]. They
        share this thread's KV blocks. `params` default to this thread's; seeded params give
        child i (from 0) the seed + i + 1."""
        if not self.paused:
            raise InvalidRequestError("spawn needs a paused thread: call run(...) or pause() first")
        tok = self.program.engine.tokenizer
        appends = [tok.encode(t, add_special_tokens=False) for t in texts]
        ids = self.program.engine.fork(self.request_id, len(appends), appends, params)
        return [self.program._adopt(rid, self, text) for rid, text in zip(ids, texts)]

    def join(self, children: Sequence[Thread], template: str = "{prefix}{text}", sep: str = "\n",
             before: str = "", after: str = "") -> str:
        """Runs `children` to the end, appends ``before + sep.join(template per child) + after``
        to this thread's context and resumes it; returns the joined text. Template fields:
        prefix (the child's appended text), text (what it generated), index."""
        self.program.drive(children, lambda: all(c.finished for c in children))
        for child in children:
            if not child.finished:  # paused by its owner: end it so its blocks go
                ended = self.program.engine.abort(child.request_id)
                child.output = ended[-1] if ended else child.output
        parts = [template.format(prefix=c.prefix, text=c.text, index=i) for i, c in enumerate(children)]
        joined = before + sep.join(parts) + after
        self.resume(joined)
        return joined

    def wait(self) -> str:
        """Runs this thread to its end; returns its text."""
        if self.paused:
            self.resume()
        self.program.drive([self], lambda: self.finished)
        return self.text
