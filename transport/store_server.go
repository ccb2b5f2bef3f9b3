package transport

// StoreServer: rank 0's rendezvous store, served over TCP to the job's
// ranks, with what a stranger on its port can make it hold bounded.

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

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
	// closing ends the waits of gets in progress, so Close never waits out
	// a get's timeout (a stray client can ask for a key that never comes).
	closing context.Context
	stop    context.CancelFunc
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
	s.closing, s.stop = context.WithCancel(context.Background())
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

// Addr is "host:port" for DialStore.
func (s *StoreServer) Addr() string { return s.ln.Addr().String() }

// Close stops serving and drops every connection; a get waiting for its key
// fails at once.
func (s *StoreServer) Close() error {
	s.stop()
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
			ctx, cancel := context.WithTimeout(s.closing, time.Duration(req.WaitMs)*time.Millisecond)
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
