"""Builds two lm-eval tasks from ../shared/data, as local JSON files and task YAMLs (nothing is
fetched from a hub when lm-eval runs):

  loom_shakespeare_cloze   multiple_choice (loglikelihood): four lines of a play, then which of
                           four candidate lines comes next (the true one, three from elsewhere)
  loom_gsm8k_cot           generate_until: a GSM8K problem with three worked examples before it;
                           exact match on the number after "####"

Usage: python benchmarks/lm_eval/make_tasks.py OUT_DIR [--docs N]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"

CLOZE_YAML = """task: loom_shakespeare_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}\\n"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
# lm-eval moves the context's trailing newline into each continuation: "\\n" + the line, as the
# play's text has it (the default " " delimiter would score a line starting with a space)
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 2.0
"""

GSM8K_YAML = """task: loom_gsm8k_cot
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\nQuestion:", "Question:"]
  max_gen_toks: 160
  do_sample: false
  temperature: 0.0
filter_list:
  - name: strict-match
    filter:
      - function: regex
        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore: [",", "\\\\$", "(?s).*#### ", "\\\\.$"]
metadata:
  version: 1.0
"""


def cloze_docs(n: int, rng: random.Random) -> list[dict]:
    lines = [ln.strip() for ln in (SHARED / "text" / "shakespeare.txt").read_text().splitlines()]
    lines = [ln for ln in lines if ln]
    spoken = [i for i in range(4, len(lines)) if len(lines[i].split()) >= 5 and not lines[i].endswith(":")]
    docs = []
    for i in rng.sample(spoken, n):
        others = rng.sample([j for j in spoken if abs(j - i) > 10], 3)
        choices = [lines[i]] + [lines[j] for j in others]
        rng.shuffle(choices)
        docs.append({"context": "\n".join(lines[i - 4:i]), "choices": choices,
                     "label": choices.index(lines[i])})
    return docs


def gsm8k_docs(n: int) -> list[dict]:
    rows = [json.loads(ln) for ln in (SHARED / "gsm8k" / "train.jsonl").read_text().splitlines() if ln.strip()]
    shots = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in rows[:3])
    docs = []
    for r in rows[3:3 + n]:
        answer = re.search(r"####\s*(.+)$", r["answer"]).group(1).strip()
        docs.append({"prompt": f"{shots}Question: {r['question']}\nAnswer:", "answer": answer})
    return docs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--docs", type=int, default=100)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for name, docs, yaml in (("loom_shakespeare_cloze", cloze_docs(args.docs, rng), CLOZE_YAML),
                             ("loom_gsm8k_cot", gsm8k_docs(args.docs), GSM8K_YAML)):
        data = (args.out / f"{name}.jsonl").resolve()
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (args.out / f"{name}.yaml").write_text(yaml.format(data=data))
    print(f"tasks written to {args.out}")


if __name__ == "__main__":
    main()
