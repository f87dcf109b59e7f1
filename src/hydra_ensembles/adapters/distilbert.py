"""DistilBERT family: DistilBertModel, DistilBertForSequenceClassification and friends."""

from __future__ import annotations

from .base import WholeAttentionAdapter


class DistilBertAdapter(WholeAttentionAdapter):
    """``transformer.layer[i].attention.{q,k,v,out}_lin``; W_O lives inside the attention module."""

    family = "DistilBERT"
    model_types = ("distilbert",)
    projection_paths = ("attention.q_lin", "attention.k_lin", "attention.v_lin", "attention.out_lin")
    head_modules = ("pre_classifier", "classifier")
    heads_attribute = "n_heads"
