"""The SimPy engine: devices, links with bandwidth sharing, collectives, memory tracking."""
from .engine import SimOptions, SimulationError, simulate
from .flows import FairShare

__all__ = ["SimOptions", "SimulationError", "simulate", "FairShare"]
