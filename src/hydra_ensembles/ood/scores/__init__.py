"""The built-in scores, one module each, registered in the order below (`ood.registry`): the
scores' order in every table and on the command line. The logit scores read the ensemble's
logits or probabilities; the feature scores read statistics of the members' features."""

from importlib import import_module

for _module in (
    "msp",
    "max_logit",
    "energy",
    "entropy",
    "mutual_information",
    "gen",
    "mds",
    "rmds",
    "mds_plus",
    "knn",
    "vim",
    "mds_layers",
    "mds_disagreement",
):
    import_module(f"{__name__}.{_module}")
