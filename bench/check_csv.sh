#!/usr/bin/env bash
# Fails unless CSV (bench/run.sh's) holds, for every configuration (P, n,
# density) in it, exactly one row per ALGORITHM named, every row has the
# header's column count, and every field but the name is a finite number.
# Only these may be nan: lower_bound_ms and the phases' wire times (*_wire_ms)
# in loopback mode, which has no link rate; torch gloo's phase times (gloo's
# phases are not visible from outside).
#
#   bench/check_csv.sh CSV ALGORITHM...
set -euo pipefail
CSV=$1
shift
awk -F, -v algs="$*" '
BEGIN { na = split(algs, want, " ") }
NR == 1 {
	cols = NF
	for (i = 1; i <= NF; i++) {
		if ($i == "lower_bound_ms" || $i ~ /_wire_ms$/) nanok[i] = 1
		if ($i ~ /^(select|agree|reduce|global_select|balance|allgather|output)_ms$/) phase[i] = 1
	}
	next
}
{
	if (NF != cols) { printf "line %d: %d fields, header has %d\n", NR, NF, cols; bad = 1; next }
	for (i = 2; i <= NF; i++)
		if ($i !~ /^-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$/ &&
		    !(tolower($i) == "nan" && ((i in nanok) || ((i in phase) && $1 == "torch_gloo_allreduce")))) {
			printf "line %d (%s): field %d is not a number: %s\n", NR, $1, i, $i; bad = 1
		}
	cfg = "P=" $2 " n=" $3 " density=" $4
	cfgs[cfg] = 1
	seen[cfg SUBSEP $1]++
}
END {
	if (NR < 2) { print "no rows"; exit 1 }
	for (c in cfgs) for (j = 1; j <= na; j++) {
		if (seen[c SUBSEP want[j]] != 1) { printf "%s: %d rows for %s, want 1\n", c, seen[c SUBSEP want[j]], want[j]; bad = 1 }
	}
	exit bad
}' "$CSV" >&2 || { echo "check_csv.sh: $CSV fails the check" >&2; exit 1; }
echo "check_csv.sh: $CSV: $(($(wc -l <"$CSV") - 1)) rows, every algorithm in every configuration, all numeric" >&2
