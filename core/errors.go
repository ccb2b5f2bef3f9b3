package core

// The errors of package core: invalid argument, invalid usage, a gradient
// holding NaN or Inf, and a mismatch between ranks.

import (
	"errors"

	"github.com/oktopk/oktopk/transport"
)

// Errors of package core; transport's errors (timeout, aborted, mismatch,
// remote) pass through wrapped. The C ABI maps each to one result code.
var (
	ErrInvalidArgument = transport.ErrInvalidArgument
	ErrInvalidUsage    = errors.New("oktopk: invalid usage")
	ErrNonFinite       = errors.New("oktopk: gradient holds NaN or Inf")
	ErrMismatch        = transport.ErrMismatch
)
