package transport

import (
	"strings"
	"testing"
	"time"
)

// Every environment setting of the transport goes through Getenv at the
// moment it is used, so the lookup the C ABI installs (libc's getenv, which
// sees a setenv made after load) decides them all.
func TestEnvironmentSettingsAreReadThroughTheInstalledLookupAtUse(t *testing.T) {
	env := map[string]string{}
	SetGetenv(func(k string) string { return env[k] })
	t.Cleanup(func() { SetGetenv(nil) })

	if CurveFromEnv() {
		t.Fatal("CURVE on with OKTOPK_CURVE unset")
	}
	env["OKTOPK_CURVE"] = "1"
	if !CurveFromEnv() {
		t.Fatal("OKTOPK_CURVE=1 set after start not seen")
	}

	env["OKTOPK_SOCKET_IFNAME"] = "oktopk-none0"
	if _, err := ResolveBindHost("", ""); err == nil || !strings.Contains(err.Error(), `"oktopk-none0"`) {
		t.Fatalf("OKTOPK_SOCKET_IFNAME set after start not seen: %v", err)
	}

	env["OKTOPK_STALL_WARN"] = "250ms"
	if d := (Diagnostics{}).withDefaults().StallWarn; d != 250*time.Millisecond {
		t.Fatalf("OKTOPK_STALL_WARN=250ms gave %v", d)
	}

	env["MASTER_ADDR"], env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"] = "127.0.0.1", "0", "1", "x"
	if _, err := InitFromEnv(t.Context(), ZMQOptions{}); err == nil || !strings.Contains(err.Error(), `MASTER_PORT="x"`) {
		t.Fatalf("MASTER_PORT set after start not seen: %v", err)
	}
}
