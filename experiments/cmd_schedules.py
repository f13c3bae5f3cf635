"""``pipetwin schedules``: every schedule with its requirements."""
import re
import textwrap

from schedules import families

NAME = "schedules"
HELP = "list the schedules and their requirements"
WIDTH = 120

# a sentence ends at a full stop followed by a space or the end, not inside "et al." / "e.g." / "i.e."
_END = re.compile(r"(?<!\bal)(?<!\be\.g)(?<!\bi\.e)\.(?=\s|$)")


def add_arguments(p):
    p.add_argument("--long", action="store_true", help="print each schedule's full description")


def first_sentence(doc: str) -> str:
    """The first sentence of a docstring's first paragraph (whole, with its full stop)."""
    para = " ".join(doc.strip().split("\n\n", 1)[0].split())
    m = _END.search(para)
    return para[:m.end()] if m else para


def main(args) -> int:
    fams = families()
    width = max(map(len, fams))
    req = max(len(f.requires) for f in fams.values())
    indent = width + req + 4
    for name, fam in fams.items():
        lines = textwrap.wrap(first_sentence(fam.doc), max(40, WIDTH - indent), break_on_hyphens=False) or [""]
        print(f"{name.ljust(width)}  {fam.requires.ljust(req)}  {lines[0]}")
        for line in lines[1:]:
            print(" " * indent + line)
        if args.long:
            print("\n".join("    " + line for line in fam.doc.splitlines()[1:]) + "\n")
    return 0
