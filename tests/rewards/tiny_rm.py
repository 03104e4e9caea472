"""A tiny reward model trained here, for tests: it prefers answers inside <answer> tags."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from treadle.store.models import build_tokenizer


def pair(a: int, b: int) -> tuple[str, str]:
    """(chosen, rejected): the same sum with and without the answer tags."""
    return f"<answer>{a + b}</answer>", f"{a + b}"


def train_tiny_reward_model(folder: Path, steps: int = 60) -> Path:
    """Train a 2-layer Qwen2 sequence classifier (num_labels=1) with the Bradley-Terry loss
    (InstructGPT, arXiv:2203.02155, eq. 1: -log sigmoid(r_chosen - r_rejected)) on
    "What is a + b?" pairs, a, b < 20, and save it with its tokenizer in ``folder``."""
    corpus = [f"What is {a} + {b}? <answer>{a + b}</answer>" for a in range(30) for b in range(30)]
    tokenizer = build_tokenizer(corpus, 300)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train = [(a, b) for a in range(20) for b in range(20)]
    for step in range(steps):
        texts = []
        for i in range(16):
            a, b = train[(step * 16 + i) % len(train)]
            for response in pair(a, b):
                chat = [
                    {"role": "user", "content": f"What is {a} + {b}?"},
                    {"role": "assistant", "content": response},
                ]
                texts.append(tokenizer.apply_chat_template(chat, tokenize=False))
        enc = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
        rewards = model(**enc).logits[:, 0].view(-1, 2)
        loss = -torch.nn.functional.logsigmoid(rewards[:, 0] - rewards[:, 1]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
