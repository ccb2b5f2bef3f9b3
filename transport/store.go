package transport

// Rendezvous goes through a Store, a small key-value service in the style of
// gloo's and torch.distributed's: ranks publish their endpoints under keys
// and wait for everyone else's. A framework that has its own store (the
// TCPStore torchrun made, Horovod's collectives) exchanges endpoints itself
// and hands the list to Connect; otherwise rank 0 serves a StoreServer.
// This file holds the Store interface, the in-process store and the client
// of a StoreServer (store_server.go; their protocol: store_wire.go).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"time"
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
