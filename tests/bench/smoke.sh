#!/usr/bin/env bash
# Runs one subcommand of bench/run.py in a scratch directory and checks what every subcommand
# leaves: exit 0, OUT/results.jsonl with at least one JSON object per line, every summary line
# naming its machine, and OUT/SUBCOMMAND.png a PNG. Exit 77 (a skip) when the subcommand exits 2
# for a missing tool or package, the reason printed.
#
#   smoke.sh SUBCOMMAND [flags...]     (--out and, when the subcommand has it, --path are given)
set -u
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
sub=${1:?usage: smoke.sh SUBCOMMAND [flags...]}
shift
work=$(mktemp -d "${ZINF_TEST_TMPDIR:-${TMPDIR:-/tmp}}/zinf-bench-smoke-XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
out=$work/out
extra=()
if /usr/bin/python3 "$repo/bench/run.py" "$sub" --help | grep -q -- '--path'; then
  extra=(--path "$work/path")
fi
/usr/bin/python3 "$repo/bench/run.py" "$sub" --out "$out" "${extra[@]}" "$@" > "$work/stdout" \
  2> "$work/stderr"
rc=$?
if ((rc == 2)) && grep -q "not installed\|not built\|not found" "$work/stderr"; then
  echo "SKIP: $(tail -1 "$work/stderr")"
  exit 77
fi
if ((rc != 0)); then
  echo "FAIL: bench/run.py $sub exited $rc:" >&2
  tail -20 "$work/stderr" >&2
  exit 1
fi
/usr/bin/python3 - "$out" "$sub" << 'EOF_CHECK' || exit 1
import json, sys
from pathlib import Path
out, sub = Path(sys.argv[1]), sys.argv[2]
lines = (out / "results.jsonl").read_text().splitlines()
if not lines:
    sys.exit(f"FAIL: {out}/results.jsonl is empty")
for n, line in enumerate(lines, 1):
    record = json.loads(line)
    if not isinstance(record, dict):
        sys.exit(f"FAIL: results.jsonl:{n} is not a JSON object")
    if "summary" in record and "cpu" not in record.get("machine", {}):
        sys.exit(f"FAIL: results.jsonl:{n}: a summary without its machine: {line[:200]}")
png = out / f"{sub}.png"
if not png.is_file() or png.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
    sys.exit(f"FAIL: no picture {png}")
print(f"PASS: {sub}: {len(lines)} JSON lines, {png.name} {png.stat().st_size} bytes")
EOF_CHECK
