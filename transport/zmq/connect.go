package zmq

// Connect: the inbox dials every peer's outbox, says hello, and waits until
// the whole job is reachable; and what a Connect that timed out reports.

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/oktopk/oktopk/transport"
	"github.com/pebbe/zmq4"
)

// peerRoutingID names the inbox's connection to rank r's outbox
// (ZMQ_CONNECT_ROUTING_ID): every message arriving under it comes from the
// address the rendezvous gave for rank r.
func peerRoutingID(r int) string { return "rank-" + strconv.Itoa(r) }

// routingIDRank is peerRoutingID's inverse; -1 for anything else.
func routingIDRank(id []byte) int {
	s, ok := strings.CutPrefix(string(id), "rank-")
	if !ok {
		return -1
	}
	r, err := strconv.Atoi(s)
	if err != nil || s != strconv.Itoa(r) {
		return -1
	}
	return r
}

// Connect connects this rank's inbox to every peer's outbox (endpoints in
// rank order, this rank's own entry ignored) and waits until every peer
// can send here and this rank can send to every peer, so that a successful
// Connect means the whole job is reachable.
func (z *Transport) Connect(ctx context.Context, endpoints []string) error {
	if len(endpoints) != z.opts.Size {
		return fmt.Errorf("%w: %d endpoints for %d ranks", transport.ErrInvalidArgument, len(endpoints), z.opts.Size)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, z.opts.ConnectTimeout)
		defer cancel()
	}
	addrs, serverKeys, err := z.learnPeers(endpoints)
	if err != nil {
		return err
	}
	if !z.connected.CompareAndSwap(false, true) {
		return fmt.Errorf("oktopk: invalid usage: already connected")
	}
	if z.opts.Size > 1 {
		if err := z.openInbox(addrs, serverKeys); err != nil {
			return err
		}
	}
	for {
		missing := []int{}
		for r := range z.hello {
			if r != z.opts.Rank && !(z.hello[r].Load() && z.bound[r].Load()) {
				missing = append(missing, r)
			}
		}
		if len(missing) == 0 {
			break
		}
		select {
		case <-z.helloCh:
		case <-ctx.Done():
			return fmt.Errorf("%w: %s", transport.ContextError(ctx, "connecting"), z.connectProblem(addrs))
		case <-z.closing:
			return z.closedErr()
		}
	}
	now := time.Now().UnixNano()
	for r := range z.lastSeen {
		z.lastSeen[r].Store(now)
	}
	z.watching.Store(true)
	return nil
}

// openInbox makes the inbox, connects it to every peer's outbox at addrs
// (with CURVE, pinning each peer's key), says hello on each connection, and
// hands the inbox to its goroutine and its monitor to the monitor's.
func (z *Transport) openInbox(addrs, serverKeys []string) error {
	inbox, err := z.zctx.NewSocket(zmq4.ROUTER)
	if err == nil {
		err = firstErr(
			inbox.SetLinger(0),
			inbox.SetRcvhwm(0),
			inbox.SetMaxmsgsize(z.opts.MaxMessageBytes+transport.HeaderSize),
			inbox.SetRcvtimeo(pollInterval),
			inbox.SetSndtimeo(0),
			inbox.SetRouterMandatory(1),
			inbox.SetReconnectIvl(reconnectInterval),
			// A unique, unguessable routing id for this inbox at every
			// peer's outbox: its hello binds the id to this rank there,
			// and a reconnect presents it again.
			inbox.SetIdentity(fmt.Sprintf("oktopk-rank-%d-%s", z.opts.Rank, transport.NewToken()[:16])),
		)
	}
	var monitor *zmq4.Socket
	if err == nil {
		// The monitor must listen before the inbox connects, or the first
		// events would be lost.
		monitor, err = monitorSocket(z.zctx, inbox, "inbox", zmq4.EVENT_DISCONNECTED|zmq4.EVENT_HANDSHAKE_SUCCEEDED)
	}
	if err != nil {
		if inbox != nil {
			inbox.Close()
		}
		return fmt.Errorf("%w: making the inbox: %w", transport.ErrRendezvous, err)
	}
	hello := transport.FrameHeader{Kind: transport.FrameHello, Token: z.token, Generation: z.opts.Generation, Sender: uint32(z.opts.Rank), Dtype: transport.DtypeBytes}
	helloFrame := make([]byte, transport.HeaderSize)
	hello.Encode(helloFrame)
	for r, ep := range addrs {
		if r == z.opts.Rank {
			continue
		}
		// Security options apply to the connections made after them, so
		// each peer's CURVE key is set just before connecting to it.
		err = firstErr(z.secureClient(inbox, serverKeys[r]), inbox.SetConnectRid(peerRoutingID(r)))
		if err == nil {
			err = inbox.Connect(ep)
		}
		if err == nil {
			// The connection's queue exists from Connect on (ZeroMQ
			// connects in the background), so the hello waits there.
			_, err = inbox.SendMessage(peerRoutingID(r), helloFrame, "")
		}
		if err != nil {
			inbox.Close()
			monitor.Close()
			return fmt.Errorf("%w: connecting to rank %d at %q: %w", transport.ErrRendezvous, r, ep, err)
		}
	}
	z.owners.Add(2)
	go z.receiveLoop(inbox, addrs)
	go z.monitorLoop(monitor, addrs)
	return nil
}

// connectProblem says, for a Connect that timed out, which peers' addresses
// this rank never reached and which peers never connected to this rank's
// own address: the two sides of an address that one host cannot reach.
func (z *Transport) connectProblem(addrs []string) string {
	var unreached []string
	var silent []int
	for r := range addrs {
		if r == z.opts.Rank {
			continue
		}
		// hello[r]: this rank's inbox reached rank r's address and r
		// answered; bound[r]: rank r's inbox reached this rank's.
		if !z.hello[r].Load() {
			unreached = append(unreached, fmt.Sprintf("rank %d at %s", r, addrs[r]))
		}
		if !z.bound[r].Load() {
			silent = append(silent, r)
		}
	}
	var parts []string
	if len(unreached) > 0 {
		parts = append(parts, "no connection from this rank to "+strings.Join(unreached, ", ")+
			" (not started, or an address this host cannot reach: set OKTOPK_SOCKET_IFNAME or the bind host on that rank)")
	}
	if len(silent) > 0 {
		parts = append(parts, fmt.Sprintf("ranks %v never connected to this rank's %s (not started, or they cannot reach it)",
			silent, strings.SplitN(z.endpoint, "#", 2)[0]))
	}
	return strings.Join(parts, "; ")
}
