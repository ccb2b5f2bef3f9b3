package main

// Environment reads through libc's getenv, so a setenv made after the
// library was loaded counts.

/*
#include <stdlib.h>
*/
import "C"

import (
	"unsafe"

	"github.com/oktopk/oktopk/transport"
)

// The library's Go runtime copied the environment when the library was
// loaded and never sees a later setenv(3) (golang/go#27693), so a setting a
// C program sets in main(), or a Python script in os.environ, after loading
// liboktopk would be ignored without a word (OKTOPK_CURVE among them). Every
// environment read in the library goes through transport.Getenv; here it
// becomes libc's getenv, which sees the process's environment as it is now.
func init() { transport.SetGetenv(libcGetenv) }

func libcGetenv(key string) string {
	k := C.CString(key)
	defer C.free(unsafe.Pointer(k))
	v := C.getenv(k)
	if v == nil {
		return ""
	}
	return C.GoString(v)
}
