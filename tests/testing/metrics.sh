# shellcheck shell=bash
# Reading zinf-train's --metrics files from bash (sourced by the bash tests):
# one flat JSON object per line, e.g. {"step":3,"loss":4.12,...}, read with Python's json module.
# Also the two small helpers every script that turns them into figures needs: sizes (parse_size,
# from args.sh) and medians.

# shellcheck source=../../launch/lib/args.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../launch/lib/args.sh"

# metric FILE KEY: "STEP VALUE" per line, VALUE as written in the JSON (the raw number text, so
# that exact comparisons are string comparisons; true/false/null for those; empty when the line
# has no KEY). A line that is not a JSON object is an error (status 1, the line named).
metric() {
  python3 - "$1" "$2" << 'EOF_METRIC'
import json, sys
path, key = sys.argv[1], sys.argv[2]
def text(v):
    return {True: "true", False: "false", None: "null"}.get(v, v) if not isinstance(v, str) else v
with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
        try:
            record = json.loads(line, parse_float=str, parse_int=str, parse_constant=str)
        except ValueError:
            sys.exit(f"{path}:{n}: not a JSON line")
        if not isinstance(record, dict):
            sys.exit(f"{path}:{n}: not a JSON object")
        print(text(record.get("step", "")), text(record.get(key, "")))
EOF_METRIC
}

# metric_after FILE KEY WARMUP: the values of KEY of the steps after the first WARMUP.
metric_after() { metric "$1" "$2" | awk -v w="$3" '$1 > w && $2 != "" { print $2 }'; }

# metrics_problem FILE FIRST LAST WORLD: nothing and status 0 when FILE holds exactly the steps
# FIRST..LAST in order, each with world_size WORLD and a finite positive loss; else one line
# saying what is wrong, and status 1.
metrics_problem() {
  local file=$1 first=$2 last=$3 world=$4 steps bad
  [[ -f $file ]] || { echo "no metrics file $file"; return 1; }
  steps=$(metric "$file" step | awk '{ printf "%s ", $1 }')
  [[ $steps == "$(seq -s ' ' "$first" "$last") " ]] ||
    { echo "metrics steps are not $first..$last: $steps"; return 1; }
  bad=$(metric "$file" world_size | awk -v w="$world" '$2 != w' | head -1)
  [[ -z $bad ]] || { echo "world_size is not $world at step/value: $bad"; return 1; }
  bad=$(metric "$file" loss |
    awk '$2 !~ /^[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?$/ || $2 + 0 <= 0' | head -1)
  [[ -z $bad ]] || { echo "bad loss at step/value: $bad"; return 1; }
}

# median: of the numbers on stdin, one per line ("nan" when there is none).
median() {
  sort -g | awk '{v[NR] = $1} END {
    if (NR == 0) { print "nan"; exit }
    if (NR % 2) printf "%.9g\n", v[(NR + 1) / 2]; else printf "%.9g\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
