#!/usr/bin/env bash
# zinf's fused CPU Adam against torch.optim.Adam on the same number of elements and threads.
#
#   launch/bench-adam-vs-torch.sh [--numel N] [--threads T] [--steps S] [--bench PATH]
#
# Prints JSON lines: the `zinf-bench adam --json` object, then (when Debian's python3-torch is
# importable by /usr/bin/python3) a torch object and {"speedup": torch_seconds / zinf_seconds}.
# Both sides report the best step time; gb_per_s counts 28 bytes per element for both.
# torch is optional: without it the script says how to install it and exits 0 with
# {"torch":"unavailable"}. /usr/bin/python3 is used on purpose, not a pyenv/venv python3 on PATH.
# --numel (up to 2^30), --threads (up to 1024) and --steps are integers >= 1 (else exit 2).
set -euo pipefail

numel=67108864
threads=2
steps=5
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bench="${ZINF_BENCH:-${repo_root}/build/bin/zinf-bench}"
python=/usr/bin/python3

# shellcheck source=lib/args.sh
source "${repo_root}/launch/lib/args.sh"
args_script="bench-adam-vs-torch.sh"

while [[ $# -gt 0 ]]; do
  case "$1" in
    --numel) need_value "$@"; numel="$2"; shift 2 ;;
    --threads) need_value "$@"; threads="$2"; shift 2 ;;
    --steps) need_value "$@"; steps="$2"; shift 2 ;;
    --bench) need_value "$@"; bench="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    *) usage_die "unknown argument '$1' (see --help)" ;;
  esac
done
# torch's Python side takes plain integers: --numel is one too (no K/M/G).
check_count --numel "${numel}" 1 "$((1 << 30))"
check_count --threads "${threads}" 1 1024
check_count --steps "${steps}" 1 100000

if [[ ! -x "${bench}" ]]; then
  echo "bench-adam-vs-torch.sh: ${bench} is not built (cmake --build <dir> --target zinf-bench," \
       "or pass --bench PATH / ZINF_BENCH)" >&2
  exit 1
fi

zinf_json=$("${bench}" adam --numel "${numel}" --threads "${threads}" --steps "${steps}" --json)
echo "${zinf_json}"

if [[ ! -x "${python}" ]] || ! "${python}" -c 'import torch' >/dev/null 2>&1; then
  echo "bench-adam-vs-torch.sh: torch is not importable by ${python}; to compare, install" \
       "Debian's build: apt-get install -y --no-install-recommends python3-torch" >&2
  echo '{"torch":"unavailable"}'
  exit 0
fi

ZINF_JSON="${zinf_json}" "${python}" - "${numel}" "${threads}" "${steps}" <<'PY'
import json, os, sys, time
import torch

numel, threads, steps = (int(a) for a in sys.argv[1:4])
torch.set_num_threads(threads)
torch.manual_seed(0)
param = torch.nn.Parameter(torch.randn(numel, dtype=torch.float32))
param.grad = torch.randn(numel, dtype=torch.float32) * 1e-3
# The default implementation of this torch version (foreach/fused left at their defaults).
opt = torch.optim.Adam([param], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
opt.step()  # allocates exp_avg / exp_avg_sq, not timed
times = []
for _ in range(steps):
    t0 = time.perf_counter()
    opt.step()
    times.append(time.perf_counter() - t0)
best = min(times)
torch_obj = {
    "bench": "torch_adam", "torch_version": torch.__version__, "numel": numel,
    "threads": threads, "steps": steps, "foreach": opt.defaults.get("foreach"),
    "seconds": best, "seconds_mean": sum(times) / len(times),
    "elements_per_s": numel / best, "gb_per_s": numel * 28 / best / 1e9,
}
print(json.dumps(torch_obj))
zinf = json.loads(os.environ["ZINF_JSON"])
print(json.dumps({"speedup": best / zinf["seconds"], "zinf_seconds": zinf["seconds"],
                  "torch_seconds": best, "numel": numel, "threads": threads}))
PY
