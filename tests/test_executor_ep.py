"""Expert parallelism in the executor (``pipetwin run --ep E``): the mesh's expert fold, the
refusals, and (spawned gloo ranks) training against the single-process reference."""
from __future__ import annotations

import pytest

from executor.mesh import Mesh


@pytest.mark.parametrize("tp,ep,etp,eps,edps", [
    # T 1, R 4 (stage on pipeline ranks 0, 2, 4, 6): EP 2 -> EP groups of consecutive replicas, EDP 2
    (1, 2, 1, ((0, 2), (4, 6)), ((0, 4), (2, 6))),
    (1, 4, 1, ((0, 2, 4, 6),), ((0,), (2,), (4,), (6,))),
    # T 2, R 4: 8 processes 0,1 4,5 8,9 12,13; EP 2 x ETP 2 -> member (k EP + e) ETP + u
    (2, 2, 2, ((0, 4), (1, 5), (8, 12), (9, 13)), ((0, 8), (1, 9), (4, 12), (5, 13))),
    (2, 4, 1, ((0, 1, 4, 5), (8, 9, 12, 13)), ((0, 8), (1, 9), (4, 12), (5, 13))),
])
def test_expert_fold_is_megatrons(tp, ep, etp, eps, edps):
    """Process i of the stage's T x R (TP fastest) is EP rank e of EP group (k, u) and EDP rank k
    of EDP group (e, u), i = (k EP + e) ETP + u (cost_models.moe's folding)."""
    mesh = Mesh(tp, 8)          # D 2 x R 4 pipeline ranks; the stage on device 0: ranks 0, 2, 4, 6
    got_ep, got_edp = mesh.expert_fold((0, 2, 4, 6), ep, etp)
    assert got_ep == eps and got_edp == edps
    assert sorted(r for g in got_ep for r in g) == sorted(r for g in got_edp for r in g) == \
        sorted(mesh.rank(p, t) for p in (0, 2, 4, 6) for t in range(tp))
