# shellcheck shell=bash
# Command-line checks shared by the launch/ scripts (sourced). A check that fails prints
# "<script>: <what is wrong>" on stderr and exits 2 (a usage error). The scripts run every check
# right after parsing their flags, before they make a directory, start a tool or write a file, so
# a bad command line leaves nothing behind.
#
#   source "$repo/launch/lib/args.sh"
#   args_script=bench-step                      # the prefix of the messages
#   while (($# > 0)); do
#     case $1 in
#       --rounds) need_value "$@"; rounds=$2; shift 2 ;;
#       ...
#   check_count --rounds "$rounds"              # an integer from 1 to 999999999
#   check_count --seed "$seed" 0                # from 0
#   state_bytes=$(check_size --state "$state")  # a size such as 4G, in bytes; exits 2 if bad
#
# Counts are plain decimal integers without a sign or leading zeros (bash reads 08 as a bad octal
# number and -1 as a flag), at most 9 digits; sizes are at most 2^50 bytes (1 PiB). Both bounds
# keep every product the scripts form (size x ranks x 12, ...) far inside bash's 64-bit
# arithmetic.

args_script=${args_script:-${0##*/}}

# The largest size check_size takes, and the largest count check_count takes by default.
args_max_size=$((1 << 50))
args_max_count=999999999

# usage_die MESSAGE...: "<script>: MESSAGE" on stderr, exit 2.
usage_die() {
  echo "$args_script: $*" >&2
  exit 2
}

# need_value "$@": inside the flag loop, where $1 is a flag that takes a value: exits 2 naming
# the flag when nothing follows it, or when the next word is another option ("--rounds --steps 3"
# would otherwise read "--steps" as the rounds).
need_value() {
  (($# >= 2)) || usage_die "$1 needs a value"
  [[ $2 != --* ]] || usage_die "$1 needs a value (got the option '$2')"
}

# check_count FLAG VALUE [MIN [MAX]]: VALUE is a decimal integer in [MIN, MAX] (default 1 and
# 999999999); exits 2 naming FLAG otherwise.
check_count() {
  local flag=$1 value=$2 min=${3:-1} max=${4:-$args_max_count}
  if [[ ! $value =~ ^(0|[1-9][0-9]{0,8})$ ]] || ((value < min || value > max)); then
    usage_die "$flag '$value': expected an integer from $min to $max"
  fi
}

# parse_size SIZE: the bytes of 123, 64K, 512M, 1G, 2T, 1GiB, 1GB (powers of 1024) on stdout;
# status 1 for anything else, and for sizes above 2^50 bytes (they would overflow the products
# the scripts form).
parse_size() {
  local s=$1 num unit shift_by=0
  [[ $s =~ ^(0|[1-9][0-9]{0,15})([KMGTkmgt]?)(i?[Bb])?$ ]] || return 1
  num=${BASH_REMATCH[1]}
  unit=${BASH_REMATCH[2]^^}
  case $unit in
    K) shift_by=10 ;;
    M) shift_by=20 ;;
    G) shift_by=30 ;;
    T) shift_by=40 ;;
  esac
  ((num <= (args_max_size >> shift_by))) || return 1
  echo $((num << shift_by))
}

# check_size FLAG VALUE [MIN [MAX]]: the bytes of VALUE (parse_size) on stdout when they are in
# [MIN, MAX] (default 1 and 2^50); exits 2 naming FLAG otherwise. Use it as
# bytes=$(check_size ...) || exit 2: the exit leaves the command substitution only.
check_size() {
  local flag=$1 value=$2 min=${3:-1} max=${4:-$args_max_size} bytes
  if ! bytes=$(parse_size "$value") || ((bytes < min || bytes > max)); then
    usage_die "$flag '$value': expected a size from $min to $max bytes, such as 64K, 512M or" \
      "2G (powers of 1024)"
  fi
  echo "$bytes"
}

# check_number FLAG VALUE: VALUE is a positive decimal number such as 0.95 or 2; exits 2 naming
# FLAG otherwise.
check_number() {
  [[ $2 =~ ^[0-9]{1,9}(\.[0-9]{1,9})?$ && $2 =~ [1-9] ]] ||
    usage_die "$1 '$2': expected a positive number such as 0.95"
}
