"""pipetwin's torch CSVs trained by ``torch.distributed.pipelining``'s own runtime (gloo on the CPU):
:mod:`executor.torch_pipelining`.

Every family whose schedule torch's CSV can hold (one model copy) at D = 2, N = 4, fp32, a small
GPT (4 blocks), 3 optimizer steps (SGD with momentum: an update off by the 1/N scale or by one
micro-batch's gradient shows in the weights, where Adam's would not), and beside them a V-shaped
and an interleaved case with 2 chunks a device, dualpipe-v with torch's OVERLAP_F_B tokens, a CSV
with torch's communication actions (loaded as written), a non-uniform partition, a tiny Llama and
one Adam run. One spawn of 2 ranks runs them all under torch's runtime, one spawn of 2 ranks
under pipetwin's executor; per step, torch's loss equals pipetwin's executor's and the
one-process reference's within 1e-5 (relative), and every final parameter equals pipetwin's
executor's and the reference's within 1e-5 of the parameter's largest magnitude (with Adam, the
reference's within lr / 1000: see the test).

The same spawn shows the one disagreement found in torch's runtime: a last stage that runs its
forwards out of micro-batch order trains on the wrong loss under torch (it keeps the losses in the
order computed and gives micro-batch m's backward the m-th), where pipetwin's executor trains it as
the reference does; :func:`executor.torch_pipelining.check_torch_run` refuses such a CSV.
"""
import pytest

pytest.importorskip("torch.distributed.pipelining")
from torch.distributed.pipelining.schedules import (  # noqa: E402
    _Action,
    _add_reduce_grad,
    _add_send_recv,
    _add_unshard_reshard,
)

from cost_models import load_model  # noqa: E402
from executor.config import RunConfig, lowered_schedule  # noqa: E402
from executor.launch import LaunchError, run_many  # noqa: E402
from executor.reference import run_reference  # noqa: E402
from executor.torch_pipelining import (  # noqa: E402
    ENGINE,
    TorchJob,
    csv_format,
    run_torch_many,
    torch_job,
)
from schedules import build, names  # noqa: E402
from schedules.torch_interop import from_torch_text, single_copy_refusal, to_torch_text  # noqa: E402

SPEC = load_model("tiny").replace(layers=4, hidden=32, heads=4, seq_len=16, vocab=64)
LLAMA = SPEC.replace(name="tiny-llama", kind="llama", kv_heads=2, ffn_hidden=48)
BASE = dict(devices=2, microbatches=4, steps=3, optimizer="sgd", lr=0.05, collect_params=True, timeout=30.0,
            model=SPEC)

# the families torch's CSV holds (one model copy) and those it cannot, from the registry's schedules
EXPRESSIBLE = [n for n in names() if single_copy_refusal(build(n, 2, 4)) is None]
REFUSED = [n for n in names() if n not in EXPRESSIBLE]


def _comms_csv(sched) -> str:
    """The schedule's CSV with communication, as torch's own lowering writes it (what
    ``_dump_csv(format="compute_comms")`` writes): a CSV torch loads as written."""
    acts = {r: [_Action.from_str(t) for t in row.split(",")] for r, row in enumerate(to_torch_text(sched).split("\n"))}
    stage_rank = {s: sched.placement[0][s] for s in range(sched.num_stages)}
    low = {r: _add_reduce_grad(_add_unshard_reshard(a), sched.num_microbatches) for r, a in acts.items()}
    low = _add_send_recv(low, stage_to_rank=stage_rank.__getitem__, num_stages=sched.num_stages)
    return "\n".join(",".join(str(a) for a in low[r]) for r in sorted(low))


SWAPPED = "0F1,0F0,0B0,0B1\n1F1,1F0,1B0,1B1"      # the last stage's forwards out of micro-batch order


def _cases():
    """name -> (config, CSV or None = the export, schedule or None = the config's)."""
    cases = {n: (RunConfig.of(schedule=n, **BASE), None, None) for n in EXPRESSIBLE}
    cases["interleaved-a2a-overlap"] = (RunConfig.of(schedule="interleaved", variant="a2a-overlap", **BASE), None,
                                        None)
    dpv = build("dualpipe-v", 2, 4)
    cases["dualpipe-v-overlap-tokens"] = (RunConfig.of(schedule="dualpipe-v", **BASE),
                                          to_torch_text(dpv, overlap=True), None)
    zbv = build("zb-v", 2, 4)
    cases["zb-v-compute-comms"] = (RunConfig.of(schedule="zb-v", **BASE), _comms_csv(zbv), None)
    cases["dapple-partition-2-4"] = (RunConfig.of(schedule="dapple", partition=(2, 4), **BASE), None, None)
    cases["llama-zb-v"] = (RunConfig.of(schedule="zb-v", **dict(BASE, model=LLAMA)), None, None)
    cases["llama-interleaved"] = (RunConfig.of(schedule="interleaved", **dict(BASE, model=LLAMA)), None, None)
    cases["dapple-adam"] = (RunConfig.of(schedule="dapple", **dict(BASE, optimizer="adam", lr=1e-3)), None, None)
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def runs():
    """name -> (torch job, torch's result, pipetwin's result); and the unchecked swapped-order job's results."""
    jobs = {k: torch_job(cfg, csv, schedule=sched) for k, (cfg, csv, sched) in CASES.items()}
    swapped_sched = from_torch_text(SWAPPED, name="swapped")
    swapped_cfg = RunConfig.of(**dict(BASE, microbatches=2))
    swapped = TorchJob(swapped_cfg, lowered_schedule(swapped_cfg, swapped_sched), SWAPPED + "\n")
    theirs = run_torch_many([*jobs.values(), swapped])
    ours = run_many([(j.config, j.schedule) for j in jobs.values()] + [(swapped_cfg, swapped_sched)])
    out = {k: (j, t, o) for (k, j), t, o in zip(jobs.items(), theirs, ours)}
    return out, (swapped_cfg, theirs[-1], ours[-1])


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(cfg):
        key = cfg.with_(schedule="gpipe", variant=None, partition=None)
        if key not in cache:
            cache[key] = run_reference(key)
        return cache[key]
    return get


def _relative(a, b) -> float:
    """The largest difference over the largest magnitude of ``b``."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def test_which_families_torch_can_express():
    assert EXPRESSIBLE == ["gpipe", "dapple", "interleaved", "zb-h1", "zb-h2", "zb-auto", "zb-v", "dualpipe-v"]
    assert REFUSED == ["chimera", "bitpipe", "bitpipe-zb"]


@pytest.mark.parametrize("case", list(CASES))
def test_torch_runtime_losses_and_weights_equal_pipetwin_and_reference(runs, references, case):
    job, theirs, ours = runs[0][case]
    ref = references(job.config)
    assert theirs.engine == ENGINE and ours.engine == "executor"
    assert len(theirs.losses) == len(ours.losses) == len(ref.losses) == 3
    for a, b, r in zip(theirs.losses, ours.losses, ref.losses):
        assert abs(a - b) <= 1e-5 * abs(b) and abs(a - r) <= 1e-5 * abs(r), (theirs.losses, ours.losses, ref.losses)
    got = {k.split("/", 1)[1]: v for k, v in theirs.params.items()}
    twin = {k.split("/", 1)[1]: v for k, v in ours.params.items()}
    assert set(got) == set(twin) == set(ref.params)
    for name, want in ref.params.items():
        assert _relative(got[name], twin[name]) <= 1e-5, name
        if job.config.optimizer == "sgd":
            assert _relative(got[name], want) <= 1e-5, name
        else:   # Adam moves an element whose gradient is 0 in exact arithmetic (a key bias: the softmax does not
            # see it) by its rounding noise, up to lr a step, in both engines alike: lr / 1000 absolute
            assert float((got[name] - want).abs().max()) <= 1e-3 * job.config.lr, name
    # the stages torch placed are the schedule's: rank d holds the stages the placement puts on it
    sched = job.schedule
    assert [d["stages"] for d in theirs.per_device] == \
        [[s for s in range(sched.num_stages) if sched.placement[0][s] == d] for d in range(2)]


def test_csv_forms_torch_was_given(runs):
    jobs = {k: v[0] for k, v in runs[0].items()}
    assert jobs["dapple"].csv == "0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n"
    assert jobs["dapple"].format == "compute_only" and jobs["zb-v-compute-comms"].format == "compute_comms"
    assert "OVERLAP_F_B" in jobs["dualpipe-v-overlap-tokens"].csv
    # torch's lowering of zb-v at D=2: one SEND_F/RECV_F and one SEND_B/RECV_B per micro-batch and cross-rank hop
    # (0->1 and 2->3; the V's turn 1->2 stays on rank 1), one REDUCE_GRAD per stage
    toks = jobs["zb-v-compute-comms"].csv.replace("\n", ",").split(",")
    assert sum(t.startswith("RECV", 1) for t in toks) == sum(t.startswith("SEND", 1) for t in toks) == 2 * 2 * 4
    assert sum(t.endswith("REDUCE_GRAD") for t in toks) == 4


def test_torch_trains_a_last_stage_out_of_order_on_the_wrong_loss(runs, references):
    """Why :func:`check_torch_run` refuses it: under torch step 0's update uses micro-batch 1's loss for
    micro-batch 0's backward (and back), so from step 1 on the losses leave the reference's;
    pipetwin's executor, keyed by micro-batch, trains it as the reference does."""
    cfg, theirs, ours = runs[1]
    ref = references(cfg)
    assert theirs.losses[0] == pytest.approx(ref.losses[0], rel=1e-6)      # the same weights at step 0
    assert abs(theirs.losses[1] - ref.losses[1]) > 1e-5 * abs(ref.losses[1])
    for a, r in zip(ours.losses, ref.losses):
        assert abs(a - r) <= 1e-5 * abs(r)
    with pytest.raises(ValueError, match=r"swapped: the last stage \(stage 1\) runs forward 0 after forward 1; "
                                         r"torch's runtime keeps the losses in the order they were computed"):
        torch_job(cfg, SWAPPED, schedule=from_torch_text(SWAPPED, name="swapped"))


# ------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("name,nearest", [("chimera", "dapple"), ("bitpipe", "zb-v"), ("bitpipe-zb", "zb-v")])
def test_two_copy_families_are_refused_naming_the_nearest(no_ranks, name, nearest):
    cfg = RunConfig.of(schedule=name, **BASE)
    with pytest.raises(ValueError) as e:
        torch_job(cfg)
    assert str(e.value) == (f"{name} has 2 model copies; PyTorch's pipeline order can only express single-copy "
                            f"schedules (an action names a stage by its index, one rank holds it): the nearest it "
                            f"runs is {nearest}")


@pytest.mark.parametrize("changes,words", [
    (dict(tp=2), "--tp 2"), (dict(tp=2, sequence_parallel=True), "--sequence-parallel"),
    (dict(replicas=2, zero=2), "--zero 2"), (dict(recompute="full"), "--recompute full"),
    (dict(dtype="bf16"), "--dtype bf16"), (dict(fault="1:F0.s1"), "--inject-fault 1:F0.s1"),
])
def test_what_torch_runtime_does_not_run_is_refused(no_ranks, changes, words):
    cfg = RunConfig.of(schedule="dapple", **{**BASE, **changes})
    with pytest.raises(ValueError, match="torch.distributed.pipelining's runtime trains pipetwin's GPT or Llama "
                                         "stages in fp32, replicated whole; drop ") as e:
        torch_job(cfg)
    assert words in str(e.value)


def test_csv_format_and_unreadable_cells():
    assert csv_format("0F0,0B0\n1F0,1B0") == "compute_only"
    assert csv_format(to_torch_text(build("dualpipe-v", 2, 4), overlap=True)) == "compute_only"
    assert csv_format("0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0") == "compute_comms"
    for bad in ("0F0 0B0", "Rank 0: 0F0", "0X0"):   # torch's from_str would read '0F0 0B0' as 0F0 alone
        with pytest.raises(ValueError, match=f"row 0 of the torch CSV: '{bad}' is not one action as torch writes"):
            csv_format(bad)


@pytest.mark.slow
def test_a_deadlocked_csv_ends_naming_the_rank_and_action():
    """A compute_comms CSV in which rank 0 never sends its activation: rank 1's forward waits on its
    RECV_F, rank 0's backward on the gradient rank 1 never sends, both past --timeout (the pipeline's
    group). The run ends naming the rank whose wait timed out first (which one is the hosts'
    scheduling: rank 1 starts waiting first, rank 0 after its forward), with that rank's action, its
    position and the wait, never a peer that only saw the connection close."""
    import re
    text = "0F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0"
    cfg = RunConfig.of(**dict(BASE, microbatches=1, steps=1, timeout=3.0))
    job = torch_job(cfg, text, schedule=from_torch_text(text))
    with pytest.raises(LaunchError) as err:
        run_torch_many([job])
    got = re.match(r"rank (\d) failed: RuntimeError: rank \1 step 0: torch's runtime failed at its action (\w+) "
                   r"\(position (\d) of the rank's lowered order\): .*Timed out waiting 3000ms for recv",
                   str(err.value), re.S)
    assert got, str(err.value)
    assert (got[2], got[3]) == {"1": ("1F0", "1"), "0": ("0B0", "2")}[got[1]]


@pytest.mark.slow
def test_cli_runtime_torch_trains_a_csv_file_as_written(tmp_path, capfd):
    """``pipetwin run --schedule-file zb-v.csv --runtime torch --check --json``: torch loads the file as written
    (here with torch's communication actions), pipetwin's executor trains the schedule it reads from it;
    the JSON holds both losses, equal within 1e-5, and the reference's beside them."""
    import json

    from experiments.cli import main
    path = tmp_path / "zb-v.csv"
    text = _comms_csv(build("zb-v", 2, 4))
    path.write_text("# zb-v, D=2, N=4, with torch's own lowering\n" + text + "\n")
    assert main(["run", "--schedule-file", str(path), "--runtime", "torch", "--steps", "2", "--check", "--json",
                 "--optimizer", "sgd", "--lr", "0.05"]) == 0
    out, err = capfd.readouterr()
    rec = json.loads(out)
    torch_rec = rec["torch"]
    assert torch_rec["engine"] == ENGINE and torch_rec["format"] == "compute_comms"
    assert torch_rec["csv"] == text + "\n" and torch_rec["csv_source"] == f"{path} as written"
    assert len(torch_rec["losses"]) == len(rec["losses"]) == 2
    for a, b, r in zip(torch_rec["losses"], rec["losses"], torch_rec["reference_check"]["reference_losses"]):
        assert abs(a - b) <= 1e-5 * abs(b) and abs(a - r) <= 1e-5 * abs(r)
    assert torch_rec["check"]["equal"] and torch_rec["reference_check"]["equal"]
    assert err.splitlines()[-2].startswith("torch.distributed.pipelining's losses equal pipetwin's executor's within "
                                           "1e-5 (relative, fp32): ")


R2 = {"zb-v-D2R2": RunConfig.of(schedule="zb-v", **dict(BASE, microbatches=2, replicas=2)),
      "interleaved-D2R2": RunConfig.of(schedule="interleaved", **dict(BASE, microbatches=2, replicas=2)),
      "dapple-zero1-adam-D2R2": RunConfig.of(schedule="dapple", zero=1, **dict(BASE, microbatches=2, replicas=2,
                                                                                optimizer="adam", lr=1e-3))}


@pytest.mark.slow
def test_replicas_average_their_gradients_as_pipetwin_does(references):
    """R = 2 pipelines of D = 2 under torch's runtime (world 4), their gradients averaged between step() and the
    optimizer: the losses equal pipetwin's executor's (which all-reduces in its bubbles, and shards Adam's state
    under ZeRO-1) and the reference's on the same global batch; both replicas end with pipetwin's weights."""
    jobs = [torch_job(cfg) for cfg in R2.values()]
    theirs = run_torch_many(jobs)
    ours = run_many(list(R2.values()))
    for (key, cfg), t, o in zip(R2.items(), theirs, ours):
        ref = references(cfg)
        for a, b, r in zip(t.losses, o.losses, ref.losses):
            assert abs(a - b) <= 1e-5 * abs(b) and abs(a - r) <= 1e-5 * abs(r), (key, t.losses, o.losses)
        assert {k.split("/")[0] for k in t.params} == {"r0.c0", "r1.c0"}
        for k, v in t.params.items():
            assert _relative(v, o.params[k]) <= 1e-5, (key, k)
        if key.startswith("zb-v"):     # each replica's V: rank r*D + d holds the stages of device d
            assert [d["stages"] for d in t.per_device] == [[0, 3], [1, 2]] * 2
