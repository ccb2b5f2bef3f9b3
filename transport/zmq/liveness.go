package zmq

// Liveness: heartbeat silence, and the socket monitors that notice a dropped
// connection (a dead peer) and count the outbox's refused connections.

import (
	"fmt"
	"strings"
	"time"

	"github.com/oktopk/oktopk/transport"
	"github.com/pebbe/zmq4"
)

// silence is how long peer has sent nothing, once that is longer than two
// heartbeat intervals (a live peer is heard from at least once a heartbeat
// interval); 0 while it is heard from, and before Connect finished. The
// mailbox's stall warnings name the peers it reports.
func (z *Transport) silence(peer int) time.Duration {
	if !z.watching.Load() {
		return 0
	}
	if d := time.Duration(time.Now().UnixNano() - z.lastSeen[peer].Load()); d > 2*heartbeatInterval {
		return d
	}
	return 0
}

func (z *Transport) checkLiveness() {
	if !z.watching.Load() {
		return
	}
	now := time.Now().UnixNano()
	for r := range z.lastSeen {
		if r == z.opts.Rank {
			continue
		}
		if silent := time.Duration(now - z.lastSeen[r].Load()); silent > z.opts.PeerTimeout {
			z.box.FailPeer(r, fmt.Errorf("%w: peer %d silent for %v", transport.ErrRemote, r, silent.Round(time.Millisecond)))
			z.forget(r)
		}
	}
}

// monitorSocket starts ZeroMQ's socket monitor on sock for events and
// returns the PAIR socket they arrive on, named name within the transport's
// private context. Only one goroutine may use that socket afterwards; sock
// stays its own owner's alone.
func monitorSocket(zctx *zmq4.Context, sock *zmq4.Socket, name string, events zmq4.Event) (*zmq4.Socket, error) {
	addr := "inproc://oktopk-monitor-" + name // the context is private
	if err := sock.Monitor(addr, events); err != nil {
		return nil, fmt.Errorf("monitoring the %s socket: %w", name, err)
	}
	m, err := zctx.NewSocket(zmq4.PAIR)
	if err == nil {
		err = firstErr(m.SetLinger(0), m.SetRcvtimeo(pollInterval))
	}
	if err == nil {
		err = m.Connect(addr)
	}
	if err != nil {
		if m != nil {
			m.Close()
		}
		return nil, fmt.Errorf("monitoring the %s socket: %w", name, err)
	}
	return m, nil
}

// outboxMonitorLoop owns the outbox's monitor socket: it counts the
// connections the outbox accepted and those that authenticated.
func (z *Transport) outboxMonitorLoop(m *zmq4.Socket) {
	defer z.owners.Done()
	defer m.Close()
	for {
		select {
		case <-z.closing:
			return
		default:
		}
		event, _, _, err := m.RecvEvent(0)
		if err != nil {
			continue
		}
		switch event {
		case zmq4.EVENT_ACCEPTED:
			z.accepted.Add(1)
		case zmq4.EVENT_HANDSHAKE_SUCCEEDED:
			z.authenticated.Add(1)
		}
	}
}

// monitorLoop owns the inbox's monitor socket: it notes when the
// connection to a peer (addrs[r] is rank r's outbox) drops and when a
// handshake brings it back, and declares a peer dead once a drop has lasted
// peerDisconnectGrace with nothing heard from it. It never touches the
// inbox itself.
func (z *Transport) monitorLoop(m *zmq4.Socket, addrs []string) {
	defer z.owners.Done()
	defer m.Close()
	down := make([]time.Time, len(addrs)) // when each peer's connection dropped; zero while up
	declared := make([]bool, len(addrs))
	for {
		select {
		case <-z.closing:
			return
		default:
		}
		for {
			event, addr, _, err := m.RecvEvent(0)
			if err != nil {
				break
			}
			r := endpointRank(addrs, addr, z.opts.Rank)
			if r < 0 {
				continue
			}
			switch event {
			case zmq4.EVENT_DISCONNECTED:
				if down[r].IsZero() {
					down[r] = time.Now()
				}
			case zmq4.EVENT_HANDSHAKE_SUCCEEDED:
				down[r] = time.Time{}
			}
		}
		if !z.watching.Load() {
			continue
		}
		now := time.Now()
		for r, since := range down {
			if since.IsZero() || declared[r] {
				continue
			}
			quiet := since
			if seen := time.Unix(0, z.lastSeen[r].Load()); seen.After(quiet) {
				quiet = seen
			}
			if now.Sub(quiet) > peerDisconnectGrace {
				declared[r] = true
				z.box.FailPeer(r, fmt.Errorf("%w: peer %d disconnected (connection lost %v ago, not re-established)",
					transport.ErrRemote, r, now.Sub(since).Round(time.Millisecond)))
				z.forget(r)
			}
		}
	}
}

// endpointRank is the rank whose outbox address a monitor event names: the
// address as connected to, or else the one peer listening on that port
// (ZeroMQ reports the address it resolved, which for a host name differs
// from the one given); -1 when none or several match.
func endpointRank(addrs []string, event string, self int) int {
	for r, a := range addrs {
		if r != self && a == event {
			return r
		}
	}
	i := strings.LastIndex(event, ":")
	if i < 0 {
		return -1
	}
	found := -1
	for r, a := range addrs {
		if r != self && strings.HasSuffix(a, event[i:]) {
			if found >= 0 {
				return -1
			}
			found = r
		}
	}
	return found
}
