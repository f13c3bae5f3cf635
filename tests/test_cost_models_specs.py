"""YAML specs: malformed files name the file and the field; unit strings; calibration profiles."""
import textwrap

import pytest
import yaml

import cost_models as cm
import schedules as S
from cost_models import _spec


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


# ----------------------------------------------------------------------------- units
@pytest.mark.parametrize("fn,value,want", [
    (_spec.size_bytes, "80 GiB", 80 * 2 ** 30), (_spec.size_bytes, "141 GB", 141e9), (_spec.size_bytes, 1024, 1024),
    (_spec.bandwidth, "200 Gb/s", 25e9), (_spec.bandwidth, "25 GB/s", 25e9), (_spec.bandwidth, "25Gbit/s", 3.125e9),
    (_spec.bandwidth, "1.5e9", 1.5e9), (_spec.seconds, "5 us", 5e-6), (_spec.seconds, "1.5 ms", 1.5e-3),
    (_spec.seconds, 0, 0.0), (_spec.flops, "312 TFLOP/s", 312e12), (_spec.flops, "125e12", 125e12),
])
def test_units(fn, value, want):
    assert fn(value, "f.yaml", "x") == pytest.approx(want)


@pytest.mark.parametrize("fn,value", [(_spec.size_bytes, "80 Gb"), (_spec.bandwidth, "fast"), (_spec.bandwidth, 0),
                                      (_spec.seconds, -1), (_spec.flops, True), (_spec.size_bytes, None)])
def test_bad_units(fn, value):
    with pytest.raises(cm.SpecError, match=r"f\.yaml: field 'x\.y'"):
        fn(value, "f.yaml", "x.y")


# ----------------------------------------------------------------------------- malformed files
def test_malformed_model_names_file_and_field(tmp_path):
    p = write(tmp_path, "m.yaml", "layers: 4\nhidden: abc\nheads: 2\nseq_len: 8\nvocab: 10\n")
    with pytest.raises(cm.SpecError, match=r"m\.yaml.*'hidden'"):
        cm.load_model(p)
    p = write(tmp_path, "m2.yaml", "layers: 4\nhidden: 10\nheads: 3\nseq_len: 8\nvocab: 10\n")
    with pytest.raises(cm.SpecError, match=r"m2\.yaml.*'heads'"):
        cm.load_model(str(p))
    p = write(tmp_path, "m3.yaml", "layers: 4\nhidden: 8\nheads: 2\nseq_len: 8\n")
    with pytest.raises(cm.SpecError, match=r"m3\.yaml: missing field 'vocab'"):
        cm.load_model(p)
    p = write(tmp_path, "m4.yaml", "layers: 4\nhidden: 8\nheads: 2\nseq_len: 8\nvocab: 9\nkind: lstm\n")
    with pytest.raises(cm.SpecError, match=r"m4\.yaml.*'kind'"):
        cm.load_model(p)
    p = write(tmp_path, "m5.yaml", "layers: [4\n")
    with pytest.raises(cm.SpecError, match=r"m5\.yaml: not valid YAML"):
        cm.load_model(p)
    with pytest.raises(cm.SpecError, match="unknown model preset 'gpt-7'.*gpt-96"):
        cm.load_model("gpt-7")
    with pytest.raises(cm.SpecError, match="does not exist"):
        cm.load_model(tmp_path / "nope.yaml")


def test_malformed_device_names_field(tmp_path):
    p = write(tmp_path, "d.yaml", "name: x\npeak_flops: {fp16: 100 TFLOP/s}\nmemory: lots\n")
    with pytest.raises(cm.SpecError, match=r"d\.yaml: field 'memory'"):
        cm.load_device(p)
    p = write(tmp_path, "d2.yaml", "peak_flops: {fp17: 1.0e12}\n")
    with pytest.raises(cm.SpecError, match=r"d2\.yaml: unknown field 'peak_flops\.fp17'"):
        cm.load_device(p)
    p = write(tmp_path, "d3.yaml", "peak_flops: {fp16: 1.0e12}\nefficiency: 1.5\n")
    with pytest.raises(cm.SpecError, match=r"d3\.yaml: field 'efficiency'"):
        cm.load_device(p)
    p = write(tmp_path, "d4.yaml", "memory: 8 GiB\n")
    with pytest.raises(cm.SpecError, match=r"d4\.yaml: missing field 'peak_flops'"):
        cm.load_device(p)


CLUSTER = """\
name: mine
nodes: 2
devices_per_node: 4
device: a100
intra: nvlink3
inter: {type: ib-hdr, bandwidth: 100 Gb/s, latency: 2 us}
nics_per_node: 2
"""


def test_cluster_from_user_file(tmp_path):
    c = cm.load_cluster(write(tmp_path, "c.yaml", CLUSTER))
    assert (c.name, c.nodes, c.devices_per_node, c.nics_per_node) == ("mine", 2, 4, 2)
    assert c.inter == cm.LinkSpec("ib-hdr", 12.5e9, 2e-6) and c.intra == cm.LINK_TYPES["nvlink3"]
    inline = CLUSTER.replace("device: a100", "device: {name: g, peak_flops: {bf16: 1 PFLOP/s}, memory: 1 GiB}")
    c = cm.load_cluster(write(tmp_path, "c2.yaml", inline))
    assert c.device.peak("bf16") == 1e15 and c.device.memory_bytes == 2 ** 30


@pytest.mark.parametrize("old,new,field", [
    ("inter: {type: ib-hdr, bandwidth: 100 Gb/s, latency: 2 us}", "inter: {type: ib-hdr, bandwidth: fast}",
     "inter.bandwidth"),
    ("inter: {type: ib-hdr, bandwidth: 100 Gb/s, latency: 2 us}", "inter: {bandwidth: 1 GB/s}", "inter.latency"),
    ("inter: {type: ib-hdr, bandwidth: 100 Gb/s, latency: 2 us}", "inter: {type: ib-hdr, speed: 1}", "inter.speed"),
    ("intra: nvlink3", "intra: nvlink9", "intra"),
    ("nodes: 2", "nodes: 0", "nodes"),
    ("nodes: 2", "nodes: two", "nodes"),
    ("nodes: 2\n", "", "nodes"),
    ("device: a100", "device: tpu", "device"),
    ("device: a100", "device: {peak_flops: {bf16: x}}", "peak_flops.bf16"),
    ("nics_per_node: 2", "nics_per_node: 2\ngpus: 3", "gpus"),
])
def test_malformed_cluster_names_file_and_field(tmp_path, old, new, field):
    p = write(tmp_path, "bad.yaml", CLUSTER.replace(old, new))
    with pytest.raises(cm.SpecError) as e:
        cm.load_cluster(p)
    assert "bad.yaml" in str(e.value) and field in str(e.value)


@pytest.mark.parametrize("option,name,text,field", [
    ("--model", "m.yaml", "layers: 4\nhidden: abc\nheads: 2\nseq_len: 8\nvocab: 10\n", "'hidden'"),
    ("--model", "m.yaml", "layers: [4\n", "not valid YAML"),
    ("--cluster", "c.yaml", CLUSTER.replace("nodes: 2", "nodes: two"), "'nodes'"),
    ("--cluster", "c.yaml", CLUSTER.replace("device: a100", "device: tpu"), "device"),
])
def test_malformed_spec_file_is_one_line_from_the_cli(tmp_path, capsys, option, name, text, field):
    """A user's malformed file is a mistake they can fix: the command line names the file and the
    field on one line and exits 2, no traceback, nothing simulated."""
    from experiments.cli import main
    p = write(tmp_path, name, text)
    assert main(["simulate", option, str(p), "-s", "dapple", "-D", "2", "-N", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipetwin: error: ")
    assert name in lines[0] and field in lines[0] and "Traceback" not in err


# ----------------------------------------------------------------------------- calibration profiles
PROFILE = """\
format: pipetwin-calibration/1
name: test-cpu
model: tiny
layers:
  embedding: {f: 1.0e-5, b_input: 0.0, w: 2.0e-5}
  block: {f: 4.0e-4, b_input: 4.5e-4, w: 3.5e-4}
  head: {f: 1.0e-4, b_input: 1.0e-4, w: 1.0e-4}
p2p: {latency: 50 us, bandwidth: 2 GB/s}
allreduce: {latency: 80 us, bandwidth: 1 GB/s}
optimizer: {seconds_per_param: 2.0e-9}
memory: 4 GiB
meta: {host: test, threads: 1}
"""


def test_profile_to_cost_model_and_cluster(tmp_path):
    prof = cm.load_profile(write(tmp_path, "p.yaml", PROFILE))
    assert prof.model == cm.load_model("tiny") and len(prof.layers) == 10
    sched = S.build("dapple", 4, 4)
    c = prof.cost_model(4).bind(sched)
    assert c.meta["partition"] == [3, 2, 2, 3]
    assert c.f[0][0] == pytest.approx(1e-5 + 2 * 4e-4)
    assert c.f[0][3] == pytest.approx(2 * 4e-4 + 1e-4)
    assert c.b[0][1] == pytest.approx(2 * (4.5e-4 + 3.5e-4))
    assert c.act_bytes[0][0] == 2 * 32 * 64 * 4
    p1 = 2 * cm.block_params(prof.model)
    assert c.static_mem[1] == 16 * p1 and c.optim_time[1] == pytest.approx(2e-9 * p1)
    cl = prof.cluster(4)
    assert cl.device.name == "cpu" and cl.device.memory_bytes == 4 * 2 ** 30 and cl.device.calibrated
    assert cm.p2p_time(cl, 0, 3, 2e6) == pytest.approx(50e-6 + 1e-3)
    assert cm.allreduce_time(cl, range(4), 1e6) == pytest.approx(cm.ring_allreduce_time(1e6, 4, 1e9, 80e-6))
    rep = cm.memory_report(sched, c, cl.device.memory_bytes)
    assert not rep.oom
    full = prof.layer_costs(recompute="full")
    assert full.b_input[1] == pytest.approx(4.5e-4 + 4.0e-4)


def test_profile_round_trip_and_per_layer(tmp_path):
    prof = cm.load_profile(write(tmp_path, "p.yaml", PROFILE))
    again = cm.load_profile(cm.save_profile(prof, tmp_path / "q.yaml"))
    assert again == prof and again.meta == prof.meta
    d = yaml.safe_load(PROFILE)
    del d["layers"]
    d["per_layer"] = [{"f": i * 1e-4, "b_input": 0, "w": 0} for i in range(10)]
    d["act_bytes"] = {"embedding": 0, "block": "1 MiB", "head": 100}
    prof = cm.profile_from_dict(d, "inline")
    lc = prof.layer_costs()
    assert lc.f[9] == pytest.approx(9e-4) and lc.act[1] == 2 ** 20 and lc.act[9] == 100
    # the time slice of an oversubscribed host: a time with a unit, kept through a round trip
    sliced = cm.load_profile(write(tmp_path, "s.yaml", PROFILE + "cores: 2\ntime_slice: 4 ms\n"))
    assert sliced.time_slice == pytest.approx(4e-3)
    assert cm.load_profile(cm.save_profile(sliced, tmp_path / "s2.yaml")) == sliced
    assert prof.time_slice is None


@pytest.mark.parametrize("old,new,field", [
    ("block: {f: 4.0e-4,", "block: {f: slow,", "layers.block.f"),
    ("  head: {f: 1.0e-4, b_input: 1.0e-4, w: 1.0e-4}\n", "", "layers.head"),
    ("p2p: {latency: 50 us, bandwidth: 2 GB/s}", "p2p: {latency: 50 us}", "p2p.bandwidth"),
    ("model: tiny", "model: tiny2", "model"),
    ("format: pipetwin-calibration/1", "format: other/2", "format"),
    ("memory: 4 GiB", "memory: much", "memory"),
    ("memory: 4 GiB", "memory: 4 GiB\ntime_slice: 0 ms", "time_slice"),
    ("memory: 4 GiB", "memory: 4 GiB\ntime_slice: soon", "time_slice"),
])
def test_malformed_profile_names_field(tmp_path, old, new, field):
    p = write(tmp_path, "prof.yaml", PROFILE.replace(old, new))
    with pytest.raises(cm.SpecError) as e:
        cm.load_profile(p)
    assert "prof.yaml" in str(e.value) and field in str(e.value)


def test_profile_per_layer_length(tmp_path):
    d = yaml.safe_load(PROFILE)
    d["per_layer"] = [{"f": 1, "b_input": 1, "w": 1}] * 3
    with pytest.raises(cm.SpecError, match="'per_layer' must list 10 layers"):
        cm.profile_from_dict(d, "x.yaml")
