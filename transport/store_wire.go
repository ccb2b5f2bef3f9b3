package transport

// The store's wire protocol, shared by StoreServer and its client: each
// message is a length and a msgpack body, checked before it is decoded.

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"time"

	"github.com/vmihailenco/msgpack/v5"
)

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
	if err := checkMsgpackLengths(body.Bytes()); err != nil {
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

// checkMsgpackLengths walks one msgpack value in b and refuses it when a
// length or count it declares exceeds the bytes that follow, or when it
// nests deeper than maxMsgpackDepth. The msgpack decoder sizes its
// allocations from declared lengths before reading (a string declaring
// 800 MB in a 52-byte message cost 56 MiB), so a store request is checked
// against its actual size first.
func checkMsgpackLengths(b []byte) error {
	bad := func(what string) error { return fmt.Errorf("%w: store message: %s", ErrBadFrame, what) }
	pending := 1 // values still to read
	depth := 0
	for pending > 0 {
		if len(b) == 0 {
			return bad("truncated")
		}
		c := b[0]
		b = b[1:]
		pending--
		var skip, items uint64 // bytes to skip after the header; values it holds
		var lenBytes int       // bytes of a length field that follows
		switch {
		case c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3: // fixints, nil, bools
		case c&0xf0 == 0x80: // fixmap
			items = 2 * uint64(c&0x0f)
		case c&0xf0 == 0x90: // fixarray
			items = uint64(c & 0x0f)
		case c&0xe0 == 0xa0: // fixstr
			skip = uint64(c & 0x1f)
		case c == 0xc4 || c == 0xd9: // bin8, str8
			lenBytes = 1
		case c == 0xc5 || c == 0xda: // bin16, str16
			lenBytes = 2
		case c == 0xc6 || c == 0xdb: // bin32, str32
			lenBytes = 4
		case c == 0xc7: // ext8: length, type, data
			lenBytes, skip = 1, 1
		case c == 0xc8:
			lenBytes, skip = 2, 1
		case c == 0xc9:
			lenBytes, skip = 4, 1
		case c == 0xca || c == 0xce || c == 0xd2: // float32, uint32, int32
			skip = 4
		case c == 0xcb || c == 0xcf || c == 0xd3: // float64, uint64, int64
			skip = 8
		case c == 0xcc || c == 0xd0:
			skip = 1
		case c == 0xcd || c == 0xd1:
			skip = 2
		case c >= 0xd4 && c <= 0xd8: // fixext 1, 2, 4, 8, 16 (and a type byte)
			skip = 1 + 1<<(c-0xd4)
		case c == 0xdc || c == 0xdd || c == 0xde || c == 0xdf: // array16/32, map16/32
			n := 2
			if c == 0xdd || c == 0xdf {
				n = 4
			}
			if len(b) < n {
				return bad("truncated")
			}
			for _, x := range b[:n] {
				items = items<<8 | uint64(x)
			}
			b = b[n:]
			if c >= 0xde {
				items *= 2
			}
		default: // 0xc1 is never used
			return bad(fmt.Sprintf("type byte %#x", c))
		}
		if lenBytes > 0 {
			if len(b) < lenBytes {
				return bad("truncated")
			}
			var n uint64
			for _, x := range b[:lenBytes] {
				n = n<<8 | uint64(x)
			}
			b = b[lenBytes:]
			skip += n
		}
		if skip > uint64(len(b)) {
			return bad(fmt.Sprintf("%d bytes declared, %d left", skip, len(b)))
		}
		b = b[skip:]
		if items > 0 {
			// Every value takes at least one byte.
			if items > uint64(len(b)) || uint64(pending)+items > uint64(len(b)) {
				return bad(fmt.Sprintf("%d values declared, %d bytes left", items, len(b)))
			}
			if depth++; depth > maxMsgpackDepth {
				return bad("nested too deep")
			}
			pending += int(items)
		}
	}
	return nil
}

// maxMsgpackDepth bounds the containers one store message may open; its
// own messages open one (the request or reply map).
const maxMsgpackDepth = 8
