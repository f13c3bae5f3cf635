"""A job simulated: :func:`simulate_job` binds a :class:`cost_models.job.Job` to its costs
(:func:`cost_models.bind.bind`) and simulates it with the options the job implies
(:func:`job_options`: its faults, its calibrated host, ``exact``)."""
from __future__ import annotations

from typing import NamedTuple

from cost_models.bind import Bound, CostInputs, bind
from cost_models.comm import links_used
from cost_models.job import Job
from schedules.registry import MAX_OPS

from .engine import SimOptions, SimResult, run
from .host import HostCores, on_one_host


class JobSimulation(NamedTuple):
    """A simulated job: what it was bound to and what the simulator returned."""

    bound: Bound
    result: SimResult


def check_slow_links(links: dict, network, low, *, crossed: bool = True) -> None:
    """Every slow link must be a link of ``network`` and (``crossed``) one the run crosses (else
    slowing it would change nothing)."""
    if not links:
        return
    if network is None or not hasattr(network, "links"):
        raise ValueError("--slow-link slows a link of a cluster: use --model/--cluster costs (not --unit-costs or "
                         "--stage-costs, which have no links)")
    known = {ln.name for ln in network.links()}
    for name in links:
        if name not in known:
            raise ValueError(f"--slow-link: no link named {name!r} in this cluster; links look like "
                             f"{', '.join(sorted(known)[:4])} ...")
    if not crossed:
        return
    used = links_used(low, network)
    for name in links:
        if name not in used:
            some = ", ".join(sorted(used)[:6]) or "none (no messages)"
            raise ValueError(f"--slow-link: this run never crosses link {name!r}, so slowing it changes nothing; "
                             f"it crosses {some}{' ...' if len(used) > 6 else ''}")


def crossed_links(bound: Bound) -> set[str]:
    """The names of the links the bound job's messages cross (none without a cluster)."""
    net = bound.network
    return links_used(bound.lowered, net) if net is not None and hasattr(net, "links") else set()


def job_options(job: Job, bound: Bound, *, check_links: bool = True) -> SimOptions:
    """The simulator's options for a bound job: its stragglers, slow links (checked against the
    network; ``check_links=False`` does not require them to be crossed), jitter and seed, ``exact``,
    and, for a calibration profile on its own host, the ranks sharing that host's cores."""
    low, faults = bound.lowered, job.faults
    slow = faults.slowdown_map
    check_slow_links(faults.slow_link_map, bound.network, low, crossed=check_links)
    for r in slow:
        if not 0 <= r < low.num_ranks:
            raise ValueError(f"--slowdown names rank {r}, but the run has ranks 0..{low.num_ranks - 1}")
    base = SimOptions(slowdown=slow, link_slowdown=faults.slow_link_map, jitter=faults.jitter, seed=faults.seed,
                      exact=job.exact)
    host = bound.report.get("host")
    return on_one_host(base, low.num_ranks, HostCores(**host)) if host else base


def simulate_job(job: Job, *, inputs: CostInputs | None = None, trace: bool = False, check_links: bool = True,
                 max_ops: int | None = MAX_OPS) -> JobSimulation:
    """Bind and simulate one iteration of ``job`` (the per-op trace kept only with ``trace``);
    ``inputs``: the job's loaded cost inputs (:func:`cost_models.bind.load_inputs`) when the caller
    has them; ``max_ops``: refuse to simulate more ops than that (None: no limit, for callers that
    bound the size themselves, as the planner does)."""
    bound = bind(job, inputs)
    opts = job_options(job, bound, check_links=check_links)
    return JobSimulation(bound, run(bound.lowered, bound.costs, bound.network, opts, trace=trace, max_ops=max_ops))
