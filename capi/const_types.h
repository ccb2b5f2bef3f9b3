/* The const-qualified names the Go exports spell their parameters with.
 * cgo spells exported parameters from their Go types, which know no const;
 * these names let the generated prototypes match include/oktopk.h's
 * exactly, so the compiler checks every export against the header. Every
 * Go file with an export includes this in its preamble. */
#ifndef OKTOPK_CONST_TYPES_H
#define OKTOPK_CONST_TYPES_H

#include "../include/oktopk.h"

typedef const char oktopk_const_char;
typedef const char *const oktopk_const_string;
typedef const uint8_t oktopk_const_uint8;
typedef const uint32_t oktopk_const_uint32;
typedef const float oktopk_const_float;
typedef const oktopk_config_t oktopk_const_config;
typedef const oktopk_unique_id_t oktopk_const_unique_id;
typedef const void oktopk_const_void;
typedef const size_t oktopk_const_size_t;
typedef const oktopk_call_options_t oktopk_const_call_options;
typedef const oktopk_link_model_t oktopk_const_link_model;

#endif
