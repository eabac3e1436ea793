#!/usr/bin/env bash
# Installs every Debian package zinf builds, tests and benchmarks with.
# Idempotent: packages already installed are skipped, and nothing is printed when none is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build g++ pkg-config git
  openmpi-bin libopenmpi-dev
  liburing-dev
  libhdf5-openmpi-dev hdf5-tools
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  nlohmann-json3-dev libcli11-dev libfmt-dev
  libopenblas-dev
  libxxhash-dev
  fio gnuplot-nox python3
  python3-dev pybind11-dev python3-numpy python3-torch python3-mpi4py
  iproute2 util-linux procps
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "install-deps: installing ${missing[*]}" >&2
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: not root and no sudo; install: ${missing[*]}" >&2; exit 1; }
  sudo_cmd=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
