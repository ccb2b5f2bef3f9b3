package zmq

// The send path as callers see it: Send, StartCall and RefuseCall hand
// frames to the outbox's goroutine and wait until the payload is copied.

import (
	"context"
	"fmt"

	"github.com/oktopk/oktopk/transport"
)

// The send path as callers see it: Send, StartCall and RefuseCall hand
// frames to the outbox's goroutine and wait until the payload is copied.

// Send hands payload to the outbox and returns once it is copied (by ZeroMQ,
// or by the outbox while peer's connection is down), so that the caller may
// reuse the buffer.
func (z *Transport) Send(ctx context.Context, peer int, tag transport.Tag, dtype transport.Dtype, count uint64, payload []byte) error {
	if err := transport.CheckPeer(z, peer); err != nil {
		return err
	}
	if err := z.box.Err(); err != nil {
		return err
	}
	if !z.connected.Load() {
		return fmt.Errorf("oktopk: invalid usage: send before Connect")
	}
	h := transport.FrameHeader{Kind: transport.FrameData, Tag: tag, Call: z.box.CallOf(tag.Seq), Dtype: dtype, Count: count, PayloadLen: uint64(len(payload))}
	return z.enqueue(ctx, peer, &h, payload)
}

// StartCall records the call this rank has begun; its heartbeats carry the
// sequence number to the peers.
func (z *Transport) StartCall(op transport.Op, seq uint64, call transport.CallDesc) {
	z.box.Start(op, seq, call)
}

func (z *Transport) enqueue(ctx context.Context, peer int, h *transport.FrameHeader, payload []byte) error {
	// Said only on failure: formatting it on every send cost an allocation.
	what := func() string { return fmt.Sprintf("sending %s to peer %d", h.Tag, peer) }
	h.Token = z.token
	h.Generation = z.opts.Generation
	h.Sender = uint32(z.opts.Rank)
	req := &sendRequest{peer: peer, header: make([]byte, transport.HeaderSize), payload: payload, done: make(chan error, 1)}
	h.Encode(req.header)
	select {
	case z.out.reqs <- req:
	case <-ctx.Done():
		return transport.ContextError(ctx, what())
	case <-z.closing:
		return z.closedErr()
	}
	// The request may have gone into the queue after the outbox drained it
	// for the last time (both cases of the select above were ready): then
	// nobody will take it, and stopped says so.
	select {
	case err := <-req.done:
		return err
	case <-z.out.stopped:
		return z.answeredOrClosed(req)
	case <-ctx.Done():
		if req.state.CompareAndSwap(reqQueued, reqCancelled) {
			return transport.ContextError(ctx, what()) // the outbox will skip it
		}
		// The outbox has taken it and is copying payload: wait so the
		// caller can reuse the buffer. The outbox never blocks on a peer,
		// so this lasts one copy at most.
		select {
		case <-req.done:
		case <-z.out.stopped:
		}
		return transport.ContextError(ctx, what())
	}
}

// answeredOrClosed is a request's outcome once the outbox has stopped: its
// answer if the outbox took it, else the reason the transport closed.
func (z *Transport) answeredOrClosed(req *sendRequest) error {
	select {
	case err := <-req.done:
		return err
	default:
		return z.closedErr()
	}
}

// RefuseCall sends a refuse frame to every peer and returns once each is
// handed to ZeroMQ (or the transport is closed, or ctx ends), so that a
// Close right after it still sends them before its bye.
func (z *Transport) RefuseCall(ctx context.Context, seq uint64, reason string) {
	z.box.Refuse(seq)
	text := []byte(transport.RefusalText(reason))
	for r := 0; r < z.opts.Size; r++ {
		if r == z.opts.Rank {
			continue
		}
		h := transport.FrameHeader{Kind: transport.FrameRefuse, Tag: transport.Tag{Seq: seq}, Dtype: transport.DtypeBytes, Count: uint64(len(text)), PayloadLen: uint64(len(text))}
		// Errors need no handling: a peer that cannot be reached fails by
		// itself (its connection drops, or it waits past its timeout).
		_ = z.enqueue(ctx, r, &h, text)
	}
}
