#!/usr/bin/env bash
# background_test.sh: tests/background.sh, which `make test` builds its
# virtualenvs with while the first suites run, does what its header says:
#   - wait with nothing started returns at once, quietly;
#   - start runs the command at nice 19, its output in the log only;
#   - wait returns once the command has ended, says it was built, and
#     leaves no pid file behind;
#   - a failed command's wait says so with its status and its log's tail,
#     and still exits 0 (the step then runs the build itself);
#   - a second start of the same name stops the first build first (two
#     builds of one virtualenv would remove each other's files);
#   - after (inside a background job) runs its command only once the named
#     build has ended, and not at all if that build failed; the named
#     build's record stays for the foreground's own wait; with none
#     started it runs its command at once;
#   - beside runs its command as start does, at the caller's own priority;
#   - result (a suite run beside another) waits for its end, prints its
#     whole output and its status, and exits 0 only if it passed; for a
#     name never started it fails.
set -u
here=$(cd "$(dirname "$0")" && pwd)
bg=$here/background.sh
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

out=$("$bg" "$dir" wait nothing 2>&1) || fail "wait with nothing started exited $?"
[ -z "$out" ] || fail "wait with nothing started printed: $out"

base=$(nice)
out=$("$bg" "$dir" start ok bash -c 'echo "nice $(nice)"; echo "to stderr" >&2; sleep 1; touch "$0/ok.done"' "$dir")
[ "$(printf '%s\n' "$out" | wc -l)" = 1 ] && [[ $out == "ok: building in the background"* ]] ||
	fail "start printed more than its one line: $out"
out=$("$bg" "$dir" wait ok) || fail "wait ok exited $?"
[ -f "$dir/ok.done" ] || fail "wait returned before the command ended"
[[ $out == "ok: built in the background in "*" s" ]] || fail "wait ok said: $out"
[ ! -f "$dir/ok.pid" ] || fail "wait left ok.pid behind"
grep -qx "nice $((base + 19 > 19 ? 19 : base + 19))" "$dir/ok.log" || fail "not at nice 19: $(head -1 "$dir/ok.log")"
grep -qx "to stderr" "$dir/ok.log" || fail "stderr is not in the log"

"$bg" "$dir" start bad bash -c 'echo boom; exit 3' >/dev/null
out=$("$bg" "$dir" wait bad) || fail "wait after a failed build exited $? (the step must go on to build it itself)"
[[ $out == *"the background build failed (3)"* && $out == *boom* ]] || fail "a failed build's wait said: $out"

"$bg" "$dir" start twice bash -c 'sleep 2; touch "$0/first.done"' "$dir" >/dev/null
first=$(cat "$dir/twice.pid")
"$bg" "$dir" start twice bash -c 'touch "$0/second.done"' "$dir" >/dev/null
kill -0 "$first" 2>/dev/null && fail "the first build of the same name still runs after the second start"
"$bg" "$dir" wait twice >/dev/null
[ -f "$dir/second.done" ] || fail "the second build did not run"
sleep 2.5
[ ! -f "$dir/first.done" ] || fail "the first build went on to its end"

"$bg" "$dir" start suite bash -c 'sleep 1; echo "first line"; echo "last line"; touch "$0/suite.done"' "$dir" >/dev/null
out=$("$bg" "$dir" result suite) || fail "result of a suite that passed exited $?"
[ -f "$dir/suite.done" ] || fail "result returned before the suite ended"
[[ $out == "first line"*"last line"*"suite: ran in the background for "*" s, status 0" ]] || fail "result said: $out"
"$bg" "$dir" start failing bash -c 'echo "1 failed"; exit 4' >/dev/null
out=$("$bg" "$dir" result failing)
rc=$?
[ "$rc" = 1 ] && [[ $out == *"1 failed"*"status 4" ]] || fail "result of a failed suite exited $rc and said: $out"
out=$("$bg" "$dir" result never 2>&1) && fail "result of a suite never started exited 0"
[[ $out == *"was not started"* ]] || fail "result of a suite never started said: $out"

# beside: as start, at the caller's own priority; result reads it the same.
out=$("$bg" "$dir" beside near bash -c 'echo "nice $(nice)"; sleep 1; touch "$0/near.done"' "$dir")
[[ $out == "near: running in the background"* ]] || fail "beside printed: $out"
out=$("$bg" "$dir" result near) || fail "result of a suite run beside exited $?"
[ -f "$dir/near.done" ] && [[ $out == "nice $base"*"near: ran in the background for "*" s, status 0" ]] ||
	fail "beside did not run at the caller's priority ($base), or result said: $out"

# after: the second job starts its command only once the first has ended.
"$bg" "$dir" start base bash -c 'sleep 1; touch "$0/base.done"' "$dir" >/dev/null
"$bg" "$dir" start over "$bg" "$dir" after base bash -c '[ -f "$0/base.done" ] && touch "$0/over.done"' "$dir" >/dev/null
"$bg" "$dir" wait over >/dev/null
[ -f "$dir/over.done" ] || fail "after ran its command before the named build ended (or not at all)"
out=$("$bg" "$dir" wait base) || fail "wait base exited $?"
[[ $out == "base: built in the background in "*" s" ]] || fail "after took the named build's record; wait base said: $out"
"$bg" "$dir" after unstarted touch "$dir/after_unstarted.done" || fail "after a build never started exited $?"
[ -f "$dir/after_unstarted.done" ] || fail "after a build never started did not run its command"
"$bg" "$dir" start broken bash -c 'exit 5' >/dev/null
"$bg" "$dir" wait broken >/dev/null
out=$("$bg" "$dir" after broken touch "$dir/after_broken.done" 2>&1)
rc=$?
[ "$rc" = 1 ] && [ ! -f "$dir/after_broken.done" ] && [[ $out == *"failed (5)"* ]] ||
	fail "after a failed build exited $rc, said: $out"

if [ "$failures" = 0 ]; then
	echo "background_test.sh: ok"
else
	echo "background_test.sh: $failures failure(s)"
	exit 1
fi
