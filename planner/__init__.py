"""The DAPPLE planner (Fan et al., PPoPP 2021) and its baselines: hybrid data x pipeline plans.

Given a model, a cluster and a global batch, find the plan with the shortest iteration that fits in
memory: the number of stages, a contiguous partition of the layers, the replicas of every stage
(data parallelism inside a stage), where every replica sits (fresh-first / append-first /
scatter-first), the micro-batch count and the schedule.

* what it plans for is a :class:`cost_models.workloads.workload.Workload` (per-layer, per-sample costs:
  transformers, the DAPPLE paper's CNN/RNN models of :mod:`cost_models.workloads.paper_models`, measured
  profiles in PipeDream's graph format; :func:`cost_models.load_workload` resolves a name); with the
  kernel cost model the per-sample times depend on the micro-batch, which makes the micro-batch
  count a real choice;
* :mod:`planner.placement`: placement policies and communication costs on the cluster;
* :mod:`planner.cost`: the objective, L = warm-up + steady + ending (DAPPLE's pivot formulation);
  its docstring states it in full;
* :mod:`planner.search`: the exact search (:func:`search_plans`, a dynamic programme with pruning)
  for DAPPLE's and PipeDream's objectives, and a brute-force reference (:func:`exhaustive`);
* :mod:`planner.simulate`: plans as IR schedules (uniform and non-uniform), simulated with SimPy;
* :mod:`planner.plan`: the plan record (:class:`Plan`: stages, replicas, devices, batching);
* :mod:`planner.choose`: choosing a plan: search + re-simulation + baselines (what ``pipetwin
  plan`` runs);
* :mod:`planner.layout`: the whole-layout search (T x D x R, schedule family, micro-batch,
  recompute, ZeRO-1, sequence parallelism; every candidate a :class:`cost_models.job.Job`);
* :mod:`planner.plan_io`: plan files, written and read back (:func:`save_plan`, :func:`load_plan`).
"""
from schedules._face import lazy_face

# module -> the names this package exports from it, imported on first use (schedules._face)
__all__, __getattr__, __dir__ = lazy_face(__name__, {
    "choose": ("Evaluated", "PlanningResult", "evaluate_plan", "plan_training"),
    "cost": ("Estimate", "estimate"),
    "placement": ("POLICIES", "Topology"),
    "plan": ("Plan", "StagePlan"),
    "plan_io": ("LoadedPlan", "load_plan", "plan_record", "save_plan"),
    "search": ("PlanError", "SearchResult", "SearchSpace", "exhaustive", "search_plans"),
    "simulate": ("build_plan", "simulate_plan"),
})
