"""executor.zero on two gloo processes: the ALLREDUCE of a ZeRO-1 stage is a reduce-scatter (each
rank receives the summed slice it steps, nothing else), and the all-gather puts the same weights
on both ranks."""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from executor.runtime import flatten


def _rank(rank: int, folder: str) -> None:
    from executor.zero import ShardedOptimizer, ShardGroups
    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store", 2), rank=rank, world_size=2)
    try:
        torch.manual_seed(0)                         # the same initial weights on both ranks
        mod = torch.nn.Linear(3, 3)                  # 12 parameters: a slice of 6 each
        params = list(mod.parameters())
        w0 = flatten([p.detach() for p in params]).clone()
        opt = ShardedOptimizer([(params, ShardGroups(dist.group.WORLD, rank, 2))], "sgd", 1.0)
        for k, p in enumerate(params):               # rank r's gradients: (r + 1) x (1, 2, 3, ...)
            p.grad = (rank + 1) * torch.arange(1.0, p.numel() + 1).view_as(p) + 100 * k
        flat = flatten([p.grad for p in params])
        total = flat.clone()
        dist.all_reduce(total)                       # the plain sum, to compare with
        scattered, work = opt.reduce_scatter(params, flat)
        work.wait()
        received = opt.shards[0].received.clone()
        not_scattered = opt.reduce_scatter([], torch.zeros(0))     # a stage without parameters
        opt.step()
        torch.save({"received": received, "sum": total, "scattered": scattered,
                    "excluded": not_scattered, "w0": w0, "w": flatten([p.detach() for p in params])},
                   f"{folder}/r{rank}.pt")
        dist.barrier()       # neither rank closes its connections while the other still reads from them
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_zero1_reduce_scatters_the_gradients_and_all_gathers_the_weights(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path),), nprocs=2, join=True)
    out = [torch.load(tmp_path / f"r{r}.pt") for r in (0, 1)]
    for r, o in enumerate(out):
        assert o["scattered"] is True and o["excluded"] == (False, None)
        # rank r received the sum of both ranks' gradients over its own 6 elements only
        assert o["received"].shape == (6,)
        assert torch.equal(o["received"], o["sum"][6 * r:6 * (r + 1)])
        # SGD (momentum's first step is the gradient itself), lr 1: w = w0 - summed gradient, on both ranks
        assert torch.allclose(o["w"], o["w0"] - o["sum"], atol=1e-6)
    assert torch.equal(out[0]["w"], out[1]["w"])


def _rank3(rank: int, folder: str) -> None:
    from executor.zero import ShardedOptimizer, ShardGroups
    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store3", 2), rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        mod = torch.nn.Linear(3, 3)                  # 12 parameters: a slice of 6 each
        params = list(mod.parameters())
        w0 = flatten([p.detach() for p in params]).clone()
        opt = ShardedOptimizer([(params, ShardGroups(dist.group.WORLD, rank, 2))], "sgd", 1.0, zero=3)
        shard = opt.shards[0]
        at_rest = (shard.flat.untyped_storage().nbytes(), opt.static_bytes(), tuple(shard.master.shape))
        moved = []

        class Watch:
            def param_storage_moved(self, old, new):
                moved.append(new != 0)
        opt.watch(Watch())
        opt.plan_step({id(params[0]): 1})
        opt.before(params, "F")
        gathered = flatten([p.detach() for p in params]).clone()
        x = torch.ones(1, 3)
        mod(x).sum().backward()                       # B: the weights are still there
        opt.after(params, "B")
        freed = shard.flat.untyped_storage().nbytes()
        flat = flatten([p.grad for p in params])
        opt.grads_ready(params)                       # the micro-batch's reduce-scatter
        grads_dropped = all(p.grad is None for p in params)
        opt.step()
        opt.gather_all()
        torch.save({"at_rest": at_rest, "gathered": gathered, "w0": w0, "freed": freed, "moved": moved,
                    "dropped": grads_dropped, "sum": 2 * flat, "w": flatten([p.detach() for p in params]),
                    "counts": dict(opt.counts)}, f"{folder}/z3r{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_zero3_keeps_a_slice_at_rest_and_gathers_the_weights_for_compute(tmp_path):
    """ZeRO-3 on two gloo processes, a Linear(3, 3) of n = 12 parameters: at rest a rank holds its
    master slice of 6 (24 bytes of weights + 24 of gradients; SGD's momentum not yet made) and the
    flat buffer's storage is 0 bytes; F gathers the 12 weights bit-equal to the initial ones, the
    last B frees them (watchers told: gathered, freed, gathered again); the micro-batch's reduce-scatter
    drops the unsharded gradients; after the step the gathered weights are w0 - the summed gradient."""
    mp.spawn(_rank3, args=(str(tmp_path),), nprocs=2, join=True)
    out = [torch.load(tmp_path / f"z3r{r}.pt") for r in (0, 1)]
    for o in out:
        assert o["at_rest"] == (0, 4 * 6 + 4 * 6, (6,))
        assert torch.equal(o["gathered"], o["w0"]) and o["freed"] == 0 and o["dropped"]
        assert o["moved"] == [True, False, True]
        assert torch.allclose(o["w"], o["w0"] - o["sum"], atol=1e-6)
        # one gather for F, one for the final read; one reduce-scatter: 12 x 4 bytes each
        assert o["counts"] == {"all_gather": 2, "all_gather_bytes": 96, "reduce_scatter": 1,
                               "reduce_scatter_bytes": 48}
    assert torch.equal(out[0]["w"], out[1]["w"])


def test_shard_groups_of_hsdp():
    """R = 4 replicas of a stage on ranks 1, 3, 5, 7 (D = 2, stage on device 1), S = 2: shard groups
    replicas {0, 1} and {2, 3}, replicate groups the same position in each; S = 0 shards over all."""
    from executor.zero import shard_groups
    ranks = [1, 3, 5, 7]
    assert shard_groups(ranks, 1, 4, 2) == ((1, 3), (1, 5), 0)
    assert shard_groups(ranks, 7, 4, 2) == ((5, 7), (3, 7), 1)
    assert shard_groups(ranks, 5, 4, 0) == ((1, 3, 5, 7), (5,), 2)
    # a bidirectional stage on two devices per replica (m = 2): a shard group is S x m ranks
    assert shard_groups([0, 3, 4, 7], 4, 2, 0) == ((0, 3, 4, 7), (4,), 2)
