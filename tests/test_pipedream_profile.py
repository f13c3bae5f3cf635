"""DAPPLE's released profiles (PipeDream graph format): the reader on every file, linear scaling,
the planner workload, and one-line errors for malformed files (library and CLI)."""
from importlib import resources

import pytest

from cost_models import load_device
from cost_models.workloads.pipedream_profile import ProfileError, load_pipedream_profile, profile_batch_from_name
from experiments.cli import main
from cost_models.workloads.pipedream_workload import profile_workload
from cost_models.workloads.workload_sources import load_workload

DIR = resources.files("cost_models") / "presets" / "profiles" / "dapple-v100"
V100 = load_device("v100")


def path(name):
    return str(DIR / name)


# file -> (profile batch, layers after dropping inputs, layers after merging zero-cost nodes,
#          parameters in millions, dropped node ids)
FILES = {
    "amoeba-36-pbs-1.txt": (1, 43, 43, 932.8, ("node1",)),
    "bert-48-pbs-2.txt": (2, 53, 52, 637.5, ()),
    "gnmt-16-pbs-64.txt": (64, 77, 33, 290.7, None),
    "vgg-19-pbs-32.txt": (32, 25, 25, 137.0, ("node1",)),
    "xlnet-36-pbs-1.txt": (1, 42, 41, 500.75, ("node1",)),
}


@pytest.mark.parametrize("fname", sorted(FILES))
def test_every_released_profile(fname):
    pbs, n, merged, mparams, dropped = FILES[fname]
    p = load_pipedream_profile(path(fname))
    assert p.profile_batch == pbs == profile_batch_from_name(fname)
    assert p.num_layers == n and p.merged().num_layers == merged
    assert sum(p.param_bytes) / 4 / 1e6 == pytest.approx(mparams, abs=0.05)
    if dropped is not None:
        assert p.dropped == dropped
    m = p.merged()
    for a, b in ((p.f, m.f), (p.b, m.b), (p.act, m.act), (p.param_bytes, m.param_bytes)):
        assert sum(a) == pytest.approx(sum(b))
    assert p.out_bytes[-1] == 0.0 and min(p.out_bytes) >= 0.0
    # linear scaling from the profile batch: times and activations x k, parameters unchanged
    one, two = p.layer_costs(pbs), p.layer_costs(2 * pbs)
    assert two.f == pytest.approx(tuple(2 * x for x in one.f))
    assert two.b_input == pytest.approx(tuple(2 * x for x in one.b_input))
    assert two.act == pytest.approx(tuple(2 * x for x in one.act))
    assert two.out_bytes == pytest.approx(tuple(2 * x for x in one.out_bytes))
    assert two.params == one.params and set(one.w) == {0.0}


def test_known_nodes():
    bert = load_pipedream_profile(path("bert-48-pbs-2.txt"))
    i = bert.layer_names.index("layer_0")
    assert (bert.f[i], bert.b[i]) == pytest.approx((2.69e-3, 4.47e-3))
    assert bert.param_bytes[i] == 50384896
    # the cut after a layer carries its output and the attention mask every layer reads
    assert bert.out_bytes[i] == 4325376 + 3538944
    assert bert.out_bytes[bert.layer_names.index("layer_46")] == 4325376 + 3538944
    vgg = load_pipedream_profile(path("vgg-19-pbs-32.txt"))
    j = vgg.layer_names.index("Conv2d_1_2")
    assert (vgg.f[j], vgg.b[j], vgg.act[j]) == pytest.approx((7.2e-3, 14.4e-3, 384e6))
    assert vgg.layer_names[0] == "Conv2d_1_1"      # the Input node (3.4 ms of data loading) is dropped
    gnmt = load_pipedream_profile(path("gnmt-16-pbs-64.txt"))
    k = gnmt.node_ids.index("node7")
    assert gnmt.layer_names[k] == "LSTM(2048, 1024)" and gnmt.f[k] == pytest.approx(4.649e-3)
    # the amoeba cells output lists [a; b]: their sum
    am = load_pipedream_profile(path("amoeba-36-pbs-1.txt"))
    assert am.act[am.layer_names.index("cell_0")] == 2 * 6422528


def test_workload_per_sample_and_kernel_curve():
    lin = profile_workload(path("bert-48-pbs-2.txt"), V100)
    raw = load_pipedream_profile(path("bert-48-pbs-2.txt")).merged()
    assert lin.f == pytest.approx(tuple(x / 2 for x in raw.f))
    assert lin.at(64) is lin and lin.layer_costs(8).f == pytest.approx(tuple(4 * x for x in raw.f))
    assert lin.total_params == pytest.approx(637.5e6, rel=1e-3)
    k = profile_workload(path("bert-48-pbs-2.txt"), V100, cost_model="kernels")
    # anchored at the profile batch, cheaper per sample on larger micro-batches
    assert k.at(2).f == pytest.approx(lin.f)
    def per_sample(w):   # forward + backward seconds of the whole model for one sample
        return sum(w.f) + sum(w.b_input) + sum(w.w)
    assert per_sample(k.at(1)) > per_sample(k.at(2)) > per_sample(k.at(16))
    scaled = profile_workload(path("bert-48-pbs-2.txt"), V100, activation_per_sample=1.7e9)
    assert scaled.activation(0, scaled.num_layers) == pytest.approx(1.7e9)


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


GOOD = ("node1 -- a -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=100, parameter_size=40\n"
        "node2 -- b -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=100, parameter_size=40\n"
        "\tnode1 -- node2\n")


@pytest.mark.parametrize("text,msg", [
    (GOOD.replace("1.0,", "nan,", 1), "forward_compute_time must be a finite number >= 0; got 'nan'"),
    (GOOD.replace("2.0,", "-2.0,", 1), "backward_compute_time must be a finite number >= 0"),
    (GOOD.replace("activation_size=100, ", "", 1), "lacks activation_size"),
    (GOOD.replace("parameter_size=40", "parameter_size=lots", 1), "parameter_size must be a number; got 'lots'"),
    (GOOD + "\tnode2 -- node9\n", "edge names node node9, which is not defined"),
    (GOOD + "\tnode2 -- node1\n", "the graph has a cycle"),
    (GOOD + "node1 -- again -- forward_compute_time=1, backward_compute_time=1, activation_size=1, parameter_size=1\n",
     "node node1 defined twice"),
    ("hello world\n", "expected 'nodeK -- NAME -- forward_compute_time="),
    ("", "no nodes"),
    (GOOD.replace("1.0,", "0,").replace("2.0,", "0,"), "every layer has zero compute time"),
])
def test_malformed_profiles_fail_clearly(tmp_path, text, msg):
    p = write(tmp_path, "m-pbs-4.txt", text)
    with pytest.raises(ProfileError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_pipedream_profile(p)


def test_profile_batch_from_name_or_option(tmp_path):
    p = write(tmp_path, "model.txt", GOOD)
    with pytest.raises(ProfileError, match="no 'pbs-B' in the file name"):
        load_pipedream_profile(p)
    assert load_pipedream_profile(p, 8).profile_batch == 8
    with pytest.raises(ProfileError, match="positive integer"):
        load_pipedream_profile(p, 0)
    with pytest.raises(ProfileError, match="is a directory"):
        load_pipedream_profile(tmp_path)
    with pytest.raises(ProfileError, match="does not exist"):
        load_pipedream_profile(tmp_path / "none-pbs-1.txt")
    with pytest.raises(ValueError, match="known model kind"):
        load_workload(p, V100, cost_model="kernels", profile_batch=8)


@pytest.mark.parametrize("argv,msg", [
    (["plan", "-m", "{bad}", "-c", "v100-2x8-25gbe", "-G", "8"], "forward_compute_time must be a finite number"),
    (["simulate", "-s", "dapple", "-D", "2", "-N", "2", "-m", "{bad}", "-c", "v100-2x8-25gbe"],
     "forward_compute_time must be a finite number"),
    (["plan", "-m", "{dir}", "-c", "v100-2x8-25gbe", "-G", "8"], "is a directory"),
    (["plan", "-m", "{nopbs}", "-c", "v100-2x8-25gbe", "-G", "8"], "give --profile-batch B"),
    (["simulate", "-s", "dapple", "-D", "2", "-N", "2", "-m", "{missing}", "-c", "v100-2x8-25gbe"], "does not exist"),
    (["plan", "-m", "bert-48", "-c", "v100-2x8-25gbe", "-G", "8", "--profile-batch", "2"],
     "--profile-batch applies to a profile file"),
    (["simulate", "-s", "dapple", "-D", "2", "-N", "2", "-m", "bert-48", "-c", "v100-2x8-25gbe",
      "--profile-batch", "2"], "--profile-batch applies to a profile file"),
])
def test_cli_errors_for_bad_profiles_are_one_line(tmp_path, capsys, argv, msg):
    d = tmp_path / "dir.txt"
    d.mkdir()
    files = {"{bad}": write(tmp_path, "bad-pbs-2.txt", GOOD.replace("1.0,", "inf,", 1)),
             "{nopbs}": write(tmp_path, "nopbs.txt", GOOD), "{dir}": str(d),
             "{missing}": str(tmp_path / "missing-pbs-1.txt")}
    rc = main([files.get(a, a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("pipetwin: error:") and msg in err[0], err


def test_cli_simulate_and_plan_a_profile(tmp_path, capsys):
    import json
    vgg = path("vgg-19-pbs-32.txt")
    rc = main(["simulate", "-s", "dapple", "-D", "4", "-N", "8", "-m", vgg, "-c", "v100-2x8-25gbe", "--json"])
    rec = json.loads(capsys.readouterr().out)
    assert rc == 0 and rec["cost_model"] == "linear" and rec["micro_batch"] == 32 and sum(rec["partition"]) == 25
    rc = main(["simulate", "-s", "dapple", "-D", "4", "-N", "8", "-m", vgg, "-c", "v100-2x8-25gbe", "--json",
               "--cost-model", "kernels", "--micro-batch", "4"])
    k = json.loads(capsys.readouterr().out)
    assert rc == 0 and k["cost_model"] == "kernels"
    # 8x fewer samples, but more than 1/8 of the time: a small micro-batch costs more per sample
    assert k["iteration_time"] > rec["iteration_time"] / 8 * 1.05
    out = tmp_path / "p.json"
    rc = main(["plan", "-m", vgg, "-c", "v100-2x8-25gbe", "-G", "32", "--top", "2", "--no-baselines",
               "--no-progress", "--json", "--out", str(out)])
    plan = json.loads(capsys.readouterr().out)
    assert rc == 0 and plan["model"]["kind"] == "profile" and plan["model"]["profile_batch"] == 32
    rc = main(["simulate", "--plan", str(out), "--json"])
    again = json.loads(capsys.readouterr().out)
    assert rc == 0 and again["iteration_time"] == pytest.approx(plan["simulated"]["iteration_time"], rel=1e-9)
