package main

// The communicator's exports: making one (unique id, environment, bind and
// connect), its rank and size, abort, the dropped-traffic count, destroy,
// and measuring the link for OKTOPK_ALGO_AUTO.

/*
#include "const_types.h"
*/
import "C"

import (
	"context"
	"unsafe"

	"github.com/oktopk/oktopk/binding"
	"github.com/oktopk/oktopk/core"
)

//export go_oktopk_get_unique_id
func go_oktopk_get_unique_id(id *C.oktopk_unique_id_t, config *C.oktopk_const_config) C.oktopk_result_t {
	return call(0, func() error {
		if id == nil {
			return invalidArgument("id is NULL")
		}
		s, err := readConfig((*C.oktopk_config_t)(config))
		if err != nil {
			return err
		}
		text, err := newUniqueID(s)
		if err != nil {
			return err
		}
		dst := unsafe.Slice((*byte)(unsafe.Pointer(&id.internal[0])), C.OKTOPK_UNIQUE_ID_BYTES)
		clear(dst)
		copy(dst, text)
		return nil
	})
}

//export go_oktopk_comm_init_rank
func go_oktopk_comm_init_rank(comm *C.oktopk_comm_t, nranks C.int, id *C.oktopk_const_unique_id, rank C.int, config *C.oktopk_const_config) C.oktopk_result_t {
	return call(0, func() error {
		if comm == nil || id == nil {
			return invalidArgument("comm or id is NULL")
		}
		if err := checkRank(int(rank), int(nranks)); err != nil {
			return err
		}
		s, err := readConfig((*C.oktopk_config_t)(config))
		if err != nil {
			return err
		}
		raw := unsafe.Slice((*byte)(unsafe.Pointer(&id.internal[0])), C.OKTOPK_UNIQUE_ID_BYTES)
		end := 0
		for end < len(raw) && raw[end] != 0 {
			end++
		}
		if end == len(raw) {
			return invalidArgument("unique id is not NUL-terminated (not made by oktopk_get_unique_id?)")
		}
		c, err := initFromUniqueID(string(raw[:end]), int(rank), int(nranks), s)
		if err != nil {
			return err
		}
		*comm = C.oktopk_comm_t(register(c))
		return nil
	})
}

//export go_oktopk_comm_init_env
func go_oktopk_comm_init_env(comm *C.oktopk_comm_t, config *C.oktopk_const_config) C.oktopk_result_t {
	return call(0, func() error {
		if comm == nil {
			return invalidArgument("comm is NULL")
		}
		s, err := readConfig((*C.oktopk_config_t)(config))
		if err != nil {
			return err
		}
		c, err := initFromEnv(s)
		if err != nil {
			return err
		}
		*comm = C.oktopk_comm_t(register(c))
		return nil
	})
}

//export go_oktopk_make_token
func go_oktopk_make_token(buf *C.char, n C.size_t) C.oktopk_result_t {
	return call(0, func() error {
		if buf == nil || n == 0 {
			return invalidArgument("buf is NULL or len is 0")
		}
		token := newToken()
		if uint64(n) <= uint64(len(token)) {
			return invalidArgument("token needs %d bytes, buffer has %d", len(token)+1, uint64(n))
		}
		copyMessage(token, buf, n)
		return nil
	})
}

//export go_oktopk_comm_bind
func go_oktopk_comm_bind(comm *C.oktopk_comm_t, nranks C.int, rank C.int, token *C.oktopk_const_char, config *C.oktopk_const_config, endpoint *C.char, endpointLen C.size_t) C.oktopk_result_t {
	return call(0, func() error {
		if comm == nil || token == nil || endpoint == nil || endpointLen == 0 {
			return invalidArgument("comm, job_token or endpoint is NULL, or endpoint_len is 0")
		}
		if err := checkRank(int(rank), int(nranks)); err != nil {
			return err
		}
		s, err := readConfig((*C.oktopk_config_t)(config))
		if err != nil {
			return err
		}
		c, err := bind(int(rank), int(nranks), C.GoString((*C.char)(token)), s)
		if err != nil {
			return err
		}
		ep := c.Net.Endpoint()
		if uint64(endpointLen) <= uint64(len(ep)) {
			c.Destroy()
			return invalidArgument("endpoint needs %d bytes, buffer has %d", len(ep)+1, uint64(endpointLen))
		}
		copyMessage(ep, endpoint, endpointLen)
		*comm = C.oktopk_comm_t(register(c))
		return nil
	})
}

//export go_oktopk_comm_connect
func go_oktopk_comm_connect(comm C.oktopk_comm_t, endpoints *C.oktopk_const_string, nranks C.int) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		if c.isConnected() {
			return invalidUsage("communicator is already connected")
		}
		if endpoints == nil {
			return invalidArgument("endpoints is NULL")
		}
		if int(nranks) != c.Size {
			return invalidArgument("%d endpoints for a communicator of %d ranks", int(nranks), c.Size)
		}
		list := unsafe.Slice(endpoints, c.Size)
		eps := make([]string, c.Size)
		for i, p := range list {
			if p == nil {
				return invalidArgument("endpoints[%d] is NULL", i)
			}
			eps[i] = C.GoString((*C.char)(p))
		}
		return c.connect(eps)
	})
}

//export go_oktopk_comm_rank
func go_oktopk_comm_rank(comm C.oktopk_comm_t, rank *C.int) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		if rank == nil {
			return invalidArgument("rank is NULL")
		}
		*rank = C.int(c.Rank)
		return nil
	})
}

//export go_oktopk_comm_size
func go_oktopk_comm_size(comm C.oktopk_comm_t, size *C.int) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		if size == nil {
			return invalidArgument("size is NULL")
		}
		*size = C.int(c.Size)
		return nil
	})
}

//export go_oktopk_comm_abort
func go_oktopk_comm_abort(comm C.oktopk_comm_t) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		c.Abort(binding.ErrAbortedByCaller)
		return nil
	})
}

//export go_oktopk_comm_dropped
func go_oktopk_comm_dropped(comm C.oktopk_comm_t, count *C.uint64_t) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		if count == nil {
			return invalidArgument("count is NULL")
		}
		var n uint64
		if c.Net != nil {
			n = c.Net.Dropped()
		}
		*count = C.uint64_t(n)
		return nil
	})
}

// go_oktopk_comm_destroy takes the handle out of the table (remove, not
// lookup), so a second destroy of it fails, and records a failure in the
// global slot only: the communicator's own is gone with it.
//
//export go_oktopk_comm_destroy
func go_oktopk_comm_destroy(comm C.oktopk_comm_t) C.oktopk_result_t {
	return call(0, func() error {
		c, err := comms.remove("communicator", int64(comm))
		if err != nil {
			return err
		}
		return c.Destroy()
	})
}

//export go_oktopk_comm_get_link
func go_oktopk_comm_get_link(comm C.oktopk_comm_t, link *C.oktopk_link_model_t, measured *C.int) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		if link == nil || link.size < 4 || measured == nil {
			return c.refuse(invalidArgument("link and measured must not be NULL; set link.size to sizeof(oktopk_link_model_t)"), true)
		}
		_, err := c.do(true, func(_ context.Context, cc *core.Communicator) (core.Stats, error) {
			m, ok := cc.Link()
			*measured = 0
			if ok {
				*measured = 1
				writeLinkModel(link, m)
			}
			return core.Stats{}, nil
		})
		return err
	})
}

//export go_oktopk_comm_set_link
func go_oktopk_comm_set_link(comm C.oktopk_comm_t, link *C.oktopk_const_link_model) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		if link == nil || link.size < C.uint32_t(unsafe.Offsetof(link.pass_seconds_per_byte)+8) {
			return c.refuse(invalidArgument("link must not be NULL; set link.size to sizeof(oktopk_link_model_t)"), true)
		}
		m := core.LinkModel{Alpha: float64(link.latency_seconds), Beta: float64(link.seconds_per_byte), Gamma: float64(link.pass_seconds_per_byte)}
		_, err := c.do(true, func(_ context.Context, cc *core.Communicator) (core.Stats, error) {
			return core.Stats{}, cc.SetLinkModel(m)
		})
		return err
	})
}

//export go_oktopk_comm_measure_link
func go_oktopk_comm_measure_link(comm C.oktopk_comm_t, link *C.oktopk_link_model_t) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		if link != nil && link.size < 4 {
			return c.refuse(invalidArgument("link.size is %d; set it to sizeof(oktopk_link_model_t)", link.size), true)
		}
		var m core.LinkModel
		_, err := c.do(false, func(ctx context.Context, cc *core.Communicator) (core.Stats, error) {
			var err error
			m, err = cc.MeasureLink(ctx)
			return core.Stats{}, err
		})
		if err == nil && link != nil {
			writeLinkModel(link, m)
		}
		return err
	})
}
