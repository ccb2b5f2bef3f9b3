"""The one ctypes binding of liboktopk, shared by the PyTorch and Horovod
front ends (as Horovod's ``common/basics.py`` is).

liboktopk embeds a Go runtime: it is loaded lazily, once per process, and
never unloaded. A child created by ``fork()`` after the library was loaded
must not call into it (the Go runtime's threads do not survive fork); such a
call raises :class:`OkTopkError` here before it reaches the library.
"""

import ctypes
import os
import threading

FLOAT32, FLOAT16, BFLOAT16, INT8, INT4 = 0, 1, 2, 3, 4  # INT8, INT4: config.value_dtype only (8-/4-bit values, scaled per 32)
STOCHASTIC_ROUNDING = 0x100  # or-ed into config.value_dtype
# The formats sparse values travel in, by name: 16-bit floats, or 8- and
# 4-bit codes with a scale per block of 32 (the rounding of each stays in
# the sender's residual, as with 16-bit values).
VALUE_DTYPES = {"float32": FLOAT32, "float16": FLOAT16, "bfloat16": BFLOAT16, "int8": INT8, "int4": INT4}

# oktopk_result_t (include/oktopk.h), the one copy of its values in Python.
SUCCESS = 0
INVALID_ARGUMENT = 1
INVALID_USAGE = 2
SYSTEM_ERROR = 3
REMOTE_ERROR = 4
TIMEOUT = 5
MISMATCH = 6
ABORTED = 7
INTERNAL_ERROR = 8
IN_PROGRESS = 9
NON_FINITE = 10

class OkTopkError(RuntimeError):
    """A liboktopk call failed. ``code`` is the oktopk_result_t value."""

    def __init__(self, code, message):
        self.code = code
        # The library's own messages already open with "oktopk: <what
        # failed>:" (e.g. "oktopk: invalid argument: tensor 7: ..."); only
        # other messages get the result's name in front.
        if not message.startswith("oktopk: "):
            message = f"oktopk: {result_name(code)}: {message}"
        super().__init__(message)

    @property
    def lost_peer(self):
        """Whether the call failed for a rank lost or gone silent: a peer's
        error or death, a timeout, or a call aborted after one (what an
        elastic restart recovers from; a mismatch of calls or settings is
        not)."""
        return self.code in (REMOTE_ERROR, TIMEOUT, ABORTED)


class Config(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("timeout_ms", ctypes.c_int32),
        ("bind_host", ctypes.c_char_p),
        ("ifname", ctypes.c_char_p),
        ("algorithm", ctypes.c_int32),
        ("density", ctypes.c_double),
        ("tau", ctypes.c_int32),
        ("tau_prime", ctypes.c_int32),
        ("value_dtype", ctypes.c_int32),
        ("curve", ctypes.c_int32),  # 0.3; OKTOPK_CURVE=1 in the environment does the same
    ]


class Stats(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("bytes_sent", ctypes.c_uint64),
        ("bytes_received", ctypes.c_uint64),
        ("messages_sent", ctypes.c_uint64),
        ("messages_received", ctypes.c_uint64),
        ("k", ctypes.c_int64),
        ("local_selected", ctypes.c_int64),
        ("global_selected", ctypes.c_int64),
        ("local_threshold", ctypes.c_float),
        ("global_threshold", ctypes.c_float),
        ("select_seconds", ctypes.c_double),
        ("reduce_seconds", ctypes.c_double),
        ("allgather_seconds", ctypes.c_double),
        ("total_seconds", ctypes.c_double),
        # 0.4: the phases the fields above leave out
        ("agree_seconds", ctypes.c_double),
        ("global_select_seconds", ctypes.c_double),
        ("balance_seconds", ctypes.c_double),
        ("output_seconds", ctypes.c_double),
        # ---- added in 0.4: which algorithm ran ("auto"'s choice) ----
        ("algorithm", ctypes.c_int32),
        ("predicted_seconds", ctypes.c_double),
        # ---- added in 0.5: xi, -1 when not measured ----
        ("xi", ctypes.c_double),
        ("xi_gradient_norm", ctypes.c_double),
        # ---- added in 0.7: xi's traffic, apart from bytes_sent/received ----
        ("xi_bytes_sent", ctypes.c_uint64),
        ("xi_bytes_received", ctypes.c_uint64),
    ]


CALL_DENSITY, CALL_MEASURE_XI, CALL_TAU_PRIME, CALL_SPARSE_ONLY = 0x1, 0x2, 0x4, 0x8  # oktopk_call_options_t.flags
CALL_UNDOABLE = 0x10  # since 0.13: the call can be taken back (oktopk_tensor_undo_call)


class CallOptions(ctypes.Structure):
    """oktopk_call_options_t (0.6): one call's density, xi, held ranges, τ′."""

    _fields_ = [
        ("size", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("density", ctypes.c_double),
        ("hold", ctypes.POINTER(ctypes.c_size_t)),
        ("hold_count", ctypes.c_size_t),
        # ---- added in 0.6 ----
        ("tau_prime", ctypes.c_int32),
    ]


class SelectionPlan(ctypes.Structure):
    """oktopk_selection_plan_t (0.10): a caller-selected call's k, exactness
    and threshold."""

    _fields_ = [("k", ctypes.c_uint64), ("exact", ctypes.c_int32), ("threshold", ctypes.c_float)]


class SelectionRules(ctypes.Structure):
    """oktopk_selection_rules_t (0.10): the selection rules' constants."""

    _fields_ = [
        ("too_many", ctypes.c_double),
        ("raise_", ctypes.c_float),
        ("max_raises", ctypes.c_int32),
        ("too_few", ctypes.c_double),
        ("nudge_low", ctypes.c_double),
        ("nudge_down", ctypes.c_float),
        ("nudge_high", ctypes.c_double),
        ("nudge_up", ctypes.c_float),
    ]


def selection_rules():
    """The library's selection rules (oktopk_selection_rules)."""
    rules = SelectionRules()
    lib().oktopk_selection_rules(ctypes.byref(rules))
    return rules


class Selected(ctypes.Structure):
    """oktopk_selected_t (0.10): a caller-selected call's selection in, and
    step 6's terms out."""

    _fields_ = [
        ("size", ctypes.c_uint32),
        ("indices", ctypes.c_void_p),
        ("values", ctypes.c_void_p),
        ("count", ctypes.c_size_t),
        ("threshold", ctypes.c_float),
        ("non_finite", ctypes.c_int32),
        ("result_indices", ctypes.c_void_p),
        ("result_values", ctypes.c_void_p),
        ("result_capacity", ctypes.c_size_t),
        ("result_count", ctypes.c_size_t),
        ("consumed_indices", ctypes.c_void_p),
        ("consumed_values", ctypes.c_void_p),
        ("consumed_capacity", ctypes.c_size_t),
        ("consumed_count", ctypes.c_size_t),
        ("error_indices", ctypes.c_void_p),
        ("error_values", ctypes.c_void_p),
        ("error_capacity", ctypes.c_size_t),
        ("error_count", ctypes.c_size_t),
    ]


class LinkModel(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("latency_seconds", ctypes.c_double),
        ("seconds_per_byte", ctypes.c_double),
        ("pass_seconds_per_byte", ctypes.c_double),
    ]


_lib = None
_lock = threading.Lock()


def _mark_forked_child():
    # Runs in a child created by fork(): the parent's Go runtime is unusable.
    global _lib
    if _lib is not None:
        _lib = _ForkedChild()


class _ForkedChild:
    def __getattr__(self, name):
        raise OkTopkError(
            INVALID_USAGE,
            "liboktopk was loaded before this process was forked; a forked child "
            "(e.g. a DataLoader worker) cannot use it. Use "
            "multiprocessing_context='spawn' or 'forkserver' for workers that "
            "need oktopk, or call oktopk only from the training process.",
        )


os.register_at_fork(after_in_child=_mark_forked_child)


def _candidates():
    """(description, path) of every place liboktopk.so is looked for, in
    order: $OKTOPK_LIBRARY, the copy installed inside this package, and
    (when the package is used from a source checkout) the repository's
    build/ folder."""
    env = os.environ.get("OKTOPK_LIBRARY")
    if env:
        # An explicit choice is never second-guessed by a fallback.
        return [("$OKTOPK_LIBRARY", env)]
    here = os.path.dirname(os.path.abspath(__file__))
    repo_build = os.path.normpath(os.path.join(here, "..", "..", "..", "build", "liboktopk.so"))
    return [("installed with the package", os.path.join(here, "liboktopk.so")), ("source checkout", repo_build)]


def library_path():
    """The liboktopk.so that :func:`lib` loads: $OKTOPK_LIBRARY if set, else
    the copy installed with this package, else the repository's
    build/liboktopk.so when the package is used from a source checkout.
    Raises :class:`OkTopkError` naming every place looked and what to do
    when none holds it."""
    candidates = _candidates()
    for _, path in candidates:
        if os.path.isfile(path):
            return path
    looked = "; ".join(f"{what}: {path}" for what, path in candidates)
    raise OkTopkError(
        INVALID_USAGE,
        f"liboktopk.so not found ({looked}). From the oktopk repository run "
        "`make install-python` (builds the library and pip-installs this package "
        "with it), or `make` then `pip install ./plugins/pytorch`; or point "
        "OKTOPK_LIBRARY at a liboktopk.so.",
    )


def _declare(lib):
    c = ctypes
    i64, u64, sz = c.c_int64, c.c_uint64, c.c_size_t
    P = c.POINTER
    sig = {
        "oktopk_get_version": (c.c_int, []),
        "oktopk_get_error_string": (c.c_char_p, [c.c_int]),
        "oktopk_algorithm_name": (c.c_char_p, [c.c_int]),
        "oktopk_algorithm_takes_reduced_values": (c.c_int, [c.c_int]),
        "oktopk_comm_measure_link": (c.c_int, [i64, P(LinkModel)]),
        "oktopk_comm_get_link": (c.c_int, [i64, P(LinkModel), P(c.c_int)]),
        "oktopk_comm_set_link": (c.c_int, [i64, P(LinkModel)]),
        "oktopk_predict_call": (c.c_int, [P(LinkModel), c.c_int, i64, c.c_int, P(Config), P(c.c_int), P(c.c_double),
                                          P(c.c_double)]),
        "oktopk_config_init": (None, [P(Config)]),
        "oktopk_get_last_error": (c.c_int, [i64, c.c_char_p, sz, P(c.c_int)]),
        "oktopk_make_token": (c.c_int, [c.c_char_p, sz]),
        "oktopk_comm_bind": (c.c_int, [P(i64), c.c_int, c.c_int, c.c_char_p, P(Config), c.c_char_p, sz]),
        "oktopk_comm_connect": (c.c_int, [i64, P(c.c_char_p), c.c_int]),
        "oktopk_comm_abort": (c.c_int, [i64]),
        "oktopk_comm_destroy": (c.c_int, [i64]),
        "oktopk_comm_dropped": (c.c_int, [i64, P(u64)]),
        "oktopk_allreduce": (c.c_int, [i64, c.c_void_p, sz, c.c_int, c.c_int, c.c_int]),
        "oktopk_sparse_allreduce_ex": (c.c_int, [i64, u64, c.c_void_p, sz, c.c_int, P(CallOptions), P(Stats)]),
        "oktopk_tensor_state_size": (c.c_int, [i64, u64, P(sz)]),
        "oktopk_tensor_state_save": (c.c_int, [i64, u64, c.c_void_p, sz]),
        "oktopk_tensor_state_load": (c.c_int, [i64, u64, c.c_void_p, sz]),
        "oktopk_tensor_state_load_regrouped": (c.c_int, [i64, u64, c.c_void_p, sz]),
        "oktopk_tensor_residual_fold": (c.c_int, [i64, u64, c.c_void_p, sz, c.c_int, P(sz), sz]),
        "oktopk_tensor_residual_unfold": (c.c_int, [i64, u64]),
        "oktopk_tensor_residual_read": (c.c_int, [i64, u64, c.c_void_p, sz]),
        "oktopk_tensor_residual_zeros": (c.c_int, [i64, u64, sz, c.c_void_p, c.c_void_p, c.c_void_p, sz, P(sz)]),
        "oktopk_tensor_undo_call": (c.c_int, [i64, u64]),
        "oktopk_topk": (c.c_int, [c.c_void_p, sz, sz, c.c_void_p, c.c_void_p]),
        "oktopk_quantize_blocks": (c.c_int, [c.c_void_p, c.c_void_p, sz, c.c_int, sz, c.c_void_p, c.c_void_p, c.c_void_p,
                                             P(c.c_int)]),
        "oktopk_dequantize_blocks": (c.c_int, [c.c_void_p, c.c_void_p, sz, c.c_int, sz, c.c_void_p]),
        "oktopk_selection_plan": (c.c_int, [i64, u64, sz, P(CallOptions), P(SelectionPlan)]),
        "oktopk_selected_capacity": (sz, [sz, sz, c.c_int]),
        "oktopk_selection_rules": (None, [P(SelectionRules)]),
        "oktopk_sparse_allreduce_selected": (c.c_int, [i64, u64, sz, c.c_int, P(CallOptions), P(Selected), P(Stats)]),
        "oktopk_tensor_state_save_residual": (c.c_int, [i64, u64, c.c_void_p, sz, c.c_void_p, sz]),
        "oktopk_tensor_state_load_residual": (c.c_int, [i64, u64, c.c_void_p, sz, c.c_void_p, sz]),
    }
    for name, (restype, argtypes) in sig.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def lib():
    """The loaded library (loading it on first use)."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                loaded = ctypes.CDLL(library_path())
                _declare(loaded)
                _lib = loaded
    return _lib


def library_version():
    """The loaded liboktopk's version, "major.minor.patch"."""
    code = lib().oktopk_get_version()
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def result_name(code):
    """What the library calls a result code (oktopk_get_error_string); the
    bare number before the library is loaded. It never loads the library
    itself: an error raised while loading it (under the loading lock) is
    named here too."""
    loaded = _lib
    if loaded is None or isinstance(loaded, _ForkedChild):
        return f"result {code}"
    try:
        return loaded.oktopk_get_error_string(code).decode()
    except Exception:  # noqa: BLE001 - naming an error must not raise another
        return f"result {code}"


def last_error(comm=0):
    buf = ctypes.create_string_buffer(1024)
    truncated = ctypes.c_int(0)
    lib().oktopk_get_last_error(comm, buf, len(buf), ctypes.byref(truncated))
    return buf.value.decode(errors="replace")


def check(code, comm=0):
    """Raise OkTopkError for a result code other than SUCCESS."""
    if code != SUCCESS:
        raise OkTopkError(code, last_error(comm))


_algorithms = None


def algorithms():
    """The algorithm names the loaded library knows, in the order of its
    oktopk_algorithm_t values (loading the library on first use)."""
    global _algorithms
    if _algorithms is None:
        names, code = [], 0
        while (name := lib().oktopk_algorithm_name(code)) is not None:
            names.append(name.decode())
            code += 1
        _algorithms = tuple(names)
    return _algorithms


def __getattr__(name):
    # ALGORITHMS comes from the library, loaded only when first asked for:
    # importing the package must work without it (it says what to do then).
    if name == "ALGORITHMS":
        return algorithms()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def algorithm_code(name):
    """The oktopk_algorithm_t value of an algorithm name; ValueError naming
    the choices for an unknown one."""
    names = algorithms()
    if name not in names:
        raise ValueError(f"unknown algorithm {name!r}; one of {', '.join(names)}")
    return names.index(name)


def reduced_value_algorithms():
    """The algorithm names that take 16-bit values, as the library's
    algorithm table says (oktopk_algorithm_takes_reduced_values)."""
    return tuple(name for code, name in enumerate(algorithms()) if lib().oktopk_algorithm_takes_reduced_values(code) == 1)


def algorithm_name(code):
    """The name of an oktopk_algorithm_t value (as stats report it)."""
    names = algorithms()
    return names[code] if 0 <= code < len(names) else f"algorithm({code})"


def default_algorithm():
    """The algorithm the library uses when none is named."""
    return algorithm_name(library_default_config().algorithm)


def library_default_config():
    """A config holding the library's own defaults (oktopk_config_init)."""
    cfg = Config()
    lib().oktopk_config_init(ctypes.byref(cfg))
    return cfg


def default_config(algorithm=None, density=None, tau=None, tau_prime=None, timeout=None, bind_host=None,
                   value_dtype="float32", stochastic_rounding=False):
    """A config with the library's defaults and these settings (None: the
    library's default). bind_host (bytes) must outlive the config: ctypes
    keeps only a pointer. value_dtype is a name in VALUE_DTYPES."""
    cfg = library_default_config()
    if algorithm is not None:
        cfg.algorithm = algorithm_code(algorithm)
    if density is not None:
        cfg.density = density
    if tau is not None:
        cfg.tau = tau
    if tau_prime is not None:
        cfg.tau_prime = tau_prime
    cfg.value_dtype = VALUE_DTYPES[value_dtype] | (STOCHASTIC_ROUNDING if stochastic_rounding else 0)
    if timeout is not None:
        cfg.timeout_ms = int(timeout * 1000)
    if bind_host is not None:
        cfg.bind_host = bind_host
    return cfg


def new_stats():
    s = Stats()
    s.size = ctypes.sizeof(Stats)
    return s


def new_link_model():
    m = LinkModel()
    m.size = ctypes.sizeof(LinkModel)
    return m


def predict_call(latency, seconds_per_byte, pass_seconds_per_byte, algorithm, n, nranks, density=None, tau=None,
                 tau_prime=None):
    """The library's cost model (the one ``algorithm="auto"`` chooses by) for
    one call of ``algorithm`` (a name) on n float32 elements over nranks
    ranks, on a link of that latency (s), time per byte sent (s) and time per
    byte of a pass over memory (s): (seconds, bytes one rank sends, the
    algorithm that would run: auto's choice for "auto"). ValueError for
    arguments the library refuses."""
    link = new_link_model()
    link.latency_seconds, link.seconds_per_byte, link.pass_seconds_per_byte = latency, seconds_per_byte, pass_seconds_per_byte
    cfg = default_config(density=density, tau=tau, tau_prime=tau_prime)
    ran, seconds, sent = ctypes.c_int(-1), ctypes.c_double(), ctypes.c_double()
    code = lib().oktopk_predict_call(ctypes.byref(link), algorithm_code(algorithm), n, nranks, ctypes.byref(cfg),
                                     ctypes.byref(ran), ctypes.byref(seconds), ctypes.byref(sent))
    if code == INVALID_ARGUMENT:
        raise ValueError(last_error())
    check(code)
    return seconds.value, sent.value, algorithm_name(ran.value)
