// Package main is liboktopk's C ABI: //export shims over packages core and
// transport. Nothing else lives here. See include/oktopk.h for the contract.
package main

/*
#include "../include/oktopk.h"
*/
import "C"

//export oktopk_get_version
func oktopk_get_version() C.int { return C.OKTOPK_VERSION_CODE }

func main() {}
