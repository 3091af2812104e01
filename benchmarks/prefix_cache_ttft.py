"""Time to first token of a 1,500-token Spec-Bench prompt with a cold cache and with its prefix cached.

Run from the repository root: .venv/bin/python benchmarks/prefix_cache_ttft.py
"""
import json
import time
from loom import LLM, SamplingParams
qs = [json.loads(l) for l in open("../shared/data/spec_bench/question.jsonl")]
llm = LLM("smollm2-135m")
tok = llm.get_tokenizer()
text = "\n\n".join(t for q in qs if q["category"] == "summarization" for t in q["turns"])
ids = tok.encode(text)[:1500]
sp = SamplingParams(max_tokens=1, temperature=0)
def ttft(prompt_ids):
    t = time.perf_counter()
    out = llm.generate(prompt_token_ids=[prompt_ids], sampling_params=sp, use_tqdm=False)[0]
    return time.perf_counter() - t, out.num_cached_tokens
cold, c0 = ttft(ids)
warm, c1 = ttft(ids)
# same prefix, new last sentence: the realistic multi-turn case
cold2, _ = ttft(ids[:1400] + tok.encode(" A different ending for this document."))
print(f"prompt {len(ids)} tokens: cold TTFT {cold*1000:.0f} ms (cached {c0}), "
      f"cached TTFT {warm*1000:.0f} ms (cached {c1} tokens), ratio {cold/warm:.1f}x; "
      f"shared 1400-token prefix + new tail: {cold2*1000:.0f} ms")
