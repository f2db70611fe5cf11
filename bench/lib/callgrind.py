"""Costs from a callgrind dump that `callgrind_annotate` does not give: self cost per
function, and who calls a function (with the cost of those calls).

valgrind 3.19's `callgrind_annotate --inclusive=no` attributes every instruction of the
gateway's dumps to `clone` (the thread entry), so `bench/profile instructions` reads the dump
itself. In the format, a cost line belongs to the function named by the last `fn=`, unless it
follows a `calls=` line: then it is the inclusive cost of a call to the function named by the
last `cfn=`. Names are compressed (`fn=(12) name` once, `fn=(12)` after).

    python3 callgrind.py self DUMP [--per ANSWERS] [--top N]
    python3 callgrind.py callers DUMP SUBSTRING [--per ANSWERS] [--top N]
"""

import argparse
import re
from collections import Counter

NAME = re.compile(r"(c?fn)=\((\d+)\)(?: (.*))?$")
COST = re.compile(r"^[+\-*0-9]")


def read(path, callee_of_interest=None):
    """Self cost per function, and the cost of calls into functions whose name contains
    `callee_of_interest`, by caller."""
    names = {}
    own = Counter()
    callers = Counter()
    current = callee = None
    after_calls = False
    with open(path, errors="replace") as dump:
        for line in dump:
            line = line.rstrip("\n")
            m = NAME.match(line)
            if m:
                kind, ident, name = m.groups()
                if name is not None:
                    names[ident] = name
                if kind == "fn":
                    current = names.get(ident, ident)
                else:
                    callee = names.get(ident, ident)
                continue
            if line.startswith("calls="):
                after_calls = True
                continue
            if COST.match(line) and current is not None:
                parts = line.split()
                cost = int(parts[1]) if len(parts) > 1 else 0
                if after_calls:
                    if callee_of_interest and callee and callee_of_interest in callee:
                        callers[current] += cost
                else:
                    own[current] += cost
                after_calls = False
    return own, callers


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["self", "callers"])
    parser.add_argument("dump")
    parser.add_argument("name", nargs="?")
    parser.add_argument("--per", type=float, default=0, help="answers in the window: cost per answer too")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    if args.what == "callers" and not args.name:
        parser.error("callers needs a function name (a substring of it)")
    own, callers = read(args.dump, args.name if args.what == "callers" else None)
    costs = own if args.what == "self" else callers
    total = sum(own.values())
    for name, cost in costs.most_common(args.top):
        per = f" {cost / args.per:>9,.0f} per answer" if args.per else ""
        print(f"{cost:>14,} ({100 * cost / total:5.2f}%){per}  {name[:150]}")


if __name__ == "__main__":
    main()
