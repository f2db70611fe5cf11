#!/usr/bin/env bash
# Documentation check: what the README and docs/ show is what the code does.
#
#   BIN_DIR=target/debug bash .ci/check-docs.sh
#
# 1. Command samples: a fenced block between `<!-- output:begin -->` and `<!-- output:end -->`
#    starts with `$ COMMAND`; the rest of the block must be exactly what COMMAND prints (stdout and
#    stderr), run by bash from the repository root with `tributary` and `downstream-sim` taken from
#    BIN_DIR and no TRIBUTARY_* or DATABASE_URL variables inherited.
# 2. Links: every relative link in a tracked Markdown file points at a tracked file or folder
#    inside the repository, and its #anchor, if any, at a heading of that file.
# 3. No issue numbers: the reader cannot see the tracker, so a number from it means nothing to them.
# Prints one line per failure and a summary; exits 1 if anything failed.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN_DIR=${BIN_DIR:-target/debug}
case $BIN_DIR in /*) ;; *) BIN_DIR=$PWD/$BIN_DIR ;; esac
[[ -x $BIN_DIR/tributary ]] || { echo "check-docs: no $BIN_DIR/tributary (cargo build --bins first)"; exit 1; }
export BIN_DIR
exec python3 - <<'PY'
import os
import re
import subprocess
import sys
from pathlib import Path

root = Path.cwd()
files = subprocess.run(["git", "ls-files", "-z"], check=True, capture_output=True, text=True).stdout.split("\0")
tracked = {f for f in files if f}
tracked_dirs = {str(parent) for f in tracked for parent in Path(f).parents if str(parent) != "."}
markdown = sorted(f for f in tracked if f.endswith(".md") and (root / f).is_file())
failures = []
checked = {"samples": 0, "links": 0}


def fail(where, what):
    failures.append(f"{where}: {what}")
    print(f"FAIL {where}: {what}")


# ---- 1. command samples --------------------------------------------------------------------------
env = {k: v for k, v in os.environ.items() if not (k.startswith("TRIBUTARY_") or k == "DATABASE_URL")}
env["PATH"] = f"{os.environ['BIN_DIR']}:{env['PATH']}"
sample = re.compile(r"<!-- output:begin -->\n```[a-z]*\n\$ (?P<cmd>[^\n]*)\n(?P<out>.*?)```\n<!-- output:end -->", re.S)
for f in markdown:
    text = (root / f).read_text()
    for m in sample.finditer(text):
        line = text[: m.start()].count("\n") + 1
        checked["samples"] += 1
        run = subprocess.run(["bash", "-c", m["cmd"]], cwd=root, env=env, capture_output=True, text=True, timeout=60)
        actual = run.stdout + run.stderr
        if actual != m["out"]:
            fail(f"{f}:{line}", f"`{m['cmd']}` prints something else now:\n--- the page\n{m['out']}--- the binary\n{actual}")
    if text.count("<!-- output:begin -->") != len(sample.findall(text)):
        fail(f, "an <!-- output:begin --> block is not a fenced block starting with `$ COMMAND` and closed by <!-- output:end -->")


# ---- 2. links ---------------------------------------------------------------------------------------
def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"`|\*\*?|_(?=\w)|(?<=\w)_", "", heading.strip())
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(path):
    seen, out = {}, set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            s = slug(m[1])
            n = seen.get(s, 0)
            out.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    return out


link = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
for f in markdown:
    in_code = False
    for n, line in enumerate((root / f).read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        line = re.sub(r"`[^`]*`", "", line)
        for m in link.finditer(line):
            target = m[1] or m[2]
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue  # a URL (https:, mailto:)
            checked["links"] += 1
            path, _, anchor = target.partition("#")
            dest = (root / f).parent / path if path else root / f
            try:
                rel = dest.resolve().relative_to(root.resolve())
            except ValueError:
                fail(f"{f}:{n}", f"{target} points outside the repository")
                continue
            rel_s = str(rel)
            if rel_s not in tracked and rel_s not in tracked_dirs and rel_s != ".":
                fail(f"{f}:{n}", f"{target}: no such file in the repository")
                continue
            if anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest):
                fail(f"{f}:{n}", f"{target}: no heading #{anchor} in {rel_s}")

# ---- 3. issue numbers ---------------------------------------------------------------------------------
issue = re.compile(r"\b[Ii]ssues? #?\d+|\(#\d+\)")
for f in sorted(tracked):
    p = root / f
    if not p.is_file() or not re.search(r"\.(md|rs|sh|py|toml|ya?ml)$|^(\.ci/run|bench/run|bench/smoke|bench/profile|Makefile)$", f):
        continue
    for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
        if issue.search(line):
            fail(f"{f}:{n}", f"names an issue the reader cannot see: {line.strip()[:100]}")

print(f"check-docs: {checked['samples']} command samples, {checked['links']} relative links in {len(markdown)} Markdown files; "
      f"{len(failures)} failed")
sys.exit(1 if failures else 0)
PY
