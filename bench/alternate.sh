# Sourced by the benchmarks that time a whole job under two or more settings, alternating between them so that
# a machine's drift falls on each alike.
#   alternate REPETITIONS WHAT FIGURE ONE_RUN SETTING...
# calls `ONE_RUN SETTING` (which prints "WALL SECONDS": the wall time and a second figure, FIGURE) for each
# setting, REPETITIONS times over, prints each run, then each setting's medians.

median() { sort -n | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }

alternate() {
  local reps="$1" what="$2" figure="$3" one_run="$4"
  shift 4
  local -A walls figures
  local rep setting result wall seconds
  for rep in $(seq "$reps"); do
    for setting in "$@"; do
      result=$("$one_run" "$setting")  # (not `read < <(...)`, which would go on after a failed run)
      read -r wall seconds <<<"$result"
      echo "repetition $rep, $what $setting: $wall s wall, $figure $seconds s"
      walls[$setting]+="$wall "
      figures[$setting]+="$seconds "
    done
  done
  for setting in "$@"; do
    echo "median, $what $setting: $(tr ' ' '\n' <<<"${walls[$setting]}" | grep . | median) s wall," \
         "$figure $(tr ' ' '\n' <<<"${figures[$setting]}" | grep . | median) s"
  done
}
