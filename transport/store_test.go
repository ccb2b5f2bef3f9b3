package transport

// Tests of the rendezvous store over TCP: set, get, add and wait, the token
// check, the bounds on what strangers on its port can make it hold, a taken
// port, and a Close that ends a get in progress.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"strings"
	"testing"
	"time"
)

// A store request whose bin header claims a 1 GiB value, 12 bytes in all:
// decoding it must not allocate what it claims (msgpack's []byte decoding
// allocates the claimed length up front), and the connection is dropped.
func TestStoreRequestClaimingAHugeValueAllocatesNothingOfIt(t *testing.T) {
	srv, err := ServeStore("127.0.0.1", 0, "job-token")
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	body := []byte{0x81, 0xa1, 'v', 0xc6, 0x40, 0, 0, 0} // {"v": bin32 of 2^30 bytes}
	msg := binary.LittleEndian.AppendUint32(nil, uint32(len(body)))
	msg = append(msg, body...)

	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for i := 0; i < 4; i++ {
		c, err := net.Dial("tcp", srv.Addr())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		var b [1]byte
		if _, err := c.Read(b[:]); err == nil {
			t.Errorf("connection %d: the server answered a malformed request instead of dropping it", i)
		}
		c.Close()
	}
	runtime.ReadMemStats(&after)
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 16<<20 {
		t.Fatalf("4 requests of %d bytes made the process allocate %d MiB", len(msg), grew>>20)
	}
	if srv.Refused() < 4 {
		t.Errorf("refused %d, want at least 4", srv.Refused())
	}
}

// Connections that have not shown the job token are capped: past
// maxUnauthenticatedConns idle ones, more are closed at once and counted;
// once the strangers go, the job's ranks are served as before.
func TestStoreCapsConnectionsThatHaveNotShownTheToken(t *testing.T) {
	srv, err := ServeStore("127.0.0.1", 0, "job-token")
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	const extra = 16
	var idle []net.Conn
	for i := 0; i < maxUnauthenticatedConns+extra; i++ {
		c, err := net.Dial("tcp", srv.Addr())
		if err != nil {
			t.Fatal(err)
		}
		idle = append(idle, c)
	}
	deadline := time.Now().Add(5 * time.Second)
	for srv.Refused() < extra && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := srv.Refused(); got != extra {
		t.Fatalf("refused %d connections of %d, want %d over the cap of %d", got, len(idle), extra, maxUnauthenticatedConns)
	}
	if got := srv.strangers.Load(); got != maxUnauthenticatedConns {
		t.Fatalf("%d unauthenticated connections held, want the cap %d", got, maxUnauthenticatedConns)
	}
	for _, c := range idle {
		c.Close()
	}
	for srv.strangers.Load() > 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := DialStore(ctx, srv.Addr(), "job-token")
	if err != nil {
		t.Fatal(err)
	}
	defer st.(*tcpStore).Close()
	if err := st.Set(ctx, "k", []byte("v")); err != nil {
		t.Fatal(err)
	}
	if v, err := st.Get(ctx, "k"); err != nil || string(v) != "v" {
		t.Fatalf("get after the strangers left: %q, %v", v, err)
	}
}

func TestStoreOverTCP(t *testing.T) {
	srv, err := ServeStore("127.0.0.1", 0, "tok")
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	a, err := DialStore(ctx, srv.Addr(), "tok")
	if err != nil {
		t.Fatal(err)
	}
	b, err := DialStore(ctx, srv.Addr(), "tok")
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan []byte)
	go func() {
		v, err := b.Get(ctx, "k")
		if err != nil {
			t.Error(err)
		}
		got <- v
	}()
	time.Sleep(50 * time.Millisecond)
	if err := a.Set(ctx, "k", []byte("v1")); err != nil {
		t.Fatal(err)
	}
	if v := <-got; string(v) != "v1" {
		t.Fatalf("Get after Set: %q", v)
	}
	for i := int64(1); i <= 3; i++ {
		n, err := a.Add(ctx, "n", 1)
		if err != nil || n != i {
			t.Fatalf("Add #%d = %d, %v", i, n, err)
		}
	}
	short, c2 := context.WithTimeout(ctx, 100*time.Millisecond)
	defer c2()
	if err := b.Wait(short, "absent"); !errors.Is(err, ErrRendezvous) {
		t.Fatalf("Wait for an absent key: %v", err)
	}
	bad, err := DialStore(ctx, srv.Addr(), "wrong")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bad.Get(ctx, "k"); !errors.Is(err, ErrAuth) {
		t.Fatalf("wrong store token: want ErrAuth, got %v", err)
	}
}

// A rendezvous port already taken fails at once with ErrRendezvous, and the
// message names the port and the way out.
func TestStoreOnATakenPortSaysWhich(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	port := taken.Addr().(*net.TCPAddr).Port
	srv, err := ServeStore("127.0.0.1", port, "tok")
	if err == nil {
		srv.Close()
		t.Fatalf("ServeStore on a port in use succeeded")
	}
	if !errors.Is(err, ErrRendezvous) || !strings.Contains(err.Error(), fmt.Sprintf("port %d is taken", port)) {
		t.Fatalf("want ErrRendezvous naming port %d, got %v", port, err)
	}
}

// A get waiting for a key that never comes holds its connection's goroutine
// on the server; Close ends that wait instead of waiting out the get's
// timeout (a minute here), and the client learns the store went away.
func TestStoreServerCloseEndsAGetInProgress(t *testing.T) {
	srv, err := ServeStore("127.0.0.1", 0, "job-token")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	client, err := DialStore(ctx, srv.Addr(), "job-token")
	if err != nil {
		t.Fatal(err)
	}
	defer client.(io.Closer).Close()
	got := make(chan error, 1)
	go func() {
		_, err := client.Get(ctx, "never-set")
		got <- err
	}()
	time.Sleep(200 * time.Millisecond) // the get is waiting on the server
	start := time.Now()
	srv.Close()
	if took := time.Since(start); took > time.Second {
		t.Errorf("Close took %v with a get in progress, want well under a second", took)
	}
	select {
	case err := <-got:
		if !errors.Is(err, ErrRendezvous) {
			t.Errorf("the waiting get returned %v, want ErrRendezvous", err)
		}
	case <-time.After(5 * time.Second):
		t.Error("the waiting get did not return after the server closed")
	}
}
