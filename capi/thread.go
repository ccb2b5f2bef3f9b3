package main

// Which C thread is calling: collectives on one communicator come from one
// thread at a time.

/*
#include <pthread.h>
#include <stdint.h>

static uintptr_t oktopk_caller_thread(void) { return (uintptr_t)pthread_self(); }
*/
import "C"

// callerThread identifies the C thread that called into the library: while
// an export runs, its goroutine runs on the caller's thread.
func callerThread() uintptr { return uintptr(C.oktopk_caller_thread()) }
