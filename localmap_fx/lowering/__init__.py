"""Boundary lowering: to_local / from_local / redistribute made explicit."""

from .boundaries import Boundary, boundary_plan, find_boundaries, lower, lower_boundaries, rewrite_boundary
from .plan import RedistributePlan, RedistributeStep, plan_redistribute

__all__ = [
    "Boundary",
    "find_boundaries",
    "boundary_plan",
    "lower",
    "lower_boundaries",
    "rewrite_boundary",
    "RedistributePlan",
    "RedistributeStep",
    "plan_redistribute",
]
