"""Hugging Face-format weights from a GGUF, for server peers that load only those (vLLM's CPU backend).

transformers dequantizes the GGUF; the model is rebuilt from its config without the
quantization config and saved as bfloat16 safetensors with the GGUF's tokenizer and chat
template (split as the model's own tokenizer splits where transformers' conversion does not:
`loom.loader.tokenizer.DIGIT_FIRST`), under ``<loom cache>/peers/hf/<gguf stem>``. The directory is written under a
temporary name and renamed into place, so a killed export never leaves a half-written model
that a later run would take.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from loom.bench.settings import BenchError
from loom.loader.registry import cache_dir

DONE_MARK = "loom-export.done"
EXPORT_FORMAT = "2"   # a done mark of another format is exported again (2: the digit-first split)


def export_dir(gguf: Path) -> Path:
    return cache_dir() / "peers" / "hf" / gguf.stem


def export_hf(gguf: Path, out: Path | None = None, log=lambda msg: print(msg, file=sys.stderr)) -> Path:
    """The exported directory of `gguf` (made on the first call)."""
    out = out or export_dir(gguf)
    mark = out / DONE_MARK
    if mark.is_file() and f"format {EXPORT_FORMAT}" in mark.read_text().splitlines():
        return out
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise BenchError("exporting Hugging Face weights needs transformers and gguf (pip install transformers gguf)") \
            from None
    log(f"exporting {gguf.name} to Hugging Face format (once) in {out}")
    try:
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        missing = model.load_state_dict(quantized.state_dict(), strict=False).missing_keys
        tied = {k for k in missing if "lm_head" in k and getattr(config, "tie_word_embeddings", False)}
        if set(missing) - tied:
            raise BenchError(f"exporting {gguf.name}: weights missing after conversion: {sorted(missing)[:5]}")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        _split_as_the_model(tokenizer, gguf)
    except (OSError, ValueError, KeyError) as e:
        raise BenchError(f"cannot export {gguf.name} with transformers: {e}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.to(torch.bfloat16).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / DONE_MARK).write_text(f"{gguf}\nformat {EXPORT_FORMAT}\n")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out


def _split_as_the_model(tokenizer, gguf: Path) -> None:
    """The digit-first split of the vocabularies whose own tokenizer has it (SmolLM2's)."""
    from tokenizers import pre_tokenizers

    from loom.loader.gguf import GGUFFile
    from loom.loader.tokenizer import DIGIT_FIRST

    if str(GGUFFile.open(gguf).metadata.get("tokenizer.ggml.pre", "")) in DIGIT_FIRST:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
