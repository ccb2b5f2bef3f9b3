package main

// The caller-selected sparse allreduce (core/oktopk_selected.go): the plan
// of a call, the call, the bound on what it returns, and the checkpoints
// that carry the caller's residual.

/*
#include "const_types.h"
*/
import "C"

import (
	"context"
	"math"
	"unsafe"

	"github.com/oktopk/oktopk/core"
)

//export go_oktopk_selection_plan
func go_oktopk_selection_plan(comm C.oktopk_comm_t, tensorID C.uint64_t, n C.size_t, options *C.oktopk_const_call_options,
	plan *C.oktopk_selection_plan_t) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		if plan == nil {
			return invalidArgument("plan is NULL")
		}
		if n == 0 || uint64(n) > core.MaxElements {
			return invalidArgument("n = %d is not in 1..%d", uint64(n), uint64(core.MaxElements))
		}
		cfg, _, err := readCallOptions((*C.oktopk_call_options_t)(options), c.settings.sparse, n)
		if err != nil {
			return err
		}
		var p core.SelectionPlan
		_, err = c.do(true, func(_ context.Context, cc *core.Communicator) (core.Stats, error) {
			p = cc.SelectionPlan(uint64(tensorID), int(n), cfg)
			return core.Stats{}, nil
		})
		if err != nil {
			return err
		}
		plan.k = C.uint64_t(p.K)
		plan.exact = 0
		if p.Exact {
			plan.exact = 1
		}
		plan.threshold = C.float(p.Threshold)
		return nil
	})
}

//export go_oktopk_selection_rules
func go_oktopk_selection_rules(rules *C.oktopk_selection_rules_t) {
	if rules == nil {
		return
	}
	r := core.Rules()
	*rules = C.oktopk_selection_rules_t{
		too_many: C.double(r.TooMany), raise: C.float(r.Raise), max_raises: C.int32_t(r.MaxRaises), too_few: C.double(r.TooFew),
		nudge_low: C.double(r.NudgeLow), nudge_down: C.float(r.NudgeDown), nudge_high: C.double(r.NudgeHigh), nudge_up: C.float(r.NudgeUp),
	}
}

//export go_oktopk_selected_capacity
func go_oktopk_selected_capacity(n C.size_t, k C.size_t, ranks C.int) C.size_t {
	if ranks < 1 || k > n || uint64(n) > core.MaxElements {
		return 0
	}
	return C.size_t(core.SelectedCapacity(int(n), int(k), int(ranks)))
}

//export go_oktopk_sparse_allreduce_selected
func go_oktopk_sparse_allreduce_selected(comm C.oktopk_comm_t, tensorID C.uint64_t, n C.size_t, dtype C.oktopk_dtype_t,
	options *C.oktopk_const_call_options, io *C.oktopk_selected_t, stats *C.oktopk_stats_t) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		in, cfg, opts, err := readSelected(c, n, dtype, (*C.oktopk_call_options_t)(options), io)
		if err != nil {
			return c.refuse(err, true)
		}
		if err := checkStats(stats); err != nil {
			return c.refuse(err, true)
		}
		var out core.SelectedOutput
		err = doWithStats(c, func(ctx context.Context, cc *core.Communicator) (core.Stats, error) {
			var st core.Stats
			var err error
			out, st, err = cc.SparseAllreduceSelected(ctx, uint64(tensorID), int(n), in.sel, in.threshold, in.nonFinite, cfg, opts)
			return st, err
		}, stats)
		if err != nil {
			return err
		}
		// The capacities were checked against the bound before the call.
		io.result_count = C.size_t(writePairs(out.Result, io.result_indices, io.result_values))
		io.consumed_count = C.size_t(writePairs(out.Consumed, io.consumed_indices, io.consumed_values))
		io.error_count = C.size_t(writePairs(out.OwnerErr, io.error_indices, io.error_values))
		return nil
	})
}

type selectedInput struct {
	sel       core.Sparse
	threshold float32
	nonFinite bool
}

// readSelected reads and checks a caller-selected call's arguments; the
// selection itself is checked by the core (agreed with the peers).
func readSelected(c *communicator, n C.size_t, dtype C.oktopk_dtype_t, options *C.oktopk_call_options_t, io *C.oktopk_selected_t) (
	selectedInput, core.Config, core.CallOptions, error) {
	var in selectedInput
	fail := func(format string, args ...any) (selectedInput, core.Config, core.CallOptions, error) {
		return in, core.Config{}, core.CallOptions{}, invalidArgument(format, args...)
	}
	switch {
	case io == nil:
		return fail("io is NULL")
	case uintptr(io.size) < unsafe.Sizeof(*io):
		return fail("io.size is %d; set it to sizeof(oktopk_selected_t) (%d)", uint32(io.size), unsafe.Sizeof(*io))
	case n == 0 || uint64(n) > core.MaxElements:
		return fail("n = %d is not in 1..%d", uint64(n), uint64(core.MaxElements))
	case io.count > n:
		return fail("count %d > n %d", uint64(io.count), uint64(n))
	case io.count > 0 && (io.indices == nil || io.values == nil):
		return fail("indices or values is NULL")
	}
	dt, err := dtypeOf(dtype)
	if err != nil {
		return in, core.Config{}, core.CallOptions{}, err
	}
	cfg, opts, err := readCallOptions(options, c.settings.sparse, n)
	if err != nil {
		return in, core.Config{}, core.CallOptions{}, err
	}
	if opts.MeasureXi || len(opts.Hold) > 0 {
		return fail("a caller-selected call measures no xi and holds nothing back (leave held entries out of the selection)")
	}
	opts.SparseOnly = false
	opts.Dtype = dt
	most := uint64(core.SelectedCapacity(int(n), cfg.K(int(n)), c.Size))
	switch {
	case uint64(io.result_capacity) < most || uint64(io.error_capacity) < most:
		return fail("result_capacity %d and error_capacity %d must be at least oktopk_selected_capacity, %d",
			uint64(io.result_capacity), uint64(io.error_capacity), most)
	case io.consumed_capacity < io.count:
		return fail("consumed_capacity %d < count %d", uint64(io.consumed_capacity), uint64(io.count))
	case io.result_indices == nil || io.result_values == nil || io.error_indices == nil || io.error_values == nil:
		return fail("result or error buffers are NULL")
	case io.count > 0 && (io.consumed_indices == nil || io.consumed_values == nil):
		return fail("consumed buffers are NULL")
	}
	th := float32(io.threshold)
	if math.IsNaN(float64(th)) {
		return fail("threshold is NaN")
	}
	in.sel = core.Sparse{
		Idx: unsafe.Slice((*uint32)(unsafe.Pointer(io.indices)), int(io.count)),
		Val: unsafe.Slice((*float32)(unsafe.Pointer(io.values)), int(io.count)),
	}
	in.threshold, in.nonFinite = th, io.non_finite != 0
	return in, cfg, opts, nil
}

// writePairs copies s into the caller's arrays (sized by the caller to
// hold it) and returns its length.
func writePairs(s core.Sparse, idx *C.uint32_t, val *C.float) int {
	if s.Len() > 0 {
		copy(unsafe.Slice((*uint32)(unsafe.Pointer(idx)), s.Len()), s.Idx)
		copy(unsafe.Slice((*float32)(unsafe.Pointer(val)), s.Len()), s.Val)
	}
	return s.Len()
}

//export go_oktopk_tensor_state_save_residual
func go_oktopk_tensor_state_save_residual(comm C.oktopk_comm_t, tensorID C.uint64_t, residual *C.oktopk_const_float, n C.size_t,
	buf unsafe.Pointer, size C.size_t) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		if buf == nil || (n > 0 && residual == nil) {
			return invalidArgument("buf or residual is NULL")
		}
		var b []byte
		_, err := c.do(true, func(_ context.Context, cc *core.Communicator) (core.Stats, error) {
			st := cc.TensorStateOf(uint64(tensorID))
			if st == nil {
				return core.Stats{}, invalidArgument("tensor %d has no state yet (no sparse allreduce or load on it)", uint64(tensorID))
			}
			var err error
			b, err = st.MarshalWithResidual(unsafe.Slice((*float32)(unsafe.Pointer(residual)), int(n)))
			return core.Stats{}, err
		})
		if err != nil {
			return err
		}
		if uint64(size) < uint64(len(b)) {
			return invalidArgument("state of tensor %d needs %d bytes, buffer has %d", uint64(tensorID), len(b), uint64(size))
		}
		copy(unsafe.Slice((*byte)(buf), len(b)), b)
		return nil
	})
}

//export go_oktopk_tensor_state_load_residual
func go_oktopk_tensor_state_load_residual(comm C.oktopk_comm_t, tensorID C.uint64_t, buf *C.oktopk_const_void, size C.size_t,
	residual *C.float, n C.size_t) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		if buf == nil || size == 0 || (n > 0 && residual == nil) {
			return invalidArgument("buf or residual is NULL, or len is 0")
		}
		if uint64(size) > math.MaxInt32 {
			return invalidArgument("state of %d bytes is larger than any tensor state", uint64(size))
		}
		b := C.GoBytes(unsafe.Pointer(buf), C.int(size))
		_, err := c.do(true, func(_ context.Context, cc *core.Communicator) (core.Stats, error) {
			st, err := c.checkedState(uint64(tensorID), b)
			if err != nil {
				return core.Stats{}, err
			}
			if st.N != int(n) {
				return core.Stats{}, invalidArgument("tensor %d: the state is of %d elements, the residual buffer of %d", uint64(tensorID), st.N, uint64(n))
			}
			copy(unsafe.Slice((*float32)(unsafe.Pointer(residual)), int(n)), st.TakeResidual())
			cc.SetTensorState(uint64(tensorID), st)
			return core.Stats{}, nil
		})
		return err
	})
}
