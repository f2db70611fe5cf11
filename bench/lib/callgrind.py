"""Costs from a callgrind dump that `callgrind_annotate` does not give: self cost per
function, and who calls a function (with the cost of those calls).

valgrind 3.19's `callgrind_annotate --inclusive=no` attributes every instruction of the
gateway's dumps to `clone` (the thread entry), so `bench/profile instructions` reads the dump
itself. In the format, a cost line belongs to the function named by the last `fn=`, unless it
follows a `calls=` line: then it is the inclusive cost of a call to the function named by the
last `cfn=`. Names are compressed (`fn=(12) name` once, `fn=(12)` after).

    python3 callgrind.py self DUMP [--per ANSWERS] [--top N]
    python3 callgrind.py callers DUMP SUBSTRING [--per ANSWERS] [--top N]
    python3 callgrind.py callees DUMP SUBSTRING [--per ANSWERS] [--top N]
    python3 callgrind.py calls DUMP NAME [NAME...] [--per ANSWERS]

`calls` counts the calls into functions named exactly NAME (the allocator's entry points, say:
how many allocations an answer makes). `callees` is the other direction: what the functions
whose name contains SUBSTRING spend, their own instructions and each function they call
(inclusive), to walk down from a layer.
"""

import argparse
import re
from collections import Counter

NAME = re.compile(r"(c?fn)=\((\d+)\)(?: (.*))?$")
COST = re.compile(r"^[+\-*0-9]")


def read(path, callee_of_interest=None, caller_of_interest=None):
    """Self cost per function; the cost of calls into functions whose name contains
    `callee_of_interest`, by caller; and what functions whose name contains
    `caller_of_interest` spend, by callee (their own cost under "(self)")."""
    names = {}
    own = Counter()
    callers = Counter()
    callees = Counter()
    count = Counter()
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
                count[callee] += int(line.split()[0][len("calls="):])
                continue
            if COST.match(line) and current is not None:
                parts = line.split()
                cost = int(parts[1]) if len(parts) > 1 else 0
                mine = caller_of_interest and caller_of_interest in current
                if after_calls:
                    if callee_of_interest and callee and callee_of_interest in callee:
                        callers[current] += cost
                    if mine:
                        callees[callee] += cost
                else:
                    own[current] += cost
                    if mine:
                        callees["(self)"] += cost
                after_calls = False
    return own, callers, callees, count


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["self", "callers", "callees", "calls"])
    parser.add_argument("dump")
    parser.add_argument("name", nargs="*")
    parser.add_argument("--per", type=float, default=0, help="answers in the window: cost per answer too")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    if args.what != "self" and not args.name:
        parser.error(f"{args.what} needs a function name (a substring of it)")
    if args.what in ("callers", "callees") and len(args.name) > 1:
        parser.error(f"{args.what} takes one function name")
    name = args.name[0] if args.name else None
    own, callers, callees, count = read(
        args.dump,
        name if args.what == "callers" else None,
        name if args.what == "callees" else None,
    )
    if args.what == "calls":
        for fn in args.name:
            per = f" {count[fn] / args.per:>9,.1f} per answer" if args.per else ""
            print(f"{count[fn]:>14,} calls{per}  {fn}")
        return
    costs = {"self": own, "callers": callers, "callees": callees}[args.what]
    total = sum(own.values())
    for name, cost in costs.most_common(args.top):
        per = f" {cost / args.per:>9,.0f} per answer" if args.per else ""
        print(f"{cost:>14,} ({100 * cost / total:5.2f}%){per}  {name[:150]}")


if __name__ == "__main__":
    main()
