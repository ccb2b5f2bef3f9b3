package main

// The collective exports: dense and sparse allreduce, blocking and
// asynchronous, and the requests the asynchronous ones return (test, wait,
// free). A collective refused for its arguments still takes its place in
// the call order (communicator.refuse).

/*
#include "const_types.h"
*/
import "C"

import (
	"context"
	"unsafe"

	"github.com/oktopk/oktopk/core"
)

// ---- dense ---------------------------------------------------------------

//export go_oktopk_allreduce
func go_oktopk_allreduce(comm C.oktopk_comm_t, data unsafe.Pointer, count C.size_t, dtype C.oktopk_dtype_t, average C.int, algorithm C.int) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		op, err := allreduceOp(c, data, count, dtype, average, algorithm)
		if err != nil {
			return c.refuse(err, true)
		}
		_, err = c.do(false, op)
		return err
	})
}

//export go_oktopk_allreduce_start
func go_oktopk_allreduce_start(comm C.oktopk_comm_t, data unsafe.Pointer, count C.size_t, dtype C.oktopk_dtype_t, average C.int, algorithm C.int, request *C.oktopk_request_t) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		op, err := allreduceOp(c, data, count, dtype, average, algorithm)
		if err == nil && request == nil {
			err = invalidArgument("request is NULL")
		}
		if err != nil {
			return c.refuse(err, false)
		}
		return startRequest(c, op, request)
	})
}

// allreduceOp checks a dense allreduce's arguments and builds its operation.
func allreduceOp(c *communicator, data unsafe.Pointer, count C.size_t, dtype C.oktopk_dtype_t, average C.int, algorithm C.int) (operation, error) {
	if err := checkBuffer(data, count, dtype); err != nil {
		return nil, err
	}
	alg := core.Algorithm(algorithm)
	if !alg.Dense() && alg != core.Auto {
		return nil, invalidArgument("algorithm %v is not a dense allreduce (use OKTOPK_ALGO_DENSE_RING, OKTOPK_ALGO_DENSE_RABENSEIFNER or OKTOPK_ALGO_AUTO)", alg)
	}
	return denseOp(c, data, int(count), dtype, average != 0, alg), nil
}

// ---- sparse --------------------------------------------------------------

//export go_oktopk_sparse_allreduce
func go_oktopk_sparse_allreduce(comm C.oktopk_comm_t, tensorID C.uint64_t, data unsafe.Pointer, count C.size_t, dtype C.oktopk_dtype_t, stats *C.oktopk_stats_t) C.oktopk_result_t {
	return sparseCall(comm, data, count, dtype, stats, func(c *communicator) (operation, error) {
		return sparseOp(c, uint64(tensorID), data, int(count), dtype, nil), nil
	})
}

//export go_oktopk_sparse_allreduce_hold
func go_oktopk_sparse_allreduce_hold(comm C.oktopk_comm_t, tensorID C.uint64_t, data unsafe.Pointer, count C.size_t, dtype C.oktopk_dtype_t,
	hold *C.oktopk_const_size_t, holdCount C.size_t, stats *C.oktopk_stats_t) C.oktopk_result_t {
	return sparseCall(comm, data, count, dtype, stats, func(c *communicator) (operation, error) {
		spans, err := readHold(unsafe.Pointer(hold), holdCount, count)
		if err != nil {
			return nil, err
		}
		return sparseOp(c, uint64(tensorID), data, int(count), dtype, spans), nil
	})
}

//export go_oktopk_sparse_allreduce_ex
func go_oktopk_sparse_allreduce_ex(comm C.oktopk_comm_t, tensorID C.uint64_t, data unsafe.Pointer, count C.size_t, dtype C.oktopk_dtype_t,
	options *C.oktopk_const_call_options, stats *C.oktopk_stats_t) C.oktopk_result_t {
	return sparseCall(comm, data, count, dtype, stats, func(c *communicator) (operation, error) {
		cfg, opts, err := readCallOptions((*C.oktopk_call_options_t)(options), c.settings.sparse, count)
		if err != nil {
			return nil, err
		}
		return sparseOpWith(c, uint64(tensorID), data, int(count), dtype, cfg, opts), nil
	})
}

// sparseCall is the body of the blocking sparse allreduces of a dense
// buffer (oktopk_sparse_allreduce and its _hold and _ex forms): it checks
// the buffer and the stats, then build reads the call's own arguments and
// makes its operation; any of these refusing refuses the call. Then it runs
// the operation and fills stats.
func sparseCall(comm C.oktopk_comm_t, data unsafe.Pointer, count C.size_t, dtype C.oktopk_dtype_t, stats *C.oktopk_stats_t,
	build func(c *communicator) (operation, error)) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		if err := checkBuffer(data, count, dtype); err != nil {
			return c.refuse(err, true)
		}
		if err := checkStats(stats); err != nil {
			return c.refuse(err, true)
		}
		op, err := build(c)
		if err != nil {
			return c.refuse(err, true)
		}
		return doWithStats(c, op, stats)
	})
}

// doWithStats runs a blocking collective and fills stats, for a failed call
// too (what it did before it failed); the call's own error comes first.
func doWithStats(c *communicator, op operation, stats *C.oktopk_stats_t) error {
	st, err := c.do(false, op)
	if werr := writeStats(stats, st); err == nil {
		err = werr
	}
	return err
}

//export go_oktopk_sparse_allreduce_start
func go_oktopk_sparse_allreduce_start(comm C.oktopk_comm_t, tensorID C.uint64_t, data unsafe.Pointer, count C.size_t, dtype C.oktopk_dtype_t, request *C.oktopk_request_t) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
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
	return callOn(comm, func(c *communicator) error {
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
		err := doWithStats(c, func(ctx context.Context, cc *core.Communicator) (core.Stats, error) {
			var st core.Stats
			var err error
			out, st, err = cc.SparseAllreduceSparse(ctx, int(n), in, cfg)
			return st, err
		}, stats)
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
		case <-r.Done():
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
		<-r.Done()
		if r.Err != nil {
			record(r.comm.handle, r.Err)
			return r.Err
		}
		return writeStats(stats, r.Stats)
	})
}

//export go_oktopk_request_free
func go_oktopk_request_free(request C.oktopk_request_t) C.oktopk_result_t {
	return call(0, func() error {
		r, err := requests.remove("request", int64(request))
		if err != nil {
			return err
		}
		<-r.Done()
		return nil
	})
}
