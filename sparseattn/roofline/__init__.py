"""Roofline cost model (docstring written after calibration)."""
from .ceilings import Ceilings, ceilings, measure_ceilings
from .counts import Shape
from .crossover import Crossover, Report, crossover, report
from .model import Cost, cost
from .profile import StepProfile, profile_step

__all__ = ["Ceilings", "ceilings", "measure_ceilings", "Shape", "Cost", "cost", "Crossover", "crossover",
           "Report", "report", "StepProfile", "profile_step"]
