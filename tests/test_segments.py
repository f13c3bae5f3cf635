"""cost_models.segments: a block's segments sum to the ledger's block, whatever the layout.

The one rule that says what each segment of an overlapped pair keeps (:func:`block_segments`) is
the ledger's block (:func:`cost_models.transformer.block_activation_bytes`) cut in two or three;
a term the ledger gains (EP's regrouping orders, ETP's gathered rows, MLA's latents) must land in
exactly one segment, or the simulator's pair memory and its unpaired memory disagree."""
import itertools

import pytest

from cost_models.model_spec import load_model
from cost_models.parallel import Parallel
from cost_models.segments import block_segments
from cost_models.transformer import block_activation_bytes, is_moe_block

GRID = [(tp, sp, ep, etp, rc) for tp, sp, ep, etp, rc in
        itertools.product([1, 2], [False, True], [1, 2], [1, 2], ["none", "selective", "full"]) if tp > 1 or not sp]


@pytest.mark.parametrize("name", ["tiny", "tiny-mixtral", "tiny-deepseek", "mixtral-8x7b", "deepseek-v3"])
def test_segments_sum_to_the_ledgers_block(name):
    spec = load_model(name)
    for tp, sp, ep, etp, rc in GRID:
        par = Parallel(tp=tp, sequence_parallel=sp, ep=ep, etp=etp)
        for i in range(min(spec.layers, 4)):
            moe = is_moe_block(spec, i)
            segs = block_segments(spec, i, tp=tp, sp=sp, recompute=rc, parallel=par)
            assert len(segs) == (3 if moe else 1 if tp == 1 else 2)
            total = block_activation_bytes(spec, rc, None, tp, sp, moe, par)
            assert sum(segs) == pytest.approx(total, rel=1e-12), (name, tp, sp, ep, etp, rc, i)


def test_the_experts_segment_keeps_etps_rows_and_eps_orders():
    """tiny-mixtral, block 0, T 1: pairs = n k = b s k; the experts segment is
    pairs (ETP h + 3 f_e) d + 16 ETP pairs at EP x ETP > 1 (two int64 orders a row computed)."""
    spec = load_model("tiny-mixtral")
    pairs = spec.micro_batch * spec.seq_len * spec.top_k
    h, fe, d = spec.hidden, spec.expert_width, spec.dtype_bytes
    for ep, etp in [(1, 1), (2, 1), (1, 2), (2, 2)]:
        seg = block_segments(spec, 0, parallel=Parallel(ep=ep, etp=etp))[1]
        assert seg == pairs * (etp * h + 3 * fe) * d + (16 * etp * pairs if ep * etp > 1 else 0)
