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
from ._spec import SpecError
from .base import LayerCosts, PerLayerCostModel, StageCosts, UnitCostModel
from .calibration import (CalibrationProfile, LayerTiming, host_flop_rate, load_profile, profile_from_dict,
                          save_profile, scaled_layer_costs)
from .cluster import (FABRICS, LINK_TYPES, MAPPINGS, Cluster, LinkSpec, cluster_from_dict, cluster_presets, link_types,
                      load_cluster, map_copies_same_node, sequential_map, stage_sharing_groups, with_fabric, with_nodes)
from .comm import (all_gather_time, allreduce_kind, allreduce_phases, allreduce_steps, allreduce_time, p2p_time,
                   path_time, reduce_scatter_time, ring_allreduce_time, step_time, steps_time)
from .device import DeviceSpec, device_from_dict, device_presets, load_device
from .kernels import COST_MODELS, GpuConstants
from .layer_measurements import load_measurements
from .pipedream_profile import PipeDreamProfile, ProfileError, load_pipedream_profile
from .memory import (MemoryReport, OutOfMemory, StaticMemory, activation_walk, check_memory, memory_report,
                     peak_activation, static_memory)
from .model_spec import ModelSpec, load_model, model_presets, spec_from_dict
from .network import Link, Network, PortNetwork
from .partition import (balanced_counts, balanced_edges, block_ranges, blocks_from_layers, default_partition,
                        even_counts, layer_ranges, layers_from_blocks, stack_partition)
from .stack import StackSpec, is_model_ref, stack_from_dict
from .job import ClusterChoice, Faults, Job, Layout, check_run_size
from .parallel import Parallel
from .bind import Bound, bind
from .workload import Workload
from .workload_sources import load_workload, workload_from_source
from .paper_models import paper_models
from .transformer import (RECOMPUTE, Layer, TransformerCostModel, block_activation_bytes, block_flops, block_params,
                          block_weight_grad_bytes, boundary_bytes, model_flops, model_params, recompute_flops,
                          transformer_layers)
