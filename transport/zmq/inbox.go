package zmq

// The receive loop: the inbox's goroutine validates each message, files
// data in the mailbox and acts on control frames; Recv waits on the mailbox.

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/oktopk/oktopk/transport"
	"github.com/pebbe/zmq4"
)

// receiveLoop owns the inbox: it validates each message, files data in the
// mailbox, records liveness, and fails peers that fell silent.
//
// It stops dialing a peer once that peer is gone (declared dead, or said
// bye or abort): ZeroMQ would otherwise redial its address for as long as
// the communicator lives, and without CURVE nothing tells this rank that
// whoever answers there later is still that rank.
func (z *Transport) receiveLoop(inbox *zmq4.Socket, addrs []string) {
	defer z.owners.Done()
	defer inbox.Close()
	dialing := make([]bool, len(addrs))
	for r := range dialing {
		dialing[r] = r != z.opts.Rank
	}
	for {
		select {
		case <-z.closing:
			return
		default:
		}
		if parts, err := inbox.RecvMessageBytes(0); err == nil {
			z.handle(parts)
		}
		z.checkLiveness()
		for more := true; more; {
			select {
			case r := <-z.gone:
				if dialing[r] {
					dialing[r] = false
					inbox.Disconnect(addrs[r])
				}
			default:
				more = false
			}
		}
	}
}

// forget tells the inbox to stop dialing peer (see receiveLoop).
func (z *Transport) forget(peer int) {
	select {
	case z.gone <- peer:
	default: // full of repeats; the peer is in there already
	}
}

// handle validates one inbox message and acts on it. ROUTER prepends the
// routing id of the connection it came on, which names the peer whose
// outbox this rank dialed: ours are [routing id, header, payload].
func (z *Transport) handle(parts [][]byte) {
	if len(parts) != 3 {
		z.dropped.Add(1)
		return
	}
	h, err := transport.DecodeFrameHeader(parts[1], z.token, z.opts.Generation, z.opts.Size)
	peer := int(h.Sender)
	if err != nil || h.PayloadLen != uint64(len(parts[2])) || peer == z.opts.Rank || peer != routingIDRank(parts[0]) {
		z.dropped.Add(1)
		return
	}
	z.lastSeen[peer].Store(time.Now().UnixNano())
	switch h.Kind {
	case transport.FrameData:
		z.box.Deliver(peer, transport.Message{Tag: h.Tag, Dtype: h.Dtype, Count: h.Count, Call: h.Call, Payload: parts[2]})
	case transport.FrameHello:
		if !z.hello[peer].Swap(true) {
			z.helloCh <- struct{}{}
		}
	case transport.FrameHeartbeat:
		z.box.NoteStarted(peer, h.Tag.Seq)
	case transport.FrameBye:
		z.box.FailPeer(peer, fmt.Errorf("%w: peer %d closed its communicator", transport.ErrRemote, peer))
		z.forget(peer)
	case transport.FrameAbort:
		z.box.PeerAborted(peer, h.Reason, strings.ToValidUTF8(string(parts[2]), "?"))
		z.forget(peer)
	case transport.FrameRefuse:
		z.box.PeerRefused(peer, h.Tag.Seq, strings.ToValidUTF8(string(parts[2]), "?"))
	}
}

// Recv waits for the message of tag from peer.
func (z *Transport) Recv(ctx context.Context, peer int, tag transport.Tag) (transport.Message, error) {
	if err := transport.CheckPeer(z, peer); err != nil {
		return transport.Message{}, err
	}
	return z.box.Receive(ctx, peer, tag)
}
