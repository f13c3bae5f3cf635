"""What things cost: model and cluster specs, compute/communication/memory cost functions.

Entry points (all units SI: seconds, bytes, bytes/s, FLOP/s):

* a job (:class:`Job`: layout, model, cluster, cost source, faults; checked when built) and its
  binding to costs: :func:`bind` -> :class:`Bound` (lowered schedule, costs, network, report);

* specs: :func:`load_model`, :func:`load_device`, :func:`load_cluster` (preset name or YAML path;
  :func:`model_presets`, :func:`device_presets`, :func:`cluster_presets` list the presets);
* compute: :class:`TransformerCostModel` ``(model, device, recompute=...).bind(schedule)`` ->
  :class:`StageCosts`; :func:`transformer_layers` for the per-layer formulas;
* network: :class:`Cluster` (``path(src, dst)``), ``cluster.place(schedule, "copies-same-node")``;
* communication: :func:`p2p_time`, :func:`ring_allreduce_time`, :func:`allreduce_time`,
  :func:`allreduce_steps`;
* memory: :func:`memory_report` / :func:`check_memory` (out-of-memory verdict);
* calibration: :func:`load_profile` -> per-layer cost model + cluster of cpu ranks;
* the kernel cost model (micro-batch-dependent GPU times): :mod:`cost_models.kernels`
  (:class:`GpuConstants`, the ``kernels:`` block of a device preset), checked and fitted against
  measured layers by :mod:`cost_models.layer_measurements` (:func:`load_measurements`);
* measured per-layer profiles in PipeDream's graph format (DAPPLE's): :func:`load_pipedream_profile`;
* per-layer, per-sample costs of a whole model (what the planner plans for and ``--model FILE.txt``
  simulates): :class:`Workload`, :func:`load_workload` (a transformer preset or spec, one of the
  DAPPLE paper's models, :func:`paper_models`, or a PipeDream profile);
* a calibration profile on another device: :func:`scaled_layer_costs`;
* a user's layer stack (``PATH.py:FUNC``): :class:`StackSpec` (measured, in its profile),
  :func:`is_model_ref`, :func:`stack_partition` (its default split).
"""
from schedules._face import lazy_face

# module -> the names this package exports from it, imported on first use (schedules._face)
__all__, __getattr__, __dir__ = lazy_face(__name__, {
    "_spec": ("SpecError",),
    "base": ("LayerCosts", "PerLayerCostModel", "StageCosts", "UnitCostModel"),
    "profile": ("CalibrationProfile", "LayerTiming", "host_flop_rate", "load_profile", "profile_from_dict",
                    "save_profile", "scaled_layer_costs"),
    "cluster": ("FABRICS", "LINK_TYPES", "MAPPINGS", "Cluster", "DeviceGrid", "LinkSpec", "cluster_from_dict",
                "cluster_presets", "link_types", "load_cluster", "map_copies_same_node", "sequential_map",
                "stage_sharing_groups", "with_fabric", "with_nodes"),
    "comm": ("all_gather_time", "allreduce_kind", "allreduce_phases", "allreduce_steps", "allreduce_time",
             "p2p_time", "path_time", "reduce_scatter_time", "ring_allreduce_time", "step_time", "steps_time"),
    "device": ("DeviceSpec", "device_from_dict", "device_presets", "load_device"),
    "kernels": ("COST_MODELS", "GpuConstants"),
    "layer_measurements": ("load_measurements",),
    "workloads.pipedream_profile": ("PipeDreamProfile", "ProfileError", "load_pipedream_profile"),
    "memory": ("MemoryReport", "OutOfMemory", "StaticMemory", "activation_walk", "check_memory", "memory_report",
               "peak_activation", "static_memory"),
    "model_spec": ("ModelSpec", "load_model", "model_presets", "spec_from_dict"),
    "network": ("Link", "Network", "PortNetwork"),
    "partition": ("balanced_counts", "balanced_edges", "block_ranges", "blocks_from_layers", "default_partition",
                  "even_counts", "layer_ranges", "layers_from_blocks", "stack_partition"),
    "stack": ("StackSpec", "is_model_ref", "stack_from_dict"),
    "job": ("ClusterChoice", "Faults", "Job", "Layout", "check_run_size"),
    "parallel": ("RECOMPUTE", "ZERO_STAGES", "Parallel"),
    "bind": ("Bound", "bind"),
    "workloads.workload": ("Workload",),
    "workloads.workload_sources": ("load_workload", "workload_from_source"),
    "workloads.paper_models": ("paper_models",),
    "transformer": ("Layer", "TransformerCostModel", "block_activation_bytes", "block_flops",
                    "block_params", "block_weight_grad_bytes", "boundary_bytes", "model_flops", "model_params",
                    "recompute_flops", "transformer_layers"),
})
