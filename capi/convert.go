package main

// The C structs read and written at the boundary: oktopk_config_t into the
// communicator's settings, the stats and link model out, call options and
// held ranges in; and the operations built over a caller's buffer, in any
// of its dtypes.

/*
#include "../include/oktopk.h"
*/
import "C"

import (
	"context"
	"time"
	"unsafe"

	"github.com/oktopk/oktopk/binding"
	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
)

// settings is a communicator's configuration, read once from the caller's
// oktopk_config_t.
type settings struct {
	timeout  time.Duration // per call; 0: none
	bindHost string
	ifname   string
	curve    bool // CURVE encryption (config.curve or $OKTOPK_CURVE)
	sparse   core.Config
}

func defaultSettings() settings {
	return settings{timeout: 60 * time.Second, sparse: core.DefaultConfig()}
}

// minConfigSize is the smallest config a caller can pass: size and version.
const minConfigSize = C.size_t(8)

// readConfig reads the fields that fit in cfg.size, so a caller built
// against an older, shorter oktopk_config_t keeps working. A NULL config
// means the defaults.
func readConfig(cfg *C.oktopk_config_t) (settings, error) {
	s := defaultSettings()
	if cfg == nil {
		return s, nil
	}
	size := uintptr(cfg.size)
	if size < uintptr(minConfigSize) {
		return s, invalidArgument("config.size is %d; initialise the config with oktopk_config_init", size)
	}
	has := func(offset, width uintptr) bool { return offset+width <= size }
	if has(unsafe.Offsetof(cfg.timeout_ms), 4) {
		if cfg.timeout_ms < 0 {
			return s, invalidArgument("config.timeout_ms %d < 0", cfg.timeout_ms)
		}
		s.timeout = time.Duration(cfg.timeout_ms) * time.Millisecond
	}
	if has(unsafe.Offsetof(cfg.bind_host), unsafe.Sizeof(cfg.bind_host)) && cfg.bind_host != nil {
		s.bindHost = C.GoString(cfg.bind_host)
	}
	if has(unsafe.Offsetof(cfg.ifname), unsafe.Sizeof(cfg.ifname)) && cfg.ifname != nil {
		s.ifname = C.GoString(cfg.ifname)
	}
	if has(unsafe.Offsetof(cfg.algorithm), 4) {
		s.sparse.Algorithm = core.Algorithm(cfg.algorithm)
	}
	if has(unsafe.Offsetof(cfg.density), 8) {
		s.sparse.Density = float64(cfg.density)
	}
	if has(unsafe.Offsetof(cfg.tau), 4) {
		s.sparse.Tau = int(cfg.tau)
	}
	if has(unsafe.Offsetof(cfg.tau_prime), 4) {
		s.sparse.TauPrime = int(cfg.tau_prime)
	}
	if has(unsafe.Offsetof(cfg.value_dtype), 4) {
		v := cfg.value_dtype
		s.sparse.Stochastic = v&C.OKTOPK_STOCHASTIC_ROUNDING != 0
		switch v &^ C.OKTOPK_STOCHASTIC_ROUNDING {
		case C.OKTOPK_FLOAT32:
			s.sparse.Values = core.ValuesFloat32
		case C.OKTOPK_FLOAT16:
			s.sparse.Values = core.ValuesFloat16
		case C.OKTOPK_BFLOAT16:
			s.sparse.Values = core.ValuesBFloat16
		case C.OKTOPK_INT8:
			s.sparse.Values = core.ValuesInt8
		case C.OKTOPK_INT4:
			s.sparse.Values = core.ValuesInt4
		default:
			return s, invalidArgument("config.value_dtype %#x: want OKTOPK_FLOAT32, OKTOPK_FLOAT16, OKTOPK_BFLOAT16 "+
				"(optionally | OKTOPK_STOCHASTIC_ROUNDING), OKTOPK_INT8 or OKTOPK_INT4", int32(v))
		}
	}
	if has(unsafe.Offsetof(cfg.curve), 4) {
		switch cfg.curve {
		case 0:
		case 1:
			s.curve = true
		default:
			return s, invalidArgument("config.curve %d: want 0 or 1 (initialise the config with oktopk_config_init)", cfg.curve)
		}
	}
	if err := s.sparse.Validate(); err != nil {
		return s, err
	}
	return s, nil
}

// oktopk_config_init writes a whole oktopk_config_t into the caller's, so
// the struct must never outgrow what callers built against 0.2 allocated
// (value_dtype was its last field): new fields go into the tail padding, or
// need a sized init call. The two lines below fail to compile otherwise.
var configLayout C.oktopk_config_t

const configSize02 = (unsafe.Offsetof(configLayout.value_dtype) + 4 + unsafe.Alignof(configLayout) - 1) /
	unsafe.Alignof(configLayout) * unsafe.Alignof(configLayout)

var _ [configSize02 - unsafe.Sizeof(configLayout)]struct{}
var _ [unsafe.Sizeof(configLayout) - configSize02]struct{}

func writeDefaultConfig(cfg *C.oktopk_config_t) {
	d := defaultSettings()
	*cfg = C.oktopk_config_t{
		size:        C.uint32_t(unsafe.Sizeof(*cfg)),
		version:     C.OKTOPK_VERSION_CODE,
		timeout_ms:  C.int32_t(d.timeout / time.Millisecond),
		algorithm:   C.int32_t(d.sparse.Algorithm),
		density:     C.double(d.sparse.Density),
		tau:         C.int32_t(d.sparse.Tau),
		tau_prime:   C.int32_t(d.sparse.TauPrime),
		value_dtype: C.OKTOPK_FLOAT32,
	}
}

// writeStats fills the fields of out that fit in out.size.
func writeStats(out *C.oktopk_stats_t, st core.Stats) error {
	if out == nil {
		return nil
	}
	size := uintptr(out.size)
	if size < 4 {
		return invalidArgument("stats.size is %d; set it to sizeof(oktopk_stats_t)", size)
	}
	has := func(offset, width uintptr) bool { return offset+width <= size }
	u64 := func(p *C.uint64_t, v uint64) {
		if has(uintptr(unsafe.Pointer(p))-uintptr(unsafe.Pointer(out)), 8) {
			*p = C.uint64_t(v)
		}
	}
	i64 := func(p *C.int64_t, v int) {
		if has(uintptr(unsafe.Pointer(p))-uintptr(unsafe.Pointer(out)), 8) {
			*p = C.int64_t(v)
		}
	}
	i32 := func(p *C.int32_t, v int) {
		if has(uintptr(unsafe.Pointer(p))-uintptr(unsafe.Pointer(out)), 4) {
			*p = C.int32_t(v)
		}
	}
	f32 := func(p *C.float, v float32) {
		if has(uintptr(unsafe.Pointer(p))-uintptr(unsafe.Pointer(out)), 4) {
			*p = C.float(v)
		}
	}
	f64 := func(p *C.double, v float64) {
		if has(uintptr(unsafe.Pointer(p))-uintptr(unsafe.Pointer(out)), 8) {
			*p = C.double(v)
		}
	}
	sec := func(p *C.double, d time.Duration) {
		if has(uintptr(unsafe.Pointer(p))-uintptr(unsafe.Pointer(out)), 8) {
			*p = C.double(d.Seconds())
		}
	}
	u64(&out.bytes_sent, st.BytesSent)
	u64(&out.bytes_received, st.BytesReceived)
	u64(&out.messages_sent, st.MessagesSent)
	u64(&out.messages_received, st.MessagesReceived)
	i64(&out.k, st.K)
	i64(&out.local_selected, st.LocalSelected)
	i64(&out.global_selected, st.GlobalSelected)
	f32(&out.local_threshold, st.LocalThreshold)
	f32(&out.global_threshold, st.GlobalThreshold)
	sec(&out.select_seconds, st.Time(core.PhaseSelect))
	sec(&out.reduce_seconds, st.Time(core.PhaseReduce))
	sec(&out.allgather_seconds, st.Time(core.PhaseBalance)+st.Time(core.PhaseAllgather))
	sec(&out.total_seconds, st.Total)
	sec(&out.agree_seconds, st.Time(core.PhaseAgree))
	sec(&out.global_select_seconds, st.Time(core.PhaseGlobalSelect))
	sec(&out.balance_seconds, st.Time(core.PhaseBalance))
	sec(&out.output_seconds, st.Time(core.PhaseOutput))
	// Added in 0.4: Auto's choice.
	i32(&out.algorithm, int(st.Algorithm))
	sec(&out.predicted_seconds, st.Predicted)
	// Added in 0.5: xi, -1 when not measured.
	xi, norm := -1.0, -1.0
	if st.XiMeasured {
		xi, norm = st.Xi, st.XiGradNorm
	}
	f64(&out.xi, xi)
	f64(&out.xi_gradient_norm, norm)
	// Added in 0.7: xi's traffic.
	u64(&out.xi_bytes_sent, st.XiBytesSent)
	u64(&out.xi_bytes_received, st.XiBytesReceived)
	return nil
}

// writeLinkModel fills the fields of out that fit in out.size.
func writeLinkModel(out *C.oktopk_link_model_t, m core.LinkModel) {
	size := uintptr(out.size)
	put := func(p *C.double, v float64) {
		if uintptr(unsafe.Pointer(p))-uintptr(unsafe.Pointer(out))+8 <= size {
			*p = C.double(v)
		}
	}
	put(&out.latency_seconds, m.Alpha)
	put(&out.seconds_per_byte, m.Beta)
	put(&out.pass_seconds_per_byte, m.Gamma)
}

func checkStats(out *C.oktopk_stats_t) error {
	if out != nil && out.size < 4 {
		return invalidArgument("stats.size is %d; set it to sizeof(oktopk_stats_t)", out.size)
	}
	return nil
}

func checkRank(rank, size int) error {
	if size < 1 || rank < 0 || rank >= size {
		return invalidArgument("rank %d of %d ranks", rank, size)
	}
	return nil
}

func boolInt(b bool) C.int {
	if b {
		return 1
	}
	return 0
}

func checkBuffer(data unsafe.Pointer, count C.size_t, dtype C.oktopk_dtype_t) error {
	switch {
	case data == nil:
		return invalidArgument("data is NULL")
	case count == 0:
		return invalidArgument("count is 0")
	case uint64(count) > core.MaxElements:
		return invalidArgument("count %d exceeds %d elements", uint64(count), uint64(core.MaxElements))
	}
	switch dtype {
	case C.OKTOPK_FLOAT32, C.OKTOPK_FLOAT16, C.OKTOPK_BFLOAT16:
		return nil
	}
	return invalidArgument("unknown dtype %d", int(dtype))
}

// dtypeOf is the element type the frames of a call on dtype carry.
func dtypeOf(dtype C.oktopk_dtype_t) (transport.Dtype, error) {
	switch dtype {
	case C.OKTOPK_FLOAT32:
		return transport.DtypeFloat32, nil
	case C.OKTOPK_FLOAT16:
		return transport.DtypeFloat16, nil
	case C.OKTOPK_BFLOAT16:
		return transport.DtypeBFloat16, nil
	}
	return 0, invalidArgument("unknown dtype %d", int(dtype))
}

// buffer is the caller's buffer as package binding takes it (checkBuffer
// has refused a bad pointer, count or dtype).
func buffer(data unsafe.Pointer, count int, dtype C.oktopk_dtype_t) binding.Buffer {
	switch dtype {
	case C.OKTOPK_FLOAT16:
		return binding.Buffer{Dtype: transport.DtypeFloat16, Half: unsafe.Slice((*uint16)(data), count)}
	case C.OKTOPK_BFLOAT16:
		return binding.Buffer{Dtype: transport.DtypeBFloat16, Half: unsafe.Slice((*uint16)(data), count)}
	}
	return binding.Float32(unsafe.Slice((*float32)(data), count))
}

// denseOp and sparseOp build the operations the worker runs, on the
// caller's buffer through the communicator's widener.
func denseOp(c *communicator, data unsafe.Pointer, count int, dtype C.oktopk_dtype_t, average bool, alg core.Algorithm) operation {
	return func(ctx context.Context, cc *core.Communicator) (core.Stats, error) {
		return c.Widener.Allreduce(ctx, cc, buffer(data, count, dtype), average, alg)
	}
}

func sparseOp(c *communicator, id uint64, data unsafe.Pointer, count int, dtype C.oktopk_dtype_t, hold []core.Span) operation {
	return sparseOpWith(c, id, data, count, dtype, c.settings.sparse, core.CallOptions{Hold: hold})
}

// sparseOpWith is sparseOp with this call's settings and options.
func sparseOpWith(c *communicator, id uint64, data unsafe.Pointer, count int, dtype C.oktopk_dtype_t, cfg core.Config, opts core.CallOptions) operation {
	return func(ctx context.Context, cc *core.Communicator) (core.Stats, error) {
		return c.Widener.SparseAllreduce(ctx, cc, id, buffer(data, count, dtype), cfg, opts)
	}
}

// readCallOptions reads the fields of the caller's options that fit in its
// size into this call's settings (the communicator's, with the density and
// τ′ replaced when asked) and options. NULL is no options.
func readCallOptions(o *C.oktopk_call_options_t, base core.Config, count C.size_t) (core.Config, core.CallOptions, error) {
	var opts core.CallOptions
	if o == nil {
		return base, opts, nil
	}
	size := uintptr(o.size)
	if size < 8 {
		return base, opts, invalidArgument("options.size is %d; set it to sizeof(oktopk_call_options_t)", size)
	}
	has := func(p unsafe.Pointer, width uintptr) bool {
		return uintptr(p)-uintptr(unsafe.Pointer(o))+width <= size
	}
	const known = C.OKTOPK_CALL_DENSITY | C.OKTOPK_CALL_MEASURE_XI | C.OKTOPK_CALL_TAU_PRIME | C.OKTOPK_CALL_SPARSE_ONLY | C.OKTOPK_CALL_UNDOABLE
	flags := o.flags
	if flags&^known != 0 {
		return base, opts, invalidArgument("options.flags 0x%x has unknown bits 0x%x", uint32(flags), uint32(flags&^known))
	}
	if flags&C.OKTOPK_CALL_DENSITY != 0 {
		if !has(unsafe.Pointer(&o.density), 8) {
			return base, opts, invalidArgument("options.flags asks for a density, and options.size %d leaves it out", size)
		}
		d := float64(o.density)
		if !(d >= 0 && d <= 1) {
			return base, opts, invalidArgument("options.density %v not in [0, 1]", d)
		}
		base.Density = d
	}
	if flags&C.OKTOPK_CALL_TAU_PRIME != 0 {
		if !has(unsafe.Pointer(&o.tau_prime), 4) {
			return base, opts, invalidArgument("options.flags asks for a tau_prime, and options.size %d leaves it out", size)
		}
		if o.tau_prime < 1 {
			return base, opts, invalidArgument("options.tau_prime %d < 1", int32(o.tau_prime))
		}
		base.TauPrime = int(o.tau_prime)
	}
	opts.MeasureXi = flags&C.OKTOPK_CALL_MEASURE_XI != 0
	opts.SparseOnly = flags&C.OKTOPK_CALL_SPARSE_ONLY != 0
	opts.Undoable = flags&C.OKTOPK_CALL_UNDOABLE != 0
	if has(unsafe.Pointer(&o.hold_count), 8) && o.hold_count > 0 {
		spans, err := readHold(unsafe.Pointer(o.hold), o.hold_count, count)
		if err != nil {
			return base, opts, err
		}
		opts.Hold = spans
	}
	return base, opts, nil
}

// readHold copies the caller's held ranges (pairs of size_t) and checks
// them against count, so that the call keeps nothing of the caller's.
func readHold(hold unsafe.Pointer, n C.size_t, count C.size_t) ([]core.Span, error) {
	if n == 0 {
		return nil, nil
	}
	if hold == nil {
		return nil, invalidArgument("hold is NULL with hold_count %d", uint64(n))
	}
	if uint64(n) > uint64(count) {
		return nil, invalidArgument("hold_count %d exceeds count %d (ranges are disjoint and not empty)", uint64(n), uint64(count))
	}
	pairs := unsafe.Slice((*C.size_t)(hold), 2*int(n))
	spans := make([]core.Span, n)
	prev := uint64(0)
	for i := range spans {
		lo, hi := uint64(pairs[2*i]), uint64(pairs[2*i+1])
		if lo < prev || hi <= lo || hi > uint64(count) {
			return nil, invalidArgument("hold range %d [%d, %d) is empty, overlaps the one before, or is not inside count %d", i, lo, hi, uint64(count))
		}
		spans[i] = core.Span{Start: int(lo), End: int(hi)}
		prev = hi
	}
	return spans, nil
}
