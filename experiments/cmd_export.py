"""``pipetwin export --to megatron|torchtitan|torch-csv``: a job, written for the framework users
train with. The job comes as ``simulate`` takes it (the layout and model options, ``--plan
PLAN.json``, ``--from-megatron FILE`` / ``--from-torchtitan FILE``); the text goes to standard output,
or ``--out FILE``. The table of arguments and its conversions both ways is
:mod:`cost_models.frameworks`; what a target cannot run is refused in one line naming the nearest
schedule it runs."""
from __future__ import annotations

from .jobs import check_plan_args, job_from_args
from .options import add_options
from .tables import printable

NAME = "export"
HELP = "write a job as Megatron-LM arguments, torchtitan overrides or a torch.distributed.pipelining CSV"


def add_arguments(p):
    add_options(p, NAME)


def write_export(ex, out: str | None, what: str) -> None:
    """An :class:`cost_models.frameworks.Export`: its beside-files, then its text (standard output
    without ``out``)."""
    import sys
    from cost_models.files import write_output
    for note in ex.notes:
        print(f"pipetwin: note: {note}", file=sys.stderr)
    for path, text in ex.files.items():
        write_output(path, text, "schedule CSV")
    if out is None:
        print(ex.text, end="")
        return
    write_output(out, ex.text, what)
    for path in ex.files:
        print(f"wrote {printable(path)}: the schedule as torch.distributed.pipelining CSV")
    print(f"wrote {printable(out)}: {what}")


def main(args) -> int:
    from cost_models.frameworks import export_job
    job = job_from_args(args, plan=check_plan_args(args))
    ex = export_job(job, args.to, args.out)
    write_export(ex, args.out, {"megatron": "Megatron-LM arguments", "torchtitan": "torchtitan overrides",
                                "torch-csv": "torch.distributed.pipelining CSV"}[args.to])
    return 0
