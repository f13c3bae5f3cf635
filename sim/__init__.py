"""The SimPy engine: devices, links with max-min fair bandwidth sharing, collectives, memory tracking,
hosts' cores (shared or time-sliced), replica symmetry; :func:`simulate_job` simulates a
:class:`cost_models.job.Job`."""
from schedules._face import lazy_face

# module -> the names this package exports from it, imported on first use (schedules._face)
__all__, __getattr__, __dir__ = lazy_face(__name__, {
    "engine": ("SimOptions", "SimResult", "SimulationError", "run", "simulate"),
    "flows": ("FairShare",),
    "job": ("JobSimulation", "job_options", "simulate_job"),
})
