#!/usr/bin/env bash
# background.sh DIR start NAME COMMAND... | DIR wait NAME | DIR result NAME
#               | DIR after NAME COMMAND... | DIR beside NAME COMMAND...
# Setup that `make test` builds while its first suites run: on a fresh
# machine the two virtualenvs (torch's download, Horovod's build from
# source) take about 5 minutes, and the suites before them leave about a
# quarter of the cores idle (measured: 29% during test-go, 23% during
# test-python, on 2 cores).
#   start  runs COMMAND in the background at the lowest CPU priority, so the
#          suites keep the cores and it takes only what they leave idle; in a
#          session of its own, its output in DIR/NAME.log, never on the
#          terminal or CI's pipe. A build of NAME still running from an
#          interrupted `make test` is stopped first: two builds of one
#          virtualenv would remove each other's files.
#   wait   returns once NAME's background build has ended (at once if none
#          was started), saying how long it took, and printing its log's
#          tail if it failed. The step that needs it then runs its own make
#          target: a no-op when the background built it, the build itself
#          when it failed (never both at once: wait returns only once the
#          background has ended).
#   beside as start, at the foreground's own priority: for suites that
#          mostly wait (on launchers, daemons and their ranks' timeouts),
#          run beside a suite that leaves cores idle; at nice 19 under a
#          busy foreground their timeouts of a few seconds could fire.
#   after  (inside a background job) runs COMMAND once NAME's build has
#          ended, if it succeeded; else exits 1 without running it, and the
#          foreground's step builds both in order. With no build of NAME
#          started it runs COMMAND at once. The frameworks'
#          virtualenv is built over torch's, so it starts after it. Unlike
#          wait it leaves NAME's record for the foreground's own wait.
#   result for a suite started in the background (test-frameworks beside
#          test-python: it fills the cores the other leaves idle): waits as
#          wait does, prints the suite's whole output and how long it ran,
#          and exits 0 if it passed, else 1 (also when it was never started
#          or died).
set -u
dir=$1 action=$2 name=$3
shift 3
pid_file=$dir/$name.pid rc_file=$dir/$name.rc log=$dir/$name.log

case $action in
start | beside)
	mkdir -p "$dir"
	if [ -f "$pid_file" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null; then
		kill -- -"$(cat "$pid_file")" 2>/dev/null
		while kill -0 "$(cat "$pid_file")" 2>/dev/null; do sleep 0.2; done
	fi
	rm -f "$rc_file"
	start=$EPOCHSECONDS
	niceness=19 what="building in the background"
	[ "$action" = beside ] && niceness=0 what="running in the background"
	setsid bash -c 'nice -n '"$niceness"' "$@"; echo "$? $(($EPOCHSECONDS - '"$start"'))" >"'"$rc_file"'"' _ "$@" \
		>"$log" 2>&1 </dev/null &
	echo $! >"$pid_file"
	echo "$name: $what (log: $log)"
	;;
wait)
	[ -f "$pid_file" ] || exit 0
	pid=$(cat "$pid_file")
	while [ ! -f "$rc_file" ] && kill -0 "$pid" 2>/dev/null; do sleep 1; done
	rm -f "$pid_file"
	read -r rc secs <"$rc_file" 2>/dev/null || { rc=died secs=?; }
	if [ "$rc" = 0 ]; then
		echo "$name: built in the background in $secs s"
	else
		echo "$name: the background build failed ($rc); its log's tail, then the build in the foreground:"
		tail -n 40 "$log"
	fi
	;;
after)
	[ -f "$pid_file" ] || [ -f "$rc_file" ] || exec "$@" # never started: the command makes what it needs itself
	if [ -f "$pid_file" ]; then
		pid=$(cat "$pid_file")
		while [ ! -f "$rc_file" ] && kill -0 "$pid" 2>/dev/null; do sleep 1; done
	fi
	read -r rc secs <"$rc_file" 2>/dev/null || rc=died
	if [ "$rc" != 0 ]; then
		echo "$name's background build failed ($rc): not running $*" >&2
		exit 1
	fi
	exec "$@"
	;;
result)
	if [ ! -f "$pid_file" ]; then
		echo "$name: was not started in the background" >&2
		exit 1
	fi
	pid=$(cat "$pid_file")
	while [ ! -f "$rc_file" ] && kill -0 "$pid" 2>/dev/null; do sleep 1; done
	rm -f "$pid_file"
	read -r rc secs <"$rc_file" 2>/dev/null || { rc=died secs=?; }
	cat "$log"
	echo "$name: ran in the background for $secs s, status $rc"
	[ "$rc" = 0 ]
	exit
	;;
*)
	echo "usage: $0 DIR start NAME COMMAND... | DIR wait NAME | DIR result NAME | DIR after NAME COMMAND... | DIR beside NAME COMMAND..." >&2
	exit 2
	;;
esac
