// Package main is liboktopk's C ABI: //export shims over packages core and
// transport. Nothing else lives here. See include/oktopk.h for the contract.
//
// The exported names are abi.c's, which refuses a child made by fork()
// before any Go code runs and then calls the go_oktopk_* export here. Every
// export starts with call(), which recovers panics into oktopkInternalError
// and maps errors to result codes once.
package main

/*
#include "../include/oktopk.h"

// cgo spells exported parameters from their Go types, which know no const;
// these names let the generated prototypes match the header's exactly, so
// the compiler checks every export against include/oktopk.h.
typedef const char oktopk_const_char;
typedef const char *const oktopk_const_string;
typedef const uint32_t oktopk_const_uint32;
typedef const float oktopk_const_float;
typedef const oktopk_config_t oktopk_const_config;
typedef const oktopk_unique_id_t oktopk_const_unique_id;
typedef const void oktopk_const_void;
typedef const size_t oktopk_const_size_t;
typedef const oktopk_call_options_t oktopk_const_call_options;
*/
import "C"

import (
	"context"
	"fmt"
	"math"
	"runtime"
	"unsafe"

	"github.com/oktopk/oktopk/core"
)

func main() {}

//export go_oktopk_algorithm_name
func go_oktopk_algorithm_name(algorithm C.int) *C.oktopk_const_char {
	if algorithm < 0 || int(algorithm) >= len(algorithmNames) {
		return nil
	}
	return (*C.oktopk_const_char)(algorithmNames[algorithm])
}

// algorithmNames are oktopk_algorithm_name's answers, allocated once.
var algorithmNames = func() []*C.char {
	var names []*C.char
	for _, a := range core.Algorithms() {
		names = append(names, C.CString(a.String()))
	}
	return names
}()

//export go_oktopk_config_init
func go_oktopk_config_init(config *C.oktopk_config_t) {
	writeDefaultConfig(config)
}

//export go_oktopk_get_last_error
func go_oktopk_get_last_error(comm C.oktopk_comm_t, buf *C.char, n C.size_t, truncated *C.int) C.oktopk_result_t {
	if buf == nil || n == 0 {
		return C.oktopkInvalidArgument
	}
	var msg string
	if comm != 0 {
		c, err := comms.get("communicator", int64(comm))
		if err != nil {
			cut := copyMessage(err.Error(), buf, n)
			if truncated != nil {
				*truncated = boolInt(cut)
			}
			return resultOf(err)
		}
		msg = c.lastError.get()
	} else {
		msg = globalLastError.get()
	}
	cut := copyMessage(msg, buf, n)
	if truncated != nil {
		*truncated = boolInt(cut)
	}
	return C.oktopkSuccess
}

// ---- communicator lifecycle ----------------------------------------------

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
		ep := c.net.Endpoint()
		if uint64(endpointLen) <= uint64(len(ep)) {
			c.destroy()
			return invalidArgument("endpoint needs %d bytes, buffer has %d", len(ep)+1, uint64(endpointLen))
		}
		copyMessage(ep, endpoint, endpointLen)
		*comm = C.oktopk_comm_t(register(c))
		return nil
	})
}

//export go_oktopk_comm_connect
func go_oktopk_comm_connect(comm C.oktopk_comm_t, endpoints *C.oktopk_const_string, nranks C.int) C.oktopk_result_t {
	return call(int64(comm), func() error {
		c, err := comms.get("communicator", int64(comm))
		if err != nil {
			return err
		}
		if c.isConnected() {
			return invalidUsage("communicator is already connected")
		}
		if endpoints == nil {
			return invalidArgument("endpoints is NULL")
		}
		if int(nranks) != c.size {
			return invalidArgument("%d endpoints for a communicator of %d ranks", int(nranks), c.size)
		}
		list := unsafe.Slice(endpoints, c.size)
		eps := make([]string, c.size)
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
	return call(int64(comm), func() error {
		c, err := comms.get("communicator", int64(comm))
		if err != nil {
			return err
		}
		if rank == nil {
			return invalidArgument("rank is NULL")
		}
		*rank = C.int(c.rank)
		return nil
	})
}

//export go_oktopk_comm_size
func go_oktopk_comm_size(comm C.oktopk_comm_t, size *C.int) C.oktopk_result_t {
	return call(int64(comm), func() error {
		c, err := comms.get("communicator", int64(comm))
		if err != nil {
			return err
		}
		if size == nil {
			return invalidArgument("size is NULL")
		}
		*size = C.int(c.size)
		return nil
	})
}

//export go_oktopk_comm_abort
func go_oktopk_comm_abort(comm C.oktopk_comm_t) C.oktopk_result_t {
	return call(int64(comm), func() error {
		c, err := comms.get("communicator", int64(comm))
		if err != nil {
			return err
		}
		c.abort(errAbortedByCaller)
		return nil
	})
}

//export go_oktopk_comm_dropped
func go_oktopk_comm_dropped(comm C.oktopk_comm_t, count *C.uint64_t) C.oktopk_result_t {
	return call(int64(comm), func() error {
		c, err := comms.get("communicator", int64(comm))
		if err != nil {
			return err
		}
		if count == nil {
			return invalidArgument("count is NULL")
		}
		var n uint64
		if c.net != nil {
			n = c.net.Dropped()
		}
		*count = C.uint64_t(n)
		return nil
	})
}

//export go_oktopk_comm_destroy
func go_oktopk_comm_destroy(comm C.oktopk_comm_t) C.oktopk_result_t {
	return call(0, func() error {
		c, err := comms.remove("communicator", int64(comm))
		if err != nil {
			return err
		}
		return c.destroy()
	})
}

//export go_oktopk_comm_measure_link
func go_oktopk_comm_measure_link(comm C.oktopk_comm_t, link *C.oktopk_link_model_t) C.oktopk_result_t {
	return call(int64(comm), func() error {
		c, err := comms.get("communicator", int64(comm))
		if err != nil {
			return err
		}
		if link != nil && link.size < 4 {
			return c.refuse(invalidArgument("link.size is %d; set it to sizeof(oktopk_link_model_t)", link.size), true)
		}
		var m core.LinkModel
		_, err = c.do(false, func(ctx context.Context, cc *core.Communicator) (core.Stats, error) {
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

// ---- collectives ---------------------------------------------------------

//export go_oktopk_allreduce
func go_oktopk_allreduce(comm C.oktopk_comm_t, data unsafe.Pointer, count C.size_t, dtype C.oktopk_dtype_t, average C.int, algorithm C.int) C.oktopk_result_t {
	return call(int64(comm), func() error {
		c, op, err := allreduceOp(comm, data, count, dtype, average, algorithm)
		if err != nil {
			return refused(c, err, true)
		}
		_, err = c.do(false, op)
		return err
	})
}

//export go_oktopk_allreduce_start
func go_oktopk_allreduce_start(comm C.oktopk_comm_t, data unsafe.Pointer, count C.size_t, dtype C.oktopk_dtype_t, average C.int, algorithm C.int, request *C.oktopk_request_t) C.oktopk_result_t {
	return call(int64(comm), func() error {
		c, op, err := allreduceOp(comm, data, count, dtype, average, algorithm)
		if err == nil && request == nil {
			err = invalidArgument("request is NULL")
		}
		if err != nil {
			return refused(c, err, false)
		}
		return startRequest(c, op, request)
	})
}

// refused returns err, the refusal of a collective call's arguments; on a
// live communicator c the refusal first takes the call's place in the
// sequence and tells the peers (communicator.refuse).
func refused(c *communicator, err error, wait bool) error {
	if c == nil {
		return err
	}
	return c.refuse(err, wait)
}

// allreduceOp checks a dense allreduce's arguments and builds its operation.
// A bad argument comes back with the communicator, for refused.
func allreduceOp(comm C.oktopk_comm_t, data unsafe.Pointer, count C.size_t, dtype C.oktopk_dtype_t, average C.int, algorithm C.int) (*communicator, operation, error) {
	c, err := comms.get("communicator", int64(comm))
	if err != nil {
		return nil, nil, err
	}
	if err := checkBuffer(data, count, dtype); err != nil {
		return c, nil, err
	}
	alg := core.Algorithm(algorithm)
	if !alg.Dense() && alg != core.Auto {
		return c, nil, invalidArgument("algorithm %v is not a dense allreduce (use OKTOPK_ALGO_DENSE_RING, OKTOPK_ALGO_DENSE_RABENSEIFNER or OKTOPK_ALGO_AUTO)", alg)
	}
	return c, denseOp(c, data, int(count), dtype, average != 0, alg), nil
}

//export go_oktopk_sparse_allreduce
func go_oktopk_sparse_allreduce(comm C.oktopk_comm_t, tensorID C.uint64_t, data unsafe.Pointer, count C.size_t, dtype C.oktopk_dtype_t, stats *C.oktopk_stats_t) C.oktopk_result_t {
	return call(int64(comm), func() error {
		c, err := comms.get("communicator", int64(comm))
		if err != nil {
			return err
		}
		if err := checkBuffer(data, count, dtype); err != nil {
			return c.refuse(err, true)
		}
		if err := checkStats(stats); err != nil {
			return c.refuse(err, true)
		}
		st, err := c.do(false, sparseOp(c, uint64(tensorID), data, int(count), dtype, nil))
		if werr := writeStats(stats, st); err == nil {
			err = werr
		}
		return err
	})
}

//export go_oktopk_sparse_allreduce_hold
func go_oktopk_sparse_allreduce_hold(comm C.oktopk_comm_t, tensorID C.uint64_t, data unsafe.Pointer, count C.size_t, dtype C.oktopk_dtype_t,
	hold *C.oktopk_const_size_t, holdCount C.size_t, stats *C.oktopk_stats_t) C.oktopk_result_t {
	return call(int64(comm), func() error {
		c, err := comms.get("communicator", int64(comm))
		if err != nil {
			return err
		}
		if err := checkBuffer(data, count, dtype); err != nil {
			return c.refuse(err, true)
		}
		if err := checkStats(stats); err != nil {
			return c.refuse(err, true)
		}
		spans, err := readHold(unsafe.Pointer(hold), holdCount, count)
		if err != nil {
			return c.refuse(err, true)
		}
		st, err := c.do(false, sparseOp(c, uint64(tensorID), data, int(count), dtype, spans))
		if werr := writeStats(stats, st); err == nil {
			err = werr
		}
		return err
	})
}

//export go_oktopk_sparse_allreduce_ex
func go_oktopk_sparse_allreduce_ex(comm C.oktopk_comm_t, tensorID C.uint64_t, data unsafe.Pointer, count C.size_t, dtype C.oktopk_dtype_t,
	options *C.oktopk_const_call_options, stats *C.oktopk_stats_t) C.oktopk_result_t {
	return call(int64(comm), func() error {
		c, err := comms.get("communicator", int64(comm))
		if err != nil {
			return err
		}
		if err := checkBuffer(data, count, dtype); err != nil {
			return c.refuse(err, true)
		}
		if err := checkStats(stats); err != nil {
			return c.refuse(err, true)
		}
		cfg, opts, err := readCallOptions((*C.oktopk_call_options_t)(options), c.settings.sparse, count)
		if err != nil {
			return c.refuse(err, true)
		}
		st, err := c.do(false, sparseOpWith(c, uint64(tensorID), data, int(count), dtype, cfg, opts))
		if werr := writeStats(stats, st); err == nil {
			err = werr
		}
		return err
	})
}

//export go_oktopk_sparse_allreduce_start
func go_oktopk_sparse_allreduce_start(comm C.oktopk_comm_t, tensorID C.uint64_t, data unsafe.Pointer, count C.size_t, dtype C.oktopk_dtype_t, request *C.oktopk_request_t) C.oktopk_result_t {
	return call(int64(comm), func() error {
		c, err := comms.get("communicator", int64(comm))
		if err != nil {
			return err
		}
		if request == nil {
			return c.refuse(invalidArgument("request is NULL"), false)
		}
		if err := checkBuffer(data, count, dtype); err != nil {
			return c.refuse(err, false)
		}
		return startRequest(c, sparseOp(c, uint64(tensorID), data, int(count), dtype, nil), request)
	})
}

//export go_oktopk_sparse_allreduce_sparse
func go_oktopk_sparse_allreduce_sparse(comm C.oktopk_comm_t, n C.size_t, inIndices *C.oktopk_const_uint32, inValues *C.oktopk_const_float, inCount C.size_t,
	outIndices *C.uint32_t, outValues *C.float, outCapacity C.size_t, outCount *C.size_t, stats *C.oktopk_stats_t) C.oktopk_result_t {
	return call(int64(comm), func() error {
		c, err := comms.get("communicator", int64(comm))
		if err != nil {
			return err
		}
		switch {
		case n == 0 || uint64(n) > core.MaxElements:
			return c.refuse(invalidArgument("n = %d is not in 1..%d", uint64(n), uint64(core.MaxElements)), true)
		case inCount > n:
			return c.refuse(invalidArgument("in_count %d > n %d", uint64(inCount), uint64(n)), true)
		case inCount > 0 && (inIndices == nil || inValues == nil):
			return c.refuse(invalidArgument("in_indices or in_values is NULL"), true)
		case outCapacity > 0 && (outIndices == nil || outValues == nil):
			return c.refuse(invalidArgument("out_indices or out_values is NULL"), true)
		case outCount == nil:
			return c.refuse(invalidArgument("out_count is NULL"), true)
		}
		if err := checkStats(stats); err != nil {
			return c.refuse(err, true)
		}
		in := core.Sparse{
			Idx: unsafe.Slice((*uint32)(unsafe.Pointer(inIndices)), int(inCount)),
			Val: unsafe.Slice((*float32)(unsafe.Pointer(inValues)), int(inCount)),
		}
		cfg := c.settings.sparse
		var out core.Sparse
		st, err := c.do(false, func(ctx context.Context, cc *core.Communicator) (core.Stats, error) {
			var st core.Stats
			var err error
			out, st, err = cc.SparseAllreduceSparse(ctx, int(n), in, cfg)
			return st, err
		})
		if werr := writeStats(stats, st); err == nil {
			err = werr
		}
		if err != nil {
			return err
		}
		*outCount = C.size_t(out.Len())
		if uint64(out.Len()) > uint64(outCapacity) {
			return invalidArgument("the global result has %d entries, out_capacity is %d", out.Len(), uint64(outCapacity))
		}
		if out.Len() > 0 {
			copy(unsafe.Slice((*uint32)(unsafe.Pointer(outIndices)), out.Len()), out.Idx)
			copy(unsafe.Slice((*float32)(unsafe.Pointer(outValues)), out.Len()), out.Val)
		}
		return nil
	})
}

// ---- requests ------------------------------------------------------------

func startRequest(c *communicator, op operation, out *C.oktopk_request_t) error {
	r, err := c.start(false, op)
	if err != nil {
		return err
	}
	*out = C.oktopk_request_t(requests.add(r))
	return nil
}

//export go_oktopk_test
func go_oktopk_test(request C.oktopk_request_t) C.oktopk_result_t {
	return call(0, func() error {
		r, err := requests.get("request", int64(request))
		if err != nil {
			return err
		}
		select {
		case <-r.done:
			return nil
		default:
			return errInProgress
		}
	})
}

//export go_oktopk_wait
func go_oktopk_wait(request C.oktopk_request_t, stats *C.oktopk_stats_t) C.oktopk_result_t {
	return call(0, func() error {
		r, err := requests.get("request", int64(request))
		if err != nil {
			return err
		}
		if err := checkStats(stats); err != nil {
			return err
		}
		<-r.done
		if r.err != nil {
			record(r.comm.handle, r.err)
			return r.err
		}
		return writeStats(stats, r.stats)
	})
}

//export go_oktopk_request_free
func go_oktopk_request_free(request C.oktopk_request_t) C.oktopk_result_t {
	return call(0, func() error {
		r, err := requests.remove("request", int64(request))
		if err != nil {
			return err
		}
		<-r.done
		return nil
	})
}

// ---- per-tensor state ----------------------------------------------------

//export go_oktopk_tensor_state_size
func go_oktopk_tensor_state_size(comm C.oktopk_comm_t, tensorID C.uint64_t, size *C.size_t) C.oktopk_result_t {
	return call(int64(comm), func() error {
		c, err := comms.get("communicator", int64(comm))
		if err != nil {
			return err
		}
		if size == nil {
			return invalidArgument("size is NULL")
		}
		b, err := c.saveState(uint64(tensorID))
		if err != nil {
			return err
		}
		*size = C.size_t(len(b))
		return nil
	})
}

//export go_oktopk_tensor_state_save
func go_oktopk_tensor_state_save(comm C.oktopk_comm_t, tensorID C.uint64_t, buf unsafe.Pointer, n C.size_t) C.oktopk_result_t {
	return call(int64(comm), func() error {
		c, err := comms.get("communicator", int64(comm))
		if err != nil {
			return err
		}
		if buf == nil {
			return invalidArgument("buf is NULL")
		}
		b, err := c.saveState(uint64(tensorID))
		if err != nil {
			return err
		}
		if uint64(n) < uint64(len(b)) {
			return invalidArgument("state of tensor %d needs %d bytes, buffer has %d", uint64(tensorID), len(b), uint64(n))
		}
		copy(unsafe.Slice((*byte)(buf), len(b)), b)
		return nil
	})
}

//export go_oktopk_tensor_state_load
func go_oktopk_tensor_state_load(comm C.oktopk_comm_t, tensorID C.uint64_t, buf *C.oktopk_const_void, n C.size_t) C.oktopk_result_t {
	return call(int64(comm), func() error {
		c, err := comms.get("communicator", int64(comm))
		if err != nil {
			return err
		}
		if buf == nil || n == 0 {
			return invalidArgument("buf is NULL or len is 0")
		}
		if uint64(n) > math.MaxInt32 {
			return invalidArgument("state of %d bytes is larger than any tensor state", uint64(n))
		}
		return c.loadState(uint64(tensorID), C.GoBytes(unsafe.Pointer(buf), C.int(n)))
	})
}

// ---- selection -----------------------------------------------------------

//export go_oktopk_topk
func go_oktopk_topk(x *C.oktopk_const_float, n C.size_t, k C.size_t, indices *C.uint32_t, values *C.float) C.oktopk_result_t {
	return call(0, func() error {
		switch {
		case uint64(n) > core.MaxElements:
			return invalidArgument("n = %d exceeds %d", uint64(n), uint64(core.MaxElements))
		case k > n:
			return invalidArgument("k = %d > n = %d", uint64(k), uint64(n))
		case n > 0 && x == nil:
			return invalidArgument("x is NULL")
		case k > 0 && (indices == nil || values == nil):
			return invalidArgument("indices or values is NULL")
		}
		s, err := core.TopK(unsafe.Slice((*float32)(unsafe.Pointer(x)), int(n)), int(k))
		if err != nil {
			return err
		}
		copy(unsafe.Slice((*uint32)(unsafe.Pointer(indices)), int(k)), s.Idx)
		copy(unsafe.Slice((*float32)(unsafe.Pointer(values)), int(k)), s.Val)
		return nil
	})
}

//export go_oktopk_threshold_select
func go_oktopk_threshold_select(x *C.oktopk_const_float, n C.size_t, threshold C.float, indices *C.uint32_t, values *C.float, capacity C.size_t, count *C.size_t) C.oktopk_result_t {
	return call(0, func() error {
		switch {
		case uint64(n) > core.MaxElements:
			return invalidArgument("n = %d exceeds %d", uint64(n), uint64(core.MaxElements))
		case n > 0 && x == nil:
			return invalidArgument("x is NULL")
		case capacity > 0 && (indices == nil || values == nil):
			return invalidArgument("indices or values is NULL")
		case count == nil:
			return invalidArgument("count is NULL")
		case math.IsNaN(float64(threshold)):
			return invalidArgument("threshold is NaN")
		}
		capN := int(min(uint64(capacity), uint64(n)))
		// The destination slices are the caller's buffers with their
		// capacity: append writes in place up to capacity and moves to Go
		// memory after, so nothing is ever written past the caller's end.
		dst := core.Sparse{
			Idx: unsafe.Slice((*uint32)(unsafe.Pointer(indices)), capN)[:0],
			Val: unsafe.Slice((*float32)(unsafe.Pointer(values)), capN)[:0],
		}
		s, nonFinite := core.SelectAboveChecked(dst, unsafe.Slice((*float32)(unsafe.Pointer(x)), int(n)), float32(threshold))
		if nonFinite > 0 {
			*count = 0
			return fmt.Errorf("%w: %d NaN or infinite entries in x", core.ErrNonFinite, nonFinite)
		}
		*count = C.size_t(s.Len())
		if uint64(s.Len()) > uint64(capacity) {
			return invalidArgument("%d entries pass the threshold, capacity is %d", s.Len(), uint64(capacity))
		}
		return nil
	})
}

// ---- diagnostics ---------------------------------------------------------

//export go_oktopk_debug_goroutines
func go_oktopk_debug_goroutines() C.int {
	return C.int(runtime.NumGoroutine())
}
