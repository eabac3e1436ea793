# shellcheck shell=bash
# Reading zinf-train's --metrics files from bash tests (sourced): one flat JSON object of numbers
# per line, e.g. {"step":3,"loss":4.12,...}.

# metric FILE KEY: "STEP VALUE" per line, VALUE as written in the JSON (raw text, so that exact
# comparisons are string comparisons).
metric() {
  awk -v key="$2" '{
    line = $0
    gsub(/^[ \t]*\{|\}[ \t]*$/, "", line)
    n = split(line, kv, ",")
    step = ""; value = ""
    for (i = 1; i <= n; ++i) {
      colon = index(kv[i], ":")
      k = substr(kv[i], 1, colon - 1); gsub(/[ \t"]/, "", k)
      v = substr(kv[i], colon + 1); gsub(/^[ \t]+|[ \t]+$/, "", v)
      if (k == "step") step = v
      if (k == key) value = v
    }
    print step, value
  }' "$1"
}
