//go:build race

package tests

// raceEnabled lets a test shrink work that the race detector makes slow
// without anything to add (its code paths are raced at smaller sizes). A
// test that shrinks is named in the Makefile's GO_TESTS_THAT_SHRINK, so that
// test-go's second pass, without the race detector, runs it at full size.
const raceEnabled = true
