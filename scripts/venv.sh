#!/usr/bin/env bash
# The Python tools of CI and the benchmark lab live in one virtualenv under the build directory
# (target/venv, or $CARGO_TARGET_DIR/venv; TRIBUTARY_VENV overrides), never in the system Python:
# Debian's refuses `pip install` outside a virtualenv, and the tools go away with `cargo clean`.
#
#   scripts/venv.sh REQUIREMENTS.txt...   creates the virtualenv if needed, installs each file once
#                                         (again only when the file changes), prints its path
#   scripts/venv.sh --missing REQ.txt...  prints the files it would install now, one a line; installs nothing
#
# Callers put "$(scripts/venv.sh FILE...)/bin" first on PATH. Progress goes to stderr.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TRIBUTARY_VENV:-${CARGO_TARGET_DIR:-$repo/target}/venv}"
[[ $venv == /* ]] || venv="$repo/$venv"

missing_only=0
if [[ ${1:-} == --missing ]]; then
  missing_only=1
  shift
fi

# stamp_of FILE: where the hash of what was installed from FILE is kept; stamp_ok FILE: FILE was
# installed as it is now.
stamp_of() { printf '%s/.installed-%s' "$venv" "$(printf '%s' "${1#"$repo"/}" | tr '/' '_')"; }
stamp_ok() { [[ "$(cat "$(stamp_of "$1")" 2>/dev/null)" == "$(sha256sum "$1" | cut -d' ' -f1)" ]]; }

if ((missing_only)); then
  for req in "$@"; do
    [[ $req == /* ]] || req="$PWD/$req"
    stamp_ok "$req" || printf '%s\n' "${req#"$repo"/}"
  done
  exit 0
fi

if [[ ! -x $venv/bin/python ]]; then
  python3 -c 'import ensurepip, venv' 2>/dev/null ||
    { echo "venv: python3 cannot create virtualenvs: install python3-venv (apt-get install python3-venv)" >&2; exit 1; }
  echo "venv: creating $venv" >&2
  mkdir -p "$(dirname "$venv")"
  timeout 300 python3 -m venv "$venv" >&2
fi

for req in "$@"; do
  [[ $req == /* ]] || req="$PWD/$req"
  [[ -f $req ]] || { echo "venv: no such requirements file: $req" >&2; exit 1; }
  # One stamp per requirements file, holding the hash of what was installed from it.
  stamp_ok "$req" && continue
  echo "venv: installing ${req#"$repo"/} into $venv" >&2
  timeout 900 "$venv/bin/pip" install -q --disable-pip-version-check -r "$req" >&2
  sha256sum "$req" | cut -d' ' -f1 >"$(stamp_of "$req")"
done

echo "$venv"
