"""The typed job: checked field by field, bound to the same costs as by hand, the same record
from the library as from the command line, carried to the executor's config."""
import json
import pickle
from dataclasses import replace

import pytest

from cost_models.parallel import Parallel
from cost_models import TransformerCostModel, UnitCostModel, load_cluster, load_model
from cost_models.bind import bind, load_inputs
from cost_models.job import ClusterChoice, Faults, Job, Layout
from experiments.cli import main
from experiments.common import metrics_record
from schedules import build, lower, step_metrics
from sim import SimOptions, run, simulate, simulate_job

LAY = Layout(schedule="dapple", devices=4, microbatches=8)


@pytest.mark.parametrize("make,words", [
    (lambda: Layout(schedule="nope", devices=2, microbatches=2), ["unknown schedule 'nope'"]),
    (lambda: Layout(schedule="dapple", devices=0, microbatches=2), ["--devices", ">= 1"]),
    (lambda: Layout(schedule="dapple", devices=2, microbatches=2, replicas=True), ["--dp"]),
    (lambda: Job(layout=LAY, unit_costs=True, model="tiny"), ["--unit-costs", "drop --model"]),
    (lambda: Job(layout=LAY, unit_costs=True, cluster=ClusterChoice(nodes=2)), ["--unit-costs", "--nodes"]),
    (lambda: Job(layout=LAY, profile="p.yaml", cost_model="linear"), ["--cost-model", "--profile"]),
    (lambda: Job(layout=LAY, profile="p.yaml", model="tiny"), ["--profile", "drop --model"]),
    (lambda: Job(layout=LAY, profile="p.yaml", cluster=ClusterChoice(fabric="rail")), ["--fabric", "--cluster"]),
    (lambda: Job(layout=LAY, partition="time"), ["--partition time", "--profile"]),
    (lambda: Job(layout=LAY, partition=(2, -1)), ["--partition", ">= 0"]),
    (lambda: Job(layout=LAY, model="tiny", profile_batch=2), ["--profile-batch", "FILE.txt"]),
    (lambda: Job.of(layout=LAY, micro_batch=0), ["--micro-batch", ">= 1"]),
    (lambda: Job.of(layout=LAY, recompute="some"), ["--recompute", "selective"]),
    (lambda: Job(layout=LAY, device_map="random"), ["--device-map", "copies-same-node"]),
    (lambda: Job(layout=LAY, faults=Faults(slowdown=((1, 2.0), (1, 3.0)))), ["--slowdown names 1 twice"]),
    (lambda: Job(layout=LAY, faults=Faults(slowdown=((1, float("nan")),))), ["--slowdown", "finite"]),
    (lambda: Job(layout=LAY, faults=Faults(jitter=-0.1)), ["--jitter", ">= 0"]),
    (lambda: Job(), ["--schedule", "--plan"]),
    (lambda: ClusterChoice(oversubscription=0.5), ["--oversubscription", ">= 1"]),
])
def test_a_bad_field_is_one_line_naming_its_option(make, words):
    with pytest.raises(ValueError) as e:
        make()
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_bound_costs_equal_the_hand_built_ones():
    """A model x cluster job binds exactly the costs and placement one writes by hand."""
    job = Job.of(layout=Layout(schedule="bitpipe", devices=4, microbatches=8, replicas=2), model="gpt3-1.3b",
              cluster="dgx-a100-4x8-ib", device_map="copies-same-node", cost_model="linear", recompute="full")
    bound = bind(job)
    low = lower(build("bitpipe", 4, 8), replicas=2)
    cl = load_cluster("dgx-a100-4x8-ib")
    tm = TransformerCostModel(load_model("gpt3-1.3b"), cl.device, parallel=Parallel(recompute="full"),
                              compute="linear")
    costs = tm.bind(low)
    by_hand = step_metrics(simulate(low, costs, cl.place(low, "copies-same-node")))
    got = run(bound.lowered, bound.costs, bound.network, SimOptions()).metrics()
    assert got.iteration_time == by_hand.iteration_time
    assert [p.peak_memory for p in got.per_device] == [p.peak_memory for p in by_hand.per_device]
    assert bound.report == {"cost_model": "linear", "model": "gpt3-1.3b", "micro_batch": 1,
                            "cluster": "dgx-a100-4x8-ib", "device_map": "copies-same-node",
                            "memory_capacity": cl.device.memory_bytes, "parameters": 1_315_723_264, "gpus": 8,
                            "tp": 1, "sequence_parallel": False, "tp_overlap": False, "zero": 0, "memory_reserve": None,
                            "memory_transient": tm.transient_bytes(), "seq_len": 2048, "precision": "bf16",
                            "device_fitted": "a100: " + cl.device.fitted, "assumptions": []}


def test_unit_job_is_the_closed_form():
    """D = N = 4: DAPPLE's bubble 3/7 under unit costs (DESIGN.md's conventions)."""
    _, res = simulate_job(Job(layout=Layout(schedule="dapple", devices=4, microbatches=4), unit_costs=True))
    low = lower(build("dapple", 4, 4))
    assert res.metrics().bubble_ratio == pytest.approx(3 / 7)
    assert res.iteration_time == step_metrics(simulate(low, UnitCostModel().bind(low))).iteration_time


def test_library_record_equals_simulate_json(capsys):
    job = Job(layout=Layout(schedule="zb-v", devices=4, microbatches=8), model="gpt3-1.3b",
              cluster=ClusterChoice(name="dgx-a100-4x8-ib", nodes=2, fabric="fat-tree", nodes_per_leaf=1),
              faults=Faults(slowdown=((1, 1.5),)))
    bound, res = simulate_job(job)
    lib = metrics_record(res, **bound.report)
    assert main(["simulate", "-s", "zb-v", "-D", "4", "-N", "8", "-m", "gpt3-1.3b", "-c", "dgx-a100-4x8-ib",
                 "--nodes", "2", "--fabric", "fat-tree", "--nodes-per-leaf", "1", "--slowdown", "1=1.5",
                 "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert cli == json.loads(json.dumps(lib))
    _, plain = simulate_job(replace(job, faults=Faults()))
    assert cli["per_device"][1]["busy"] == pytest.approx(1.5 * plain.metrics().per_device[1].busy, rel=1e-9)


def test_jobs_are_frozen_picklable_records():
    job = Job(layout=LAY, model="tiny", cluster="dgx-a100-1x8", faults=Faults(slow_links=(("n0.g0.out", 2.0),)))
    assert pickle.loads(pickle.dumps(job)) == job
    assert job.with_layout(schedule="gpipe").layout == replace(LAY, schedule="gpipe")
    assert job.with_layout(schedule="gpipe").model == "tiny"
    rec = json.loads(json.dumps(job.record()))
    assert rec["layout"]["schedule"] == "dapple" and rec["cluster"]["name"] == "dgx-a100-1x8"
    assert rec["faults"]["slow_links"] == [["n0.g0.out", 2.0]]
    with pytest.raises(AttributeError):
        job.model = "gpt-96"


def test_inputs_are_checked_before_any_schedule_is_built():
    """A cluster too small for D x R is refused by the size check, before an O(D^2) build."""
    job = Job(layout=Layout(schedule="dapple", devices=1000, microbatches=8), model="tiny", cluster="dgx-a100-1x8")
    limits = load_inputs(job).limits()
    assert limits["cluster_devices"] == 8
    with pytest.raises(ValueError, match="do not fit on cluster"):
        bind(job)


def test_run_config_from_job():
    from executor.config import RunConfig
    job = Job.of(layout=Layout(schedule="interleaved", devices=2, microbatches=4, replicas=2, chunks=2), model="tiny",
              partition=(3, 2, 2, 3), recompute="selective", eager=False)
    cfg = RunConfig.from_job(job, steps=2, lr=0.01)
    lay = cfg.layout
    assert (lay.schedule, lay.devices, lay.microbatches, lay.replicas, lay.chunks) == ("interleaved", 2, 4, 2, 2)
    assert cfg.blocks == (2, 2, 2, 2)         # layers (embedding and head included) -> blocks of tiny
    assert cfg.stage_layers == (3, 2, 2, 3) and cfg.parallel.recompute == "selective" and not cfg.job.eager
    assert (cfg.steps, cfg.lr) == (2, 0.01)
    for sim_only in (replace(job, cost_model="linear"), replace(job, cluster=ClusterChoice(name="dgx-a100-1x8")),
                     replace(job, faults=Faults(jitter=0.1))):
        with pytest.raises(ValueError, match="a training run takes a job's layout and model only"):
            RunConfig.from_job(sim_only)
