"""Greedy circuit extraction (paper Algorithm 1, Appendix D.1.2).

Repeat ``budget`` times: for every remaining head, ablate it temporarily (zero its W_O column
block, here by masking its output before W_O), score the objective S on validation data, restore;
then ablate for good the head whose removal leaves the highest S. S is ID accuracy (``acc``),
MSP AUROC between ID and OOD validation data (``ood``), or their mean (``avg``). Ties in S
(frequent: accuracy and AUROC saturate) are broken by a continuous companion score
(`tie_break_value`), then by head index.

Two implementations return the same order:

* ``method="reference"``: the plain algorithm, one full forward pass per candidate.
* ``method="fast"`` (default): exact accelerations. The hidden states entering every layer are
  computed once per step (ablating a head of layer l leaves layers < l unchanged), all of a
  layer's candidates run together as one candidate-stacked batch from that layer on, reusing
  that layer's Q/K/V and attention (identical for all its candidates: ablation acts after them)
  where the family exposes them (BERT), and where the classifier reads only [CLS] (BERT) the
  last layer runs W_O, LayerNorm and MLP for [CLS] only (`ArchitectureAdapter.first_token_only`).
  Across steps, candidates restart from their stored states above the layer of the last removal
  (`candidates.SuffixCache`); for a dual encoder, the candidates of the tower the removal left
  untouched do not run at all: their stored tower output is scored against the other tower's new
  embeddings (`benchmarks/zero_shot_circuit_speed.py`; timings: docs/benchmarks.md).

An approximate mode, ``method="lazy"``, is for large models: after a full evaluation, the next
steps evaluate (with the fast path) only the ``shortlist`` candidates that scored best when last
evaluated, refreshing all scores every ``refresh_every`` steps (lazy greedy). It is not exact;
``benchmarks/circuit_speed.py`` reports its agreement with the exact order.

Candidate evaluations can be split across ``torch.distributed`` ranks; an interrupted extraction
resumes from its checkpoint file and ends with the same result.

The parts: ``order`` (`CircuitOrder` and its JSON form), ``objectives`` (S, its tie-break, its
bounds under rounding), ``candidates`` (the reference and fast evaluations behind `evaluator`, the
suffix cache), ``rescoring`` (fp32 re-scoring of a low-precision extraction), ``search`` (the
greedy loop, checkpoints, ranks) and ``extract`` (`extract_circuit` and `CircuitConfig`).
"""

from .extract import CircuitConfig, extract_circuit
from .objectives import objective_bounds, objective_value, tie_break_value
from .order import OBJECTIVES, CircuitError, CircuitOrder, Objective, removal_ranking

__all__ = [
    "OBJECTIVES",
    "CircuitConfig",
    "CircuitError",
    "CircuitOrder",
    "Objective",
    "extract_circuit",
    "objective_bounds",
    "objective_value",
    "removal_ranking",
    "tie_break_value",
]
