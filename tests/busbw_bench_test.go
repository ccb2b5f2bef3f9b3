package tests

import (
	"bufio"
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
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
// One b.N iteration is one whole multi-process run (each size timed over
// BUSBW_ITERS allreduces, median), so -benchtime 1x is the useful setting.
func BenchmarkRingAllreduceBetweenProcesses(b *testing.B) {
	bin := filepath.Join(b.TempDir(), "busbw")
	if out, err := exec.Command("go", "build", "-o", bin, "./cmd/busbw").CombinedOutput(); err != nil {
		b.Fatalf("building the busbw command: %v\n%s", err, out)
	}
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
	port := freePortB(b)
	cmds := make([]*exec.Cmd, p)
	outs := make([]*bytes.Buffer, p)
	for r := 0; r < p; r++ {
		cmd := exec.Command(bin, "-iters", iters)
		cmd.Env = append(os.Environ(), "MASTER_ADDR=127.0.0.1", fmt.Sprintf("MASTER_PORT=%d", port),
			fmt.Sprintf("RANK=%d", r), fmt.Sprintf("WORLD_SIZE=%d", p), "OKTOPK_SOCKET_IFNAME=")
		outs[r] = &bytes.Buffer{}
		cmd.Stdout, cmd.Stderr = outs[r], outs[r]
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		cmds[r] = cmd
	}
	kill := time.AfterFunc(10*time.Minute, func() {
		for _, c := range cmds {
			c.Process.Kill()
		}
	})
	defer kill.Stop()
	for r, c := range cmds {
		if err := c.Wait(); err != nil {
			b.Fatalf("rank %d: %v\n%s", r, err, outs[r])
		}
	}
	var lines []string
	sc := bufio.NewScanner(outs[0])
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

// freePortB is freePort for a benchmark: a port free a moment ago, with the
// one above it free too (rank 0 serves rendezvous on MASTER_PORT+1).
func freePortB(b *testing.B) int {
	b.Helper()
	for try := 0; try < 20; try++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		l2, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port+1))
		l.Close()
		if err == nil {
			l2.Close()
			return port
		}
	}
	b.Fatal("no free port pair")
	return 0
}
