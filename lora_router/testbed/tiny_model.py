"""A tiny Qwen2 model and rank-1 LoRA adapters, built locally and cached (no download).

Nothing can be fetched from a model hub here, so the tier builds its own model: a Qwen2 config
with random weights, a byte-level BPE tokenizer trained on a few lines with `tokenizers`, and
rank-1 `peft` adapters (`init_lora_weights=False`, so each one changes the output). The result
is cached under `~/.cache/lora-router/` (or `$LORA_ROUTER_CACHE`) in a directory named by a hash
of every parameter below and of this file, so a change here builds a new model and never
reuses a stale one. A build goes to a temporary directory renamed into place at the end, so an
interrupted build leaves nothing that looks finished.

Run it directly to build (or find) the model and print its directory:
`python -m lora_router.testbed.tiny_model`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TinyModel:
    """The builder's parameters; every one goes into the cache key."""

    # head_dim = hidden_size / num_attention_heads must be 64: the CPU attention kernels
    # reject 16.
    hidden_size: int = 128
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    max_position_embeddings: int = 4096
    vocab_size: int = 512  # the trained tokenizer's size; embeddings are sized to it
    adapters: int = 3  # distinct rank-1 adapters, adapter-0 ...
    seed: int = 0


# Lines the tokenizer is trained on: enough variety for a few hundred byte-level merges.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Solve for x: 2x + 3 = 11. The answer is x = 4.",
    "A router sends every sample of a prompt to the replica that holds its prefix.",
    "Reinforcement learning from verifiable rewards trains a policy with group baselines.",
    "def add(a, b):\n    return a + b\n",
    "What is 17 times 23? Let us think step by step: 17 * 23 = 391.",
    "user: hello\nassistant: Hello! How can I help you today?",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \"",
]

EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = [EOS, "<|im_start|>", "<|im_end|>"]


def cache_root() -> Path:
    return Path(os.environ.get("LORA_ROUTER_CACHE", Path.home() / ".cache" / "lora-router"))


def cache_key(params: TinyModel) -> str:
    digest = hashlib.sha256(json.dumps(asdict(params), sort_keys=True).encode())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()[:16]


def model_dir(params: TinyModel = TinyModel()) -> Path:
    """The cached model's directory, built first if it is not there yet."""
    target = cache_root() / f"tiny-qwen2-{cache_key(params)}"
    if (target / "complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        _build(params, staging)
        (staging / "complete").write_text("ok\n")
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same build first; its copy is identical in shape.
            if not (target / "complete").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def adapter_dir(base: Path, index: int) -> Path:
    return base / "adapters" / f"adapter-{index}"


def _build(params: TinyModel, out: Path) -> None:
    # Imported here: only the vLLM tier's environment has them, and test collection must not
    # need them.
    import torch
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(params.seed)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=params.vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS, model_max_length=4096
    )
    fast.chat_template = CHAT_TEMPLATE
    model_path = out / "model"
    fast.save_pretrained(model_path)

    vocab = tokenizer.get_vocab_size()
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=params.hidden_size,
        intermediate_size=params.intermediate_size,
        num_hidden_layers=params.num_hidden_layers,
        num_attention_heads=params.num_attention_heads,
        num_key_value_heads=params.num_key_value_heads,
        max_position_embeddings=params.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=fast.convert_tokens_to_ids(EOS),
        eos_token_id=fast.convert_tokens_to_ids(EOS),
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(model_path, safe_serialization=True)

    for index in range(params.adapters):
        torch.manual_seed(params.seed + 1 + index)
        lora = LoraConfig(
            r=1,
            lora_alpha=2,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            init_lora_weights=False,
            lora_dropout=0.0,
            bias="none",
        )
        peft_model = get_peft_model(Qwen2ForCausalLM(config), lora)
        peft_model.save_pretrained(adapter_dir(out, index))


if __name__ == "__main__":
    print(model_dir())
    sys.exit(0)
