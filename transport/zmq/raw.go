package zmq

// Raw sockets: bare ZeroMQ sockets outside any transport, for the programs
// that look at the transport from outside: the bus-bandwidth tool's
// raw-ZeroMQ baseline, and the strangers of the garbage and chaos tests,
// which connect to a rank's port without the job's credentials. They live
// here so that this package stays the module's only user of the ZeroMQ
// binding; they carry no framing, authentication or liveness of their own.

import (
	"syscall"
	"time"

	"github.com/pebbe/zmq4"
)

// ErrAgain is what a raw socket's send or receive returns when its timeout
// passes first (EAGAIN); test it with errors.Is.
var ErrAgain error = zmq4.Errno(syscall.EAGAIN)

// SocketType is a raw socket's ZeroMQ pattern.
type SocketType int

const (
	Dealer SocketType = iota // ZMQ_DEALER
	Router                   // ZMQ_ROUTER
)

// RawContext is a ZeroMQ context of its own, for raw sockets.
type RawContext struct{ zctx *zmq4.Context }

// NewRawContext makes a ZeroMQ context.
func NewRawContext() (*RawContext, error) {
	zctx, err := zmq4.NewContext()
	if err != nil {
		return nil, err
	}
	return &RawContext{zctx: zctx}, nil
}

// NewSocket makes a raw socket of type t in the context.
func (c *RawContext) NewSocket(t SocketType) (*RawSocket, error) {
	kind := zmq4.DEALER
	if t == Router {
		kind = zmq4.ROUTER
	}
	s, err := c.zctx.NewSocket(kind)
	if err != nil {
		return nil, err
	}
	return &RawSocket{s: s}, nil
}

// Term ends the context, once its sockets are closed (ZeroMQ's zmq_ctx_term).
func (c *RawContext) Term() error { return c.zctx.Term() }

// RawSocket is one bare ZeroMQ socket. Like every ZeroMQ socket it is not
// safe for concurrent use.
type RawSocket struct{ s *zmq4.Socket }

// SetLinger bounds how long Close lets unsent messages wait (ZMQ_LINGER).
func (s *RawSocket) SetLinger(d time.Duration) error { return s.s.SetLinger(d) }

// SetSndtimeo bounds how long a send blocks (ZMQ_SNDTIMEO).
func (s *RawSocket) SetSndtimeo(d time.Duration) error { return s.s.SetSndtimeo(d) }

// SetRcvtimeo bounds how long a receive blocks (ZMQ_RCVTIMEO).
func (s *RawSocket) SetRcvtimeo(d time.Duration) error { return s.s.SetRcvtimeo(d) }

// SetSndhwm bounds the messages queued to send per peer (ZMQ_SNDHWM; 0: no bound).
func (s *RawSocket) SetSndhwm(n int) error { return s.s.SetSndhwm(n) }

// SetRcvhwm bounds the messages queued on receipt per peer (ZMQ_RCVHWM; 0: no bound).
func (s *RawSocket) SetRcvhwm(n int) error { return s.s.SetRcvhwm(n) }

// Connect connects to a ZeroMQ endpoint ("tcp://host:port").
func (s *RawSocket) Connect(endpoint string) error { return s.s.Connect(endpoint) }

// Bind binds to a ZeroMQ endpoint ("tcp://host:*" for any free port).
func (s *RawSocket) Bind(endpoint string) error { return s.s.Bind(endpoint) }

// LastEndpoint is the endpoint the last Bind bound, with its port.
func (s *RawSocket) LastEndpoint() (string, error) { return s.s.GetLastEndpoint() }

// SendMessage sends parts (strings, byte slices, or slices of either) as
// one multi-part message and returns the bytes sent.
func (s *RawSocket) SendMessage(parts ...any) (int, error) { return s.s.SendMessage(parts...) }

// SendBytes sends one part; more says that further parts of the same
// message follow.
func (s *RawSocket) SendBytes(data []byte, more bool) (int, error) {
	var flags zmq4.Flag
	if more {
		flags = zmq4.SNDMORE
	}
	return s.s.SendBytes(data, flags)
}

// RecvMessage waits for one multi-part message and returns its parts as
// strings.
func (s *RawSocket) RecvMessage() ([]string, error) { return s.s.RecvMessage(0) }

// RecvMessageBytes waits for one multi-part message.
func (s *RawSocket) RecvMessageBytes() ([][]byte, error) { return s.s.RecvMessageBytes(0) }

// Close closes the socket.
func (s *RawSocket) Close() error { return s.s.Close() }
