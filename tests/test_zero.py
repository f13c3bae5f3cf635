"""executor.zero on two gloo processes: the ALLREDUCE of a ZeRO-1 stage is a reduce-scatter (each
rank receives the summed slice it steps, nothing else), and the all-gather puts the same weights
on both ranks."""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from executor.runtime import flatten


def _rank(rank: int, folder: str) -> None:
    from executor.zero import ShardedOptimizer
    dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store", 2), rank=rank, world_size=2)
    try:
        torch.manual_seed(0)                         # the same initial weights on both ranks
        mod = torch.nn.Linear(3, 3)                  # 12 parameters: a slice of 6 each
        params = list(mod.parameters())
        w0 = flatten([p.detach() for p in params]).clone()
        opt = ShardedOptimizer([(params, dist.group.WORLD, rank, 2)], "sgd", 1.0)
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
