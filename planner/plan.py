"""A plan: stages (contiguous layer ranges), the replicas of each, where they sit, and the batching.

The global batch G is split into M micro-batches of b = G / M samples; stage s runs on r_s devices
and each of them processes b / r_s samples of every micro-batch (data parallelism inside the
stage; the stage's gradients are all-reduced over its r_s devices once per iteration).

A plan is **uniform** when every stage has the same number of replicas R: it is then R copies of a
D-stage pipeline, which the IR expresses directly (``lower(build(schedule, D, M), replicas=R)``,
per-replica micro-batch b / R, rank ``i * D + s`` = replica i of stage s). A non-uniform plan is
simulated through :func:`schedules.dapple_replicated.replicated_schedule` (see there).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from cost_models.files import short_list


@dataclass(frozen=True)
class StagePlan:
    """Layers [start, stop) on ``len(devices)`` replicas (physical device ids)."""

    start: int
    stop: int
    devices: tuple[int, ...]

    @property
    def replicas(self) -> int:
        return len(self.devices)

    @property
    def num_layers(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Plan:
    model: str
    cluster: str
    global_batch: int
    microbatches: int
    stages: tuple[StagePlan, ...]
    policy: str
    schedule: str = "dapple"
    chunks: int = 2
    split: tuple[int, ...] = ()     # layers per stage of the schedule when it has other stages than the
    #                                 plan's (interleaved, V-shaped: v x D); () = the plan's own partition

    def __post_init__(self):
        for name in ("global_batch", "microbatches", "chunks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"plan: field {name!r} must be an integer >= 1; got {v!r}")
        if not self.stages:
            raise ValueError("plan: field 'stages' is empty; a plan needs at least one stage")
        if self.global_batch % self.microbatches:
            raise ValueError(f"global batch {self.global_batch} is not a multiple of {self.microbatches} micro-batches")
        b = self.micro_batch
        for s, st in enumerate(self.stages):
            if st.replicas < 1 or b % st.replicas:
                raise ValueError(f"stage {s}: micro-batch {b} cannot be split over {st.replicas} replicas")
            if st.stop <= st.start:
                raise ValueError(f"stage {s} has no layers ({st.start}..{st.stop})")
        for a, c in zip(self.stages, self.stages[1:]):
            if a.stop != c.start:
                raise ValueError(f"stages must be contiguous: one ends at layer {a.stop}, the next starts at {c.start}")
        if self.split and (sum(self.split) != self.num_layers or min(self.split) < 1):
            raise ValueError(f"plan: field 'split' {short_list(self.split)} must give each schedule stage >= 1 "
                             f"layer and cover the plan's {self.num_layers} layers")
        devs = [d for st in self.stages for d in st.devices]
        if len(set(devs)) != len(devs):
            raise ValueError("two stages share a device")

    # ---------------------------------------------------------------- shape
    @property
    def micro_batch(self) -> int:
        """b: samples per micro-batch, over all replicas of a stage."""
        return self.global_batch // self.microbatches

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(st.replicas for st in self.stages)

    @property
    def partition(self) -> tuple[int, ...]:
        """Layers per stage."""
        return tuple(st.num_layers for st in self.stages)

    @property
    def schedule_partition(self) -> tuple[int, ...]:
        """Layers per stage of the schedule the plan runs: ``split`` where the schedule's stages are
        not the plan's, else :attr:`partition` (what the simulator, the executor and the printed
        command use)."""
        return self.split or self.partition

    @property
    def num_layers(self) -> int:
        return self.stages[-1].stop - self.stages[0].start

    @property
    def devices_used(self) -> int:
        return sum(self.replicas)

    @property
    def uniform(self) -> bool:
        return len(set(self.replicas)) == 1

    @property
    def dp(self) -> int:
        """R for a uniform plan (replicas of every stage)."""
        if not self.uniform:
            raise ValueError(f"plan with replicas {short_list(self.replicas)} is not uniform")
        return self.stages[0].replicas

    def device_map(self) -> tuple[int, ...]:
        """Rank -> physical device for the IR form of a uniform plan: rank i * D + s is replica i of stage s."""
        D, R = self.num_stages, self.dp
        return tuple(self.stages[r % D].devices[r // D] for r in range(D * R))

    def with_schedule(self, schedule: str, chunks: int | None = None, split: tuple[int, ...] = ()) -> "Plan":
        return replace(self, schedule=schedule, chunks=self.chunks if chunks is None else chunks,
                       split=tuple(split))

    def describe(self) -> str:
        reps = self.replicas
        rep = f"x{reps[0]} each" if self.uniform else "replicas " + ":".join(map(str, reps))
        over = f" over {len(self.split)} schedule stages" if self.split else ""
        return (f"{self.num_stages} stage(s) {rep}, layers " + "|".join(map(str, self.schedule_partition)) + over
                + f", {self.policy}, M={self.microbatches} x b={self.micro_batch}, {self.schedule}")

    # ---------------------------------------------------------------- dict
    def to_dict(self) -> dict:
        return {"model": self.model, "cluster": self.cluster, "global_batch": self.global_batch,
                "microbatches": self.microbatches, "micro_batch": self.micro_batch, "policy": self.policy,
                "schedule": self.schedule, "chunks": self.chunks, "split": list(self.split),
                "stages": [{"layers": [st.start, st.stop], "replicas": st.replicas, "devices": list(st.devices)}
                           for st in self.stages]}

    @staticmethod
    def from_dict(d: dict) -> "Plan":
        try:
            stages = tuple(StagePlan(int(s["layers"][0]), int(s["layers"][1]), tuple(int(x) for x in s["devices"]))
                           for s in d["stages"])
            for k, (s, st) in enumerate(zip(d["stages"], stages)):
                if "replicas" in s and int(s["replicas"]) != st.replicas:
                    raise ValueError(f"plan: stage {k} has 'replicas' {s['replicas']} but {st.replicas} devices")
            return Plan(str(d["model"]), str(d["cluster"]), int(d["global_batch"]), int(d["microbatches"]), stages,
                        str(d["policy"]), str(d.get("schedule", "dapple")), int(d.get("chunks", 2)),
                        tuple(int(x) for x in d.get("split") or ()))
        except KeyError as e:
            raise ValueError(f"plan: missing field {e.args[0]!r}") from None
        except (TypeError, IndexError):
            raise ValueError("plan: malformed field (stages need 'layers': [start, stop] and 'devices': [ids])") \
                from None
