"""Megatron-LM and torchtitan in and out (cost_models.frameworks): the issue's Megatron YAML simulates
with every flag read or listed, its export prints its flags, and export -> import gives the same job
record and the same simulated step time to the bit, for Megatron-LM, torchtitan and torch's CSV."""
import json
from pathlib import Path

import pytest
import yaml

from cost_models.files import load_schedule_file
from cost_models.frameworks import (MEGATRON, MEGATRON_UNMODELLED, export_job, read_megatron, read_torchtitan,
                                    runs_on, _partition_layout, _expand_layout, _layout_partition, _tt_split)
from cost_models.job import Job, Layout
from experiments.cli import main
from sim import simulate_job

FIXTURE = Path(__file__).parent / "data" / "megatron_gpt32_pp4_vp.yaml"
H100 = "dgx-h100-ib:4"


def _time(job) -> float:
    return simulate_job(job)[1].iteration_time


def _fixture():
    return read_megatron(FIXTURE.read_text(), str(FIXTURE))


# ------------------------------------------------------------------------------------------- the issue's YAML
def test_issue_yaml_is_read_whole():
    """The 'Done when' GPT: 32 layers, h 4096, 32 heads, 8 query groups, sequence 8192, TP 1 x PP 4
    with one layer per virtual stage (v = 32 / (4 x 1) = 8 chunks), DP 2 (the recipe's 1 node x 8
    GPUs / (TP 1 x PP 4)), N = global 16 / (micro 1 x DP 2) = 8, distributed optimizer (ZeRO-1),
    bf16; the vocabulary 50257 padded as Megatron pads it, to a multiple of 128 x TP 1: 50304."""
    imp = _fixture()
    f, m = imp.fields, imp.fields["model"]
    assert (m.layers, m.hidden, m.heads, m.kv, m.seq_len, m.micro_batch, m.vocab) == \
        (32, 4096, 32, 8, 8192, 1, 50304)
    assert (m.kind, m.ffn, m.tied, m.has_dropout, m.attention_kind, m.dtype_bytes) == \
        ("gpt", 4 * 4096, True, True, "flash", 2)
    assert (f["schedule"], f["devices"], f["chunks"], f["replicas"], f["microbatches"]) == ("interleaved", 4, 8, 2, 8)
    assert (f["tp"], f["zero"], f["precision"], f["recompute"], f["partition"], f["eager"]) == \
        (1, 1, "bf16", "none", None, True)
    assert imp.global_batch == 16
    # no flag silently dropped: each is read by a row of the table, or listed
    given = set(yaml.safe_load(FIXTURE.read_text())["MODEL_ARGS"])
    read = {flag for r in MEGATRON for flag in r.flags}
    assert imp.unmodelled == ("--transformer-impl",) and set(imp.unmodelled) <= set(MEGATRON_UNMODELLED)
    assert imp.ignored == ("--train-iters", "--lr", "--log-interval", "--data-path")
    assert given - read == set(imp.unmodelled) | set(imp.ignored)


def test_issue_yaml_simulates_and_lists_what_it_does_not_model(capsys):
    """simulate --from-megatron: the job of the file (the same time as the library's), its notes on
    standard error and in --json."""
    assert main(["simulate", "--from-megatron", str(FIXTURE), "-c", H100, "--json"]) == 0
    out, err = capsys.readouterr()
    rec = json.loads(out)
    assert rec["imported"] == {"from": f"Megatron-LM arguments {FIXTURE}", "not_modelled": ["--transformer-impl"],
                               "ignored": ["--train-iters", "--lr", "--log-interval", "--data-path"]}
    assert (rec["schedule"], rec["devices"], rec["microbatches"], rec["replicas"], rec["gpus"]) == \
        ("interleaved", 4, 8, 2, 8)
    assert rec["iteration_time"] == _time(_fixture().job(cluster=H100))
    assert err.splitlines() == [f"pipetwin: --from-megatron {FIXTURE}: not modelled: --transformer-impl",
                                f"pipetwin: --from-megatron {FIXTURE}: ignored: --train-iters, --lr, --log-interval, "
                                f"--data-path"]


def test_export_of_the_issue_yaml_prints_its_flags(capsys):
    """export --to megatron of that job: every flag of the file a row reads comes back with its value
    (--vocab-size 50257 comes back padded as Megatron pads it, 50304 with a divisor of 128 that keeps it)."""
    assert main(["export", "--to", "megatron", "--from-megatron", str(FIXTURE)]) == 0
    out = capsys.readouterr().out
    toks = out.replace("\\\n", " ").split()
    pairs, i = {}, 0
    while i < len(toks):
        if i + 1 < len(toks) and not toks[i + 1].startswith("--"):
            pairs[toks[i]], i = toks[i + 1], i + 2
        else:
            pairs[toks[i]], i = True, i + 1
    given = yaml.safe_load(FIXTURE.read_text())["MODEL_ARGS"]
    imp = _fixture()
    for flag, value in given.items():
        if flag in imp.ignored or flag in imp.unmodelled or flag in ("--tokenizer-type", "--vocab-size"):
            continue
        assert pairs[flag] == (True if value is True else str(value)), flag
    assert pairs["--vocab-size"] == "50304" and pairs["--make-vocab-size-divisible-by"] == "128"


# ------------------------------------------------------------------------------------------- round trips
def _jobs():
    """Jobs over the table's rows: dense and MoE, GQA gpt and llama, virtual stages and a layout
    string, ZeRO 0-3, TP + SP, CP, recompute, precisions."""
    fx = _fixture().job(cluster=H100)
    return {
        "issue-yaml": fx,
        "llama-tp2-zero3-full": Job.of(model="llama3-8b", cluster=H100, layout=Layout(schedule="dapple", devices=4,
                                       microbatches=8, replicas=2), tp=2, sequence_parallel=True, zero=3,
                                       reshard_after_forward=True, recompute="full", micro_batch=2, seq_len=4096),
        "llama-layout-string": Job.of(model="llama3-8b", cluster=H100, partition=(3, 10, 11, 10),
                                      layout=Layout(schedule="dapple", devices=4, microbatches=8), seq_len=2048,
                                      eager=False),
        "gpt-interleaved-cp2": Job.of(model="gpt3-1.3b", cluster=H100, layout=Layout(schedule="interleaved",
                                      devices=4, microbatches=8, chunks=3, replicas=2), cp=2, cp_comm="allgather",
                                      recompute="selective", zero=1),
        "gpt-megatron-fsdp-zero2": Job.of(model="gpt3-1.3b", cluster=H100, layout=Layout(schedule="dapple", devices=2,
                                          microbatches=4, replicas=4), zero=2),
        "mixtral-ep-a2a-overlap": Job.of(model="mixtral-8x7b", cluster=H100, seq_len=4096,
                                         layout=Layout(schedule="interleaved", variant="a2a-overlap", devices=4,
                                                       microbatches=8, replicas=2, chunks=2),
                                         tp=2, sequence_parallel=True, ep=2, etp=1, zero=1, dp_shard=0),
        "deepseek-mla-moe-fp8-overlap": Job.of(model="deepseek-v3", cluster="dgx-h100-ib:64", seq_len=4096,
                                               layout=Layout(schedule="interleaved", variant="a2a-overlap",
                                                             devices=8, microbatches=16, replicas=8, chunks=2),
                                               ep=8, zero=1, precision="fp8", a2a_hierarchical=True),
        "gpt-fp8": Job.of(model="gpt3-1.3b", cluster=H100, precision="fp8",
                          layout=Layout(schedule="dapple", devices=2, microbatches=4, replicas=4), zero=1, dp_shard=2),
    }


@pytest.mark.parametrize("name", list(_jobs()))
def test_megatron_round_trip_same_job_and_time(name):
    """export -> import: the imported job is the canonical form (an explicit spec); exported and
    imported again it is the same record, and it simulates to the bit as the job it came from."""
    job = _jobs()[name]
    R = job.layout.replicas
    cluster = job.cluster.name
    j0 = read_megatron(export_job(job, "megatron").text, "a", replicas=R).job(cluster=cluster)
    j1 = read_megatron(export_job(j0, "megatron").text, "b", replicas=R).job(cluster=cluster)
    assert j1.record() == j0.record()
    assert _time(j0) == _time(job)


TT_JOBS = {
    "llama-fsdp-tp2-1f1b": dict(model="llama3-8b", layout=Layout(schedule="dapple", devices=4, microbatches=8,
                                replicas=2), tp=2, sequence_parallel=True, zero=3, seq_len=4096, recompute="full"),
    "llama-hsdp-zbv": dict(model="llama3-8b", layout=Layout(schedule="zb-v", devices=2, microbatches=8, replicas=4),
                           zero=3, dp_shard=2, reshard_after_forward=True, seq_len=2048, recompute="selective"),
    "gpt-ddp-interleaved": dict(model="gpt3-1.3b", layout=Layout(schedule="interleaved", devices=4, microbatches=8,
                                chunks=3, replicas=2)),
    "mixtral-dualpipe-v": dict(model="mixtral-8x7b", layout=Layout(schedule="dualpipe-v", devices=2,
                               microbatches=8, replicas=2), ep=2, seq_len=4096, zero=3),
    "gpt-gpipe-cp2": dict(model="gpt3-1.3b", layout=Layout(schedule="gpipe", devices=2, microbatches=4,
                          replicas=1), cp=2),
}


@pytest.mark.parametrize("name", list(TT_JOBS))
def test_torchtitan_round_trip_same_job_and_time(name, tmp_path):
    """torchtitan: the same (the model comes from --model, as torchtitan's recipe holds it)."""
    kw = TT_JOBS[name]
    job = Job.of(cluster=H100, **kw)
    out = str(tmp_path / "tt.txt")
    ex0 = export_job(job, "torchtitan", out)
    j0 = read_torchtitan(ex0.text, out, kw["model"]).job(cluster=H100)
    j1 = read_torchtitan(export_job(j0, "torchtitan", out).text, out, kw["model"]).job(cluster=H100)
    assert j1.record() == j0.record()
    assert _time(j0) == _time(job)


@pytest.mark.parametrize("schedule,chunks", [("zb-h1", 2), ("zb-h2", 2), ("zb-auto", 2), ("interleaved", 2),
                                             ("interleaved", 4), ("zb-v", 2), ("dualpipe-v", 2), ("gpipe", 2),
                                             ("dapple", 2)])
def test_torch_csv_round_trip_same_time(schedule, chunks, tmp_path):
    """torch-csv: the job's schedule read back as a schedule file simulates to the bit as the family
    (zb-auto: the order it makes from the job's costs, as the simulator builds it)."""
    job = Job.of(model="gpt3-1.3b", cluster=H100, layout=Layout(schedule=schedule, devices=4, microbatches=8,
                                                                 chunks=chunks, replicas=2))
    path = tmp_path / "s.csv"
    path.write_text(export_job(job, "torch-csv").text)
    sf = load_schedule_file(str(path))
    back = Job.of(model="gpt3-1.3b", cluster=H100, layout=Layout.of_file(sf, replicas=2))
    assert _time(back) == _time(job)


def test_torchtitan_without_a_torch_name_runs_from_a_csv_beside_out(tmp_path, capsys):
    """zb-h1 has no torchtitan name: the overrides name the CSV written beside --out, and the
    import reads it back (the same time to the bit)."""
    out = tmp_path / "zbh1.txt"
    argv = ["export", "--to", "torchtitan", "-s", "zb-h1", "-D", "4", "-N", "8", "--dp", "2", "-m", "gpt3-1.3b",
            "--zero", "3", "-c", H100, "--out", str(out)]
    assert main(argv) == 0
    csv = tmp_path / "zbh1.schedule.csv"
    text = out.read_text()
    assert f"--parallelism.pipeline_parallel_schedule_csv {csv}" in text
    assert "--parallelism.pipeline_parallel_schedule 1F1B" in text
    assert csv.read_text().splitlines()[0].startswith("0F0,0F1,0F2,0F3")
    capsys.readouterr()
    assert main(["simulate", "--from-torchtitan", str(out), "-m", "gpt3-1.3b", "-c", H100, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    job = Job.of(model="gpt3-1.3b", cluster=H100, layout=Layout(schedule="zb-h1", devices=4, microbatches=8,
                                                                 replicas=2), zero=3)
    assert rec["iteration_time"] == _time(job)
    assert rec["imported"]["not_modelled"] == [] and rec["imported"]["ignored"] == []


def test_cli_round_trip_through_a_yaml_file(tmp_path, capsys):
    """export --out FILE.yaml writes a MODEL_ARGS block; simulate --from-megatron reads it back (--dp
    gives the GPUs the flags do not hold): the same iteration time."""
    out = tmp_path / "job.yaml"
    base = ["-s", "dapple", "-D", "4", "-N", "8", "--dp", "2", "-m", "llama3-8b", "--tp", "2", "--sequence-parallel",
            "--zero", "1", "--recompute", "selective", "--seq-len", "4096", "-c", H100]
    assert main(["export", "--to", "megatron", "--out", str(out)] + base) == 0
    args = yaml.safe_load(out.read_text())["MODEL_ARGS"]
    assert (args["--tensor-model-parallel-size"], args["--pipeline-model-parallel-size"], args["--swiglu"],
            args["--num-query-groups"], args["--recompute-granularity"], args["--global-batch-size"]) == \
        (2, 4, True, 8, "selective", 16)
    capsys.readouterr()
    assert main(["simulate", "--json", "--from-megatron", str(out), "--dp", "2", "-c", H100]) == 0
    got = json.loads(capsys.readouterr().out)["iteration_time"]
    assert main(["simulate", "--json"] + base) == 0
    assert got == json.loads(capsys.readouterr().out)["iteration_time"]


def test_a_launch_command_with_torchrun_and_env(tmp_path):
    """A launch script: environment assignments, torchrun's --nproc-per-node x --nnodes (2 x 8 = 16
    GPUs = TP 2 x PP 2 x DP 4), continuation lines, comments, --flag=value; N = 64 / (2 x 4) = 8."""
    text = ("# pretrain\nCUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node 8 --nnodes 2 pretrain_gpt.py \\\n"
            "  --num-layers 16 --hidden-size 2048 --num-attention-heads 16 \\\n"
            "  --seq-length=4096 --max-position-embeddings 4096 --swiglu --normalization RMSNorm \\\n"
            "  --position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights \\\n"
            "  --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 \\\n"
            "  --micro-batch-size 2 --global-batch-size 64 --vocab-size 32000 --bf16 \\\n"
            "  --recompute-granularity full --recompute-method block --recompute-num-layers 2 \\\n"
            "  --hidden-dropout 0 --attention-dropout 0 --attention-backend unfused\n")
    imp = read_megatron(text, "launch.sh")
    f, m = imp.fields, imp.fields["model"]
    assert (m.kind, m.layers, m.hidden, m.ffn, m.vocab, m.tied, m.has_dropout, m.attention_kind) == \
        ("llama", 16, 2048, int(4 * 2048 * 2 / 3 / 64) * 64, 32000, False, False, "eager")
    assert (f["tp"], f["sequence_parallel"], f["devices"], f["replicas"], f["microbatches"], f["recompute"]) == \
        (2, True, 2, 4, 8, "full")
    assert imp.unmodelled == ("--recompute-method block --recompute-num-layers 2 (priced as full recomputation of "
                              "every block)",)
    assert f["eager"] is False          # no --overlap-grad-reduce: gradients reduced after the last backward


def test_layout_string_both_ways():
    """Megatron's layout string: E and L placed as pipetwin counts them (stage 0 holds the embedding,
    the last the loss); (t|)*n and t*n expand."""
    assert _expand_layout("E|(t|)*3,t*2L", "x") == ["E", "t", "t", "t", "ttL"]
    assert _layout_partition(_expand_layout("Et*2|t*4|t*4|t*2L", "x"), 12, "x") == (3, 4, 4, 3)
    assert _partition_layout((3, 10, 11, 10)) == "Et*2|t*10|t*11|t*9L"
    assert _layout_partition(_expand_layout(_partition_layout((3, 10, 11, 10)), "x"), 32, "x") == (3, 10, 11, 10)


def test_torchtitan_split_is_its_generate_fqn_rule():
    """torchtitan's split (pipeline_parallel.py): L + first + last effective layers, floor per stage,
    the remainder on the first stages; the embedding and the head count 1 layer each in pipetwin's
    partition. 32 layers on 4 stages: with 1/1 less layers 34 = 9 + 9 + 8 + 8 ->
    (9, 9 - 0, 8, 8) as layer counts (stage 0: E + 8 blocks; stage 3: 7 blocks + head); with 0/0: 32
    = 8 x 4 -> (9, 8, 8, 9), pipetwin's default split."""
    assert _tt_split(32, 4, 1, 1) == (9, 9, 8, 8)
    assert _tt_split(32, 4, 0, 0) == (9, 8, 8, 9)
    assert _tt_split(32, 1, 1, 1) == (34,)


def test_what_each_target_runs():
    assert runs_on("megatron") == ("dapple", "interleaved")
    assert "bitpipe" not in runs_on("torchtitan") and "zb-h1" in runs_on("torch-csv")


def test_plan_emit_searches_what_the_target_runs(capsys):
    """plan --emit megatron --from-megatron: the file's model, sequence, global batch and GPUs; the
    search over Megatron-LM's schedules; the plan's arguments printed after it."""
    assert main(["plan", "--from-megatron", str(FIXTURE), "-c", H100, "--emit", "megatron", "--no-progress",
                 "--top", "2"]) == 0
    out = capsys.readouterr().out
    head, args = out.split("megatron arguments of the plan:\n")
    assert "global batch 16 x 8192 tokens" in head
    rows = [ln.split() for ln in head.splitlines() if ln[:1].isdigit()]
    assert rows and all(r[3].startswith(("dapple", "interleaved")) for r in rows)
    assert "--num-layers 32 \\" in args and "--global-batch-size 16 \\" in args


def test_a_gpt_block_with_query_groups():
    """A Megatron GPT with 8 query groups and GeLU is a gpt block with kv_heads (h 4096, a 32, k 8,
    e 128, f 16384): parameters h(h + 2ke) + h^2 + 2hf + biases (h + 2ke) + f + 2h + norms 4h;
    a BERT block still refuses kv_heads; the executor's GPT refuses it (it has no such attention)."""
    from cost_models.model_spec import ModelSpec, SpecError
    from cost_models.transformer import block_params
    from executor.config import RunConfig, lowered_schedule
    m = _fixture().fields["model"]
    h, k, e, f = 4096, 8, 128, 16384
    assert block_params(m) == h * (h + 2 * k * e) + h * h + 2 * h * f + (h + 2 * k * e) + f + 2 * h + 4 * h
    with pytest.raises(SpecError, match="grouped-query attention"):
        ModelSpec(name="b", kind="bert", layers=2, hidden=64, heads=4, kv_heads=2, seq_len=8, vocab=16)
    small = m.replace(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, seq_len=8, vocab=16)
    cfg = RunConfig(job=Job.of(model=small, layout=Layout(schedule="dapple", devices=2, microbatches=2)))
    with pytest.raises(ValueError, match="the executor's GPT has no grouped-query attention"):
        lowered_schedule(cfg)


def test_what_ifs_of_the_simulation_are_named_not_written(capsys):
    """--expert-imbalance is a what-if of the simulation (routing skew), no training argument: the
    export writes the job without it and says so on standard error."""
    assert main(["export", "--to", "megatron", "-s", "interleaved", "--variant", "a2a-overlap", "-D", "4", "-N", "8",
                 "--dp", "2", "-m", "mixtral-8x7b", "--seq-len", "4096", "--ep", "2", "--expert-imbalance", "1.5",
                 "-c", H100]) == 0
    out, err = capsys.readouterr()
    assert "imbalance" not in out and "--moe-token-dispatcher-type alltoall \\" in out
    assert err == ("pipetwin: note: --expert-imbalance 1.5 is a what-if of the simulation; Megatron-LM has no "
                   "argument for it (not written)\n")


def test_a_schedule_given_overrides_the_files(capsys):
    """'What would ZB-V give me?': -s zb-v over the file's interleaved (its 8 chunks dropped with it),
    the rest of the file's job kept: the same time as the job written out by hand."""
    assert main(["simulate", "--json", "--from-megatron", str(FIXTURE), "-s", "zb-v", "-c", H100]) == 0
    got = json.loads(capsys.readouterr().out)
    job = _fixture().job(cluster=H100).with_(schedule="zb-v")
    assert (got["schedule"], got["devices"], got["microbatches"], got["replicas"]) == ("zb-v", 4, 8, 2)
    assert got["iteration_time"] == _time(job)
