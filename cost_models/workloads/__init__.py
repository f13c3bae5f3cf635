"""Workloads: the per-layer, per-sample costs of whole models that the planner plans for, and the
papers' data they are made of (data, not formulas; the formulas they price with are
:mod:`cost_models.transformer` and :mod:`cost_models.kernels`, which never import this package).

- :mod:`cost_models.workloads.workload`: the record (:class:`~cost_models.workloads.workload.Workload`)
  and a transformer's workload;
- :mod:`cost_models.workloads.workload_sources`: a workload by name (what ``--model`` means to the
  planner) and back from a plan file's ``source``;
- :mod:`cost_models.workloads.paper_models`, :mod:`cost_models.workloads.paper_kernels`: the DAPPLE
  paper's CNN/RNN models and their kernels;
- :mod:`cost_models.workloads.pipedream_profile`, :mod:`cost_models.workloads.pipedream_workload`:
  measured profiles in PipeDream's graph format (DAPPLE's released ones) and their workloads.

``cost_models`` re-exports :class:`~cost_models.Workload`, :func:`~cost_models.load_workload`,
:func:`~cost_models.workload_from_source`, :func:`~cost_models.paper_models` and
:func:`~cost_models.load_pipedream_profile`.
"""
