"""Model files, round 4 (issue 47, item 5): what a new user's model file does that pipetwin must
take or refuse well.

- A first stage without parameters (a reshape and a ReLU, or an ``nn.Identity`` whose output is the
  input tensor itself) trains: its B has nothing to do. Losses equal the single-process reference's
  within 1e-6 (relative) at D = 2 under 1F1B, GPipe, ZB-H1 and ZB-V (split backward), in one launch
  with the built-in GPT beside them (its ranks pass the same launch).
- Ranks check that they built the same weights: a ``build()`` that seeds from ``os.getpid()`` is
  refused before step 0 with one line naming the rank and the first layer (exit status 2).
- The model file's folder is importable (``beside/model.py`` imports ``widths.py``) while its code
  runs, and its printing goes to standard error: ``run --json`` still parses.
"""
import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from executor.config import RunConfig
from executor.reference import run_reference
from executor.user_model import build_stack, layer_digests, stack_layout, user_code
from experiments.cli import main as cli_main

MODELS = Path(__file__).resolve().parent / "data" / "models"
FREE, IDENTITY = f"{MODELS / 'param_free.py'}:build", f"{MODELS / 'param_free.py'}:build_identity"
PID, BESIDE = (f"{MODELS / n}:build" for n in ("pid_seeded.py", "beside/model.py"))
BASE = dict(steps=3, optimizer="sgd", lr=0.1, timeout=30.0)

CASES = {2: {
    "free-dapple": RunConfig.of(model=FREE, schedule="dapple", devices=2, microbatches=4, partition=(2, 3), **BASE),
    "free-gpipe": RunConfig.of(model=FREE, schedule="gpipe", devices=2, microbatches=4, partition=(2, 3), **BASE),
    "free-zb-h1": RunConfig.of(model=FREE, schedule="zb-h1", devices=2, microbatches=4, partition=(2, 3), **BASE),
    # four stages: a reshape alone, a ReLU alone (no parameters in the middle), then the linears
    "free-zb-v": RunConfig.of(model=FREE, schedule="zb-v", devices=2, microbatches=4, partition=(1, 1, 1, 2),
                              **BASE),
    "identity-dapple": RunConfig.of(model=IDENTITY, schedule="dapple", devices=2, microbatches=4, partition=(1, 4),
                                    **BASE),
    "gpt-dapple": RunConfig.of(model="tiny", schedule="dapple", devices=2, microbatches=4, **BASE),
}}


def _reference(cfg):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_reference(cfg)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES[2]))
def test_parameter_free_first_stage_trains_as_the_reference(runs, case):
    cfg, low, res = runs(2)[case]
    ref = _reference(cfg)
    assert len(res.losses) == 3 == len(ref.losses)
    for got, want in zip(res.losses, ref.losses):
        assert abs(got - want) <= 1e-6 * abs(want), (case, res.losses, ref.losses)
    if case.startswith(("free", "identity")):
        assert res.losses[-1] < res.losses[0]          # it trained
        layout = stack_layout(cfg.model, low.num_stages, partition=cfg.blocks)
        assert sum(layout.params[i] for i in layout.stage_ranges()[0]) == 0     # the first stage holds none


def test_a_build_seeded_from_the_pid_is_refused_before_step_0(capsys):
    rc = cli_main(["run", "--model", PID, "-s", "dapple", "-D", "2", "-N", "2", "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == (f"pipetwin: error: model {PID}: rank 1 built other weights than rank 0 (first at layer 0, Linear); "
                   f"does build() seed from the process id or the time? pipetwin seeds every rank's build alike "
                   f"(--seed): leave the seeding to it\n")


def test_layer_digests_tell_every_weight_apart():
    a, b = build_stack(FREE, 0).layers, build_stack(FREE, 0).layers
    assert layer_digests(a) == layer_digests(b)
    empty = hashlib.blake2b(digest_size=16).hexdigest()          # Flat, ReLU and Tanh hold no tensor
    assert [d == empty for d in layer_digests(a)] == [True, True, False, True, False]
    assert layer_digests(build_stack(FREE, 1).layers)[2] != layer_digests(a)[2]     # another seed
    with torch.no_grad():
        b[4].bias[3] = torch.nextafter(b[4].bias[3], torch.tensor(2.0))        # one bit of one weight
    assert [x == y for x, y in zip(layer_digests(a), layer_digests(b))] == [True, True, True, True, False]
    # a buffer counts too (e.g. a BatchNorm's running mean)
    bn1, bn2 = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
    bn2.running_mean[0] = 1.0
    assert layer_digests([bn1]) != layer_digests([bn2])


def test_model_folder_is_importable_and_its_printing_goes_to_stderr(capsys):
    folder = str(MODELS / "beside")
    assert cli_main(["run", "--model", BESIDE, "-s", "dapple", "-D", "1", "-N", "2", "--steps", "2", "--reference",
                     "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)           # standard output is the JSON object alone
    assert len(result["losses"]) == 2 and result["engine"] == "reference"
    assert "model.py: building with HIDDEN = 16\n" in err and "model.py: forward\n" in err
    assert "model.py: sample\n" in err
    assert folder not in sys.path       # only while the model's code runs


@pytest.mark.slow
def test_model_folder_and_printing_on_spawned_ranks(capsys):
    assert cli_main(["run", "--model", BESIDE, "-s", "dapple", "-D", "2", "-N", "2", "--steps", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["engine"] == "executor" and "model.py: building with HIDDEN = 16\n" in err


def test_user_code_puts_the_folder_first_and_stdout_on_stderr(tmp_path, capsys):
    with user_code(str(tmp_path)):
        assert sys.path[0] == str(tmp_path)
        print("from the model")
    assert str(tmp_path) not in sys.path
    print("from pipetwin")
    assert capsys.readouterr() == ("from pipetwin\n", "from the model\n")
