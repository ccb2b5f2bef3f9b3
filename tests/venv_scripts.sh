#!/usr/bin/env bash
# venv_scripts.sh VENV...: every executable in each virtualenv's bin/ runs.
# A script's first line must name an interpreter that exists (a virtualenv
# built in one folder and moved to another keeps the old folder there, and
# then `bin/pip` fails with "bad interpreter"), and the script must exit 0
# with --version or, failing that, --help. The activate scripts must set
# VIRTUAL_ENV to the virtualenv's own folder. Scripts run two at a time.
#
# A few scripts come from their packages unable to finish either call,
# whatever the virtualenv; for those the test requires exactly the failure
# below, which their own code raises (so their interpreter started them and
# they ran), and prints it:
#   pyftmerge               fontTools' font merger takes no --version or --help
#                           and rejects them as unknown options
#   proton-viewer           triton's profile viewer imports pandas, which
#                           triton does not require
#   convert-caffe2-to-onnx  torch 2.0's wheel installs these scripts but not
#   convert-onnx-to-caffe2  the caffe2 package they import
#   ccmake                  the cmake wheel has a launcher for ccmake but no
#                           ccmake binary
set -u
status=0
check_one() {
	local f=$1 first interp out
	IFS= read -r first <"$f" || first=""
	if [[ $first == "#!"* ]]; then
		interp=${first#\#!}
		interp=${interp%% *}
		if [ ! -x "$interp" ]; then
			echo "FAIL: $f: interpreter $interp does not exist"
			return 1
		fi
	fi
	for flag in --version --help; do
		if out=$(timeout 120 "$f" "$flag" </dev/null 2>&1); then
			echo "ok: $f $flag"
			return 0
		fi
	done
	local known=""
	case $(basename "$f") in
	pyftmerge) known="UnknownOptionError: Unknown option 'help'" ;;
	proton-viewer) known="No module named 'pandas'" ;;
	convert-caffe2-to-onnx | convert-onnx-to-caffe2) known="No module named 'caffe2'" ;;
	ccmake) known="'ccmake' is not available in cmake installation" ;;
	esac
	if [ -n "$known" ] && grep -qF "$known" <<<"$out"; then
		echo "ok: $f ran and stopped as its package makes it: $known"
		return 0
	fi
	echo "FAIL: $f exits nonzero with --version and with --help: $(tail -n 2 <<<"$out" | tr '\n' ' ')"
	return 1
}
export -f check_one
for venv in "$@"; do
	if [ ! -d "$venv/bin" ]; then
		echo "FAIL: $venv/bin does not exist"
		status=1
		continue
	fi
	for f in "$venv"/bin/*; do
		[ -f "$f" ] && [ -x "$f" ] && printf '%s\0' "$f"
	done | xargs -0 -n 1 -P 2 bash -c 'check_one "$1"' _ || status=1
	# activate is sourced, not run: it must point at this folder.
	want=$(cd "$venv" && pwd)
	if ! grep -q "^VIRTUAL_ENV=[\"']\?$want[\"']\?$" "$venv/bin/activate"; then
		echo "FAIL: $venv/bin/activate does not set VIRTUAL_ENV to $want: $(grep '^VIRTUAL_ENV=' "$venv/bin/activate")"
		status=1
	fi
done
[ $status = 0 ] && echo "venv_scripts.sh: every script in $# virtualenvs' bin/ runs"
exit $status
