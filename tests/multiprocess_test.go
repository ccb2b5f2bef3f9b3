package tests

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
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

// startRanks launches p rank processes in -loop mode and returns them with
// their combined output buffers.
func startRanks(t *testing.T, bin string, p int, args ...string) ([]*exec.Cmd, []*syncBuffer) {
	t.Helper()
	port := freePort(t)
	cmds := make([]*exec.Cmd, p)
	outs := make([]*syncBuffer, p)
	for r := 0; r < p; r++ {
		cmd := exec.Command(bin, args...)
		cmd.Env = append(os.Environ(), "MASTER_ADDR=127.0.0.1", fmt.Sprintf("MASTER_PORT=%d", port),
			fmt.Sprintf("RANK=%d", r), fmt.Sprintf("WORLD_SIZE=%d", p), "OKTOPK_SOCKET_IFNAME=")
		outs[r] = &syncBuffer{}
		cmd.Stdout, cmd.Stderr = outs[r], outs[r]
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmds[r] = cmd
	}
	t.Cleanup(func() {
		for _, c := range cmds {
			c.Process.Signal(syscall.SIGCONT)
			c.Process.Kill()
			c.Wait()
		}
	})
	return cmds, outs
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func buildRank(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "rank")
	if out, err := exec.Command("go", "build", "-o", bin, "./cmd/rank").CombinedOutput(); err != nil {
		t.Fatalf("building the rank command: %v\n%s", err, out)
	}
	return bin
}

// waitCalls waits until every rank has completed at least `calls` calls.
func waitCalls(t *testing.T, outs []*syncBuffer, calls int) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		ready := 0
		for _, o := range outs {
			if strings.Contains(o.String(), fmt.Sprintf("call %d ok", calls)) {
				ready++
			}
		}
		if ready == len(outs) {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatal("ranks never got going")
}

// A stopped (SIGSTOP) rank is neither dead nor answering: the others must
// return a timeout error within the call timeout + 10%, never hang.
func TestStoppedPeerTimesOutWithinBound(t *testing.T) {
	const callTimeout = 3 * time.Second
	bin := buildRank(t)
	cmds, outs := startRanks(t, bin, 3, "-n", "50000", "-loop", "100000", "-call-timeout", callTimeout.String())
	waitCalls(t, outs, 3)
	stopped := time.Now()
	cmds[2].Process.Signal(syscall.SIGSTOP)
	for r := 0; r < 2; r++ {
		err := cmds[r].Wait()
		took := time.Since(stopped)
		if err == nil {
			t.Fatalf("rank %d finished without an error with a stopped peer", r)
		}
		if took > callTimeout*11/10+time.Second { // +1 s for the call in flight when SIGSTOP landed
			t.Errorf("rank %d returned %v after the stop, bound %v", r, took, callTimeout*11/10)
		}
		if !strings.Contains(outs[r].String(), "timeout") && !strings.Contains(outs[r].String(), "remote") {
			t.Errorf("rank %d: error does not say timeout or remote failure:\n%s", r, tail(outs[r].String()))
		}
		t.Logf("rank %d returned %v after the stop: %s", r, took.Round(time.Millisecond), tail(outs[r].String()))
	}
}

// Killing a rank at random points over several runs: the survivors always
// return an error within the bound, none hangs, none crashes.
func TestKilledPeerAtRandomPointsNeverHangs(t *testing.T) {
	const callTimeout = 2 * time.Second
	bin := buildRank(t)
	for run := 0; run < 4; run++ {
		cmds, outs := startRanks(t, bin, 3, "-n", "20000", "-loop", "100000", "-call-timeout", callTimeout.String())
		waitCalls(t, outs, 2)
		time.Sleep(time.Duration(run*37%100) * time.Millisecond)
		victim := run % 3
		killed := time.Now()
		cmds[victim].Process.Kill()
		for r := range cmds {
			if r == victim {
				continue
			}
			err := cmds[r].Wait()
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() != 2 {
				t.Fatalf("run %d rank %d: want a clean error exit (2), got %v:\n%s", run, r, err, tail(outs[r].String()))
			}
			if took := time.Since(killed); took > callTimeout*11/10+time.Second {
				t.Errorf("run %d rank %d returned %v after the kill", run, r, took)
			}
		}
	}
}

func tail(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}
