"""Model files, round 4 (issue 47, item 5): what a new user's model file does that pipetwin must
take or refuse well.

- A first stage without parameters (a reshape and a ReLU, or an ``nn.Identity`` whose output is the
  input tensor itself) trains: its B has nothing to do; a middle stage of one ``nn.Identity`` passes
  the gradient on. Losses equal the single-process reference's within 1e-6 (relative) at D = 2 under
  1F1B, GPipe, ZB-H1, interleaved and ZB-V (split backward), in one launch with the built-in GPT
  beside them (its ranks pass the same launch).
- Ranks check that they built the same weights: a ``build()`` that seeds from ``os.getpid()`` is
  refused before step 0 with one line naming the rank and the first layer (exit status 2).
- The model file's folder is importable (``beside/model.py`` imports ``widths.py``) while its code
  runs, and its printing goes to standard error: ``run --json`` still parses.
- ``run --check`` trains the reference beside the run: one line "losses equal the reference's
  within 1e-5 ..." and exit 0, or ``pipetwin: check failed:`` with the first step (dropout: each
  rank draws its own masks) and exit 1.
"""
import hashlib
import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from executor.config import RunConfig
from executor.reference import CHECK_TOLERANCE, LossCheck
from executor.user_model import build_stack, layer_digests, stack_layout, user_code
from experiments.cli import main as cli_main
from tests.helpers import reference_one_thread

MODELS = Path(__file__).resolve().parent / "data" / "models"
FREE, IDENTITY, PASS = (f"{MODELS / 'param_free.py'}:{f}" for f in ("build", "build_identity", "build_pass"))
PID, DROPOUT, BESIDE = (f"{MODELS / n}:build" for n in ("pid_seeded.py", "dropout.py", "beside/model.py"))
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
    # a middle stage of one nn.Identity: its output is the received tensor itself (full and split backward)
    "pass-interleaved": RunConfig.of(model=PASS, schedule="interleaved", devices=2, microbatches=4,
                                     partition=(1, 1, 1, 2), **BASE),
    "pass-zb-v": RunConfig.of(model=PASS, schedule="zb-v", devices=2, microbatches=4, partition=(1, 1, 1, 2), **BASE),
    "gpt-dapple": RunConfig.of(model="tiny", schedule="dapple", devices=2, microbatches=4, **BASE),
}}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES[2]))
def test_parameter_free_first_stage_trains_as_the_reference(runs, case):
    cfg, low, res = runs(2)[case]
    ref = reference_one_thread(cfg)
    assert len(res.losses) == 3 == len(ref.losses)
    for got, want in zip(res.losses, ref.losses):
        assert abs(got - want) <= 1e-6 * abs(want), (case, res.losses, ref.losses)
    if case.startswith(("free", "identity", "pass")):
        assert res.losses[-1] < res.losses[0]          # it trained
        layout = stack_layout(cfg.model, low.num_stages, partition=cfg.blocks)
        assert sum(layout.params[i] for i in layout.stage_ranges()[0]) == 0     # the first stage holds none


def test_a_build_seeded_from_the_pid_is_refused_before_step_0(capsys):
    t0 = time.monotonic()
    rc = cli_main(["run", "--model", PID, "-s", "dapple", "-D", "2", "-N", "2", "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and time.monotonic() - t0 < 60      # at the ranks' start, no timeout waited out
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


# ---------------------------------------------------------------------------- run --check
def test_loss_check_numbers_and_lines():
    ok = LossCheck((2.0, 1.0), (2.0, 1.0 + 5e-6))
    assert ok.tolerance == 1e-5 == CHECK_TOLERANCE["fp32"] and ok.equal and ok.first_step is None
    assert ok.differences == (0.0, pytest.approx(5e-6 / (1 + 5e-6), rel=1e-9))
    assert ok.line() == "losses equal the reference's within 1e-5 (relative, fp32): largest difference 5.0e-06 at " \
                        "step 1 of 2"
    assert LossCheck((1.0, 1.0), (1.0, 1.0)).line() == \
        "losses equal the reference's within 1e-5 (relative, fp32): identical at all 2 steps"
    bad = LossCheck((1.5, 1.25, 1.0), (1.5, 1.2, 1.1))
    assert bad.first_step == 1 and not bad.equal
    assert bad.line() == ("losses differ from the reference's at step 1: 1.250000 vs 1.200000, a difference of "
                          "4.2e-02 > 1e-5 (relative, fp32)")
    assert bad.to_dict() == {"reference_losses": [1.5, 1.2, 1.1], "tolerance": 1e-5, "dtype": "fp32",
                             "relative_differences": list(bad.differences), "first_step_beyond": 1, "equal": False}
    assert LossCheck((1.0005,), (1.0,), "bf16").equal and not LossCheck((1.002,), (1.0,), "bf16").equal
    assert LossCheck((float("nan"),), (1.0,)).first_step == 0
    assert LossCheck((0.0,), (0.0,)).equal
    with pytest.raises(ValueError, match="the run has 1 losses, the reference 2"):
        LossCheck((1.0,), (1.0, 1.0))


def test_check_help_states_the_tolerances():
    from experiments.options import row
    help_text = row("check").help
    fp32, bf16 = (LossCheck((), (), d).tolerance_text for d in ("fp32", "bf16"))
    assert (fp32, bf16) == ("1e-5", "1e-3") and tuple(CHECK_TOLERANCE.values()) == (1e-5, 1e-3, 1e-2)
    assert f"{fp32} relative in fp32 ({bf16} in bf16)" in help_text
    assert "exit status 1" in help_text


def test_check_with_reference_is_refused(capsys, no_ranks):
    assert cli_main(["run", "--model", FREE, "-D", "2", "-N", "2", "--check", "--reference"]) == 2
    assert capsys.readouterr().err == ("pipetwin: error: --check trains the reference beside the run; --reference "
                                       "trains only the reference (drop one)\n")


@pytest.mark.slow
def test_check_passes_for_a_parameter_free_first_stage(capsys):
    assert cli_main(["run", "--model", FREE, "-s", "dapple", "-D", "2", "-N", "4", "--partition", "2,3", "--steps",
                     "3", "--check"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"losses equal the reference's within 1e-5 \(relative, fp32\): (identical at all 3 steps|"
                        r"largest difference \d\.\de-\d\d at step \d of 3)", out[-1]), out[-1]


@pytest.mark.slow
def test_check_fails_with_the_first_step_for_dropout(capsys):
    rc = cli_main(["run", "--model", DROPOUT, "-s", "dapple", "-D", "2", "-N", "4", "--steps", "3", "--check",
                   "--json"])
    out, err = capsys.readouterr()
    assert rc == 1
    check = json.loads(out)["check"]
    assert check["equal"] is False and check["tolerance"] == 1e-5 and len(check["reference_losses"]) == 3
    k = check["first_step_beyond"]
    assert k == 0     # each rank draws its own masks from the first micro-batch on
    assert re.fullmatch(r"pipetwin: check failed: losses differ from the reference's at step 0: \d\.\d{6} vs "
                        r"\d\.\d{6}, a difference of \d\.\de[-+]\d\d > 1e-5 \(relative, fp32\)\n", err), err
