"""The SimPy engine: devices, links with max-min fair bandwidth sharing, collectives, memory tracking,
hosts' cores (shared or time-sliced), replica symmetry; :func:`simulate_job` simulates a
:class:`cost_models.job.Job`."""
from .engine import SimOptions, SimResult, SimulationError, run, simulate
from .flows import FairShare
from .job import JobSimulation, job_options, simulate_job

__all__ = ["SimOptions", "SimResult", "SimulationError", "run", "simulate", "FairShare", "JobSimulation",
           "job_options", "simulate_job"]
