package tests

// A benchmark of the dense ring allreduce between processes, through
// oktopk's transport and over raw ZeroMQ sockets, reporting both bus
// bandwidths and their ratio.

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// BenchmarkRingAllreduceBetweenProcesses starts P OS processes of the busbw
// command on 127.0.0.1 for P = 2 and 4; they rendezvous torchrun-style and
// time the dense ring allreduce of 1 to 64 MiB through oktopk's transport
// and the same ring schedule over raw ZeroMQ sockets between the same
// processes. It reports both bus bandwidths (bytes·2(P−1)/P per second) and
// their ratio, the transport's overhead; the goal is a ratio of at least 0.8.
//
//	go test -run '^$' -bench RingAllreduceBetweenProcesses -benchtime 1x ./tests
//
// One b.N iteration is one whole multi-process run, so -benchtime 1x is the
// useful setting. Each size is timed over at least BUSBW_ITERS allreduces
// of each kind (more for small sizes), in blocks of runs of one kind in the
// order A B B A A B …, each block opening with untimed runs; the times are
// medians and the ratio is the median over neighbouring block pairs (see
// compare in the busbw command for why).
func BenchmarkRingAllreduceBetweenProcesses(b *testing.B) {
	bin := buildCommand(b, "busbw")
	iters := os.Getenv("BUSBW_ITERS")
	if iters == "" {
		iters = "5"
	}
	for _, p := range []int{2, 4} {
		b.Run(fmt.Sprintf("P=%d", p), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				lines := runBusbw(b, bin, p, iters)
				if i < b.N-1 {
					continue
				}
				for _, l := range lines {
					f := fields(l)
					size, _ := strconv.Atoi(f["size"])
					for _, key := range []string{"oktopk_busbw_MBps", "raw_busbw_MBps", "ratio"} {
						v, err := strconv.ParseFloat(f[key], 64)
						if err != nil {
							b.Fatalf("line %q: %s: %v", l, key, err)
						}
						b.ReportMetric(v, fmt.Sprintf("%dMiB_%s", size>>20, key))
					}
					b.Log(l)
				}
			}
		})
	}
}

func runBusbw(b *testing.B, bin string, p int, iters string) []string {
	cmds, outs := startRanks(b, bin, p, "-iters", iters)
	waitRanks(b, cmds, outs, 10*time.Minute)
	if b.Failed() {
		b.FailNow()
	}
	var lines []string
	sc := bufio.NewScanner(strings.NewReader(outs[0].String()))
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "busbw ") {
			lines = append(lines, sc.Text())
		}
	}
	if len(lines) == 0 {
		b.Fatalf("rank 0 printed no figures:\n%s", outs[0])
	}
	return lines
}

// fields parses "key=value" words.
func fields(line string) map[string]string {
	m := map[string]string{}
	for _, w := range strings.Fields(line) {
		if k, v, ok := strings.Cut(w, "="); ok {
			m[k] = v
		}
	}
	return m
}
