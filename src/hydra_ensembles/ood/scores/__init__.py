"""The built-in feature scores, one module each, registered in the order below (`ood.registry`):
the scores' order in every table and on the command line."""

from importlib import import_module

for _module in ("mds", "rmds", "mds_plus", "knn", "vim"):
    import_module(f"{__name__}.{_module}")
