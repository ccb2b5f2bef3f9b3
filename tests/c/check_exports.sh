#!/usr/bin/env bash
# check_exports.sh LIB HEADER: the library exports exactly the functions the
# header declares, plus the runtime symbols cgo itself must export.
set -eu
lib=$1
header=$2
exported=$(nm -D --defined-only "$lib" | awk '{print $3}' | sort)
cgo='^(_cgo_.*|_cgoexp_.*|x_cgo_.*|x_crosscall2_ptr|crosscall1|crosscall2|fatalf)$'
stray=$(grep -Ev '^oktopk_' <<<"$exported" | grep -Ev "$cgo" || true)
if [ -n "$stray" ]; then
	echo "check_exports: $lib exports symbols outside oktopk_* and cgo's own:" >&2
	echo "$stray" >&2
	exit 1
fi
declared=$(grep -oE '\boktopk_[a-z0-9_]+\(' "$header" | tr -d '(' | sort -u)
ours=$(grep -E '^oktopk_' <<<"$exported" | sort -u)
if [ "$declared" != "$ours" ]; then
	echo "check_exports: header and library disagree (< header only, > library only):" >&2
	diff <(echo "$declared") <(echo "$ours") >&2 || true
	exit 1
fi
echo "check_exports: $(wc -l <<<"$ours") oktopk_* functions, all declared in $header; nothing else but cgo's runtime"
