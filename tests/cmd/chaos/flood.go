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

	"github.com/vmihailenco/msgpack/v5"

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

func randomBytes(n int) []byte {
	b := make([]byte, n)
	rand.Read(b)
	return b
}

// randomBytes: four connections at a time, each writing up to 64 KiB of
// noise and closing.
func (f *flooder) randomBytes(t target) {
	var wg sync.WaitGroup
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for f.live() {
				c, err := f.dial(t.addr)
				if err != nil {
					time.Sleep(10 * time.Millisecond)
					continue
				}
				n := 1 + int(randomBytes(2)[0])<<8
				c.SetWriteDeadline(time.Now().Add(time.Second))
				if w, err := c.Write(randomBytes(n)); err == nil {
					f.delivered.Add(1)
					f.bytes.Add(int64(w))
				}
				c.Close()
			}
		}()
	}
	wg.Wait()
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

// emptyFrames: over ZeroMQ, messages of one, two and three empty parts (a
// rank's messages have three: routing id, header, payload); over raw
// ZMTP, bursts of empty frames; to the store, empty length-prefixed
// messages.
func (f *flooder) emptyFrames(t target) {
	if t.proto == "store" {
		for f.live() {
			c, err := f.dial(t.addr)
			if err != nil {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			c.SetWriteDeadline(time.Now().Add(time.Second))
			if _, err := c.Write(make([]byte, 4*64)); err == nil {
				f.delivered.Add(1)
			}
			c.Close()
		}
		return
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for f.live() {
			c, err := f.dial(t.addr)
			if err != nil {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			if err := zmtpOpen(c); err != nil {
				f.fail(err)
				c.Close()
				continue
			}
			var burst []byte
			for i := 0; i < 1000; i++ {
				burst = append(burst, zmtpFrameHeader(0)...)
			}
			c.SetWriteDeadline(time.Now().Add(time.Second))
			if _, err := c.Write(burst); err == nil {
				f.delivered.Add(1000)
			}
			c.Close()
		}
	}()
	zctx, err := zmq.NewRawContext()
	if err != nil {
		f.fail(err)
		wg.Wait()
		return
	}
	defer zctx.Term()
	for f.live() {
		s, err := zctx.NewSocket(zmq.Dealer)
		if err != nil {
			f.fail(err)
			break
		}
		s.SetLinger(100 * time.Millisecond)
		s.SetSndtimeo(100 * time.Millisecond)
		if err := s.Connect("tcp://" + t.addr); err != nil {
			f.fail(err)
			s.Close()
			break
		}
		for i := 0; i < 300 && f.live(); i++ {
			parts := make([]any, 1+i%3)
			for j := range parts {
				parts[j] = []byte{}
			}
			if _, err := s.SendMessage(parts...); err == nil {
				f.delivered.Add(1)
			}
		}
		s.Close()
	}
	wg.Wait()
}

// hugeAnnounce: each of f.conns connections announces a message far above
// any limit (ZeroMQ must refuse it from the header alone), or, on every
// other connection, one just below a rank's default limit (1 GiB), of which
// it sends f.body bytes and then nothing: the rank holds whatever it
// buffers for such a message until the connection ends. The store gets
// eight times as many connections: length prefixes above its limit, at it
// (1 MiB, with all but one byte of the body), and a few short messages
// whose msgpack value announces 64 MiB.
func (f *flooder) hugeAnnounce(t target) {
	var wg sync.WaitGroup
	var mu sync.Mutex
	var open []net.Conn
	chunk := randomBytes(64 << 10)
	conns := f.conns
	if t.proto == "store" {
		conns *= 8 // the store's limit is 1 MiB a message
	}
	for i := 0; i < conns && f.live(); i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := f.dial(t.addr)
			if err != nil {
				return
			}
			c.SetWriteDeadline(f.until)
			var head []byte
			var body int64
			if t.proto == "store" {
				switch i % 4 {
				case 0:
					head = binary.LittleEndian.AppendUint32(nil, 0xffffffff)
				case 1:
					// A short message whose value claims 64 MiB of bytes:
					// what the server allocates for it before the token
					// check. (Modest: a server that does allocate it grows by
					// gigabytes over a flood; the harness caps a rank's RSS.)
					if i%32 == 1 {
						head = storeClaim(64 << 20)
					} else {
						head = binary.LittleEndian.AppendUint32(nil, 0xffffffff)
					}
				default:
					head, body = binary.LittleEndian.AppendUint32(nil, 1<<20), 1<<20-1
				}
			} else {
				if err := zmtpOpen(c); err != nil {
					if refusedAtGreeting(err) {
						// The rank read the greeting and closed the
						// connection (a stranger's mechanism, no password):
						// the flood reached it and was refused before any
						// frame, which is what a rank should do.
						f.delivered.Add(1)
					} else {
						f.fail(err)
					}
					c.Close()
					return
				}
				head = zmtpFrameHeader(1 << 62)
				if i%2 == 1 {
					head, body = zmtpFrameHeader(1<<30-1), f.body
				}
			}
			if _, err := c.Write(head); err != nil {
				f.fail(err)
				c.Close()
				return
			}
			f.delivered.Add(1)
			for sent := int64(0); sent < body && f.live(); {
				n := min(int64(len(chunk)), body-sent)
				w, err := c.Write(chunk[:n])
				sent += int64(w)
				f.bytes.Add(int64(w))
				if err != nil {
					break
				}
			}
			mu.Lock()
			open = append(open, c)
			f.held.Store(int64(len(open)))
			mu.Unlock()
		}()
	}
	wg.Wait()
	time.Sleep(time.Until(f.until))
	for _, c := range open {
		c.Close()
	}
}

// storeClaim is a length-prefixed store message, a msgpack map whose value
// field announces n bytes (bin 32) that never follow.
func storeClaim(n uint32) []byte {
	body := []byte{0x81, 0xa1, 'v', 0xc6}
	body = binary.BigEndian.AppendUint32(body, n)
	return append(binary.LittleEndian.AppendUint32(nil, uint32(len(body))), body...)
}

// idleConns: f.conns connections that say nothing, held until the end.
func (f *flooder) idleConns(t target) {
	var open []net.Conn
	for i := 0; i < f.conns && f.live(); i++ {
		c, err := f.dial(t.addr)
		if err != nil {
			continue
		}
		open = append(open, c)
		f.delivered.Add(1)
	}
	f.held.Add(int64(len(open)))
	time.Sleep(time.Until(f.until))
	for _, c := range open {
		c.Close()
	}
}

// strangerFrame is an oktopk frame header (transport/frame.go's layout) as
// a process without the job's token would forge it: every field plausible,
// the token digest random.
func strangerFrame(kind byte, sender uint32, seq, count uint64) []byte {
	b := make([]byte, 96)
	binary.LittleEndian.PutUint32(b[0:], 0x4b544b4f) // "OKTK"
	binary.LittleEndian.PutUint16(b[4:], 2)
	b[6] = kind
	rand.Read(b[8:24])
	binary.LittleEndian.PutUint32(b[28:], sender)
	binary.LittleEndian.PutUint64(b[32:], seq)
	b[44] = 4 // oktopk
	b[45] = 1 // float32
	binary.LittleEndian.PutUint64(b[48:], count)
	binary.LittleEndian.PutUint64(b[56:], 4*count)
	return b
}

// storeRequest has the store's wire fields (transport/store_wire.go).
type storeRequest struct {
	Token  string `msgpack:"t"`
	Op     string `msgpack:"o"`
	Key    string `msgpack:"k"`
	Value  []byte `msgpack:"v"`
	Delta  int64  `msgpack:"d"`
	WaitMs int64  `msgpack:"w"`
}

// wrongToken: hello, heartbeat and data frames claiming each rank, with a
// token digest of their own; store requests (set, get, add) with a wrong
// token, each on a fresh connection since the store drops it after refusing.
func (f *flooder) wrongToken(t target) {
	if t.proto == "store" {
		ops := []string{"set", "get", "add"}
		for i := 0; f.live(); i++ {
			c, err := f.dial(t.addr)
			if err != nil {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			body, _ := msgpack.Marshal(storeRequest{Token: fmt.Sprintf("%x", randomBytes(32)), Op: ops[i%3],
				Key: fmt.Sprintf("oktopk/g0/ep/%d", i%f.size), Value: []byte("tcp://127.0.0.1:1"), Delta: 1, WaitMs: 10})
			msg := binary.LittleEndian.AppendUint32(nil, uint32(len(body)))
			c.SetDeadline(time.Now().Add(time.Second))
			if _, err := c.Write(append(msg, body...)); err == nil {
				f.delivered.Add(1)
				io.Copy(io.Discard, io.LimitReader(c, 1<<16)) // the refusal, then EOF
			}
			c.Close()
		}
		return
	}
	zctx, err := zmq.NewRawContext()
	if err != nil {
		f.fail(err)
		return
	}
	defer zctx.Term()
	for round := 0; f.live(); round++ {
		s, err := zctx.NewSocket(zmq.Dealer)
		if err != nil {
			f.fail(err)
			return
		}
		s.SetLinger(100 * time.Millisecond)
		s.SetSndtimeo(100 * time.Millisecond)
		if err := s.Connect("tcp://" + t.addr); err != nil {
			f.fail(err)
			s.Close()
			return
		}
		sender := uint32(round % f.size)
		payload := randomBytes(4 * 64)
		for i := 0; i < 200 && f.live(); i++ {
			var parts []any
			switch i % 3 {
			case 0:
				parts = []any{strangerFrame(2, sender, 0, 0), []byte{}} // hello
			case 1:
				parts = []any{strangerFrame(3, sender, uint64(i), 0), []byte{}} // heartbeat
			default:
				parts = []any{strangerFrame(1, sender, uint64(1+i/3), 64), payload} // data
			}
			if _, err := s.SendMessage(parts...); err == nil {
				f.delivered.Add(1)
			} else if !errors.Is(err, zmq.ErrAgain) {
				f.fail(err)
			}
		}
		s.Close()
	}
}
