// Package tests holds oktopk's cross-process Go tests: rank processes
// (tests/cmd/rank) joined over real ZeroMQ sockets on this machine, checked
// for exact sums, bitwise-identical results on every rank, and clear errors
// on dead, slow and mismatched peers, wrong tokens and garbage on the port.
// Its subfolders hold the other languages' tests (c, python, horovod, wheel,
// launch) and the commands the tests run (cmd).
package tests
