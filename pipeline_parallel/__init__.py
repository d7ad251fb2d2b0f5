"""pipeline_parallel: pipeline-parallel training of decoder-only language models in PyTorch."""

from .classic import train_step_pipeline_1f1b, train_step_pipeline_afab
from .partition import ModelCosts, balanced_layer_counts, estimate_costs
from .pipeline import Pipeline
from .schedules import Action, ScheduleError, build_schedule

__all__ = [
    "Action",
    "ModelCosts",
    "Pipeline",
    "ScheduleError",
    "balanced_layer_counts",
    "build_schedule",
    "estimate_costs",
    "train_step_pipeline_1f1b",
    "train_step_pipeline_afab",
]
