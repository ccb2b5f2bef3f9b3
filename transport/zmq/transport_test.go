package zmq

// Tests of the ZeroMQ transport over loopback: exchange order, tags, large
// messages, timeouts, aborts, dead peers, strangers' frames, the unique-id
// rendezvous, and sends racing an abort or a close.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/oktopk/oktopk/transport"

	"github.com/pebbe/zmq4"
)

// startZMQ connects size ranks inside this test process over real TCP
// sockets on loopback, rendezvousing through an in-memory store.
func startZMQ(t testing.TB, size int, mutate func(*Options)) []*Transport {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	store := transport.NewMemStore()
	token := transport.NewToken()
	zs := make([]*Transport, size)
	errs := make([]error, size)
	var wg sync.WaitGroup
	for r := 0; r < size; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			o := Options{Rank: r, Size: size, Token: token}
			if mutate != nil {
				mutate(&o)
			}
			zs[r], errs[r] = Rendezvous(ctx, store, o)
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d rendezvous: %v", r, err)
		}
	}
	t.Cleanup(func() {
		for _, z := range zs {
			z.Close()
		}
	})
	return zs
}

func TestZMQEveryPairExchangesInOrder(t *testing.T) {
	for _, size := range []int{2, 3, 5} {
		t.Run(fmt.Sprint("P=", size), func(t *testing.T) {
			zs := startZMQ(t, size, nil)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			const msgs = 20
			var wg sync.WaitGroup
			errs := make(chan error, size*size*2)
			for _, z := range zs {
				for peer := 0; peer < size; peer++ {
					if peer == z.Rank() {
						continue
					}
					wg.Add(2)
					go func() {
						defer wg.Done()
						for i := 0; i < msgs; i++ {
							p := []byte(fmt.Sprintf("%d->%d #%d", z.Rank(), peer, i))
							if err := z.Send(ctx, peer, transport.Tag{Op: transport.OpControl, Seq: 7, Step: 3}, transport.DtypeBytes, uint64(len(p)), p); err != nil {
								errs <- err
								return
							}
						}
					}()
					go func() {
						defer wg.Done()
						for i := 0; i < msgs; i++ {
							m, err := z.Recv(ctx, peer, transport.Tag{Op: transport.OpControl, Seq: 7, Step: 3})
							if err != nil {
								errs <- err
								return
							}
							if want := fmt.Sprintf("%d->%d #%d", peer, z.Rank(), i); string(m.Payload) != want {
								errs <- fmt.Errorf("rank %d got %q, want %q", z.Rank(), m.Payload, want)
								return
							}
						}
					}()
				}
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
		})
	}
}

func TestZMQTagsKeepConcurrentOperationsApart(t *testing.T) {
	zs := startZMQ(t, 2, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// Sent in one order, received in the opposite one.
	for seq := uint64(1); seq <= 5; seq++ {
		p := []byte{byte(seq)}
		if err := zs[0].Send(ctx, 1, transport.Tag{Op: transport.OpAllgather, Seq: seq, Step: 0}, transport.DtypeBytes, 1, p); err != nil {
			t.Fatal(err)
		}
	}
	for seq := uint64(5); seq >= 1; seq-- {
		m, err := zs[1].Recv(ctx, 0, transport.Tag{Op: transport.OpAllgather, Seq: seq, Step: 0})
		if err != nil {
			t.Fatal(err)
		}
		if m.Payload[0] != byte(seq) {
			t.Fatalf("seq %d delivered payload of seq %d", seq, m.Payload[0])
		}
	}
}

func TestZMQLargeMessageArrivesIntact(t *testing.T) {
	zs := startZMQ(t, 2, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	p := make([]byte, 12<<20+5)
	for i := range p {
		p[i] = byte(i * 7)
	}
	go zs[0].Send(ctx, 1, transport.Tag{Op: transport.OpAllgather, Seq: 1, Step: 0}, transport.DtypeBytes, uint64(len(p)), p)
	m, err := zs[1].Recv(ctx, 0, transport.Tag{Op: transport.OpAllgather, Seq: 1, Step: 0})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(m.Payload, p) {
		t.Fatal("payload corrupted")
	}
}

func TestZMQMismatchedOpIsReported(t *testing.T) {
	zs := startZMQ(t, 2, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	zs[0].Send(ctx, 1, transport.Tag{Op: transport.OpOkTopk, Seq: 1, Step: 0}, transport.DtypeBytes, 0, nil)
	_, err := zs[1].Recv(ctx, 0, transport.Tag{Op: transport.OpTopkA, Seq: 1, Step: 0})
	if !errors.Is(err, transport.ErrMismatch) || !strings.Contains(err.Error(), "oktopk") || !strings.Contains(err.Error(), "topka") {
		t.Fatalf("want a mismatch naming both ops, got %v", err)
	}
}

func TestZMQRecvTimesOutWithinDeadline(t *testing.T) {
	zs := startZMQ(t, 2, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := zs[0].Recv(ctx, 1, transport.Tag{Op: transport.OpAllgather, Seq: 9, Step: 1})
	if !errors.Is(err, transport.ErrTimeout) {
		t.Fatalf("want ErrTimeout, got %v", err)
	}
	if !strings.Contains(err.Error(), "peer 1") || !strings.Contains(err.Error(), "seq=9") {
		t.Errorf("timeout should name the peer and sequence number: %v", err)
	}
	if d := time.Since(start); d > 600*time.Millisecond {
		t.Fatalf("returned after %v for a 300ms deadline", d)
	}
}

func TestZMQAbortUnblocksWaitingReceive(t *testing.T) {
	zs := startZMQ(t, 2, nil)
	done := make(chan error)
	go func() {
		_, err := zs[0].Recv(context.Background(), 1, transport.Tag{Op: transport.OpAllgather, Seq: 1, Step: 0})
		done <- err
	}()
	time.Sleep(50 * time.Millisecond)
	zs[0].Abort(errors.New("test abort"))
	select {
	case err := <-done:
		if !errors.Is(err, transport.ErrAborted) {
			t.Fatalf("want ErrAborted, got %v", err)
		}
	case <-time.After(time.Second):
		t.Fatal("abort did not unblock Recv within 1s")
	}
	// The peer learns of the abort too, and fails fast.
	start := time.Now()
	_, err := zs[1].Recv(context.Background(), 0, transport.Tag{Op: transport.OpAllgather, Seq: 1, Step: 0})
	if !errors.Is(err, transport.ErrRemote) || time.Since(start) > time.Second {
		t.Fatalf("peer of an aborted rank: want ErrRemote at once, got %v after %v", err, time.Since(start))
	}
}

func TestZMQSilentPeerIsDeclaredDead(t *testing.T) {
	zs := startZMQ(t, 3, func(o *Options) { o.PeerTimeout = time.Second })
	// Rank 2 stops everything without saying bye (as SIGKILL would).
	zs[2].box.Fail(transport.ErrClosed)
	close(zs[2].closing)
	zs[2].closeOnce.Do(func() {})
	// Its sockets send a final bye on the way out; suppress that by
	// waiting for the owners only after rank 0 checks.
	start := time.Now()
	_, err := zs[0].Recv(context.Background(), 2, transport.Tag{Op: transport.OpAllgather, Seq: 1, Step: 0})
	if !errors.Is(err, transport.ErrRemote) {
		t.Fatalf("want ErrRemote, got %v", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("dead peer detected after %v", d)
	}
}

func TestZMQOtherJobsFramesAreRefused(t *testing.T) {
	zs := startZMQ(t, 2, nil)
	// A rank of another job (other token) connects to rank 1's outbox and
	// sends a perfectly formed frame.
	intruder, err := Listen(Options{Rank: 0, Size: 2, Token: transport.NewToken()})
	if err != nil {
		t.Fatal(err)
	}
	defer intruder.Close()
	other, err := Listen(Options{Rank: 1, Size: 2, Token: "x"})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	// Connect fails: rank 1's outbox refuses the intruder's connection at
	// its handshake (another job's password), and counts it; no frame of
	// the intruder's ever reaches it.
	intruder.Connect(ctx, []string{intruder.Endpoint(), zs[1].Endpoint()})
	intruder.Send(context.Background(), 1, transport.Tag{Op: transport.OpAllgather, Seq: 1, Step: 0}, transport.DtypeBytes, 3, []byte("bad"))
	if zs[1].Refusals().Connections == 0 {
		t.Fatal("a connection with another job's token was not refused")
	}
	// The real job still works and never sees the intruder's payload.
	ctx, cancel = context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	go zs[0].Send(context.Background(), 1, transport.Tag{Op: transport.OpAllgather, Seq: 1, Step: 0}, transport.DtypeBytes, 2, []byte("ok"))
	m, err := zs[1].Recv(ctx, 0, transport.Tag{Op: transport.OpAllgather, Seq: 1, Step: 0})
	if err != nil || string(m.Payload) != "ok" {
		t.Fatalf("got %q, %v; want the real peer's message", m.Payload, err)
	}
}

func TestZMQGarbageOnThePortIsHarmless(t *testing.T) {
	zs := startZMQ(t, 2, nil)
	addr := strings.TrimPrefix(zs[1].Endpoint(), "tcp://")
	for _, junk := range [][]byte{
		[]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
		bytes.Repeat([]byte{0xff}, 4096),
		{0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f}, // a ZMTP greeting cut short
	} {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		c.Write(junk)
		c.Close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	go zs[0].Send(ctx, 1, transport.Tag{Op: transport.OpAllgather, Seq: 2, Step: 0}, transport.DtypeBytes, 5, []byte("still"))
	m, err := zs[1].Recv(ctx, 0, transport.Tag{Op: transport.OpAllgather, Seq: 2, Step: 0})
	if err != nil || string(m.Payload) != "still" {
		t.Fatalf("after garbage: got %q, %v", m.Payload, err)
	}
}

func TestZMQClosedPeerFailsWaitersAtOnce(t *testing.T) {
	zs := startZMQ(t, 2, nil)
	zs[1].Close()
	start := time.Now()
	_, err := zs[0].Recv(context.Background(), 1, transport.Tag{Op: transport.OpAllgather, Seq: 1, Step: 0})
	if !errors.Is(err, transport.ErrRemote) || time.Since(start) > time.Second {
		t.Fatalf("want ErrRemote within 1s, got %v after %v", err, time.Since(start))
	}
}

func TestUniqueIDRendezvous(t *testing.T) {
	id, srv, err := NewUniqueID(Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	parsed, err := transport.ParseUniqueID(id.String())
	if err != nil || parsed != id || len(id.String()) > 255 {
		t.Fatalf("round trip %q: %v %v", id.String(), parsed, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	const size = 3
	zs := make([]*Transport, size)
	var wg sync.WaitGroup
	for r := 0; r < size; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			z, err := InitFromUniqueID(ctx, parsed, r, size, Options{})
			if err != nil {
				t.Error(err)
				return
			}
			zs[r] = z
		}()
	}
	wg.Wait()
	for _, z := range zs {
		if z != nil {
			defer z.Close()
		}
	}
	if t.Failed() {
		return
	}
	go zs[2].Send(ctx, 0, transport.Tag{Op: transport.OpAllgather, Seq: 1, Step: 0}, transport.DtypeBytes, 1, []byte{42})
	if m, err := zs[0].Recv(ctx, 2, transport.Tag{Op: transport.OpAllgather, Seq: 1, Step: 0}); err != nil || m.Payload[0] != 42 {
		t.Fatalf("%v %v", m, err)
	}
	if _, err := transport.ParseUniqueID("oktopk1:nonsense"); err == nil {
		t.Fatal("malformed unique id accepted")
	}
}

// senderRig is a transport cut down to its send path — the real Send,
// enqueue and outbox goroutine over a real ROUTER, with no peer connected
// (so the outbox holds what it is given) — so that a stress test can build
// thousands of them in a few seconds. Abort and Close work on it as on a
// full transport.
func senderRig(t *testing.T) *Transport {
	t.Helper()
	zctx, err := zmq4.NewContext()
	if err != nil {
		t.Fatal(err)
	}
	sock, err := zctx.NewSocket(zmq4.ROUTER)
	if err == nil {
		err = firstErr(sock.SetLinger(0), sock.SetSndtimeo(0), sock.SetRouterMandatory(1))
	}
	if err != nil {
		t.Fatal(err)
	}
	z := &Transport{
		opts:     Options{Rank: 0, Size: 2, Token: "rig"},
		token:    transport.DigestToken("rig"),
		zctx:     zctx,
		box:      transport.NewMailbox(0, 2, transport.Diagnostics{StallWarn: -1}),
		out:      outboxQueue{reqs: make(chan *sendRequest, sendQueueLength), stopped: make(chan struct{})},
		lastSeen: make([]atomic.Int64, 2),
		hello:    make([]atomic.Bool, 2),
		bound:    make([]atomic.Bool, 2),
		helloCh:  make(chan struct{}, 4),
		gone:     make(chan int, 2),
		closing:  make(chan struct{}),
	}
	z.connected.Store(true)
	z.owners.Add(1)
	go z.outboxLoop(sock)
	return z
}

// Sends racing an abort or a close (the path oktopk_comm_abort and
// oktopk_comm_destroy take with requests in flight): in every trial,
// senders released at once send as fast as they can while the transport is
// aborted (odd trials: closed) under them, and every send must return,
// successful or not, within its own deadline plus a poll interval. A send
// could once queue its request after the peer's sender had drained the
// queue for the last time and wait for an answer that never came, past its
// deadline: the old code hung in about 3% of trials.
func TestZMQSendsRacingAbortOrCloseReturnByTheirDeadline(t *testing.T) {
	const senders, trials = 32, 1000
	const sendDeadline = 500 * time.Millisecond
	budget := time.Now().Add(5 * time.Second)
	hung, ran := 0, 0
	for trial := 0; trial < trials && time.Now().Before(budget); trial++ {
		ran++
		z := senderRig(t)
		var wg, ready sync.WaitGroup
		gate := make(chan struct{})
		for g := 0; g < senders; g++ {
			wg.Add(1)
			ready.Add(1)
			go func() {
				defer wg.Done()
				payload := make([]byte, 64)
				ready.Done()
				<-gate
				for i := 0; ; i++ {
					ctx, cancel := context.WithTimeout(context.Background(), sendDeadline)
					err := z.Send(ctx, 1, transport.Tag{Op: transport.OpAllgather, Seq: uint64(g + 1), Step: uint32(i)}, transport.DtypeBytes, 64, payload)
					cancel()
					if err != nil {
						return
					}
				}
			}()
		}
		ready.Wait()
		close(gate)
		runtime.Gosched()
		closed := make(chan struct{})
		if trial%2 == 0 {
			z.Abort(errors.New("test abort"))
			close(closed)
		} else {
			go func() { z.Close(); close(closed) }()
		}
		finished := make(chan struct{})
		go func() { wg.Wait(); close(finished) }()
		select {
		case <-finished:
		case <-time.After(sendDeadline + pollInterval):
			hung++
		}
		<-closed
		if trial%2 == 0 {
			z.Close()
		}
	}
	if hung > 0 {
		t.Fatalf("in %d of %d trials a send had not returned %v after the abort or close (its deadline: %v)",
			hung, ran, sendDeadline+pollInterval, sendDeadline)
	}
	t.Logf("%d trials, every send returned", ran)
}
