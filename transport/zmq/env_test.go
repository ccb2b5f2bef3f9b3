package zmq

// Tests that this package's environment settings (OKTOPK_CURVE, the
// launcher's variables) are read through transport.Getenv at use.

import (
	"strings"
	"testing"

	"github.com/oktopk/oktopk/transport"
)

// The ZeroMQ transport's environment settings go through transport.Getenv
// at the moment they are used, so the lookup the C ABI installs (libc's
// getenv, which sees a setenv made after load) decides them too (the
// package transport's own settings are tested there).
func TestEnvironmentSettingsAreReadThroughTheInstalledLookupAtUse(t *testing.T) {
	env := map[string]string{}
	transport.SetGetenv(func(k string) string { return env[k] })
	t.Cleanup(func() { transport.SetGetenv(nil) })

	if CurveFromEnv() {
		t.Fatal("CURVE on with OKTOPK_CURVE unset")
	}
	env["OKTOPK_CURVE"] = "1"
	if !CurveFromEnv() {
		t.Fatal("OKTOPK_CURVE=1 set after start not seen")
	}

	env["MASTER_ADDR"], env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"] = "127.0.0.1", "0", "1", "x"
	if _, err := InitFromEnv(t.Context(), Options{}); err == nil || !strings.Contains(err.Error(), `MASTER_PORT="x"`) {
		t.Fatalf("MASTER_PORT set after start not seen: %v", err)
	}
}
