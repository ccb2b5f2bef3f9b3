package main

// The flooder: a stranger without the job's token that attacks a rank's
// ports for a while. The harness runs it as its own process (inside an
// attacker network namespace when the job runs in namespaces), so its
// sockets and memory are never confused with a rank's. Targets are
// "zmq=host:port" (a rank's ZeroMQ inbox) and "store=host:port" (rank 0's
// rendezvous server). Kinds:
//
//	random-bytes   connect, write random bytes, close, again
//	empty-frames   ZeroMQ messages of empty parts; empty store messages
//	huge-announce  frames announcing sizes above the limit (refused at once)
//	               and just below it, followed by part of the body and held
//	               open: whatever a rank buffers for them shows in its RSS
//	idle-conns     many connections that send nothing, held open
//	wrong-token    well-formed hello and data frames and store requests
//	               carrying another token
//
// It prints one JSON line: what it managed to deliver.

import (
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/oktopk/oktopk/transport/zmq"
)

// FloodReport is the flooder's output line.
type FloodReport struct {
	Kind      string `json:"kind"`
	Delivered int64  `json:"delivered"` // connections or messages that got through to the port
	Bytes     int64  `json:"bytes"`
	Held      int64  `json:"held"` // connections held open at the peak
	Errors    int64  `json:"errors"`
	FirstErr  string `json:"first_err,omitempty"`
}

type target struct{ proto, addr string }

type flooder struct {
	kind    string
	targets []target
	until   time.Time
	size    int   // world size, for plausible rank numbers
	conns   int   // connections per target (idle-conns, huge-announce)
	body    int64 // bytes of body sent per huge announcement

	delivered, bytes, held, errs atomic.Int64
	firstErr                     atomic.Value
}

func (f *flooder) fail(err error) {
	f.errs.Add(1)
	f.firstErr.CompareAndSwap(nil, err.Error())
}

func floodMain(args []string) int {
	fs := flag.NewFlagSet("flood", flag.ContinueOnError)
	kind := fs.String("kind", "random-bytes", "what to send")
	targets := fs.String("targets", "", "comma-separated zmq=host:port and store=host:port")
	dur := fs.Duration("dur", time.Second, "how long")
	size := fs.Int("size", 4, "world size of the job attacked")
	conns := fs.Int("conns", 16, "connections per target held by idle-conns and huge-announce")
	body := fs.Int64("body", 8<<20, "bytes of body after each huge announcement below the limit")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	f := &flooder{kind: *kind, until: time.Now().Add(*dur), size: *size, conns: *conns, body: *body}
	for _, t := range strings.Split(*targets, ",") {
		proto, addr, ok := strings.Cut(t, "=")
		if !ok || (proto != "zmq" && proto != "store") {
			fmt.Fprintf(os.Stderr, "chaos flood: bad target %q\n", t)
			return 2
		}
		f.targets = append(f.targets, target{proto, addr})
	}
	var attack func(target)
	switch f.kind {
	case "random-bytes":
		attack = f.randomBytes
	case "empty-frames":
		attack = f.emptyFrames
	case "huge-announce":
		attack = f.hugeAnnounce
	case "idle-conns":
		attack = f.idleConns
	case "wrong-token":
		attack = f.wrongToken
	default:
		fmt.Fprintf(os.Stderr, "chaos flood: unknown kind %q\n", f.kind)
		return 2
	}
	var wg sync.WaitGroup
	for _, t := range f.targets {
		wg.Add(1)
		go func() {
			defer wg.Done()
			attack(t)
		}()
	}
	wg.Wait()
	rep := FloodReport{Kind: f.kind, Delivered: f.delivered.Load(), Bytes: f.bytes.Load(), Held: f.held.Load(), Errors: f.errs.Load()}
	if s, ok := f.firstErr.Load().(string); ok {
		rep.FirstErr = s
	}
	json.NewEncoder(os.Stdout).Encode(rep)
	return 0
}

func (f *flooder) live() bool { return time.Now().Before(f.until) }

func (f *flooder) dial(addr string) (net.Conn, error) {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		f.fail(err)
		return nil, err
	}
	return c, nil
}

// eachConn dials addr again and again until the flood ends, pausing 10 ms
// after a failed dial, and hands each connection (with the attempt's number)
// to use, closing it after.
func (f *flooder) eachConn(addr string, use func(i int, c net.Conn)) {
	for i := 0; f.live(); i++ {
		c, err := f.dial(addr)
		if err != nil {
			time.Sleep(10 * time.Millisecond)
			continue
		}
		use(i, c)
		c.Close()
	}
}

// dealer is a DEALER socket of zctx connected to addr, with short linger
// and send timeouts so that a flood never blocks on a peer that stops
// reading; on a failure it records it in f and returns nil.
func (f *flooder) dealer(zctx *zmq.RawContext, addr string) *zmq.RawSocket {
	s, err := zctx.NewSocket(zmq.Dealer)
	if err != nil {
		f.fail(err)
		return nil
	}
	s.SetLinger(100 * time.Millisecond)
	s.SetSndtimeo(100 * time.Millisecond)
	if err := s.Connect("tcp://" + addr); err != nil {
		f.fail(err)
		s.Close()
		return nil
	}
	return s
}

func randomBytes(n int) []byte {
	b := make([]byte, n)
	rand.Read(b)
	return b
}

// zmtpGreeting is a ZMTP 3.0 client greeting with the NULL mechanism.
func zmtpGreeting() []byte {
	g := make([]byte, 64)
	// The signature is also a ZMTP 1.0 frame header (length 1, then the
	// flags byte 0x7f), which is how libzmq reads it.
	g[0], g[8], g[9] = 0xff, 1, 0x7f
	g[10], g[11] = 3, 0
	copy(g[12:], "NULL")
	return g
}

// zmtpReady is the READY command of a DEALER.
func zmtpReady() []byte {
	body := []byte{5}
	body = append(body, "READY"...)
	body = append(body, 11)
	body = append(body, "Socket-Type"...)
	body = binary.BigEndian.AppendUint32(body, 6)
	body = append(body, "DEALER"...)
	return append([]byte{0x04, byte(len(body))}, body...) // command, short size
}

// zmtpOpen speaks as a ZeroMQ DEALER on a raw connection: its greeting, the
// peer's greeting read back, then its READY. libzmq takes in what follows
// the greeting only once the greeting exchange is over (bytes sent with the
// greeting in one segment sit unread), so after zmtpOpen a ROUTER accepts
// the frames written next.
func zmtpOpen(c net.Conn) error {
	c.SetDeadline(time.Now().Add(time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := c.Write(zmtpGreeting()); err != nil {
		return err
	}
	if _, err := io.ReadFull(c, make([]byte, 64)); err != nil {
		return fmt.Errorf("ZMTP greeting: %w", err)
	}
	_, err := c.Write(zmtpReady())
	return err
}

// refusedAtGreeting reports whether zmtpOpen failed because the peer closed
// the connection during the greeting.
func refusedAtGreeting(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET)
}

// zmtpFrameHeader announces a final (no MORE) message frame of size bytes.
func zmtpFrameHeader(size uint64) []byte {
	if size < 256 {
		return []byte{0x00, byte(size)}
	}
	return binary.BigEndian.AppendUint64([]byte{0x02}, size)
}
