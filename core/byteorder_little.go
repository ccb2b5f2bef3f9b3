//go:build !(ppc64 || s390x || mips || mips64)

package core

// On a little-endian machine a 64-bit word read from x[e:e+2] holds x[e] in
// its low half: the top (sign) bits of the two entries are bits 31 and 63.
const (
	firstEntryTopBit  = 31
	secondEntryTopBit = 63
)
