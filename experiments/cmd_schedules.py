"""``pipetwin schedules``: every schedule with its requirements."""
from schedules import families

NAME = "schedules"
HELP = "list the schedules and their requirements"


def add_arguments(p):
    p.add_argument("--long", action="store_true", help="print each schedule's full description")


def main(args) -> int:
    fams = families()
    width = max(map(len, fams))
    for name, fam in fams.items():
        first = fam.doc.splitlines()[0] if fam.doc else ""
        print(f"{name.ljust(width)}  {fam.requires:<42}  {first}")
        if args.long:
            print("\n".join("    " + line for line in fam.doc.splitlines()[1:]) + "\n")
    return 0
