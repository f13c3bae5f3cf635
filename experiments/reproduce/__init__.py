"""Paper reproductions. Each target writes CSV + PNG + a markdown report under ``out/reproduce/<name>``;
every number comes from the simulator at run time, with the paper's numbers beside it."""
from __future__ import annotations

import importlib

TARGETS = {
    "bitpipe": "experiments.reproduce.bitpipe",
    "dapple-runtime": "experiments.reproduce.dapple_runtime",
    "dapple-planner": "experiments.reproduce.dapple_planner",
    "cost-curves": "experiments.reproduce.cost_curves",
    "megatron": "experiments.reproduce.megatron",
    "korthikanti": "experiments.reproduce.korthikanti",
    "zero-bubble": "experiments.reproduce.zero_bubble",
    "deepseek-v3": "experiments.reproduce.deepseek_v3",
    "llama3": "experiments.reproduce.llama3",
    "torchtitan": "experiments.reproduce.torchtitan",
    "hetero-schedules": "experiments.hetero_schedules",
}


def available() -> dict[str, str]:
    out = {}
    for name, mod in TARGETS.items():
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue
        out[name] = mod
    return out


def run(name: str, out_dir, quick: bool = False) -> str:
    targets = available()
    if name not in targets:
        raise ValueError(f"unknown reproduction {name!r}; choose one of {', '.join(targets)}")
    return importlib.import_module(targets[name]).run(out_dir, quick=quick)
