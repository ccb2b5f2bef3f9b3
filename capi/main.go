// Package main is liboktopk's C ABI: //export shims over packages core and
// transport. Nothing else lives here. See include/oktopk.h for the contract.
//
// The exported names are abi.c's, which refuses a child made by fork()
// before any Go code runs and then calls the go_oktopk_* export here. Every
// export that returns a result code gets it from resultOf (errors.go);
// every one but oktopk_get_last_error runs its body through call, or
// callOn for a communicator handle, which recovers panics into
// oktopkInternalError and records the failure's message.
//
// The files: main.go the library-wide exports; lifecycle.go the
// communicator's making, queries, abort and destroy; collectives.go the
// allreduces and their requests; state.go per-tensor state; selection.go
// top-k and threshold selection; errors.go result codes, call and the last
// error; handles.go the handle table; worker.go the communicator and its
// worker; connect.go rendezvous; convert.go the C structs; env.go,
// memory.go and thread.go the process's environment, collector and
// threads; quantize.c the blockwise rounding of the PyTorch plugin's
// quantized allreduce (plain C: no Go runtime entry).
package main

/*
#cgo CFLAGS: -O3
#include "const_types.h"
*/
import "C"

import (
	"runtime"

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

//export go_oktopk_algorithm_takes_reduced_values
func go_oktopk_algorithm_takes_reduced_values(algorithm C.int) C.int {
	if algorithm < 0 || int(algorithm) >= len(algorithmNames) {
		return -1
	}
	if core.Algorithm(algorithm).TakesReducedValues() {
		return 1
	}
	return 0
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

// go_oktopk_get_last_error is not run through call: reading the last error
// must not replace it, so its own failures are not recorded.
//
//export go_oktopk_get_last_error
func go_oktopk_get_last_error(comm C.oktopk_comm_t, buf *C.char, n C.size_t, truncated *C.int) C.oktopk_result_t {
	if buf == nil || n == 0 {
		return resultOf(invalidArgument("buf is NULL or len is 0"))
	}
	msg := globalLastError.get()
	var err error
	if comm != 0 {
		var c *communicator
		if c, err = lookup(comm); err != nil {
			msg = err.Error() // which handle is wrong, and why
		} else {
			msg = c.lastError.get()
		}
	}
	cut := copyMessage(msg, buf, n)
	if truncated != nil {
		*truncated = boolInt(cut)
	}
	return resultOf(err)
}

//export go_oktopk_debug_goroutines
func go_oktopk_debug_goroutines() C.int {
	return C.int(runtime.NumGoroutine())
}
