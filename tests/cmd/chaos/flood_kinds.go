package main

// The flooder's kinds of attack (listed in flood.go), each sending until
// the flood's time is up and counting what got through.

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/oktopk/oktopk/transport/zmq"
	"github.com/vmihailenco/msgpack/v5"
)

// randomBytes: four connections at a time, each writing up to 64 KiB of
// noise and closing.
func (f *flooder) randomBytes(t target) {
	var wg sync.WaitGroup
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f.eachConn(t.addr, func(_ int, c net.Conn) {
				n := 1 + int(randomBytes(2)[0])<<8
				c.SetWriteDeadline(time.Now().Add(time.Second))
				if w, err := c.Write(randomBytes(n)); err == nil {
					f.delivered.Add(1)
					f.bytes.Add(int64(w))
				}
			})
		}()
	}
	wg.Wait()
}

// emptyFrames: over ZeroMQ, messages of one, two and three empty parts (a
// rank's messages have three: routing id, header, payload); over raw
// ZMTP, bursts of empty frames; to the store, empty length-prefixed
// messages.
func (f *flooder) emptyFrames(t target) {
	if t.proto == "store" {
		f.eachConn(t.addr, func(_ int, c net.Conn) {
			c.SetWriteDeadline(time.Now().Add(time.Second))
			if _, err := c.Write(make([]byte, 4*64)); err == nil {
				f.delivered.Add(1)
			}
		})
		return
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		f.eachConn(t.addr, func(_ int, c net.Conn) {
			if err := zmtpOpen(c); err != nil {
				f.fail(err)
				return
			}
			var burst []byte
			for i := 0; i < 1000; i++ {
				burst = append(burst, zmtpFrameHeader(0)...)
			}
			c.SetWriteDeadline(time.Now().Add(time.Second))
			if _, err := c.Write(burst); err == nil {
				f.delivered.Add(1000)
			}
		})
	}()
	zctx, err := zmq.NewRawContext()
	if err != nil {
		f.fail(err)
		wg.Wait()
		return
	}
	defer zctx.Term()
	for f.live() {
		s := f.dealer(zctx, t.addr)
		if s == nil {
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
		f.eachConn(t.addr, func(i int, c net.Conn) {
			body, _ := msgpack.Marshal(storeRequest{Token: fmt.Sprintf("%x", randomBytes(32)), Op: ops[i%3],
				Key: fmt.Sprintf("oktopk/g0/ep/%d", i%f.size), Value: []byte("tcp://127.0.0.1:1"), Delta: 1, WaitMs: 10})
			msg := binary.LittleEndian.AppendUint32(nil, uint32(len(body)))
			c.SetDeadline(time.Now().Add(time.Second))
			if _, err := c.Write(append(msg, body...)); err == nil {
				f.delivered.Add(1)
				io.Copy(io.Discard, io.LimitReader(c, 1<<16)) // the refusal, then EOF
			}
		})
		return
	}
	zctx, err := zmq.NewRawContext()
	if err != nil {
		f.fail(err)
		return
	}
	defer zctx.Term()
	for round := 0; f.live(); round++ {
		s := f.dealer(zctx, t.addr)
		if s == nil {
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
