"""``pipetwin schedules``: every schedule with its requirements; ``--export NAME -D D -N N --format
torch-csv|text [--out FILE]`` writes one family's compute-only schedule as a file that
``--schedule-file`` reads back (:mod:`schedules.io`; standard output without ``--out``)."""
import re
import textwrap

from schedules import families
from schedules.io import FORMAT_NAMES, FORMATS
from schedules.registry import aliases_of

from .checks import output_file, positive_int

NAME = "schedules"
HELP = "list the schedules and their requirements"
WIDTH = 120

# a sentence ends at a full stop followed by a space or the end, not inside "et al." / "e.g." / "i.e."
_END = re.compile(r"(?<!\bal)(?<!\be\.g)(?<!\bi\.e)\.(?=\s|$)")


def add_arguments(p):
    p.add_argument("--long", action="store_true", help="print each schedule's full description")
    p.add_argument("--export", metavar="NAME", help="write schedule NAME (a family or an upstream name) as a file "
                   "that --schedule-file reads: give -D, -N and --format")
    p.add_argument("--devices", "-D", type=positive_int, help="--export: pipeline devices D")
    p.add_argument("--microbatches", "-N", type=positive_int, help="--export: micro-batches N")
    p.add_argument("--chunks", "-v", type=positive_int, help="--export: chunks per device (families that take them)")
    p.add_argument("--variant", help="--export: the family's variant (default: its first)")
    p.add_argument("--format", choices=FORMATS,
                   help="--export: " + "; ".join(f"{k}: {v}" for k, v in FORMAT_NAMES.items())
                   + " (single-copy schedules only)")
    p.add_argument("--out", metavar="FILE", type=output_file, help="--export: write here (default: standard output)")


def first_sentence(doc: str) -> str:
    """The first sentence of a docstring's first paragraph (whole, with its full stop)."""
    para = " ".join(doc.strip().split("\n\n", 1)[0].split())
    m = _END.search(para)
    return para[:m.end()] if m else para


def export(args) -> int:
    """``--export``: build the family and write it in ``--format`` (stdout, or ``--out``)."""
    from cost_models.files import write_output
    from schedules import build, get
    from schedules.io import export_text

    from .jobs import check_chunks
    missing = [f for f, v in (("-D", args.devices), ("-N", args.microbatches), ("--format", args.format)) if v is None]
    if missing:
        raise ValueError(f"--export {args.export} needs {', '.join(missing)}")
    check_chunks(args.chunks, [args.export])
    if args.out is not None and args.format == "text" and str(args.out).lower().endswith(".csv"):
        raise ValueError(f"--out {args.out}: a .csv name is read back as torch.distributed.pipelining CSV; "
                         f"write --format text under another name (e.g. .txt) or use --format torch-csv")
    kw = {k: v for k, v in (("chunks", args.chunks), ("variant", args.variant)) if v is not None}
    text = export_text(build(args.export, args.devices, args.microbatches, **kw), args.format)
    if args.out is None:
        print(text, end="")
        return 0
    write_output(args.out, text, "schedule file")
    print(f"wrote {args.out}: {get(args.export).name} D={args.devices} N={args.microbatches} as "
          f"{FORMAT_NAMES[args.format]}")
    return 0


def main(args) -> int:
    if args.export is not None:
        return export(args)
    given = [f for f, v in (("-D", args.devices), ("-N", args.microbatches), ("--chunks", args.chunks),
                            ("--variant", args.variant), ("--format", args.format), ("--out", args.out))
             if v is not None]
    if given:
        raise ValueError(f"{', '.join(given)} apply to --export NAME; give it (or drop them)")
    fams = families()
    width = max(map(len, fams))
    req = max(len(f.requires) for f in fams.values())
    indent = width + req + 4
    for name, fam in fams.items():
        also = aliases_of(name)
        text = first_sentence(fam.doc) + (f" Upstream name: {', '.join(also)}." if also else "")
        lines = textwrap.wrap(text, max(40, WIDTH - indent), break_on_hyphens=False) or [""]
        print(f"{name.ljust(width)}  {fam.requires.ljust(req)}  {lines[0]}")
        for line in lines[1:]:
            print(" " * indent + line)
        if args.long:
            print("\n".join("    " + line for line in fam.doc.splitlines()[1:]) + "\n")
    return 0
