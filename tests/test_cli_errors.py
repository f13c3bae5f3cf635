"""Bad input: every class of defect found on first contact exits with status 2 and one line on
stderr that names the option (or file) to change, fast, with no traceback; nothing hangs."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from experiments.cli import main
from tests.test_cost_models_specs import PROFILE

SIM = ["simulate", "-s", "dapple", "-D", "4", "-N", "8"]
UNIT = SIM + ["--unit-costs"]
RUN = ["run", "-s", "dapple", "-D", "2", "-N", "2", "--steps", "1"]
LAYOUT = ["plan", "-m", "llama3-8b", "-c", "dgx-h100-ib:2", "-G", "64", "--tp", "auto", "--no-progress"]
MOE = SIM + ["-m", "mixtral-8x7b", "--seq-len", "4096", "--dp", "2", "-c", "dgx-h100-ib:1"]
SWEEP = ["sweep", "-s", "dapple", "-D", "2", "-N", "2", "--no-figures", "--no-progress", "--workers", "1"]


def _plan(tmp_path: Path, **changes) -> str:
    """A real plan file (pipetwin plan --out) with fields of its 'plan' record changed."""
    path = tmp_path / "good.json"
    if not path.exists():
        assert main(["plan", "-m", "tiny", "-c", "v100-2x8-25gbe", "-G", "16", "--no-progress", "--no-baselines",
                     "--out", str(path)]) == 0
    rec = json.loads(path.read_text())
    rec["plan"].update(changes)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(rec))
    return str(bad)


def _layout_plan(tmp_path: Path, tp: int) -> str:
    """A whole-layout plan file (as pipetwin plan --tp writes it) of the tiny GPT on one DGX H100:
    T x D=2 x R=2, micro-batch 1, ZeRO-1, sequence parallelism where T > 1."""
    from cost_models import load_cluster, load_model, with_nodes
    from cost_models.job import Job, Layout
    from planner.plan_io import layout_plan_record
    path = tmp_path / f"layout-t{tp}.json"
    if not path.exists():
        job = Job.of(layout=Layout(schedule="dapple", devices=2, microbatches=4, replicas=2), tp=tp,
                     model=load_model("tiny"), micro_batch=1, zero=1, sequence_parallel=tp > 1)
        path.write_text(json.dumps(layout_plan_record(job, with_nodes(load_cluster("dgx-h100-ib"), 1), 8)))
    return str(path)


# (id, argv (with {file} = an existing file, {dir} = an existing folder, {empty} = an empty file, {plan0} /
#  {plan_nostages} = plan files with a bad field, {plan} = a DAPPLE plan, {layout} / {layout_t1} = whole-layout
#  plans at T = 2 / 1), words the one line must contain)
CASES = [
    # hangs: NaN / inf / out-of-range numbers in every float option
    ("slowdown-nan", SIM + ["--slowdown", "2=nan"], ["--slowdown", "nan"]),
    ("slowdown-inf", SIM + ["--slowdown", "2=inf"], ["--slowdown", "inf"]),
    ("slowdown-zero", SIM + ["--slowdown", "2=0"], ["--slowdown"]),
    ("jitter-nan", UNIT + ["--jitter", "nan"], ["--jitter", "nan"]),
    ("jitter-inf", UNIT + ["--jitter", "inf"], ["--jitter"]),
    ("jitter-negative", UNIT + ["--jitter", "-0.1"], ["--jitter"]),
    ("slow-link-nan", SIM + ["--slow-link", "n0.g0.out=nan"], ["--slow-link"]),
    ("lr-negative", RUN + ["--lr", "-1"], ["--lr"]),
    ("lr-nan", RUN + ["--lr", "nan"], ["--lr"]),
    ("timeout-inf", RUN + ["--timeout", "inf"], ["--timeout"]),
    # hangs: sizes refused before an O(D^2) build
    ("D-huge-unit", ["simulate", "-s", "dapple", "-D", "100000", "-N", "8", "--unit-costs"], ["-D", "limit"]),
    ("D-huge-cluster", ["simulate", "-s", "dapple", "-D", "100000", "-N", "8"], ["-D", "limit"]),
    ("D-beyond-cluster", ["compare", "-D", "1000", "-N", "8"], ["--cluster", "1000 ranks"]),
    ("D-beyond-layers", ["run", "-s", "dapple", "-D", "1000", "-N", "8"], ["-D", "--model"]),
    ("N-huge", ["simulate", "-s", "dapple", "-D", "4", "-N", "10000000", "--unit-costs"], ["-N", "limit"]),
    ("N-huge-run", ["run", "-s", "dapple", "-D", "2", "-N", "10000000"], ["-N", "limit"]),
    ("N-zero", ["simulate", "-s", "dapple", "-D", "4", "-N", "0", "--unit-costs"], ["--microbatches"]),
    ("D-negative", ["bubbles", "-D", "-3"], ["--devices"]),
    ("steps-zero", RUN[:-1] + ["0"], ["--steps"]),
    # tensor parallelism and ZeRO (the simulator's T x D x R)
    ("tp-not-dividing-heads", ["simulate", "-s", "dapple", "-D", "4", "-N", "8", "--tp", "3"],
     ["--tp 3", "heads (32)"]),
    ("tp-not-dividing-kv-heads", ["simulate", "-s", "dapple", "-D", "4", "-N", "8", "--tp", "16", "-m", "llama3-8b",
                                  "-c", "dgx-h100-ib:8"], ["--tp 16", "kv_heads (8)"]),
    ("tp-beyond-cluster", ["simulate", "-s", "dapple", "-D", "8", "-N", "8", "--tp", "8"],
     ["64 GPUs (T=8 x D=8 x R=1)", "--cluster"]),
    ("sp-without-tp", SIM + ["--sequence-parallel"], ["--sequence-parallel", "--tp"]),
    ("zero-without-dp", SIM + ["--zero", "1"], ["--zero 1", "--dp"]),
    ("tp-with-unit-costs", UNIT + ["--tp", "2"], ["--tp", "--unit-costs"]),
    ("cp-not-dividing-sequence", SIM + ["-m", "llama3-8b", "-c", "dgx-h100-ib:4", "--cp", "3"],
     ["--cp 3", "divisible by 2 x 3 = 6", "2C chunks"]),
    ("cp-with-mla", SIM + ["-m", "tiny-deepseek", "--cp", "2"],
     ["--cp 2", "tiny-deepseek has latent attention (MLA)", "K/V exchange is not", "drop --cp"]),
    ("cp-ep-not-folding", SIM + ["-m", "tiny-mixtral", "--cp", "2", "--ep", "4"],
     ["--ep 4 x --etp 1 must divide", "T x C x R = 1 x 2 x 1", "more --dp"]),
    ("cp-with-kernels", SIM + ["-m", "llama3-8b", "-c", "dgx-h100-ib:4", "--cp", "2", "--cost-model", "kernels"],
     ["--cp 2", "--cost-model linear"]),
    ("cp-tp-not-dividing-node", SIM + ["-m", "llama3-8b", "-c", "dgx-h100-ib:4", "--tp", "2", "--cp", "3",
                                       "--seq-len", "6144"], ["--tp 2 x --cp 3 = 6", "8 devices per node"]),
    ("cp-too-many-gpus", SIM + ["-m", "llama3-8b", "-c", "dgx-h100-ib:1", "--tp", "2", "--cp", "2"],
     ["16 GPUs (T=2 x C=2 x D=4 x R=1)", "do not fit", "--tp/--cp/-D/--dp"]),
    ("tp-in-a-run-not-dividing-heads", RUN + ["--tp", "3"], ["--tp 3", "heads (4)"]),
    ("sp-in-a-run-without-tp", RUN + ["--sequence-parallel"], ["--sequence-parallel", "--tp > 1"]),
    ("sp-in-a-run-not-dividing-seq", RUN + ["--tp", "2", "--sequence-parallel", "--seq-len", "15"],
     ["--tp 2", "sequence length", "(15)"]),
    ("sp-not-dividing-seq", SIM + ["--tp", "2", "--sequence-parallel", "--seq-len", "15"],
     ["--tp 2", "sequence length", "(15)"]),
    ("run-cp-not-dividing-sequence", RUN + ["--cp", "3"], ["--cp 3", "(32) divisible by 2 x 3 = 6", "2C chunks"]),
    ("run-cp-sp-not-dividing-tokens", RUN + ["--cp", "2", "--tp", "4", "--sequence-parallel", "--seq-len", "36"],
     ["--cp 2 with --sequence-parallel", "18 tokens divisible by --tp 4"]),
    ("run-cp-comm-unknown", RUN + ["--cp", "2", "--cp-comm", "p2p"], ["--cp-comm", "'p2p'", "'ring', 'allgather'"]),
    ("run-cp-zero", RUN + ["--cp", "0"], ["--cp", "'0'"]),
    ("run-slowdown-rank-outside", RUN + ["--slowdown", "9=2"], ["--slowdown 9=...", "the run has ranks 0..", "D x R"]),
    ("run-slowdown-torch-runtime", RUN + ["--slowdown", "1=2", "--runtime", "torch"],
     ["pipelining's runtime", "drop --slowdown"]),
    ("run-cluster-one-pool", RUN + ["--cluster", "dgx-a100-4x8-ib"], ["takes a job's layout and model only",
                                                                      "drop --cluster"]),
    ("run-cluster-mixed-and-slowdown", RUN + ["--cluster", "a100-h100", "--slowdown", "1=2"],
     ["--cluster a100-h100 emulates its pools", "drop --slowdown"]),
    ("run-cluster-mixed-one-pool-used", RUN + ["--cluster", "a100-h100", "--device-map", "sequential"],
     ["the ranks of this run sit on pools [0, 0] of a100-h100 (device map sequential)", "nothing to emulate"]),
    ("by-pool-map-pool-too-small", SIM + ["--dp", "3", "-c", "consumer-mix", "--device-map", "by-pool", "-m", "tiny"],
     ["pool 0 has 4 devices", "stages [0, 1] on it need 6 (3 each)"]),
    ("validate-cluster-one-pool", ["validate", "--cluster", "dgx-a100-4x8-ib", "--schedules", "1f1b"],
     ["validate --cluster emulates a mixed cluster's pools", "dgx-a100-4x8-ib has one pool", "drop --cluster"]),
    ("run-slowdown-below-one", RUN + ["--slowdown", "1=0.5"], ["--slowdown 1=0.5", "a factor must be >= 1"]),
    ("run-a2a-wire-without-ep", RUN + ["--a2a-wire", "20 MB/s"], ["--a2a-wire slows the expert all-to-alls",
                                                                 "--ep E > 1"]),
    ("run-a2a-wire-mixed-cluster", RUN + ["--cluster", "a100-h100", "--a2a-wire", "20 MB/s"],
     ["--cluster a100-h100 emulates its pools", "--a2a-wire"]),
    ("a2a-wire-zero", SIM + ["--a2a-wire", "0"], ["--a2a-wire", "positive bandwidth"]),
    ("a2a-wire-no-unit", SIM + ["--a2a-wire", "20 MB"], ["--a2a-wire", "B/s"]),
    ("simulate-a2a-wire-without-profile", MOE + ["--ep", "2", "--a2a-wire", "20 MB/s"],
     ["--a2a-wire emulates", "--profile", "without --cluster"]),
    ("simulate-a2a-wire-profile-of-ep1", SIM + ["--profile", "{tp1profile}", "--a2a-wire", "20 MB/s"],
     ["--a2a-wire slows", "has none", "--ep E > 1"]),
    ("run-cp-torch-runtime", RUN + ["--cp", "2", "--runtime", "torch"], ["pipelining's runtime", "drop --cp 2"]),
    ("run-overlap-torch-runtime", RUN + ["--overlap-fb", "--runtime", "torch"], ["pipelining's runtime",
                                                                                 "drop --overlap-fb"]),
    # expert parallelism in a run (executor.expert_parallel): the simulator's rules, then the executor's reach
    ("run-ep-dense-model", RUN + ["--ep", "2", "--dp", "2"], ["--ep acts on a mixture of experts", "tiny is dense"]),
    ("run-ep-not-folding", RUN + ["--ep", "2", "--model", "tiny-mixtral"], ["--ep 2 x --etp 1 must divide",
                                                                            "T x R = 1 x 1", "more --dp"]),
    ("run-ep-not-dividing-experts", RUN + ["--ep", "3", "--dp", "3", "--model", "tiny-mixtral"],
     ["--ep 3 does not divide the 8 experts"]),
    ("run-etp-model-file", RUN + ["--etp", "2", "--dp", "2", "--model",
                                  f"{Path(__file__).parent}/data/models/dropout.py:build"],
     ["--etp 2 splits a mixture of experts", "model file", "use --ep 1 --etp 1"]),
    ("run-etp-not-dividing-width", RUN + ["--etp", "3", "--dp", "3", "--model", "tiny-deepseek"],
     ["--etp 3 does not divide the expert width 16"]),
    ("run-ep-zero3-two-copies", ["run", "-s", "chimera", "-D", "2", "-N", "2", "--steps", "1", "--ep", "2", "--dp",
                                 "2", "--zero", "3", "--model", "tiny-mixtral"],
     ["--zero 3 shards a stage", "chimera holds stage 0 on 2 devices", "--zero 1"]),
    ("run-ep-two-copies", ["run", "-s", "chimera", "-D", "2", "-N", "2", "--steps", "1", "--ep", "2", "--dp", "2",
                           "--model", "tiny-mixtral"], ["--ep 2 with chimera", "one-copy schedule"]),
    ("run-ep-torch-runtime", RUN + ["--ep", "2", "--dp", "2", "--model", "tiny-mixtral", "--runtime", "torch"],
     ["pipelining's runtime", "drop --ep 2"]),
    ("run-ep-model-file", RUN + ["--ep", "2", "--dp", "2", "--model",
                                 f"{Path(__file__).parent}/data/models/dropout.py:build"],
     ["--ep 2 splits a mixture of experts", "model file", "use --ep 1"]),
    ("run-a2a-fault-without-ep", RUN + ["--inject-fault", "1:a2a"], ["1:a2a", "expert all-to-all", "--ep > 1"]),
    ("run-ep-zero", RUN + ["--ep", "0"], ["--ep", "'0'"]),
    # the knobs of issues 43 and 46 given NaN, inf, a negative number, a folder or no path at all
    ("dp-shard-nan", SIM + ["-m", "tiny", "--dp", "2", "--zero", "2", "--dp-shard", "nan"], ["--dp-shard", "'nan'"]),
    ("dp-shard-negative", SIM + ["-m", "tiny", "--dp", "2", "--zero", "2", "--dp-shard", "-1"], ["--dp-shard", "'-1'"]),
    ("cp-inf", SIM + ["-m", "tiny", "--cp", "inf"], ["--cp", "'inf'"]),
    ("cp-negative", SIM + ["-m", "tiny", "--cp", "-2"], ["--cp", "'-2'"]),
    ("from-megatron-folder", ["simulate", "--from-megatron", "{dir}", "-c", "dgx-h100-ib"],
     ["--from-megatron", "is a folder"]),
    ("from-megatron-device", ["simulate", "--from-megatron", "/dev/null", "-c", "dgx-h100-ib"],
     ["--from-megatron", "not a regular file"]),
    ("from-torchtitan-folder", ["simulate", "--from-torchtitan", "{dir}", "-m", "llama3-8b"],
     ["--from-torchtitan", "is a folder"]),
    ("export-out-folder", ["export", "-D", "4", "-N", "8", "-m", "gpt3-1.3b", "--to", "megatron", "--out", "{dir}"],
     ["--out", "is a folder"]),
    ("export-out-unwritable", ["export", "-D", "4", "-N", "8", "-m", "gpt3-1.3b", "--to", "megatron", "--out",
                               "/proc/x/y.txt"], ["--out", "cannot be written"]),
    ("run-cp-model-file", RUN + ["-m", "{model}:in_place", "--cp", "2"],
     ["--cp 2", "model file's layers are not split"]),
    ("run-cp-with-mla", RUN + ["-m", "tiny-deepseek", "--cp", "2"],
     ["--cp 2", "one head width for Q, K and V", "12-wide query/key heads and 8-wide value heads", "drop --cp"]),
    ("run-cp-moe-capacity", RUN + ["-m", "tiny-mixtral", "--cp", "2", "--capacity-factor", "1.25"],
     ["--capacity-factor 1.25 with --cp 2", "reference drops among the whole sequence's", "--capacity-factor 0"]),
    ("run-cp-ep-not-folding", RUN + ["-m", "tiny-mixtral", "--cp", "2", "--ep", "4"],
     ["--ep 4 x --etp 1 must divide", "T x C x R = 1 x 2 x 1", "more --dp"]),
    ("run-tp-with-experts-without-sp", RUN + ["-m", "tiny-mixtral", "--tp", "2"],
     ["a mixture of experts at --tp 2 needs --sequence-parallel"]),
    ("run-tp-with-latent-attention-without-sp", RUN + ["-m", "{mladense}", "--tp", "2"],
     ["latent attention (MLA) at --tp 2 needs --sequence-parallel"]),
    ("run-tp-with-capacity-factor", RUN + ["-m", "tiny-mixtral", "--tp", "2", "--sequence-parallel",
                                           "--capacity-factor", "1.5"],
     ["--capacity-factor 1.5 with --tp 2", "drop --capacity-factor"]),
    ("run-tp-not-dividing-shared-expert", RUN + ["-m", "{oddshared}", "--tp", "2", "--sequence-parallel"],
     ["--tp 2 does not divide the shared experts' width (15)"]),
    ("run-tp-cp-with-experts", RUN + ["-m", "tiny-mixtral", "--tp", "2", "--sequence-parallel", "--cp", "2"],
     ["--tp 2 with --cp 2 for a mixture of experts", "use --tp 1 or --cp 1"]),
    ("run-capacity-factor-dense", RUN + ["--capacity-factor", "1.5"], ["--capacity-factor acts on a mixture of experts",
                                                                       "model tiny is dense"]),
    ("run-torch-experts", RUN + ["-m", "tiny-mixtral", "--runtime", "torch"],
     ["drop --model tiny-mixtral (a mixture of experts"]),
    ("run-qk-norm", RUN + ["-m", "qwen3-30b-a3b", "--seq-len", "16"], ["qwen3-30b-a3b has heads of 128"]),
    ("sp-with-run-plan", ["run", "--plan", "{plan}", "--sequence-parallel"],
     ["--sequence-parallel: the plan file fixes sequence parallelism", "off in bad.json"]),
    ("zero-in-a-run-without-dp", RUN + ["--zero", "1"], ["--zero 1", "--dp"]),
    ("zero3-in-a-run-of-a-model-file", RUN + ["-m", "{model}:in_place", "--dp", "2", "--zero", "3"],
     ["--zero 3", "gradients and weights", "model file", "--zero 0"]),
    ("reshard-in-a-run-without-zero-3", RUN + ["--dp", "2", "--zero", "2", "--reshard-after-forward"],
     ["--reshard-after-forward", "--zero 3"]),
    ("dp-shard-in-a-run-not-dividing-dp", RUN + ["--dp", "4", "--zero", "3", "--dp-shard", "3"],
     ["--dp-shard 3", "--dp 4"]),
    ("dp-shard-in-a-run-without-zero", RUN + ["--dp", "4", "--dp-shard", "2"], ["--dp-shard", "--zero"]),
    ("zero3-in-a-run-of-chimera", ["run", "-s", "chimera", "-D", "2", "-N", "2", "--dp", "2", "--zero", "3"],
     ["--zero 3", "chimera holds stage 0 on 2 devices of a replica", "--zero 1"]),
    ("sp-with-a-profile", SIM + ["--profile", "{file}", "--tp", "2", "--sequence-parallel"],
     ["--sequence-parallel", "--profile"]),
    # calibrate / validate with tensor parallelism: refused before any measurement
    ("calibrate-tp-not-dividing-heads", ["calibrate", "--tp", "3", "--out", "{dir}/c.yaml"], ["--tp 3", "heads (4)"]),
    ("calibrate-tp-zero", ["calibrate", "--tp", "0"], ["--tp"]),
    ("calibrate-tp-model-file", ["calibrate", "-m", "{model}:in_place", "--tp", "2", "--out", "{dir}/c.yaml"],
     ["--tp 2", "model file", "--tp 1"]),
    # calibrate / validate with expert parallelism: refused before any measurement
    ("calibrate-ep-of-a-dense-model", ["calibrate", "--ep", "2", "--out", "{dir}/c.yaml"], ["--ep 2", "dense"]),
    ("calibrate-ep-not-dividing-experts", ["calibrate", "-m", "tiny-mixtral", "--ep", "3", "--out", "{dir}/c.yaml"],
     ["--ep 3", "8 experts"]),
    ("calibrate-ep-model-file", ["calibrate", "-m", "{model}:in_place", "--ep", "2", "--out", "{dir}/c.yaml"],
     ["--ep 2", "model file", "--ep 1"]),
    ("validate-ep-of-a-dense-model", ["validate", "--ep", "2", "--dp", "2", "--plot", "{dir}/v.png"],
     ["--ep 2", "dense"]),
    ("validate-ep-not-dividing-dp", ["validate", "-m", "tiny-mixtral", "--ep", "2", "--plot", "{dir}/v.png"],
     ["--ep 2", "--dp a multiple of 2"]),
    ("validate-ep-with-a-profile-of-ep1", ["validate", "--ep", "2", "--dp", "2", "--profile", "{tp1profile}"],
     ["measured at --ep 1, not --ep 2", "calibrate with --ep 2"]),
    ("validate-tp-not-dividing-heads", ["validate", "--tp", "3", "--plot", "{dir}/v.png"], ["--tp 3", "heads (4)"]),
    ("validate-tp-model-file", ["validate", "-m", "{model}:in_place", "--tp", "2", "--plot", "{dir}/v.png"],
     ["--tp 2", "model file"]),
    ("validate-tp-with-a-profile-of-t1", ["validate", "--tp", "2", "--profile", "{tp1profile}"],
     ["measured at --tp 1, not --tp 2", "calibrate with --tp 2"]),
    ("validate-t1-with-a-profile-of-tp2", ["validate", "--tp", "1", "--profile", "{tp2profile}"],
     ["measured at --tp 2, not --tp 1"]),
    ("validate-tp2-profile-more-processes-than-cores", ["validate", "-D", "4", "--profile", "{tp2profile}"],
     ["8 processes (4 ranks x T=2) on 2 cores", "--ranks 4"]),
    ("simulate-tp2-profile-at-t1", SIM + ["--profile", "{tp2profile}"], ["measured at --tp 2, not --tp 1"]),
    ("simulate-tp2-profile-on-a-cluster", SIM + ["--tp", "2", "--profile", "{tp2profile}", "-c", "dgx-a100-1x8"],
     ["--tp 2", "--cluster dgx-a100-1x8", "--tp 1"]),
    ("profile-tp-nan", SIM + ["--profile", "{tpnan}"], ["tpnan.yaml", "'tp'"]),
    ("profile-tp-zero", SIM + ["--profile", "{tpzero}"], ["tpzero.yaml", "'tp'", ">= 1"]),
    ("profile-tp-without-allreduce", SIM + ["--profile", "{tpnoar}"], ["tpnoar.yaml", "tp_allreduce"]),
    ("profile-tp-allreduce-inf", SIM + ["--tp", "2", "--profile", "{tparinf}"],
     ["tparinf.yaml", "tp_allreduce.bandwidth"]),
    ("profile-tp-not-dividing-heads", SIM + ["--tp", "3", "--profile", "{tp3}"], ["tp3.yaml", "tp 3", "heads (4)"]),
    ("hf-config-unknown-arch", SIM + ["-m", "{hf_bert}"], ["'architectures'", "BertForMaskedLM", "Llama, Mistral"]),
    ("hf-config-folder", SIM + ["-m", "{dir}/x.json"], ["x.json"]),
    # silent wrong results
    ("slow-link-unused", SIM + ["--slow-link", "n1.nic0.out=4"], ["--slow-link", "never crosses"]),
    ("slow-link-unknown", SIM + ["--slow-link", "nope=4"], ["--slow-link", "nope"]),
    ("oversubscription-on-flat", SIM + ["-c", "dgx-a100-4x8-ib", "--oversubscription", "4"],
     ["--oversubscription", "flat", "--fabric fat-tree"]),
    ("slow-link-unit-costs", UNIT + ["--slow-link", "n0.nic0.out=4"], ["--slow-link", "--unit-costs", "no links"]),
    ("profile-and-model", SIM + ["--profile", "{file}", "-m", "tiny"], ["--profile", "--model"]),
    ("unit-and-cluster", UNIT + ["-c", "dgx-a100-1x8"], ["--unit-costs", "--cluster"]),
    ("fault-unknown-token", RUN + ["--inject-fault", "1:F9.s1"], ["--inject-fault", "F9.s1"]),
    ("fault-rank-beyond", RUN + ["--inject-fault", "5:F0.s1"], ["--inject-fault", "ranks 0..1"]),
    ("fault-step-beyond", RUN + ["--inject-fault", "1:F0.s1:7"], ["--inject-fault", "steps"]),
    ("fault-syntax", RUN + ["--inject-fault", "nonsense"], ["--inject-fault", "RANK:TOKEN"]),
    # tracebacks: files
    ("plan-microbatches-0", ["simulate", "--plan", "{plan0}"], ["bad.json", "microbatches"]),
    ("plan-no-stages", ["run", "--plan", "{plan_nostages}"], ["bad.json", "stages"]),
    ("plan-missing", ["simulate", "--plan", "{dir}/none.json"], ["plan file", "does not exist"]),
    ("plan-folder", ["simulate", "--plan", "{dir}"], ["plan file", "folder"]),
    ("data-missing", RUN + ["--data", "{dir}/none.txt"], ["--data", "does not exist"]),
    ("data-folder", RUN + ["--data", "{dir}"], ["--data", "folder"]),
    ("data-empty", RUN + ["--data", "{empty}"], ["--data", "empty"]),
    ("model-file-empty", SIM + ["-m", "{empty}"], ["model file", "empty"]),
    ("model-yaml-nan", SIM + ["-m", "{nanmodel}"], ["nanmodel.yaml", "hidden"]),
    ("cluster-yaml-inf", SIM + ["-c", "{infcluster}"], ["infcluster.yaml", "bandwidth"]),
    ("cluster-pod-over-nan", SIM + ["-c", "{podnan}"], ["podnan.yaml", "pod_oversubscription", "nan"]),
    ("cluster-pod-over-below-1", SIM + ["-c", "{podhalf}"], ["podhalf.yaml", "pod_oversubscription", ">= 1"]),
    ("cluster-pod-zero", SIM + ["-c", "{podzero}"], ["podzero.yaml", "nodes_per_pod", ">= 1"]),
    ("cluster-pod-not-whole-leaves", SIM + ["-c", "{podleaf}"], ["podleaf", "nodes_per_pod (3)", "nodes_per_leaf (2)"]),
    ("profile-folder", SIM + ["--profile", "{dir}"], ["calibration profile", "folder"]),
    ("stage-costs-empty", SIM + ["--stage-costs", "{empty}"], ["--stage-costs", "empty"]),
    ("stage-costs-and-model", SIM + ["--stage-costs", "{file}", "-m", "tiny"], ["--stage-costs", "--model"]),
    ("stage-costs-activation-w-nan", SIM + ["--stage-costs", "{sc_actw_nan}"],
     ["sc_actw_nan.yaml", "'activation_w' must be"]),
    ("stage-costs-activation-w-inf", SIM + ["--stage-costs", "{sc_actw_inf}"],
     ["sc_actw_inf.yaml", "'activation_w' must be"]),
    ("stage-costs-activation-w-neg", SIM + ["--stage-costs", "{sc_actw_neg}"],
     ["sc_actw_neg.yaml", "'activation_w' must be"]),
    ("stage-costs-blocking-not-bool", SIM + ["--stage-costs", "{sc_blocking}"], ["sc_blocking.yaml", "true or false"]),
    ("memory-limit-fixed-order", UNIT + ["--memory-limit", "8"], ["--memory-limit", "zb-auto only"]),
    ("memory-limit-bad", UNIT + ["--memory-limit", "lots"], ["--memory-limit"]),
    ("memory-limit-run", ["run", "-s", "zb-auto", "-D", "2", "-N", "2", "--memory-limit", "4"],
     ["--memory-limit", "executor"]),
    # tracebacks: output paths under an existing file, refused before any work
    ("plot-under-file", UNIT + ["--plot", "{file}/t.png"], ["--plot", "is a file"]),
    ("trace-under-file", RUN + ["--trace", "{file}/t.csv"], ["--trace", "is a file"]),
    ("plan-out-under-file", ["plan", "-m", "tiny", "-c", "v100-2x8-25gbe", "-G", "16", "--out", "{file}/p.json"],
     ["--out", "is a file"]),
    ("calibrate-out-under-file", ["calibrate", "--out", "{file}/c.yaml"], ["--out", "is a file"]),
    ("validate-plot-under-file", ["validate", "--plot", "{file}/v.png"], ["--plot", "is a file"]),
    ("validate-report-under-file", ["validate", "--report", "{file}/reports"], ["--report", "is a file"]),
    ("compare-out-is-file", ["compare", "-D", "2", "-N", "2", "--unit-costs", "--out", "{file}"], ["--out", "file"]),
    ("demo-out-is-file", ["demo", "--out", "{file}"], ["--out", "file"]),
    # a folder whose permission bits allow writing (to root) where no file can be created: /proc
    ("plan-seq-len-zero", LAYOUT + ["--seq-len", "0"], ["--seq-len", "0"]),
    ("plan-seq-len-nan", LAYOUT + ["--seq-len", "nan"], ["--seq-len", "nan"]),
    ("plan-seq-len-with-dapple", ["plan", "-m", "tiny", "-c", "v100-2x8-25gbe", "-G", "16", "--seq-len", "64",
                                  "--search", "dapple"], ["--seq-len applies to the whole-layout search", "--search"]),
    ("plan-tp-of-a-layer-profile", ["plan", "-m", "vgg-19", "-c", "dgx-h100-ib:4", "-G", "64", "--tp", "auto"],
     ["--tp", "vgg-19", "without --tp"]),
    ("plan-out-in-proc", LAYOUT + ["--out", "/proc/pipetwin-plan.json"], ["--out", "/proc", "cannot be written"]),
    ("chrome-trace-in-proc", SIM + ["--chrome-trace", "/proc/pipetwin.json"],
     ["--chrome-trace", "/proc", "cannot be written"]),
    ("run-trace-in-proc", RUN + ["--trace", "/proc/pipetwin.csv"], ["--trace", "/proc", "cannot be written"]),
    ("demo-out-in-proc", ["demo", "--out", "/proc/pipetwin-demo"], ["--out", "/proc", "cannot be written"]),
    ("reproduce-out-in-proc", ["reproduce", "zero-bubble", "--quick", "--out", "/proc/pipetwin-zb"],
     ["--out", "/proc", "cannot be written"]),
    ("reproduce-unknown", ["reproduce", "nope"], ["target", "nope"]),
    # options that do nothing where they are given
    ("recompute-with-plan", ["simulate", "--plan", "{plan}", "--recompute", "full"],
     ["--recompute: the plan file fixes recomputation", "recompute none in bad.json"]),
    ("run-recompute-with-plan", ["run", "--plan", "{plan}", "--recompute", "full"], ["--recompute", "plan file fixes"]),
    # a plan file fixes the layout, model and cluster: the options that would change them are refused,
    # even when given at their defaults (the what-ifs it takes are applied: test_planner_layout.py)
    ("plan-zero-default", ["simulate", "--plan", "{layout}", "--zero", "0"],
     ["--zero: the plan file fixes ZeRO (zero 1 in layout-t2.json); drop --zero or plan again"]),
    ("plan-zero-dapple", ["simulate", "--plan", "{plan}", "--zero", "1"], ["--zero", "zero 0 in bad.json"]),
    ("plan-device-map", ["simulate", "--plan", "{layout}", "--device-map", "sequential"],
     ["--device-map: the plan file fixes the device map", "device map megatron in layout-t2.json"]),
    ("plan-device-map-dapple", ["simulate", "--plan", "{plan}", "--device-map", "sequential"],
     ["--device-map", "the planner's placement"]),
    ("plan-sequence-parallel", ["simulate", "--plan", "{layout}", "--sequence-parallel"],
     ["--sequence-parallel", "sequence parallel on"]),
    ("plan-recompute-default", ["simulate", "--plan", "{layout}", "--recompute", "none"],
     ["--recompute", "recompute none in layout-t2.json"]),
    ("plan-micro-batch", ["simulate", "--plan", "{layout}", "--micro-batch", "2"], ["--micro-batch", "micro-batch 1"]),
    ("plan-partition", ["simulate", "--plan", "{plan}", "--partition", "5,5"], ["--partition", "the layer partition"]),
    ("plan-seq-len", ["simulate", "--plan", "{layout}", "--seq-len", "16"], ["--seq-len", "sequence length 32"]),
    ("plan-nodes", ["simulate", "--plan", "{layout}", "--nodes", "2"], ["--nodes", "the cluster's size (1 nodes"]),
    ("plan-cluster-and-tp", ["simulate", "--plan", "{layout}", "--tp", "2", "-c", "dgx-h100-ib"],
     ["--tp: the plan file fixes tensor parallelism (T 2", "drop --tp, --cluster or plan again"]),
    ("plan-unit-costs", ["simulate", "--plan", "{layout}", "--unit-costs"], ["--unit-costs", "the costs"]),
    ("plan-profile-batch", ["simulate", "--plan", "{plan}", "--profile-batch", "4"], ["--profile-batch", "the costs"]),
    ("plan-tp-overlap-t1", ["simulate", "--plan", "{layout_t1}", "--tp-overlap"],
     ["--tp-overlap: the plan file fixes tensor parallelism (T 1 in layout-t1.json)"]),
    ("plan-tp-overlap-dapple", ["simulate", "--plan", "{plan}", "--tp-overlap"], ["--tp-overlap", "T 1 in bad.json"]),
    ("plan-cost-model-dapple", ["simulate", "--plan", "{plan}", "--cost-model", "linear"],
     ["--cost-model: the plan file fixes the layer costs"]),
    ("run-plan-zero-default", ["run", "--plan", "{layout}", "--zero", "0"], ["--zero", "zero 1 in layout-t2.json"]),
    ("run-plan-seq-len", ["run", "--plan", "{plan}", "--seq-len", "16"], ["--seq-len", "plan file fixes"]),
    ("run-plan-micro-batch", ["run", "--plan", "{layout}", "--micro-batch", "2"], ["--micro-batch", "micro-batch 1"]),
    ("run-plan-profile", ["run", "--plan", "{plan}", "--profile", "{file}"], ["--profile", "the layer partition"]),
    # --runtime torch: what torch.distributed.pipelining's runtime cannot train as pipetwin does
    ("run-torch-unknown-runtime", RUN + ["--runtime", "megatron"], ["--runtime", "'megatron'", "'pipetwin', 'torch'"]),
    ("run-torch-two-copies", RUN + ["-s", "chimera", "--runtime", "torch"],
     ["chimera has 2 model copies", "the nearest it runs is dapple"]),
    ("run-torch-bitpipe", RUN + ["-s", "bitpipe", "-N", "4", "--runtime", "torch"],
     ["bitpipe has 2 model copies", "the nearest it runs is zb-v"]),
    ("run-torch-reference", RUN + ["--runtime", "torch", "--reference"],
     ["--runtime torch", "--reference", "drop one"]),
    ("run-torch-zero", RUN + ["--runtime", "torch", "--dp", "2", "--zero", "2"], ["replicated whole", "drop --zero 2"]),
    ("run-torch-tp", RUN + ["--runtime", "torch", "--tp", "2"], ["drop --tp 2"]),
    ("run-torch-recompute", RUN + ["--runtime", "torch", "--recompute", "full"], ["drop --recompute full"]),
    ("run-torch-bf16", RUN + ["--runtime", "torch", "--dtype", "bf16"], ["fp32", "drop --dtype bf16"]),
    ("run-torch-model-file", RUN + ["--runtime", "torch", "-m", "{model}:in_place"], ["(a model file)"]),
    ("run-torch-fault", RUN + ["--runtime", "torch", "--inject-fault", "1:F0.s1"], ["drop --inject-fault 1:F0.s1"]),
    ("run-torch-csv-out-of-order", ["run", "--schedule-file", "{torch_swapped}", "--runtime", "torch"],
     ["swapped.csv", "runs forward 0 after forward 1", "micro-batch order"]),
    ("run-torch-csv-spaced", ["run", "--schedule-file", "{torch_spaced}", "--runtime", "torch"],
     ["'0F0 0F1 0B0 0B1' is not one action as torch writes them", "comma-separated"]),
    ("chunks-without-chunks", ["simulate", "-s", "zb-v", "-D", "4", "-N", "8", "--unit-costs", "--chunks", "3"],
     ["--chunks", "interleaved", "zb-v"]),
    ("chunks-compare-none-chunked", ["compare", "-D", "4", "-N", "8", "--unit-costs", "--schedules", "dapple,gpipe",
                                     "--chunks", "3"], ["--chunks", "dapple, gpipe"]),
    ("chunks-run", RUN + ["--chunks", "4"], ["--chunks", "dapple"]),
    ("partition-with-unit-costs", UNIT + ["--partition", "1,1,1,1"], ["--partition", "--unit-costs"]),
    ("recompute-with-unit-costs", UNIT + ["--recompute", "full"], ["--recompute", "--unit-costs"]),
    ("fault-with-reference", RUN + ["--reference", "--inject-fault", "1:F0.s1"], ["--inject-fault", "--reference"]),
    ("plan-schedule-never-planned", ["plan", "-m", "bert-48", "-c", "v100-2x8-25gbe", "-G", "64", "--no-progress",
                                     "--no-baselines", "--schedules", "chimera"], ["chimera", "dapple search"]),
    ("sweep-no-schedules", ["sweep", "-s", "", "-D", "4", "-N", "8", "--unit-costs", "--out", "{dir}/sw"],
     ["--schedules", "names no schedule"]),
    ("model-yaml-key-twice", SIM + ["-m", "{dupmodel}"], ["dupmodel.yaml", "'hidden'", "twice"]),
    ("cluster-yaml-key-twice", SIM + ["-c", "{dupcluster}"], ["dupcluster.yaml", "'bandwidth'", "twice"]),
    ("profile-key-twice", ["simulate", "-s", "dapple", "-D", "2", "-N", "2", "--profile", "{dupprofile}"],
     ["dupprofile.yaml", "'latency'", "twice"]),
    ("profile-measured-cut-short", ["simulate", "-s", "dapple", "-D", "2", "-N", "2", "--profile", "{cutprofile}"],
     ["cutprofile.yaml", "precision", "cut short"]),
    ("slowdown-below-1", SIM + ["--slowdown", "2=0.001"], ["--slowdown", "0.001", ">= 1"]),
    ("slow-link-below-1", SIM + ["--slow-link", "n0.nic0.out=0.5"], ["--slow-link", ">= 1"]),
    ("jitter-beyond-1", UNIT + ["--jitter", "5"], ["--jitter", "[0, 1]"]),
    # your model file
    ("data-not-a-regular-file", RUN + ["--data", "/dev/zero"], ["--data", "/dev/zero", "not a regular file"]),
    ("model-py-without-func", SIM + ["-m", "{model}"], ["model.py", ":FUNC"]),
    ("run-m-py-without-func", RUN + ["-m", "{model}"], ["model.py", ":FUNC"]),
    ("model-in-place-on-input", RUN + ["-m", "{model}:in_place"], ["layer 1 (AddOne)", "in place"]),
    ("model-integer-inside-a-stage", RUN + ["-m", "{model}:integer_cut"], ["layer 1 (Tok)", "integer", "stage 1"]),
    ("model-build-exits", RUN + ["-m", "{model}:exits"], ["exits()", "sys.exit(0)"]),
    # a model too big for the host: counted on the meta device, refused before a weight is made
    ("model-too-big-to-run", RUN + ["-m", "{model}:huge"], ["huge", "running 2 ranks of its 160,000,000,081 "
                                                           "parameters", "GiB of memory on this host", "-D/--dp"]),
    ("model-too-big-to-build", ["validate", "-m", "{model}:huge", "--plot", "{dir}/v.png"],
     ["huge", "building its 160,000,000,081 parameters", "GiB of memory on this host"]),
    # a memory limit the device does not have
    ("plan-memory-limit-above-the-device", ["plan", "-m", "gpt3-1.3b", "-c", "dgx-a100-4x8-ib", "-G", "64",
                                            "--memory-limit", "10 TiB", "--no-progress"],
     ["--memory-limit 10 TiB", "a100's 80 GiB", "--force"]),
    # the whole-layout planner (plan --tp)
    ("plan-layout-no-plan-fits", LAYOUT + ["-m", "llama3-405b", "-c", "dgx-h100-ib:1", "-G", "8", "--schedules",
                                           "dapple", "--micro-batches", "1", "--recompute", "full"],
     ["no plan fits: the smallest needs", "per GPU", "more than the", "usable"]),
    ("plan-layout-gpus-not-multiple", LAYOUT + ["--gpus", "12"], ["--gpus 12", "multiple of the 8 GPUs"]),
    ("plan-gpus-zero", LAYOUT + ["--gpus", "0"], ["argument --gpus: must be an integer >= 1; got '0'"]),
    ("plan-gpus-nan", LAYOUT + ["--gpus", "nan"], ["argument --gpus: must be an integer >= 1; got 'nan'"]),
    ("plan-gpus-negative", LAYOUT + ["--gpus", "-8"], ["argument --gpus: must be an integer >= 1; got '-8'"]),
    # -D is the pipeline's D everywhere: the GPU budget of old (plan --devices N) is refused, naming --gpus
    ("plan-devices-as-a-gpu-budget", LAYOUT + ["--devices", "512"],
     ["--devices 512", "pipeline's devices D", "--gpus N"]),
    ("plan-dapple-devices", ["plan", "-m", "bert-48", "-c", "v100-2x8-25gbe", "-G", "64", "--search", "dapple",
                             "--devices", "16"], ["--devices is the pipeline's devices D", "--gpus N"]),
    ("plan-devices-with-a-dapple-option", ["plan", "-m", "tiny", "-c", "dgx-a100-ib:1", "-G", "8", "--devices", "4",
                                           "--no-baselines"], ["--devices", "--no-baselines", "--gpus N"]),
    ("plan-layout-batch-not-divisible", LAYOUT + ["-G", "7", "--micro-batches", "2"],
     ["-G 7 is not divisible", "use a multiple of 2"]),
    ("plan-tp-not-dividing-node", LAYOUT + ["--tp", "3"], ["--tp 3", "does not divide the 8 GPUs of a node"]),
    ("plan-tp-not-dividing-model", LAYOUT + ["-m", "tiny", "--tp", "8"], ["--tp 8", "heads (4)"]),
    ("plan-tp-zero", LAYOUT + ["--tp", "0"], ["--tp", "integers >= 1", "'0'"]),
    ("plan-tp-nan", LAYOUT + ["--tp", "nan"], ["--tp", "integers >= 1", "'nan'"]),
    ("plan-micro-batches-negative", LAYOUT + ["--micro-batches", "-2"], ["--micro-batches", "integers >= 1"]),
    ("plan-micro-batches-inf", LAYOUT + ["--micro-batches", "inf"], ["--micro-batches", "'inf'"]),
    ("plan-layout-memory-limit-nan", LAYOUT + ["--memory-limit", "nan"], ["--memory-limit"]),
    ("plan-layout-dapple-option", LAYOUT + ["--uniform"], ["--uniform", "DAPPLE planner", "--tp"]),
    ("plan-layout-device-map-unknown", LAYOUT + ["--device-map", "sequential,nope"], ["--device-map", "'nope'"]),
    ("plan-device-map-with-dapple", ["plan", "-m", "tiny", "-c", "v100-2x8-25gbe", "-G", "16", "--device-map",
                                     "megatron", "--search", "dapple"], ["--device-map", "whole-layout search"]),
    ("plan-plot-with-dapple", ["plan", "-m", "tiny", "-c", "v100-2x8-25gbe", "-G", "16", "--plot", "{dir}/p.png",
                               "--search", "dapple"], ["--plot", "whole-layout search"]),
    ("plan-plot-under-file", LAYOUT + ["--plot", "{file}/p.png"], ["--plot", "is a file"]),
    ("plan-plot-is-folder", LAYOUT + ["--plot", "{dir}"], ["--plot", "folder"]),
    ("plan-layout-out-under-file", LAYOUT + ["--out", "{file}/p.json"], ["--out", "is a file"]),
    # control characters in names are printed escaped
    ("model-name-escape", SIM + ["-m", "bad\x1b[31m"], ["model preset", "bad\\x1b[31m"]),
    ("schedule-name-escape", ["simulate", "-s", "zz\x07", "-D", "4", "-N", "8"], ["zz\\x07"]),
    ("cluster-name-escape", SIM + ["-c", "no\x1bpe"], ["no\\x1bpe"]),
    # long work is bounded, the bound stated
    ("bubbles-max-k-huge", ["bubbles", "--max-k", "1000"],
     ["--max-k 1000", "ops, beyond the table's limit", "use --max-k <="]),
    ("plan-global-batch-huge", ["plan", "-m", "gpt-96", "-c", "dgx-a100-ib:4", "-G", "100000000"],
     ["-G 100,000,000", "102,400,000,000 tokens per step", "--global-tokens"]),
    # tracebacks and truncated files: a full disk (ENOSPC) is one line naming the path
    ("chrome-trace-disk-full", UNIT + ["--chrome-trace", "/dev/full"], ["Chrome trace /dev/full", "No space left"]),
    ("trace-disk-full", UNIT + ["--trace", "/dev/full"], ["trace /dev/full", "No space left"]),
    ("plot-disk-full", UNIT + ["--plot", "/dev/full"], ["figure /dev/full", "No space left"]),
    ("plan-out-disk-full", ["plan", "-m", "tiny", "-c", "v100-2x8-25gbe", "-G", "16", "--no-progress",
                            "--no-baselines", "--out", "/dev/full"], ["plan file /dev/full", "No space left"]),
    ("run-trace-disk-full", RUN + ["--trace", "/dev/full"], ["trace /dev/full", "No space left"]),
    # names over 255 bytes (ENAMETOOLONG), refused while parsing
    ("trace-name-too-long", UNIT + ["--trace", "{dir}/" + "t" * 300 + ".csv"], ["--trace", "304 bytes", "255"]),
    ("sweep-out-name-too-long", ["sweep", "-D", "2", "-N", "2", "--unit-costs", "--out", "{dir}/" + "d" * 300],
     ["--out", "300 bytes"]),
    ("calibrate-out-name-too-long", ["calibrate", "--out", "{dir}/" + "c" * 300 + "/p.yaml"], ["--out", "300 bytes"]),
    # silent wrong results: a sweep folder holds one experiment
    ("sweep-other-model", SWEEP + ["-m", "gpt3-1.3b", "--out", "{sweep}"],
     ["--out", "model 'tiny' there, 'gpt3-1.3b'"]),
    ("sweep-other-memory-reserve", SWEEP + ["-m", "tiny", "--memory-reserve", "2 GiB", "--out", "{sweep}"],
     ["--out", "memory_reserve None there, 2147483648.0 here", "another --out"]),
    ("sweep-zero-4", SWEEP + ["-m", "tiny", "--zero", "0,4", "--out", "{dir}/z"],
     ["--zero", "out of 0, 1, 2, 3", "'0,4'"]),
    ("sweep-recompute-unknown", SWEEP + ["-m", "tiny", "--recompute", "nan", "--out", "{dir}/r"],
     ["--recompute", "none, selective, full", "'nan'"]),
    ("sweep-other-fabric", SWEEP + ["-m", "tiny", "--fabric", "fat-tree", "--out", "{sweep}"],
     ["cluster.fabric None there, 'fat-tree' here"]),
    ("sweep-other-cost-model", SWEEP + ["-m", "tiny", "--cost-model", "linear", "--out", "{sweep}"],
     ["cost_model 'kernels' there, 'linear' here"]),
    ("sweep-other-cluster", SWEEP + ["-m", "tiny", "-c", "dgx-a100-1x8", "--out", "{sweep}"],
     ["cluster.name 'dgx-a100-4x8-ib' there, 'dgx-a100-1x8' here"]),
    ("sweep-folder-in-use", SWEEP + ["-m", "tiny", "--out", "{locked}"],
     ["--out", "is being written by another sweep", "another --out"]),
    ("sweep-folder-of-unknown-experiment", SWEEP + ["-m", "tiny", "--out", "{unrecorded}"],
     ["--out", "sweep.csv but no sweep.json"]),
    ("model-name-too-long", SIM + ["-m", "{dir}/" + "m" * 300 + ".yaml"], ["model file", "305 bytes"]),
    # output paths (issue 47): every format checked while parsing, no output onto an input
    ("plot-format-unknown", UNIT + ["--plot", "{dir}/t.bmp"], ["argument --plot", "'.bmp'", ".png, .pdf, .svg"]),
    ("plot-no-extension", UNIT + ["--plot", "{dir}/timeline"], ["argument --plot", "it has no extension"]),
    ("trace-not-csv", UNIT + ["--trace", "{dir}/t.tsv"], ["argument --trace", "'.tsv'", "written as .csv"]),
    ("chrome-trace-not-json", UNIT + ["--chrome-trace", "{dir}/t.csv"], ["--chrome-trace", "written as .json"]),
    ("run-plot-format", RUN + ["--plot", "{dir}/t.gif"], ["argument --plot", "'.gif'"]),
    ("plan-plot-format", LAYOUT + ["--plot", "{dir}/l.txt"], ["argument --plot", "'.txt'"]),
    ("chrome-trace-onto-model", SIM + ["-m", "{hf_bert}", "--chrome-trace", "{hf_bert}"],
     ["--chrome-trace", "is the file --model reads", "give --chrome-trace another path"]),
    ("calibrate-out-onto-model", ["calibrate", "-m", "{nanmodel}", "--out", "{nanmodel}"],
     ["--out", "is the file --model reads", "overwrite that input"]),
    ("plan-out-not-json", ["plan", "-m", "tiny", "-c", "v100-2x8-25gbe", "-G", "16", "--out", "{dir}/p.yaml"],
     ["argument --out", "plan file", "written as .json"]),
    # issue 47 (2): sizes checked before anything is built; a -G that looks like tokens
    ("plan-G-looks-like-tokens", ["plan", "-m", "llama3-8b", "-c", "dgx-h100-ib:4", "-G", "4194304"],
     ["-G 4,194,304 sequences of 8,192 tokens", "34,359,738,368 tokens per step", "--global-tokens 4M (= -G 512)"]),
    ("plan-G-looks-like-tokens-dapple", ["plan", "-m", "gpt3-1.3b", "-c", "dgx-a100-1x8", "--search", "dapple",
                                         "-G", "65536"], ["-G 65,536", "--global-tokens 64k (= -G 32)"]),
    ("plan-global-tokens-not-whole", ["plan", "-m", "llama3-8b", "-c", "dgx-h100-ib:4", "--global-tokens", "4000000"],
     ["--global-tokens 4,000,000", "8,192-token", "nearest is 3,997,696 tokens (-G 488)"]),
    ("plan-global-tokens-bad", ["plan", "-m", "llama3-8b", "-c", "dgx-h100-ib:4", "--global-tokens", "4.5x"],
     ["--global-tokens", "'4.5x'", "4M"]),
    ("plan-global-tokens-zero", ["plan", "-m", "llama3-8b", "-c", "dgx-h100-ib:4", "--global-tokens", "0"],
     ["--global-tokens", "'0'"]),
    ("plan-global-tokens-layer-profile", ["plan", "-m", "vgg-19", "-c", "dgx-a100-1x8", "--global-tokens", "64k"],
     ["--global-tokens", "sequence length", "-G"]),
    ("plan-no-global-batch", ["plan", "-m", "llama3-8b", "-c", "dgx-h100-ib:4"], ["-G", "--global-tokens"]),
    ("plan-G-and-global-tokens", ["plan", "-m", "llama3-8b", "-c", "dgx-h100-ib:4", "-G", "8", "--global-tokens",
                                  "64k"], ["-G", "--global-tokens", "not both"]),
    ("simulate-ops-beyond-limit", ["simulate", "-s", "dapple", "-D", "64", "-N", "100000", "-m", "gpt3-175b", "-c",
                                   "a100-8x8-ib"], ["-N 100000", "89,600,000 ops", "4,000,000", "-N 4,464"]),
    ("plan-file-ops-beyond-limit", ["simulate", "--plan", "{plan_huge}"],
     ["bad.json: field 'plan.microbatches' 10,000,000", "beyond pipetwin's limit of 4,000,000 ops"]),
    ("compare-ops-beyond-limit", ["compare", "--schedules", "dapple,gpipe", "-D", "64", "-N", "100000", "-m",
                                  "gpt3-175b", "-c", "a100-8x8-ib"], ["-N 100000", "4,000,000", "-N 4,464"]),
    # issue 47 (6): messages: one short line naming the field or option
    ("partition-of-4000-entries", SIM + ["-m", "gpt3-1.3b", "--partition", ",".join(["1"] * 4000)],
     ["partition [1, 1, 1, 1, 1, 1, ..., 1, 1] (4,000 entries)", "4000 stage(s)"]),
    ("memory-reserve-above-device", SIM + ["-m", "gpt3-1.3b", "-c", "dgx-a100-1x8", "--memory-reserve", "100GiB"],
     ["--memory-reserve 100 GiB", "a100's 80 GiB", "nothing would be usable"]),
    ("memory-reserve-equal-to-device-compare", ["compare", "-D", "2", "-N", "2", "-m", "tiny", "-c", "dgx-a100-1x8",
                                                "--memory-reserve", "80GiB"], ["--memory-reserve 80 GiB"]),
    ("memory-reserve-above-device-plan-file", ["simulate", "--plan", "{layout}", "--memory-reserve", "1TiB"],
     ["--memory-reserve 1 TiB", "80 GiB"]),
    ("plan-file-as-model", SIM + ["-m", "{plan}"], ["is a pipetwin plan file", "not a Hugging Face config",
                                                    "give it as --plan"]),
    ("layout-plan-file-as-model", SIM + ["-m", "{layout}"], ["is a pipetwin plan file", "give it as --plan"]),
    ("plan-file-as-stage-costs", SIM + ["--stage-costs", "{plan}"], ["not a stage-costs file", "give it as --plan"]),
    ("plan-file-as-profile", SIM + ["--profile", "{plan}"], ["not a calibration profile", "give it as --plan"]),
    ("plan-file-as-cluster", SIM + ["-m", "tiny", "-c", "{layout}"], ["not a cluster spec", "give it as --plan"]),
    ("plan-file-as-schedule-file", SIM + ["--schedule-file", "{plan}"], ["not a schedule file", "give it as --plan"]),
    ("stage-costs-as-plan", ["simulate", "--plan", "{sc_blocking}"], ["is a stage-costs file",
                                                                     "give it as --stage-costs"]),
    ("model-spec-as-plan", ["simulate", "--plan", "{nanmodel}"], ["is a model spec", "give it as --model"]),
    ("profile-as-plan", ["simulate", "--plan", "{tp1profile}"], ["is a calibration profile", "give it as --profile"]),
    ("profile-as-model", SIM + ["-m", "{tp1profile}"], ["is a calibration profile", "give it as --profile"]),
    ("stage-costs-as-profile", SIM + ["--profile", "{sc_blocking}"], ["is a stage-costs file",
                                                                      "give it as --stage-costs"]),
    ("hf-config-nan-field", SIM + ["-m", "{hfnan}"], ["field 'rope_theta' is NaN, not a number"]),
    ("plan-json-nested-200000-deep", ["simulate", "--plan", "{deepjson}"], ["deep.json", "nested deeper"]),
    ("model-yaml-nested-200000-deep", SIM + ["-m", "{deepyaml}"], ["deep.yaml", "nested deeper"]),
    ("hf-config-nested-200000-deep", SIM + ["-m", "{deepjson}"], ["deep.json", "nested deeper"]),
    ("plan-file-symlink-loop", ["simulate", "--plan", "{loop}"], ["plan file", "loop.json", "symbolic link loop"]),
    ("model-symlink-loop", SIM + ["-m", "{loop}"], ["loop.json", "symbolic link loop"]),
    ("device-map-of-6000-characters", SIM + ["--device-map", ",".join(["0"] * 3000)],
     ["--device-map", "'0,0,0,", "...' (5,999 characters)", "megatron"]),
    ("model-unknown-field-of-many", SIM + ["-m", "{unknownfield}"], ["unknown field 'ffn'", "did you mean",
                                                                     "ffn_hidden", "(30 entries)"]),
    ("sweep-record-nested-200000-deep", SWEEP + ["-m", "tiny", "--out", "{deepsweep}"],
     ["sweep record", "sweep.json", "nested deeper", "another --out"]),
    ("schedule-file-as-plan", ["simulate", "--plan", "{schedtext}"], ["is a schedule file",
                                                                     "give it as --schedule-file"]),
    ("model-file-as-plan", ["simulate", "--plan", "{model}"], ["plan file", "model.py is a Python file",
                                                               "--model", "model.py:FUNC"]),
    ("plan-file-broken-link", ["simulate", "--plan", "{broken}"],
     ["plan file", "broken.json", "broken link", "nowhere.json"]),
    # the mixture-of-experts options (issue 41): NaN, inf, zero, negative, out of range, a folder for a file
    ("ep-zero", MOE + ["--ep", "0"], ["--ep", "0"]),
    ("ep-nan", MOE + ["--ep", "nan"], ["--ep", "nan"]),
    ("ep-not-folding", MOE + ["--ep", "4"], ["--ep 4 x --etp 1 must divide", "T x R = 1 x 2"]),
    ("ep-not-dividing-experts", MOE + ["--dp", "3", "--ep", "3", "-c", "dgx-h100-ib:2"],
     ["--ep 3 does not divide the 8 experts"]),
    ("etp-negative", MOE + ["--etp", "-1"], ["--etp", "-1"]),
    ("expert-imbalance-nan", MOE + ["--expert-imbalance", "nan"], ["--expert-imbalance", "nan"]),
    ("expert-imbalance-inf", MOE + ["--expert-imbalance", "inf"], ["--expert-imbalance", "inf"]),
    ("expert-imbalance-below-one", MOE + ["--expert-imbalance", "0.5"], ["--expert-imbalance", "0.5"]),
    ("expert-load-folder", MOE + ["--expert-load", "{dir}"], ["--expert-load"]),
    ("expert-load-empty", MOE + ["--expert-load", "{empty}"], ["--expert-load"]),
    ("capacity-factor-nan", MOE + ["--capacity-factor", "nan"], ["--capacity-factor", "nan"]),
    ("capacity-factor-negative", MOE + ["--capacity-factor", "-1"], ["--capacity-factor", "-1"]),
    ("capacity-factor-below-one", MOE + ["--capacity-factor", "0.5"], ["--capacity-factor", "0 (dropless)"]),
    ("route-nodes-negative", MOE + ["--route-nodes", "-1"], ["--route-nodes", "-1"]),
    ("route-nodes-flat", MOE + ["--route-nodes", "2"], ["--route-nodes", "--a2a-hierarchical"]),
    ("overlap-sm-share-nan", MOE + ["--overlap-sm-share", "nan"], ["--overlap-sm-share", "nan"]),
    ("overlap-sm-share-one", MOE + ["--overlap-sm-share", "1"], ["--overlap-sm-share", "1"]),
    ("precision-unknown", MOE + ["--precision", "fp4"], ["--precision", "fp4"]),
    ("precision-not-on-device", SIM + ["--precision", "fp8", "-m", "gpt3-1.3b", "-c", "dgx-a100-ib:1"],
     ["'a100'", "fp8"]),
    ("fp8-recipe-without-fp8", SIM + ["--fp8-recipe", "blockwise", "-m", "gpt3-1.3b", "-c", "dgx-h100-ib:1"],
     ["--fp8-recipe", "--precision fp8"]),
    ("fp8-gather-without-zero3", SIM + ["--precision", "fp8", "--fp8-gather", "-m", "gpt3-1.3b",
                                        "-c", "dgx-h100-ib:1"], ["--fp8-gather", "--zero 3"]),
    ("p2p-scatter-gather-without-tp", SIM + ["--p2p-scatter-gather", "-m", "gpt3-1.3b"],
     ["--p2p-scatter-gather", "--tp > 1"]),
    ("grad-accumulation-llama", SIM + ["--grad-accumulation", "autograd", "-m", "llama3-8b", "-c", "dgx-h100-ib:1",
                                       "--cost-model", "kernels"], ["--grad-accumulation autograd", "llama"]),
    ("grad-accumulation-unit-costs", UNIT + ["--grad-accumulation", "autograd"],
     ["--grad-accumulation", "model's formulas"]),
    ("moe-tp-without-sp", MOE + ["--dp", "1", "--tp", "2"], ["--tp 2 needs --sequence-parallel"]),
    ("overlap-fb-dense", SIM + ["--overlap-fb", "-m", "gpt3-1.3b"], ["--overlap-fb acts on a mixture of experts"]),
]
# issue 45: clusters of mixed pools (files in tests/data/pools): every bad pool field names its pool
_POOLS = str(Path(__file__).parent / "data" / "pools")
_MIXED = ["simulate", "-s", "dapple", "-D", "2", "-N", "8", "-m", "gpt3-1.3b"]
CASES += [
    ("pools-missing-field", _MIXED + ["-c", f"{_POOLS}/missing-inter.yaml"], ["missing field 'pools[1].inter'"]),
    ("pools-bad-device", _MIXED + ["-c", f"{_POOLS}/bad-device.yaml"], ["field 'pools[1].device'", "'h1000'",
                                                                         "choose one of"]),
    ("pools-bad-link", _MIXED + ["-c", f"{_POOLS}/bad-link.yaml"], ["field 'pools[1].intra'", "'nvlink9'", "known:"]),
    ("pools-zero-nodes", _MIXED + ["-c", f"{_POOLS}/zero-nodes.yaml"], ["field 'pools[0].nodes'", "integer >= 1"]),
    ("pools-unknown-field", _MIXED + ["-c", f"{_POOLS}/unknown-field.yaml"], ["unknown field 'pools[1].gpus'",
                                                                               "known: device"]),
    ("pools-not-a-list", _MIXED + ["-c", f"{_POOLS}/not-a-list.yaml"], ["field 'pools' must be a list"]),
    ("pools-no-between", _MIXED + ["-c", f"{_POOLS}/no-between.yaml"], ["2 pools need field 'between'",
                                                                         "between: ib-hdr"]),
    ("pools-fat-tree", _MIXED + ["-c", f"{_POOLS}/fat-tree.yaml"], ["field 'fabric'", "flat fabric", "remove it"]),
    ("pools-same-name", _MIXED + ["-c", f"{_POOLS}/same-name.yaml"], ["pools 0 and 1 are both named 'a100'",
                                                                       "give one a 'name:'"]),
    ("mixed-fabric-option", _MIXED + ["-c", "a100-h100", "--fabric", "fat-tree"], ["2 pools", "drop --fabric"]),
    ("mixed-nodes-option", _MIXED + ["-c", "a100-h100", "--nodes", "4"], ["2 pools", "each pool's 'nodes'"]),
    ("mixed-nodes-suffix", _MIXED + ["-c", "a100-h100:4"], ["2 pools", "each pool's 'nodes'"]),
    ("mixed-tp-spans-two-kinds", _MIXED + ["-c", "consumer-mix", "--tp", "8", "-D", "1"],
     ["--tp 8", "pool 0 (rtx-3090, 1 x 4)", "never spans two device kinds", "divides 4"]),
    ("mixed-cp", _MIXED + ["-c", "a100-h100", "--cp", "2"], ["--cp 2", "mixed cluster a100-h100", "one-pool"]),
    ("mixed-zero3", _MIXED + ["-c", "a100-h100", "--zero", "3", "--dp", "2"], ["--zero 3", "mixed cluster"]),
    ("mixed-moe", _MIXED + ["-c", "a100-h100", "-m", "mixtral-8x7b"], ["mixture of experts mixtral-8x7b",
                                                                        "mixed cluster"]),
    ("mixed-uneven-copies-same-node", _MIXED + ["-c", f"{_POOLS}/uneven.yaml", "--device-map", "copies-same-node"],
     ["pools of 4 and 8 devices per node", "--device-map sequential or megatron"]),
    ("mixed-kernels-without-constants", _MIXED + ["-c", "consumer-mix", "--cost-model", "kernels", "-D", "3"],
     ["--cost-model kernels", "rtx-3090 has none", "--cost-model linear"]),
    ("mixed-profile", ["simulate", "-s", "dapple", "-D", "2", "-N", "4", "--profile", "{tp1profile}", "-c",
                       "a100-h100"], ["scaled onto it", "one device kind", "a100, h100"]),
]
if not torch.cuda.is_available():
    CASES.append(("device-cuda-without-gpu", RUN + ["--device", "cuda"], ["--device cuda", "CUDA"]))
# issue 47 item 1: a file field the command line would refuse is refused in the file, by the same check; a
# device without the field its cost model reads; item 7: --all-replicas without a timeline
_A47 = str(Path(__file__).parent / "data" / "assumptions")
CASES += [
    ("cluster-file-flat-oversubscription", SIM + ["-m", "gpt3-1.3b", "-c", f"{_A47}/flat-oversubscribed.yaml"],
     ["flat-oversubscribed.yaml", "field 'oversubscription'", "fat-tree"]),
    ("cluster-file-flat-leaves", SIM + ["-m", "gpt3-1.3b", "-c", f"{_A47}/flat-leaves.yaml"],
     ["field 'oversubscription' and field 'nodes_per_leaf'", "fabric is flat"]),
    ("device-no-efficiency-linear", SIM + ["-m", "gpt3-1.3b", "-c", f"{_A47}/no-efficiency.yaml"],
     ["device 'noeff'", "field 'efficiency'", "linear cost model"]),
    ("device-no-efficiency-asked-linear", SIM + ["-m", "gpt3-1.3b", "-c", f"{_A47}/kernels-no-efficiency.yaml",
                                                 "--cost-model", "linear"],
     ["field 'efficiency'", "--cost-model kernels"]),
    ("hf-sliding-window-not-a-number", SIM + ["-m", f"{_A47}/bad-window.json"], ["bad-window.json",
                                                                                  "'sliding_window'", "'1k'"]),
    ("all-replicas-without-plot", UNIT + ["--dp", "2", "--all-replicas"], ["--all-replicas", "--plot"]),
    ("compare-all-replicas-without-plot", ["compare", "-D", "2", "-N", "2", "--unit-costs", "--all-replicas"],
     ["--all-replicas", "--plot"]),
]

# issue 46: export to / import from Megatron-LM and torchtitan; every refusal one line (cost_models.frameworks)
EXPORT = ["export", "-D", "4", "-N", "8", "-m", "gpt3-1.3b"]
_MG = ("nodes: 1\ngpus: 8\nMODEL_ARGS:\n  --num-layers: 8\n  --hidden-size: 256\n  --num-attention-heads: 8\n"
       "  --seq-length: 512\n  --micro-batch-size: 1\n  --global-batch-size: 16\n  --vocab-size: 1000\n"
       "  --pipeline-model-parallel-size: 2\n  --bf16: true\n")
FRAMEWORK_FILES = {
    "mg_ok": _MG,
    "mg_bf16_fp16": _MG + "  --fp16: true\n",
    "mg_global": _MG.replace("--global-batch-size: 16", "--global-batch-size: 15"),
    "mg_no_seq": _MG.replace("  --seq-length: 512\n", ""),
    "mg_no_gpus": _MG.replace("nodes: 1\ngpus: 8\n", ""),
    "mg_moe_freq": _MG + "  --num-experts: 4\n  --moe-layer-freq: '([0]+[1])*4'\n  --swiglu: true\n",
    "mg_layout_mtp": _MG + "  --pipeline-model-parallel-layout: 'Et*4|t*4mL'\n",
    "mg_twice": "--num-layers 8 --num-layers 4 --hidden-size 256\n",
    "mg_fp8": _MG.replace("  --bf16: true\n", "  --fp8-format: hybrid\n"),
    "mg_no_vocab": _MG.replace("  --vocab-size: 1000\n", "  --tokenizer-type: HuggingFaceTokenizer\n"),
    "mg_two_vp": _MG + "  --num-layers-per-virtual-pipeline-stage: 2\n  --num-virtual-stages-per-pipeline-rank: 2\n",
    "tt_ok": "NGPU=8 ./run_train.sh --module llama3 --config llama3_8b --parallelism.pipeline_parallel_degree 2\n",
    "tt_tokens": "NGPU=8 --training.max_context_length 3000 --training.num_tokens_per_microbatch_per_dp_rank 4096\n",
    "tt_accumulate": "NGPU=8 --parallelism.pipeline_parallel_degree 2 --parallelism.num_pp_microbatches 4 "
                     "--training.num_tokens_per_microbatch_per_dp_rank 2048 --training.max_context_length 2048 "
                     "--training.num_tokens_per_train_step 131072\n",
    "tt_no_gpus": "--parallelism.pipeline_parallel_degree 2\n",
}
CASES += [
    ("export-megatron-zb-v", EXPORT + ["--to", "megatron", "-s", "zb-v"],
     ["Megatron-LM cannot run zb-v", "split backward", "nearest: --schedule interleaved --chunks 2"]),
    ("export-megatron-bitpipe", EXPORT + ["--to", "megatron", "-s", "bitpipe"],
     ["cannot run bitpipe", "no bidirectional pipelines", "nearest: --schedule interleaved"]),
    ("export-megatron-gpipe", EXPORT + ["--to", "megatron", "-s", "gpipe"], ["no GPipe", "nearest: --schedule dapple"]),
    ("export-megatron-interleaved-1", EXPORT + ["--to", "megatron", "-s", "interleaved", "--chunks", "1"],
     ["--chunks 1 is 1F1B", "--schedule dapple"]),
    ("export-megatron-schedule-file", ["export", "--to", "megatron", "--schedule-file", "{schedtext}", "-m",
                                       "gpt3-1.3b"], ["not a schedule file", "torch-csv"]),
    ("export-megatron-hsdp-fsdp", EXPORT + ["--to", "megatron", "-s", "dapple", "--dp", "4", "--zero", "3",
                                            "--dp-shard", "2"], ["--dp-shard 2", "nearest --dp-shard 0"]),
    ("export-megatron-tf32", EXPORT + ["--to", "megatron", "-s", "dapple", "--precision", "tf32"],
     ["--precision tf32", "nearest --precision bf16"]),
    ("export-torchtitan-chimera", EXPORT + ["--to", "torchtitan", "-s", "chimera"],
     ["torchtitan cannot run chimera", "nearest: --schedule dapple"]),
    ("export-torch-csv-bitpipe", EXPORT + ["--to", "torch-csv", "-s", "bitpipe"],
     ["2 model copies", "the nearest it runs is zb-v"]),
    ("export-torchtitan-zero1", EXPORT + ["--to", "torchtitan", "-s", "dapple", "--dp", "2", "--zero", "1"],
     ["FSDP2", "--zero 1", "nearest --zero 3"]),
    ("export-torchtitan-fp8", EXPORT + ["--to", "torchtitan", "-s", "dapple", "--precision", "fp8", "-c",
                                        "dgx-h100-ib"], ["float8", "nearest: --precision bf16"]),
    ("export-torchtitan-csv-without-out", EXPORT + ["--to", "torchtitan", "-s", "zb-h1"],
     ["no schedule named zb-h1", "give --out FILE"]),
    ("export-torchtitan-partition", EXPORT + ["--to", "torchtitan", "-s", "dapple", "--partition", "7,5,8,6"],
     ["cannot place --partition 7,5,8,6", "nearest: --partition 7,7,6,6"]),
    ("export-unit-costs", ["export", "--to", "megatron", "-s", "dapple", "-D", "2", "-N", "2", "--unit-costs"],
     ["--unit-costs has none", "give --model"]),
    ("export-bert", EXPORT + ["--to", "megatron", "-s", "dapple", "-m", "bert-48"], ["BERT encoder"]),
    ("export-megatron-overlap-without-virtual-stages", ["export", "--to", "megatron"] + MOE[1:] + ["--ep", "2",
                                                                                            "--overlap-fb"],
     ["combined 1F1B", "nearest --schedule interleaved --variant a2a-overlap"]),
    ("export-megatron-overlap-full-recompute", ["export", "--to", "megatron", "-s", "interleaved", "--variant",
                                                "a2a-overlap"] + MOE[3:] + ["--ep", "2", "--recompute", "full"],
     ["refuses full recomputation", "nearest --recompute selective"]),
    ("from-megatron-and-model", ["simulate", "--from-megatron", "{mg_ok}", "-m", "tiny"], ["drop --model"]),
    ("from-megatron-and-torchtitan", ["simulate", "--from-megatron", "{mg_ok}", "--from-torchtitan", "{tt_ok}"],
     ["--from-megatron or --from-torchtitan, not both"]),
    ("from-megatron-and-plan", ["simulate", "--from-megatron", "{mg_ok}", "--plan", "{layout}"],
     ["--plan both bring a job"]),
    ("from-torchtitan-without-model", ["simulate", "--from-torchtitan", "{tt_ok}"], ["recipe", "give --model"]),
    ("megatron-bf16-and-fp16", ["simulate", "--from-megatron", "{mg_bf16_fp16}"], ["--bf16 and --fp16"]),
    ("megatron-global-batch", ["simulate", "--from-megatron", "{mg_global}"],
     ["--global-batch-size 15 is no multiple of --micro-batch-size 1 x DP 4"]),
    ("megatron-no-seq-length", ["simulate", "--from-megatron", "{mg_no_seq}"], ["--seq-length is missing"]),
    ("megatron-no-gpus", ["simulate", "--from-megatron", "{mg_no_gpus}"], ["how many GPUs", "give --dp R"]),
    ("megatron-moe-layer-freq", ["simulate", "--from-megatron", "{mg_moe_freq}"], ["mixes dense and MoE"]),
    ("megatron-layout-mtp", ["simulate", "--from-megatron", "{mg_layout_mtp}"], ["MTP", "multi-token"]),
    ("megatron-flag-twice", ["simulate", "--from-megatron", "{mg_twice}"], ["--num-layers is given twice"]),
    ("megatron-fp8-alone", ["simulate", "--from-megatron", "{mg_fp8}"], ["--fp8-format hybrid", "add --bf16"]),
    ("megatron-no-vocab", ["simulate", "--from-megatron", "{mg_no_vocab}"], ["HuggingFaceTokenizer",
                                                                              "--vocab-size N"]),
    ("megatron-two-virtual-flags", ["simulate", "--from-megatron", "{mg_two_vp}"],
     ["--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank, not both"]),
    ("torchtitan-tokens", ["simulate", "--from-torchtitan", "{tt_tokens}", "-m", "tiny"],
     ["4096 is no multiple of max_context_length 3000"]),
    ("torchtitan-accumulation", ["simulate", "--from-torchtitan", "{tt_accumulate}", "-m", "tiny"],
     ["gradient accumulation", "num_pp_microbatches 16"]),
    ("torchtitan-shard-without-gpus", ["simulate", "--from-torchtitan", "{tt_no_gpus}", "-m", "tiny"],
     ["data_parallel_shard_degree -1", "give --dp R"]),
    ("plan-emit-json", ["plan", "--from-megatron", "{mg_ok}", "-c", "dgx-h100-ib", "--emit", "megatron", "--json"],
     ["--emit", "pipetwin export --to TARGET --plan PLAN.json"]),
    ("plan-emit-dapple-search", ["plan", "-m", "tiny", "-c", "v100-2x8-25gbe", "-G", "16", "--search", "dapple",
                                 "--emit", "megatron"], ["--emit", "drop --search dapple"]),
    ("sweep-without-devices", ["sweep", "--no-figures", "--out", "{dir}/sw"],
     ["give --devices and --microbatches", "--from-megatron"]),
]
# issue 45 item 3: planning on a mixed cluster (the type-aware planner takes DAPPLE's space)
_PLAN_MIXED = ["plan", "-m", "gpt3-1.3b", "-c", "a100-h100", "-G", "64", "--no-progress"]
CASES += [
    ("type-blind-one-pool", ["plan", "-m", "tiny", "-c", "v100-2x8-25gbe", "-G", "16", "--type-blind"],
     ["--type-blind", "mixed cluster", "v100-2x8-25gbe has one kind"]),
    ("mixed-plan-tp", _PLAN_MIXED + ["--tp", "2"], ["--tp", "mixed cluster", "type-aware", "drop it",
                                                    "--search layout"]),
    # the whole-layout search on a mixed cluster: what the simulator prices per pool, stages whole on a pool
    ("mixed-layout-cp", _PLAN_MIXED + ["--search", "layout", "--cp", "2"], ["--cp 2", "mixed cluster a100-h100",
                                                                           "priced for one pool", "drop --cp"]),
    ("mixed-layout-device-map", _PLAN_MIXED + ["--search", "layout", "--device-map", "sequential"],
     ["--device-map sequential", "mixed cluster", "whole on a pool", "drop --device-map"]),
    ("mixed-layout-moe", ["plan", "-m", "mixtral-8x22b", "-c", "a100-h100", "-G", "64", "--no-progress", "--search",
                          "layout"], ["mixture of experts mixtral-8x22b", "one pool", "dense model"]),
    ("mixed-layout-emit", _PLAN_MIXED + ["--search", "layout", "--emit", "megatron"],
     ["--emit", "mixed cluster a100-h100", "pipetwin only", "drop --emit"]),
    ("mixed-plan-policies", _PLAN_MIXED + ["--policies", "fresh-first"], ["--policies", "by pool", "drop"]),
    ("mixed-plan-no-simulate", _PLAN_MIXED + ["--no-simulate"], ["--no-simulate", "by simulation"]),
    ("mixed-plan-schedules", _PLAN_MIXED + ["--schedules", "1f1b"], ["--schedules 1f1b", "1F1B",
                                                                     "pipetwin compare"]),
    ("mixed-plan-memory-limit", _PLAN_MIXED + ["--memory-limit", "100 GiB"], ["--memory-limit", "smallest pool",
                                                                               "--force"]),
    ("mixed-plan-emit", _PLAN_MIXED + ["--emit", "megatron"], ["--emit", "pipetwin only"]),
]


@pytest.fixture()
def files(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    empty = tmp_path / "empty"
    empty.write_text("")
    (tmp_path / "nanmodel.yaml").write_text("layers: 4\nhidden: .nan\nheads: 4\nseq_len: 8\nvocab: 16\n")
    (tmp_path / "infcluster.yaml").write_text("nodes: 1\ndevices_per_node: 8\ndevice: a100\n"
                                              "intra: {type: nvlink3, bandwidth: .inf}\ninter: ib-hdr\n")
    pods = ("nodes: 4\ndevices_per_node: 8\ndevice: a100\nintra: nvlink3\ninter: ib-hdr\nfabric: rail\n"
            "nodes_per_leaf: 2\n")
    for name, extra in (("podnan", "nodes_per_pod: 2\npod_oversubscription: .nan\n"),
                        ("podhalf", "nodes_per_pod: 2\npod_oversubscription: 0.5\n"),
                        ("podzero", "nodes_per_pod: 0\n"), ("podleaf", "nodes_per_pod: 3\n")):
        (tmp_path / f"{name}.yaml").write_text(pods + extra)
    (tmp_path / "mladense.yaml").write_text(     # tiny-deepseek's latent attention, a dense MLP
        "name: mla-dense\nkind: llama\nlayers: 4\nhidden: 32\nheads: 4\nhead_size: 8\nkv_lora_rank: 16\n"
        "q_lora_rank: 24\nrope_head_dim: 4\nv_head_size: 8\nffn_hidden: 64\nseq_len: 16\nvocab: 64\n"
        "micro_batch: 2\ndtype_bytes: 4\n")
    (tmp_path / "oddshared.yaml").write_text(   # tiny-deepseek's shape, a shared expert 15 wide
        (Path(__file__).parents[1] / "cost_models/presets/models/tiny-deepseek.yaml").read_text()
        .replace("name: tiny-deepseek", "name: odd-shared").replace("shared_ffn: 16", "shared_ffn: 15"))
    (tmp_path / "dupmodel.yaml").write_text("layers: 4\nhidden: 64\nheads: 4\nseq_len: 8\nvocab: 16\nhidden: 32\n")
    (tmp_path / "dupcluster.yaml").write_text("nodes: 1\ndevices_per_node: 8\ndevice: a100\n"
                                              "intra: {type: nvlink3, bandwidth: 300 GB/s, bandwidth: 3 GB/s}\n"
                                              "inter: ib-hdr\n")
    (tmp_path / "dupprofile.yaml").write_text(PROFILE.replace("latency: 50 us", "latency: 50 us, latency: 5 us"))
    (tmp_path / "cutprofile.yaml").write_text(_measured_profile_text(tmp_path).rsplit("precision:", 1)[0])
    (tmp_path / "model.py").write_text(MODEL_FILE)
    (tmp_path / "swapped.csv").write_text("0F1,0F0,0B0,0B1\n1F1,1F0,1B0,1B1\n")    # --runtime torch refuses both
    (tmp_path / "spaced.csv").write_text("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n")
    (tmp_path / "bert.json").write_text('{"architectures": ["BertForMaskedLM"], "hidden_size": 768}')
    sc = "stages:\n  - {f: 1, b: 1, w: 1}\nmessage: 0\nactivation: 100\n"
    for name, extra in (("sc_actw_nan", "activation_w: .nan\n"), ("sc_actw_inf", "activation_w: .inf\n"),
                        ("sc_actw_neg", "activation_w: -1\n"), ("sc_blocking", "blocking_sends: 1\n")):
        (tmp_path / f"{name}.yaml").write_text(sc + extra)
    measured = _measured_profile_text(tmp_path)
    tp_ar = "tp_allreduce: {latency: 30 us, bandwidth: 1 GB/s}\n"
    (tmp_path / "tp1profile.yaml").write_text(measured)
    (tmp_path / "tp2profile.yaml").write_text(measured + "tp: 2\n" + tp_ar)
    (tmp_path / "tpnan.yaml").write_text(measured + "tp: .nan\n" + tp_ar)
    (tmp_path / "tpzero.yaml").write_text(measured + "tp: 0\n")
    (tmp_path / "tpnoar.yaml").write_text(measured + "tp: 2\n")
    (tmp_path / "tparinf.yaml").write_text(measured + "tp: 2\ntp_allreduce: {latency: 30 us, bandwidth: .inf}\n")
    (tmp_path / "tp3.yaml").write_text(measured + "tp: 3\n" + tp_ar)
    names = ("nanmodel", "infcluster", "dupmodel", "dupcluster", "dupprofile", "cutprofile", "sc_actw_nan",
             "sc_actw_inf", "sc_actw_neg", "sc_blocking", "tp1profile", "tp2profile", "tpnan", "tpzero", "tpnoar",
             "tparinf", "tp3", "podnan", "podhalf", "podzero", "podleaf", "mladense", "oddshared")
    made = {"file": str(f), "dir": str(tmp_path), "empty": str(empty), "tmp": tmp_path,
            "model": str(tmp_path / "model.py"), "hf_bert": str(tmp_path / "bert.json"),
            "torch_swapped": str(tmp_path / "swapped.csv"), "torch_spaced": str(tmp_path / "spaced.csv"),
            **{n: str(next(tmp_path.glob(n + ".*"))) for n in names}}
    yield made
    if "tmp_held" in made:
        made["tmp_held"].close()


def _issue47_file(tmp_path: Path, key: str) -> str:
    """Issue 47's bad files, made when a row asks for one: a Hugging Face config with a NaN field,
    JSON and YAML nested 200,000 deep, a symbolic link loop and a broken link."""
    if key == "schedtext":
        return str(_write(tmp_path / "s.txt", "0: F0.s0 B0.s0\n1: F0.s1 B0.s1\n"))
    if key == "deepsweep":
        (tmp_path / "deepsweep").mkdir()
        _write(tmp_path / "deepsweep" / "sweep.json", '{"job": ' + "[" * 200_000 + "]" * 200_000 + "}")
        return str(tmp_path / "deepsweep")
    if key == "unknownfield":
        return str(_write(tmp_path / "m.yaml", "layers: 4\nhidden: 64\nheads: 4\nseq_len: 8\nvocab: 16\nffn: 128\n"))
    if key == "hfnan":
        hf = json.loads((Path(__file__).parent / "data" / "hf" / "Meta-Llama-3-8B" / "config.json").read_text())
        hf["rope_theta"] = float("nan")
        return str(_write(tmp_path / "hfnan.json", json.dumps(hf)))
    if key in ("deepjson", "deepyaml"):
        return str(_write(tmp_path / ("deep.json" if key == "deepjson" else "deep.yaml"),
                          "[" * 200_000 + "]" * 200_000))
    link = tmp_path / f"{key}.json"
    if key == "loop":
        (tmp_path / "loop2.json").symlink_to(link)
        link.symlink_to(tmp_path / "loop2.json")
    else:
        link.symlink_to(tmp_path / "nowhere.json")
    return str(link)


ISSUE47_FILES = ("schedtext", "deepsweep", "unknownfield", "hfnan", "deepjson", "deepyaml", "loop", "broken")


MODEL_FILE = """\
import sys
import time
import types

import torch
from torch import nn


class AddOne(nn.Module):
    def forward(self, x):
        x += 1
        return x


class Tok(nn.Module):
    def forward(self, x):
        return x.argmax(-1) % 16


def _stack(middle):
    def sample(g, b):
        x = torch.randn(b, 8, generator=g)
        return x, x.sum(1, keepdim=True)
    return types.SimpleNamespace(layers=[nn.Linear(8, 8), *middle, nn.Linear(8, 1)], loss=nn.functional.mse_loss,
                                 sample=sample)


def in_place():
    return _stack([AddOne(), nn.Linear(8, 8)])


def integer_cut():
    return _stack([Tok(), nn.Embedding(16, 8)])


def nan_loss():
    s = _stack([nn.Linear(8, 8)])
    s.loss = lambda out, target: (out - target).pow(2).mean() * float("nan")
    return s


def exits():
    sys.exit(0)


def hangs():
    while True:
        time.sleep(0.05)


def huge():   # 64 x 2.5 G parameters: 640 GB of fp32 weights, were it built
    return _stack([nn.Linear(50_000, 50_000, bias=False) for _ in range(64)])
"""


def _measured_profile_text(tmp_path) -> str:
    """A profile as pipetwin calibrate writes it (a measured one: meta.runtime_scale, every field)."""
    from dataclasses import replace

    from cost_models import load_profile, save_profile
    base = load_profile(_write(tmp_path / "base.yaml", PROFILE))
    n = len(base.layers)
    measured = replace(base, meta={**base.meta, "runtime_scale": {"F": 1.0}}, cores=2, act_bytes=(1e3,) * n,
                       act_w_bytes=(0.0,) * n)
    return save_profile(measured, tmp_path / "measured.yaml").read_text()


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _fill(argv, files):
    out = []
    for a in argv:
        if "{plan0}" in a:
            a = _plan(files["tmp"], microbatches=0)
        elif "{plan_nostages}" in a:
            a = _plan(files["tmp"], stages=[])
        elif a == "{plan}":
            a = _plan(files["tmp"])
        elif a == "{plan_huge}":   # a DAPPLE plan's micro-batches edited far beyond the op limit
            a = _plan(files["tmp"], microbatches=10_000_000, global_batch=160_000_000)
        elif a.strip("{}") in FRAMEWORK_FILES and a.startswith("{"):
            a = str(_write(files["tmp"] / f"{a.strip('{}')}.txt", FRAMEWORK_FILES[a.strip("{}")]))
        elif a.strip("{}") in ISSUE47_FILES and a.startswith("{"):
            a = _issue47_file(files["tmp"], a.strip("{}"))
        elif a in ("{layout}", "{layout_t1}"):
            a = _layout_plan(files["tmp"], 2 if a == "{layout}" else 1)
        elif a == "{sweep}":        # a finished sweep of model tiny on the default cluster
            a = str(files["tmp"] / "sweep")
            assert main(SWEEP + ["-m", "tiny", "--out", a]) == 0
        elif a == "{locked}":       # a folder another sweep is writing (it holds the lock)
            import fcntl
            folder = files["tmp"] / "busy"
            folder.mkdir()
            held = open(folder / ".sweep.lock", "w")
            fcntl.flock(held, fcntl.LOCK_EX)
            files["tmp_held"] = held                # released when the test's files go
            a = str(folder)
        elif a == "{unrecorded}":   # a sweep table with no record of its experiment
            (files["tmp"] / "old").mkdir()
            (files["tmp"] / "old" / "sweep.csv").write_text("schedule,devices\n")
            a = str(files["tmp"] / "old")
        out.append(a.format(**{k: v for k, v in files.items() if not k.startswith("tmp")}))
    return out


RUNS_FIRST = {"run-trace-disk-full"}     # refused when writing what the run made: its ranks start first


@pytest.mark.parametrize("argv,words", [pytest.param(*c[1:], id=c[0], marks=[pytest.mark.slow] * (c[0] in RUNS_FIRST))
                                        for c in CASES])
def test_bad_input_exits_2_with_one_line(capsys, files, request, argv, words):
    if request.node.callspec.id not in RUNS_FIRST:
        request.getfixturevalue("no_ranks")     # refused before any rank starts
    argv = _fill(argv, files)
    capsys.readouterr()
    t0 = time.monotonic()
    rc = main(argv)
    took = time.monotonic() - t0
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("pipetwin: error: "), err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert lines[0].isprintable(), lines[0]
    assert len(lines[0]) <= MAX_LINE, (len(lines[0]), lines[0])
    assert request.node.callspec.id in RUNS_FIRST or took < REFUSED_WITHIN_S, (took, lines[0])


MAX_LINE = 300           # characters of a refusal (issue 47: one line a terminal shows whole)
REFUSED_WITHIN_S = 30.0  # a refusal comes before any long work (generous: the test machine is shared)


def test_measured_profile_reads_back_whole_and_not_cut(tmp_path):
    """A measured profile round-trips; cut anywhere after its meta (which comes first) it is refused."""
    from cost_models import load_profile
    text = _measured_profile_text(tmp_path)
    assert text.index("meta:") < text.index("model:")
    assert load_profile(_write(tmp_path / "whole.yaml", text)).cores == 2
    lines = text.splitlines(keepends=True)
    for cut in (len(lines) - 1, len(lines) // 2):
        with pytest.raises(ValueError, match="cut short|must list|missing field"):
            load_profile(_write(tmp_path / "cut.yaml", "".join(lines[:cut])))


def test_hanging_model_file_times_out(capsys, files, monkeypatch):
    """A build() that never returns is stopped at the stated bound (BUILD_SECONDS; 1 s here)."""
    import executor.user_model as um
    monkeypatch.setattr(um, "BUILD_SECONDS", 1.0)
    rc = main(RUN + ["-m", files["model"] + ":hangs"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "hangs() did not finish in 1 s" in err[0], err


@pytest.mark.slow
def test_nan_loss_is_a_failed_run(capsys, files):
    """A loss that is NaN: exit status 1, one line naming the step, for the pipeline and the reference."""
    for extra in ([], ["--reference"]):
        rc = main(RUN + ["-m", files["model"] + ":nan_loss"] + extra)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 1 and len(err) == 1 and "the loss is nan at step 0" in err[0], err


def test_a_model_too_big_is_refused_in_seconds(capsys, files, no_ranks):
    """640 GB of weights: refused from the meta device's count in a few seconds (a real build would
    take minutes and the host's memory); with --force a memory limit above the device's is planned."""
    for argv in (RUN + ["-m", files["model"] + ":huge"], ["validate", "-m", files["model"] + ":huge"]):
        assert main(argv) == 2      # from the meta device's count: no rank started (no_ranks)
        assert "160,000,000,081 parameters needs at least" in capsys.readouterr().err
    from experiments.cmd_plan import check_limit
    from cost_models.device import load_device
    a100 = load_device("a100")
    check_limit(a100.memory_bytes, a100, False)              # the device's own memory: fine
    check_limit(2 * a100.memory_bytes, a100, True)           # forced
    with pytest.raises(ValueError, match="--memory-limit 160 GiB is above the a100's 80 GiB"):
        check_limit(2 * a100.memory_bytes, a100, False)


def test_plan_names_the_schedule_it_answers(capsys):
    """plan --schedules dapple,gpipe answers one of those; the dapple plans are kept only when asked for."""
    argv = ["plan", "-m", "bert-48", "-c", "v100-2x8-25gbe", "-G", "64", "--no-progress", "--no-baselines", "--json"]
    assert main(argv + ["--schedules", "gpipe"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["schedule"] == "gpipe"


@pytest.mark.slow
@pytest.mark.parametrize("argv,word", [
    (["simulate", "-s", "dapple", "-D", "4", "-N", "8", "--slowdown", "2=nan"], "--slowdown"),
    (["run", "-s", "dapple", "-D", "100000", "-N", "8"], "-D"),
    (["run", "-s", "dapple", "-D", "2", "-N", "2", "--data", "/nonexistent/x.txt"], "--data"),
])
def test_bad_input_real_process(argv, word):
    """The same through the console entry point: one stderr line, status 2, within the time bound."""
    p = subprocess.run([sys.executable, "-c", "import sys; from experiments.cli import main; sys.exit(main())",
                        *argv], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and word in lines[0], p.stderr


def test_host_memory_checked_before_spawning(capsys):
    """A planned run that cannot fit in this host's memory is refused before any rank starts."""
    from executor.launch import available_host_bytes
    avail = available_host_bytes()
    if avail is None or avail > 150 * 2 ** 30:
        pytest.skip("needs a host with /proc/meminfo and < 150 GiB available (gpt-96 needs ~180 GB)")
    rc = main(["run", "-s", "dapple", "-D", "2", "-N", "2", "--model", "gpt-96", "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "GiB of memory on this host" in err and len(err.strip().splitlines()) == 1


def test_version_and_presets(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("pipetwin ")
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in ("tiny", "gpt3-1.3b", "dgx-a100-4x8-ib", "v100-2x8-25gbe", "a100", "h200"):
        assert f"  {name} " in out
    assert max(len(line) for line in out.splitlines()) <= 120


def test_outputs_fit_120_columns(capsys):
    """schedules (descriptions end with their sentence) and plan (details below the table) fit 120 columns."""
    assert main(["schedules"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 120
    blocks = [b for b in out.replace("\n" + " " * 20, " ").splitlines()]   # continuation lines joined
    assert len(blocks) == 11 and all(b.rstrip().endswith(".") for b in blocks), blocks
    assert "then a flush." in " ".join(out.split())
    assert main(["plan", "-m", "bert-48", "-c", "v100-2x8-25gbe", "-G", "64", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 120
    assert "  PipeDream planner: " in out


def test_tiny_memory_in_a_unit_that_fits(capsys):
    assert main(["simulate", "-s", "dapple", "-D", "2", "-N", "4", "-m", "tiny", "-c", "dgx-a100-1x8"]) == 0
    out = capsys.readouterr().out
    assert "memory in MiB" in out and "fits: peak" in out and "MiB on device" in out


def test_slow_link_crossed_by_some_compared_schedules(capsys):
    """compare: a slow link that some schedules cross is applied to them and a note names the others."""
    rc = main(["compare", "-D", "16", "-N", "16", "-m", "bert-48", "-c", "v100-2x8-25gbe", "--schedules",
               "dapple,gpipe", "--slow-link", "n0.nic0.out=10"])
    assert rc == 0 and "slow-link" not in capsys.readouterr().out


def test_simulate_without_network_refuses_to_drop_communication():
    from cost_models import TransformerCostModel, load_cluster, load_model
    from schedules import build, lower
    from sim import simulate
    low = lower(build("dapple", 2, 4))
    costs = TransformerCostModel(load_model("tiny"), load_cluster("dgx-a100-1x8").device).bind(low)
    with pytest.raises(ValueError, match="no network was given"):
        simulate(low, costs)
    free = simulate(low, costs, free_comm=True)
    placed = simulate(low, costs, load_cluster("dgx-a100-1x8").place(low))
    assert free.end.max() < placed.end.max()     # the network really adds the message times


def test_save_profile_creates_its_folder(tmp_path):
    """validate in a fresh folder: the calibration profile's folder (out/) is created when it is written."""
    from cost_models import load_profile, save_profile
    src = tmp_path / "p.yaml"
    src.write_text(PROFILE)
    prof = load_profile(src)
    out = save_profile(prof, tmp_path / "fresh" / "out" / "calibration.yaml")
    assert load_profile(out) == prof


def test_profile_file_is_checked_where_it_is_used(capsys, tmp_path):
    """A profile field that is NaN is refused with the file and field named."""
    bad = tmp_path / "nan.yaml"
    bad.write_text(PROFILE.replace("latency: 50 us", "latency: .nan"))
    assert main(SIM[:1] + ["-s", "dapple", "-D", "2", "-N", "2", "--profile", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "nan.yaml" in err and "p2p.latency" in err and len(err.strip().splitlines()) == 1


def test_validate_refuses_a_profile_that_does_not_model_more_ranks_than_cores(capsys, tmp_path):
    """A profile calibrated for 2 ranks on 2 cores (no time slice) cannot predict 4 ranks on them:
    validate says so before it runs anything; with a time slice it would go on (not run here)."""
    prof = tmp_path / "two.yaml"
    prof.write_text(PROFILE.replace("threads: 1}", "threads: 1, ranks: 2}") + "cores: 2\n")
    assert main(["validate", "-D", "4", "--profile", str(prof)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "4 ranks on 2 cores" in err[0] and "for 2 ranks" in err[0] and "--ranks 4" in err[0]


def test_outputs_are_written_whole_or_not_at_all(tmp_path):
    """An error while writing leaves the old file as it was and no temporary file; a device is
    written in place (never replaced by a file); a full disk is one FileError naming the path."""
    from cost_models.files import FileError, output_file, write_output
    target = tmp_path / "t.csv"
    write_output(target, "old\n")
    with pytest.raises(RuntimeError):
        with output_file(target) as fh:
            fh.write("half a ro")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.csv"]
    write_output(target, b"new\n")
    assert target.read_text() == "new\n"
    (tmp_path / "link.csv").symlink_to(target)
    write_output(tmp_path / "link.csv", "through the link\n")
    assert (tmp_path / "link.csv").is_symlink() and target.read_text() == "through the link\n"
    (tmp_path / "link.csv").unlink()
    write_output("/dev/null", "x" * 1000)
    assert Path("/dev/null").is_char_device()
    with pytest.raises(FileError, match="trace /dev/full could not be written: No space left on device"):
        write_output("/dev/full", "x" * 100_000, "trace")


def test_calibrate_keeps_its_measurement_when_the_final_write_fails(tmp_path):
    """A disk that fills up during calibrate's measurement: the profile is kept in the temporary
    folder and the one line names it."""
    from cost_models import load_profile
    from cost_models.files import FileError
    from experiments.cmd_calibrate import save_measured
    prof = load_profile(_write(tmp_path / "p.yaml", PROFILE))
    with pytest.raises(FileError) as e:
        save_measured(prof, Path("/dev/full"))
    msg = str(e.value)
    assert "/dev/full" in msg and "No space left" in msg and "\n" not in msg
    kept = Path(msg.rsplit("kept in ", 1)[1].split(" (copy")[0])
    assert load_profile(kept) == prof


def test_zero_without_replicas_is_one_refusal_in_simulate_and_run(capsys):
    """``--zero 1`` with R = 1 shards nothing: simulate and run refuse it alike, with the same one line
    (exit 2), with and without tensor parallelism."""
    for extra in ([], ["--tp", "2"]):
        lines = []
        for argv in (["simulate", "-s", "dapple", "-D", "2", "-N", "4", "-m", "tiny"], RUN):
            capsys.readouterr()
            assert main(argv + extra + ["--zero", "1"]) == 2
            lines.append(capsys.readouterr().err.strip())
        assert lines[0] == lines[1] == ("pipetwin: error: --zero 1 shards over the data-parallel replicas; give "
                                        "--dp > 1")
