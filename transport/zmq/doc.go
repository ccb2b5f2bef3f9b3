// Package zmq is the ZeroMQ TCP implementation of transport.Transport: what
// a user runs, between processes and hosts. Package transport holds the
// interface, the frame format, the mailbox that matches messages to
// receives, and the rendezvous; this package holds the sockets. It is the
// only package of the module that uses the ZeroMQ binding: RawContext and
// RawSocket lend bare sockets to the tools that measure or attack the
// transport from outside.
//
// A rank joins a job with Rendezvous (a shared transport.Store),
// InitFromUniqueID (an id made by NewUniqueID on rank 0) or InitFromEnv (a
// launcher's environment), or binds with Listen and connects with Connect
// after a rendezvous of its own.
//
// The transport works as follows. Each rank binds one ROUTER
// socket, its outbox, on the address it advertises, and every peer's inbox
// (a ROUTER that only ever connects) dials it: a rank's messages to a peer
// travel outbox → the peer's inbox, over a connection the receiver opened
// itself to the address the rendezvous gave it. On each socket one
// goroutine, its only user, does all the work. The outbox's goroutine takes
// every Send from a channel and sends it to the peer's inbox connection;
// messages to one peer keep their order, and a peer whose connection is
// down has its messages held (copied) until it is back, never holding up
// the others. The inbox's goroutine validates each frame and files it in
// the mailbox.
//
// ZeroMQ sockets are not goroutine-safe, hence one owner goroutine per socket
// and a private zmq4.Context per transport, so that closing one communicator
// never touches another's sockets.
//
// Why the receiver dials: a stranger can open a connection to any bound
// port, and ZeroMQ decodes what arrives there under the socket's limits
// before anything else looks at it — a frame's announced size is allocated
// up front (so a 1 GiB limit let anyone make a rank hold 1 GiB per
// connection), and no option bounds a multi-part message that never ends
// (0x01 0x00 repeated: 32 bytes of queue per wire byte, whatever the
// high-water mark). So the only port a rank binds, the outbox, never takes
// data: its frames are capped at outboxFrameLimit, and a connection must
// pass a PLAIN handshake with the job's password, or CURVE with the job's
// keys (auth.go), before it may send any frame at all. What a connection
// that has not authenticated can make a rank hold is one handshake frame of
// at most outboxFrameLimit plus ZeroMQ's fixed per-connection buffers (20
// KiB in all, measured with 400 such connections), for at most
// handshakeLimit; the kernel's socket buffers come on top, as for any TCP
// port. How many such connections a stranger keeps open at once is bounded
// only by how fast it can open them and by the process's file limit: this
// layer cannot close one before ZeroMQ does. Large messages
// arrive only on the inbox's own connections, which accept frames of up to
// MaxMessageBytes. Refused connections and frames are counted (Dropped).
//
// Liveness has three sources, fastest first. Close sends a bye frame and
// Abort an abort frame, so peers of an orderly or failed rank learn of it at
// once. A rank that dies without a word (SIGKILL, a crash, OOM) has its TCP
// connections closed by the kernel: a socket monitor on the inbox reports
// the drop of its connection to that rank, and a drop not repaired within
// peerDisconnectGrace fails every receive waiting on that peer with
// ErrRemote ("peer 2 disconnected"). A rank that hangs with its connections
// up (SIGSTOP, a stuck process, a host gone without a reset) is caught by
// heartbeats: the outbox sends one to every peer it has been idle towards
// for a heartbeatInterval, and a peer not heard from for PeerTimeout is
// declared dead the same way, unless the caller's deadline fires first.
package zmq
