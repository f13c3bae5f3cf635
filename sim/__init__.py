"""The SimPy engine: devices, links with max-min fair bandwidth sharing, collectives, memory tracking,
hosts' cores (shared or time-sliced), replica symmetry."""
from .engine import SimOptions, SimResult, SimulationError, run, simulate
from .flows import FairShare

__all__ = ["SimOptions", "SimResult", "SimulationError", "run", "simulate", "FairShare"]
