//go:build ppc64 || s390x || mips || mips64

package core

// On a big-endian machine a 64-bit word read from x[e:e+2] holds x[e] in
// its high half: the top (sign) bits of the two entries are bits 63 and 31.
const (
	firstEntryTopBit  = 63
	secondEntryTopBit = 31
)
