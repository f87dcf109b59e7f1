"""Batch scoring past one process, on Ray Data (the ``ray`` extra: ``pip install
"hydra-ensembles[ray]"``): the records ``hydra-ens predict`` writes, for a dataset of any size,
on this machine (Ray embedded, started and stopped with the job) or on a Ray cluster, with the
false-discovery-rate screening decided over the whole dataset. Nothing here imports Ray until
it is called; without Ray installed, a call says which extra to install (docs/scaling.md)."""

from .cluster import RayPlan, ray_session, require_ray, worker_room
from .scoring import (
    PREDICTIONS_MANIFEST,
    data_files,
    predict_dataset,
    read_predictions,
    screen_dataset,
    write_predictions,
)

__all__ = [
    "PREDICTIONS_MANIFEST",
    "RayPlan",
    "data_files",
    "predict_dataset",
    "ray_session",
    "read_predictions",
    "require_ray",
    "screen_dataset",
    "worker_room",
    "write_predictions",
]
