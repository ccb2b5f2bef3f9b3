package transport

// Getenv and SetGetenv: the one lookup through which the transport reads
// its environment settings, at the moment each is used.

import (
	"os"
	"sync/atomic"
)

// The transport's settings from the environment (OKTOPK_SOCKET_IFNAME,
// OKTOPK_CURVE, OKTOPK_STALL_WARN, and InitFromEnv's MASTER_ADDR,
// MASTER_PORT, RANK, WORLD_SIZE, OKTOPK_RENDEZVOUS_PORT, OKTOPK_JOB_TOKEN)
// are read at the moment they are used, through Getenv, never cached.
//
// os.Getenv is right for a Go program, but not inside liboktopk: the Go
// runtime of a c-shared library copies the environment once, when the
// library is loaded, and never sees a later setenv(3) (golang/go#27693).
// A training script that sets os.environ["OKTOPK_CURVE"] = "1" after
// importing its framework would then run unencrypted without a word. The C
// ABI therefore installs libc's getenv here at load.
var getenv atomic.Pointer[func(string) string]

// SetGetenv makes f the transport's environment lookup; nil restores
// os.Getenv.
func SetGetenv(f func(string) string) {
	if f == nil {
		getenv.Store(nil)
		return
	}
	getenv.Store(&f)
}

// Getenv is the value of the environment variable key as the process sees
// it now ("" when unset).
func Getenv(key string) string {
	if f := getenv.Load(); f != nil {
		return (*f)(key)
	}
	return os.Getenv(key)
}
