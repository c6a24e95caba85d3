# Shared by the run_*_selftest.sh scripts (sourced; they set OUT, ARCH and
# FLAGS first).
#
#   build_selftest BIN OBJDIR PTXAS_SOURCE SOURCE...
# Compiles SOURCE... in parallel into OBJDIR (one log per object in $OUT) and
# links BIN, unless BIN already loads (a carried build: `BIN --probe`) and
# REBUILD is not 1. PTXAS_SOURCE (one of the sources, or "") is compiled with
# -Xptxas -v and its register, spill and C75xx (wgmma serialization) lines are
# printed. Returns non-zero when the build fails.
build_selftest() {
  local bin=$1 objdir=$2 ptxas_source=$3
  shift 3
  if [ "${REBUILD:-0}" != 1 ] && "$bin" --probe >/dev/null 2>&1; then return 0; fi
  echo "== building $bin"
  local start=$SECONDS pids=() f failed=0
  # A fresh object set: the link takes every object of OBJDIR, and one left
  # from an older source list would define its symbols twice.
  mkdir -p "$objdir"
  rm -f "$objdir"/*.o
  for f in "$@"; do
    local extra=""
    [ "$f" = "$ptxas_source" ] && extra="-Xptxas -v"
    nvcc $FLAGS $extra -c "$f" -o "$objdir/$(basename "$f" .cu).o" \
      2> "$OUT/build_$(basename "$f" .cu).log" &
    pids+=($!)
  done
  for f in "${pids[@]}"; do wait "$f" || failed=1; done
  # Errors and warnings (ptxas -v info lines aside) go to the console.
  grep -hv "ptxas info\|bytes stack frame" "$OUT"/build_*.log
  if [ $failed -ne 0 ] || ! nvcc $ARCH "$objdir"/*.o -o "$bin"; then
    echo "BUILD FAILED"
    return 1
  fi
  echo "== built in $((SECONDS - start))s"
  if [ -n "$ptxas_source" ]; then
    echo "ptxas, $(basename "$ptxas_source") (count, line):"
    grep -E "Used|spill|C75" "$OUT/build_$(basename "$ptxas_source" .cu).log" | sort | uniq -c
  fi
}

#   sass_summary OBJECT
# HGMMA and local-memory (LDL/STL) instruction counts of OBJECT's SASS, kept
# in $OUT/<object>.sass (when cuobjdump is there).
sass_summary() {
  command -v cuobjdump >/dev/null || return 0
  local sass="$OUT/$(basename "$1" .o).sass"
  cuobjdump --dump-sass "$1" > "$sass" 2>&1
  echo "== SASS: $(grep -c HGMMA "$sass") HGMMA, $(grep -cE 'LDL|STL' "$sass") LDL/STL"
}
