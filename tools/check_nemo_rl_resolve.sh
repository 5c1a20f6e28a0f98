#!/usr/bin/env bash
# Can jetrl_megatron be installed into NeMo-RL v0.7.0's environment? A pip dry-run on Python 3.13 of the project
# (with its gpu extra: torch, triton, vLLM) against NeMo-RL's versions, constraints/nemo_rl_v0.7.0.txt. Prints the
# versions pip would install; exits non-zero when it cannot resolve. Needs the package index; installs nothing.
# Usage, from anywhere:  bash tools/check_nemo_rl_resolve.sh [EXTRAS]
#   EXTRAS  gpu (default), or '' for the library alone
#   PYTHON  a Python 3.13 interpreter (default: the first python3.13 that runs, then pyenv's newest 3.13)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
extras=${1-gpu}
py=${PYTHON:-}
if [ -z "$py" ]; then
  # pyenv's shim for a version that is installed but not selected exists and fails: try each candidate
  for cand in python3.13 "$HOME"/.pyenv/versions/3.13*/bin/python3.13; do
    if "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 13))' 2>/dev/null; then py=$cand; fi
  done
fi
[ -n "$py" ] || { echo "no Python 3.13 found: set PYTHON=/path/to/python3.13" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m venv "$work/venv"
vpy=$work/venv/bin/python
"$vpy" -m pip install -q --upgrade pip 2>/dev/null
echo "date: $(date -u +%Y-%m-%dT%H:%MZ)  $("$vpy" -V)  pip $("$vpy" -m pip --version | cut -d' ' -f2)"
# --prefer-binary, not --only-binary=:all:: antlr4-python3-runtime 4.9.3 (hydra-core's) exists only as an sdist.
cmd=(install --dry-run --ignore-installed --prefer-binary --quiet --report "$work/report.json"
     -c "$repo/constraints/nemo_rl_v0.7.0.txt" "$repo${extras:+[$extras]}")
echo "pip install --dry-run --ignore-installed --prefer-binary -c constraints/nemo_rl_v0.7.0.txt .${extras:+[$extras]}"
"$vpy" -m pip "${cmd[@]}" 2> >(grep -v '^WARNING: Location' >&2)
"$vpy" - "$work/report.json" "$repo/constraints/nemo_rl_v0.7.0.txt" <<'EOF'
import json
import re
import sys

canon = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
pins = {}
for line in open(sys.argv[2]):
    line = line.split("#", 1)[0].strip()
    if line:
        name, version = line.split("==")
        pins[canon(name)] = version
got = sorted((canon(i["metadata"]["name"]), i["metadata"]["version"]) for i in json.load(open(sys.argv[1]))["install"])
free = [f"{n}=={v}" for n, v in got if n not in pins and n != "jetrl-megatron"]
print(f"resolved: {len(got)} packages; not pinned by NeMo-RL's file (pip's choice): {len(free)}")
for name, version in got:
    print(f"  {name}=={version}" + ("" if name in pins or name == "jetrl-megatron" else "   (pip's choice)"))
EOF
