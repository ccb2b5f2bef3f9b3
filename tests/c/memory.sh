#!/usr/bin/env bash
# memory.sh P N CALLS [ALGORITHM...]: each algorithm's peak RSS growth per
# rank over real ZeroMQ sockets, one job (P processes) per algorithm so that
# no algorithm's memory is counted against another. The baseline is taken
# once the caller's buffer is allocated and touched (build/oktopk_test's
# memory mode). Prints one row per algorithm: the largest growth over the
# ranks, in MiB and in units of N × the element size. DTYPE (float32 or
# bfloat16, default float32) is the caller's buffer's; LIMIT_OKTOPK and
# LIMIT_OTHER (in those units; unset: no check) make it fail when a rank
# grew more.
#
#   tests/c/memory.sh 4 16777216 12            # every algorithm, n = 2^24
set -u
here=$(cd "$(dirname "$0")" && pwd)
bin=${OKTOPK_TEST_BIN:-$here/../../build/oktopk_test}
P=$1 N=$2 CALLS=$3
shift 3
algs=("$@")
[ ${#algs[@]} -gt 0 ] || algs=(dense_ring dense_rabenseifner oktopk topka topkdsa ssar_recursive_double \
	ssar_split_allgather dsar_split_allgather gtopk gaussiank)
status=0
dtype=${DTYPE:-float32}
size=4
[ "$dtype" = float32 ] || size=2
printf '| algorithm | peak extra RSS per rank (max over %d ranks) | ÷ (n × %d B) |\n|---|---|---|\n' "$P" "$size"
for alg in "${algs[@]}"; do
	limit=${LIMIT_OTHER:-0}
	[ "$alg" = oktopk ] && limit=${LIMIT_OKTOPK:-0}
	out=$("$here/launch.sh" "$P" "$bin" memory "$alg" "$N" "$CALLS" "$limit" "$dtype" 2>&1)
	rc=$?
	if [ $rc -ne 0 ]; then
		echo "$out" | tail -20 >&2
		echo "memory.sh: $alg failed" >&2
		status=1
	fi
	echo "$out" | awk -v alg="$alg" '
		/MEM / { for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
			if (v["peak_extra_mib"] + 0 > mib) { mib = v["peak_extra_mib"] + 0; ratio = v["ratio"] } }
		END { if (ratio == "") printf "| %s | failed | |\n", alg; else printf "| %s | %.1f MiB | %.2f |\n", alg, mib, ratio }'
done
exit $status
