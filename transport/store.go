package transport

// Rendezvous goes through a Store, a small key-value service in the style of
// gloo's and torch.distributed's: ranks publish their endpoints under keys
// and wait for everyone else's. A framework that has its own store (the
// TCPStore torchrun made, Horovod's collectives) exchanges endpoints itself
// and hands the list to Connect; otherwise rank 0 serves a StoreServer.

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/vmihailenco/msgpack/v5"
)

// Store is a rendezvous key-value store shared by the ranks of one job.
type Store interface {
	Set(ctx context.Context, key string, value []byte) error
	// Get waits until key exists (or ctx ends) and returns its value.
	Get(ctx context.Context, key string) ([]byte, error)
	Wait(ctx context.Context, keys ...string) error
	// Add adds delta to the integer stored at key (0 if absent) and returns
	// the new value.
	Add(ctx context.Context, key string, delta int64) (int64, error)
}

// memStore is a Store in memory: the server's table, and a Store for tests.
type memStore struct {
	mu      sync.Mutex
	data    map[string][]byte
	changed chan struct{} // closed and replaced on every write
}

// NewMemStore returns an in-process Store.
func NewMemStore() Store { return newMemStore() }

func newMemStore() *memStore {
	return &memStore{data: make(map[string][]byte), changed: make(chan struct{})}
}

func (m *memStore) Set(_ context.Context, key string, value []byte) error {
	m.mu.Lock()
	m.data[key] = append([]byte(nil), value...)
	close(m.changed)
	m.changed = make(chan struct{})
	m.mu.Unlock()
	return nil
}

func (m *memStore) Get(ctx context.Context, key string) ([]byte, error) {
	for {
		m.mu.Lock()
		v, ok := m.data[key]
		ch := m.changed
		m.mu.Unlock()
		if ok {
			return append([]byte(nil), v...), nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return nil, fmt.Errorf("%w: %w", ErrRendezvous, ContextError(ctx, "waiting for store key "+key))
		}
	}
}

func (m *memStore) Wait(ctx context.Context, keys ...string) error {
	for _, k := range keys {
		if _, err := m.Get(ctx, k); err != nil {
			return err
		}
	}
	return nil
}

func (m *memStore) Add(_ context.Context, key string, delta int64) (int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	var cur int64
	if v, ok := m.data[key]; ok {
		n, err := strconv.ParseInt(string(v), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("%w: store key %q is not an integer", ErrRendezvous, key)
		}
		cur = n
	}
	cur += delta
	m.data[key] = []byte(strconv.FormatInt(cur, 10))
	close(m.changed)
	m.changed = make(chan struct{})
	return cur, nil
}

// The wire protocol of StoreServer: each request and reply is a 4-byte
// little-endian length and a msgpack body, at most maxStoreMessage bytes.
// Values are endpoints and counters, well under a kilobyte each.
const maxStoreMessage = 64 << 10

// What a stranger can make the store server hold: connections that have not
// yet shown the job token are at most maxUnauthenticatedConns, each must send
// its first request within firstRequestTimeout, and a request's buffer grows
// only with the bytes that arrived. So strangers hold at most
// maxUnauthenticatedConns × maxStoreMessage = 4 MiB of buffers at once.
const (
	maxUnauthenticatedConns = 64
	firstRequestTimeout     = 10 * time.Second
)

// storeValue is a store value, sent as msgpack bin. It decodes with the
// claimed length checked against maxStoreMessage first: msgpack's own
// []byte decoding allocates whatever length a bin header claims, so 13
// bytes from anyone could make the server allocate 4 GiB.
type storeValue []byte

func (v *storeValue) DecodeMsgpack(d *msgpack.Decoder) error {
	n, err := d.DecodeBytesLen()
	if err != nil {
		return err
	}
	if n < 0 { // nil
		*v = nil
		return nil
	}
	if n > maxStoreMessage {
		return fmt.Errorf("%w: store value of %d bytes", ErrBadFrame, n)
	}
	b := make([]byte, n)
	if err := d.ReadFull(b); err != nil {
		return err
	}
	*v = b
	return nil
}

type storeRequest struct {
	Token  string     `msgpack:"t"`
	Op     string     `msgpack:"o"` // set, get, add
	Key    string     `msgpack:"k"`
	Value  storeValue `msgpack:"v"`
	Delta  int64      `msgpack:"d"`
	WaitMs int64      `msgpack:"w"` // get: how long the server may wait for the key
}

type storeReply struct {
	Err   string     `msgpack:"e"`
	Value storeValue `msgpack:"v"`
	Num   int64      `msgpack:"n"`
}

// StoreServer serves a memStore over TCP to the ranks of one job; requests
// must carry the job token.
type StoreServer struct {
	ln    net.Listener
	token string
	data  *memStore
	wg    sync.WaitGroup
	mu    sync.Mutex
	conns map[net.Conn]struct{}
	// strangers counts connections that have not shown the job token yet.
	strangers atomic.Int32
	refused   atomic.Uint64 // connections and requests dropped unauthenticated
}

// ServeStore listens on host:port (port 0: any free port).
func ServeStore(host string, port int, token string) (*StoreServer, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
	if err != nil {
		hint := ""
		if errors.Is(err, syscall.EADDRINUSE) && port != 0 {
			// The usual cause besides a second job on the same port: a port
			// inside the kernel's ephemeral range (ip_local_port_range), which
			// outgoing connections on this host take as their source port.
			hint = fmt.Sprintf(" (port %d is taken; choose MASTER_PORT or OKTOPK_RENDEZVOUS_PORT below the ephemeral range, as torchrun's default 29500 is)", port)
		}
		return nil, fmt.Errorf("%w: store listen: %w%s", ErrRendezvous, err, hint)
	}
	s := &StoreServer{ln: ln, token: token, data: newMemStore(), conns: make(map[net.Conn]struct{})}
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

// Addr is "host:port" for DialStore.
func (s *StoreServer) Addr() string { return s.ln.Addr().String() }

// Close stops serving and drops every connection.
func (s *StoreServer) Close() error {
	err := s.ln.Close()
	s.mu.Lock()
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return err
}

func (s *StoreServer) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		if s.strangers.Add(1) > maxUnauthenticatedConns {
			s.strangers.Add(-1)
			s.refused.Add(1)
			c.Close()
			continue
		}
		s.mu.Lock()
		s.conns[c] = struct{}{}
		s.mu.Unlock()
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer func() {
				// A bug in decoding a stranger's request must not take the
				// host process down: that connection is dropped instead.
				_ = recover()
				s.mu.Lock()
				delete(s.conns, c)
				s.mu.Unlock()
				c.Close()
			}()
			s.serve(c)
		}()
	}
}

// Refused is how many connections and requests the server dropped before
// they showed the job token (over the cap, too slow, garbage, wrong token).
func (s *StoreServer) Refused() uint64 { return s.refused.Load() }

func (s *StoreServer) serve(c net.Conn) {
	authenticated := false
	defer func() {
		if !authenticated {
			s.strangers.Add(-1)
		}
	}()
	c.SetReadDeadline(time.Now().Add(firstRequestTimeout))
	for {
		var req storeRequest
		if err := readStoreMessage(c, &req); err != nil {
			if !authenticated {
				s.refused.Add(1)
			}
			return // garbage or a closed connection: drop it
		}
		if subtle.ConstantTimeCompare([]byte(req.Token), []byte(s.token)) != 1 {
			s.refused.Add(1)
			writeStoreMessage(c, storeReply{Err: "wrong job token"})
			return
		}
		if !authenticated {
			authenticated = true
			s.strangers.Add(-1)
			c.SetReadDeadline(time.Time{})
		}
		var rep storeReply
		switch req.Op {
		case "set":
			s.data.Set(context.Background(), req.Key, req.Value)
		case "get":
			ctx, cancel := context.WithTimeout(context.Background(), time.Duration(req.WaitMs)*time.Millisecond)
			v, err := s.data.Get(ctx, req.Key)
			cancel()
			if err != nil {
				rep.Err = "timeout waiting for key " + req.Key
			}
			rep.Value = v
		case "add":
			n, err := s.data.Add(context.Background(), req.Key, req.Delta)
			if err != nil {
				rep.Err = err.Error()
			}
			rep.Num = n
		default:
			rep.Err = "unknown store op " + strconv.Quote(req.Op)
		}
		if err := writeStoreMessage(c, rep); err != nil {
			return
		}
	}
}

func readStoreMessage(r io.Reader, v any) error {
	var lenBuf [4]byte
	if _, err := io.ReadFull(r, lenBuf[:]); err != nil {
		return err
	}
	n := binary.LittleEndian.Uint32(lenBuf[:])
	if n > maxStoreMessage {
		return fmt.Errorf("%w: store message of %d bytes", ErrBadFrame, n)
	}
	// The buffer grows with the bytes that arrive, not with the length a
	// sender claims.
	var body bytes.Buffer
	if _, err := io.CopyN(&body, r, int64(n)); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return err
	}
	return msgpack.Unmarshal(body.Bytes(), v)
}

func writeStoreMessage(w io.Writer, v any) error {
	body, err := msgpack.Marshal(v)
	if err != nil {
		return err
	}
	if len(body) > maxStoreMessage {
		return fmt.Errorf("%w: store message of %d bytes", ErrBadFrame, len(body))
	}
	msg := binary.LittleEndian.AppendUint32(make([]byte, 0, 4+len(body)), uint32(len(body)))
	_, err = w.Write(append(msg, body...))
	return err
}

// tcpStore is the client side of StoreServer.
type tcpStore struct {
	addr, token string
	mu          sync.Mutex
	conn        net.Conn
}

// DialStore connects to a StoreServer, retrying until ctx ends (rank 0 may
// not be up yet).
func DialStore(ctx context.Context, addr, token string) (Store, error) {
	s := &tcpStore{addr: addr, token: token}
	for {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			s.conn = c
			return s, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%w: store at %s unreachable: %w", ErrRendezvous, addr, err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (s *tcpStore) do(ctx context.Context, req storeRequest) (storeReply, error) {
	req.Token = s.token
	var rep storeReply
	s.mu.Lock()
	defer s.mu.Unlock()
	if dl, ok := ctx.Deadline(); ok {
		s.conn.SetDeadline(dl.Add(time.Second))
	} else {
		s.conn.SetDeadline(time.Time{})
	}
	if err := writeStoreMessage(s.conn, req); err != nil {
		return rep, fmt.Errorf("%w: store %s: %w", ErrRendezvous, req.Op, err)
	}
	if err := readStoreMessage(s.conn, &rep); err != nil {
		if errors.Is(err, io.EOF) {
			return rep, fmt.Errorf("%w: store closed the connection (wrong job token?)", ErrRendezvous)
		}
		return rep, fmt.Errorf("%w: store %s: %w", ErrRendezvous, req.Op, err)
	}
	if rep.Err != "" {
		if rep.Err == "wrong job token" {
			return rep, fmt.Errorf("%w: %s", ErrAuth, rep.Err)
		}
		return rep, fmt.Errorf("%w: store: %s", ErrRendezvous, rep.Err)
	}
	return rep, nil
}

func (s *tcpStore) Set(ctx context.Context, key string, value []byte) error {
	_, err := s.do(ctx, storeRequest{Op: "set", Key: key, Value: value})
	return err
}

func (s *tcpStore) Get(ctx context.Context, key string) ([]byte, error) {
	wait := time.Hour
	if dl, ok := ctx.Deadline(); ok {
		wait = time.Until(dl)
		if wait < 0 {
			wait = 0
		}
	}
	rep, err := s.do(ctx, storeRequest{Op: "get", Key: key, WaitMs: wait.Milliseconds()})
	return []byte(rep.Value), err
}

func (s *tcpStore) Wait(ctx context.Context, keys ...string) error {
	for _, k := range keys {
		if _, err := s.Get(ctx, k); err != nil {
			return err
		}
	}
	return nil
}

func (s *tcpStore) Add(ctx context.Context, key string, delta int64) (int64, error) {
	rep, err := s.do(ctx, storeRequest{Op: "add", Key: key, Delta: delta})
	return rep.Num, err
}

// Close drops the connection to the server.
func (s *tcpStore) Close() error { return s.conn.Close() }
