# shellcheck shell=bash
# The output directories of the launch/ scripts (sourced). A script writes, replaces and removes
# files only in a directory it made: one that did not exist, one that was empty, or one it made on
# an earlier run, which holds its marker file .made-by-<script>. Any other existing directory is
# refused, so that `--dir ~` or `--out /data` never loses a file the script did not create.

# claim_dir DIR SCRIPT: makes DIR (created if missing) the output directory of SCRIPT and marks
# it; prints why and returns 1 when DIR is not a directory SCRIPT may write in (see above).
claim_dir() {
  local dir=$1 script=$2
  local marker=$dir/.made-by-$script
  if [[ -e $dir || -L $dir ]] && [[ ! -d $dir ]]; then
    echo "$script: $dir exists and is not a directory" >&2
    return 1
  fi
  if [[ -d $dir && ! (-f $marker && ! -L $marker) && -n $(ls -A -- "$dir") ]]; then
    echo "$script: $dir already holds files $script did not make; give a new or empty" \
      "directory (or remove this one)" >&2
    return 1
  fi
  mkdir -p -- "$dir" || return 1
  [[ -f $marker ]] || : > "$marker"
}

# empty_claimed_dir DIR SCRIPT: claim_dir, then removes everything in DIR but the marker: a
# fresh output directory for every run.
empty_claimed_dir() {
  claim_dir "$1" "$2" || return 1
  find "$1" -mindepth 1 -maxdepth 1 ! -name ".made-by-$2" -exec rm -rf -- {} +
}
