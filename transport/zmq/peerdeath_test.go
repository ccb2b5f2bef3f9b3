package zmq

// Tests of peer death with a rank in a child process: a killed rank fails
// its peers' receives quickly, a stopped one is not taken for dead, and a
// dead rank's address is not dialed again.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/oktopk/oktopk/transport"
)

// childRankEnv makes this test binary run as one rank of a test's job
// instead of running tests: "rank size token". A real process is what a
// peer-death test needs, since only the kernel closes a killed process's
// connections the way a crash does.
const childRankEnv = "OKTOPK_TEST_CHILD_RANK"

func TestMain(m *testing.M) {
	if spec := os.Getenv(childRankEnv); spec != "" {
		os.Exit(runChildRank(spec))
	}
	os.Exit(m.Run())
}

// runChildRank binds, prints its endpoint, reads every rank's endpoint from
// stdin, connects, and then idles (heartbeats only) until it is killed or
// stdin closes.
func runChildRank(spec string) int {
	var rank, size int
	var token string
	if _, err := fmt.Sscan(spec, &rank, &size, &token); err != nil {
		fmt.Fprintln(os.Stderr, "child rank:", err)
		return 1
	}
	z, err := Listen(Options{Rank: rank, Size: size, Token: token})
	if err != nil {
		fmt.Fprintln(os.Stderr, "child rank:", err)
		return 1
	}
	fmt.Println(z.Endpoint())
	in := bufio.NewReader(os.Stdin)
	line, err := in.ReadString('\n')
	if err != nil {
		return 1
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := z.Connect(ctx, strings.Fields(line)); err != nil {
		fmt.Fprintln(os.Stderr, "child rank:", err)
		return 1
	}
	io.Copy(io.Discard, in)
	z.Close()
	return 0
}

// startWithChildRank connects ranks 0 … size-2 in this process and rank
// size-1 in a child process, all over TCP on loopback, and returns the
// ranks in this process, the child, and every rank's endpoint.
func startWithChildRank(t *testing.T, size int) ([]*Transport, *exec.Cmd, []string) {
	t.Helper()
	token := transport.NewToken()
	zs := make([]*Transport, size-1)
	endpoints := make([]string, size)
	for r := range zs {
		z, err := Listen(Options{Rank: r, Size: size, Token: token})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { z.Close() })
		zs[r], endpoints[r] = z, z.Endpoint()
	}
	child := exec.Command(os.Args[0])
	child.Env = append(os.Environ(), fmt.Sprintf("%s=%d %d %s", childRankEnv, size-1, size, token))
	child.Stderr = os.Stderr
	stdin, err := child.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		child.Process.Signal(syscall.SIGCONT)
		child.Process.Kill()
		child.Wait()
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatalf("child rank never printed its endpoint: %v", err)
	}
	endpoints[size-1] = strings.TrimSpace(line)
	if _, err := io.WriteString(stdin, strings.Join(endpoints, " ")+"\n"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	errs := make([]error, len(zs))
	var wg sync.WaitGroup
	for r, z := range zs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = z.Connect(ctx, endpoints)
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d connect: %v", r, err)
		}
	}
	return zs, child, endpoints
}

// A rank killed with SIGKILL is found dead through its dropped connections:
// receives blocked on it with a 30 s deadline (and the default 30 s
// PeerTimeout) return within 3 s an ErrRemote naming the peer, and Close
// afterwards takes under 1 s.
func TestZMQKilledPeerFailsWaitersThroughItsDroppedConnection(t *testing.T) {
	zs, child, _ := startWithChildRank(t, 3)
	type result struct {
		rank int
		err  error
		at   time.Time
	}
	results := make(chan result, len(zs))
	for r, z := range zs {
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_, err := z.Recv(ctx, 2, transport.Tag{Op: transport.OpAllgather, Seq: 1, Step: 0})
			results <- result{r, err, time.Now()}
		}()
	}
	time.Sleep(300 * time.Millisecond) // both receivers blocked, heartbeats flowing
	killed := time.Now()
	if err := child.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	for range zs {
		res := <-results
		d := res.at.Sub(killed)
		if !errors.Is(res.err, transport.ErrRemote) || !strings.Contains(res.err.Error(), "peer 2 disconnected") {
			t.Errorf("rank %d: want ErrRemote naming peer 2 as disconnected, got %v after %v", res.rank, res.err, d)
			continue
		}
		if d > 3*time.Second {
			t.Errorf("rank %d: killed peer detected after %v, bound 3s", res.rank, d)
		}
		t.Logf("rank %d: detected in %v: %v", res.rank, d.Round(time.Millisecond), res.err)
	}
	for r, z := range zs {
		start := time.Now()
		z.Close()
		if d := time.Since(start); d > time.Second {
			t.Errorf("rank %d: Close after a dead peer took %v, bound 1s", r, d)
		}
	}
}

// A stopped rank (SIGSTOP) keeps its connections up, so the monitor must
// not take it for dead: the receiver's own deadline decides, with a timeout.
func TestZMQStoppedPeerIsNotTakenForDisconnected(t *testing.T) {
	zs, child, _ := startWithChildRank(t, 2)
	if err := child.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	const deadline = 3 * peerDisconnectGrace
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	start := time.Now()
	_, err := zs[0].Recv(ctx, 1, transport.Tag{Op: transport.OpAllgather, Seq: 1, Step: 0})
	if !errors.Is(err, transport.ErrTimeout) || strings.Contains(err.Error(), "disconnected") {
		t.Fatalf("want a timeout, got %v", err)
	}
	if d := time.Since(start); d < deadline || d > deadline*11/10 {
		t.Fatalf("returned after %v, want the %v deadline", d, deadline)
	}
}

// Once a killed peer is declared dead, this rank stops dialing its address:
// a process that later listens there gets no connection (without CURVE it
// would otherwise be handed the job's password at the next reconnect, and
// its frames would be taken for the dead rank's).
func TestZMQDeadPeersAddressIsNotRedialed(t *testing.T) {
	zs, child, endpoints := startWithChildRank(t, 2)
	addr, _, err := splitEndpoint(endpoints[1])
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := zs[0].Recv(ctx, 1, transport.Tag{Op: transport.OpAllgather, Seq: 1, Step: 0}); !errors.Is(err, transport.ErrRemote) {
		t.Fatalf("want the killed peer declared dead (ErrRemote), got %v", err)
	}
	time.Sleep(2 * pollInterval) // the inbox's goroutine acts on it
	ln, err := net.Listen("tcp", strings.TrimPrefix(addr, "tcp://"))
	if err != nil {
		t.Fatalf("listening on the dead peer's address: %v", err)
	}
	defer ln.Close()
	ln.(*net.TCPListener).SetDeadline(time.Now().Add(10 * reconnectInterval))
	if c, err := ln.Accept(); err == nil {
		c.Close()
		t.Fatal("the dead peer's address was dialed again after it was declared dead")
	}
}
