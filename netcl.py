"""netcl — deep-learning training on any OpenCL device, in one file.

netcl trains real models (MLPs, CNNs, small transformers) on any OpenCL device — NVIDIA,
AMD, Intel and Apple GPUs, or a CPU through PoCL — and on a plain NumPy backend, with the loop
people know from PyTorch. This file is the whole library; `kernels.cl` beside it holds every
kernel, in sections that mirror the ones below. Read it top to bottom: each section uses only
what stands above it.

    BufferPool -> device & kernels -> Tensor -> autograd (Node, Tape) -> operations
    -> nn modules -> optimizers -> mixed precision -> distributed -> data -> Trainer
    -> the import aliases (netcl.nn, netcl.optim, netcl.trainer, ...)

The library proper ends with mixed precision, before the distributed section. Distributed
(data parallelism over MPI), data (DataLoader and its worker processes) and the Trainer are
conveniences built on it, which a learner may read last.

A training step:

    import numpy as np, netcl
    from netcl import nn, functional as F
    device = netcl.manager.default()               # an OpenCL GPU if there is one, else NumPy
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = netcl.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = netcl.Tensor.from_host(np.random.rand(32, 64), queue=device.queue)
    y = np.random.randint(0, 10, size=32)
    with netcl.Tape() as tape:
        loss = F.cross_entropy(model(x), y)
    opt.zero_grad(); tape.backward(loss); opt.step()
    print(loss.value.to_host())

What netcl is not: a general array library (tensors are contiguous: a permute or a slice is
a copy), a graph compiler, or a model-parallel trainer (it has data parallelism over MPI).

Set NETCL_DEBUG=1 to print each kernel build, NETCL_DEBUG=2 to also time every launch.
"""
import builtins
import contextlib
import csv
import functools
import gzip
import inspect
import itertools
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import struct
import sys
import threading
import time
import traceback
import types
import warnings
import weakref
import zipfile
import zlib
from collections import OrderedDict, defaultdict, deque
from multiprocessing import shared_memory

import numpy as np

try:
    import pyopencl as cl
except ImportError:  # the NumPy backend still works; asking for OpenCL explains what to install
    cl = None
# pocl-binary-distribution without PyOpenCL leaves a directory pyopencl/.libs behind, which
# imports as an empty namespace package: only the real module has the API.
if cl is not None and not hasattr(cl, "get_platforms"):
    cl = None

DEBUG = int(os.environ.get("NETCL_DEBUG", "0") or 0)

_INSTALL_HINT = ("install an OpenCL driver for your GPU, or PoCL for a CPU OpenCL device: "
                 "python -m pip install pocl-binary-distribution (or 'pyopencl[pocl]')")


def _ceil_div(a, b):
    return -(-a // b)


def _round_up(n, multiple):
    return _ceil_div(n, multiple) * multiple

# Argument checks, for every public entry point, with one message shape: "where: name must be
# what, got value". A bool is not an integer or a number here, though Python counts it as one.
# A value out of range raises ValueError, and so does one of the wrong kind, except in the ops
# that raise TypeError for it as PyTorch's do (wrong_type=TypeError).

def _is_int(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_scalar(value):
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _check_int(where, name, value, minimum=None, wrong_type=ValueError):
    """`value` as an int, checked to be one and, given `minimum`, at least that."""
    if not _is_int(value) or (minimum is not None and value < minimum):
        what = ("an integer" if minimum is None else "a positive integer" if minimum == 1
                else f"an integer >= {minimum}")
        raise (ValueError if _is_int(value) else wrong_type)(
            f"{where}: {name} must be {what}, got {value!r:.60}")
    return int(value)


def _check_number(where, name, value, minimum=None, maximum=None, finite=False,
                  wrong_type=ValueError):
    """`value` as a float, checked to be a number and, where asked, at least `minimum`, at
    most `maximum` and finite (NaN is in no range)."""
    if not _is_scalar(value) or not ((minimum is None or value >= minimum)
                                     and (maximum is None or value <= maximum)
                                     and (not finite or math.isfinite(value))):
        what = "a finite number" if finite else "a number"
        if minimum is not None and maximum is not None:
            what += f" in [{minimum}, {maximum}]"
        elif minimum is not None:
            what += f" >= {minimum}"
        elif maximum is not None:
            what += f" <= {maximum}"
        raise (ValueError if _is_scalar(value) else wrong_type)(
            f"{where}: {name} must be {what}, got {value!r:.60}")
    return float(value)


# ============================================================================ BufferPool
# Allocating device memory costs a driver call (and on some drivers a sync); a training loop
# asks for the same sizes every step. The pool keeps released buffers in size buckets and
# hands them out again. Buckets are powers of two split in four, so at most 25% is wasted.
# Threads share a Device's pool, so its books are kept under a lock.


_bucket_of = {}  # nbytes -> its bucket: a training step asks for the same few sizes


def _bucket(nbytes):
    size = _bucket_of.get(nbytes)
    if size is None:
        step = 1 << max((nbytes - 1).bit_length() - 3, 0)  # a quarter of nbytes' octave
        size = 256 if nbytes <= 256 else _round_up(nbytes, step)
        if len(_bucket_of) < 4096:  # remembered up to a bound: sizes may vary without end
            _bucket_of[nbytes] = size
    return size


class BufferPool:
    """A caching allocator for one device: `alloc(nbytes)`, `release(buffer)`, `stats()`."""

    def __init__(self, allocate, max_bytes=None):
        self._allocate = allocate
        self._max_bytes = max_bytes
        self._cached = defaultdict(list)  # bucket size -> free buffers
        self._in_use = {}  # id(buffer) -> (buffer, bucket size), for each buffer handed out
        self.in_use_bytes = self.cached_bytes = self.peak_bytes = 0
        self.hits = self.misses = 0
        # Reentrant: a Tensor freed while this thread holds the lock (a garbage collection
        # inside alloc) releases its buffer into the same pool.
        self._lock = threading.RLock()

    def alloc(self, nbytes):
        """A buffer of at least `nbytes` bytes, from the cache when one of its bucket is free."""
        return self._take(_check_int("BufferPool.alloc", "nbytes", nbytes, 0, TypeError))

    def _take(self, nbytes):
        """alloc without the argument checks, for Tensor._alloc (nbytes is an int >= 0)."""
        size = _bucket_of.get(nbytes) or _bucket(nbytes)  # the dict alone, for a size seen before
        with self._lock:
            free = self._cached.get(size)
            if free:
                buffer = free.pop()
                self.cached_bytes -= size
                self.hits += 1
            else:
                buffer = self._fresh(size)
                self.misses += 1
            self.in_use_bytes += size
            if self.in_use_bytes > self.peak_bytes:
                self.peak_bytes = self.in_use_bytes
            self._in_use[id(buffer)] = buffer, size
        return buffer

    def _fresh(self, size):
        for attempt in range(2):  # on failure give the cache back to the driver, retry once
            try:
                if self._max_bytes is not None and size > self._max_bytes:
                    raise MemoryError(f"larger than the device's largest allocation, "
                                      f"{self._max_bytes} bytes")
                return self._allocate(size)
            except (MemoryError, ValueError, OverflowError) + ((cl.Error,) if cl else ()) as error:
                if attempt == 0 and self.cached_bytes:
                    self.empty_cache()
                    continue
                raise MemoryError(f"cannot allocate {size} bytes ({error}); pool stats: "
                                  f"{self.stats()}") from None

    def release(self, buffer):
        """Give a buffer back; the next alloc of its bucket reuses it. Only a buffer this pool
        handed out and not yet taken back is accepted: cached twice, one buffer would be handed
        to two tensors at once."""
        with self._lock:
            held = self._in_use.pop(id(buffer), None)  # the pool's reference kept ids unique
            if held is None:
                raise ValueError(f"BufferPool.release: {type(buffer).__name__} {id(buffer):#x} is "
                                 f"not in use from this pool (released already, or allocated "
                                 f"elsewhere)")
            size = held[1]
            self._cached[size].append(buffer)
            self.in_use_bytes -= size
            self.cached_bytes += size

    def stats(self):
        """Bytes in use and cached, the peak in use, and cache hits and misses."""
        with self._lock:
            return {"in_use_bytes": self.in_use_bytes, "cached_bytes": self.cached_bytes,
                    "peak_bytes": self.peak_bytes, "hits": self.hits, "misses": self.misses}

    def empty_cache(self):
        """Free every cached buffer (buffers in use are untouched)."""
        with self._lock:
            self._cached.clear()
            self.cached_bytes = 0


# ============================================================================ device & kernels
# A Device is one backend instance: the NumPy backend ("cpu"), or one OpenCL device with one
# context, one in-order queue, one compiled program (two: see launch) and one BufferPool. The
# in-order queue is what makes buffer reuse safe: a buffer released by the host may still be
# read by a queued kernel, but any kernel that later writes it is queued behind that read.
# Several threads may use one Device: its lock makes each launch (setting a shared Kernel
# object's arguments, then enqueueing it) one step, and guards its counters and uploads.

class _CpuQueue:
    """The NumPy backend's stand-in for a command queue: work runs at once, so finish() is free."""

    def __init__(self, device):
        self.device = device

    def finish(self):
        """Nothing is ever pending on the NumPy backend."""


_CL_SCALARS = {"int": np.int32, "uint": np.uint32, "float": np.float32}


def _kernel_source():
    """kernels.cl beside this file (a source checkout), else in netcl_kernels/ (a wheel)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for path in (os.path.join(here, "kernels.cl"),
                 os.path.join(here, "netcl_kernels", "kernels.cl")):
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
    raise RuntimeError(f"kernels.cl not found beside {__file__} nor in netcl_kernels/")


@functools.lru_cache(maxsize=1024)
def _rounded_grid(global_size, local_size):
    """Each global size rounded up to a multiple of its local size (cached: the grids of a
    training step repeat)."""
    return tuple(map(_round_up, global_size, local_size))


class Device:
    """One backend instance. Get one from `manager.default(...)`, which caches them.

    `.backend` is "opencl" or "cpu", `.queue` its (in-order) queue, `.pool` its BufferPool,
    `.name` a human-readable name. `.launches` and `.syncs` count kernel launches and
    host-device synchronisations (for tests and benchmarks: syncs are what cost); `.builds`
    and `.build_seconds` count the builds of kernels.cl and the time they took.
    """

    def __init__(self, backend, name, queue=None, cl_device=None):
        self.backend = backend
        self.name = name
        self.launches = 0
        self.syncs = 0
        self.builds = 0
        self.build_seconds = 0.0
        self._lock = threading.Lock()  # launches, counters, uploads, the float16 build
        self._kernels = {}          # kernels.cl built for float32 activations
        self._half_kernels = None   # built for float16 storage, on the first call that needs it
        self._tensor_cores = False  # decided by the half build's probe (NVIDIA devices only)
        self._autocast_notice = False
        if backend == "cpu":
            self.queue = _CpuQueue(self)
            self.context = None
            self.pool = BufferPool(lambda nbytes: np.empty(nbytes, np.uint8))
        else:
            self.queue = queue
            self.context = queue.context
            self.cl_device = cl_device
            self.pool = BufferPool(self._cl_alloc, max_bytes=cl_device.max_mem_alloc_size)
            self._uploads = deque()  # events of queued host-to-device copies, oldest first
            # The GEMM variant: local-memory tiles on GPUs, packed vector rows on CPUs (PoCL),
            # where local memory is slow and wide vector loads are fast; their block shape.
            self.gemm = "packed" if cl_device.type & cl.device_type.CPU else "tiled"
            self.panel_rows, self.panel_cols = _panel_shape(cl_device, self.context)
            self.compute_units = cl_device.max_compute_units
            # Inline PTX reaches NVIDIA's tensor cores; elsewhere it would not even build.
            # None: not probed yet (the probe is part of the first half build).
            if "NVIDIA" in cl_device.platform.name.upper() and \
                    os.environ.get("NETCL_TENSOR_CORES", "1") != "0":
                self._tensor_cores = None
            self._has_fp16 = "cl_khr_fp16" in cl_device.extensions
            self._kernels = self._build_program(half=False)

    def __repr__(self):
        return f"Device({self.backend!r}, {self.name!r})"

    def finish(self):
        """Block until every queued kernel and copy has completed."""
        self._count_sync()
        self.queue.finish()
        if self.backend == "opencl":
            with self._lock:  # not clear(): another thread may have queued a copy meanwhile
                self._drop_completed_uploads()

    def _count_sync(self):
        """One more host-device synchronisation, counted under the lock (threads count too)."""
        with self._lock:
            self.syncs += 1

    def upload(self, buffer, host):
        """Queue a copy of the host array `host` into `buffer` without waiting for it.

        PyOpenCL's event for such a copy holds `host` alive and, when dropped, waits for the
        copy: so events are kept here and dropped only once the device reports them complete.
        """
        with self._lock:
            self._uploads.append(cl.enqueue_copy(self.queue, buffer, host, is_blocking=False))
            self._drop_completed_uploads()

    def _drop_completed_uploads(self):
        """Drop the events of completed copies, oldest first (the queue is in order)."""
        while (self._uploads and self._uploads[0].command_execution_status
               == cl.command_execution_status.COMPLETE):
            self._uploads.popleft()

    # --- kernels: one program per build (float32, float16 storage) and context, one
    # pyopencl.Kernel object per kernel name.
    # Fetching `program.name` creates a new Kernel object each time (~100 µs on a GPU), so
    # every kernel is created once here, with its scalar argument types preset.
    # kernels.cl is built twice from the same source: HALF_STORAGE=0 for float32 activations,
    # HALF_STORAGE=1 for float16 storage (autocast), where the buffers a kernel marks act_t
    # hold halfs. The same names, the same arguments; launch(..., half=True) picks the second.
    @property
    def tensor_cores(self):
        """Whether products under autocast run on tensor cores (NVIDIA, through inline PTX),
        decided once per device by a probe; NETCL_TENSOR_CORES=0 turns them off."""
        if self._tensor_cores is None:
            self._half_program()
        return self._tensor_cores

    @property
    def autocast_half(self):
        """Whether autocast stores activations as float16 here: where tensor cores or half
        arithmetic (cl_khr_fp16) make it pay. Elsewhere (PoCL, for one) each float16 value
        costs a conversion on every load and store, which made steps slower than float32."""
        return self.backend == "opencl" and (self.tensor_cores or self._has_fp16)

    def _half_program(self):
        """The float16-storage build, made on first use. On a device that may have tensor
        cores it is first built with them and trusted only if the probe kernel computes one
        16x8x16 product right; any failure means the portable build, silently."""
        if self._half_kernels is None:
            with self._lock:  # built and probed once, even when two threads ask at once
                if self._half_kernels is None:
                    kernels = None
                    if self._tensor_cores is None:
                        try:
                            kernels = self._build_program(half=True, tensor_cores=True)
                            self._tensor_cores = self._probe_tensor_cores(kernels)
                        except RuntimeError:
                            self._tensor_cores = False
                        if not self._tensor_cores:
                            kernels = None
                    self._half_kernels = kernels or self._build_program(half=True)
        return self._half_kernels

    def _probe_tensor_cores(self, kernels):
        rng = np.random.default_rng(0)
        a = rng.standard_normal((16, 16)).astype(np.float16)
        b = rng.standard_normal((16, 8)).astype(np.float16)
        flags = cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR
        a_buf = cl.Buffer(self.context, flags, hostbuf=a.view(np.uint32))
        bt_buf = cl.Buffer(self.context, flags, hostbuf=np.ascontiguousarray(b.T).view(np.uint32))
        d = np.zeros((16, 8), np.float32)
        d_buf = cl.Buffer(self.context, cl.mem_flags.WRITE_ONLY, d.nbytes)
        try:
            kernels["tensor_core_probe"](self.queue, (32,), (32,), a_buf, bt_buf, d_buf)
            cl.enqueue_copy(self.queue, d, d_buf, is_blocking=True)  # a sync, once per device
        except cl.Error:
            return False
        expected = a.astype(np.float32) @ b.astype(np.float32)
        return bool(np.allclose(d, expected, rtol=1e-3, atol=1e-3))

    def _build_program(self, half, tensor_cores=False):
        """kernels.cl built for float32 (half=False) or float16-storage activations (with
        the tensor-core kernels if asked), as {kernel name: pyopencl.Kernel}."""
        source = _kernel_source()
        options = ["-cl-mad-enable", "-cl-kernel-arg-info",  # never fast-relaxed: keep NaN/Inf
                   f"-DHALF_STORAGE={int(half)}", f"-DTENSOR_CORES={int(tensor_cores)}",
                   f"-DCPU_DEVICE={int(bool(self.cl_device.type & cl.device_type.CPU))}",
                   # (Winograd's kernels read and write either storage: the float32 build)
                   f"-DWINOGRAD={int(not half and _winograd_device(self.cl_device))}",
                   f"-DPANEL_ROWS={self.panel_rows}", f"-DPANEL_COLS={self.panel_cols}"]
        if self.cl_device.single_fp_config & cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT:
            # IEEE division and sqrt where the device offers them, as PyTorch computes them
            # (OpenCL's default allows errors of 2.5 and 3 ulps)
            options.append("-cl-fp32-correctly-rounded-divide-sqrt")
        started = time.perf_counter()
        program = cl.Program(self.context, source)
        try:
            program.build(options=options)
        except cl.Error as error:
            log = program.get_build_info(self.cl_device, cl.program_build_info.LOG)
            raise RuntimeError(f"building kernels.cl (HALF_STORAGE={int(half)}) for {self.name} "
                               f"failed:\n{log or error}") from None
        kernels = {}
        for kernel in program.all_kernels():
            kernel.set_scalar_arg_dtypes([_CL_SCALARS.get(kernel.get_arg_info(
                i, cl.kernel_arg_info.TYPE_NAME)) for i in range(kernel.num_args)])
            kernels[kernel.function_name] = kernel
        self.builds += 1
        self.build_seconds += time.perf_counter() - started
        if DEBUG:
            print(f"netcl: built {len(kernels)} kernels ({'float16' if half else 'float32'} "
                  f"activations) for {self.name} in {time.perf_counter() - started:.2f} s",
                  file=sys.stderr)
        return kernels

    def launch(self, name, global_size, local_size, *args, half=False):
        """Enqueue kernel `name`; global sizes are rounded up to multiples of the local size.
        half=True runs the float16-storage build: the buffers the kernel marks act_t are halfs.
        Returns the launch's pyopencl.Event (bench_netcl.py --kernels times kernels by them)."""
        if len(global_size) == 1:  # most launches: the one-line form of the rounding below
            if global_size[0] % local_size[0]:
                global_size = (_round_up(global_size[0], local_size[0]),)
        else:
            global_size = _rounded_grid(tuple(global_size), tuple(local_size))
        kernel = (self._half_program() if half else self._kernels)[name]
        with self._lock:  # another thread's set_args must not land between ours and the enqueue
            event = kernel(self.queue, global_size, local_size, *args)
            self.launches += 1
        if DEBUG >= 2:  # a deliberate sync per launch, to time each kernel
            started = time.perf_counter()
            self.queue.finish()
            print(f"netcl: {name} {global_size} {1e6 * (time.perf_counter() - started):.0f} µs",
                  file=sys.stderr)
        return event

    def _cl_alloc(self, nbytes):
        return cl.Buffer(self.context, cl.mem_flags.READ_WRITE, nbytes)


_devices = {}           # cache key -> Device: the same request returns the same Device
_devices_by_queue = {}  # id of an OpenCL queue -> its Device
_devices_lock = threading.Lock()  # two threads asking at once still get one Device
_chosen_default = [None]  # the Device manager.set_default chose (None: NETCL_DEVICE, else auto)
# This process's index among the data-parallel ranks on its host (set by distributed.init()):
# of several equally good devices, rank r takes device r % count, so each GPU gets one rank.
_local_rank = 0


def _opencl_devices():
    """[(platform index, device index, cl.Device)] of every OpenCL device; [] if none."""
    if cl is None:
        return []
    try:
        platforms = cl.get_platforms()
    except cl.Error:  # no ICD loader entries: "PLATFORM_NOT_FOUND_KHR"
        return []
    found = []
    for p, platform in enumerate(platforms):
        try:
            devices = platform.get_devices()
        except cl.Error:
            continue
        found.extend((p, d, device) for d, device in enumerate(devices))
    return found


def _no_opencl_error():
    """The RuntimeError for a request for OpenCL where there is none: what to install."""
    if cl is None:
        return RuntimeError("OpenCL needs PyOpenCL, which is not installed: python -m pip install "
                            "pyopencl, or 'pyopencl[pocl]' to add PoCL for a CPU OpenCL device")
    return RuntimeError(f"no OpenCL platform found; {_INSTALL_HINT}")


def _opencl_device(platform_index, device_index, cl_device):
    key = ("opencl", platform_index, device_index)
    with _devices_lock:
        if key not in _devices:
            context = cl.Context([cl_device])
            queue = cl.CommandQueue(context)  # in-order: what makes pooled buffer reuse safe
            device = Device("opencl", cl_device.name.strip(), queue, cl_device)
            _devices[key] = device
            _devices_by_queue[id(queue)] = device
    return _devices[key]


def _describe(cl_device):
    """A device in plain words for notices: "OpenCL CPU device 'name' (platform)"."""
    # From the type's flags: PoCL reports its CPU device as "ALL | CPU".
    kind = ("GPU " if cl_device.type & cl.device_type.GPU else
            "accelerator " if cl_device.type & cl.device_type.ACCELERATOR else
            "CPU " if cl_device.type & cl.device_type.CPU else "")
    return f"OpenCL {kind}device '{cl_device.name.strip()}' ({cl_device.platform.name.strip()})"


def _default_device(device=None):
    """The Device for `device`: "cpu", "gpu"/"opencl", "opencl:P:D", or None/"auto".

    None is the device manager.set_default chose, if it chose one; otherwise the environment
    variable NETCL_DEVICE decides (same values). An explicit argument wins over both, and
    asking for a device here does not make it the default. "auto" is an OpenCL GPU if there
    is one, otherwise the NumPy backend.
    """
    if isinstance(device, Device):
        return device
    if device is None and _chosen_default[0] is not None:
        return _chosen_default[0]
    request = device if device is not None else (os.environ.get("NETCL_DEVICE") or "auto")
    if not isinstance(request, str):
        raise ValueError(f"device must be a string such as 'cpu', 'gpu', 'opencl', 'auto' or "
                         f"'opencl:P:D', got {request!r}")
    request = request.strip().lower()
    if request == "cpu":
        with _devices_lock:
            if "cpu" not in _devices:
                _devices["cpu"] = Device("cpu", "NumPy")
        return _devices["cpu"]
    if request == "auto":
        gpus = [d for d in _opencl_devices() if d[2].type & cl.device_type.GPU]
        return _opencl_device(*gpus[_local_rank % len(gpus)]) if gpus else _default_device("cpu")
    if request in ("gpu", "opencl"):
        found = _opencl_devices()
        if not found:
            raise _no_opencl_error()
        rank = lambda d: (0 if d[2].type & cl.device_type.GPU else
                          1 if d[2].type & cl.device_type.ACCELERATOR else 2)
        best = min(found, key=rank)
        peers = [d for d in found if rank(d) == rank(best)]
        best = peers[_local_rank % len(peers)]
        if rank(best) and ("opencl", best[0], best[1]) not in _devices:
            print(f"netcl: no OpenCL GPU found; using {_describe(best[2])}", file=sys.stderr)
        return _opencl_device(*best)
    parts = request.split(":")
    if len(parts) == 3 and parts[0] == "opencl" and parts[1].isdigit() and parts[2].isdigit():
        found = {(p, d): dev for p, d, dev in _opencl_devices()}
        if not found:
            raise _no_opencl_error()
        key = (int(parts[1]), int(parts[2]))
        if key not in found:
            raise ValueError(f"device {request!r}: no OpenCL device {key[1]} on platform "
                             f"{key[0]}; available: {sorted(found)}")
        return _opencl_device(*key, found[key])
    source = "device" if device is not None else "NETCL_DEVICE"
    raise ValueError(f"{source} must be 'cpu', 'gpu', 'opencl', 'auto' or 'opencl:P:D', "
                     f"got {device if device is not None else request!r}")


def _device_of(queue=None):
    """The Device that owns `queue` (None: the default device; a Device is itself; a string
    such as "opencl" is resolved as manager.default resolves it)."""
    if queue is None or isinstance(queue, str):
        return _default_device(queue)
    if isinstance(queue, Device):
        return queue
    if isinstance(queue, _CpuQueue):
        return queue.device
    device = _devices_by_queue.get(id(queue))
    if device is None:
        if cl is None or not isinstance(queue, cl.CommandQueue):
            raise ValueError(f"queue must be a netcl Device's queue or a pyopencl.CommandQueue, "
                             f"got {queue!r}")
        if queue.properties & cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE:
            raise ValueError("queue must be in-order: pooled buffers are reused in queue order")
        with _devices_lock:
            device = _devices_by_queue.get(id(queue))
            if device is None:
                device = Device("opencl", queue.device.name.strip(), queue, queue.device)
                _devices_by_queue[id(queue)] = device
    return device


def _target_device(where, device):
    """The Device a `.to(device)` names; ValueError naming `where` for anything else."""
    if device is None:
        raise ValueError(f"{where}: device must be a Device, a queue, or 'cpu', 'gpu', "
                         f"'opencl', 'auto' or 'opencl:P:D', got None")
    try:
        return _device_of(device)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def _set_default_device(device):
    """Make `device` the default from now on, as torch.set_default_device: where Tensors,
    Parameters and modules created without queue= go, and a Trainer whose model has no
    parameters trains. `device` is what manager.default takes (a Device, "cpu", "gpu",
    "opencl", "opencl:P:D", "auto") or a queue; it wins over NETCL_DEVICE. None forgets the
    choice (NETCL_DEVICE decides again). Returns the Device that is now the default."""
    _chosen_default[0] = None if device is None else _device_of(device)
    return _default_device()


# ============================================================================ Tensor
# A Tensor is a shape and a dtype over pooled memory: an ndarray view of a pooled byte buffer
# on the NumPy backend, a pyopencl.Buffer on OpenCL. Tensors are always C-contiguous, so a
# reshape is a view that keeps its base alive. When the last reference to a Tensor goes, its
# buffer returns to the pool at once (reference counting calls Tensor.__del__).

_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int32))


def _check_shape(shape):
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if not all(isinstance(s, (int, np.integer)) and s >= 0 for s in shape):
        raise ValueError(f"shape must be non-negative integers, got {shape}")
    return tuple(int(s) for s in shape)


def _check_dtype(dtype, device):
    dtype = np.dtype(dtype)
    if dtype in _DTYPES or (dtype == np.float64 and device.backend == "cpu"):
        return dtype
    raise ValueError(f"dtype must be float32, float16 or int32 (float64 on the NumPy backend "
                     f"only), got {dtype}")


def _real_array(where, value, what="operand"):
    """value as an ndarray of bool, integer or float numbers, else TypeError naming `where`.
    np.asarray makes an object array of None, a str array of a string, and the float copy
    after it would hold NaN or fail in NumPy's words; a complex value would lose its imaginary
    part with only a warning. PyTorch refuses all of them with a TypeError."""
    array = np.asarray(value)
    if array.dtype.kind not in "biuf":
        shown = (f"of dtype {array.dtype}, shape {array.shape}" if isinstance(value, np.ndarray)
                 else f"{value!r:.60} ({type(value).__name__})")
        raise TypeError(f"{where}: {what} {shown} does not hold real numbers (bool, integer "
                        f"or float)")
    return array


def _resolve_shape(op, old_shape, shape):
    if type(shape) is tuple and all(type(s) is int and s >= 0 for s in shape) \
            and math.prod(shape) == math.prod(old_shape):
        return shape  # the usual case, checked in one pass: ops reshape on every step
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if not all(_is_int(s) for s in shape):
        raise ValueError(f"{op}: shape must be integers, got {shape}")
    shape = tuple(int(s) for s in shape)
    size = math.prod(old_shape)
    if shape.count(-1) > 1 or any(s < -1 for s in shape):
        raise ValueError(f"{op}: invalid shape {shape} (at most one -1, no other negatives)")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if known == 0 or size % known:
            raise ValueError(f"{op}: cannot reshape {old_shape} (size {size}) into {shape}")
        shape = tuple(size // known if s == -1 else s for s in shape)
    if math.prod(shape) != size:
        raise ValueError(f"{op}: cannot reshape {old_shape} (size {size}) into {shape}")
    return shape


def _write(tensor, array):
    """Overwrite a tensor's contents from a host array of its shape, without a host sync.

    A blocking copy on an in-order queue would wait for every kernel queued before it, so
    the upload is queued instead, from a private copy of `array` (the caller may reuse its
    array at once); the device keeps the copy alive until the upload has completed.
    """
    if tensor.device.backend == "cpu":
        np.copyto(tensor.data, np.asarray(array).reshape(tensor.shape), casting="unsafe")
    elif tensor.size:
        host = np.array(array, dtype=tensor.dtype, order="C", copy=True).reshape(tensor.shape)
        tensor.device.upload(tensor.data, host)
        if tensor.dtype == np.int32:
            tensor._labels = host


class Tensor:
    """Device memory with a shape and a dtype (float32, float16 storage, or int32)."""

    __slots__ = ("device", "shape", "dtype", "data", "_base", "_labels", "_pooled", "__weakref__")

    def __init__(self, device, shape, dtype, data, base=None):
        # Internal: shape is a tuple of ints and dtype an np.dtype (Tensor.empty and
        # from_host check what users give). Every op makes its outputs through here.
        self._pooled = None  # the pool buffer this tensor owns, if any: released in __del__
        self.device = device
        self.shape = shape
        self.dtype = dtype
        self.data = data     # ndarray (NumPy backend) or pyopencl.Buffer, of at least nbytes
        self._base = base    # the Tensor that owns the memory, for views
        self._labels = None  # int32 tensors written from the host keep that copy: checking
        #                      class labels then needs no read back from the device

    @staticmethod
    def empty(shape, dtype=np.float32, queue=None):
        """An uninitialised tensor from the pool of `queue`'s device (default device if None)."""
        device = _device_of(queue)
        return Tensor._alloc(device, _check_shape(shape), _check_dtype(dtype, device))

    @staticmethod
    def _alloc(device, shape, dtype):
        """Tensor.empty without the argument checks, for the ops' own outputs."""
        nbytes = math.prod(shape) * dtype.itemsize
        buffer = device.pool._take(nbytes)
        data = buffer[:nbytes].view(dtype).reshape(shape) if device.backend == "cpu" else buffer
        tensor = Tensor(device, shape, dtype, data)
        tensor._pooled = buffer
        return tensor

    def __del__(self):
        # A method, not a weakref.finalize per tensor: a training step makes hundreds of
        # tensors, and registering a finalizer costs more than the rest of the allocation.
        if self._pooled is not None:
            self.device.pool.release(self._pooled)

    @staticmethod
    def from_host(array, queue=None, dtype=None):
        """Copy a host array to the device. float64 becomes float32 (float64 stays only when
        asked for with dtype=np.float64, on the NumPy backend); integers become int32, and one
        outside int32's range raises instead of wrapping around."""
        array = _real_array("Tensor.from_host", array, "array")
        if dtype is None:
            if array.dtype == np.float16:
                dtype = np.float16
            elif array.dtype.kind in "iub":
                dtype = np.int32
            else:
                dtype = np.float32
        tensor = Tensor.empty(array.shape, dtype, queue)
        if tensor.dtype == np.int32 and not np.can_cast(array.dtype, np.int32):
            limits = np.iinfo(np.int32)
            outside = array[(array < limits.min) | (array > limits.max)]
            if outside.size:
                raise ValueError(f"Tensor.from_host: integer {outside[0]} is outside int32's "
                                 f"range [{limits.min}, {limits.max}]")
        _write(tensor, array)
        return tensor

    def to_host(self):
        """A NumPy copy of the contents. Blocks until the queued work that writes it is done."""
        if self.device.backend == "cpu":
            return self.data.copy()
        host = np.empty(self.shape, self.dtype)
        if host.size:
            self.device._count_sync()
            cl.enqueue_copy(self.device.queue, host, self.data, is_blocking=True)
        return host

    def __float__(self):
        """The value of a one-element tensor (a sync: it waits for the work that writes it)."""
        if self.size != 1:
            raise TypeError(f"only a one-element tensor converts to float, got shape {self.shape}")
        return float(self.to_host().reshape(()))

    @property
    def queue(self):
        """The queue of the device this tensor lives on."""
        return self.device.queue

    @property
    def size(self):
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self):
        """Bytes of the contents (the buffer may be larger: pool buckets round up)."""
        return self.size * self.dtype.itemsize

    @property
    def ndim(self):
        """Number of dimensions."""
        return len(self.shape)

    def reshape(self, shape):
        """A view with a new shape (one -1 allowed); no copy."""
        return self._view(_resolve_shape("reshape", self.shape, shape))

    def _view(self, shape):
        """reshape without the checks, for the ops: `shape` is a tuple of ints they computed,
        of this tensor's size."""
        data = self.data.reshape(shape) if self.device.backend == "cpu" else self.data
        return Tensor(self.device, shape, self.dtype, data, base=self._base or self)

    def to(self, device):
        """This tensor on `device` (a Device, a queue, or "cpu", "opencl", ... as
        manager.default takes): self if it is there already, else a copy there, as
        torch.Tensor.to. The dtype is kept, and int32 labels get a host copy on OpenCL as
        from_host gives them. A copy from an OpenCL device waits for the work that writes
        this tensor (read back, not taken from a host copy: the device may have changed it)."""
        device = _target_device("Tensor.to", device)
        if device is self.device:
            return self
        return Tensor.from_host(self.to_host(), device.queue, self.dtype)

    def __repr__(self):
        return f"Tensor(shape={self.shape}, dtype={self.dtype.name}, device={self.device.name!r})"


# --- tensor helpers ---------------------------------------------------------------------------
# What the ops (and autograd's gradient sums) make tensors with: an uninitialised one like
# another, a filled one, a copy, a cast, the same-shape sum, a host value on a device.

def _like(x, shape=None, dtype=None):
    """An uninitialised tensor on x's device, shaped like x unless `shape` is given."""
    return Tensor._alloc(x.device, x.shape if shape is None else tuple(shape),
                         x.dtype if dtype is None else np.dtype(dtype))


# np.result_type costs about a microsecond a call; ops ask it for the same few pairs of dtypes.
_result_type = functools.lru_cache(maxsize=64)(np.result_type)


def _compute_dtype(dtype):
    """The dtype results are computed in (a reduction's, a loss's): float32 for float16
    storage."""
    return np.dtype(np.float32) if dtype == np.float16 else np.dtype(dtype)


def _computed(data):
    """A NumPy array as the NumPy backend computes with it: float16 storage widened to float32,
    as the kernels compute (NumPy's own float16 loops would round every intermediate, and its
    matmul sums in float16); other dtypes as they are."""
    return data.astype(np.float32) if data.dtype == np.float16 else data


def _fill(shape, value, like):
    """A tensor of `value` on like's device, in like's compute dtype (see _compute_dtype)."""
    out = _like(like, shape, _compute_dtype(like.dtype))
    if like.device.backend == "cpu":
        out.data.fill(value)
    elif out.size:
        cl.enqueue_fill_buffer(like.device.queue, out.data, np.float32(value), 0, out.nbytes)
    return out


def _copy(x, out=None):
    out = _like(x) if out is None else out
    if x.device.backend == "cpu":
        np.copyto(out.data, x.data)
    elif x.size:
        cl.enqueue_copy(x.device.queue, out.data, x.data, byte_count=x.nbytes)
    return out


def _grid(n):
    return (n,), (256,)


def _cast(x, dtype, out=None):
    """A copy of x in float16 storage or float32 (rounding to nearest even, as NumPy), into
    `out` if given."""
    out = _like(x, dtype=dtype) if out is None else out
    if x.device.backend == "cpu":
        out.data[...] = x.data
    elif x.size:  # the half build's casts; act_t is half there
        kernel = "cast_to_act" if out.dtype == np.float16 else "cast_from_act"
        x.device.launch(kernel, *_grid(x.size), x.size, x.data, out.data, half=True)
    return out


def _float32(x):
    """x itself, or a float32 copy if it is float16 storage."""
    return _cast(x, np.float32) if x.dtype == np.float16 else x


def _half_grad(x):
    """Whether the gradient of x may be kept in float16 storage: x is float16 storage on
    OpenCL (the NumPy backend, where autocast does nothing, keeps float32 gradients)."""
    return x.dtype == np.float16 and x.device.backend == "opencl"


def _add_tensors(a, b):
    """a + b for two tensors of one size (the gradients meeting at one node); in float32 when
    their storage differs (a float16 activation's and a float32 one's)."""
    if a.dtype != b.dtype:
        a, b = _float32(a), _float32(b)
    out = _like(a)
    if a.device.backend == "cpu":
        np.add(a.data, b.data.reshape(a.shape), out=out.data)
    elif out.size:
        out.device.launch("add_fwd", *_grid(out.size), out.size, a.data, b.data, out.data,
                          half=out.dtype == np.float16)
    return out


@functools.lru_cache(maxsize=1024)
def _sum_chunks(columns, R, compute_units):
    """Into how many chunks sum_axis splits R: one work-item per column leaves most compute
    units idle when the columns are few and long, so R is cut into equal chunks (a power of
    two dividing R, at least 256 long: a short sum is not worth a second launch) until there
    are 8 work-groups' worth per unit."""
    chunks = 1
    while columns * chunks < 8 * 256 * compute_units and R % (2 * chunks) == 0 \
            and R // (2 * chunks) >= 256:
        chunks *= 2
    return chunks


_COLUMN_LANES = 16  # kernels.cl's sum_columns: a work-group is this many columns x lanes
_ROW_GROUP = 256    # kernels.cl's sum_rows: a work-group of this many sums one row


def _sum_axis_tensor(x, outer, R, inner, scale=1.0, out=None):
    """x seen as (outer, R, inner) -> (outer, inner), scale * sum over R (float32 for float16;
    into `out` if given)."""
    out = _like(x, (outer, inner), _compute_dtype(x.dtype)) if out is None else out
    half = x.dtype == np.float16
    if x.device.backend == "cpu":
        np.sum(x.data.reshape(outer, R, inner), axis=1, out=out.data, dtype=out.dtype)
        if scale != 1.0:
            out.data *= scale
    elif out.size:
        if R == 0:  # an empty sum: 0 (a mean's scale is then nan, and so is the mean)
            cl.enqueue_fill_buffer(x.device.queue, out.data,
                                   np.float32(math.nan if math.isnan(scale) else 0.0), 0,
                                   out.nbytes)
            return out
        chunks = _sum_chunks(outer * inner, R, x.device.compute_units)
        if outer * inner == 1 and R > 4096:  # one long sum: in parallel, then the partials
            groups = min(_ceil_div(R, 4096), 256)
            partial = _like(out, (groups,))
            x.device.launch("sum_all", (groups * 256,), (256,), R, 1.0, x.data, partial.data,
                            half=half)
            x.device.launch("sum_all", (256,), (256,), groups, scale, partial.data, out.data)
        elif inner == 1 and R >= _ROW_GROUP and x.device.gemm == "tiled":
            # long rows on a GPU (a convolution's bias gradient): a work-group per row
            x.device.launch("sum_rows", (outer * _ROW_GROUP,), (_ROW_GROUP,), R, scale, x.data,
                            out.data, half=half)
        elif chunks > 1 and inner >= _COLUMN_LANES and x.device.gemm == "tiled":
            # few long columns on a GPU (a bias gradient): one launch, lanes of rows per column
            x.device.launch("sum_columns", (inner, _COLUMN_LANES, outer),
                            (_COLUMN_LANES, _COLUMN_LANES, 1), R, inner, scale, x.data,
                            out.data, half=half)
        elif chunks > 1:  # few long columns elsewhere: sum chunks of R, then those
            partial = _like(out, (outer * chunks, inner))
            x.device.launch("sum_axis", *_grid(partial.size), outer * chunks, R // chunks,
                            inner, 1.0, x.data, partial.data, half=half)
            x.device.launch("sum_axis", *_grid(out.size), outer, chunks, inner, scale,
                            partial.data, out.data)
        else:
            x.device.launch("sum_axis", *_grid(outer * inner), outer, R, inner, scale,
                            x.data, out.data, half=half)
    return out


def _different_devices(op, *devices):
    """The ValueError for operands on different devices, saying how to bring them together."""
    names = ", ".join(f"{d.backend} ({d.name})" for d in devices)
    return ValueError(f"{op}: operands are on different devices: {names}; move them to one "
                      f"device with .to(device) (model.to(device) moves a model), or create "
                      f"them there with queue=device.queue or manager.set_default(device)")


def _as_tensor(op, value, like):
    """value (a Tensor or an array) as a Tensor on `like`'s device (arrays, integer ones too,
    take like's float dtype, as PyTorch promotes integers)."""
    if isinstance(value, Tensor):
        if value.device is not like.device:
            raise _different_devices(op, value.device, like.device)
        return value
    array = _real_array(op, value)
    dtype = like.dtype if like.dtype.kind == "f" else None
    return Tensor.from_host(array, queue=like.device.queue, dtype=dtype)


# ============================================================================ autograd
# A Node wraps a Tensor value. An operation run inside a Tape, on at least one input that
# requires a gradient, records an _Op: its parents (the _Op of each recorded input, the Node
# itself for a leaf or a constant) and a backward function that maps the output's gradient to
# its parents' gradients. The graph holds _Ops, not the output Nodes, so an output's value
# goes back to the pool as soon as the program drops the Node (a pre-activation once its ReLU
# has run), unless a backward closure saved it, as PyTorch frees what autograd did not save.
# The Tape's list is in creation order, which is a topological order, so backward walks it in
# reverse, dropping each _Op's parents and closure once it has run.
# Nested Tapes: an op is recorded on every Tape open in its thread, so each Tape can
# differentiate what was computed inside it (to a Tape, a value computed before it opened is a
# constant). A node two Tapes share is freed by whichever backward runs first; a later backward
# through it on the other Tape raises rather than return a partial gradient.
# Threads: the open Tapes, no_grad and autocast are per thread, as PyTorch's grad mode and
# autocast state: a new thread starts with no Tape, recording on and autocast off. So several
# threads may train on one Device at once (it serialises its launches); a Tape records only
# the ops of the thread that opened it, and is closed by that thread.


class _ThreadState(threading.local):
    """What gets recorded, per thread: the open Tapes (innermost last) and the no_grad and
    autocast stacks (the mixed-precision section's autocast pushes onto the latter)."""

    def __init__(self):  # runs again in each new thread: nothing is inherited
        self.tapes = []
        self.grad_enabled = [True]
        self.autocast_enabled = [False]


_state = _ThreadState()
_FREED = object()  # _Op.backward once a Tape's backward has freed the op


class _Op:
    """One recorded operation: `parents` (an _Op or a leaf/constant Node per input),
    `backward`, `node`, a weak reference to its output Node, which becomes a constant
    (requires_grad False) when the op is freed, and `half_grad`: whether backward takes its
    gradient in float16 storage (else in float32; None: in either): see _record."""

    __slots__ = ("parents", "backward", "node", "half_grad")

    def __init__(self, parents, backward, node, half_grad=False):
        self.parents = tuple([p._op or p for p in parents])
        self.backward = backward
        self.node = weakref.ref(node)
        self.half_grad = half_grad

    def free(self):
        """Drop the parents and the closure (what only this backward saved goes back to the
        pool) and make the output Node, if it still exists, a constant."""
        self.parents, self.backward = None, _FREED
        node = self.node()
        if node is not None:
            node.requires_grad = False  # an intermediate value, now a constant


class Node:
    """A value in the computation graph: `.value` (a Tensor), `.grad` (a Tensor or None)."""

    __slots__ = ("value", "grad", "requires_grad", "_op", "__weakref__")
    __array_ufunc__ = None  # `array * node` calls node.__rmul__, not NumPy's elementwise loop

    def __init__(self, value, requires_grad=False):
        self.value = value if isinstance(value, Tensor) else Tensor.from_host(value)
        if requires_grad and self.value.dtype.kind != "f":  # PyTorch's rule and words
            raise TypeError(f"Only Tensors of floating point dtype can require gradients, got "
                            f"{self.value.dtype.name}")
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self._op = None  # the _Op that computed it, if a Tape recorded that; None for a leaf

    shape = property(lambda self: self.value.shape, doc="The value's shape.")
    dtype = property(lambda self: self.value.dtype, doc="The value's dtype.")
    device = property(lambda self: self.value.device, doc="The value's Device.")

    def __repr__(self):
        return f"{type(self).__name__}(shape={self.shape}, requires_grad={self.requires_grad})"

    __add__ = lambda self, other: add(self, other)
    __radd__ = lambda self, other: add(other, self)
    __sub__ = lambda self, other: sub(self, other)
    __rsub__ = lambda self, other: sub(other, self)
    __mul__ = lambda self, other: mul(self, other)
    __rmul__ = lambda self, other: mul(other, self)
    __truediv__ = lambda self, other: div(self, other)
    __rtruediv__ = lambda self, other: div(other, self)
    __matmul__ = lambda self, other: matmul(self, other)
    __rmatmul__ = lambda self, other: matmul(other, self)
    __neg__ = lambda self: neg(self)

    def sum(self, axis=None, keepdims=False):
        """Sum over `axis` (all axes if None)."""
        return reduce_sum(self, axis, keepdims)

    def mean(self, axis=None, keepdims=False):
        """Mean over `axis` (all axes if None)."""
        return reduce_mean(self, axis, keepdims)

    def reshape(self, *shape):
        """A reshaped view (one -1 allowed)."""
        return reshape(self, shape[0] if len(shape) == 1 else shape)

    @property
    def T(self):
        """The transpose of a 2-D node."""
        return transpose(self)

    __pow__ = lambda self, exponent: power(self, exponent)

    def pow(self, exponent):
        """self ** exponent (a number)."""
        return power(self, exponent)

    def sqrt(self):
        """Square root."""
        return sqrt(self)

    def abs(self):
        """|self|."""
        return absolute(self)

    def max(self, axis=None, keepdims=False):
        """The largest value along `axis` (all axes if None): values only, as torch.amax."""
        return reduce_max(self, axis, keepdims)

    def var(self, axis=None, correction=1, keepdims=False):
        """Variance along `axis` (all axes if None), unbiased by default."""
        return var(self, axis, correction, keepdims)

    def std(self, axis=None, correction=1, keepdims=False):
        """Standard deviation along `axis` (all axes if None), unbiased by default."""
        return std(self, axis, correction, keepdims)

    def masked_fill(self, mask, value):
        """A copy with the number `value` where mask is true."""
        return masked_fill(self, mask, value)
    def permute(self, *dims):
        """The dimensions reordered, out.shape[i] = shape[dims[i]]; dims as ints or one tuple."""
        return permute(self, dims[0] if len(dims) == 1 and isinstance(dims[0], (tuple, list))
                       else dims)

    def transpose(self, dim0, dim1):
        """Dimensions dim0 and dim1 swapped."""
        return transpose(self, dim0, dim1)

    def squeeze(self, dim=None):
        """Without the dimensions of size 1 (only those in `dim`, if given)."""
        return squeeze(self, dim)

    def unsqueeze(self, dim):
        """With a new dimension of size 1 at `dim`."""
        return unsqueeze(self, dim)

    def split(self, split_size_or_sections, dim=0):
        """Pieces along `dim`: see functional.split."""
        return split(self, split_size_or_sections, dim)

    def chunk(self, chunks, dim=0):
        """`chunks` pieces along `dim`: see functional.chunk."""
        return chunk(self, chunks, dim)

    def unbind(self, dim=0):
        """The slices along `dim`: see functional.unbind."""
        return unbind(self, dim)

    def __getitem__(self, key):
        """x[key]: ints, slices with a positive step, `...`, None, or one integer array
        indexing the leading dimension (see _index)."""
        return _index(self, key)

    def _taped_root(self):
        """The _Op that a Tape's backward from this node needs to have recorded: this node's
        own (None for a leaf). A node made on no Tape on purpose, on top of one that was (the
        mixed-precision section's scaled loss), names that one's instead."""
        return self._op

    def _seed(self):
        """Where a backward from this one-element node with no grad given starts, and the
        gradient there: its own _Op (itself, for a leaf) and 1. The scaled loss starts a step
        further down instead, at the loss, whose gradient is the scale."""
        return self._op or self, _fill(self.shape, 1.0, self.value)

    def to(self, device):
        """This node's value on `device`, as torch.Tensor.to: self if it is there already,
        else a new Node (inside a Tape its gradient flows back to this device). A Parameter
        gives a plain Node too, as in PyTorch; Module.to moves parameters in place."""
        device = _target_device("Node.to", device)
        if device is self.device:
            return self
        source = self.device
        return _record(self.value.to(device), (self,), lambda g: (g.to(source),))


class Parameter(Node):
    """A trainable leaf: a Node with requires_grad=True.

    `_grad_slot` is None, or the Tensor where backward stores this parameter's gradient: an
    optimizer that keeps every gradient in one flat buffer points it at its segment there.
    """

    __slots__ = ("_grad_slot", "_flat", "_half_stale")

    def __init__(self, value):
        super().__init__(value, requires_grad=True)
        self._grad_slot = None
        self._flat = None          # (the optimizer's _FlatBuffers holding it, its index), if any
        self._half_stale = False   # set when the value changes outside the optimizer's update


def _add_into(dst, src, alpha=1.0):
    """dst += alpha * src, in place (same size)."""
    if dst.device.backend == "cpu":
        src_data = src.data.reshape(dst.shape)
        dst.data += alpha * src_data if alpha != 1.0 else src_data
    elif src.size:
        dst.device.launch("accumulate", *_grid(src.size), src.size, alpha, dst.data, src.data)


class _Owned(tuple):
    """An op's gradients, as its backward returns them, that it allocated for this call and
    keeps no reference to: the Tape stores such a gradient as a leaf's first without a copy
    (PyTorch's AccumulateGrad likewise takes a gradient that nothing else holds)."""


def _check_grad(op, node, what):
    """node.grad, set by hand, as the kernels must find it: a float Tensor of node's shape on
    its device; else TypeError or ValueError naming `what` (a kernel would read or write
    past a smaller buffer, or read an int32 one's bits as floats)."""
    grad = node.grad
    if not isinstance(grad, Tensor):
        raise TypeError(f"{op}: {what} has a .grad of type {type(grad).__name__}; a gradient "
                        f"is a netcl Tensor")
    if grad.dtype.kind != "f":
        raise TypeError(f"{op}: {what} has a gradient of dtype {grad.dtype.name}; gradients "
                        f"must be float tensors")
    if grad.device is not node.value.device:
        raise ValueError(f"{op}: {what}'s .grad is on {grad.device}, different devices from "
                         f"its value's {node.value.device}")
    if grad.shape != node.shape:
        raise ValueError(f"{op}: {what} of shape {node.shape} has a .grad of shape "
                         f"{grad.shape}")


_grad_lock = threading.Lock()  # one leaf's gradient, added to by backwards in several threads


def _accumulate_grad(leaf, grad, owned=False):
    """PyTorch semantics: the first gradient is stored, later ones are added in place. The
    first is copied, so no two leaves ever share (and later mutate) one buffer, unless the
    op owned it (_Owned); into the leaf's `_grad_slot` when an optimizer gave it one (Adam's
    flat gradient buffer). A parameter's gradients are float32; a float16 leaf's may come
    in float16 storage, and those are summed into a new tensor (float32 where the two
    storages differ), as `accumulate` adds float32 in place only."""
    with _grad_lock:  # the test of None and the store or the add: one step for other threads
        if leaf.grad is None:
            slot = getattr(leaf, "_grad_slot", None)
            leaf.grad = grad if grad is slot or owned and slot is None else _copy(grad, out=slot)
            return
        _check_grad("backward", leaf, "a leaf")  # (set by hand)
        if leaf.grad.dtype != grad.dtype or grad.dtype == np.float16:
            leaf.grad = _add_tensors(leaf.grad, grad)
        else:
            _add_into(leaf.grad, grad)


class Tape:
    """Records the operations run inside `with Tape() as tape:`; `tape.backward(loss)`.

    Tapes nest: an op is recorded on every Tape open in its thread, so an outer Tape's
    backward runs through what an inner one recorded too, while to the inner Tape a value
    computed before it opened is a constant. Whichever backward runs first frees the nodes
    they share; a later backward through them on the other Tape raises RuntimeError.
    Each thread has its own open Tapes, no_grad and autocast, and several threads may train
    on one Device at once; a Tape records the ops of the thread that opened it, and that
    thread must close it.
    """

    def __init__(self):
        self._ops = []

    def __enter__(self):
        _state.tapes.append(self)
        return self

    def __exit__(self, *exc):
        if self not in _state.tapes:
            raise RuntimeError("Tape: closed in a thread that did not open it (a Tape records "
                               "the ops of the thread that opened it)")
        _state.tapes.remove(self)

    def backward(self, loss, grad=None):
        """Accumulate d(loss)/d(leaf) into every leaf's `.grad`, then free the graph.

        `grad` (a Tensor, Node or array shaped like loss) seeds the backward pass; without it
        the loss must have one element and the seed is 1. The gradient of a float16 value
        (autocast's activations) is float16 storage where its op's backward writes it so, as
        PyTorch keeps a gradient in its tensor's dtype; parameters' gradients are float32.
        """
        if not isinstance(loss, Node):
            raise TypeError(f"backward: loss must be a Node, got {type(loss).__name__}")
        root = loss._taped_root()  # the loss's _Op, or what it was made from after the Tape closed
        if root is not None and root.backward is _FREED:
            raise RuntimeError("backward: the graph of this loss was already freed by a backward "
                               "(on this Tape, or on another Tape that recorded it too)")
        if not loss.requires_grad:
            raise RuntimeError("backward: loss does not require grad (it was computed outside "
                               "a Tape, or from constants only)")
        # Searched from the end: the loss is usually the last node recorded.
        if root is not None and not any(op is root for op in reversed(self._ops)):
            raise RuntimeError("backward: this loss was recorded on another Tape, not on this "
                               "one; call backward on a Tape that was open when it was computed")
        if grad is None:
            if math.prod(loss.shape) != 1:
                raise RuntimeError(f"backward: grad can be implied only for a loss of one "
                                   f"element, got shape {loss.shape}")
            start, grad = loss._seed()
        else:
            start = loss._op or loss
            grad = _float32(_as_tensor("backward", grad.value if isinstance(grad, Node) else grad,
                                       loss.value))
            if grad.dtype.kind != "f":  # kernels would read an int32 tensor's bits as floats
                raise ValueError(f"backward: grad of dtype {grad.dtype.name}; a gradient "
                                 f"holds floats")
            if grad.shape != loss.shape:
                raise ValueError(f"backward: grad shape {grad.shape} != loss shape {loss.shape}")
        if loss._op is not root:  # the loss's own step runs first, then the tape's; freed with them
            self._ops.append(loss._op)
        if type(start) is not _Op:  # a leaf: the loss itself, or the one a scaled loss scales
            _accumulate_grad(start, grad)
            self._free()
            return
        grads = {id(start): grad}
        ops = self._ops
        recorded = None  # ids of the ops still on this Tape, gathered when a freed parent is met
        try:
            while ops:
                # Taken off the tape as it is reached, and its closure dropped once it has
                # run: what only this op's backward needed (saved inputs, a float16 weight
                # copy) goes back to the pool now, not after the whole pass.
                op = ops.pop()
                g = grads.pop(id(op), None)  # pop: the gradient is freed once consumed
                if g is not None:
                    if op.half_grad is not None and (g.dtype == np.float16) is not op.half_grad:
                        g = _cast(g, np.float16) if op.half_grad else _float32(g)  # its storage
                    parent_grads = op.backward(g)
                    owned = type(parent_grads) is _Owned
                    for parent, parent_grad in zip(op.parents, parent_grads):
                        if type(parent) is not _Op:  # a leaf, or a constant
                            if parent_grad is not None and parent.requires_grad:
                                _accumulate_grad(parent, parent_grad, owned)
                        elif parent.backward is _FREED:  # a constant, unless this Tape recorded it
                            recorded = recorded or {id(o) for o in ops}
                            if id(parent) in recorded:
                                raise RuntimeError(
                                    "backward: part of this loss's graph was already freed by a "
                                    "backward on another Tape that recorded it too; the "
                                    "gradient through it is lost")
                        elif parent_grad is None:
                            continue
                        elif id(parent) in grads:
                            grads[id(parent)] = _add_tensors(grads[id(parent)], parent_grad)
                        else:
                            grads[id(parent)] = parent_grad
                op.free()
                del op, g
        finally:
            self._free()

    def _free(self):
        for op in self._ops:
            op.free()
        self._ops.clear()


class no_grad(contextlib.ContextDecorator):
    """Inside `with no_grad():` (or a function decorated with it) no operation is recorded."""

    def __enter__(self):
        _state.grad_enabled.append(False)

    def __exit__(self, *exc):
        _state.grad_enabled.pop()


def _record(value, parents, backward, half_grad=False):
    """Wrap an op's output; record it on every Tape open in this thread when a parent needs a
    gradient. half_grad=True: backward reads float16 gradients, and gets its output's
    gradient in float16 storage where the output is (_half_grad): the Tape rounds a float32
    one (a loss's gradient, contributions summed in float32), as PyTorch keeps a gradient
    in its tensor's dtype. half_grad=None: backward reads either storage, and gets the
    gradient as it comes (conv2d by Winograd, whose kernels round a float32 one as they read
    it). Every other backward gets float32, a float16 gradient widened, so an op that never
    heard of float16 gradients stays correct."""
    node = Node(value)
    tapes = _state.tapes
    if tapes and _state.grad_enabled[-1]:
        for parent in parents:  # a loop, not any(...): this runs for every op
            if parent.requires_grad:
                node.requires_grad = True
                node._op = op = _Op(parents, backward, node,
                                    None if half_grad is None else
                                    half_grad and _half_grad(value))
                for tape in tapes:
                    tape._ops.append(op)
                break
    return node


def _free_grad_slot(node):
    """Where an op's backward may write a leaf's gradient directly: the leaf's `_grad_slot`
    in its optimizer's flat gradient buffer while the slot is free, holding no gradient yet
    (saves the copy that _accumulate_grad would make), else None."""
    slot = getattr(node, "_grad_slot", None)
    if (slot is None or node.grad is not None or node._op is not None
            or not node.requires_grad):
        return None
    return slot


# ============================================================================ operations
# Each op: validate shapes (before anything is enqueued), compute the output on the NumPy
# backend (the readable reference) or with a kernel, and define its backward beside it.
# Ops accept Nodes, Tensors, arrays and Python scalars; arrays join the other operand's device.
#
# Names in op bodies: the operands, once _nodes has made them Nodes, have lowercase names
# (x, w, b), and the Tensor each holds is the same letter in capitals (X = x.value), which is
# what the NumPy code and the kernel launches read. Everything else an op makes is a Tensor
# until _record wraps the output in its Node: the output (y, out), the incoming gradient g and
# the gradients backward returns. Other capitals are sizes (N, C, H, W), as in the shape
# comments; the helpers that take only Tensors (the *_tensor functions, _gemm) name them in
# lowercase.

_generator = [np.random.default_rng()]


def manual_seed(seed):
    """Seed netcl's random stream: parameter initialisation, dropout masks, shuffling."""
    _generator[0] = np.random.default_rng(seed)


def _rng():
    return _generator[0]


def _devices_of(op, *values):
    devices = {id(v.device): v.device for v in values if isinstance(v, (Node, Tensor))}
    if len(devices) > 1:
        raise _different_devices(op, *devices.values())
    return next(iter(devices.values()), None) or _default_device()


def _as_node(op, value, device, dtype=None):
    """value as a Node; arrays become float tensors (dtype, a partner's float dtype, or
    float32): netcl's operations compute in floating point, as PyTorch promotes ints."""
    if isinstance(value, Node):
        return value
    if isinstance(value, Tensor):
        return Node(value)
    array = _real_array(op, value)
    float_dtype = dtype if dtype is not None and dtype.kind == "f" else np.dtype(np.float32)
    return Node(Tensor.from_host(array, device.queue, float_dtype))


def _promote_int(x, dtype):
    """The int32 Node x as a constant Node of the float `dtype`, as PyTorch promotes an integer
    operand (integer tensors have no gradient there either)."""
    out = _like(x.value, dtype=dtype)
    if x.device.backend == "cpu":
        out.data[...] = x.value.data
    elif out.size:
        x.device.launch("int_to_act", *_grid(out.size), out.size, x.value.data, out.data,
                        half=out.dtype == np.float16)
    return Node(out)


def _nodes(op, *values, numeric=True):
    """Nodes for the operands of `op`, all on one device (arrays and scalars join it).

    Numeric ops promote integer operands as PyTorch does: an int32 tensor, like an integer
    array, takes the dtype of the first floating-point operand, float32 if there is none
    (_promote_int). Where PyTorch keeps integers (int + int, relu of an int tensor) netcl
    computes in float32 all the same: it has no integer arithmetic kernels, and both backends
    must agree. Labels and indices stay int32 for the ops that read them as such (a
    cross_entropy target, reshape)."""
    # The usual case, Nodes of one device (of floats, for a numeric op): nothing to convert
    # or move. A plain loop: generator expressions cost more than the test, in every op.
    device = values[0].value.device if isinstance(values[0], Node) else None
    for v in values:
        if not isinstance(v, Node) or v.value.device is not device or (
                numeric and v.value.dtype.kind != "f"):
            break
    else:
        return list(values)
    device = _devices_of(op, *values)
    dtype = next((v.dtype for v in values if isinstance(v, (Node, Tensor))
                  and v.dtype.kind == "f"), None)
    nodes = [_as_node(op, v, device, dtype) for v in values]
    if numeric:
        nodes = [node if node.dtype.kind == "f" else
                 _promote_int(node, dtype or np.dtype(np.float32)) for node in nodes]
    return nodes


# --- float16 storage ----------------------------------------------------------------------
# float16 is a storage type only: kernels load it, compute in float32 and store the result
# rounded back (kernels.cl: act_t), and the NumPy backend widens it to float32 for its
# products and elementwise formulas likewise (_computed). The rules, on both backends:
# - matmul, linear and conv2d write float16 inside autocast on OpenCL (_half_activations);
# - elementwise ops, pooling and transpose keep their input's storage: float16 in, float16 out;
#   except, inside autocast on OpenCL, those PyTorch's autocast runs in float32 (exp, log,
#   pow, rsqrt, a number divided by a tensor: _AUTOCAST_FLOAT32), which widen a float16
#   input first and return float32, so that exp(12) is not an inf;
# - an op whose operands mix float16 and float32 widens the float16 one and computes in float32;
# - reductions, softmax and losses read float16 and return float32 (_compute_dtype);
# - the gradient of a float16 value is float16 storage where its backward writes it so (the
#   products' dx, elementwise ops, pooling, permutes: _record's half_grad), half the memory
#   of the gradients that dominate backward; other backward ops return float32 for it, and
#   their own float16 gradients reach them widened (Tape.backward). Parameters'
#   gradients and optimizer state stay float32; the loss scale (AMPGradScaler) keeps small
#   float16 gradients from flushing to zero, and an overflow is an inf that skips the step.

def _half_activations(device):
    """Whether matmul, linear and conv2d write float16 storage: inside autocast, on an
    OpenCL device where it pays (Device.autocast_half; elsewhere a notice, once, says the
    device trains in float32). On the NumPy backend autocast does nothing."""
    if not _state.autocast_enabled[-1] or device.backend != "opencl":
        return False
    if not device.autocast_half and not device._autocast_notice:
        device._autocast_notice = True
        print(f"netcl: autocast keeps float32 on {device.name}: without tensor cores or half "
              f"arithmetic, float16 storage would make steps slower", file=sys.stderr)
    return device.autocast_half


def _half_operand(x):
    """x in float16 storage (a copy, rounded, unless it already is): a tensor-core operand."""
    return x if x.dtype == np.float16 else _cast(x, np.float16)


def _half_weight(w):
    """The weight Node w's value in float16 storage, for tensor cores: the copy its optimizer
    keeps (Adam and AdamW write it in their update, _FlatBuffers.half_copies) while the value
    is still that optimizer's, else a fresh rounding."""
    flat, index = getattr(w, "_flat", None) or (None, None)
    if flat is None or w.value is not flat.param_views[index]:
        return _half_operand(w.value)
    copy = flat.half_copies()[index]
    if w._half_stale:  # changed outside the update (load_state_dict): round it again
        _cast(w.value, np.float16, out=copy)
        w._half_stale = False
    return copy


def _to_float32(x):
    """The Node x widened to float32 when it is float16 storage (its gradient passes through)."""
    if x.dtype != np.float16:
        return x
    return _record(_cast(x.value, np.float32), (x,), lambda g: (g,))


# The elementwise ops that PyTorch's autocast runs in float32 whatever their input (its CUDA
# "ops that can autocast to float32": exp, log, pow, rsqrt, __rtruediv__), by kernel name:
# in float16 they overflow or lose their precision where float32 does not (exp(12) is
# 162755, past float16's 65504).
_AUTOCAST_FLOAT32 = {"exp", "log", "pow", "rsqrt", "rdiv_scalar"}


def _autocast_input(name, x):
    """The Node x as the elementwise op `name` takes it: widened to float32 inside autocast
    on an OpenCL device when the op is one of _AUTOCAST_FLOAT32, else as it is."""
    if (name in _AUTOCAST_FLOAT32 and x.dtype == np.float16 and _state.autocast_enabled[-1]
            and x.device.backend == "opencl"):
        return _to_float32(x)
    return x


# --- elementwise, one input ---------------------------------------------------------------
# NumPy reference and kernel name side by side; `s` is what the gradient needs: the input x
# or the output y.

def _erf(x):
    """erf for NumPy arrays, which NumPy lacks: math.erf element by element for float64 (exact,
    slow); for float32, Abramowitz & Stegun 7.1.26, whose |error| < 1.5e-7 is below float32's
    resolution."""
    if x.dtype == np.float64:
        return np.vectorize(math.erf, otypes=[np.float64])(x)
    t = 1.0 / (1.0 + 0.3275911 * np.abs(x))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027
                                                                          + t * 1.061405429))))
    return np.sign(x) * (1.0 - poly * np.exp(-x * x))


def _silu_slope(x):
    """d silu / dx = sigmoid(x) (1 + x (1 - sigmoid(x))), PyTorch's silu_backward."""
    sigmoid_x = 1 / (1 + np.exp(-x))
    return sigmoid_x * (1 + x * (1 - sigmoid_x))


_GELU_TANH_K = math.sqrt(2 / math.pi)


def _gelu_tanh_s(x):
    """PyTorch's gelu(x, approximate="tanh"), 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x +
    0.044715 x^3), is x s for s = (1 + tanh(u)) / 2 = sigmoid(2u). Through exp, 1 + tanh(u)
    keeps its precision where tanh(u) is close to -1, which the sum itself would cancel."""
    return 1 / (1 + np.exp(-2 * _GELU_TANH_K * (x + 0.044715 * x * x * x)))


def _gelu_tanh_slope(x):
    """d(x s)/dx: PyTorch's 0.5 (1 + t) + 0.5 x (1 - t^2) du/dx, with 1 - t^2 = 4 s (1 - s)."""
    s = _gelu_tanh_s(x)
    return s + 2 * x * s * (1 - s) * _GELU_TANH_K * (1 + 3 * 0.044715 * x * x)


_UNARY = {  # name: (forward on x, gradient from (g, s, alpha), s is "x" or "y")
    "neg": (lambda x, a: -x, None, None),  # its backward is neg itself (_unary)
    "relu": (lambda x, a: np.maximum(x, 0),  # np.maximum keeps NaN, as PyTorch
             lambda g, s, a: g * ~(s <= 0), "y"),  # gated on y, as PyTorch: NaN passes g
    "leaky_relu": (lambda x, a: np.where(x > 0, x, x * a),
                   lambda g, s, a: np.where(s > 0, g, g * a), "x"),
    "sigmoid": (lambda x, a: 1 / (1 + np.exp(-x)), lambda g, s, a: g * s * (1 - s), "y"),
    "tanh": (lambda x, a: np.tanh(x), lambda g, s, a: g * (1 - s * s), "y"),
    "gelu": (lambda x, a: 0.5 * x * (1 + _erf(x / math.sqrt(2))),
             lambda g, s, a: g * (0.5 * (1 + _erf(s / math.sqrt(2)))
                                  + s * np.exp(-0.5 * s * s) / math.sqrt(2 * math.pi)), "x"),
    "exp": (lambda x, a: np.exp(x), lambda g, s, a: g * s, "y"),
    "log": (lambda x, a: np.log(x), lambda g, s, a: g / s, "x"),
    "rdiv": (None, lambda g, s, a: -a * g / (s * s), "x"),  # d(a / x)/dx, for scalar / x
    "sqrt": (lambda x, a: np.sqrt(x), lambda g, s, a: g / (2 * s), "y"),
    "rsqrt": (lambda x, a: 1 / np.sqrt(x), lambda g, s, a: -0.5 * g * s * s * s, "y"),
    "abs": (lambda x, a: np.abs(x),  # PyTorch's sgn: 0 at 0 and at NaN (NumPy's sign keeps NaN)
            lambda g, s, a: g * np.where(np.isnan(s), 0, np.sign(s)), "x"),
    "pow": (lambda x, a: np.power(x, a),  # a = the exponent; PyTorch's gradient is 0 for a = 0
            lambda g, s, a: g * a * np.power(s, a - 1) if a != 0 else np.zeros_like(g), "x"),
    "silu": (lambda x, a: x / (1 + np.exp(-x)), lambda g, s, a: g * _silu_slope(s), "x"),
    "gelu_tanh": (lambda x, a: x * _gelu_tanh_s(x),
                  lambda g, s, a: g * _gelu_tanh_slope(s), "x"),
}


_SCALAR_OPS = {  # kernel name: NumPy reference, for x (op) constant
    "add_scalar": lambda x, c: x + c, "mul_scalar": lambda x, c: x * c,
    "div_scalar": lambda x, c: x / c, "rsub_scalar": lambda x, c: c - x,
    "rdiv_scalar": lambda x, c: c / x,
}


def _unary_tensor(name, x, alpha=0.0):
    """out = f(x) for the elementwise op `name` (a kernel `{name}_fwd` or a scalar kernel)."""
    out = _like(x)
    if x.device.backend == "cpu":
        forward = _UNARY[name][0] if name in _UNARY else _SCALAR_OPS[name]
        with np.errstate(all="ignore"):  # inf/nan are values here, not errors (as PyTorch)
            out.data[...] = forward(_computed(x.data), alpha)
    elif x.size:
        kernel = f"{name}_fwd" if name in _UNARY else name
        x.device.launch(kernel, *_grid(x.size), x.size, alpha, x.data, out.data,
                        half=x.dtype == np.float16)
    return out


def _unary_grad_tensor(name, g, s, alpha=0.0):
    """dL/dx from g = dL/dout and s, the saved x or y, all three in s's storage."""
    out = _like(g)
    if g.device.backend == "cpu":
        with np.errstate(all="ignore"):
            out.data[...] = _UNARY[name][1](_computed(g.data), _computed(s.data), alpha)
    elif g.size:
        g.device.launch(f"{name}_bwd", *_grid(g.size), g.size, alpha, g.data, s.data, out.data,
                        half=s.dtype == np.float16)
    return out


def _unary(name, x, alpha=0.0):
    (x,) = _nodes(name, x)
    x = _autocast_input(name, x)
    y = _unary_tensor(name, x.value, alpha)
    saved = x.value if _UNARY[name][2] == "x" else y

    def backward(g):
        if name == "neg":  # g's own storage, whichever it is
            return (_unary_tensor("neg", g),)
        return (_unary_grad_tensor(name, g, saved, alpha),)
    return _record(y, (x,), backward, half_grad=True)


def neg(x):
    """-x."""
    return _unary("neg", x)


def relu(x):
    """max(x, 0)."""
    return _unary("relu", x)


def leaky_relu(x, negative_slope=0.01):
    """x where x > 0, else negative_slope * x."""
    return _unary("leaky_relu", x, _check_number("leaky_relu", "negative_slope", negative_slope))


def sigmoid(x):
    """1 / (1 + exp(-x))."""
    return _unary("sigmoid", x)


def tanh(x):
    """Hyperbolic tangent."""
    return _unary("tanh", x)


def gelu(x, approximate="none"):
    """x * Phi(x): the exact (erf) form, PyTorch's default, or with approximate="tanh"
    PyTorch's 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return _unary("gelu" if approximate == "none" else "gelu_tanh", x)


def exp(x):
    """e ** x."""
    return _unary("exp", x)


def log(x):
    """Natural logarithm."""
    return _unary("log", x)


def sqrt(x):
    """Square root (NaN below 0; the gradient at 0 is inf, as PyTorch's)."""
    return _unary("sqrt", x)


def rsqrt(x):
    """1 / sqrt(x)."""
    return _unary("rsqrt", x)


def absolute(x):
    """|x| (functional.abs; not netcl.abs, which would hide Python's abs in this file). The
    gradient is sign(x): 0 at 0, as PyTorch's."""
    return _unary("abs", x)


def power(x, exponent):
    """x ** exponent for a number `exponent`, as torch.pow (functional.pow, `x ** 2`): NaN for
    a negative x and a non-integer exponent. The gradient is exponent * x ** (exponent - 1),
    as PyTorch's: at x = 0 infinite below exponent 1, 1 at 1, 0 above; 0 for exponent 0."""
    if not _is_scalar(exponent):
        raise TypeError(f"pow: exponent must be a number (netcl has no tensor exponents), got "
                        f"{exponent!r:.60} ({type(exponent).__name__})")
    return _unary("pow", x, float(exponent))


def clamp(x, min=None, max=None):
    """x limited to [min, max], as torch.clamp: either bound may be None; NaN stays NaN; with
    min > max every element is max. The gradient passes where min <= x <= max, the bounds
    included, as PyTorch's, and is 0 elsewhere."""
    if min is None and max is None:
        raise ValueError("clamp: at least one of min and max must be given")
    for name, bound in (("min", min), ("max", max)):
        if bound is not None and not _is_scalar(bound):
            raise TypeError(f"clamp: {name} must be a number or None, got {bound!r:.60}")
    (x,) = _nodes("clamp", x)
    low = -math.inf if min is None else float(min)  # an absent bound clamps nothing
    high = math.inf if max is None else float(max)
    X = x.value
    y = _like(X)
    if X.device.backend == "cpu":
        y.data[...] = np.minimum(np.maximum(X.data, low), high)  # both keep NaN
    elif X.size:
        X.device.launch("clamp_fwd", *_grid(X.size), X.size, low, high, X.data, y.data,
                        half=X.dtype == np.float16)

    def backward(g):  # g, X and out in X's storage
        out = _like(g)
        if g.device.backend == "cpu":
            out.data[...] = np.where((X.data >= low) & (X.data <= high), g.data, 0)
        elif g.size:
            g.device.launch("clamp_bwd", *_grid(g.size), g.size, low, high, g.data, X.data,
                            out.data, half=X.dtype == np.float16)
        return (out,)
    return _record(y, (x,), backward, half_grad=True)


def silu(x):
    """x * sigmoid(x)."""
    return _unary("silu", x)


# --- elementwise, two inputs ---------------------------------------------------------------
# Operands broadcast as in NumPy and PyTorch: shapes align on the right, and along each
# dimension the two sizes are equal or one is 1, which repeats (a missing leading dimension
# counts as 1): (N, D) + (D,), (N, D) * (N, 1), (3, 1) - (1, 4) -> (3, 4). A repeated
# operand's gradient is the output's gradient summed over the dimensions it repeated along.
# A Python scalar takes the scalar kernels: one launch, no buffer for the constant.

_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}
_BROADCAST_RANK = 8  # groups of dimensions kernels.cl's broadcast_t holds


def _broadcast(op, a_shape, b_shape):
    """The broadcast shape of a_shape and b_shape, and the output seen as groups of dimensions,
    each (size, a_repeats, b_repeats), outermost first: adjacent dimensions along which the
    same operand repeats merge, and size-1 dimensions drop out, so (N, D) + (D,) is
    [(N, False, True), (D, False, False)] and most broadcasts are 1 to 3 groups."""
    if a_shape == b_shape:  # the common case, without the loop
        size = math.prod(a_shape)
        return tuple(a_shape), [] if size == 1 else [(size, False, False)]
    ndim = max(len(a_shape), len(b_shape))
    a_dims = (1,) * (ndim - len(a_shape)) + tuple(a_shape)
    b_dims = (1,) * (ndim - len(b_shape)) + tuple(b_shape)
    shape, groups = [], []
    for axis, (a_size, b_size) in enumerate(zip(a_dims, b_dims)):
        if a_size != b_size and a_size != 1 and b_size != 1:
            raise ValueError(f"{op}: shapes {a_shape} and {b_shape} do not broadcast: sizes "
                             f"{a_size} and {b_size} at dimension {axis} of the output (they "
                             f"must be equal, or one of them 1)")
        size = b_size if a_size == 1 else a_size
        shape.append(size)
        if size == 1:
            continue
        repeats = (a_size == 1, b_size == 1)
        if groups and groups[-1][1:] == repeats:
            groups[-1] = (groups[-1][0] * size, *repeats)
        else:
            groups.append((size, *repeats))
    if len(groups) > _BROADCAST_RANK:
        raise ValueError(f"{op}: shapes {a_shape} and {b_shape} broadcast in {len(groups)} "
                         f"groups of dimensions (adjacent ones along which the same operand "
                         f"repeats form one); netcl's kernels index at most {_BROADCAST_RANK}")
    return tuple(shape), groups


def _broadcast_plan(groups):
    """kernels.cl's broadcast_t for `groups`: their count, then per group its size, a's stride
    and b's stride in elements (0 along a group the operand repeats), padded to
    _BROADCAST_RANK. A runtime argument: a new shape is no new compile."""
    sizes, a_strides, b_strides = ([0] * _BROADCAST_RANK for _ in range(3))
    a_step = b_step = 1
    for g in reversed(range(len(groups))):
        sizes[g], a_repeats, b_repeats = groups[g]
        a_strides[g], b_strides[g] = 0 if a_repeats else a_step, 0 if b_repeats else b_step
        a_step *= 1 if a_repeats else sizes[g]
        b_step *= 1 if b_repeats else sizes[g]
    return struct.pack(f"{1 + 3 * _BROADCAST_RANK}i", len(groups), *sizes, *a_strides, *b_strides)


_MIXED = {np.dtype(np.float16), np.dtype(np.float32)}


def _binary_tensor(name, a, b):
    """out = a (op) b, broadcast. float16 against float32 (a gradient, a weight) computes in
    float32."""
    shape, groups = _broadcast(name, a.shape, b.shape)
    if (name == "add" and a.dtype != b.dtype and {a.dtype, b.dtype} == _MIXED
            and a.device.backend == "opencl" and a.size == b.size == math.prod(shape) > 0):
        # a float32 residual stream plus a block's float16 output: the float16 one read as
        # it is stored, not widened by a pass of its own first (and the same sum either way)
        a, b = (a, b) if a.dtype == np.float32 else (b, a)
        out = _like(a, shape)
        out.device.launch("add_mixed_fwd", *_grid(out.size), out.size, a.data, b.data,
                          out.data, half=True)
        return out
    if a.dtype != b.dtype:
        a, b = _float32(a), _float32(b)
    out = _like(a, shape, _result_type(a.dtype, b.dtype))
    if a.device.backend == "cpu":
        with np.errstate(all="ignore"):
            _BINARY[name](a.data, b.data, out=out.data)
    elif out.size:
        half = out.dtype == np.float16
        if a.size == b.size == out.size:  # out's elements in out's order: no index arithmetic
            out.device.launch(f"{name}_fwd", *_grid(out.size), out.size, a.data, b.data,
                              out.data, half=half)
        else:
            out.device.launch(f"{name}_bcast", *_grid(out.size), out.size,
                              _broadcast_plan(groups), a.data, b.data, out.data, half=half)
    return out


def _unbroadcast(g, shape):
    """g, shaped like a broadcast output, summed back to an operand of `shape`: over each group
    of dimensions the operand repeated along (keepdims where it had a 1, as PyTorch's
    sum_to_size). A bias row (D,) of an (N, D) output is one sum over N."""
    if g.size == math.prod(shape):
        return g if g.shape == shape else g.reshape(shape)
    _, groups = _broadcast("backward", shape, g.shape)  # cannot raise: shape broadcast to g's
    sizes = [size for size, _, _ in groups]
    half = g.dtype == np.float16
    for axis in reversed(range(len(groups))):
        if groups[axis][1]:
            g = _sum_axis_tensor(g, math.prod(sizes[:axis]), sizes[axis],
                                 math.prod(sizes[axis + 1:]))
            del sizes[axis]
    # summed in float32; a float16 g is the gradient of a float16 operand, kept so
    return (_cast(g, np.float16) if half else g).reshape(shape)


def _scalar_op(kernel, x, constant, grad_scale):
    """x (op) constant: the gradient w.r.t. x is g * grad_scale (or rdiv's own rule)."""
    (x,) = _nodes(kernel, x)
    x = _autocast_input(kernel, x)
    y = _unary_tensor(kernel, x.value, float(constant))

    def backward(g):  # in g's storage
        if kernel == "rdiv_scalar":
            return (_unary_grad_tensor("rdiv", g, x.value, float(constant)),)
        return (g if grad_scale == 1.0 else _unary_tensor("mul_scalar", g, grad_scale),)
    return _record(y, (x,), backward, half_grad=True)


def add(a, b):
    """a + b, broadcast."""
    if _is_scalar(b):
        return _scalar_op("add_scalar", a, b, 1.0)
    if _is_scalar(a):
        return _scalar_op("add_scalar", b, a, 1.0)
    a, b = _nodes("add", a, b)
    return _record(_binary_tensor("add", a.value, b.value), (a, b),
                   lambda g: (_unbroadcast(g, a.shape), _unbroadcast(g, b.shape)),
                   half_grad=True)


def sub(a, b):
    """a - b, broadcast."""
    if _is_scalar(b):
        return _scalar_op("add_scalar", a, -b, 1.0)
    if _is_scalar(a):
        return _scalar_op("rsub_scalar", b, a, -1.0)
    a, b = _nodes("sub", a, b)
    return _record(_binary_tensor("sub", a.value, b.value), (a, b),
                   lambda g: (_unbroadcast(g, a.shape),
                              _unary_tensor("neg", _unbroadcast(g, b.shape))), half_grad=True)


def mul(a, b):
    """a * b, broadcast."""
    if _is_scalar(b):
        return _scalar_op("mul_scalar", a, b, float(b))
    if _is_scalar(a):
        return _scalar_op("mul_scalar", b, a, float(a))
    a, b = _nodes("mul", a, b)
    return _record(_binary_tensor("mul", a.value, b.value), (a, b),
                   lambda g: (_unbroadcast(_binary_tensor("mul", g, b.value), a.shape),
                              _unbroadcast(_binary_tensor("mul", g, a.value), b.shape)),
                   half_grad=True)


def div(a, b):
    """a / b, broadcast."""
    if _is_scalar(b):
        return _scalar_op("div_scalar", a, b, 1.0 / float(b) if b else math.copysign(math.inf, b))
    if _is_scalar(a):
        return _scalar_op("rdiv_scalar", b, a, None)
    a, b = _nodes("div", a, b)

    def backward(g):
        A, B = (a.value, b.value) if a.dtype == b.dtype else (_float32(a.value), _float32(b.value))
        grad_a = _binary_tensor("div", g, B)
        grad_b = _like(g)  # d(a/b)/db = -g a / b^2, at the output's shape, then summed back
        if g.device.backend == "cpu":
            with np.errstate(all="ignore"):
                grad_b.data[...] = (-_computed(g.data) * _computed(A.data) /
                                    (_computed(B.data) * _computed(B.data)))
        elif g.size:
            half = A.dtype == np.float16
            if A.size == B.size == g.size:
                g.device.launch("div_bwd_b", *_grid(g.size), g.size, g.data, A.data, B.data,
                                grad_b.data, half=half)
            else:
                plan = _broadcast_plan(_broadcast("div", A.shape, B.shape)[1])
                g.device.launch("div_bwd_b_bcast", *_grid(g.size), g.size, plan, g.data,
                                A.data, B.data, grad_b.data, half=half)
        return _unbroadcast(grad_a, a.shape), _unbroadcast(grad_b, b.shape)
    return _record(_binary_tensor("div", a.value, b.value), (a, b), backward, half_grad=True)


# --- maximum, minimum and selection ----------------------------------------------------------
# Binary ops built on the broadcasting above: each step is one _binary_tensor of a BINARY
# kernel, and each gradient is summed back to its operand's shape with _unbroadcast. Gradients
# are computed only for the operands that need one (a mask, a fill value rarely do).

def _max_share(x, y, out):
    """x's share of the gradient of maximum(x, y): 1 where x > y, 0 where x < y, and half each
    on a tie, as PyTorch's (a NaN on either side gives both the whole gradient)."""
    out[...] = np.where(x < y, 0.0, np.where(x == y, 0.5, 1.0))
    return out


_BINARY.update(  # NumPy references of the kernels of this sub-section, called like ufuncs
    maximum=np.maximum, minimum=np.minimum, max_share=_max_share,  # both keep NaN, as PyTorch
    where_pick=lambda mask, x, out: np.copyto(out, np.where(mask != 0, x, -0.0)),
    where_drop=lambda mask, x, out: np.copyto(out, np.where(mask != 0, -0.0, x)))


def _extremum(op, a, b):
    a, b = _nodes(op, a, b)
    _broadcast(op, a.shape, b.shape)  # shape errors name the op, before anything is queued
    A, B = a.value, b.value

    def backward(g):
        # a's share in maximum(a, b) is _max_share(a, b), b's is _max_share(b, a); in
        # minimum(a, b) a wins where maximum(b, a) would pick a, so the two swap.
        first, second = (A, B) if op == "maximum" else (B, A)

        def grad(node, x, y):
            if not node.requires_grad:
                return None
            share = _binary_tensor("max_share", x, y)
            return _unbroadcast(_binary_tensor("mul", g, share), node.shape)
        return grad(a, first, second), grad(b, second, first)
    return _record(_binary_tensor(op, A, B), (a, b), backward, half_grad=True)


def maximum(a, b):
    """The elementwise larger of a and b, NaN if either is NaN, as torch.maximum. On a tie each
    gets half the gradient."""
    return _extremum("maximum", a, b)


def minimum(a, b):
    """The elementwise smaller of a and b, NaN if either is NaN, as torch.minimum. On a tie each
    gets half the gradient."""
    return _extremum("minimum", a, b)


def _mask(op, cond, like, name):
    """cond (the argument `name`) as a tensor of 1s (true) and 0s in like's dtype and on like's
    device, the operand the selection kernels read. cond: a bool or integer array, or an int32
    Tensor or Node (netcl's bool tensors), nonzero meaning true; PyTorch takes bool only, netcl
    has no bool dtype. A constant: no gradient flows to it."""
    if isinstance(cond, Node):
        cond = cond.value
    if isinstance(cond, Tensor):
        if cond.dtype != np.int32:
            raise TypeError(f"{op}: {name} must hold bools or integers (an int32 Tensor), "
                            f"got a {cond.dtype.name} Tensor of shape {cond.shape}")
        if cond.device is not like.device:
            raise _different_devices(op, cond.device, like.device)
        mask = _like(cond, dtype=like.dtype)
        if cond.device.backend == "cpu":
            mask.data[...] = cond.data != 0
        elif cond.size:
            cond.device.launch("nonzero_mask", *_grid(cond.size), cond.size, cond.data,
                               mask.data, half=like.dtype == np.float16)
        return mask
    array = _real_array(op, cond, name)
    if array.dtype.kind not in "biu":
        raise TypeError(f"{op}: {name} must hold bools or integers, got dtype {array.dtype} "
                        f"(shape {array.shape})")
    return Tensor.from_host(array != 0, like.device.queue, like.dtype)


def _where(op, cond, a, b, cond_name):
    if not any(isinstance(v, (Node, Tensor)) for v in (a, b)):  # where(mask, 1.0, 0.0): the
        a = _as_node(op, a, _devices_of(op, cond))              # result joins mask's device
    a, b = _nodes(op, a, b)
    mask = _mask(op, cond, a.value, cond_name)
    picked_shape = _broadcast(op, mask.shape, a.shape)[0]
    dropped_shape = _broadcast(op, mask.shape, b.shape)[0]
    _broadcast(op, picked_shape, dropped_shape)  # shape errors name the op, before any launch
    # a where the mask is true, b elsewhere, each -0.0 in the other's places, then summed:
    # x + -0.0 is x for every x, NaN, infinities and signed zeros included, so the sum is
    # exactly the selection, and every step broadcasts as the binary ops do.
    picked = _binary_tensor("where_pick", mask, a.value)
    dropped = _binary_tensor("where_drop", mask, b.value)

    def backward(g):  # the gradient goes to the side each element came from
        return (_unbroadcast(_binary_tensor("where_pick", mask, g), a.shape)
                if a.requires_grad else None,
                _unbroadcast(_binary_tensor("where_drop", mask, g), b.shape)
                if b.requires_grad else None)
    return _record(_binary_tensor("add", picked, dropped), (a, b), backward, half_grad=True)


def where(cond, a, b):
    """a where cond is true, else b, as torch.where; cond, a and b broadcast together. cond is
    a constant: a bool or integer array or an int32 Tensor, nonzero meaning true."""
    return _where("where", cond, a, b, "condition")


def masked_fill(x, mask, value):
    """x with the number `value` where mask is true (where(mask, value, x)), as
    torch.masked_fill: `att.masked_fill(causal == 0, -math.inf)`. For a float16 x a finite
    value past 65504 is a RuntimeError, as PyTorch's."""
    _check_number("masked_fill", "value", value, wrong_type=TypeError)
    if (getattr(x, "dtype", None) == np.float16 and math.isfinite(value) and
            builtins.abs(value) > 65504):
        # PyTorch's check (c10's overflows<Half>): a finite value past float16's largest
        # would silently become inf (-1e9 for a mask: use -math.inf)
        raise RuntimeError(f"masked_fill: value {value!r} cannot be converted to float16 "
                           f"without overflow (float16's largest is 65504)")
    return _where("masked_fill", mask, value, x, "mask")


# --- shapes -----------------------------------------------------------------------------------

def reshape(x, shape):
    """A view of x with a new shape (one -1 allowed)."""
    (x,) = _nodes("reshape", x, numeric=False)
    old_shape = x.shape
    return _record(x.value.reshape(shape), (x,), lambda g: (g._view(old_shape),),
                   half_grad=True)


def flatten(x, start_dim=1, end_dim=-1):
    """Merge dimensions start_dim..end_dim into one (the batch dimension stays by default)."""
    (x,) = _nodes("flatten", x, numeric=False)
    ndim = len(x.shape)
    start, end = (start_dim + ndim if start_dim < 0 else start_dim,
                  end_dim + ndim if end_dim < 0 else end_dim)
    if ndim == 0:
        return reshape(x, (1,))
    if not (0 <= start < ndim and 0 <= end < ndim and start <= end):
        raise ValueError(f"flatten: start_dim={start_dim}, end_dim={end_dim} invalid for "
                         f"shape {x.shape}")
    return reshape(x, x.shape[:start] + (math.prod(x.shape[start:end + 1]),) + x.shape[end + 1:])


# --- matrix products -------------------------------------------------------------------------

# kernels.cl's tiled kernels (gemm_nn, gemm_nt, gemm_tn; GPUs): a work-group of 16x16
# work-items computes a 64x64 tile of C, or a 128x128 one in the _big kernels, stepping along
# K in slices 16 deep.
_TILE_GROUP = 16            # work-items along each side of a work-group
_TILE, _TILE_BIG = 64, 128  # the side of the tile of C one work-group computes
_TILE_K = 16                # the depth of a slice: split-K chunks are multiples of it
# kernels.cl's vector GEMM blocks, for operands whose contiguous dimension is a multiple of
# 4: (rows, columns, work-items) of C a work-group computes, and the TFLOP/s each reached on
# a large product on the H200. A product takes the block with the least padded work per
# unit of that speed, among those whose blocks keep at least half the compute units busy
# (the smallest block always qualifies): n = 4096 takes 128x256, n = 1024 64x128. A batch of
# products takes the smallest block: conv2d's three (one per sample, 64 x 784 x 288 and
# alike) ran 1.1-1.5x faster in it than in the others on the H200.
_VECTOR_BLOCKS = ((64, 64, 256, 31.0), (64, 128, 128, 34.0), (128, 256, 512, 43.0))
# Split K over the grid only into chunks at least this long, and only a K of two chunks or
# more: a shorter chunk does too little arithmetic to pay for writing its partial product
# and summing the partials (a launch more). The vector kernels split such a K into chunks
# of at least _VECTOR_SPLIT_K_MIN, enough of them for this many work-groups per compute
# unit (one each leaves the units waiting on memory: conv2d's weight gradient ran at 12
# TFLOP/s on the H200 with 130 work-groups).
_SPLIT_K_MIN = 1024
_VECTOR_SPLIT_K_MIN = 256
_SPLIT_GROUPS_PER_UNIT = 4
# kernels.cl's tensor-core blocks: (rows, columns, work-items) of the large and the small
# one, and of the one that gathers unaligned operands; their k-tile depth (split-K chunks
# are multiples of it). The large block takes products of more than 64 rows whose 128x128
# blocks fill every compute unit and whose K is at least _TC_LARGE_K: with a shorter one
# its pipeline has little to overlap (conv2d's input gradient, K = 64: 109 against 85 µs
# in small blocks).
_TC_LARGE, _TC_SMALL, _TC_GATHER = (128, 128, 128), (64, 64, 128), (128, 64, 128)
_TC_LARGE_K = 256
_TC_TILE_K = 32
_TC_VECTOR = 8  # halves the tensor-core kernels copy at a time (16 bytes)
# A product up to this many multiply-adds takes the gathering tensor-core block however few
# its blocks: it is launch-bound either way, and the float32 kernels would first widen its
# float16 operands (a small model's 10-class layer: three casts a step).
_TC_GATHER_ANYWAY = 1 << 24
# The largest float32 input (elements) the tensor cores read without a cast (linear): there
# the launch saved counts most. Beyond it a cast and the copying kernels are faster: on the
# H200 the 784-feature first layer of a 4096 batch took 250 µs a product on the kernels
# that round as they load, against 110 on the copying ones after a 10 µs cast.
_TC_FLOAT_INPUT_MAX = 1 << 20
# kernels.cl's packed kernels (pack_a, pack_b, gemm_packed; CPU devices): op(a) in panels of
# panel_rows rows, op(b) in panels of panel_cols columns; a work-item computes one block of C
# that size, its accumulators two vectors of panel_cols / 2 floats per row.


def _panel_shape(cl_device, context):
    """(rows, columns) of the packed GEMM's block of C on a CPU device: 12x32 where its
    compiler writes vectors of 16 floats (AVX-512's 32 registers: 24 float16 accumulators),
    else 6x16 (AVX2's 16: 12 float8 accumulators). On an AVX-512 Xeon, n=1024 products ran
    at 200-230 GFLOP/s with 12x32 blocks against 140 with 6x16 ones.
    The device's vector width is the CPU's, but PoCL's compiler may target less: an LLVM
    older than the CPU compiles AVX2 code for an AVX-512 AMD EPYC (Zen 4), where 12x32
    blocks spill (115 against 190 GFLOP/s at n=1024). clang then warns that a float16
    argument "changes the ABI" without avx512f, which a one-line probe build shows."""
    if cl_device.native_vector_width_float < 16:
        return (6, 16)
    probe = cl.Program(context, "__kernel void panel_probe(__global float* x) "
                                "{ vstore16(vload16(0, x), 0, x + 16); }")
    with warnings.catch_warnings():  # PyOpenCL warns of any compiler output
        warnings.simplefilter("ignore")
        try:
            probe.build()
        except cl.Error:
            return (6, 16)
    log = probe.get_build_info(cl_device, cl.program_build_info.LOG) or ""
    return (6, 16) if "avx512f" in log else (12, 32)


_PANEL_MACS = 1 << 25  # CPU devices pack both operands into panels from this many M*N*K
_PACK_K = 8  # kernels.cl's PACK_K: the k's of one panel a pack work-item copies
# A long K over few blocks of C (conv2d's weight gradient: K = 50176, C 64x288) is split
# into chunks this long, so a panel's chunk stays in cache while every block that reads it
# runs; whole, the panels streamed from memory once per block (that product: 61 -> 29 ms).
_PANEL_K_CHUNK = 1024
# The bytes of B's panels a band of gemm_packed's blocks reads (kernels.cl): half of a 1 MiB
# L2 cache, the smallest of current server cores'.
_PANEL_BAND_BYTES = 1 << 19


def _gemm_dims(a, b, trans_a, trans_b):
    """(batch, M, K, N) of op(a) @ op(b): a (M, K) or (batch, M, K), (K, M) ... when
    transposed; b likewise; batch is 1 when both are matrices."""
    M, K = (a.shape[-1], a.shape[-2]) if trans_a else a.shape[-2:]
    N = b.shape[-2] if trans_b else b.shape[-1]
    batch = a.shape[0] if len(a.shape) == 3 else b.shape[0] if len(b.shape) == 3 else 1
    return batch, M, K, N


def _batch_strides(a, b, M, K, N):
    """Elements between the matrices of a batched a and b; 0 for one every product shares."""
    return (M * K if len(a.shape) == 3 else 0), (K * N if len(b.shape) == 3 else 0)


def _packed_gemm(a, b, trans_a, trans_b, bias, half, out, b_cols=None, a_run=None,
                 b_run=None, c_run=None, bias_rows=False):
    """_gemm on CPU devices: op(a) packed into panels of the device's panel_rows rows and op(b)
    into panels of its panel_cols columns (kernels.cl: pack_a, pack_b), so the product
    streams both through the caches. Packing reads float16 storage and writes float32, so it
    takes any operand's storage and the inner loop reads float only.
    For conv2d, whose pixels are columns: with b_cols, b is op(b) (K, b_cols) already in
    panels, a (K, Np) float32 matrix (kernels.cl: im2col_panels). With a_run, b_run or
    c_run, the columns of that untransposed matrix come in runs of that many, one per sample
    (kernels.cl: RUN_AT): a (M, nb*L) is stored (nb, M, L), say, as conv2d's gradient is;
    with c_run (or bias_rows) the bias (M) is per row, an output channel's."""
    batch, M, K, N = _gemm_dims(a, b, trans_a, trans_b)
    N = N if b_cols is None else b_cols
    device = a.device
    rows, cols = device.panel_rows, device.panel_cols
    Mp, Np = _round_up(M, rows), _round_up(N, cols)
    stride_a, stride_b = _batch_strides(a, b, M, K, N)
    # Panels when the product is large enough for streaming them to pay (2-3x at n=1024);
    # a small one packs only an operand the kernel cannot read as it is (fewer launches).
    panels = M * N * K >= _PANEL_MACS or b_cols is not None
    A, B = a, b
    a_k, a_r, b_panel, b_k = 1, K, 1, Np  # the operands' own rows
    if b_cols is not None:
        b_panel, b_k = K, cols
    # (gemm_packed reads a's own rows whatever M: past M a block's rows read its first)
    if panels or trans_a or a.dtype == np.float16 or a_run is not None:
        count = a.shape[0] if a.ndim == 3 else 1
        A = _like(a, (count, Mp, K), np.float32)
        device.launch("pack_a", (Mp // rows * _ceil_div(K, _PACK_K), count), (256, 1),
                      M, K, Mp, int(trans_a), K if a_run is None else a_run, stride_a, a.data,
                      A.data, half=a.dtype == np.float16)
        stride_a, a_k, a_r = (Mp * K if a.ndim == 3 else 0), rows, 1
    if b_cols is None and (panels or trans_b or Np != N or b.dtype == np.float16 or
                           b_run is not None):
        count = b.shape[0] if b.ndim == 3 else 1
        B = _like(b, (count, K, Np), np.float32)
        device.launch("pack_b", (Np // cols * _ceil_div(K, _PACK_K), count), (256, 1),
                      K, N, Np, int(trans_b), N if b_run is None else b_run, stride_b, b.data,
                      B.data, half=b.dtype == np.float16)
        stride_b, b_panel, b_k = (K * Np if b.ndim == 3 else 0), K, cols
    # Split K (partial products, then their sum) where the partials cost at most a quarter
    # of reading the operands: a long K and a small C.
    splits = (_ceil_div(K, _PANEL_K_CHUNK) if panels and batch == 1 and bias is None and not
              half and c_run is None and K >= 4 * _PANEL_K_CHUNK and
              4 * M * N <= _PANEL_K_CHUNK * (M + N) else 1)
    k_chunk = _PANEL_K_CHUNK if splits > 1 else K
    if splits > 1:
        stride_a, stride_b = rows * k_chunk, cols * k_chunk
    # Blocks of C in bands of column panels whose B stays in L2 (kernels.cl: gemm_packed);
    # at most all of them, so that the kernel's band * row panels stays within C's blocks.
    band = min(Np // cols, max(1, _PANEL_BAND_BYTES // (4 * cols * max(k_chunk, 1))))
    target = _like(out, (splits, M, N)) if splits > 1 else out
    device.launch("gemm_packed", (_round_up(Mp // rows * (Np // cols), 8), 1, batch * splits),
                  (8, 1, 1), M, N, K, k_chunk, band,
                  a_k, a_r, b_panel, b_k, stride_a, stride_b, N if c_run is None else c_run,
                  int(bias is not None), int(bias_rows or c_run is not None), A.data, B.data,
                  None if bias is None else bias.data, target.data, half=half)
    if splits > 1:
        _sum_axis_tensor(target, 1, splits, M * N, out=out.reshape((1, M * N)))


def _tensor_core_gemm(a, b, trans_a, trans_b, bias, out, bias_rows=False, dims=None,
                      round_float32=False):
    """Run _gemm's product on tensor cores if it can: both operands in float16 storage (or,
    with round_float32, one float32 one that the kernel rounds, _tensor_core_float_side) and
    a device whose probe passed. Returns whether it did. dims: _gemm_dims(a, b, trans_a,
    trans_b), if the caller has them. (Without round_float32 a float16 operand beside a
    float32 one, outside autocast, gets the float32 product, as on every other device.)"""
    device = a.device
    float_side = _tensor_core_float_side(a, b, trans_a, trans_b)
    if float_side is None or (float_side and not round_float32) or not device.tensor_cores:
        return False
    batch, M, K, N = dims or _gemm_dims(a, b, trans_a, trans_b)
    plan = _tensor_core_plan(batch, M, K, N, trans_a, trans_b, bias is not None,
                             out.dtype == np.float16, device.compute_units, float_side)
    if plan is None:
        return False
    kernel, grid, group, splits, k_chunk = plan
    target = _like(out, (batch, splits, M, N)) if splits > 1 else out
    device.launch(kernel, grid, group, M, N, K, k_chunk, *_batch_strides(a, b, M, K, N),
                  _bias_code(bias, bias_rows), a.data, b.data,
                  None if bias is None else bias.data, target.data, half=True)
    if splits > 1:
        _sum_axis_tensor(target, batch, splits, M * N, out=out.reshape((batch, M * N)))
    return True


def _tensor_core_float_side(a, b, trans_a, trans_b):
    """Which operand of a tensor-core product is float32: "" (neither: both are float16
    storage), "a" (x @ W^T, a float32 input's forward) or "b" (g^T @ x, its weight gradient);
    None for any other mix of dtypes and layouts, which the tensor cores do not take."""
    if trans_a and trans_b:
        return None
    if a.dtype == b.dtype == np.float16:
        return ""
    if a.dtype == np.float32 and b.dtype == np.float16 and trans_b:
        return "a"
    if a.dtype == np.float16 and b.dtype == np.float32 and trans_a:
        return "b"
    return None


@functools.lru_cache(maxsize=1024)
def _tensor_core_plan(batch, M, K, N, trans_a, trans_b, has_bias, half_out, units,
                      float_side=""):
    """_tensor_core_gemm's launch, a function of the sizes alone: (kernel, global size, local
    size, splits, k_chunk), or None where the float32 kernels do the product better. Cached,
    as _tiled_plan is. float_side: which operand is float32 (_tensor_core_float_side); only
    the aligned blocks come with such kernels."""
    if not K:
        return None
    # Where an operand's contiguous dimension is not a multiple of _TC_VECTOR, its rows are
    # not 16-byte aligned and the gathering block takes the product.
    aligned = (M if trans_a else K) % _TC_VECTOR == 0 and (K if trans_b else N) % _TC_VECTOR == 0
    # The large block: more than 64 rows (with fewer, half of it would idle), a K of at
    # least _TC_LARGE_K, and enough blocks to fill every compute unit.
    large_rows, large_cols, _ = _TC_LARGE
    large = (aligned and M > _TC_SMALL[0] and K >= _TC_LARGE_K and
             batch * _ceil_div(M, large_rows) * _ceil_div(N, large_cols) >= units)
    rows, cols, threads = _TC_LARGE if large else _TC_SMALL if aligned else _TC_GATHER
    blocks = batch * _ceil_div(M, rows) * _ceil_div(N, cols)
    # Split K when the blocks leave most compute units idle and K is long enough to share
    # (a weight gradient summed over a large batch): float32 partial products, then their sum.
    # (A gathering block is slow: it takes one more split to fill every unit.)
    fill = units // blocks if aligned else _ceil_div(units, blocks)
    splits = (max(1, min(fill, K // _SPLIT_K_MIN))
              if not has_bias and not half_out and 2 * blocks <= units else 1)
    if not aligned and blocks * splits < units and M * N * K > _TC_GATHER_ANYWAY:
        return None  # too few gathering blocks: the split-K float32 kernels do it faster
    k_chunk = _round_up(_ceil_div(K, splits), _TC_TILE_K) if splits > 1 else K
    splits = _ceil_div(K, k_chunk)
    layout = "tn" if trans_a else "nt" if trans_b else "nn"
    block = "l" if large else "s" if aligned else "u"
    if float_side and (block == "u" or half_out != (float_side == "a")):
        return None  # the float32-input kernels: x @ W^T to half, g^T @ x to float (kernels.cl)
    kernel = f"gemm_tc_{layout}_{'h' if half_out else 'f'}_{block}" + (
        f"_x{float_side}" if float_side else "")
    return (kernel, (_ceil_div(N, cols) * threads, _ceil_div(M, rows), batch * splits),
            (threads, 1, 1), splits, k_chunk)


def _vector_block(batch, M, N, units, blocks):
    """The entry of `blocks` (_VECTOR_BLOCKS) for a product C (M, N): (rows, columns,
    work-items)."""
    best, chosen = None, None
    for rows, cols, threads, speed in blocks:
        count = batch * _ceil_div(M, rows) * _ceil_div(N, cols)
        cost = count * rows * cols / speed
        if (chosen is None or 2 * count >= units) and (best is None or cost <= best):
            best, chosen = cost, (rows, cols, threads)
    return chosen


@functools.lru_cache(maxsize=1024)
def _tiled_plan(batch, M, K, N, trans_a, trans_b, may_split, has_bias, units, blocks):
    """_tiled_gemm's launch, a function of the sizes alone: (kernel, global size, local size,
    splits, k_chunk). The vector kernels where each operand's contiguous dimension is a
    multiple of 4, in the block _vector_block picks from `blocks`; else 128x128 tiles when
    there are enough of them to fill every compute unit, else 64x64. K is split over the
    grid (may_split: a float32 result) when the blocks leave most compute units idle: on
    the vector kernels into enough chunks for a few work-groups per compute unit, on the
    scalar ones (a lone product without bias) one per unit. Cached: a training step asks
    for the same few products every time."""
    layout = "tn" if trans_a else "nt" if trans_b else "nn"
    # float4 rows: the contiguous dimension of each operand (K of op(A) = A, M of A^T, N of
    # B, K of B^T) a multiple of 4 (C's rows need not be: the kernels store those one by one)
    vector = blocks and (M if trans_a else K) % 4 == 0 and (K if trans_b else N) % 4 == 0
    if vector:
        rows, cols, threads = _vector_block(batch, M, N, units, blocks[:1] if batch > 1 else
                                            blocks)
        kernel, group = f"gemm_{layout}_{rows}x{cols}", (threads, 1, 1)
    else:
        big = batch * _ceil_div(M, _TILE_BIG) * _ceil_div(N, _TILE_BIG) >= units
        rows = cols = _TILE_BIG if big else _TILE
        kernel = f"gemm_{layout}" + ("_big" if big else "")
        group = (_TILE_GROUP, _TILE_GROUP, 1)
    grid = (_ceil_div(N, cols) * group[0], _ceil_div(M, rows) * group[1])
    count = batch * _ceil_div(M, rows) * _ceil_div(N, cols)
    splits = 1
    if may_split and 2 * count <= units and K >= 2 * _SPLIT_K_MIN:
        if vector:
            splits = min(_ceil_div(_SPLIT_GROUPS_PER_UNIT * units, count),
                         K // _VECTOR_SPLIT_K_MIN)
        elif batch == 1 and not has_bias:
            splits = min(units // count, K // _SPLIT_K_MIN)
    if splits <= 1:
        return kernel, grid + (batch,), group, 1, K
    k_chunk = _round_up(_ceil_div(K, splits), _TILE_K)
    splits = _ceil_div(K, k_chunk)
    if not vector:
        kernel += "_split"  # the 64x64 kernels compiled for it (big is False here)
    return kernel, grid + (batch * splits,), group, splits, k_chunk


def _tiled_gemm(a, b, dims, trans_a, trans_b, bias, bias_rows, half, out):
    """_gemm on kernels.cl's tiled kernels, as _tiled_plan lays it out. dims: _gemm_dims(a, b,
    trans_a, trans_b), which _gemm has already computed."""
    batch, M, K, N = dims
    if half and trans_a:  # gemm_tn writes float: a float16 C is the float32 one, rounded
        single = _like(out, dtype=np.float32)
        _tiled_gemm(a, b, dims, trans_a, trans_b, bias, bias_rows, False, single)
        _cast(single, np.float16, out=out)
        return
    # The half build's tiled kernels read float16 where autocast leaves it (kernels.cl):
    # gemm_nn and gemm_nt take a (and write C) in float16, for the forward products and dx =
    # g w, and gemm_tn takes b, for linear's weight gradient g^T x. Other float16 operands
    # widen; a float32 a of a float16 C is rounded (a loss's gradient into float16 logits).
    reads_half_b = trans_a and b.dtype == np.float16
    a = _half_operand(a) if half else _float32(a)
    b = b if reads_half_b else _float32(b)
    # Split K only for float32 results: partial sums in float16 would lose what float32 keeps.
    kernel, grid, group, splits, k_chunk = _tiled_plan(
        batch, M, K, N, trans_a, trans_b, not half, bias is not None, a.device.compute_units,
        _VECTOR_BLOCKS)
    target = _like(out, (batch, splits, M, N)) if splits > 1 else out
    if kernel.endswith("_split"):  # (a lone product, no bias)
        a.device.launch(kernel, grid, group, M, N, K, k_chunk, 0, 0, 0, a.data, b.data, None,
                        target.data, half=reads_half_b)
    else:
        a.device.launch(kernel, grid, group, M, N, K, k_chunk, *_batch_strides(a, b, M, K, N),
                        _bias_code(bias, bias_rows), a.data, b.data,
                        None if bias is None else bias.data, target.data,
                        half=half or reads_half_b)
    if splits > 1:
        _sum_axis_tensor(target, batch, splits, M * N, out=out._view((batch, M * N)))


def _bias_code(bias, bias_rows):
    """The GEMM kernels' has_bias: 0 none, 1 one per column of C, 2 one per row."""
    return 0 if bias is None else 2 if bias_rows else 1


def _gemm(a, b, trans_a=False, trans_b=False, bias=None, half=False, out=None, bias_rows=False,
          round_float32=False):
    """C (M, N) = op(a) @ op(b) [+ bias (N)]; op transposes when asked, without a copy.
    With bias_rows the bias is (M,), one per row of C (conv2d's output channels).
    Either operand may be a batch (batch, rows, cols) of matrices, the other a matrix all
    products share; C is then (batch, M, N), every product in one launch.

    half=True (OpenCL only): C is written in float16 storage (autocast's products, the
    gradient of a float16 input), accumulating in float32. Otherwise C is float32. An operand
    in float16 storage (a value the forward kept, a float16 gradient) is read as such where
    the kernel takes it, and widened to float32 first where it does not; the tiled kernels
    that write float16 read a as float16 too (_tiled_gemm).
    `out`, if given, is the tensor to write. On OpenCL the product runs on CPU devices'
    packed kernels (_packed_gemm), else on tensor cores where it can (both operands in
    float16 storage on a device with them, or with round_float32, autocast's products, one
    float32 operand that they round: _tensor_core_gemm), else on the tiled kernels
    (_tiled_gemm).
    """
    dims = batch, M, K, N = _gemm_dims(a, b, trans_a, trans_b)
    batched = len(a.shape) == 3 or len(b.shape) == 3
    if out is None:
        out = _like(a, (batch, M, N) if batched else (M, N), np.float16 if half else
                    _compute_dtype(_result_type(a.dtype, b.dtype)))
    if a.device.backend == "cpu":
        A, B = _computed(a.data), _computed(b.data)  # float32 sums for float16 storage
        np.matmul(np.swapaxes(A, -1, -2) if trans_a else A,
                  np.swapaxes(B, -1, -2) if trans_b else B, out=out.data)
        if bias is not None:
            out.data += bias.data[:, None] if bias_rows else bias.data
    elif M and N and batch:  # (an empty C has nothing to write)
        if a.device.gemm == "packed":
            _packed_gemm(a, b, trans_a, trans_b, bias, half, out, bias_rows=bias_rows)
        elif not _tensor_core_gemm(a, b, trans_a, trans_b, bias, out, bias_rows, dims,
                                   round_float32):
            _tiled_gemm(a, b, dims, trans_a, trans_b, bias, bias_rows, half, out)
    return out


def _batch_shape(op, a_batch, b_batch):
    """The broadcast of two batch shapes (NumPy's rule), or ValueError naming op."""
    try:
        return tuple(np.broadcast_shapes(a_batch, b_batch))
    except ValueError:
        raise ValueError(f"{op}: batch dimensions {a_batch} and {b_batch} do not "
                         f"broadcast") from None


def _matmul_grad(x, y, shape, trans_a=False, trans_b=False, half=False):
    """The gradient op(x) @ op(y) of an operand of `shape`, in float16 storage if half (but
    for the sum below): where that operand is one matrix that a batch shared, the sum over
    the batch, as one product of the stacked rows when the batch is on the side that is
    summed over (dB = A^T g), else summed after the products."""
    if len(shape) == 3 or (x.ndim == 2 and y.ndim == 2):
        return _gemm(x, y, trans_a=trans_a, trans_b=trans_b, half=half)
    if trans_a:  # dB = sum over the batch of A_i^T g_i: the batch's rows stacked
        return _gemm(x.reshape((-1, x.shape[-1])), y.reshape((-1, y.shape[-1])), trans_a=True,
                     half=half)
    products = _gemm(x, y, trans_b=trans_b)  # dA = sum over the batch of g_i B_i^T
    count, rows, cols = products.shape
    return _sum_axis_tensor(products, 1, count, rows * cols).reshape((rows, cols))


def _matmul_batch(a, b):
    """a @ b for a, b each a matrix (rows, cols) or a batch (count, rows, cols), on _gemm."""
    A, B = a.value, b.value
    half = _half_activations(A.device)
    if half and A.device.tensor_cores:  # float16 operands: every product on the tensor cores
        A, B = _half_weight(a), _half_weight(b)
    half_a, half_b = _half_grad(a.value), _half_grad(b.value)  # each gradient in its storage

    def backward(g):
        # a float16 product's gradient in float16, as PyTorch keeps a gradient in its tensor's
        # dtype (and tensor cores take both operands so); a float32 one's as it is, even when
        # both operands are float16 (outside autocast)
        if half and A.dtype == B.dtype == np.float16:
            g = _half_operand(g)
        return (_matmul_grad(g, B, A.shape, trans_b=True, half=half_a)
                if a.requires_grad else None,
                _matmul_grad(A, g, B.shape, trans_a=True, half=half_b)
                if b.requires_grad else None)
    return _record(_gemm(_half_operand(A) if half else A, B, half=half), (a, b), backward,
                   half_grad=True)


def matmul(a, b):
    """a @ b with PyTorch's rules: (M, K) @ (K, N) -> (M, N); batches (..., M, K) @ (..., K, N)
    with broadcast batch dimensions; a 1-D operand is a row (left) or column (right) vector
    whose dimension is dropped from the result, and 1-D @ 1-D is a dot product. Every product
    of a batch runs in one launch; (..., M, K) @ (K, N) is one product of (... * M) rows.
    Inside autocast (OpenCL) the result is float16 storage, computed from a rounded to
    float16 and b (on tensor cores b is rounded too)."""
    a, b = _nodes("matmul", a, b)
    if not a.shape or not b.shape:
        raise ValueError(f"matmul: both operands need at least 1 dimension, got shapes "
                         f"{a.shape} and {b.shape}")
    a2 = a if len(a.shape) >= 2 else reshape(a, (1, a.shape[0]))
    b2 = b if len(b.shape) >= 2 else reshape(b, (b.shape[0], 1))
    (M, K), N = a2.shape[-2:], b2.shape[-1]
    if K != b2.shape[-2]:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not align "
                         f"({K} != {b2.shape[-2]})")
    batch = _batch_shape("matmul", a2.shape[:-2], b2.shape[:-2])
    if len(b2.shape) == 2 and batch:  # one right matrix: the batch is just more rows of a
        out = _matmul_batch(reshape(a2, (-1, K)), b2)
    else:
        count = math.prod(batch)

        def operand(x, rows, cols):
            """x as one shared matrix (rows, cols), or as the whole batch (count, rows, cols)."""
            if math.prod(x.shape[:-2]) == 1:
                return reshape(x, (rows, cols))
            if x.shape[:-2] != batch:  # broadcast along some batch dimensions: expand it
                x = add(x, _fill(batch + (rows, cols), 0.0, x.value))
            return reshape(x, (count, rows, cols))
        out = _matmul_batch(operand(a2, M, K), operand(b2, K, N))
    out_shape = batch + (M, N)
    if len(a.shape) == 1:
        out_shape = out_shape[:-2] + out_shape[-1:]
    if len(b.shape) == 1:
        out_shape = out_shape[:-1]
    return reshape(out, out_shape)


def _tensor_cores_read_float32(X, out_features, has_bias):
    """Whether the tensor-core kernels read linear's float32 input X (rows, in) as it is, in
    both the forward and the weight gradient, rounding it to half on the way into local
    memory (kernels.cl: tc_read_operand): no cast of X of its own, and no float16 copy kept
    for backward. Both products must have such a kernel (an aligned block)."""
    if X.dtype != np.float32 or X.size > _TC_FLOAT_INPUT_MAX:
        return False
    (rows, features), units = X.shape, X.device.compute_units
    return (_tensor_core_plan(1, rows, features, out_features, False, True, has_bias, True,
                              units, "a") is not None and
            _tensor_core_plan(1, out_features, rows, features, True, False, False, False,
                              units, "b") is not None)


def linear(x, w, b=None):
    """x (..., in) @ w.T + b: w is (out, in) as in PyTorch, b (out,) or None. Inside autocast
    (OpenCL) x is read and the output written as float16 storage; w and b stay float32."""
    x, w, *rest = _nodes("linear", x, w, *(() if b is None else (b,)))
    b = rest[0] if rest else None
    if len(w.shape) != 2 or not x.shape or x.shape[-1] != w.shape[1]:
        raise ValueError(f"linear: input {x.shape} does not match weight {w.shape} "
                         f"(expected input (..., {w.shape[-1] if w.shape else '?'}))")
    if b is not None and b.shape != (w.shape[0],):
        raise ValueError(f"linear: bias shape {b.shape} != ({w.shape[0]},) for weight {w.shape}")
    # (..., in) is one product over all rows: reshaped views of the tensors, one recorded op
    rows = math.prod(x.shape[:-1])
    X, W = x.value._view((rows, x.shape[-1])), w.value
    half = _half_activations(X.device)
    # On tensor cores every product takes float16 operands: x rounded as autocast's other
    # devices do, and a float16 copy of the weight, kept for backward. A float32 x is read as
    # it is where the kernels can (_tensor_cores_read_float32); else it is cast for the
    # forward and cast again for the weight's gradient, not kept cast through the backward
    # pass, whose peak the copy would add to (7 MiB for 4096 x 784; a cast takes ~10 µs).
    tensor_cores = half and X.device.tensor_cores
    X_product, cast_again = X, False
    if tensor_cores:
        W = _half_weight(w)
        if not _tensor_cores_read_float32(X, w.shape[0], b is not None):
            X_product = _half_operand(X)
            cast_again = X_product is not X

    half_x = _half_grad(x.value)  # dx in x's storage

    def backward(g):  # only the gradients somebody needs (the input's usually is not)
        g = g._view((rows, w.shape[0]))  # float16 under autocast: the tensor cores' operand
        # A parameter's gradient is written straight into its slot in the optimizer's flat
        # buffer when it has one free (_free_grad_slot; None otherwise: a new tensor). dw
        # first: where the kernels widen a float16 g for it (the tiled ones), that float32
        # copy is freed before dx is allocated.
        grad_w = (_gemm(g, _half_operand(X) if cast_again else X, trans_a=True,  # dw = g^T x
                        out=_free_grad_slot(w), round_float32=tensor_cores)
                  if w.requires_grad else None)
        grads = [_gemm(g, W, half=half_x)._view(x.shape) if x.requires_grad else None,  # g W
                 grad_w]
        if b is not None:                                        # db = the sum of g's rows
            cols = w.shape[0]
            slot = _free_grad_slot(b)
            if slot is not None:
                _sum_axis_tensor(g, 1, rows, cols, out=slot._view((1, cols)))
                grads.append(slot)
            elif b.requires_grad:
                grads.append(_sum_axis_tensor(g, 1, rows, cols)._view(b.shape))
            else:
                grads.append(None)
        return grads
    out = _gemm(_half_operand(X) if half and not tensor_cores else X_product, W, trans_b=True,
                bias=None if b is None else _float32(b.value),  # (read as float32)
                half=half, round_float32=tensor_cores)
    del X_product  # (a cast of x is not kept for backward)
    return _record(out._view(x.shape[:-1] + (w.shape[0],)),
                   (x, w) + ((b,) if b is not None else ()), backward, half_grad=True)


# --- shape ops --------------------------------------------------------------------------------
# Permuting, joining, cutting and indexing, as PyTorch's. netcl's tensors are contiguous, so
# where PyTorch returns a strided view these ops copy: a permute is one gather (each output
# element finds its input through strides); cat, stack, split, chunk and slicing copy rows
# between blocks seen as (outer, rows, inner); integer-array indexing gathers rows. squeeze
# and unsqueeze only change the shape: views, through reshape. Each backward moves the
# gradient back the same way; a row gathered twice sums its two gradients, without atomics.

def _check_dim(op, dim, ndim, name="dim"):
    """dim in [-ndim, ndim) as an index from 0; a 0-d tensor takes -1 and 0, as PyTorch."""
    _check_int(op, name, dim, wrong_type=TypeError)
    size = max(ndim, 1)
    if not -size <= dim < size:
        raise ValueError(f"{op}: {name} {dim} out of range for a tensor of {ndim} dimensions "
                         f"(expected [{-size}, {size - 1}])")
    return int(dim) % size


_MAX_PERMUTE_RANK = 6  # kernels.cl's permute_axes takes six sizes and six steps


@functools.lru_cache(maxsize=1024)
def _merged_permutation(shape, dims):
    """x.permute(dims) seen with as few dimensions as it moves: (sizes, steps), one entry per
    dimension of the output, whose index k moves steps[k] elements in x. Size-1 dimensions
    are dropped, and neighbours that stay neighbours in x merge: (B, T, H, D) -> (B, H, T, D)
    stays 4-D, (B, T, H, D) -> (T, B, H, D) is 3-D, (T, C, 1) -> (1, C, T) a 2-D transpose.
    Cached (shape and dims are tuples), so the result is tuples, which no caller can change."""
    x_steps = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    sizes, steps = [], []
    for d in dims:
        if shape[d] == 1:
            continue
        if steps and steps[-1] == x_steps[d] * shape[d]:  # continues the previous dimension
            sizes[-1] *= shape[d]
            steps[-1] = x_steps[d]
        else:
            sizes.append(shape[d])
            steps.append(x_steps[d])
    return tuple(sizes), tuple(steps)


def _transpose_tensor(x):
    rows, cols = x.shape
    out = _like(x, (cols, rows))
    if x.device.backend == "cpu":
        np.copyto(out.data, x.data.T)
    elif x.size:
        x.device.launch("transpose2d", (cols, rows), (16, 16), rows, cols, x.data, out.data,
                        half=x.dtype == np.float16)
    return out


def _permute_tensor(x, dims):
    """x.permute(dims) as a new contiguous tensor: a copy, a 2-D transpose, or one gather."""
    shape = tuple(x.shape[d] for d in dims)
    sizes, steps = _merged_permutation(x.shape, dims)
    if len(sizes) == 2:  # a plain transpose once merged: the 2-D kernel needs no divisions
        return _transpose_tensor(x.reshape((sizes[1], sizes[0]))).reshape(shape)
    out = _like(x, shape)
    if x.device.backend == "cpu":
        np.copyto(out.data, x.data.transpose(dims))
    elif len(sizes) < 2:  # the order of the elements does not change
        _copy(x, out)
    elif out.size:
        pad = _MAX_PERMUTE_RANK - len(sizes)  # size-1 dimensions in front, which never move
        sizes, steps = (1,) * pad + sizes, (0,) * pad + steps
        x.device.launch("permute_axes", *_grid(out.size), out.size, *sizes[1:], *steps,
                        x.data, out.data, half=x.dtype == np.float16)
    return out


def permute(x, dims):
    """x with its dimensions reordered, out.shape[i] = x.shape[dims[i]], as torch.permute (a
    copy, not a view). The backward permutes the gradient back, by the inverse permutation."""
    (x,) = _nodes("permute", x, numeric=False)
    if not isinstance(dims, (tuple, list)):
        raise TypeError(f"permute: dims must be a tuple of ints, got {dims!r}")
    if len(dims) != len(x.shape):
        raise ValueError(f"permute: dims {tuple(dims)} has {len(dims)} entries for a tensor of "
                         f"shape {x.shape} ({len(x.shape)} dimensions)")
    dims = tuple(_check_dim("permute", d, len(x.shape)) for d in dims)
    if len(set(dims)) != len(dims):
        raise ValueError(f"permute: repeated dim in {dims}")
    if len(_merged_permutation(x.shape, dims)[0]) > _MAX_PERMUTE_RANK:
        raise ValueError(f"permute: dims {dims} on shape {x.shape} move more than "
                         f"{_MAX_PERMUTE_RANK} separate dimensions")
    inverse = tuple(sorted(range(len(dims)), key=dims.__getitem__))  # np.argsort, for a few ints
    return _record(_permute_tensor(x.value, dims), (x,),
                   lambda g: (_permute_tensor(g, inverse),), half_grad=True)


def _swap_dims(x, dim0, dim1):
    """transpose(x, dim0, dim1): the permutation that swaps two dimensions."""
    (x,) = _nodes("transpose", x, numeric=False)
    if dim0 is None or dim1 is None:
        raise TypeError(f"transpose: give both dim0 and dim1 (or neither, for a 2-D x), got "
                        f"dim0={dim0!r}, dim1={dim1!r}")
    ndim = len(x.shape)
    d0 = _check_dim("transpose", dim0, ndim, "dim0")
    d1 = _check_dim("transpose", dim1, ndim, "dim1")
    dims = list(range(ndim))
    if ndim:  # a 0-d x takes dims 0 and -1 too, and stays as it is
        dims[d0], dims[d1] = dims[d1], dims[d0]
    return permute(x, dims)


def transpose(x, dim0=None, dim1=None):
    """The transpose of a 2-D x (a copy); given dim0 and dim1, x of any rank with those two
    dimensions swapped, as torch.transpose (shape ops, below)."""
    if dim0 is not None or dim1 is not None:
        return _swap_dims(x, dim0, dim1)
    (x,) = _nodes("transpose", x, numeric=False)
    if len(x.shape) != 2:
        raise ValueError(f"transpose: expected a 2-D operand, got shape {x.shape}")
    return _record(_transpose_tensor(x.value), (x,), lambda g: (_transpose_tensor(g),),
                   half_grad=True)


def squeeze(x, dim=None):
    """x without its dimensions of size 1, or only those of them in `dim` (an int or a tuple:
    a listed dimension of another size stays, as PyTorch). A view."""
    (x,) = _nodes("squeeze", x, numeric=False)
    ndim = len(x.shape)
    if dim is None:
        dims = range(ndim)
    else:
        listed = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
        dims = [_check_dim("squeeze", d, ndim) for d in listed]
        if len(set(dims)) != len(dims):
            raise ValueError(f"squeeze: repeated dim in {dim}")
    return reshape(x, tuple(s for d, s in enumerate(x.shape) if not (s == 1 and d in dims)))


def unsqueeze(x, dim):
    """x with a new dimension of size 1 at `dim`, in [-(ndim + 1), ndim]. A view."""
    (x,) = _nodes("unsqueeze", x, numeric=False)
    d = _check_dim("unsqueeze", dim, len(x.shape) + 1)
    return reshape(x, x.shape[:d] + (1,) + x.shape[d:])


def _copy_rows(src, dst, dim, n, src_at=(0, 1), dst_at=(0, 1)):
    """Copy n rows along `dim` from src into dst (same shape but for `dim`): row start + j *
    step of dst, (start, step) = dst_at, gets row start' + j * step' of src, (start', step')
    = src_at. Both are seen as (outer, rows, inner). A float32 src is rounded into a float16
    dst as it is copied (a float32 gradient put in place in a float16 one)."""
    (src_start, src_step), (dst_start, dst_step) = src_at, dst_at
    if dst.device.backend == "cpu":
        before = (slice(None),) * dim
        dst.data[before + (slice(dst_start, dst_start + n * dst_step, dst_step),)] = \
            src.data[before + (slice(src_start, src_start + n * src_step, src_step),)]
        return
    outer, inner = math.prod(dst.shape[:dim]), math.prod(dst.shape[dim + 1:])
    if not outer * n * inner:
        return
    kernel = "copy_rows"
    if src.dtype != dst.dtype:
        if src.dtype == np.float32 and dst.dtype == np.float16:
            kernel = "copy_rows_from_float"
        else:
            src = _cast(src, dst.dtype)
    dst.device.launch(kernel, *_grid(outer * n * inner), outer, n, inner, src.shape[dim],
                      dst.shape[dim], src_start, src_step, dst_start, dst_step, src.data,
                      dst.data, half=dst.dtype == np.float16)


def _node_list(op, tensors):
    """The operands of cat or stack as Nodes of one device, all of one dtype or of float16
    storage and float32 (cat then widens the float16 ones, as the elementwise ops do)."""
    if not isinstance(tensors, (tuple, list)):
        raise TypeError(f"{op}: tensors must be a tuple or list of tensors, got "
                        f"{type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{op}: expected a non-empty list of tensors")
    nodes = _nodes(op, *tensors, numeric=False)
    dtypes = {node.dtype for node in nodes}
    if len(dtypes) > 1 and dtypes != {np.dtype(np.float16), np.dtype(np.float32)}:
        raise ValueError(f"{op}: tensors of dtypes {sorted(d.name for d in dtypes)}; expected "
                         f"one dtype (float16 storage with float32 widens)")
    return nodes


def cat(tensors, dim=0):
    """The tensors joined along `dim`, as torch.cat: their shapes agree but along `dim`; as
    there, a 1-D empty tensor (shape (0,)) joins any shape, adding nothing. Each input's
    gradient is its slice of the output's."""
    nodes = _node_list("cat", tensors)
    joined = [i for i, node in enumerate(nodes) if node.shape != (0,)] or [0]
    first = nodes[joined[0]].shape
    for i in joined:
        if not nodes[i].shape:
            raise ValueError(f"cat: zero-dimensional tensor (at position {i}) cannot be "
                             f"concatenated")
        if len(nodes[i].shape) != len(first):
            raise ValueError(f"cat: tensors must have the same number of dimensions: shapes "
                             f"{first} and {nodes[i].shape} (position {i})")
    d = _check_dim("cat", dim, len(first))
    for i in joined:
        if nodes[i].shape[:d] + nodes[i].shape[d + 1:] != first[:d] + first[d + 1:]:
            raise ValueError(f"cat: shapes {first} and {nodes[i].shape} (position {i}) must "
                             f"match except in dimension {d}")
    if len({node.dtype for node in nodes}) > 1:  # float16 storage with float32: widened
        nodes = [_to_float32(node) for node in nodes]
    starts = dict(zip(joined, np.cumsum([0] + [nodes[i].shape[d] for i in joined]).tolist()))
    rows = builtins.sum(nodes[i].shape[d] for i in joined)
    out = _like(nodes[joined[0]].value, first[:d] + (rows,) + first[d + 1:])
    for i in joined:
        _copy_rows(nodes[i].value, out, d, nodes[i].shape[d], dst_at=(starts[i], 1))

    def backward(g):  # g (..., all inputs' rows, ...) -> the rows of each input that needs them
        grads = [_like(g, node.shape) if node.requires_grad else None for node in nodes]
        for i in joined:  # a skipped (0,) input's gradient is empty: nothing to copy
            if grads[i] is not None:
                _copy_rows(g, grads[i], d, nodes[i].shape[d], src_at=(starts[i], 1))
        return grads
    return _record(out, tuple(nodes), backward)


def stack(tensors, dim=0):
    """The tensors, all of one shape, joined along a new dimension `dim`, as torch.stack."""
    nodes = _node_list("stack", tensors)
    for i, node in enumerate(nodes):
        if node.shape != nodes[0].shape:
            raise ValueError(f"stack: expects each tensor to be equal size, but got "
                             f"{nodes[0].shape} at entry 0 and {node.shape} at entry {i}")
    d = _check_dim("stack", dim, len(nodes[0].shape) + 1)
    return cat([unsqueeze(node, d) for node in nodes], d)


def _row_views_allowed(x, starts):
    """Whether views of x's leading rows may begin at each of `starts`: always on NumPy; on
    OpenCL when x owns its buffer (a sub-buffer of a sub-buffer is not allowed) and each start
    falls on the device's sub-buffer alignment (mem_base_addr_align, in bits)."""
    if x.device.backend == "cpu":
        return True
    owner = x._base or x
    if owner._pooled is None or x.data is not owner.data:
        return False
    row_bytes = math.prod(x.shape[1:]) * x.dtype.itemsize
    align = x.device.cl_device.mem_base_addr_align // 8
    return all(start * row_bytes % align == 0 for start in starts)


def _row_view(x, start, rows):
    """Rows start .. start + rows of x along its leading dimension, as a view (see
    _row_views_allowed); an empty piece gets a buffer of its own (a sub-buffer may not be
    empty)."""
    shape = (rows,) + x.shape[1:]
    if not math.prod(shape):
        return _like(x, shape)
    if x.device.backend == "cpu":
        return Tensor(x.device, shape, x.dtype, x.data[start:start + rows], base=x._base or x)
    row_bytes = math.prod(x.shape[1:]) * x.dtype.itemsize
    data = x.data.get_sub_region(start * row_bytes, rows * row_bytes)
    return Tensor(x.device, shape, x.dtype, data, base=x._base or x)


def _zero_rows(x, d, start, rows):
    """Set rows start .. start + rows of x along dimension d to zero, in place."""
    if x.device.backend == "cpu":
        x.data[(slice(None),) * d + (slice(start, start + rows),)] = 0
    elif d == 0 and rows:  # contiguous bytes
        row_bytes = math.prod(x.shape[1:]) * x.dtype.itemsize
        if row_bytes:
            cl.enqueue_fill_buffer(x.device.queue, x.data, np.zeros((), x.dtype),
                                   start * row_bytes, rows * row_bytes)
    else:
        zeros = _fill(x.shape[:d] + (rows,) + x.shape[d + 1:], 0.0, x)
        _copy_rows(zeros, x, d, rows, dst_at=(start, 1))


def _pieces(x, d, sizes, squeeze=False):
    """x cut along dimension d into pieces of `sizes` rows: a tuple of Nodes (with dimension
    d removed if squeeze: unbind's pieces of one row). Along the leading dimension the
    pieces are views, as PyTorch's (no copy; on OpenCL where the device lets a sub-buffer
    start at every piece), else copies."""
    starts = list(itertools.accumulate(sizes, initial=0))  # np.cumsum, for a few ints
    X = x.value
    if d == 0 and _row_views_allowed(X, starts[1:-1]):
        values = [_row_view(X, start, rows) for start, rows in zip(starts, sizes)]
    else:
        values = []
        for start, rows in zip(starts, sizes):
            values.append(_like(X, x.shape[:d] + (rows,) + x.shape[d + 1:]))
            _copy_rows(X, values[-1], d, rows, src_at=(start, 1))
    # A node has one gradient, so the pieces' gradients meet in one buffer of x's shape, held
    # by a hidden node between x and the pieces: the first piece whose backward runs makes it
    # and hands it to the hidden node; every piece copies its gradient into its own rows.
    # The hidden node was recorded before the pieces, so its backward runs after theirs: it
    # zeroes the rows of the pieces that got no gradient, then passes the buffer on to x.
    # Under autocast the buffer is float16 storage, as x's gradient: a piece's gradient is
    # taken in the storage it comes in (attention's are float32) and rounded as it is copied.
    buffer, placed = [], set()
    grad_dtype = np.float16 if _half_grad(X) else None  # (None: g's own)

    def zero_the_rest(g):
        for i in sorted(set(range(len(sizes))) - placed):
            _zero_rows(g, d, starts[i], sizes[i])
        return (g,)
    whole = _record(X, (x,), zero_the_rest, half_grad=True)

    shapes = [value.shape for value in values]  # of x's rank

    def place(i):
        def backward(g):
            first = not buffer
            if first:
                buffer.append(_like(g, x.shape, grad_dtype))
            _copy_rows(g._view(shapes[i]), buffer[0], d, sizes[i], dst_at=(starts[i], 1))
            placed.add(i)
            return (buffer[0] if first else None,)
        return backward
    if squeeze:
        values = [value._view(value.shape[:d] + value.shape[d + 1:]) for value in values]
    return tuple(_record(value, (whole,), place(i), half_grad=None)
                 for i, value in enumerate(values))


def _cut_dim(op, x, dim):
    """The dimension split and chunk cut x along (x is at least 1-D, as PyTorch asks)."""
    if not x.shape:
        raise ValueError(f"{op}: expects at least a 1-dimensional tensor, got shape ()")
    return _check_dim(op, dim, len(x.shape))


def split(x, split_size_or_sections, dim=0):
    """x cut along `dim`, as torch.split: into pieces of split_size_or_sections rows (an int;
    the last piece may be shorter) or of the listed sizes, which must add up to x's size
    there. A tuple of Nodes; in backward, their gradients are put back in place."""
    (x,) = _nodes("split", x, numeric=False)
    d = _cut_dim("split", x, dim)
    size, sections = x.shape[d], split_size_or_sections
    if _is_int(sections):
        if sections < 0 or (sections == 0 and size):
            raise ValueError(f"split: split_size must be positive (0 only for a dimension of "
                             f"size 0), got {sections} for dimension {d} of size {size}")
        count = max(_ceil_div(size, sections), 1) if sections else 1  # one piece at least
        sizes = [int(sections)] * (count - 1) + [size - int(sections) * (count - 1)]
    elif isinstance(sections, (tuple, list)) and all(_is_int(s) for s in sections):
        sizes = [int(s) for s in sections]
        if any(s < 0 for s in sizes) or builtins.sum(sizes) != size:
            raise ValueError(f"split: sections {sizes} must be non-negative and add up to "
                             f"{size}, the size of dimension {d} of shape {x.shape}")
    else:
        raise TypeError(f"split: split_size_or_sections must be an int or a list of ints, got "
                        f"{split_size_or_sections!r}")
    return _pieces(x, d, sizes)


def chunk(x, chunks, dim=0):
    """x cut into `chunks` pieces along `dim`, as torch.chunk: pieces of ceil(size / chunks)
    rows, so there may be fewer than `chunks` (a size of 0 gives `chunks` empty pieces)."""
    (x,) = _nodes("chunk", x, numeric=False)
    chunks = _check_int("chunk", "chunks", chunks, 1, TypeError)
    d = _cut_dim("chunk", x, dim)
    size = x.shape[d]
    return _pieces(x, d, [0] * chunks) if size == 0 else split(x, _ceil_div(size, chunks), d)


def unbind(x, dim=0):
    """x's slices along `dim`, that dimension removed, as torch.unbind: a tuple of x.shape[dim]
    Nodes (views along the leading dimension, as split's pieces)."""
    (x,) = _nodes("unbind", x, numeric=False)
    d = _cut_dim("unbind", x, dim)
    return _pieces(x, d, [1] * x.shape[d], squeeze=True)


def _slice(x, d, start, step, rows):
    """x's rows start, start + step, ... (`rows` of them) along dimension d (a copy); the
    backward puts the gradient back into those rows of zeros."""
    out = _like(x.value, x.shape[:d] + (rows,) + x.shape[d + 1:])
    _copy_rows(x.value, out, d, rows, src_at=(start, step))

    def backward(g):
        grad = _fill(x.shape, 0.0, g)
        _copy_rows(g, grad, d, rows, dst_at=(start, step))
        return (grad,)
    return _record(out, (x,), backward)


def _host_index(op, index, x, d, negative):
    """(the indices as a host int array in [0, size), an int32 Tensor of them on x's device
    or None to upload) for indexing dimension d of x; negative indices count from the end
    where `negative` (x[idx]), not for index_select (as PyTorch). IndexError names a bad one."""
    size = x.shape[d]
    if isinstance(index, Node):
        index = index.value
    device_index = None
    if isinstance(index, Tensor):
        _devices_of(op, x, index)
        if index.dtype != np.int32:
            raise IndexError(f"{op}: an index tensor must be int32, got {index.dtype.name}")
        # An index out of range would read outside x on the device, so indices are checked on
        # the host: with the copy an upload kept, else read back (a sync).
        host = index._labels if index._labels is not None else index.to_host()
        device_index = index
    else:
        host = np.asarray(index)
        if isinstance(index, list) and host.size == 0:  # x[[]], x[[[], []]] pick nothing:
            host = host.astype(np.int64)                 # NumPy reads empty lists as floats
        if host.dtype.kind not in "iu":
            raise IndexError(f"{op}: indices must be integers, got dtype {host.dtype}")
    bad = host[(host < (-size if negative else 0)) | (host >= size)]
    if bad.size:
        raise IndexError(f"{op}: index {bad.flat[0]} is out of bounds for dimension {d} with "
                         f"size {size}")
    if negative and (host < 0).any():
        host, device_index = np.where(host < 0, host + size, host), None
    return host.astype(np.int64), device_index


def _gather(x, d, host, device_index):
    """The rows host (an int array in [0, size), flattened) of x along dimension d: x seen as
    (outer, size, inner) -> (outer, m, inner). On the NumPy backend np.take and, for the
    backward, np.add.at; on OpenCL one gather and, for the backward, a sum per row of x over
    the positions gathered from it (sorted by row on the host, so no atomics are needed)."""
    flat = host.reshape(-1)
    outer, size, inner = math.prod(x.shape[:d]), x.shape[d], math.prod(x.shape[d + 1:])
    X = x.value
    out = _like(X, x.shape[:d] + (flat.size,) + x.shape[d + 1:])
    if X.device.backend == "cpu":
        np.take(X.data, flat, axis=d, out=out.data)
    elif out.size:
        if device_index is None:
            device_index = Tensor.from_host(flat.astype(np.int32), X.queue)
        X.device.launch("gather_rows", *_grid(out.size), outer, size, flat.size, inner,
                        device_index.data, X.data, out.data, half=X.dtype == np.float16)

    def backward(g):  # g (outer, m, inner) -> dx (outer, size, inner), repeated rows summed
        grad = _like(g, x.shape)
        if g.device.backend == "cpu":
            grad.data.fill(0)
            np.add.at(grad.data.reshape(outer, size, inner), (slice(None), flat),
                      g.data.reshape(outer, flat.size, inner))
        elif grad.size:
            # Row r's gradient sums g at positions order[starts[r]:starts[r + 1]], in
            # increasing position, as np.add.at adds them: both backends agree to the bit.
            order = np.argsort(flat, kind="stable")
            starts = np.searchsorted(flat[order], np.arange(size + 1))
            order, starts = (Tensor.from_host(a.astype(np.int32), g.queue)
                             for a in (order, starts))
            g.device.launch("gather_rows_bwd", *_grid(grad.size), outer, size, flat.size, inner,
                            starts.data, order.data, g.data, grad.data)
        return (grad,)
    return _record(out, (x,), backward)


def index_select(x, dim, index):
    """The entries of x at `index` (a 1-D integer array or int32 Tensor, repeats allowed) along
    `dim`, as torch.index_select: out.shape[dim] = len(index). Indices must lie in
    [0, size); the gradient of a row picked several times is the sum of theirs."""
    (x,) = _nodes("index_select", x, numeric=False)
    if not x.shape:
        raise ValueError("index_select: expects at least a 1-dimensional tensor, got shape ()")
    d = _check_dim("index_select", dim, len(x.shape))
    host, device_index = _host_index("index_select", index, x, d, negative=False)
    if host.ndim > 1:
        raise IndexError(f"index_select: index must be a vector, got shape {host.shape}")
    return _gather(x, d, host, device_index)


def _index(x, key):
    """x[key] (Node.__getitem__), as PyTorch's indexing: a key of ints (from the end when
    negative), slices with a positive step, `...` and None (a new dimension of size 1), or
    one integer array (a NumPy array, a list or an int32 Tensor, of any shape; repeats and
    negative indices allowed) that picks along the leading dimension. A copy, unless the key
    only reshapes (`x[:]`, `x[None]`), which is a view."""
    (x,) = _nodes("index", x, numeric=False)
    if isinstance(key, (Node, Tensor, np.ndarray, list)):
        if not x.shape:
            raise IndexError("index: an integer array cannot index a 0-dimensional tensor")
        host, device_index = _host_index("index", key, x, 0, negative=True)
        return reshape(_gather(x, 0, host, device_index), host.shape + x.shape[1:])
    items = key if isinstance(key, tuple) else (key,)
    for item in items:
        if not (item is None or item is Ellipsis or isinstance(item, slice) or _is_int(item)):
            raise TypeError(f"index: {item!r} ({type(item).__name__}) is not a supported index: "
                            f"ints, slices, ..., None, or one integer array for dimension 0")
    ellipses = [i for i, item in enumerate(items) if item is Ellipsis]
    used = builtins.sum(item is not None and item is not Ellipsis for item in items)
    if len(ellipses) > 1:
        raise IndexError("index: an index can only have a single ellipsis ('...')")
    if used > len(x.shape):
        raise IndexError(f"index: too many indices ({used}) for a tensor of shape {x.shape}")
    if ellipses:
        at = ellipses[0]
        items = items[:at] + (slice(None),) * (len(x.shape) - used) + items[at + 1:]
    cuts, d, shape = [], 0, []  # every item checked before the first copy is queued
    for item in items:
        if item is None:
            shape.append(1)
            continue
        size = x.shape[d]
        if isinstance(item, slice):
            if _is_int(item.step) and item.step <= 0:
                raise ValueError(f"index: slice step must be greater than zero, got {item.step}")
            start, stop, step = item.indices(size)
            rows = len(range(start, stop, step))
            shape.append(rows)
        else:
            if not -size <= item < size:
                raise IndexError(f"index: index {item} is out of bounds for dimension {d} with "
                                 f"size {size}")
            start, step, rows = int(item) % size, 1, 1
        if rows != size:
            cuts.append((d, start, step, rows))
        d += 1
    value = x
    for cut in cuts:  # one copy per dimension that is cut
        value = _slice(value, *cut)
    return reshape(value, tuple(shape) + x.shape[d:])


# --- reductions -------------------------------------------------------------------------------

def _axes(op, shape, axis):
    if axis is None or (isinstance(axis, (tuple, list)) and not axis):  # (): all, as PyTorch
        return tuple(range(len(shape)))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else axis
    if not isinstance(axes, (tuple, list)) or not all(
            _is_int(a) for a in axes):
        raise TypeError(f"{op}: axis must be an int or a tuple of ints, got {axis!r}")
    ndim = max(len(shape), 1)
    normalised = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"{op}: axis {a} out of range for shape {shape}")
        normalised.append(int(a) % ndim)
    if len(set(normalised)) != len(normalised):
        raise ValueError(f"{op}: repeated axis in {axis}")
    return tuple(sorted(normalised)) if shape else ()


def _expand_axis_tensor(g, outer, R, inner, scale=1.0):
    """g seen as (outer, inner) -> (outer, R, inner), scale * g repeated along R."""
    out = _like(g, (outer, R, inner))
    if g.device.backend == "cpu":
        out.data[...] = g.data.reshape(outer, 1, inner) * scale
    elif out.size:
        g.device.launch("expand_axis", *_grid(out.size), outer, R, inner, scale, g.data, out.data)
    return out


def _reduce(op, x, axis, keepdims, mean):
    (x,) = _nodes(op, x)
    shape = x.shape
    axes = _axes(op, shape, axis)
    count = math.prod(shape[a] for a in axes)
    scale = (1.0 / count if count else math.nan) if mean else 1.0
    value, steps = x.value, []
    for a in reversed(axes):  # one axis at a time, last first, so earlier indices stay valid
        before = value.shape
        outer, R, inner = math.prod(before[:a]), before[a], math.prod(before[a + 1:])
        steps.append((outer, R, inner, before))
        last = a == axes[0]
        value = _sum_axis_tensor(value, outer, R, inner, scale if last else 1.0)
        value = value.reshape(before[:a] + before[a + 1:])
    if not axes and mean:  # mean over no axes is x itself, but a new tensor (float32)
        value = _cast(value, np.float32) if value.dtype == np.float16 else _copy(value)
    out_shape = tuple(1 if i in axes else s for i, s in enumerate(shape)) if keepdims else \
        tuple(s for i, s in enumerate(shape) if i not in axes)

    def backward(g):
        for i, (outer, R, inner, before) in enumerate(reversed(steps)):
            g = _expand_axis_tensor(g, outer, R, inner, scale if i == 0 else 1.0).reshape(before)
        return (g.reshape(shape),)
    return _record(value.reshape(out_shape), (x,), backward)


def reduce_sum(x, axis=None, keepdims=False):
    """Sum over `axis` (an int, a tuple, or None for all); the reduced axes are dropped."""
    return _reduce("sum", x, axis, keepdims, mean=False)


def reduce_mean(x, axis=None, keepdims=False):
    """Mean over `axis` (an int, a tuple, or None for all); the reduced axes are dropped."""
    return _reduce("mean", x, axis, keepdims, mean=True)


# max, min, argmax, var, std and logsumexp reduce one axis (an int), or all of x (None, seen
# as one row), with a kernel per output element that loops over the reduced axis R.

def _one_axis(op, shape, axis, keepdims):
    """x of `shape` seen as (outer, R, inner) along `axis`, and the output shape."""
    if axis is None:
        return 1, math.prod(shape), 1, ((1,) * len(shape) if keepdims else ())
    _check_int(op, "axis", axis, wrong_type=TypeError)
    (a,) = _axes(op, shape, axis) or (None,)  # a 0-d x takes axis 0 or -1, as PyTorch
    if a is None:
        return 1, 1, 1, ()
    out_shape = shape[:a] + (1,) * keepdims + shape[a + 1:]
    return math.prod(shape[:a]), shape[a], math.prod(shape[a + 1:]), out_shape


def _extremum_axis_tensor(op, x, outer, R, inner, largest):
    """x seen as (outer, R, inner) -> values (outer, inner) and int32 indices (outer, inner) of
    the first largest (smallest) element along R; NaN counts as the extreme, as PyTorch."""
    if R == 0:  # PyTorch raises IndexError (RuntimeError for all of x): a bad value, to netcl
        raise ValueError(f"{op}: cannot reduce an empty axis (x of shape {x.shape})")
    values = _like(x, (outer, inner), _compute_dtype(x.dtype))
    indices = _like(x, (outer, inner), np.int32)
    if x.device.backend == "cpu":
        v = x.data.reshape(outer, R, inner)
        first = (np.argmax if largest else np.argmin)(v, axis=1)  # the first NaN, if any
        indices.data[...] = first
        values.data[...] = np.take_along_axis(v, first[:, None, :], axis=1)[:, 0, :]
    elif values.size:
        x.device.launch("extremum_axis", *_grid(outer * inner), outer, R, inner, int(largest),
                        x.data, values.data, indices.data, half=x.dtype == np.float16)
    return values, indices


def _extremum_reduce(op, x, axis, keepdims, largest):
    (x,) = _nodes(op, x)
    outer, R, inner, out_shape = _one_axis(op, x.shape, axis, keepdims)
    X = x.value
    values, _ = _extremum_axis_tensor(op, X, outer, R, inner, largest)

    def backward(g):  # g shared equally among the elements equal to the extreme, as amax's
        out = _like(g, x.shape)
        if g.device.backend == "cpu":
            ties = X.data.reshape(outer, R, inner) == values.data.reshape(outer, 1, inner)
            with np.errstate(all="ignore"):  # a NaN extreme ties with nothing: NaN, as PyTorch
                out.data.reshape(outer, R, inner)[...] = (
                    g.data.reshape(outer, 1, inner) / ties.sum(1, keepdims=True, dtype=g.dtype)
                    * ties)
        elif g.size:
            g.device.launch("extremum_axis_bwd", *_grid(outer * inner), outer, R, inner, g.data,
                            X.data, values.data, out.data, half=X.dtype == np.float16)
        return (out,)
    return _record(values.reshape(out_shape), (x,), backward)


def reduce_max(x, axis=None, keepdims=False):
    """The largest value along `axis` (an int; None: of all of x), as torch.amax: the values
    only, not torch.max(x, dim)'s (values, indices) pair; argmax gives the indices. Ties share
    the gradient equally. NaN is the largest. An empty axis raises ValueError.
    functional.max (not netcl.max, which would hide Python's max in this file)."""
    return _extremum_reduce("max", x, axis, keepdims, largest=True)


def reduce_min(x, axis=None, keepdims=False):
    """The smallest value along `axis`, as torch.amin; see reduce_max. functional.min."""
    return _extremum_reduce("min", x, axis, keepdims, largest=False)


def argmax(x, axis=None, keepdims=False):
    """The index of the first largest element along `axis` (None: into the flattened x), as
    torch.argmax: an int32 Tensor, outside autograd. NaN counts as the largest."""
    (x,) = _nodes("argmax", x)
    outer, R, inner, out_shape = _one_axis("argmax", x.shape, axis, keepdims)
    _, indices = _extremum_axis_tensor("argmax", x.value, outer, R, inner, largest=True)
    return indices.reshape(out_shape)


def _variance(op, x, axis, correction, keepdims, root):
    _check_number(op, "correction", correction, wrong_type=TypeError)
    (x,) = _nodes(op, x)
    outer, R, inner, out_shape = _one_axis(op, x.shape, axis, keepdims)
    X = x.value
    # PyTorch divides by max(N - correction, 0): inf or nan when N <= correction.
    dof = float(max(R - correction, 0))
    y = _like(X, (outer, inner), _compute_dtype(X.dtype))
    if X.device.backend == "cpu":
        v = X.data.reshape(outer, R, inner).astype(y.dtype, copy=False)
        with np.errstate(all="ignore"):  # an empty axis: nan, as PyTorch
            squares = np.sum((v - v.sum(axis=1, keepdims=True) / R) ** 2, axis=1)
            y.data[...] = np.sqrt(squares / dof) if root else squares / dof
    elif y.size:
        X.device.launch("var_axis", *_grid(y.size), outer, R, inner, dof, int(root), X.data,
                        y.data, half=X.dtype == np.float16)

    def backward(g):
        # PyTorch's var_backward: 2 / (N - correction) * g * (x - mean), with g / (2 std) for
        # std (0 where std is 0, as PyTorch's std_backward). PyTorch's full reduction with
        # N <= correction has its own rule (inf or nan everywhere); this is the per-axis one.
        scale = 2.0 / (R - correction) if R != correction else math.inf
        out = _like(g, x.shape)
        if g.device.backend == "cpu":
            v = X.data.reshape(outer, R, inner).astype(g.dtype, copy=False)
            gv, yv = g.data.reshape(outer, 1, inner), y.data.reshape(outer, 1, inner)
            with np.errstate(all="ignore"):
                if root:
                    gv = np.where(yv == 0, 0, gv / (2 * yv))
                out.data.reshape(outer, R, inner)[...] = \
                    scale * gv * (v - v.sum(axis=1, keepdims=True) / R)
        elif g.size:
            g.device.launch("var_axis_bwd", *_grid(outer * inner), outer, R, inner, scale,
                            int(root), g.data, y.data, X.data, out.data,
                            half=X.dtype == np.float16)
        return (out,)
    return _record(y.reshape(out_shape), (x,), backward)


def var(x, axis=None, correction=1, keepdims=False):
    """Variance along `axis` (an int; None: of all of x), sum((x - mean)^2) / (N - correction),
    as torch.var: correction=1 (Bessel's, the unbiased estimate) is PyTorch's default."""
    return _variance("var", x, axis, correction, keepdims, root=False)


def std(x, axis=None, correction=1, keepdims=False):
    """Standard deviation, sqrt(var(x, axis, correction)), as torch.std."""
    return _variance("std", x, axis, correction, keepdims, root=True)


def logsumexp(x, axis, keepdims=False):
    """log(sum(exp(x))) along `axis`, computed stably, as torch.logsumexp: shifted by the
    maximum (by 0 where it is infinite, so a row of -inf gives -inf and one holding inf gives
    inf, not nan); an empty axis gives -inf. The gradient is softmax(x) times g."""
    (x,) = _nodes("logsumexp", x)
    outer, R, inner, out_shape = _one_axis("logsumexp", x.shape, axis, keepdims)
    X = x.value
    y = _like(X, (outer, inner), _compute_dtype(X.dtype))
    if X.device.backend == "cpu":
        v = X.data.reshape(outer, R, inner).astype(y.dtype, copy=False)
        peak = np.max(v, axis=1, initial=-np.inf)
        shift = np.where(np.isinf(peak), 0, peak)
        with np.errstate(all="ignore"):
            y.data[...] = shift + np.log(np.sum(np.exp(v - shift[:, None, :]), axis=1))
    elif y.size:
        X.device.launch("logsumexp_axis", *_grid(y.size), outer, R, inner, X.data, y.data,
                        half=X.dtype == np.float16)

    def backward(g):
        out = _like(g, x.shape)
        if g.device.backend == "cpu":
            with np.errstate(all="ignore"):
                out.data.reshape(outer, R, inner)[...] = g.data.reshape(outer, 1, inner) * \
                    np.exp(X.data.reshape(outer, R, inner) - y.data.reshape(outer, 1, inner))
        elif out.size:
            g.device.launch("logsumexp_axis_bwd", *_grid(out.size), outer, R, inner, g.data,
                            X.data, y.data, out.data, half=X.dtype == np.float16)
        return (out,)
    return _record(y.reshape(out_shape), (x,), backward)


# --- softmax and losses -----------------------------------------------------------------------

def _softmax(op, x, axis, log_mode):
    _check_int(op, "axis", axis)
    (x,) = _nodes(op, x)
    (a,) = _axes(op, x.shape, axis) or (0,)
    shape = x.shape or (1,)
    outer, R, inner = math.prod(shape[:a]), shape[a], math.prod(shape[a + 1:])
    X = x.value
    y = _like(X, dtype=_compute_dtype(X.dtype))
    if X.device.backend == "cpu":
        v = X.data.reshape(outer, R, inner).astype(y.dtype, copy=False)
        shifted = v - v.max(axis=1, keepdims=True, initial=-np.inf)  # (an empty axis: empty)
        with np.errstate(all="ignore"):
            lse = np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            y.data.reshape(outer, R, inner)[...] = (shifted - lse if log_mode
                                                    else np.exp(shifted - lse))
    elif X.size:
        X.device.launch("softmax_axis", *_grid(outer * inner), outer, R, inner, int(log_mode),
                        X.data, y.data, half=X.dtype == np.float16)

    def backward(g):
        out = _like(g)
        if g.device.backend == "cpu":
            gv, yv = g.data.reshape(outer, R, inner), y.data.reshape(outer, R, inner)
            if log_mode:
                out.data.reshape(outer, R, inner)[...] = gv - np.exp(yv) * gv.sum(1, keepdims=True)
            else:
                out.data.reshape(outer, R, inner)[...] = yv * (gv - (gv * yv).sum(1, keepdims=True))
        elif g.size:
            g.device.launch("softmax_axis_bwd", *_grid(outer * inner), outer, R, inner,
                            int(log_mode), g.data, y.data, out.data)
        return (out,)
    return _record(y, (x,), backward)


def softmax(x, axis=-1):
    """exp(x) / sum(exp(x)) along `axis`."""
    return _softmax("softmax", x, axis, log_mode=False)


def log_softmax(x, axis=-1):
    """x - logsumexp(x) along `axis`, computed stably."""
    return _softmax("log_softmax", x, axis, log_mode=True)


_REDUCTIONS = ("mean", "sum", "none")


def _check_loss_args(op, reduction, ignore_index=-100):
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    _check_int(op, "ignore_index", ignore_index, wrong_type=TypeError)


def _class_layout(op, x, what):
    """Scores x (C,), (N, C) or (N, C, d1, ...) seen as (outer, C, inner), the class axis in
    the middle, as the kernels read it (in place: no transposition); and the shape of the
    losses, one per target: (), (N,) or (N, d1, ...)."""
    if not x.shape:
        raise ValueError(f"{op}: {what} must be (C,), (N, C) or (N, C, d1, ...), got shape ()")
    if len(x.shape) == 1:
        return (1, x.shape[0], 1), ()
    return (x.shape[0], x.shape[1], math.prod(x.shape[2:])), x.shape[:1] + x.shape[2:]


def _class_target(op, x, target, loss_shape, ignore_index, probabilities):
    """The target of a classification loss on scores x, checked on the host before anything
    is enqueued: (T, soft, count). T is on x's device: int32 class indices shaped like the
    losses, or (soft, where `probabilities` allows) float probabilities shaped like x. count
    is what "mean" divides by: the index targets other than ignore_index, or the number of
    probability rows (0 when there are no classes, so the mean is NaN, as PyTorch's)."""
    t = target.value if isinstance(target, Node) else target
    if isinstance(t, Tensor):
        _devices_of(op, x, t)
        soft = t.dtype.kind == "f"
        # A wrong label would read out of bounds on the device, so labels are checked on the
        # host: with the copy an upload kept, else read back (a sync).
        host = None if soft else (t._labels if t._labels is not None else t.to_host())
    else:
        host = np.asarray(t)
        soft = host.dtype.kind == "f"
        if host.dtype.kind not in "iuf":
            raise ValueError(f"{op}: target must hold integers or floats, got {host.dtype}")
    C = x.shape[1] if len(x.shape) > 1 else x.shape[0]
    if soft:
        shape = t.shape if isinstance(t, Tensor) else host.shape
        if not probabilities:
            raise ValueError(f"{op}: target must hold class indices (integers), got floats "
                             f"of shape {shape}")
        if shape != x.shape:
            raise ValueError(f"{op}: probability target of shape {shape} does not match "
                             f"logits {x.shape} (a probability target has the logits' shape)")
        if ignore_index >= 0:  # PyTorch's rule: the default -100 passes unnoticed
            raise ValueError(f"{op}: ignore_index={ignore_index} is not supported for "
                             f"probability targets")
        T = _float32(t) if isinstance(t, Tensor) else Tensor.from_host(
            host, x.value.queue, _compute_dtype(x.dtype))
        return T, True, math.prod(loss_shape) if C else 0
    if host.shape != loss_shape:
        raise ValueError(f"{op}: index target of shape {host.shape} does not match logits "
                         f"{x.shape}; expected {loss_shape}")
    bad = host[((host < 0) | (host >= C)) & (host != ignore_index)]
    if bad.size:
        raise ValueError(f"{op}: target label {bad[0]} out of range [0, {C})")
    T = t if isinstance(t, Tensor) else Tensor.from_host(host.astype(np.int32), x.value.queue)
    return T, False, int(np.count_nonzero(host != ignore_index))


def _reduce_losses(losses, reduction, count):
    """The losses themselves ("none"), their sum, or their sum / count ("mean"; NaN when count
    is 0, as PyTorch's mean over nothing)."""
    if reduction == "none":
        return losses
    scale = 1.0 if reduction == "sum" else 1.0 / count if count else math.nan
    return _sum_axis_tensor(losses, 1, losses.size, 1, scale).reshape(())


def _log_softmax_classes(logits):
    """log_softmax over the classes of logits (outer, C, inner): the NumPy reference of the
    kernels' row loops. initial=-inf, as the kernels start their maximum: with C = 0 the empty
    sums are 0, and log(0) no error."""
    shifted = logits - logits.max(axis=1, keepdims=True, initial=-np.inf)
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def _pick_class(values, labels, kept):
    """values (outer, C, inner) at the classes labels (outer, 1, inner). Where not kept (an
    ignored target) class 0 is read instead, for the caller to mask; with C = 0 every target
    is ignored and the picks are zeros."""
    if not values.shape[1]:
        return np.zeros(labels.shape, values.dtype)
    return np.take_along_axis(values, np.where(kept, labels, 0), axis=1)


def cross_entropy(logits, target, reduction="mean", ignore_index=-100, label_smoothing=0.0):
    """Cross-entropy of logits (C,), (N, C) or (N, C, d1, ...) against class indices (), (N,)
    or (N, d1, ...), or probabilities shaped like the logits, as PyTorch's cross_entropy.

    Index targets: any integer array or an int32 Tensor; an index outside [0, C) raises
    unless it is ignore_index: such a target adds nothing, and "mean" divides by the number
    of the others (NaN if there are none). Probability (one-hot or soft) targets give the
    same loss and gradient as indices would; "mean" divides by the number of targets, so the
    mean over empty logits is NaN and the sum 0. label_smoothing e in [0, 1] mixes every
    target with the uniform distribution: (1 - e) t + e / C (PyTorch's formula). Index
    targets are constants; a probability target that requires a gradient gets one, as in
    PyTorch: -(1 - e) log_softmax(logits), scaled as the loss was reduced.
    """
    _check_loss_args("cross_entropy", reduction, ignore_index)
    # PyTorch refuses only values above 1 (it silently treats negatives and NaN as 0); its
    # documented range is [0, 1], and that is what is checked here.
    smoothing = _check_number("cross_entropy", "label_smoothing", label_smoothing, 0.0, 1.0)
    (x,) = _nodes("cross_entropy", logits)
    (outer, C, inner), loss_shape = _class_layout("cross_entropy", x, "logits")
    T, soft, count = _class_target("cross_entropy", x, target, loss_shape, ignore_index,
                                   probabilities=True)
    t = target if soft and isinstance(target, Node) and target.requires_grad else None
    X = x.value
    half = X.dtype == np.float16  # float16 logits are read as such; the loss is float32
    uniform = smoothing / C if C else 0.0  # the smoothed target's share of every class

    losses = _like(X, loss_shape, _compute_dtype(X.dtype))
    if X.device.backend == "cpu":
        log_p = _log_softmax_classes(X.data.reshape(outer, C, inner).astype(losses.dtype,
                                                                           copy=False))
        if soft:
            smoothed = T.data.reshape(outer, C, inner) * (1 - smoothing) + uniform
            losses.data[...] = -(smoothed * log_p).sum(axis=1).reshape(loss_shape)
        else:
            labels = T.data.reshape(outer, 1, inner)
            kept = labels != ignore_index
            nll = -_pick_class(log_p, labels, kept)
            if smoothing:  # PyTorch: (1 - e) nll + e / C * sum over the classes of -log p
                nll = (1 - smoothing) * nll - uniform * log_p.sum(axis=1, keepdims=True)
            losses.data[...] = np.where(kept, nll, 0).reshape(loss_shape)
    elif losses.size:
        if soft:
            X.device.launch("cross_entropy_soft", *_grid(losses.size), outer, C, inner,
                            smoothing, X.data, T.data, losses.data, half=half)
        else:
            X.device.launch("cross_entropy_index", *_grid(losses.size), outer, C, inner,
                            ignore_index, smoothing, X.data, T.data, losses.data, half=half)
    loss = _reduce_losses(losses, reduction, count)
    scale = 1.0 / count if reduction == "mean" and count else 1.0
    per_target = int(reduction == "none")  # g has one value per target, else one in all

    def backward(g):  # g () or loss_shape -> dlogits (outer, C, inner), dtarget (probabilities)
        # dlogits in the logits' storage, float16 under autocast: the kernel rounds it once,
        # as the Tape's cast for their op would, so that cast (a launch) is not needed.
        grad_x = (_like(X, dtype=X.dtype if _half_grad(X) else losses.dtype)
                  if x.requires_grad else None)
        grad_t = _like(T) if t is not None else None
        if g.device.backend == "cpu":
            g_rows = scale * g.data.reshape((outer, 1, inner) if per_target else (1, 1, 1))
            log_p = _log_softmax_classes(X.data.reshape(outer, C, inner).astype(losses.dtype,
                                                                               copy=False))
            if grad_x is not None:  # softmax(x) sum_c t_c - t, t the smoothed target
                if soft:
                    smoothed = T.data.reshape(outer, C, inner) * (1 - smoothing) + uniform
                    grad = np.exp(log_p) * smoothed.sum(axis=1, keepdims=True) - smoothed
                else:
                    labels = T.data.reshape(outer, 1, inner)
                    one_hot = np.arange(C).reshape(1, C, 1) == labels
                    grad = np.where(labels != ignore_index,
                                    np.exp(log_p) - (one_hot * (1 - smoothing) + uniform), 0)
                grad_x.data[...] = (grad * g_rows).reshape(X.shape)
            if grad_t is not None:
                grad_t.data[...] = (-(1 - smoothing) * log_p * g_rows).reshape(T.shape)
        elif losses.size:
            if grad_x is not None:
                half_grad = grad_x.dtype == np.float16
                g.device.launch("cross_entropy_bwd", *_grid(losses.size), outer, C, inner,
                                per_target, scale, int(soft), ignore_index, smoothing, g.data,
                                X.data, None if soft else T.data, T.data if soft else None,
                                None if half_grad else grad_x.data,
                                grad_x.data if half_grad else None, half=half)
            if grad_t is not None:
                g.device.launch("cross_entropy_target_bwd", *_grid(losses.size), outer, C,
                                inner, per_target, scale, smoothing, g.data, X.data,
                                grad_t.data, half=half)
        return (grad_x,) if t is None else (grad_x, grad_t)
    return _record(loss, (x,) if t is None else (x, t), backward)


def nll_loss(log_probs, target, reduction="mean", ignore_index=-100):
    """The negative log-likelihood -log_probs[target] of log-probabilities (C,), (N, C) or
    (N, C, d1, ...) (a log_softmax over axis 1) against class indices (), (N,) or
    (N, d1, ...), as PyTorch's nll_loss: a target equal to ignore_index adds nothing, and
    "mean" divides by the number of the others (NaN if there are none). The target is a
    constant; cross_entropy is log_softmax and nll_loss in one pass."""
    _check_loss_args("nll_loss", reduction, ignore_index)
    (x,) = _nodes("nll_loss", log_probs)
    (outer, C, inner), loss_shape = _class_layout("nll_loss", x, "log_probs")
    T, _, count = _class_target("nll_loss", x, target, loss_shape, ignore_index,
                                probabilities=False)
    X = x.value
    losses = _like(X, loss_shape, _compute_dtype(X.dtype))
    if X.device.backend == "cpu":
        labels = T.data.reshape(outer, 1, inner)
        kept = labels != ignore_index
        picked = _pick_class(X.data.reshape(outer, C, inner), labels, kept)
        losses.data[...] = np.where(kept, -picked, 0).reshape(loss_shape)
    elif losses.size:
        X.device.launch("nll_loss_fwd", *_grid(losses.size), outer, C, inner, ignore_index,
                        X.data, T.data, losses.data, half=X.dtype == np.float16)
    loss = _reduce_losses(losses, reduction, count)
    scale = 1.0 / count if reduction == "mean" and count else 1.0
    per_target = int(reduction == "none")

    def backward(g):  # g () or loss_shape -> dlog_probs: -g at each target's class, else 0
        grad_x = _like(X, dtype=losses.dtype)
        if g.device.backend == "cpu":
            labels = T.data.reshape(outer, 1, inner)
            hit = (np.arange(C).reshape(1, C, 1) == labels) & (labels != ignore_index)
            g_rows = g.data.reshape((outer, 1, inner) if per_target else (1, 1, 1))
            grad_x.data[...] = np.where(hit, -scale * g_rows, 0).reshape(X.shape)
        elif grad_x.size:
            g.device.launch("nll_loss_bwd", *_grid(grad_x.size), outer, C, inner, per_target,
                            scale, ignore_index, g.data, T.data, grad_x.data)
        return (grad_x,)
    return _record(loss, (x,), backward)


def _loss_weight(op, name, value, x):
    """A loss's weight or pos_weight for input x: None, or a constant Tensor in x's compute
    dtype whose shape broadcasts to x's (PyTorch multiplies in place: x's shape may not grow).
    On OpenCL it is repeated to x's shape on the device unless the kernels can repeat it
    themselves (i % size): a trailing part of x's shape, leading 1s aside."""
    if value is None:
        return None
    if isinstance(value, Node) and value.requires_grad and _state.tapes and \
            _state.grad_enabled[-1]:  # PyTorch refuses this too: it defines no such gradient
        raise ValueError(f"{op}: {name} requires a gradient, which the loss does not define "
                         f"(a {name} is a constant)")
    if isinstance(value, (Node, Tensor)):
        w = _float32(_as_tensor(op, value.value if isinstance(value, Node) else value, x.value))
        if w.dtype.kind != "f":
            raise ValueError(f"{op}: {name} of dtype {w.dtype.name}; a {name} holds floats")
    else:
        w = Tensor.from_host(_real_array(op, value, name), x.value.queue,
                             _compute_dtype(x.dtype))
    try:
        fits = np.broadcast_shapes(w.shape, x.shape) == x.shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"{op}: {name} of shape {w.shape} does not broadcast to the input's "
                         f"shape {x.shape}")
    core = w.shape[next((i for i, s in enumerate(w.shape) if s != 1), len(w.shape)):]
    if x.device.backend == "cpu" or core == x.shape[len(x.shape) - len(core):]:
        return w
    padded = (1,) * (len(x.shape) - len(w.shape)) + w.shape
    for axis, size in enumerate(x.shape):  # expand one axis at a time, the earlier ones done
        if padded[axis] != size:
            w = _expand_axis_tensor(w, math.prod(x.shape[:axis]), size,
                                    math.prod(padded[axis + 1:]))
    return w.reshape(x.shape)


def _log_sigmoid(x):
    """log(sigmoid(x)) = min(x, 0) - log1p(exp(-|x|)): exp never overflows."""
    return np.minimum(x, 0) - np.log1p(np.exp(-np.abs(x)))


def binary_cross_entropy_with_logits(input, target, weight=None, reduction="mean",
                                     pos_weight=None):
    """Binary cross-entropy of logits against targets in [0, 1] of the same shape, as
    PyTorch's binary_cross_entropy_with_logits, in its stable form (no sigmoid is rounded):
        loss = weight * ((1 - t) x - (1 + (pos_weight - 1) t) log_sigmoid(x))
    weight and pos_weight (None: 1) broadcast to the input's shape as PyTorch's (a
    pos_weight (C,) weighs the positives of each class of (N, C) input) and are constants;
    the target may require a gradient. "mean" divides by the number of elements (NaN if
    there are none)."""
    op = "binary_cross_entropy_with_logits"
    _check_loss_args(op, reduction)
    x, t = _nodes(op, input, target)
    if t.shape != x.shape:
        raise ValueError(f"{op}: target shape {t.shape} must be the same as input shape "
                         f"{x.shape}")
    W, PW = _loss_weight(op, "weight", weight, x), _loss_weight(op, "pos_weight", pos_weight, x)
    X, T = x.value, _float32(t.value)
    n = X.size
    # the kernels' sizes of the weights they repeat (i % size); 0: no weight, i.e. 1
    sizes = (0 if W is None else W.size, 0 if PW is None else PW.size)
    weights = (None if W is None else W.data, None if PW is None else PW.data)
    half = X.dtype == np.float16

    losses = _like(X, dtype=_compute_dtype(X.dtype))
    if X.device.backend == "cpu":
        logit = X.data.astype(losses.dtype, copy=False)
        log_weight = 1 if PW is None else 1 + (PW.data - 1) * T.data  # PyTorch's order
        loss = (1 - T.data) * logit - log_weight * _log_sigmoid(logit)
        losses.data[...] = loss if W is None else loss * W.data
    elif n:
        X.device.launch("bce_logits_fwd", *_grid(n), n, *sizes, X.data, T.data, *weights,
                        losses.data, half=half)
    scale = 1.0 / n if reduction == "mean" and n else 1.0
    per_element = int(reduction == "none")

    def backward(g):  # g () or x's shape -> dinput, dtarget
        grads = []
        for wrt_target, node in ((0, x), (1, t)):
            if not node.requires_grad:
                grads.append(None)
                continue
            grad = _like(X, dtype=losses.dtype)
            if g.device.backend == "cpu":
                logit = X.data.astype(losses.dtype, copy=False)
                if wrt_target:  # -x - (pos_weight - 1) log_sigmoid(x)
                    d = -logit if PW is None else -logit - (PW.data - 1) * _log_sigmoid(logit)
                else:  # (1 + (pos_weight - 1) t) sigmoid(x) - pos_weight t
                    with np.errstate(over="ignore"):
                        sig = 1 / (1 + np.exp(-logit))
                    d = sig - T.data if PW is None else \
                        (1 + (PW.data - 1) * T.data) * sig - PW.data * T.data
                d = d * scale * g.data.reshape(X.shape if per_element else ())
                grad.data[...] = d if W is None else d * W.data
            elif n:
                g.device.launch("bce_logits_bwd", *_grid(n), n, per_element, scale, *sizes,
                                wrt_target, g.data, X.data, T.data, *weights, grad.data,
                                half=half)
            grads.append(grad)
        return grads
    return _record(_reduce_losses(losses, reduction, n), (x, t), backward)


def mse_loss(input, target, reduction="mean"):
    """Mean (or summed, or per-element) squared error (input - target) ** 2, in float32 for
    float16 storage (a square overflows float16 from a difference of 256)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"mse_loss: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    x, t = _nodes("mse_loss", input, target)
    if x.shape != t.shape:
        raise ValueError(f"mse_loss: input shape {x.shape} != target shape {t.shape}")
    diff = sub(_to_float32(x), _to_float32(t))
    squared = mul(diff, diff)
    return squared if reduction == "none" else _reduce(reduction, squared, None, False,
                                                       mean=reduction == "mean")


# --- convolution and pooling ----------------------------------------------------------------
# Images are NCHW. Each op slides an (R, S) window over the (H, W) plane, padded by (PH, PW)
# on every side, in steps of (SH, SW); conv2d's window may be dilated, its taps (DH, DW)
# apart; output sizes round down, as PyTorch. The NumPy versions
# view every window at once through stride tricks. On OpenCL, conv2d is the GEMM above on
# the columns im2col writes (C*R*S values per output pixel), so it gets faster whenever the
# GEMM does. On GPUs the forward and the weight gradient gather those columns from the
# input as they load their tiles instead (an implicit GEMM: the vector kernels with another
# fetch of B, _conv_gemm), where the operands allow; the columns then cost neither memory
# nor a pass. On CPU devices im2col writes the packed GEMM's panels itself and the products
# read and write NCHW, so the columns are written once and read once and nothing is
# swapped (the conv2d benchmark's kernels outside the GEMM: 155 -> 26 ms, in one run).
# Every backward is a gather (one work-item per input pixel, or on CPU devices per plane,
# sums what it fed): no atomics.

def _pair(op, name, value, minimum):
    """kernel_size, stride, padding or dilation: an int or a pair of ints, each >= minimum (as
    PyTorch)."""
    pair = (value, value) if isinstance(value, (int, np.integer)) else value
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(
            _is_int(v) and v >= minimum for v in pair)):
        kind = "positive" if minimum else "non-negative"
        raise ValueError(f"{op}: {name} must be a {kind} int or a pair of them, got {value!r}")
    return int(pair[0]), int(pair[1])


def _window(op, x_shape, kernel, stride, padding, dilation=(1, 1)):
    """The geometry (H, W, R, S, SH, SW, PH, PW, DH, DW, OH, OW) of a kernel sliding over
    x (N, C, H, W): the order of kernels.cl's WINDOW_ARGS. A dilated kernel spans
    ((R - 1) DH + 1, (S - 1) DW + 1) pixels; raises if that is larger than the padded input."""
    if len(x_shape) != 4:
        raise ValueError(f"{op}: input must be 4-D (N, C, H, W), got shape {x_shape}")
    H, W = x_shape[2:]
    (R, S), (SH, SW), (PH, PW), (DH, DW) = kernel, stride, padding, dilation
    span_h, span_w = (R - 1) * DH + 1, (S - 1) * DW + 1
    if span_h > H + 2 * PH or span_w > W + 2 * PW:
        spans = "" if dilation == (1, 1) else \
            f" with dilation {dilation} spans ({span_h}, {span_w}), which"
        raise ValueError(f"{op}: kernel ({R}, {S}){spans} is larger than the padded input "
                         f"({H + 2 * PH}, {W + 2 * PW}) (input {x_shape}, padding {padding})")
    return (H, W, R, S, SH, SW, PH, PW, DH, DW,
            (H + 2 * PH - span_h) // SH + 1, (W + 2 * PW - span_w) // SW + 1)


def _windows_numpy(x, window, pad_value):
    """x (N, C, H, W) -> (N, C, OH, OW, R, S), every window of the padded x: a strided view
    (of the span of each dilated window, every DH-th row and DW-th column of it)."""
    H, W, R, S, SH, SW, PH, PW, DH, DW, OH, OW = window
    padded = np.pad(x, ((0, 0), (0, 0), (PH, PH), (PW, PW)), constant_values=pad_value)
    span = ((R - 1) * DH + 1, (S - 1) * DW + 1)
    return np.lib.stride_tricks.sliding_window_view(padded, span, axis=(2, 3))[
        :, :, ::SH, ::SW, ::DH, ::DW]


def _col2im_numpy(windows, window):
    """The adjoint of _windows_numpy: windows (N, C, OH, OW, R, S) summed onto (N, C, H, W)."""
    H, W, R, S, SH, SW, PH, PW, DH, DW, OH, OW = window
    N, C = windows.shape[:2]
    padded = np.zeros((N, C, H + 2 * PH, W + 2 * PW), windows.dtype)
    for r in range(R):
        for s in range(S):
            padded[:, :, r * DH:r * DH + SH * OH:SH, s * DW:s * DW + SW * OW:SW] += \
                windows[..., r, s]
    return padded[:, :, PH:PH + H, PW:PW + W]


_IM2COL_BYTES = 1 << 28  # conv2d's im2col buffer at most (256 MiB): larger batches go in chunks


def _im2col(X, n0, nb, window, tensor_cores=False, per_image=False, ones=False):
    """Samples n0 .. n0+nb-1 of x (N, C, H, W) -> cols (C*R*S, nb*OH*OW): column p holds the
    window of output pixel p, zeros where it covers padding; per_image: (nb, C*R*S, OH*OW),
    one such matrix per sample. float32, or with tensor_cores float16, their operands
    (rounded as they are copied where x is float32). ones: one more row, of ones, after the
    taps."""
    H, W, R, S, SH, SW, PH, PW, DH, DW, OH, OW = window
    C, L = X.shape[1], OH * OW
    taps = C * R * S + bool(ones)
    shape = (nb, taps, L) if per_image else (taps, nb * L)
    cols = _like(X, shape, np.float16 if tensor_cores else np.float32)
    if not tensor_cores:
        kernel = "im2col"
    else:
        kernel = "im2col_act" if X.dtype == np.float16 else "im2col_act_f"
    X.device.launch(kernel, (nb * L, C + bool(ones)), (256, 1), n0, nb, C, *window,
                    *_cols_strides(cols.shape, L), X.data, cols.data,
                    half=tensor_cores or X.dtype == np.float16)
    return cols


def _cols_strides(shape, pixels):
    """kernels.cl's (tap_stride, image_stride) of im2col's columns: shaped (nb, taps, pixels),
    one matrix per sample, or (taps, nb * pixels), the samples' pixels side by side."""
    return (pixels, shape[1] * pixels) if len(shape) == 3 else (shape[1], pixels)


_PIXEL_RUN = 64  # kernels.cl's PIXEL_RUN: the pixels one im2col_panels_t work-item copies


def _im2col_panels(X, n0, nb, window, transposed, ones=False):
    """_im2col for CPU devices, written as the packed GEMM's panels from a zero-padded copy of
    the samples (kernels.cl: im2col_panels): cols (C*R*S, nb*OH*OW) in panels of the
    device's panel_cols pixels, the forward product's b; or transposed, cols^T (nb*OH*OW,
    C*R*S [+ 1 with ones: a column of ones after the taps]) in panels of as many taps, the
    weight gradient's. Both are (K, Np) float32 matrices for _packed_gemm's b_cols."""
    H, W, R, S, SH, SW, PH, PW, DH, DW, OH, OW = window
    C, pixels = X.shape[1], nb * OH * OW
    padded = _like(X, (nb, C, H + 2 * PH, W + 2 * PW), np.float32)
    X.device.launch("pad_images", *_grid(nb * C * (H + 2 * PH)), n0, nb, C, H, W, PH, PW,
                    X.data, padded.data, half=X.dtype == np.float16)
    taps, width = C * R * S, X.device.panel_cols
    if transposed:
        cols = _like(X, (pixels, _round_up(taps + bool(ones), width)), np.float32)
        X.device.launch("im2col_panels_t", (_ceil_div(pixels, _PIXEL_RUN),
                                            cols.shape[1] // width), (1, 1),
                        nb, C, *window, int(bool(ones)), padded.data, cols.data)
    else:  # one work-item per channel of a panel
        cols = _like(X, (taps, _round_up(pixels, width)), np.float32)
        X.device.launch("im2col_panels", *_grid(C * cols.shape[1] // width), nb, C,
                        *window, padded.data, cols.data)
    return cols


# On GPUs conv2d's forward (where the direct convolution below does not take it) and weight
# gradient gather their columns from the input as they go (kernels.cl: conv_fwd_*,
# conv_wgrad_*), where the operand they read in float4s allows it: the forward where C*R*S
# is a multiple of 4, the weight gradient where OH*OW is; not on tensor cores (kernels.cl
# says why). Both take the 64x64 block of _VECTOR_BLOCKS: on an
# H100 the benchmark's forward (its samples side by side) ran in 79 µs against 126 in the
# 64x128 block, the weight gradient in 92 against 148.
_CONV_BLOCKS = _VECTOR_BLOCKS[:1]
_MAX_GRID_BATCH = 65535  # the work-groups a launch may have along its third dimension


@functools.lru_cache(maxsize=256)
def _conv_plan(batch, M, K, N, units, may_split=True):
    """_conv_gemm's launch, a function of the sizes alone, as _tiled_plan's: (kernel suffix,
    global size, local size, splits, k_chunk). K is split only for a lone product (the
    weight gradient's, K = N*OH*OW) whose partial products may be float32 (may_split)."""
    rows, cols, threads = _vector_block(batch, M, N, units, _CONV_BLOCKS)
    grid = (_ceil_div(N, cols) * threads, _ceil_div(M, rows))
    count = batch * _ceil_div(M, rows) * _ceil_div(N, cols)
    splits = 1
    if may_split and batch == 1 and 2 * count <= units and K >= 2 * _SPLIT_K_MIN:
        splits = min(_ceil_div(_SPLIT_GROUPS_PER_UNIT * units, count), K // _VECTOR_SPLIT_K_MIN)
    k_chunk = _round_up(_ceil_div(K, splits), _TILE_K) if splits > 1 else K
    splits = _ceil_div(K, k_chunk) if K else 1
    return f"_{rows}x{cols}", grid + (batch * splits,), (threads, 1, 1), splits, k_chunk


def _conv_gemm(kernel, a, x, out, dims, window, bias=None, bias_grad=None):
    """out = an implicit-GEMM convolution of x (N, C, H, W) (kernels.cl: `kernel` is
    conv_fwd or conv_wgrad): conv_fwd, out (N, M, OH*OW) = a (M, C*R*S) @ each sample's
    columns [+ bias (M,) per row], as one product over the samples' columns side by side
    where OH*OW is a multiple of 4 (dims then (1, M, C*R*S, N*OH*OW)); conv_wgrad,
    out (M, C*R*S) = a (N, M, OH*OW), read as (M, N*OH*OW), @ the columns of every sample,
    transposed, and with bias_grad (M,) given, the sum of a over every pixel into it too:
    the columns get a row of ones, whose column of the product is that sum
    (_part_bias_column).
    dims: (batch, M, K, N) of the product, as _gemm_dims. In the build of x's storage: the
    tensors kernels.cl marks act_t (x; conv_fwd's out, conv_wgrad's a) are in it, the
    others float32."""
    batch, M, K, N = dims
    taps = N
    if bias_grad is not None:  # the row of ones, then padding to whole float4s
        N = _round_up(taps + 1, 4)
    suffix, grid, group, splits, k_chunk = _conv_plan(batch, M, K, N, a.device.compute_units,
                                                      out.dtype == np.float32)
    target = _like(out, (splits, M, N)) if splits > 1 or bias_grad is not None else out
    image = math.prod(x.shape[1:])
    c_run = window[-2] * window[-1] if kernel == "conv_fwd" and batch == 1 else 0
    a.device.launch(kernel + suffix, grid, group, M, N, K, k_chunk, 0, image,
                    _bias_code(bias, True), a.data, x.data, None if bias is None else bias.data,
                    target.data, image, -1 if bias_grad is None else taps, c_run, *window,
                    half=x.dtype == np.float16)
    if bias_grad is not None:
        _part_bias_column(target, splits, taps, out, bias_grad)
    elif splits > 1:
        _sum_axis_tensor(target, 1, splits, M * N, out=out._view((1, M * N)))


# conv2d's 3x3 convolutions at stride 1 on GPUs, the forward and the input gradient, are
# direct convolutions (kernels.cl: conv_direct_*). On an H100 the benchmark's forward took
# 76 µs against the implicit GEMM's 79, its input gradient 86 against 123 for the product
# and col2im, plus 9 µs per launch of conv_filters (one launch now lays out both); with the
# taps' loops not unrolled (any window) they took 100 and 131, so other windows keep the
# GEMMs. Per count of output rows, the block (rows, pixels, work-items): 64 rows by 128
# pixels took the forward 72 µs against 79 for 64 by 64. The input channels a chunk copies
# into local memory at most (4 ran slower, 12 no faster; 16, with loops over any window,
# 112 µs against 100); the local memory a work-group may take.
_DIRECT_BLOCKS = {64: (64, 128, 128), 32: (32, 128, 128)}
_DIRECT_CHANNELS = 8
_DIRECT_LOCAL_BYTES = 32 * 1024


def _direct_window(window):
    """Whether conv2d's window is one conv_direct computes: 3x3 filters, stride 1, no
    dilation."""
    H, W, R, S, SH, SW, PH, PW, DH, DW, OH, OW = window
    return R == S == 3 and SH == SW == DH == DW == 1


@functools.lru_cache(maxsize=256)
def _direct_plan(M, C, window, local_bytes):
    """conv_direct's launch for M output rows over C input channels: (kernel suffix, rows,
    pixels, work-items, channels per chunk, halo rows, halo width), or None where one
    channel's filters and halo do not fit in local_bytes of local memory."""
    H, W, R, S, SH, SW, PH, PW, DH, DW, OH, OW = window
    rows, pixels, threads = _DIRECT_BLOCKS[32 if M <= 32 else 64]
    # a block's pixels, from any column on, cover at most this many output rows
    spanned = min(OH, (pixels + OW - 2) // OW + 1)
    halo_rows, halo_width = spanned + 2, OW + 2
    per_channel = 4 * (rows * 9 + halo_rows * halo_width)
    chunk = min(C, _DIRECT_CHANNELS, local_bytes // per_channel)
    if chunk < 1:
        return None
    return f"_{rows}x{pixels}", rows, pixels, threads, chunk, halo_rows, halo_width


def _direct_fits(device, N, M, C, window):
    """conv_direct's plan (_direct_plan) for N samples of M output rows over C input
    channels on device; None where it does not fit, or its grid would pass 2**31
    work-items."""
    plan = _direct_plan(M, C, window, min(device.cl_device.local_mem_size, _DIRECT_LOCAL_BYTES))
    if plan is None or N * _ceil_div(window[-2] * window[-1], plan[2]) * plan[3] >= 2 ** 31:
        return None
    return plan


def _direct_filters(w, forward, turned):
    """The float32 3x3 filters w (K, C, 3, 3) as conv_direct reads them, both layouts in one
    launch (kernels.cl: conv_filters): (the forward's (C*9, K), the input gradient's turned
    (K*9, C)), None for one not asked for."""
    K, C = w.shape[:2]
    forward = _like(w, (C * 9, K), np.float32) if forward else None
    turned = _like(w, (K * 9, C), np.float32) if turned else None
    if w.size:
        w.device.launch("conv_filters", *_grid(w.size), K, C, 9, w.data,
                        None if forward is None else forward.data,
                        None if turned is None else turned.data)
    return forward, turned


def _conv_direct(filters, x, out, window, bias=None):
    """out (N, M, OH, OW) = the convolution of x (N, C, H, W) by 3x3 filters at stride 1
    (kernels.cl: conv_direct_*) [+ bias (M,)], the filters laid out (C*9, M) by
    _direct_filters: the forward's, or the input gradient's turned ones. x and out in one
    storage (the build that runs). Only where _direct_fits gives a plan."""
    H, W, R, S, SH, SW, PH, PW, DH, DW, OH, OW = window
    (N, M), C = out.shape[:2], x.shape[1]
    if not out.size:  # nothing to write (no launch: a grid of 0 work-items is an error
        return        # before OpenCL 2.1)
    suffix, rows, pixels, threads, chunk, halo_rows, halo_width = _direct_fits(
        x.device, N, M, C, window)
    tiles = _ceil_div(OH * OW, pixels)
    x.device.launch("conv_direct" + suffix, (N * tiles * threads, _ceil_div(M, rows)),
                    (threads, 1), M, C, chunk, tiles, int(bias is not None), halo_rows,
                    halo_width, filters.data, x.data, None if bias is None else bias.data,
                    out.data, cl.LocalMemory(4 * rows * chunk * 9),
                    cl.LocalMemory(4 * chunk * halo_rows * halo_width), *window,
                    half=x.dtype == np.float16)


# Where the device has the local memory and work-group size for them, conv2d's 3x3
# convolutions at stride 1 take Winograd's F(2x2, 3x3) instead (kernels.cl:
# conv_winograd_*): 16 multiplications per 2x2 output tile, filter and channel where the
# direct convolution takes 36, for the forward, the input gradient (by the turned filters)
# and the weight gradient (conv_winograd_wgrad_*, its tiles split over the compute units,
# then summed by conv_wgrad_sum). _WINOGRAD False keeps the direct kernels. Per count of
# output rows (the forward's filters, the input gradient's channels), the block (rows,
# tiles), a work-item per 64 outputs; the weight gradient's block (filters, channels); the
# local memory and work-items their largest block takes (the forward's two buffers of 4
# channels, the weight gradient's chunk of 8 tiles, as float32). The kernels' own
# CL_KERNEL_WORK_GROUP_SIZE is no guide: an H100's driver reports 256 for kernels that it
# builds for, and runs in, work-groups of 512.
_WINOGRAD = True
_WINOGRAD_BLOCKS = {64: (64, 32), 32: (32, 32)}
_WINOGRAD_WGRAD_BLOCK = (64, 32)
_WINOGRAD_CHUNK = 8
_WINOGRAD_LOCAL_BYTES = 16 * _WINOGRAD_CHUNK * 96 * 4
_WINOGRAD_THREADS = 512


def _winograd_device(info):
    """Whether an OpenCL device (its pyopencl.Device `info`) has the local memory and
    work-group size conv_winograd's kernels take; kernels.cl builds them only there."""
    return (info.local_mem_size >= _WINOGRAD_LOCAL_BYTES and
            info.max_work_group_size >= _WINOGRAD_THREADS)


def _winograd_fits(device, N, C, K, window):
    """Whether conv2d's window is one conv_winograd computes (_direct_window's), on a device
    that built its kernels (_winograd_device), for N samples of C input channels and K
    filters: the 2x2 tiles of the output and of the input (the input gradient's output),
    16 work-items each, and the transformed filters (16 * C * K values, C and K rounded up
    to multiples of 4: at most 16 * max(C, K)**2) stay below 2**31, as the kernels count in
    32 bits."""
    H, W, OH, OW = window[0], window[1], window[-2], window[-1]
    tiles = N * _ceil_div(max(H, OH), 2) * _ceil_div(max(W, OW), 2)
    filters = 16 * _round_up(max(C, K), 4) ** 2
    return (_WINOGRAD and _direct_window(window) and max(16 * tiles, filters) < 2 ** 31 and
            _winograd_device(device.cl_device) and "conv_winograd_64x32" in device._kernels)


def _winograd_filters(w, forward, turned):
    """The float32 3x3 filters w (K, C, 3, 3) transformed for conv_winograd (U = G w G^T),
    both layouts in one launch (kernels.cl: winograd_filters): (the forward's (16, C, Kp),
    the input gradient's turned (16, K, Cp)), Kp and Cp K and C rounded up to multiples of
    4; None for one not asked for."""
    K, C = w.shape[:2]
    Kp, Cp = _round_up(K, 4), _round_up(C, 4)
    forward = _like(w, (16, C, Kp), np.float32) if forward else None
    turned = _like(w, (16, K, Cp), np.float32) if turned else None
    if w.size:  # the forward's C x Kp work-items, then the turned's K x Cp
        w.device.launch("winograd_filters", *_grid(C * Kp + (K * Cp if turned else 0)), K, C,
                        Kp, Cp, w.data,
                        None if forward is None else forward.data,
                        None if turned is None else turned.data)
    return forward, turned


def _winograd_tiles(N, window):
    """The 2x2 output tiles of N samples of conv2d's window: (tiles, tile rows, tile
    columns), the last two per sample."""
    OH, OW = window[-2:]
    TH, TW = _ceil_div(OH, 2), _ceil_div(OW, 2)
    return N * TH * TW, TH, TW


def _winograd_mode(t, rounded):
    """The storage in which a Winograd kernel reads or writes tensor t (kernels.cl:
    wino_load): 2 float16; 1 float32 whose values are rounded to float16 as they pass
    (`rounded`: autocast's rounding, with no float16 copy); 0 float32."""
    return 2 if t.dtype == np.float16 else int(bool(rounded))


def _conv_winograd(filters, x, out, window, bias=None, rounded=False):
    """out (N, M, OH, OW) = the convolution of x (N, C, H, W) by 3x3 filters at stride 1
    (kernels.cl: conv_winograd_*) [+ bias (M,)], the filters transformed by
    _winograd_filters: the forward's, or the input gradient's turned ones. x and out each
    in float32 or float16 storage; `rounded`: a float32 one's values rounded to float16 as
    they are read or written (_winograd_mode)."""
    (N, M), C = out.shape[:2], x.shape[1]
    if not out.size:  # nothing to write (no launch: a grid of 0 work-items is an error
        return        # before OpenCL 2.1)
    rows, tiles = _WINOGRAD_BLOCKS[32 if M <= 32 else 64]
    T, TH, TW = _winograd_tiles(N, window)
    threads = rows * tiles // 4
    x_mode = _winograd_mode(x, rounded)  # a float32 x rounded as it is read: the _r kernels
    x.device.launch(f"conv_winograd_{rows}x{tiles}{'_r' if x_mode == 1 else ''}",
                    (_ceil_div(T, tiles) * threads, _ceil_div(M, rows)), (threads, 1), M, C,
                    filters.shape[2], T, TH, TW, int(bias is not None), filters.data, x.data,
                    None if bias is None else bias.data, out.data, x_mode,
                    _winograd_mode(out, rounded), *window)


def _winograd_wgrad(g, x, window, grad_w, grad_b=None, rounded=False):
    """conv2d's weight gradient by Winograd's F(2x2, 3x3) (kernels.cl:
    conv_winograd_wgrad_*): grad_w (K, C, 3, 3) = the sums over every pixel of g (N, K, OH,
    OW) times x (N, C, H, W) at each tap, and with grad_b (K,) given, the sums of g into it.
    g and x each in float32 or float16 storage (`rounded`: _conv_winograd's). The tiles
    split over the compute units; their partial sums, where there is more than one or a
    bias, are summed by conv_wgrad_sum. Only where N, K and C are nonzero."""
    (N, K), C = g.shape[:2], x.shape[1]
    filters, channels = _WINOGRAD_WGRAD_BLOCK
    T, TH, TW = _winograd_tiles(N, window)
    blocks = _ceil_div(K, filters) * _ceil_div(C, channels)
    # a split per compute unit (two per unit ran slower: 103 + 21 µs against 77 + 13)
    splits = max(1, min(_ceil_div(g.device.compute_units, blocks), _ceil_div(T, _WINOGRAD_CHUNK)))
    chunk = _round_up(_ceil_div(T, splits), _WINOGRAD_CHUNK)
    splits = _ceil_div(T, chunk)
    width = C * 9 + (grad_b is not None)
    direct = splits == 1 and grad_b is None  # the one split's sums are the gradient
    parts = grad_w if direct else _like(g, (splits, K, width), np.float32)
    threads = filters * channels // 4
    g.device.launch(f"conv_winograd_wgrad_{filters}x{channels}",
                    (splits * threads, _ceil_div(C, channels), _ceil_div(K, filters)),
                    (threads, 1, 1), K, C, T, TH, TW, chunk, width, g.data, x.data, parts.data,
                    _winograd_mode(g, rounded), _winograd_mode(x, rounded), *window)
    if not direct:
        g.device.launch("conv_wgrad_sum", *_grid(K * width), splits, K, C * 9, width,
                        parts.data, grad_w.data, None if grad_b is None else grad_b.data)


def _part_bias_column(products, splits, taps, dw=None, db=None):
    """conv2d's weight-gradient products whose column `taps` sums g (a row of ones in the
    columns), (splits, K, taps + 1 [+ padding]), summed over the splits and parted
    (kernels.cl: conv_wgrad_sum): (dw (K, taps), db (K,)), float32, into the ones given."""
    K, width = products.shape[-2:]
    dw = _like(products, (K, taps), np.float32) if dw is None else dw
    db = _like(products, (K,), np.float32) if db is None else db
    products.device.launch("conv_wgrad_sum", *_grid(K * width), splits, K, taps, width,
                           products.data, dw.data, db.data)
    return dw, db


def _summed(total, part):
    """total + part, in place into total (None: part itself)."""
    if total is None:
        return part
    _add_into(total, part)
    return total


def _row_block(x, start, rows):
    """Rows start .. start+rows-1 of x (M, ...): x itself when that is all of it, else a copy."""
    if start == 0 and rows == x.shape[0]:
        return x
    out = _like(x, (rows,) + x.shape[1:])
    if x.device.backend == "cpu":
        np.copyto(out.data, x.data[start:start + rows])
    elif out.size:
        cl.enqueue_copy(x.device.queue, out.data, x.data, src_offset=start * out.nbytes // rows,
                        byte_count=out.nbytes)
    return out


def _grouped_gemm(a, b, groups, trans_a=False, trans_b=False):
    """conv2d's products on OpenCL: a, b and the result cut into `groups` equal blocks of rows,
    block g of the result = op(block g of a) @ op(block g of b), as a block-diagonal matrix
    would give. With groups=1 this is _gemm itself; otherwise each group's operands are
    copied out and its product copied into place (the GEMM kernels take no offsets, and
    grouped convolutions are not on a hot path)."""
    if groups == 1:
        return _gemm(a, b, trans_a, trans_b)
    rows_a, rows_b = a.shape[0] // groups, b.shape[0] // groups
    out = None
    for g in range(groups):
        block = _gemm(_row_block(a, g * rows_a, rows_a), _row_block(b, g * rows_b, rows_b),
                      trans_a, trans_b)
        if out is None:
            out = _like(block, (groups * block.shape[0], block.shape[1]))
        if block.size:
            cl.enqueue_copy(a.device.queue, out.data, block.data, dst_offset=g * block.nbytes,
                            byte_count=block.nbytes)
    return out


def conv2d(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
    """x (N, C, H, W) with filters w (K, C / groups, R, S) [+ b (K,)] -> (N, K, OH, OW), as
    PyTorch's conv2d (a cross-correlation, zero padding). With G = groups, the channels split
    into G groups, and output channel k of group g = k // (K / G) sees only input channels
    g C/G .. (g+1) C/G - 1, as c' = g C/G + c:
        out[n, k, i, j] = b[k] + sum over c, r, s of
                          w[k, c, r, s] * x[n, c', i*SH + r*DH, j*SW + s*DW]
    stride, padding and dilation (the spacing of the kernel's taps) are an int or a pair
    (height, width). Inside autocast (OpenCL) the output is float16 storage; x is read in its
    own storage; the product is float32. On tensor cores x and w are rounded to float16 and
    every product runs there; by Winograd's kernels (3x3 filters at stride 1, where the
    device has them) a float32 x and output gradient are rounded to float16 as they are
    read, as PyTorch's autocast casts them, and a float32 x's gradient is rounded too."""
    stride = _pair("conv2d", "stride", stride, 1)
    padding = _pair("conv2d", "padding", padding, 0)
    dilation = _pair("conv2d", "dilation", dilation, 1)
    groups = _check_int("conv2d", "groups", groups, 1)
    x, w, *rest = _nodes("conv2d", x, w, *(() if b is None else (b,)))
    b = rest[0] if rest else None
    if len(w.shape) != 4:
        raise ValueError(f"conv2d: weight must be 4-D (K, C, R, S), got shape {w.shape}")
    window = _window("conv2d", x.shape, w.shape[2:], stride, padding, dilation)
    if w.shape[0] % groups:  # PyTorch's rule: every group has K / groups filters
        raise ValueError(f"conv2d: weight {w.shape} has {w.shape[0]} filters, not divisible "
                         f"by groups={groups}")
    if x.shape[1] != w.shape[1] * groups:
        per_group = "" if groups == 1 else f" ({w.shape[1]} per group, groups={groups})"
        raise ValueError(f"conv2d: input {x.shape} has {x.shape[1]} channels, weight {w.shape} "
                         f"expects {w.shape[1] * groups}{per_group}")
    if b is not None and b.shape != (w.shape[0],):
        raise ValueError(f"conv2d: bias shape {b.shape} != ({w.shape[0]},) for weight {w.shape}")
    H, W, R, S, SH, SW, PH, PW, DH, DW, OH, OW = window
    (N, C), K, L = x.shape[:2], w.shape[0], OH * OW
    G, group_taps = groups, w.shape[1] * R * S  # group_taps: the rows of one group's columns
    # (a float16 bias is widened: every kernel reads the bias as float32)
    X, weight, bias = x.value, w.value, None if b is None else _float32(b.value)
    weight_rows = weight.reshape((K, group_taps))  # a view: the GEMM's left operand
    # CPU devices' packed GEMM reads the columns as im2col writes them, and writes NCHW
    # (grouped convolutions take the general path below).
    panels = X.device.backend == "opencl" and X.device.gemm == "packed" and G == 1
    # im2col on the whole batch at once (fewer launches), in chunks of samples if too large.
    # Columns are float32; the weight gradient's panels pad each pixel's taps to a panel,
    # and its columns have a row of ones more for a bias that needs a gradient.
    taps = C * R * S + (b is not None and b.requires_grad)
    taps = _round_up(taps, X.device.panel_cols) if panels else taps
    per_chunk = max(1, _IM2COL_BYTES // max(1, taps * L * 4))
    chunks = [(n0, min(per_chunk, N - n0)) for n0 in range(0, N, per_chunk)]

    half = _half_activations(X.device)
    turned_filters = None  # the input gradient's (direct or Winograd), where the forward
    # lays them out
    # GPUs' implicit GEMMs (_conv_gemm), direct convolutions (_conv_direct) and Winograd's
    # (_conv_winograd): one group and float32 weights; x in the storage of the output (the
    # build they run in), but for Winograd's, which read and write either; per product the
    # layout _CONV_BLOCKS's comment gives
    gpu = (X.device.backend == "opencl" and X.device.gemm == "tiled" and G == 1 and
           weight.dtype == np.float32 and 0 < N <= _MAX_GRID_BATCH)
    # 3x3 windows at stride 1 by Winograd's F(2x2, 3x3) where the device allows, under
    # autocast too, in place of the tensor cores: float32 sums, 16 multiplications per tile
    # where the tensor cores' product takes 36 (and no columns). Its kernels read x and g
    # and write out and dx in either storage; under autocast a float32 x, g or dx has its
    # values rounded to float16 as they pass, as PyTorch's autocast rounds its float16
    # copies (so no copy: x is saved for backward as it is)
    winograd = (gpu and _winograd_fits(X.device, N, C, K, window) and
                X.dtype in (np.float16, np.float32))
    tensor_cores = half and X.device.tensor_cores and not winograd  # float16 operands
    if tensor_cores:  # (im2col rounds a float32 x as it copies it)
        X = X if X.dtype in (np.float16, np.float32) else _half_operand(X)
        weight_rows = _half_weight(w).reshape((K, group_taps))
    # the other kernels above: where the tensor cores do not take the products
    implicit = gpu and not tensor_cores and X.dtype == (np.float16 if half else np.float32)
    # float32 outside autocast, whatever x's storage: swap_axes01 then runs its float build
    out = _like(X, (N, K, OH, OW), np.float16 if half else _compute_dtype(X.dtype))
    # Each group's filters and channels, for the NumPy versions: a group is an ordinary
    # convolution of its own channels (one einsum over a group axis would be twice as slow).
    group_slices = [(slice(g * K // G, (g + 1) * K // G), slice(g * C // G, (g + 1) * C // G))
                    for g in range(G)]
    if X.device.backend == "cpu":  # in float32 for float16 storage (_computed)
        windows = _windows_numpy(_computed(X.data), window, 0.0)
        for k, c in group_slices:
            out.data[:, k] = np.einsum("nchwrs,kcrs->nkhw", windows[:, c],
                                       _computed(weight.data[k]), optimize=True)
        if bias is not None:
            out.data += bias.data.reshape(K, 1, 1)
    elif out.size and panels:
        for n0, nb in chunks:  # out[n0:n0+nb] (nb, K, OH*OW): the filters on the columns
            y = out if nb == N else _like(out, (nb, K, OH, OW))
            _packed_gemm(weight_rows, _im2col_panels(X, n0, nb, window, False), False, False,
                         bias, half, y, b_cols=nb * L, c_run=L)
            if y is not out:
                cl.enqueue_copy(X.device.queue, out.data, y.data, dst_offset=n0 * y.nbytes // nb,
                                byte_count=y.nbytes)
    elif out.size and winograd:
        # the input gradient's filters in the same launch, where a backward will want them
        recorded = bool(_state.tapes) and _state.grad_enabled[-1] and x.requires_grad
        filters, turned_filters = _winograd_filters(weight, True,
                                                    recorded and PH <= 2 and PW <= 2)
        _conv_winograd(filters, X, out, window, bias, half)
    elif out.size and implicit and _direct_window(window) and _direct_fits(X.device, N, K, C,
                                                                          window):
        # the input gradient's filters in the same launch, where a backward will want them
        recorded = bool(_state.tapes) and _state.grad_enabled[-1] and x.requires_grad
        filters, turned_filters = _direct_filters(weight, True,
                                                  recorded and PH <= 2 and PW <= 2)
        _conv_direct(filters, X, out, window, bias)
    elif out.size and implicit and group_taps % 4 == 0:  # side by side where L allows
        _conv_gemm("conv_fwd", weight_rows, X, out,
                   (1, K, group_taps, N * L) if L % 4 == 0 else (N, K, group_taps, L), window,
                   bias)
    elif out.size and G == 1:
        for n0, nb in chunks:  # out[n] (K, OH*OW) = w (K, C*R*S) @ cols[n] + b, a batch of nb
            y = out if nb == N else _like(out, (nb, K, OH, OW))
            cols = _im2col(X, n0, nb, window, tensor_cores, per_image=True)
            if half and not tensor_cores:  # float32 operands, the result rounded once
                _cast(_gemm(weight_rows, cols, bias=bias, bias_rows=True), np.float16,
                      out=y.reshape((nb, K, L)))
            else:
                _gemm(weight_rows, cols, bias=bias, half=half, out=y.reshape((nb, K, L)),
                      bias_rows=True)
            if y is not out:
                cl.enqueue_copy(X.device.queue, out.data, y.data, dst_offset=n0 * y.nbytes // nb,
                                byte_count=y.nbytes)
    elif out.size:
        for n0, nb in chunks:  # y (K, nb*OH*OW): each group's filters on its channels' columns
            y = _grouped_gemm(weight_rows, _im2col(X, n0, nb, window, tensor_cores), G)
            X.device.launch("swap_axes01", *_grid(y.size), K, nb, L, 0, n0 * K * L,
                            int(bias is not None), y.data, None if bias is None else bias.data,
                            out.data, half=half)  # (K, nb, OH*OW) + bias -> out[n0:n0+nb]

    # Winograd's backward reads g in either storage where its kernels take every product
    # (the input gradient's turned window within the span, and the bias gradient in the
    # weight gradient's): the Tape then passes g as it comes, a float32 seed too
    either_g = winograd and PH <= 2 and PW <= 2 and K * C > 0

    def backward(g):  # g (N, K, OH, OW) -> dx (N, C, H, W), dw (K, C, R, S), db (K,)
        # the bias gradient: a column of the weight gradient's product where that has one
        ones = b is not None and b.requires_grad
        # g in out's storage, as the Tape gives other ops theirs, where Winograd's kernels
        # do not take every product that reads it
        if g.dtype != out.dtype and not (either_g and (w.requires_grad or not ones)):
            g = _cast(g, out.dtype)
        # A gradient nobody needs is not computed: a first layer's input is data. dx is in
        # x's storage (not X's: on tensor cores an x in neither float is a float16 copy).
        grad_x = (_like(X, dtype=np.float16 if _half_grad(x.value) else
                        _compute_dtype(x.dtype)) if x.requires_grad else None)
        grad_w = grad_b = None
        if g.device.backend == "cpu":  # in float32 for float16 storage (_computed)
            windows = _windows_numpy(_computed(X.data), window, 0.0)
            g_data = _computed(g.data)
            # a float16 weight's gradient float32, as on OpenCL
            grad_w = (_like(weight, dtype=_compute_dtype(weight.dtype)) if w.requires_grad
                      else None)
            for k, c in group_slices:
                if grad_w is not None:
                    grad_w.data[k] = np.einsum("nkhw,nchwrs->kcrs", g_data[:, k], windows[:, c],
                                               optimize=True)
                if grad_x is not None:
                    grad_windows = np.einsum("nkhw,kcrs->nchwrs", g_data[:, k],
                                             _computed(weight.data[k]), optimize=True)
                    grad_x.data[:, c] = _col2im_numpy(grad_windows, window)
        elif panels:
            Hp, Wp = H + 2 * PH, W + 2 * PW
            for n0, nb in chunks:
                # g[n0:n0+nb] as the (K, nb*OH*OW) matrix of its samples' pixels side by side,
                # stored as it is, (nb, K, OH*OW): in runs of L columns, one per sample
                g_cols = _row_block(g.reshape((N, K * L)), n0, nb).reshape((K, nb * L))
                if w.requires_grad:  # dw = g_cols @ cols^T, summed over the chunks
                    # (with a bias, cols^T gets a column of ones: the product's last column
                    # is then the bias gradient)
                    part = _like(g, (K, group_taps + ones), np.float32)
                    _packed_gemm(g_cols, _im2col_panels(X, n0, nb, window, True, ones), False,
                                 False, None, False, part, b_cols=group_taps + ones, a_run=L)
                    if ones:
                        part, part_b = _part_bias_column(part, 1, group_taps)
                        grad_b = _summed(grad_b, part_b)
                    grad_w = _summed(grad_w, part.reshape(weight.shape))
                if grad_x is not None:  # dcols = w^T @ g_cols (nb, C*R*S, OH*OW), then col2im
                    grad_cols = _like(g, (group_taps, nb * L), np.float32)
                    _packed_gemm(weight_rows, g_cols, True, False, None, False, grad_cols,
                                 b_run=L, c_run=L)
                    padded = _like(g, (nb, C, Hp, Wp), np.float32)
                    g.device.launch("col2im_planes", (nb * C,), (16,), n0, nb, C, *window,
                                    grad_cols.data, padded.data, grad_x.data,
                                    half=grad_x.dtype == np.float16)
            if w.requires_grad and grad_w is None:  # an empty batch: no chunks
                grad_w = _fill(weight.shape, 0.0, weight)
        elif G == 1:
            explicit_w = w.requires_grad
            # dx of a direct convolution (padding within the window's span): the convolution
            # of g by the filters turned half a turn, padded by the rest of the span
            turned_window = (OH, OW, 3, 3, 1, 1, 2 - PH, 2 - PW, 1, 1, H, W)
            grad_x_done = grad_x is not None and (either_g or (
                implicit and _direct_window(window) and g.dtype == X.dtype == grad_x.dtype and
                PH <= 2 and PW <= 2 and
                _direct_fits(g.device, N, C, K, turned_window) is not None))
            if grad_x_done:
                filters = turned_filters  # laid out by the forward, where it could tell
                if winograd:
                    if filters is None:
                        filters = _winograd_filters(weight, False, True)[1]
                    _conv_winograd(filters, g, grad_x, turned_window, rounded=half)
                else:
                    if filters is None:
                        filters = _direct_filters(weight, False, True)[1]
                    _conv_direct(filters, g, grad_x, turned_window)
            if winograd and w.requires_grad and N * K * C:
                grad_w = _like(weight)
                if ones:
                    grad_b = _like(weight, (K,), np.float32)
                _winograd_wgrad(g, X, window, grad_w, grad_b, rounded=half)
                explicit_w = False
            elif implicit and g.dtype == X.dtype and w.requires_grad and L % 4 == 0:
                # dw = g cols^T over every sample's pixels (g and x read in one build), and
                # the bias gradient in the same product
                grad_w = _like(weight)
                if ones:
                    grad_b = _like(weight, (K,), np.float32)
                _conv_gemm("conv_wgrad", g, X, grad_w, (1, K, N * L, group_taps), window,
                           bias_grad=grad_b)
                explicit_w = False
            for n0, nb in (chunks if explicit_w or grad_x is not None and not grad_x_done
                           else ()):
                # one product per sample, read from g as it is stored
                g_rows = _row_block(g.reshape((N, K * L)), n0, nb).reshape((nb, K, L))
                if explicit_w:  # dw = sum over samples of g[n] @ cols[n]^T
                    # (and with a bias, a row of ones in the columns: its column of the
                    # product sums g, the bias gradient; conv_wgrad_sum parts the two)
                    cols = _im2col(X, n0, nb, window, tensor_cores, per_image=True, ones=ones)
                    part = _gemm(g_rows, cols, trans_b=True)  # (nb, K, C*R*S [+ 1])
                    if ones:
                        part, part_b = _part_bias_column(part, nb, group_taps)
                        grad_b = _summed(grad_b, part_b)
                    elif nb > 1:
                        part = _sum_axis_tensor(part, 1, nb, K * group_taps)
                    grad_w = _summed(grad_w, part.reshape(weight.shape))
                if grad_x is not None and not grad_x_done:
                    # dcols[n] = w^T @ g[n] (nb, C*R*S, OH*OW), then col2im
                    # (on tensor cores dcols is float16, as PyTorch's autocast writes its input
                    # gradients: half the bytes to write and to read back)
                    grad_cols = _gemm(weight_rows, g_rows, trans_a=True, half=tensor_cores,
                                      round_float32=tensor_cores)
                    kernel = "col2im" if not tensor_cores else (
                        "col2im_act" if grad_x.dtype == np.float16 else "col2im_act_f")
                    g.device.launch(kernel, (nb * H * W, C), (256, 1), n0, nb, C, *window,
                                    *_cols_strides(grad_cols.shape, L), grad_cols.data,
                                    grad_x.data, half=tensor_cores or
                                    grad_x.dtype == np.float16)
            if w.requires_grad and grad_w is None:  # an empty batch: no chunks
                grad_w = _fill(weight.shape, 0.0, weight)
        else:
            for n0, nb in chunks:
                # g[n0:n0+nb] (nb, K, OH*OW) -> (K, nb*OH*OW), in g's storage: float16 under
                # autocast (the tensor cores' operand; the other GEMMs read or widen it)
                g_rows = _like(g, (K, nb * L))
                g.device.launch("swap_axes01_act", *_grid(g_rows.size), nb, K, L, n0 * K * L,
                                0, 0, g.data, None, g_rows.data, half=g.dtype == np.float16)
                if w.requires_grad:  # dw = g_rows @ cols^T per group, summed over the chunks
                    cols = _im2col(X, n0, nb, window, tensor_cores)
                    part = _grouped_gemm(g_rows, cols, G, trans_b=True)
                    if grad_w is None:
                        grad_w = part.reshape(weight.shape)
                    else:
                        _add_into(grad_w, part)
                if grad_x is not None:  # dcols = w^T @ g_rows per group, then col2im
                    grad_cols = _grouped_gemm(weight_rows, g_rows, G, trans_a=True)
                    g.device.launch("col2im", (nb * H * W, C), (256, 1), n0, nb, C, *window,
                                    *_cols_strides(grad_cols.shape, L), grad_cols.data,
                                    grad_x.data, half=grad_x.dtype == np.float16)
            if w.requires_grad and grad_w is None:  # an empty batch: no chunks
                grad_w = _fill(weight.shape, 0.0, weight)
        if ones and grad_b is None:  # sum over OH*OW, then N
            per_image = _sum_axis_tensor(g, N * K, L, 1)
            grad_b = _sum_axis_tensor(per_image, 1, N, K).reshape((K,))
        return _Owned((grad_x, grad_w) + ((grad_b,) if b is not None else ()))
    return _record(out, (x, w) + ((b,) if b is not None else ()), backward,
                   half_grad=None if either_g else True)


def _pool_args(op, kernel_size, stride, padding):
    """A pooling op's (kernel, stride, padding) as pairs; stride defaults to the kernel size."""
    kernel = _pair(op, "kernel_size", kernel_size, 1)
    stride = kernel if stride is None else _pair(op, "stride", stride, 1)  # PyTorch default
    padding = _pair(op, "padding", padding, 0)
    if padding[0] > kernel[0] // 2 or padding[1] > kernel[1] // 2:  # PyTorch's rule and words
        raise ValueError(f"{op}: pad should be at most half of effective kernel size, but got "
                         f"pad={padding}, kernel_size={kernel}")
    return kernel, stride, padding


def _pool_window(op, x, kernel_size, stride, padding):
    """A pooling op's input as a Node, and its window geometry."""
    args = _pool_args(op, kernel_size, stride, padding)
    (x,) = _nodes(op, x)
    return x, _window(op, x.shape, *args)


def max_pool2d(x, kernel_size, stride=None, padding=0):
    """The maximum of each window: x (N, C, H, W) -> (N, C, OH, OW). stride defaults to
    kernel_size; padding is -inf. The gradient goes to the first maximum of each window in
    row-major order (PyTorch's tie rule); NaN counts as the largest value."""
    x, window = _pool_window("max_pool2d", x, kernel_size, stride, padding)
    H, W, R, S, SH, SW, PH, PW, _, _, OH, OW = window  # pooling windows are not dilated
    N, C = x.shape[:2]
    X = x.value
    out = _like(X, (N, C, OH, OW))
    argmax = _like(X, (N, C, OH, OW), np.int32)  # the winner's index h * W + w in its plane
    if X.device.backend == "cpu":
        windows = _windows_numpy(X.data, window, -np.inf).reshape(N, C, OH, OW, R * S)
        out.data[...] = windows.max(axis=-1)
        r, s = np.divmod(windows.argmax(axis=-1), S)  # the first maximum; NaN wins
        # A window of nothing but -inf picks its first element, maybe padding; clamping moves
        # the pick to its first real pixel, as PyTorch.
        h = np.maximum(np.arange(OH).reshape(OH, 1) * SH - PH + r, 0)
        w = np.maximum(np.arange(OW) * SW - PW + s, 0)
        argmax.data[...] = h * W + w
    elif out.size:
        X.device.launch("max_pool2d_fwd", *_grid(out.size), N * C, *window, X.data, out.data,
                        argmax.data, half=X.dtype == np.float16)

    def backward(g):  # g (N, C, OH, OW) -> dx (N, C, H, W), both in x's storage
        grad_x = _like(g, X.shape)
        if g.device.backend == "cpu":
            planes = np.arange(N * C).reshape(N, C, 1, 1) * (H * W)
            grad_x.data[...] = np.bincount((planes + argmax.data).ravel(), g.data.ravel(),
                                           N * C * H * W).reshape(X.shape)
        elif grad_x.size:
            g.device.launch("max_pool2d_bwd", *_grid(grad_x.size), N * C, *window, g.data,
                            argmax.data, grad_x.data, half=g.dtype == np.float16)
        return (grad_x,)
    return _record(out, (x,), backward, half_grad=True)


def avg_pool2d(x, kernel_size, stride=None, padding=0):
    """The mean of each window: x (N, C, H, W) -> (N, C, OH, OW). stride defaults to
    kernel_size; padded zeros count in the mean (PyTorch's default count_include_pad=True)."""
    x, window = _pool_window("avg_pool2d", x, kernel_size, stride, padding)
    H, W, R, S, SH, SW, PH, PW, _, _, OH, OW = window
    N, C = x.shape[:2]
    X = x.value
    out = _like(X, (N, C, OH, OW))
    if X.device.backend == "cpu":
        out.data[...] = _windows_numpy(X.data, window, 0.0).mean(axis=(-2, -1))
    elif out.size:
        X.device.launch("avg_pool2d_fwd", *_grid(out.size), N * C, *window, X.data, out.data,
                        half=X.dtype == np.float16)

    def backward(g):  # g (N, C, OH, OW) -> dx (N, C, H, W): each window's share, g / (R*S)
        grad_x = _like(g, X.shape)  # both in x's storage
        if g.device.backend == "cpu":
            shares = np.broadcast_to((g.data / (R * S)).reshape(N, C, OH, OW, 1, 1),
                                     (N, C, OH, OW, R, S))
            grad_x.data[...] = _col2im_numpy(shares, window)
        elif grad_x.size:
            g.device.launch("avg_pool2d_bwd", *_grid(grad_x.size), N * C, *window, g.data,
                            grad_x.data, half=g.dtype == np.float16)
        return (grad_x,)
    return _record(out, (x,), backward, half_grad=True)


# --- dropout ----------------------------------------------------------------------------------

def _fmix32(h):
    """MurmurHash3's finaliser on uint32 arrays, as kernels.cl's fmix32."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _dropout_keep(n, seed, p):
    """The keep mask of kernels.cl's dropout_mask: uniform(seed, i) >= p."""
    with np.errstate(over="ignore"):
        i = np.arange(n, dtype=np.uint32)
        h = _fmix32(i * np.uint32(0x9E3779B1) + _fmix32(np.array(seed, np.uint32)))
    return (h >> np.uint32(8)).astype(np.float32) * np.float32(1 / 16777216) >= np.float32(p)


def dropout(x, p=0.5, training=True):
    """Zero each element with probability p and scale the rest by 1/(1-p) (when training)."""
    p = _check_number("dropout", "p", p, 0.0, 1.0)
    (x,) = _nodes("dropout", x)
    if not training or p == 0.0:
        return x
    seed = int(_rng().integers(0, 2**32))
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)

    def masked(v):
        out = _like(v)
        if v.device.backend == "cpu":
            out.data[...] = np.where(_dropout_keep(v.size, seed, p).reshape(v.shape),
                                     v.data * scale, 0)
        elif v.size:
            v.device.launch("dropout_mask", *_grid(v.size), v.size, seed, p, scale,
                            v.data, out.data, half=v.dtype == np.float16)
        return out
    return _record(masked(x.value), (x,), lambda g: (masked(g),), half_grad=True)


# --- normalisation, embedding and attention ---------------------------------------------------
# The layers a transformer adds to linear and softmax. The normalisations read their input in
# its own storage and return float32 (PyTorch's autocast runs layer_norm in float32 too); their
# statistics take two passes, the mean and then the mean squared deviation, which cancels less
# than E[x^2] - E[x]^2. Every sum over rows in a backward (a weight's gradient, an embedding
# row's, a key's) is a gather in a fixed order: no atomics (OpenCL 1.2 has no float ones),
# and the same bits on every run.

_NORM_GROUP = 64  # kernels.cl's NORM_GROUP: work-items per row of layer_norm


def _norm_grid(rows):
    return (rows * _NORM_GROUP,), (_NORM_GROUP,)


def _normalized_shape(op, normalized_shape):
    """normalized_shape as a tuple: an int or a non-empty sequence of non-negative ints."""
    shape = ((normalized_shape,) if isinstance(normalized_shape, (int, np.integer))
             else normalized_shape)
    if type(shape) is tuple and shape and all(type(s) is int and s >= 0 for s in shape):
        return shape  # the usual case (a module's own), checked in one pass
    if not (isinstance(shape, (tuple, list)) and shape and all(
            _is_int(s) and s >= 0 for s in shape)):
        raise ValueError(f"{op}: normalized_shape must be an int or a non-empty tuple of "
                         f"non-negative ints, got {normalized_shape!r}")
    return tuple(int(s) for s in shape)


def _data_or_none(tensor):
    """A kernel's buffer argument for an optional operand: its data, or None (NULL)."""
    return None if tensor is None else tensor.data


def _optional_nodes(op, x, *optional):
    """Nodes for x and the optional operands that are not None (one device), None kept."""
    x, *given = _nodes(op, x, *(p for p in optional if p is not None))
    return [x] + [None if p is None else given.pop(0) for p in optional]


# layer_norm's weight gradient: rows one work-group sums (256 per lane of the 16 in
# kernels.cl's sum_columns scheme) before a second launch sums the chunks.
_ROWS_PER_CHUNK = 4096


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """x (..., *normalized_shape) normalised over its last len(normalized_shape) dimensions,
    as PyTorch's layer_norm: (x - mean) / sqrt(var + eps) * weight + bias, var the biased
    variance, weight and bias (normalized_shape) optional. Returns float32 for float16 x."""
    shape = _normalized_shape("layer_norm", normalized_shape)
    eps = _check_number("layer_norm", "eps", eps)
    x, w, b = _optional_nodes("layer_norm", x, weight, bias)
    if x.shape[max(len(x.shape) - len(shape), 0):] != shape or len(x.shape) < len(shape):
        raise ValueError(f"layer_norm: normalized_shape {shape} does not match input {x.shape} "
                         f"(expected input (..., {', '.join(map(str, shape))}))")
    for name, p in (("weight", w), ("bias", b)):
        if p is not None and p.shape != shape:
            raise ValueError(f"layer_norm: {name} shape {p.shape} != normalized_shape {shape}")
    D, rows = math.prod(shape), math.prod(x.shape[:len(x.shape) - len(shape)])
    X = x.value
    W, B = (None if p is None else _float32(p.value) for p in (w, b))
    dtype = _compute_dtype(X.dtype)
    y = _like(X, dtype=dtype)
    mean, rstd = _like(X, (rows,), dtype), _like(X, (rows,), dtype)  # kept for backward
    if X.device.backend == "cpu":
        v = X.data.reshape(rows, D).astype(dtype, copy=False)
        with np.errstate(all="ignore"):  # D = 0: empty rows, a NaN mean nobody reads
            mu = v.sum(axis=1, keepdims=True) / D
            r = 1 / np.sqrt(((v - mu) ** 2).sum(axis=1, keepdims=True) / D + eps)
        out = (v - mu) * r
        if W is not None:
            out = out * W.data.reshape(D)
        if B is not None:
            out = out + B.data.reshape(D)
        y.data.reshape(rows, D)[...] = out
        mean.data[...], rstd.data[...] = mu.reshape(rows), r.reshape(rows)
    elif rows:
        X.device.launch("layer_norm_fwd", *_norm_grid(rows), rows, D, eps, int(W is not None),
                        int(B is not None), X.data, _data_or_none(W), _data_or_none(B), y.data,
                        mean.data, rstd.data, half=X.dtype == np.float16)

    def backward(g):  # g (..., D) -> dx (..., D), dweight, dbias (normalized_shape)
        grad_x = _like(g) if x.requires_grad else None
        grad_w = grad_b = None
        if g.device.backend == "cpu":
            v, gv = X.data.reshape(rows, D).astype(dtype, copy=False), g.data.reshape(rows, D)
            x_hat = (v - mean.data.reshape(rows, 1)) * rstd.data.reshape(rows, 1)
            if grad_x is not None:
                d_hat = gv * W.data.reshape(D) if W is not None else gv
                with np.errstate(all="ignore"):  # D = 0, as in forward
                    grad_x.data.reshape(rows, D)[...] = rstd.data.reshape(rows, 1) * (
                        d_hat - d_hat.sum(axis=1, keepdims=True) / D
                        - x_hat * (d_hat * x_hat).sum(axis=1, keepdims=True) / D)
            if W is not None:
                grad_w = _free_grad_slot(w) or _like(W, dtype=dtype)
                grad_w.data.reshape(D)[...] = (gv * x_hat).sum(axis=0)
            if B is not None:
                grad_b = (_free_grad_slot(b) if b is not w else None) or _like(B, dtype=dtype)
                grad_b.data.reshape(D)[...] = gv.sum(axis=0)
        else:
            half = X.dtype == np.float16
            if grad_x is not None and grad_x.size:
                g.device.launch("layer_norm_bwd_dx", *_norm_grid(rows), rows, D,
                                int(W is not None), g.data, X.data, _data_or_none(W), mean.data,
                                rstd.data, grad_x.data, half=half)
            if W is not None or B is not None:
                # Column sums of g x_hat and of g in one launch over chunks of rows, into the
                # parameters' gradient slots where they are free; more than one chunk (a very
                # long batch) takes a second launch each to sum the chunks.
                chunks = _ceil_div(rows, _ROWS_PER_CHUNK)
                # (one parameter as both weight and bias: its slot takes the first only)
                grads = [(_free_grad_slot(p) if p is not None and (i == 0 or p is not w)
                          else None) or _like(g, shape) for i, p in enumerate((w, b))]
                parts = ([grad._view((1, D)) for grad in grads] if chunks == 1 else
                         [_like(g, (chunks, D)) for _ in grads])
                if chunks and D:
                    g.device.launch("layer_norm_bwd_params", (D, _COLUMN_LANES * chunks),
                                    (_COLUMN_LANES, _COLUMN_LANES), rows, D, _ROWS_PER_CHUNK,
                                    g.data, X.data, mean.data, rstd.data, parts[0].data,
                                    parts[1].data, half=half)
                elif D:  # no rows: the sums are 0
                    for grad in grads:
                        _zero_rows(grad.reshape((1, D)), 0, 0, 1)
                if chunks > 1:
                    for part, grad in zip(parts, grads):
                        _sum_axis_tensor(part, 1, chunks, D, out=grad.reshape((1, D)))
                grad_w, grad_b = grads
        return [grad_x] + [grad for p, grad in ((w, grad_w), (b, grad_b)) if p is not None]
    return _record(y, tuple(p for p in (x, w, b) if p is not None), backward)


def batch_norm(x, running_mean, running_var, weight=None, bias=None, training=False,
               momentum=0.1, eps=1e-5):
    """x (N, C, *) normalised per channel over N and the trailing dimensions, as PyTorch's
    batch_norm: (x - mean) / sqrt(var + eps) * weight + bias, weight and bias (C,) optional.
    training=True: mean and var are the batch's (var biased), and running_mean, running_var
    (Tensors (C,), or None) are updated in place, running = (1 - momentum) * running +
    momentum * batch statistic, with the unbiased variance var * n / (n - 1), n = N * L.
    training=False: running_mean and running_var are the statistics. Returns float32 for
    float16 x."""
    momentum = _check_number("batch_norm", "momentum", momentum)
    eps = _check_number("batch_norm", "eps", eps)
    x, w, b = _optional_nodes("batch_norm", x, weight, bias)
    if len(x.shape) < 2:
        raise ValueError(f"batch_norm: input must be (N, C, *), got shape {x.shape}")
    (N, C), L = x.shape[:2], math.prod(x.shape[2:])
    count = N * L
    stats = (running_mean, running_var)
    if any(s is not None for s in stats) and not all(isinstance(s, Tensor) for s in stats):
        raise TypeError(f"batch_norm: running_mean and running_var must both be Tensors or "
                        f"both None, got {type(running_mean).__name__} and "
                        f"{type(running_var).__name__}")
    for name, p in (("running_mean", running_mean), ("running_var", running_var),
                    ("weight", w), ("bias", b)):
        if p is not None and p.shape != (C,):
            raise ValueError(f"batch_norm: {name} of shape {p.shape} does not match the {C} "
                             f"channels of input {x.shape}; expected ({C},)")
    if running_mean is not None:
        _devices_of("batch_norm", x, running_mean, running_var)
        for name, s in (("running_mean", running_mean), ("running_var", running_var)):
            if s.dtype.kind != "f":
                raise TypeError(f"batch_norm: {name} must be a float tensor, got "
                                f"{s.dtype.name}")
    elif not training:
        raise ValueError("batch_norm: running_mean and running_var must be given when not "
                         "training (training=False normalises with them)")
    if training and count == 1:  # PyTorch's check and words
        raise ValueError(f"batch_norm: expected more than 1 value per channel when training, "
                         f"got input size {x.shape}")
    X = x.value
    W, B = (None if p is None else _float32(p.value) for p in (w, b))
    dtype = _compute_dtype(X.dtype)
    if training:
        mean, var = _like(X, (C,), dtype), _like(X, (C,), dtype)
    else:
        mean, var = _float32(running_mean), _float32(running_var)
    update = training and running_mean is not None and count > 0  # an empty batch: none
    y = _like(X, dtype=dtype)
    if X.device.backend == "cpu":
        v = X.data.reshape(N, C, L).astype(dtype, copy=False)
        if training:
            with np.errstate(all="ignore"):  # an empty batch: NaN statistics nobody reads
                mean.data[...] = v.sum(axis=(0, 2)) / count
                var.data[...] = ((v - mean.data.reshape(C, 1)) ** 2).sum(axis=(0, 2)) / count
        if update:
            running_mean.data[...] = (1 - momentum) * running_mean.data + momentum * mean.data
            running_var.data[...] = ((1 - momentum) * running_var.data
                                     + momentum * var.data * (count / (count - 1)))
        out = (v - mean.data.reshape(C, 1)) / np.sqrt(var.data.reshape(C, 1) + eps)
        if W is not None:
            out = out * W.data.reshape(C, 1)
        if B is not None:
            out = out + B.data.reshape(C, 1)
        y.data.reshape(N, C, L)[...] = out
    elif y.size:
        half = X.dtype == np.float16
        if training:  # one work-group per channel
            # the kernel updates float32 statistics: float16 ones through float32 copies
            running = [s if s is None or not update else _float32(s) for s in stats]
            X.device.launch("batch_norm_stats", (C * 256,), (256,), N, C, L, momentum,
                            int(update), X.data, mean.data, var.data,
                            _data_or_none(running[0]), _data_or_none(running[1]), half=half)
            for s, copy in zip(stats, running):
                if copy is not s:
                    _cast(copy, np.float16, out=s)
        X.device.launch("batch_norm_fwd", *_grid(y.size), y.size, C, L, eps, int(W is not None),
                        int(B is not None), X.data, mean.data, var.data, _data_or_none(W),
                        _data_or_none(B), y.data, half=half)

    def backward(g):  # g (N, C, *) -> dx (N, C, *), dweight, dbias (C,)
        # With batch statistics the mean and the variance depend on x too: dx = weight *
        # rstd * (g - mean(g) - x_hat * mean(g x_hat)); with running ones, weight * rstd * g.
        grad_x = _like(g) if x.requires_grad else None
        sum_g, sum_g_x_hat = _like(g, (C,)), _like(g, (C,))  # = dbias, dweight
        if g.device.backend == "cpu":
            v, gv = X.data.reshape(N, C, L).astype(dtype, copy=False), g.data.reshape(N, C, L)
            rstd = 1 / np.sqrt(var.data.reshape(C, 1) + eps)
            x_hat = (v - mean.data.reshape(C, 1)) * rstd
            sum_g.data[...] = gv.sum(axis=(0, 2))
            sum_g_x_hat.data[...] = (gv * x_hat).sum(axis=(0, 2))
            if grad_x is not None:
                scale = rstd * (W.data.reshape(C, 1) if W is not None else 1)
                if training:
                    grad_x.data.reshape(N, C, L)[...] = scale * (
                        gv - (sum_g.data.reshape(C, 1) + x_hat * sum_g_x_hat.data.reshape(C, 1))
                        / count)
                else:
                    grad_x.data.reshape(N, C, L)[...] = scale * gv
        elif g.size:
            g.device.launch("batch_norm_bwd_sums", (C * 256,), (256,), N, C, L, eps, g.data,
                            X.data, mean.data, var.data, sum_g.data, sum_g_x_hat.data,
                            half=X.dtype == np.float16)
            if grad_x is not None:
                g.device.launch("batch_norm_bwd_dx", *_grid(g.size), g.size, C, L,
                                1.0 / count, eps, int(training), int(W is not None), g.data,
                                X.data, mean.data, var.data, _data_or_none(W), sum_g.data,
                                sum_g_x_hat.data, grad_x.data, half=X.dtype == np.float16)
        else:  # an empty batch: the sums are 0
            sum_g, sum_g_x_hat = _fill((C,), 0.0, g), _fill((C,), 0.0, g)
        return [grad_x] + [grad for p, grad in ((w, sum_g_x_hat), (b, sum_g)) if p is not None]
    return _record(y, tuple(p for p in (x, w, b) if p is not None), backward)


def embedding(idx, weight):
    """Rows of weight (num_embeddings, dim) picked by idx, an integer array or int32 Tensor
    of any shape: -> (*idx.shape, dim), as PyTorch's embedding. A row's gradient is the sum of
    the output gradients of every position that picked it. idx is a constant."""
    (w,) = _nodes("embedding", weight)
    if len(w.shape) != 2:
        raise ValueError(f"embedding: weight must be 2-D (num_embeddings, embedding_dim), got "
                         f"shape {w.shape}")
    t = idx.value if isinstance(idx, Node) else idx
    if isinstance(t, Tensor):
        _devices_of("embedding", w, t)
        if t.dtype != np.int32:
            raise TypeError(f"embedding: idx must hold integers, got a {t.dtype} Tensor")
        # Indices are checked on the host, as cross_entropy's labels: with the copy an upload
        # kept, else read back (a sync: only indices computed on the device need one).
        host = t._labels if t._labels is not None else t.to_host()
    else:
        host = _real_array("embedding", t, "idx")
        if host.dtype.kind not in "iu":
            raise TypeError(f"embedding: idx must hold integers, got dtype {host.dtype}")
    num, dim = w.shape
    bad = host[(host < 0) | (host >= num)]
    if bad.size:
        raise IndexError(f"embedding: index {bad.flat[0]} is out of range [0, {num}) for "
                         f"{num} embeddings")
    W = _float32(w.value)
    flat = host.reshape(-1).astype(np.int64)
    out = _like(W, host.shape + (dim,))
    if W.device.backend == "cpu":
        out.data[...] = W.data[host]
    elif out.size:
        if isinstance(t, Tensor):
            indices = t
        else:  # checked above, and astype's copy is ours: uploaded without from_host's copy
            indices = _like(W, host.shape, np.int32)
            W.device.upload(indices.data, host.astype(np.int32))
        W.device.launch("embedding_fwd", *_grid(out.size), out.size, dim, indices.data, W.data,
                        out.data)

    def backward(g):  # g (*idx.shape, dim) -> dweight (num, dim), in its slot if free
        grad = _free_grad_slot(w) or _like(g, (num, dim))
        if g.device.backend == "cpu":
            grad.data[...] = 0
            np.add.at(grad.data, flat, g.data.reshape(flat.size, dim))  # (dim may be 0)
        elif grad.size:
            # Where each row's run starts (num + 1 entries), then the positions sorted by
            # index (stably: each row sums in position order): a gather per (row, column), no
            # atomics. One array, so one upload. (Held in a name until the launch: a Tensor's
            # buffer goes back to the pool as soon as the Tensor goes.)
            host_runs = np.empty(num + 1 + flat.size, np.int32)
            host_runs[0] = 0
            np.cumsum(np.bincount(flat, minlength=num), out=host_runs[1:num + 1])
            host_runs[num + 1:] = np.argsort(flat, kind="stable")
            runs = _like(grad, host_runs.shape, np.int32)
            g.device.upload(runs.data, host_runs)  # host_runs is ours: no copy needed
            g.device.launch("embedding_bwd", *_grid(grad.size), num, dim, runs.data, g.data,
                            grad.data)
        return (grad,)
    return _record(out, (w,), backward)


def _attention_mask(mask, lead, L, S, like):
    """attn_mask (bool: True takes part; or float: added to the scores), broadcast to
    (*lead, L, S), as the kernels read it: (tensor, (div, mod, stride_b, stride_l, stride_s)),
    the mask of batch b, row l, key s at ((b / div) % mod) * stride_b + l * stride_l +
    s * stride_s. Broadcast dimensions get no copy when the mask's own batch dimensions are one
    run of lead's (the usual (L, S), (B, 1, L, S) or (H, L, S)); others are repeated."""
    op = "scaled_dot_product_attention"
    if isinstance(mask, Node) and mask.requires_grad and _state.tapes and \
            _state.grad_enabled[-1]:  # recorded: its gradient would be lost without a word
        raise ValueError(f"{op}: attn_mask requires grad, but the mask is a constant here (no "
                         f"gradient flows into it); pass attn_mask.value to use its values")
    m = mask.value if isinstance(mask, Node) else mask
    if isinstance(m, Tensor):
        _devices_of(op, like, m)
        if m.dtype.kind != "f":
            raise TypeError(f"{op}: attn_mask must be bool or float, got a {m.dtype} Tensor")
        shape = m.shape
    else:
        m = _real_array(op, m, "attn_mask")
        if m.dtype.kind not in "bf":
            raise TypeError(f"{op}: attn_mask must be bool or float, got dtype {m.dtype}")
        shape = m.shape
    full = tuple(lead) + (L, S)
    if len(shape) > len(full) or any(a not in (1, f) for a, f in zip(shape[::-1], full[::-1])):
        raise ValueError(f"{op}: attn_mask of shape {shape} does not broadcast to the scores "
                         f"{full}")
    shape = (1,) * (len(full) - len(shape)) + tuple(shape)
    batch, (Lm, Sm) = shape[:-2], shape[-2:]
    kept = [i for i, n in enumerate(batch) if n != 1]
    if kept and kept != list(range(kept[0], kept[-1] + 1)):  # e.g. (B, 1, H): repeat it
        # (a Tensor mask is read back for that: a sync, for such a rare layout only)
        m = np.broadcast_to(m.to_host() if isinstance(m, Tensor) else m, full[:-2] + (Lm, Sm))
        kept = list(range(len(lead)))
    dtype = _compute_dtype(like.dtype)
    if isinstance(m, Tensor):
        tensor = _float32(m)
    else:
        additive = np.where(m, 0.0, -np.inf) if m.dtype == bool else m  # PyTorch's rule
        tensor = Tensor.from_host(np.ascontiguousarray(additive), like.queue, dtype)
    div = math.prod(lead[kept[-1] + 1:]) if kept else 1
    mod = math.prod(lead[i] for i in kept)
    return tensor, (div, mod, Lm * Sm, Sm if Lm != 1 else 0, int(Sm != 1))


def _attention_scores(Q, K, scale, mask, geometry, causal):
    """NumPy: the scores (B, L, S) = scale q k^T + mask (-inf above the diagonal if causal),
    and each row's log-sum-exp, +inf for a row without a key to attend to (so that all its
    probabilities exp(score - lse) are 0: PyTorch's output there is 0)."""
    B, L, S = Q.shape[0], Q.shape[1], K.shape[1]
    scores = np.matmul(Q, K.transpose(0, 2, 1)) * scale
    if mask is not None:
        div, mod, stride_b, stride_l, stride_s = geometry
        Lm, Sm = (L if stride_l else 1), (S if stride_s else 1)
        per_batch = (np.arange(B) // div) % mod
        scores = scores + mask.data.reshape(mod, Lm, Sm)[per_batch]  # (L or S may be 0)
    if causal:  # top-left aligned, as PyTorch: key s takes part in row l when s <= l
        scores = np.where(np.tri(L, S, dtype=bool), scores, -np.inf)
    top = scores.max(axis=2, keepdims=True, initial=-np.inf)
    with np.errstate(all="ignore"):
        lse = np.log(np.exp(scores - np.where(top == -np.inf, 0, top)).sum(axis=2, keepdims=True))
    return scores, np.where(top == -np.inf, np.inf, top + lse)


_ATTENTION_GROUP = 64  # kernels.cl's ATTENTION_GROUP: work-items per row of the attention kernels


def _attention_grid(rows):
    return (rows * _ATTENTION_GROUP,), (_ATTENTION_GROUP,)


def scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0,
                                 scale=None):
    """softmax(q k^T * scale + mask) v for q (..., L, E), k (..., S, E), v (..., S, Ev) ->
    (..., L, Ev), as PyTorch's scaled_dot_product_attention. scale defaults to 1/sqrt(E);
    attn_mask, broadcast to (..., L, S), is bool (True takes part) or float (added), and a
    constant; is_causal lets row l see keys s <= l. dropout_p > 0 drops attention weights
    (netcl's dropout stream, manual_seed). A row that attends to no key gives 0, as PyTorch.
    q, k and v share their leading dimensions (PyTorch would broadcast them). The mask gets no
    gradient: one that requires grad, recorded on a Tape, is a ValueError."""
    op = "scaled_dot_product_attention"
    if attn_mask is not None and is_causal:  # PyTorch's words
        raise ValueError(f"{op}: explicit attn_mask should not be set when is_causal=True")
    _check_number(op, "dropout_p", dropout_p, 0.0, 1.0)
    if scale is not None:
        _check_number(op, "scale", scale)
    q, k, v = _nodes(op, q, k, v)
    if min(len(q.shape), len(k.shape), len(v.shape)) < 2 or not (
            q.shape[:-2] == k.shape[:-2] == v.shape[:-2]) or q.shape[-1] != k.shape[-1] \
            or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"{op}: q {q.shape}, k {k.shape} and v {v.shape} do not fit (expected "
                         f"(..., L, E), (..., S, E) and (..., S, Ev), the same leading sizes)")
    lead, (L, E), (S, Ev) = q.shape[:-2], q.shape[-2:], v.shape[-2:]
    B = math.prod(lead)
    # With E = 0 every score is the empty dot product, 0, whatever the scale: PyTorch scales
    # q and k by sqrt(scale) before their product (so the weights are uniform, not NaN).
    scale = 0.0 if not E else 1.0 / math.sqrt(E) if scale is None else float(scale)
    Q, K, V = q.value, k.value, v.value
    if not Q.dtype == K.dtype == V.dtype:  # mixed storage: all three in float32
        Q, K, V = _float32(Q), _float32(K), _float32(V)
    mask, geometry = (None, (1, 1, 0, 0, 0)) if attn_mask is None else \
        _attention_mask(attn_mask, lead, L, S, Q)
    p = float(dropout_p)
    seed = int(_rng().integers(0, 2**32)) if p > 0 else 0
    drop_scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    dtype = _compute_dtype(Q.dtype)
    out = _like(Q, lead + (L, Ev), dtype)
    lse = _like(Q, (B, L), dtype)  # each row's log-sum-exp: backward recomputes from it
    half = Q.dtype == np.float16
    # The kernels' arguments after the sizes: how scores are made, masked and dropped.
    settings = (scale, int(is_causal), int(mask is not None), *geometry, p, drop_scale, seed)

    def host_arrays():
        return (Q.data.reshape(B, L, E).astype(dtype, copy=False),
                K.data.reshape(B, S, E).astype(dtype, copy=False),
                V.data.reshape(B, S, Ev).astype(dtype, copy=False))

    def host_probabilities(Qh, Kh):
        """NumPy: the attention weights P and the dropped ones P * D (B, L, S)."""
        scores, row_lse = _attention_scores(Qh, Kh, scale, mask, geometry, is_causal)
        probs = np.exp(scores - row_lse)
        if p == 0:
            return probs, probs, row_lse
        keep = _dropout_keep(B * L * S, seed, p).reshape(B, L, S)
        return probs, np.where(keep, probs * drop_scale, 0), row_lse

    if Q.device.backend == "cpu":
        Qh, Kh, Vh = host_arrays()
        _, dropped, row_lse = host_probabilities(Qh, Kh)
        out.data.reshape(B, L, Ev)[...] = np.matmul(dropped, Vh)
        lse.data[...] = row_lse.reshape(B, L)
    elif B * L:
        Q.device.launch("attention_fwd", *_attention_grid(B * L), B, L, S, E, Ev, *settings,
                        Q.data, K.data, V.data, _data_or_none(mask), out.data, lse.data,
                        half=half)

    def backward(g):  # g (..., L, Ev) -> dq (..., L, E), dk (..., S, E), dv (..., S, Ev)
        # P = exp(score - lse), D the dropout mask (scaled), out = (P D) v:
        # dv = (P D)^T g; dP = D (g v^T); dscore = P (dP - delta), delta = rowsum(g out);
        # dq = scale dscore k, dk = scale dscore^T q.
        grad_q, grad_k, grad_v = _like(g, Q.shape), _like(g, K.shape), _like(g, V.shape)
        if g.device.backend == "cpu":
            Qh, Kh, Vh = host_arrays()
            probs, dropped, _ = host_probabilities(Qh, Kh)
            G = g.data.reshape(B, L, Ev)
            delta = (G * out.data.reshape(B, L, Ev)).sum(axis=2, keepdims=True)
            d_probs = np.matmul(G, Vh.transpose(0, 2, 1))  # d(P D) = g v^T
            if p:
                keep = _dropout_keep(B * L * S, seed, p).reshape(B, L, S)
                d_probs = np.where(keep, d_probs * drop_scale, 0)
            d_scores = probs * (d_probs - delta)
            grad_q.data.reshape(B, L, E)[...] = np.matmul(d_scores, Kh) * scale
            grad_k.data.reshape(B, S, E)[...] = np.matmul(d_scores.transpose(0, 2, 1), Qh) * scale
            grad_v.data.reshape(B, S, Ev)[...] = np.matmul(dropped.transpose(0, 2, 1), G)
        else:
            delta = _like(g, (B, L))  # written by the first kernel, read by the second
            if B * L:  # one work-group per query row: dq, delta
                g.device.launch("attention_bwd_q", *_attention_grid(B * L), B, L, S, E, Ev,
                                *settings, Q.data, K.data, V.data, _data_or_none(mask), g.data,
                                out.data, lse.data, delta.data, grad_q.data, half=half)
            if B * S:  # one work-group per key row: dk, dv, summed over the query rows
                g.device.launch("attention_bwd_kv", *_attention_grid(B * S), B, L, S, E, Ev,
                                *settings, Q.data, K.data, V.data, _data_or_none(mask), g.data,
                                lse.data, delta.data, grad_k.data, grad_v.data, half=half)
        return grad_q, grad_k, grad_v
    return _record(out, (q, k, v), backward)


# ============================================================================ nn modules
# Modules hold Parameters and sub-modules, registered by attribute assignment as in PyTorch,
# and buffers (saved, never trained: running statistics), registered with register_buffer;
# so named_parameters() yields PyTorch's names in PyTorch's order and state_dict() loads
# into the same torch.nn model and back.

def _check_buffer(name, value):
    """A buffer's value: a Tensor, a host NumPy array, or None (TypeError otherwise, as
    PyTorch)."""
    if value is not None and not isinstance(value, (Tensor, np.ndarray)):
        raise TypeError(f"buffer {name!r} must be a Tensor, a NumPy array or None, got "
                        f"{type(value).__name__}")
    return value


class StateDictError(KeyError, ValueError, RuntimeError):
    """A state dict that does not fit: a missing or unexpected key, or a wrong shape. It is a
    KeyError and a ValueError for callers catching either, and a RuntimeError as in PyTorch."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class Module:
    """Base class: parameters(), named_parameters(), train()/eval(), state_dict(), __call__."""

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__() "
                               f"before assigning attributes")
        if isinstance(value, Parameter):  # a reassigned name keeps its place, as PyTorch
            self._modules.pop(name, None)
            self._buffers.pop(name, None)
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._parameters.pop(name, None)
            self._buffers.pop(name, None)
            self._modules[name] = value
        elif name in self._buffers:  # a new value for a registered buffer, as PyTorch
            self._buffers[name] = _check_buffer(name, value)
        else:
            self._parameters.pop(name, None)
            self._modules.pop(name, None)
        object.__setattr__(self, name, value)

    def register_buffer(self, name, tensor):
        """Register state that is saved but not trained, as PyTorch: a BatchNorm's running
        statistics. `tensor` is a Tensor, a NumPy array kept on the host (a counter the
        host needs anyway, such as num_batches_tracked), or None (then it is left out of
        state_dict). It becomes the attribute `name`, and state_dict() holds it after the
        module's parameters; parameters() never does."""
        if not isinstance(name, str) or not name or "." in name:
            raise KeyError(f"register_buffer: name must be a non-empty string without '.', "
                           f"got {name!r}")
        if name not in self._buffers and (name in self.__dict__ or hasattr(type(self), name)):
            raise KeyError(f"register_buffer: attribute {name!r} already exists")
        self._buffers[name] = _check_buffer(name, tensor)
        object.__setattr__(self, name, tensor)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """The computation; subclasses define it."""
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def named_parameters(self, prefix=""):
        """(name, Parameter) pairs: own parameters first, then each sub-module's."""
        for name, param in self._parameters.items():
            yield prefix + name, param
        for name, module in self._modules.items():
            yield from module.named_parameters(prefix + name + ".")

    def parameters(self):
        """The Parameters, in named_parameters() order."""
        return [param for _, param in self.named_parameters()]

    def named_buffers(self, prefix=""):
        """(name, buffer) pairs: own buffers first, then each sub-module's (None ones left out)."""
        for name, buffer in self._buffers.items():
            if buffer is not None:
                yield prefix + name, buffer
        for name, module in self._modules.items():
            yield from module.named_buffers(prefix + name + ".")

    def _state_items(self, prefix=""):
        """(name, Parameter or buffer) in PyTorch's state_dict order: each module's own
        parameters, then its own buffers, then its sub-modules' in turn."""
        yield from ((prefix + name, param) for name, param in self._parameters.items())
        yield from ((prefix + name, buffer) for name, buffer in self._buffers.items()
                    if buffer is not None)
        for name, module in self._modules.items():
            yield from module._state_items(prefix + name + ".")

    def train(self, mode=True):
        """Set training mode (dropout active) on this module and its sub-modules."""
        object.__setattr__(self, "training", bool(mode))
        for module in self._modules.values():
            module.train(mode)
        return self

    def eval(self):
        """Set evaluation mode (dropout off)."""
        return self.train(False)

    def to(self, device):
        """Move every parameter (its gradient too) and every Tensor buffer (a BatchNorm's
        running statistics) to `device`, in place, and return self, as torch.nn.Module.to.
        `device`: a Device, a queue, or "cpu", "opencl", ... as manager.default takes.

        As PyTorch advises, move the model before creating its optimizer: Adam and AdamW
        hold their parameters in flat buffers on the device, so moving parameters that a
        live Adam holds raises ValueError (nothing is moved then). SGD keeps the same
        Parameters and follows them, until it has momentum buffers on the old device."""
        device = _target_device(f"{type(self).__name__}.to", device)
        for name, param in self.named_parameters():
            owner = param._flat[0].owner() if param._flat is not None else None
            if owner is not None and param.device is not device:
                raise ValueError(f"{type(self).__name__}.to: parameter {name!r} lives in the "
                                 f"flat buffers of its {type(owner).__name__} optimizer on "
                                 f"{param.device.name}; call .to(device) before creating the "
                                 f"optimizer")
        self._move_to(device)
        return self

    def _move_to(self, device):
        for param in self._parameters.values():
            if param.device is not device:
                param.value = param.value.to(device)
                param.grad = None if param.grad is None else param.grad.to(device)
                param._grad_slot = param._flat = None  # out of a dropped optimizer's buffers
        for name, buffer in self._buffers.items():
            if isinstance(buffer, Tensor):  # host arrays (num_batches_tracked) stay
                setattr(self, name, buffer.to(device))
        for module in self._modules.values():
            module._move_to(device)

    def state_dict(self):
        """An ordered dict of NumPy copies of every parameter and buffer, under PyTorch's
        names and in its order."""
        return OrderedDict((name, entry.copy() if isinstance(entry, np.ndarray) else
                            (entry.value if isinstance(entry, Node) else entry).to_host())
                           for name, entry in self._state_items())

    def load_state_dict(self, state):
        """Copy arrays into the existing parameters and buffers (an optimizer built before
        keeps working). A missing or an unexpected key, a shape mismatch, or a bool or
        complex array raises StateDictError naming it, before anything is written."""
        entries = OrderedDict(self._state_items())
        missing = [k for k in entries if k not in state]
        unexpected = [k for k in state if k not in entries]
        if missing or unexpected:
            raise StateDictError(f"load_state_dict: missing keys {missing}, unexpected keys "
                                 f"{unexpected}")
        arrays = {}
        for name, entry in entries.items():
            kind = "parameter" if isinstance(entry, Node) else "buffer"
            array = state[name]
            array = array.to_host() if isinstance(array, Tensor) else np.asarray(array)
            if array.shape != entry.shape:
                raise StateDictError(f"load_state_dict: {name!r} has shape {array.shape}, the "
                                     f"{kind} has {entry.shape}")
            # Integers convert as PyTorch's copy_ does; bool or complex values are no weights.
            if array.dtype.kind not in "fiu":
                raise StateDictError(f"load_state_dict: {name!r} has dtype {array.dtype}, the "
                                     f"{kind} holds {np.dtype(entry.dtype)}")
            arrays[name] = array
        for name, entry in entries.items():  # only once every key fits: a rejected state
            if isinstance(entry, np.ndarray):  # leaves everything as it was
                entry[...] = arrays[name]      # a buffer the host keeps
            else:
                _write(entry.value if isinstance(entry, Node) else entry, arrays[name])
            if isinstance(entry, Parameter):
                entry._half_stale = True  # its optimizer's float16 copy is out of date

    # --- printing: PyTorch's layout, then the parameter count ---------------------------------
    def extra_repr(self):
        """This module's own settings, for repr(), as PyTorch's extra_repr; subclasses with
        arguments return them ("in_features=784, out_features=128, bias=True")."""
        return ""

    def __repr__(self):
        """PyTorch's layout: `Name(extra)`, or one line per setting and per sub-module,
        `(name): repr`, indented by two spaces."""
        extra = self.extra_repr()
        lines = extra.split("\n") if extra else []
        children = [f"({name}): " + repr(module).replace("\n", "\n  ")
                    for name, module in self._modules.items()]
        if len(lines) == 1 and not children:
            return f"{type(self).__name__}({lines[0]})"
        body = "".join("\n  " + line for line in lines + children)
        return f"{type(self).__name__}({body}\n)" if body else f"{type(self).__name__}()"

    def __str__(self):
        """What print(model) shows: repr() and a last line with num_parameters() (PyTorch
        prints no count; Keras' summary does, in these words)."""
        return f"{self!r}\nTotal params: {self.num_parameters():,}"

    def num_parameters(self):
        """The number of parameter values, a Parameter shared by two modules counted once."""
        unique = {id(p): p for p in self.parameters()}
        return builtins.sum(p.value.size for p in unique.values())


def _uniform_parameter(shape, bound, queue):
    values = _rng().uniform(-bound, bound, size=shape).astype(np.float32)
    return Parameter(Tensor.from_host(values, queue))


class Linear(Module):
    """y = x @ weight.T + bias, weight (out_features, in_features); PyTorch's initialisation:
    weight and bias ~ U(-1/sqrt(in_features), 1/sqrt(in_features))."""

    def __init__(self, in_features, out_features, bias=True, *, queue=None):
        super().__init__()
        self.in_features = _check_int("Linear", "in_features", in_features, 1)
        self.out_features = _check_int("Linear", "out_features", out_features, 1)
        bound = 1.0 / math.sqrt(self.in_features)
        self.weight = _uniform_parameter((self.out_features, self.in_features), bound, queue)
        self.bias = _uniform_parameter((self.out_features,), bound, queue) if bias else None

    def forward(self, x):
        """x (..., in_features) -> (..., out_features)."""
        return linear(x, self.weight, self.bias)

    def extra_repr(self):
        """PyTorch's string: in_features, out_features, bias."""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class Conv2d(Module):
    """2-D convolution over (N, C, H, W) input, weight (out_channels, in_channels / groups,
    kh, kw); PyTorch's initialisation: weight and bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
    fan_in = in_channels / groups * kh * kw. kernel_size, stride, padding and dilation: an int
    or a pair; in_ch and out_ch must both be multiples of groups."""

    def __init__(self, in_ch, out_ch, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, *, queue=None):
        super().__init__()
        self.in_channels = _check_int("Conv2d", "in_ch", in_ch, 1)  # PyTorch's attribute names
        self.out_channels = _check_int("Conv2d", "out_ch", out_ch, 1)
        self.kernel_size = _pair("Conv2d", "kernel_size", kernel_size, 1)
        self.stride = _pair("Conv2d", "stride", stride, 1)
        self.padding = _pair("Conv2d", "padding", padding, 0)
        self.dilation = _pair("Conv2d", "dilation", dilation, 1)
        self.groups = _check_int("Conv2d", "groups", groups, 1)
        for name, channels in (("in_ch", in_ch), ("out_ch", out_ch)):
            if channels % groups:
                raise ValueError(f"Conv2d: {name}={channels} is not divisible by "
                                 f"groups={groups}")
        group_channels = self.in_channels // self.groups
        bound = 1.0 / math.sqrt(group_channels * math.prod(self.kernel_size))
        self.weight = _uniform_parameter((self.out_channels, group_channels) + self.kernel_size,
                                         bound, queue)
        self.bias = _uniform_parameter((self.out_channels,), bound, queue) if bias else None

    def forward(self, x):
        """x (N, in_channels, H, W) -> (N, out_channels, OH, OW)."""
        return conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation,
                      self.groups)

    def extra_repr(self):
        """PyTorch's: the defaults of padding, dilation, groups and bias left out."""
        text = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}")
        if self.padding != (0, 0):
            text += f", padding={self.padding}"
        if self.dilation != (1, 1):
            text += f", dilation={self.dilation}"
        if self.groups != 1:
            text += f", groups={self.groups}"
        return text + (", bias=False" if self.bias is None else "")


class MaxPool2d(Module):
    """max_pool2d as a module; stride defaults to kernel_size, padding (-inf) to 0."""

    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__()
        _pool_args("MaxPool2d", kernel_size, stride, padding)  # errors at construction
        self.kernel_size, self.padding = kernel_size, padding
        self.stride = kernel_size if stride is None else stride  # as PyTorch stores it

    def forward(self, x):
        """x (N, C, H, W) -> (N, C, OH, OW)."""
        return max_pool2d(x, self.kernel_size, self.stride, self.padding)

    def extra_repr(self):
        """PyTorch's string: netcl's pooling is PyTorch's with dilation 1 and ceil_mode off."""
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
                f"dilation=1, ceil_mode=False")


class ReLU(Module):
    """max(x, 0)."""

    def forward(self, x):
        """Apply relu."""
        return relu(x)


class Tanh(Module):
    """tanh(x)."""

    def forward(self, x):
        """Apply tanh."""
        return tanh(x)


class Sigmoid(Module):
    """1 / (1 + exp(-x))."""

    def forward(self, x):
        """Apply sigmoid."""
        return sigmoid(x)


class GELU(Module):
    """x * Phi(x): the exact erf form, or PyTorch's tanh approximation (approximate="tanh")."""

    def __init__(self, approximate="none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x):
        """Apply gelu."""
        return gelu(x, self.approximate)

    def extra_repr(self):
        """PyTorch's string: approximate."""
        return f"approximate={self.approximate!r}"


class Dropout(Module):
    """Dropout with probability p while training; the identity in eval mode."""

    def __init__(self, p=0.5):
        super().__init__()
        self.p = _check_number("Dropout", "p", p, 0.0, 1.0)

    def forward(self, x):
        """Apply dropout when training."""
        return dropout(x, self.p, self.training)

    def extra_repr(self):
        """PyTorch's string: p, inplace."""
        return f"p={self.p}, inplace=False"  # PyTorch's string; netcl never drops in place


class Flatten(Module):
    """Flatten dimensions start_dim..end_dim (keeps the batch dimension by default)."""

    def __init__(self, start_dim=1, end_dim=-1):
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x):
        """Apply flatten."""
        return flatten(x, self.start_dim, self.end_dim)

    def extra_repr(self):
        """PyTorch's string: start_dim, end_dim."""
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


class Sequential(Module):
    """Modules applied in order, registered as "0", "1", ... (PyTorch's names)."""

    def __init__(self, *modules):
        super().__init__()
        for i, module in enumerate(modules):
            if not isinstance(module, Module):
                raise ValueError(f"Sequential: argument {i} is not a Module: {module!r}")
            setattr(self, str(i), module)

    def forward(self, x):
        """Apply each module in turn."""
        for module in self._modules.values():
            x = module(x)
        return x

    def __getitem__(self, index):
        return list(self._modules.values())[index]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


# --- normalisation, embedding and attention ---------------------------------------------------

def _constant_parameter(shape, value, queue):
    return Parameter(Tensor.from_host(np.full(shape, value, np.float32), queue))


class LayerNorm(Module):
    """layer_norm over the last dimensions, normalized_shape (an int or a tuple); PyTorch's
    initialisation: weight ones, bias zeros (elementwise_affine=False: neither; bias=False:
    no bias)."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, *,
                 queue=None):
        super().__init__()
        self.normalized_shape = _normalized_shape("LayerNorm", normalized_shape)
        self.eps = _check_number("LayerNorm", "eps", eps)
        self.elementwise_affine = bool(elementwise_affine)
        self.weight = (_constant_parameter(self.normalized_shape, 1.0, queue)
                       if elementwise_affine else None)
        self.bias = (_constant_parameter(self.normalized_shape, 0.0, queue)
                     if elementwise_affine and bias else None)

    def forward(self, x):
        """x (..., *normalized_shape) -> the same shape."""
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self):
        """PyTorch's string: normalized_shape, eps, elementwise_affine, bias."""
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}")


class _BatchNorm(Module):
    """BatchNorm1d and BatchNorm2d: batch_norm with PyTorch's parameters and buffers.

    Training normalises with the batch's statistics and updates running_mean and
    running_var (buffers: in state_dict, not in parameters()); eval normalises with them.
    momentum=None makes the running statistics the plain average over every batch so far
    (num_batches_tracked, an int64 kept on the host as PyTorch keeps it, counts them).
    track_running_stats=False keeps no statistics and always normalises with the batch's.
    """

    input_ranks = ()  # the input dimensions a subclass accepts

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, *, queue=None):
        super().__init__()
        name = type(self).__name__
        self.num_features = _check_int(name, "num_features", num_features, 1)
        self.eps = _check_number(name, "eps", eps)
        self.momentum = None if momentum is None else _check_number(name, "momentum", momentum)
        self.affine, self.track_running_stats = bool(affine), bool(track_running_stats)
        C = self.num_features
        self.weight = _constant_parameter((C,), 1.0, queue) if affine else None
        self.bias = _constant_parameter((C,), 0.0, queue) if affine else None
        tracked = track_running_stats
        self.register_buffer("running_mean", Tensor.from_host(np.zeros(C, np.float32), queue)
                             if tracked else None)
        self.register_buffer("running_var", Tensor.from_host(np.ones(C, np.float32), queue)
                             if tracked else None)
        self.register_buffer("num_batches_tracked", np.zeros((), np.int64) if tracked else None)

    def forward(self, x):
        """x (N, C, ...) -> the same shape, normalised per channel."""
        (x,) = _nodes(type(self).__name__, x)
        if len(x.shape) not in self.input_ranks:  # PyTorch's words
            ranks = " or ".join(f"{r}D" for r in self.input_ranks)
            raise ValueError(f"{type(self).__name__}: expected {ranks} input (got "
                             f"{len(x.shape)}D input)")
        counting = self.training and self.track_running_stats
        batches = int(self.num_batches_tracked) + 1 if counting else 0
        factor = 0.0 if self.momentum is None else self.momentum  # PyTorch's
        if counting and self.momentum is None:
            factor = 1.0 / batches  # the average over every batch so far
        # As PyTorch: training uses the batch; eval the running statistics if there are any.
        out = batch_norm(x, self.running_mean if not self.training or counting else None,
                         self.running_var if not self.training or counting else None,
                         self.weight, self.bias, self.training or self.running_mean is None,
                         factor, self.eps)
        if counting:  # counted once batch_norm has accepted the batch
            self.num_batches_tracked[...] = batches
        return out

    def extra_repr(self):
        """PyTorch's string (its bias=False, a weight without a bias, netcl does not offer)."""
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, bias={self.affine}, "
                f"track_running_stats={self.track_running_stats}")


class BatchNorm1d(_BatchNorm):
    """Batch normalisation of (N, C) or (N, C, L) input, per channel C."""

    input_ranks = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Batch normalisation of (N, C, H, W) input, per channel C."""

    input_ranks = (4,)


class Embedding(Module):
    """A lookup table: weight (num_embeddings, embedding_dim), PyTorch's initialisation
    N(0, 1). Called on integer indices of any shape -> (*shape, embedding_dim)."""

    def __init__(self, num_embeddings, embedding_dim, *, queue=None):
        super().__init__()
        self.num_embeddings = _check_int("Embedding", "num_embeddings", num_embeddings, 1)
        self.embedding_dim = _check_int("Embedding", "embedding_dim", embedding_dim, 1)
        values = _rng().standard_normal((self.num_embeddings, self.embedding_dim))
        self.weight = Parameter(Tensor.from_host(values.astype(np.float32), queue))

    def forward(self, idx):
        """idx (...) integers in [0, num_embeddings) -> (..., embedding_dim)."""
        return embedding(idx, self.weight)

    def extra_repr(self):
        """PyTorch's string: num_embeddings, embedding_dim."""
        return f"{self.num_embeddings}, {self.embedding_dim}"


# A state that is not a flat dict of arrays (an optimizer's, a training checkpoint) is stored
# flattened: each leaf is one array under its dotted path ("optimizer.state.3.exp_avg"; Python
# numbers and strings as 0-d arrays), and one more entry, _TREE_KEY, holds a JSON skeleton of
# the nesting: {"dict": [[key, node], ...]}, {"list": [...]}, {"tuple": [...]}, null for None,
# or {"array"|"int"|"float"|"bool"|"str": dotted path} for a leaf. JSON, unlike a pickle,
# cannot run code, and the skeleton brings back what the dots cannot say: a dict keyed by
# ints from a list, a model's "0.weight" from a nested dict, a float from a 0-d array.
_TREE_KEY = "__netcl_tree__"
_LEAF_KINDS = {bool: "bool", int: "int", float: "float", str: "str"}


def _is_array_like(value):
    return isinstance(value, (np.ndarray, np.generic, Tensor, Node))


def _add_array(arrays, key, value):
    if isinstance(value, Node):
        value = value.value
    array = value.to_host() if isinstance(value, Tensor) else np.asarray(value)
    if array.dtype.hasobject:
        raise ValueError(f"save: {key!r} is not a numeric array (dtype {array.dtype})")
    if str(key) in arrays:  # the archive's names are strings: one would replace the other
        raise ValueError(f"save: two entries are both {str(key)!r} as strings; an archive can "
                         f"hold only one of them")
    arrays[str(key)] = array


def _flatten_state(value, path, arrays):
    """Add `value`'s leaves to `arrays` under dotted paths; return its skeleton."""
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise ValueError(f"save: key {key!r} in {path or 'the state'} must be a str or "
                                 f"an int")
        return {"dict": [[key, _flatten_state(item, f"{path}.{key}" if path else str(key),
                                              arrays)] for key, item in value.items()]}
    if isinstance(value, (list, tuple)):
        items = [_flatten_state(item, f"{path}.{i}" if path else str(i), arrays)
                 for i, item in enumerate(value)]
        return {"tuple" if isinstance(value, tuple) else "list": items}
    if value is None:
        return None
    kind = "array" if _is_array_like(value) else _LEAF_KINDS.get(type(value))
    if kind is None:
        raise ValueError(f"save: {path!r} is a {type(value).__name__}; a state holds arrays, "
                         f"numbers, strings, None, and dicts and lists of them")
    _add_array(arrays, path, value)
    return {kind: path}


def _unflatten_state(node, archive, path):
    """Rebuild what _flatten_state saw from its skeleton and the archive's arrays."""
    if node is None:
        return None
    if isinstance(node, dict) and len(node) == 1:
        (kind, content), = node.items()
        if kind == "dict" and isinstance(content, list) and all(
                isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (str, int))
                for pair in content):
            return {key: _unflatten_state(item, archive, path) for key, item in content}
        if kind in ("list", "tuple") and isinstance(content, list):
            items = [_unflatten_state(item, archive, path) for item in content]
            return items if kind == "list" else tuple(items)
        if kind in ("array", *_LEAF_KINDS.values()) and isinstance(content, str):
            if content not in archive.files or content == _TREE_KEY:
                raise ValueError(f"load: {path} names an entry {content!r} it does not hold")
            array = archive[content]
            if kind == "array":
                return array
            if array.ndim != 0 or array.dtype.kind not in {"bool": "b", "int": "iu", "float": "f",
                                                           "str": "U"}[kind]:
                raise ValueError(f"load: {path}: entry {content!r} is not a {kind} (dtype "
                                 f"{array.dtype}, shape {array.shape})")
            return {"bool": bool, "int": int, "float": float, "str": str}[kind](array[()])
    raise ValueError(f"load: {path} has a malformed structure entry ({str(node)[:80]})")


def save(state, path):
    """Write `state` to exactly `path` as .npz (no pickles).

    state: a dict of arrays (or Tensors/Nodes), as a model's state_dict, stored as it is; or
    any nesting of dicts (str or int keys), lists and tuples over arrays, Python numbers,
    strings and None, as an optimizer's or a scheduler's state_dict, stored flattened under
    dotted keys, so that load() returns it as it was (Python numbers as Python numbers).

    The archive is written to a temporary file beside `path`, flushed to disk, then renamed
    onto it: a full disk, a write error or a Ctrl-C leaves the previous file intact and no
    temporary behind. A new file gets the permissions open() would give it; an existing one
    keeps its own. A failure raises OSError naming `path`.
    """
    if not isinstance(state, dict):
        raise ValueError(f"save: state must be a dict, got {type(state).__name__}")
    arrays = {}
    # A flat dict of arrays under string keys is stored as it is (NumPy's savez layout);
    # anything else with the structure entry, which keeps int keys ints.
    if all(_is_array_like(value) and isinstance(key, str) for key, value in state.items()):
        for key, value in state.items():
            if key == _TREE_KEY:  # load would read it as the skeleton of a nested state
                raise ValueError(f"save: the key {_TREE_KEY!r} is netcl's own; use another")
            _add_array(arrays, key, value)
    else:
        skeleton = _flatten_state(state, "", arrays)
        _add_array(arrays, _TREE_KEY, json.dumps(skeleton))
    path = os.fspath(path)
    target = os.path.realpath(path)  # through a symlink, as open() would write
    directory = os.path.dirname(target)
    # Same directory: the rename stays on one filesystem, where it is atomic.
    temporary = os.path.join(directory, f".{os.path.basename(target)}.{os.urandom(4).hex()}.tmp")
    try:
        try:
            mode = os.stat(target).st_mode & 0o7777
        except FileNotFoundError:
            mode = None
        f = open(temporary, "xb")  # "x": a new file, never one that someone else made
        try:
            with f:  # a file object, so NumPy does not append ".npz"
                np.savez(f, **arrays)
                f.flush()
                os.fsync(f.fileno())  # the data is on disk before the name points at it
            if mode is not None:
                os.chmod(temporary, mode)
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(temporary)
            raise
    except OSError as error:  # name the file being saved, not the temporary
        raise OSError(error.errno, f"save: {error.strerror or error}", path) from error
    if os.name == "posix":  # make the rename durable too; Windows cannot open a directory
        with contextlib.suppress(OSError):  # some filesystems refuse to fsync a directory
            directory_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(directory_fd)
            finally:
                os.close(directory_fd)


def load(path):
    """Read a .npz written by save(): a dict of NumPy arrays, or the nested state that was
    saved. Never unpickles, so a file from a stranger cannot run code. A file that is no such
    archive (a .npy, a truncated or damaged .npz, one holding pickled objects, a malformed
    structure entry) raises ValueError naming it; a missing one, OSError."""
    path = os.fspath(path)
    with open(path, "rb") as file:
        magic = file.peek(4)[:4]
        if magic not in (b"PK\x03\x04", b"PK\x05\x06"):  # a zip file, empty or not
            raise ValueError(f"load: {path} is not a netcl .npz archive (it starts with "
                             f"{magic!r}, not a zip file's b'PK')")
        try:
            with np.load(file, allow_pickle=False) as archive:
                if _TREE_KEY not in archive.files:
                    state = {key: archive[key] for key in archive.files}
                    for key, value in state.items():  # NumPy hands other members as bytes
                        if not isinstance(value, np.ndarray):
                            raise ValueError(f"its member {key!r} is no .npy array")
                    return state
                try:
                    skeleton = json.loads(str(archive[_TREE_KEY][()]))
                    state = _unflatten_state(skeleton, archive, path)
                except RecursionError:
                    raise ValueError(f"load: {path} nests its structure too deeply") from None
                if not isinstance(state, dict):
                    raise ValueError(f"load: {path} has a malformed structure entry")
                return state
        except (ValueError, TypeError, EOFError, zipfile.BadZipFile, zlib.error) as error:
            raise ValueError(f"load: {path} is not a readable netcl .npz archive "
                             f"({error})") from error


# ============================================================================ optimizers
# PyTorch's update rules. A parameter whose .grad is None is left untouched; `.lr` is a checked
# property, so a schedule can set it between steps. SGD runs one launch per parameter. Adam
# and AdamW keep the whole model in flat buffers, so that a step, gradient clipping included,
# is three launches whatever the number of parameters, and never waits for the device: the
# gradient norm, the clipping coefficient, the skip decision and the step count all stay in
# device memory.

def _check_hyperparameter(what, value, below=None, name=None):
    """PyTorch's check and message, e.g. "Invalid learning rate: -1 (lr)": 0 <= value (< below),
    with the argument's name added."""
    if not _is_scalar(value) or not (0.0 <= value and (below is None or value < below)):
        raise ValueError(f"Invalid {what}: {value}" + (f" ({name})" if name else ""))


def _state_part(op, state, keys, what="state"):
    """state, a dict with every one of `keys` (a state_dict's part), or an error naming what
    is missing: a state_dict of another kind of optimizer or schedule, or no state_dict."""
    if not isinstance(state, dict):
        raise TypeError(f"{op}: {what} must be a dict (a state_dict() output), got "
                        f"{type(state).__name__}")
    missing = [key for key in keys if key not in state]
    if missing:
        raise ValueError(f"{op}: {what} has no {missing[0]!r} (a state_dict of another kind of "
                         f"optimizer or schedule?)")
    return state


def _param_group(op, state, keys, entry_keys):
    """The one parameter group of an optimizer's state_dict, checked with _state_part, after
    checking each per-parameter entry of state["state"] for entry_keys."""
    _state_part(op, state, ("state", "param_groups"))
    groups = state["param_groups"]
    if not isinstance(groups, (list, tuple)) or len(groups) != 1:
        raise ValueError(f"{op}: param_groups must be a list of one group, got {groups!r:.80}")
    if not isinstance(state["state"], dict):
        raise TypeError(f"{op}: state['state'] must be a dict, got "
                        f"{type(state['state']).__name__}")
    for i, entry in state["state"].items():
        _state_part(op, entry, entry_keys, f"the state of parameter {i}")
    return _state_part(op, groups[0], keys, "param_groups[0]")


class Optimizer:
    """Base class: holds the parameters; zero_grad() sets every .grad to None.

    `_found_inf` is None, or, for the duration of one AMPGradScaler.step, the scaler's device
    flag (an int32 Tensor (1,)) saying a gradient was inf/NaN: a subclass whose step reads it
    on the device and makes the step a no-op says so with `_skips_on_device = True`, in the
    class that defines that step (a subclass that overrides it says so again, or the scaler
    decides on the host whether to call it).
    """

    _skips_on_device = False

    def __init__(self, params, lr):
        self.params = list(params)
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        for i, p in enumerate(self.params):
            if not isinstance(p, Node) or not p.requires_grad:
                raise ValueError(f"optimizer: parameter {i} is not a Parameter: {p!r}")
            if any(p is q for q in self.params[:i]):  # it would be updated twice per step
                raise ValueError(f"optimizer: parameter {i} appears more than once")
        self.lr = lr
        self._found_inf = None

    @property
    def lr(self):
        """The learning rate; settable between steps (a schedule does)."""
        return self._lr

    @lr.setter
    def lr(self, value):
        """Checked as in the constructor: a string would fail only inside a kernel launch,
        and a negative rate would climb the loss."""
        _check_hyperparameter("learning rate", value, name="lr")
        self._lr = float(value)

    def zero_grad(self):
        """Drop every gradient (set to None, as PyTorch's set_to_none=True)."""
        for p in self.params:
            p.grad = None

    def _grads(self):
        """The gradient tensors a step reads (for AMPGradScaler.unscale_)."""
        return [p.grad for p in self.params if p.grad is not None]


class SGD(Optimizer):
    """Stochastic gradient descent with momentum, Nesterov momentum and weight decay, exactly
    as torch.optim.SGD (dampening 0):
        d = grad + weight_decay * p
        buf = d (first step) or momentum * buf + d
        d = d + momentum * buf (nesterov) or buf
        p -= lr * d
    """

    _skips_on_device = True

    def __init__(self, params, lr, momentum=0, weight_decay=0, nesterov=False):
        super().__init__(params, lr)
        self._set_hyperparameters(momentum, weight_decay, nesterov)
        self.momentum_buffers = [None] * len(self.params)

    def _set_hyperparameters(self, momentum, weight_decay, nesterov):
        """Check all three, then set them (so a rejected load_state_dict changes nothing)."""
        _check_hyperparameter("momentum value", momentum, name="momentum")
        _check_hyperparameter("weight_decay value", weight_decay, name="weight_decay")
        if nesterov and momentum <= 0:
            raise ValueError(f"Nesterov momentum requires momentum > 0, got momentum={momentum!r}")
        self.momentum, self.weight_decay = float(momentum), float(weight_decay)
        self.nesterov = bool(nesterov)

    def step(self):
        """Update every parameter that has a gradient."""
        _check_float_grads("SGD.step", self.params)
        found_inf = self._found_inf  # an AMPGradScaler's: nonzero makes the step a no-op
        if found_inf is not None and found_inf.device.backend == "cpu" and found_inf.data[0]:
            return
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            first = self.momentum_buffers[i] is None
            if first and self.momentum:
                # Zeros, not garbage: a first step the device skips leaves the buffer as it was,
                # and momentum * 0 + d on the next step is then what a first step gives.
                self.momentum_buffers[i] = _fill(p.shape, 0.0, p.value)
            buf = self.momentum_buffers[i]
            P, G = p.value, p.grad
            if buf is not None and buf.device is not P.device:
                raise ValueError(f"SGD.step: parameter {i} is on {P.device.name}, its momentum "
                                 f"buffer on {buf.device.name}: the model was moved after this "
                                 f"optimizer's first step; call .to(device) before creating "
                                 f"the optimizer")
            if P.device.backend == "cpu":
                d = G.data + self.weight_decay * P.data
                if self.momentum:
                    buf.data[...] = d if first else self.momentum * buf.data + d
                    d = d + self.momentum * buf.data if self.nesterov else buf.data
                P.data -= self.lr * d
            elif P.size:
                # sgd_step reads and writes float32: a float16 parameter or gradient goes
                # through a float32 copy (the momentum buffer is float32 already: _fill)
                P32, G32 = _float32(P), _float32(G)
                P.device.launch("sgd_step", *_grid(P.size), P.size, self.lr, self.momentum,
                                self.weight_decay, int(self.nesterov), int(first),
                                int(found_inf is not None),
                                None if found_inf is None else found_inf.data,
                                P32.data, G32.data, (buf or P32).data)
                if P32 is not P:
                    _cast(P32, np.float16, out=P)

    def state_dict(self):
        """PyTorch's layout: {"state": {index: {"momentum_buffer": array}}, "param_groups"}."""
        return {"state": {i: {"momentum_buffer": buf.to_host()}
                          for i, buf in enumerate(self.momentum_buffers) if buf is not None},
                "param_groups": [{"lr": self.lr, "momentum": self.momentum,
                                  "weight_decay": self.weight_decay, "nesterov": self.nesterov,
                                  "params": list(range(len(self.params)))}]}

    def load_state_dict(self, state):
        """Restore hyper-parameters and momentum buffers from state_dict()'s output. All of it
        is checked before anything is set: a rejected state leaves the optimizer as it was."""
        name = "SGD.load_state_dict"
        group = _param_group(name, state, ("lr", "momentum", "weight_decay", "nesterov",
                                           "params"), ("momentum_buffer",))
        if len(group["params"]) != len(self.params):
            raise ValueError(f"{name}: the state is for {len(group['params'])} parameters, the "
                             f"optimizer has {len(self.params)}")
        _check_hyperparameter("learning rate", group["lr"], name="lr")
        buffers = [None] * len(self.params)
        for i, entry in state["state"].items():
            i = int(i)
            if not 0 <= i < len(self.params):
                raise ValueError(f"{name}: state for parameter {i}, but the optimizer has "
                                 f"{len(self.params)}")
            p = self.params[i]
            buf = _real_array(name, entry["momentum_buffer"], f"momentum_buffer {i}")
            if buf.shape != p.shape:
                raise ValueError(f"{name}: momentum_buffer {i} has shape {buf.shape}, parameter "
                                 f"has {p.shape}")
            # In the parameter's compute dtype: an integer array would become an int32 tensor
            # that the update kernel reads as floats.
            buffers[i] = Tensor.from_host(buf, p.value.queue, _compute_dtype(p.dtype))
        self._set_hyperparameters(group["momentum"], group["weight_decay"], group["nesterov"])
        self.lr = group["lr"]
        self.momentum_buffers = buffers


# --- gradient norms and clip_grad_norm -------------------------------------------------------
# The norm of many gradients is the norm of all of them seen as one vector (PyTorch computes
# the norm of the per-tensor norms, torch/nn/utils/clip_grad.py: the same thing). It never
# leaves the device. Stage one writes partial results: sums of |g|^p (maxima of |g| for the
# inf-norm), one per OpenCL work-group, one per tensor on the NumPy backend. Stage two, inside
# whichever kernel needs the norm, has one work-group combine them into (sum)^(1/p) or the
# maximum, so the norm is ready in device memory without the host ever reading it.

def _norm_groups(n, device):
    """Work-groups for the partials of n elements: about 4096 elements each, 8 per compute
    unit at most: a GPU needs that many loads in flight to read at full speed (the H200 read
    a 20M-element gradient at 1.2 TB/s with 256), and on a CPU device more only add the
    overhead of running groups (PoCL, 2 cores: 66 groups took 544 µs, 16 took 241)."""
    most = 8 * device.compute_units if device.gemm == "packed" else max(
        256, 8 * device.compute_units)
    return min(max(_ceil_div(n, 4096), 1), most)


def _norm_partials(grads, norm_type):
    """Partial results of the norm_type-norm of the tensors `grads` (stage one above)."""
    device = grads[0].device
    if device.backend == "cpu":
        with np.errstate(all="ignore"):  # an inf/NaN gradient gives an inf/NaN norm, silently
            # (float16 gradients summed in float32, as the kernels do)
            values = [g.data.ravel().astype(np.promote_types(g.dtype, np.float32), copy=False)
                      for g in grads]
            partials = [np.abs(v).max(initial=0.0) if math.isinf(norm_type) else
                        np.dot(v, v) if norm_type == 2 else np.sum(np.abs(v) ** norm_type)
                        for v in values]
        return Tensor.from_host(np.array(partials), device.queue, np.float64)
    groups = [_norm_groups(g.size, device) for g in grads]
    # builtins.sum: the module's own `sum` is reduce_sum, bound at the end of the file
    partials = Tensor.empty((builtins.sum(groups),), np.float32, device.queue)
    first = 0
    for g, count in zip(grads, groups):
        device.launch("norm_partials", (count * 256,), (256,), g.size, norm_type, first,
                      g.data, partials.data)
        first += count
    return partials


def _total_norm(partials, norm_type):
    """Stage two on the NumPy backend (kernels.cl: total_norm): partials (k,) -> the norm."""
    if math.isinf(norm_type):
        return partials.max(initial=0.0)
    return partials.sum() ** (1.0 / norm_type)


def _check_float_grads(op, params):
    """An error naming the first of `params` whose gradient (set by hand) the kernels cannot
    read as its gradient (_check_grad)."""
    for i, p in enumerate(params):
        if p.grad is not None:
            _check_grad(op, p, f"parameter {i}")


def clip_grad_norm(params, max_norm, norm_type=2.0, error_if_nonfinite=False):
    """Scale the gradients of `params` in place so that their global norm is at most max_norm,
    and return the norm they had: a device scalar (a Tensor of shape ()) that float() reads.
    That read is the only sync; clipping itself never waits for the device.

    PyTorch's clip_grad_norm_ (torch/nn/utils/clip_grad.py): total = the norm_type-norm of all
    gradients seen as one vector (norm_type > 0, or inf / "inf"); every gradient is multiplied
    by min(max_norm / (total + 1e-6), 1), by 1 too, since deciding would need a sync. A
    non-finite total raises RuntimeError with error_if_nonfinite=True; otherwise the gradients
    are multiplied all the same and become non-finite (Adam.step(max_norm=...) is what skips).
    """
    params = [params] if isinstance(params, Node) else list(params)
    _check_number("clip_grad_norm", "max_norm", max_norm, minimum=0)
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm: norm_type must be positive or inf, got {norm_type}")
    _check_float_grads("clip_grad_norm", params)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:  # as PyTorch: nothing to clip, and the norm is 0
        return _fill((), 0.0, params[0].value) if params else Tensor.from_host(np.float32(0.0))
    device = _devices_of("clip_grad_norm", *grads)
    # The kernels read and scale float32: a float16 gradient (a float16 leaf's, on OpenCL)
    # through a float32 copy, rounded back once scaled
    wide = grads if device.backend == "cpu" else [_float32(g) for g in grads]
    partials = _norm_partials(wide, norm_type)
    total_norm = Tensor.empty((), np.float32, device.queue)
    clip_coef = Tensor.empty((), np.float32, device.queue)
    if device.backend == "cpu":
        total_norm.data[...] = _total_norm(partials.data, norm_type)
        with np.errstate(all="ignore"):
            clip_coef.data[...] = np.minimum(max_norm / (total_norm.data + np.float32(1e-6)), 1.0)
    else:
        device.launch("clip_coefficient", (256,), (256,), partials.size, norm_type, max_norm,
                      partials.data, total_norm.data, clip_coef.data)
    # Only this check needs the norm's value on the host: a deliberate sync, asked for.
    if error_if_nonfinite and not math.isfinite(float(total_norm)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            f"non-finite, so it cannot be clipped. To disable this error and scale the "
            f"gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    for g, w in zip(grads, wide):
        if device.backend == "cpu":
            with np.errstate(all="ignore"):  # inf * 0 is NaN here, as in PyTorch
                g.data *= clip_coef.data
        elif g.size:
            device.launch("scale_by_device_scalar", *_grid(w.size), w.size, clip_coef.data, w.data)
            if w is not g:
                _cast(w, np.float16, out=g)
    return total_norm


clip_grad_norm_ = clip_grad_norm  # PyTorch's in-place name


# --- flat buffers ------------------------------------------------------------------------------
# Adam and AdamW keep parameters, gradients and both moments in four flat buffers, each
# parameter owning the same segment of each. A parameter's `.value` becomes a view of its
# segment of the parameter buffer, so the model keeps working through the same Parameter
# objects, and its `_grad_slot` the view of its segment of the gradient buffer, so backward
# stores the gradient there (_accumulate_grad). The gradient norm is then one reduction over
# the flat gradients and the update one launch over all four buffers.
#
# Views are OpenCL sub-buffers (ndarray slices on the NumPy backend) rather than offsets that
# kernels would have to take: every other kernel, and .to_host(), sees an ordinary buffer. A
# sub-buffer must start at a multiple of the device's base-address alignment (128 bytes on
# PoCL, 512 on NVIDIA), so each segment is padded up to it. The padding of the gradient
# buffer is zero and stays zero (backward and clip_grad_norm write segments only, the update
# only reads gradients), so a reduction over the whole buffer is the norm of the gradients.
# The flat buffers come from the pool like any tensor's memory and go back to it with the
# optimizer; the parameters' old buffers go back at once.

def _segment(flat, offset, shape):
    """A view of `shape` into the 1-D tensor `flat`, from element `offset`."""
    size = math.prod(shape)
    if flat.device.backend == "cpu":
        data = flat.data[offset:offset + size].reshape(shape)
    else:  # a sub-buffer may not be empty: a zero-size segment still spans one element
        itemsize = flat.dtype.itemsize
        data = flat.data.get_sub_region(offset * itemsize, max(size, 1) * itemsize)
    return Tensor(flat.device, shape, flat.dtype, data, base=flat)


class _FlatBuffers:
    """`params`, `grads`, `exp_avg`, `exp_avg_sq`: flat float32 tensors (size,), and each
    parameter's segment of each (`param_views[i]`, `grad_views[i]`, ...)."""

    def __init__(self, params):
        like = params[0].value
        device = like.device
        # Segment starts, in elements: mem_base_addr_align is in bits, and a start must be
        # aligned in the float16 copy (half_copies) too; NumPy needs none.
        align = 1 if device.backend == "cpu" else max(device.cl_device.mem_base_addr_align // 16, 1)
        offsets, self.size = [], 0
        for p in params:
            offsets.append(self.size)
            self.size += _round_up(max(p.value.size, 1), align)
        self.params, self.grads, self.exp_avg, self.exp_avg_sq = (
            _fill((self.size,), 0.0, like) for _ in range(4))
        self._views = lambda flat: [_segment(flat, offset, p.shape)
                                    for offset, p in zip(offsets, params)]
        self.param_views, self.grad_views = self._views(self.params), self._views(self.grads)
        self.exp_avg_views = self._views(self.exp_avg)
        self.exp_avg_sq_views = self._views(self.exp_avg_sq)
        self.params_half = self.half_views = None  # see half_copies
        self.owner = lambda: None  # the optimizer using these buffers (a weakref), if any
        for index, (p, value, slot) in enumerate(zip(params, self.param_views, self.grad_views)):
            p.value = _copy(p.value, out=value)
            if isinstance(p, Parameter):  # a plain Node leaf has no slot: its grads stay apart
                p._grad_slot = slot
                p._flat = (self, index)
                if p.grad is not None:
                    p.grad = _copy(p.grad, out=slot)

    def half_copies(self):
        """The parameters rounded to float16, flat and one view each, for tensor cores under
        autocast: made on first use, then kept equal to the parameters by the update kernel
        (adam_step writes both), so a step needs no pass that rounds the weights again."""
        if self.params_half is None:
            self.params_half = _cast(self.params, np.float16)
            self.half_views = self._views(self.params_half)
        return self.half_views


# --- Adam and AdamW ----------------------------------------------------------------------------

class Adam(Optimizer):
    """Adam with PyTorch's rule and defaults (torch/optim/adam.py, _single_tensor_adam):
        g = grad + weight_decay * p                 (an L2 penalty; AdamW decays p instead)
        m = m + (1 - beta1) * (g - m)               (exp_avg.lerp_(g, 1 - beta1))
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    where t counts the applied steps. PyTorch keeps one such count per parameter; netcl keeps
    one per optimizer, on the device. The two agree whenever every parameter gets a gradient
    on every step (a parameter whose .grad is None is left untouched, moments included).

    step(max_norm=c) clips first, exactly as clip_grad_norm(params, c) would, but inside the
    update: each gradient is scaled in registers and .grad is left as it was. A non-finite
    gradient norm makes the step a no-op on the device: parameters and moments stay
    bit-identical and t does not advance. Since the parameters live in flat buffers (see
    above), a step is three kernel launches (two without max_norm) whatever the number of
    parameters, and it never syncs.
    """

    decoupled_weight_decay = False
    _skips_on_device = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0):
        super().__init__(params, lr)
        self._set_hyperparameters(betas, eps, weight_decay)
        name = type(self).__name__
        device = _devices_of(name, *self.params)
        for i, p in enumerate(self.params):
            if p.dtype != np.float32:
                raise ValueError(f"{name}: parameter {i} is {p.dtype}; only float32 "
                                 f"parameters are supported")
        self._flat = _FlatBuffers(self.params)
        self._flat.owner = weakref.ref(self)  # while this optimizer lives, Module.to refuses
        self._step_count = Tensor.from_host(np.zeros(1, np.int32), device.queue)  # t
        self._scalars = Tensor.empty((4,), np.float32, device.queue)  # see _prepare
        # None, or for the duration of one AMPGradScaler.step(max_norm=...) that unscaled the
        # gradients, the partials of their 2-norm that its pass wrote (_norm_partials' layout):
        # the clip takes those rather than read every gradient again.
        self._grad_norm_partials = None
        # None, or for the duration of such a step, the arguments with which adam_prepare also
        # works out the scaler's next state (AMPGradScaler._speculation); _scaler_updated says
        # whether a launch took them.
        self._scaler_update, self._scaler_updated = None, False

    def _set_hyperparameters(self, betas, eps, weight_decay):
        _check_hyperparameter("epsilon value", eps, name="eps")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"Invalid betas: {betas!r} (a pair (beta1, beta2) is needed)")
        _check_hyperparameter("beta parameter at index 0", betas[0], below=1.0, name="betas")
        _check_hyperparameter("beta parameter at index 1", betas[1], below=1.0, name="betas")
        _check_hyperparameter("weight_decay value", weight_decay, name="weight_decay")
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps, self.weight_decay = float(eps), float(weight_decay)

    def step(self, max_norm=None):
        """Update every parameter that has a gradient; with max_norm, clip the gradients'
        global 2-norm to it first (in registers: .grad is not changed)."""
        if max_norm is not None:
            _check_number(f"{type(self).__name__}.step", "max_norm", max_norm, minimum=0)
        runs = self._runs()
        if not runs:
            return
        partials = None
        if max_norm is not None:
            partials = self._grad_norm_partials
            if partials is None:
                partials = _norm_partials([g for _, g, *_ in runs], 2.0)
        self._prepare(partials, max_norm)
        for p, g, m, v, p_half in runs:
            self._update(p, g, m, v, p_half)

    def _runs(self):
        """(param, grad, exp_avg, exp_avg_sq) tensors to update: the four whole flat buffers
        when every parameter's value and gradient are its segments (as after any backward),
        else each parameter that has a gradient, one by one (one launch each)."""
        flat = self._flat
        if all(p.value is value and p.grad is slot
               for p, value, slot in zip(self.params, flat.param_views, flat.grad_views)):
            return [(flat.params, flat.grads, flat.exp_avg, flat.exp_avg_sq, flat.params_half)]
        runs = []
        for i, (p, m, v) in enumerate(zip(self.params, flat.exp_avg_views, flat.exp_avg_sq_views)):
            if p.grad is None:
                continue
            if p.grad.shape != p.shape or p.grad.dtype != p.dtype or p.grad.device is not p.device:
                raise ValueError(f"{type(self).__name__}.step: parameter {i} {p.shape} has a "
                                 f"gradient of shape {p.grad.shape}, dtype {p.grad.dtype}")
            own = p.value is flat.param_views[i] and flat.half_views is not None
            runs.append((p.value, p.grad, m, v, flat.half_views[i] if own else None))
        return runs

    def _grads(self):
        """The gradients the step reads: the flat gradient buffer, or each parameter's."""
        return [g for _, g, *_ in self._runs()]

    # A step's scalars are written in device memory by one small kernel before the update:
    #   scalars (4) = grad_scale, skip, 1 - beta1^t, sqrt(1 - beta2^t)
    # grad_scale multiplies every gradient in registers (the clip coefficient) and a nonzero
    # skip makes the update a no-op: a non-finite norm, or an AMPGradScaler's found_inf (its
    # unscale_ has already divided the gradients by the scale, in place, as PyTorch's does).
    # t advances only when the step applies.
    def _prepare(self, partials, max_norm):
        beta1, beta2 = self.betas
        step_count, scalars, found_inf = self._step_count, self._scalars, self._found_inf
        if step_count.device.backend == "cpu":
            grad_scale, skip = 1.0, found_inf is not None and bool(found_inf.data[0])
            if partials is not None:
                total_norm = np.float32(_total_norm(partials.data, 2.0))
                skip = skip or not np.isfinite(total_norm)
                with np.errstate(all="ignore"):
                    grad_scale = min(np.float32(max_norm) / (total_norm + np.float32(1e-6)), 1.0)
            step_count.data += 0 if skip else 1
            t = int(step_count.data[0])
            scalars.data[...] = (grad_scale, skip, 1 - beta1 ** t, math.sqrt(1 - beta2 ** t))
        else:
            # The kernel computes 1 - beta^t as -expm1(t ln beta), with ln beta from the host
            # in float64: 1 - beta2 from beta2 rounded to float32 would keep 4 digits of 0.001.
            log = lambda beta: math.log(beta) if beta > 0 else -math.inf
            update = self._scaler_update
            step_count.device.launch(
                "adam_prepare", (256,), (256,), 0 if partials is None else partials.size,
                0.0 if max_norm is None else float(max_norm), log(beta1), log(beta2),
                int(found_inf is not None), None if partials is None else partials.data,
                None if found_inf is None else found_inf.data, step_count.data, scalars.data,
                int(update is not None), *(update or (0.0, 0.0, 0) + (None,) * 6))
            self._scaler_updated = update is not None

    def _update(self, p, g, m, v, p_half=None):
        """The rule of the class docstring on param p, grad g, exp_avg m, exp_avg_sq v; p_half,
        if given, is p's float16 copy (_FlatBuffers.half_copies), written with p."""
        beta1, beta2 = self.betas
        if p.device.backend == "cpu":
            grad_scale, skip, bias_correction1, bias_correction2_sqrt = self._scalars.data
            if skip:
                return
            # PyTorch's in-place calls, one by one; temporaries are pooled scratch (`out=`),
            # since fresh arrays of a model's size would cost page faults on every step.
            P, M, V = p.data, m.data, v.data
            grad, scratch = _like(g), _like(g)
            G, S = grad.data, scratch.data
            with np.errstate(all="ignore"):
                np.multiply(g.data, grad_scale, out=G)
                if self.decoupled_weight_decay:                  # param.mul_(1 - lr * wd)
                    P *= 1 - self.lr * self.weight_decay
                elif self.weight_decay:                          # grad = grad.add(param, alpha=wd)
                    G += np.multiply(P, self.weight_decay, out=S)
                np.subtract(G, M, out=S)                         # exp_avg.lerp_(grad, 1 - beta1)
                M += np.multiply(S, 1 - beta1, out=S)
                V *= beta2                                       # exp_avg_sq.mul_(beta2)
                np.multiply(G, G, out=S)                         #   .addcmul_(grad, grad,
                V += np.multiply(S, 1 - beta2, out=S)            #             value=1 - beta2)
                denom = np.sqrt(V, out=S)                        # denom = (exp_avg_sq.sqrt()
                denom /= bias_correction2_sqrt                   #   / bias_correction2_sqrt)
                denom += self.eps                                #   .add_(eps)
                np.divide(M, denom, out=S)                       # param.addcdiv_(exp_avg, denom,
                P -= np.multiply(S, self.lr / bias_correction1, out=S)  # value=-lr / bc1)
        elif p.size:
            decoupled = self.decoupled_weight_decay
            p.device.launch("adam_step", *_grid(p.size), p.size, self.lr, 1.0 - beta1, beta2,
                            1.0 - beta2, self.eps, 0.0 if decoupled else self.weight_decay,
                            1.0 - self.lr * self.weight_decay if decoupled else 1.0,
                            self._scalars.data, p.data, g.data, m.data, v.data,
                            None if p_half is None else p_half.data)

    def state_dict(self):
        """PyTorch's layout, with NumPy arrays: {"state": {i: {"step", "exp_avg",
        "exp_avg_sq"}}, "param_groups": [{"lr", "betas", "eps", "weight_decay", "params"}]}.
        Every parameter has state, with the optimizer's one step count. Reads the device."""
        step = int(self._step_count.to_host()[0])
        flat = self._flat
        moments = zip(flat.exp_avg_views, flat.exp_avg_sq_views)
        return {"state": {i: {"step": step, "exp_avg": m.to_host(), "exp_avg_sq": v.to_host()}
                          for i, (m, v) in enumerate(moments)},
                "param_groups": [{"lr": self.lr, "betas": self.betas, "eps": self.eps,
                                  "weight_decay": self.weight_decay,
                                  "params": list(range(len(self.params)))}]}

    def load_state_dict(self, state):
        """Restore hyper-parameters, moments and the step count from state_dict()'s output,
        so that the optimizer continues the same trajectory. A parameter without state gets
        zero moments; where steps differ between parameters (a PyTorch checkpoint), the
        largest is taken. All of it is checked before anything is set: a rejected state leaves
        the optimizer as it was."""
        name = f"{type(self).__name__}.load_state_dict"
        group = _param_group(name, state, ("lr", "betas", "eps", "weight_decay", "params"),
                             ("step", "exp_avg", "exp_avg_sq"))
        if len(group["params"]) != len(self.params):
            raise ValueError(f"{name}: the state is for {len(group['params'])} parameters, the "
                             f"optimizer has {len(self.params)}")
        _check_hyperparameter("learning rate", group["lr"], name="lr")
        moments, steps = {}, [0]
        for i, entry in state["state"].items():
            i = int(i)
            if not 0 <= i < len(self.params):
                raise ValueError(f"{name}: state for parameter {i}, but the optimizer has "
                                 f"{len(self.params)}")
            moments[i] = [np.asarray(_real_array(name, entry[key], f"{key} of parameter {i}"),
                                     np.float32) for key in ("exp_avg", "exp_avg_sq")]
            for key, array in zip(("exp_avg", "exp_avg_sq"), moments[i]):
                if array.shape != self.params[i].shape:
                    raise ValueError(f"{name}: {key} of parameter {i} has shape {array.shape}, "
                                     f"the parameter has {self.params[i].shape}")
            step = float(entry["step"])  # a number, or PyTorch's one-element tensor
            if not (step.is_integer() and 0 <= step < 2**31):  # the device count is int32
                raise ValueError(f"{name}: step of parameter {i} must be an integer in "
                                 f"[0, 2**31), got {entry['step']!r}")
            steps.append(int(step))
        self._set_hyperparameters(group["betas"], group["eps"], group["weight_decay"])
        self.lr = group["lr"]
        flat = self._flat
        for i, views in enumerate(zip(flat.exp_avg_views, flat.exp_avg_sq_views)):
            zeros = np.zeros(self.params[i].shape, np.float32)
            for view, array in zip(views, moments.get(i, (zeros, zeros))):
                _write(view, array)
        _write(self._step_count, np.array([max(steps)], np.int32))


class AdamW(Adam):
    """AdamW: Adam with decoupled weight decay (torch/optim/adamw.py). Instead of adding
    weight_decay * p to the gradient, each step first shrinks p = p * (1 - lr * weight_decay),
    then applies Adam's rule without weight decay. PyTorch's defaults (weight_decay=0.01);
    step(max_norm=...), the flat buffers and the per-optimizer step count as Adam's."""

    decoupled_weight_decay = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, lr, betas, eps, weight_decay)


# --- learning-rate schedule --------------------------------------------------------------------

class WarmupCosine:
    """Linear warm-up from 0 to the optimizer's learning rate, then cosine decay to min_lr.

    With base_lr the optimizer's lr before any schedule set it (its `initial_lr`, recorded
    by the first schedule built on it, as PyTorch's schedulers do), W = warmup_steps,
    T = total_steps and s the number of step() calls so far (0 at construction):
        lr(s) = base_lr * s / W                                              for s < W
        lr(s) = min_lr + (base_lr - min_lr) * (1 + cos(pi * (s - W) / (T - W))) / 2
                                                                             for W <= s < T
        lr(s) = min_lr                                                       for s >= T
    The optimizer's .lr is set to lr(0) at construction (0 when W > 0) and to lr(s) by each
    step(). Call step() after optimizer.step(), as with PyTorch's schedulers.
    """

    step_every = "batch"  # Trainer.fit calls step() after every optimizer step

    def __init__(self, optimizer, warmup_steps, total_steps, min_lr=0.0):
        warmup_steps = _check_int("WarmupCosine", "warmup_steps", warmup_steps, 0)
        total_steps = _check_int("WarmupCosine", "total_steps", total_steps, 1)
        if warmup_steps > total_steps:
            raise ValueError(f"WarmupCosine: warmup_steps ({warmup_steps}) must not exceed "
                             f"total_steps ({total_steps})")
        min_lr = _check_number("WarmupCosine", "min_lr", min_lr, minimum=0)
        self.optimizer = optimizer
        # The lr before any schedule set it (PyTorch's initial_lr, kept on the optimizer): a
        # second schedule of one optimizer starts from it, not from the first one's lr(0) = 0.
        if getattr(optimizer, "initial_lr", None) is None:
            optimizer.initial_lr = float(optimizer.lr)
        self.base_lr, self.min_lr = float(optimizer.initial_lr), float(min_lr)
        self.warmup_steps, self.total_steps = int(warmup_steps), int(total_steps)
        self.last_step = 0
        optimizer.lr = self.lr_at(0)

    def lr_at(self, s):
        """lr(s), the formula of the class docstring."""
        W, T = self.warmup_steps, self.total_steps
        if s >= T:
            return self.min_lr
        if s < W:
            return self.base_lr * s / W
        cosine = (1 + math.cos(math.pi * (s - W) / (T - W))) / 2
        return self.min_lr + (self.base_lr - self.min_lr) * cosine

    def step(self):
        """Count one optimizer step and set the optimizer's lr for the next."""
        self.last_step += 1
        self.optimizer.lr = self.lr_at(self.last_step)

    def state_dict(self):
        """The schedule's settings and position, plain Python numbers."""
        return {"base_lr": self.base_lr, "min_lr": self.min_lr, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps, "last_step": self.last_step}

    def load_state_dict(self, state):
        """Restore state_dict()'s output and set the optimizer's lr to match. All of it is
        checked, as the constructor checks, before anything is set."""
        op = "WarmupCosine.load_state_dict"
        _state_part(op, state, ("base_lr", "min_lr", "warmup_steps", "total_steps",
                                "last_step"))
        base_lr, min_lr = (float(_check_number(op, key, state[key], minimum=0, finite=True))
                           for key in ("base_lr", "min_lr"))
        warmup_steps = _check_int(op, "warmup_steps", state["warmup_steps"], 0)
        total_steps = _check_int(op, "total_steps", state["total_steps"], 1)
        last_step = _check_int(op, "last_step", state["last_step"], 0)
        if warmup_steps > total_steps:
            raise ValueError(f"{op}: warmup_steps ({warmup_steps}) must not exceed total_steps "
                             f"({total_steps})")
        self.base_lr, self.min_lr = base_lr, min_lr
        self.warmup_steps, self.total_steps, self.last_step = warmup_steps, total_steps, last_step
        self.optimizer.lr = self.lr_at(self.last_step)


class StepLR:
    """PyTorch's StepLR (torch/optim/lr_scheduler.py): every step_size-th call of step()
    multiplies the optimizer's lr by gamma, so lr = initial lr * gamma ** (epoch // step_size)
    while nothing else changes it. Like PyTorch's step() it scales the lr the optimizer has
    (get_lr's chained form), not a closed form: the same floats as PyTorch, and a change made
    from outside is kept. Call step() once per epoch, after that epoch's optimizer steps."""

    step_every = "epoch"

    def __init__(self, optimizer, step_size, gamma=0.1):  # PyTorch default gamma
        self.step_size = _check_int("StepLR", "step_size", step_size, 1)
        self.gamma = _check_number("StepLR", "gamma", gamma, minimum=0, finite=True)
        self.optimizer = optimizer
        self.last_epoch = 0  # PyTorch's constructor takes its first step: -1 becomes 0

    def step(self):
        """Count one epoch; at each multiple of step_size, lr *= gamma."""
        self.last_epoch += 1
        if self.last_epoch % self.step_size == 0:
            self.optimizer.lr = self.optimizer.lr * self.gamma

    def state_dict(self):
        """step_size, gamma, last_epoch and the lr it set (load_state_dict restores them)."""
        return {"step_size": self.step_size, "gamma": self.gamma, "last_epoch": self.last_epoch,
                "lr": self.optimizer.lr}

    def load_state_dict(self, state):
        """Restore state_dict()'s output, the optimizer's lr with it; all of it is checked
        before anything is set."""
        op = "StepLR.load_state_dict"
        _state_part(op, state, ("step_size", "gamma", "last_epoch", "lr"))
        step_size = _check_int(op, "step_size", state["step_size"], 1)
        last_epoch = _check_int(op, "last_epoch", state["last_epoch"], 0)
        gamma = _check_number(op, "gamma", state["gamma"], minimum=0, finite=True)
        _check_hyperparameter("learning rate", state["lr"], name="lr")
        self.optimizer.lr = state["lr"]
        self.step_size, self.gamma, self.last_epoch = step_size, float(gamma), last_epoch


class ReduceLROnPlateau:
    """PyTorch's ReduceLROnPlateau, with its defaults: step(metric) once per epoch; after more
    than `patience` epochs in a row without improvement, lr = max(lr * factor, min_lr) (a
    change smaller than eps is skipped), then `cooldown` epochs in which bad epochs are not
    counted. Improvement, with best the best metric so far:
        mode "min", threshold_mode "rel": metric < best * (1 - threshold)
        mode "min", threshold_mode "abs": metric < best - threshold
        mode "max": metric > best * (1 + threshold), or metric > best + threshold.
    A NaN metric is never an improvement."""

    step_every = "epoch"

    def __init__(self, optimizer, mode="min", factor=0.1, patience=10, threshold=1e-4,
                 threshold_mode="rel", cooldown=0, min_lr=0, eps=1e-8):
        if mode not in ("min", "max"):
            raise ValueError(f"ReduceLROnPlateau: mode must be 'min' or 'max', got {mode!r}")
        if threshold_mode not in ("rel", "abs"):
            raise ValueError(f"ReduceLROnPlateau: threshold_mode must be 'rel' or 'abs', got "
                             f"{threshold_mode!r}")
        if not _is_scalar(factor) or not 0 <= factor < 1:  # PyTorch: "Factor should be < 1.0."
            raise ValueError(f"ReduceLROnPlateau: factor must be in [0, 1), got {factor!r}")
        for name, value in (("threshold", threshold), ("min_lr", min_lr), ("eps", eps)):
            _check_number("ReduceLROnPlateau", name, value, minimum=0)
        self.optimizer, self.mode, self.threshold_mode = optimizer, mode, threshold_mode
        self.factor, self.threshold = float(factor), float(threshold)
        self.min_lr, self.eps = float(min_lr), float(eps)
        self.patience = _check_int("ReduceLROnPlateau", "patience", patience, 0)
        self.cooldown = _check_int("ReduceLROnPlateau", "cooldown", cooldown, 0)
        self.best = math.inf if mode == "min" else -math.inf
        self.num_bad_epochs, self.cooldown_counter, self.last_epoch = 0, 0, 0

    def is_better(self, metric, best):
        """Whether `metric` improves on `best` by more than the threshold."""
        if self.mode == "min":
            return metric < (best * (1.0 - self.threshold) if self.threshold_mode == "rel"
                             else best - self.threshold)
        return metric > (best * (self.threshold + 1.0) if self.threshold_mode == "rel"
                         else best + self.threshold)

    def step(self, metric):
        """Count one epoch whose monitored value is `metric`; reduce the lr on a plateau."""
        current = float(metric)
        self.last_epoch += 1
        if self.is_better(current, self.best):
            self.best, self.num_bad_epochs = current, 0
        else:
            self.num_bad_epochs += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0  # bad epochs in cooldown do not count
        if self.num_bad_epochs > self.patience:
            old_lr = self.optimizer.lr
            new_lr = max(old_lr * self.factor, self.min_lr)
            if old_lr - new_lr > self.eps:
                self.optimizer.lr = new_lr
            self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0

    def state_dict(self):
        """Every setting and the plateau's count (load_state_dict restores them)."""
        return {key: getattr(self, key) for key in (
            "mode", "factor", "patience", "threshold", "threshold_mode", "cooldown", "min_lr",
            "eps", "best", "num_bad_epochs", "cooldown_counter", "last_epoch")}

    def load_state_dict(self, state):
        """Restore state_dict()'s output, checked as the constructor checks."""
        _state_part("ReduceLROnPlateau.load_state_dict", state, (
            "mode", "factor", "patience", "threshold", "threshold_mode", "cooldown", "min_lr",
            "eps", "best", "num_bad_epochs", "cooldown_counter", "last_epoch"))
        checked = ReduceLROnPlateau(self.optimizer, *(state[key] for key in (
            "mode", "factor", "patience", "threshold", "threshold_mode", "cooldown", "min_lr",
            "eps")))
        for key in ("num_bad_epochs", "cooldown_counter", "last_epoch"):
            setattr(checked, key, _check_int("ReduceLROnPlateau.load_state_dict", key,
                                             state[key], 0))
        checked.best = float(state["best"])
        self.__dict__.update(checked.__dict__)


# ============================================================================ mixed precision
# Mixed precision here means float16 *storage* for activations. Inside `autocast`, matmul,
# linear and conv2d write their outputs as float16 and the ops after them keep that storage
# (operations: "float16 storage"), so the activations a forward pass keeps for backward take
# half the memory and half the memory traffic, and so do their gradients in backward (the
# gradient of a float16 activation is float16 storage, as in PyTorch). Every kernel still
# computes in float32 (half arithmetic, cl_khr_fp16, is missing on many devices, NVIDIA's
# OpenCL among them), and weights, their gradients and optimizer state stay float32.
#
# AMPGradScaler is PyTorch's GradScaler (torch/amp/grad_scaler.py): the loss is multiplied by
# a scale before backward; unscale_ divides the gradients by it and checks them for inf/NaN;
# step skips the update if it found any; update lowers the scale after such a step and raises
# it after growth_interval clean ones. The activations' float16 gradients are what it is
# for, as in PyTorch: scaled up, small ones do not flush to zero, and one that overflows
# float16 becomes an inf that reaches the parameters' float32 gradients, so the step is
# skipped and the scale backs off. It all runs on the device. The scale, the growth tracker
# and the inf flags live in device memory; the inf check is one pass over the gradients (for
# Adam's fused clip the same pass sums their squares for the norm); where PyTorch reads
# found_inf on the host to decide whether to call optimizer.step (`.item()` in
# _maybe_opt_step), netcl always calls it and its kernel skips; the scale update waits for
# the next scale(), whose single-work-item kernel runs it and scales the loss. So an AMP step
# never waits for the device, and the scaler adds one launch to a clipping Adam step (the
# scaling; its unscale pass is the norm's) and two to others; only get_scale() and
# state_dict() read the device.

class autocast(contextlib.ContextDecorator):
    """Inside `with autocast():` (or a function decorated with it), matmul, linear and conv2d
    on an OpenCL device read and write activations as float16 storage, accumulating in
    float32; elementwise ops keep float16, except exp, log, pow, rsqrt and a number divided
    by a tensor, which PyTorch's autocast runs in float32 (they widen a float16 input and
    return float32); reductions, softmax and losses return float32. The
    gradients of float16 activations are float16 storage too (scale the loss with
    AMPGradScaler); parameters, their gradients and optimizer state stay float32.
    `autocast(enabled=False)` inside it turns it off again. On the NumPy backend it does
    nothing."""

    def __init__(self, enabled=True):
        # A bool, as PyTorch's (which raises TypeError at entry): autocast("cuda"), ported
        # from torch.autocast, or enabled="False", would otherwise turn it on.
        if not isinstance(enabled, (bool, np.bool_)):
            raise TypeError(f"autocast: enabled must be True or False, got {enabled!r:.60} "
                            f"({type(enabled).__name__})")
        self.enabled = bool(enabled)

    def __enter__(self):
        _state.autocast_enabled.append(self.enabled)
        return self

    def __exit__(self, *exc):
        _state.autocast_enabled.pop()


def _zero_flag(flag):
    """Set an int32 device flag (1,) to 0 without waiting (a fill, not a kernel)."""
    if flag.device.backend == "cpu":
        flag.data[0] = 0
    else:
        cl.enqueue_fill_buffer(flag.device.queue, flag.data, np.int32(0), 0, 4)
    return flag


class _ScaledLoss(Node):
    """AMPGradScaler.scale's loss * scale: recorded on no Tape on purpose, since the scaler
    usually runs after the `with Tape()` block has closed. Tape.backward runs its step first,
    then the graph of the loss it was made from, which that Tape must have recorded. From the
    implicit seed 1 it skips that step: the loss's gradient is then the scale itself (1 *
    scale is exact), the scale tensor seen in the loss's shape, where a fill of ones and a
    kernel that scales them would take two launches.

    Its value may be made on demand (AMPGradScaler.scale): a training loop only passes the
    scaled loss to backward, which needs its shape alone, so the product is a launch saved.
    `_loss` and `_scale` are then the loss's value and the scale tensor to multiply, which
    the scaler keeps as they are until that value has been made (AMPGradScaler._settle)."""

    __slots__ = ("_scaler", "_loss", "_scale")

    @property
    def value(self):
        """loss * scale (a Tensor), made on the first read if it waits."""
        value = Node.value.__get__(self)
        if value is None:  # made now, from the loss and scale as they were at scale()
            value = self._scaler._times_scale(self._loss, self._scale)
            self.value, self._loss, self._scale = value, None, None
        return value

    @value.setter
    def value(self, value):
        """Node's own slot holds it (None while it waits)."""
        Node.value.__set__(self, value)

    def _made(self):
        """Whether the value exists (it has been read, or was made at once)."""
        return Node.value.__get__(self) is not None

    # What describes the value, without making it: a waiting value is a one-element float32
    # product on the loss's device.
    @property
    def shape(self):
        """The value's shape."""
        return self.value.shape if self._loss is None else self._loss.shape

    @property
    def dtype(self):
        """The value's dtype."""
        return self.value.dtype if self._loss is None else np.dtype(np.float32)

    @property
    def device(self):
        """The value's Device."""
        return self.value.device if self._loss is None else self._loss.device

    def _taped_root(self):
        if not self.requires_grad:
            return self._op  # freed by a backward already, or None: never recorded
        parent = self._op.parents[0]
        return parent if type(parent) is _Op else None  # None: the loss was a leaf

    def _seed(self):
        # A view of the scale tensor, not a copy: backward only reads the gradients it is
        # given (a leaf's first gradient is copied, _accumulate_grad), and nothing writes
        # the scale before the work queued by this backward has read it.
        return self._op.parents[0], self._scaler._current_scale()._view(self.shape)


# Where each optimizer stands between two update() calls (PyTorch's OptState).
_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"


def _skips_inf_on_device(optimizer):
    """Whether optimizer.step makes itself a no-op on the device after an inf/NaN gradient
    (Optimizer._found_inf): `_skips_on_device` says so in the class that defines the step it
    runs, or in a class before that one in its method order (a subclass of it, or one that
    puts a mixin's step first). A class that overrides step() without saying so again, or a
    step set on the instance, may not read the flag, so AMPGradScaler decides for it on the
    host, as PyTorch does for every optimizer; a wrapper (DistributedOptimizer, whose
    _skips_on_device is a property) answers for the optimizer it wraps."""
    if "step" in vars(optimizer):
        return False
    for cls in type(optimizer).__mro__:
        if "_skips_on_device" in vars(cls):
            said = vars(cls)["_skips_on_device"]
            if isinstance(said, property):
                return bool(optimizer._skips_on_device)
            return bool(said)
        if "step" in vars(cls):  # the step it runs, and nothing said at or before its class
            return False
    return False


class AMPGradScaler:
    """PyTorch's GradScaler, with its defaults and call order, running on the device:

        scaler = AMPGradScaler()
        with Tape() as tape, autocast():
            loss = cross_entropy(model(x), y)
        tape.backward(scaler.scale(loss))
        scaler.step(optimizer, max_norm=1.0)  # or unscale_, clip_grad_norm, step(optimizer)
        scaler.update()

    scale(loss) is loss * scale, so backward gives every gradient times the scale.
    unscale_(optimizer) divides the optimizer's gradients by the scale, in place, and records
    on the device whether any is inf or NaN; call it before working on the true gradients
    (clip_grad_norm), once per optimizer per update(). step(optimizer, **kw) unscales first
    unless unscale_ was called, then calls optimizer.step(**kw) (so max_norm clips the unscaled
    gradients); after an inf/NaN that step is a no-op on the device: parameters and moments
    stay bit-identical and Adam's step count does not advance. update() multiplies the scale
    by backoff_factor after such a step, and by growth_factor (if the result is finite) after
    growth_interval clean steps in a row; growth_factor and backoff_factor act as float32
    numbers (exactly PyTorch's arithmetic for any factor that is one, the defaults included).
    With enabled=False every method passes through: scale returns the loss, step calls
    optimizer.step, get_scale() is 1.0, state_dict() is {}.
    """

    def __init__(self, init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True):  # PyTorch's defaults
        self._enabled = bool(enabled)
        if self._enabled:
            self._check_settings("init_scale", init_scale, growth_factor, backoff_factor,
                                 growth_interval)
        self._init_scale = float(init_scale)
        self._growth_factor, self._backoff_factor = float(growth_factor), float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._init_growth_tracker = 0
        # Device state, created by the first scale() on the loss's device: scale (1,) float32,
        # growth tracker (1,) int32, and found_inf_any (1,) int32, the OR of every optimizer's
        # inf check since the last update (which reads it and zeroes it).
        self._scale = self._growth_tracker = self._found_inf_any = None
        # id(optimizer) -> {"stage", "found_inf": int32 (1,) flag, None after a fused clip's pass}
        self._per_optimizer = {}
        self._update_pending = False  # update() was called and has not run yet (see update)
        # On OpenCL, spare (found_inf_any, scale, growth tracker) buffers, which a fused
        # Adam step fills with the state update() will give (_speculation); _speculated: they
        # hold it, and nothing has changed found_inf_any since.
        self._spare, self._speculated = None, False
        self._lazy = None  # a weak reference to the latest loss whose value waits (_settle)

    @staticmethod
    def _check_settings(scale_name, scale, growth_factor, backoff_factor, growth_interval):
        """PyTorch's checks and messages (asserts there), and a positive finite scale."""
        if not (_is_scalar(growth_factor) and growth_factor > 1.0):
            raise ValueError(f"The growth factor must be > 1.0, got {growth_factor!r}")
        if not (_is_scalar(backoff_factor) and 0.0 < backoff_factor < 1.0):
            raise ValueError(f"The backoff factor must be < 1.0 (and > 0), got "
                             f"{backoff_factor!r}")
        if not (_is_scalar(scale) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"{scale_name} must be positive and finite, got {scale!r}")
        _check_int("AMPGradScaler", "growth_interval", growth_interval, 1)

    def scale(self, loss):
        """loss * scale (a float32 Node, a _ScaledLoss), to pass to tape.backward; for a list
        or tuple of losses (nested or not), the same structure of them, as PyTorch's."""
        if not self._enabled:
            return loss
        if isinstance(loss, (list, tuple)):
            return type(loss)(self.scale(each) for each in loss)
        (loss,) = _nodes("AMPGradScaler.scale", loss)
        device = loss.device
        if self._scale is None:
            queue = device.queue
            self._scale = Tensor.from_host(np.array([self._init_scale], np.float32), queue)
            self._growth_tracker = Tensor.from_host(
                np.array([self._init_growth_tracker], np.int32), queue)
            self._found_inf_any = _zero_flag(Tensor.empty((1,), np.int32, queue))
            if device.backend == "opencl":
                self._spare = (Tensor.empty((1,), np.int32, queue),
                               Tensor.empty((1,), np.float32, queue),
                               Tensor.empty((1,), np.int32, queue))
        elif device is not self._scale.device:
            raise ValueError(f"AMPGradScaler.scale: the loss is on {device.name}, the scale on "
                             f"{self._scale.device.name}")
        value = loss.value
        self._settle()  # the previous loss's value, if it waits and is still held
        # The value may wait for a one-element loss an op computed, unless it is the memory of
        # a leaf it was made from (a parameter's view, which a step changes: steps settle
        # first anyway, see step).
        memory = value._base or value
        lazy = (value.size == 1 and device.backend == "opencl" and loss._op is not None and
                not any(isinstance(parent, Node) and (memory is parent.value or
                                                      memory is parent.value._base)
                        for parent in loss._op.parents))
        if self._update_pending and lazy:
            # Last step's update() and this product in one kernel.
            self._update_pending = False
            out = _like(value, dtype=np.float32)
            device.launch("amp_update_then_scale", (1,), (1,), *self._update_args(),
                          value.data, out.data, half=value.dtype == np.float16)
            lazy = False
        else:
            # The usual step (update() ran in the fused step: see _speculation): the value is
            # made when it is first read, if ever; backward needs the scale alone.
            out = None if lazy else self._times_scale(value)
        scaled = _ScaledLoss.__new__(_ScaledLoss)
        scaled.value, scaled._loss, scaled._scale = (None, value, self._scale) if lazy else (
            out, None, None)
        scaled.grad, scaled.requires_grad, scaled._op = None, loss.requires_grad, None
        scaled._scaler = self
        if lazy:
            self._lazy = weakref.ref(scaled)
        if loss.requires_grad:
            scaled._op = _Op((loss,), lambda g: (self._times_scale(g),), scaled)
        return scaled

    def _times_scale(self, x, scale=None):
        """x * scale in float32 (the current scale, unless another is given), the scale read
        on the device: the host never knows it."""
        scale = self._current_scale() if scale is None else scale
        if x.device.backend == "cpu":
            out = _cast(x, np.float32) if x.dtype == np.float16 else _copy(x)
            with np.errstate(all="ignore"):  # an overflow to inf is what update() detects
                out.data *= scale.data[0]
            return out
        out = _like(x, dtype=np.float32)
        if out.size:
            x.device.launch("times_scale", *_grid(out.size), out.size, scale.data, x.data,
                            out.data, half=x.dtype == np.float16)
        return out

    def _settle(self):
        """Make the value of the latest scaled loss whose value waits, if it is still held,
        before the scale tensor it was scaled with changes."""
        scaled = self._lazy and self._lazy()
        self._lazy = None
        if scaled is not None and not scaled._made():
            scaled.value  # noqa: B018 (made now)

    def _speculation(self):
        """adam_prepare's arguments for working out update()'s result into the spare buffers,
        after this step's unscaling pass: found_inf_any, scale and tracker are then final
        unless another optimizer is unscaled before update(). (step has settled any loss
        waiting to be scaled with a spare.)"""
        spare_found, spare_scale, spare_tracker = self._spare
        return (self._growth_factor, self._backoff_factor, self._growth_interval,
                self._found_inf_any.data, self._scale.data, self._growth_tracker.data,
                spare_found.data, spare_scale.data, spare_tracker.data)

    def unscale_(self, optimizer):
        """Divide the optimizer's gradients by the scale in place, and note on the device
        whether any of them is inf or NaN (one pass over the flat gradient buffer of Adam and
        AdamW; one launch per gradient otherwise)."""
        if self._enabled:
            self._unscale(optimizer)

    def _unscale(self, optimizer, norm_partials=False):
        """unscale_'s work. With norm_partials, the same pass also sums the squares of the
        unscaled gradients and returns them as _norm_partials(grads, 2.0) would (the same
        numbers in its layout), so that a clip after it need not read every gradient again.
        That clip needs no inf flag of this optimizer's own either: a non-finite scaled
        gradient is non-finite unscaled, so is the norm of these partials, and a non-finite
        norm skips the step just the same (found_inf_any, for update(), is set all the same)."""
        self._check_scale("unscale_")
        self._speculated = False  # this pass may change found_inf_any
        state = self._per_optimizer.setdefault(id(optimizer), {"stage": _READY, "found_inf": None})
        if state["stage"] == _UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the "
                               "last update().")
        if state["stage"] == _STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        _check_float_grads("AMPGradScaler.unscale_", optimizer.params)
        grads = optimizer._grads()
        if any(g.dtype == np.float16 for g in grads):
            raise ValueError("Attempting to unscale FP16 gradients.")
        device = self._scale.device
        _devices_of("AMPGradScaler.unscale_", self._scale, *grads)
        scale, found_inf_any = self._current_scale(), self._found_inf_any
        found_inf = None if norm_partials else _zero_flag(_like(scale, (1,), np.int32))
        partials = None
        if device.backend == "cpu":
            # 1/scale in float64, then rounded, as PyTorch (scale.double().reciprocal()).
            inv_scale = np.float32(1.0 / np.float64(scale.data[0]))
            found = False
            for g in grads:
                found = found or not np.isfinite(g.data).all()
                with np.errstate(all="ignore"):
                    g.data *= inv_scale
            if found:
                found_inf_any.data[0] = 1
                if found_inf is not None:
                    found_inf.data[0] = 1
            if norm_partials and grads:
                partials = _norm_partials(grads, 2.0)
        else:
            groups = [_norm_groups(g.size, device) for g in grads]
            if norm_partials and grads:
                partials = _like(scale, (builtins.sum(groups),))
            first = 0
            for g, count in zip(grads, groups):
                device.launch("amp_unscale", (count * 256,), (256,), g.size, first, scale.data,
                              g.data, None if found_inf is None else found_inf.data,
                              found_inf_any.data, None if partials is None else partials.data)
                first += count
        state["stage"], state["found_inf"] = _UNSCALED, found_inf
        return partials

    def step(self, optimizer, *args, **kwargs):
        """optimizer.step(*args, **kwargs) after unscaling (unless unscale_ was called), as a
        no-op on the device if a gradient was inf/NaN. Returns what optimizer.step returns."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale("step")
        # A waiting loss value is made first: the step changes what the loss may share memory
        # with, and a fused one writes the spares, of which one may be the scale it waits for.
        self._settle()
        state = self._per_optimizer.get(id(optimizer), {"stage": _READY})
        if state["stage"] == _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if not any(p.grad is not None for p in optimizer.params):  # PyTorch's assert
            raise RuntimeError("No inf checks were recorded for this optimizer.")
        partials = None
        skips = _skips_inf_on_device(optimizer)
        if state["stage"] == _READY:
            # Adam's clip reads every gradient for their norm, as unscaling does: one pass
            # unscales and sums the squares, and the clip takes the sums (_grad_norm_partials).
            clips = skips and isinstance(optimizer, Adam) and (
                args[0] if args else kwargs.get("max_norm")) is not None
            partials = self._unscale(optimizer, norm_partials=clips)
            state = self._per_optimizer[id(optimizer)]
        result = None
        if skips:
            optimizer._found_inf = state["found_inf"]
            if partials is not None:
                optimizer._grad_norm_partials = partials
                if self._spare is not None:  # update()'s work, in Adam's adam_prepare
                    optimizer._scaler_update = self._speculation()
            try:
                result = optimizer.step(*args, **kwargs)
            finally:
                optimizer._found_inf = None
                if partials is not None:
                    optimizer._grad_norm_partials = None
                    self._speculated = optimizer._scaler_updated
                    optimizer._scaler_update, optimizer._scaler_updated = None, False
        elif not state["found_inf"].to_host()[0]:
            # An optimizer that cannot skip by itself: decide on the host, as PyTorch does.
            result = optimizer.step(*args, **kwargs)
        state["stage"] = _STEPPED
        return result

    def update(self, new_scale=None):
        """Back off after a step with an inf/NaN gradient, grow after growth_interval clean
        steps (aten's _amp_update_scale_); or, with new_scale, set the scale.

        After a fused Adam step (step(adam, max_norm=...)) the device has already worked out
        the new state into spare buffers (_speculation), and update() swaps them in: no
        launch. Otherwise it is deferred: the next scale() of a one-element loss runs it in
        the kernel that scales the loss, a launch less per step. Everything that reads the
        scale before that (get_scale, state_dict, load_state_dict, unscale_, update(new_scale),
        another scale(), a backward through a scaled loss) runs it first, so nothing sees the
        delay."""
        if not self._enabled:
            return
        self._check_scale("update")
        if new_scale is not None:
            self._settle()
            _write(self._current_scale(), np.array([float(new_scale)], np.float32))
            _zero_flag(self._found_inf_any)
        elif not any(state["stage"] != _READY for state in self._per_optimizer.values()):
            raise RuntimeError("No inf checks were recorded prior to update.")
        elif self._speculated:
            state = self._found_inf_any, self._scale, self._growth_tracker
            (self._found_inf_any, self._scale, self._growth_tracker), self._spare = \
                self._spare, state
        else:
            self._update_pending = True
        self._speculated = False
        self._per_optimizer = {}

    def _current_scale(self):
        """The scale tensor, after the update() still pending, if one is (see update)."""
        if not self._update_pending:
            return self._scale
        self._update_pending = False
        self._settle()  # the update changes the scale in place
        if self._scale.device.backend == "cpu":  # kernels.cl: update_scale
            scale, tracker, found_inf = (self._scale.data, self._growth_tracker.data,
                                         self._found_inf_any.data)
            if found_inf[0]:
                scale[0] *= np.float32(self._backoff_factor)
                tracker[0] = 0
            elif tracker[0] + 1 == self._growth_interval:
                with np.errstate(over="ignore"):
                    grown = scale[0] * np.float32(self._growth_factor)
                if np.isfinite(grown):
                    scale[0] = grown
                tracker[0] = 0
            else:
                tracker[0] += 1
            found_inf[0] = 0
        else:
            self._scale.device.launch("amp_update_scale", (1,), (1,), *self._update_args())
        return self._scale

    def _update_args(self):
        """The update's arguments to amp_update_scale and amp_update_then_scale."""
        return (self._growth_factor, self._backoff_factor, self._growth_interval,
                self._found_inf_any.data, self._scale.data, self._growth_tracker.data)

    def _check_scale(self, funcname):
        if self._scale is None:  # PyTorch's message (an assert there)
            raise RuntimeError(f"Attempted {funcname} but _scale is None.  This may indicate "
                               f"your script did not use scaler.scale(loss or outputs) earlier "
                               f"in the iteration.")

    def get_scale(self):
        """The current scale as a float (a sync: it reads the device); 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        if self._scale is None:
            return self._init_scale
        return float(self._current_scale().to_host()[0])

    def is_enabled(self):
        """Whether the scaler scales (the `enabled` it was made with)."""
        return self._enabled

    def get_growth_factor(self):
        """The factor update() grows the scale by after growth_interval clean steps."""
        return self._growth_factor

    def get_backoff_factor(self):
        """The factor update() multiplies the scale by after an inf/NaN step."""
        return self._backoff_factor

    def get_growth_interval(self):
        """The clean steps in a row after which update() grows the scale."""
        return self._growth_interval

    def set_growth_factor(self, new_factor):
        """The factor the next update() grows the scale by (checked as the constructor's)."""
        self._set_settings(growth_factor=new_factor)

    def set_backoff_factor(self, new_factor):
        """The factor the next update() backs off by (checked as the constructor's)."""
        self._set_settings(backoff_factor=new_factor)

    def set_growth_interval(self, new_interval):
        """The clean steps in a row after which update() grows the scale. As in PyTorch, a
        count of clean steps already past the new interval grows nothing until an inf/NaN
        step starts the count again."""
        self._set_settings(growth_interval=new_interval)

    def _set_settings(self, growth_factor=None, backoff_factor=None, growth_interval=None):
        """The setters' work: an update() already called runs with the settings it was
        called with; the next one, and a fused step's speculation of it, takes the new ones."""
        growth_factor = self._growth_factor if growth_factor is None else growth_factor
        backoff_factor = self._backoff_factor if backoff_factor is None else backoff_factor
        growth_interval = self._growth_interval if growth_interval is None else growth_interval
        if self._enabled:
            self._check_settings("scale", 1.0, growth_factor, backoff_factor, growth_interval)
            self._current_scale()
            self._speculated = False  # spares worked out with the old settings are dropped
        self._growth_factor, self._backoff_factor = float(growth_factor), float(backoff_factor)
        self._growth_interval = int(growth_interval)

    def state_dict(self):
        """PyTorch's keys: scale, growth_factor, backoff_factor, growth_interval,
        _growth_tracker (reads the device); {} when disabled."""
        if not self._enabled:
            return {}
        scale = self.get_scale()  # first: it runs a pending update, which moves the tracker
        tracker = (self._init_growth_tracker if self._growth_tracker is None
                   else int(self._growth_tracker.to_host()[0]))
        return {"scale": scale, "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": tracker}

    def load_state_dict(self, state):
        """Restore state_dict()'s output (a no-op when disabled). All of it is checked, with
        the constructor's checks, before anything is set: a rejected state changes nothing."""
        if not self._enabled:
            return
        if len(state) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        keys = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
        # 0-d arrays (what netcl.load gives back) count as the numbers they hold.
        values = [state[key].item() if isinstance(state[key], np.ndarray) and state[key].ndim == 0
                  else state[key] for key in keys]
        scale, growth_factor, backoff_factor, growth_interval, tracker = values
        self._check_settings("scale", scale, growth_factor, backoff_factor, growth_interval)
        _check_int("AMPGradScaler.load_state_dict", "_growth_tracker", tracker, 0)
        self._current_scale()  # a pending update runs with the factors it was called with
        self._settle()
        self._speculated = False
        self._init_scale = float(scale)
        self._growth_factor, self._backoff_factor = float(growth_factor), float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._init_growth_tracker = int(tracker)
        if self._scale is not None:
            _write(self._scale, np.array([self._init_scale], np.float32))
            _write(self._growth_tracker, np.array([self._init_growth_tracker], np.int32))


# ============================================================================ distributed
# Data-parallel training over MPI, as PyTorch's DistributedDataParallel: `mpiexec -n N python
# train.py` starts N processes (ranks), one per device, each holding the whole model. Every
# rank trains on its own share of each epoch (the DataLoader shards itself), and before each
# update the gradients are averaged over the ranks, so every rank applies the same update to
# the same parameters and they stay identical. A training script adds:
#
#     netcl.distributed.init()                                # first: it picks this rank's device
#     opt = netcl.distributed.DistributedOptimizer(AdamW(model.parameters()))
#     loader = DataLoader(train_set, batch_size=B)            # B per rank: N * B per step
#
# (Trainer wraps its optimizer itself.) The average is one MPI all-reduce per step: of Adam's
# and AdamW's flat gradient buffer, or of all of SGD's gradients packed into one host buffer.
# It runs before clipping and the update, so the fused clip sees the global norm, and before
# AMPGradScaler's inf check, so an inf on one rank (a sum spreads it) skips the step on every
# rank. DDP overlaps buckets of the all-reduce with the rest of backward; here it is one
# collective after backward, because MPI wheels are not GPU-aware: OpenCL gradients go
# through host memory, and the copy down has to wait for backward to finish anyway.
# mpi4py is imported by init() alone: a program that never calls it never needs MPI.

_mpi = None  # after init(): (mpi4py's MPI module, MPI.COMM_WORLD)
# What the collectives cost, for stats(): counts by kind, and the seconds inside MPI.
_comm_stats = {"gradient_allreduces": 0, "gradient_bytes": 0, "gradient_seconds": 0.0,
               "metric_allreduces": 0, "broadcasts": 0}


def init():
    """Join the MPI job this process was started in (`mpiexec -n N python script.py`): learn
    this process's rank and the world size, pick its device, and make an uncaught exception
    on any rank end the whole job. Without mpiexec the job is one rank. A second call does
    nothing.

    Call it before manager.default(): of several GPUs on a host, local rank r takes GPU
    r % count (NETCL_DEVICE, or an explicit device, still wins). An exception that reaches
    the top of any rank prints that rank's traceback, then MPI_Abort ends every rank: the
    others never hang in a collective waiting for it.
    """
    global _mpi, _local_rank
    if _mpi is not None:
        return
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise ImportError("netcl.distributed.init needs mpi4py and an MPI library: python -m "
                          "pip install mpi4py mpich (netcl's 'mpi' extra)") from err
    comm = MPI.COMM_WORLD
    host_ranks = comm.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks sharing this host's memory
    _local_rank = host_ranks.Get_rank()
    host_ranks.Free()
    _mpi = (MPI, comm)
    previous_hook = sys.excepthook

    def abort_job(kind, value, tb):
        previous_hook(kind, value, tb)  # this rank's traceback first
        print(f"netcl.distributed: rank {comm.Get_rank()} of {comm.Get_size()} failed; "
              f"aborting the job", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        comm.Abort(1)

    sys.excepthook = abort_job


def is_initialized():
    """Whether init() has been called (PyTorch's torch.distributed.is_initialized)."""
    return _mpi is not None


def rank():
    """This process's rank in [0, world_size()); 0 before init(), so one script runs both ways."""
    return 0 if _mpi is None else _mpi[1].Get_rank()


def world_size():
    """The number of ranks; 1 before init()."""
    return 1 if _mpi is None else _mpi[1].Get_size()


def is_main():
    """Whether this is rank 0: the one that prints and writes checkpoints."""
    return rank() == 0


def stats():
    """What the collectives have cost since the process started: counts of gradient
    all-reduces (one per step), their bytes and the seconds spent inside them (in MPI: host
    staging not included, and a rank that waits for a slower one waits here), metric
    all-reduces (Trainer: one per epoch and one per evaluation) and broadcasts (parameters,
    seeds: at start)."""
    return dict(_comm_stats)


def broadcast_parameters(params, root=0):
    """Overwrite the values on every rank with rank `root`'s, in one broadcast, so that all
    ranks start identical (DDP does it when it wraps a model). `params`: a Module (its
    parameters and its buffers, running statistics included) or an iterable of Parameters,
    Tensors and host arrays. Does nothing with one rank."""
    if isinstance(params, Module):
        values = [p.value for p in params.parameters()] + [b for _, b in params.named_buffers()]
    else:
        values = [p.value if isinstance(p, Node) else p for p in params]
    for i, value in enumerate(values):
        if not isinstance(value, (Tensor, np.ndarray)):
            raise TypeError(f"broadcast_parameters: item {i} is {type(value).__name__}, not a "
                            f"Parameter, Tensor or NumPy array")
    if _check_int("broadcast_parameters", "root", root, 0) >= world_size():
        raise ValueError(f"broadcast_parameters: root must be a rank in [0, {world_size()}), "
                         f"got {root!r}")
    if world_size() == 1 or not values:
        return
    # float64 holds every float32 and every integer count exactly: one message for all dtypes.
    offsets = np.cumsum([0] + [value.size for value in values])
    packed = np.empty(offsets[-1], np.float64)
    here = rank() == root
    if here:
        for value, start, end in zip(values, offsets, offsets[1:]):
            packed[start:end] = (value.to_host() if isinstance(value, Tensor) else value).ravel()
    _mpi[1].Bcast(packed, root=root)
    _comm_stats["broadcasts"] += 1
    if not here:
        for value, start, end in zip(values, offsets, offsets[1:]):
            if isinstance(value, Tensor):
                _write(value, packed[start:end].reshape(value.shape))
            else:
                value[...] = packed[start:end].reshape(value.shape)


class DistributedOptimizer:
    """An optimizer whose step first averages the gradients over all ranks (Horovod's
    DistributedOptimizer; DDP does the same from hooks in backward):

        opt = DistributedOptimizer(AdamW(model.parameters(), lr=3e-3))
        with Tape() as tape:
            loss = cross_entropy(model(x), y)
        opt.zero_grad(); tape.backward(loss); opt.step(max_norm=1.0)

    Wrapping broadcasts rank 0's parameters, so every rank starts from them. step(max_norm)
    averages the gradients (one all-reduce; see stats()), then clips them to max_norm if
    given (inside the update for Adam and AdamW, by clip_grad_norm otherwise), then steps.
    AMPGradScaler's unscale_ and step average first as well. synchronize() averages at once,
    for work on the gradients between backward and step (Horovod's habit); the step after it
    does not average again. zero_grad, lr, params, state_dict and the rest are the wrapped
    optimizer's. Every rank must step the same parameters: each all-reduce must match.
    Before init(), or with one rank, it only passes calls through.
    """

    def __init__(self, optimizer):
        if isinstance(optimizer, DistributedOptimizer) or not isinstance(optimizer, Optimizer):
            raise TypeError(f"DistributedOptimizer: optimizer must be a netcl optimizer "
                            f"(SGD, Adam, AdamW), got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self._fused_clip = "max_norm" in inspect.signature(optimizer.step).parameters
        self._synchronized = False
        self._staging = np.empty(0, np.float32)  # host copy of the gradients, reused each step
        broadcast_parameters(optimizer.params)
        flat = getattr(optimizer, "_flat", None)
        if flat is not None and flat.params_half is not None:  # keep the float16 copy equal
            _cast(flat.params, np.float16, out=flat.params_half)

    def __getattr__(self, name):  # anything not defined here is the wrapped optimizer's
        if name == "optimizer":  # not set yet (a half-built object): no recursion
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    @property
    def lr(self):
        """The wrapped optimizer's learning rate (a schedule sets it through the wrapper)."""
        return self.optimizer.lr

    @lr.setter
    def lr(self, value):
        """Sets the wrapped optimizer's learning rate."""
        self.optimizer.lr = value

    # AMPGradScaler.step hands an optimizer that skips on the device its inf flag this way.
    @property
    def _skips_on_device(self):
        return _skips_inf_on_device(self.optimizer)

    @property
    def _found_inf(self):
        return self.optimizer._found_inf

    @_found_inf.setter
    def _found_inf(self, flag):
        self.optimizer._found_inf = flag

    def zero_grad(self):
        """The wrapped optimizer's zero_grad; the next gradients are averaged again."""
        self._synchronized = False
        self.optimizer.zero_grad()

    def _grads(self):
        """The averaged gradients (AMPGradScaler.unscale_ reads them through this)."""
        self.synchronize()
        return self.optimizer._grads()

    def synchronize(self):
        """Average the gradients over the ranks now, in place: one all-reduce of all of them.
        Does nothing if they are already averaged since the last step, or with one rank."""
        if self._synchronized or world_size() == 1:
            return
        grads = self.optimizer._grads()
        if grads:
            self._average(grads)
        self._synchronized = True

    def step(self, max_norm=None):
        """Average the gradients (unless synchronize() already did), clip them to max_norm's
        global 2-norm if given, and update the parameters."""
        if max_norm is not None:
            _check_number("DistributedOptimizer.step", "max_norm", max_norm, minimum=0)
        self.synchronize()
        self._synchronized = False
        if max_norm is None:
            return self.optimizer.step()
        if self._fused_clip:
            return self.optimizer.step(max_norm=max_norm)
        clip_grad_norm(self.optimizer.params, max_norm)
        return self.optimizer.step()

    def _average(self, grads):
        """grads (tensors of one device) <- their mean over the ranks."""
        MPI, comm = _mpi
        device = _devices_of("DistributedOptimizer.step", *grads)
        for g in grads:
            if g.dtype != np.float32:
                raise ValueError(f"DistributedOptimizer.step: gradients must be float32, got "
                                 f"{g.dtype} of shape {g.shape}")
        total = builtins.sum(g.size for g in grads)
        offsets = np.cumsum([0] + [g.size for g in grads])
        pieces = list(zip(grads, offsets, offsets[1:]))
        if device.backend == "cpu" and len(grads) == 1:
            host = grads[0].data.reshape(-1)  # the flat gradient buffer itself: no staging
        else:
            if self._staging.size != total:
                self._staging = np.empty(total, np.float32)
            host = self._staging
            if device.backend == "cpu":
                for g, start, end in pieces:
                    host[start:end] = g.data.ravel()
            else:
                # Down to the host: the one wait the step needs (for backward to finish).
                copies = [cl.enqueue_copy(device.queue, host[start:end], g.data, is_blocking=False)
                          for g, start, end in pieces if g.size]
                device._count_sync()
                if copies:
                    cl.wait_for_events(copies)
        started = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
        _comm_stats["gradient_seconds"] += time.perf_counter() - started
        _comm_stats["gradient_allreduces"] += 1
        _comm_stats["gradient_bytes"] += host.nbytes
        np.divide(host, comm.Get_size(), out=host)  # the mean, as DDP's
        if host is self._staging:
            for g, start, end in pieces:
                if device.backend == "cpu":
                    g.data[...] = host[start:end].reshape(g.shape)
                elif g.size:
                    # Queued, not waited for: the next step's copy down into the same host
                    # buffer is queued after it, and the host writes the buffer only then.
                    device.upload(g.data, host[start:end])


def _sum_over_ranks(*numbers):
    """The sums over all ranks of a few numbers, in one small all-reduce (the numbers
    themselves with one rank). Integers stay integers."""
    if world_size() == 1:
        return numbers
    MPI, comm = _mpi
    totals = np.array(numbers, np.float64)
    comm.Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
    _comm_stats["metric_allreduces"] += 1
    return tuple(type(n)(t) if isinstance(n, (int, np.integer)) else float(t)
                 for n, t in zip(numbers, totals))


def _loader_shard(shard, shards, seed, shuffle):
    """DataLoader's (rank, world_size, seed) from its arguments (rank=shard, world_size=shards):
    None takes both from init() (one process of one before it); with more than one rank, a
    shuffle needs the same seed on every rank, so a missing one becomes rank 0's, broadcast."""
    if (shard is None) != (shards is None):
        raise ValueError(f"DataLoader: give both rank and world_size or neither, got "
                         f"rank={shard!r}, world_size={shards!r}")
    if shard is None:
        shard, shards = rank(), world_size()
    shards = _check_int("DataLoader", "world_size", shards, 1)
    shard = _check_int("DataLoader", "rank", shard, 0)
    if shard >= shards:
        raise ValueError(f"DataLoader: rank must be in [0, world_size={shards}), got {shard}")
    if seed is None:
        seed = int(_rng().integers(2**63))
        if shuffle and shards > 1:
            if _mpi is None:
                raise ValueError("DataLoader: a shuffled shard (world_size > 1) needs a seed "
                                 "that every rank shares, or netcl.distributed.init() to "
                                 "agree on one")
            seed = _mpi[1].bcast(seed, root=0)
            _comm_stats["broadcasts"] += 1
    return shard, shards, seed


def _data_parallel(model, optimizer):
    """Trainer's set-up after init(): every rank starts from rank 0's model, buffers included,
    and steps through a DistributedOptimizer."""
    if isinstance(model, Module):
        broadcast_parameters(model)
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer
    return DistributedOptimizer(optimizer)


# ============================================================================ data
# A DataLoader turns a dataset (anything indexable that returns (x, y, *extra) tuples) into
# batches of NumPy arrays, one epoch at a time. Three things can run ahead of the consumer:
#   1. worker processes build the next batches (num_workers > 0),
#   2. those batches travel back through reused shared-memory blocks instead of pickles
#      (use_shared_mem=True),
#   3. the next `prefetch` batches are already being copied to the device (bind_queue).
# The order of batches never depends on any of this: it comes from the seed and the epoch alone.

# How long stopping waits for workers to finish their current batch before it terminates them.
_WORKER_JOIN_SECONDS = 2.0
# Bounds on what runs ahead. PyTorch's prefetch_factor has none, but here each batch in flight
# may hold a shared-memory block (two file descriptors), so a huge prefetch would only fail
# later with "Too many open files"; and `prefetch` tasks must fit a worker's pipe unread.
_MAX_PREFETCH = 64
_MAX_BATCHES_IN_FLIGHT = 1024  # num_workers * prefetch
# Each field inside a shared-memory block starts on a 64-byte boundary (a cache line).
_FIELD_ALIGN = 64


class ArrayDataset:
    """Equal-length arrays `(x, y, *extra)` seen as a dataset of `(x[i], y[i], ...)` tuples.

    Indexing with an integer gives one sample; indexing with an index array gives a whole
    batch with one fancy index per array, which is how the DataLoader gathers batches from it
    (no per-sample Python loop). The arrays are kept as given, not copied.
    """

    def __init__(self, x, y, *extra):
        self.arrays = tuple(np.asarray(array) for array in (x, y) + extra)
        lengths = [len(array) if array.ndim else None for array in self.arrays]
        if None in lengths or len(set(lengths)) != 1:
            shapes = [array.shape for array in self.arrays]
            raise ValueError(f"ArrayDataset: arrays must share their first dimension, "
                             f"got shapes {shapes}")

    def __len__(self):
        return len(self.arrays[0])

    def __getitem__(self, index):
        return tuple(array[index] for array in self.arrays)


class GpuBatch(tuple):
    """A batch `(xb, yb, *extra)` whose `xb` and `yb` are device Tensors; extras stay on the host.

    `batch.host` is the tuple of host arrays the batch was made from.
    """

    def __new__(cls, fields, host):
        batch = super().__new__(cls, fields)
        batch.host = host
        return batch


def _stack_samples(samples):
    """Default collate: a list of N sample tuples -> a tuple of arrays, each (N, *field shape)."""
    first = samples[0]
    if not isinstance(first, (tuple, list)):
        raise TypeError(f"DataLoader: the dataset returned {type(first).__name__}; "
                        f"expected a tuple (x, y, *extra)")
    for sample in samples:
        if len(sample) != len(first):
            raise ValueError(f"DataLoader: samples have {len(first)} and {len(sample)} fields; "
                             f"all need the same")
    return tuple(np.stack([sample[field] for sample in samples]) for field in range(len(first)))


def _build_batch(dataset, indices, collate_fn):
    """Gather the samples at `indices` into one batch; runs in the consumer or in a worker."""
    if collate_fn is None and isinstance(dataset, ArrayDataset):
        return dataset[indices]
    samples = [dataset[int(index)] for index in indices]
    return (collate_fn or _stack_samples)(samples)


def _batch_indices(order, batch_no, batch_size):
    """Batch `batch_no` of an epoch is one slice of the epoch's sample order."""
    return order[batch_no * batch_size:(batch_no + 1) * batch_size]


def _shared_layout(batch):
    """Where each array of a batch goes in one shared-memory block.

    Returns `([(shape, dtype, offset), ...], total_bytes)`, or None when the batch is not a
    tuple of plain arrays (a custom collate_fn may return anything, and object arrays hold
    pointers), which then travels pickled.
    """
    if not isinstance(batch, tuple):
        return None
    layout, offset = [], 0
    for array in batch:
        if not isinstance(array, np.ndarray) or array.dtype.hasobject:
            return None
        layout.append((array.shape, array.dtype, offset))
        offset += _round_up(array.nbytes, _FIELD_ALIGN)
    return layout, offset


def _worker_main(dataset, collate_fn, order, batch_size, connection):
    """Body of a worker process: build the batches the consumer asks for, in the order asked.

    A task is `(batch_no, block_name)`; `block_name` names the shared-memory block to write the
    batch into, or is None to send it pickled. The answer is `("shared", layout)`,
    `("pickled", batch)` or `("error", traceback text)`. `None`, the consumer closing its end
    of the pipe, or the consumer's death means stop.
    """
    # Ctrl-C reaches every process of the terminal's process group. The consumer handles it
    # and stops its workers, so a worker must not die of it half-way through a message.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    consumer = multiprocessing.parent_process()
    blocks = {}  # name -> SharedMemory attached in this process
    try:
        while True:
            # If the consumer is killed, nobody sends the stop message, and under "fork" this
            # worker and its later siblings hold copies of the consumer's pipe end, so no EOF
            # comes either: watch the consumer process itself too.
            multiprocessing.connection.wait([connection, consumer.sentinel])
            if not consumer.is_alive():
                return
            task = connection.recv()
            if task is None:
                return
            batch_no, block_name = task
            try:
                indices = _batch_indices(order, batch_no, batch_size)
                batch = _build_batch(dataset, indices, collate_fn)
                layout = _shared_layout(batch) if block_name is not None else None
                if layout is None:
                    connection.send(("pickled", batch))
                    continue
                if block_name not in blocks:
                    blocks[block_name] = shared_memory.SharedMemory(name=block_name)
                block = blocks[block_name]
                fields, nbytes = layout
                if nbytes > block.size:
                    # Larger than the first batch, which sized the block: pickle this one; the
                    # consumer then replaces the block with one large enough.
                    connection.send(("pickled", batch))
                    continue
                for array, (shape, dtype, offset) in zip(batch, fields):
                    np.ndarray(shape, dtype, buffer=block.buf, offset=offset)[...] = array
                connection.send(("shared", fields))
            except Exception:
                connection.send(("error", traceback.format_exc()))
    except (EOFError, OSError):
        return  # the consumer closed the pipe: it wants nothing more
    finally:
        for block in blocks.values():
            block.close()


@contextlib.contextmanager
def _ctrl_c_deferred(on_interrupt=None):
    """Run the body to its end even if Ctrl-C comes meanwhile; then deliver the Ctrl-C.

    For the code that creates or frees workers and shared-memory blocks: a KeyboardInterrupt
    half-way through would leave a process or a block that no list holds, so that nothing
    would ever stop or free it. SIGINT's handler is swapped for one that only notes the signal
    (and calls `on_interrupt`), and the signal is raised again, through the handler it
    replaced, once the body is done. Python runs signal handlers in the main thread only, so
    in any other thread nothing can interrupt the body; nor can SIGINT while it is ignored;
    and a handler set outside Python (None) is left alone, as signal.signal could not put it
    back.
    """
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) in (None, signal.SIG_IGN):
        yield
        return
    received = []

    def note(signum, frame):
        received.append(signum)
        if on_interrupt is not None:
            on_interrupt()

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            signal.raise_signal(signal.SIGINT)


def _stop_workers(processes, connections, blocks):
    """Stop worker processes and free their shared memory; safe on a half-started pool, and
    safe to call again: each resource leaves its list only once released, so a second call
    finishes whatever a first one left.

    Ctrl-C is held off meanwhile; one that comes during the stop terminates the workers at
    once instead of waiting for their current batches. A module-level function (not a method)
    so that the `weakref.finalize` that calls it holds no reference to the pool it cleans up
    after.
    """
    def terminate_now():
        for process in processes:
            process.terminate()

    with _ctrl_c_deferred(on_interrupt=terminate_now):
        while connections:
            try:
                connections[-1].send(None)
            except OSError:
                pass  # that worker is already gone
            connections.pop().close()
        # A worker stops after the batch it is building; one stuck in user code is terminated.
        deadline = time.monotonic() + _WORKER_JOIN_SECONDS
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        while processes:
            process = processes[-1]
            if process.is_alive():
                process.terminate()
                process.join(1.0)
            if process.is_alive():
                process.kill()
                # Bounded too: a killed process the kernel cannot reap (stuck in a driver)
                # must not hang the caller; multiprocessing reaps it when it can.
                process.join(_WORKER_JOIN_SECONDS)
            processes.pop()
        while blocks:
            block = blocks[-1]
            block.close()
            with contextlib.suppress(FileNotFoundError):  # unlinked by a stop interrupted here
                block.unlink()
            blocks.pop()


def _new_block(nbytes):
    """A shared-memory block named netcl_<pid>_<random>: whose it is shows in /dev/shm."""
    return shared_memory.SharedMemory(name=f"netcl_{os.getpid()}_{os.urandom(6).hex()}",
                                      create=True, size=nbytes)


class _WorkerPool:
    """Worker processes building one epoch's batches ahead of the consumer.

    Batch k goes to worker `k % num_workers`, and a worker answers its tasks in the order it
    got them, so the consumer reads batch k from that worker's pipe: batches come out in
    sampler order without a reordering buffer, whatever the number of workers. Each worker has
    at most `prefetch` batches in flight, and with shared memory each in-flight batch has its
    own block: batch k uses block `(k // num_workers) % prefetch` of worker `k % num_workers`.
    Workers get the epoch's sample order once, at start, so a task is only a batch number and
    a block name: messages that small never fill the pipe, so sending one never blocks.
    """

    def __init__(self, loader, order):
        self.num_workers = loader.num_workers
        self.depth = loader.prefetch
        self.num_batches = len(loader)
        self.timeout = loader.timeout or None  # 0: wait for a batch as long as it takes
        # Every worker and block goes into these lists the moment it exists (Ctrl-C is held
        # off in between), and the lists are what the stop frees.
        self.processes, self.connections, self.blocks = [], [], []
        # Should close() never run, or a Ctrl-C cut it short, finalizers stop the pool when it
        # is collected. Two of them: a finalizer runs only once, and a Ctrl-C landing in its
        # first lines, before Ctrl-C is held off, ends it; the second then does the work, or
        # finds none left.
        for _ in range(2):
            weakref.finalize(self, _stop_workers, self.processes, self.connections, self.blocks)
        try:
            if loader.use_shared_mem:
                self._create_blocks(loader, order)
            context = multiprocessing.get_context()  # the platform's default start method
            for worker_id in range(self.num_workers):
                with _ctrl_c_deferred():
                    parent_end, child_end = context.Pipe()
                    self.connections.append(parent_end)
                    args = (loader.dataset, loader.collate_fn, order, loader.batch_size, child_end)
                    process = context.Process(target=_worker_main, args=args, daemon=True,
                                              name=f"netcl-data-worker-{worker_id}")
                    process.start()
                    self.processes.append(process)
                    # Only the worker holds its end now, so if it dies the pipe reports EOF.
                    child_end.close()
            for batch_no in range(min(self.num_workers * self.depth, self.num_batches)):
                self._send_task(batch_no)
        except BaseException:
            self.close()
            raise

    def _create_blocks(self, loader, order):
        """One shared-memory block per in-flight batch, sized by building the first batch here.

        Creating them before any worker starts also starts multiprocessing's resource tracker
        first, so every worker shares it and an interrupted run still has its blocks unlinked.
        """
        indices = _batch_indices(order, 0, loader.batch_size)
        first = _build_batch(loader.dataset, indices, loader.collate_fn)
        layout = _shared_layout(first)
        if layout is None:
            return  # not a tuple of plain arrays: batches travel pickled
        with _ctrl_c_deferred():
            for _ in range(self.num_workers * self.depth):
                self.blocks.append(_new_block(max(layout[1], 1)))

    def _block_index(self, batch_no):
        worker_id = batch_no % self.num_workers
        return worker_id * self.depth + (batch_no // self.num_workers) % self.depth

    def _send_task(self, batch_no):
        worker_id = batch_no % self.num_workers
        block_name = self.blocks[self._block_index(batch_no)].name if self.blocks else None
        try:
            self.connections[worker_id].send((batch_no, block_name))
        except OSError:
            raise self._death(worker_id, batch_no) from None

    def _receive(self, worker_id, batch_no):
        """Worker `worker_id`'s message with batch `batch_no`; RuntimeError if the worker died
        instead, or if the DataLoader's timeout passed first."""
        connection, process = self.connections[worker_id], self.processes[worker_id]
        # Waiting on the process sentinel as well as the pipe means a killed worker wakes us
        # up: no polling loop, and no hang.
        if not multiprocessing.connection.wait([connection, process.sentinel], self.timeout):
            raise RuntimeError(f"DataLoader timed out after {self.timeout:g} seconds waiting "
                               f"for batch {batch_no} from worker {worker_id} (pid "
                               f"{process.pid}); the epoch's workers are stopped")
        if connection.poll():
            try:
                return connection.recv()
            except (EOFError, ConnectionResetError):
                pass  # the worker died, maybe mid-message or with our tasks unread
        raise self._death(worker_id, batch_no)

    def _death(self, worker_id, batch_no):
        """The error for a worker that exited without being asked to, on its way to `batch_no`."""
        process = self.processes[worker_id]
        process.join(1.0)
        message = (f"DataLoader worker {worker_id} (pid {process.pid}) exited unexpectedly "
                   f"with exit code {process.exitcode}")
        sigbus = getattr(signal, "SIGBUS", None)  # POSIX only
        if self.blocks and sigbus is not None and process.exitcode == -sigbus:
            # tmpfs gives a block its pages only when they are first written, so a full
            # /dev/shm shows as SIGBUS in the worker writing the batch, not as an error.
            block = self.blocks[self._block_index(batch_no)]
            message += (f" (SIGBUS): shared memory ran out: /dev/shm had no room left for a "
                        f"batch's block of {block.size} bytes ({len(self.blocks)} blocks, one "
                        f"per batch in flight). Pass use_shared_mem=False, use fewer "
                        f"num_workers or a smaller prefetch, or make /dev/shm larger (in "
                        f"Docker: --shm-size)")
        return RuntimeError(message)

    def take(self, batch_no):
        """Batch `batch_no` as host arrays; then ask its worker for the batch `depth` rounds on."""
        worker_id = batch_no % self.num_workers
        kind, payload = self._receive(worker_id, batch_no)
        if kind == "error":
            raise RuntimeError(f"DataLoader worker {worker_id} failed on batch {batch_no}:\n"
                               f"{payload}")
        block_index = self._block_index(batch_no)
        if kind == "shared":
            block = self.blocks[block_index]
            # Copy out, so the block can be refilled while the caller still holds this batch:
            # a batch already handed out is never overwritten.
            batch = tuple(np.ndarray(shape, dtype, buffer=block.buf, offset=offset).copy()
                          for shape, dtype, offset in payload)
        else:  # "pickled"
            batch = payload
            # Pickled although we have blocks: it was too large for its block, so enlarge it.
            layout = _shared_layout(batch) if self.blocks else None
            if layout is not None and layout[1] > self.blocks[block_index].size:
                self._grow_block(block_index, layout[1])
        next_batch = batch_no + self.num_workers * self.depth
        if next_batch < self.num_batches:
            self._send_task(next_batch)
        return batch

    def _grow_block(self, index, nbytes):
        """Replace a block too small for a batch; the worker attaches the new one by name."""
        with _ctrl_c_deferred():
            old = self.blocks[index]
            self.blocks[index] = _new_block(nbytes)
            old.close()
            old.unlink()

    def close(self):
        """Stop the workers and free the shared memory; calling it again does nothing."""
        _stop_workers(self.processes, self.connections, self.blocks)


class DataLoader:
    """Batches from a dataset, epoch after epoch, optionally built by workers and prefetched
    onto a device.

    dataset: an `ArrayDataset`, a list of `(x, y, *extra)` tuples, or any object with
        `__len__` and `__getitem__` returning such tuples.
    batch_size: samples per batch; the last batch is smaller unless `drop_last`.
    shuffle: a new permutation each epoch from `(seed, epoch)`; otherwise dataset order.
    num_workers: 0 builds batches in this process; N > 0 starts N worker processes per epoch
        (under the "spawn" and "forkserver" start methods, dataset and collate_fn are pickled
        to them).
    use_shared_mem: with workers, batches come back through reused shared-memory blocks
        instead of pickles (in /dev/shm; a worker that finds it full dies of SIGBUS, and the
        error then says so).
    seed: base seed of the shuffle; None draws one from `manual_seed`'s stream.
    collate_fn: `collate_fn(list of sample tuples) -> batch`; the default stacks each field.
    prefetch: batches in flight per worker, and batches uploaded ahead to the device; at most
        64, and num_workers * prefetch at most 1024.
    device_queue: a device queue; iteration then yields `GpuBatch`es (see `bind_queue`).
    timeout: seconds to wait for a worker's batch before raising RuntimeError; 0 (PyTorch's
        default) waits forever. Only for num_workers > 0, as in PyTorch.
    rank, world_size: load only this rank's share of every epoch, as PyTorch's
        DistributedSampler: the epoch's order (the same on every rank, from the same seed) is
        padded to a multiple of world_size by repeating its first samples (drop_last=True
        cuts it down instead), and rank r takes the samples at r, r + world_size, ... So the
        shards are disjoint, and their union is every sample once, plus fewer than
        world_size repeats without drop_last. None: both from netcl.distributed.init()
        (before it, one rank of one: every sample). With no seed, rank 0's is broadcast:
        every rank must then create the loader.

    `len(loader)` is the number of batches per epoch (of this rank's share). With a given
    seed the batches, and their order, are the same for any `num_workers` and `use_shared_mem`.

    Workers never outlive an epoch: when it ends, breaks, raises, times out or is interrupted
    by Ctrl-C (at any moment, even while workers start or stop, even twice), the workers are
    stopped and their shared memory freed before the exception reaches the caller, or when
    the iterator is dropped. A KeyboardInterrupt that comes while workers start or stop is
    held until that is done, then raised; one during the stop also ends the wait for the
    workers' current batches.
    """

    def __init__(self, dataset, batch_size=1, shuffle=True, num_workers=0, use_shared_mem=False,
                 drop_last=False, seed=None, collate_fn=None, prefetch=2, device_queue=None,
                 timeout=0, rank=None, world_size=None):
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ValueError(f"DataLoader: dataset must have __len__ and __getitem__, "
                             f"got {type(dataset).__name__}")
        if len(dataset) == 0:
            raise ValueError("DataLoader: dataset is empty")
        self.batch_size = _check_int("DataLoader", "batch_size", batch_size, 1)
        self.num_workers = _check_int("DataLoader", "num_workers", num_workers, 0)
        self.prefetch = _check_int("DataLoader", "prefetch", prefetch, 1)
        if self.prefetch > _MAX_PREFETCH:
            raise ValueError(f"DataLoader: prefetch must be <= {_MAX_PREFETCH}, got {prefetch!r}")
        if self.num_workers * self.prefetch > _MAX_BATCHES_IN_FLIGHT:
            raise ValueError(f"DataLoader: num_workers * prefetch (batches in flight) must be "
                             f"<= {_MAX_BATCHES_IN_FLIGHT}, got {self.num_workers} * "
                             f"{self.prefetch} = {self.num_workers * self.prefetch}")
        _check_number("DataLoader", "timeout", timeout, minimum=0, finite=True)  # 0 waits forever
        if timeout and not self.num_workers:
            raise ValueError(f"DataLoader: timeout={timeout!r} needs num_workers > 0: it bounds "
                             f"the wait for a worker's batch (as in PyTorch)")
        self.timeout = float(timeout)
        if collate_fn is not None and not callable(collate_fn):
            raise ValueError(f"DataLoader: collate_fn must be callable, got {collate_fn!r}")
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.use_shared_mem = bool(use_shared_mem)
        self.drop_last = bool(drop_last)
        self.collate_fn = collate_fn
        if seed is not None:
            seed = _check_int("DataLoader", "seed", seed, 0)
        # (see distributed, below: sharding and agreeing on a seed)
        self.rank, self.world_size, self.seed = _loader_shard(rank, world_size, seed, self.shuffle)
        self.epoch = 0
        self.bind_queue(device_queue)

    def bind_queue(self, queue):
        """Yield `GpuBatch`es on `queue`'s device from now on (None: host batches again).

        Each batch's `xb` and `yb` are uploaded `prefetch` batches ahead of the one handed out,
        with copies queued on the device's in-order queue, so kernels that use them are
        ordered after their upload without any host wait. Batches must be tuples
        `(x, y, *extra)`. Returns the loader.
        """
        self.device = None if queue is None else _device_of(queue)
        return self

    def __len__(self):
        if self.drop_last:
            return self._samples_per_rank() // self.batch_size
        return _ceil_div(self._samples_per_rank(), self.batch_size)

    def _samples_per_rank(self):
        if self.drop_last:
            return len(self.dataset) // self.world_size
        return _ceil_div(len(self.dataset), self.world_size)

    def __iter__(self):
        """One epoch of batches; each call to iter() is the next epoch."""
        order = self._epoch_order(self.epoch)
        self.epoch += 1
        if self.num_workers == 0:
            batches = self._batches_here(order)
        else:
            # Start the workers now, so they build batches while the caller gets ready.
            batches = self._batches_from_workers(_WorkerPool(self, order))
            next(batches)  # into its `try`, so that even dropped unstarted it stops the workers
        return batches if self.device is None else self._device_batches(batches)

    def _epoch_order(self, epoch):
        """The epoch's sample order: a permutation seeded by (seed, epoch), or 0..N-1; then
        this rank's share of it (np.resize pads cyclically or cuts, as DistributedSampler)."""
        n = len(self.dataset)
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle \
            else np.arange(n)
        if self.world_size == 1:
            return order
        padded = np.resize(order, self._samples_per_rank() * self.world_size)
        return padded[self.rank::self.world_size]

    def _batches_here(self, order):
        for batch_no in range(len(self)):
            indices = _batch_indices(order, batch_no, self.batch_size)
            yield _build_batch(self.dataset, indices, self.collate_fn)

    def _batches_from_workers(self, pool):
        # `finally` runs when the loop ends, breaks or raises, or when the generator is
        # dropped (it is closed then); should that stop be cut short, the pool's finalizers
        # finish it.
        try:
            yield  # __iter__ runs the generator to here
            for batch_no in range(len(self)):
                yield pool.take(batch_no)
        finally:
            pool.close()

    def _device_batches(self, host_batches):
        """GpuBatches, each uploaded `prefetch` batches before it is handed out."""
        uploaded = deque()
        try:
            for host in host_batches:
                uploaded.append(self._upload(host))
                if len(uploaded) > self.prefetch:
                    yield uploaded.popleft()
            while uploaded:
                yield uploaded.popleft()
        finally:
            host_batches.close()

    def _upload(self, host):
        """Host batch -> GpuBatch: `xb` and `yb` become device Tensors, extras stay host arrays.

        `Tensor.from_host` queues the copy without waiting (floats become float32, integer
        labels int32) and keeps the integer labels' host copy, so checking them later needs no
        read back from the device.
        """
        if not isinstance(host, (tuple, list)):
            raise TypeError(f"DataLoader: a device batch needs a tuple (x, y, *extra), "
                            f"got {type(host).__name__}")
        host = tuple(host)
        on_device = [Tensor.from_host(array, queue=self.device.queue) for array in host[:2]]
        return GpuBatch(on_device + list(host[2:]), host)


# IDX (the MNIST file format): two zero bytes, a type code, the number of dimensions, then
# each dimension as a big-endian uint32, then the data, big-endian, row-major.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def _read_at_most(stream, limit):
    """Up to `limit` bytes of `stream`, a piece at a time: memory grows with what the file
    really holds, never to the size its header claims."""
    data = bytearray()
    while len(data) < limit:
        piece = stream.read(min(limit - len(data), 1 << 20))
        if not piece:
            break
        data += piece
    return data


def _read_idx(stream, path):
    """The array in IDX `stream` (the file, or its decompressed gzip stream) from `path`."""
    header = stream.read(4)
    if len(header) < 4:
        raise ValueError(f"load_idx: {path}: truncated header ({len(header)} bytes)")
    if header[:2] != b"\x00\x00":
        raise ValueError(f"load_idx: {path}: bad magic number 0x{header.hex()} "
                         f"(an IDX file starts with 0x0000)")
    type_code, ndim = header[2], header[3]
    if type_code not in _IDX_DTYPES:
        raise ValueError(f"load_idx: {path}: unknown IDX type code 0x{type_code:02x}")
    dims = stream.read(4 * ndim)
    data_start = 4 + 4 * ndim
    if len(dims) < 4 * ndim:
        raise ValueError(f"load_idx: {path}: truncated header "
                         f"({4 + len(dims)} bytes, {ndim} dimensions)")
    shape = struct.unpack(f">{ndim}I", dims)
    dtype = np.dtype(_IDX_DTYPES[type_code])
    count = math.prod(shape)
    expected = data_start + count * dtype.itemsize
    data = _read_at_most(stream, count * dtype.itemsize + 1)
    if data_start + len(data) != expected:
        problem, size = (("truncated data", f"{data_start + len(data)} bytes")
                         if data_start + len(data) < expected else
                         ("trailing bytes after the data", f"more than {expected} bytes"))
        raise ValueError(f"load_idx: {path}: {problem}: {size}, shape {shape} needs {expected}")
    try:
        array = np.frombuffer(data, dtype, count).reshape(shape)
    except ValueError as error:  # more dimensions than NumPy supports
        raise ValueError(f"load_idx: {path}: {ndim} dimensions: {error}") from error
    return array.astype(dtype.newbyteorder("="))


def load_idx(path):
    """Read an IDX file (plain or gzip-compressed) into an ndarray of the file's type.

    MNIST images come back as uint8 `(N, 28, 28)`, labels as uint8 `(N,)`, in native byte
    order. Gzip is recognised by its magic bytes, whatever the file is called. A bad magic
    number, an unknown type code, or a size that does not match the header raises ValueError
    naming the file; a missing file raises OSError. The file is read as a stream, header
    first, and never past the size the header declares (plus one byte, to see that it ends):
    a small file cannot make it allocate more than the file holds, nor read /dev/zero forever.
    """
    path = os.fspath(path)
    with open(path, "rb") as file:
        if file.peek(2)[:2] != b"\x1f\x8b":
            return _read_idx(file, path)
        try:
            with gzip.GzipFile(fileobj=file) as stream:
                return _read_idx(stream, path)
        except (OSError, EOFError, zlib.error) as error:
            raise ValueError(f"load_idx: {path}: truncated or corrupt gzip data "
                             f"({error})") from error


# ============================================================================ Trainer
# A small wrapper around the explicit Tape loop, for classifiers and regressions. Its step is
# an asynchronous pipeline of five points: (1) enqueue the forward; (2) drain: wait,
# interruptibly, only for steps long done, so at most MAX_IN_FLIGHT steps are ever queued
# ahead; (3) every metrics_stride-th step, read the loss and the logits back; (4) enqueue
# backward and the optimizer step without waiting; (5) return, so the host fetches the next
# batch while the device works. Every wait is a host sync and is counted in Device.syncs.
# No garbage-collector pass per step: the Tape frees the graph after backward, so buffers
# return to the pool by reference counting.

class History(list):
    """What fit() returns: one dict per epoch (epoch, loss, accuracy, [val_loss, val_accuracy,]
    samples_per_s, seconds). The accuracy keys exist only for a classifier (see fit); val_*
    are None in an epoch without validation."""

    def to_csv(self, path):
        """Write one row per epoch, a column per key (in order of first appearance), None as
        an empty cell."""
        columns = list(dict.fromkeys(key for record in self for key in record))
        with open(path, "w", newline="") as file:
            writer = csv.DictWriter(file, columns)
            writer.writeheader()
            writer.writerows({key: "" if value is None else value for key, value in record.items()}
                             for record in self)

    def plot(self, path):
        """Write a PNG to `path`: loss (and val_loss) per epoch, and beside it accuracy (and
        val_accuracy) for a classifier. Needs matplotlib, which netcl does not depend on."""
        try:  # imported here: matplotlib is optional, and slow to import
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as error:
            raise ImportError("History.plot needs matplotlib: pip install matplotlib") from error
        panels = [keys for keys in (("loss", "val_loss"), ("accuracy", "val_accuracy"))
                  if any(record.get(keys[0]) is not None for record in self)]
        # A Figure on its own Agg canvas: no pyplot, so no window and no global backend change.
        figure = Figure(figsize=(5 * max(len(panels), 1), 3.5))
        FigureCanvasAgg(figure)
        for i, keys in enumerate(panels):
            axes = figure.add_subplot(1, len(panels), i + 1)
            for key in keys:
                points = [(r["epoch"], r[key]) for r in self if r.get(key) is not None]
                if points:
                    axes.plot(*zip(*points), marker="o", label=key)
            axes.set_xlabel("epoch")
            axes.set_title(keys[0])
            axes.legend()
        figure.tight_layout()
        figure.savefig(path, format="png")


def _trainer_device(model, device_queue):
    """The Trainer's device: device_queue's, else the one the model's parameters are on (the
    default device for a model without any). Parameters on two devices, or on another device
    than device_queue, raise ValueError naming them: the first step would fail otherwise."""
    named = model.named_parameters() if callable(getattr(model, "named_parameters", None)) else ()
    first = None
    for name, param in named:
        if first is None:
            first = name, param.device
        elif param.device is not first[1]:
            raise ValueError(f"Trainer: the model's parameters are on different devices: "
                             f"{first[0]!r} on {first[1].backend} ({first[1].name}), {name!r} "
                             f"on {param.device.backend} ({param.device.name}); move the model "
                             f"to one device with model.to(device)")
    if device_queue is None:
        return _default_device() if first is None else first[1]
    device = _device_of(device_queue)
    if first is not None and first[1] is not device:
        raise ValueError(f"Trainer: device_queue belongs to {device.backend} ({device.name}), "
                         f"but the model's parameters are on {first[1].backend} "
                         f"({first[1].name}); move the model with model.to(device), or leave "
                         f"device_queue out")
    return device


def _as_value(x):
    return x.value if isinstance(x, Node) else x


def _add_weighted_loss(loss_sum, loss, batch_size):
    """loss_sum + batch_size * loss, summed on the loss's device without a sync (loss_sum None:
    from 0). Read once at the end of a pass, it gives the mean loss per sample."""
    if loss.value.size != 1:
        raise TypeError(f"Trainer: loss_fn must return a loss of one element, got shape "
                        f"{loss.shape}")
    if loss_sum is None:
        loss_sum = _fill((), 0.0, loss.value)
    _add_into(loss_sum, loss.value, float(batch_size))
    return loss_sum


def _set_mode(model, training):
    if callable(getattr(model, "train", None)):
        model.train(training)


def _host_labels(labels):
    return labels if isinstance(labels, np.ndarray) else labels.to_host()


def _check_labels(labels, logits_shape):
    """Class indices (N,) in [0, C) or one-hot rows (N, C), for logits (N, C); checked on the
    host copy (a device-only Tensor of labels is left to the loss)."""
    if len(logits_shape) != 2:  # the accuracy is an argmax over C, whatever the loss
        raise ValueError(f"Trainer: the model returned shape {logits_shape}; fit and evaluate "
                         f"need class scores (N, C)")
    if not isinstance(labels, np.ndarray):
        return
    n, classes = logits_shape
    if labels.ndim == 2:
        if labels.shape != (n, classes):
            raise ValueError(f"Trainer: one-hot labels of shape {labels.shape} (width "
                             f"{labels.shape[1]}) do not match the model's output ({n}, {classes})")
    elif labels.ndim == 1 and labels.dtype.kind in "iu":
        bad = labels[(labels < 0) | (labels >= classes)]
        if bad.size:
            raise ValueError(f"Trainer: label {bad[0]} out of range for the model's "
                             f"{classes} outputs [0, {classes})")
    else:
        raise ValueError(f"Trainer: labels must be class indices (N,) or one-hot (N, C), got "
                         f"shape {labels.shape} dtype {labels.dtype}")


def _class_indices(labels):
    return labels.argmax(1) if labels.ndim == 2 else labels


def _is_classification(loss_fn, labels):
    """Whether fit and evaluate measure accuracy: the loss takes classes, or a loss of one's
    own gets integer labels (class indices or one-hot rows)."""
    if loss_fn in (cross_entropy, nll_loss):
        return True
    if loss_fn in (mse_loss, binary_cross_entropy_with_logits):
        return False
    return np.dtype(labels.dtype).kind in "biu"


def _no_batches(loader, epoch):
    return (f"fit: {loader} yielded no batches in epoch {epoch}; it must yield batches every "
            f"epoch (a generator is used up after one pass: pass a DataLoader or a list of "
            f"batches instead)")


def _wait_interruptibly(device, event):
    """Wait for an OpenCL event of `device` by polling, so KeyboardInterrupt is delivered
    meanwhile. A host sync, counted as finish() counts one."""
    device._count_sync()
    spins = 0
    while event.command_execution_status != cl.command_execution_status.COMPLETE:
        spins += 1
        time.sleep(0 if spins < 100 else 0.0005)


def _epoch_line(record, epochs):
    parts = [f"epoch {record['epoch']}/{epochs}"]
    parts += [f"{key} {record[key]:.4f}" for key in ("loss", "accuracy", "val_loss", "val_accuracy")
              if record.get(key) is not None]
    parts += [f"{record['samples_per_s']:.0f} samples/s", f"{record['seconds']:.2f} s"]
    return "  ".join(parts)


class _Progress:
    """A one-line progress bar for terminals, per epoch, redrawn at metrics steps:
    `epoch 2/5 [=====>   ] 120/469 loss 0.3120 5400 samples/s ETA 15s`."""

    def __init__(self, epochs, batches):
        self.epochs, self.batches = epochs, batches  # batches per epoch, None if unknown
        self.epoch, self.started = None, time.perf_counter()

    def update(self, epoch, batch_no, loss, samples_per_s):
        """Redraw the bar after batch `batch_no` (from 1) of `epoch`."""
        if epoch != self.epoch:
            self.epoch, self.started = epoch, time.perf_counter()
        text = f"epoch {epoch}/{self.epochs} "
        if self.batches:
            done = min(batch_no / self.batches, 1.0)
            bar = "=" * int(24 * done) + ">" + " " * (24 - int(24 * done))
            elapsed = time.perf_counter() - self.started
            text += (f"[{bar}] {batch_no}/{self.batches} loss {loss:.4f} {samples_per_s:.0f} "
                     f"samples/s ETA {elapsed / done - elapsed:.0f}s")
        else:
            text += f"step {batch_no} loss {loss:.4f} {samples_per_s:.0f} samples/s"
        self._show(text)

    def validating(self, epoch):
        """Say so while validation runs, rather than leave a bar that seems frozen."""
        self._show(f"epoch {epoch}/{self.epochs} validating...")

    def clear(self):
        """Erase the bar, so the epoch's line prints in its place."""
        self._show("")

    def _show(self, text):
        sys.stdout.write("\r" + text + "\033[K")
        sys.stdout.flush()


def _check_loss_fn(op, loss_fn):
    """A loss is a callable loss_fn(logits, target), or None for the Trainer's own."""
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"{op}: loss_fn must be callable or None, got {loss_fn!r}")


def _check_loader(op, name, loader):
    """A loader is any iterable of batches (checked before the first epoch trains)."""
    if not hasattr(loader, "__iter__"):
        raise TypeError(f"{op}: {name} must be an iterable of batches, got "
                        f"{type(loader).__name__}")


class Trainer:
    """fit()/evaluate() for classifiers (and regressions, see fit):
    `Trainer(model, optimizer, grad_clip=1.0).fit(loader)`.

    model: any callable mapping an input Node to logits (N, C) (a regression's output: any
    shape its loss takes). optimizer: a netcl optimizer.
    device_queue: the queue batches are uploaded to; by default the device of the model's
        parameters (manager.default()'s for a model without any).
    mixed_precision: forward under autocast with an AMPGradScaler (off on the NumPy backend).
    grad_clip: global-norm clipping each step, fused into optimizer.step(max_norm=...) when the
    optimizer's step accepts it. loss_fn: default loss (cross_entropy). metrics_stride: read
    loss and accuracy back every this many steps (each read is a host sync).
    """

    MAX_IN_FLIGHT = 2  # steps queued ahead of the one the host has waited for

    def __init__(self, model, optimizer, device_queue=None, mixed_precision=False,
                 grad_clip=None, loss_fn=None, metrics_stride=10):
        if not callable(model):
            raise ValueError(f"Trainer: model must be callable, got {model!r}")
        if not callable(getattr(optimizer, "step", None)):
            raise ValueError(f"Trainer: optimizer must have a step() method, got {optimizer!r}")
        if grad_clip is not None and not (_is_scalar(grad_clip) and grad_clip > 0):
            raise ValueError(f"Trainer: grad_clip must be a positive number or None, got "
                             f"{grad_clip!r}")
        _check_loss_fn("Trainer", loss_fn)
        metrics_stride = _check_int("Trainer", "metrics_stride", metrics_stride, 1)
        if is_initialized():  # data-parallel: rank 0's model everywhere, gradients averaged
            optimizer = _data_parallel(model, optimizer)
        self.model, self.optimizer = model, optimizer
        self.device = _trainer_device(model, device_queue)
        self.grad_clip = None if grad_clip is None else float(grad_clip)
        self.loss_fn = loss_fn
        self.metrics_stride = int(metrics_stride)
        if mixed_precision and self.device.backend == "cpu" and is_main():
            print("netcl: mixed precision has no effect on the NumPy backend; training in float32")
            mixed_precision = False
        self.mixed_precision = bool(mixed_precision)
        # Disabled without mixed precision: then it passes the loss and the step through.
        self.scaler = AMPGradScaler(enabled=self.mixed_precision)
        if self.mixed_precision and self.device.autocast_half:
            self.device._half_program()  # built now: the first epoch's samples/s stays honest
        # Checked once: does this optimizer clip inside its own step?
        self._fused_clip = "max_norm" in inspect.signature(optimizer.step).parameters
        self._in_flight = deque()  # one marker event per queued step (OpenCL)
        self._loss_sum = None      # device scalar: the epoch's summed batch losses
        # Where the loop stands, for save_checkpoint: epochs done in the last fit, its best
        # monitored value and epochs since it improved; what load_checkpoint left for fit.
        self.epoch, self._best, self._bad_epochs, self._monitor = 0, None, 0, None
        self._train_loader = self._scheduler = self._loaded = None

    # --- the step ---------------------------------------------------------------------------
    def _train_step(self, step, x, target, labels, loss_fn, classify):
        """One step, the five points of the pipeline (see the section's banner). Returns
        (metrics, logits): metrics is (loss, logits) as host values on metrics steps (logits
        None for a regression), else None; logits is this step's output Node."""
        # 1. Enqueue the forward (returns as soon as the kernels are queued).
        with Tape() as tape, autocast(enabled=self.mixed_precision):
            logits = self.model(x)
            if classify:
                _check_labels(labels, _as_value(logits).shape)
            loss = loss_fn(logits, target)
        # 2. Drain: wait, interruptibly, for old steps only, so memory stays bounded.
        self._drain(self.MAX_IN_FLIGHT)
        # 3. Metrics: one read for the loss, one for the logits; waits for this forward.
        metrics = None
        if step % self.metrics_stride == 0:
            if self.device.backend == "opencl":  # wait for this forward, interruptibly
                self._drain(0)
                _wait_interruptibly(self.device, cl.enqueue_marker(self.device.queue))
            metrics = (float(loss.value.to_host()),
                       _as_value(logits).to_host() if classify else None)
            if not math.isfinite(metrics[0]):  # before its backward and step: nothing applied
                raise RuntimeError(f"non-finite loss at step {step}")
        self._loss_sum = _add_weighted_loss(self._loss_sum, loss, x.shape[0])
        # 4. Enqueue backward and the optimizer step, without waiting. Without mixed precision
        # the scaler is disabled: scale() returns the loss, unscale_() and update() do nothing.
        self.optimizer.zero_grad()
        tape.backward(self.scaler.scale(loss))
        if self.grad_clip is not None and not self._fused_clip:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not scaled ones
            clip_grad_norm(self.optimizer.params, self.grad_clip)
        self.scaler.step(self.optimizer, **self._clip_kwargs())
        self.scaler.update()
        if self.device.backend == "opencl":
            self._in_flight.append(cl.enqueue_marker(self.device.queue))
        # 5. Return: the caller fetches the next batch while the device works.
        return metrics, logits

    def _clip_kwargs(self):
        fused = self.grad_clip is not None and self._fused_clip
        return {"max_norm": self.grad_clip} if fused else {}

    def _drain(self, keep):
        """Wait until at most `keep` steps are queued. Polls instead of blocking in finish()
        so that Ctrl-C interrupts the wait."""
        while len(self._in_flight) > keep:
            _wait_interruptibly(self.device, self._in_flight.popleft())

    # --- fit / evaluate ---------------------------------------------------------------------
    def fit(self, train_loader, val_loader=None, epochs=1, loss_fn=None, log_every=1,
            checkpoint=None, scheduler=None, monitor=None, patience=None, resume=None,
            training_checkpoint=None):
        """Train up to epoch `epochs`, printing a line per epoch, validating every `log_every`
        epochs when val_loader is given; return the History.

        A classifier (loss cross_entropy or nll_loss, or a loss of your own with integer
        labels: class indices (N,) or one-hot (N, C)) gets accuracy and val_accuracy; anything
        else (mse_loss, binary_cross_entropy_with_logits, float targets) is a regression: only
        the losses, and no accuracy keys in the History.

        monitor: what "better" means: "val_accuracy" or "val_loss" (higher accuracy, lower
            loss), or "accuracy"/"loss" of the training set. Default: val_accuracy for a
            classifier, else val_loss; the training set's when there is no val_loader. It is
            read in each epoch that has it (every log_every-th with validation).
        checkpoint: a path where the model's state_dict is saved whenever the monitored value
            is strictly better than before (the first always saves).
        patience: stop after this many monitored epochs in a row without a strictly better
            value (Keras' EarlyStopping); None never stops early.
        scheduler: a learning-rate schedule, stepped as it says (`step_every`): WarmupCosine
            after every batch, StepLR after every epoch, ReduceLROnPlateau after every
            monitored epoch with the monitored value; a schedule of your own with step() and
            no step_every, after every epoch (PyTorch's convention).
        training_checkpoint: a path where save_checkpoint() writes the whole training state
            after every epoch, for resume.
        resume: a path written by save_checkpoint(): load it (load_checkpoint) and carry on
            after its last epoch. As Keras' initial_epoch, `epochs` is the last epoch number:
            fit(epochs=4, resume=after_2) runs epochs 3 and 4, and their History.

        A batch of no samples, a loader that yields no batches in an epoch (a generator is
        used up after its first pass), and per-sample (x, y) tuples raise ValueError.
        """
        epochs = _check_int("fit", "epochs", epochs, 0)
        log_every = _check_int("fit", "log_every", log_every, 1)
        if patience is not None:
            patience = _check_int("fit", "patience", patience, 1)
        if monitor not in (None, "val_loss", "val_accuracy", "loss", "accuracy"):
            raise ValueError(f"fit: monitor must be 'val_loss', 'val_accuracy', 'loss', "
                             f"'accuracy' or None, got {monitor!r}")
        if monitor in ("val_loss", "val_accuracy") and val_loader is None:
            raise ValueError(f"fit: monitor={monitor!r} needs a val_loader")
        # What would otherwise fail only after the first epoch has trained, checked now:
        _check_loader("fit", "train_loader", train_loader)
        if val_loader is not None:
            _check_loader("fit", "val_loader", val_loader)
        _check_loss_fn("fit", loss_fn)
        for name, path in (("checkpoint", checkpoint), ("training_checkpoint",
                                                        training_checkpoint)):
            if path is None:
                continue
            if not isinstance(path, (str, os.PathLike)):
                raise TypeError(f"fit: {name} must be a path (str or os.PathLike), got "
                                f"{type(path).__name__}")
            if not callable(getattr(self.model, "state_dict", None)):
                raise ValueError(f"fit: {name} needs a model with state_dict()")
            folder = os.path.dirname(os.path.abspath(os.fspath(path)))
            if not os.path.isdir(folder):
                raise ValueError(f"fit: {name}={os.fspath(path)!r}: no directory {folder!r} "
                                 f"to write it in")
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise ValueError(f"fit: scheduler must have a step() method, got {scheduler!r}")
        step_every = getattr(scheduler, "step_every", "epoch")
        if step_every not in ("batch", "epoch"):
            raise ValueError(f"fit: scheduler.step_every must be 'batch' or 'epoch', got "
                             f"{step_every!r}")
        loss_fn = loss_fn or self.loss_fn or cross_entropy
        if resume is None:
            self._start_loop(train_loader, scheduler, monitor)
        else:
            with self._unchanged_on_error():  # a rejected checkpoint changes nothing
                self._read_checkpoint(resume)
                self._start_loop(train_loader, scheduler, monitor)
        history, step, classify = History(), 0, None
        if resume is not None and patience is not None and self._bad_epochs >= patience:
            if is_main():  # the run resumed had stopped early: so does this one
                print(f"early stopping: {self._monitor} has not improved on {self._best:.4f} "
                      f"for {self._bad_epochs} epochs")
            return history
        batches = len(train_loader) if hasattr(train_loader, "__len__") else None
        progress = _Progress(epochs, batches) if sys.stdout.isatty() and is_main() else None
        for epoch in range(self.epoch + 1, epochs + 1):
            # --- one pass over the training set ---
            _set_mode(self.model, True)
            started = time.perf_counter()
            samples, seen, correct, batch_no = 0, 0, 0, 0
            self._loss_sum = None
            last = None
            for batch_no, batch in enumerate(train_loader, 1):
                x, target, labels = self._prepare(batch)
                if classify is None:  # decided once, from the first batch
                    classify = _is_classification(loss_fn, labels)
                    maximize = self._resolve_monitor(classify, val_loader is not None, scheduler)
                metrics, last_logits = self._train_step(step, x, target, labels, loss_fn, classify)
                if step_every == "batch":
                    scheduler.step()
                last = (last_logits, labels)
                batch_size = x.shape[0]
                samples += batch_size
                if metrics is not None:
                    loss_value, logits = metrics
                    seen += batch_size
                    if classify:
                        correct += int((logits.argmax(1)
                                        == _class_indices(_host_labels(labels))).sum())
                    if progress:
                        progress.update(epoch, batch_no, loss_value,
                                        samples / (time.perf_counter() - started))
                step += 1
            if batch_no == 0:
                raise ValueError(_no_batches("train_loader", epoch))
            self._drain(0)
            if seen == 0 and classify:  # no metrics step this epoch: sample its last batch
                seen = len(last[1])
                correct = int((_as_value(last[0]).to_host().argmax(1)
                               == _class_indices(_host_labels(last[1]))).sum())
            last = None
            # One read per epoch, which also waits for the epoch's last step.
            loss_sum = float(self._loss_sum.to_host())
            # Data-parallel: the whole job's epoch, in one small all-reduce (nothing with one rank).
            loss_sum, samples, correct, seen = _sum_over_ranks(loss_sum, samples, correct, seen)
            seconds = time.perf_counter() - started
            # --- the epoch's record: loss of every step, weighted by batch size; accuracy
            # sampled at metrics steps; validation every log_every epochs ---
            record = {"epoch": epoch, "loss": loss_sum / samples}
            if classify:
                record["accuracy"] = correct / seen
            if val_loader is not None:
                record["val_loss"] = None
                if classify:
                    record["val_accuracy"] = None
                if epoch % log_every == 0:
                    if progress:
                        progress.validating(epoch)
                    result = self._evaluate(val_loader, loss_fn, classify,
                                            _no_batches("val_loader", epoch))
                    record.update({f"val_{key}": value for key, value in result.items()})
            record["samples_per_s"] = samples / seconds if seconds > 0 else math.nan
            record["seconds"] = seconds
            history.append(record)
            # --- what the monitored value decides: best checkpoint, plateau, early stop ---
            value = record.get(self._monitor)
            if value is not None:
                if self._best is None or (value > self._best if maximize else value < self._best):
                    self._best, self._bad_epochs = value, 0
                    if checkpoint is not None and is_main():  # the ranks' models are identical
                        save(self.model.state_dict(), checkpoint)
                else:
                    self._bad_epochs += 1
                if isinstance(scheduler, ReduceLROnPlateau):
                    scheduler.step(value)
            if step_every == "epoch" and scheduler is not None \
                    and not isinstance(scheduler, ReduceLROnPlateau):
                scheduler.step()
            self.epoch = epoch
            if training_checkpoint is not None and is_main():
                self.save_checkpoint(training_checkpoint)
            if progress:
                progress.clear()
            if is_main():
                print(_epoch_line(record, epochs))
            if patience is not None and self._bad_epochs >= patience:
                if is_main():
                    print(f"early stopping: {self._monitor} has not improved on {self._best:.4f} "
                          f"for {self._bad_epochs} epochs")
                break
        return history

    def _start_loop(self, train_loader, scheduler, monitor):
        """Set where the loop starts: after a loaded checkpoint's epoch, or at epoch 1."""
        state = self._loaded
        if state is not None and state["scheduler"] is not None and scheduler is None:
            raise ValueError("fit: the checkpoint holds a scheduler's state; pass the same kind "
                             "of scheduler as fit(scheduler=...) to resume it")
        if state is not None and None not in (state["monitor"], monitor) \
                and monitor != state["monitor"]:
            raise ValueError(f"fit: the checkpoint's best value is of {state['monitor']!r}, "
                             f"not monitor={monitor!r}")
        self._loaded = None
        self._train_loader, self._scheduler, self._monitor = train_loader, scheduler, monitor
        self.epoch, self._best, self._bad_epochs = 0, None, 0
        if state is None:
            return
        if scheduler is not None and state["scheduler"] is not None:
            scheduler.load_state_dict(state["scheduler"])
        if isinstance(train_loader, DataLoader) and state["loader_epoch"] is not None:
            train_loader.epoch = state["loader_epoch"]  # its shuffle goes on from there
        _generator[0] = state["random"]
        self.epoch, self._best = state["epoch"], state["best"]
        self._bad_epochs = state["bad_epochs"]
        self._monitor = monitor or state["monitor"]

    def _resolve_monitor(self, classify, has_val, scheduler):
        """Fill in the default monitor for this task and check it; True if higher is better."""
        default = "accuracy" if classify else "loss"
        self._monitor = self._monitor or (f"val_{default}" if has_val else default)
        maximize = self._monitor.endswith("accuracy")
        if maximize and not classify:
            raise ValueError(f"fit: monitor={self._monitor!r}, but this is a regression (no "
                             f"accuracy is measured); monitor a loss")
        if isinstance(scheduler, ReduceLROnPlateau) and (scheduler.mode == "max") != maximize:
            raise ValueError(f"fit: ReduceLROnPlateau(mode={scheduler.mode!r}) would treat "
                             f"{self._monitor} the wrong way round; use mode="
                             f"{'max' if maximize else 'min'!r}")
        return maximize

    def save_checkpoint(self, path):
        """Write the whole training state to `path` (netcl.save's .npz, no pickles): model,
        optimizer (moments, step count), scaler, the last fit's scheduler, the epochs done,
        the best monitored value and epochs without improvement, the train DataLoader's epoch
        (its shuffle order) and netcl's random stream (dropout), so that fit(resume=path)
        continues as if it had never stopped."""
        for what, owner in (("model", self.model), ("optimizer", self.optimizer)):
            if not callable(getattr(owner, "state_dict", None)):
                raise ValueError(f"Trainer.save_checkpoint: the {what} has no state_dict()")
        loader = self._train_loader
        save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
              "scaler": self.scaler.state_dict(),  # {} when disabled, as PyTorch's
              "scheduler": None if self._scheduler is None else self._scheduler.state_dict(),
              "trainer": {"epoch": self.epoch, "monitor": self._monitor, "best": self._best,
                          "bad_epochs": self._bad_epochs,
                          "loader_epoch": loader.epoch if isinstance(loader, DataLoader) else None,
                          # PCG64's state holds 128-bit integers: kept as JSON text
                          "random": json.dumps(_rng().bit_generator.state)}}, path)

    def load_checkpoint(self, path):
        """Read a file of save_checkpoint(): the model, optimizer and scaler are restored now;
        the epoch, the early-stopping state, the scheduler's state, the DataLoader's epoch
        and the random stream are taken up by the next fit(). A checkpoint that does not fit
        raises and leaves the model, optimizer and scaler as they were."""
        with self._unchanged_on_error():
            self._read_checkpoint(path)

    def _read_checkpoint(self, path):
        """load_checkpoint's work, without its restoring on an error (fit's own covers it)."""
        state = load(path)
        loop = state.get("trainer")
        if not isinstance(loop, dict) or not {"model", "optimizer"} <= set(state):
            raise ValueError(f"Trainer.load_checkpoint: {os.fspath(path)} is not a training "
                             f"checkpoint (a state_dict saved by fit(checkpoint=...) loads with "
                             f"model.load_state_dict(netcl.load(path)))")
        try:
            random = np.random.default_rng()
            random.bit_generator.state = json.loads(loop["random"])
            epoch, bad_epochs = int(loop["epoch"]), int(loop["bad_epochs"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"Trainer.load_checkpoint: {os.fspath(path)} has a damaged "
                             f"'trainer' entry ({error!r})") from error
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scaler"):  # None or {}: saved without mixed precision
            self.scaler.load_state_dict(state["scaler"])
        self._loaded = {"epoch": epoch, "bad_epochs": bad_epochs, "best": loop.get("best"),
                        "monitor": loop.get("monitor"), "loader_epoch": loop.get("loader_epoch"),
                        "scheduler": state.get("scheduler"), "random": random}

    @contextlib.contextmanager
    def _unchanged_on_error(self):
        """On an error inside, put the model's, optimizer's and scaler's states back as they
        were before it (a resume that fails halfway leaves no half-loaded model), then raise."""
        owners = [owner for owner in (self.model, self.optimizer, self.scaler)
                  if callable(getattr(owner, "state_dict", None))]
        saved = [owner.state_dict() for owner in owners]
        try:
            yield
        except BaseException:
            for owner, state in zip(owners, saved):
                owner.load_state_dict(state)
            raise

    def evaluate(self, data_loader, loss_fn=None):
        """One pass in eval mode without gradients: {"loss": mean per sample, "accuracy"}
        (no accuracy for a regression, as in fit)."""
        _check_loader("evaluate", "data_loader", data_loader)
        _check_loss_fn("evaluate", loss_fn)
        result = self._evaluate(data_loader, loss_fn or self.loss_fn or cross_entropy, None,
                                "evaluate: data_loader yielded no batches")
        if is_main():
            print("evaluate: " + ", ".join(f"{key} {value:.4f}" for key, value in result.items()))
        return result

    def _evaluate(self, data_loader, loss_fn, classify, empty_message):
        """The pass of evaluate(), silent; classify None decides it from the first batch."""
        was_training = getattr(self.model, "training", None)
        _set_mode(self.model, False)
        total, loss_sum, correct = 0, None, 0
        try:
            with no_grad(), autocast(enabled=self.mixed_precision):
                for batch in data_loader:
                    x, target, labels = self._prepare(batch)
                    if classify is None:
                        classify = _is_classification(loss_fn, labels)
                    logits = self.model(x)
                    if classify:
                        _check_labels(labels, _as_value(logits).shape)
                    loss = loss_fn(logits, target)
                    loss_sum = _add_weighted_loss(loss_sum, loss, x.shape[0])
                    if classify:
                        # A read of every batch's logits, a host sync: the argmax is compared
                        # with the labels on the host, as netcl has no device comparison op.
                        correct += int((_as_value(logits).to_host().argmax(1)
                                        == _class_indices(_host_labels(labels))).sum())
                    total += x.shape[0]
                    if self.device.backend == "opencl":  # as in fit: few batches queued ahead
                        self._in_flight.append(cl.enqueue_marker(self.device.queue))
                        self._drain(self.MAX_IN_FLIGHT)
        finally:
            if was_training is not None:
                _set_mode(self.model, was_training)
        self._drain(0)
        # One read of the summed loss, which also waits for the last batch.
        loss_sum = 0.0 if loss_sum is None else float(loss_sum.to_host())
        total, loss_sum, correct = _sum_over_ranks(total, loss_sum, correct)  # every rank's shard
        if total == 0:
            raise ValueError(empty_message)
        return {"loss": loss_sum / total, "accuracy": correct / total} if classify \
            else {"loss": loss_sum / total}

    def _prepare(self, batch):
        """(input Node, target for the loss, labels) from a batch (xb, yb, *extra). labels is
        a host array when one exists (NumPy batches, GpuBatch.host), else the device Tensor,
        read back only when metrics need it. Integer inputs (uint8 images) become float32, as
        model(array) converts them; an empty batch raises ValueError (its mean loss is NaN)."""
        if not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise ValueError(f"Trainer: a batch must be a tuple (xb, yb, *extra), got "
                             f"{type(batch).__name__}")
        xb, yb = batch[0], batch[1]
        shapes = [v.shape if isinstance(v, (Node, Tensor)) else np.shape(v) for v in (xb, yb)]
        if () in shapes:  # one (x, y) pair, as iterating over a list of samples gives
            raise ValueError(f"Trainer: a batch (xb, yb) has xb of shape {shapes[0]} and yb of "
                             f"shape {shapes[1]}: this looks like one sample, not a batch; "
                             f"wrap the samples in a DataLoader, e.g. DataLoader(samples, "
                             f"batch_size=32) or DataLoader(ArrayDataset(x, y), batch_size=32)")
        if isinstance(batch, GpuBatch):
            labels = batch.host[1]
        elif isinstance(yb, (Tensor, Node)):
            value = _as_value(yb)
            labels = value._labels if value._labels is not None else value
        else:
            labels = np.asarray(yb)
        if isinstance(batch, GpuBatch) and isinstance(xb, Tensor) and xb.dtype.kind != "f":
            xb = batch.host[0]  # the loader uploaded int32, which no op computes with
        if isinstance(xb, (Node, Tensor)):
            x = xb if isinstance(xb, Node) else Node(xb)
        else:  # converted on the host, before the upload
            xb = np.asarray(xb)
            x = Node(Tensor.from_host(xb, self.device.queue,
                                      np.float32 if xb.dtype.kind in "biu" else None))
        if x.shape[:1] == (0,):
            raise ValueError(f"Trainer: empty batch (xb of shape {x.shape}); a batch needs at "
                             f"least one sample")
        if isinstance(labels, np.ndarray) and labels.ndim == 2 and labels.dtype.kind != "f":
            # integer one-hot rows: the loss takes them as class probabilities
            target = Tensor.from_host(labels.astype(np.float32), self.device.queue)
        elif isinstance(yb, (Tensor, Node)):
            target = yb
        else:
            target = Tensor.from_host(labels, self.device.queue)
        return x, target, labels


# ============================================================================ import aliases
# The one file also answers the dotted import paths people know (netcl.nn, netcl.optim, ...):
# each is a small module object registered in sys.modules, holding the same objects.

def _alias(name, **members):
    module = types.ModuleType(f"{__name__}.{name}", f"netcl.{name}: an alias of names in netcl")
    module.__dict__.update(members)
    sys.modules[module.__name__] = module
    return module


manager = _alias("manager", default=_default_device, set_default=_set_default_device,
                 Device=Device)
functional = _alias(
    "functional", matmul=matmul, linear=linear, add=add, sub=sub, mul=mul, div=div, neg=neg,
    relu=relu, leaky_relu=leaky_relu, sigmoid=sigmoid, tanh=tanh, gelu=gelu, exp=exp, log=log,
    sum=reduce_sum, mean=reduce_mean, reshape=reshape, flatten=flatten, transpose=transpose,
    softmax=softmax, log_softmax=log_softmax, cross_entropy=cross_entropy, mse_loss=mse_loss,
    dropout=dropout, conv2d=conv2d, max_pool2d=max_pool2d, avg_pool2d=avg_pool2d,
    sqrt=sqrt, rsqrt=rsqrt, abs=absolute, pow=power, clamp=clamp, silu=silu, maximum=maximum,
    minimum=minimum, where=where, masked_fill=masked_fill, max=reduce_max, min=reduce_min,
    argmax=argmax, var=var, std=std, logsumexp=logsumexp, layer_norm=layer_norm,
    batch_norm=batch_norm, embedding=embedding,
    scaled_dot_product_attention=scaled_dot_product_attention,
    permute=permute, squeeze=squeeze, unsqueeze=unsqueeze, cat=cat, stack=stack, split=split,
    chunk=chunk, unbind=unbind, index_select=index_select,
    nll_loss=nll_loss, binary_cross_entropy_with_logits=binary_cross_entropy_with_logits)
autograd = _alias("autograd", Node=Node, Parameter=Parameter, Tape=Tape, no_grad=no_grad)
nn = _alias("nn", Module=Module, Linear=Linear, ReLU=ReLU, Tanh=Tanh, Sigmoid=Sigmoid,
            GELU=GELU, Dropout=Dropout, Flatten=Flatten, Sequential=Sequential,
            Conv2d=Conv2d, MaxPool2d=MaxPool2d, Parameter=Parameter, functional=functional,
            LayerNorm=LayerNorm, BatchNorm1d=BatchNorm1d, BatchNorm2d=BatchNorm2d,
            Embedding=Embedding)
sys.modules[f"{__name__}.nn.functional"] = functional  # import netcl.nn.functional as F
optim = _alias("optim", Optimizer=Optimizer, SGD=SGD, Adam=Adam, AdamW=AdamW,
               clip_grad_norm=clip_grad_norm, clip_grad_norm_=clip_grad_norm_,
               WarmupCosine=WarmupCosine, StepLR=StepLR, ReduceLROnPlateau=ReduceLROnPlateau,
               AMPGradScaler=AMPGradScaler)
optim.lr_scheduler = _alias("optim.lr_scheduler", StepLR=StepLR,
                            ReduceLROnPlateau=ReduceLROnPlateau, WarmupCosine=WarmupCosine)
amp = _alias("amp", autocast=autocast, AMPGradScaler=AMPGradScaler)
data = _alias("data", DataLoader=DataLoader, ArrayDataset=ArrayDataset, GpuBatch=GpuBatch,
              load_idx=load_idx)
data.dataloader = _alias("data.dataloader", DataLoader=DataLoader)
trainer = _alias("trainer", Trainer=Trainer, History=History)
distributed = _alias("distributed", init=init, is_initialized=is_initialized, rank=rank,
                     world_size=world_size, is_main=is_main, stats=stats,
                     broadcast_parameters=broadcast_parameters,
                     DistributedOptimizer=DistributedOptimizer)
# Flat names for the reductions too (netcl.sum, netcl.mean). Binding sum here shadows
# Python's built-in in the whole module, not only below this line: a function looks up its
# globals when it runs, not when it is defined. So code in this file that means the built-in
# calls it as builtins.sum.
globals().update(sum=reduce_sum, mean=reduce_mean)
