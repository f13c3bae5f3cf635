"""Fixtures shared by the test modules: the calibrations of this machine, the lazy runs of a
module's cases, and a guard that no rank starts (for refusals).

The suite has two tiers (pytest.ini's markers): ``make check`` leaves out the tests marked
``slow`` (processes beyond one world-2 run per family, real calibrations, notebooks, paper
reproductions); ``make test`` runs everything but ``long``. Share what a test needs through the
fixtures here (or a module's ``CASES`` and ``runs``) rather than launching ranks or calibrating
again: every launch costs seconds of process start-up on this 2-core host.

A real calibration takes 15-25 s on two cores, so each kind is made once per test session and
shared: the tiny GPT's (calibrated and validated in one sitting) by the cross-validation tests
and the cross-validation notebook, the tied language model's (a model file, through ``pipetwin
calibrate``) by the model-file tests and the model-file notebook. Session fixtures are made on
first use only: a test file run alone calibrates no more than it needs.
"""
from pathlib import Path

import pytest

MODELS = Path(__file__).resolve().parent.parent / "notebooks" / "models"
TIED_LM = f"{MODELS / 'tied_lm.py'}:build"


@pytest.fixture(scope="session")
def tiny_sitting(tmp_path_factory):
    """The tiny GPT calibrated and validated in one sitting on 2 ranks
    (:func:`calibration.calibrate_and_compare`: GPipe and DAPPLE beside the calibration's traced
    runs, 4 steps, two rounds whatever the host's load: a busy host leaves the runs unsettled,
    which the profile records; the fits use all runs then), its profile saved: (profile as
    measured, profile read back from its file, comparisons, the file)."""
    from calibration import SittingRules, calibrate_and_compare
    from cost_models import load_profile, save_profile
    from cost_models.job import Job, Layout
    jobs = [Job(layout=Layout(schedule=s, devices=2, microbatches=4), model="tiny") for s in ("gpipe", "dapple")]
    prof, comps = calibrate_and_compare(jobs, steps=4, repeats=5, rules=SittingRules(runs=2, max_runs=2, warmup=1))
    path = save_profile(prof, tmp_path_factory.mktemp("tiny") / "calibration.yaml")
    return prof, load_profile(path), comps, path


@pytest.fixture(scope="session")
def tied_lm_profile(tmp_path_factory):
    """``notebooks/models/tied_lm.py`` calibrated by ``pipetwin calibrate`` on 2 ranks, short (3
    repeats per measurement, one round of 4-step traced runs): (profile, its file)."""
    from cost_models import load_profile
    from experiments.cli import main
    path = tmp_path_factory.mktemp("tied_lm") / "tied_lm.yaml"
    assert main(["calibrate", "--model", TIED_LM, "--ranks", "2", "--repeats", "3", "--runtime-steps", "4",
                 "--runtime-repeats", "1", "--out", str(path)]) == 0
    return load_profile(path), path


@pytest.fixture(scope="module")
def runs(request):
    """The test module's ``CASES`` run lazily, one launch of ranks per world size, each once:
    ``runs(world)`` -> {case: (config, lowered schedule, result)}. ``CASES`` is {world: {case:
    config, or (config, schedule) to run a schedule other than the config's own}}."""
    from executor.config import lowered_schedule
    from executor.launch import run_many
    cases_of, cache = request.module.CASES, {}

    def get(world):
        if world not in cache:
            jobs = {k: c if isinstance(c, tuple) else (c, None) for k, c in cases_of[world].items()}
            results = run_many(list(jobs.values()))
            cache[world] = {k: (cfg, lowered_schedule(cfg, sched), res)
                            for (k, (cfg, sched)), res in zip(jobs.items(), results)}
        return cache[world]
    return get


@pytest.fixture()
def no_ranks(monkeypatch):
    """Fails the test if anything starts ranks (:func:`executor.launch.launch`, which every run,
    calibration and benchmark goes through): for refusals that must come before any process starts,
    said without a time bound (the host is shared)."""
    import executor.launch

    def refuse(target, payload, world):
        raise AssertionError(f"{world} ranks were started ({target}) before the refusal")
    monkeypatch.setattr(executor.launch, "launch", refuse)
