# bench/run.py io-vs-fio on an 8 MiB file, 2 trials (both orders of the tools): the JSON lines of
# each trial and op, the summaries, io-vs-fio.png. --target 0.001: a smoke test times nothing (a
# loaded CI machine must not fail it); skipped where fio is not installed.
if(TARGET zinf-bench)
  add_test(NAME bench_io_vs_fio_smoke
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/smoke.sh io-vs-fio
                   --size 8M --trials 2 --target 0.001 --bin $<TARGET_FILE:zinf-bench>)
  set_tests_properties(bench_io_vs_fio_smoke PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77)
endif()

# --target: a median ratio zinf/fio below it is exit 1, after the figures ("pass": false in the
# summaries) and the picture are written.
if(TARGET zinf-bench)
  add_test(NAME bench_io_vs_fio_target
           COMMAND bash -c [=[
work=$(mktemp -d "${TMPDIR:-/tmp}/zinf-bench-target-XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
/usr/bin/python3 "$0/bench/run.py" io-vs-fio --out "$work/out" --path "$work/path" --size 4M \
  --trials 1 --target 1000000 --bin "$1" > "$work/stdout" 2> "$work/stderr"
rc=$?
if ((rc == 2)) && grep -q "not installed" "$work/stderr"; then
  echo "SKIP: $(tail -1 "$work/stderr")"; exit 77
fi
((rc == 1)) || { echo "FAIL: exit $rc, expected 1"; cat "$work/stderr"; exit 1; }
grep -q "below --target" "$work/stderr" || { echo "FAIL: no verdict"; cat "$work/stderr"; exit 1; }
[[ $(grep -c '"pass": false' "$work/out/results.jsonl") == 2 ]] ||
  { echo "FAIL: the summaries do not say pass false"; cat "$work/out/results.jsonl"; exit 1; }
[[ -s $work/out/io-vs-fio.png ]] || { echo "FAIL: no picture"; exit 1; }
echo "PASS: $(tail -1 "$work/stderr")"
]=] ${PROJECT_SOURCE_DIR} $<TARGET_FILE:zinf-bench>)
  set_tests_properties(bench_io_vs_fio_target PROPERTIES TIMEOUT 60 SKIP_RETURN_CODE 77)
endif()
