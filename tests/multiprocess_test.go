package tests

// Tests of jobs of separate rank processes over TCP: every algorithm
// verified across four processes, and stopped or killed peers detected
// within bounds with no hang, crash or wrong result; and their helpers.

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	mathrand "math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/oktopk/oktopk/tests/internal/ports"
)

// freePort returns a TCP port that was free a moment ago, with the one
// above it, both below the kernel's ephemeral range (package ports says
// why).
func freePort(t testing.TB) int {
	t.Helper()
	low := ports.EphemeralLow()
	for try := 0; try < 100; try++ {
		port := 10000 + mathrand.Intn(low-10002)
		if ports.PairFree(port) {
			return port
		}
	}
	t.Fatal("no free port pair below the ephemeral range")
	return 0
}

// TestFourProcessesAllreduceOverTCP starts 4 OS processes of the rank
// command on 127.0.0.1; they rendezvous torchrun-style, run every
// registered algorithm and verify every element against the exact sum.
// All ranks must end with identical bits (same hash per algorithm).
func TestFourProcessesAllreduceOverTCP(t *testing.T) {
	const p = 4
	cmds, outs := startRanks(t, buildRank(t), p, "-n", "20011", "-iters", "2", "-timeout", "90s")
	waitRanks(t, cmds, outs, 120*time.Second)
	if t.Failed() {
		return
	}
	// Every algorithm line must carry the same hash on every rank.
	hashes := map[string]string{}
	for r := 0; r < p; r++ {
		sc := bufio.NewScanner(strings.NewReader(outs[r].String()))
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

// waitRanks waits for every rank's process and reports each that failed,
// with its output. After limit it kills them all, so that a hung job fails
// the test instead of hanging it.
func waitRanks(t testing.TB, cmds []*exec.Cmd, outs []*syncBuffer, limit time.Duration) {
	t.Helper()
	deadline := time.AfterFunc(limit, func() {
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
}

// startRanks launches p processes of bin as the ranks of a torchrun-style
// job on 127.0.0.1 and returns them with their combined output buffers;
// whatever still runs when the test ends is killed.
func startRanks(t testing.TB, bin string, p int, args ...string) ([]*exec.Cmd, []*syncBuffer) {
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

func buildRank(t testing.TB) string { return buildCommand(t, "rank") }

// buildCommand builds ./cmd/name into the test's temporary folder.
func buildCommand(t testing.TB, name string) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), name)
	if out, err := exec.Command("go", "build", "-o", bin, "./cmd/"+name).CombinedOutput(); err != nil {
		t.Fatalf("building the %s command: %v\n%s", name, err, out)
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

// faultTally counts what the fault tests injected and saw; each test adds
// to it and prints the running total in one line (the figure in docs/failures.md).
var faultTally struct {
	mu                                   sync.Mutex
	faults, runs, hangs, crashes, wrongs int
}

// faultOutcomes counts one test's survivors that hung, crashed or returned
// wrong results.
type faultOutcomes struct{ hangs, crashes, wrongs int }

// judge counts o and fails t for it, naming the rank by what; it reports
// false for a rank that hung, which has nothing more to check.
func (f *faultOutcomes) judge(t *testing.T, o rankOutcome, what, output string) bool {
	t.Helper()
	switch {
	case o.hung:
		f.hangs++
		t.Errorf("%s hung", what)
		return false
	case o.wrong:
		f.wrongs++
		t.Errorf("%s: %s", what, tail(output))
	case o.crashed:
		f.crashes++
		t.Errorf("%s crashed:\n%s", what, output)
	}
	return true
}

func reportFaults(t *testing.T, faults, runs int, seen faultOutcomes) {
	ft := &faultTally
	ft.mu.Lock()
	defer ft.mu.Unlock()
	ft.faults += faults
	ft.runs += runs
	ft.hangs += seen.hangs
	ft.crashes += seen.crashes
	ft.wrongs += seen.wrongs
	line := fmt.Sprintf("faults injected: %d, runs: %d, hangs: %d, crashes: %d, wrong results: %d",
		ft.faults, ft.runs, ft.hangs, ft.crashes, ft.wrongs)
	t.Log(line)
	fmt.Println(line)
}

// Exit statuses of the rank command's -loop mode.
const (
	rankExitError       = 10
	rankExitWrongResult = 11
)

// rankOutcome is how one rank process ended after a fault.
type rankOutcome struct {
	hung, crashed, wrong bool
	failedAfter          time.Duration // duration of the call that failed (-1 if not printed)
	closedIn             time.Duration // Close after the failure (-1 if not printed)
	returned             time.Duration // since the fault
	err                  string        // the failing call's error line
}

var (
	failedAfterRE = regexp.MustCompile(`call \d+ failed after (\S+): (.*)`)
	closedInRE    = regexp.MustCompile(`closed in (\S+)`)
)

// waitRank waits for a rank process at most limit after the fault at
// faultAt, kills it if it has not returned (a hang), and classifies how it
// ended: a clean error exit, a wrong result, or anything else (a crash).
func waitRank(cmd *exec.Cmd, out *syncBuffer, faultAt time.Time, limit time.Duration) rankOutcome {
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	o := rankOutcome{failedAfter: -1, closedIn: -1}
	var err error
	select {
	case err = <-done:
		o.returned = time.Since(faultAt)
	case <-time.After(time.Until(faultAt.Add(limit))):
		o.hung = true
		cmd.Process.Kill()
		<-done
		return o
	}
	text := out.String()
	var ee *exec.ExitError
	switch {
	case strings.Contains(text, "WRONG RESULT"):
		o.wrong = true
	case !errors.As(err, &ee) || ee.ExitCode() != rankExitError:
		o.crashed = true
	}
	if m := failedAfterRE.FindStringSubmatch(text); m != nil {
		o.failedAfter, _ = time.ParseDuration(m[1])
		o.err = m[2]
	}
	if m := closedInRE.FindStringSubmatch(text); m != nil {
		o.closedIn, _ = time.ParseDuration(m[1])
	}
	return o
}

// A stopped (SIGSTOP) rank is neither dead nor answering: each other rank's
// failing call returns a timeout within the call timeout + 10%, measured from
// the start of that call, naming the peer and the operation's sequence
// number (and the stopped rank, silent since); destroy then takes under 1 s.
func TestStoppedPeerTimesOutWithinBound(t *testing.T) {
	const callTimeout = 3 * time.Second
	bin := buildRank(t)
	cmds, outs := startRanks(t, bin, 3, "-n", "50000", "-loop", "100000", "-call-timeout", callTimeout.String())
	waitCalls(t, outs, 3)
	stopped := time.Now()
	cmds[2].Process.Signal(syscall.SIGSTOP)
	var seen faultOutcomes
	for r := 0; r < 2; r++ {
		o := waitRank(cmds[r], outs[r], stopped, 2*callTimeout+5*time.Second)
		if !seen.judge(t, o, fmt.Sprintf("rank %d (peer stopped)", r), outs[r].String()) {
			continue
		}
		if o.failedAfter < 0 || o.failedAfter > callTimeout*11/10 {
			t.Errorf("rank %d: failing call returned after %v, bound %v", r, o.failedAfter, callTimeout*11/10)
		}
		if !strings.Contains(o.err, "timeout") || !strings.Contains(o.err, "seq=") ||
			!strings.Contains(o.err, "peer") || !strings.Contains(o.err, "rank 2 silent") {
			t.Errorf("rank %d: error should be a timeout naming the peer, seq and the silent rank 2: %s", r, o.err)
		}
		if o.closedIn < 0 || o.closedIn > time.Second {
			t.Errorf("rank %d: destroy after the failure took %v, bound 1s", r, o.closedIn)
		}
		t.Logf("rank %d: call failed after %v, destroyed in %v: %s", r, o.failedAfter, o.closedIn, o.err)
	}
	reportFaults(t, 1, 1, seen)
}

// Killing a rank (SIGKILL) at seeded random points of a verified allreduce
// loop, over runs of several algorithms: every survivor's failing call
// returns within the call timeout + 10%, it exits cleanly (no crash), destroy
// takes under 1 s, no rank ever computed a wrong result before the kill
// (every element of every call is checked), and none hangs.
// OKTOPK_FAULT_SEED replays a run; OKTOPK_FAULT_RUNS sets the count (20).
func TestKilledPeerAtRandomPointsNeverHangs(t *testing.T) {
	const callTimeout = time.Second
	runs := 20
	if v, err := strconv.Atoi(os.Getenv("OKTOPK_FAULT_RUNS")); err == nil && v > 0 {
		runs = v
	}
	seed := time.Now().UnixNano()
	if v, err := strconv.ParseInt(os.Getenv("OKTOPK_FAULT_SEED"), 10, 64); err == nil {
		seed = v
	}
	t.Logf("seed %d (OKTOPK_FAULT_SEED=%d replays it)", seed, seed)
	rng := mathrand.New(mathrand.NewSource(seed))
	// Rabenseifner on ranges of several pieces, where a rank waits for its
	// partner's first piece before it sends the rest.
	algs := []struct{ alg, n string }{{"oktopk", "20000"}, {"topka", "20000"}, {"gtopk", "20000"},
		{"ssar_split_allgather", "20000"}, {"dense_ring", "20000"}, {"dense_rabenseifner", "600000"}}
	bin := buildRank(t)
	began := time.Now()
	var seen faultOutcomes
	for run := 0; run < runs; run++ {
		alg := algs[run%len(algs)].alg
		cmds, outs := startRanks(t, bin, 3, "-n", algs[run%len(algs)].n, "-loop", "100000", "-call-timeout", callTimeout.String(), "-alg", alg)
		waitCalls(t, outs, 1)
		delay := time.Duration(rng.Int63n(int64(300 * time.Millisecond)))
		victim := rng.Intn(3)
		time.Sleep(delay)
		killed := time.Now()
		cmds[victim].Process.Kill()
		cmds[victim].Wait()
		if strings.Contains(outs[victim].String(), "WRONG RESULT") {
			seen.wrongs++
			t.Errorf("run %d: killed rank %d had computed a wrong result: %s", run, victim, tail(outs[victim].String()))
		}
		for r := range cmds {
			if r == victim {
				continue
			}
			o := waitRank(cmds[r], outs[r], killed, 2*callTimeout+5*time.Second)
			what := fmt.Sprintf("run %d (%s, rank %d killed %v after call 1): rank %d", run, alg, victim, delay.Round(time.Millisecond), r)
			if !seen.judge(t, o, what, outs[r].String()) {
				continue
			}
			if o.failedAfter < 0 || o.failedAfter > callTimeout*11/10 {
				t.Errorf("%s: failing call returned after %v, bound %v", what, o.failedAfter, callTimeout*11/10)
			}
			if o.closedIn < 0 || o.closedIn > time.Second {
				t.Errorf("%s: destroy after a dead peer took %v, bound 1s", what, o.closedIn)
			}
		}
	}
	if d := time.Since(began); d > time.Duration(runs)*5*time.Second {
		t.Errorf("%d runs took %v", runs, d)
	}
	t.Logf("%d runs in %v", runs, time.Since(began).Round(time.Millisecond))
	reportFaults(t, runs, runs, seen)
}

// A killed rank's survivors learn of its death from its dropped TCP
// connections, not from the call timeout: with a 20 s per-call timeout,
// every survivor's failing call returns within 5 s of the SIGKILL with an
// error naming the dead peer as disconnected, and destroy takes under 1 s.
func TestKilledPeerIsDetectedLongBeforeTheCallTimeout(t *testing.T) {
	const (
		callTimeout = 20 * time.Second
		bound       = 5 * time.Second
		runs        = 3
	)
	seed := time.Now().UnixNano()
	if v, err := strconv.ParseInt(os.Getenv("OKTOPK_FAULT_SEED"), 10, 64); err == nil {
		seed = v
	}
	t.Logf("seed %d (OKTOPK_FAULT_SEED=%d replays it)", seed, seed)
	rng := mathrand.New(mathrand.NewSource(seed))
	algs := []string{"oktopk", "dense_ring", "gtopk"}
	bin := buildRank(t)
	var seen faultOutcomes
	for run := 0; run < runs; run++ {
		alg := algs[run%len(algs)]
		cmds, outs := startRanks(t, bin, 3, "-n", "20000", "-loop", "100000", "-call-timeout", callTimeout.String(), "-alg", alg)
		waitCalls(t, outs, 1)
		victim := rng.Intn(3)
		time.Sleep(time.Duration(rng.Int63n(int64(300 * time.Millisecond))))
		killed := time.Now()
		cmds[victim].Process.Kill()
		cmds[victim].Wait()
		for r := range cmds {
			if r == victim {
				continue
			}
			o := waitRank(cmds[r], outs[r], killed, callTimeout+5*time.Second)
			what := fmt.Sprintf("run %d (%s, rank %d killed): rank %d", run, alg, victim, r)
			if !seen.judge(t, o, what, outs[r].String()) {
				continue
			}
			if o.returned > bound {
				t.Errorf("%s: returned %v after the kill, bound %v (call timeout %v)", what, o.returned, bound, callTimeout)
			}
			if dead := fmt.Sprintf("peer %d disconnected", victim); !strings.Contains(o.err, dead) {
				t.Errorf("%s: error should say %q: %s", what, dead, o.err)
			}
			if o.closedIn < 0 || o.closedIn > time.Second {
				t.Errorf("%s: destroy after a dead peer took %v, bound 1s", what, o.closedIn)
			}
			t.Logf("%s: exited %v after the kill: %s", what, o.returned.Round(time.Millisecond), o.err)
		}
	}
	reportFaults(t, runs, runs, seen)
}

func tail(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}
