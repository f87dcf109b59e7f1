"""Factories for tests: tiny random BERT/ViT models and their inputs."""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForSequenceClassification, ViTConfig, ViTForImageClassification

VOCAB = 40


def tiny_bert(
    layers: int = 2,
    heads: int = 4,
    head_dim: int = 3,
    labels: int = 3,
    seed: int = 0,
    intermediate=None,
    init_range: float = 0.02,
    dropout: float = 0.1,
) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    hidden = heads * head_dim
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate or 2 * hidden + 1,
        max_position_embeddings=32,
        num_labels=labels,
        initializer_range=init_range,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return BertForSequenceClassification(config).eval()


def tiny_vit(
    layers: int = 2,
    heads: int = 4,
    head_dim: int = 3,
    labels: int = 3,
    seed: int = 0,
    init_range: float = 0.02,
) -> ViTForImageClassification:
    torch.manual_seed(seed)
    hidden = heads * head_dim
    config = ViTConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden + 1,
        image_size=8,
        patch_size=4,
        num_channels=1,
        num_labels=labels,
        initializer_range=init_range,
    )
    return ViTForImageClassification(config).eval()


def text_inputs(
    batch: int = 4, tokens: int = 9, seed: int = 0, padded: bool = True
) -> dict[str, torch.Tensor]:
    """Random token ids; with ``padded`` every other row has a different amount of padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, tokens), generator=g)
    mask = torch.ones(batch, tokens, dtype=torch.long)
    if padded:
        for row in range(1, batch, 2):
            mask[row, max(1, tokens - row - 1) :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def image_inputs(batch: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(batch, 1, 8, 8, generator=g)}


def labelled(inputs: dict[str, torch.Tensor], labels: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """``inputs`` with random ``labels`` added."""
    batch = next(iter(inputs.values())).shape[0]
    return {
        **inputs,
        "labels": torch.randint(0, labels, (batch,), generator=torch.Generator().manual_seed(seed)),
    }
