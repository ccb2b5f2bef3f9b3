package main

// oktopk_predict_call: Auto's cost model for one call, without a
// communicator (core.LinkModel.PredictCall), for planners that compose
// calls into a training step.

/*
#include "const_types.h"
*/
import "C"

import (
	"math"
	"unsafe"

	"github.com/oktopk/oktopk/core"
)

//export go_oktopk_predict_call
func go_oktopk_predict_call(link *C.oktopk_const_link_model, algorithm C.int, n C.int64_t, nranks C.int,
	config *C.oktopk_const_config, ran *C.int, seconds *C.double, bytesPerRank *C.double) C.oktopk_result_t {
	return call(0, func() error {
		switch {
		case link == nil || seconds == nil:
			return invalidArgument("link or seconds is NULL")
		case link.size < C.uint32_t(unsafe.Offsetof(link.pass_seconds_per_byte)+8):
			return invalidArgument("link.size is %d; set it to sizeof(oktopk_link_model_t)", link.size)
		case algorithm < 0 || !core.Algorithm(algorithm).Valid():
			return invalidArgument("unknown algorithm %d", int(algorithm))
		case n < 1 || uint64(n) > core.MaxElements:
			return invalidArgument("n = %d: want 1 to %d elements", int64(n), uint64(core.MaxElements))
		case nranks < 1:
			return invalidArgument("nranks = %d: want at least 1", int(nranks))
		}
		m := core.LinkModel{Alpha: float64(link.latency_seconds), Beta: float64(link.seconds_per_byte),
			Gamma: float64(link.pass_seconds_per_byte)}
		if !m.Valid() {
			return invalidArgument("link model %v: every figure must be finite and >= 0", m)
		}
		s, err := readConfig((*C.oktopk_config_t)(config))
		if err != nil {
			return err
		}
		t, b, a := m.PredictCall(core.Algorithm(algorithm), int(n), int(nranks), s.sparse)
		if math.IsInf(t, 0) || math.IsNaN(t) {
			return invalidArgument("the prediction overflows (%v s): the link model's figures are too large", t)
		}
		*seconds = C.double(t)
		if bytesPerRank != nil {
			*bytesPerRank = C.double(b)
		}
		if ran != nil {
			*ran = C.int(a)
		}
		return nil
	})
}
