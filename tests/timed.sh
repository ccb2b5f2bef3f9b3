#!/usr/bin/env bash
# timed.sh FILE reset | FILE run NAME COMMAND... | FILE print
# The wall time of each step of `make test`, kept in FILE, one line a step
# in the order they ran: NAME, seconds, status (tab-separated).
#   reset  empties FILE (the first step of `make test`).
#   run    runs COMMAND, adds its line to FILE and exits with COMMAND's
#          status; on a failure it first prints the table so far, naming
#          NAME. Under `make -k` it exits 0 instead, so that the next steps
#          run, and `print` fails at the end. Under `make -n` (which still
#          runs the Makefile's `+` lines, so that the sub-makes show the
#          steps' recipes) it only runs COMMAND.
#   print  prints the table: each step's seconds and share of the total,
#          then the total; exits 1 if any step failed.
#   TIMED_TITLE names the whole in the table's heading and in a failure's
#   line ("make test" unless set; make demo sets "make demo").
set -u
file=$1 action=$2
title=${TIMED_TITLE:-make test}
shift 2
# make's one-letter flags are the first word of MAKEFLAGS when it has any
# ("kn -j2 ..."); " -j2 ..." or " -- X=1" has none.
case ${MAKEFLAGS:-} in
"" | [[:space:]]* | -*) flags="" ;;
*) flags=${MAKEFLAGS%% *} ;;
esac

now_us() { local t=${EPOCHREALTIME//[!0-9]/}; echo $((10#$t)); }

print_table() {
	[ -s "$file" ] || return 0
	awk -F'\t' -v title="$title" '
		{ name[NR] = $1; secs[NR] = $2; status[NR] = $3; total += $2
		  if (length($1) > w) w = length($1); if ($3 != "ok") failed = 1 }
		END {
			if (w < 5) w = 5
			print ""
			print title ": wall time of each step, in the order they ran"
			for (i = 1; i <= NR; i++)
				printf("  %-" w "s %8.1f s %5.1f%%  %s\n", name[i], secs[i],
					(total > 0 ? 100 * secs[i] / total : 0), status[i])
			printf("  %-" w "s %8.1f s (%dm%02ds)%s\n", "total", total,
				int(total / 60), int(total) % 60, (failed ? "  FAILED" : ""))
			exit failed
		}' "$file"
}

case $action in
reset)
	mkdir -p "$(dirname "$file")"
	: >"$file"
	;;
run)
	name=$1
	shift
	[[ $flags == *n* ]] && exec "$@"
	start=$(now_us)
	"$@"
	rc=$?
	us=$(($(now_us) - start))
	status=ok
	[ $rc = 0 ] || status=FAILED
	printf '%s\t%d.%d\t%s\n' "$name" $((us / 1000000)) $((us / 100000 % 10)) "$status" >>"$file"
	if [ $rc != 0 ]; then
		[[ $flags == *k* ]] && exit 0
		print_table
		echo "$title: $name failed"
	fi
	exit $rc
	;;
print)
	print_table
	;;
*)
	echo "usage: $0 FILE reset | FILE run NAME COMMAND... | FILE print" >&2
	exit 2
	;;
esac
