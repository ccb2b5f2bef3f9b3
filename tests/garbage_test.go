package tests

// Tests that a stranger sending garbage to a rank's port, raw or over
// ZMTP, leaves every allreduce of a ZeroMQ job exact and no call failing.

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
	"github.com/oktopk/oktopk/transport/zmq"
)

// strangerHeader is a 96-byte oktopk v2 header as a process without the
// job's token would forge it: every field plausible, the token digest random.
func strangerHeader(seq uint64, count, payloadLen uint64) []byte {
	b := make([]byte, 96)
	binary.LittleEndian.PutUint32(b[0:], 0x4b544b4f) // "OKTK"
	binary.LittleEndian.PutUint16(b[4:], 2)
	b[6] = 1 // data
	rand.Read(b[8:24])
	binary.LittleEndian.PutUint32(b[28:], 0) // claims to be rank 0
	binary.LittleEndian.PutUint64(b[32:], seq)
	b[44] = byte(core.DenseRing.Op())
	b[45] = byte(transport.DtypeFloat32)
	binary.LittleEndian.PutUint64(b[48:], count)
	binary.LittleEndian.PutUint64(b[56:], payloadLen)
	binary.LittleEndian.PutUint64(b[72:], 20000)
	binary.LittleEndian.PutUint64(b[80:], 20000)
	b[88] = byte(transport.DtypeFloat32)
	return b
}

// attack is one kind of garbage a stranger sends to addr ("host:port").
type attack struct {
	name string
	send func(zctx *zmq.RawContext, addr string, seq uint64) error
}

func rawTCP(payload func() []byte) func(*zmq.RawContext, string, uint64) error {
	return func(_ *zmq.RawContext, addr string, _ uint64) error {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetWriteDeadline(time.Now().Add(time.Second))
		_, err = c.Write(payload())
		return err
	}
}

// viaDealer opens a real ZMTP DEALER session to the rank's port (NULL
// mechanism, no job password: the rank refuses it at the handshake) and
// sends each message (a list of parts).
func viaDealer(msgs func(seq uint64) [][][]byte) func(*zmq.RawContext, string, uint64) error {
	return func(zctx *zmq.RawContext, addr string, seq uint64) error {
		s, err := zctx.NewSocket(zmq.Dealer)
		if err != nil {
			return err
		}
		defer s.Close()
		s.SetLinger(100 * time.Millisecond)
		s.SetSndtimeo(time.Second)
		if err := s.Connect("tcp://" + addr); err != nil {
			return err
		}
		for _, parts := range msgs(seq) {
			if _, err := s.SendMessage(parts); err != nil {
				return err
			}
		}
		return nil
	}
}

func randomBytes(n int) []byte {
	b := make([]byte, n)
	rand.Read(b)
	return b
}

// The largest message payload a rank accepts from a peer in this test
// (MaxMessageBytes); the port a rank advertises, its outbox, takes frames
// of at most 4 KiB from anyone.
const garbageMaxMessage = 1 << 20

var attacks = []attack{
	{"random bytes", rawTCP(func() []byte { return randomBytes(4096) })},
	{"HTTP request", rawTCP(func() []byte { return []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n") })},
	{"ZMTP greeting cut short", rawTCP(func() []byte { return []byte{0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f} })},
	{"truncated frame", viaDealer(func(seq uint64) [][][]byte {
		h := strangerHeader(seq, 4, 16)
		return [][][]byte{{h[:40], randomBytes(16)}, {h[:95]}}
	})},
	{"wrong token", viaDealer(func(seq uint64) [][][]byte {
		return [][][]byte{{strangerHeader(seq, 4, 16), randomBytes(16)}}
	})},
	{"oversized count", viaDealer(func(seq uint64) [][][]byte {
		return [][][]byte{{strangerHeader(seq, 1<<60, 16), randomBytes(16)}, {strangerHeader(seq, 1<<40, 1<<42), nil}}
	})},
	{"wrong part count", viaDealer(func(seq uint64) [][][]byte {
		h := strangerHeader(seq, 0, 0)
		return [][][]byte{{h}, {h, nil, nil, nil}}
	})},
	{"part above MaxMessageBytes", viaDealer(func(seq uint64) [][][]byte {
		return [][][]byte{{strangerHeader(seq, 0, 0), make([]byte, 2*garbageMaxMessage)}}
	})},
}

// Garbage on the port: while 3 ranks over ZeroMQ run dense and density-1
// Ok-Topk allreduces, each checked bitwise against the exact sum, a stranger
// keeps connecting to the port rank 1 advertises and sending every kind of
// garbage in attacks. Every result stays exact, no call fails, and rank 1
// counts what it refused. A stranger has no job password, so ZeroMQ's
// handshake refuses its connection before any of its frames is decoded (a
// frame over the port's 4 KiB frame limit, even a handshake frame, closes
// the connection as soon as its size is read); the memory bounds
// themselves are tested in transport/zmq/flood_test.go.
func TestGarbageOnThePortDuringAllreducesLeavesResultsExact(t *testing.T) {
	const p, n, iters = 3, 20000, 60
	comms := zmqCommsWith(t, p, func(_ int, o *zmq.Options) {
		o.MaxMessageBytes = garbageMaxMessage
		o.Diagnostics.StallWarn = -1
	})
	victim := comms[1].T.(*zmq.Transport)
	addr := strings.TrimPrefix(victim.Endpoint(), "tcp://")
	if i := strings.Index(addr, "#"); i >= 0 {
		addr = addr[:i]
	}

	zctx, err := zmq.NewRawContext()
	if err != nil {
		t.Fatal(err)
	}
	var seq atomic.Uint64
	stop := make(chan struct{})
	sent := make([]atomic.Int64, len(attacks))
	var attacker sync.WaitGroup
	attacker.Add(1)
	go func() {
		defer attacker.Done()
		for round := 0; ; round++ {
			for i, a := range attacks {
				select {
				case <-stop:
					return
				default:
				}
				if err := a.send(zctx, addr, seq.Load()+1); err == nil {
					sent[i].Add(1)
				}
			}
		}
	}()

	errs, _ := eachRank(p, func(r int) error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		x := make([]float32, n)
		for it := 0; it < iters; it++ {
			if r == 0 {
				seq.Store(uint64(it))
			}
			for i := range x {
				x[i] = float32((r*7+i*3+it*5)%17 - 8)
			}
			var err error
			if it%2 == 0 {
				_, err = comms[r].Allreduce(ctx, x, false, core.DenseRing)
			} else {
				cfg := core.DefaultConfig()
				cfg.Density = 1
				_, err = comms[r].SparseAllreduce(ctx, 1, x, cfg)
			}
			if err != nil {
				return fmt.Errorf("iteration %d: %w", it, err)
			}
			for i, got := range x {
				var want float32
				for q := 0; q < p; q++ {
					want += float32((q*7+i*3+it*5)%17 - 8)
				}
				if it%2 == 1 {
					want /= p
				}
				if got != want {
					return fmt.Errorf("iteration %d: element %d is %v, want %v", it, i, got, want)
				}
			}
		}
		return nil
	})
	close(stop)
	attacker.Wait()
	zctx.Term()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	var summary []string
	for i, a := range attacks {
		if sent[i].Load() == 0 {
			t.Errorf("attack %q was never delivered", a.name)
		}
		summary = append(summary, fmt.Sprintf("%s ×%d", a.name, sent[i].Load()))
	}
	refused := victim.Refusals()
	if refused.Connections == 0 {
		t.Error("the attacked rank refused no connections")
	}
	t.Logf("%d iterations exact under attack (%s); rank 1 refused %d connections and %d frames",
		iters, strings.Join(summary, ", "), refused.Connections, refused.Frames)
}
