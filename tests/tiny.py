"""A tiny local causal LM and chat data for tests that train for real on the CPU: a two-layer Llama with random
weights, a word-level tokenizer with a chat template, and chat rows of its words."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<s> assistant {% endif %}")
WORDS = ["user", "assistant", "system", *[f"w{i}" for i in range(10)]]


def chat_tokenizer(folder: Path, words: list[str] = WORDS, chat_template: str | None = CHAT_TEMPLATE):
    """A word-level tokenizer over `words` with `chat_template`, saved into `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["[UNK]", "[PAD]", "<s>", "</s>", *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                           special_tokens=[("<s>", 2), ("</s>", 3)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                        bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    return tokenizer


def hub_snapshot(hub: Path, repo: str) -> Path:
    """A snapshot folder of `repo` in a Hugging Face cache, as huggingface_hub lays it out."""
    entry = hub / f"models--{repo.replace('/', '--')}"
    (entry / "refs").mkdir(parents=True, exist_ok=True)
    (entry / "refs" / "main").write_text("0" * 40)
    snapshot = entry / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True, exist_ok=True)
    return snapshot


def chats(count: int = 24) -> list[dict]:
    return [{"messages": [{"role": "user", "content": " ".join(f"w{(i + j) % 10}" for j in range(3 + i % 7))},
                          {"role": "assistant", "content": " ".join(f"w{j % 10}" for j in range(2 + i % 5))}]}
            for i in range(count)]


def tiny_llama(folder: Path) -> Path:
    """A two-layer Llama with random weights and a chat tokenizer, saved as a local model folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = chat_tokenizer(folder)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=2, eos_token_id=3)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def write_chats(path: Path, count: int = 24) -> Path:
    import json

    path.write_text("".join(json.dumps(row) + "\n" for row in chats(count)))
    return path
