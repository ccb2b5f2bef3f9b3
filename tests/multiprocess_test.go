package tests

import (
	"bufio"
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// freePort returns a TCP port that was free a moment ago, and checks the
// one above it too (rank 0 serves rendezvous on MASTER_PORT+1).
func freePort(t *testing.T) int {
	t.Helper()
	for try := 0; try < 20; try++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		l2, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port+1))
		l.Close()
		if err == nil {
			l2.Close()
			return port
		}
	}
	t.Fatal("no free port pair")
	return 0
}

// TestFourProcessesAllreduceOverTCP starts 4 OS processes of the rank
// command on 127.0.0.1; they rendezvous torchrun-style, run every
// registered algorithm and verify every element against the exact sum.
// All ranks must end with identical bits (same hash per algorithm).
func TestFourProcessesAllreduceOverTCP(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "rank")
	build := exec.Command("go", "build", "-o", bin, "./cmd/rank")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the rank command: %v\n%s", err, out)
	}
	const p = 4
	port := freePort(t)
	cmds := make([]*exec.Cmd, p)
	outs := make([]*bytes.Buffer, p)
	for r := 0; r < p; r++ {
		cmd := exec.Command(bin, "-n", "20011", "-iters", "2", "-timeout", "90s")
		cmd.Env = append(os.Environ(), "MASTER_ADDR=127.0.0.1", fmt.Sprintf("MASTER_PORT=%d", port),
			fmt.Sprintf("RANK=%d", r), fmt.Sprintf("WORLD_SIZE=%d", p), "OKTOPK_SOCKET_IFNAME=")
		outs[r] = &bytes.Buffer{}
		cmd.Stdout, cmd.Stderr = outs[r], outs[r]
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmds[r] = cmd
	}
	deadline := time.AfterFunc(120*time.Second, func() {
		for _, c := range cmds {
			c.Process.Kill()
		}
	})
	defer deadline.Stop()
	for r, c := range cmds {
		if err := c.Wait(); err != nil {
			t.Errorf("rank %d: %v\n%s", r, err, outs[r])
		}
	}
	if t.Failed() {
		return
	}
	// Every algorithm line must carry the same hash on every rank.
	hashes := map[string]string{}
	for r := 0; r < p; r++ {
		sc := bufio.NewScanner(bytes.NewReader(outs[r].Bytes()))
		lines := 0
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			if len(f) != 6 || f[3] != "ok" {
				continue
			}
			lines++
			alg, hash := f[2], f[5]
			if prev, ok := hashes[alg]; ok && prev != hash {
				t.Errorf("%s: rank %d hash %s differs from %s", alg, r, hash, prev)
			}
			hashes[alg] = hash
		}
		if lines < 2 {
			t.Errorf("rank %d verified only %d algorithms:\n%s", r, lines, outs[r])
		}
	}
	t.Logf("verified over TCP on %d processes: %d algorithms", p, len(hashes))
}
