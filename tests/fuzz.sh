#!/usr/bin/env bash
# fuzz.sh DURATION PKG:TARGET...: fuzzes each target for DURATION (Go's
# -fuzztime, e.g. 10m), one after the other, and fails if any finds a
# failing input. Go writes a failing input under PKG/testdata/fuzz/TARGET/;
# a run that fails without writing one and says only "context deadline
# exceeded" is Go's fuzz coordinator tripping over its own deadline at the
# end of a duration (golang/go#75804, fixed from Go 1.27), not a finding: it
# is reported and passed.
set -u
GO=${GO:-go}
time=$1
shift
status=0
for spec in "$@"; do
	pkg=${spec%%:*} target=${spec#*:}
	corpus=$pkg/testdata/fuzz/$target
	before=$(ls "$corpus" 2>/dev/null | sort)
	log=$(mktemp)
	echo "== $target ($pkg) for $time"
	"$GO" test -run '^$' -fuzz "^$target\$" -fuzztime "$time" "./$pkg" 2>&1 | tee "$log" | grep -v '^fuzz: elapsed'
	rc=${PIPESTATUS[0]}
	after=$(ls "$corpus" 2>/dev/null | sort)
	if [[ $rc != 0 ]]; then
		if [[ $before == "$after" ]] && grep -q 'context deadline exceeded' "$log"; then
			echo "fuzz.sh: $target: Go's coordinator reported its own deadline with no failing input (golang/go#75804); not a finding"
		else
			echo "fuzz.sh: $target FAILED; new inputs in $corpus:" $(comm -13 <(echo "$before") <(echo "$after"))
			status=1
		fi
	fi
	rm -f "$log"
done
exit $status
