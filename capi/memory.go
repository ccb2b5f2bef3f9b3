package main

// The Go collector's policy (GOGC, GOMEMLIMIT, OKTOPK_GOGC), set when the
// library is loaded.

/*
#include <stdlib.h>
*/
import "C"

import (
	"fmt"
	"io"
	"math"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"unsafe"
)

// The Go collector's policy in this library. With Go's default (GOGC=100)
// the heap may grow to twice what is live before a collection: the
// residuals and scratch buffers of a job are live for its whole run, so the
// collector's headroom alone would add as much memory again as the
// residuals take, filled by the garbage of a few hundred calls (received
// messages). The library's large buffers hold no pointers, so a collection
// costs little however large they are (they are never scanned), and a
// smaller headroom is cheap: the library sets GOGC to defaultGOGC when it
// is loaded, a heap at most a quarter above what is live.
//
// The user decides otherwise with OKTOPK_GOGC (a percentage, or "off"),
// or with Go's own GOGC and GOMEMLIMIT, which the library then leaves as
// the user set them. All three are read when the library is loaded, through
// the C library's getenv: a variable a Python script sets before its first
// oktopk call counts, though the Go runtime itself sees only the
// environment the process started with (so the library applies GOGC and
// GOMEMLIMIT itself when they were set after the process started).
const defaultGOGC = 25

func init() { applyMemoryPolicy(libcLookupEnv, os.Getenv, os.Stderr) }

// applyMemoryPolicy sets the collector's policy from the environment as
// getenv sees it now (startEnv: as the runtime saw it at process start),
// warning on w about a value it cannot read.
func applyMemoryPolicy(getenv func(string) (string, bool), startEnv func(string) string, w io.Writer) {
	warn := func(name, value string, err error) {
		fmt.Fprintf(w, "oktopk: ignoring %s=%q: %v\n", name, value, err)
	}
	if v, ok := getenv("OKTOPK_GOGC"); ok {
		percent, err := parseGOGC(v)
		if err == nil {
			debug.SetGCPercent(percent)
			return
		}
		warn("OKTOPK_GOGC", v, err)
	}
	userSet := false
	if v, ok := getenv("GOGC"); ok {
		userSet = true
		// The runtime applied the value it saw at process start; a value
		// set later is applied here.
		if v != startEnv("GOGC") {
			if percent, err := parseGOGC(v); err == nil {
				debug.SetGCPercent(percent)
			} else {
				warn("GOGC", v, err)
			}
		}
	}
	if v, ok := getenv("GOMEMLIMIT"); ok {
		userSet = true
		if v != startEnv("GOMEMLIMIT") {
			if limit, err := parseMemoryLimit(v); err == nil {
				debug.SetMemoryLimit(limit)
			} else {
				warn("GOMEMLIMIT", v, err)
			}
		}
	}
	if !userSet {
		debug.SetGCPercent(defaultGOGC)
	}
}

// libcLookupEnv is getenv(3) that also tells an unset variable from an
// empty one (env.go's libcGetenv does not): the environment as it is now,
// not the copy the Go runtime took when the process started.
func libcLookupEnv(name string) (string, bool) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	v := C.getenv(cname)
	if v == nil {
		return "", false
	}
	return C.GoString(v), true
}

// parseGOGC reads a GOGC value: a percentage ≥ 0, or "off" (-1).
func parseGOGC(v string) (int, error) {
	if v == "off" {
		return -1, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("want a percentage >= 0 or \"off\"")
	}
	return n, nil
}

// parseMemoryLimit reads a GOMEMLIMIT value as the Go runtime does: a
// number of bytes with an optional unit (B, KiB, MiB, GiB, TiB), or "off".
func parseMemoryLimit(v string) (int64, error) {
	if v == "off" {
		return math.MaxInt64, nil
	}
	units := []struct {
		suffix string
		scale  int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}, {"B", 1}}
	scale := int64(1)
	for _, u := range units {
		if strings.HasSuffix(v, u.suffix) {
			v, scale = strings.TrimSuffix(v, u.suffix), u.scale
			break
		}
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 || n > math.MaxInt64/scale {
		return 0, fmt.Errorf("want a number of bytes with an optional unit (B, KiB, MiB, GiB, TiB) or \"off\"")
	}
	return n * scale, nil
}
