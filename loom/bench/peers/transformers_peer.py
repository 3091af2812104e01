"""Hugging Face transformers on the same GGUF file (dequantized to float32 on load).

Single requests use `generate()` greedily; concurrent requests use one batched `generate()` with
left padding, which is how transformers users batch. All requests of a batch start and stop
together, so their TTFT and time per token are the batch's. Prefill is one forward pass over
the prompt that keeps only the last position's logits, as `generate()` does.
"""

from __future__ import annotations

from typing import Sequence

import torch
import transformers
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

from loom.bench.peers.base import Peer, RequestTiming, RunTiming, now


class _StepClock(StoppingCriteria):
    """A stopping criterion that never stops; it records when each new token exists."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.times.append(now())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class TransformersPeer(Peer):
    def load(self) -> None:
        torch.set_num_threads(self.threads)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path.parent, gguf_file=self.model_path.name,
                                                          dtype=torch.float32).eval()
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.model.config.eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        self.pad_id = gen.pad_token_id if gen.pad_token_id is not None else (eos if eos is not None else 0)
        self.info.update(version=transformers.__version__, torch=torch.__version__, dtype="float32")
        self.notes.append("float32 (GGUF dequantized on load); concurrency = one batched generate() with left "
                          "padding, so every request of a batch shares its TTFT and time per token")

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> RunTiming:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[row, width - len(p):] = 1
        clock = _StepClock()
        start = now()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, pad_token_id=self.pad_id,
                                      stopping_criteria=StoppingCriteriaList([clock]))
        wall = now() - start
        produced = int(out.shape[1] - width)
        if not clock.times or produced < 1:
            raise RuntimeError("generate() produced no tokens")
        first, last = clock.times[0], clock.times[-1]
        tpot = (last - first) / (produced - 1) if produced > 1 else None
        timing = RequestTiming(ttft=first - start, tpot=tpot, output_tokens=produced,
                               token_times=tuple(t - start for t in clock.times[:produced]))
        return RunTiming(wall, [timing] * len(prompts))

    def prefill(self, prompt: Sequence[int]) -> float:
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        with torch.inference_mode():
            start = now()
            logits = self.model(input_ids=ids, use_cache=True, logits_to_keep=1).logits
            int(logits[0, -1].argmax())
            return now() - start
