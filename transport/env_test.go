package transport

// Tests that the transport's environment settings are read through the
// lookup SetGetenv installs, at the moment they are used.

import (
	"strings"
	"testing"
	"time"
)

// Every environment setting of the transport goes through Getenv at the
// moment it is used, so the lookup the C ABI installs (libc's getenv, which
// sees a setenv made after load) decides them all (package zmq tests its
// own: OKTOPK_CURVE, and the launcher's variables InitFromEnv reads).
func TestEnvironmentSettingsAreReadThroughTheInstalledLookupAtUse(t *testing.T) {
	env := map[string]string{}
	SetGetenv(func(k string) string { return env[k] })
	t.Cleanup(func() { SetGetenv(nil) })

	env["OKTOPK_SOCKET_IFNAME"] = "oktopk-none0"
	if _, err := ResolveBindHost("", ""); err == nil || !strings.Contains(err.Error(), `"oktopk-none0"`) {
		t.Fatalf("OKTOPK_SOCKET_IFNAME set after start not seen: %v", err)
	}

	env["OKTOPK_STALL_WARN"] = "250ms"
	if d := (Diagnostics{}).withDefaults().StallWarn; d != 250*time.Millisecond {
		t.Fatalf("OKTOPK_STALL_WARN=250ms gave %v", d)
	}
}
