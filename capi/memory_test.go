package main

// Tests of the garbage collector's policy at load time, from OKTOPK_GOGC,
// GOGC and GOMEMLIMIT, and of parsing memory limits.

import (
	"math"
	"runtime/debug"
	"strings"
	"testing"
)

// The collector's policy at load time: the library's own GOGC unless the
// user set OKTOPK_GOGC, GOGC or GOMEMLIMIT; the user's values applied when
// the runtime could not have seen them (set after the process started).
func TestMemoryPolicy(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(100))
	defer debug.SetMemoryLimit(debug.SetMemoryLimit(-1))
	gcPercent := func() int { p := debug.SetGCPercent(0); debug.SetGCPercent(p); return p }
	for _, c := range []struct {
		name       string
		now, start map[string]string
		percent    int
		limit      int64 // -1: left as it was
		warning    string
	}{
		{"nothing set: the library's default", nil, nil, defaultGOGC, -1, ""},
		{"OKTOPK_GOGC wins", map[string]string{"OKTOPK_GOGC": "40", "GOGC": "300"}, nil, 40, -1, ""},
		{"OKTOPK_GOGC=off", map[string]string{"OKTOPK_GOGC": "off"}, nil, -1, -1, ""},
		{"bad OKTOPK_GOGC: warned, default", map[string]string{"OKTOPK_GOGC": "lots"}, nil, defaultGOGC, -1, "OKTOPK_GOGC"},
		{"GOGC from process start: left to the runtime", map[string]string{"GOGC": "300"}, map[string]string{"GOGC": "300"}, 77, -1, ""},
		{"GOGC set later: applied", map[string]string{"GOGC": "300"}, nil, 300, -1, ""},
		{"GOMEMLIMIT set later: applied, GOGC left", map[string]string{"GOMEMLIMIT": "3GiB"}, nil, 77, 3 << 30, ""},
		{"bad GOMEMLIMIT: warned, nothing changed", map[string]string{"GOMEMLIMIT": "3 apples"}, nil, 77, -1, "GOMEMLIMIT"},
	} {
		t.Run(c.name, func(t *testing.T) {
			debug.SetGCPercent(77)
			debug.SetMemoryLimit(math.MaxInt64)
			var out strings.Builder
			applyMemoryPolicy(func(k string) (string, bool) { v, ok := c.now[k]; return v, ok },
				func(k string) string { return c.start[k] }, &out)
			if got := gcPercent(); got != c.percent {
				t.Errorf("GOGC %d, want %d", got, c.percent)
			}
			want := c.limit
			if want == -1 {
				want = math.MaxInt64
			}
			if got := debug.SetMemoryLimit(-1); got != want {
				t.Errorf("memory limit %d, want %d", got, want)
			}
			if (c.warning == "") != (out.Len() == 0) || !strings.Contains(out.String(), c.warning) {
				t.Errorf("warning %q, want one naming %q", out.String(), c.warning)
			}
		})
	}
}

func TestParseMemoryLimit(t *testing.T) {
	for in, want := range map[string]int64{"0": 0, "123": 123, "5B": 5, "2KiB": 2048, "7MiB": 7 << 20, "1TiB": 1 << 40, "off": math.MaxInt64} {
		if got, err := parseMemoryLimit(in); err != nil || got != want {
			t.Errorf("parseMemoryLimit(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "-1", "1GB", "x", "99999999999TiB"} {
		if _, err := parseMemoryLimit(in); err == nil {
			t.Errorf("parseMemoryLimit(%q) accepted", in)
		}
	}
}
