package main

// Per-tensor state (residual, thresholds, counters) for checkpoints: the
// exports that size, save and load it, and how a save and a load run on the
// communicator's queue.

/*
#include "const_types.h"
*/
import "C"

import (
	"context"
	"math"
	"strings"
	"unsafe"

	"github.com/oktopk/oktopk/core"
)

//export go_oktopk_tensor_state_size
func go_oktopk_tensor_state_size(comm C.oktopk_comm_t, tensorID C.uint64_t, size *C.size_t) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		if size == nil {
			return invalidArgument("size is NULL")
		}
		_, err := c.do(true, func(_ context.Context, cc *core.Communicator) (core.Stats, error) {
			st := cc.TensorStateOf(uint64(tensorID))
			if st == nil {
				return core.Stats{}, invalidArgument("tensor %d has no state yet (no sparse allreduce or load on it)", uint64(tensorID))
			}
			*size = C.size_t(st.MarshaledSize())
			return core.Stats{}, nil
		})
		return err
	})
}

//export go_oktopk_tensor_state_save
func go_oktopk_tensor_state_save(comm C.oktopk_comm_t, tensorID C.uint64_t, buf unsafe.Pointer, n C.size_t) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
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
	return callOn(comm, func(c *communicator) error {
		b, err := stateBytes(buf, n)
		if err != nil {
			return err
		}
		return c.loadState(uint64(tensorID), b)
	})
}

// stateBytes copies a caller's saved tensor state, refusing a NULL, empty
// or impossibly large one.
func stateBytes(buf *C.oktopk_const_void, n C.size_t) ([]byte, error) {
	if buf == nil || n == 0 {
		return nil, invalidArgument("buf is NULL or len is 0")
	}
	if uint64(n) > math.MaxInt32 {
		return nil, invalidArgument("state of %d bytes is larger than any tensor state", uint64(n))
	}
	return C.GoBytes(unsafe.Pointer(buf), C.int(n)), nil
}

//export go_oktopk_tensor_state_load_regrouped
func go_oktopk_tensor_state_load_regrouped(comm C.oktopk_comm_t, tensorID C.uint64_t, buf *C.oktopk_const_void, n C.size_t) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		b, err := stateBytes(buf, n)
		if err != nil {
			return err
		}
		_, err = c.do(true, func(_ context.Context, cc *core.Communicator) (core.Stats, error) {
			st := new(core.TensorState)
			if err := st.UnmarshalBinary(b); err != nil {
				return core.Stats{}, invalidArgument("tensor %d: %s", uint64(tensorID), withoutSentinel(err, core.ErrInvalidArgument))
			}
			st.Regroup(c.Rank, c.Size)
			cc.SetTensorState(uint64(tensorID), st)
			return core.Stats{}, nil
		})
		return err
	})
}

// Tensor state save and load go through the communicator's queue, so a save
// sees every call issued before it, and a load applies before every call
// issued after it. They are local: they still work after an abort, and from
// any thread. A save after a failure holds this rank's state, which may
// differ by the failed call from its peers' (the call may have completed on
// some ranks); include/oktopk.h says what to restart from instead.

func (c *communicator) saveState(id uint64) ([]byte, error) {
	var out []byte
	_, err := c.do(true, func(_ context.Context, cc *core.Communicator) (core.Stats, error) {
		st := cc.TensorStateOf(id)
		if st == nil {
			return core.Stats{}, invalidArgument("tensor %d has no state yet (no sparse allreduce or load on it)", id)
		}
		var err error
		out, err = st.MarshalBinary()
		return core.Stats{}, err
	})
	return out, err
}

// loadState refuses, before the state is installed, a state saved by another
// rank or by a communicator of another size (the blob records both): loaded,
// it would make the run drift from the uninterrupted one, or fail only at
// the tensor's next sparse allreduce.
func (c *communicator) loadState(id uint64, b []byte) error {
	_, err := c.do(true, func(_ context.Context, cc *core.Communicator) (core.Stats, error) {
		st, err := c.checkedState(id, b)
		if err != nil {
			return core.Stats{}, err
		}
		cc.SetTensorState(id, st)
		return core.Stats{}, nil
	})
	return err
}

// checkedState is the state in b, refused if malformed or another rank's
// or another size's.
func (c *communicator) checkedState(id uint64, b []byte) (*core.TensorState, error) {
	st := new(core.TensorState)
	if err := st.UnmarshalBinary(b); err != nil {
		return nil, invalidArgument("tensor %d: %s", id, withoutSentinel(err, core.ErrInvalidArgument))
	}
	if err := st.CheckOwner(c.Rank, c.Size); err != nil {
		return nil, invalidArgument("tensor %d: %s", id, withoutSentinel(err, core.ErrInvalidArgument))
	}
	st.Rank, st.Size = c.Rank, c.Size // a version-1 state's next save records them
	return st, nil
}

// withoutSentinel is err's message without sentinel's leading text, for a
// message that adds context and wraps the same sentinel again: wrapping err
// whole would read "oktopk: invalid argument: tensor 7: oktopk: invalid
// argument: ...".
func withoutSentinel(err, sentinel error) string {
	return strings.TrimPrefix(err.Error(), sentinel.Error()+": ")
}

//export go_oktopk_tensor_residual_fold
func go_oktopk_tensor_residual_fold(comm C.oktopk_comm_t, tensorID C.uint64_t, data unsafe.Pointer, count C.size_t, dtype C.oktopk_dtype_t,
	hold *C.oktopk_const_size_t, holdCount C.size_t) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		if err := checkBuffer(data, count, dtype); err != nil {
			return err
		}
		spans, err := readHold(unsafe.Pointer(hold), holdCount, count)
		if err != nil {
			return err
		}
		_, err = c.do(true, func(_ context.Context, cc *core.Communicator) (core.Stats, error) {
			return c.Widener.Run(buffer(data, int(count), dtype), func(x []float32) (core.Stats, error) {
				return core.Stats{}, cc.FoldResidual(uint64(tensorID), x, spans, valueTypeOf(dtype))
			})
		})
		return err
	})
}

//export go_oktopk_tensor_residual_read
func go_oktopk_tensor_residual_read(comm C.oktopk_comm_t, tensorID C.uint64_t, data unsafe.Pointer, count C.size_t) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		if err := checkBuffer(data, count, C.OKTOPK_FLOAT32); err != nil {
			return err
		}
		_, err := c.do(true, func(_ context.Context, cc *core.Communicator) (core.Stats, error) {
			return core.Stats{}, cc.ReadResidual(uint64(tensorID), unsafe.Slice((*float32)(data), int(count)))
		})
		return err
	})
}

//export go_oktopk_tensor_residual_zeros
func go_oktopk_tensor_residual_zeros(comm C.oktopk_comm_t, tensorID C.uint64_t, n C.size_t, before *C.oktopk_const_uint8, zero *C.uint8_t, became *C.int64_t, capacity C.size_t, count *C.size_t) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		switch {
		case n == 0:
			return invalidArgument("n is 0")
		case uint64(n) > core.MaxElements:
			return invalidArgument("n = %d exceeds %d elements", uint64(n), uint64(core.MaxElements))
		case zero == nil:
			return invalidArgument("zero is NULL")
		case before != nil && capacity > 0 && became == nil:
			return invalidArgument("became is NULL")
		case count == nil:
			return invalidArgument("count is NULL")
		}
		var prior []byte
		if before != nil {
			prior = unsafe.Slice((*byte)(unsafe.Pointer(before)), int(n))
		}
		var list []int64
		if became != nil && capacity > 0 {
			list = unsafe.Slice((*int64)(unsafe.Pointer(became)), int(min(uint64(capacity), uint64(n))))
		}
		marks := unsafe.Slice((*byte)(unsafe.Pointer(zero)), int(n))
		_, err := c.do(true, func(_ context.Context, cc *core.Communicator) (core.Stats, error) {
			listed, err := cc.ResidualZeros(uint64(tensorID), prior, marks, list)
			*count = C.size_t(listed)
			return core.Stats{}, err
		})
		return err
	})
}

//export go_oktopk_tensor_residual_unfold
func go_oktopk_tensor_residual_unfold(comm C.oktopk_comm_t, tensorID C.uint64_t) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		_, err := c.do(true, func(_ context.Context, cc *core.Communicator) (core.Stats, error) {
			return core.Stats{}, cc.UnfoldResidual(uint64(tensorID))
		})
		return err
	})
}

//export go_oktopk_tensor_undo_call
func go_oktopk_tensor_undo_call(comm C.oktopk_comm_t, tensorID C.uint64_t) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		_, err := c.do(true, func(_ context.Context, cc *core.Communicator) (core.Stats, error) {
			return core.Stats{}, cc.UndoCall(uint64(tensorID))
		})
		return err
	})
}

// valueTypeOf is the value type of a caller's element type.
func valueTypeOf(dtype C.oktopk_dtype_t) core.ValueType {
	switch dtype {
	case C.OKTOPK_FLOAT16:
		return core.ValuesFloat16
	case C.OKTOPK_BFLOAT16:
		return core.ValuesBFloat16
	}
	return core.ValuesFloat32
}
