package zmq

// Tests of what a stranger without the job token can make a rank hold:
// floods of empty frames and huge frame headers keep its memory bounded,
// and Close stays prompt after a flood.

import (
	"bytes"
	"encoding/binary"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/oktopk/oktopk/transport"
)

// What a stranger — a process without the job token — may make a rank hold.
// The tests below attack a rank of this test process and measure the
// process's own resident memory (VmRSS), so each bound covers both ranks,
// the attacker's few buffers and the Go heap's noise: 24 MiB, against the
// hundreds of MiB the same attacks cost when the port a rank advertises
// took frames of up to 1 GiB from anyone that finished a NULL handshake.
const strangerRSSBound = 24 << 20

// vmRSS is this process's resident set size in bytes.
func vmRSS(t *testing.T) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == "VmRSS:" && f[2] == "kB" {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatal("no VmRSS in /proc/self/status")
	return 0
}

// zmtpGreeting is the 64-byte ZMTP 3.0 greeting of a client using mechanism.
func zmtpGreeting(mechanism string) []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10] = 0xff, 0x7f, 3
	copy(g[12:32], mechanism)
	return g
}

// nullReady is the READY command a NULL-mechanism DEALER sends after its
// greeting; with it the handshake of a NULL server is complete.
func nullReady() []byte {
	var body bytes.Buffer
	body.WriteString("\x05READY\x0bSocket-Type")
	binary.Write(&body, binary.BigEndian, uint32(6))
	body.WriteString("DEALER")
	return append([]byte{0x04, byte(body.Len())}, body.Bytes()...)
}

// longFrameHeader announces a ZMTP frame of size bytes (flags: 0x02 long,
// 0x04 command).
func longFrameHeader(flags byte, size uint64) []byte {
	b := make([]byte, 9)
	b[0] = flags | 0x02
	binary.BigEndian.PutUint64(b[1:], size)
	return b
}

// stranger opens a TCP connection to the port z advertises (its outbox),
// writes opening, then writes pattern repeatedly until limit bytes are
// sent, the rank closes the connection, or until passes. It returns the bytes written; the connection
// stays open until the test ends, so that whatever the rank holds for it is
// still held when the test measures.
func stranger(t *testing.T, z *Transport, opening []byte, pattern []byte, limit int, until time.Time) int {
	t.Helper()
	addr, _, err := splitEndpoint(z.Endpoint())
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp", strings.TrimPrefix(addr, "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetWriteDeadline(until)
	sent, _ := c.Write(opening)
	chunk := pattern
	if len(chunk) < 256<<10 {
		chunk = bytes.Repeat(pattern, (256<<10)/len(pattern))
	}
	for sent < limit {
		n, err := c.Write(chunk)
		sent += n
		if err != nil {
			break
		}
	}
	return sent
}

// refusedSoon waits up to two seconds for z to have refused at least want
// connections more than before, and returns how many it refused.
func refusedSoon(z *Transport, before, want uint64) uint64 {
	deadline := time.Now().Add(2 * time.Second)
	for z.Dropped()-before < want && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	return z.Dropped() - before
}

// A stranger completes a ZMTP 3.0 NULL greeting with a rank's port and then
// streams zero bytes (an empty frame every two bytes) or 0x01 0x00 pairs
// (empty frames that each announce one more part, a message that never
// ends: no ZeroMQ high-water mark bounds it). The rank's memory stays within
// strangerRSSBound, the connections are counted as refused, and the job
// still works.
func TestZMQStrangerFloodKeepsMemoryBounded(t *testing.T) {
	zs := startZMQ(t, 2, nil)
	victim := zs[1]
	before, base := victim.Dropped(), vmRSS(t)
	until := time.Now().Add(2 * time.Second)
	opening := append(zmtpGreeting("NULL"), nullReady()...)
	var wg sync.WaitGroup
	sent := make([]int, 2)
	for i, pattern := range [][]byte{{0x00, 0x00}, {0x01, 0x00}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sent[i] = stranger(t, victim, opening, pattern, 16<<20, until)
		}()
	}
	wg.Wait()
	time.Sleep(200 * time.Millisecond) // whatever was queued is decoded by now
	grew := vmRSS(t) - base
	t.Logf("sent %d and %d bytes of empty frames; RSS grew %.1f MiB", sent[0], sent[1], float64(grew)/(1<<20))
	if grew > strangerRSSBound {
		t.Fatalf("a stranger's flood of empty frames grew the rank's RSS by %.1f MiB, bound %d MiB",
			float64(grew)/(1<<20), strangerRSSBound>>20)
	}
	if got := refusedSoon(victim, before, 2); got < 2 {
		t.Fatalf("%d of the 2 flooding connections counted as refused", got)
	}
	recvReal(t, zs, 0, 1, transport.Tag{Op: transport.OpAllgather, Seq: 1, Step: 0})
}

// Six strangers announce 1 GiB frames and send 64 MiB each: three after a
// NULL handshake (a data frame), three with a PLAIN greeting (the handshake
// command itself). Every connection is refused at its frame's size, before
// authentication; the rank's memory stays within strangerRSSBound.
func TestZMQStrangersCannotMakeARankBufferLargeFrames(t *testing.T) {
	zs := startZMQ(t, 2, nil)
	victim := zs[1]
	before, base := victim.Dropped(), vmRSS(t)
	until := time.Now().Add(3 * time.Second)
	openings := [][]byte{
		append(append(zmtpGreeting("NULL"), nullReady()...), longFrameHeader(0, 1<<30)...),
		append(zmtpGreeting("PLAIN"), longFrameHeader(0x04, 1<<30)...),
	}
	var wg sync.WaitGroup
	sent := make([]int, 6)
	for i := range sent {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sent[i] = stranger(t, victim, openings[i%2], make([]byte, 1<<20), 64<<20, until)
		}()
	}
	wg.Wait()
	time.Sleep(200 * time.Millisecond)
	grew := vmRSS(t) - base
	t.Logf("sent %v bytes behind 1 GiB frame headers; RSS grew %.1f MiB", sent, float64(grew)/(1<<20))
	if grew > strangerRSSBound {
		t.Fatalf("strangers' 1 GiB frames grew the rank's RSS by %.1f MiB, bound %d MiB",
			float64(grew)/(1<<20), strangerRSSBound>>20)
	}
	if got := refusedSoon(victim, before, 6); got < 6 {
		t.Fatalf("%d of the 6 connections counted as refused", got)
	}
	recvReal(t, zs, 0, 1, transport.Tag{Op: transport.OpAllgather, Seq: 1, Step: 0})
}

// closeSlack is what a loaded machine (tests share two cores) may add to
// CloseBound.
const closeSlack = 250 * time.Millisecond

// After a stranger's flood, Close still returns within CloseBound (plus
// closeSlack). Before, the flood's queued frames made it take 0.9 s.
func TestZMQCloseAfterAFloodIsPrompt(t *testing.T) {
	zs := startZMQ(t, 2, nil)
	victim := zs[1]
	until := time.Now().Add(2 * time.Second)
	opening := append(zmtpGreeting("NULL"), nullReady()...)
	var wg sync.WaitGroup
	for _, pattern := range [][]byte{{0x00, 0x00}, {0x01, 0x00}, {0x00, 0x00}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			stranger(t, victim, opening, pattern, 32<<20, until)
		}()
	}
	wg.Wait()
	start := time.Now()
	victim.Close()
	if took := time.Since(start); took > CloseBound+closeSlack {
		t.Fatalf("Close after a flood took %v, bound %v", took, CloseBound+closeSlack)
	} else {
		t.Logf("Close after a flood took %v (bound %v)", took, CloseBound+closeSlack)
	}
}
