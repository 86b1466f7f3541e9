"""netcl's test suite (pytest + Hypothesis).

Run everything with `python -m pytest -q test_netcl.py`; a subset with `-k`, by name or by
section word: `-k op_` (every op case), `-k "scaler or autocast"`, `-k "dataloader or worker"`,
`-k trainer`. Every test that can runs on both backends through the `backend` fixture: "cpu"
(the NumPy backend) and "opencl" (in CI: PoCL on the CPU); `cpu` and `opencl` name one
backend. Without an OpenCL platform the OpenCL half is skipped, unless NETCL_REQUIRE_OPENCL=1
is set (as in CI), in which case it fails.

The sections follow netcl.py's:
- devices (the default device, NETCL_DEVICE, set_default), the BufferPool (reuse, stats,
  MemoryError, a flat pool over a training loop), Tensor (round trips, dtypes, views, .to());
- autograd (accumulation, fan-out, tape lifetime, no_grad, constants, nested Tapes, threads);
- operations. The CASES registry (`@case`) holds one entry per op and form: it draws the inputs
  and gives a NumPy float64 reference. Two tests run every case: the forward against the
  reference and the gradient against central finite differences in float64 on the NumPy
  backend, and the OpenCL backend against the NumPy backend in float32 on random shapes. Then
  each family's edges (PyTorch's conventions at NaN, ties, empty axes) and argument errors;
- nn modules, state_dict, save / load, print(model); optimizers against NumPy transcriptions of
  PyTorch's formulas; mixed precision (autocast, float16 storage, tensor cores, AMPGradScaler
  against a transcription of PyTorch's GradScaler);
- data-parallel training over MPI (`mpiexec -n 2`), data (DataLoader order, workers, shared
  memory, interrupts, load_idx), the Trainer (fit, evaluate, checkpoints, resume, schedules,
  History), the examples and the import aliases.

Shared pieces: the fixtures `backend`, `cpu`, `opencl` and `digits` (scikit-learn's digits and
the tutorial's split); `tensor`, `param`, `host`, `raises_naming`; `_mlp`, the one MLP builder;
`_central_differences`, the one finite-difference gradient (of the cases and of any test that
needs one beyond them); `_sgd_reference` and `_adam_reference`, PyTorch's optimizer rules in
float64; two tables, ARGUMENT_ERRORS (a bad argument, the error and what its message names) and
IMPORT_ALIASES (the dotted import paths); and four Hypothesis settings, one per kind of test
(FD_, XB_, TRAINING_ and PROPERTY_SETTINGS).
"""
import contextlib
import functools
import gc
import gzip
import importlib
import inspect
import math
import multiprocessing
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import types
import warnings
import weakref
import zipfile
from collections import Counter, namedtuple

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import netcl
import netcl.functional as F
from netcl import nn


# ---------------------------------------------------------------------------------------------
# fixtures and helpers
# ---------------------------------------------------------------------------------------------

BACKENDS = ["cpu", "opencl"]

# Hypothesis settings, one per kind of test. deadline=None everywhere: the first OpenCL call
# of a kernel may wait for PoCL to compile it. The whole suite has to stay well under ten
# minutes on two cores, hence few examples. The function-scoped fixtures that some of these
# tests take (monkeypatch, tmp_path) hold nothing an example changes.
_QUIET = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
# an op's float64 forward and gradient against a reference and finite differences (NumPy)
FD_SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=_QUIET)
# the OpenCL backend against the NumPy backend (or a known answer) on random shapes
XB_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=_QUIET)
# each example trains for steps or starts worker processes: optimizers, scaler, Trainer, data
TRAINING_SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=_QUIET)
# host-side bookkeeping only (schedules, shards): cheap, so more examples
PROPERTY_SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=_QUIET)


def _get_device(name):
    if name == "opencl":
        try:
            return netcl.manager.default("opencl")
        except RuntimeError as err:
            if os.environ.get("NETCL_REQUIRE_OPENCL") == "1":
                pytest.fail(f"NETCL_REQUIRE_OPENCL=1 but no OpenCL device: {err}")
            pytest.skip(f"no OpenCL device: {err}")
    return netcl.manager.default(name)


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request):
    """The Device of each backend in turn."""
    return _get_device(request.param)


@pytest.fixture(scope="session")
def cpu():
    return netcl.manager.default("cpu")


@pytest.fixture(scope="session")
def opencl():
    return _get_device("opencl")


Digits = namedtuple("Digits", "x y x_train y_train x_test y_test")


@pytest.fixture(scope="session")
def digits():
    """scikit-learn's 8x8 digits: x (1797, 64) float32 in [0, 1], y (1797,) labels, and the
    tutorial's split of them (stratified, 20% for testing, random_state=0). Read-only."""
    from sklearn import datasets, model_selection  # the test extra installs scikit-learn
    data = datasets.load_digits()
    x = (data.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = model_selection.train_test_split(
        x, data.target, test_size=0.2, random_state=0, stratify=data.target)
    return Digits(x, data.target, x_train, y_train, x_test, y_test)


def tensor(array, dev, dtype=None):
    """A device Tensor holding `array` (float64 kept only when dtype=np.float64 is asked)."""
    array = np.asarray(array)
    if dtype is None:
        return netcl.Tensor.from_host(array, queue=dev.queue)
    return netcl.Tensor.from_host(array, queue=dev.queue, dtype=dtype)


def param(array, dev, dtype=None):
    return netcl.Parameter(tensor(array, dev, dtype))


def host(x):
    """A Node or Tensor's value as a NumPy array."""
    if isinstance(x, netcl.Node):
        x = x.value
    return x.to_host()


@contextlib.contextmanager
def raises_naming(exc, *needles):
    """pytest.raises that also checks the message: each needle (or, for a tuple of needles,
    one of them) must appear in it."""
    with pytest.raises(exc) as info:
        yield info
    message = str(info.value)
    for needle in needles:
        options = needle if isinstance(needle, tuple) else (needle,)
        assert any(str(option) in message for option in options), (
            f"{' or '.join(map(repr, map(str, options)))} missing from error: {message!r}")


# ---------------------------------------------------------------------------------------------
# devices: the default device, NETCL_DEVICE, set_default, the device notice
# ---------------------------------------------------------------------------------------------

def test_default_cpu_device():
    dev = netcl.manager.default("cpu")
    assert dev.backend == "cpu"
    assert netcl.manager.default("cpu") is dev
    assert isinstance(dev.name, str) and dev.name
    assert dev.pool is netcl.manager.default("cpu").pool
    dev.finish()


def test_default_opencl_device(opencl):
    assert opencl.backend == "opencl"
    assert netcl.manager.default("opencl") is opencl
    assert netcl.manager.default("gpu").backend == "opencl"
    import pyopencl as cl
    assert isinstance(opencl.queue, cl.CommandQueue)
    opencl.finish()


def test_unknown_device_name_raises():
    with raises_naming(ValueError, "nonsense"):
        netcl.manager.default("nonsense")


def test_netcl_device_env_decides_default(monkeypatch):
    monkeypatch.setenv("NETCL_DEVICE", "cpu")
    assert netcl.manager.default() is netcl.manager.default("cpu")


def test_netcl_device_env_opencl(monkeypatch, opencl):
    monkeypatch.setenv("NETCL_DEVICE", "opencl")
    assert netcl.manager.default().backend == "opencl"
    monkeypatch.setenv("NETCL_DEVICE", "opencl:0:0")
    assert netcl.manager.default().backend == "opencl"
    # An explicit argument wins over the environment, both ways round.
    assert netcl.manager.default("cpu").backend == "cpu"
    monkeypatch.setenv("NETCL_DEVICE", "cpu")
    assert netcl.manager.default().backend == "cpu"
    assert netcl.manager.default("opencl").backend == "opencl"


def test_auto_without_opencl_gpu_is_cpu(monkeypatch):
    monkeypatch.delenv("NETCL_DEVICE", raising=False)
    try:
        import pyopencl as cl
        has_gpu = any(d.type & cl.device_type.GPU
                      for p in cl.get_platforms() for d in p.get_devices())
    except Exception:
        has_gpu = False
    expected = "opencl" if has_gpu else "cpu"
    assert netcl.manager.default().backend == expected
    assert netcl.manager.default("auto").backend == expected


# --- a machine without PyOpenCL

def _run_python(script, *flags, env=None, timeout=120):
    """Run `script` in a fresh interpreter (with `flags`) that imports this checkout's netcl;
    return its stdout."""
    here = os.path.dirname(os.path.abspath(netcl.__file__))
    script = f"import sys\nsys.path.insert(0, {here!r})\n" + script
    result = subprocess.run([sys.executable, *flags, "-c", script], env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_default_device_without_pyopencl_is_numpy_and_opencl_says_what_to_install(tmp_path):
    # pocl-binary-distribution installed without PyOpenCL leaves pyopencl/.libs and no
    # __init__.py. A regular package anywhere on sys.path wins over such a directory, so the
    # child runs without site-packages (-S) and sees only it and NumPy.
    site = tmp_path / "site"
    (site / "pyopencl" / ".libs").mkdir(parents=True)
    numpy_dir = pathlib.Path(np.__file__).parent
    for name in ("numpy", "numpy.libs"):  # numpy.libs: the BLAS a NumPy wheel links to
        if (numpy_dir.parent / name).exists():
            (site / name).symlink_to(numpy_dir.parent / name)
    env = {k: v for k, v in os.environ.items() if k != "NETCL_DEVICE"}
    env["PYTHONPATH"] = str(site)
    out = _run_python("""
import pyopencl
assert getattr(pyopencl, "__file__", None) is None, pyopencl  # the empty namespace package
import netcl
assert netcl.manager.default().backend == "cpu"
assert netcl.manager.default("auto") is netcl.manager.default("cpu")
for request in ("opencl", "gpu", "opencl:0:0"):
    try:
        netcl.manager.default(request)
    except RuntimeError as error:
        print(request, "->", error)
    else:
        raise AssertionError(f"default({request!r}) without PyOpenCL returned a device")
""", "-S", env=env)
    lines = out.splitlines()
    assert [line.split(" ->")[0] for line in lines] == ["opencl", "gpu", "opencl:0:0"], out
    for line in lines:
        assert "pip install pyopencl" in line and "pocl" in line.lower(), line


# --- manager.set_default, mixed devices, the device notice

@pytest.fixture
def chosen_default():
    """manager.set_default, undone after the test (the rest of the suite uses the usual
    NETCL_DEVICE-or-auto default)."""
    yield netcl.manager.set_default
    netcl.manager.set_default(None)


def _other(backend):
    """The other backend's Device: where a test's objects start before they are moved."""
    return _get_device("opencl" if backend.backend == "cpu" else "cpu")


def test_set_default_device_is_used_wherever_no_queue_is_given(backend, chosen_default, monkeypatch):
    assert chosen_default(backend.backend) is backend
    assert netcl.manager.default() is backend
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert netcl.Tensor.from_host(x).device is backend
    assert netcl.Tensor.empty((2,)).device is backend
    assert netcl.Parameter(x).device is backend
    assert netcl.Node(x).device is backend
    layers = [nn.Linear(3, 2), nn.Conv2d(1, 2, 3), nn.LayerNorm(3), nn.BatchNorm1d(3), nn.Embedding(4, 2)]
    assert all(p.device is backend for layer in layers for p in layer.parameters())
    assert layers[3].running_mean.device is backend
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    trainer = netcl.Trainer(lambda x: model(x), netcl.optim.SGD(model.parameters(), lr=0.1))
    assert trainer.device is backend  # a model without parameters(): the default device
    # A Device given works too; None goes back to NETCL_DEVICE, else auto.
    assert chosen_default(backend) is backend
    monkeypatch.setenv("NETCL_DEVICE", "cpu")
    assert chosen_default(None) is netcl.manager.default("cpu")
    assert netcl.Tensor.from_host(x).device.backend == "cpu"


def test_set_default_wins_over_netcl_device_and_default_kind_leaves_it(opencl, chosen_default, monkeypatch):
    monkeypatch.setenv("NETCL_DEVICE", "cpu")
    # Asking manager.default for a device does not make it the default (existing callers).
    assert netcl.manager.default("opencl") is opencl
    assert netcl.manager.default().backend == "cpu"
    assert chosen_default("opencl") is opencl
    assert netcl.manager.default() is opencl  # code's choice wins over the environment
    assert netcl.manager.default("cpu").backend == "cpu"  # an explicit argument wins over both
    with raises_naming(ValueError, "nonsense"):
        chosen_default("nonsense")
    assert netcl.manager.default() is opencl  # a rejected choice changes nothing


def test_mixed_device_errors_say_how_to_fix_them(opencl, cpu):
    fix = (".to(device)", "queue=device.queue")
    x = tensor(np.ones((2, 3), np.float32), cpu)
    w = param(np.ones((4, 3), np.float32), opencl)
    with raises_naming(ValueError, "linear", "different devices", "NumPy", opencl.name, *fix):
        F.linear(x, w)
    cond = tensor(np.array([1, 0, 1]), cpu)
    a = tensor(np.ones(3, np.float32), opencl)
    with raises_naming(ValueError, "where", "different devices", *fix):
        F.where(cond, a, a)
    with netcl.Tape() as tape:
        loss = (w * w).sum()
    with raises_naming(ValueError, "backward", "different devices", *fix):
        tape.backward(loss, grad=tensor(np.ones((), np.float32), cpu))


def _netcl_env(**extra):
    """The environment of a subprocess that imports this netcl.py, not an installed one."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(netcl.__file__)), **extra)
    env.pop("NETCL_DEVICE", None)
    return env


def test_device_notice_is_plain_words(opencl):
    import pyopencl as cl
    if opencl.cl_device.type & (cl.device_type.GPU | cl.device_type.ACCELERATOR):
        pytest.skip("the notice is printed for a CPU OpenCL device only")
    result = subprocess.run([sys.executable, "-c", "import netcl; netcl.manager.default('opencl')"],
                            env=_netcl_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (f"netcl: no OpenCL GPU found; using OpenCL CPU device "
            f"'{opencl.cl_device.name.strip()}' ({opencl.cl_device.platform.name.strip()})"
            in result.stderr), result.stderr
    assert "ALL" not in result.stderr  # not the type bitfield's string


# ---------------------------------------------------------------------------------------------
# BufferPool
# ---------------------------------------------------------------------------------------------

POOL_KEYS = {"in_use_bytes", "cached_bytes", "peak_bytes", "hits", "misses"}


def test_pool_reuses_a_released_size(backend):
    pool = backend.pool
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        pool.empty_cache()
        stats = pool.stats()
        assert POOL_KEYS <= set(stats)
        assert stats["cached_bytes"] == 0
        nbytes = 3 * 1024 * 1024 + 13
        buf = pool.alloc(nbytes)
        after_alloc = pool.stats()
        assert after_alloc["misses"] == stats["misses"] + 1
        assert after_alloc["in_use_bytes"] >= stats["in_use_bytes"] + nbytes
        assert after_alloc["peak_bytes"] >= after_alloc["in_use_bytes"]
        pool.release(buf)
        del buf
        after_release = pool.stats()
        assert after_release["in_use_bytes"] == stats["in_use_bytes"]
        assert after_release["cached_bytes"] >= nbytes
        buf = pool.alloc(nbytes)
        again = pool.stats()
        assert again["hits"] == after_release["hits"] + 1
        assert again["misses"] == after_release["misses"]
        assert again["cached_bytes"] < after_release["cached_bytes"]
        pool.release(buf)
        del buf
        pool.empty_cache()
        assert pool.stats()["cached_bytes"] == 0
    finally:
        if gc_was_enabled:
            gc.enable()


def test_tensor_buffer_returns_to_pool(backend):
    pool = backend.pool
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        before = pool.stats()["in_use_bytes"]
        t = netcl.Tensor.empty((1000, 37), queue=backend.queue)
        assert pool.stats()["in_use_bytes"] >= before + 1000 * 37 * 4
        del t
        assert pool.stats()["in_use_bytes"] == before
        hits = pool.stats()["hits"]
        t = netcl.Tensor.empty((1000, 37), queue=backend.queue)
        assert pool.stats()["hits"] == hits + 1
        del t
    finally:
        if gc_was_enabled:
            gc.enable()


def test_pool_impossible_request_raises_memory_error(backend):
    four_pib = 4 * 2 ** 50
    with pytest.raises(MemoryError):
        backend.pool.alloc(four_pib)
    with pytest.raises(MemoryError):
        netcl.Tensor.empty((four_pib // 4,), queue=backend.queue)
    # The pool still works afterwards.
    t = tensor(np.arange(6, dtype=np.float32), backend)
    np.testing.assert_array_equal(host(t), np.arange(6, dtype=np.float32))


def test_pool_stays_flat_over_training(backend):
    """300 SGD steps of a small MLP with the garbage collector off: buffers come back by
    reference counting alone, so bytes in use stay flat and almost every allocation hits."""
    model = _mlp(backend)
    opt = netcl.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((300, 16, 20)).astype(np.float32)
    ys = rng.integers(0, 10, size=(300, 16))
    in_use, stats_at = [], {}
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for step in range(301):
            xb = tensor(xs[step % 300], backend)
            with netcl.Tape() as tape:
                loss = F.cross_entropy(model(xb), ys[step % 300])
            opt.zero_grad()
            tape.backward(loss)
            opt.step()
            del xb, loss, tape
            backend.finish()
            stats = backend.pool.stats()
            in_use.append(stats["in_use_bytes"])
            stats_at[step] = stats
    finally:
        if gc_was_enabled:
            gc.enable()
    later = in_use[50:]
    assert max(later) == in_use[50] and min(later) == in_use[50], (
        f"in_use_bytes drifts: at step 50 {in_use[50]}, min {min(later)}, max {max(later)}, "
        f"at step 300 {in_use[300]}")
    hits = stats_at[300]["hits"] - stats_at[50]["hits"]
    misses = stats_at[300]["misses"] - stats_at[50]["misses"]
    assert hits > 0, "no pool hits at all in steps 50..300"
    assert hits > 0.9 * (hits + misses), f"hits {hits}, misses {misses} over steps 50..300"


def test_pool_alloc_takes_a_non_negative_int(backend):
    for bad in (1.5, "8", None, True, np.float32(4)):
        with raises_naming(TypeError, "alloc", "nbytes", repr(bad)):
            backend.pool.alloc(bad)
    with raises_naming(ValueError, "alloc", "nbytes", "-5"):
        backend.pool.alloc(-5)
    backend.pool.release(backend.pool.alloc(np.int64(0)))


def test_pool_release_refuses_a_buffer_it_does_not_own(backend):
    pool = backend.pool
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection in between would release tensors and move the stats
    try:
        first = pool.alloc(5000)
        pool.release(first)
        before = pool.stats()
        with raises_naming(ValueError, "release", "released already"):
            pool.release(first)
        assert pool.stats() == before
        a, b = pool.alloc(5000), pool.alloc(5000)
        assert a is not b  # a double release would have cached `first` twice
        # Foreign buffers: another pool's, a plain array, a tensor's view (NumPy backend) or a
        # tensor of the other backend.
        view = netcl.Tensor.empty((8,), queue=backend.queue)
        elsewhere = netcl.Tensor.empty((8,), queue=netcl.manager.default("cpu").queue)
        foreign = [netcl.BufferPool(lambda nbytes: np.empty(nbytes, np.uint8)).alloc(5000),
                   np.empty(5000, np.uint8),
                   view.data if backend.backend == "cpu" else elsewhere.data]
        before = pool.stats()
        for buffer in foreign:
            with raises_naming(ValueError, "release", "allocated elsewhere"):
                pool.release(buffer)
        assert pool.stats() == before
        pool.release(a)
        pool.release(b)
        del view, elsewhere
    finally:
        if gc_was_enabled:
            gc.enable()


# ---------------------------------------------------------------------------------------------
# Tensor: round trips, dtypes, views, .to()
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32])
def test_tensor_round_trip(backend, dtype):
    rng = np.random.default_rng(1)
    array = (rng.standard_normal((7, 13)) * 100).astype(dtype)
    t = tensor(array, backend)
    assert np.dtype(t.dtype) == np.dtype(dtype)
    assert tuple(t.shape) == (7, 13)
    assert t.size == 91
    assert t.device is backend
    assert t.queue is backend.queue
    out = t.to_host()
    assert isinstance(out, np.ndarray)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, array)


def test_tensor_float64_becomes_float32(backend):
    array = np.linspace(-1, 1, 12).reshape(3, 4)
    t = netcl.Tensor.from_host(array, queue=backend.queue)
    assert np.dtype(t.dtype) == np.float32
    np.testing.assert_array_equal(t.to_host(), array.astype(np.float32))


def test_tensor_from_host_copies(backend):
    array = np.arange(12, dtype=np.float32)
    t = tensor(array, backend)
    array[:] = -1
    out = t.to_host()
    np.testing.assert_array_equal(out, np.arange(12, dtype=np.float32))
    out[:] = 5
    np.testing.assert_array_equal(t.to_host(), np.arange(12, dtype=np.float32))


def test_tensor_empty(backend):
    t = netcl.Tensor.empty((4, 5), queue=backend.queue)
    assert tuple(t.shape) == (4, 5) and np.dtype(t.dtype) == np.float32
    t = netcl.Tensor.empty((3,), dtype=np.int32, queue=backend.queue)
    assert tuple(t.shape) == (3,) and np.dtype(t.dtype) == np.int32
    assert t.to_host().shape == (3,)


def _shares_buffer(a, b, dev):
    if dev.backend == "cpu":
        return np.shares_memory(a.data, b.data)
    return a.data is b.data or a.data.int_ptr == b.data.int_ptr


def test_reshape_is_a_view(backend):
    array = np.arange(24, dtype=np.float32).reshape(4, 6)
    t = tensor(array, backend)
    r = t.reshape((2, 12))
    assert tuple(r.shape) == (2, 12)
    assert _shares_buffer(r, t, backend)
    np.testing.assert_array_equal(r.to_host(), array.reshape(2, 12))
    r = t.reshape((3, -1, 2))
    assert tuple(r.shape) == (3, 4, 2)
    assert _shares_buffer(r, t, backend)
    # Through the ops too: reshape and flatten of a Node view its value.
    x = netcl.Node(tensor(np.arange(24, dtype=np.float32).reshape(2, 3, 4), backend))
    assert _shares_buffer(F.reshape(x, (6, 4)).value, x.value, backend)
    assert _shares_buffer(F.flatten(x).value, x.value, backend)


def test_from_host_refuses_integers_outside_int32(backend):
    for values, needle in (([0, 2**32 + 1], 2**32 + 1), ([-(2**31) - 1], -(2**31) - 1),
                           (np.array([3, 2**63], np.uint64), 2**63),
                           (np.array([2**31], np.uint32), 2**31)):
        with raises_naming(ValueError, "from_host", needle):
            tensor(np.array(values), backend)
    edges = np.array([-(2**31), 2**31 - 1, 0])
    np.testing.assert_array_equal(host(tensor(edges, backend)), edges)
    with raises_naming(TypeError, "from_host", "complex"):
        netcl.Tensor.from_host(np.array([1 + 5j]), backend.queue, np.float32)
    with raises_naming(TypeError, "from_host", "object"):
        tensor(np.array([1, None]), backend)
    logits = tensor(np.zeros((2, 3)), backend)
    with raises_naming(ValueError, "cross_entropy", 2**32 + 1):
        F.cross_entropy(logits, np.array([0, 2**32 + 1]))


def test_tensor_to_and_node_to(backend):
    source = _other(backend)
    values = np.array([[1.0, -2.0, 3.0]], np.float32)
    t = tensor(values, source)
    assert t.to(source) is t and t.to(source.queue) is t
    moved = t.to(backend)
    assert moved.device is backend and moved.dtype == np.float32
    np.testing.assert_array_equal(moved.to_host(), values)
    half = tensor(values, source, np.float16).to(backend)
    assert half.dtype == np.float16
    labels = tensor(np.array([2, 0, 1]), source).to(backend)
    assert labels.dtype == np.int32
    np.testing.assert_array_equal(labels.to_host(), [2, 0, 1])
    if backend.backend == "opencl":  # label tensors keep the host copy the Trainer checks
        np.testing.assert_array_equal(labels._labels, [2, 0, 1])
    with raises_naming(ValueError, "Tensor.to", "nonsense"):
        t.to("nonsense")
    # Node.to: a new node there; inside a Tape the gradient comes back to the source device.
    w = netcl.Parameter(tensor(values, source))
    assert w.to(source) is w
    with netcl.Tape() as tape:
        on_backend = w.to(backend)
        loss = (on_backend * on_backend).sum()
    assert on_backend.device is backend and not isinstance(on_backend, netcl.Parameter)
    tape.backward(loss)
    assert w.grad.device is source
    np.testing.assert_allclose(host(w.grad), 2 * values)


def test_tensor_to_copies_what_the_device_holds_not_a_host_copy(opencl, cpu):
    """An int32 tensor written from the host keeps that host copy, but the device may change
    it later (Adam's step count counts on the device): .to() copies the current contents."""
    model = nn.Linear(2, 2, queue=opencl.queue)
    opt = netcl.optim.AdamW(model.parameters())
    with netcl.Tape() as tape:
        loss = (model(tensor(np.ones((1, 2), np.float32), opencl)) ** 2).sum()
    tape.backward(loss)
    opt.step()
    np.testing.assert_array_equal(opt._step_count.to(cpu).to_host(), [1])
    np.testing.assert_array_equal(opt._step_count.to(cpu).to(opencl)._labels, [1])


# ---------------------------------------------------------------------------------------------
# autograd: Tape semantics, nested Tapes, threads
# ---------------------------------------------------------------------------------------------

def test_fan_out_gradients_are_summed(backend):
    rng = np.random.default_rng(6)
    x_host = rng.standard_normal((5, 4)).astype(np.float32)
    a = rng.standard_normal((5, 4)).astype(np.float32)
    x = param(x_host, backend)
    with netcl.Tape() as tape:
        loss = F.sum(x * a) + F.sum(F.exp(x)) + (x * x).sum()
    tape.backward(loss)
    expected = a + np.exp(x_host) + 2 * x_host
    np.testing.assert_allclose(host(x.grad), expected, rtol=1e-5, atol=1e-6)
    # An intermediate node feeding two ops.
    z = param(x_host, backend)
    with netcl.Tape() as tape:
        h = F.tanh(z)
        loss = F.sum(h * a) + F.sum(F.exp(h))
    tape.backward(loss)
    t = np.tanh(x_host)
    np.testing.assert_allclose(host(z.grad), (a + np.exp(t)) * (1 - t ** 2), rtol=1e-5,
                               atol=1e-6)


def test_two_backward_passes_accumulate(backend):
    rng = np.random.default_rng(7)
    w_host = rng.standard_normal((3, 4)).astype(np.float32)
    x_host = rng.standard_normal((6, 4)).astype(np.float32)
    w = param(w_host, backend)
    grads = []
    for _ in range(3):
        with netcl.Tape() as tape:
            loss = F.sum(F.tanh(F.linear(x_host, w)))
        tape.backward(loss)
        grads.append(host(w.grad))
    expected = ((1 - np.tanh(x_host @ w_host.T) ** 2).T @ x_host)
    np.testing.assert_allclose(grads[0], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads[1], 2 * grads[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grads[2], 3 * grads[0], rtol=1e-6, atol=1e-6)


def test_backward_inside_and_after_the_with_block(backend):
    x_host = np.array([[1.0, -2.0, 3.0]], np.float32)
    x = param(x_host, backend)
    with netcl.Tape() as tape:
        loss = (x * x).sum()
        tape.backward(loss)
    np.testing.assert_allclose(host(x.grad), 2 * x_host)
    y = param(x_host, backend)
    with netcl.Tape() as tape:
        loss = (y * y * y).sum()
    tape.backward(loss)
    np.testing.assert_allclose(host(y.grad), 3 * x_host ** 2, rtol=1e-6)


def test_values_readable_after_backward(backend):
    rng = np.random.default_rng(8)
    x_host = rng.standard_normal((4, 3)).astype(np.float32)
    w_host = rng.standard_normal((3, 5)).astype(np.float32)
    x, w = param(x_host, backend), param(w_host, backend)
    with netcl.Tape() as tape:
        h = x @ w
        r = F.relu(h)
        loss = r.mean()
    tape.backward(loss)
    np.testing.assert_allclose(host(h), x_host @ w_host, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(host(r), np.maximum(x_host @ w_host, 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(host(loss), np.maximum(x_host @ w_host, 0).mean(), rtol=1e-5)
    assert host(loss).shape == ()
    np.testing.assert_allclose(host(x), x_host)


def test_a_dropped_intermediate_goes_back_to_the_pool_inside_a_tape(backend):
    """The graph keeps what backward needs, not every output: a pre-activation the program
    drops inside a Tape is back in the pool at once (ReLU saved its output, as PyTorch's),
    and the gradient is still right."""
    rng = np.random.default_rng(8)
    x_host = rng.standard_normal((64, 32)).astype(np.float32)
    w_host = rng.standard_normal((32, 48)).astype(np.float32)
    x, w = tensor(x_host, backend), param(w_host, backend)
    pool = backend.pool
    gc_was_enabled = gc.isenabled()
    gc.disable()  # only reference counts free buffers here
    try:
        with netcl.Tape() as tape:
            h = x @ w
            held = pool.stats()["in_use_bytes"]
            r = F.relu(h)
            assert pool.stats()["in_use_bytes"] > held  # r's buffer
            del h
            assert pool.stats()["in_use_bytes"] == held  # h's went back
            loss = r.sum()
        tape.backward(loss)
    finally:
        if gc_was_enabled:
            gc.enable()
    expected = x_host.T @ (x_host @ w_host > 0).astype(np.float32)
    np.testing.assert_allclose(host(w.grad), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["array", "tensor", "node"])
def test_backward_grad_argument_kinds(backend, kind):
    rng = np.random.default_rng(9)
    x_host = rng.standard_normal((3, 4)).astype(np.float32)
    g = rng.standard_normal((3, 4)).astype(np.float32)
    grad = {"array": g, "tensor": tensor(g, backend),
            "node": netcl.Node(tensor(g, backend))}[kind]
    x = param(x_host, backend)
    with netcl.Tape() as tape:
        y = F.sigmoid(x)
    tape.backward(y, grad=grad)
    s = 1 / (1 + np.exp(-x_host))
    np.testing.assert_allclose(host(x.grad), g * s * (1 - s), rtol=1e-5, atol=1e-6)


def test_ops_outside_a_tape_keep_no_graph(backend):
    x = param(np.ones((64, 64), np.float32), backend)
    middle = x * 2.0
    alive = weakref.ref(middle.value)
    y = middle * x                     # a recorded mul would save `middle` for its backward
    del middle
    gc.collect()
    assert alive() is None, "an op outside a Tape kept its input alive"
    np.testing.assert_array_equal(host(y), np.full((64, 64), 2.0, np.float32))


def test_value_from_outside_tape_is_constant(backend):
    x_host = np.array([1.0, 2.0, -3.0], np.float32)
    x = param(x_host, backend)
    y = x * 3.0                        # outside any Tape
    with netcl.Tape() as tape:
        loss = (y * x).sum()
    tape.backward(loss)
    np.testing.assert_allclose(host(x.grad), 3 * x_host)


def test_no_grad_records_nothing_inside_a_tape(backend):
    x_host = np.array([[0.5, -1.5], [2.0, 1.0]], np.float32)
    x = param(x_host, backend)
    with netcl.Tape() as tape:
        with netcl.no_grad():
            y = x * 2.0
        loss = (y * x).sum()
    tape.backward(loss)
    np.testing.assert_allclose(host(x.grad), 2 * x_host)      # 4 * x if y were recorded


def test_ops_accept_tensors_and_arrays(backend):
    rng = np.random.default_rng(10)
    a_host = rng.standard_normal((3, 4)).astype(np.float32)
    b_host = rng.standard_normal((4, 2)).astype(np.float32)
    out = F.matmul(tensor(a_host, backend), b_host)
    assert isinstance(out, netcl.Node)
    assert out.value.device is backend
    np.testing.assert_allclose(host(out), a_host @ b_host, rtol=1e-5, atol=1e-6)
    x = param(a_host, backend)
    with netcl.Tape() as tape:
        loss = F.sum(F.add(x, a_host) * a_host)
    tape.backward(loss)
    np.testing.assert_allclose(host(x.grad), a_host, rtol=1e-6)
    assert tuple(x.shape) == (3, 4)


@pytest.mark.parametrize("call, op, sizes", [
    (lambda a, b: F.matmul(a((3, 47)), b((53, 6))), "matmul", (47, 53)),
    (lambda a, b: a((3, 47)) @ b((53, 6)), "matmul", (47, 53)),
    (lambda a, b: F.linear(a((5, 17)), b((4, 19))), "linear", (17, 19)),
    (lambda a, b: F.linear(a((5, 17)), b((4, 17)), b((23,))), "linear", (4, 23)),
    (lambda a, b: F.add(a((3, 41)), b((41, 3))), "add", (41,)),
    (lambda a, b: F.sub(a((3, 41)), b((41, 3))), "sub", (41,)),
    (lambda a, b: F.mul(a((3, 41)), b((41, 3))), "mul", (41,)),
    (lambda a, b: F.div(a((3, 41)), b((41, 3))), "div", (41,)),
    (lambda a, b: F.add(a((3, 41)), b((37,))), "add", (41, 37)),
    (lambda a, b: F.mse_loss(a((3, 41)), b((3, 37))), "mse_loss", (41, 37)),
    (lambda a, b: F.reshape(a((3, 41)), (7, -1)), "reshape", (7, ("41", "123"))),
])
def test_shape_errors_name_op_and_sizes(backend, call, op, sizes):
    def make(shape):
        return param(np.ones(shape, np.float32), backend)
    with raises_naming(ValueError, op, *sizes):
        call(make, make)


def test_cross_entropy_target_length_mismatch(backend):
    with raises_naming(ValueError, "cross_entropy", 7, 4):
        F.cross_entropy(param(np.zeros((7, 3), np.float32), backend), np.zeros(4, np.int64))


def test_mixing_devices_raises(cpu, opencl):
    a = param(np.ones((2, 3), np.float32), cpu)
    b = param(np.ones((2, 3), np.float32), opencl)
    with pytest.raises(ValueError):
        F.add(a, b)
    with pytest.raises(ValueError):
        F.matmul(b, param(np.ones((3, 2), np.float32), cpu))


def test_first_gradients_are_copies_unless_the_op_owns_them(backend, monkeypatch):
    """A leaf's first gradient is stored, later ones are added in place (PyTorch). It is
    stored as a copy where an op's backward may hand one buffer to two parents (add gives
    both its gradient), so no two leaves share one and adding into one leaves the other as
    it was; conv2d's gradients are new tensors of its own (_Owned), stored without a copy,
    and later gradients are added into them."""
    copies = []
    copy = netcl._copy
    monkeypatch.setattr(netcl, "_copy", lambda *args, **kwargs: (
        copies.append(1), copy(*args, **kwargs))[1])
    rng = np.random.default_rng(0)
    a, b = (param(rng.standard_normal((2, 3)).astype(np.float32), backend) for _ in range(2))
    g = rng.standard_normal((2, 3)).astype(np.float32)
    with netcl.Tape() as tape:
        out = a + b
    tape.backward(out, grad=g)
    assert len(copies) == 2 and not _shares_buffer(a.grad, b.grad, backend)
    with netcl.Tape() as tape:
        out = a * 3.0
    tape.backward(out, grad=g)
    np.testing.assert_allclose(host(a.grad), 4 * g, rtol=1e-6)
    np.testing.assert_array_equal(host(b.grad), g)

    arrays = [rng.standard_normal(shape).astype(np.float32)
              for shape in ((2, 3, 5, 5), (4, 3, 3, 3), (4,))]
    leaves = [param(array, backend) for array in arrays]
    seed = rng.standard_normal((2, 4, 5, 5)).astype(np.float32)
    copies.clear()
    firsts = []
    for _ in range(2):
        with netcl.Tape() as tape:
            out = F.conv2d(*leaves, padding=1)
        tape.backward(out, grad=seed)
        firsts = firsts or [host(p.grad) for p in leaves]
    assert copies == []
    for p, first in zip(leaves, firsts):
        np.testing.assert_allclose(host(p.grad), 2 * first, rtol=1e-5, atol=1e-5)


# --- nested Tapes and threads

def test_nested_tapes_outer_backward_runs_through_the_inner_tape(backend):
    p = param(np.ones(3), backend)
    with netcl.Tape() as outer:
        a = p * 2.0
        with netcl.Tape() as inner:
            loss = (a * 3.0).sum()
    outer.backward(loss)
    np.testing.assert_array_equal(host(p.grad), np.full(3, 6.0, np.float32))
    with raises_naming(RuntimeError, "backward", "already freed by a backward"):
        inner.backward(loss)  # outer's backward freed the nodes the two tapes share
    np.testing.assert_array_equal(host(p.grad), np.full(3, 6.0, np.float32))


def test_nested_tapes_inner_backward_sees_only_its_own_ops(backend):
    p = param(np.ones(3), backend)
    q_host = np.array([1.0, 2.0, 3.0], np.float32)
    q = param(q_host, backend)
    with netcl.Tape() as outer:
        a = p * 2.0
        with netcl.Tape() as inner:
            loss = (a * 3.0 + q * q).sum()
    inner.backward(loss)
    assert p.grad is None  # `a` was computed before the inner Tape opened: a constant there
    np.testing.assert_array_equal(host(q.grad), 2 * q_host)
    with raises_naming(RuntimeError, "backward", "already freed by a backward"):
        outer.backward(loss)
    assert p.grad is None


def test_nested_tapes_refuse_a_partial_gradient_through_freed_nodes(backend):
    p = param(np.ones(3), backend)
    with netcl.Tape() as outer:
        a = p * 2.0
        with netcl.Tape() as inner:
            b = a * 3.0
            inner_loss = b.sum()
        inner.backward(inner_loss)  # frees b, which the outer Tape recorded too
        loss = (b * p).sum()        # d/dp = 12 through b and a; b's graph is gone
    with raises_naming(RuntimeError, "backward", "freed"):
        outer.backward(loss)


def test_backward_of_a_loss_recorded_on_another_tape_raises(backend):
    p = param(np.ones(3), backend)
    other = netcl.Tape()
    with netcl.Tape() as tape:
        loss = (p * 2.0).sum()
    with raises_naming(RuntimeError, "backward", "another Tape"):
        other.backward(loss)
    with raises_naming(RuntimeError, "backward", "another Tape"):
        other.backward(netcl.AMPGradScaler(init_scale=4.0).scale(loss))
    assert p.grad is None
    tape.backward(loss)  # the refused calls left the graph whole
    np.testing.assert_array_equal(host(p.grad), np.full(3, 2.0, np.float32))


@contextlib.contextmanager
def _held_in_another_thread(context):
    """Enter `context()` in a second thread and keep it entered while the block runs here."""
    entered, done = threading.Event(), threading.Event()

    def hold():
        with context():
            entered.set()
            done.wait(10)
    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert entered.wait(10)
        yield
    finally:
        done.set()
        holder.join()


def _in_threads(*targets):
    """Run each target in its own thread, all started together and switching often (the races
    need a switch at the wrong moment); their results, or the first error raised in one."""
    results, errors = [None] * len(targets), []
    barrier = threading.Barrier(len(targets))

    def run(i, target):
        try:
            barrier.wait()
            results[i] = target()
        except BaseException as error:  # re-raised in the test's thread
            errors.append(error)
    threads = [threading.Thread(target=run, args=(i, t)) for i, t in enumerate(targets)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]
    return results


def test_one_kernel_launched_from_two_threads_gets_each_launch_its_own_arguments(opencl):
    """Device.launch from two threads at once: every result belongs to its own launch,
    uploads and counters included."""
    steps = 3000

    def launch_many(seed, n):
        rng = np.random.default_rng(seed)
        a_host = rng.standard_normal(n).astype(np.float32)
        a = netcl.Tensor.empty((n,), queue=opencl.queue)
        opencl.upload(a.data, a_host)
        outs = [netcl.Tensor.empty((n,), queue=opencl.queue) for _ in range(steps)]
        for i, out in enumerate(outs):  # out = a * i
            opencl.launch("mul_scalar", *netcl._grid(n), n, float(i), a.data, out.data)
            if i % 100 == 0:
                opencl.finish()
        return a_host, outs
    launches = opencl.launches
    results = _in_threads(lambda: launch_many(3, 37), lambda: launch_many(4, 53))
    assert opencl.launches - launches == 2 * steps
    for a_host, outs in results:
        for i, out in enumerate(outs):
            np.testing.assert_array_equal(out.to_host(), a_host * np.float32(i))


def test_buffer_pool_shared_by_two_threads_keeps_its_books():
    """One thread allocating and releasing, the other also emptying the cache: no buffer is
    handed out twice, and the stats add up to what the pool really holds."""
    pool = netcl.BufferPool(lambda nbytes: np.empty(nbytes, np.uint8))
    holders = {}

    def churn(me, empty_cache):
        for _ in range(2000):
            held = [pool.alloc(256) for _ in range(3)]
            for buffer in held:
                assert holders.setdefault(id(buffer), me) == me, "one buffer handed out twice"
            for buffer in held:
                del holders[id(buffer)]
                pool.release(buffer)
            if empty_cache:
                pool.empty_cache()
            assert pool.stats()["cached_bytes"] >= 0
    _in_threads(lambda: churn(0, False), lambda: churn(1, True))
    stats = pool.stats()
    assert stats["in_use_bytes"] == 0
    assert stats["hits"] + stats["misses"] == 2 * 2000 * 3
    cached = stats["cached_bytes"] // 256
    for _ in range(cached + 1):  # every cached buffer is a hit, then the next one a miss
        pool.alloc(256)
    after = pool.stats()
    assert (after["hits"] - stats["hits"], after["misses"] - stats["misses"]) == (cached, 1)
    assert after["cached_bytes"] == 0


def test_two_threads_asking_for_one_queue_get_one_device(opencl):
    import pyopencl as cl
    queue = cl.CommandQueue(opencl.context)
    first, second = _in_threads(lambda: netcl.Tensor.empty((1,), queue=queue).device,
                                lambda: netcl.Tensor.empty((1,), queue=queue).device)
    assert first is second


def _train_own_parameter(device, seed, rows, cols, steps):
    """`steps` SGD steps on a parameter of this call's own: (final weight, final gradient)."""
    rng = np.random.default_rng(seed)
    x = tensor(rng.standard_normal((rows, cols)).astype(np.float32), device)
    y = tensor(rng.standard_normal((rows, 3)).astype(np.float32), device)
    w = param(0.5 * rng.standard_normal((3, cols)).astype(np.float32), device)
    opt = netcl.SGD([w], lr=0.05, momentum=0.9)
    for _ in range(steps):
        with netcl.Tape() as tape:
            loss = F.mse_loss(F.tanh(F.linear(x, w)), y)
        opt.zero_grad()
        tape.backward(loss)
        opt.step()
    return host(w), host(w.grad)


def test_two_threads_training_own_parameters_match_one_thread(backend):
    jobs = [(backend, 1, 8, 5, 300), (backend, 2, 16, 7, 300)]
    expected = [_train_own_parameter(*job) for job in jobs]
    got = _in_threads(*(lambda job=job: _train_own_parameter(*job) for job in jobs))
    for (w, grad), (w_expected, grad_expected) in zip(got, expected):
        np.testing.assert_array_equal(grad, grad_expected)
        np.testing.assert_array_equal(w, w_expected)


def test_a_tape_records_only_the_ops_of_its_own_thread(backend):
    p = param(np.ones(3), backend)
    with netcl.Tape() as tape:
        (elsewhere,) = _in_threads(lambda: (p * 5.0).sum())
        loss = (p * 2.0).sum()
    assert not elsewhere.requires_grad  # no Tape is open in the thread that computed it
    tape.backward(loss)
    np.testing.assert_array_equal(host(p.grad), np.full(3, 2.0, np.float32))
    with raises_naming(RuntimeError, "Tape", "thread"):
        _in_threads(netcl.Tape().__enter__, lambda: None)[0].__exit__(None, None, None)


def test_no_grad_is_per_thread(backend):
    p = param(np.array([1.0, -2.0, 3.0], np.float32), backend)
    with _held_in_another_thread(netcl.no_grad):
        with netcl.Tape() as tape:
            loss = (p * p).sum()
        tape.backward(loss)
    np.testing.assert_array_equal(host(p.grad), [2.0, -4.0, 6.0])

    def train_in_new_thread():  # a new thread records, whatever the starting thread's mode
        q = param(np.ones(2), backend)
        with netcl.Tape() as tape:
            loss = (q * 4.0).sum()
        tape.backward(loss)
        return host(q.grad)
    with netcl.no_grad():
        (grad,) = _in_threads(train_in_new_thread)
    np.testing.assert_array_equal(grad, [4.0, 4.0])


def test_autocast_is_per_thread(portable_half):
    opencl = portable_half  # a device where autocast stores float16
    x = param(np.ones((4, 8), np.float32), opencl)
    w = param(np.ones((8, 2), np.float32), opencl)
    with _held_in_another_thread(netcl.autocast):
        assert (x @ w).dtype == np.float32
    with netcl.autocast():
        assert (x @ w).dtype == np.float16
        (elsewhere,) = _in_threads(lambda: x @ w)  # a new thread starts with autocast off
    assert elsewhere.dtype == np.float32


# ---------------------------------------------------------------------------------------------
# operations: the CASES registry, then each family's edges and errors
# ---------------------------------------------------------------------------------------------

# --- core ops: cases shared by the finite-difference and the cross-backend tests
# A case builds the inputs of one op from Hypothesis draws and a NumPy generator:
# fn(*nodes, *consts) runs the op; ref(*arrays) is its NumPy float64 reference (None where the
# output is random, as dropout's); inputs get gradients, consts do not (float consts become
# Tensors of the input dtype, integer ones stay NumPy arrays); tol is "ew" (elementwise) or
# "acc" (a sum inside: GEMM, reductions, losses); seed is set with manual_seed before each
# forward (dropout).

Case = namedtuple("Case", "fn ref inputs consts tol seed", defaults=((), "ew", None))


SMALL_DIM = st.integers(1, 4)                       # finite differences: few elements


DIM = st.integers(1, 40)


GEMM_DIM = st.one_of(st.integers(1, 70), st.sampled_from([64, 65, 127, 128, 129]))


def _dim(draw, fd, strategy=DIM):
    return draw(SMALL_DIM if fd else strategy)


def _shape(draw, fd, min_ndim=1, max_ndim=3):
    ndim = draw(st.integers(min_ndim, max_ndim))
    if not fd and ndim == 1 and draw(st.booleans()):
        return (draw(st.integers(1000, 5000)),)      # crosses work-group boundaries
    return tuple(_dim(draw, fd) for _ in range(ndim))


def _away_from_zero(rng, shape, low=0.2, high=2.0):
    """Values with |x| in [low, high]: no kinks (relu) and no poles (div) nearby."""
    return rng.choice([-1.0, 1.0], size=shape) * rng.uniform(low, high, size=shape)


def _erf(x):
    return np.vectorize(math.erf)(x)


def _log_softmax(x, axis=-1):
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


def _reduce(losses, reduction):
    return {"mean": losses.mean(), "sum": losses.sum(), "none": losses}[reduction]


def _cross_entropy_ref(logits, target, reduction):
    log_probs = _log_softmax(logits)
    if target.ndim == 1:
        losses = -log_probs[np.arange(len(target)), target]
    else:
        losses = -(target * log_probs).sum(axis=1)
    return _reduce(losses, reduction)


CASES = {}


def case(name):
    def register(builder):
        CASES[name] = builder
        return builder
    return register


@case("matmul")
def _(draw, rng, fd):
    m, k, n = (_dim(draw, fd, GEMM_DIM) for _ in range(3))
    return Case(F.matmul, np.matmul,
                [rng.standard_normal((m, k)), rng.standard_normal((k, n))], tol="acc")


def _batch_dims(draw, fd):
    """A batch shape of 1 or 2 dimensions for batched matmul (sizes from 0 up)."""
    return tuple(draw(st.integers(0 if fd else 1, 3)) for _ in range(draw(st.integers(1, 2))))


@case("matmul_batched")
def _(draw, rng, fd):  # (..., M, K) @ (..., K, N), equal batch dimensions
    batch = _batch_dims(draw, fd)
    m, k, n = (_dim(draw, fd, GEMM_DIM) for _ in range(3))
    return Case(F.matmul, np.matmul, [rng.standard_normal(batch + (m, k)),
                                      rng.standard_normal(batch + (k, n))], tol="acc")


@case("matmul_broadcast_batch")
def _(draw, rng, fd):  # batch dimensions that broadcast against each other: (2, 1) and (3,)
    m, k, n = (_dim(draw, fd, GEMM_DIM) for _ in range(3))
    outer, inner = draw(st.integers(1, 3)), draw(st.integers(2, 3))
    a_batch, b_batch = draw(st.sampled_from([((outer, 1), (inner,)), ((1, inner), (outer, 1)),
                                             ((outer, inner), (1, inner))]))
    return Case(F.matmul, np.matmul, [rng.standard_normal(a_batch + (m, k)),
                                      rng.standard_normal(b_batch + (k, n))], tol="acc")


@case("matmul_shared_operand")
def _(draw, rng, fd):  # a batch against one matrix, on either side (its gradient is a sum)
    batch = _batch_dims(draw, fd)
    m, k, n = (_dim(draw, fd, GEMM_DIM) for _ in range(3))
    left = draw(st.booleans())
    a = rng.standard_normal((m, k) if left else batch + (m, k))
    b = rng.standard_normal(batch + (k, n) if left else (k, n))
    return Case(F.matmul, np.matmul, [a, b], tol="acc")


@case("matmul_vector")
def _(draw, rng, fd):  # 1-D operands: a row on the left, a column on the right, a dot product
    k = _dim(draw, fd, GEMM_DIM)
    kind = draw(st.sampled_from(["vector_batch", "batch_vector", "dot"]))
    batch = _batch_dims(draw, fd)
    m = _dim(draw, fd, GEMM_DIM)
    a = rng.standard_normal((k,) if kind != "batch_vector" else batch + (m, k))
    b = rng.standard_normal((k,) if kind != "vector_batch" else batch + (k, m))
    return Case(F.matmul, np.matmul, [a, b], tol="acc")


@case("matmul_operator")
def _(draw, rng, fd):
    m, k, n = (_dim(draw, fd, GEMM_DIM) for _ in range(3))
    return Case(lambda a, b: a @ b, np.matmul,
                [rng.standard_normal((m, k)), rng.standard_normal((k, n))], tol="acc")


@case("linear")
def _(draw, rng, fd):
    n, d_in, d_out = (_dim(draw, fd, GEMM_DIM) for _ in range(3))
    return Case(F.linear, lambda x, w, b: x @ w.T + b,
                [rng.standard_normal((n, d_in)), rng.standard_normal((d_out, d_in)),
                 rng.standard_normal(d_out)], tol="acc")


@case("linear_no_bias")
def _(draw, rng, fd):
    n, d_in, d_out = (_dim(draw, fd, GEMM_DIM) for _ in range(3))
    return Case(lambda x, w: F.linear(x, w), lambda x, w: x @ w.T,
                [rng.standard_normal((n, d_in)), rng.standard_normal((d_out, d_in))], tol="acc")


BINARY = {
    "add": (F.add, lambda a, b: a + b, np.add),
    "sub": (F.sub, lambda a, b: a - b, np.subtract),
    "mul": (F.mul, lambda a, b: a * b, np.multiply),
    "div": (F.div, lambda a, b: a / b, np.divide),
}


def _binary_cases(name, functional, operator, ref):
    @case(name)
    def _(draw, rng, fd):
        shape = _shape(draw, fd)
        return Case(functional, ref, [rng.standard_normal(shape), _away_from_zero(rng, shape)])

    @case(name + "_operator")
    def _(draw, rng, fd):
        shape = _shape(draw, fd)
        return Case(operator, ref, [rng.standard_normal(shape), _away_from_zero(rng, shape)])

    @case(name + "_row_broadcast")
    def _(draw, rng, fd):
        rows, cols = _dim(draw, fd), _dim(draw, fd)
        return Case(functional, ref,
                    [rng.standard_normal((rows, cols)), _away_from_zero(rng, (cols,))],
                    tol="acc")       # the row's gradient is a sum over rows

    @case(name + "_scalar_right")
    def _(draw, rng, fd):
        shape = _shape(draw, fd)
        return Case(lambda x: operator(x, 1.75), lambda x: ref(x, 1.75),
                    [rng.standard_normal(shape)])

    @case(name + "_scalar_left")
    def _(draw, rng, fd):
        shape = _shape(draw, fd)
        return Case(lambda x: operator(-2.5, x), lambda x: ref(-2.5, x),
                    [_away_from_zero(rng, shape)])

    @case(name + "_functional_scalar")
    def _(draw, rng, fd):
        shape = _shape(draw, fd)
        return Case(lambda x: functional(x, 0.5), lambda x: ref(x, 0.5),
                    [rng.standard_normal(shape)])


for _name, (_functional, _operator, _ref) in BINARY.items():
    _binary_cases(_name, _functional, _operator, _ref)


# Broadcast operands: NumPy's rule is the reference (np.add etc. broadcast as PyTorch does).
def _broadcast_pair(draw, fd):
    """Two shapes that broadcast, drawn dimension by dimension of the output (0 to 4 of them):
    a size (now and then 0) and which operand repeats there (has a 1); then each operand drops
    up to 2 leading dimensions (a missing dimension counts as 1). Hypothesis favours the first
    value of sampled_from and the lowest integer: those are broadcasts that matter."""
    a_shape, b_shape = [], []
    for _ in range(draw(st.sampled_from([3, 2, 4, 1, 0]))):
        size = 0 if draw(st.integers(0, 11)) == 11 else draw(
            st.integers(2, 4) if fd else st.integers(2, 12))
        repeats = draw(st.sampled_from(["b", "a", "neither", "both"]))
        a_shape.append(1 if repeats in ("a", "both") else size)
        b_shape.append(1 if repeats in ("b", "both") else size)
    return (tuple(a_shape[draw(st.sampled_from([0, 1, 2])):]),
            tuple(b_shape[draw(st.sampled_from([0, 1, 2])):]))


def _broadcast_cases(name, functional, operator, ref):
    for suffix, fn in (("_broadcast", functional), ("_broadcast_operator", operator)):
        @case(name + suffix)
        def _(draw, rng, fd, fn=fn):
            a_shape, b_shape = _broadcast_pair(draw, fd)
            # asarray: a 0-d draw is a NumPy scalar, which the finite differences cannot shift
            return Case(fn, ref, [np.asarray(rng.standard_normal(a_shape)),
                                  np.asarray(_away_from_zero(rng, b_shape))],
                        tol="acc")   # a repeated operand's gradient is a sum


for _name, (_functional, _operator, _ref) in BINARY.items():
    _broadcast_cases(_name, _functional, _operator, _ref)


UNARY = {
    "neg": (lambda x: -x, lambda x: -x, "normal"),
    "relu": (F.relu, lambda x: np.maximum(x, 0), "away"),
    "leaky_relu": (F.leaky_relu, lambda x: np.where(x > 0, x, 0.01 * x), "away"),
    "leaky_relu_slope": (lambda x: F.leaky_relu(x, negative_slope=0.2),
                         lambda x: np.where(x > 0, x, 0.2 * x), "away"),
    "sigmoid": (F.sigmoid, lambda x: 1 / (1 + np.exp(-x)), "normal"),
    "tanh": (F.tanh, np.tanh, "normal"),
    "gelu": (F.gelu, lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))), "normal"),
    "exp": (F.exp, np.exp, "normal"),
    "log": (F.log, np.log, "positive"),
}


def _unary_case(name, fn, ref, values):
    @case(name)
    def _(draw, rng, fd):
        shape = _shape(draw, fd)
        if values == "away":
            x = _away_from_zero(rng, shape)
        elif values == "positive":
            x = rng.uniform(0.2, 3.0, size=shape)
        else:
            x = rng.standard_normal(shape) * 1.5
        return Case(fn, ref, [x])


for _name, (_fn, _ref, _values) in UNARY.items():
    _unary_case(_name, _fn, _ref, _values)


def _reduction_case(name, functional, method, ref):
    @case(name)
    def _(draw, rng, fd):
        shape = _shape(draw, fd)
        axis = draw(st.sampled_from([None] + list(range(-1, len(shape)))))
        keepdims = draw(st.booleans())
        return Case(lambda x: functional(x, axis=axis, keepdims=keepdims),
                    lambda x: np.asarray(ref(x, axis=axis, keepdims=keepdims)),
                    [rng.standard_normal(shape)], tol="acc")

    @case(name + "_method")
    def _(draw, rng, fd):
        shape = _shape(draw, fd)
        axis = draw(st.sampled_from([None] + list(range(len(shape)))))
        if axis is None:
            return Case(lambda x: getattr(x, method)(), lambda x: np.asarray(ref(x)),
                        [rng.standard_normal(shape)], tol="acc")
        return Case(lambda x: getattr(x, method)(axis), lambda x: ref(x, axis=axis),
                    [rng.standard_normal(shape)], tol="acc")


_reduction_case("sum", F.sum, "sum", np.sum)


_reduction_case("mean", F.mean, "mean", np.mean)


def _split_with_minus_one(draw, shape):
    """A new shape for the same size, one entry maybe -1."""
    size = int(np.prod(shape))
    divisors = [d for d in range(1, size + 1) if size % d == 0]
    first = draw(st.sampled_from(divisors))
    new = [first, size // first]
    if draw(st.booleans()):
        new[draw(st.integers(0, 1))] = -1
    return tuple(new), (first, size // first)


@case("reshape")
def _(draw, rng, fd):
    shape = _shape(draw, fd, 1, 3)
    new, resolved = _split_with_minus_one(draw, shape)
    return Case(lambda x: F.reshape(x, new), lambda x: x.reshape(resolved),
                [rng.standard_normal(shape)])


@case("reshape_method")
def _(draw, rng, fd):
    shape = _shape(draw, fd, 2, 3)
    new, resolved = _split_with_minus_one(draw, shape)
    return Case(lambda x: x.reshape(new), lambda x: x.reshape(resolved),
                [rng.standard_normal(shape)])


@case("flatten")
def _(draw, rng, fd):
    shape = _shape(draw, fd, 2, 4)
    return Case(F.flatten, lambda x: x.reshape(x.shape[0], -1), [rng.standard_normal(shape)])


@case("flatten_start_dim_1")
def _(draw, rng, fd):
    shape = _shape(draw, fd, 2, 4)
    return Case(lambda x: F.flatten(x, start_dim=1), lambda x: x.reshape(x.shape[0], -1),
                [rng.standard_normal(shape)])


@case("transpose")
def _(draw, rng, fd):
    shape = (_dim(draw, fd, GEMM_DIM), _dim(draw, fd, GEMM_DIM))
    return Case(lambda x: x.T, lambda x: x.T, [rng.standard_normal(shape)])


def _softmax_ref(x, axis=-1):
    return np.exp(_log_softmax(x, axis))


@case("softmax")
def _(draw, rng, fd):
    shape = _shape(draw, fd, 1, 3)
    return Case(F.softmax, _softmax_ref, [rng.standard_normal(shape) * 3], tol="acc")


@case("softmax_axis")
def _(draw, rng, fd):
    shape = (_dim(draw, fd), _dim(draw, fd, GEMM_DIM))
    axis = draw(st.sampled_from([-1, 1]))
    return Case(lambda x: F.softmax(x, axis=axis), _softmax_ref,
                [rng.standard_normal(shape) * 3], tol="acc")


@case("log_softmax")
def _(draw, rng, fd):
    shape = _shape(draw, fd, 1, 3)
    return Case(F.log_softmax, _log_softmax, [rng.standard_normal(shape) * 3], tol="acc")


@case("log_softmax_axis")
def _(draw, rng, fd):
    shape = (_dim(draw, fd), _dim(draw, fd, GEMM_DIM))
    axis = draw(st.sampled_from([-1, 1]))
    return Case(lambda x: F.log_softmax(x, axis=axis), _log_softmax,
                [rng.standard_normal(shape) * 3], tol="acc")


def _cross_entropy_cases(reduction):
    @case("cross_entropy_index_" + reduction)
    def _(draw, rng, fd):
        n, classes = _dim(draw, fd), _dim(draw, fd, GEMM_DIM)
        target = rng.integers(0, classes, size=n)
        return Case(lambda x, t: F.cross_entropy(x, t, reduction=reduction),
                    lambda x, t: np.asarray(_cross_entropy_ref(x, t, reduction)),
                    [rng.standard_normal((n, classes)) * 3], [target], tol="acc")

    @case("cross_entropy_soft_" + reduction)
    def _(draw, rng, fd):
        n, classes = _dim(draw, fd), _dim(draw, fd, GEMM_DIM)
        target = rng.uniform(0, 1, size=(n, classes))
        target /= target.sum(axis=1, keepdims=True)
        return Case(lambda x, t: F.cross_entropy(x, t, reduction=reduction),
                    lambda x, t: np.asarray(_cross_entropy_ref(x, t, reduction)),
                    [rng.standard_normal((n, classes)) * 3], [target], tol="acc")


for _reduction in ["mean", "sum", "none"]:
    _cross_entropy_cases(_reduction)


@case("cross_entropy_default_reduction")
def _(draw, rng, fd):
    n, classes = _dim(draw, fd), _dim(draw, fd)
    target = rng.integers(0, classes, size=n).astype(np.int32)
    return Case(F.cross_entropy, lambda x, t: np.asarray(_cross_entropy_ref(x, t, "mean")),
                [rng.standard_normal((n, classes))], [target], tol="acc")


@case("mse_loss")
def _(draw, rng, fd):
    shape = _shape(draw, fd)
    return Case(F.mse_loss, lambda a, b: np.asarray(((a - b) ** 2).mean()),
                [rng.standard_normal(shape), rng.standard_normal(shape)], tol="acc")


@case("mse_loss_const_target")
def _(draw, rng, fd):
    shape = _shape(draw, fd)
    return Case(F.mse_loss, lambda a, b: np.asarray(((a - b) ** 2).mean()),
                [rng.standard_normal(shape)], [rng.standard_normal(shape)], tol="acc")


@case("composite_mlp")
def _(draw, rng, fd):
    n, d_in, hidden, classes = (_dim(draw, fd) for _ in range(4))
    target = rng.integers(0, classes, size=n)

    def fn(x, w1, b1, w2, b2, t):
        return F.cross_entropy(F.linear(F.tanh(F.linear(x, w1, b1)), w2, b2), t)

    def ref(x, w1, b1, w2, b2, t):
        return np.asarray(_cross_entropy_ref(np.tanh(x @ w1.T + b1) @ w2.T + b2, t, "mean"))

    return Case(fn, ref, [rng.standard_normal((n, d_in)), rng.standard_normal((hidden, d_in)),
                          rng.standard_normal(hidden), rng.standard_normal((classes, hidden)),
                          rng.standard_normal(classes)], [target], tol="acc")


@case("dropout")
def _(draw, rng, fd):
    shape = _shape(draw, fd)
    p = draw(st.sampled_from([0.1, 0.5, 0.8]))
    return Case(lambda x: F.dropout(x, p, True), None, [rng.standard_normal(shape)],
                seed=draw(st.integers(0, 2 ** 31 - 1)))


# --- elementwise and reductions (sqrt ... logsumexp). Inputs keep away from the points where
# PyTorch's gradient is a convention (abs at 0, clamp's bounds, ties, pow at 0); the tests under
# "--- elementwise and reductions" below check those conventions.

def _away_from(points, x, gap=0.05):
    """x with every element closer than `gap` to one of `points` moved up by 2 * gap."""
    for point in points:
        x = np.where(np.abs(x - point) < gap, x + 2 * gap, x)
    return x


def _gelu_tanh_ref(x):  # torch.nn.functional.gelu(x, approximate="tanh")
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


for _name, (_fn, _ref, _values) in {
    "sqrt": (F.sqrt, np.sqrt, "positive"),
    "sqrt_method": (lambda x: x.sqrt(), np.sqrt, "positive"),
    "rsqrt": (F.rsqrt, lambda x: 1 / np.sqrt(x), "positive"),
    "abs": (F.abs, np.abs, "away"),
    "abs_method": (lambda x: x.abs(), np.abs, "away"),
    "pow_square_operator": (lambda x: x ** 2, np.square, "normal"),
    "pow_cube": (lambda x: F.pow(x, 3), lambda x: x ** 3, "normal"),
    "pow_negative_method": (lambda x: x.pow(-2), lambda x: x ** -2.0, "away"),
    "pow_fraction": (lambda x: F.pow(x, 1.5), lambda x: x ** 1.5, "positive"),
    "pow_zero": (lambda x: F.pow(x, 0), np.ones_like, "normal"),
    "silu": (F.silu, lambda x: x / (1 + np.exp(-x)), "normal"),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), _gelu_tanh_ref, "normal"),
}.items():
    _unary_case(_name, _fn, _ref, _values)


@case("clamp")
def _(draw, rng, fd):
    shape = _shape(draw, fd)
    low, high = draw(st.sampled_from([(-0.5, 0.7), (None, 0.3), (-0.2, None)]))
    x = _away_from([b for b in (low, high) if b is not None], rng.standard_normal(shape))
    return Case(lambda x: F.clamp(x, low, high), lambda x: np.clip(x, low, high), [x])


def _extremum_cases(name, functional, ref):
    @case(name)
    def _(draw, rng, fd):
        shape = _shape(draw, fd)
        return Case(functional, ref, [rng.standard_normal(shape), rng.standard_normal(shape)])

    @case(name + "_row_broadcast")
    def _(draw, rng, fd):
        rows, cols = _dim(draw, fd), _dim(draw, fd)
        return Case(functional, ref,
                    [rng.standard_normal((rows, cols)), rng.standard_normal(cols)], tol="acc")

    @case(name + "_scalar")
    def _(draw, rng, fd):
        x = _away_from([0.25], rng.standard_normal(_shape(draw, fd)))
        return Case(lambda x: functional(x, 0.25), lambda x: ref(x, 0.25), [x])


_extremum_cases("maximum", F.maximum, np.maximum)


_extremum_cases("minimum", F.minimum, np.minimum)


@case("where")
def _(draw, rng, fd):
    shape = _shape(draw, fd)
    return Case(lambda a, b, cond: F.where(cond, a, b), lambda a, b, cond: np.where(cond, a, b),
                [rng.standard_normal(shape), rng.standard_normal(shape)],
                [rng.random(shape) < 0.5])


@case("where_broadcast")
def _(draw, rng, fd):
    rows, cols = _dim(draw, fd), _dim(draw, fd)
    return Case(lambda a, b, cond: F.where(cond, a, b), lambda a, b, cond: np.where(cond, a, b),
                [rng.standard_normal((rows, cols)), rng.standard_normal(cols)],
                [rng.random(cols) < 0.5], tol="acc")  # b's gradient is a sum over rows


@case("where_scalar")
def _(draw, rng, fd):
    shape = _shape(draw, fd)
    return Case(lambda a, cond: F.where(cond, -1.25, a), lambda a, cond: np.where(cond, -1.25, a),
                [rng.standard_normal(shape)], [rng.integers(-2, 3, size=shape)])


@case("masked_fill")
def _(draw, rng, fd):
    shape = _shape(draw, fd)
    return Case(lambda x, mask: F.masked_fill(x, mask, -1.5),
                lambda x, mask: np.where(mask, -1.5, x),
                [rng.standard_normal(shape)], [rng.integers(0, 2, size=shape)])


@case("masked_fill_method")
def _(draw, rng, fd):
    rows, cols = _dim(draw, fd), _dim(draw, fd)
    return Case(lambda x, mask: x.masked_fill(mask, 2.0), lambda x, mask: np.where(mask, 2.0, x),
                [rng.standard_normal((rows, cols))], [rng.random(cols) < 0.5])


_reduction_case("max", F.max, "max", np.max)  # also "max_method": x.max(axis)


@case("min")
def _(draw, rng, fd):
    shape = _shape(draw, fd)
    axis = draw(st.sampled_from([None] + list(range(-1, len(shape)))))
    keepdims = draw(st.booleans())
    return Case(lambda x: F.min(x, axis, keepdims),
                lambda x: np.asarray(np.min(x, axis=axis, keepdims=keepdims)),
                [rng.standard_normal(shape)], tol="acc")


def _variance_cases(name, functional, ref):  # ref: np.var or np.std, whose ddof is correction
    @case(name)
    def _(draw, rng, fd):
        shape = tuple(s + 1 for s in _shape(draw, fd))  # every axis >= 2 > correction
        axis = draw(st.sampled_from([None] + list(range(-1, len(shape)))))
        correction = draw(st.sampled_from([0, 1, 0.5]))
        keepdims = draw(st.booleans())
        return Case(lambda x: functional(x, axis, correction=correction, keepdims=keepdims),
                    lambda x: np.asarray(ref(x, axis=axis, ddof=correction, keepdims=keepdims)),
                    [rng.standard_normal(shape)], tol="acc")

    @case(name + "_method")
    def _(draw, rng, fd):
        shape = tuple(s + 1 for s in _shape(draw, fd))
        if draw(st.booleans()):
            return Case(lambda x: getattr(x, name)(), lambda x: np.asarray(ref(x, ddof=1)),
                        [rng.standard_normal(shape)], tol="acc")
        axis = draw(st.integers(0, len(shape) - 1))
        return Case(lambda x: getattr(x, name)(axis), lambda x: ref(x, axis=axis, ddof=1),
                    [rng.standard_normal(shape)], tol="acc")


_variance_cases("var", F.var, np.var)


_variance_cases("std", F.std, np.std)


def _logsumexp_ref(x, axis, keepdims):  # torch.logsumexp
    peak = x.max(axis=axis, keepdims=True)
    out = peak + np.log(np.exp(x - peak).sum(axis=axis, keepdims=True))
    return out if keepdims else out.squeeze(axis)


@case("logsumexp")
def _(draw, rng, fd):
    shape = _shape(draw, fd)
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    keepdims = draw(st.booleans())
    return Case(lambda x: F.logsumexp(x, axis, keepdims=keepdims),
                lambda x: _logsumexp_ref(x, axis, keepdims),
                [rng.standard_normal(shape) * 3], tol="acc")


# --- normalisation, embedding and attention: NumPy transcriptions of PyTorch's formulas

ATTENTION_DIM = st.integers(1, 24)


def _layer_norm_ref(x, shape, w=None, b=None, eps=1e-5):
    """torch.nn.functional.layer_norm: the biased variance over the last len(shape) dims."""
    axes = tuple(range(x.ndim - len(shape), x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    return y * (1 if w is None else w) + (0 if b is None else b)


def _layer_norm_shapes(draw, fd):
    """(leading shape, normalized_shape): rows across layer_norm's 256-row chunks too."""
    lead = (_dim(draw, fd, st.one_of(st.integers(1, 40), st.sampled_from([255, 256, 257, 600]))),)
    lead = draw(st.sampled_from([(), lead, lead + (_dim(draw, fd, st.integers(1, 3)),)]))
    if draw(st.booleans()):
        return lead, (_dim(draw, fd, GEMM_DIM),)
    return lead, (_dim(draw, fd, st.integers(1, 8)), _dim(draw, fd, st.integers(1, 8)))


@case("layer_norm")
def _(draw, rng, fd):
    lead, shape = _layer_norm_shapes(draw, fd)
    return Case(lambda x, w, b: F.layer_norm(x, shape, w, b),
                lambda x, w, b: _layer_norm_ref(x, shape, w, b),
                [rng.standard_normal(lead + shape), rng.standard_normal(shape),
                 rng.standard_normal(shape)], tol="acc")


@case("layer_norm_no_affine")
def _(draw, rng, fd):
    lead, shape = _layer_norm_shapes(draw, fd)
    return Case(lambda x: F.layer_norm(x, shape, eps=1e-3),
                lambda x: _layer_norm_ref(x, shape, eps=1e-3),
                [rng.standard_normal(lead + shape) * 3], tol="acc")


@case("layer_norm_weight_only")
def _(draw, rng, fd):
    lead, shape = _layer_norm_shapes(draw, fd)
    return Case(lambda x, w: F.layer_norm(x, shape, weight=w),
                lambda x, w: _layer_norm_ref(x, shape, w),
                [rng.standard_normal(lead + shape), rng.standard_normal(shape)], tol="acc")


def _batch_norm_ref(x, mean=None, var=None, w=None, b=None, eps=1e-5):
    """torch.nn.functional.batch_norm per channel (dim 1): with the batch's mean and biased
    variance over every other dim (training=True), or with the given ones (training=False)."""
    axes, shape = (0,) + tuple(range(2, x.ndim)), (1, -1) + (1,) * (x.ndim - 2)
    if mean is None:
        mean, var = x.mean(axis=axes, keepdims=True), x.var(axis=axes, keepdims=True)
    else:
        mean, var = mean.reshape(shape), var.reshape(shape)
    y = (x - mean) / np.sqrt(var + eps)
    return y * (1 if w is None else w.reshape(shape)) + (0 if b is None else b.reshape(shape))


def _batch_norm_shape(draw, fd):
    """(N, C, *trailing): at least two values per channel, as training needs."""
    channels = _dim(draw, fd, st.integers(1, 12))
    trailing = tuple(_dim(draw, fd) for _ in range(draw(st.integers(0, 2))))
    n = max(_dim(draw, fd), 2 if not trailing or math.prod(trailing) == 1 else 1)
    return (n, channels) + trailing


@case("batch_norm_training")
def _(draw, rng, fd):
    shape = _batch_norm_shape(draw, fd)
    C = shape[1]
    return Case(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
                lambda x, w, b: _batch_norm_ref(x, w=w, b=b),
                [rng.standard_normal(shape) * 2 + 1, rng.standard_normal(C),
                 rng.standard_normal(C)], tol="acc")


@case("batch_norm_training_no_affine")
def _(draw, rng, fd):
    shape = _batch_norm_shape(draw, fd)
    C = shape[1]
    # Running statistics are updated in place; the output does not depend on them.
    return Case(lambda x, mean, var: F.batch_norm(x, mean, var, training=True, eps=1e-3),
                lambda x, mean, var: _batch_norm_ref(x, eps=1e-3),
                [rng.standard_normal(shape)], [np.zeros(C), np.ones(C)], tol="acc")


@case("batch_norm_eval")
def _(draw, rng, fd):
    shape = _batch_norm_shape(draw, fd)
    C = shape[1]
    return Case(lambda x, w, b, mean, var: F.batch_norm(x, mean, var, w, b),
                lambda x, w, b, mean, var: _batch_norm_ref(x, mean, var, w, b),
                [rng.standard_normal(shape), rng.standard_normal(C), rng.standard_normal(C)],
                [rng.standard_normal(C), rng.uniform(0.5, 2.0, C)], tol="acc")


@case("embedding")
def _(draw, rng, fd):
    num, dim = _dim(draw, fd), _dim(draw, fd)
    idx_shape = tuple(_dim(draw, fd) for _ in range(draw(st.integers(0, 3))))
    idx = rng.integers(0, num, size=idx_shape)  # few rows: most are picked more than once
    return Case(lambda w, i: F.embedding(i, w), lambda w, i: w[i],
                [rng.standard_normal((num, dim))], [idx], tol="acc")


def _attention_ref(q, k, v, mask=None, causal=False, scale=None):
    """The reference implementation in the documentation of
    torch.nn.functional.scaled_dot_product_attention (without dropout)."""
    L, S = q.shape[-2], k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    bias = np.zeros((L, S))
    if causal:
        bias = np.where(np.tril(np.ones((L, S), bool)), 0.0, -np.inf)
    if mask is not None:
        bias = np.where(mask, 0.0, -np.inf) if mask.dtype == bool else bias + mask
    scores = q @ np.swapaxes(k, -1, -2) * scale + bias
    return _softmax_ref(scores) @ v


def _attention_inputs(draw, rng, fd, max_lead=2):
    lead = tuple(_dim(draw, fd, st.integers(1, 3)) for _ in range(draw(st.integers(0, max_lead))))
    L, S, E, Ev = (_dim(draw, fd, ATTENTION_DIM) for _ in range(4))
    return lead, L, S, [rng.standard_normal(lead + (L, E)), rng.standard_normal(lead + (S, E)),
                        rng.standard_normal(lead + (S, Ev))]


def _mask_shape(draw, lead, L, S):
    """A shape that broadcasts to (*lead, L, S): leading dims dropped, any dim 1 or kept."""
    full = lead + (L, S)
    shape = tuple(draw(st.sampled_from([1, n])) for n in full)
    return shape[draw(st.integers(0, len(lead))):]


@case("scaled_dot_product_attention")
def _(draw, rng, fd):
    _, _, _, inputs = _attention_inputs(draw, rng, fd)
    return Case(F.scaled_dot_product_attention, _attention_ref, inputs, tol="acc")


@case("scaled_dot_product_attention_causal")
def _(draw, rng, fd):
    _, _, _, inputs = _attention_inputs(draw, rng, fd)
    return Case(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                lambda q, k, v: _attention_ref(q, k, v, causal=True), inputs, tol="acc")


@case("scaled_dot_product_attention_bool_mask")
def _(draw, rng, fd):
    lead, L, S, inputs = _attention_inputs(draw, rng, fd, max_lead=3)
    mask = rng.uniform(size=_mask_shape(draw, lead, L, S)) < 0.6
    mask[..., 0] = True  # every row attends to a key (a row of none: its own test)
    return Case(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                lambda q, k, v, m: _attention_ref(q, k, v, m), inputs, [mask], tol="acc")


@case("scaled_dot_product_attention_float_mask_and_scale")
def _(draw, rng, fd):
    lead, L, S, inputs = _attention_inputs(draw, rng, fd, max_lead=3)
    shape = _mask_shape(draw, lead, L, S)
    mask = np.where(rng.uniform(size=shape) < 0.3, -np.inf, rng.standard_normal(shape))
    mask[..., 0] = rng.standard_normal(shape[:-1])
    scale = draw(st.sampled_from([0.3, 1.0, 2.5]))
    return Case(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, m, scale=scale),
                lambda q, k, v, m: _attention_ref(q, k, v, m, scale=scale), inputs, [mask],
                tol="acc")


# --- shape ops: permute, transpose, squeeze, unsqueeze, cat, stack, split, chunk, indexing.
# Their shapes may have zero-size dimensions; dims and indices are drawn negative too.

def _shape_op_shape(draw, fd, min_ndim=1, max_ndim=4):
    """A shape of min_ndim..max_ndim dimensions, each 0 one time in ten."""
    ndim = draw(st.integers(min_ndim, max_ndim))
    high = 3 if fd else (40 if ndim <= 2 else 8)
    return tuple(0 if draw(st.integers(0, 9)) == 0 else draw(st.integers(1, high))
                 for _ in range(ndim))


def _standard_normal(rng, shape):
    return np.asarray(rng.standard_normal(shape))  # an ndarray for shape () too


def _dim_of(draw, ndim):
    """A dim of a tensor of ndim dimensions, from the end half of the time."""
    return draw(st.integers(-max(ndim, 1), max(ndim, 1) - 1))


@case("permute")
def _(draw, rng, fd):
    shape = _shape_op_shape(draw, fd, 0, 4)
    dims = [d - len(shape) if draw(st.booleans()) else d
            for d in draw(st.permutations(range(len(shape))))]
    form = draw(st.sampled_from(["function", "method", "method_tuple"]))
    fn = {"function": lambda x: F.permute(x, dims), "method": lambda x: x.permute(*dims),
          "method_tuple": lambda x: x.permute(tuple(dims))}[form]
    return Case(fn, lambda x: np.transpose(x, dims), [_standard_normal(rng, shape)])


@case("permute_6d")
def _(draw, rng, fd):  # six dimensions that all move: the kernel's full rank
    shape = tuple(draw(st.integers(2, 2 if fd else 4)) for _ in range(6))
    dims = draw(st.permutations(range(6)).filter(
        lambda p: all(b != a + 1 for a, b in zip(p, p[1:]))))
    return Case(lambda x: F.permute(x, dims), lambda x: np.transpose(x, dims),
                [_standard_normal(rng, shape)])


@case("transpose_dims")
def _(draw, rng, fd):
    shape = _shape_op_shape(draw, fd)
    dim0, dim1 = _dim_of(draw, len(shape)), _dim_of(draw, len(shape))
    fn = (lambda x: x.transpose(dim0, dim1)) if draw(st.booleans()) else \
        (lambda x: F.transpose(x, dim0, dim1))
    return Case(fn, lambda x: np.swapaxes(x, dim0, dim1), [_standard_normal(rng, shape)])


@case("squeeze")
def _(draw, rng, fd):
    shape = tuple(1 if draw(st.booleans()) else s for s in _shape_op_shape(draw, fd, 0, 4))
    ndim = len(shape)
    dim = draw(st.one_of(st.none(), st.integers(-max(ndim, 1), max(ndim, 1) - 1),
                         st.lists(st.sampled_from(range(-ndim, 0)) if ndim else st.nothing(),
                                  unique=True).map(tuple)))
    listed = range(ndim) if dim is None else [dim] if isinstance(dim, int) else dim

    def ref(x):  # torch.squeeze: the listed dimensions of size 1 go, the others stay
        return np.squeeze(x, tuple(d for d in listed if x.ndim and x.shape[d] == 1))
    fn = (lambda x: x.squeeze(dim)) if draw(st.booleans()) else (lambda x: F.squeeze(x, dim))
    return Case(fn, ref, [_standard_normal(rng, shape)])


@case("unsqueeze")
def _(draw, rng, fd):
    shape = _shape_op_shape(draw, fd, 0, 3)
    dim = _dim_of(draw, len(shape) + 1)
    fn = (lambda x: x.unsqueeze(dim)) if draw(st.booleans()) else (lambda x: F.unsqueeze(x, dim))
    return Case(fn, lambda x: np.expand_dims(x, dim), [_standard_normal(rng, shape)])


def _rows_along(draw, fd, shape, dim, count):
    """`count` shapes like `shape` but for their sizes along dim (0 one time in ten)."""
    high = 3 if fd else 12
    return [shape[:dim] + (0 if draw(st.integers(0, 9)) == 0 else draw(st.integers(1, high)),)
            + shape[dim + 1:] for _ in range(count)]


@case("cat")
def _(draw, rng, fd):
    shape = _shape_op_shape(draw, fd, 1, 3)
    dim = _dim_of(draw, len(shape))
    shapes = _rows_along(draw, fd, shape, dim % len(shape), draw(st.integers(1, 3)))
    return Case(lambda *xs: F.cat(list(xs), dim), lambda *xs: np.concatenate(xs, axis=dim),
                [_standard_normal(rng, s) for s in shapes])


@case("cat_skips_1d_empty")
def _(draw, rng, fd):  # torch.cat's legacy: a (0,) tensor joins tensors of any shape
    shape = _shape_op_shape(draw, fd, 2, 3)
    return Case(lambda a, b, c: F.cat([a, b, c], 0),
                lambda a, b, c: np.concatenate([b, c], axis=0),
                [np.zeros(0), _standard_normal(rng, shape), _standard_normal(rng, shape)])


@case("stack")
def _(draw, rng, fd):
    shape = _shape_op_shape(draw, fd, 0, 3)
    dim = _dim_of(draw, len(shape) + 1)
    return Case(lambda *xs: F.stack(list(xs), dim), lambda *xs: np.stack(xs, axis=dim),
                [_standard_normal(rng, shape) for _ in range(draw(st.integers(1, 3)))])


def _split_args(draw, shape, dim):
    """split_size_or_sections for dimension dim of shape, and the cut positions it means
    (torch.split: pieces of split_size rows, the last one what is left; or the sections)."""
    size = shape[dim]
    if draw(st.booleans()):
        split_size = draw(st.integers(1 if size else 0, size + 2))
        return split_size, list(range(split_size, size, split_size)) if split_size else []
    cuts = sorted(draw(st.lists(st.integers(0, size), max_size=3)))
    return [b - a for a, b in zip([0] + cuts, cuts + [size])], cuts


def _weighted_pieces(pieces, dim, cat):
    """The pieces scaled by 1, 2, 3, ... and joined again: each piece's gradient differs."""
    return cat([piece * float(i + 1) for i, piece in enumerate(pieces)], dim)


@case("split")
def _(draw, rng, fd):
    shape = _shape_op_shape(draw, fd, 1, 3)
    dim = _dim_of(draw, len(shape))
    sections, cuts = _split_args(draw, shape, dim % len(shape))
    split = (lambda x: x.split(sections, dim)) if draw(st.booleans()) else \
        (lambda x: F.split(x, sections, dim))
    return Case(lambda x: _weighted_pieces(split(x), dim, F.cat),
                lambda x: _weighted_pieces(np.split(x, cuts, dim), dim, np.concatenate),
                [_standard_normal(rng, shape)])


@case("split_some_pieces")
def _(draw, rng, fd):  # the pieces left out get no gradient, so theirs are zeros
    shape = _shape_op_shape(draw, fd, 1, 3)
    dim = _dim_of(draw, len(shape))
    sections, cuts = _split_args(draw, shape, dim % len(shape))
    chosen = draw(st.lists(st.integers(0, len(cuts)), min_size=1, unique=True))
    return Case(lambda x: F.cat([F.split(x, sections, dim)[k] for k in chosen], dim),
                lambda x: np.concatenate([np.split(x, cuts, dim)[k] for k in chosen], dim),
                [_standard_normal(rng, shape)])


@case("chunk")
def _(draw, rng, fd):
    shape = _shape_op_shape(draw, fd, 1, 3)
    dim = _dim_of(draw, len(shape))
    chunks = draw(st.integers(1, 5))
    size = shape[dim]
    step = max(-(-size // chunks), 1)  # torch.chunk: pieces of ceil(size / chunks) rows
    chunk = (lambda x: x.chunk(chunks, dim)) if draw(st.booleans()) else \
        (lambda x: F.chunk(x, chunks, dim))
    return Case(lambda x: _weighted_pieces(chunk(x), dim, F.cat),
                lambda x: _weighted_pieces(np.split(x, list(range(step, size, step)), dim), dim,
                                           np.concatenate),
                [_standard_normal(rng, shape)])


@case("unbind")
def _(draw, rng, fd):  # some slices only: the others' gradients are zeros
    shape = list(_shape_op_shape(draw, fd, 1, 3))
    dim = _dim_of(draw, len(shape))
    d = dim % len(shape)
    shape[d] = shape[d] or 2  # (an empty dimension has no slices: see the explicit test)
    chosen = draw(st.lists(st.integers(0, shape[d] - 1), min_size=1, max_size=3, unique=True))
    unbind = (lambda x: x.unbind(dim)) if draw(st.booleans()) else (lambda x: F.unbind(x, dim))
    return Case(lambda x: F.stack([unbind(x)[k] * float(k + 1) for k in chosen], 0),
                lambda x: np.stack([np.take(x, k, axis=d) * float(k + 1) for k in chosen], 0),
                [_standard_normal(rng, tuple(shape))])


def _basic_index(draw, size):
    """One entry of a basic index for a dimension of `size`: an int, a slice, or `:`."""
    kind = draw(st.sampled_from(["int", "slice", "colon"] if size else ["slice", "colon"]))
    if kind == "int":
        return draw(st.integers(-size, size - 1))
    if kind == "colon":
        return slice(None)
    bound = st.one_of(st.none(), st.integers(-size - 2, size + 2))
    return slice(draw(bound), draw(bound), draw(st.one_of(st.none(), st.integers(1, 3))))


@case("getitem")
def _(draw, rng, fd):  # NumPy's basic indexing is PyTorch's for positive steps
    shape = _shape_op_shape(draw, fd, 1, 4)
    head = draw(st.integers(0, len(shape)))
    tail = draw(st.integers(0, len(shape) - head)) if draw(st.booleans()) else None
    key = [_basic_index(draw, size) for size in shape[:head]]
    if tail is not None:  # an ellipsis, then entries for the last `tail` dimensions
        key += [Ellipsis] + [_basic_index(draw, size) for size in shape[len(shape) - tail:]]
    for _ in range(draw(st.integers(0, 2))):
        key.insert(draw(st.integers(0, len(key))), None)
    key = key[0] if len(key) == 1 and draw(st.booleans()) else tuple(key)
    return Case(lambda x: x[key], lambda x: np.array(x[key]), [_standard_normal(rng, shape)])


@case("getitem_int_array")
def _(draw, rng, fd):  # x[idx]: repeats and negative indices, as NumPy's
    shape = _shape_op_shape(draw, fd, 1, 3)
    rows, m = shape[0], draw(st.integers(0, 6 if fd else 60))
    index_shape = draw(st.sampled_from([(m,), (2, m), ()])) if rows else (0,)
    index = rng.integers(-rows, max(rows, 1), size=index_shape)
    kind = draw(st.sampled_from(["array", "list", "tensor"]))

    def fn(x, index):
        if kind == "list":
            return x[index.tolist()]
        if kind == "tensor":
            return x[netcl.Tensor.from_host(index.astype(np.int32), queue=x.value.queue)]
        return x[index]
    return Case(fn, lambda x, index: x[index], [_standard_normal(rng, shape)], [index])


@case("index_select")
def _(draw, rng, fd):
    shape = _shape_op_shape(draw, fd, 1, 3)
    dim = _dim_of(draw, len(shape))
    rows, m = shape[dim], draw(st.integers(0, 6 if fd else 60))
    index = rng.integers(0, rows, size=m if rows else 0)
    as_tensor = draw(st.booleans())

    def fn(x, index):
        if as_tensor:
            index = netcl.Tensor.from_host(index.astype(np.int32), queue=x.value.queue)
        return F.index_select(x, dim, index)
    return Case(fn, lambda x, index: np.take(x, index, axis=dim), [_standard_normal(rng, shape)],
                [index])


# --- losses: N-d cross_entropy, ignore_index, label_smoothing, probability targets with a
# gradient, nll_loss, binary_cross_entropy_with_logits. References transcribe PyTorch's
# formulas (torch.nn.functional and aten/src/ATen/native/LossNLL.cpp, Loss.cpp) in float64.

REDUCTIONS = st.sampled_from(["mean", "sum", "none"])


def _nll_loss_ref(log_p, target, reduction, ignore_index=-100):
    """torch.nn.functional.nll_loss: -log_p[target] along the class axis (1, or 0 for 1-D
    input); an ignored target adds 0, and "mean" divides by the number of the others."""
    axis = 1 if log_p.ndim > 1 else 0
    kept = target != ignore_index
    picked = np.take_along_axis(log_p, np.expand_dims(np.where(kept, target, 0), axis), axis)
    losses = np.where(kept, -picked.squeeze(axis), 0.0)
    return {"mean": losses.sum() / kept.sum(), "sum": losses.sum(), "none": losses}[reduction]


def _cross_entropy_nd_ref(x, target, reduction, ignore_index=-100, label_smoothing=0.0):
    """torch.nn.functional.cross_entropy on logits (C,), (N, C) or (N, C, d1, ...): index
    targets as LossNLL.cpp's cross_entropy_loss_label_smoothing (nll_loss, plus e / C times
    the summed -log_softmax of the kept targets), probabilities as
    cross_entropy_loss_prob_target (t (1 - e) + e / C; "mean" divides by numel / C)."""
    axis = 1 if x.ndim > 1 else 0
    classes, e = x.shape[axis], label_smoothing
    log_p = _log_softmax(x, axis)
    if target.dtype.kind == "f":
        losses = -((target * (1 - e) + e / classes) * log_p).sum(axis)
        return {"mean": losses.sum() / (x.size / classes), "sum": losses.sum(),
                "none": losses}[reduction]
    kept = target != ignore_index
    smooth = np.where(kept, -log_p.sum(axis), 0.0)
    smooth = {"mean": smooth.sum() / kept.sum(), "sum": smooth.sum(), "none": smooth}[reduction]
    return (1 - e) * _nll_loss_ref(log_p, target, reduction, ignore_index) + e / classes * smooth


def _bce_with_logits_ref(x, t, weight=None, pos_weight=None, reduction="mean"):
    """torch.nn.functional.binary_cross_entropy_with_logits (Loss.cpp): (1 - t) x -
    (1 + (pos_weight - 1) t) log_sigmoid(x), times weight; log_sigmoid(x) = -log(1 + e^-x)."""
    log_weight = 1.0 if pos_weight is None else 1 + (pos_weight - 1) * t
    losses = (1 - t) * x - log_weight * -np.logaddexp(0.0, -x)
    losses = losses if weight is None else losses * weight
    return {"mean": losses.mean(), "sum": losses.sum(), "none": losses}[reduction]


def _class_scores_shape(draw, fd, extra_dims=(0, 2)):
    """(N, C) followed by 0..2 spatial dimensions d1, ...: logits of the N-d losses."""
    n, classes = _dim(draw, fd), _dim(draw, fd, st.integers(1, 12))
    spatial = tuple(_dim(draw, fd, st.integers(1, 6))
                    for _ in range(draw(st.integers(*extra_dims))))
    return (n, classes) + spatial


def _probabilities(rng, shape, axis=1):
    p = rng.uniform(0, 1, size=shape)
    return p / p.sum(axis=axis, keepdims=True)


def _labels_with_ignored(draw, rng, shape):
    """Class indices for logits `shape` with some set to an ignore_index (the default -100,
    or one inside [0, C)); the first is never ignored, so a mean is never 0 / 0."""
    classes = shape[1]
    ignore_index = draw(st.sampled_from([-100, -1, 0] if classes > 1 else [-100, -1]))
    target = rng.integers(0, classes, size=shape[:1] + shape[2:])
    target[rng.uniform(size=target.shape) < 0.4] = ignore_index
    target.flat[0] = classes - 1 if ignore_index == 0 else 0
    return target, ignore_index


@case("cross_entropy_nd_index")
def _(draw, rng, fd):
    shape = _class_scores_shape(draw, fd, (1, 2))
    reduction = draw(REDUCTIONS)
    target = rng.integers(0, shape[1], size=shape[:1] + shape[2:])
    return Case(lambda x, t: F.cross_entropy(x, t, reduction=reduction),
                lambda x, t: np.asarray(_cross_entropy_nd_ref(x, t, reduction)),
                [rng.standard_normal(shape) * 3], [target], tol="acc")


@case("cross_entropy_nd_soft")
def _(draw, rng, fd):
    shape = _class_scores_shape(draw, fd, (1, 2))
    reduction = draw(REDUCTIONS)
    return Case(lambda x, t: F.cross_entropy(x, t, reduction=reduction),
                lambda x, t: np.asarray(_cross_entropy_nd_ref(x, t, reduction)),
                [rng.standard_normal(shape) * 3], [_probabilities(rng, shape)], tol="acc")


@case("cross_entropy_1d")
def _(draw, rng, fd):
    classes = _dim(draw, fd, GEMM_DIM)
    target = (_probabilities(rng, (classes,), axis=0) if draw(st.booleans())
              else np.array(rng.integers(0, classes)))
    reduction = draw(REDUCTIONS)
    return Case(lambda x, t: F.cross_entropy(x, t, reduction=reduction),
                lambda x, t: np.asarray(_cross_entropy_nd_ref(x, t, reduction)),
                [rng.standard_normal(classes) * 3], [target], tol="acc")


@case("cross_entropy_ignore_index")
def _(draw, rng, fd):
    shape = _class_scores_shape(draw, fd)
    target, ignore_index = _labels_with_ignored(draw, rng, shape)
    reduction = draw(REDUCTIONS)
    return Case(lambda x, t: F.cross_entropy(x, t, reduction=reduction,
                                             ignore_index=ignore_index),
                lambda x, t: np.asarray(_cross_entropy_nd_ref(x, t, reduction, ignore_index)),
                [rng.standard_normal(shape) * 3], [target], tol="acc")


@case("cross_entropy_label_smoothing")
def _(draw, rng, fd):
    shape = _class_scores_shape(draw, fd)
    target, ignore_index = _labels_with_ignored(draw, rng, shape)
    smoothing = draw(st.sampled_from([0.05, 0.3, 1.0]))
    reduction = draw(REDUCTIONS)
    return Case(lambda x, t: F.cross_entropy(x, t, reduction=reduction, ignore_index=ignore_index,
                                             label_smoothing=smoothing),
                lambda x, t: np.asarray(_cross_entropy_nd_ref(x, t, reduction, ignore_index,
                                                              smoothing)),
                [rng.standard_normal(shape) * 3], [target], tol="acc")


@case("cross_entropy_label_smoothing_soft")
def _(draw, rng, fd):
    shape = _class_scores_shape(draw, fd)
    smoothing = draw(st.sampled_from([0.05, 0.3, 1.0]))
    reduction = draw(REDUCTIONS)
    return Case(lambda x, t: F.cross_entropy(x, t, reduction=reduction,
                                             label_smoothing=smoothing),
                lambda x, t: np.asarray(_cross_entropy_nd_ref(x, t, reduction,
                                                              label_smoothing=smoothing)),
                [rng.standard_normal(shape) * 3], [_probabilities(rng, shape)], tol="acc")


@case("cross_entropy_soft_target_gradient")
def _(draw, rng, fd):
    # the target is an input: it gets d loss / d target = -(1 - e) log_softmax(x), reduced
    shape = _class_scores_shape(draw, fd)
    smoothing = draw(st.sampled_from([0.0, 0.2]))
    reduction = draw(REDUCTIONS)
    return Case(lambda x, t: F.cross_entropy(x, t, reduction=reduction,
                                             label_smoothing=smoothing),
                lambda x, t: np.asarray(_cross_entropy_nd_ref(x, t, reduction,
                                                              label_smoothing=smoothing)),
                [rng.standard_normal(shape) * 3, _probabilities(rng, shape)], tol="acc")


@case("nll_loss")
def _(draw, rng, fd):
    shape = _class_scores_shape(draw, fd)
    target, ignore_index = _labels_with_ignored(draw, rng, shape)
    if draw(st.booleans()):  # one sample: log-probabilities (C,), a 0-d target
        shape, target = shape[1:2], target.flat[0]
    reduction = draw(REDUCTIONS)
    return Case(lambda x, t: F.nll_loss(x, t, reduction=reduction, ignore_index=ignore_index),
                lambda x, t: np.asarray(_nll_loss_ref(x, t, reduction, ignore_index)),
                [rng.standard_normal(shape)], [np.asarray(target)], tol="acc")


@case("binary_cross_entropy_with_logits")
def _(draw, rng, fd):
    shape = _shape(draw, fd)
    reduction = draw(REDUCTIONS)
    return Case(lambda x, t: F.binary_cross_entropy_with_logits(x, t, reduction=reduction),
                lambda x, t: np.asarray(_bce_with_logits_ref(x, t, reduction=reduction)),
                [rng.standard_normal(shape) * 3, rng.uniform(0, 1, size=shape)], tol="acc")


def _broadcasting_to(draw, shape):
    """A shape that broadcasts to `shape` without growing it: a trailing part, maybe with 1s."""
    tail = shape[len(shape) - draw(st.integers(0, len(shape))):]
    return tuple(draw(st.sampled_from([size, 1])) for size in tail)


@case("binary_cross_entropy_with_logits_weights")
def _(draw, rng, fd):
    shape = _shape(draw, fd)
    reduction = draw(REDUCTIONS)
    weight = rng.uniform(0.5, 2.0, size=_broadcasting_to(draw, shape))
    pos_weight = rng.uniform(0.2, 3.0, size=_broadcasting_to(draw, shape))
    return Case(lambda x, t, w, pw: F.binary_cross_entropy_with_logits(
                    x, t, weight=w, reduction=reduction, pos_weight=pw),
                lambda x, t, w, pw: np.asarray(_bce_with_logits_ref(x, t, w, pw, reduction)),
                [rng.standard_normal(shape) * 3, rng.uniform(0, 1, size=shape)],
                [weight, pos_weight], tol="acc")


# --- conv2d with dilation and groups: the reference is written from the definition.

def _conv2d_ref(x, w, b, stride, padding, dilation, groups):
    """torch.nn.functional.conv2d from its definition, one output pixel at a time: filter k
    of group g = k // (K / groups) sees channels g C/G .. (g+1) C/G - 1 through taps
    `dilation` apart, the first at (i SH - PH, j SW - PW)."""
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    N, C, H, W = x.shape
    K, group_channels, R, S = w.shape
    padded = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    OH, OW = (H + 2 * ph - dh * (R - 1) - 1) // sh + 1, (W + 2 * pw - dw * (S - 1) - 1) // sw + 1
    out = np.zeros((N, K, OH, OW))
    for k in range(K):
        g = k // (K // groups)
        channels = padded[:, g * group_channels:(g + 1) * group_channels]
        for i in range(OH):
            for j in range(OW):
                taps = channels[:, :, i * sh:i * sh + dh * (R - 1) + 1:dh,
                                j * sw:j * sw + dw * (S - 1) + 1:dw]
                out[:, k, i, j] = np.tensordot(taps, w[k], axes=3)
    return out if b is None else out + b.reshape(1, K, 1, 1)


@case("conv2d_dilation_groups")
def _(draw, rng, fd):
    small = st.integers(1, 2) if fd else st.integers(1, 4)
    groups = draw(st.integers(1, 3))
    N, group_channels, group_filters = draw(small), draw(small), draw(small)
    R, S = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    stride, dilation = draw(st.integers(1, 2)), (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    padding = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    span = ((R - 1) * dilation[0] + 1, (S - 1) * dilation[1] + 1)
    top = 7 if fd else 12
    H = draw(st.integers(max(1, span[0] - 2 * padding[0]), max(top, span[0])))
    W = draw(st.integers(max(1, span[1] - 2 * padding[1]), max(top, span[1])))
    inputs = [rng.standard_normal((N, groups * group_channels, H, W)),
              rng.standard_normal((groups * group_filters, group_channels, R, S))]
    if draw(st.booleans()):
        inputs.append(rng.standard_normal(groups * group_filters))
    geometry = (stride, padding, dilation, groups)
    return Case(lambda x, w, b=None: F.conv2d(x, w, b, *geometry),
                lambda x, w, b=None: _conv2d_ref(x, w, b, (stride, stride), *geometry[1:]),
                inputs, tol="acc")


# --- conv2d and pooling without dilation or groups: kernel, stride and padding as an int or a
# pair, sizes the stride need not divide

def pair_or_int(values):
    """An int, or a pair of them: both forms are accepted wherever PyTorch accepts them."""
    return st.one_of(values, st.tuples(values, values))


def as_pair(v):
    return v if isinstance(v, tuple) else (v, v)


@st.composite
def pool_cases(draw):
    N, C = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    R, S = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    kernel = draw(st.sampled_from([(R, S), R]))
    (R, S) = as_pair(kernel)
    stride = draw(st.one_of(st.none(), pair_or_int(st.integers(1, 3))))
    padding = draw(st.one_of(st.just(0), st.tuples(st.integers(0, R // 2),
                                                   st.integers(0, S // 2))))
    (ph, pw) = as_pair(padding)
    H = draw(st.integers(max(1, R - 2 * ph), 7))
    W = draw(st.integers(max(1, S - 2 * pw), 7))
    seed = draw(st.integers(0, 2**32 - 1))
    return (N, C, H, W), kernel, stride, padding, seed



def pool_loops(x, kernel, stride, padding, kind):
    """(out, winner): max pool as PyTorch's CPU loop, the first maximum over the real pixels
    of each window, and that pixel's (h, w); avg pool counting padded zeros."""
    (R, S), (sh, sw), (ph, pw) = kernel, stride, padding
    N, C, H, W = x.shape
    OH, OW = (H + 2 * ph - R) // sh + 1, (W + 2 * pw - S) // sw + 1
    out = np.zeros((N, C, OH, OW))
    winner = np.zeros((N, C, OH, OW, 2), int)
    for n in range(N):
        for c in range(C):
            for i in range(OH):
                for j in range(OW):
                    h0, w0 = i * sh - ph, j * sw - pw
                    rows = range(max(h0, 0), min(h0 + R, H))
                    cols = range(max(w0, 0), min(w0 + S, W))
                    if kind == "avg":
                        out[n, c, i, j] = sum(x[n, c, h, w] for h in rows for w in cols) / (R * S)
                        continue
                    best, at = -np.inf, (rows[0], cols[0])
                    for h in rows:
                        for w in cols:
                            if x[n, c, h, w] > best:
                                best, at = x[n, c, h, w], (h, w)
                    out[n, c, i, j], winner[n, c, i, j] = best, at
    return out, winner




@case("conv2d")
def _(draw, rng, fd):
    N, C, K = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    R, S = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    stride = draw(pair_or_int(st.integers(1, 3)))
    padding = draw(pair_or_int(st.integers(0, 2)))
    (ph, pw) = as_pair(padding)
    H = draw(st.integers(max(1, R - 2 * ph), 7))
    W = draw(st.integers(max(1, S - 2 * pw), 7))
    inputs = [rng.standard_normal((N, C, H, W)), rng.standard_normal((K, C, R, S))]
    if draw(st.booleans()):
        inputs.append(rng.standard_normal(K))
    return Case(lambda x, w, b=None: F.conv2d(x, w, b, stride=stride, padding=padding),
                lambda x, w, b=None: _conv2d_ref(x, w, b, as_pair(stride), as_pair(padding),
                                                 (1, 1), 1),
                inputs, tol="acc")


def _pool_case(draw, rng, kind):
    x_shape, kernel, stride, padding, _ = draw(pool_cases())
    pool = F.max_pool2d if kind == "max" else F.avg_pool2d
    window = as_pair(kernel), as_pair(kernel if stride is None else stride), as_pair(padding)
    # distinct values: no ties within eps of each other
    return Case(lambda x: pool(x, kernel, stride, padding),
                lambda x: pool_loops(x, *window, kind)[0], [rng.standard_normal(x_shape)])


@case("max_pool2d")
def _(draw, rng, fd):
    return _pool_case(draw, rng, "max")


@case("avg_pool2d")
def _(draw, rng, fd):
    return _pool_case(draw, rng, "avg")



# Random outputs cannot be compared across backends (the mask stream is per backend).
CROSS_BACKEND_CASES = sorted(name for name in CASES if name != "dropout")


def _draw_case(data, name, fd):
    seed = data.draw(st.integers(0, 2 ** 32 - 1), label="seed")
    return CASES[name](data.draw, np.random.default_rng(seed), fd)


def _forward(dev, c, arrays, dtype, record):
    """Run c.fn on `arrays` (the grad inputs) on dev; return (output Node, input Nodes, tape)."""
    nodes = [param(a, dev, dtype) for a in arrays]
    consts = [tensor(v, dev, dtype) if np.asarray(v).dtype.kind == "f" else v
              for v in c.consts]
    if c.seed is not None:
        netcl.manual_seed(c.seed)
    if not record:
        return c.fn(*nodes, *consts), nodes, None
    with netcl.Tape() as tape:
        out = c.fn(*nodes, *consts)
    return out, nodes, tape


def _forward_backward(dev, c, dtype, grad_out_seed=0):
    """Output and input gradients for a random upstream gradient (as host arrays)."""
    out, nodes, tape = _forward(dev, c, c.inputs, dtype, record=True)
    y = host(out)
    g = np.random.default_rng(grad_out_seed).standard_normal(y.shape)
    tape.backward(out, grad=tensor(g, dev, dtype))
    grads = []
    for node in nodes:
        assert node.grad is not None, "an input of the op got no gradient"
        grads.append(host(node.grad))
    return y, g, grads


def _central_differences(f, arrays, g, eps=1e-6):
    """d sum(f(arrays) * g) / d arrays[i] for each i, by central differences (float64 arrays;
    f takes the list of arrays and returns a host array)."""
    grads = []
    for i, array in enumerate(arrays):
        shifted = [a.copy() for a in arrays]
        numeric = np.zeros_like(array)
        for idx in np.ndindex(array.shape):
            values = []
            for value in (array[idx] + eps, array[idx] - eps):
                shifted[i][idx] = value
                values.append(float(np.sum(f(shifted) * g)))
            shifted[i][idx] = array[idx]
            numeric[idx] = (values[0] - values[1]) / (2 * eps)
        grads.append(numeric)
    return grads


# --- core ops: float64 reference and finite differences on the NumPy backend

@pytest.mark.parametrize("name", sorted(CASES))
@FD_SETTINGS
@given(data=st.data())
def test_op_forward_and_gradient_float64(name, data, cpu):
    c = _draw_case(data, name, fd=True)
    y, g, grads = _forward_backward(cpu, c, np.float64)
    assert y.dtype == np.float64, f"{name}: float64 input gave a {y.dtype} output on the CPU"
    if c.ref is not None:
        expected = np.asarray(c.ref(*c.inputs, *c.consts))
        assert y.shape == expected.shape
        # float64 arithmetic on both sides: they agree to rounding.
        np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)

    numerics = _central_differences(
        lambda arrays: host(_forward(cpu, c, arrays, np.float64, record=False)[0]), c.inputs, g)
    for i, (analytic, numeric) in enumerate(zip(grads, numerics)):
        assert analytic.shape == c.inputs[i].shape
        assert analytic.dtype == np.float64
        np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-7,
                                   err_msg=f"{name}: gradient of input {i}")


# --- core ops: the OpenCL backend against the NumPy backend, float32, random shapes

TOLERANCE = {"ew": dict(rtol=1e-5, atol=1e-6), "acc": dict(rtol=1e-4, atol=1e-4)}


@pytest.mark.parametrize("name", CROSS_BACKEND_CASES)
@XB_SETTINGS
@given(data=st.data())
def test_op_opencl_matches_numpy(name, data, cpu, opencl):
    c = _draw_case(data, name, fd=False)
    c = c._replace(inputs=[a.astype(np.float32) for a in c.inputs],
                   consts=[v.astype(np.float32) if v.dtype.kind == "f" else v
                           for v in map(np.asarray, c.consts)])
    y_cpu, _, grads_cpu = _forward_backward(cpu, c, None)
    y_cl, _, grads_cl = _forward_backward(opencl, c, None)
    def tol(reference):
        """TOLERANCE[c.tol]; for a sum ("acc") its atol is relative to the largest value of
        the result: float32 rounding in sums whose terms cancel is of the terms' size, not of
        the small result's (attention's gradients, a GEMM's row of mixed signs)."""
        tolerance = dict(TOLERANCE[c.tol])
        if c.tol == "acc" and np.size(reference):
            tolerance["atol"] *= max(1.0, float(np.nanmax(np.abs(np.where(
                np.isfinite(reference), reference, 0)))))
        return tolerance

    assert y_cpu.dtype == np.float32 and y_cl.dtype == np.float32
    expected = np.asarray(c.ref(*[a.astype(np.float64) for a in c.inputs], *c.consts))
    assert y_cpu.shape == expected.shape and y_cl.shape == expected.shape
    np.testing.assert_allclose(y_cpu, expected, **tol(expected),
                               err_msg=f"{name}: NumPy backend forward")
    np.testing.assert_allclose(y_cl, y_cpu, **tol(expected), err_msg=f"{name}: forward")
    for i, (g_cl, g_cpu) in enumerate(zip(grads_cl, grads_cpu)):
        assert g_cl.shape == g_cpu.shape == c.inputs[i].shape
        np.testing.assert_allclose(g_cl, g_cpu, **tol(g_cpu),
                                   err_msg=f"{name}: gradient of input {i}")


@pytest.mark.parametrize("m, k, n", [
    (1, 1, 1), (1, 129, 1), (129, 1, 129), (4, 8, 16), (5, 9, 17), (3, 64, 65), (64, 64, 64),
    (65, 33, 127), (257, 130, 300),
])
def test_gemm_edge_shapes_opencl_matches_numpy(cpu, opencl, m, k, n):
    """Fixed shapes around tile sizes, through all three GEMM forms: x @ w.T + b forward,
    g @ w and g.T @ x backward."""
    rng = np.random.default_rng(m * 10007 + k * 101 + n)
    c = Case(F.linear, None, [rng.standard_normal((m, k)).astype(np.float32),
                              rng.standard_normal((n, k)).astype(np.float32),
                              rng.standard_normal(n).astype(np.float32)])
    y_cpu, _, grads_cpu = _forward_backward(cpu, c, None)
    y_cl, _, grads_cl = _forward_backward(opencl, c, None)
    x, w, b = (a.astype(np.float64) for a in c.inputs)
    np.testing.assert_allclose(y_cpu, x @ w.T + b, **TOLERANCE["acc"])
    np.testing.assert_allclose(y_cl, y_cpu, **TOLERANCE["acc"])
    for g_cl, g_cpu in zip(grads_cl, grads_cpu):
        np.testing.assert_allclose(g_cl, g_cpu, **TOLERANCE["acc"])


# Each device picks one GEMM form (packed float8 rows on CPU devices; on GPUs the vector
# kernels in one of three block sizes where the operands' rows are multiples of 4, else
# 64x64 or 128x128 local-memory tiles, split over K when the tiles are few and K is long).
# CI runs on PoCL, so every form is forced here in turn: (gemm, compute units, the vector
# blocks to choose from; () for none).
GEMM_FORMS = {"packed": ("packed", None, None), "tiles64": ("tiled", 10 ** 9, ()),
              "tiles128": ("tiled", 1, ()), "split_k": ("tiled", 64, None),
              **{f"vector{rows}x{cols}": ("tiled", 1, ((rows, cols, threads, speed),))
                 for rows, cols, threads, speed in netcl._VECTOR_BLOCKS}}


def _force_gemm_form(opencl, monkeypatch, form):
    gemm, units, blocks = GEMM_FORMS[form]
    monkeypatch.setattr(opencl, "gemm", gemm)
    if units is not None:
        monkeypatch.setattr(opencl, "compute_units", units)
    if blocks is not None:
        monkeypatch.setattr(netcl, "_VECTOR_BLOCKS", blocks)


@pytest.mark.parametrize("form", sorted(GEMM_FORMS))
@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (5, 0, 3), (70, 129, 33), (130, 17, 129),
                                     (64, 5000, 100), (7, 4099, 9), (130, 300, 900),
                                     (70, 8192, 60), (68, 132, 260), (4, 8, 4), (4, 0, 8),
                                     (68, 8192, 64), (36, 2048, 10)])
def test_every_gemm_form_matches_numpy(opencl, monkeypatch, form, m, k, n):
    """Every layout, without bias, with one per column or one per row; (130, 300, 900) is
    past _PANEL_MACS, where the packed form packs both operands into panels, and (70, 8192,
    60) has the long K over a small C that it splits into _PANEL_K_CHUNK-long chunks
    (without bias). The vector
    kernels take the shapes whose operands' rows are multiples of 4, (68, 132, 260) in
    every layout, ragged against each block; (36, 2048, 10) takes them for A B^T, whose C
    has rows of 10, and splits K with the bias (split_k)."""
    _force_gemm_form(opencl, monkeypatch, form)
    rng = np.random.default_rng(m * 7 + k * 3 + n)
    a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    biases = {None: 0, "columns": rng.standard_normal(n), "rows": rng.standard_normal(m)}
    for trans_a, trans_b in ((False, False), (False, True), (True, False)):
        A = tensor(a.T.copy() if trans_a else a, opencl)
        B = tensor(b.T.copy() if trans_b else b, opencl)
        for per, bias in biases.items():  # none, one per column (linear), per row (conv2d)
            out = netcl._gemm(A, B, trans_a, trans_b, None if per is None else tensor(bias, opencl),
                              bias_rows=per == "rows")
            expected = a @ b + (bias[:, None] if per == "rows" else bias)
            np.testing.assert_allclose(host(out), expected, rtol=1e-4,
                                       atol=1e-4 * max(1.0, np.abs(expected).max()))


@pytest.fixture(scope="session", params=[(6, 16), (12, 32)], ids=["6x16", "12x32"])
def packed(request, opencl):
    """A Device on the OpenCL device whose packed GEMM computes blocks of C of this shape,
    whatever the CPU's own (kernels.cl: gemm_packed; netcl._panel_shape picks 12x32 where
    vectors hold 16 floats, 6x16 elsewhere): CI's machine tests both builds."""
    import pyopencl as cl
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(netcl, "_panel_shape", lambda cl_device, context: request.param)
        device = netcl.Device("opencl", f"{opencl.name} ({request.param} panels)",
                              cl.CommandQueue(opencl.context), opencl.cl_device)
    netcl._devices_by_queue[id(device.queue)] = device  # tensors on its queue are its own
    device.gemm = "packed"
    assert (device.panel_rows, device.panel_cols) == request.param
    assert netcl.Tensor.from_host(np.zeros(1), device.queue).device is device
    return device


@pytest.mark.parametrize("width, log, shape", [
    (8, "", (6, 16)),  # AVX2's vectors: no probe needed
    (16, "", (12, 32)),  # AVX-512's, and a compiler that targets them
    # AVX-512's, but a compiler that targets AVX2 (PoCL's LLVM on a Zen 4 EPYC)
    (16, "warning: AVX vector argument of type '__private float16' (vector of 16 'float' "
         "values) without 'avx512f' enabled changes the ABI", (6, 16))])
def test_panel_shape_follows_what_the_compiler_targets(monkeypatch, width, log, shape):
    """12x32 blocks only where the compiler writes 16-float vectors: a CPU's vector width
    alone is not enough (12x32 ran at 0.6x the speed of 6x16 on such an EPYC)."""
    built = []

    class Program:  # stands in for pyopencl.Program: its build log is `log`
        def __init__(self, context, source):
            built.append(source)

        def build(self):
            return self

        def get_build_info(self, device, what):
            return log

    monkeypatch.setattr(netcl.cl, "Program", Program)
    device = types.SimpleNamespace(native_vector_width_float=width)
    assert netcl._panel_shape(device, None) == shape
    assert len(built) == (width >= 16)


def test_panel_shape_of_this_device_builds_without_abi_warnings(opencl):
    """The packed kernels in the shape this CPU device gets build without clang's warning
    that a vector argument changes the ABI (a float16 passed where the compiler does not
    target AVX-512 sent vstore16's stores astray, and broke PoCL's kernel cache)."""
    import pyopencl as cl
    if not opencl.cl_device.type & cl.device_type.CPU:
        pytest.skip("the packed GEMM runs on CPU devices")
    for rows, cols in {(opencl.panel_rows, opencl.panel_cols), (6, 16), (12, 32)}:
        program = cl.Program(opencl.context, netcl._kernel_source())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program.build(options=[f"-DPANEL_ROWS={rows}", f"-DPANEL_COLS={cols}"])
        log = program.get_build_info(opencl.cl_device, cl.program_build_info.LOG) or ""
        assert "changes the ABI" not in log, (rows, cols, log[:500])
        assert len(program.all_kernels()) > 100


@pytest.mark.parametrize("batch_a, batch_b, m, k, n", [
    (0, 0, 1, 1, 1), (0, 0, 13, 70, 33),  # small: A's own rows, ragged against 6, 12, 16, 32
    (0, 0, 130, 300, 900),                 # past _PANEL_MACS: both operands in panels
    (0, 0, 25, 1000, 700),                 # bands of column panels, the last one narrower
    (0, 0, 70, 8192, 60),                  # a long K over a small C, split into chunks
    (3, 3, 20, 50, 40), (2, 0, 37, 64, 35), (0, 4, 7, 9, 65)])  # batches, one side or both
def test_packed_gemm_in_either_panel_shape_matches_numpy(packed, batch_a, batch_b, m, k, n):
    """Every layout, with no bias, one per column and one per row, in either panel shape."""
    rng = np.random.default_rng(m + k + n)
    a = rng.standard_normal((batch_a, m, k) if batch_a else (m, k))
    b = rng.standard_normal((batch_b, k, n) if batch_b else (k, n))
    t = lambda x: np.ascontiguousarray(np.swapaxes(x, -1, -2))
    biases = {None: 0, "columns": rng.standard_normal(n), "rows": rng.standard_normal(m)}
    for trans_a, trans_b in ((False, False), (False, True), (True, False)):
        A, B = tensor(t(a) if trans_a else a, packed), tensor(t(b) if trans_b else b, packed)
        for per, bias in biases.items():
            if per is not None and (batch_a or batch_b):
                continue  # a batch's products take no bias
            launches = packed.launches
            out = netcl._gemm(A, B, trans_a, trans_b, None if per is None else tensor(bias, packed),
                              bias_rows=per == "rows")
            assert out.device is packed and packed.launches > launches
            expected = a @ b + (bias[:, None] if per == "rows" else bias)
            np.testing.assert_allclose(host(out), expected, rtol=1e-4,
                                       atol=1e-4 * max(1.0, np.abs(expected).max()))


@pytest.mark.parametrize("m, k, n, trans_a, trans_b, kernel, splits", [
    (4096, 4096, 4096, False, False, "gemm_nn_128x256", 1),
    (1024, 1024, 1024, False, True, "gemm_nt_64x128", 1),
    (4096, 4096, 784, True, False, "gemm_tn_128x256", 1),  # a large MLP's first weight gradient
    (50176, 288, 64, False, False, "gemm_nn_64x64", 1),     # tall, 64 columns
    (64, 50176, 288, False, True, "gemm_nt_64x64", 105),    # a long K over a small C: split
    (4096, 4096, 10, False, True, "gemm_nt_64x64", 9),      # rows of 10 in C: stored singly
    (128, 784, 256, False, True, "gemm_nt_64x64", 1),       # a small MLP's first layer
    (4096, 4095, 4096, False, False, "gemm_nn_big", 1),     # rows of 4095: no float4s
    (130, 300, 900, True, False, "gemm_tn", 1),             # A^T with rows of 130
    (10, 4095, 4096, False, False, "gemm_nn_split", 2),     # rows of 4095, few tiles
])
def test_gpu_gemm_picks_its_kernel_by_shape(opencl, monkeypatch, m, k, n, trans_a, trans_b,
                                            kernel, splits):
    """On a GPU of 132 compute units (the H200), which tiled kernel each product takes, and
    into how many chunks it splits K (the third dimension of its grid). The launches are
    recorded, not run."""
    monkeypatch.setattr(opencl, "gemm", "tiled")
    monkeypatch.setattr(opencl, "compute_units", 132)
    launched = []
    monkeypatch.setattr(opencl, "launch", lambda name, grid, *args, **kwargs:
                        launched.append((name, grid)))
    a = netcl.Tensor.empty((k, m) if trans_a else (m, k), queue=opencl.queue)
    b = netcl.Tensor.empty((n, k) if trans_b else (k, n), queue=opencl.queue)
    netcl._gemm(a, b, trans_a, trans_b)
    (name, grid), *sums = launched
    assert (name, grid[2]) == (kernel, splits)
    assert len(sums) == (splits > 1)  # the partial products' sum


@pytest.mark.parametrize("winograd", [True, False])
def test_gpu_conv2d_stores_no_columns(opencl, monkeypatch, winograd):
    """On a GPU of 132 compute units, the benchmark's conv2d (64, 32, 28, 28) with 64 3x3
    filters, after one launch that lays out the filters for the forward and the input
    gradient: by Winograd's F(2x2, 3x3) (kernels.cl: conv_winograd_*), the forward, the input
    gradient by the turned filters, and the weight gradient over every tile, split over the
    compute units and summed, with the bias gradient as one more column of its sums; without
    it (_WINOGRAD False, or a device without the local memory), the forward and the input
    gradient direct convolutions (conv_direct_*), and the weight gradient an implicit GEMM
    (conv_wgrad_*) over every sample's pixels, its long K split over the grid and summed, with
    the bias gradient as one more column of it. No columns are stored: im2col, col2im and the
    transposing kernels never run. The launches are recorded, not run."""
    monkeypatch.setattr(opencl, "gemm", "tiled")
    monkeypatch.setattr(opencl, "compute_units", 132)
    monkeypatch.setattr(netcl, "_WINOGRAD", winograd)
    launched = []
    monkeypatch.setattr(opencl, "launch", lambda name, grid, *args, **kwargs:
                        launched.append((name, grid)))
    x, w, b = (netcl.Parameter(netcl.Tensor.empty(shape, queue=opencl.queue))
               for shape in ((64, 32, 28, 28), (64, 32, 3, 3), (64,)))
    with netcl.Tape() as tape:
        out = F.conv2d(x, w, b, padding=1)
    tape.backward(out, grad=netcl.Tensor.empty(out.shape, queue=opencl.queue))
    if winograd:
        # the filters: a work-item per filter and channel for each layout; 64 * 14 * 14
        # tiles of 2x2 pixels: the forward's in blocks of 32 by 64 filters (512 work-items),
        # the input gradient's in blocks of 32 by its 32 rows (256); the weight gradient's in
        # 131 splits of 96 (132 units, one block of filters by channels)
        assert launched == [("winograd_filters", (2 * 64 * 32,)),
                            ("conv_winograd_64x32", (392 * 512, 1)),
                            ("conv_winograd_32x32", (392 * 256, 1)),
                            ("conv_winograd_wgrad_64x32", (131 * 512, 1, 1)),
                            ("conv_wgrad_sum", (64 * (32 * 9 + 1),))]
        return
    # the forward: 64 samples of 7 blocks of 128 pixels, one block of 64 filters; the input
    # gradient: 7 blocks of 128 pixels per sample, one block of its 32 rows; the weight
    # gradient's K, 64 * 784 pixels, in 105 chunks of 480 (_conv_plan)
    assert launched[:3] == [("conv_filters", (64 * 32 * 9,)),
                            ("conv_direct_64x128", (64 * 7 * 128, 1)),
                            ("conv_direct_32x128", (64 * 7 * 128, 1))]
    assert [name for name, _ in launched[3:]] == ["conv_wgrad_64x64", "conv_wgrad_sum"]
    assert launched[3][1][2] == 105


@pytest.mark.parametrize("short", ["local memory", "work-items"])
def test_gpu_conv2d_without_winograds_resources_takes_the_direct_kernels(opencl, monkeypatch,
                                                                        short):
    """A device with less than the 48 KiB of local memory Winograd's kernels take, or with
    work-groups smaller than their 512 work-items, runs 3x3 convolutions at stride 1 by the
    direct kernels: the NumPy backend's output and gradients."""
    monkeypatch.setattr(opencl, "gemm", "tiled")
    if short == "local memory":
        monkeypatch.setattr(netcl, "_WINOGRAD_LOCAL_BYTES", opencl.cl_device.local_mem_size + 1)
    else:
        monkeypatch.setattr(netcl, "_WINOGRAD_THREADS", opencl.cl_device.max_work_group_size + 1)
    window = netcl._window("conv2d", (2, 3, 8, 8), (3, 3), (1, 1), (1, 1), (1, 1))
    assert not netcl._winograd_fits(opencl, 2, 3, 64, window)
    launched = []
    launch = opencl.launch
    monkeypatch.setattr(opencl, "launch", lambda name, *args, **kwargs: (
        launched.append(name), launch(name, *args, **kwargs)))
    rng = np.random.default_rng(8)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in
              ((2, 3, 8, 8), (64, 3, 3, 3), (64,))]
    g = rng.standard_normal((2, 64, 8, 8)).astype(np.float32)
    op = lambda x, w, b: F.conv2d(x, w, b, padding=1)
    want_out, want_grads = run_op(op, arrays, g, netcl.manager.default("cpu"))
    got_out, got_grads = run_op(op, arrays, g, opencl)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-4, atol=1e-4)
    for got, want in zip(got_grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not any("winograd" in name for name in launched)
    assert launched.count("conv_direct_64x128") == 1


def test_winograd_counts_in_32_bits(opencl):
    """Winograd's kernels take a batch whose tiles of the output and of the input, 16
    work-items each, and whose transformed filters (16 per filter and channel, each count
    rounded up to a multiple of 4) stay below 2**31; beyond that (a long batch of large
    images, or filters of 4.8 GB) conv2d takes other kernels."""
    window = netcl._window("conv2d", (1, 3, 1024, 1024), (3, 3), (1, 1), (1, 1), (1, 1))
    per_sample = 512 * 512  # 2x2 tiles of a 1024x1024 image
    largest = (2 ** 31 - 1) // (16 * per_sample)
    assert netcl._winograd_fits(opencl, largest, 3, 64, window)
    assert not netcl._winograd_fits(opencl, largest + 1, 3, 64, window)
    assert netcl._winograd_fits(opencl, 1, 11584, 3, window)  # 16 * 11584**2 < 2**31
    assert not netcl._winograd_fits(opencl, 1, 3, 11588, window)


def test_kernels_cl_builds_winograd_only_where_it_fits(opencl, monkeypatch):
    """kernels.cl builds Winograd's kernels (48 KiB of static local memory, work-groups of
    512 required) only for a device that has both; elsewhere they would fail the whole
    build. A device short of local memory gets the rest of the kernels, and conv2d there
    the direct ones."""
    assert "conv_winograd_64x32" in opencl._kernels  # PoCL has both
    monkeypatch.setattr(netcl, "_WINOGRAD_LOCAL_BYTES", opencl.cl_device.local_mem_size + 1)
    kernels = opencl._build_program(half=False)
    assert not any("winograd" in name for name in kernels)
    assert "conv_direct_64x128" in kernels and "gemm_nn" in kernels


IM2COL_BYTES = netcl._IM2COL_BYTES


@XB_SETTINGS
@given(data=st.data())
def test_gpu_implicit_conv2d_matches_numpy(opencl, monkeypatch, data):
    """GPUs' conv2d with few stored columns: with 3x3 filters at stride 1, undilated, all
    three by Winograd's F(2x2, 3x3) (kernels.cl: conv_winograd_*), the input gradient by the
    turned filters, the weight gradient's tiles split or not; or without it (_WINOGRAD False),
    the forward a direct convolution (conv_direct_*) in chunks of input channels (unless its
    local memory would not hold one channel), and so the input gradient; else the forward an
    implicit GEMM (conv_fwd_*) and the input gradient a product and col2im; the weight
    gradient, where Winograd does not take it, an implicit GEMM (conv_wgrad_*).
    Each GEMM where the operand it reads in float4s has rows of a multiple of 4 (else that
    product takes im2col's columns), with a bias or not, the samples' columns in chunks or
    not: over blocks of filters and pixels and slices of K that the sizes leave ragged, the
    weight gradient's K split or not, strides, dilation, and padding wider than the window.
    Output and gradients are the NumPy backend's, and the kernels that ran are the ones
    these rules pick."""
    draw = data.draw
    monkeypatch.setattr(opencl, "gemm", "tiled")
    monkeypatch.setattr(opencl, "compute_units", draw(st.sampled_from([2, 132])))
    N, C, K = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4, 8, 12, 40])), \
        draw(st.sampled_from([1, 3, 8, 70]))
    square = draw(st.booleans())  # 3x3 filters at stride 1, undilated: the direct window
    R, S = (3, 3) if square else (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    stride = (1, 1) if square else draw(st.sampled_from([(1, 1), (2, 1), (1, 2)]))
    dilation = (1, 1) if square else draw(st.sampled_from([(1, 1), (2, 1), (1, 3)]))
    padding = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))
    span = ((R - 1) * dilation[0] + 1, (S - 1) * dilation[1] + 1)
    H = draw(st.integers(max(1, span[0] - 2 * padding[0]), 30))
    W = draw(st.integers(max(1, span[1] - 2 * padding[1]), 30))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    with_bias = draw(st.booleans())  # with one, the weight gradient's product sums it too
    chunks = N if draw(st.booleans()) else 1  # > 1: each product that takes columns
    # does it a sample at a time (set in every example: the patch outlives the example)
    monkeypatch.setattr(netcl, "_IM2COL_BYTES", 1 if chunks > 1 else IM2COL_BYTES)
    # the direct convolutions' chunks of input channels (a fresh plan cache: the limits
    # change between examples), or no local memory for them: the implicit GEMM's forward
    fits = draw(st.booleans())
    winograd = draw(st.booleans()) and (R, S) == (3, 3) and stride == dilation == (1, 1)
    monkeypatch.setattr(netcl, "_WINOGRAD", winograd)
    direct = fits and (R, S) == (3, 3) and stride == dilation == (1, 1) and not winograd
    monkeypatch.setattr(netcl, "_DIRECT_CHANNELS", draw(st.sampled_from([1, 3, 8])))
    monkeypatch.setattr(netcl, "_DIRECT_LOCAL_BYTES", 32 * 1024 if fits else 4)
    monkeypatch.setattr(netcl, "_direct_plan", functools.lru_cache(netcl._direct_plan.__wrapped__))
    arrays = [rng.standard_normal(s).astype(np.float32) for s in
              ((N, C, H, W), (K, C, R, S), (K,))[:3 if with_bias else 2]]
    op = lambda x, w, b=None: F.conv2d(x, w, b, stride=stride, padding=padding,
                                       dilation=dilation)
    cpu = netcl.manager.default("cpu")
    OH, OW = op(*(tensor(a, cpu) for a in arrays)).shape[2:]
    g = rng.standard_normal((N, K, OH, OW)).astype(np.float32)
    want_out, want_grads = run_op(op, arrays, g, cpu)
    launched = []
    launch = opencl.launch
    monkeypatch.setattr(opencl, "launch", lambda name, *args, **kwargs: (
        launched.append(name), launch(name, *args, **kwargs)))
    got_out, got_grads = run_op(op, arrays, g, opencl)
    scale = lambda want: 1e-4 * max(1.0, np.abs(want).max())
    np.testing.assert_allclose(got_out, want_out, rtol=1e-4, atol=scale(want_out))
    for got, want in zip(got_grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=scale(want))
    conv = [name.rsplit("_", 1)[0] for name in launched if name.startswith("conv_")
            and name not in ("conv_wgrad_sum", "conv_filters")]
    # the input gradient: a direct (or Winograd) convolution where the padding is within the
    # window's span, else a product and col2im
    direct_x = (direct or winograd) and max(padding) <= 2
    if winograd:
        assert conv == ["conv_winograd"] * (1 + direct_x) + ["conv_winograd_wgrad"]
        assert launched.count("winograd_filters") == 1  # the forward lays out both
        assert launched.count("im2col") == 0
        # the weight gradient's tiles split where the units outnumber its blocks of 64
        # filters by 32 channels and there are more tiles than one chunk of 8
        tiles = N * -(-OH // 2) * -(-OW // 2)
        split = tiles > 8 and opencl.compute_units > -(-K // 64) * -(-C // 32)
        assert launched.count("conv_wgrad_sum") == (with_bias or split)
    else:
        forward = ["conv_direct"] if direct else ["conv_fwd"] * (C * R * S % 4 == 0)
        assert conv == (forward + ["conv_direct"] * direct_x
                        + ["conv_wgrad"] * (OH * OW % 4 == 0))
        assert launched.count("conv_filters") == direct  # the forward lays out both layouts
        assert launched.count("im2col") == ((not direct and C * R * S % 4 != 0)
                                            + (OH * OW % 4 != 0)) * chunks
        # the bias gradient: a column of the weight gradient's product (per chunk of samples
        # where the weight gradient takes im2col's columns)
        implicit_w = OH * OW % 4 == 0
        assert launched.count("conv_wgrad_sum") == with_bias * (1 if implicit_w else chunks)
    assert launched.count("col2im") == (not direct_x) * chunks


@pytest.mark.parametrize("gemm", ["winograd", "tiled", "packed"])
def test_conv2d_weight_gradient_with_a_frozen_bias(opencl, monkeypatch, gemm):
    """A bias that needs no gradient leaves the weight gradient's product as it is (no
    column of ones: GPUs' Winograd sums, on one compute unit written in place, and their
    implicit GEMM, CPU devices' packed one), and the weight gradient right; a trainable bias
    with a frozen weight gets its gradient from sums of its own."""
    monkeypatch.setattr(opencl, "gemm", "packed" if gemm == "packed" else "tiled")
    monkeypatch.setattr(netcl, "_WINOGRAD", gemm == "winograd")
    monkeypatch.setattr(opencl, "compute_units", 1)
    rng = np.random.default_rng(5)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in
               ((2, 3, 6, 6), (5, 3, 3, 3), (5,)))
    g = rng.standard_normal((2, 5, 6, 6)).astype(np.float32)
    cpu = netcl.manager.default("cpu")
    launched = []
    launch = opencl.launch
    monkeypatch.setattr(opencl, "launch", lambda name, *args, **kwargs: (
        launched.append(name), launch(name, *args, **kwargs)))
    for frozen in ("b", "w"):
        results = []
        for device in (cpu, opencl):
            X, W, B = (netcl.Parameter(netcl.Tensor.from_host(a, queue=device.queue))
                       for a in (x, w, b))
            (B if frozen == "b" else W).requires_grad = False
            with netcl.Tape() as tape:
                out = F.conv2d(X, W, B, padding=1)
            tape.backward(out, grad=g)
            trained = W if frozen == "b" else B
            results.append((X.grad.to_host(), trained.grad.to_host()))
            assert (B if frozen == "b" else W).grad is None
        for got, want in zip(results[1], results[0]):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert "conv_wgrad_sum" not in launched
    assert launched.count({"winograd": "conv_winograd_wgrad_64x32", "tiled": "conv_wgrad_64x64",
                           "packed": "im2col_panels_t"}[gemm]) == 1


@pytest.mark.parametrize("shapes", [((0, 3, 6, 6), (5, 3, 3, 3)), ((2, 0, 6, 6), (5, 0, 3, 3))])
def test_gpu_conv2d_of_empty_operands_launches_no_empty_grid(opencl, monkeypatch, shapes):
    """An empty batch or no input channels on a GPU's conv2d (3x3 at stride 1: the direct
    convolutions' window): the NumPy backend's output and gradients (the bias alone, or
    nothing), and no launch with a grid of 0 work-items, an error before OpenCL 2.1."""
    monkeypatch.setattr(opencl, "gemm", "tiled")
    launched = []
    launch = opencl.launch
    monkeypatch.setattr(opencl, "launch", lambda name, grid, *args, **kwargs: (
        launched.append((name, grid)), launch(name, grid, *args, **kwargs)))
    x_shape, w_shape = shapes
    arrays = [np.ones(s, np.float32) for s in (x_shape, w_shape, w_shape[:1])]
    op = lambda x, w, b: F.conv2d(x, w, b, padding=1)
    g = np.ones((x_shape[0], w_shape[0]) + x_shape[2:], np.float32)
    want_out, want_grads = run_op(op, arrays, g, netcl.manager.default("cpu"))
    got_out, got_grads = run_op(op, arrays, g, opencl)
    np.testing.assert_array_equal(got_out, want_out)
    for got, want in zip(got_grads, want_grads):
        np.testing.assert_array_equal(got, want)
    assert [name for name, grid in launched if 0 in grid] == []


def test_gpu_direct_input_gradient_lays_out_its_own_filters(opencl, monkeypatch):
    """Where the forward's direct convolution does not fit in local memory (64 filters by
    a halo) but the input gradient's does (3 rows), the forward is an implicit GEMM and the
    backward lays out the turned filters itself (conv_filters, one launch) for its direct
    convolution: the NumPy backend's output and gradients."""
    monkeypatch.setattr(opencl, "gemm", "tiled")
    monkeypatch.setattr(netcl, "_WINOGRAD", False)  # (else Winograd's kernels take all three)
    # 8x8 pixels at padding 1: a 10x10 halo; per channel the forward's block takes
    # 4 * (64*9 + 100) bytes, the input gradient's 4 * (32*9 + 100)
    monkeypatch.setattr(netcl, "_DIRECT_LOCAL_BYTES", 2000)
    monkeypatch.setattr(netcl, "_direct_plan", functools.lru_cache(netcl._direct_plan.__wrapped__))
    launched = []
    launch = opencl.launch
    monkeypatch.setattr(opencl, "launch", lambda name, *args, **kwargs: (
        launched.append(name), launch(name, *args, **kwargs)))
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 8, 8), (64, 3, 3, 3))]
    g = rng.standard_normal((2, 64, 8, 8)).astype(np.float32)
    op = lambda x, w: F.conv2d(x, w, padding=1)
    want_out, want_grads = run_op(op, arrays, g, netcl.manager.default("cpu"))
    got_out, got_grads = run_op(op, arrays, g, opencl)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-4, atol=1e-4)
    for got, want in zip(got_grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert [name for name in launched if name.startswith("conv_")
            and not name.startswith("conv_wgrad")] == ["conv_filters", "conv_direct_32x128"]


@pytest.mark.parametrize("gemm", ["tiled", "packed"])
def test_conv2d_of_a_float16_weight_with_a_bias(opencl, monkeypatch, gemm):
    """A float16 weight (float16 storage, outside autocast) takes the products on im2col's
    columns, with the bias gradient as their column of ones' sums: float32 gradients, the
    float32 results on the same values."""
    monkeypatch.setattr(opencl, "gemm", gemm)
    rng = np.random.default_rng(12)
    arrays = [rng.standard_normal(s).astype(np.float16).astype(np.float32) for s in
              ((2, 8, 4, 4), (5, 8, 3, 3), (5,))]
    g = rng.standard_normal((2, 5, 4, 4)).astype(np.float32)
    op = lambda x, w, b: F.conv2d(x, w, b, padding=1)
    params = _opencl_against_numpy(opencl, op, arrays, g, (np.float32, np.float16, np.float32))
    assert all(p.grad.dtype == np.float32 for p in params)


def _opencl_against_numpy(opencl, fn, arrays, g, dtypes):
    """fn's output and gradients (for the seed g) on OpenCL, its operands Parameters of
    `arrays` stored as `dtypes`, against the NumPy backend's on the float32 arrays; returns
    the OpenCL Parameters."""
    want_out, want_grads = run_op(fn, arrays, g, netcl.manager.default("cpu"))
    params = [netcl.Parameter(netcl.Tensor.from_host(a, queue=opencl.queue, dtype=dtype))
              for a, dtype in zip(arrays, dtypes)]
    with netcl.Tape() as tape:
        out = fn(*params)
    tape.backward(out, grad=g)
    np.testing.assert_allclose(host(out), want_out, rtol=1e-4, atol=1e-4)
    for p, want in zip(params, want_grads):
        np.testing.assert_allclose(host(p.grad).astype(np.float32), want, rtol=1e-4, atol=1e-4)
    return params


@pytest.mark.parametrize("gemm", ["tiled", "packed"])
@pytest.mark.parametrize("op", ["linear", "conv2d 3x3", "conv2d 5x5", "conv2d 3x3 direct"])
def test_a_float16_bias_is_read_as_its_values(opencl, monkeypatch, gemm, op):
    """A float16 bias (float16 storage, outside autocast) beside float32 operands adds its
    own values, widened, in linear and in every conv2d path (Winograd's, the direct kernels,
    im2col's products): the kernels read a bias as float32, so it is widened first."""
    monkeypatch.setattr(opencl, "gemm", gemm)
    monkeypatch.setattr(netcl, "_WINOGRAD", op != "conv2d 3x3 direct")
    rng = np.random.default_rng(13)
    if op == "linear":
        shapes, fn, g_shape = ((6, 8), (5, 8), (5,)), F.linear, (6, 5)
    else:
        r = 5 if op.endswith("5x5") else 3
        shapes, g_shape = ((2, 8, 6, 6), (5, 8, r, r), (5,)), (2, 5, 9 - r, 9 - r)
        fn = lambda x, w, b: F.conv2d(x, w, b, padding=1)
    arrays = [rng.standard_normal(s).astype(np.float16).astype(np.float32) for s in shapes]
    g = rng.standard_normal(g_shape).astype(np.float32)
    _opencl_against_numpy(opencl, fn, arrays, g, (np.float32, np.float32, np.float16))


def test_tiled_gemm_plan_follows_the_device_compute_units(opencl, monkeypatch):
    """_tiled_gemm's launch plan is cached, keyed by the device's compute units too: the same
    product splits K over many units and takes the 128x128 tiles on one, right both times.
    (Rows of 95 keep it on the scalar kernels.)"""
    monkeypatch.setattr(opencl, "gemm", "tiled")
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((2048, 95)), rng.standard_normal((2048, 200))
    A, B = tensor(a, opencl), tensor(b, opencl)
    launched = []
    real_launch = opencl.launch
    monkeypatch.setattr(opencl, "launch", lambda name, *args, **kwargs: (
        launched.append(name), real_launch(name, *args, **kwargs)))
    for units, kernel in ((132, "gemm_tn_split"), (1, "gemm_tn_big"), (132, "gemm_tn_split")):
        monkeypatch.setattr(opencl, "compute_units", units)
        launched.clear()
        out = netcl._gemm(A, B, trans_a=True)
        assert launched[0] == kernel
        np.testing.assert_allclose(host(out), a.T @ b, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("form", sorted(GEMM_FORMS))
def test_every_gemm_form_takes_a_batch(opencl, monkeypatch, form):
    """A batch of products past _PANEL_MACS each, against one shared matrix on either side
    and against a batch, in every layout (the vector kernels take all but A^T B, whose A
    has rows of 130), and a batch with a long K."""
    _force_gemm_form(opencl, monkeypatch, form)
    rng = np.random.default_rng(3)
    m, k, n = 130, 300, 900
    shapes = (((2, m, k), (2, k, n)), ((m, k), (2, k, n)), ((2, m, k), (k, n)),
              ((2, 68, 4096), (2, 4096, 64)))  # a long K: split_k's vector kernels split it
    for a_shape, b_shape in shapes:
        a, b = rng.standard_normal(a_shape), rng.standard_normal(b_shape)
        for trans_a, trans_b in ((False, False), (False, True), (True, False)):
            A = tensor(np.swapaxes(a, -1, -2).copy() if trans_a else a, opencl)
            B = tensor(np.swapaxes(b, -1, -2).copy() if trans_b else b, opencl)
            expected = np.matmul(a, b)
            np.testing.assert_allclose(host(netcl._gemm(A, B, trans_a, trans_b)), expected,
                                       rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("gemm", ["packed", "tiled"])
@pytest.mark.parametrize("shape, axis", [((4096, 3), 0), ((2, 1536, 5), 1), ((512, 1), 0),
                                         ((4096, 40), 0), ((3, 2048, 17), 1), ((6, 784), 1),
                                         ((5, 3, 1000), 2)])
def test_long_sums_over_few_columns_match_numpy(cpu, opencl, monkeypatch, gemm, shape, axis):
    """A sum over few long columns (a bias gradient over a large batch) is split into chunks
    on CPU devices, then the chunks are summed; on GPUs ("tiled") 16 or more columns take
    sum_columns' one launch, and long rows (the last axis) sum_rows' work-group per row. Forward and backward match the NumPy backend. Small integers
    sum exactly in float32 in any order, so only a wrong sum can differ."""
    monkeypatch.setattr(opencl, "gemm", gemm)
    x = np.random.default_rng(9).integers(-8, 9, shape).astype(np.float32)
    for reduce in (F.sum, F.mean):
        results = []
        for dev in (cpu, opencl):
            p = param(x, dev)
            with netcl.Tape() as tape:
                out = reduce(p, axis=axis)
            tape.backward(out, grad=np.ones(out.shape, np.float32))
            results.append((host(out), host(p.grad)))
        (out32, grad32), (out_cl, grad_cl) = results
        np.testing.assert_allclose(out_cl, out32, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(grad_cl, grad32)


# --- cross_entropy targets and errors

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_index_and_one_hot_agree(backend, reduction):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((9, 6)).astype(np.float32) * 2
    labels = rng.integers(0, 6, size=9)
    one_hot = np.eye(6, dtype=np.float32)[labels]
    g = rng.standard_normal(9).astype(np.float32) if reduction == "none" else None
    results = []
    for target in [labels, labels.astype(np.int32), tensor(labels.astype(np.int32), backend),
                   one_hot, tensor(one_hot, backend), netcl.Node(tensor(one_hot, backend))]:
        x = param(logits, backend)
        with netcl.Tape() as tape:
            loss = F.cross_entropy(x, target, reduction=reduction)
        tape.backward(loss, grad=g)
        results.append((host(loss), host(x.grad)))
    expected = _cross_entropy_ref(logits.astype(np.float64), labels, reduction)
    for loss, grad in results:
        np.testing.assert_allclose(loss, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(loss, results[0][0], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(grad, results[0][1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad_label", [17, 5, -1, -4])
def test_cross_entropy_out_of_range_label(backend, bad_label):
    logits = param(np.zeros((4, 5), np.float32), backend)
    labels = np.array([0, 1, bad_label, 2])
    with raises_naming(ValueError, bad_label):
        F.cross_entropy(logits, labels)


@pytest.mark.parametrize("width", [9, 4])
def test_cross_entropy_wrong_one_hot_width(backend, width):
    logits = param(np.zeros((3, 5), np.float32), backend)
    target = np.eye(width, dtype=np.float32)[[0, 1, 2]]
    with raises_naming(ValueError, width):
        F.cross_entropy(logits, target)


# --- dropout

def test_dropout_mask_scale_and_seed(backend):
    rng = np.random.default_rng(4)
    p = 0.3
    x_host = _away_from_zero(rng, (64, 50)).astype(np.float32)
    g = rng.standard_normal((64, 50)).astype(np.float32)

    def run(seed):
        x = param(x_host, backend)
        netcl.manual_seed(seed)
        with netcl.Tape() as tape:
            y = F.dropout(x, p, True)
        tape.backward(y, grad=g)
        return host(y), host(x.grad)

    y, grad = run(5)
    kept = y != 0
    np.testing.assert_allclose(y[kept], x_host[kept] / (1 - p), rtol=1e-6)
    assert abs((~kept).mean() - p) < 0.05, f"dropped fraction {(~kept).mean()} for p={p}"
    np.testing.assert_allclose(grad, np.where(kept, g / (1 - p), 0), rtol=1e-6)
    y_again, grad_again = run(5)
    np.testing.assert_array_equal(y_again, y)
    np.testing.assert_array_equal(grad_again, grad)
    y_other, _ = run(6)
    assert not np.array_equal(y_other != 0, kept), "a different seed gave the same mask"
    # Two calls after one seed draw different masks from the stream.
    netcl.manual_seed(5)
    first = host(F.dropout(tensor(x_host, backend), p, True))
    second = host(F.dropout(tensor(x_host, backend), p, True))
    np.testing.assert_array_equal(first, y)
    assert not np.array_equal(first != 0, second != 0)


def test_dropout_identity_when_not_training_or_p_zero(backend):
    rng = np.random.default_rng(5)
    x_host = rng.standard_normal((8, 9)).astype(np.float32)
    g = rng.standard_normal((8, 9)).astype(np.float32)
    for p, training in [(0.5, False), (0.0, True)]:
        x = param(x_host, backend)
        with netcl.Tape() as tape:
            y = F.dropout(x, p=p, training=training)
        tape.backward(y, grad=g)
        np.testing.assert_array_equal(host(y), x_host)
        np.testing.assert_array_equal(host(x.grad), g)


# --- convolution and pooling: their forwards and gradients are op cases (conv2d, max_pool2d,
# avg_pool2d); here PyTorch's tie rule and NaN, the chunked im2col path and skipped gradients

# --- the max pool gradient written from its definition, one output at a time -----------------

def max_pool_grad_loops(g, winner, x_shape):
    dx = np.zeros(x_shape)
    N, C, OH, OW = g.shape
    for n in range(N):
        for c in range(C):
            for i in range(OH):
                for j in range(OW):
                    h, w = winner[n, c, i, j]
                    dx[n, c, h, w] += g[n, c, i, j]
    return dx


def run_op(op, arrays, g, device, dtype=np.float32):
    """(output, [gradient of each array]) of sum(op(*arrays) * g), on `device`."""
    params = [netcl.Parameter(netcl.Tensor.from_host(a, queue=device.queue, dtype=dtype))
              for a in arrays]
    with netcl.Tape() as tape:
        out = op(*params)
    tape.backward(out, grad=g)
    return out.value.to_host(), [p.grad.to_host() for p in params]


# --- conv2d -----------------------------------------------------------------------------------

def _im2col_taps(device, taps):
    """The float32 columns per pixel conv2d's im2col budgets for: on CPU devices (packed) the
    weight gradient's panels pad a pixel's taps to a whole panel."""
    return netcl._round_up(taps, device.panel_cols) if device.gemm == "packed" else taps


def test_conv2d_im2col_in_chunks_matches_whole_batch(opencl, monkeypatch):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in ((5, 3, 6, 5), (4, 3, 3, 3), (4,))]
    g = rng.standard_normal((5, 4, 3, 3)).astype(np.float32)
    op = lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1)
    whole = run_op(op, arrays, g, opencl)
    monkeypatch.setattr(netcl, "_IM2COL_BYTES", 2 * _im2col_taps(opencl, 27) * 9 * 4)  # 2 a chunk
    launches = opencl.launches
    chunked = run_op(op, arrays, g, opencl)
    assert opencl.launches - launches > 15  # 3 chunks: the chunked path really ran
    np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-6, atol=1e-6)
    for got, want in zip(chunked[1], whole[1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


CONV2D_GEMM_CASES = [
    # panels of 16 pixels straddling rows and samples, the last one ragged; two tap panels,
    # the second ragged; stride, padding and dilation differing along H and W
    (((3, 5, 11, 9), (7, 5, 3, 2)), dict(stride=(2, 1), padding=(1, 2), dilation=(2, 1)), None),
    # 4608 pixels: the weight gradient's long K split into chunks, the last one short
    (((2, 3, 48, 48), (5, 3, 3, 3)), dict(padding=1), None),
    # im2col in chunks of two samples, one of 1 x 1 filters
    (((5, 6, 7, 5), (4, 6, 1, 1)), dict(stride=2), 2),
    # 28 x 28 pixels per sample, a multiple of 4: the vector kernels, one product per sample
    (((3, 4, 28, 28), (8, 4, 3, 3)), dict(padding=1), None),
]


@pytest.mark.parametrize("shapes, geometry, per_chunk", CONV2D_GEMM_CASES)
@pytest.mark.parametrize("gemm", ["packed", "tiled"])
def test_conv2d_on_its_gemm_layouts_matches_numpy(opencl, monkeypatch, shapes, geometry,
                                                  per_chunk, gemm):
    """On CPU devices (packed) conv2d's im2col writes the packed GEMM's panels and its product
    writes NCHW; on GPUs (tiled) each sample's columns are a matrix of their own, and each
    product of the forward and backward is one batched GEMM that reads and writes NCHW.
    Output and gradients are NumPy's at the edges of those panels and tiles."""
    monkeypatch.setattr(opencl, "gemm", gemm)
    _check_conv2d_against_numpy(opencl, monkeypatch, shapes, geometry, per_chunk)


def test_packed_gemm_bands_no_wider_than_its_columns(packed, monkeypatch):
    """A short K would make a band of column panels wider than C (kernels.cl: gemm_packed
    maps its ids through band x row panels, which must stay within C's blocks: an int)."""
    launched = []
    launch = packed.launch
    monkeypatch.setattr(packed, "launch", lambda name, *args, **kwargs: (
        launched.append((name, args)), launch(name, *args, **kwargs)))
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((20000, 1)), rng.standard_normal((1, 40))
    out = netcl._gemm(tensor(a, packed), tensor(b, packed))
    (grid, local, M, N, K, k_chunk, band, *_), = [args for name, args in launched
                                                  if name == "gemm_packed"]
    assert 1 <= band <= -(-N // packed.panel_cols)
    np.testing.assert_allclose(host(out), a @ b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shapes, geometry, per_chunk", CONV2D_GEMM_CASES)
def test_conv2d_in_either_panel_shape_matches_numpy(packed, monkeypatch, shapes, geometry,
                                                    per_chunk):
    """im2col's panels (of pixels, and of taps for the weight gradient) as wide as the packed
    GEMM's, in either shape."""
    _check_conv2d_against_numpy(packed, monkeypatch, shapes, geometry, per_chunk)


def _check_conv2d_against_numpy(opencl, monkeypatch, shapes, geometry, per_chunk):
    rng = np.random.default_rng(9)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    arrays.append(rng.standard_normal(shapes[1][0]).astype(np.float32))
    op = lambda x, w, b: F.conv2d(x, w, b, **geometry)
    cpu = netcl.manager.default("cpu")
    g = rng.standard_normal(op(*(tensor(a, cpu) for a in arrays)).shape).astype(np.float32)
    want_out, want_grads = run_op(op, arrays, g, cpu)
    if per_chunk:
        C, R, S = shapes[1][1:]
        taps = _im2col_taps(opencl, C * R * S)
        monkeypatch.setattr(netcl, "_IM2COL_BYTES", per_chunk * taps * want_out[0, 0].size * 4)
    got_out, got_grads = run_op(op, arrays, g, opencl)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(got_grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_conv2d_skips_gradients_nobody_needs(backend):
    """The input of a first layer is data: its gradient is not computed, dw still is."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 5, 5)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    g = rng.standard_normal((2, 4, 5, 5)).astype(np.float32)
    launches = backend.launches
    _, (_, want) = run_op(lambda x, w: F.conv2d(x, w, padding=1), [x, w], g, backend)
    both = backend.launches - launches
    weight = netcl.Parameter(netcl.Tensor.from_host(w, backend.queue))
    launches = backend.launches
    with netcl.Tape() as tape:
        out = F.conv2d(x, weight, padding=1)
    tape.backward(out, grad=g)
    np.testing.assert_allclose(weight.grad.to_host(), want, rtol=1e-6, atol=1e-6)
    if backend.backend == "opencl":
        assert backend.launches - launches < both


# --- pooling ----------------------------------------------------------------------------------

@XB_SETTINGS
@given(pool_cases(), st.data())
def test_max_pool_ties_go_to_the_first_maximum(backend, case, data):
    """Few distinct values (and -inf) make ties everywhere; the gradient follows PyTorch:
    the first maximum in row-major order among each window's real pixels."""
    x_shape, kernel, stride, padding, seed = case
    x = np.random.default_rng(seed).choice(
        np.array([-np.inf, 0.0, 1.0, 2.0], np.float32), size=x_shape,
        p=data.draw(st.sampled_from([(0.1, 0.3, 0.3, 0.3), (0.7, 0.1, 0.1, 0.1)])))
    stride_pair = as_pair(kernel if stride is None else stride)
    expected, winner = pool_loops(x, as_pair(kernel), stride_pair, as_pair(padding), "max")
    g = np.random.default_rng(seed + 1).standard_normal(expected.shape).astype(np.float32)
    out, (grad,) = run_op(lambda p: F.max_pool2d(p, kernel, stride, padding), [x], g, backend)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_allclose(grad, max_pool_grad_loops(g, winner, x_shape), rtol=1e-6,
                               atol=1e-6)


def test_max_pool_nan_propagates(backend):
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    x[0, 0, 0, 1] = np.nan
    x[0, 0, 1, 0] = np.nan
    out, (grad,) = run_op(lambda p: F.max_pool2d(p, 2), [x], np.ones((1, 1, 2, 2), np.float32),
                          backend)
    assert np.isnan(out[0, 0, 0, 0]) and np.array_equal(out[0, 0, 1], [13, 15])
    assert grad[0, 0, 0, 1] == 1 and grad[0, 0, 1, 0] == 0  # the first NaN wins its window


def test_pool_defaults_and_known_values(backend):
    x = np.arange(1, 17, dtype=np.float32).reshape(1, 1, 4, 4)
    np.testing.assert_array_equal(F.max_pool2d(netcl.Tensor.from_host(x, backend.queue), 2)
                                  .value.to_host(), [[[[6, 8], [14, 16]]]])
    avg = F.avg_pool2d(netcl.Tensor.from_host(x, backend.queue), 3, stride=1, padding=1)
    assert avg.shape == (1, 1, 4, 4)  # padded zeros count: the corner is (1+2+5+6) / 9
    np.testing.assert_allclose(avg.value.to_host()[0, 0, 0, 0], 14 / 9, rtol=1e-6)
    assert F.max_pool2d(netcl.Tensor.from_host(np.zeros((1, 1, 5, 7), np.float32), backend.queue),
                        2).shape == (1, 1, 2, 3)  # sizes round down


# --- invalid arguments: ValueError naming them, before anything is enqueued -------------------

X, W = (2, 3, 5, 5), (4, 3, 3, 3)  # a valid input and weight; the cases below break one thing


@pytest.mark.parametrize("call, words", [
    (lambda t: F.conv2d(t(2, 3, 2, 2), t(*W)), ["conv2d", "kernel (3, 3)", "padded input (2, 2)"]),
    (lambda t: F.conv2d(t(2, 3, 1, 5), t(*W), padding=(0, 1)),
     ["conv2d", "kernel (3, 3)", "padded input (1, 7)"]),
    (lambda t: F.conv2d(t(2, 2, 5, 5), t(*W)), ["conv2d", "2 channels", "expects 3"]),
    (lambda t: F.conv2d(t(*X), t(*W), stride=0), ["conv2d", "stride", "0"]),
    (lambda t: F.conv2d(t(*X), t(*W), stride=(1, -2)), ["conv2d", "stride", "-2"]),
    (lambda t: F.conv2d(t(*X), t(*W), padding=-1), ["conv2d", "padding", "-1"]),
    (lambda t: F.conv2d(t(*X), t(*W), t(5)), ["conv2d", "bias", "(5,)", "(4,)"]),
    (lambda t: F.conv2d(t(3, 5, 5), t(*W)), ["conv2d", "4-D", "(3, 5, 5)"]),
    (lambda t: F.conv2d(t(*X), t(3, 3, 3)), ["conv2d", "4-D", "(3, 3, 3)"]),
    (lambda t: F.max_pool2d(t(*X), 6), ["max_pool2d", "kernel (6, 6)", "padded input (5, 5)"]),
    (lambda t: F.max_pool2d(t(*X), 3, padding=2), ["max_pool2d", "pad should be at most half"]),
    (lambda t: F.max_pool2d(t(*X), 2, stride=0), ["max_pool2d", "stride", "0"]),
    (lambda t: F.avg_pool2d(t(*X), (2, 0)), ["avg_pool2d", "kernel_size", "(2, 0)"]),
    (lambda t: F.avg_pool2d(t(*X), 8, padding=(1, 4)), ["avg_pool2d", "kernel (8, 8)", "(7, 13)"]),
    (lambda t: F.avg_pool2d(t(5, 5), 2), ["avg_pool2d", "4-D", "(5, 5)"]),
    (lambda t: nn.Conv2d(3, 4, 0), ["kernel_size", "0"]),
    (lambda t: nn.Conv2d(3, 4, 3, stride=0), ["stride", "0"]),
    (lambda t: nn.MaxPool2d(2, stride=-1), ["MaxPool2d", "stride", "-1"]),
    (lambda t: nn.MaxPool2d(2, padding=2), ["MaxPool2d", "pad should be at most half"]),
])
def test_invalid_arguments_raise_value_error_naming_them(backend, call, words):
    tensor = lambda *shape: netcl.Tensor.from_host(np.zeros(shape, np.float32), backend.queue)
    launches = backend.launches
    with pytest.raises(ValueError) as error:
        call(tensor)
    for word in words:
        assert word in str(error.value)
    assert backend.launches == launches


# --- modules ----------------------------------------------------------------------------------

def test_conv2d_module_init_state_dict_and_names(backend):
    netcl.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, queue=backend.queue), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Conv2d(8, 4, (3, 2), stride=(1, 2), bias=False,
                                                     queue=backend.queue),
                          nn.Flatten(), nn.Linear(4 * 3 * 2, 10, queue=backend.queue))
    state = model.state_dict()
    assert list(state) == ["0.weight", "0.bias", "3.weight", "5.weight", "5.bias"]
    assert state["0.weight"].shape == (8, 3, 3, 3) and state["0.bias"].shape == (8,)
    assert state["3.weight"].shape == (4, 8, 3, 2)
    for key, fan_in in (("0.weight", 27), ("0.bias", 27), ("3.weight", 48)):
        bound = 1 / np.sqrt(fan_in)  # PyTorch's U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        assert np.abs(state[key]).max() <= bound and np.abs(state[key]).max() > 0.8 * bound
    conv = model[0]
    assert (conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding) == \
        (3, 8, (3, 3), (1, 1), (1, 1))
    assert (model[2].kernel_size, model[2].stride, model[2].padding) == (2, 2, 0)

    x = np.random.default_rng(0).standard_normal((2, 3, 10, 10)).astype(np.float32)
    out = model(netcl.Tensor.from_host(x, backend.queue))
    assert out.shape == (2, 10)
    netcl.manual_seed(0)
    again = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, queue=backend.queue), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Conv2d(8, 4, (3, 2), stride=(1, 2), bias=False,
                                                     queue=backend.queue),
                          nn.Flatten(), nn.Linear(4 * 3 * 2, 10, queue=backend.queue))
    for key, value in again.state_dict().items():
        np.testing.assert_array_equal(value, state[key])  # manual_seed reproduces the init
    again.load_state_dict({k: v + 1 for k, v in state.items()})
    np.testing.assert_array_equal(again.state_dict()["3.weight"], state["3.weight"] + 1)

    expected = F.conv2d(x, conv.weight, conv.bias, padding=1).value.to_host()
    np.testing.assert_array_equal(conv(netcl.Tensor.from_host(x, backend.queue)).value.to_host(),
                                  expected)


def test_small_cnn_learns(backend, digits):
    """A conv-relu-pool CNN fits a batch of the digits: the whole stack trains end to end."""
    x = digits.x[:128].reshape(-1, 1, 8, 8)
    y = digits.y[:128]
    netcl.manual_seed(0)
    q = backend.queue
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, queue=q), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(8 * 4 * 4, 10, queue=q))
    opt = netcl.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xb = netcl.Tensor.from_host(x, q)
    losses = []
    for _ in range(30):
        with netcl.Tape() as tape:
            loss = F.cross_entropy(model(xb), y)
        opt.zero_grad()
        tape.backward(loss)
        opt.step()
        losses.append(float(loss.value.to_host()))
    assert losses[-1] < 0.25 * losses[0]


# --- PyTorch's behaviour at the edges: NumPy and integer operands, NaN, empty axis lists

def test_integer_arrays_join_float_operands_as_float(backend):
    x = param(np.arange(6.0).reshape(2, 3), backend)
    assert (x + np.arange(3)).dtype == np.float32
    loss = F.mse_loss(x, np.ones((2, 3), np.int64))
    assert float(host(loss)) == pytest.approx(np.mean((np.arange(6.0) - 1) ** 2))
    layer = nn.Linear(4, 2, queue=backend.queue)
    pixels = np.arange(8, dtype=np.uint8).reshape(2, 4)
    expected = pixels.astype(np.float64) @ host(layer.weight).T + host(layer.bias)
    np.testing.assert_allclose(host(layer(pixels)), expected, rtol=1e-5)
    relu = F.relu(netcl.Tensor.from_host(np.arange(-1, 2), backend.queue))  # int32 promotes
    assert relu.dtype == np.float32
    np.testing.assert_array_equal(host(relu), [0.0, 0.0, 1.0])


def test_numpy_array_on_the_left_of_an_operator(backend):
    x = param(np.ones((4, 5)), backend)
    np.testing.assert_array_equal(host(np.arange(5, dtype=np.float32) * x), np.tile(np.arange(5.0), (4, 1)))
    np.testing.assert_array_equal(host(np.ones((3, 4), np.float32) @ x), np.full((3, 5), 4.0))
    np.testing.assert_array_equal(host(np.ones(5, np.float32) - x), np.zeros((4, 5)))


def test_relu_gradient_passes_at_nan_as_pytorch(backend):
    x = param([np.nan, -1.0, 2.0], backend)
    with netcl.Tape() as tape:
        y = F.relu(x)
    tape.backward(y, grad=np.ones(3, np.float32))
    np.testing.assert_array_equal(host(x.grad), [1.0, 0.0, 1.0])


def test_reducing_over_no_listed_axis_reduces_all_as_pytorch(backend):
    x = param(np.arange(6.0).reshape(2, 3), backend)
    assert float(host(F.sum(x, axis=()))) == 15.0
    assert float(host(F.mean(x, axis=()))) == 2.5


# --- operands that are no real numbers, empty logits, reduction axes

@pytest.mark.parametrize("bad, needle", [(None, "None"), ("2", "'2'"), (object(), "object"),
                                         (np.array([1 + 5j, 2, 3]), "complex"), (1j, "1j")])
def test_operand_that_is_not_real_numbers_raises_type_error(backend, bad, needle):
    x = tensor(np.ones(3), backend)
    with raises_naming(TypeError, "mul", needle):
        F.mul(x, bad)
    with raises_naming(TypeError, "sub", needle):
        netcl.Node(x) - bad
    with raises_naming(TypeError, "relu", needle):
        F.relu(bad)
    if bad is not None:  # grad=None is the implied seed
        w = param(np.ones(3), backend)
        with netcl.Tape() as tape:
            loss = w * 2.0
        with raises_naming(TypeError, "backward", needle):
            tape.backward(loss, grad=bad)


def test_bool_and_integer_operands_promote_to_float(backend):
    x = tensor([1.0, 2.0, 3.0], backend)
    product = F.mul(x, np.array([True, False, True]))
    assert product.dtype == np.float32
    np.testing.assert_array_equal(host(product), [1.0, 0.0, 3.0])
    big = F.mul(x, np.array([2**40, 0, -(2**40)]))  # far outside int32, exact in float32
    np.testing.assert_array_equal(host(big), [2.0**40, 0.0, -3 * 2.0**40])
    w = param([1.0, 2.0], backend)
    with netcl.Tape() as tape:
        y = w * 3.0
    tape.backward(y, grad=np.array([1, 2]))
    assert w.grad.dtype == np.float32
    np.testing.assert_array_equal(host(w.grad), [3.0, 6.0])
    with netcl.Tape() as tape:
        y = w * 3.0
    with raises_naming(ValueError, "backward", "int32"):
        tape.backward(y, grad=tensor(np.array([1, 2]), backend))


@pytest.mark.parametrize("reduction, expected", [("mean", math.nan), ("sum", 0.0), ("none", None)])
@pytest.mark.parametrize("n, c, soft", [(3, 0, True), (0, 0, True), (0, 0, False), (0, 3, False),
                                        (0, 3, True)])
def test_cross_entropy_of_empty_logits_as_pytorch(backend, n, c, soft, reduction, expected):
    x = param(np.zeros((n, c)), backend)
    target = np.full((n, c), 0.5) if soft else np.zeros(n, np.int64)
    with netcl.Tape() as tape:
        loss = F.cross_entropy(x, target, reduction=reduction)
        total = F.sum(loss)
    tape.backward(total)
    if expected is None:
        np.testing.assert_array_equal(host(loss), np.zeros(n, np.float32))
    else:
        assert loss.shape == () and np.array_equal(host(loss), expected, equal_nan=True)
    assert host(x.grad).shape == (n, c)


def test_cross_entropy_with_no_classes_refuses_every_index(backend):
    with raises_naming(ValueError, "cross_entropy", "label 0", "[0, 0)"):
        F.cross_entropy(tensor(np.zeros((2, 0)), backend), np.array([0, 0]))


def test_reduction_axis_must_be_ints(backend):
    x = tensor(np.ones((2, 3)), backend)
    for name, op in (("sum", F.sum), ("mean", F.mean)):
        for bad in ("0", 1.0, True, (0, "1"), (1.0,), {0}):
            with raises_naming(TypeError, f"{name}: axis must be an int or a tuple of ints",
                               repr(bad)):
                op(x, axis=bad)
    np.testing.assert_array_equal(host(F.sum(x, axis=[np.int64(0), -1])), 6.0)
    with raises_naming(ValueError, "sum", "axis 2 out of range"):
        F.sum(x, axis=2)


def test_tanh_saturates_to_one_with_zero_gradient(backend):
    values = np.array([10.0, -10.0, 20.0, -20.0, np.inf, -np.inf])
    x = param(values, backend)
    with netcl.Tape() as tape:
        y = F.tanh(x)
        total = F.sum(y)
    tape.backward(total)
    np.testing.assert_array_equal(host(y), np.sign(values))
    np.testing.assert_array_equal(host(x.grad), np.zeros(6))
    half = F.tanh(tensor(values, backend, np.float16))  # float16 storage: the half build
    np.testing.assert_array_equal(host(half), np.sign(values))
    assert np.isnan(host(F.tanh(tensor([np.nan], backend)))[0])


# --- elementwise and reductions
# The conventions of PyTorch's gradients at the points the op cases keep away from, the
# edges (NaN, infinities, empty axes, zero-size tensors) and the errors. Expected values are
# PyTorch's, worked out from its formulas (derivatives.yaml, FunctionsManual.cpp).

def _value_and_grad(dev, op, *arrays, grad=None):
    """op(*leaves) on dev and the gradient of each leaf for an upstream gradient of ones."""
    leaves = [param(a, dev) for a in arrays]
    with netcl.Tape() as tape:
        out = op(*leaves)
    tape.backward(out, grad=np.ones(out.shape, np.float32) if grad is None else grad)
    return (host(out), *[host(p.grad) for p in leaves])


def test_abs_gradient_at_zero_is_zero(backend):
    x = np.array([0.0, -0.0, 2.0, -3.0, np.nan])
    y, grad = _value_and_grad(backend, F.abs, x)
    np.testing.assert_array_equal(y, [0.0, 0.0, 2.0, 3.0, np.nan])
    np.testing.assert_array_equal(grad, [0.0, 0.0, 1.0, -1.0, 0.0])  # sgn(0) = sgn(nan) = 0


@pytest.mark.parametrize("exponent, value, grad", [
    # x = 0, -2, 2; torch.pow's backward: exponent * x ** (exponent - 1), 0 for exponent 0
    (0, [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]),
    (0.5, [0.0, np.nan, math.sqrt(2)], [np.inf, np.nan, 0.5 / math.sqrt(2)]),
    (1, [0.0, -2.0, 2.0], [1.0, 1.0, 1.0]),
    (2, [0.0, 4.0, 4.0], [0.0, -4.0, 4.0]),
    (3, [0.0, -8.0, 8.0], [0.0, 12.0, 12.0]),
    (-1, [np.inf, -0.5, 0.5], [-np.inf, -0.25, -0.25]),
    (2.5, [0.0, np.nan, 2 ** 2.5], [0.0, np.nan, 2.5 * 2 ** 1.5]),
])
def test_pow_at_zero_and_negative_bases(backend, exponent, value, grad):
    y, g = _value_and_grad(backend, lambda x: x ** exponent, np.array([0.0, -2.0, 2.0]))
    np.testing.assert_allclose(y, value, rtol=1e-6)
    np.testing.assert_allclose(g, grad, rtol=1e-6)


def test_pow_gradient_is_zero_for_exponent_zero_even_at_nan(backend):
    y, g = _value_and_grad(backend, lambda x: F.pow(x, 0.0), np.array([np.nan, np.inf, 0.0]))
    np.testing.assert_array_equal(y, [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(g, [0.0, 0.0, 0.0])


def test_pow_takes_a_number_exponent(backend):
    x = tensor(np.ones(3), backend)
    with raises_naming(TypeError, "pow", "exponent", "Tensor"):
        F.pow(x, x)
    with raises_naming(TypeError, "pow", "exponent", "str"):
        netcl.Node(x) ** "2"


@pytest.mark.parametrize("low, high, value, grad", [
    (2.0, 2.5, [2.0, 2.0, 2.5, 2.5, np.nan], [0.0, 1.0, 1.0, 0.0, 0.0]),  # bounds pass g
    (3.0, 2.0, [2.0, 2.0, 2.0, 2.0, np.nan], [0.0, 0.0, 0.0, 0.0, 0.0]),  # min > max: max
    (2.0, None, [2.0, 2.0, 2.5, 3.0, np.nan], [0.0, 1.0, 1.0, 1.0, 0.0]),
    (None, 2.5, [1.0, 2.0, 2.5, 2.5, np.nan], [1.0, 1.0, 1.0, 0.0, 0.0]),
])
def test_clamp_at_the_bounds(backend, low, high, value, grad):
    x = np.array([1.0, 2.0, 2.5, 3.0, np.nan])
    y, g = _value_and_grad(backend, lambda x: F.clamp(x, low, high), x)
    np.testing.assert_array_equal(y, value)
    np.testing.assert_array_equal(g, grad)


def test_clamp_errors(backend):
    x = tensor(np.ones(3), backend)
    with raises_naming(ValueError, "clamp", "min", "max"):
        F.clamp(x)
    with raises_naming(TypeError, "clamp", "max"):
        F.clamp(x, 0.0, x)
    with raises_naming(TypeError, "clamp", "min"):
        F.clamp(x, min="0")


def test_silu_and_tanh_gelu_far_out(backend):
    """Large |x|: silu and the tanh GELU go to 0 and to x without inf or nan, in both
    directions (silu checked against a float64 transcription of PyTorch's formulas)."""
    x = np.array([-100.0, -30.0, -8.0, 8.0, 30.0, 100.0])
    y, g = _value_and_grad(backend, F.silu, x)
    np.testing.assert_allclose(y, x / (1 + np.exp(-x)), rtol=1e-6, atol=1e-30)
    sig = 1 / (1 + np.exp(-x))
    np.testing.assert_allclose(g, sig * (1 + x * (1 - sig)), rtol=1e-5, atol=1e-30)
    x = np.array([-100.0, -30.0, 30.0, 100.0])
    y, g = _value_and_grad(backend, lambda x: F.gelu(x, approximate="tanh"), x)
    np.testing.assert_array_equal(y, [0.0, 0.0, 30.0, 100.0])
    np.testing.assert_array_equal(g, [0.0, 0.0, 1.0, 1.0])


def test_gelu_approximate_argument(backend):
    x = tensor(np.random.default_rng(3).standard_normal((4, 5)), backend)
    np.testing.assert_array_equal(host(F.gelu(x, "none")), host(F.gelu(x)))
    np.testing.assert_allclose(host(F.gelu(x, approximate="tanh")),
                               _gelu_tanh_ref(host(x).astype(np.float64)), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(host(nn.GELU(approximate="tanh")(x)),
                                  host(F.gelu(x, approximate="tanh")))
    np.testing.assert_array_equal(host(nn.GELU()(x)), host(F.gelu(x)))
    with raises_naming(ValueError, "gelu", "approximate", "'sigmoid'"):
        F.gelu(x, approximate="sigmoid")
    with raises_naming(ValueError, "GELU", "approximate", "'fast'"):
        nn.GELU(approximate="fast")


@pytest.mark.parametrize("op, value, grad_a, grad_b", [
    # a = [1, 2, nan, 3], b = [1, 3, 1, nan]: ties split the gradient; NaN gives both all of it
    (F.maximum, [1.0, 3.0, np.nan, np.nan], [0.5, 0.0, 1.0, 1.0], [0.5, 1.0, 1.0, 1.0]),
    (F.minimum, [1.0, 2.0, np.nan, np.nan], [0.5, 1.0, 1.0, 1.0], [0.5, 0.0, 1.0, 1.0]),
])
def test_maximum_minimum_ties_and_nan(backend, op, value, grad_a, grad_b):
    y, ga, gb = _value_and_grad(backend, op, np.array([1.0, 2.0, np.nan, 3.0]),
                                np.array([1.0, 3.0, 1.0, np.nan]))
    np.testing.assert_array_equal(y, value)
    np.testing.assert_array_equal(ga, grad_a)
    np.testing.assert_array_equal(gb, grad_b)


def test_maximum_with_a_constant_and_shape_errors(backend):
    y, g = _value_and_grad(backend, lambda x: F.maximum(x, 0.0), np.array([-1.0, 0.0, 2.0]))
    np.testing.assert_array_equal(y, [0.0, 0.0, 2.0])
    np.testing.assert_array_equal(g, [0.0, 0.5, 1.0])  # relu's twin, but a tie shares
    for op in (F.maximum, F.minimum):
        with raises_naming(ValueError, op.__name__, "(2, 3)", "(4,)"):
            op(tensor(np.ones((2, 3)), backend), tensor(np.ones(4), backend))


def test_where_selects_exactly(backend):
    """The unchosen side never leaks, not even a NaN or an inf; signed zeros survive; the
    gradient goes to the chosen side only."""
    cond = np.array([True, False, True, False, True])
    a = np.array([-0.0, np.nan, np.inf, 1.0, 2.0])
    b = np.array([np.nan, -0.0, 5.0, -np.inf, 3.0])
    y, ga, gb = _value_and_grad(backend, lambda a, b: F.where(cond, a, b), a, b,
                                grad=np.full(5, 2.0, np.float32))
    np.testing.assert_array_equal(y, [-0.0, -0.0, np.inf, -np.inf, 2.0])
    assert list(np.signbit(y[:2])) == [True, True]
    np.testing.assert_array_equal(ga, [2.0, 0.0, 2.0, 0.0, 2.0])
    np.testing.assert_array_equal(gb, [0.0, 2.0, 0.0, 2.0, 0.0])


@pytest.mark.parametrize("kind", ["bool", "int", "tensor", "node"])
def test_where_condition_kinds(backend, kind):
    cond = np.array([[1, 0, 3], [0, -2, 0]])
    condition = {"bool": cond != 0, "int": cond, "tensor": tensor(cond, backend),
                 "node": netcl.Node(tensor(cond, backend))}[kind]
    a = np.arange(6.0).reshape(2, 3)
    out = F.where(condition, tensor(a, backend), -1.0)
    np.testing.assert_array_equal(host(out), np.where(cond != 0, a, -1.0))


def test_where_broadcasts_condition_and_sides(backend):
    cond = np.array([True, False, True])  # (3,) against (2, 3) and a scalar
    a, b = np.arange(6.0).reshape(2, 3), np.array([10.0, 20.0, 30.0])
    y, ga, gb = _value_and_grad(backend, lambda a, b: F.where(cond, a, b), a, b)
    np.testing.assert_array_equal(y, np.where(cond, a, b))
    np.testing.assert_array_equal(ga, np.broadcast_to(cond, (2, 3)).astype(np.float32))
    np.testing.assert_array_equal(gb, [0.0, 2.0, 0.0])
    out = F.where(tensor(cond, backend), 1.0, 0.0)  # two numbers: on the condition's device
    assert out.device is backend and out.dtype == np.float32
    np.testing.assert_array_equal(host(out), [1.0, 0.0, 1.0])


def test_where_and_masked_fill_errors(backend):
    x = tensor(np.ones((2, 3)), backend)
    with raises_naming(TypeError, "where", "condition", "float"):
        F.where(np.ones((2, 3)), x, x)
    with raises_naming(TypeError, "where", "condition", "float32"):
        F.where(x, x, x)
    with raises_naming(TypeError, "masked_fill", "mask", "float"):
        F.masked_fill(x, np.zeros(3), 1.0)
    with raises_naming(TypeError, "masked_fill", "value"):
        F.masked_fill(x, np.zeros(3, bool), x)
    with raises_naming(ValueError, "where", "(2, 3)", "(4,)"):
        F.where(np.ones(4, bool), x, x)
    with raises_naming(ValueError, "masked_fill", "(2, 3)", "(2,)"):
        x_node = netcl.Node(x)
        x_node.masked_fill(np.ones(2, bool), 0.0)


def test_where_condition_on_another_device_raises(cpu, opencl):
    with raises_naming(ValueError, "where", "devices"):
        F.where(tensor(np.ones(3, np.int32), cpu), tensor(np.ones(3), opencl), 0.0)


def test_masked_fill_causal_attention(backend):
    """The GPT use: scores masked above the diagonal with -inf, then softmax. Masked places
    get probability 0 and no gradient."""
    rng = np.random.default_rng(21)
    scores = rng.standard_normal((2, 4, 4))
    causal = np.tril(np.ones((4, 4)))
    weights = rng.standard_normal((2, 4, 4)).astype(np.float32)
    y, g = _value_and_grad(backend, lambda s: F.softmax(s.masked_fill(causal == 0, -math.inf)),
                           scores, grad=weights)
    masked = np.where(causal == 0, -np.inf, scores)
    expected = np.exp(masked - masked.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-7)
    assert np.all(y[:, causal == 0] == 0)
    # softmax's backward, then nothing where the fill was
    expected_grad = expected * (weights - (weights * expected).sum(-1, keepdims=True))
    np.testing.assert_allclose(g, expected_grad, rtol=1e-5, atol=1e-6)
    assert np.all(g[:, causal == 0] == 0)


def test_max_ties_share_the_gradient(backend):
    x = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]])
    y, g = _value_and_grad(backend, lambda x: F.max(x, 1), x)  # torch.amax(x, 1)
    np.testing.assert_array_equal(y, [3.0, 2.0])
    np.testing.assert_allclose(g, [[0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]], rtol=1e-7)
    y, g = _value_and_grad(backend, lambda x: x.max(), x)  # all of x
    assert y.shape == () and y == 3.0
    np.testing.assert_array_equal(g, [[0, 0.5, 0.5], [0, 0, 0]])
    y, g = _value_and_grad(backend, lambda x: F.min(x, 0, keepdims=True),
                           np.array([[1.0, 2.0, 5.0], [1.0, 3.0, 5.0]]))
    np.testing.assert_array_equal(y, [[1.0, 2.0, 5.0]])
    np.testing.assert_array_equal(g, [[0.5, 1, 0.5], [0.5, 0, 0.5]])


def test_max_with_nan(backend):
    """NaN is the largest and the smallest; a NaN extreme ties with nothing, so its column's
    gradient is NaN (g / 0 * 0), as PyTorch's amax backward."""
    x = np.array([[1.0, np.nan, 3.0], [2.0, 5.0, 4.0]])
    for op in (lambda x: F.max(x, 1), lambda x: F.min(x, 1)):
        y, g = _value_and_grad(backend, op, x)
        assert np.isnan(y[0]) and not np.isnan(y[1])
        assert np.isnan(g[0]).all() and not np.isnan(g[1]).any()


def test_argmax(backend):
    x = np.array([[1.0, 3.0, 3.0, 0.0], [np.nan, 2.0, np.nan, 9.0], [4.0, 4.0, 4.0, 4.0]])
    t = tensor(x, backend)
    out = F.argmax(t, 1)
    assert isinstance(out, netcl.Tensor) and out.dtype == np.int32
    np.testing.assert_array_equal(host(out), [1, 0, 0])  # the first of ties; NaN is largest
    np.testing.assert_array_equal(host(F.argmax(t, 0)), [1, 2, 1, 1])
    np.testing.assert_array_equal(host(F.argmax(t, -1, keepdims=True)), [[1], [0], [0]])
    assert host(F.argmax(tensor(np.array([[0.0, 1.0], [7.0, 2.0]]), backend))) == 2  # flat
    assert F.argmax(tensor(np.array([[0.0, 1.0]]), backend), keepdims=True).shape == (1, 1)
    assert F.argmax(netcl.Node(t), 1).shape == (3,)  # Nodes too; no gradient
    assert F.argmax(tensor(np.zeros((0, 3)), backend), 1).shape == (0,)


def test_reductions_over_empty_axes(backend):
    empty = tensor(np.zeros((2, 0)), backend)
    for op in (F.max, F.min, F.argmax):
        name = {F.max: "max", F.min: "min", F.argmax: "argmax"}[op]
        with raises_naming(ValueError, name, "empty", "(2, 0)"):
            op(empty, 1)
        with raises_naming(ValueError, name, "empty", "(2, 0)"):
            op(empty)  # all of an empty x
    np.testing.assert_array_equal(host(F.var(empty, 1)), [np.nan, np.nan])  # as PyTorch
    np.testing.assert_array_equal(host(F.std(empty, 1)), [np.nan, np.nan])
    np.testing.assert_array_equal(host(F.logsumexp(empty, 1)), [-np.inf, -np.inf])
    assert F.var(empty).shape == () and np.isnan(host(F.var(empty)))
    # an empty x reduced along a non-empty axis: an empty result, forward and backward
    for op in (lambda x: F.max(x, 1), lambda x: F.min(x, 1), lambda x: F.var(x, 1),
               lambda x: F.std(x, 1, keepdims=True), lambda x: F.logsumexp(x, -1)):
        y, g = _value_and_grad(backend, op, np.zeros((0, 3)))
        assert y.shape in ((0,), (0, 1)) and g.shape == (0, 3)


def test_softmax_embedding_and_masked_attention_over_empty_axes(backend):
    """As PyTorch: softmax and log_softmax over an empty axis are empty; an embedding of
    width 0 has a (num, 0) gradient; attention with a mask and no queries (L = 0) is empty,
    and with no keys (S = 0) is zeros; forward and backward on both backends."""
    for op in (lambda x: F.softmax(x, -1), lambda x: F.log_softmax(x, -1)):
        y, g = _value_and_grad(backend, op, np.zeros((3, 0)))
        assert y.shape == (3, 0) and g.shape == (3, 0)
    idx = tensor(np.array([1, 2], np.int32), backend)
    y, g = _value_and_grad(backend, lambda w: F.embedding(idx, w), np.zeros((10, 0)))
    assert y.shape == (2, 0) and g.shape == (10, 0)
    for L, S in ((0, 0), (0, 5), (3, 0)):
        for mask in (np.ones((L, S), bool), np.zeros((L, S), np.float32)):
            q, kv = np.ones((2, L, 8)), np.ones((2, S, 8))
            out, gq, gk, gv = _value_and_grad(
                backend, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                q, kv, kv)
            np.testing.assert_array_equal(out, np.zeros((2, L, 8)))
            assert gq.shape == (2, L, 8) and gk.shape == gv.shape == (2, S, 8)


@pytest.mark.parametrize("correction, value, grad", [
    # x = [[1, 2], [3, 3]] along axis 1; torch.var's backward 2 / (N - correction) g (x - mean)
    (0, [0.25, 0.0], [[-0.5, 0.5], [0.0, 0.0]]),
    (1, [0.5, 0.0], [[-1.0, 1.0], [0.0, 0.0]]),
    (0.5, [1 / 3, 0.0], [[-2 / 3, 2 / 3], [0.0, 0.0]]),
    (2, [np.inf, np.nan], [[-np.inf, np.inf], [np.nan, np.nan]]),  # N = correction
    (3, [np.inf, np.nan], [[1.0, -1.0], [0.0, 0.0]]),  # divides by max(N - correction, 0)
])
def test_var_corrections(backend, correction, value, grad):
    x = np.array([[1.0, 2.0], [3.0, 3.0]])
    y, g = _value_and_grad(backend, lambda x: F.var(x, 1, correction=correction), x)
    np.testing.assert_allclose(y, value, rtol=1e-6)
    np.testing.assert_allclose(g, grad, rtol=1e-6)


def test_std_of_a_constant_has_zero_gradient(backend):
    """PyTorch's std_backward masks the 1 / std of a zero std: 0, not nan."""
    x = np.array([[1.0, 2.0], [3.0, 3.0]])
    y, g = _value_and_grad(backend, lambda x: x.std(1), x)
    np.testing.assert_allclose(y, [math.sqrt(0.5), 0.0], rtol=1e-6)
    np.testing.assert_allclose(g, [[-math.sqrt(0.5), math.sqrt(0.5)], [0.0, 0.0]], rtol=1e-6)
    y, g = _value_and_grad(backend, lambda x: F.std(x), np.full(4, 7.0))
    assert y == 0.0
    np.testing.assert_array_equal(g, np.zeros(4))


def test_var_is_stable_far_from_zero(backend):
    """Two passes: a large mean does not swamp a small spread."""
    x = 1e4 + np.array([0.0, 1.0, 2.0, 3.0])
    np.testing.assert_allclose(host(F.var(tensor(x, backend))), np.var(x, ddof=1), rtol=1e-6)


def test_logsumexp_is_stable(backend):
    x = np.array([[1000.0, 1000.0], [-1000.0, -1001.0], [np.inf, 1.0], [-np.inf, -np.inf]])
    y, g = _value_and_grad(backend, lambda x: F.logsumexp(x, 1), x)
    np.testing.assert_allclose(y[:2], [1000 + math.log(2), -1000 + math.log1p(math.exp(-1))],
                               rtol=1e-6)
    np.testing.assert_array_equal(y[2:], [np.inf, -np.inf])  # not nan: shifted by 0
    # PyTorch's gradient, exp(x - lse), from the float32 lse: softmax up to lse's rounding
    # (float32's spacing at 1000 is 2**-14), and exactly what PyTorch gives (0.49998546 here)
    np.testing.assert_allclose(g[:2], np.exp(x[:2] - y[:2, None].astype(np.float64)), rtol=1e-6)
    np.testing.assert_allclose(g[:2], [[0.5, 0.5], [1 / (1 + math.exp(-1)),
                                                    1 / (1 + math.exp(1))]], atol=2 ** -14)
    np.testing.assert_array_equal(g[2:], [[np.nan, 0.0], [np.nan, np.nan]])  # as PyTorch


def test_reductions_reject_bad_axes_and_arguments(backend):
    x = tensor(np.ones((2, 3)), backend)
    for name, op in [("max", F.max), ("min", F.min), ("argmax", F.argmax), ("var", F.var),
                     ("std", F.std), ("logsumexp", F.logsumexp)]:
        with raises_naming(TypeError, name, "axis", "(0, 1)"):
            op(x, (0, 1))
        with raises_naming(ValueError, name, "axis", "2", "(2, 3)"):
            op(x, 2)
    with raises_naming(TypeError, "var", "correction"):
        F.var(x, correction="1")
    with raises_naming(TypeError, "logsumexp", "axis"):
        F.logsumexp(x)  # axis is required, as torch.logsumexp's dim


def test_reductions_of_a_zero_dimensional_tensor(backend):
    x = np.array(5.0)
    for op in (lambda x: F.max(x, 0), lambda x: F.min(x, -1), lambda x: F.logsumexp(x, 0)):
        y, g = _value_and_grad(backend, op, x)
        assert y.shape == () and y == 5.0 and g == 1.0
    assert host(F.argmax(tensor(x, backend), 0)) == 0
    y, g = _value_and_grad(backend, lambda x: F.var(x, correction=0), x)
    assert y == 0.0 and g == 0.0


@pytest.mark.parametrize("op", [
    F.sqrt, F.rsqrt, F.abs, lambda x: x ** 2, lambda x: F.clamp(x, -1.0, 1.0), F.silu,
    lambda x: F.gelu(x, approximate="tanh"), lambda x: F.maximum(x, x),
    lambda x: F.minimum(x, 0.0), lambda x: F.where(np.ones((0, 3), bool), x, 1.0),
    lambda x: x.masked_fill(np.zeros(3, bool), 2.0),
], ids=["sqrt", "rsqrt", "abs", "pow", "clamp", "silu", "gelu_tanh", "maximum", "minimum",
        "where", "masked_fill"])
def test_elementwise_on_zero_size_tensors(backend, op):
    y, g = _value_and_grad(backend, op, np.zeros((0, 3)))
    assert y.shape == (0, 3) and g.shape == (0, 3)


# --- normalisation, embedding and attention

def _batch_norm_module_ref(batches, momentum, eps=1e-5):
    """torch.nn.BatchNorm1d's training steps, transcribed: each batch normalised with its own
    statistics; running_mean and running_var (unbiased variance) moved by momentum, or by
    1 / num_batches_tracked for momentum=None. Returns the outputs and the final state."""
    C = batches[0].shape[1]
    running_mean, running_var = np.zeros(C), np.ones(C)
    outputs = []
    for count, x in enumerate(batches, start=1):
        axes = (0,) + tuple(range(2, x.ndim))
        n = x.size // C
        mean, var = x.mean(axis=axes), x.var(axis=axes)
        factor = 1.0 / count if momentum is None else momentum
        running_mean = (1 - factor) * running_mean + factor * mean
        running_var = (1 - factor) * running_var + factor * var * n / (n - 1)
        outputs.append(_batch_norm_ref(x, mean, var, eps=eps))
    return outputs, running_mean, running_var


@pytest.mark.parametrize("shape, module", [((8, 3), netcl.BatchNorm1d),
                                           ((5, 3, 4), netcl.BatchNorm1d),
                                           ((4, 3, 2, 5), netcl.BatchNorm2d)])
@pytest.mark.parametrize("momentum", [0.1, 0.5, None])
def test_batch_norm_running_stats_and_eval_follow_pytorch(backend, shape, module, momentum):
    rng = np.random.default_rng(40)
    batches = [(rng.standard_normal(shape) * (i + 1) + i).astype(np.float32) for i in range(3)]
    bn = module(3, momentum=momentum, queue=backend.queue)
    outputs, running_mean, running_var = _batch_norm_module_ref(batches, momentum)
    for x, expected in zip(batches, outputs):
        np.testing.assert_allclose(host(bn(tensor(x, backend))), expected, rtol=1e-5, atol=1e-5)
    state = bn.state_dict()
    np.testing.assert_allclose(state["running_mean"], running_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["running_var"], running_var, rtol=1e-5, atol=1e-6)
    assert state["num_batches_tracked"] == 3
    # eval: the running statistics normalise, and the gradient is weight * g / sqrt(var + eps)
    bn.eval()
    x = param(batches[0], backend)
    with netcl.Tape() as tape:
        y = bn(x)
    np.testing.assert_allclose(host(y), _batch_norm_ref(batches[0], running_mean, running_var),
                               rtol=1e-5, atol=1e-5)
    g = rng.standard_normal(shape).astype(np.float32)
    tape.backward(y, grad=tensor(g, backend))
    channel = (1, 3) + (1,) * (len(shape) - 2)
    np.testing.assert_allclose(host(x.grad), g / np.sqrt(running_var.reshape(channel) + 1e-5),
                               rtol=1e-5, atol=1e-6)
    assert bn.state_dict()["num_batches_tracked"] == 3  # eval counts nothing


def test_batch_norm_updates_float16_running_statistics_in_their_storage(backend):
    """float16 running statistics are updated as float32 ones would be, rounded to float16
    (on OpenCL through float32 copies: batch_norm_stats updates float32); running statistics
    that are not floats are a TypeError naming them."""
    x = np.arange(24, dtype=np.float32).reshape(8, 3) ** 1.5
    running_mean = tensor(np.full(3, 0.5), backend, dtype=np.float16)
    running_var = tensor(np.full(3, 2.0), backend, dtype=np.float16)
    F.batch_norm(tensor(x, backend), running_mean, running_var, training=True, momentum=0.25)
    want_mean = 0.75 * 0.5 + 0.25 * x.astype(np.float64).mean(axis=0)
    want_var = 0.75 * 2.0 + 0.25 * x.astype(np.float64).var(axis=0, ddof=1)
    for got, want in ((running_mean, want_mean), (running_var, want_var)):
        assert got.dtype == np.float16
        np.testing.assert_allclose(host(got).astype(np.float64), want, rtol=1e-3)
    with raises_naming(TypeError, "running_mean", "int32"):
        F.batch_norm(tensor(x, backend), tensor(np.zeros(3, np.int32), backend),
                     running_var, training=True)


def test_batch_norm_train_eval_switching(backend):
    rng = np.random.default_rng(41)
    bn = netcl.BatchNorm1d(4, queue=backend.queue)
    x = tensor(rng.standard_normal((6, 4)) * 3 + 2, backend)
    trained = host(bn(x))
    after_one = bn.state_dict()
    bn.eval()
    assert not bn.training
    first, second = host(bn(x)), host(bn(x))
    np.testing.assert_array_equal(first, second)  # no statistics move in eval
    assert not np.allclose(first, trained, atol=1e-3)  # running, not batch, statistics
    for key, value in bn.state_dict().items():
        np.testing.assert_array_equal(value, after_one[key])
    bn.train()
    np.testing.assert_array_equal(host(bn(x)), trained)
    assert bn.state_dict()["num_batches_tracked"] == 2
    assert not np.array_equal(bn.state_dict()["running_mean"], after_one["running_mean"])


def test_batch_norm_without_running_stats_or_affine(backend):
    rng = np.random.default_rng(42)
    x = rng.standard_normal((7, 3, 2)).astype(np.float32)
    plain = netcl.BatchNorm1d(3, affine=False, track_running_stats=False, queue=backend.queue)
    assert plain.parameters() == [] and list(plain.state_dict()) == []
    assert plain.running_mean is None and plain.weight is None
    plain.eval()  # without running statistics eval normalises with the batch's, as PyTorch
    np.testing.assert_allclose(host(plain(tensor(x, backend))), _batch_norm_ref(x),
                               rtol=1e-5, atol=1e-5)
    stats_only = netcl.BatchNorm1d(3, affine=False, queue=backend.queue)
    assert list(stats_only.state_dict()) == ["running_mean", "running_var", "num_batches_tracked"]
    no_stats = netcl.BatchNorm1d(3, track_running_stats=False, queue=backend.queue)
    np.testing.assert_allclose(host(no_stats(tensor(x, backend))), _batch_norm_ref(x),
                               rtol=1e-5, atol=1e-5)
    assert list(no_stats.state_dict()) == ["weight", "bias"] and no_stats.running_var is None


def test_batch_norm_state_dict_keys_order_and_round_trip(backend, tmp_path):
    netcl.manual_seed(0)
    model = netcl.Sequential(netcl.Linear(4, 3, queue=backend.queue),
                             netcl.BatchNorm1d(3, queue=backend.queue))
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias", "1.weight",
                                                         "1.bias"]
    assert [n for n, _ in model.named_buffers()] == ["1.running_mean", "1.running_var",
                                                      "1.num_batches_tracked"]
    model(tensor(np.random.default_rng(43).standard_normal((5, 4)), backend))
    state = model.state_dict()
    assert list(state) == ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean",
                           "1.running_var", "1.num_batches_tracked"]  # PyTorch's order
    assert state["1.weight"].dtype == np.float32 and state["1.running_var"].shape == (3,)
    counter = state["1.num_batches_tracked"]
    assert isinstance(counter, np.ndarray) and counter.dtype == np.int64 and counter.shape == ()
    assert counter == 1
    np.testing.assert_array_equal(state["1.weight"], np.ones(3))  # PyTorch's initialisation
    np.testing.assert_array_equal(state["1.bias"], np.zeros(3))
    # A PyTorch state dict, as NumPy arrays: float32 statistics, an int64 counter.
    torch_like = dict(state)
    torch_like["1.running_mean"] = np.array([0.5, -1.0, 2.0], np.float32)
    torch_like["1.running_var"] = np.array([1.5, 0.25, 4.0], np.float32)
    torch_like["1.num_batches_tracked"] = np.array(17, np.int64)
    other = netcl.Sequential(netcl.Linear(4, 3, queue=backend.queue),
                             netcl.BatchNorm1d(3, queue=backend.queue))
    other.load_state_dict(torch_like)
    for key, value in other.state_dict().items():
        np.testing.assert_array_equal(value, torch_like[key])
        assert value.dtype == torch_like[key].dtype
    netcl.save(other.state_dict(), tmp_path / "bn.npz")
    loaded = netcl.load(tmp_path / "bn.npz")
    assert loaded["1.num_batches_tracked"].dtype == np.int64
    model.load_state_dict(loaded)
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(value, torch_like[key])
    del torch_like["1.running_var"]
    with raises_naming((KeyError, ValueError, RuntimeError), "1.running_var"):
        model.load_state_dict(torch_like)
    with raises_naming((KeyError, ValueError, RuntimeError), "1.running_mean", "(4,)"):
        model.load_state_dict(dict(loaded, **{"1.running_mean": np.zeros(4, np.float32)}))


def test_batch_norm_zero_size_and_errors(backend):
    bn = netcl.BatchNorm1d(3, queue=backend.queue)
    x = param(np.zeros((0, 3), np.float32), backend)
    with netcl.Tape() as tape:
        y = bn(x)
        loss = y.sum()
    assert y.shape == (0, 3)
    tape.backward(loss)
    np.testing.assert_array_equal(host(bn.weight.grad), np.zeros(3))
    np.testing.assert_array_equal(host(bn.bias.grad), np.zeros(3))
    state = bn.state_dict()  # an empty batch moves no statistics, but counts (PyTorch)
    np.testing.assert_array_equal(state["running_mean"], np.zeros(3))
    np.testing.assert_array_equal(state["running_var"], np.ones(3))
    assert state["num_batches_tracked"] == 1
    with raises_naming(ValueError, "more than 1 value per channel", "(1, 3)"):
        bn(tensor(np.ones((1, 3)), backend))
    assert bn.state_dict()["num_batches_tracked"] == 1  # a refused batch is not counted
    with raises_naming(ValueError, "BatchNorm1d", "2D or 3D", "4D"):
        bn(tensor(np.ones((2, 3, 2, 2)), backend))
    with raises_naming(ValueError, "BatchNorm2d", "4D", "3D"):
        netcl.BatchNorm2d(3, queue=backend.queue)(tensor(np.ones((2, 3, 2)), backend))
    with raises_naming(ValueError, "batch_norm", "running_mean", "(2,)", "3"):
        F.batch_norm(tensor(np.ones((4, 3)), backend), tensor(np.zeros(2), backend),
                     tensor(np.ones(2), backend), training=True)
    with raises_naming(ValueError, "batch_norm", "weight", "(2,)"):
        F.batch_norm(tensor(np.ones((4, 3)), backend), None, None,
                     weight=tensor(np.ones(2), backend), training=True)
    with raises_naming(ValueError, "batch_norm", "running_mean", "training"):
        F.batch_norm(tensor(np.ones((4, 3)), backend), None, None, training=False)
    with raises_naming(ValueError, "batch_norm", "(N, C"):
        F.batch_norm(tensor(np.ones(4), backend), None, None, training=True)
    with raises_naming(ValueError, "batch_norm", "momentum"):
        F.batch_norm(tensor(np.ones((4, 3)), backend), None, None, training=True, momentum="x")
    with raises_naming(TypeError, "batch_norm", "running_mean"):
        F.batch_norm(tensor(np.ones((4, 3)), backend), np.zeros(3), np.ones(3))
    with raises_naming(ValueError, "num_features"):
        netcl.BatchNorm1d(0)


def test_register_buffer_and_named_buffers(backend):
    class Counter(netcl.Module):
        def __init__(self):
            super().__init__()
            self.scale = param(np.ones(2), backend)
            self.register_buffer("total", tensor(np.zeros(2), backend))
            self.register_buffer("steps", np.zeros((), np.int64))
            self.register_buffer("nothing", None)
            self.child = netcl.Linear(2, 2, queue=backend.queue)

    m = Counter()
    assert [n for n, _ in m.named_parameters()] == ["scale", "child.weight", "child.bias"]
    assert [n for n, _ in m.named_buffers()] == ["total", "steps"]  # None is left out
    assert list(m.state_dict()) == ["scale", "total", "steps", "child.weight", "child.bias"]
    m.total = tensor(np.full(2, 3.0), backend)  # a new value keeps the buffer's place
    assert list(m.state_dict()) == ["scale", "total", "steps", "child.weight", "child.bias"]
    np.testing.assert_array_equal(m.state_dict()["total"], [3.0, 3.0])
    assert len(m.parameters()) == 3
    with raises_naming(TypeError, "total"):
        m.total = 5
    with raises_naming(KeyError, "scale", "exists"):
        m.register_buffer("scale", tensor(np.zeros(2), backend))
    with raises_naming(KeyError, "a.b"):
        m.register_buffer("a.b", None)
    with raises_naming(TypeError, "other"):
        m.register_buffer("other", [1.0])


def test_layer_norm_module(backend):
    ln = netcl.LayerNorm((2, 3), queue=backend.queue)
    assert ln.normalized_shape == (2, 3)
    assert [n for n, _ in ln.named_parameters()] == ["weight", "bias"]
    np.testing.assert_array_equal(host(ln.weight), np.ones((2, 3)))
    np.testing.assert_array_equal(host(ln.bias), np.zeros((2, 3)))
    assert list(netcl.LayerNorm(4, bias=False).state_dict()) == ["weight"]
    assert netcl.LayerNorm(4, elementwise_affine=False).parameters() == []
    x = np.random.default_rng(44).standard_normal((5, 2, 3)).astype(np.float32)
    np.testing.assert_allclose(host(ln(tensor(x, backend))), _layer_norm_ref(x, (2, 3)),
                               rtol=1e-5, atol=1e-5)
    with raises_naming(ValueError, "normalized_shape"):
        netcl.LayerNorm(())


def test_layer_norm_with_one_parameter_as_weight_and_bias_in_an_optimizer(backend):
    """A parameter an optimizer holds gets its gradient written into the optimizer's flat
    buffer; one parameter as both weight and bias of a layer_norm takes the sum of both
    gradients, as it does outside an optimizer, not the bias's twice."""
    x = np.array([[1, 2, 4, 8], [0, 1, 0, -1]], np.float32)
    r = np.array([[1, 0, 0, 0], [0, 0, 0, 1]], np.float32)
    grads = []
    for optimizer in (None, netcl.optim.SGD, netcl.optim.AdamW):
        w = param(np.ones(4, np.float32), backend)
        if optimizer is not None:
            optimizer([w], lr=0.1)
        with netcl.Tape() as tape:
            loss = F.sum(F.mul(F.layer_norm(x, 4, w, w), r))
        tape.backward(loss)
        grads.append(host(w.grad))
    mean, std = x.mean(axis=1, keepdims=True), np.sqrt(x.var(axis=1, keepdims=True) + 1e-5)
    expected = ((x - mean) / std * r).sum(axis=0) + r.sum(axis=0)  # d/dweight + d/dbias
    for grad in grads:
        np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6)


def test_layer_norm_zero_size_and_errors(backend):
    w, b = param(np.ones(4), backend), param(np.zeros(4), backend)
    x = param(np.zeros((0, 4), np.float32), backend)
    with netcl.Tape() as tape:
        y = F.layer_norm(x, (4,), w, b)
        loss = y.sum()
    assert y.shape == (0, 4)
    tape.backward(loss)
    np.testing.assert_array_equal(host(w.grad), np.zeros(4))
    np.testing.assert_array_equal(host(b.grad), np.zeros(4))
    assert F.layer_norm(tensor(np.zeros((3, 0)), backend), (0,)).shape == (3, 0)
    with raises_naming(ValueError, "layer_norm", "(2,)", "(4, 3)"):
        F.layer_norm(tensor(np.ones((4, 3)), backend), (2,))
    with raises_naming(ValueError, "layer_norm", "weight", "(2,)", "(3,)"):
        F.layer_norm(tensor(np.ones((4, 3)), backend), 3, weight=tensor(np.ones(2), backend))
    with raises_naming(ValueError, "layer_norm", "normalized_shape"):
        F.layer_norm(tensor(np.ones((4, 3)), backend), (-3,))
    with raises_naming(ValueError, "layer_norm", "eps"):
        F.layer_norm(tensor(np.ones((4, 3)), backend), 3, eps=None)


@pytest.mark.parametrize("op", ["layer_norm", "batch_norm", "attention"])
def test_normalisation_and_attention_read_float16_storage(cpu, opencl, op):
    """float16 storage in (autocast's activations), float32 out, on both backends alike."""
    rng = np.random.default_rng(45)
    x = rng.standard_normal((6, 3, 8)).astype(np.float16)
    run = {"layer_norm": lambda x: F.layer_norm(x, 8),
           "batch_norm": lambda x: F.batch_norm(x, None, None, training=True),
           "attention": lambda x: F.scaled_dot_product_attention(x, x, x, is_causal=True)}[op]
    results = []
    for dev in (cpu, opencl):
        node = netcl.Node(tensor(x, dev), requires_grad=True)
        with netcl.Tape() as tape:
            y = run(node)
        tape.backward(y, grad=np.ones(y.shape, np.float32))
        assert y.dtype == np.float32 and node.grad.dtype == np.float32
        results.append((host(y), host(node.grad)))
    (y_cpu, g_cpu), (y_cl, g_cl) = results
    np.testing.assert_allclose(y_cl, y_cpu, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g_cl, g_cpu, rtol=1e-4, atol=1e-5)


def test_embedding_module_and_index_kinds(backend):
    netcl.manual_seed(0)
    emb = netcl.Embedding(200, 50, queue=backend.queue)
    weight = host(emb.weight)
    assert list(emb.state_dict()) == ["weight"] and weight.shape == (200, 50)
    assert abs(weight.mean()) < 0.02 and abs(weight.std() - 1.0) < 0.02  # N(0, 1), as PyTorch
    idx = np.array([[3, 0, 199], [3, 3, 7]])
    for kind in (idx, idx.astype(np.int32), tensor(idx, backend), idx.tolist()):
        np.testing.assert_array_equal(host(emb(kind)), weight[idx])
    assert emb(np.int64(5)).shape == (50,)
    assert emb(np.zeros((2, 0), np.int64)).shape == (2, 0, 50)


def test_embedding_backward_sums_repeated_rows_in_a_fixed_order(cpu, opencl):
    """A row picked many times gets the sum of its positions' gradients; the OpenCL gather
    adds them in position order, as np.add.at does, so both backends agree to the bit."""
    rng = np.random.default_rng(46)
    idx = rng.integers(0, 5, size=(40, 30))
    w0 = rng.standard_normal((9, 6)).astype(np.float32)
    g = rng.standard_normal((40, 30, 6)).astype(np.float32)
    grads = []
    for dev in (cpu, opencl, opencl):
        w = param(w0, dev)
        with netcl.Tape() as tape:
            y = F.embedding(idx, w)
        tape.backward(y, grad=tensor(g, dev))
        grads.append(host(w.grad))
    expected = np.zeros((9, 6))
    np.add.at(expected, idx.ravel(), g.reshape(-1, 6).astype(np.float64))
    np.testing.assert_allclose(grads[0], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(grads[1], grads[0])
    np.testing.assert_array_equal(grads[2], grads[1])
    np.testing.assert_array_equal(grads[0][5:], 0)  # rows nobody picked


def test_embedding_backward_uploads_one_array(opencl, monkeypatch):
    """The backward's gather plan (row starts, then positions sorted by row) travels to the
    device in one upload, and still sums each row's positions right."""
    rng = np.random.default_rng(47)
    idx = rng.integers(0, 7, size=(8, 16))
    w0 = rng.standard_normal((7, 5)).astype(np.float32)
    g = rng.standard_normal((8, 16, 5)).astype(np.float32)
    w = param(w0, opencl)
    with netcl.Tape() as tape:
        y = F.embedding(idx, w)
    seed = tensor(g, opencl)
    uploads = []
    real_upload = opencl.upload
    monkeypatch.setattr(opencl, "upload", lambda *args: (uploads.append(args), real_upload(*args)))
    tape.backward(y, grad=seed)
    assert len(uploads) == 1
    expected = np.zeros((7, 5))
    np.add.at(expected, idx.ravel(), g.reshape(-1, 5).astype(np.float64))
    np.testing.assert_allclose(host(w.grad), expected, rtol=1e-5, atol=1e-5)


def test_embedding_zero_size_and_errors(backend):
    w = param(np.ones((5, 3)), backend)
    with netcl.Tape() as tape:
        y = F.embedding(np.zeros((0,), np.int64), w)
        loss = y.sum()
    assert y.shape == (0, 3)
    tape.backward(loss)
    np.testing.assert_array_equal(host(w.grad), np.zeros((5, 3)))
    for bad in (5, -1):
        with raises_naming(IndexError, "embedding", f"index {bad}", "[0, 5)"):
            F.embedding(np.array([0, bad]), w)
    with raises_naming(IndexError, "index 9"):
        F.embedding(tensor(np.array([9], np.int32), backend), w)
    with raises_naming(TypeError, "embedding", "idx", "float"):
        F.embedding(np.array([1.0]), w)
    with raises_naming(TypeError, "embedding", "idx", "float32"):
        F.embedding(tensor(np.array([1.0]), backend), w)
    with raises_naming(ValueError, "embedding", "weight", "(5,)"):
        F.embedding(np.array([1]), param(np.ones(5), backend))
    with raises_naming(ValueError, "num_embeddings"):
        netcl.Embedding(0, 3)


def test_attention_row_without_keys_gives_zero(backend):
    rng = np.random.default_rng(47)
    q, k, v = (param(rng.standard_normal(s), backend) for s in [(2, 3, 4), (2, 5, 4), (2, 5, 6)])
    mask = np.ones((3, 5), bool)
    mask[1] = False  # query row 1 may attend to nothing: PyTorch gives 0, not NaN
    with netcl.Tape() as tape:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        loss = (y * y).sum()
    out = host(y)
    np.testing.assert_array_equal(out[:, 1], 0)
    np.testing.assert_allclose(out[:, [0, 2]], _attention_ref(*map(host, (q, k, v)))[:, [0, 2]],
                               rtol=1e-5, atol=1e-5)
    tape.backward(loss)
    np.testing.assert_array_equal(host(q.grad)[:, 1], 0)
    assert all(np.isfinite(host(p.grad)).all() for p in (q, k, v))


def test_attention_zero_size(backend):
    rng = np.random.default_rng(48)
    cases = [((2, 0, 4), (2, 5, 4), (2, 5, 3)),   # no queries
             ((2, 3, 4), (2, 0, 4), (2, 0, 3)),   # no keys: zeros, as PyTorch
             ((0, 3, 4), (0, 5, 4), (0, 5, 3))]   # no batch
    for shapes in cases:
        q, k, v = (param(rng.standard_normal(s), backend) for s in shapes)
        with netcl.Tape() as tape:
            y = F.scaled_dot_product_attention(q, k, v)
            loss = y.sum()
        assert y.shape == shapes[0][:-1] + (3,)
        np.testing.assert_array_equal(host(y), 0)
        tape.backward(loss)
        for p, s in zip((q, k, v), shapes):
            assert host(p.grad).shape == s
            np.testing.assert_array_equal(host(p.grad), 0)


def test_attention_errors(backend):
    q, k, v = (tensor(np.ones(s), backend) for s in [(2, 3, 4), (2, 5, 4), (2, 5, 6)])
    attention = F.scaled_dot_product_attention
    with raises_naming(ValueError, "scaled_dot_product_attention", "attn_mask", "is_causal"):
        attention(q, k, v, attn_mask=np.ones((3, 5), bool), is_causal=True)
    for p in (1.5, -0.1, "0.1"):
        with raises_naming(ValueError, "scaled_dot_product_attention", "dropout_p"):
            attention(q, k, v, dropout_p=p)
    with raises_naming(ValueError, "scaled_dot_product_attention", "(2, 5, 3)"):
        attention(q, tensor(np.ones((2, 5, 3)), backend), v)
    with raises_naming(ValueError, "scaled_dot_product_attention", "(2, 4, 6)"):
        attention(q, k, tensor(np.ones((2, 4, 6)), backend))
    with raises_naming(ValueError, "scaled_dot_product_attention", "(3, 3, 4)"):
        attention(tensor(np.ones((3, 3, 4)), backend), k, v)
    with raises_naming(ValueError, "scaled_dot_product_attention", "(4,)"):
        attention(tensor(np.ones(4), backend), k, v)
    with raises_naming(ValueError, "attn_mask", "(3, 4)", "(2, 3, 5)"):
        attention(q, k, v, attn_mask=np.ones((3, 4), bool))
    with raises_naming(TypeError, "attn_mask", "int"):
        attention(q, k, v, attn_mask=np.ones((3, 5), np.int64))
    with raises_naming(ValueError, "scaled_dot_product_attention", "scale"):
        attention(q, k, v, scale="big")


def _dropped_attention(dev, seed, p, L=40, S=30, g=None):
    """Attention with q = k = 0 (every weight 1/S) and v = I: the output is the dropout
    factor of each weight, / S. Returns the output and the gradient of v for `g`."""
    q, k = param(np.zeros((L, 4)), dev), param(np.zeros((S, 4)), dev)
    v = param(np.eye(S), dev)
    netcl.manual_seed(seed)
    with netcl.Tape() as tape:
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
    tape.backward(y, grad=tensor(np.ones((L, S)) if g is None else g, dev))
    return host(y), host(v.grad)


@pytest.mark.parametrize("p", [0.2, 0.5])
def test_attention_dropout_statistics_and_determinism(backend, p):
    out, grad_v = _dropped_attention(backend, 0, p)
    factor = out * 30 * (1 - p)  # 1 for a kept weight, 0 for a dropped one
    np.testing.assert_allclose(factor[factor > 0.5], 1, rtol=1e-5)
    dropped = (factor < 0.5).mean()
    assert abs(dropped - p) < 4 * math.sqrt(p * (1 - p) / factor.size)
    again, _ = _dropped_attention(backend, 0, p)
    np.testing.assert_array_equal(again, out)  # the same seed, the same mask
    other, _ = _dropped_attention(backend, 1, p)
    assert not np.array_equal(other, out)
    # backward drops what forward dropped: dv = (P D)^T g, and P D / S is the output here
    g = np.random.default_rng(49).standard_normal((40, 30)).astype(np.float32)
    _, grad_v = _dropped_attention(backend, 0, p, g=g)
    np.testing.assert_allclose(grad_v, out.T @ g, rtol=1e-5, atol=1e-5)


def test_attention_dropout_gradient_and_backends_agree(cpu, opencl):
    """With the mask fixed by manual_seed, dropout attention is a smooth function: its
    gradient matches central differences (float64, NumPy backend), and the OpenCL backend,
    whose mask is the same hash of the same seed, matches the NumPy one."""
    rng = np.random.default_rng(50)
    arrays = [rng.standard_normal(s) for s in [(2, 3, 4), (2, 5, 4), (2, 5, 3)]]
    g = rng.standard_normal((2, 3, 3))

    def run(dev, values, dtype=np.float64):
        nodes = [param(a, dev, dtype) for a in values]
        netcl.manual_seed(7)
        with netcl.Tape() as tape:
            y = F.scaled_dot_product_attention(*nodes, dropout_p=0.4)
        tape.backward(y, grad=tensor(g, dev, dtype))
        return host(y), [host(n.grad) for n in nodes]

    def forward(values):
        netcl.manual_seed(7)
        return host(F.scaled_dot_product_attention(
            *[tensor(a, cpu, np.float64) for a in values], dropout_p=0.4))

    y, grads = run(cpu, arrays)
    for analytic, numeric in zip(grads, _central_differences(forward, arrays, g)):
        np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-7)
    y32, grads32 = run(cpu, arrays, None)
    y_cl, grads_cl = run(opencl, arrays, None)
    np.testing.assert_allclose(y_cl, y32, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_cl, grads32):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert (y32 == 0).any()  # some weights were dropped


def test_tiny_attention_model_learns(backend):
    """Embeddings, causal attention, LayerNorm and a linear head learn to copy the previous
    token, which takes attention: the loss falls far below chance (log 6) in 50 Adam steps."""
    netcl.manual_seed(0)
    vocab, dim, B, T = 6, 16, 16, 8
    emb = netcl.Embedding(vocab, dim, queue=backend.queue)
    pos = netcl.Embedding(T, dim, queue=backend.queue)
    projections = [netcl.Linear(dim, dim, queue=backend.queue) for _ in range(3)]
    norm = netcl.LayerNorm(dim, queue=backend.queue)
    head = netcl.Linear(dim, vocab, queue=backend.queue)
    opt = netcl.Adam([p for m in [emb, pos, *projections, norm, head] for p in m.parameters()],
                     lr=0.02)
    rng = np.random.default_rng(51)
    losses = []
    for _ in range(50):
        tokens = rng.integers(0, vocab, size=(B, T))
        target = np.concatenate([tokens[:, :1], tokens[:, :-1]], axis=1)  # the previous token
        with netcl.Tape() as tape:
            x = emb(tokens) + pos(np.arange(T))                              # (B, T, C)
            q, k, v = (projection(x) for projection in projections)
            h = x + F.scaled_dot_product_attention(q, k, v, is_causal=True)
            logits = head(norm(h))                                           # (B, T, vocab)
            loss = F.cross_entropy(F.reshape(logits, (B * T, vocab)), target.reshape(-1))
        opt.zero_grad()
        tape.backward(loss)
        opt.step()
        losses.append(float(loss.value))
    assert np.mean(losses[-10:]) < 0.1 * math.log(vocab), losses[::10]


# --- shape ops

def _grad_of(dev, array, op, weights_seed=0, index_dtype=None):
    """(output, gradient of the input) of sum(op(x) * w) for a random w, as host arrays."""
    x = param(array, dev, index_dtype)
    with netcl.Tape() as tape:
        y = op(x)
    w = np.random.default_rng(weights_seed).standard_normal(y.shape).astype(np.float32)
    tape.backward(y, grad=tensor(w, dev))
    return host(y), host(x.grad), w


@pytest.mark.parametrize("index", [
    np.array([3, 1, 3, 3, -2, 0]),                      # -2 is row 3 again
    [3, 1, 3, 3, -2, 0],
    np.array([[3, 1, 3], [3, -2, 0]]),
])
def test_repeated_indices_accumulate(backend, index):
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    y, grad, w = _grad_of(backend, x, lambda p: p[index])
    rows = np.array([3, 1, 3, 3, 3, 0]).reshape(np.shape(index))
    np.testing.assert_array_equal(y, x[rows])
    w_rows = w.reshape(6, 3)
    expected = np.zeros_like(x)  # torch's index backward: each row sums what it gave
    expected[3] = w_rows[0] + w_rows[2] + w_rows[3] + w_rows[4]
    expected[1], expected[0] = w_rows[1], w_rows[5]
    np.testing.assert_allclose(grad, expected, rtol=1e-6)
    # rows 2 and 4 were never picked: exactly 0
    assert not grad[[2, 4]].any()


def test_gathered_gradients_sum_in_the_same_order_on_both_backends(cpu, opencl):
    """Many repeats of few rows: the OpenCL backward adds in the order np.add.at does."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((7, 33)).astype(np.float32)
    index = rng.integers(-7, 7, size=(40, 25))
    results = [_grad_of(dev, x, lambda p: p[index], 4) for dev in (cpu, opencl)]
    np.testing.assert_array_equal(results[1][0], results[0][0])
    np.testing.assert_array_equal(results[1][1], results[0][1])
    select = [_grad_of(dev, x, lambda p: F.index_select(p, 1, np.abs(index[0])), 5)
              for dev in (cpu, opencl)]
    np.testing.assert_array_equal(select[1][1], select[0][1])


@pytest.mark.parametrize("key", [
    np.s_[1:3], np.s_[1:4:2], np.s_[3:], np.s_[-1], np.s_[2], np.s_[:, -1], np.s_[:, 1:3],
    np.s_[..., 2], np.s_[..., -1, :], np.s_[None, 2], np.s_[1, None, ::3], np.s_[-3:-1, :, 1],
    np.s_[5:9], np.s_[3:1], np.s_[:], np.s_[()], np.s_[...], np.s_[np.int64(2)],
    np.s_[1, 2, 3], np.s_[-4, -5, -6], np.s_[::5, 1::2, ::4],
])
def test_getitem_basic_forms(backend, key):
    x = np.arange(120, dtype=np.float32).reshape(4, 5, 6)
    y, grad, w = _grad_of(backend, x, lambda p: p[key])
    np.testing.assert_array_equal(y, x[key])
    expected = np.zeros_like(x)
    expected[key] = w  # the gradient lands where the values came from
    np.testing.assert_array_equal(grad, expected)


def test_getitem_int_array_forms(backend):
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    p = param(x, backend)
    for index, rows in [([2, 0, -1], [2, 0, 3]), (np.array([2, 0, -1], np.int32), [2, 0, 3]),
                        (np.array(1), 1), ([], np.zeros(0, int)),
                        (np.array([[0], [3]]), [[0], [3]]),
                        (tensor(np.array([2, 0, 3], np.int32), backend), [2, 0, 3]),
                        (netcl.Node(tensor(np.array([-1, 1], np.int32), backend)), [3, 1])]:
        np.testing.assert_array_equal(host(p[index]), x[np.array(rows)])
    np.testing.assert_array_equal(host(F.index_select(p, 1, [2, 2, 0])), x[:, [2, 2, 0]])
    np.testing.assert_array_equal(host(F.index_select(p, -1, np.array(1))), x[:, [1]])


def test_full_slices_and_none_are_views(backend):
    x = netcl.Node(tensor(np.arange(24, dtype=np.float32).reshape(2, 3, 4), backend))
    for key in (np.s_[:], np.s_[None], np.s_[..., None], np.s_[:, :, 0:4], np.s_[0:2, ...]):
        assert _shares_buffer(x[key].value, x.value, backend), key
    assert _shares_buffer(x.unsqueeze(1).value, x.value, backend)
    assert _shares_buffer(F.squeeze(x[None]).value, x.value, backend)
    assert not _shares_buffer(x[1:].value, x.value, backend)  # tensors are contiguous: a copy


def test_split_pieces_without_gradient_contribute_zeros(backend):
    x = np.arange(14, dtype=np.float32).reshape(7, 2)
    p = param(x, backend)
    with netcl.Tape() as tape:
        a, b, c, d = p.split(2)
        loss = (b * 3.0).sum() + (d * 5.0).sum() + p.sum()  # a and c get no gradient
    assert [piece.shape for piece in (a, b, c, d)] == [(2, 2), (2, 2), (2, 2), (1, 2)]
    tape.backward(loss)
    np.testing.assert_array_equal(host(p.grad)[:, 0], [1, 1, 4, 4, 1, 1, 6])
    for piece, rows in zip((a, b, c, d), (x[0:2], x[2:4], x[4:6], x[6:])):
        np.testing.assert_array_equal(host(piece), rows)


@pytest.mark.usefixtures("portable_half")
@pytest.mark.parametrize("dim", [0, 2])  # pieces as views of rows, and as copies
def test_split_of_float16_storage_keeps_its_gradients_in_float16(opencl, monkeypatch, dim):
    """Under autocast the pieces of a float16-storage activation take their gradients in
    float16 storage, as PyTorch keeps a gradient in its tensor's dtype: the gradient buffer
    is put together in that storage (copy_rows in the float16 build), with no cast to float32
    and back on the way; x's and w's gradients are the float32 run's up to float16
    rounding, zero where a piece got no gradient. (The packed GEMM on every device: the
    tiled one's weight gradient reads g as float32, a cast of linear's own.)"""
    monkeypatch.setattr(opencl, "gemm", "packed")
    rng = np.random.default_rng(3)
    x_host, w_host = rng.standard_normal((6, 5, 8)), rng.standard_normal((6, 8)) / 3
    launched = []
    launch = opencl.launch
    results = {}
    for amp in (False, True):
        x, w = param(x_host.astype(np.float32), opencl), param(w_host.astype(np.float32), opencl)
        with netcl.Tape() as tape, netcl.autocast(enabled=amp):
            h = F.linear(x, w)                # (6, 5, 6), float16 storage under autocast
            q, k, v = F.split(h, 2, dim=dim)  # k gets no gradient
            out = q * v
        assert h.dtype == (np.float16 if amp else np.float32)
        monkeypatch.setattr(opencl, "launch", lambda name, *args, **kwargs: (
            launched.append((name, kwargs.get("half", False))), launch(name, *args, **kwargs)))
        launched.clear()
        tape.backward(out, grad=np.ones(out.shape, np.float32))
        monkeypatch.setattr(opencl, "launch", launch)
        if amp:
            # after the product's backward (the seed's own conversion comes before it)
            names = [name for name, _ in launched]
            after = names[names.index("mul_fwd"):]
            assert "cast_from_act" not in after and "cast_to_act" not in after
            if dim:
                assert ("copy_rows", True) in launched and ("copy_rows", False) not in launched
        results[amp] = host(x.grad), host(w.grad)
    for half, single in zip(results[True], results[False]):
        np.testing.assert_allclose(half, single, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dim", [0, 1])  # pieces as views of rows, and as copies
@pytest.mark.parametrize("cut", ["unbind", "split"])
def test_pieces_round_float32_gradients_into_float16_storage_as_they_copy_them(opencl,
                                                                               monkeypatch,
                                                                               cut, dim):
    """attention over float16 q, k and v gives float32 gradients. Where q, k and v are pieces
    of one float16 tensor (a transformer's qkv, unbound), their gradients are rounded into
    its float16 gradient as they are copied into place (copy_rows_from_float), with no cast
    pass: the same halves as rounding the float32 gradients that separate q, k and v get."""
    rng = np.random.default_rng(5)
    shape = [2, 4, 8]
    shape.insert(dim, 3)
    x_host = rng.standard_normal(shape).astype(np.float16)
    cut_x, join = (F.unbind, np.stack) if cut == "unbind" else (
        lambda x, dim: F.split(x, 1, dim), np.concatenate)
    # q, k and v on their own: float32 gradients
    alone = [param(p if cut == "split" else p.squeeze(dim), opencl)
             for p in np.split(x_host, 3, axis=dim)]
    with netcl.Tape() as tape:
        out = F.scaled_dot_product_attention(*alone, is_causal=True)
    g = rng.standard_normal(out.shape).astype(np.float32)
    tape.backward(out, grad=g)
    assert {p.grad.dtype for p in alone} == {np.dtype(np.float32)}
    # the pieces of one tensor
    x = param(x_host, opencl)
    assert x.dtype == np.float16
    with netcl.Tape() as tape:
        out = F.scaled_dot_product_attention(*cut_x(x, dim), is_causal=True)
    launched = []
    launch = opencl.launch
    monkeypatch.setattr(opencl, "launch", lambda name, *args, **kwargs: (
        launched.append(name), launch(name, *args, **kwargs))[1])
    tape.backward(out, grad=g)
    monkeypatch.setattr(opencl, "launch", launch)
    assert "cast_to_act" not in launched and launched.count("copy_rows_from_float") == 3
    assert x.grad.dtype == np.float16
    np.testing.assert_array_equal(host(x.grad),
                                  join([host(p.grad) for p in alone], dim).astype(np.float16))


def test_a_float32_plus_a_float16_tensor_is_one_float32_sum(opencl):
    """A residual stream (float32) plus a block's output in float16 storage: the exact float32
    sums of the float16 values widened, in either order, from one kernel (add_mixed_fwd);
    operands of one size that broadcast to more (12, 1) + (1, 12) take the broadcasting
    kernel after a widening."""
    rng = np.random.default_rng(8)
    a = rng.standard_normal((5, 12)).astype(np.float32)
    b = rng.standard_normal((5, 12)).astype(np.float16)
    A, B = tensor(a, opencl), tensor(b, opencl)
    launches = opencl.launches
    for left, right in ((A, B), (B, A)):
        out = F.add(left, right)
        assert out.dtype == np.float32
        np.testing.assert_array_equal(host(out), a + b.astype(np.float32))
    assert opencl.launches - launches == 2
    column, row = a[0].reshape(12, 1), b[0].reshape(1, 12)
    for left, right in ((column, row), (row, column)):
        out = F.add(tensor(left, opencl), tensor(right, opencl))
        np.testing.assert_array_equal(host(out), left + right.astype(np.float32))
        assert out.shape == (12, 12)


def test_cat_with_constants_gives_the_parameter_its_rows(backend):
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    constant = np.ones((2, 2), np.float32)
    y, grad, w = _grad_of(backend, x, lambda p: F.cat([constant, p, tensor(constant, backend)]))
    np.testing.assert_array_equal(y, np.concatenate([constant, x, constant]))
    np.testing.assert_array_equal(grad, w[2:5])


def test_split_and_chunk_piece_sizes(backend):
    """torch.split and torch.chunk's counts: chunk may give fewer pieces than asked, and a
    dimension of size 0 gives one empty piece to split, `chunks` empty ones to chunk."""
    def sizes(pieces, dim=0):
        return [piece.shape[dim] for piece in pieces]
    x = param(np.zeros((7, 0, 5), np.float32), backend)
    assert sizes(F.chunk(x, 3)) == [3, 3, 1]
    assert sizes(F.chunk(x, 5)) == [2, 2, 2, 1]
    assert sizes(F.chunk(x, 9)) == [1] * 7
    assert sizes(F.chunk(x, 3, dim=1), 1) == [0, 0, 0]
    assert sizes(F.split(x, 2, dim=1), 1) == [0]
    assert sizes(F.split(x, 0, dim=1), 1) == [0]
    assert sizes(F.split(x, 10)) == [7]
    assert sizes(F.split(x, [0, 7, 0])) == [0, 7, 0]
    assert sizes(F.split(x, (2, 3), dim=-1), 2) == [2, 3]
    assert sizes(x.chunk(2, -1), 2) == [3, 2]


def test_shape_op_node_methods_and_names(backend):
    x = np.random.default_rng(0).standard_normal((2, 1, 3, 4)).astype(np.float32)
    p = param(x, backend)
    np.testing.assert_array_equal(host(p.permute(3, 0, 2, 1)), x.transpose(3, 0, 2, 1))
    np.testing.assert_array_equal(host(p.permute([3, 0, 2, 1])), x.transpose(3, 0, 2, 1))
    np.testing.assert_array_equal(host(p.transpose(-1, 0)), np.swapaxes(x, -1, 0))
    np.testing.assert_array_equal(host(F.transpose(p, 2, 2)), x)
    assert p.squeeze().shape == (2, 3, 4) and p.squeeze(0).shape == (2, 1, 3, 4)
    assert p.squeeze((1, -4)).shape == (2, 3, 4) and p.unsqueeze(-1).shape == (2, 1, 3, 4, 1)
    assert p.unsqueeze(4).shape == (2, 1, 3, 4, 1) and p.unsqueeze(-5).shape == (1, 2, 1, 3, 4)
    np.testing.assert_array_equal(host(p[1, 0].T), x[1, 0].T)   # .T and transpose(x) stay 2-D
    with raises_naming(ValueError, "transpose", "2-D"):
        F.transpose(p)
    scalar = param(np.array(2.5, np.float32), backend)  # a 0-d tensor takes dims 0 and -1
    assert F.transpose(scalar, 0, -1).shape == () and scalar.squeeze(0).shape == ()
    assert scalar.unsqueeze(-1).shape == (1,) and F.permute(scalar, ()).shape == ()
    for name in ["permute", "squeeze", "unsqueeze", "cat", "stack", "split", "chunk",
                 "index_select", "transpose"]:
        assert getattr(netcl, name) is getattr(F, name), name


def test_permute_is_one_launch_of_up_to_six_moving_dimensions(opencl):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 2, 3, 2, 3)).astype(np.float32)
    p = tensor(x, opencl)
    launches = opencl.launches
    y = F.permute(p, (5, 3, 1, 4, 2, 0))
    assert opencl.launches - launches == 1
    np.testing.assert_array_equal(host(y), x.transpose(5, 3, 1, 4, 2, 0))
    # Seven dimensions, of which the moves keep two pairs together: five move.
    x7 = rng.standard_normal((2, 3, 2, 3, 2, 3, 2)).astype(np.float32)
    dims = (5, 6, 3, 4, 0, 2, 1)
    np.testing.assert_array_equal(host(F.permute(tensor(x7, opencl), dims)), x7.transpose(dims))
    with raises_naming(ValueError, "permute", "6"):
        F.permute(tensor(x7, opencl), (6, 4, 2, 0, 5, 3, 1))


@XB_SETTINGS
@given(values=hnp.arrays(np.float32, st.integers(0, 41),
                         elements=st.floats(width=32, allow_nan=True, allow_infinity=True)))
def test_casts_round_and_widen_as_numpy(opencl, values):
    """cast_to_act rounds float32 to float16 storage (nearest even, overflow to inf, NaN
    kept) and cast_from_act widens it back, as NumPy's astype, at every length."""
    half = netcl._cast(tensor(values, opencl), np.float16)
    with np.errstate(over="ignore"):
        expected = values.astype(np.float16)
    np.testing.assert_array_equal(host(half), expected)
    np.testing.assert_array_equal(host(netcl._cast(half, np.float32)), expected.astype(np.float32))


def test_shape_ops_move_float16_storage_exactly(opencl):
    """float16 in, float16 out: the same bits moved (nothing is computed). The gradients are
    the very gradients of a float32 run, rounded, through the permutes (whose backward moves
    float16 gradients); the other ops' backward is float32, and what reaches them through a
    float16 view (a slice's or unsqueeze's reshape) was rounded once, and so is a leaf's
    gradient when its one contribution came so: each of at most two contributions to an
    element off by half an ulp of float16, at most one more rounding of their sum."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 6, 5)).astype(np.float16)
    ops = {
        "permute": (lambda p: p.permute(2, 0, 1), lambda a: a.transpose(2, 0, 1)),
        "transpose_2d": (lambda p: p.transpose(0, 2), lambda a: a.transpose(2, 1, 0)),
        "cat": (lambda p: F.cat([p, p[:, :2]], 1), lambda a: np.concatenate([a, a[:, :2]], 1)),
        "stack": (lambda p: F.stack([p, p], -1), lambda a: np.stack([a, a], -1)),
        "split": (lambda p: F.split(p, [1, 3, 1], -1)[1], lambda a: a[..., 1:4]),
        "chunk": (lambda p: F.chunk(p, 2, 1)[1], lambda a: a[:, 3:]),
        "slice": (lambda p: p[:, -1, 1::2], lambda a: a[:, -1, 1::2]),
        "index": (lambda p: p[[3, 0, 3, -1]], lambda a: a[[3, 0, 3, -1]]),
        "index_select": (lambda p: F.index_select(p, 1, [5, 5, 0]), lambda a: a[:, [5, 5, 0]]),
    }
    for name, (op, reference) in ops.items():
        y16, grad16, w = _grad_of(opencl, x, op, index_dtype=np.float16)
        y32, grad32, _ = _grad_of(opencl, x.astype(np.float32), op)
        assert y16.dtype == np.float16, name
        np.testing.assert_array_equal(y16.view(np.uint16), reference(x).view(np.uint16), name)
        if name in ("permute", "transpose_2d"):
            assert grad16.dtype == np.float16, name
            np.testing.assert_array_equal(grad16, grad32.astype(np.float16), name)
        else:
            np.testing.assert_allclose(grad16, grad32, rtol=0,
                                       atol=3 * 2.0 ** -11 * np.abs(w).max(), err_msg=name)
    mixed = F.cat([tensor(x, opencl), tensor(x.astype(np.float32), opencl)])
    assert mixed.dtype == np.float32  # float16 storage met with float32 widens
    np.testing.assert_array_equal(host(mixed), np.concatenate([x, x]).astype(np.float32))


def test_shape_ops_move_int32_exactly(backend):
    labels = np.array([[7, -1, 2 ** 31 - 1], [0, 5, -2 ** 31]], np.int32)  # odd bit patterns
    t = tensor(labels, backend)
    for out, expected in [(F.cat([t, t], 1), np.concatenate([labels, labels], 1)),
                          (F.permute(t, (1, 0)), labels.T), (netcl.Node(t)[[1, 1, 0]],
                                                             labels[[1, 1, 0]]),
                          (netcl.Node(t)[:, 1:], labels[:, 1:]),
                          (F.stack([t, t]).permute(1, 2, 0), np.stack([labels] * 2, -1))]:
        assert out.dtype == np.int32
        np.testing.assert_array_equal(host(out), expected)


def _scalar(like):
    """A 0-d parameter on like's device (uploaded: no kernel launch)."""
    return param(np.array(0.0, np.float32), like.device)


@pytest.mark.parametrize("call, error, words", [
    (lambda x: F.permute(x, (0,)), ValueError, ["permute", "(0,)", "(2, 3)"]),
    (lambda x: F.permute(x, (1, 1)), ValueError, ["permute", "repeated"]),
    (lambda x: F.permute(x, (0, 2)), ValueError, ["permute", "dim 2", "[-2, 1]"]),
    (lambda x: F.permute(x, (0, 1.0)), TypeError, ["permute", "1.0"]),
    (lambda x: F.permute(x, 1), TypeError, ["permute", "dims"]),
    (lambda x: F.transpose(x, 0), TypeError, ["transpose", "dim1"]),
    (lambda x: x.transpose(0, -3), ValueError, ["transpose", "dim1", "-3"]),
    (lambda x: F.squeeze(x, 2), ValueError, ["squeeze", "dim 2"]),
    (lambda x: F.squeeze(x, (1, -1)), ValueError, ["squeeze", "repeated"]),
    (lambda x: x.unsqueeze(3), ValueError, ["unsqueeze", "dim 3", "[-3, 2]"]),
    (lambda x: x.unsqueeze(None), TypeError, ["unsqueeze", "dim", "None"]),
    (lambda x: F.cat([]), ValueError, ["cat", "non-empty"]),
    (lambda x: F.cat(x), TypeError, ["cat", "tensors", "Parameter"]),
    (lambda x: F.cat([x, np.zeros((2, 4))]), ValueError,
     ["cat", "(2, 3)", "(2, 4)", "dimension 0"]),
    (lambda x: F.cat([x, np.zeros((2, 4))], dim=1), None, None),
    (lambda x: F.cat([x, np.zeros((2, 3, 1))], 0), ValueError, ["cat", "(2, 3)", "(2, 3, 1)"]),
    (lambda x: F.cat([x, x], dim=2), ValueError, ["cat", "dim 2"]),
    (lambda x: F.cat([_scalar(x), _scalar(x)]), ValueError,
     ["cat", "zero-dimensional", "position 0"]),
    (lambda x: F.cat([x, netcl.Tensor.empty((2, 3), np.int32, queue=x.value.queue)]),
     ValueError, ["cat", "int32", "float32"]),
    (lambda x: F.stack([x, np.zeros((3, 2))]), ValueError,
     ["stack", "(2, 3)", "(3, 2)", "entry 1"]),
    (lambda x: F.stack([x, x], 3), ValueError, ["stack", "dim 3"]),
    (lambda x: F.stack(()), ValueError, ["stack", "non-empty"]),
    (lambda x: F.split(x, 0), ValueError, ["split", "split_size", "0"]),
    (lambda x: F.split(x, -1, 1), ValueError, ["split", "split_size", "-1"]),
    (lambda x: F.split(x, [1, 1], 1), ValueError, ["split", "[1, 1]", "3"]),
    (lambda x: F.split(x, [3, -1]), ValueError, ["split", "[3, -1]"]),
    (lambda x: F.split(x, 1.5), TypeError, ["split", "split_size_or_sections", "1.5"]),
    (lambda x: F.split(_scalar(x), 1), ValueError, ["split", "1-dimensional"]),
    (lambda x: F.chunk(x, 0), ValueError, ["chunk", "chunks", "0"]),
    (lambda x: F.chunk(x, 2.0), TypeError, ["chunk", "chunks", "2.0"]),
    (lambda x: F.chunk(x, 2, dim=-3), ValueError, ["chunk", "dim -3"]),
    (lambda x: x[2], IndexError, ["index 2", "dimension 0", "size 2"]),
    (lambda x: x[-3], IndexError, ["index -3", "size 2"]),
    (lambda x: x[:, 3], IndexError, ["index 3", "dimension 1", "size 3"]),
    (lambda x: x[0, 0, 0], IndexError, ["too many", "(2, 3)"]),
    (lambda x: _scalar(x)[0], IndexError, ["too many", "()"]),
    (lambda x: x[..., 0, ...], IndexError, ["ellipsis"]),
    (lambda x: x[::-1], ValueError, ["step", "-1"]),
    (lambda x: x[:, ::0], ValueError, ["step", "0"]),
    (lambda x: x[1.0], TypeError, ["index", "1.0", "float"]),
    (lambda x: x[True], TypeError, ["index", "True"]),
    (lambda x: x["a"], TypeError, ["index", "'a'"]),
    (lambda x: x[np.array([0, 5])], IndexError, ["index 5", "dimension 0", "size 2"]),
    (lambda x: x[[-3, 0]], IndexError, ["index -3", "size 2"]),
    (lambda x: x[tensor(np.array([1, 2], np.int32), x.device)], IndexError, ["index 2", "size 2"]),
    (lambda x: x[np.array([0.0])], IndexError, ["integers", "float64"]),
    (lambda x: x[tensor(np.array([0.0], np.float32), x.device)], IndexError, ["int32", "float32"]),
    (lambda x: x[np.array([True, False])], IndexError, ["integers", "bool"]),
    (lambda x: _scalar(x)[np.array([0])], IndexError, ["0-dimensional"]),
    (lambda x: F.index_select(x, 1, [-1]), IndexError, ["index_select", "index -1", "size 3"]),
    (lambda x: F.index_select(x, 0, [[0]]), IndexError, ["index_select", "vector", "(1, 1)"]),
    (lambda x: F.index_select(x, 2, [0]), ValueError, ["index_select", "dim 2"]),
])
def test_shape_op_errors_name_the_op_and_the_value(backend, call, error, words):
    x = param(np.zeros((2, 3), np.float32), backend)
    launches = backend.launches
    if error is None:  # the control: the same call with a fitting argument works
        call(x)
        return
    with raises_naming(error, *words):
        call(x)
    assert backend.launches == launches  # raised before anything was queued


def test_mixing_devices_in_shape_ops_raises(cpu, opencl):
    a = param(np.ones((2, 3), np.float32), cpu)
    b = param(np.ones((2, 3), np.float32), opencl)
    with raises_naming(ValueError, "cat", "different devices"):
        F.cat([a, b])
    with raises_naming(ValueError, "index", "different devices"):
        b[tensor(np.array([0], np.int32), cpu)]


# --- losses and convolution options
# The op cases above check values and gradients; these check PyTorch's edge semantics and the
# argument errors.

@pytest.mark.parametrize("op", ["cross_entropy", "cross_entropy_smoothed", "nll_loss"])
def test_all_ignored_targets_as_pytorch(backend, op):
    """Every target ignored: the mean is 0 / 0 = NaN, the sum 0, the losses 0, and the
    gradient 0 (PyTorch's nll_loss and cross_entropy, with or without label_smoothing)."""
    loss_fn = {"cross_entropy": F.cross_entropy, "nll_loss": F.nll_loss,
               "cross_entropy_smoothed": lambda *a, **k: F.cross_entropy(*a, **k,
                                                                         label_smoothing=0.3)}[op]
    logits = np.random.default_rng(0).standard_normal((3, 4, 2))
    for ignore_index, target in ((-100, np.full((3, 2), -100)), (2, np.full((3, 2), 2))):
        for reduction, expected in (("mean", np.nan), ("sum", 0.0), ("none", np.zeros((3, 2)))):
            x = param(logits, backend)
            with netcl.Tape() as tape:
                loss = loss_fn(x, target, reduction=reduction, ignore_index=ignore_index)
                total = F.sum(loss)
            tape.backward(total)
            np.testing.assert_array_equal(host(loss), expected)
            np.testing.assert_array_equal(host(x.grad), np.zeros((3, 4, 2)))


def test_ignored_targets_do_not_count_in_the_mean(backend):
    """"mean" divides by the number of targets that are not ignored, not by N."""
    logits = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    target = np.array([0, -100, 2, -100])
    loss = host(F.cross_entropy(tensor(logits, backend), target))
    kept = host(F.cross_entropy(tensor(logits[[0, 2]], backend), target[[0, 2]]))
    np.testing.assert_allclose(loss, kept, rtol=1e-6)
    assert host(F.nll_loss(tensor(logits, backend), target)) == \
        pytest.approx(-(logits[0, 0] + logits[2, 2]) / 2, rel=1e-6)


def test_cross_entropy_nd_is_the_2d_loss_over_every_position(backend):
    """Logits (N, C, d1, d2) are (N * d1 * d2) rows of C classes, the class axis second, as
    PyTorch's: the loss and gradient equal those of the permuted 2-D loss."""
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((2, 5, 3, 4)).astype(np.float32)
    labels = rng.integers(0, 5, size=(2, 3, 4))
    labels[0, 1] = -100
    rows = logits.transpose(0, 2, 3, 1).reshape(-1, 5)
    results = []
    for x_host, t in ((logits, labels), (rows, labels.reshape(-1))):
        x = param(x_host, backend)
        with netcl.Tape() as tape:
            loss = F.cross_entropy(x, t, label_smoothing=0.1)
        tape.backward(loss)
        results.append((host(loss), host(x.grad)))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-6)
    np.testing.assert_allclose(results[0][1].transpose(0, 2, 3, 1).reshape(-1, 5),
                               results[1][1], rtol=1e-5, atol=1e-7)
    none = F.cross_entropy(tensor(logits, backend), labels, reduction="none")
    assert none.shape == (2, 3, 4) and np.all(host(none)[0, 1] == 0)


def test_label_smoothing_one_is_the_uniform_target(backend):
    """label_smoothing=1 replaces every target by the uniform distribution: index and
    probability targets then give the same loss, -mean over the classes of log_softmax."""
    logits = np.random.default_rng(3).standard_normal((4, 6)).astype(np.float32)
    expected = -_log_softmax(logits.astype(np.float64)).mean(axis=1).mean()
    for target in (np.array([0, 5, 2, 2]), np.eye(6, dtype=np.float32)[[1, 1, 3, 4]]):
        loss = F.cross_entropy(tensor(logits, backend), target, label_smoothing=1.0)
        assert host(loss) == pytest.approx(expected, rel=1e-6)


def test_probability_target_gets_its_gradient(backend):
    """A probability target that requires a gradient gets -(1 - e) log_softmax(logits),
    scaled by the reduction (PyTorch's); a target that does not is left alone, and logits
    that need none get none."""
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((3, 4)).astype(np.float32)
    probs = _probabilities(rng, (3, 4)).astype(np.float32)
    x, t = param(logits, backend), param(probs, backend)
    with netcl.Tape() as tape:
        loss = F.cross_entropy(x, t, label_smoothing=0.25)
    tape.backward(loss)
    np.testing.assert_allclose(host(t.grad), -0.75 * _log_softmax(logits) / 3, rtol=1e-5)
    constant_logits = netcl.Node(tensor(logits, backend))
    t = param(probs, backend)
    with netcl.Tape() as tape:
        loss = F.cross_entropy(constant_logits, t, reduction="sum")
    tape.backward(loss)
    np.testing.assert_allclose(host(t.grad), -_log_softmax(logits), rtol=1e-5)
    assert constant_logits.grad is None


def test_binary_cross_entropy_with_logits_is_stable(backend):
    """PyTorch's stable formula: no overflow at large |x|, exact at x = 0; pos_weight (C,)
    weighs the positive term of each class of (N, C)."""
    x = tensor(np.array([[100.0, -100.0, 0.0]], np.float32), backend)
    t = np.array([[0.0, 1.0, 0.5]], np.float32)
    loss = host(F.binary_cross_entropy_with_logits(x, t, reduction="none"))
    np.testing.assert_allclose(loss, [[100.0, 100.0, math.log(2)]], rtol=1e-6)
    weighted = F.binary_cross_entropy_with_logits(x, np.ones((1, 3), np.float32), reduction="none",
                                                  pos_weight=np.array([1.0, 3.0, 2.0], np.float32))
    np.testing.assert_allclose(host(weighted), [[0.0, 300.0, 2 * math.log(2)]], atol=1e-6)


@pytest.mark.parametrize("shape", [(0, 3), (2, 3, 0), (0, 3, 2)])
def test_losses_over_zero_size_inputs(backend, shape):
    """Nothing to average (no samples, or no positions d1): "mean" is NaN and "sum" 0, as
    PyTorch; gradients keep the shape."""
    target_shape = shape[:1] + shape[2:]
    calls = [lambda x, r: F.binary_cross_entropy_with_logits(x, np.zeros(shape), reduction=r),
             lambda x, r: F.cross_entropy(x, np.zeros(target_shape, np.int64), reduction=r),
             lambda x, r: F.cross_entropy(x, np.zeros(shape), reduction=r),
             lambda x, r: F.nll_loss(x, np.zeros(target_shape, np.int64), reduction=r)]
    for call in calls:
        for reduction, expected in (("mean", np.nan), ("sum", 0.0)):
            x = param(np.zeros(shape), backend)
            with netcl.Tape() as tape:
                loss = call(x, reduction)
            tape.backward(loss)
            assert loss.shape == () and np.array_equal(host(loss), expected, equal_nan=True)
            assert host(x.grad).shape == shape


def test_binary_cross_entropy_weights_broadcast_as_pytorch(backend):
    """weight and pos_weight broadcast to the input's shape, from any axis (here (C, 1) over
    (N, C, L), which the kernels cannot repeat by themselves); they never grow it."""
    rng = np.random.default_rng(5)
    x, t = rng.standard_normal((2, 3, 4)), rng.uniform(size=(2, 3, 4))
    weight, pos_weight = rng.uniform(0.5, 2, (3, 1)), rng.uniform(0.5, 2, (2, 1, 4))
    loss = F.binary_cross_entropy_with_logits(tensor(x, backend), t, weight=weight,
                                              reduction="none", pos_weight=pos_weight)
    np.testing.assert_allclose(host(loss), _bce_with_logits_ref(x, t, weight, pos_weight, "none"),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("call, error, words", [
    (lambda x: F.cross_entropy(x, np.array([0, 1]), label_smoothing=1.5), ValueError,
     ["cross_entropy", "label_smoothing", "1.5"]),
    (lambda x: F.cross_entropy(x, np.array([0, 1]), label_smoothing=-0.1), ValueError,
     ["cross_entropy", "label_smoothing", "-0.1"]),
    (lambda x: F.cross_entropy(x, np.array([0, 1]), label_smoothing=math.nan), ValueError,
     ["cross_entropy", "label_smoothing", "nan"]),
    (lambda x: F.cross_entropy(x, np.array([0, 1]), label_smoothing="0.1"), ValueError,
     ["cross_entropy", "label_smoothing", "'0.1'"]),
    (lambda x: F.cross_entropy(x, np.array([0, 1]), ignore_index=1.0), TypeError,
     ["cross_entropy", "ignore_index", "1.0"]),
    (lambda x: F.cross_entropy(x, np.full((2, 3), 1 / 3), ignore_index=0), ValueError,
     ["cross_entropy", "ignore_index=0", "probability"]),
    (lambda x: F.cross_entropy(x, np.array([0, 3])), ValueError, ["cross_entropy", "label 3"]),
    (lambda x: F.cross_entropy(x, np.array([0, 1]), reduction="avg"), ValueError,
     ["cross_entropy", "reduction", "'avg'"]),
    (lambda x: F.cross_entropy(x.reshape(2, 3, 1), np.zeros((2, 3), np.int64)), ValueError,
     ["cross_entropy", "(2, 3)", "(2, 1)"]),
    (lambda x: F.cross_entropy(x.reshape(2, 1, 3), np.full((2, 3, 1), 0.5)), ValueError,
     ["cross_entropy", "(2, 3, 1)", "(2, 1, 3)"]),
    (lambda x: F.cross_entropy(tensor(np.float32(1), x.device), np.array(0)), ValueError,
     ["cross_entropy", "logits", "()"]),
    (lambda x: F.nll_loss(x, np.full((2, 3), 1 / 3)), ValueError, ["nll_loss", "class indices"]),
    (lambda x: F.nll_loss(x, np.array([0, -1])), ValueError, ["nll_loss", "label -1"]),
    (lambda x: F.nll_loss(x, np.array([0, 1, 2])), ValueError, ["nll_loss", "(3,)", "(2,)"]),
    (lambda x: F.nll_loss(x, np.array([0, 1]), ignore_index=None), TypeError,
     ["nll_loss", "ignore_index", "None"]),
    (lambda x: F.binary_cross_entropy_with_logits(x, np.zeros((3, 2))), ValueError,
     ["binary_cross_entropy_with_logits", "target", "(3, 2)", "(2, 3)"]),
    (lambda x: F.binary_cross_entropy_with_logits(x, np.zeros((2, 3)), weight=np.ones(2)),
     ValueError, ["binary_cross_entropy_with_logits", "weight", "(2,)", "(2, 3)"]),
    (lambda x: F.binary_cross_entropy_with_logits(x, np.zeros((2, 3)),
                                                  pos_weight=np.ones((1, 2, 3))),
     ValueError, ["binary_cross_entropy_with_logits", "pos_weight", "(1, 2, 3)"]),
    (lambda x: F.binary_cross_entropy_with_logits(x, np.zeros((2, 3)), reduction=None),
     ValueError, ["binary_cross_entropy_with_logits", "reduction", "None"]),
])
def test_loss_arguments_are_checked(backend, call, error, words):
    x = param(np.zeros((2, 3)), backend)
    launches = backend.launches
    with raises_naming(error, *words):
        call(x)
    assert backend.launches == launches


def test_loss_weights_are_constants(backend):
    """PyTorch defines no gradient for weight or pos_weight and refuses one that requires it;
    outside a Tape nothing is recorded, so a Parameter is just its value there."""
    x, weight = param(np.zeros((2, 3)), backend), param(np.ones(3), backend)
    for name in ("weight", "pos_weight"):
        with netcl.Tape(), raises_naming(ValueError, "binary_cross_entropy_with_logits", name,
                                         "gradient"):
            F.binary_cross_entropy_with_logits(x, np.zeros((2, 3)), **{name: weight})
        loss = F.binary_cross_entropy_with_logits(x, np.zeros((2, 3)), **{name: weight})
        assert host(loss) == pytest.approx(math.log(2), rel=1e-6)


def test_grouped_conv2d_is_one_conv2d_per_group(backend):
    """groups=G is G ordinary convolutions side by side, each on its C/G channels with its
    K/G filters (depthwise when G = C); dilation spreads the taps, as the definition says."""
    rng = np.random.default_rng(6)
    for groups, dilation in ((2, 1), (4, (2, 1))):
        x = rng.standard_normal((2, 4, 7, 6)).astype(np.float32)
        w = rng.standard_normal((2 * groups, 4 // groups, 3, 3)).astype(np.float32)
        whole = host(F.conv2d(tensor(x, backend), w, padding=1, dilation=dilation, groups=groups))
        per = len(w) // groups
        parts = [host(F.conv2d(tensor(x[:, g * (4 // groups):(g + 1) * (4 // groups)], backend),
                               w[g * per:(g + 1) * per], padding=1, dilation=dilation))
                 for g in range(groups)]
        np.testing.assert_allclose(whole, np.concatenate(parts, axis=1), rtol=1e-5, atol=1e-5)


def test_grouped_dilated_conv2d_in_im2col_chunks(opencl, monkeypatch):
    """A batch split into im2col chunks gives what the whole batch gives, grouped and dilated."""
    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in ((5, 4, 7, 6), (6, 2, 3, 2), (6,))]
    op = lambda x, w, b: F.conv2d(x, w, b, stride=(1, 2), padding=2, dilation=(2, 3), groups=2)
    g = rng.standard_normal(op(*arrays).shape).astype(np.float32)
    launches = opencl.launches
    whole = run_op(op, arrays, g, opencl)
    whole_launches, launches = opencl.launches - launches, opencl.launches
    # two samples' columns per chunk: C*R*S rows of OH*OW float32 values each
    monkeypatch.setattr(netcl, "_IM2COL_BYTES", 2 * (4 * 3 * 2) * (7 * 4) * 4)
    chunked = run_op(op, arrays, g, opencl)
    assert opencl.launches - launches > whole_launches  # three chunks really ran
    for got, want in zip([chunked[0]] + chunked[1], [whole[0]] + whole[1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_grouped_dilated_conv2d_of_an_empty_batch(backend):
    x = param(np.zeros((0, 4, 5, 5)), backend)
    w = param(np.ones((6, 2, 2, 2)), backend)
    with netcl.Tape() as tape:
        out = F.conv2d(x, w, stride=1, padding=1, dilation=3, groups=2)
    assert out.shape == (0, 6, 4, 4)
    tape.backward(out, grad=np.zeros(out.shape, np.float32))
    assert host(x.grad).shape == (0, 4, 5, 5)
    np.testing.assert_array_equal(host(w.grad), np.zeros((6, 2, 2, 2)))


@pytest.mark.parametrize("gemm", ["packed", "tiled"])
@pytest.mark.parametrize("groups", [3, 1])  # packed, groups=1: im2col into the GEMM's panels
@pytest.mark.usefixtures("portable_half")
def test_autocast_grouped_dilated_conv2d_is_the_float32_result_rounded(opencl, monkeypatch,
                                                                        gemm, groups):
    """Under autocast a grouped, dilated conv2d writes float16 storage: the float32 result on
    the same values, rounded once; so is the input's gradient (float16 storage, as the
    input), and the weights' gradients are the float32 ones."""
    monkeypatch.setattr(opencl, "gemm", gemm)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 6, 8, 7)).astype(np.float16)
    weights = [rng.standard_normal((9, 6 // groups, 3, 3)) / 5, rng.standard_normal(9)]
    results = {}
    for enabled, dtype in ((False, np.float32), (True, np.float16)):
        leaves = [param(x, opencl, dtype)] + [param(w, opencl) for w in weights]
        with netcl.Tape() as tape, netcl.autocast(enabled=enabled):
            out = F.conv2d(*leaves, stride=(2, 1), padding=2, dilation=(2, 1), groups=groups)
        seed = np.random.default_rng(1).standard_normal(out.shape).astype(np.float16)
        tape.backward(out, grad=seed.astype(np.float32))
        results[enabled] = host(out), [host(p.grad) for p in leaves]
    (single, (dx32, *dw32)), (half, (dx16, *dw16)) = results[False], results[True]
    assert half.dtype == np.float16
    np.testing.assert_array_equal(half, single.astype(np.float16))
    assert dx16.dtype == np.float16
    np.testing.assert_array_equal(dx16, dx32.astype(np.float16))
    for g16, g32 in zip(dw16, dw32):
        assert g16.dtype == np.float32
        np.testing.assert_array_equal(g16, g32)


@pytest.mark.usefixtures("portable_half")
def test_autocast_winograd_rounds_a_float32_input_as_numpy_rounds_to_float16(opencl,
                                                                             monkeypatch):
    """Winograd's kernels round a float32 input under autocast (kernels.cl: wino_round) as
    NumPy casts to float16: to nearest, ties to even, float16's subnormals, 65504 and what
    rounds to it, what rounds to infinity, what rounds to zero. Each value is a 1x1 sample
    convolved by the filter whose centre tap is 1, which Winograd's transforms pass exactly
    (sums of the value's quarters), so the float16 output is the rounded input itself."""
    monkeypatch.setattr(opencl, "gemm", "tiled")
    rng = np.random.default_rng(12)
    half_values = rng.integers(0, 0x7bff, 4000).astype(np.uint16).view(np.float16)
    below = half_values.astype(np.float32)
    above = np.nextafter(half_values, np.float16(np.inf)).astype(np.float32)
    values = np.concatenate([
        below, (below + above) / 2,  # ties: to the even neighbour
        np.nextafter((below + above) / 2, np.float32(np.inf)),  # just past a tie
        np.nextafter((below + above) / 2, np.float32(-np.inf)),
        rng.standard_normal(2000).astype(np.float32) * 10.0 ** rng.integers(-9, 5, 2000),
        [0.0, -0.0, 2 ** -24, 2 ** -25, 3 * 2 ** -26, 2 ** -14, 2 ** -14 - 2 ** -30,
         65504.0, 65519.0, 65520.0, 1e6, 3e38, 1e-30, 1e-45]]).astype(np.float32)
    values = np.concatenate([values, -values])
    x = param(values.reshape(-1, 1, 1, 1), opencl)
    centre = np.zeros((1, 1, 3, 3), np.float32)
    centre[0, 0, 1, 1] = 1.0
    with netcl.autocast():
        out = F.conv2d(x, param(centre, opencl), padding=1)
    assert out.dtype == np.float16
    with np.errstate(over="ignore"):  # (what rounds to infinity)
        want = values.astype(np.float16)
    got = host(out).reshape(-1)
    # bit for bit, but for the zeros' signs (the transforms' sums of a zero's quarters with
    # the padding's zeros give +0)
    zero = want == 0
    np.testing.assert_array_equal(got[~zero].view(np.uint16), want[~zero].view(np.uint16))
    assert zero.sum() > 4 and (got[zero] == 0).all()


@pytest.mark.usefixtures("portable_half")
def test_autocast_winograd_conv2d_rounds_a_float32_input_and_seed_as_it_reads_them(
        opencl, monkeypatch):
    """Under autocast Winograd's conv2d reads a float32 input and a float32 seed rounded to
    float16 as they pass, with no copy (no cast launch at all): the output is the float32
    convolution of the rounded input, rounded once; the input gradient in the input's
    float32 storage, that of the rounded seed rounded to float16, as PyTorch's float16 one
    widened; the weight and bias gradients float32, those of the rounded input and seed."""
    monkeypatch.setattr(opencl, "gemm", "tiled")
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 8, 7, 6)).astype(np.float32)
    weights = [rng.standard_normal((16, 8, 3, 3)) / 5, rng.standard_normal(16)]
    seed = rng.standard_normal((2, 16, 7, 6)).astype(np.float32)
    launched = []
    launch = opencl.launch
    monkeypatch.setattr(opencl, "launch", lambda name, *args, **kwargs: (
        launched.append(name), launch(name, *args, **kwargs)))
    results = {}
    for enabled in (False, True):  # float32 on the rounded input, then autocast on x
        leaves = [param(x.astype(np.float16).astype(np.float32) if not enabled else x,
                        opencl)] + [param(w, opencl) for w in weights]
        launched.clear()
        with netcl.Tape() as tape, netcl.autocast(enabled=enabled):
            out = F.conv2d(*leaves, padding=1)
        # the float32 run on the rounded seed, the autocast one on the float32 seed itself
        # (a Tensor: an array would be uploaded in the output's storage)
        tape.backward(out, grad=netcl.Tensor.from_host(
            seed if enabled else seed.astype(np.float16).astype(np.float32), opencl.queue))
        results[enabled] = host(out), [host(p.grad) for p in leaves]
    # the forward's float32 input and the input gradient's float32 seed read rounded: the
    # kernels that round each value once the products it was loaded before have run
    assert launched.count("conv_winograd_32x32_r") == 2 and "im2col" not in launched
    assert not [name for name in launched if name.startswith("cast")]  # no float16 copies
    (single, (dx32, *dw32)), (half, (dx16, *dw16)) = results[False], results[True]
    assert half.dtype == np.float16 and dx16.dtype == np.float32
    np.testing.assert_array_equal(half, single.astype(np.float16))
    np.testing.assert_array_equal(dx16, dx32.astype(np.float16).astype(np.float32))
    for g16, g32 in zip(dw16, dw32):
        assert g16.dtype == np.float32
        np.testing.assert_array_equal(g16, g32)


@pytest.mark.parametrize("rows", [32, 64])
def test_winograds_raw_kernels_read_every_storage_as_the_others(opencl, rows):
    """conv_winograd_*_r (which keep x's stored bits until the transform) give the bits of
    conv_winograd_* for x in each storage mode, at a ragged edge of tiles and padding."""
    rng = np.random.default_rng(5)
    N, C, H, W, M = 3, 5, 7, 9, rows + 3
    window = (H, W, 3, 3, 1, 1, 1, 2, 1, 1, H, W - 2)
    filters = netcl._winograd_filters(netcl.Tensor.from_host(
        rng.standard_normal((M, C, 3, 3)).astype(np.float32), opencl.queue), True, False)[0]
    values = rng.standard_normal((N, C, H, W)) * 3
    tiles = netcl._WINOGRAD_BLOCKS[rows][1]
    T, TH, TW = netcl._winograd_tiles(N, window)
    for dtype, mode in [(np.float32, 0), (np.float32, 1), (np.float16, 2)]:
        x = netcl.Tensor.from_host(values.astype(dtype), opencl.queue)
        outs = []
        for suffix in ("", "_r"):
            out = netcl.Tensor.from_host(np.full((N, M, H, W - 2), np.nan, np.float32),
                                         opencl.queue)
            opencl.launch(f"conv_winograd_{rows}x{tiles}{suffix}",
                          (netcl._ceil_div(T, tiles) * rows * tiles // 4, netcl._ceil_div(M, rows)),
                          (rows * tiles // 4, 1), M, C, filters.shape[2], T, TH, TW, 0,
                          filters.data, x.data, None, out.data, mode, 0, *window)
            outs.append(host(out))
        assert np.isfinite(outs[0]).all()
        np.testing.assert_array_equal(outs[1], outs[0])


@pytest.mark.parametrize("winograd", [True, False])
@pytest.mark.parametrize("units", [2, 132])  # 2: a float32 forward's K split over the grid
@pytest.mark.usefixtures("portable_half")
def test_autocast_implicit_conv2d_is_the_float32_result_rounded(opencl, monkeypatch, units,
                                                                winograd):
    """Under autocast GPUs' convolutions without tensor cores (Winograd's, or the direct
    ones and the weight gradient's implicit GEMM, with the bias gradient in the weight
    gradient's sums) read and write float16 storage: the float32 result on the same values,
    rounded once, and the same float32 weight and bias gradients."""
    monkeypatch.setattr(opencl, "gemm", "tiled")
    monkeypatch.setattr(opencl, "compute_units", units)
    monkeypatch.setattr(netcl, "_WINOGRAD", winograd)
    if units == 2:  # short K split too (plans made under these limits are not kept)
        monkeypatch.setattr(netcl, "_SPLIT_K_MIN", 16)
        monkeypatch.setattr(netcl, "_VECTOR_SPLIT_K_MIN", 16)
        monkeypatch.setattr(netcl, "_conv_plan", functools.lru_cache(netcl._conv_plan.__wrapped__))
    rng = np.random.default_rng(10)
    x = rng.standard_normal((3, 8, 6, 6)).astype(np.float16)
    weights = [rng.standard_normal((8, 8, 3, 3)) / 5, rng.standard_normal(8)]
    launched = []
    launch = opencl.launch
    monkeypatch.setattr(opencl, "launch", lambda name, *args, **kwargs: (
        launched.append((name, kwargs.get("half", False))), launch(name, *args, **kwargs)))
    results = {}
    for enabled, dtype in ((False, np.float32), (True, np.float16)):
        leaves = [param(x, opencl, dtype)] + [param(w, opencl) for w in weights]
        launched.clear()
        with netcl.Tape() as tape, netcl.autocast(enabled=enabled):
            out = F.conv2d(*leaves, padding=1)
        seed = np.random.default_rng(1).standard_normal(out.shape).astype(np.float16)
        tape.backward(out, grad=seed.astype(np.float32))
        results[enabled] = host(out), [host(p.grad) for p in leaves]
        # the products in the build of the storage (Winograd's, in the float32 build, read
        # and write either)
        products = sorted(name.removesuffix("_r").rsplit("_", 1)[0] for name, half in launched
                          if name.startswith("conv_") and half == (enabled and not winograd)
                          and name not in ("conv_wgrad_sum", "conv_filters"))
        assert products == (["conv_winograd", "conv_winograd", "conv_winograd_wgrad"] if winograd
                            else ["conv_direct", "conv_direct", "conv_wgrad"])
        assert [name for name, _ in launched].count("conv_wgrad_sum") == 1
    (single, (dx32, *dw32)), (half, (dx16, *dw16)) = results[False], results[True]
    assert half.dtype == dx16.dtype == np.float16
    if units == 2:  # the float32 forward's K in chunks (float16 output is never split):
        # another order of the sum, so up to a rounding of the float16 result apart
        np.testing.assert_allclose(half, single.astype(np.float16), rtol=1e-3, atol=1e-3)
    else:
        np.testing.assert_array_equal(half, single.astype(np.float16))
    np.testing.assert_array_equal(dx16, dx32.astype(np.float16))
    for g16, g32 in zip(dw16, dw32):
        assert g16.dtype == np.float32
        np.testing.assert_array_equal(g16, g32)


@pytest.mark.parametrize("winograd", [True, False])
def test_conv2d_of_float16_storage_outside_autocast_is_float32(opencl, monkeypatch, winograd):
    """As linear and matmul: a float16 input outside autocast gives the float32 product (the
    output once had x's dtype while the kernel wrote floats, past the end of its buffer), by
    Winograd's kernels too (reading x's float16 storage) and by the device's own path."""
    if winograd:
        monkeypatch.setattr(opencl, "gemm", "tiled")
    monkeypatch.setattr(netcl, "_WINOGRAD", winograd)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 3, 6, 5)).astype(np.float16)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    out = F.conv2d(tensor(x, opencl), tensor(w, opencl), padding=1)
    single = F.conv2d(tensor(x.astype(np.float32), opencl), tensor(w, opencl), padding=1)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(host(out), host(single))


@pytest.mark.parametrize("call, words", [
    (lambda t: F.conv2d(t(2, 4, 5, 5), t(3, 2, 3, 3), groups=2),
     ["conv2d", "3 filters", "groups=2"]),
    (lambda t: F.conv2d(t(2, 3, 5, 5), t(4, 2, 3, 3), groups=2),
     ["conv2d", "3 channels", "expects 4", "groups=2"]),
    (lambda t: F.conv2d(t(2, 4, 5, 5), t(4, 4, 3, 3), groups=2),
     ["conv2d", "4 channels", "expects 8"]),
    (lambda t: F.conv2d(t(2, 4, 5, 5), t(4, 2, 3, 3), groups=0), ["conv2d", "groups", "0"]),
    (lambda t: F.conv2d(t(2, 4, 5, 5), t(4, 2, 3, 3), groups=2.0), ["conv2d", "groups", "2.0"]),
    (lambda t: F.conv2d(t(2, 4, 5, 5), t(4, 4, 3, 3), groups=True), ["conv2d", "groups", "True"]),
    (lambda t: F.conv2d(t(2, 4, 5, 5), t(4, 4, 3, 3), dilation=0), ["conv2d", "dilation", "0"]),
    (lambda t: F.conv2d(t(2, 4, 5, 5), t(4, 4, 3, 3), dilation=(1, -2)),
     ["conv2d", "dilation", "-2"]),
    (lambda t: F.conv2d(t(2, 4, 5, 5), t(4, 4, 3, 3), dilation=3),
     ["conv2d", "kernel (3, 3)", "dilation (3, 3)", "spans (7, 7)", "padded input (5, 5)"]),
    (lambda t: nn.Conv2d(3, 4, 3, groups=2), ["Conv2d", "in_ch=3", "groups=2"]),
    (lambda t: nn.Conv2d(4, 3, 3, groups=2), ["Conv2d", "out_ch=3", "groups=2"]),
    (lambda t: nn.Conv2d(4, 4, 3, groups=0), ["Conv2d", "groups", "0"]),
    (lambda t: nn.Conv2d(4, 4, 3, dilation=(0, 1)), ["Conv2d", "dilation", "(0, 1)"]),
])
def test_conv2d_groups_and_dilation_are_checked(backend, call, words):
    tensor = lambda *shape: netcl.Tensor.from_host(np.zeros(shape, np.float32), backend.queue)
    launches = backend.launches
    with raises_naming(ValueError, *words):
        call(tensor)
    assert backend.launches == launches


def test_conv2d_module_dilation_and_groups(backend):
    """nn.Conv2d as PyTorch's: weight (out, in / groups, kh, kw), U(+-1/sqrt(fan_in)) with
    fan_in = in / groups * kh * kw, the attributes, and the functional op underneath."""
    netcl.manual_seed(0)
    conv = nn.Conv2d(6, 9, (3, 2), 1, 2, (2, 1), 3, queue=backend.queue)  # PyTorch's order
    assert (conv.dilation, conv.groups, conv.padding) == ((2, 1), 3, (2, 2))
    state = conv.state_dict()
    assert list(state) == ["weight", "bias"] and state["weight"].shape == (9, 2, 3, 2)
    bound = 1 / np.sqrt(2 * 3 * 2)
    for value in state.values():
        assert np.abs(value).max() <= bound and np.abs(value).max() > 0.7 * bound
    x = np.random.default_rng(9).standard_normal((2, 6, 7, 5)).astype(np.float32)
    out = conv(tensor(x, backend))
    np.testing.assert_array_equal(host(out), host(F.conv2d(x, conv.weight, conv.bias, padding=2,
                                                           dilation=(2, 1), groups=3)))
    np.testing.assert_allclose(host(out), _conv2d_ref(x.astype(np.float64), state["weight"],
                                                      state["bias"], (1, 1), (2, 2), (2, 1), 3),
                               rtol=1e-5, atol=1e-5)


# --- broadcasting
# add, sub, mul and div broadcast as NumPy and PyTorch do, and integer operands promote to
# floating point. The gradient references transcribe PyTorch's autograd: derivatives.yaml's
# formulas at the output's shape, then summed to each operand's shape (sum_to_size).

def _sum_to_size(g, shape):
    """torch.Tensor.sum_to_size in NumPy: sum over the leading dimensions `shape` lacks, then,
    keeping them, over those where it has a 1."""
    g = g.sum(axis=tuple(range(g.ndim - len(shape))))
    return g.sum(axis=tuple(i for i, size in enumerate(shape) if size == 1), keepdims=True)


BINARY_GRADS = {  # derivatives.yaml: d(out)/da and d(out)/db times g
    "add": lambda a, b, g: (g, g),
    "sub": lambda a, b, g: (g, -g),
    "mul": lambda a, b, g: (g * b, g * a),
    "div": lambda a, b, g: (g / b, -g * a / (b * b)),
}


BROADCAST_SHAPES = [
    ((45, 65), (45, 1)), ((5, 3, 14, 16), (5, 1, 14, 1)), ((1, 32, 32, 32), (1, 32, 1, 1)),
    ((3, 1), (1, 4)), ((1, 4), (3, 1)), ((7,), (2, 3, 7)), ((2, 1, 5), (4, 1)),
    ((300, 2), (1, 2)), ((3, 1, 1), (3, 100, 7)),              # across work-group boundaries
    ((), (3, 4)), ((2, 3), ()), ((), ()), ((1,), (2, 3)), ((1, 1, 1), (5,)),   # 0-d and 1s
    ((0, 3), (3,)), ((2, 0), (2, 1)), ((0, 1), (1, 5)), ((), (0,)), ((4, 0, 2), (1, 1)),
    ((2, 1, 3, 1, 2, 1, 2, 1), (1, 2, 1, 3, 1, 2, 1, 2)),      # 8 groups, the kernels' most
]


@pytest.mark.parametrize("a_shape, b_shape", BROADCAST_SHAPES)
def test_broadcast_forward_and_gradients(backend, a_shape, b_shape):
    rng = np.random.default_rng(len(a_shape) * 10 + len(b_shape))
    a = np.asarray(rng.standard_normal(a_shape), np.float32)
    b = np.asarray(_away_from_zero(rng, b_shape), np.float32)
    shape = np.broadcast_shapes(a_shape, b_shape)
    g = rng.standard_normal(shape).astype(np.float32)
    a64, b64, g64 = a.astype(np.float64), b.astype(np.float64), g.astype(np.float64)
    for name, (functional, _, ref) in BINARY.items():
        pa, pb = param(a, backend), param(b, backend)
        with netcl.Tape() as tape:
            y = functional(pa, pb)
        tape.backward(y, grad=g)
        assert y.shape == shape, name
        np.testing.assert_allclose(host(y), ref(a64, b64), rtol=1e-5, atol=1e-6, err_msg=name)
        for p, grad in zip((pa, pb), BINARY_GRADS[name](a64, b64, g64)):
            expected = _sum_to_size(np.broadcast_to(grad, shape), p.shape)
            assert host(p.grad).shape == p.shape, name
            np.testing.assert_allclose(host(p.grad), expected, rtol=1e-4, atol=1e-4,
                                       err_msg=f"{name}: gradient of the {p.shape} operand")


@pytest.mark.parametrize("a_shape, b_shape", [((3, 4), (3,)), ((2, 3), (3, 2)),
                                              ((5, 1, 4), (2, 4, 1)), ((0,), (2,)),
                                              ((2, 3, 4), (2, 1, 3))])
def test_broadcast_shape_errors_name_op_and_both_shapes(backend, a_shape, b_shape):
    a, b = np.ones(a_shape, np.float32), np.ones(b_shape, np.float32)
    launches = backend.launches
    for name, (functional, operator, _) in BINARY.items():
        for call in (lambda: functional(param(a, backend), param(b, backend)),
                     lambda: operator(param(a, backend), param(b, backend)),
                     lambda: operator(a, param(b, backend)),      # the reflected operator
                     lambda: operator(param(a, backend), b)):
            with raises_naming(ValueError, name, str(a_shape), str(b_shape)):
                call()
    assert backend.launches == launches, "a shape error enqueued work"


def test_broadcast_of_more_groups_than_the_kernels_index_raises(backend):
    # 9 alternating groups: both backends refuse, so they never disagree
    a = param(np.ones((2, 1, 2, 1, 2, 1, 2, 1, 2), np.float32), backend)
    b = param(np.ones((1, 2, 1, 2, 1, 2, 1, 2, 1), np.float32), backend)
    with raises_naming(ValueError, "mul", "9 groups", "8"):
        F.mul(a, b)
    assert F.mul(a, b.reshape(2, 2, 2, 2)).shape == (2, 1, 2, 1, 2, 2, 2, 2, 2)


def test_node_operators_broadcast_both_ways(backend):
    rng = np.random.default_rng(21)
    row = rng.standard_normal(3).astype(np.float32)
    column = _away_from_zero(rng, (4, 1)).astype(np.float32)
    g = rng.standard_normal((4, 3)).astype(np.float32)
    r64, c64, g64 = row.astype(np.float64), column.astype(np.float64), g.astype(np.float64)
    calls = [  # (operator on (row, column), reference, gradient of the row)
        (lambda r, c: r + c, r64 + c64, g64.sum(0)),
        (lambda r, c: c - r, c64 - r64, -g64.sum(0)),
        (lambda r, c: r * c, r64 * c64, (g64 * c64).sum(0)),
        (lambda r, c: c / r, c64 / r64, (-g64 * c64 / r64 ** 2).sum(0)),
        (lambda r, c: r / c, r64 / c64, (g64 / c64).sum(0)),
    ]
    for column_kind in ("array", "node"):
        for fn, expected, row_grad in calls:
            r = param(row, backend)
            c = column if column_kind == "array" else netcl.Node(tensor(column, backend))
            with netcl.Tape() as tape:
                y = fn(r, c)
            tape.backward(y, grad=g)
            np.testing.assert_allclose(host(y), expected, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(host(r.grad), row_grad, rtol=1e-5, atol=1e-5)


def test_broadcast_keeps_the_common_cases_cheap(opencl, monkeypatch):
    """Operands of the output's shape take the kernels without index arithmetic; a bias row
    is one launch forward and one column sum backward, as before broadcasting."""
    names = []
    launch = opencl.launch
    monkeypatch.setattr(opencl, "launch", lambda name, *args, **kw: (names.append(name),
                                                                   launch(name, *args, **kw)))
    rng = np.random.default_rng(22)
    for x_shape, y_shape, forward, backward in [
            ((8, 5), (8, 5), ["add_fwd"], []), ((1, 8, 5), (8, 5), ["add_fwd"], []),
            ((8, 5), (5,), ["add_bcast"], ["sum_axis"]),
            ((8, 5), (8, 1), ["add_bcast"], ["sum_axis"])]:
        x = param(rng.standard_normal(x_shape), opencl)
        y = param(rng.standard_normal(y_shape), opencl)
        names.clear()
        with netcl.Tape() as tape:
            out = x + y
        assert names == forward, (x_shape, y_shape)
        names.clear()
        tape.backward(out, grad=np.ones(out.shape, np.float32))
        assert names == backward, (x_shape, y_shape)


def test_broadcast_float16_storage(opencl):
    """float16 operands broadcast in float16 storage (the float32 result rounded); a float16
    operand against a float32 one widens, as without broadcasting. The gradients are float16
    storage too: the float32 ones but for one rounding of each elementwise term before the
    sum over the broadcast dimensions, and one of the sum."""
    rng = np.random.default_rng(23)
    a = rng.standard_normal((6, 1, 5)).astype(np.float16)
    b = (rng.uniform(0.5, 2, (4, 1)) * rng.choice([-1, 1], (4, 1))).astype(np.float16)
    # backward(grad=array) gives the seed the loss's dtype: the same float16 values for both
    g = rng.standard_normal((6, 4, 5)).astype(np.float16).astype(np.float32)
    for name, (functional, _, ref) in BINARY.items():
        grads = {}
        # (|a|, |b|, |g|): the float32 gradients are then the sums of the terms' magnitudes
        for key, (x, y_, seed) in {np.float16: (a, b, g), np.float32: (a, b, g),
                                   "magnitudes": (abs(a), abs(b), abs(g))}.items():
            dtype = np.float16 if key is np.float16 else np.float32
            pa, pb = param(x.astype(dtype), opencl, dtype), param(y_.astype(dtype), opencl, dtype)
            with netcl.Tape() as tape:
                y = functional(pa, pb)
            tape.backward(y, grad=seed)
            grads[key] = host(pa.grad), host(pb.grad)
            if key is np.float16:
                _assert_rounded_from(host(y), ref(a.astype(np.float64), b.astype(np.float64)),
                                     name)
        for half_grad, float_grad, magnitude in zip(grads[np.float16], grads[np.float32],
                                                    grads["magnitudes"]):
            assert half_grad.dtype == np.float16, name
            bound = 2.0 ** -11 * (np.abs(magnitude) + np.abs(float_grad)) + 2.0 ** -24
            assert (np.abs(half_grad.astype(np.float64) - float_grad) <= bound).all(), name
        mixed = functional(tensor(a, opencl), tensor(b.astype(np.float32), opencl))
        assert mixed.dtype == np.float32
        np.testing.assert_array_equal(host(mixed), ref(a.astype(np.float32),
                                                       b.astype(np.float32)))


def test_integer_tensors_promote_to_float(backend):
    """As PyTorch: an int tensor with a float operand, or under exp and relu, computes in
    floating point. int with int gives float32 here (PyTorch keeps int; true division is
    float there too)."""
    ints_host = np.array([[3, -2, 0, 7]])
    ints = tensor(ints_host, backend)
    assert ints.dtype == np.int32
    floats_host = np.array([[0.5], [-1.5]], np.float32)
    floats = tensor(floats_host, backend)
    i64, f64 = ints_host.astype(np.float64), floats_host.astype(np.float64)
    node = netcl.Node(ints)
    with np.errstate(divide="ignore", invalid="ignore"):  # x / 0 and 0 / 0 in the references
        results = [
            (node + 0.5, i64 + 0.5), (2.0 - node, 2.0 - i64), (F.mul(ints, 0.25), i64 * 0.25),
            (F.mul(ints, floats), i64 * f64), (F.div(floats, ints), f64 / i64),
            (F.sub(ints, np.array([1.5])), i64 - 1.5), (node * np.arange(4), i64 * np.arange(4)),
            (F.exp(ints), np.exp(i64)), (F.relu(ints), np.maximum(i64, 0)),
            (F.add(ints, ints), 2 * i64), (node / node, i64 / i64), (F.sum(ints), i64.sum()),
            (F.tanh(node), np.tanh(i64))]
    for out, expected in results:
        assert out.dtype == np.float32
        np.testing.assert_allclose(host(out), expected, rtol=1e-6, atol=1e-7)
    half = F.add(ints, tensor(np.array([0.25], np.float16), backend))  # int + half -> half
    assert half.dtype == np.float16
    np.testing.assert_array_equal(host(half), (i64 + 0.25).astype(np.float16))
    w = param(floats_host, backend)
    with netcl.Tape() as tape:
        loss = (w * ints).sum()                        # the int operand is a constant
    tape.backward(loss)
    np.testing.assert_array_equal(host(w.grad), np.full((2, 1), ints_host.sum(), np.float32))
    labels = tensor(np.array([1, 0]), backend)         # labels stay labels
    loss = F.cross_entropy(tensor(np.zeros((2, 3)), backend), labels)
    assert labels.dtype == np.int32
    assert float(host(loss)) == pytest.approx(math.log(3))


def test_leading_dimension_pieces_are_views_where_the_device_allows(opencl):
    """split/unbind along dimension 0 make no copy when every piece starts on the device's
    sub-buffer alignment (the pieces share x's memory, as PyTorch's views), and copy when one
    does not; both give the same values and gradients."""
    align = opencl.cl_device.mem_base_addr_align // 8  # bytes
    row = align // 4  # float32 elements in one aligned row
    for rows_per_piece, cols, views in ((2, row, True), (1, row + 1, False)):
        host_rows = np.arange(3 * rows_per_piece * cols, dtype=np.float32).reshape(-1, cols)
        x = param(host_rows, opencl)
        with netcl.Tape() as tape:
            before = opencl.launches
            pieces = F.split(x, rows_per_piece, 0)
            made = opencl.launches - before
            loss = (pieces[0] * 1.0 + pieces[2] * 3.0).sum()
        assert (made == 0) == views, (rows_per_piece, cols, made)
        tape.backward(loss)
        for k, piece in enumerate(pieces):
            np.testing.assert_array_equal(piece.value.to_host(),
                                          host_rows[k * rows_per_piece:(k + 1) * rows_per_piece])
        expected = np.repeat(np.array([1.0, 0.0, 3.0], np.float32), rows_per_piece)
        np.testing.assert_array_equal(x.grad.to_host(),
                                      np.broadcast_to(expected[:, None], host_rows.shape))


def test_unbind_matches_torch_and_checks_its_argument(backend):
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    for dim in (0, 1, -1):
        pieces = F.unbind(tensor(x, backend), dim)
        assert len(pieces) == x.shape[dim]
        for k, piece in enumerate(pieces):  # torch.unbind: the slices, the dimension removed
            np.testing.assert_array_equal(piece.value.to_host(), np.take(x, k, axis=dim))
    assert F.unbind(tensor(np.zeros((2, 0)), backend), 1) == ()
    with pytest.raises(ValueError, match="unbind"):
        F.unbind(tensor(np.float32(1.0), backend))
    with raises_naming(ValueError, "unbind", "3"):
        F.unbind(tensor(x, backend), 3)


@pytest.mark.parametrize("scale", [None, 2.0, math.inf])
def test_attention_with_empty_query_and_key_rows_weighs_every_key_alike(backend, scale):
    """E = 0: every score is the empty dot product, 0, whatever the scale (PyTorch scales q
    and k by sqrt(scale) before their product), so each output row is the mean of v's rows
    (of those it may see, when causal) and v's gradient spreads g evenly; not NaN."""
    rng = np.random.default_rng(6)
    q, k = np.zeros((2, 3, 0), np.float32), np.zeros((2, 4, 0), np.float32)
    v, g = rng.standard_normal((2, 4, 5)).astype(np.float32), np.ones((2, 3, 5), np.float32)
    for causal in (False, True):
        V = param(v, backend)
        with netcl.Tape() as tape:
            out = F.scaled_dot_product_attention(q, k, V, is_causal=causal, scale=scale)
        tape.backward(out, grad=g)
        seen = np.tril(np.ones((3, 4))) if causal else np.ones((3, 4))
        weights = seen / seen.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(host(out), weights @ v, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(host(V.grad), np.swapaxes(weights, 0, 1) @ g, rtol=1e-6)


def test_a_mask_that_requires_grad_is_refused_while_recording(backend):
    """attention's mask gets no gradient, so one that requires grad is a ValueError on a Tape
    (its gradient would be lost without a word); outside a Tape, or as its .value, it works."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 3, 4)).astype(np.float32) for _ in range(3))
    mask = param(rng.standard_normal((3, 3)).astype(np.float32), backend)
    Q = param(q, backend)
    with netcl.Tape():
        with raises_naming(ValueError, "attn_mask"):
            F.scaled_dot_product_attention(Q, k, v, attn_mask=mask)
        out = F.scaled_dot_product_attention(Q, k, v, attn_mask=mask.value)
    with netcl.no_grad():
        np.testing.assert_array_equal(
            host(F.scaled_dot_product_attention(Q, k, v, attn_mask=mask)), host(out))


@pytest.mark.parametrize("causal, masked, p", [(False, False, 0.0), (True, False, 0.0),
                                               (False, True, 0.0), (True, False, 0.3)])
def test_attention_rows_longer_than_a_work_group(cpu, opencl, causal, masked, p):
    """The attention kernels share each row among a work-group of 64 work-items, in blocks
    of 64 keys (or queries) and columns: lengths and head sizes past one block, causal rows
    that stop early, and a mask whose rows begin with -inf agree with the NumPy backend."""
    rng = np.random.default_rng(3)
    B, L, S, E, Ev = 2, 70, 130, 80, 65
    arrays = [rng.standard_normal(s).astype(np.float32) for s in [(B, L, E), (B, S, E), (B, S, Ev)]]
    g = rng.standard_normal((B, L, Ev)).astype(np.float32)
    mask = None
    if masked:
        mask = rng.standard_normal((L, S)).astype(np.float32)
        mask[:, :3] = -np.inf  # each row's first keys masked out
        mask[5] = -np.inf      # and one row with no key at all: its output is 0

    def run(dev):
        nodes = [param(a, dev) for a in arrays]
        netcl.manual_seed(11)
        with netcl.Tape() as tape:
            y = F.scaled_dot_product_attention(*nodes, attn_mask=mask, is_causal=causal,
                                               dropout_p=p)
        tape.backward(y, grad=tensor(g, dev))
        return [host(y)] + [host(n.grad) for n in nodes]

    for expected, got in zip(run(cpu), run(opencl)):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# nn modules, state_dict, save / load, print(model)
# ---------------------------------------------------------------------------------------------

def _mlp(dev, sizes=(20, 32, 10), seed=0, activations=(nn.ReLU,)):
    """The suite's MLP: a Linear between each two sizes, seeded by manual_seed(seed), and
    between the Linears the activations in turn."""
    netcl.manual_seed(seed)
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
        if i:
            layers.append(activations[(i - 1) % len(activations)]())
        layers.append(nn.Linear(fan_in, fan_out, queue=dev.queue))
    return nn.Sequential(*layers)


def test_named_parameters_names_and_order(backend):
    model = _mlp(backend)
    named = list(model.named_parameters())
    assert [n for n, _ in named] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert [tuple(p.shape) for _, p in named] == [(32, 20), (32,), (10, 32), (10,)]
    assert [id(p) for p in model.parameters()] == [id(p) for _, p in named]
    assert all(isinstance(p, netcl.Parameter) for _, p in named)
    assert all(p.value.device is backend for _, p in named)


def test_linear_default_init_bounds(backend):
    netcl.manual_seed(0)
    layer = netcl.Linear(200, 300, queue=backend.queue)
    bound = 1 / math.sqrt(200)
    w = host(layer.weight)
    b = host(layer.bias)
    assert w.shape == (300, 200) and b.shape == (300,)
    for values in (w, b):
        assert np.abs(values).max() <= bound
        assert values.max() > 0.9 * bound and values.min() < -0.9 * bound
    # Uniform: standard deviation bound / sqrt(3).
    assert abs(w.std() - bound / math.sqrt(3)) < 0.02 * bound
    no_bias = netcl.Linear(5, 3, bias=False, queue=backend.queue)
    assert [n for n, _ in no_bias.named_parameters()] == ["weight"]


def test_manual_seed_reproducible_init(backend):
    first = _mlp(backend, seed=11).state_dict()
    second = _mlp(backend, seed=11).state_dict()
    other = _mlp(backend, seed=12).state_dict()
    for key in first:
        np.testing.assert_array_equal(first[key], second[key])
    assert not np.array_equal(first["0.weight"], other["0.weight"])


def test_sequential_forward_matches_numpy(backend):
    model = _mlp(backend)
    state = model.state_dict()
    x = np.random.default_rng(12).standard_normal((7, 20)).astype(np.float32)
    expected = np.maximum(x @ state["0.weight"].T + state["0.bias"], 0) @ state["2.weight"].T \
        + state["2.bias"]
    np.testing.assert_allclose(host(model(tensor(x, backend))), expected, rtol=1e-5, atol=1e-5)


def test_state_dict_layout(backend):
    model = _mlp(backend)
    state = model.state_dict()
    assert isinstance(state, dict)
    assert list(state) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for (name, p), (key, value) in zip(model.named_parameters(), state.items()):
        assert name == key
        assert isinstance(value, np.ndarray) and value.dtype == np.float32
        np.testing.assert_array_equal(value, host(p))


def test_load_state_dict_copies_into_existing_parameters(backend):
    source = _mlp(backend, seed=1).state_dict()
    model = _mlp(backend, seed=2)
    params_before = list(model.parameters())
    opt = netcl.SGD(model.parameters(), lr=0.5)
    model.load_state_dict(source)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params_before]
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(value, source[key])
    # The optimizer built before the load updates the loaded values.
    weight = params_before[0]
    g = np.full((32, 20), 0.25, np.float32)
    with netcl.Tape() as tape:
        loss = (weight * g).sum()
    opt.zero_grad()
    tape.backward(loss)
    opt.step()
    np.testing.assert_allclose(host(weight), source["0.weight"] - 0.5 * g, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("change, key", [
    (lambda s: s.pop("2.bias"), "2.bias"),
    (lambda s: s.__setitem__("4.weight", np.zeros((3, 3), np.float32)), "4.weight"),
    (lambda s: s.__setitem__("0.weight", np.zeros((20, 32), np.float32)), "0.weight"),
])
def test_load_state_dict_rejects_bad_keys_and_shapes(backend, change, key):
    model = _mlp(backend)
    state = model.state_dict()
    before = {k: v.copy() for k, v in state.items()}
    change(state)
    with raises_naming((KeyError, ValueError, RuntimeError), key):
        model.load_state_dict(state)
    if key != "4.weight":
        # Nothing is half-loaded: the parameters keep their values.
        for k, v in model.state_dict().items():
            np.testing.assert_array_equal(v, before[k])


def test_train_eval_and_dropout_module(backend):
    netcl.manual_seed(0)
    drop = netcl.Dropout(0.5)
    layer = netcl.Linear(10, 40, queue=backend.queue)
    model = netcl.Sequential(layer, drop)
    x = tensor(np.random.default_rng(13).standard_normal((30, 10)), backend)
    assert model.training and drop.training
    model.eval()
    assert not model.training and not drop.training
    out_eval = host(model(x))
    np.testing.assert_array_equal(out_eval, host(layer(x)))
    assert np.count_nonzero(out_eval == 0) == 0
    model.train()
    assert model.training and drop.training
    out_train = host(model(x))
    dropped = out_train == 0
    assert 0.3 < dropped.mean() < 0.7
    np.testing.assert_allclose(out_train[~dropped], 2 * out_eval[~dropped], rtol=1e-6)


@pytest.mark.parametrize("module, fn", [
    (lambda: netcl.ReLU(), F.relu), (lambda: netcl.Tanh(), F.tanh),
    (lambda: netcl.Sigmoid(), F.sigmoid), (lambda: netcl.GELU(), F.gelu),
    (lambda: netcl.Flatten(), F.flatten),
])
def test_activation_modules_match_functional(backend, module, fn):
    x = tensor(np.random.default_rng(14).standard_normal((4, 3, 5)), backend)
    m = module()
    assert list(m.parameters()) == []
    out = host(m(x))
    np.testing.assert_array_equal(out, host(fn(x)))
    if isinstance(m, netcl.Flatten):
        assert out.shape == (4, 15)


# --- save / load

def test_save_load_round_trip(backend, tmp_path):
    model = _mlp(backend, seed=3)
    state = model.state_dict()
    state["steps"] = np.array(7, np.int32)
    path = str(tmp_path / "weights.ckpt")
    netcl.save(state, path)
    assert os.listdir(tmp_path) == ["weights.ckpt"]
    loaded = netcl.load(path)
    assert sorted(loaded) == sorted(state)
    for key, value in state.items():
        assert isinstance(loaded[key], np.ndarray)
        assert loaded[key].dtype == value.dtype
        np.testing.assert_array_equal(loaded[key], value)
    del loaded["steps"]
    other = _mlp(backend, seed=4)
    other.load_state_dict(loaded)
    x = tensor(np.ones((2, 20), np.float32), backend)
    np.testing.assert_array_equal(host(other(x)), host(model(x)))


class _Booby:
    """Unpickling this creates a file: proof that a loader ran pickle."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_load_refuses_pickled_objects(tmp_path):
    marker = str(tmp_path / "unpickled")
    path = str(tmp_path / "evil.npz")
    np.savez(path, weight=np.array([_Booby(marker)], dtype=object))
    with pytest.raises(ValueError):
        netcl.load(path)
    assert not os.path.exists(marker), "netcl.load unpickled an object"


def test_load_missing_key_names_it(backend, tmp_path):
    model = _mlp(backend)
    state = model.state_dict()
    del state["0.bias"]
    path = str(tmp_path / "partial.npz")
    netcl.save(state, path)
    with raises_naming((KeyError, ValueError, RuntimeError), "0.bias"):
        model.load_state_dict(netcl.load(path))


def test_reassigning_a_parameter_keeps_its_place():
    class Layer(netcl.Module):
        def __init__(self):
            super().__init__()
            self.weight = netcl.Parameter(np.ones(2, np.float32))
            self.bias = netcl.Parameter(np.zeros(2, np.float32))
            self.weight = netcl.Parameter(np.ones(3, np.float32))
    assert [name for name, _ in Layer().named_parameters()] == ["weight", "bias"]


def _same_arrays(loaded, expected):
    assert sorted(loaded) == sorted(expected)
    for key, value in expected.items():
        assert loaded[key].dtype == np.asarray(value).dtype
        np.testing.assert_array_equal(loaded[key], value)


def test_save_on_a_full_disk_keeps_the_previous_file(tmp_path):
    path = tmp_path / "ckpt.npz"
    good = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "steps": np.array(7, np.int32)}
    netcl.save(good, path)
    # In a child, so that the file-size limit (what a full disk does to a write) stays there.
    out = _run_python(f"""
import resource, signal
import numpy as np, netcl
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, write() fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    netcl.save({{"w": np.ones((64, 64), np.float32), "steps": np.array(8)}}, {str(path)!r})
except OSError as error:
    print("OSError:", error)
""")
    _same_arrays(netcl.load(path), good)
    assert os.listdir(tmp_path) == ["ckpt.npz"]  # no temporary left behind
    assert out.startswith("OSError:") and str(path) in out, out


@pytest.mark.parametrize("failure", ["KeyboardInterrupt", "OSError"])
def test_interrupted_save_keeps_the_previous_file_and_its_mode(tmp_path, monkeypatch, failure):
    import errno
    path = tmp_path / "ckpt.npz"
    good = {"w": np.arange(6, dtype=np.float32), "b": np.ones(2, np.float32)}
    netcl.save(good, path)
    os.chmod(path, 0o604)
    real_savez = np.savez

    def savez_then_fail(file, **arrays):
        file.write(b"PK\x03\x04" + bytes(100))  # a partial archive, then the interruption
        raise (KeyboardInterrupt() if failure == "KeyboardInterrupt"
               else OSError(errno.ENOSPC, "No space left on device"))

    monkeypatch.setattr(np, "savez", savez_then_fail)
    with pytest.raises(KeyboardInterrupt if failure == "KeyboardInterrupt" else OSError) as caught:
        netcl.save({"w": np.zeros(6, np.float32)}, path)
    monkeypatch.setattr(np, "savez", real_savez)
    assert os.listdir(tmp_path) == ["ckpt.npz"]
    _same_arrays(netcl.load(path), good)
    if failure == "OSError":
        assert str(path) in str(caught.value) and caught.value.errno == errno.ENOSPC
    # A save that succeeds replaces the file and keeps its mode; a new file gets open()'s.
    newer = {"w": np.full(6, 2.0, np.float32)}
    netcl.save(newer, path)
    _same_arrays(netcl.load(path), newer)
    assert os.stat(path).st_mode & 0o7777 == 0o604
    umask = os.umask(0o027)
    try:
        netcl.save(newer, tmp_path / "new.ckpt")
    finally:
        os.umask(umask)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.npz", "new.ckpt"]  # exactly the path given
    assert os.stat(tmp_path / "new.ckpt").st_mode & 0o7777 == 0o666 & ~0o027


def test_load_of_a_file_that_is_no_archive_names_it(tmp_path):
    weights = np.arange(100, dtype=np.float64)
    netcl.save({"w": weights, "b": np.zeros(5, np.float32)}, tmp_path / "good.npz")
    raw = (tmp_path / "good.npz").read_bytes()
    flipped = bytearray(raw)
    flipped[raw.index(weights.tobytes()) + 8] ^= 0xFF  # one byte of "w": its CRC no longer fits
    np.save(tmp_path / "array.npy", weights)
    files = {"half.npz": raw[:len(raw) // 2], "cut.npz": raw[:-10], "flipped.npz": bytes(flipped),
             "noise.bin": np.random.default_rng(0).bytes(300), "empty.npz": b""}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    for name in ["array.npy", *files]:
        with raises_naming(ValueError, str(tmp_path / name), "npz"):
            netcl.load(tmp_path / name)
    with pytest.raises(FileNotFoundError):
        netcl.load(tmp_path / "missing.npz")
    netcl.save({}, tmp_path / "nothing.npz")  # an empty archive is still one
    assert netcl.load(tmp_path / "nothing.npz") == {}


def test_save_rejects_keys_that_are_equal_as_strings(tmp_path):
    path = tmp_path / "ckpt.npz"
    netcl.save({0: np.zeros(2), 1: np.ones(2)}, path)  # int keys come back ints
    assert list(netcl.load(path)) == [0, 1]
    path.unlink()
    with raises_naming(ValueError, "save", "'1'"):
        netcl.save({1: np.zeros(2), "1": np.ones(2)}, path)
    assert not path.exists()
    # netcl's own key, which load would read as a nested state's skeleton: refused, and the
    # file saved before is kept
    netcl.save({"w": np.ones(2)}, path)
    with raises_naming(ValueError, "save", "__netcl_tree__"):
        netcl.save({"__netcl_tree__": np.zeros(2), "w": np.zeros(2)}, path)
    np.testing.assert_array_equal(netcl.load(path)["w"], np.ones(2))


@pytest.mark.parametrize("bad", [np.complex64, np.bool_])
def test_load_state_dict_rejects_bool_and_complex_arrays_changing_nothing(backend, bad):
    model = _mlp(backend, seed=3)
    before = model.state_dict()
    state = {key: np.full(value.shape, 0.5, value.dtype) for key, value in before.items()}
    last = list(state)[-1]
    state[last] = np.ones(state[last].shape, bad)
    with raises_naming(ValueError, repr(last), str(np.dtype(bad))):
        model.load_state_dict(state)
    _same_arrays(model.state_dict(), before)  # the keys before it were not written either
    state[last] = np.ones(state[last].shape, np.int64)  # integers convert, as in PyTorch
    model.load_state_dict(state)
    assert np.all(model.state_dict()[last] == 1.0) and model.state_dict()[last].dtype == np.float32


# --- nested state

def test_save_and_load_nested_state_as_it_was(backend, tmp_path):
    netcl.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4, queue=backend.queue), nn.ReLU(),
                          nn.Linear(4, 2, queue=backend.queue))
    for opt in (netcl.AdamW(model.parameters(), lr=0.01),
                netcl.SGD(model.parameters(), lr=0.1, momentum=0.9)):
        with netcl.Tape() as tape:
            loss = F.sum(model(tensor(np.ones((2, 3)), backend)))
        tape.backward(loss)
        opt.step()
        state = opt.state_dict()
        netcl.save(state, tmp_path / "opt.npz")
        loaded = netcl.load(tmp_path / "opt.npz")
        assert str(loaded) == str(state)  # types too: int keys, tuples, Python numbers
        fresh = type(opt)(model.parameters(), lr=0.5)
        fresh.load_state_dict(loaded)
        assert str(fresh.state_dict()) == str(state)
    keys = set(np.load(tmp_path / "opt.npz").files)
    assert "state.0.momentum_buffer" in keys and "param_groups.0.lr" in keys
    nested = {"model": model.state_dict(), "misc": [1, 2.5, True, None, "min", (3, -1.0)],
              "empty": {}, 7: {"x": np.arange(3)}}
    netcl.save(nested, tmp_path / "nested.npz")
    loaded = netcl.load(tmp_path / "nested.npz")
    assert list(loaded) == ["model", "misc", "empty", 7]
    assert loaded["misc"] == [1, 2.5, True, None, "min", (3, -1.0)]
    assert [type(v) for v in loaded["misc"][:3]] == [int, float, bool]
    assert list(loaded["model"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]  # dots kept
    _same_arrays(loaded["model"], model.state_dict())
    np.testing.assert_array_equal(loaded[7]["x"], np.arange(3))
    # a flat dict of arrays stays the format it always was
    netcl.save(model.state_dict(), tmp_path / "flat.npz")
    assert set(np.load(tmp_path / "flat.npz").files) == set(model.state_dict())


def test_save_rejects_what_a_state_cannot_hold_and_load_a_forged_structure(tmp_path):
    path = tmp_path / "bad.npz"
    for state, needle in (({"a": {"b": object()}}, "a.b"), ({"a": [{(1, 2): 3}]}, "(1, 2)"),
                          ([np.zeros(2)], "dict")):
        with raises_naming(ValueError, "save", needle):
            netcl.save(state, path)
        assert not path.exists()
    for forged in ('{"dict": [["w", {"array": "missing"}]]}', '{"eval": "os.system"}',
                   '{"dict": [["w", {"int": "w"}]]}', "[1, 2", '{"list": []}'):
        np.savez(path, w=np.zeros(3), __netcl_tree__=np.array(forged))
        with raises_naming(ValueError, "load", str(path)):
            netcl.load(path)
    # zips that are no .npz: a text member, or a structure entry that is no .npy
    for member in ("hello.txt", "__netcl_tree__.npy"):
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr(member, b"not an array")
        with raises_naming(ValueError, "load", str(path)):
            netcl.load(path)


def test_module_to_moves_parameters_and_buffers_in_place(backend):
    source = _other(backend)
    netcl.manual_seed(3)
    q = source.queue
    model = nn.Sequential(nn.Linear(5, 4, queue=q), nn.BatchNorm1d(4, queue=q), nn.ReLU(),
                          nn.Linear(4, 3, queue=q))
    x = np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32)
    with netcl.Tape() as tape:  # trains the batch norm's running statistics once
        loss = F.cross_entropy(model(tensor(x, source)), np.array([0, 1, 2, 0, 1, 2]))
    tape.backward(loss)
    params = dict(model.named_parameters())
    before = {name: host(p) for name, p in params.items()}
    grads = {name: host(p.grad) for name, p in params.items()}
    stats = model[1].running_mean.to_host(), model[1].running_var.to_host()
    model.eval()
    expected = host(model(tensor(x, source)))

    assert model.to(backend.backend) is model
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    for name, p in params.items():
        assert p.device is backend and p.grad.device is backend, name
        np.testing.assert_array_equal(host(p), before[name], err_msg=name)
        np.testing.assert_array_equal(host(p.grad), grads[name], err_msg=name)
    assert model[1].running_mean.device is backend and model[1].running_var.device is backend
    np.testing.assert_array_equal(model[1].running_mean.to_host(), stats[0])
    np.testing.assert_array_equal(model[1].running_var.to_host(), stats[1])
    assert isinstance(model[1].num_batches_tracked, np.ndarray)  # a host counter stays one
    assert model[1]._buffers["running_mean"] is model[1].running_mean
    np.testing.assert_allclose(host(model(tensor(x, backend))), expected, rtol=1e-5, atol=1e-5)
    assert model.to(backend) is model  # already there: nothing changes
    with raises_naming(ValueError, "Sequential.to", "device"):
        model.to(None)
    with raises_naming(ValueError, "Sequential.to", "nonsense"):
        model.to("nonsense")


# PyTorch 2's print() of the same modules (torch.nn, CPU), character for character.
TORCH_MODEL_REPR = """\
Sequential(
  (0): Conv2d(1, 16, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
  (1): ReLU()
  (2): MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)
  (3): Conv2d(16, 32, kernel_size=(3, 5), stride=(2, 2), dilation=(2, 2), groups=2, bias=False)
  (4): MaxPool2d(kernel_size=3, stride=1, padding=1, dilation=1, ceil_mode=False)
  (5): Flatten(start_dim=1, end_dim=-1)
  (6): Linear(in_features=10, out_features=5, bias=False)
  (7): Dropout(p=0.25, inplace=False)
  (8): GELU(approximate='none')
  (9): GELU(approximate='tanh')
  (10): Tanh()
  (11): Sigmoid()
  (12): LayerNorm((5,), eps=1e-05, elementwise_affine=True, bias=True)
  (13): LayerNorm((4, 5), eps=1e-06, elementwise_affine=False, bias=False)
  (14): LayerNorm((5,), eps=1e-05, elementwise_affine=True, bias=False)
  (15): BatchNorm1d(16, eps=1e-05, momentum=0.1, affine=True, bias=True, track_running_stats=True)
  (16): BatchNorm2d(8, eps=1e-05, momentum=None, affine=False, bias=False, track_running_stats=False)
  (17): Embedding(10, 3)
  (18): Sequential(
    (0): Linear(in_features=2, out_features=2, bias=True)
    (1): ReLU()
  )
  (19): Sequential()
  (20): Flatten(start_dim=0, end_dim=2)
)"""


def _printed_model():
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, (3, 5), stride=2, dilation=2, groups=2, bias=False),
        nn.MaxPool2d(3, stride=1, padding=1), nn.Flatten(), nn.Linear(10, 5, bias=False),
        nn.Dropout(0.25), nn.GELU(), nn.GELU(approximate="tanh"), nn.Tanh(), nn.Sigmoid(),
        nn.LayerNorm(5), nn.LayerNorm((4, 5), eps=1e-6, elementwise_affine=False),
        nn.LayerNorm(5, bias=False), nn.BatchNorm1d(16),
        nn.BatchNorm2d(8, momentum=None, affine=False, track_running_stats=False),
        nn.Embedding(10, 3), nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Sequential(),
        nn.Flatten(0, 2))


def test_repr_of_a_model_is_pytorchs():
    model = _printed_model()
    assert repr(model) == TORCH_MODEL_REPR
    assert repr(nn.Linear(784, 128)) == "Linear(in_features=784, out_features=128, bias=True)"
    assert repr(nn.MaxPool2d((2, 3))) == ("MaxPool2d(kernel_size=(2, 3), stride=(2, 3), padding=0, "
                                         "dilation=1, ceil_mode=False)")

    class Net(nn.Module):  # a user's module: attribute names, sub-modules indented
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 3)
            self.block = nn.Sequential(nn.ReLU())

        def forward(self, x):
            return self.block(self.fc(x))

    assert repr(Net()) == ("Net(\n  (fc): Linear(in_features=2, out_features=3, bias=True)\n"
                           "  (block): Sequential(\n    (0): ReLU()\n  )\n)")


def test_print_model_adds_the_parameter_count(capsys):
    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    assert model.num_parameters() == 784 * 128 + 128 + 128 * 10 + 10
    print(model)
    assert capsys.readouterr().out == repr(model) + "\nTotal params: 101,770\n"
    shared = nn.Linear(3, 3)
    assert nn.Sequential(shared, nn.ReLU(), shared).num_parameters() == 12  # counted once
    batch_norm = nn.BatchNorm1d(4)  # its running statistics are buffers, not parameters
    assert batch_norm.num_parameters() == 8
    assert nn.ReLU().num_parameters() == 0


# ---------------------------------------------------------------------------------------------
# optimizers: SGD, Adam, AdamW, clip_grad_norm, schedules, state
# ---------------------------------------------------------------------------------------------

# --- optim.SGD

def _sgd_reference(initial, grads_per_step, lrs, momentum=0.0, weight_decay=0.0, nesterov=False):
    """PyTorch's SGD rule (torch/optim/sgd.py, _single_tensor_sgd, dampening=0) in NumPy:
        d_p = grad + weight_decay * p
        buf = d_p on the first step, else momentum * buf + d_p
        d_p = d_p + momentum * buf if nesterov else buf       (only when momentum != 0)
        p  -= lr * d_p
    Returns the float64 parameters after each step."""
    params = [p.astype(np.float64) for p in initial]
    bufs = [None] * len(params)
    history = []
    for grads, lr in zip(grads_per_step, lrs):
        for i, (p, g) in enumerate(zip(params, grads)):
            d_p = g + weight_decay * p  # float64, as p is
            if momentum:
                bufs[i] = d_p.copy() if bufs[i] is None else momentum * bufs[i] + d_p
                d_p = d_p + momentum * bufs[i] if nesterov else bufs[i]
            params[i] = p - lr * d_p
        history.append([p.copy() for p in params])
    return history


def _set_grads(params, grads):
    """Give each parameter exactly `grad` through a backward pass: d/dp sum(p * g) = g."""
    with netcl.Tape() as tape:
        loss = sum(((p * g).sum() for p, g in zip(params, grads)), start=0.0)
    tape.backward(loss)


@pytest.mark.parametrize("momentum, weight_decay, nesterov", [
    (0.0, 0.0, False), (0.9, 0.0, False), (0.0, 0.01, False), (0.5, 0.1, False),
    (0.9, 0.01, True), (0.8, 0.0, True),
])
def test_sgd_matches_pytorch_rule(backend, momentum, weight_decay, nesterov):
    rng = np.random.default_rng(15)
    shapes = [(5, 3), (3,), (2, 2, 2)]
    initial = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    params = [param(p, backend) for p in initial]
    opt = netcl.SGD(params, lr=0.1, momentum=momentum, weight_decay=weight_decay,
                    nesterov=nesterov)
    steps = 5
    grads_per_step = [[rng.standard_normal(s).astype(np.float32) for s in shapes]
                      for _ in range(steps)]
    lrs = [0.1, 0.1, 0.05, 0.05, 0.2]
    expected = _sgd_reference(initial, grads_per_step, lrs, momentum, weight_decay, nesterov)
    for step in range(steps):
        opt.lr = lrs[step]
        assert opt.lr == lrs[step]
        opt.zero_grad()
        _set_grads(params, grads_per_step[step])
        opt.step()
        for p, e in zip(params, expected[step]):
            np.testing.assert_allclose(host(p), e, rtol=1e-5, atol=1e-6,
                                       err_msg=f"after step {step + 1}")


@pytest.mark.parametrize("momentum, weight_decay, nesterov", [
    (0.0, 0.0, False), (0.9, 0.01, False), (0.9, 0.0, True)])
@pytest.mark.parametrize("param_dtype, grad_dtype", [
    (np.float16, np.float16), (np.float16, np.float32), (np.float32, np.float16)])
def test_sgd_steps_float16_parameters_and_gradients(backend, momentum, weight_decay, nesterov,
                                                     param_dtype, grad_dtype):
    """A float16 parameter (float16 storage) or gradient steps by the same rule, the
    parameter staying in its storage (on OpenCL through float32 copies: sgd_step reads and
    writes float32); within float16's rounding of each step."""
    rng = np.random.default_rng(18)
    initial = rng.standard_normal(300).astype(np.float16).astype(np.float32)
    p = param(initial, backend, dtype=param_dtype)
    opt = netcl.SGD([p], lr=0.1, momentum=momentum, weight_decay=weight_decay,
                    nesterov=nesterov)
    grads = [rng.standard_normal(300).astype(np.float16).astype(np.float32) for _ in range(3)]
    expected = _sgd_reference([initial], [[g] for g in grads], [0.1] * 3, momentum,
                              weight_decay, nesterov)
    for g, want in zip(grads, expected):
        p.grad = netcl.Tensor.from_host(g, queue=backend.queue, dtype=grad_dtype)
        opt.step()
        assert p.dtype == param_dtype
        np.testing.assert_allclose(host(p).astype(np.float64), want[0], rtol=4e-3, atol=4e-3)


def test_sgd_zero_grad_and_untouched_parameters(backend):
    rng = np.random.default_rng(16)
    used_host = rng.standard_normal((4, 3)).astype(np.float32)
    unused_host = rng.standard_normal((4, 3)).astype(np.float32)
    used, unused = param(used_host, backend), param(unused_host, backend)
    opt = netcl.SGD([used, unused], lr=0.1, momentum=0.9, weight_decay=0.1)
    for _ in range(3):
        opt.zero_grad()
        assert used.grad is None and unused.grad is None
        _set_grads([used], [np.ones((4, 3), np.float32)])
        assert used.grad is not None and unused.grad is None
        opt.step()
    np.testing.assert_array_equal(host(unused), unused_host)
    assert not np.allclose(host(used), used_host)
    opt.zero_grad()
    assert used.grad is None


def test_sgd_state_dict_round_trip(backend):
    rng = np.random.default_rng(17)
    initial = rng.standard_normal((6, 2)).astype(np.float32)
    grads = [rng.standard_normal((6, 2)).astype(np.float32) for _ in range(4)]
    a = param(initial, backend)
    opt_a = netcl.SGD([a], lr=0.1, momentum=0.9)
    for g in grads[:2]:
        opt_a.zero_grad()
        _set_grads([a], [g])
        opt_a.step()
    state = opt_a.state_dict()
    assert isinstance(state, dict)
    b = param(host(a), backend)
    opt_b = netcl.SGD([b], lr=0.1, momentum=0.9)
    opt_b.load_state_dict(state)
    for g in grads[2:]:
        for p, opt in [(a, opt_a), (b, opt_b)]:
            opt.zero_grad()
            _set_grads([p], [g])
            opt.step()
    np.testing.assert_allclose(host(b), host(a), rtol=1e-6, atol=1e-7)


# --- optimizers: SGD, Adam, AdamW, clip_grad_norm, WarmupCosine against NumPy float64
# transcriptions of PyTorch's formulas:
# - torch/optim/sgd.py, _single_tensor_sgd (dampening 0);
# - torch/optim/adam.py, _single_tensor_adam, and torch/optim/adamw.py (decoupled weight
#   decay: param.mul_(1 - lr * weight_decay));
# - torch/nn/utils/clip_grad.py, clip_grad_norm_ (_get_total_norm, _clip_grads_with_norm_).

def _normal(rng, *shapes):
    """float32 standard-normal arrays of the given shapes."""
    return [rng.standard_normal(shape).astype(np.float32) for shape in shapes]


def _make(kind, params, lr, hyper):
    if kind == "sgd":
        return netcl.SGD(params, lr=lr, **hyper)
    return (netcl.Adam if kind == "adam" else netcl.AdamW)(params, lr=lr, **hyper)


# --- references: PyTorch's formulas in NumPy float64

def _total_norm_reference(grads, norm_type=2.0):
    """clip_grad.py's _get_total_norm: the norm of the per-tensor norms."""
    norms = [np.linalg.norm(g.astype(np.float64).ravel(), norm_type) for g in grads]
    return float(np.linalg.norm(np.array(norms), norm_type))


def _adam_reference(initial, grads_per_step, lrs, betas=(0.9, 0.999), eps=1e-8,
                    weight_decay=0.0, decoupled=False, max_norm=None):
    """torch/optim/adam.py, _single_tensor_adam (AdamW: decoupled_weight_decay=True), after
    clip_grad_norm_(params, max_norm) when max_norm is given; a non-finite norm skips the step
    and does not count it (netcl's fused step). One step count for all parameters."""
    beta1, beta2 = betas
    params = [p.astype(np.float64) for p in initial]
    exp_avg = [np.zeros_like(p) for p in params]
    exp_avg_sq = [np.zeros_like(p) for p in params]
    step = 0
    history = []
    for grads, lr in zip(grads_per_step, lrs):
        grads = [g.astype(np.float64) for g in grads]
        skip = False
        if max_norm is not None:
            total_norm = _total_norm_reference(grads)
            skip = not math.isfinite(total_norm)
            clip_coef = min(max_norm / (total_norm + 1e-6), 1.0)
            grads = [g * clip_coef for g in grads]
        if not skip:
            step += 1
            for i, grad in enumerate(grads):
                if weight_decay and decoupled:
                    params[i] = params[i] * (1 - lr * weight_decay)
                elif weight_decay:
                    grad = grad + weight_decay * params[i]
                exp_avg[i] = exp_avg[i] + (1 - beta1) * (grad - exp_avg[i])  # lerp_
                exp_avg_sq[i] = beta2 * exp_avg_sq[i] + (1 - beta2) * grad * grad
                bias_correction1 = 1 - beta1 ** step
                bias_correction2_sqrt = math.sqrt(1 - beta2 ** step)
                step_size = lr / bias_correction1
                denom = np.sqrt(exp_avg_sq[i]) / bias_correction2_sqrt + eps
                params[i] = params[i] - step_size * exp_avg[i] / denom
        history.append([p.copy() for p in params])
    return history


# --- trajectories against the references

SHAPES = st.lists(st.sampled_from([(3,), (4, 5), (2, 3, 2), (1,), (33,)]), min_size=1, max_size=4)


HYPER = {
    "sgd": st.fixed_dictionaries({"momentum": st.sampled_from([0.0, 0.5, 0.9]),
                                   "weight_decay": st.sampled_from([0.0, 0.01, 0.1]),
                                   "nesterov": st.booleans()}),
    "adam": st.fixed_dictionaries({"betas": st.sampled_from([(0.9, 0.999), (0.5, 0.9),
                                                             (0.0, 0.99)]),
                                   "eps": st.sampled_from([1e-8, 1e-6, 1e-3]),
                                   "weight_decay": st.sampled_from([0.0, 0.01, 0.1])}),
}


HYPER["adamw"] = HYPER["adam"]


def _float32_arrays(shapes, scale=1.0):
    """float32 arrays of `shapes` whose values Hypothesis draws (so that a failure shrinks to
    the smallest values that show it), each array at its own magnitude, 1e-2 to 1e2 times
    `scale`."""
    def one(shape):
        values = hnp.arrays(np.float32, shape, elements=st.floats(-3, 3, width=32))
        return st.builds(lambda a, m: (a * np.float32(m * scale)).astype(np.float32), values,
                         st.sampled_from([1e-2, 1e-1, 1.0, 1e1, 1e2]))
    return st.tuples(*map(one, shapes)).map(list)


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
@TRAINING_SETTINGS
@given(data=st.data(), shapes=SHAPES, seed=st.integers(0, 2**31 - 1))
def test_trajectory_matches_pytorch_rule(backend, kind, data, shapes, seed):
    hyper = data.draw(HYPER[kind], label="hyper")
    if kind == "sgd" and hyper["nesterov"] and not hyper["momentum"]:
        hyper["nesterov"] = False
    max_norm = None if kind == "sgd" else data.draw(st.sampled_from([None, 0.5, 10.0]), "max_norm")
    rng = np.random.default_rng(seed)
    steps = 21
    initial = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads_per_step = [[(rng.standard_normal(s) * 10.0 ** rng.uniform(-2, 1)).astype(np.float32)
                       for s in shapes] for _ in range(steps)]
    lrs = list(rng.uniform(1e-3, 5e-2, steps))
    if kind == "sgd":
        expected = _sgd_reference(initial, grads_per_step, lrs, **hyper)
    else:
        expected = _adam_reference(initial, grads_per_step, lrs, decoupled=kind == "adamw",
                                   max_norm=max_norm, **hyper)
    params = [param(p, backend) for p in initial]
    opt = _make(kind, params, lrs[0], hyper)
    for step in range(steps):
        opt.lr = lrs[step]
        opt.zero_grad()
        _set_grads(params, grads_per_step[step])
        opt.step() if max_norm is None else opt.step(max_norm=max_norm)
        for p, e in zip(params, expected[step]):
            # float32 against float64: 150 examples per case never differed by 1e-6
            np.testing.assert_allclose(host(p), e, rtol=5e-6, atol=5e-6,
                                       err_msg=f"{kind} {hyper} after step {step + 1}")


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_parameter_without_grad_is_untouched(backend, kind):
    """A parameter whose .grad is None keeps its value and moments; the others follow the
    reference, clipped by the norm of the gradients that exist."""
    rng = np.random.default_rng(1)
    initial = _normal(rng, (5, 4), 7)
    grads = [[rng.standard_normal((5, 4)).astype(np.float32)] for _ in range(6)]
    used, unused = param(initial[0], backend), param(initial[1], backend)
    opt = _make(kind, [used, unused], 0.01, {"weight_decay": 0.1})
    expected = _adam_reference(initial[:1], grads, [0.01] * 6, weight_decay=0.1,
                               decoupled=kind == "adamw", max_norm=1.0)
    for step, g in enumerate(grads):
        opt.zero_grad()
        _set_grads([used], g)
        assert unused.grad is None
        opt.step(max_norm=1.0)
        np.testing.assert_allclose(host(used), expected[step][0], rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(host(unused), initial[1])
    state = opt.state_dict()["state"][1]
    assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()


def test_gradients_assigned_by_hand_are_used(backend):
    """.grad set directly (not by backward, so outside the flat buffer) still steps right."""
    rng = np.random.default_rng(2)
    initial = _normal(rng, (3, 3), 4)
    grads = [[rng.standard_normal(p.shape).astype(np.float32) for p in initial] for _ in range(3)]
    params = [param(p, backend) for p in initial]
    opt = netcl.AdamW(params, lr=0.05)
    expected = _adam_reference(initial, grads, [0.05] * 3, weight_decay=0.01, decoupled=True,
                               max_norm=0.7)
    for step, gs in enumerate(grads):
        for p, g in zip(params, gs):
            p.grad = netcl.Tensor.from_host(g, queue=backend.queue)
        opt.step(max_norm=0.7)
        for p, e in zip(params, expected[step]):
            np.testing.assert_allclose(host(p), e, rtol=2e-5, atol=2e-5)
            assert p.grad is not None


# --- fused clipping, clip_grad_norm, non-finite gradients

@pytest.mark.parametrize("kind", ["adam", "adamw"])
@TRAINING_SETTINGS
@given(data=st.data(), shapes=SHAPES, max_norm=st.sampled_from([0.1, 1.0, 100.0]))
def test_fused_clip_step_equals_clip_then_step(backend, kind, data, shapes, max_norm):
    initial = data.draw(_float32_arrays(shapes), label="initial")
    grads_per_step = [data.draw(_float32_arrays(shapes), label=f"grads of step {step + 1}")
                      for step in range(4)]
    fused = [param(p, backend) for p in initial]
    unfused = [param(p, backend) for p in initial]
    opt_fused = _make(kind, fused, 0.01, {"weight_decay": 0.05})
    opt_unfused = _make(kind, unfused, 0.01, {"weight_decay": 0.05})
    for grads in grads_per_step:
        for params, opt in [(fused, opt_fused), (unfused, opt_unfused)]:
            opt.zero_grad()
            _set_grads(params, grads)
        netcl.clip_grad_norm(unfused, max_norm)
        opt_unfused.step()
        opt_fused.step(max_norm=max_norm)
        for p, g in zip(fused, grads):  # the fused step writes no clipped gradients
            np.testing.assert_array_equal(host(p.grad), g)
        for a, b in zip(fused, unfused):
            np.testing.assert_allclose(host(a), host(b), rtol=1e-5, atol=1e-6)
    # The moments are sums of clipped gradients, whose components are at most max_norm: the
    # two orders of rounding may differ by a few float32 ulps of the largest term, which a
    # moment that cancels to near zero shows in full.
    term = min(max_norm, max((float(np.abs(g).max()) for gs in grads_per_step for g in gs
                              if g.size), default=0.0))
    ulps = 4 * float(np.finfo(np.float32).eps)
    for a, b in zip(opt_fused.state_dict()["state"].values(),
                    opt_unfused.state_dict()["state"].values()):
        assert a["step"] == b["step"] == 4
        np.testing.assert_allclose(a["exp_avg"], b["exp_avg"], rtol=1e-5,
                                   atol=1e-7 + ulps * term)
        np.testing.assert_allclose(a["exp_avg_sq"], b["exp_avg_sq"], rtol=1e-5,
                                   atol=1e-9 + ulps * term ** 2)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_gpu_norm_of_a_large_gradient_takes_more_work_groups(opencl, monkeypatch, norm_type):
    """On a GPU (132 compute units, the H200) a gradient of 2^21 elements has its norm's
    partials from 512 work-groups, not 256 (8 per compute unit), and the norm is right."""
    monkeypatch.setattr(opencl, "gemm", "tiled")
    monkeypatch.setattr(opencl, "compute_units", 132)
    g = np.random.default_rng(4).standard_normal(1 << 21).astype(np.float32)
    p = param(np.zeros(g.shape), opencl)
    p.grad = netcl.Tensor.from_host(g, queue=opencl.queue)
    groups = []
    real_launch = opencl.launch
    monkeypatch.setattr(opencl, "launch", lambda name, grid, *args, **kwargs: (
        groups.append(grid[0] // 256) if name in ("norm_partials", "amp_unscale") else None,
        real_launch(name, grid, *args, **kwargs)))
    total = netcl.clip_grad_norm([p], 1e9, norm_type=norm_type)
    expected = _total_norm_reference([g], norm_type)
    assert math.isclose(float(total), expected, rel_tol=1e-5)
    assert groups == [512]


@TRAINING_SETTINGS
@given(grads=SHAPES.flatmap(_float32_arrays),
       norm_type=st.sampled_from([2.0, 1.0, 3.0, math.inf, "inf"]),
       max_norm=st.sampled_from([0.01, 1.0, 1e4]), without_grad=st.booleans())
def test_clip_grad_norm_matches_float64_reference(backend, grads, norm_type, max_norm,
                                                  without_grad):
    shapes = [g.shape for g in grads]
    params = [param(np.zeros(s), backend) for s in shapes]
    for p, g in zip(params, grads):
        p.grad = netcl.Tensor.from_host(g, queue=backend.queue)
    if without_grad:
        params.append(param(np.zeros(3), backend))
    expected_norm = _total_norm_reference(grads, float(norm_type))
    syncs = backend.syncs
    total_norm = netcl.clip_grad_norm(params, max_norm, norm_type=norm_type)
    assert backend.syncs == syncs, "clip_grad_norm waited for the device"
    assert isinstance(total_norm, netcl.Tensor) and total_norm.shape == ()
    assert math.isclose(float(total_norm), expected_norm, rel_tol=1e-5)
    clip_coef = min(max_norm / (expected_norm + 1e-6), 1.0)
    for p, g in zip(params, grads):
        np.testing.assert_allclose(host(p.grad), g * clip_coef, rtol=1e-5, atol=1e-30)
    if without_grad:
        assert params[-1].grad is None


@pytest.mark.parametrize("sizes", [(8,), (300,), (1000, 7)])
def test_clip_grad_norm_of_float16_gradients(backend, sizes):
    """float16 gradients (a float16 leaf's gradient is float16 storage on OpenCL), alone or
    beside a float32 one: the norm of their values, and each scaled in its own storage (on
    OpenCL through float32 copies: the kernels read and scale float32)."""
    rng = np.random.default_rng(19)
    grads = [rng.standard_normal(n).astype(np.float16).astype(np.float32) for n in sizes]
    params = [param(np.zeros(g.shape), backend) for g in grads]
    for i, (p, g) in enumerate(zip(params, grads)):  # the last float32 where there are two
        dtype = np.float32 if i and i == len(grads) - 1 else np.float16
        p.grad = netcl.Tensor.from_host(g, queue=backend.queue, dtype=dtype)
    expected_norm = _total_norm_reference(grads, 2.0)
    total = netcl.clip_grad_norm(params, 1.0)
    assert math.isclose(float(total), expected_norm, rel_tol=1e-5)
    for p, g in zip(params, grads):
        assert p.grad.dtype in (np.float16, np.float32) and p.grad.shape == g.shape
        np.testing.assert_allclose(host(p.grad).astype(np.float64), g / expected_norm,
                                   rtol=1e-3, atol=1e-7)


def test_integer_parameters_and_gradients_are_type_errors(backend):
    """Only float tensors require gradients (PyTorch's rule and words), and a gradient set by
    hand to an int32 tensor is a TypeError naming the parameter where the kernels would read
    it as floats: SGD's step, clip_grad_norm, the scaler's unscale_ and a backward adding
    into it. Nothing is changed before the error."""
    with raises_naming(TypeError, "floating point", "int32"):
        param(np.ones(3, np.int32), backend, dtype=np.int32)
    with raises_naming(TypeError, "floating point"):
        netcl.Node(tensor(np.ones(3, np.int32), backend, dtype=np.int32), requires_grad=True)
    p, q = param(np.ones(4), backend), param(np.ones(4), backend)
    q.grad = tensor(np.ones(4, np.float32), backend)
    p.grad = tensor(np.array([1, 2, -1, -3], np.int32), backend, dtype=np.int32)
    scaler = netcl.AMPGradScaler(init_scale=4.0)
    scaler.scale(netcl.Node(tensor(np.ones(()), backend)))  # (the scale lives on the device)
    for call, name in ((lambda: netcl.SGD([q, p], lr=0.1).step(), "SGD.step"),
                       (lambda: netcl.clip_grad_norm([q, p], 1.0), "clip_grad_norm"),
                       (lambda: scaler.unscale_(netcl.SGD([q, p], lr=0.1)), "unscale_")):
        with raises_naming(TypeError, name, "parameter 1", "int32"):
            call()
        np.testing.assert_array_equal(host(p), np.ones(4))
        np.testing.assert_array_equal(host(q.grad), np.ones(4))
        np.testing.assert_array_equal(host(p.grad), [1, 2, -1, -3])
    with netcl.Tape() as tape:
        loss = (p * 2.0).sum()
    with raises_naming(TypeError, "backward", "int32"):
        tape.backward(loss)
    np.testing.assert_array_equal(host(p.grad), [1, 2, -1, -3])


def test_a_gradient_set_by_hand_must_fit_its_parameter(cpu, opencl):
    """A .grad set by hand of another shape (a kernel would write past the smaller buffer:
    a segfault on OpenCL), not a Tensor, or on another device is an error naming the
    parameter in a backward adding into it, SGD's step and clip_grad_norm; nothing changes."""
    for backend, other in ((cpu, opencl), (opencl, cpu)):
        p = param(np.ones((64, 64)), backend)
        for bad, error, words in ((tensor(np.zeros(2), backend), ValueError, "(64, 64) (2,)"),
                                  (tensor(np.zeros((2, 2048)), backend), ValueError, "(2, 2048)"),
                                  (np.zeros((64, 64), np.float32), TypeError, "ndarray"),
                                  (tensor(np.zeros((64, 64)), other), ValueError, "devices")):
            p.grad = bad
            with netcl.Tape() as tape:
                loss = (p * 1.0).sum()
            with raises_naming(error, "backward", *words.split()):
                tape.backward(loss)
            for call, name in ((lambda: netcl.SGD([p], lr=0.1).step(), "SGD.step"),
                               (lambda: netcl.clip_grad_norm([p], 1.0), "clip_grad_norm")):
                with raises_naming(error, name, "parameter 0", *words.split()):
                    call()
            assert p.grad is bad
            np.testing.assert_array_equal(host(p), np.ones((64, 64)))


def test_backwards_in_threads_add_every_gradient_into_a_shared_leaf(backend):
    """Several threads' backwards into one leaf whose .grad is None: the first stores, the
    others add (the test of None and the store are one step for the other threads)."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        for _ in range(20):
            w = param(np.ones(3), backend)
            barrier = threading.Barrier(4)

            def train():
                with netcl.Tape() as tape:
                    loss = (w * 1.0).sum()
                barrier.wait()
                tape.backward(loss)
            threads = [threading.Thread(target=train) for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            np.testing.assert_array_equal(host(w.grad), [4.0, 4.0, 4.0])
    finally:
        sys.setswitchinterval(switch)


def test_clip_grad_norm_alias_single_parameter_and_no_grads(backend):
    assert netcl.clip_grad_norm_ is netcl.clip_grad_norm
    p = param([3.0, 4.0], backend)
    assert float(netcl.clip_grad_norm_(p, 1.0)) == 0.0  # no gradient: the norm is 0
    p.grad = netcl.Tensor.from_host(np.array([3.0, 4.0], np.float32), queue=backend.queue)
    assert float(netcl.clip_grad_norm_(p, 1.0)) == pytest.approx(5.0)
    np.testing.assert_allclose(host(p.grad), [0.6, 0.8], rtol=1e-5)
    with raises_naming(ValueError, "norm_type"):
        netcl.clip_grad_norm([p], 1.0, norm_type=0)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_clip_grad_norm_non_finite(backend, bad, norm_type):
    g = np.array([1.0, bad, -2.0], np.float32)
    p = param(np.zeros(3), backend)
    p.grad = netcl.Tensor.from_host(g, queue=backend.queue)
    with raises_naming(RuntimeError, "non-finite", "error_if_nonfinite=False"):
        netcl.clip_grad_norm([p], 1.0, norm_type, error_if_nonfinite=True)
    np.testing.assert_array_equal(host(p.grad), g)  # raised before scaling, as PyTorch
    total_norm = float(netcl.clip_grad_norm([p], 1.0, norm_type))
    assert math.isnan(total_norm) if np.isnan(bad) else total_norm == math.inf
    with np.errstate(all="ignore"):  # PyTorch multiplies by the NaN (or 0) coefficient anyway
        expected = g * np.float32(min(1.0 / (np.float32(total_norm) + np.float32(1e-6)), 1.0))
    np.testing.assert_array_equal(host(p.grad), expected)
    assert not np.isfinite(host(p.grad)).all()


@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gradient_skips_the_fused_step(backend, kind, bad):
    rng = np.random.default_rng(3)
    initial = _normal(rng, (4, 3), 5)
    good = [[rng.standard_normal(p.shape).astype(np.float32) for p in initial] for _ in range(3)]
    poisoned = [g.copy() for g in good[2]]
    poisoned[1][2] = bad
    a = [param(p, backend) for p in initial]
    b = [param(p, backend) for p in initial]
    opt_a, opt_b = _make(kind, a, 0.01, {}), _make(kind, b, 0.01, {})
    for grads in good[:2]:
        for params, opt in [(a, opt_a), (b, opt_b)]:
            opt.zero_grad()
            _set_grads(params, grads)
            opt.step(max_norm=1.0)
    before = [host(p) for p in a], opt_a.state_dict()
    opt_a.zero_grad()
    _set_grads(a, poisoned)
    launches, syncs = backend.launches, backend.syncs
    opt_a.step(max_norm=1.0)
    assert backend.syncs == syncs
    after = [host(p) for p in a], opt_a.state_dict()
    for x, y in zip(before[0], after[0]):
        np.testing.assert_array_equal(x, y)
    assert after[1]["state"][0]["step"] == before[1]["state"][0]["step"] == 2
    for i in range(len(a)):
        for key in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(after[1]["state"][i][key], before[1]["state"][i][key])
    # The skipped step did not count: the next good step is the third, as for `b`.
    for params, opt in [(a, opt_a), (b, opt_b)]:
        opt.zero_grad()
        _set_grads(params, good[2])
        opt.step(max_norm=1.0)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(host(x), host(y))


# --- launches, syncs, flat buffers

def _launches_per_step(dev, layers, max_norm):
    model = _mlp(dev, (8,) * (layers + 1), seed=4)
    opt = netcl.AdamW(model.parameters(), lr=1e-3)
    x = netcl.Tensor.from_host(np.ones((2, 8), np.float32), queue=dev.queue)
    counts = []
    for _ in range(3):
        with netcl.Tape() as tape:
            loss = model(x).sum()
        opt.zero_grad()
        tape.backward(loss)
        launches, syncs = dev.launches, dev.syncs
        opt.step(max_norm=max_norm)
        counts.append((dev.launches - launches, dev.syncs - syncs))
    return len(model.parameters()), counts


@pytest.mark.parametrize("max_norm", [1.0, None])
def test_step_launches_do_not_grow_with_parameter_count(backend, max_norm):
    small_count, small = _launches_per_step(backend, 1, max_norm)
    large_count, large = _launches_per_step(backend, 10, max_norm)
    assert (small_count, large_count) == (2, 20)
    assert small == large
    expected = 0 if backend.backend == "cpu" else (3 if max_norm else 2)
    assert small == [(expected, 0)] * 3  # launches per step, and no host sync


def test_backward_accumulates_into_the_flat_buffer(backend):
    """Two backward passes without zero_grad add up, in place, and the step stays fused."""
    rng = np.random.default_rng(7)
    initial = _normal(rng, (3, 4), 4)
    grads = [rng.standard_normal(p.shape).astype(np.float32) for p in initial]
    params = [param(p, backend) for p in initial]
    opt = netcl.AdamW(params, lr=0.01)
    _set_grads(params, grads)
    first = [p.grad for p in params]
    _set_grads(params, grads)
    assert [p.grad for p in params] == first  # the same tensors, accumulated in place
    for p, g in zip(params, grads):
        np.testing.assert_allclose(host(p.grad), 2 * g, rtol=1e-6)
    launches = backend.launches
    opt.step(max_norm=1.0)
    assert backend.launches - launches == (0 if backend.backend == "cpu" else 3)
    expected = _adam_reference(initial, [[2 * g for g in grads]], [0.01], weight_decay=0.01,
                               decoupled=True, max_norm=1.0)
    for p, e in zip(params, expected[0]):
        np.testing.assert_allclose(host(p), e, rtol=5e-6, atol=5e-6)


def test_model_keeps_working_through_the_flat_buffers(backend):
    model = _mlp(backend, (8, 8, 8), seed=5)
    x = netcl.Tensor.from_host(_normal(np.random.default_rng(5), (3, 8))[0], queue=backend.queue)
    before = host(model(x))
    weights = model.state_dict()
    opt = netcl.Adam(model.parameters(), lr=0.1)
    np.testing.assert_array_equal(host(model(x)), before)
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, weights[name])
    with netcl.Tape() as tape:
        loss = model(x).sum()
    tape.backward(loss)
    opt.step()
    assert not np.allclose(host(model(x)), before)
    model.load_state_dict(weights)  # copies into the flat buffer: the optimizer sees it
    np.testing.assert_array_equal(host(model(x)), before)
    opt.step()
    assert not np.allclose(host(model(x)), before)


# --- state, validation, API

@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_state_dict_round_trip_continues_the_trajectory(backend, kind):
    rng = np.random.default_rng(6)
    initial = _normal(rng, (6, 2), 3)
    grads = [[rng.standard_normal(p.shape).astype(np.float32) for p in initial] for _ in range(6)]
    hyper = {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05}
    a = [param(p, backend) for p in initial]
    opt_a = _make(kind, a, 0.02, hyper)
    for g in grads[:3]:
        opt_a.zero_grad()
        _set_grads(a, g)
        opt_a.step(max_norm=1.0)
    state = opt_a.state_dict()
    assert state["state"][0]["step"] == 3 and set(state["state"]) == {0, 1}
    assert state["param_groups"][0]["betas"] == (0.8, 0.99)
    b = [param(host(p), backend) for p in a]
    opt_b = _make(kind, b, 1.0, {})
    opt_b.load_state_dict(state)
    assert (opt_b.lr, opt_b.betas, opt_b.eps, opt_b.weight_decay) == (0.02, (0.8, 0.99), 1e-6, 0.05)
    for g in grads[3:]:
        for params, opt in [(a, opt_a), (b, opt_b)]:
            opt.zero_grad()
            _set_grads(params, g)
            opt.step(max_norm=1.0)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(host(x), host(y))
    bad = opt_a.state_dict()
    bad["state"][1]["exp_avg"] = np.zeros(4, np.float32)
    with raises_naming(ValueError, "exp_avg", "(4,)"):
        opt_b.load_state_dict(bad)


@pytest.mark.parametrize("make, message", [
    (lambda ps: netcl.Adam(ps, lr=-1), "Invalid learning rate: -1"),
    (lambda ps: netcl.AdamW(ps, eps=-1e-8), "Invalid epsilon value: -1e-08"),
    (lambda ps: netcl.Adam(ps, betas=(1.0, 0.999)), "Invalid beta parameter at index 0: 1.0"),
    (lambda ps: netcl.AdamW(ps, betas=(0.9, -0.5)), "Invalid beta parameter at index 1: -0.5"),
    (lambda ps: netcl.Adam(ps, weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
    (lambda ps: netcl.SGD(ps, lr=-1), "Invalid learning rate: -1"),
    (lambda ps: netcl.SGD(ps, lr=0.1, momentum=-1), "Invalid momentum value: -1"),
    (lambda ps: netcl.Adam([]), "empty parameter list"),
    (lambda ps: netcl.AdamW([]), "empty parameter list"),
    (lambda ps: netcl.AdamW(ps + ps), "parameter 1 appears more than once"),
])
def test_invalid_hyperparameters_raise_pytorch_messages(make, message):
    params = [param(np.zeros(2), netcl.manager.default("cpu"))]
    with raises_naming(ValueError, message):
        make(params)


def test_defaults_signatures_and_aliases():
    from netcl.optim import SGD, Adam, AdamW, WarmupCosine, clip_grad_norm, clip_grad_norm_
    assert (SGD, Adam, AdamW) == (netcl.SGD, netcl.Adam, netcl.AdamW)
    assert WarmupCosine is netcl.WarmupCosine
    assert clip_grad_norm is clip_grad_norm_ is netcl.clip_grad_norm is netcl.clip_grad_norm_
    assert "max_norm" not in inspect.signature(SGD.step).parameters
    for cls in (Adam, AdamW):
        assert inspect.signature(cls.step).parameters["max_norm"].default is None
    params = [param(np.zeros(2), netcl.manager.default("cpu"))]
    adam, adamw = Adam(params), AdamW(params)
    assert (adam.lr, adam.betas, adam.eps, adam.weight_decay) == (1e-3, (0.9, 0.999), 1e-8, 0.0)
    assert (adamw.lr, adamw.betas, adamw.eps) == (1e-3, (0.9, 0.999), 1e-8)
    assert adamw.weight_decay == 0.01


# --- WarmupCosine

def _warmup_cosine_reference(s, base_lr, warmup, total, min_lr):
    """Linear warm-up from 0 to base_lr over `warmup` steps, cosine to min_lr at `total`."""
    if s >= total:
        return min_lr
    if s < warmup:
        return base_lr * s / warmup
    progress = (s - warmup) / (total - warmup)
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("warmup, total, min_lr", [(0, 10, 0.0), (3, 10, 0.0), (4, 12, 0.01),
                                                   (5, 5, 0.0), (0, 1, 0.001)])
def test_warmup_cosine_matches_its_formula(warmup, total, min_lr):
    opt = netcl.AdamW([param(np.zeros(2), netcl.manager.default("cpu"))], lr=0.1)
    schedule = netcl.WarmupCosine(opt, warmup, total, min_lr=min_lr)
    lrs = [opt.lr]
    for _ in range(total + 3):
        schedule.step()
        lrs.append(opt.lr)
    expected = [_warmup_cosine_reference(s, 0.1, warmup, total, min_lr) for s in range(total + 4)]
    np.testing.assert_allclose(lrs, expected, rtol=1e-12, atol=1e-15)
    if warmup:
        assert lrs[0] == 0.0 and lrs[warmup] == pytest.approx(0.1 if warmup < total else min_lr)
    assert lrs[-1] == min_lr
    # state round trip: a fresh schedule continues where the first stopped
    state = schedule.state_dict()
    other = netcl.WarmupCosine(netcl.SGD(opt.params, lr=0.5), warmup, total)
    other.load_state_dict(state)
    assert other.optimizer.lr == opt.lr and other.last_step == schedule.last_step


# Argument validation: one row per bad argument, (call, exception, what the message names).
# `call(x)` gets a Parameter x (2, 3) of ones with a gradient of twos, on each backend; a
# rejected call changes nothing (a negative max_norm would have reversed the update).
ARGUMENT_ERRORS = {
    "Adam betas": (lambda x: netcl.Adam([x], betas=(0.9,)), ValueError, ["betas"]),
    "SGD lr": (lambda x: netcl.SGD([x], lr=-1.0), ValueError, ["Invalid learning rate", "lr"]),
    "WarmupCosine warmup_steps -1": (lambda x: netcl.WarmupCosine(netcl.SGD([x], lr=0.1), -1, 10),
                                     ValueError, ["warmup_steps"]),
    "WarmupCosine total_steps 0": (lambda x: netcl.WarmupCosine(netcl.SGD([x], lr=0.1), 0, 0),
                                   ValueError, ["total_steps"]),
    "WarmupCosine warmup_steps > total": (
        lambda x: netcl.WarmupCosine(netcl.SGD([x], lr=0.1), 11, 10), ValueError, ["warmup_steps"]),
    "WarmupCosine warmup_steps 1.5": (
        lambda x: netcl.WarmupCosine(netcl.SGD([x], lr=0.1), 1.5, 10), ValueError, ["warmup_steps"]),
    "WarmupCosine min_lr": (lambda x: netcl.WarmupCosine(netcl.SGD([x], lr=0.1), 1, 10, min_lr=-1),
                            ValueError, ["min_lr", "-1"]),
    "AdamW.step max_norm -1.0": (lambda x: netcl.AdamW([x], lr=0.1).step(max_norm=-1.0),
                                 ValueError, ["max_norm", "-1.0"]),
    "AdamW.step max_norm '1'": (lambda x: netcl.AdamW([x], lr=0.1).step(max_norm="1"),
                                ValueError, ["max_norm", "1"]),
    "clip_grad_norm -1.0": (lambda x: netcl.clip_grad_norm([x], -1.0), ValueError, ["max_norm"]),
    "clip_grad_norm '1'": (lambda x: netcl.clip_grad_norm([x], "1"), ValueError, ["max_norm"]),
    "reshape 2.5": (lambda x: F.reshape(x, (2.5, 2)), ValueError, ["reshape", "2.5"]),
    "softmax axis": (lambda x: F.softmax(x, axis=(0, 1)), ValueError, ["softmax", "axis"]),
    "leaky_relu negative_slope": (lambda x: F.leaky_relu(x, "0.1"), ValueError,
                                  ["negative_slope"]),
    "AMPGradScaler init_scale": (lambda x: netcl.AMPGradScaler(init_scale="big"), ValueError,
                                 ["init_scale"]),
}


@pytest.mark.parametrize("name", sorted(ARGUMENT_ERRORS))
def test_a_bad_argument_is_named_and_changes_nothing(backend, name):
    call, error, needles = ARGUMENT_ERRORS[name]
    x = param(np.ones((2, 3)), backend)
    with netcl.Tape() as tape:
        loss = (x * 2.0).sum()
    tape.backward(loss)
    with raises_naming(error, *needles):
        call(x)
    np.testing.assert_array_equal(host(x), np.ones((2, 3)))


def test_numpy_scalars_are_numbers_and_netcl_device_is_checked(cpu, monkeypatch):
    x = param(np.ones((2, 2)), cpu)
    assert host(F.dropout(x, np.float32(0.0), True)).sum() == 4.0
    assert nn.Dropout(np.float64(0.25)).p == 0.25
    monkeypatch.setenv("NETCL_DEVICE", "bogus")
    with raises_naming(ValueError, "NETCL_DEVICE", "bogus"):
        netcl.manager.default()


def _state_variant(state, change):
    """A copy of an optimizer's state_dict (its dicts copied) with `change` applied to it."""
    copy = {"state": {i: dict(entry) for i, entry in state["state"].items()},
            "param_groups": [dict(group) for group in state["param_groups"]]}
    change(copy)
    return copy


def _trained_optimizer(kind, backend):
    params = [param(np.arange(6.0).reshape(2, 3) / 7, backend), param([0.5, -0.25], backend)]
    opt = _make(kind, params, 0.1, {"momentum": 0.9} if kind == "sgd" else {})
    for grads in ([np.ones((2, 3)), np.array([1.0, -2.0])], [np.full((2, 3), 0.5), np.ones(2)]):
        opt.zero_grad()
        _set_grads(params, grads)
        opt.step()
    return opt


def _group(**changes):
    return lambda state: state["param_groups"][0].update(changes)


def _entry(index, **changes):
    return lambda state: state["state"][index].update(changes)


_SGD_REJECTED = [
    (_group(lr=-3), ValueError, "Invalid learning rate: -3"),
    (_group(lr="fast"), ValueError, "Invalid learning rate: fast"),
    (_group(momentum=-1), ValueError, "Invalid momentum value: -1"),
    (_group(momentum=0.0, nesterov=True), ValueError, "Nesterov momentum requires momentum > 0"),
    (_group(weight_decay=-0.5), ValueError, "Invalid weight_decay value: -0.5"),
    (_group(params=[0]), ValueError, "the state is for 1 parameters"),
    (_entry(1, momentum_buffer=np.zeros(3)), ValueError, "momentum_buffer 1 has shape (3,)"),
    (_entry(1, momentum_buffer=np.zeros(2, complex)), TypeError, "momentum_buffer 1"),
    (lambda state: state.update(state={5: {"momentum_buffer": np.zeros(2)}, **state["state"]}),
     ValueError, "state for parameter 5"),
    # another optimizer's state, or none: named, not a KeyError, IndexError or TypeError
    (lambda state: state["param_groups"][0].pop("nesterov"), ValueError, "'nesterov'"),
    (lambda state: state["state"][1].pop("momentum_buffer"), ValueError, "'momentum_buffer'"),
    (lambda state: state.pop("param_groups"), ValueError, "'param_groups'"),
    (lambda state: state.update(param_groups=[]), ValueError, "param_groups"),
    (lambda state: state.update(state=None), TypeError, "state"),
]


_ADAM_REJECTED = [
    (_group(lr=-3), ValueError, "Invalid learning rate: -3"),
    (_group(betas=(1.0, 0.999)), ValueError, "Invalid beta parameter at index 0: 1.0"),
    (_group(eps=-1e-8), ValueError, "Invalid epsilon value: -1e-08"),
    (_group(weight_decay=-0.5), ValueError, "Invalid weight_decay value: -0.5"),
    (_entry(1, exp_avg_sq=np.zeros(3)), ValueError, "exp_avg_sq of parameter 1 has shape (3,)"),
    (_entry(1, exp_avg=np.zeros(2, complex)), TypeError, "exp_avg of parameter 1"),
    (_entry(1, step=2**40), ValueError, "step of parameter 1"),
    (_entry(1, step=-1), ValueError, "step of parameter 1"),
    (_entry(0, step=1.5), ValueError, "step of parameter 0"),
    (lambda state: state["param_groups"][0].pop("betas"), ValueError, "'betas'"),
    (lambda state: state["state"][0].pop("exp_avg_sq"), ValueError, "'exp_avg_sq'"),
    (lambda state: state.clear(), ValueError, "'state'"),
]


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_optimizer_load_state_dict_of_no_dict_is_a_type_error(backend, kind):
    opt = _trained_optimizer(kind, backend)
    before = opt.state_dict()
    for bad in (None, [before]):
        with raises_naming(TypeError, "load_state_dict", "dict"):
            opt.load_state_dict(bad)
    np.testing.assert_equal(opt.state_dict(), before)


@pytest.mark.parametrize("kind, change, error, message",
                         [("sgd", *case) for case in _SGD_REJECTED]
                         + [(kind, *case) for kind in ("adam", "adamw") for case in _ADAM_REJECTED])
def test_optimizer_load_state_dict_rejects_a_bad_state_and_changes_nothing(backend, kind, change,
                                                                           error, message):
    opt = _trained_optimizer(kind, backend)
    before = opt.state_dict()
    with raises_naming(error, message):
        opt.load_state_dict(_state_variant(before, change))
    np.testing.assert_equal(opt.state_dict(), before)


def test_sgd_load_state_dict_keeps_buffers_float(backend):
    opt = _trained_optimizer("sgd", backend)
    state = _state_variant(opt.state_dict(), _entry(1, momentum_buffer=np.array([2, -1])))
    opt.load_state_dict(state)
    assert opt.momentum_buffers[1].dtype == np.float32
    np.testing.assert_array_equal(host(opt.momentum_buffers[1]), [2.0, -1.0])


def test_learning_rate_assignment_is_checked(backend):
    for kind in ("sgd", "adam", "adamw"):
        opt = _trained_optimizer(kind, backend)
        for bad in ("fast", -3, None, math.nan):
            with raises_naming(ValueError, "Invalid learning rate", str(bad), "lr"):
                opt.lr = bad
            assert opt.lr == 0.1
        opt.lr = np.float32(0.5)
        assert opt.lr == 0.5 and type(opt.lr) is float
        schedule = netcl.WarmupCosine(opt, warmup_steps=2, total_steps=4)
        for _ in range(4):
            opt.step()
            schedule.step()
        assert opt.lr == 0.0


def _step_lr_reference(lrs_before, step_size, gamma, epochs):
    """PyTorch's StepLR.get_lr, chained: at each non-zero multiple of step_size, lr * gamma."""
    lr, out = lrs_before, []
    for last_epoch in range(1, epochs + 1):
        if last_epoch % step_size == 0:
            lr = lr * gamma
        out.append(lr)
    return out


def _plateau_reference(metrics, lr, mode, factor, patience, threshold, threshold_mode, cooldown,
                       min_lr, eps):
    """PyTorch's ReduceLROnPlateau.step, transcribed: the lr after each step(metric)."""
    best = math.inf if mode == "min" else -math.inf
    bad = cooldown_counter = 0
    out = []
    for current in metrics:
        if mode == "min" and threshold_mode == "rel":
            better = current < best * (1.0 - threshold)
        elif mode == "min":
            better = current < best - threshold
        elif threshold_mode == "rel":
            better = current > best * (threshold + 1.0)
        else:
            better = current > best + threshold
        if better:
            best, bad = current, 0
        else:
            bad += 1
        if cooldown_counter > 0:
            cooldown_counter -= 1
            bad = 0
        if bad > patience:
            new_lr = max(lr * factor, min_lr)
            if lr - new_lr > eps:
                lr = new_lr
            cooldown_counter, bad = cooldown, 0
        out.append(lr)
    return out


@PROPERTY_SETTINGS
@given(step_size=st.integers(1, 5), gamma=st.floats(0.05, 1.0),
       metrics=st.lists(st.sampled_from([1.0, 0.9, 0.8999, 0.5, 0.7, 2.0, math.nan]),
                        min_size=1, max_size=30),
       mode=st.sampled_from(["min", "max"]), threshold_mode=st.sampled_from(["rel", "abs"]),
       patience=st.integers(0, 3), cooldown=st.integers(0, 2),
       threshold=st.sampled_from([0.0, 1e-4, 0.05]), min_lr=st.sampled_from([0.0, 0.004]))
def test_step_lr_and_reduce_lr_on_plateau_follow_pytorch(step_size, gamma, metrics, mode,
                                                         threshold_mode, patience, cooldown,
                                                         threshold, min_lr):
    cpu = netcl.manager.default("cpu")
    opt = netcl.SGD([param(np.zeros(2), cpu)], lr=0.1)
    schedule = netcl.StepLR(opt, step_size, gamma)
    lrs = []
    for _ in range(12):
        schedule.step()
        lrs.append(opt.lr)
    assert lrs == _step_lr_reference(0.1, step_size, gamma, 12)
    opt.lr = 0.1
    kwargs = dict(mode=mode, factor=0.5, patience=patience, threshold=threshold,
                  threshold_mode=threshold_mode, cooldown=cooldown, min_lr=min_lr, eps=1e-8)
    plateau = netcl.optim.lr_scheduler.ReduceLROnPlateau(opt, **kwargs)
    lrs = []
    for i, metric in enumerate(metrics):
        plateau.step(metric)
        lrs.append(opt.lr)
        if i == len(metrics) // 2:  # a fresh schedule from the state continues the same
            opt.lr, state = opt.lr, plateau.state_dict()
            plateau = netcl.ReduceLROnPlateau(opt)
            plateau.load_state_dict(state)
    assert lrs == _plateau_reference(metrics, 0.1, **kwargs)
    moved = netcl.StepLR(netcl.SGD(opt.params, lr=0.3), step_size, gamma)
    moved.load_state_dict(schedule.state_dict())
    assert moved.optimizer.lr == schedule.optimizer.lr and moved.last_epoch == 12


@pytest.mark.parametrize("make, needle", [
    (lambda opt: netcl.StepLR(opt, 0), "step_size"), (lambda opt: netcl.StepLR(opt, 2.0), "step_size"),
    (lambda opt: netcl.StepLR(opt, 2, gamma=-1), "gamma"),
    (lambda opt: netcl.ReduceLROnPlateau(opt, mode="up"), "mode"),
    (lambda opt: netcl.ReduceLROnPlateau(opt, factor=1.0), "factor"),
    (lambda opt: netcl.ReduceLROnPlateau(opt, threshold_mode="x"), "threshold_mode"),
    (lambda opt: netcl.ReduceLROnPlateau(opt, patience=-1), "patience"),
    (lambda opt: netcl.ReduceLROnPlateau(opt, min_lr=-1), "min_lr")])
def test_schedules_validate_their_arguments(cpu, make, needle):
    with raises_naming(ValueError, needle):
        make(netcl.SGD([param(np.zeros(2), cpu)], lr=0.1))


def test_module_to_after_adam_raises_until_the_optimizer_is_gone(backend):
    source = _other(backend)
    model = nn.Sequential(nn.Linear(3, 2, queue=source.queue))
    opt = netcl.optim.AdamW(model.parameters(), lr=0.1)
    with raises_naming(ValueError, "'0.weight'", "AdamW", "before creating the optimizer"):
        model.to(backend)
    assert all(p.device is source for p in model.parameters())  # nothing moved
    del opt
    gc.collect()
    model.to(backend)
    opt = netcl.optim.AdamW(model.parameters(), lr=0.1)
    before = host(model[0].weight)
    x = tensor(np.ones((4, 3), np.float32), backend)
    with netcl.Tape() as tape:
        loss = F.cross_entropy(model(x), np.array([0, 1, 0, 1]))
    opt.zero_grad()
    tape.backward(loss)
    opt.step()
    assert model[0].weight.device is backend
    assert not np.array_equal(host(model[0].weight), before)


def test_sgd_follows_a_moved_model_until_it_has_momentum(backend):
    source = _other(backend)
    model = nn.Sequential(nn.Linear(3, 2, queue=source.queue))
    opt = netcl.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = np.ones((4, 3), np.float32)

    def step(dev):
        with netcl.Tape() as tape:
            loss = F.cross_entropy(model(tensor(x, dev)), np.array([0, 1, 0, 1]))
        opt.zero_grad()
        tape.backward(loss)
        opt.step()

    model.to(backend)  # before the first step: SGD holds the same Parameters
    before = host(model[0].weight)
    step(backend)
    assert not np.array_equal(host(model[0].weight), before)
    model.to(source)  # now its momentum buffers are on `backend`
    with raises_naming(ValueError, "SGD.step", "momentum", "before creating the optimizer"):
        step(source)


# ---------------------------------------------------------------------------------------------
# mixed precision: autocast, float16 storage, tensor cores, AMPGradScaler
# ---------------------------------------------------------------------------------------------

# autocast (float16 storage, float32 arithmetic) and AMPGradScaler. The scaler is checked
# against a NumPy transcription of PyTorch's GradScaler (torch/amp/grad_scaler.py: scale,
# unscale_, step, update) with aten's kernels (aten/src/ATen/native/cuda/AmpKernels.cu:
# _amp_foreach_non_finite_check_and_unscale_, _amp_update_scale_), followed by the optimizer
# references above.

# Rounding a value to float16 moves it by at most half an ulp, 2**-11 relative (2**-25 absolute
# among subnormals); 1e-6 more covers the float32 arithmetic before the rounding.
HALF_RTOL, HALF_ATOL = 2.0 ** -11 + 1e-6, 2.0 ** -25


@pytest.fixture
def portable_half(opencl, monkeypatch):
    """autocast's float16 storage through the portable kernels, on any OpenCL device. A device
    with neither tensor cores nor half arithmetic (PoCL) keeps float32 under autocast, and the
    tensor cores round the weights to float16 as well, so the tests of float16 storage itself
    pretend to half arithmetic and switch the tensor cores off."""
    opencl._half_program()  # probe first, so the patch below outlives no decision
    monkeypatch.setattr(opencl, "_tensor_cores", False)
    monkeypatch.setattr(opencl, "_has_fp16", True)
    return opencl


def _assert_rounded_from(out, exact, what=""):
    """out (float16) is `exact` (float64) rounded to float16, up to float32 arithmetic."""
    assert out.dtype == np.float16, f"{what}: {out.dtype}"
    np.testing.assert_allclose(out.astype(np.float64), exact, rtol=HALF_RTOL, atol=HALF_ATOL,
                               err_msg=what)


def _relative_error(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _gelu_reference(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def _one(shape=(7, 5), low=None):
    """Inputs of a case: one array, standard normal or uniform in [low, 2)."""
    return lambda r: [r.standard_normal(shape) if low is None else r.uniform(low, 2, shape)]


def _two(b_shape=(7, 5), b_low=None):
    return lambda r: [r.standard_normal((7, 5))] + _one(b_shape, b_low)(r)


# (name, inputs from a generator, netcl op, float64 reference, output stays float16)
HALF_OP_CASES = [
    ("relu", _one(), F.relu, lambda x: np.maximum(x, 0), True),
    ("leaky_relu", _one(), lambda x: F.leaky_relu(x, 0.1), lambda x: np.where(x > 0, x, 0.1 * x),
     True),
    ("sigmoid", _one(), F.sigmoid, lambda x: 1 / (1 + np.exp(-x)), True),
    ("tanh", _one(), F.tanh, np.tanh, True),
    ("gelu", _one(), F.gelu, _gelu_reference, True),
    ("exp", _one(), F.exp, np.exp, True),
    ("log", _one(low=0.1), F.log, np.log, True),
    ("neg", _one(), lambda x: -x, lambda x: -x, True),
    ("add", _two(), F.add, np.add, True),
    ("sub_bias", _two((5,)), F.sub, np.subtract, True),
    ("mul", _two(), F.mul, np.multiply, True),
    ("div", _two(b_low=0.5), F.div, np.divide, True),
    ("add_scalar", _one(), lambda x: x + 1.5, lambda x: x + 1.5, True),
    ("rsub_scalar", _one(), lambda x: 2.0 - x, lambda x: 2.0 - x, True),
    ("mul_scalar", _one(), lambda x: x * 0.3, lambda x: x * 0.3, True),
    ("div_scalar", _one(), lambda x: x / 3.0, lambda x: x / 3.0, True),
    ("rdiv_scalar", _one(low=0.5), lambda x: 3.0 / x, lambda x: 3.0 / x, True),
    ("transpose", _one(), lambda x: x.T, lambda x: x.T, True),
    ("max_pool2d", _one((2, 3, 6, 6)), lambda x: F.max_pool2d(x, 2),
     lambda x: x.reshape(2, 3, 3, 2, 3, 2).max(axis=(3, 5)), True),
    ("avg_pool2d", _one((2, 3, 6, 6)), lambda x: F.avg_pool2d(x, 2),
     lambda x: x.reshape(2, 3, 3, 2, 3, 2).mean(axis=(3, 5)), True),
    ("sum", _one(), lambda x: x.sum(), np.sum, False),
    ("mean_axis0", _one(), lambda x: F.mean(x, 0), lambda x: x.mean(0), False),
    ("sum_long", _one((5000,)), F.sum, np.sum, False),
    ("softmax", _one(), F.softmax, _softmax_ref, False),
    ("log_softmax", _one(), F.log_softmax, _log_softmax, False),
    ("cross_entropy", _one(), lambda x: F.cross_entropy(x, np.arange(7) % 5),
     lambda x: _cross_entropy_ref(x, np.arange(7) % 5, "mean"), False),
    ("mse_loss", _two(), F.mse_loss, lambda x, t: np.mean((x - t) ** 2), False),
]


# The ops whose backward reads their output y, which float16 storage keeps rounded: their
# gradient is the float32 one only up to that rounding. Every other op's backward reads the
# same values in both storages and computes the same float32 arithmetic.
_BACKWARD_READS_ROUNDED_OUTPUT = {"sigmoid", "tanh", "exp", "sqrt", "rsqrt"}
# cross_entropy returns float32 but writes its logits' gradient in their storage, rounded once.
_HALF_GRADIENT_OF_A_FLOAT32_OUTPUT = {"cross_entropy"}


@pytest.mark.parametrize("case", HALF_OP_CASES, ids=[c[0] for c in HALF_OP_CASES])
def test_float16_storage_ops(opencl, case):
    """float16 in: elementwise ops, pooling and transpose write float16 (the float32 result
    rounded), reductions, softmax and losses return float32. The gradients of the float16
    leaves are float16 storage through the former and cross_entropy, float32 through the
    rest: exactly the float32 gradient of the same values (rounded), but where backward reads
    the rounded output (then up to that rounding)."""
    name, make, op, reference, stays_half = case
    rng = np.random.default_rng(11)
    arrays = [a.astype(np.float16) for a in make(rng)]
    exact = reference(*[a.astype(np.float64) for a in arrays])
    outs, grads = {}, {}
    for dtype in (np.float16, np.float32):
        netcl.manual_seed(0)
        leaves = [param(a.astype(dtype), opencl, dtype) for a in arrays]
        with netcl.Tape() as tape:
            y = op(*leaves)
            # float32 holding float16 values: the gradient reaching y is float32 (a mixed
            # product), and rounding it to float16 storage loses nothing
            weights = np.random.default_rng(5).standard_normal(y.shape).astype(np.float16)
            loss = (y * tensor(weights.astype(np.float32), opencl)).sum()
        tape.backward(loss)
        outs[dtype], grads[dtype] = host(y), [host(p.grad) for p in leaves]
    if stays_half:
        _assert_rounded_from(outs[np.float16], exact, name)
    else:
        assert outs[np.float16].dtype == np.float32
        np.testing.assert_allclose(outs[np.float16], exact, rtol=1e-5, atol=1e-6, err_msg=name)
    for half_grad, float_grad in zip(grads[np.float16], grads[np.float32]):
        # a float16 output's gradient, float16 storage, flows back to float16 operands; the
        # reductions' backward (not converted) gives float32
        half_storage = stays_half or name in _HALF_GRADIENT_OF_A_FLOAT32_OUTPUT
        assert half_grad.dtype == (np.float16 if half_storage else np.float32), name
        assert float_grad.dtype == np.float32, name
        if name in _BACKWARD_READS_ROUNDED_OUTPUT:
            np.testing.assert_allclose(half_grad, float_grad, rtol=4e-3, atol=1e-3, err_msg=name)
        else:
            np.testing.assert_array_equal(half_grad, float_grad.astype(half_grad.dtype),
                                          err_msg=name)


def test_dropout_keeps_float16_storage(opencl):
    x = np.random.default_rng(12).standard_normal((9, 40)).astype(np.float16)
    outs = []
    for dtype in (np.float16, np.float32):
        netcl.manual_seed(3)
        outs.append(host(F.dropout(tensor(x, opencl, dtype), 0.3, training=True)))
    _assert_rounded_from(outs[0], outs[1].astype(np.float64), "dropout")


def test_mixed_float16_and_float32_operands_compute_in_float32(opencl):
    rng = np.random.default_rng(13)
    a = rng.standard_normal((6, 4)).astype(np.float16)
    b = rng.standard_normal(4).astype(np.float32)
    half, single = tensor(a, opencl), tensor(b, opencl)
    for out, expected in [(F.add(half, single), a.astype(np.float32) + b),
                          (F.mul(single, half), b * a.astype(np.float32)),
                          (F.div(half, single), a.astype(np.float32) / b)]:
        assert out.dtype == np.float32
        np.testing.assert_array_equal(host(out), expected)


@pytest.mark.parametrize("gemm", ["packed", "tiled"])
@pytest.mark.parametrize("m, k, n", [(5, 7, 9), (64, 32, 48), (33, 70, 17), (150, 40, 140)])
@pytest.mark.usefixtures("portable_half")
def test_autocast_products_are_the_float32_result_rounded(opencl, monkeypatch, gemm, m, k, n):
    """With float16 inputs, the autocast linear/matmul/conv2d output is exactly the float32
    result on the same values rounded to float16: the same float32 accumulation, one rounding.
    So is the input's gradient, float16 storage as the input; the weights' gradients, read
    from the float16 input the forward kept, are exactly the float32 ones, in float32.
    Both GEMM variants run here (the GPUs' tiled one too); 150 x 140 takes the 128-wide tiles."""
    monkeypatch.setattr(opencl, "gemm", gemm)
    rng = np.random.default_rng(m + k + n)
    arrays = {
        "linear": [rng.standard_normal((m, k)), rng.standard_normal((n, k)) / math.sqrt(k),
                   rng.standard_normal(n)],
        "matmul": [rng.standard_normal((m, k)), rng.standard_normal((k, n)) / math.sqrt(k)],
        "conv2d": [rng.standard_normal((2, 3, 7, 6)), rng.standard_normal((n % 5 + 2, 3, 3, 3)) / 5,
                   rng.standard_normal(n % 5 + 2)],
    }
    products = {"linear": F.linear, "matmul": F.matmul,
                "conv2d": lambda x, w, b: F.conv2d(x, w, b, stride=(1, 2), padding=1)}
    for name, product in products.items():
        x, *weights = arrays[name]
        x = x.astype(np.float16)  # the input in float16 storage, or those values in float32
        results = {}
        for enabled, dtype in ((False, np.float32), (True, np.float16)):
            leaves = [param(x, opencl, dtype)] + [param(w, opencl) for w in weights]
            with netcl.Tape() as tape, netcl.autocast(enabled=enabled):
                out = product(*leaves)
            seed = np.random.default_rng(1).standard_normal(out.shape).astype(np.float16)
            tape.backward(out, grad=seed.astype(np.float32))
            results[enabled] = host(out), [host(p.grad) for p in leaves]
        (single, (dx32, *dw32)), (half, (dx16, *dw16)) = results[False], results[True]
        assert half.dtype == np.float16 and single.dtype == np.float32, name
        np.testing.assert_array_equal(half, single.astype(np.float16), err_msg=name)
        assert dx16.dtype == np.float16, name
        np.testing.assert_array_equal(dx16, dx32.astype(np.float16), err_msg=name)
        for g16, g32 in zip(dw16, dw32):
            assert g16.dtype == np.float32
            np.testing.assert_array_equal(g16, g32, err_msg=name)


def _digits_mlp(dev, hidden=64, seed=0):
    """The float16 tests' model of 8x8 digits: a ReLU and a Tanh, both in float16 storage."""
    return _mlp(dev, (64, hidden, hidden, 10), seed, activations=(nn.ReLU, nn.Tanh))


@pytest.mark.parametrize("gemm", ["packed", "tiled"])
@pytest.mark.usefixtures("portable_half")
def test_autocast_mlp_forward_matches_float32(opencl, monkeypatch, gemm):
    """Under autocast every activation is float16 storage and the logits match the float32
    forward within float16 precision; the loss, the gradients and the weights are float32."""
    monkeypatch.setattr(opencl, "gemm", gemm)
    rng = np.random.default_rng(14)
    x = tensor(rng.standard_normal((48, 64)).astype(np.float32), opencl)
    y = rng.integers(0, 10, 48)
    model = _digits_mlp(opencl, seed=1)
    results = {}
    for enabled in (False, True):
        for p in model.parameters():
            p.grad = None
        with netcl.Tape() as tape, netcl.autocast(enabled=enabled):
            h = x
            activations = []
            for layer in model:
                h = layer(h)
                activations.append(h)
            loss = F.cross_entropy(h, y)
        tape.backward(loss)
        assert loss.dtype == np.float32
        assert all(a.dtype == (np.float16 if enabled else np.float32) for a in activations)
        results[enabled] = (host(h), float(loss.value), [host(p.grad) for p in model.parameters()])
    (logits32, loss32, grads32), (logits16, loss16, grads16) = results[False], results[True]
    assert _relative_error(logits16, logits32) < 1e-2
    assert abs(loss16 - loss32) < 1e-2 * abs(loss32)
    for p, g16, g32 in zip(model.parameters(), grads16, grads32):
        assert p.dtype == np.float32 and g16.dtype == np.float32
        assert _relative_error(g16, g32) < 1e-2


def test_autocast_is_a_noop_on_the_numpy_backend(cpu):
    model = _digits_mlp(cpu, seed=2)
    x = tensor(np.random.default_rng(15).standard_normal((8, 64)), cpu)
    plain = host(model(x))
    with netcl.autocast():
        inside = model(x)
    assert inside.dtype == np.float32
    np.testing.assert_array_equal(host(inside), plain)


@pytest.mark.usefixtures("portable_half")
def test_autocast_nests_and_decorates(opencl):
    x = tensor(np.ones((4, 3), np.float32), opencl)
    w = tensor(np.ones((2, 3), np.float32), opencl)

    @netcl.autocast()
    def product():
        return F.linear(x, w)
    assert F.linear(x, w).dtype == np.float32
    assert product().dtype == np.float16
    with netcl.autocast():
        assert F.linear(x, w).dtype == np.float16
        with netcl.autocast(enabled=False):
            assert F.linear(x, w).dtype == np.float32
        assert F.linear(x, w).dtype == np.float16
    assert F.linear(x, w).dtype == np.float32


@pytest.mark.usefixtures("portable_half")
@pytest.mark.parametrize("op, reference, slope", [
    (F.exp, np.exp, np.exp),
    (F.log, np.log, lambda v: 1 / v),
    (F.rsqrt, lambda v: v ** -0.5, lambda v: -0.5 * v ** -1.5),
    (lambda x: x ** 3, lambda v: v ** 3, lambda v: 3 * v ** 2),
    (lambda x: 1.0 / x, lambda v: 1 / v, lambda v: -1 / v ** 2),
])
def test_autocast_runs_pytorchs_float32_ops_in_float32(opencl, op, reference, slope):
    """exp, log, rsqrt, pow and a number divided by a tensor: PyTorch's autocast runs them in
    float32 (its CUDA ops that autocast to float32), so inside autocast a float16 activation
    is widened and the result is float32: exp(12) is 162755, not float16's inf. The gradient
    reaches the float16 input through the widening. Outside autocast float16 stays float16."""
    w = tensor(np.eye(4) * 4, opencl)
    x = param(np.array([[0.5, 3.0, 12.0, 20.0]], np.float32), opencl)
    with netcl.Tape() as tape, netcl.autocast():
        h = F.linear(x, w)  # float16 storage: 2, 12, 48, 80
        y = op(h)
        loss = y[:, 0].sum()  # a gradient that float16 storage holds
    assert h.dtype == np.float16 and y.dtype == np.float32
    values = host(h).astype(np.float64)
    np.testing.assert_allclose(host(y), reference(values), rtol=1e-5)  # float16's: 5e-4
    assert np.isfinite(host(y)).all()  # exp(48), 48 ** 3: past float16
    tape.backward(loss)
    expected = np.zeros((1, 4))
    expected[0, 0] = 4 * slope(values[0, 0])  # w = 4 I
    np.testing.assert_allclose(host(x.grad), expected, rtol=2e-3)  # dL/dh in float16
    half = netcl.Node(tensor(values, opencl, np.float16))
    assert op(half).dtype == np.float16  # outside autocast: the input's storage
    with netcl.autocast(enabled=False):
        assert op(half).dtype == np.float16


def test_autocast_float32_ops_keep_float16_on_the_numpy_backend(cpu):
    """On the NumPy backend autocast does nothing: exp of float16 stays float16."""
    x = tensor(np.array([1.0, 12.0]), cpu, np.float16)
    with netcl.autocast():
        assert F.exp(x).dtype == np.float16


def _half_node(values, dev, requires_grad=False):
    """A float16 Node (a Parameter if requires_grad) on dev."""
    t = tensor(np.asarray(values, np.float16), dev, np.float16)
    return netcl.Parameter(t) if requires_grad else netcl.Node(t)


def test_float16_products_sum_in_float32_on_both_backends(backend):
    """float16 is storage: matmul, linear and conv2d of float16 operands sum in float32 on
    the NumPy backend too (NumPy's own float16 matmul and einsum round as they go: 200 * 200
    * 4 was inf there, and a long sum of 1 + 2**-10 lost its small parts)."""
    a, b = _half_node(np.full((1, 4), 200), backend), _half_node(np.full((4, 1), 200), backend)
    assert host(F.matmul(a, b)).tolist() == [[160000.0]]
    assert host(F.linear(a, F.transpose(b))).tolist() == [[160000.0]]
    image, kernel = _half_node(np.full((1, 1, 3, 3), 300), backend), _half_node(
        np.full((1, 1, 3, 3), 300), backend)
    assert host(F.conv2d(image, kernel)).tolist() == [[[[810000.0]]]]
    long_row = _half_node(np.full((1, 3000), 1 + 2 ** -10), backend)
    ones = _half_node(np.ones((3000, 1)), backend)
    np.testing.assert_allclose(host(F.matmul(long_row, ones)), [[3000 * (1 + 2 ** -10)]],
                               rtol=1e-6)


def test_float16_matmul_outside_autocast_keeps_its_float32_gradient(backend):
    """Two float16 operands outside autocast give a float32 product, and its gradient stays
    float32 on the way to them (it was rounded to float16 first: g = 1e5 made dA inf, where
    dA = g B^T = 300). Each operand's own gradient is then in its storage."""
    A = _half_node(np.full((2, 4), 0.5), backend, requires_grad=True)
    B = _half_node(np.full((4, 3), 1e-3), backend, requires_grad=True)
    with netcl.Tape() as tape:
        Y = A @ B
        loss = (Y * tensor(np.full((2, 3), 1e5), backend)).sum()
    assert Y.dtype == np.float32
    tape.backward(loss)
    np.testing.assert_allclose(host(A.grad).astype(np.float64), np.full((2, 4), 300.0),
                               rtol=1e-3)


def test_float16_unary_gradients_compute_in_float32_on_both_backends(backend):
    """The NumPy backend computes an elementwise op on float16 storage in float32 and rounds
    once, as the kernels do: gelu(tanh)'s slope at +-1000 is 1 and 0 (in float16 x * x
    overflowed and the slope was NaN)."""
    x = _half_node([1000.0, -1000.0, 2.0], backend, requires_grad=True)
    with netcl.Tape() as tape:
        loss = (F.gelu(x, approximate="tanh") * tensor(np.ones(3), backend)).sum()
    tape.backward(loss)
    np.testing.assert_allclose(host(x.grad).astype(np.float64), [1.0, 0.0, 1.0861], rtol=1e-3)


def test_float16_conv2d_weight_gradient_is_float32_on_both_backends(backend):
    """A float16 weight's gradient is float32 on the NumPy backend as on OpenCL."""
    x = _half_node(np.ones((1, 1, 4, 4)), backend, requires_grad=True)
    w = _half_node(np.ones((1, 1, 3, 3)), backend, requires_grad=True)
    with netcl.Tape() as tape:
        loss = F.conv2d(x, w, padding=1).sum()
    tape.backward(loss)
    assert w.grad.dtype == np.float32
    np.testing.assert_array_equal(host(w.grad), [[[[9, 12, 9], [12, 16, 12], [9, 12, 9]]]])


def test_float16_division_gradients_compute_in_float32_on_both_backends(backend):
    """d(a/b)/db = -a / b**2 from float16 a = b = 300: -1/300 (b * b overflowed in float16
    on the NumPy backend, which gave -0)."""
    a = _half_node([300.0], backend, requires_grad=True)
    b = _half_node([300.0], backend, requires_grad=True)
    with netcl.Tape() as tape:
        loss = F.div(a, b).sum()
    tape.backward(loss)
    np.testing.assert_allclose(host(b.grad).astype(np.float64), [-1 / 300], rtol=1e-3)
    np.testing.assert_allclose(host(a.grad).astype(np.float64), [1 / 300], rtol=1e-3)


def test_masked_fill_refuses_a_value_float16_cannot_hold(backend):
    """As PyTorch: a finite fill value past float16's 65504 is an error for float16 storage
    (it would silently be inf); inf itself, and any value for float32, are fine."""
    x = _half_node([1.0, 2.0, 3.0], backend)
    mask = np.array([True, False, True])
    for value in (-1e9, 65505.0):
        with raises_naming(RuntimeError, "masked_fill", repr(value), "float16"):
            F.masked_fill(x, mask, value)
    assert host(F.masked_fill(x, mask, -math.inf)).tolist() == [-math.inf, 2.0, -math.inf]
    assert host(F.masked_fill(x, mask, -65504.0)).tolist() == [-65504.0, 2.0, -65504.0]
    as_float32 = netcl.Node(tensor([1.0, 2.0, 3.0], backend))
    assert host(F.masked_fill(as_float32, mask, -1e9)).tolist() == [-1e9, 2.0, -1e9]
    with raises_naming(RuntimeError, "masked_fill"):  # a float16 NumPy x too
        F.masked_fill(np.ones(3, np.float16), mask, -1e9)
    # a NumPy x goes to the device of a mask that is a device tensor
    on_device = tensor(np.array([1, 0, 1], np.int32), backend, np.int32)
    filled = F.masked_fill(np.array([1.0, 2.0, 3.0], np.float32), on_device, -5.0)
    assert filled.device is backend and host(filled).tolist() == [-5.0, 2.0, -5.0]


@pytest.mark.parametrize("enabled", ["yes", "False", None, 0, 1, "cuda"])
def test_autocast_rejects_an_enabled_that_is_not_a_bool(enabled):
    """PyTorch raises TypeError for a non-bool enabled; coercing would turn autocast on for
    enabled="False", or for autocast("cuda") ported from torch.autocast."""
    with raises_naming(TypeError, "autocast", "enabled", repr(enabled)):
        netcl.autocast(enabled)
    assert netcl.autocast(np.bool_(False)).enabled is False


def test_one_kernel_source_builds_both_storage_types(opencl):
    """The same kernels in both builds, but for Winograd's, in the float32 build only (they
    read and write either storage); the half build adds the tensor-core ones only where the
    device's probe passed."""
    half = set(opencl._half_program())
    extra = half - set(opencl._kernels)
    winograd = {name for name in opencl._kernels if "winograd" in name}
    assert bool(winograd) == netcl._winograd_device(opencl.cl_device)
    assert set(opencl._kernels) - winograd <= half and not winograd & half
    assert all(name.startswith(("gemm_tc_", "tensor_core_probe")) for name in extra)
    assert bool(extra) == opencl.tensor_cores


def _digits_accuracy(dev, digits, amp):
    x_train, y_train, x_test, y_test = digits.x_train, digits.y_train, digits.x_test, digits.y_test
    model = _digits_mlp(dev)
    opt = netcl.AdamW(model.parameters(), lr=3e-3)
    scaler = netcl.AMPGradScaler(enabled=amp)
    rng = np.random.default_rng(0)
    for _ in range(8):
        order = rng.permutation(len(x_train))
        for start in range(0, len(order), 64):
            idx = order[start:start + 64]
            with netcl.Tape() as tape, netcl.autocast(enabled=amp):
                loss = F.cross_entropy(model(tensor(x_train[idx], dev)), y_train[idx])
            opt.zero_grad()
            tape.backward(scaler.scale(loss))
            scaler.step(opt, max_norm=1.0)
            scaler.update()
    with netcl.autocast(enabled=amp):
        logits = host(model(tensor(x_test, dev)))
    return (logits.argmax(axis=1) == y_test).mean()


@pytest.mark.parametrize("path", ["device", "portable"])
def test_autocast_training_reaches_the_float32_accuracy(opencl, digits, request, path):
    """"device": what autocast does on this device (tensor cores on NVIDIA, float32 on PoCL);
    "portable": float16 storage through the portable kernels."""
    if path == "portable":
        request.getfixturevalue("portable_half")
    single = _digits_accuracy(opencl, digits, amp=False)
    mixed = _digits_accuracy(opencl, digits, amp=True)
    assert single >= 0.94, f"float32 accuracy {single:.3f}"
    assert mixed >= 0.94 and abs(mixed - single) <= 0.02, f"{mixed:.3f} vs float32 {single:.3f}"


def test_autocast_keeps_float32_where_float16_storage_does_not_pay(opencl, monkeypatch, capsys):
    """Without tensor cores or half arithmetic (PoCL), float16 storage only adds conversions:
    autocast then computes in float32 and says so once."""
    opencl._half_program()
    monkeypatch.setattr(opencl, "_tensor_cores", False)
    monkeypatch.setattr(opencl, "_has_fp16", False)
    monkeypatch.setattr(opencl, "_autocast_notice", False)
    x, w = tensor(np.ones((4, 8)), opencl), tensor(np.ones((2, 8)), opencl)
    with netcl.autocast():
        first, second = F.linear(x, w), F.matmul(x, F.transpose(w))
    assert first.dtype == second.dtype == np.float32
    np.testing.assert_array_equal(host(first), np.full((4, 2), 8.0))
    assert capsys.readouterr().err.count("autocast keeps float32") == 1


def test_autocast_overflow_makes_the_scaler_skip_and_back_off(opencl):
    """A scale so large that the scaled backward overflows: the step is skipped on the device
    (parameters bit-identical) and the scale backs off, whatever path autocast took."""
    netcl.manual_seed(3)
    model = nn.Linear(64, 10, queue=opencl.queue)
    opt = netcl.AdamW(model.parameters(), lr=1e-2)
    before = [host(p) for p in model.parameters()]
    # dW = sum over the batch of (scale * dloss/dlogits) x: about 32 * 2**120 / 32 * 1e4, past
    # float32's 3.4e38 (and float16's 65504 far earlier)
    scaler = netcl.AMPGradScaler(init_scale=2.0 ** 120)
    x = tensor(1e4 * np.random.default_rng(4).standard_normal((32, 64)), opencl)
    with netcl.Tape() as tape, netcl.autocast():
        loss = F.cross_entropy(model(x), np.arange(32) % 10)
    tape.backward(scaler.scale(loss))
    scaler.step(opt, max_norm=1.0)
    scaler.update()
    for p, old in zip(model.parameters(), before):
        np.testing.assert_array_equal(host(p), old)
    assert scaler.get_scale() == 2.0 ** 119


# --- float16 activation gradients under autocast

def _gradient_probe(x, seen, half_grad):
    """x itself, recorded as an op whose backward notes the storage of the gradient it gets
    (declaring, or not, that it reads float16 gradients) and passes it on."""
    return netcl._record(x.value, (x,), lambda g: (seen.append(g.dtype) or g,),
                         half_grad=half_grad)


@pytest.mark.usefixtures("portable_half")
def test_the_tape_gives_each_backward_its_gradient_storage(opencl):
    """A backward that reads float16 gets a float16 value's gradient in float16 storage, a
    float32 contribution rounded; one that does not gets float32, a float16 one widened; and
    a node with a float16 and a float32 contribution (a residual) gets their float32 sum,
    rounded once."""
    rng = np.random.default_rng(31)
    x = rng.standard_normal((6, 5)).astype(np.float16)
    seed = rng.standard_normal((6, 5)).astype(np.float32)  # not float16 values: rounded
    for half_grad in (True, False):
        seen = []
        leaf = param(x, opencl, np.float16)
        with netcl.Tape() as tape:
            y = _gradient_probe(leaf, seen, half_grad)
        tape.backward(y, grad=tensor(seed, opencl))  # a float32 Tensor (an array would take
                                                     # y's dtype)
        assert seen == [np.float16 if half_grad else np.float32]
        expected = seed.astype(np.float16) if half_grad else seed
        np.testing.assert_array_equal(host(leaf.grad), expected)
    seen = []
    leaf = param(x, opencl, np.float16)
    with netcl.Tape() as tape:
        h = _gradient_probe(leaf, seen, True)
        loss = (F.relu(h) * 3.0).sum() + (h * tensor(seed, opencl)).sum()  # float16 + float32
    tape.backward(loss)
    assert seen == [np.float16]
    residual = (np.float32(3.0) * (x > 0) + seed).astype(np.float16)
    np.testing.assert_array_equal(host(leaf.grad), residual)
    seen = []
    single = param(x.astype(np.float32), opencl)  # a float32 value: float32 gradient
    with netcl.Tape() as tape:
        y = _gradient_probe(single, seen, True)
    tape.backward(y, grad=tensor(seed, opencl))
    assert seen == [np.float32]


@XB_SETTINGS
@given(m=st.integers(1, 40), k=st.integers(1, 40), n=st.integers(1, 40),
       product=st.sampled_from(["linear", "matmul"]), gemm=st.sampled_from(["packed", "tiled"]),
       seed=st.integers(0, 2 ** 31))
@pytest.mark.usefixtures("portable_half")
def test_autocast_input_gradient_is_the_float32_one_rounded(opencl, monkeypatch, m, k, n,
                                                            product, gemm, seed):
    """The gradient of a float16 input to linear or matmul is float16 storage: exactly the
    float32 gradient of the same values, rounded once; the weight's stays float32, exactly
    the float32 one."""
    monkeypatch.setattr(opencl, "gemm", gemm)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float16)
    w = rng.standard_normal((n, k) if product == "linear" else (k, n)) / math.sqrt(k)
    g = rng.standard_normal((m, n)).astype(np.float16).astype(np.float32)
    op = F.linear if product == "linear" else F.matmul
    grads = {}
    for enabled, dtype in ((False, np.float32), (True, np.float16)):
        leaves = [param(x, opencl, dtype), param(w, opencl)]
        with netcl.Tape() as tape, netcl.autocast(enabled=enabled):
            out = op(*leaves)
        tape.backward(out, grad=g)
        grads[enabled] = [host(p.grad) for p in leaves]
    (dx32, dw32), (dx16, dw16) = grads[False], grads[True]
    assert dx16.dtype == np.float16 and dw16.dtype == np.float32
    np.testing.assert_array_equal(dx16, dx32.astype(np.float16))
    np.testing.assert_array_equal(dw16, dw32)


@pytest.mark.parametrize("gemm", ["packed", "tiled"])
@pytest.mark.usefixtures("portable_half")
def test_autocast_cnn_activation_gradients_are_float16(opencl, monkeypatch, gemm):
    """A small CNN under autocast: the gradients reaching its float16 activations (the
    convolution's output, the ReLU's, the pooled one) are float16 storage, the parameters'
    are float32 and match the float32 run within float16 precision."""
    monkeypatch.setattr(opencl, "gemm", gemm)
    netcl.manual_seed(4)
    conv = nn.Conv2d(3, 8, 3, padding=1, queue=opencl.queue)
    head = nn.Linear(8 * 4 * 4, 10, queue=opencl.queue)
    rng = np.random.default_rng(6)
    x = tensor(rng.standard_normal((5, 3, 8, 8)), opencl)
    labels = rng.integers(0, 10, 5)
    params = list(conv.parameters()) + list(head.parameters())
    results = {}
    for enabled in (False, True):
        for p in params:
            p.grad = None
        seen = []
        with netcl.Tape() as tape, netcl.autocast(enabled=enabled):
            h = _gradient_probe(conv(x), seen, True)
            h = _gradient_probe(F.relu(h), seen, True)
            h = _gradient_probe(F.max_pool2d(h, 2), seen, True)
            loss = F.cross_entropy(head(F.flatten(h)), labels) * 1024.0  # a loss scale
        tape.backward(loss)
        assert seen == [np.float16 if enabled else np.float32] * 3
        assert all(p.grad.dtype == np.float32 for p in params)
        results[enabled] = [host(p.grad) for p in params]
    for g16, g32 in zip(results[True], results[False]):
        assert _relative_error(g16, g32) < 1e-2


@pytest.mark.parametrize("target", ["index", "ignored", "smoothed", "soft"])
@pytest.mark.usefixtures("portable_half")
def test_cross_entropy_writes_the_float16_logits_gradient_itself(opencl, target):
    """The gradient of float16 logits is float16 storage written by the loss's own backward
    kernel: exactly the float32 gradient of the same values, rounded once, with no cast
    launched after it (the Tape would cast a float32 one for the op that made the logits)."""
    rng = np.random.default_rng(41)
    logits = rng.standard_normal((9, 7)).astype(np.float16)
    labels, kwargs = rng.integers(0, 7, 9), {}
    if target == "ignored":
        labels[::3] = -100
    elif target == "smoothed":
        kwargs["label_smoothing"] = 0.1
    elif target == "soft":
        labels = rng.dirichlet(np.ones(7), 9).astype(np.float32)
    grads = {}
    for dtype in (np.float32, np.float16):
        seen = []
        leaf = param(logits, opencl, dtype)
        with netcl.Tape() as tape:
            loss = F.cross_entropy(_gradient_probe(leaf, seen, True), labels, **kwargs)
        launches = opencl.launches
        tape.backward(loss)
        assert opencl.launches == launches + 1, dtype  # cross_entropy_bwd alone
        assert seen == [dtype]
        grads[dtype] = host(leaf.grad)
    assert grads[np.float16].dtype == np.float16
    np.testing.assert_array_equal(grads[np.float16], grads[np.float32].astype(np.float16))


# --- tensor cores: NVIDIA only (the probe decides); the fallback is tested on every device

def _tensor_core_device(opencl):
    if not opencl.tensor_cores:
        pytest.skip(f"{opencl.name} has no tensor cores reachable from OpenCL")
    return opencl


@XB_SETTINGS
@given(m=st.integers(1, 300), n=st.integers(1, 300), k=st.integers(1, 300),
       layout=st.sampled_from(["nn", "nt", "tn"]), half_out=st.booleans(),
       per=st.sampled_from([None, "columns", "rows"]), aligned=st.booleans(),
       seed=st.integers(0, 2 ** 31))
def test_tensor_core_gemm_is_a_float32_product_of_float16_operands(
        opencl, m, n, k, layout, half_out, per, aligned, seed):
    """Every layout, ragged edges and rows that are not 16-byte aligned included, without
    bias or with one per column or per row: within float32 accumulation error of the exact
    product of the float16 operands (plus one rounding to float16 for a float16 output)."""
    dev = _tensor_core_device(opencl)
    if aligned:  # the contiguous dimension of each operand a multiple of 8, or any size
        round8 = lambda v: -(-v // 8) * 8
        k = round8(k) if layout in ("nn", "nt") else k
        m = round8(m) if layout == "tn" else m
        n = round8(n) if layout in ("nn", "tn") else n
    else:  # enough blocks for the gathering kernels to be chosen
        m = max(m, 128 * dev.compute_units // max(1, -(-n // 64)) + 1)
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float16)
    b = rng.standard_normal((k, n)).astype(np.float16)
    bias = None if per is None else rng.standard_normal(m if per == "rows" else n)
    A = tensor(a.T.copy() if layout == "tn" else a, dev)
    B = tensor(b.T.copy() if layout == "nt" else b, dev)
    out = netcl.Tensor.empty((m, n), np.float16 if half_out else np.float32, dev.queue)
    assert netcl._tensor_core_gemm(A, B, layout == "tn", layout == "nt",
                                   None if bias is None else tensor(bias, dev), out,
                                   bias_rows=per == "rows")
    added = 0.0 if bias is None else bias.astype(np.float32).astype(np.float64)
    exact = a.astype(np.float64) @ b.astype(np.float64) + (
        added[:, None] if per == "rows" else added)
    bound = k * 2.0 ** -23 * (np.abs(a).astype(np.float64) @ np.abs(b)) + 1e-30
    if per is not None:  # the bias is added in float32 too: one more rounding of the result
        bound = bound + 2.0 ** -24 * np.abs(exact)
    if half_out:
        bound = bound + 2.0 ** -11 * np.abs(exact) + 2.0 ** -24
    assert (np.abs(host(out).astype(np.float64) - exact) <= bound).all()


@pytest.mark.parametrize("layout, m, n, k, batch, kernel, splits", [
    ("nn", 4096, 4096, 4096, 1, "gemm_tc_nn_h_l", 1),    # many blocks: 128x128
    ("nn", 1024, 1024, 1024, 1, "gemm_tc_nn_h_s", 1),    # 64 large blocks: 64x64
    ("nn", 4096, 4096, 248, 1, "gemm_tc_nn_h_s", 1),     # many, but a short K: 64x64
    ("nn", 4096, 4096, 256, 1, "gemm_tc_nn_h_l", 1),     # ... at _TC_LARGE_K: 128x128
    ("nn", 64, 784, 288, 64, "gemm_tc_nn_h_s", 1),       # conv2d's forward, 64 filters
    ("nt", 64, 288, 784, 64, "gemm_tc_nt_f_s", 1),       # ... its weight gradient per sample
    ("tn", 288, 784, 64, 64, "gemm_tc_tn_f_s", 1),       # ... its input gradient's columns
    ("nt", 64, 288, 8192, 1, "gemm_tc_nt_f_s", 8),       # few blocks, long K: split
    ("nn", 4096, 10, 256, 1, "gemm_tc_nn_h_u", 1),       # rows of 10: gathered
])
def test_tensor_core_gemm_picks_its_block_by_shape(opencl, monkeypatch, layout, m, n, k,
                                                    batch, kernel, splits):
    """On a GPU of 132 compute units whose tensor-core probe passed: which block each
    product takes, and into how many chunks it splits K. The launches are recorded, not run
    (any device can check this plan)."""
    monkeypatch.setattr(opencl, "_tensor_cores", True)
    monkeypatch.setattr(opencl, "compute_units", 132)
    launched = []
    monkeypatch.setattr(opencl, "launch", lambda name, grid, *args, **kwargs:
                        launched.append((name, grid)))
    lead = (batch,) if batch > 1 else ()
    a = netcl.Tensor.empty((k, m) if layout == "tn" else (m, k), np.float16, opencl.queue)
    b = netcl.Tensor.empty(lead + ((n, k) if layout == "nt" else (k, n)), np.float16,
                           opencl.queue)
    out = netcl.Tensor.empty(lead + (m, n), np.float16 if kernel.split("_")[3] == "h" else np.float32,
                             opencl.queue)
    assert netcl._tensor_core_gemm(a, b, layout == "tn", layout == "nt", None, out)
    (name, grid), *sums = launched
    assert (name, grid[2]) == (kernel, batch * splits)
    assert len(sums) == (splits > 1)


@XB_SETTINGS
@given(m=st.integers(1, 300), n=st.integers(1, 300), k=st.integers(1, 300),
       side=st.sampled_from(["a", "b"]), bias=st.booleans(), split=st.booleans(),
       seed=st.integers(0, 2 ** 31))
def test_tensor_core_gemm_rounds_a_float32_operand_as_a_cast_would(opencl, m, n, k, side,
                                                                    bias, split, seed):
    """linear's two products of a float32 input, x @ W^T (to half, with or without bias) and
    g^T @ x (to float, K split or not), read x as float32: bit for bit the product of x cast
    to float16 first, with values across float16's range (subnormals, overflow to inf)."""
    dev = _tensor_core_device(opencl)
    round8 = lambda v: -(-v // 8) * 8  # the float16 operand's rows 16-byte aligned
    if side == "a":
        k, bias, split = round8(k), bias, False
    else:
        m, n, bias = round8(m), round8(n), False
        k = k * 40 if split else k  # a long K over few blocks is split
    rng = np.random.default_rng(seed)
    shape_x = (m, k) if side == "a" else (k, n)
    x = (rng.standard_normal(shape_x) * 10.0 ** rng.uniform(-9, 5, shape_x)).astype(np.float32)
    other = rng.standard_normal((n, k) if side == "a" else (k, m)).astype(np.float16)
    X32, X16, O = tensor(x, dev), tensor(x.astype(np.float16), dev), tensor(other, dev)
    b = tensor(rng.standard_normal(n), dev) if bias else None
    outs = []
    for X in (X32, X16):
        out = netcl.Tensor.empty((m, n), np.float16 if side == "a" else np.float32, dev.queue)
        args = (X, O, False, True) if side == "a" else (O, X, True, False)
        assert netcl._tensor_core_gemm(*args, b, out, round_float32=True)
        outs.append(host(out))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("side", ["a", "b"])
def test_tensor_cores_round_a_float32_operand_only_when_asked(opencl, monkeypatch, side):
    """A float16 operand beside a float32 one takes the tensor cores, which round the float32
    one, only where the caller asks (autocast's products, round_float32): elsewhere, as a
    float16 weight's gradient outside autocast, the product is float32's. The launches are
    recorded, not run (any device can check this choice)."""
    monkeypatch.setattr(opencl, "_tensor_cores", True)
    monkeypatch.setattr(opencl, "compute_units", 132)
    launched = []
    monkeypatch.setattr(opencl, "launch", lambda name, grid, *args, **kwargs:
                        launched.append(name))
    m, n, k = 128, 256, 784
    x = netcl.Tensor.empty((m, k) if side == "a" else (k, n), np.float32, opencl.queue)
    other = netcl.Tensor.empty((n, k) if side == "a" else (k, m), np.float16, opencl.queue)
    args = (x, other, False, True) if side == "a" else (other, x, True, False)
    out = netcl.Tensor.empty((m, n), np.float16 if side == "a" else np.float32, opencl.queue)
    assert not netcl._tensor_core_gemm(*args, None, out)
    assert launched == []
    assert netcl._tensor_core_gemm(*args, None, out, round_float32=True)
    assert launched == [f"gemm_tc_{'nt_h' if side == 'a' else 'tn_f'}_s_x{side}"]
    launched.clear()
    monkeypatch.setattr(opencl, "gemm", "tiled")  # a GPU's: the float32 kernels take it
    netcl._gemm(*args, half=side == "a", out=out)
    products = [name for name in launched if name.startswith("gemm_")]
    assert len(products) == 1 and not products[0].startswith("gemm_tc")


@pytest.mark.parametrize("rows, features, outputs, forward, weight_gradient", [
    (128, 784, 256, ["gemm_tc_nt_h_s_xa"], ["gemm_tc_tn_f_s_xb"]),  # the small MLP's first layer
    (1024, 784, 4096, ["gemm_tc_nt_h_l_xa"], ["gemm_tc_tn_f_l_xb"]),  # 128x128 blocks
    (64, 784, 256, ["gemm_tc_nt_h_s_xa"], ["gemm_tc_tn_f_s_xb"]),     # 64 rows
    # large, or unaligned: a cast for each product, none kept through the backward pass
    (4096, 784, 4096, ["cast_to_act", "gemm_tc_nt_h_l"], ["cast_to_act", "gemm_tc_tn_f_l"]),
    (128, 30, 256, ["cast_to_act", "gemm_tc_nt_h_u"], ["cast_to_act", "gemm_tc_tn_f_u"]),
])
def test_linear_on_tensor_cores_reads_a_float32_input_without_a_cast(
        opencl, monkeypatch, rows, features, outputs, forward, weight_gradient):
    """Under autocast on tensor cores (132 compute units) the first layer's products read the
    float32 input themselves: no cast_to_act, no float16 copy of it, where both products have
    such a kernel and the input is small (netcl._TC_FLOAT_INPUT_MAX); elsewhere the input is
    cast for each product, and the forward's cast is not kept for backward. The launches are
    recorded, not run."""
    for name, value in (("_tensor_cores", True), ("compute_units", 132), ("gemm", "tiled")):
        monkeypatch.setattr(opencl, name, value)
    launched = []
    monkeypatch.setattr(opencl, "launch", lambda name, *args, **kwargs: launched.append(name))
    x = netcl.Tensor.empty((rows, features), np.float32, opencl.queue)
    layer = nn.Linear(features, outputs, queue=opencl.queue)
    netcl.optim.AdamW(layer.parameters())  # which keeps the weight's float16 copy
    with netcl.Tape(), netcl.autocast():  # the first forward makes that copy
        layer(x)
    launched.clear()
    gc.collect()  # an earlier test's garbage, freed during this one, would make held negative
    in_use = opencl.pool.in_use_bytes
    with netcl.Tape() as tape, netcl.autocast():
        out = layer(x)
        loss = out.sum()
    assert out.dtype == np.float16
    assert launched[:len(forward)] == forward and launched[len(forward)] == "sum_rows"
    held = opencl.pool.in_use_bytes - in_use  # out and loss: no float16 copy of x
    assert held == netcl._bucket(out.value.nbytes) + netcl._bucket(4)
    launched.clear()
    tape.backward(loss)
    # (the sum's backward casts the gradient of the float16 output first)
    assert launched[:3] == ["expand_axis", "expand_axis", "cast_to_act"]
    assert [name for name in launched[3:] if name.startswith(("gemm", "cast"))] == \
        weight_gradient


@pytest.mark.parametrize("stride", [1, 2])
def test_autocast_conv2d_takes_winograd_before_the_tensor_cores(opencl, monkeypatch, stride):
    """Under autocast on a device with tensor cores (132 compute units), conv2d of a float16
    input by 3x3 filters at stride 1 runs Winograd's kernels (in the float32 build: they read
    either storage), all three products, with no columns and no tensor-core product; at
    stride 2 it keeps the tensor cores' columns and products. The launches are recorded, not
    run."""
    for name, value in (("_tensor_cores", True), ("compute_units", 132), ("gemm", "tiled")):
        monkeypatch.setattr(opencl, name, value)
    launched = []
    monkeypatch.setattr(opencl, "launch", lambda name, *args, **kwargs:
                        launched.append((name, kwargs.get("half", False))))
    x = netcl.Parameter(netcl.Tensor.empty((8, 16, 12, 12), np.float16, opencl.queue))
    w, b = (netcl.Parameter(netcl.Tensor.empty(shape, queue=opencl.queue))
            for shape in ((32, 16, 3, 3), (32,)))
    with netcl.Tape() as tape, netcl.autocast():
        out = F.conv2d(x, w, b, stride=stride, padding=1)
    assert out.dtype == np.float16
    tape.backward(out, grad=netcl.Tensor.empty(out.shape, np.float16, opencl.queue))
    names = [name for name, _ in launched]
    winograd = [(name, half) for name, half in launched if name.startswith("conv_winograd")]
    if stride == 1:
        # the input gradient reads the seed, which backward widens to float32, rounded
        assert winograd == [("conv_winograd_32x32", False), ("conv_winograd_32x32_r", False),
                            ("conv_winograd_wgrad_64x32", False)]
        assert not any(name.startswith(("gemm", "im2col", "col2im")) for name in names)
    else:
        assert winograd == [] and any(name.startswith("gemm_tc") for name in names)
        assert any(name.startswith("im2col") for name in names)


@pytest.mark.parametrize("layout, m, n, k", [
    ("nt", 64, 288, 8192),    # a convolution's weight gradient: few blocks, long K, split
    ("nn", 4096, 2048, 10),   # the gradient through a 10-class layer: unaligned rows
    ("tn", 4096, 2050, 64),   # a weight gradient of unaligned width
])
def test_tensor_core_gemm_split_and_unaligned_shapes(opencl, layout, m, n, k):
    """The products of training that take split-K or the gathering kernels."""
    dev = _tensor_core_device(opencl)
    rng = np.random.default_rng(m + n + k)
    a = rng.standard_normal((m, k)).astype(np.float16)
    b = rng.standard_normal((k, n)).astype(np.float16)
    A = tensor(a.T.copy() if layout == "tn" else a, dev)
    B = tensor(b.T.copy() if layout == "nt" else b, dev)
    out = netcl.Tensor.empty((m, n), np.float32, dev.queue)
    assert netcl._tensor_core_gemm(A, B, layout == "tn", layout == "nt", None, out)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    bound = k * 2.0 ** -23 * (np.abs(a).astype(np.float64) @ np.abs(b))
    assert (np.abs(host(out) - exact) <= bound).all()


@pytest.mark.parametrize("a_batch, b_batch", [(3, 3), (None, 3), (3, None)])
@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
def test_tensor_core_gemm_batched(opencl, layout, a_batch, b_batch):
    """A batch of products in one launch; a matrix shared by the batch has no batch axis."""
    dev = _tensor_core_device(opencl)
    rng = np.random.default_rng(11)
    m, k, n = 72, 40, 56
    a = rng.standard_normal(((a_batch,) if a_batch else ()) + (m, k)).astype(np.float16)
    b = rng.standard_normal(((b_batch,) if b_batch else ()) + (k, n)).astype(np.float16)
    A = tensor(np.swapaxes(a, -1, -2).copy() if layout == "tn" else a, dev)
    B = tensor(np.swapaxes(b, -1, -2).copy() if layout == "nt" else b, dev)
    out = netcl.Tensor.empty((3, m, n), np.float32, dev.queue)
    assert netcl._tensor_core_gemm(A, B, layout == "tn", layout == "nt", None, out)
    exact = np.matmul(a.astype(np.float64), b.astype(np.float64))
    bound = k * 2.0 ** -23 * np.matmul(np.abs(a).astype(np.float64), np.abs(b))
    assert (np.abs(host(out) - exact) <= bound).all()


def test_tensor_core_training_step_matches_float32(opencl):
    """linear forward and backward on tensor cores: the gradients of an MLP are those of the
    float32 step within float16 rounding of the gradients. Input and weights hold values that
    float16 represents, so both steps see the same pre-activations: rounding the weights would
    otherwise flip the ReLU of the ones within a rounding of 0, a few per thousand, and move
    the first layer's gradients by percents."""
    dev = _tensor_core_device(opencl)
    rng = np.random.default_rng(5)
    x = tensor(rng.standard_normal((256, 64)).astype(np.float16).astype(np.float32), dev)
    y = rng.integers(0, 16, 256)
    model = _mlp(dev, (64, 128, 16), seed=1)
    model.load_state_dict({name: value.astype(np.float16).astype(np.float32)
                           for name, value in model.state_dict().items()})
    grads = {}
    for enabled in (False, True):
        for p in model.parameters():
            p.grad = None
        with netcl.Tape() as tape, netcl.autocast(enabled=enabled):
            # summed, as a loss scale would make it: float16 gradients of a mean over 256
            # samples would sit among float16's subnormals
            loss = F.cross_entropy(model(x), y, reduction="sum")
        tape.backward(loss)
        grads[enabled] = [host(p.grad) for p in model.parameters()]
    for g16, g32 in zip(grads[True], grads[False]):
        assert g16.dtype == np.float32 and _relative_error(g16, g32) < 1e-2


@pytest.mark.parametrize("x_dtype", [np.float32, np.float16])
def test_tensor_core_conv2d_matches_float32(opencl, x_dtype):
    """conv2d under autocast on tensor cores (im2col columns and filters in float16): output
    and gradients are the float32 ones within float16 rounding, on float16-representable
    input and filters; for an input in either storage (its gradient in its storage, from
    float16 input-gradient columns)."""
    dev = _tensor_core_device(opencl)
    rng = np.random.default_rng(6)
    arrays = [rng.standard_normal((4, 8, 9, 7)), rng.standard_normal((16, 8, 3, 3)) / 8,
              rng.standard_normal(16)]
    arrays = [a.astype(np.float16).astype(np.float32) for a in arrays]
    seed = rng.standard_normal((4, 16, 9, 4)).astype(np.float16).astype(np.float32)
    results = {}
    for enabled in (False, True):
        leaves = [param(arrays[0], dev, x_dtype if enabled else None)] + [
            param(a, dev) for a in arrays[1:]]
        with netcl.Tape() as tape, netcl.autocast(enabled=enabled):
            out = F.conv2d(*leaves, stride=(1, 2), padding=1)
        tape.backward(out, grad=seed)
        results[enabled] = [host(out).astype(np.float32)] + [host(p.grad) for p in leaves]
    assert results[True][1].dtype == x_dtype
    for got, expected in zip(results[True], results[False]):
        assert _relative_error(got.astype(np.float32), expected) < 1e-2


@pytest.mark.parametrize("dx_dtype", [np.float16, np.float32])
def test_col2im_of_float16_columns_sums_what_col2im_of_float32_ones_does(opencl, dx_dtype):
    """col2im_act and col2im_act_f (the input gradient from the tensor cores' float16 columns,
    into float16 or float32 storage) sum the same values in the same order as col2im from
    the columns' float32 values: equal to its result, rounded where dx is float16. A strided,
    dilated, padded window, one matrix of columns per sample."""
    window = netcl._window("conv2d", (3, 4, 9, 8), (3, 2), (2, 1), (2, 1), (2, 3))
    H, W, R, S, SH, SW, PH, PW, DH, DW, OH, OW = window
    N, C, L = 3, 4, OH * OW
    cols = np.random.default_rng(9).standard_normal((N, C * R * S, L)).astype(np.float16)
    results = {}
    for kernel, dtype, half in (("col2im", np.float32, False),
                                ("col2im_act" if dx_dtype == np.float16 else "col2im_act_f",
                                 np.float16, True)):
        dcols = tensor(cols, opencl, dtype)
        dx = netcl.Tensor.empty((N, C, H, W), dx_dtype if half else np.float32, opencl.queue)
        opencl.launch(kernel, (N * H * W, C), (256, 1), 0, N, C, *window,
                      *netcl._cols_strides(dcols.shape, L), dcols.data, dx.data, half=half)
        results[kernel] = host(dx)
    single, other = results.pop("col2im"), results.popitem()[1]
    assert other.dtype == dx_dtype
    np.testing.assert_array_equal(other, single.astype(dx_dtype))
    assert np.abs(single).sum() > 0


@pytest.mark.parametrize("ones", [False, True])
def test_im2col_of_a_float32_input_into_float16_columns_rounds_it(opencl, ones):
    """im2col_act_f (the tensor cores' columns of a float32 input, with no float16 copy of it
    first) writes im2col's float32 columns rounded to float16, and with `ones` the row of
    ones after the taps. A strided, dilated, padded window, the samples side by side."""
    window = netcl._window("conv2d", (3, 4, 9, 8), (3, 2), (2, 1), (2, 1), (2, 3))
    x = tensor(np.random.default_rng(4).standard_normal((3, 4, 9, 8)), opencl)
    single = host(netcl._im2col(x, 0, 3, window, ones=ones))
    half = host(netcl._im2col(x, 0, 3, window, tensor_cores=True, ones=ones))
    assert single.shape == half.shape == (4 * 3 * 2 + ones, 3 * window[-2] * window[-1])
    assert half.dtype == np.float16
    np.testing.assert_array_equal(half, single.astype(np.float16))
    assert np.abs(single).sum() > 0 and (single[-1] == 1).all() == ones


def test_adam_keeps_the_float16_copy_of_its_parameters(opencl):
    """Once made (the first autocast forward on tensor cores asks for it), the float16 copy
    of Adam's flat parameters is written by the update kernel itself: after steps, a skipped
    step and a load_state_dict it is always the parameters rounded to nearest even."""
    model = _digits_mlp(opencl, hidden=32, seed=4)
    opt = netcl.AdamW(model.parameters(), lr=1e-2)
    copies = opt._flat.half_copies()
    x = tensor(np.random.default_rng(7).standard_normal((16, 64)), opencl)

    def check(weights_only=False):
        for p, copy in zip(model.parameters(), copies):
            if p.value.ndim == 2 or not weights_only:
                np.testing.assert_array_equal(host(copy), host(p).astype(np.float16))
    for scale in (1.0, 1.0, math.inf):  # the last step is skipped: an inf gradient
        with netcl.Tape() as tape, netcl.autocast():
            loss = F.cross_entropy(model(x), np.arange(16) % 10)
        opt.zero_grad()
        tape.backward(loss, grad=np.float32(scale))
        opt.step(max_norm=1.0)
        check()
    state = {name: value + 0.5 for name, value in model.state_dict().items()}
    model.load_state_dict(state)
    with netcl.autocast():
        model(x)  # on tensor cores the forward rounds the changed weights (not biases) again
    if opencl.tensor_cores:
        check(weights_only=True)
    for p in model.parameters():
        netcl._half_weight(p)
    check()


def test_a_failed_tensor_core_probe_falls_back_to_the_portable_build(opencl, monkeypatch):
    """A tensor-core build that fails, or a probe that computes a wrong product, leaves the
    device with the portable float16 build and no tensor cores, silently."""
    real_build = opencl._build_program

    def build(half, tensor_cores=False):
        if tensor_cores:
            raise RuntimeError("building kernels.cl failed: ptxas error")
        return real_build(half)
    for patch in ({"_build_program": build},
                  {"_build_program": lambda half, tensor_cores=False: real_build(half),
                   "_probe_tensor_cores": lambda kernels: False}):
        monkeypatch.setattr(opencl, "_half_kernels", None)
        monkeypatch.setattr(opencl, "_tensor_cores", None)  # as on a device not yet probed
        for name, value in patch.items():
            monkeypatch.setattr(opencl, name, value)
        assert opencl.tensor_cores is False
        kernels = opencl._half_program()
        assert "gemm_nt" in kernels and not any(name.startswith("gemm_tc") for name in kernels)
        x, w = tensor(np.ones((3, 8)), opencl), tensor(np.ones((2, 8)), opencl)
        a16 = netcl.Tensor.from_host(np.ones((3, 8), np.float16), opencl.queue)
        w16 = netcl.Tensor.from_host(np.ones((8, 2), np.float16), opencl.queue)
        assert not netcl._tensor_core_gemm(a16, w16, False, False, None,
                                           netcl.Tensor.empty((3, 2), np.float32, opencl.queue))
        np.testing.assert_array_equal(host(F.linear(x, w)), np.full((3, 2), 8.0))


# --- AMPGradScaler against PyTorch ------------------------------------------------------------

class _GradScalerReference:
    """torch/amp/grad_scaler.py's GradScaler, as PyTorch computes it (float32 tensors):
    scale(loss) multiplies by the float32 scale, so backward of loss = sum(p * g) gives
    float32(scale * g); unscale_ multiplies by inv_scale = float32(1 / float64(scale)) and
    flags any non-finite value (_amp_foreach_non_finite_check_and_unscale_); update is
    _amp_update_scale_: the float32 scale times the (double) factor, narrowed to float32,
    and growth only when that is finite."""

    def __init__(self, init_scale, growth_factor, backoff_factor, growth_interval):
        self.scale, self.growth_tracker = np.float32(init_scale), 0
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval

    def scaled_grads(self, grads):
        with np.errstate(over="ignore", invalid="ignore"):
            return [g * self.scale for g in grads]

    def unscale(self, grads):
        inv_scale = np.float32(1.0 / np.float64(self.scale))
        found_inf = not all(np.isfinite(g).all() for g in grads)
        with np.errstate(over="ignore", invalid="ignore"):
            return [g * inv_scale for g in grads], found_inf

    def update(self, found_inf):
        with np.errstate(over="ignore"):
            if found_inf:
                self.scale = np.float32(np.float64(self.scale) * self.backoff_factor)
                self.growth_tracker = 0
            elif self.growth_tracker + 1 == self.growth_interval:
                grown = np.float32(np.float64(self.scale) * self.growth_factor)
                if np.isfinite(grown):
                    self.scale = grown
                self.growth_tracker = 0
            else:
                self.growth_tracker += 1


def _clip_reference(grads, max_norm):
    """clip_grad_norm_ in float64 on float32 gradients."""
    coef = min(max_norm / (_total_norm_reference(grads) + 1e-6), 1.0)
    return [g.astype(np.float64) * coef for g in grads]


def _scaled_backward(scaler, params, grads):
    """backward of scaler.scale(sum(p * g)) with the scaler applied after the Tape closed, as
    the Trainer does: every p.grad becomes float32(scale * g)."""
    with netcl.Tape() as tape:
        loss = sum(((p * g).sum() for p, g in zip(params, grads)), start=0.0)
    tape.backward(scaler.scale(loss))


def _moments(opt, kind):
    """{parameter index: [arrays of its optimizer state]} (Adam's step count first)."""
    keys = ["momentum_buffer"] if kind == "sgd" else ["step", "exp_avg", "exp_avg_sq"]
    return {i: [np.asarray(s[key]) for key in keys] for i, s in opt.state_dict()["state"].items()}


AMP_MODES = {"sgd": ["step", "unscale_step", "unscale_clip_step"],
             "adam": ["step", "step_max_norm", "unscale_step", "unscale_clip_step"]}


AMP_MODES["adamw"] = AMP_MODES["adam"]


AMP_HYPER = {"sgd": {"momentum": 0.9, "weight_decay": 0.01, "nesterov": False},
             "adam": {"weight_decay": 0.01}, "adamw": {"weight_decay": 0.05}}


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
@TRAINING_SETTINGS
@given(data=st.data(), shapes=SHAPES, seed=st.integers(0, 2**31 - 1))
def test_scaler_trajectory_matches_pytorch(backend, kind, data, shapes, seed):
    """Steps with random finite, inf and NaN gradients: the scale and growth tracker follow
    PyTorch's exactly; unscale_ leaves exactly PyTorch's unscaled gradients; a skipped step
    leaves parameters and moments bit-identical (Adam's step count too); applied steps follow
    the optimizer's reference on the applied gradients."""
    init_scale = data.draw(st.sampled_from([1.0, 3.0, 65536.0, 2.0 ** 120]), "init_scale")
    growth_factor = data.draw(st.sampled_from([2.0, 1.5, 4.0]), "growth_factor")
    backoff_factor = data.draw(st.sampled_from([0.5, 0.25, 0.75]), "backoff_factor")
    growth_interval = data.draw(st.integers(1, 3), "growth_interval")
    steps, max_norm, lr = 8, 1.0, 0.01
    poison = data.draw(st.lists(st.sampled_from([None, None, np.inf, -np.inf, np.nan]),
                                min_size=steps, max_size=steps), "poison")
    modes = data.draw(st.lists(st.sampled_from(AMP_MODES[kind]), min_size=steps, max_size=steps),
                      "modes")
    rng = np.random.default_rng(seed)
    initial = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads_per_step = [[(rng.standard_normal(s) * 10.0 ** rng.uniform(-2, 1)).astype(np.float32)
                       for s in shapes] for _ in range(steps)]
    for grads, bad in zip(grads_per_step, poison):
        if bad is not None:
            target = grads[rng.integers(len(grads))]
            target.reshape(-1)[rng.integers(target.size)] = bad
    hyper = AMP_HYPER[kind]
    params = [param(p, backend) for p in initial]
    opt = _make(kind, params, lr, hyper)
    scaler = netcl.AMPGradScaler(init_scale, growth_factor, backoff_factor, growth_interval)
    reference = _GradScalerReference(init_scale, growth_factor, backoff_factor, growth_interval)
    applied = []  # the gradients each applied step used, unscaled (and clipped), float64
    for step, (grads, mode) in enumerate(zip(grads_per_step, modes)):
        context = f"{kind} step {step + 1} {mode}, poison {poison[step]}"
        before = [host(p) for p in params], _moments(opt, kind)
        opt.zero_grad()
        _scaled_backward(scaler, params, grads)
        unscaled, found_inf = reference.unscale(reference.scaled_grads(grads))
        if mode.startswith("unscale"):
            scaler.unscale_(opt)
            for p, expected in zip(params, unscaled):
                np.testing.assert_array_equal(host(p.grad), expected, err_msg=context)
        if mode == "unscale_clip_step":
            netcl.clip_grad_norm(params, max_norm)
        if mode == "step_max_norm":
            scaler.step(opt, max_norm=max_norm)
        else:
            scaler.step(opt)
        scaler.update()
        reference.update(found_inf)
        assert scaler.get_scale() == float(reference.scale), context
        assert scaler.state_dict()["_growth_tracker"] == reference.growth_tracker, context
        if found_inf:
            for old, p in zip(before[0], params):
                np.testing.assert_array_equal(host(p), old, err_msg=context)
            moments = _moments(opt, kind)
            for i, old in before[1].items():
                for a, b in zip(old, moments[i]):
                    np.testing.assert_array_equal(a, b, err_msg=context)
            for i in set(moments) - set(before[1]):  # SGD on OpenCL: zero buffers, see SGD.step
                assert not any(a.any() for a in moments[i]), context
            continue
        clip = mode in ("unscale_clip_step", "step_max_norm")
        applied.append(_clip_reference(unscaled, max_norm) if clip else
                       [g.astype(np.float64) for g in unscaled])
        if kind == "sgd":
            expected = _sgd_reference(initial, applied, [lr] * len(applied), **hyper)[-1]
        else:
            expected = _adam_reference(initial, applied, [lr] * len(applied),
                                       decoupled=kind == "adamw", **hyper)[-1]
            assert _moments(opt, kind)[0][0] == len(applied), context  # the step count
        for p, e in zip(params, expected):
            np.testing.assert_allclose(host(p), e, rtol=5e-6, atol=5e-6, err_msg=context)


def test_scaler_growth_stops_short_of_inf(backend):
    """As aten's _amp_update_scale_: a grown scale that would be inf is not taken, and the
    growth tracker restarts all the same."""
    p, opt, _ = _scaler_setup(backend)
    scaler = netcl.AMPGradScaler(init_scale=2.0 ** 125, growth_interval=1)
    for expected in (2.0 ** 126, 2.0 ** 127, 2.0 ** 127):
        opt.zero_grad()
        _scaled_backward(scaler, [p], [np.full(3, 1e-3, np.float32)])
        scaler.step(opt)
        scaler.update()
        assert scaler.state_dict()["scale"] == expected and \
            scaler.state_dict()["_growth_tracker"] == 0


def test_backward_from_a_scaled_loss_seeds_the_loss_with_the_scale(backend):
    """From the implicit seed 1, backward through scaler.scale(loss) starts at the loss, its
    gradient the scale tensor itself (no kernel, no copy): the gradients an explicit seed 1
    gives through the scaling's own backward, bit for bit, for a loss a Tape recorded and for
    a leaf. The graph is freed all the same."""
    g = np.random.default_rng(43).standard_normal((3, 4)).astype(np.float32)
    launches, grads = {}, {}
    for seed in ("implicit", "explicit"):
        p, leaf = param(np.ones((3, 4)), backend), param([2.5], backend)
        scaler = netcl.AMPGradScaler(init_scale=3.0)
        with netcl.Tape() as tape:
            loss = (p * g).sum()
        scaled, scaled_leaf = scaler.scale(loss), scaler.scale(leaf)
        assert host(scaled) == host(loss) * 3.0 and host(scaled_leaf) == [7.5]  # values made
        before = backend.launches
        if seed == "implicit":
            tape.backward(scaled)
            tape.backward(scaled_leaf)
        else:
            tape.backward(scaled, grad=np.ones((), np.float32))
            tape.backward(scaled_leaf, grad=np.ones(1, np.float32))
        launches[seed], grads[seed] = backend.launches - before, (host(p.grad), host(leaf.grad))
        for node in (scaled, scaled_leaf):
            with raises_naming(RuntimeError, "already freed"):
                tape.backward(node)
    np.testing.assert_array_equal(grads["implicit"][0], 3.0 * g)
    np.testing.assert_array_equal(grads["implicit"][1], [3.0])
    for a, b in zip(grads["implicit"], grads["explicit"]):
        np.testing.assert_array_equal(a, b)
    if backend.backend == "opencl":  # the explicit seeds' two times_scale kernels
        assert launches["implicit"] == launches["explicit"] - 2


@pytest.mark.parametrize("make_loss", [lambda x: x.reshape(()), lambda x: x,
                                       lambda x: F.sum(x * 1.0)])
def test_gradients_seeded_by_the_scale_do_not_share_its_memory(backend, make_loss):
    """The seed of a scaled loss is the scale tensor itself: gradients that reach a leaf
    unchanged (through a reshape, or the loss being the leaf) are copies, so a scale the
    scaler changes later (update, or a second backward's scale) leaves them as they were."""
    x = param([2.0], backend)
    scaler = netcl.AMPGradScaler(init_scale=8.0)
    with netcl.Tape() as tape:
        loss = make_loss(x)
    tape.backward(scaler.scale(loss))
    grad = x.grad
    np.testing.assert_array_equal(host(grad), [8.0])
    scaler.unscale_(netcl.SGD([x], lr=0.1))  # x.grad / 8, in place
    np.testing.assert_array_equal(host(x.grad), [1.0])
    scaler.update(new_scale=2.0)  # writes the scale tensor
    np.testing.assert_array_equal(host(scaler._scale), [2.0])
    np.testing.assert_array_equal(host(x.grad), [1.0])


@pytest.mark.usefixtures("portable_half")
def test_scaler_scales_a_float16_loss_and_takes_a_new_scale(opencl):
    p = param([1.0, 2.0], opencl)
    scaler = netcl.AMPGradScaler(init_scale=4.0)
    x = tensor(np.ones((1, 2), np.float32), opencl)
    with netcl.Tape() as tape, netcl.autocast():
        out = F.linear(x, F.reshape(p, (1, 2))).reshape(())
    assert out.dtype == np.float16
    scaled = scaler.scale(out)  # after the Tape closed, as the Trainer does
    assert scaled.dtype == np.float32 and float(scaled.value) == 12.0
    tape.backward(scaled)
    np.testing.assert_array_equal(host(p.grad), [4.0, 4.0])
    scaler.step(netcl.SGD([p], lr=0.0))
    scaler.update(new_scale=256.0)  # PyTorch's update(new_scale): the tracker is left as is
    assert scaler.state_dict() == {"scale": 256.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                   "growth_interval": 2000, "_growth_tracker": 0}


def _scaler_setup(dev, kind="sgd"):
    p = param(np.array([1.0, -2.0, 3.0], np.float32), dev)
    opt = netcl.SGD([p], lr=0.1) if kind == "sgd" else netcl.AdamW([p], lr=0.1)
    return p, opt, netcl.AMPGradScaler()


def test_scaler_call_order_errors_are_pytorch_s(backend):
    p, opt, scaler = _scaler_setup(backend)
    g = [np.array([0.5, 0.25, -1.0], np.float32)]
    calls = [(lambda: scaler.unscale_(opt), "unscale_"), (lambda: scaler.step(opt), "step"),
             (scaler.update, "update")]
    for call, name in calls:
        with raises_naming(RuntimeError, f"Attempted {name} but _scale is None"):
            call()
    _scaled_backward(scaler, [p], g)
    with raises_naming(RuntimeError, "No inf checks were recorded prior to update."):
        scaler.update()
    with raises_naming(RuntimeError, "Closure use is not currently supported"):
        scaler.step(opt, closure=lambda: None)
    scaler.unscale_(opt)
    with raises_naming(RuntimeError, "unscale_() has already been called on this optimizer "
                                     "since the last update()."):
        scaler.unscale_(opt)
    scaler.step(opt)
    with raises_naming(RuntimeError, "unscale_() is being called after step()."):
        scaler.unscale_(opt)
    with raises_naming(RuntimeError, "step() has already been called since the last update()."):
        scaler.step(opt)
    scaler.update()
    opt.zero_grad()  # a new iteration works again, once each
    _scaled_backward(scaler, [p], g)
    scaler.step(opt)
    scaler.update()
    np.testing.assert_allclose(host(p), [1.0 - 0.1, -2.0 - 0.05, 3.0 + 0.2], rtol=1e-6)


@pytest.mark.parametrize("kwargs, needle", [
    ({"growth_factor": 1.0}, "The growth factor must be > 1.0"),
    ({"backoff_factor": 1.0}, "The backoff factor must be < 1.0"),
    ({"growth_interval": 0}, "growth_interval"),
    ({"init_scale": -1.0}, "init_scale"),
])
def test_scaler_rejects_bad_arguments(kwargs, needle):
    with raises_naming(ValueError, needle):
        netcl.AMPGradScaler(**kwargs)
    netcl.AMPGradScaler(enabled=False, **kwargs)  # as PyTorch: a disabled scaler checks nothing


class _OwnStepSGD(netcl.SGD):
    """An SGD whose own step() reads nothing of the scaler's: it must not be called after an
    inf/NaN gradient."""

    def step(self):
        self.calls += 1
        return "stepped"


class _CountingStep:
    """A mixin whose step counts its calls, then runs the optimizer's own."""

    def step(self):
        self.calls += 1
        return super().step()


@pytest.mark.parametrize("kind", ["own step", "own step, wrapped", "own step, says it skips",
                                  "mixin first, says it skips", "says it skips below"])
def test_scaler_decides_on_the_host_for_a_subclass_with_its_own_step(backend, kind):
    """A subclass that overrides step() may not read the scaler's inf flag on the device: the
    scaler then calls it only after clean gradients and returns None otherwise, as PyTorch's
    _maybe_opt_step (in a DistributedOptimizer too, which answers for what it wraps). One that
    says `_skips_on_device = True` again, in the class of that step or in a class before it
    in the method order, is trusted (and SGD's own step then skips: parameters unchanged)."""
    if kind.startswith("own step") and kind != "own step, says it skips":
        cls = _OwnStepSGD
    elif kind == "own step, says it skips":
        class cls(_CountingStep, netcl.SGD):  # noqa: N801
            _skips_on_device = True

            def step(self):
                return super().step()
    elif kind == "mixin first, says it skips":
        class cls(_CountingStep, netcl.SGD):  # noqa: N801
            _skips_on_device = True
    else:
        class Counting(_CountingStep, netcl.SGD):
            pass

        class cls(Counting):  # noqa: N801
            _skips_on_device = True
    p = param(np.array([1.0, 2.0], np.float32), backend)
    opt = cls([p], lr=0.1)
    opt.calls = 0
    if kind == "own step, wrapped":
        opt = netcl.DistributedOptimizer(opt)  # one rank: it passes calls through
    scaler = netcl.AMPGradScaler(init_scale=2.0 ** 120)
    opt.zero_grad()
    _scaled_backward(scaler, [p], [np.array([2.0 ** 10, 1.0], np.float32)])  # 2**130: inf
    result = scaler.step(opt)
    scaler.update()
    np.testing.assert_array_equal(host(p), [1.0, 2.0])
    assert scaler.get_scale() == 2.0 ** 119
    trusted = "says it skips" in kind
    if trusted:
        assert opt.calls == 1  # called; skipped on the device
    else:
        assert result is None and opt.calls == 0
    opt.zero_grad()
    _scaled_backward(scaler, [p], [np.array([1.0, 1.0], np.float32)])
    result = scaler.step(opt)
    scaler.update()
    assert opt.calls == (2 if trusted else 1)
    if trusted:
        np.testing.assert_allclose(host(p), [0.9, 1.9], rtol=1e-6)
    else:
        assert result == "stepped"


def test_scaler_decides_on_the_host_for_a_step_set_on_the_instance(backend):
    """A step function set on an SGD instance may not read the inf flag either."""
    p = param(np.array([1.0, 2.0], np.float32), backend)
    opt = netcl.SGD([p], lr=0.1)
    calls = []
    opt.step = lambda: calls.append(1)
    scaler = netcl.AMPGradScaler(init_scale=2.0 ** 120)
    _scaled_backward(scaler, [p], [np.array([2.0 ** 10, 1.0], np.float32)])
    assert scaler.step(opt) is None and not calls
    scaler.update()


def test_scaler_scales_a_list_or_tuple_of_losses(backend):
    """scale() of (nested) lists and tuples gives the same structure of scaled losses, as
    PyTorch's apply_scale; each backward then gives scale times its gradient."""
    p = param(np.array([1.0, 2.0], np.float32), backend)
    scaler = netcl.AMPGradScaler(init_scale=4.0)
    with netcl.Tape() as tape:
        losses = [(p * 1.0).sum(), ((p * 2.0).sum(), [(p * p).sum()])]
    scaled = scaler.scale(losses)
    assert isinstance(scaled, list) and isinstance(scaled[1], tuple)
    assert isinstance(scaled[1][1], list) and len(scaled[1][1]) == 1
    for loss, expected in ((scaled[0], 12.0), (scaled[1][0], 24.0), (scaled[1][1][0], 20.0)):
        assert float(host(loss)) == expected
    p.grad = None
    tape.backward(scaled[1][1][0])
    np.testing.assert_array_equal(host(p.grad), [8.0, 16.0])  # 4 * 2p
    assert netcl.AMPGradScaler(enabled=False).scale(losses) is losses


def test_scaler_step_without_gradients_is_an_error(backend):
    """PyTorch asserts that step() found gradients to check ("No inf checks were recorded for
    this optimizer."): a step with none is a loop that forgot its backward."""
    p = param(np.array([1.0, 2.0], np.float32), backend)
    opt = netcl.AdamW([p], lr=0.1)
    scaler = netcl.AMPGradScaler()
    _scaled_backward(scaler, [param(np.zeros(2), backend)], [np.ones(2, np.float32)])
    opt.zero_grad()
    with raises_naming(RuntimeError, "No inf checks were recorded for this optimizer"):
        scaler.step(opt)
    np.testing.assert_array_equal(host(p), [1.0, 2.0])


def test_scaler_settings_can_be_read_and_set(backend):
    """PyTorch's getters and setters: is_enabled, get/set_growth_factor, _backoff_factor,
    _growth_interval. A new growth interval and factor take effect at the next update(), and
    bad values are refused with the constructor's errors, changing nothing."""
    p, opt, _ = _scaler_setup(backend, "adamw")
    scaler = netcl.AMPGradScaler(init_scale=8.0)
    assert scaler.is_enabled() and not netcl.AMPGradScaler(enabled=False).is_enabled()
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval()) == (2.0, 0.5, 2000)
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(2)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval()) == (4.0, 0.25, 2)
    g = [np.array([1.0, 2.0, 3.0], np.float32)]
    scales = []
    for _ in range(2):
        opt.zero_grad()
        _scaled_backward(scaler, [p], g)
        scaler.step(opt, max_norm=1.0)  # the fused step works out update() ahead of it
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == [8.0, 32.0]  # grown by 4 after 2 clean steps
    opt.zero_grad()
    _scaled_backward(scaler, [p], g)
    scaler.step(opt, max_norm=1.0)
    scaler.set_growth_interval(1)  # between step and update: the next update() takes it
    scaler.set_growth_factor(8.0)
    scaler.update()
    assert scaler.get_scale() == 256.0
    opt.zero_grad()
    _scaled_backward(scaler, [p], g)
    scaler.step(opt)  # not fused: update() waits for the next scale()
    scaler.update()
    scaler.set_growth_factor(2.0)  # after update(): that update grows by 8 all the same
    assert scaler.get_scale() == 2048.0
    scaler.set_growth_factor(8.0)
    for setter, value, needle in ((scaler.set_growth_factor, 1.0, "growth factor"),
                                  (scaler.set_backoff_factor, 1.5, "backoff factor"),
                                  (scaler.set_growth_interval, 0, "growth_interval")):
        with raises_naming(ValueError, needle):
            setter(value)
    assert scaler.state_dict()["growth_factor"] == 8.0
    assert scaler.state_dict()["growth_interval"] == 1


def test_disabled_scaler_passes_through(backend):
    rng = np.random.default_rng(16)
    initial, g = (rng.standard_normal(6).astype(np.float32) for _ in range(2))
    p, q = param(initial, backend), param(initial, backend)
    opt_p, opt_q = netcl.AdamW([p], lr=0.1), netcl.AdamW([q], lr=0.1)
    scaler = netcl.AMPGradScaler(enabled=False)
    assert scaler.get_scale() == 1.0 and isinstance(scaler.get_scale(), float)
    assert scaler.state_dict() == {}
    scaler.load_state_dict({"scale": 8.0})  # ignored
    with netcl.Tape() as tape:
        loss = (p * g).sum()
    assert scaler.scale(loss) is loss
    tape.backward(loss)
    scaler.unscale_(opt_p)
    np.testing.assert_array_equal(host(p.grad), g)
    scaler.step(opt_p, max_norm=0.5)  # passed through to AdamW.step
    scaler.update()
    _set_grads([q], [g])
    opt_q.step(max_norm=0.5)
    np.testing.assert_array_equal(host(p), host(q))


def test_scaler_state_dict_round_trip(backend):
    p, opt, scaler = _scaler_setup(backend, "adamw")
    scaler = netcl.AMPGradScaler(init_scale=1024.0, growth_interval=3)
    expected = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                "growth_interval": 3, "_growth_tracker": 0}
    assert scaler.state_dict() == expected  # before any scale(): the initial values
    g = [np.array([1.0, 2.0, 3.0], np.float32)]
    for _ in range(2):
        opt.zero_grad()
        _scaled_backward(scaler, [p], g)
        scaler.step(opt)
        scaler.update()
    state = scaler.state_dict()
    assert state == dict(expected, _growth_tracker=2)
    assert isinstance(state["scale"], float) and isinstance(state["_growth_tracker"], int)
    fresh, used = netcl.AMPGradScaler(), netcl.AMPGradScaler(init_scale=8.0)
    _scaled_backward(used, [param(np.zeros(3), backend)], g)  # its device state exists already
    for other in (fresh, used):
        other.load_state_dict(state)
        assert other.state_dict() == state
        other_p = param(np.zeros(3), backend)
        other_opt = netcl.SGD([other_p], lr=0.1)
        _scaled_backward(other, [other_p], g)
        other.step(other_opt)
        other.update()
        assert other.state_dict() == dict(expected, scale=2048.0)  # the third clean step grows
    with raises_naming(RuntimeError, "The source state dict is empty"):
        fresh.load_state_dict({})


def _amp_step(model, opt, scaler, x, y, path):
    with netcl.Tape() as tape, netcl.autocast():
        loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    tape.backward(scaler.scale(loss))
    if path == "fused":
        scaler.step(opt, max_norm=1.0)
    else:
        scaler.unscale_(opt)
        netcl.clip_grad_norm(opt.params, 1.0)
        scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("kind, path", [("adamw", "fused"), ("adamw", "unscale_clip"),
                                        ("sgd", "unscale_clip")])
def test_amp_step_makes_no_host_sync(opencl, kind, path):
    """The Trainer's mixed-precision step, both ways it clips: no host sync at all; only
    get_scale() reads the device."""
    model = _digits_mlp(opencl, hidden=32, seed=6)
    opt = netcl.AdamW(model.parameters(), lr=1e-3) if kind == "adamw" else \
        netcl.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = netcl.AMPGradScaler()
    rng = np.random.default_rng(17)
    x = tensor(rng.standard_normal((16, 64)).astype(np.float32), opencl)
    y = tensor(rng.integers(0, 10, 16).astype(np.int32), opencl)
    for _ in range(3):
        syncs = opencl.syncs
        _amp_step(model, opt, scaler, x, y, path)
        assert opencl.syncs == syncs
    assert scaler.get_scale() == 65536.0
    assert opencl.syncs == syncs + 1


def test_amp_optimizer_launches_do_not_grow_with_parameter_count(backend):
    """One pass over the flat gradients that unscales them and sums their squares, then the
    fused clip + step (adam_prepare, adam_step); update() runs in the next scale()'s kernel:
    three launches for 2 parameters as for 20."""
    counts = []
    for layers in (1, 10):
        model = _mlp(backend, (8,) * (layers + 1), seed=4)
        opt = netcl.AdamW(model.parameters(), lr=1e-3)
        scaler = netcl.AMPGradScaler()
        x = tensor(np.ones((2, 8), np.float32), backend)
        with netcl.Tape() as tape:
            loss = model(x).sum()
        tape.backward(scaler.scale(loss))
        launches = backend.launches
        scaler.step(opt, max_norm=1.0)
        scaler.update()
        counts.append(backend.launches - launches)
    assert counts == [0, 0] if backend.backend == "cpu" else counts == [3, 3]


def _clipping_step(model, opt, scaler, x, y, amp):
    """One step of the benchmarks' loop: AdamW clipping at 1.0, through the scaler if amp."""
    with netcl.Tape() as tape, netcl.autocast(enabled=amp):
        loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    if amp:
        tape.backward(scaler.scale(loss))
        scaler.step(opt, max_norm=1.0)
        scaler.update()
    else:
        tape.backward(loss)
        opt.step(max_norm=1.0)


@pytest.mark.parametrize("gemm", ["packed", "tiled"])
@pytest.mark.usefixtures("portable_half")
def test_an_autocast_step_launches_what_a_float32_step_does_and_one_more(opencl, monkeypatch,
                                                                         gemm):
    """Outside the matrix products (whose float16 operands cost packs or widening casts on
    the portable kernels, and nothing on tensor cores), an autocast step with a scaler and a
    clipping AdamW launches the float32 step's kernels, its norm pass being the one that
    unscales, and one more: the input's cast to float16 (which tensor cores do without, see
    test_linear_on_tensor_cores_reads_a_float32_input_without_a_cast). The scaler's update()
    runs in adam_prepare, the loss's scaled value is never read, the loss's gradient comes
    without a kernel, the logits' in float16 without a cast. And no host sync."""
    monkeypatch.setattr(opencl, "gemm", gemm)
    launched, in_product = [], [0]
    launch, gemm_product = opencl.launch, netcl._gemm

    def recording_launch(name, *args, **kwargs):
        if not in_product[0]:
            launched.append(name)
        return launch(name, *args, **kwargs)

    def product(*args, **kwargs):
        in_product[0] += 1
        try:
            return gemm_product(*args, **kwargs)
        finally:
            in_product[0] -= 1

    monkeypatch.setattr(opencl, "launch", recording_launch)
    monkeypatch.setattr(netcl, "_gemm", product)
    rng = np.random.default_rng(29)
    x = tensor(rng.standard_normal((16, 64)).astype(np.float32), opencl)
    y = rng.integers(0, 10, 16)
    counts = {}
    for amp in (False, True):
        model = _digits_mlp(opencl, hidden=32, seed=7)
        opt, scaler = netcl.AdamW(model.parameters(), lr=1e-3), netcl.AMPGradScaler()
        for _ in range(2):  # the first scale() has no update to run
            _clipping_step(model, opt, scaler, x, y, amp)
        launched.clear()
        syncs = opencl.syncs
        _clipping_step(model, opt, scaler, x, y, amp)
        assert opencl.syncs == syncs
        counts[amp] = Counter(launched)
    single, mixed = counts[False], counts[True]
    assert mixed - single == Counter({"cast_to_act": 1, "amp_unscale": 1})
    assert single - mixed == Counter({"norm_partials": 1})
    assert sum(mixed.values()) == sum(single.values()) + 1


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_scaler_step_unscales_in_the_pass_that_sums_the_squares_for_the_clip(backend, kind):
    """scaler.step(opt, max_norm=c) unscales the gradients in the pass that sums their squares
    for the clip: bit for bit the parameters, moments, step count and unscaled gradients of
    unscale_ then step(max_norm=c), whose norm is a pass of its own; and, to rounding, the
    parameters of unscale_, clip_grad_norm, step(). A step with an inf or a NaN gradient is
    skipped by each, bit for bit."""
    shapes = [(5, 7), (7,), (3, 5), (3,)]
    initial = [a.astype(np.float32) for a in map(np.random.default_rng(23).standard_normal,
                                                 shapes)]
    rng = np.random.default_rng(24)
    grads_per_step = [[(rng.standard_normal(s) * 10.0 ** rng.uniform(-1, 1)).astype(np.float32)
                       for s in shapes] for _ in range(6)]
    grads_per_step[3][1][2], grads_per_step[4][0][1, 3] = np.inf, np.nan
    runs = {}
    for path in ("fused", "unscale_first", "clip_grad_norm"):
        params = [param(p, backend) for p in initial]
        opt = _make(kind, params, 0.01, {"weight_decay": 0.01})
        scaler = netcl.AMPGradScaler(init_scale=1024.0, growth_interval=2)
        runs[path] = []
        for grads in grads_per_step:
            opt.zero_grad()
            _scaled_backward(scaler, params, grads)
            if path == "fused":
                scaler.step(opt, max_norm=1.0)
            else:
                scaler.unscale_(opt)
                if path == "clip_grad_norm":
                    netcl.clip_grad_norm(params, 1.0)
                    scaler.step(opt)
                else:
                    scaler.step(opt, max_norm=1.0)
            scaler.update()
            runs[path].append(([host(p) for p in params], [host(p.grad) for p in params],
                               _moments(opt, kind)))
        runs[path].append(scaler.state_dict())
    fused, split, recipe = runs["fused"], runs["unscale_first"], runs["clip_grad_norm"]
    assert fused[-1] == split[-1] == recipe[-1] and fused[-1]["scale"] == 512.0
    for step, ((p_f, g_f, m_f), (p_s, g_s, m_s), (p_r, _, m_r)) in enumerate(
            zip(fused[:-1], split[:-1], recipe[:-1])):
        for a, b, c in zip(p_f, p_s, p_r):
            np.testing.assert_array_equal(a, b, err_msg=f"step {step}")
            np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
        for a, b in zip(g_f, g_s):
            np.testing.assert_array_equal(a, b, err_msg=f"step {step}")
        for i in m_f:
            for a, b, c in zip(m_f[i], m_s[i], m_r[i]):
                np.testing.assert_array_equal(a, b, err_msg=f"step {step}")
                np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
        if step in (3, 4):  # skipped: what the step before left, step count included
            for a, b in zip(p_f, fused[step - 1][0]):
                np.testing.assert_array_equal(a, b, err_msg=f"step {step}")
            assert m_f[0][0] == 3
    assert fused[-2][2][0][0] == 4  # the step count: applied steps only


def test_scaler_overflow_skips_the_fused_step_and_backs_off(backend):
    """Scaled gradients that overflow float32: the fused unscale + clip + step leaves the
    parameters, the moments and the step count bit-identical, the gradients unscaled (inf
    where they overflowed), and the scale backs off; the next step applies."""
    rng = np.random.default_rng(27)
    initial = [rng.standard_normal(s).astype(np.float32) for s in ((4, 3), (3,))]
    params = [param(p, backend) for p in initial]
    opt = netcl.AdamW(params, lr=1e-2)
    scaler = netcl.AMPGradScaler(init_scale=2.0 ** 120)
    grads = [np.full((4, 3), 1e-3, np.float32), np.array([2.0 ** 10, 1.0, -1.0], np.float32)]
    opt.zero_grad()
    _scaled_backward(scaler, params, grads)  # 2**130: inf; the others stay finite
    scaler.step(opt, max_norm=1.0)
    scaler.update()
    for p, old in zip(params, initial):
        np.testing.assert_array_equal(host(p), old)
    reference = _GradScalerReference(2.0 ** 120, 2.0, 0.5, 2000)
    unscaled, found_inf = reference.unscale(reference.scaled_grads(grads))
    assert found_inf and np.isinf(unscaled[1][0])
    for p, expected in zip(params, unscaled):
        np.testing.assert_array_equal(host(p.grad), expected)
    for step, exp_avg, exp_avg_sq in _moments(opt, "adamw").values():
        assert step == 0 and not exp_avg.any() and not exp_avg_sq.any()
    assert scaler.get_scale() == 2.0 ** 119
    opt.zero_grad()
    _scaled_backward(scaler, params, [g / 2.0 ** 10 for g in grads])
    scaler.step(opt, max_norm=1.0)
    scaler.update()
    assert _moments(opt, "adamw")[0][0] == 1
    assert not np.array_equal(host(params[0]), initial[0])


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("where", [0, 7, 8, 517, 1000, 1002])
def test_scaler_finds_one_inf_wherever_it_is(backend, fused, where):
    """One inf in a gradient of 1003 values is found wherever it sits: at a vector lane, the
    last lane of a run, a run's tail (CPU devices read runs of float8, kernels.cl: cpu_run),
    or the last element. The step is skipped and the scale backs off; without the inf the
    unscaled gradient is g exactly (a power-of-two scale)."""
    g = np.random.default_rng(where).standard_normal(1003).astype(np.float32)
    for bad in (False, True):
        p = param(np.zeros(1003), backend)
        opt = netcl.optim.AdamW([p], lr=0.1)
        scaler = netcl.AMPGradScaler(init_scale=256.0)
        grad = g.copy()
        if bad:
            grad[where] = np.inf
        _scaled_backward(scaler, [p], [grad])
        if fused:
            scaler.step(opt, max_norm=1.0)
        else:
            scaler.unscale_(opt)
            np.testing.assert_array_equal(host(p.grad), grad)
            scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == (128.0 if bad else 256.0)
        assert (host(p) == 0).all() == bad


def test_fused_clip_skips_a_norm_that_overflows_without_backing_off(backend):
    """Finite gradients whose sum of squares overflows float32: the clip's norm is inf, so
    the fused step skips (bit-identical parameters, as when unscale_ came first), while the
    inf check found nothing, so the scale does not back off."""
    for unscale_first in (False, True):
        p = param(np.ones(4, np.float32), backend)
        opt, scaler = netcl.AdamW([p], lr=0.1), netcl.AMPGradScaler(init_scale=4.0)
        _scaled_backward(scaler, [p], [np.full(4, 1e20, np.float32)])
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt, max_norm=1.0)
        scaler.update()
        np.testing.assert_array_equal(host(p), np.ones(4, np.float32))
        np.testing.assert_array_equal(host(p.grad), np.full(4, 1e20, np.float32))
        assert scaler.state_dict()["scale"] == 4.0 and scaler.state_dict()["_growth_tracker"] == 1
        assert _moments(opt, "adamw")[0][0] == 0


def test_a_scaled_loss_read_late_is_the_loss_times_its_own_scale(backend, monkeypatch):
    """scale(loss)'s value may be made only when it is read (no launch in a loop that never
    reads it); read steps later, after update() has grown the scale every step, each is its
    loss times the scale it was scaled with. A fused step runs update()'s work in
    adam_prepare: after the first step, no kernel of the scaler's own runs."""
    p = param(np.ones(3), backend)
    opt = netcl.AdamW([p], lr=0.1)
    scaler = netcl.AMPGradScaler(init_scale=8.0, growth_interval=1)  # doubles every step
    launched = []
    if backend.backend == "opencl":
        launch = backend.launch
        monkeypatch.setattr(backend, "launch", lambda name, *args, **kwargs: (
            launched.append(name), launch(name, *args, **kwargs))[1])
    kept = []
    for step in range(4):
        opt.zero_grad()
        with netcl.Tape() as tape:
            loss = (p * np.array([1.0, 2.0, 3.0], np.float32)).sum()
        scaled = scaler.scale(loss)
        kept.append((scaled, float(host(loss))))
        tape.backward(scaled)
        scaler.step(opt, max_norm=1.0)
        scaler.update()
        if step == 0:
            launched.clear()
    assert not {"amp_update_scale", "amp_update_then_scale"} & set(launched)
    assert scaler.get_scale() == 8.0 * 2 ** 4
    for step, (scaled, value) in enumerate(kept):
        assert host(scaled) == np.float32(value) * np.float32(8.0 * 2 ** step), step


@pytest.mark.parametrize("make_loss", ["reshape", "leaf"])
@pytest.mark.parametrize("kind", ["sgd", "adam", "adam_clip"])
def test_a_scaled_loss_sharing_memory_with_a_parameter_keeps_its_value(backend, make_loss,
                                                                         kind):
    """A loss that is a view of a parameter (or the parameter itself) changes when the step
    updates it; its scaled value, read after the step, is still the loss before the step
    times the scale, as PyTorch's (computed at scale())."""
    p = param([2.0], backend)
    opt = netcl.SGD([p], lr=1.0) if kind == "sgd" else netcl.AdamW([p], lr=1.0)
    scaler = netcl.AMPGradScaler(init_scale=4.0)
    with netcl.Tape() as tape:
        loss = p.reshape(()) if make_loss == "reshape" else p
    scaled = scaler.scale(loss)
    tape.backward(scaled)
    scaler.step(opt, **({"max_norm": 1.0} if kind == "adam_clip" else {}))
    scaler.update()
    assert host(p)[0] != 2.0 and float(host(scaled).reshape(-1)[0]) == 8.0


def test_a_scaled_float64_loss_is_float64_on_the_numpy_backend(cpu):
    """The scaled loss's dtype is its value's: float64 for a float64 loss on NumPy."""
    x = param(np.array([1.5, 2.0]), cpu, dtype=np.float64)
    with netcl.Tape():
        loss = (x * x).sum()
    scaled = netcl.AMPGradScaler(init_scale=4.0).scale(loss)
    assert scaled.dtype == host(scaled).dtype == np.float64 and host(scaled) == 25.0


def _scaler_read(scaler, read):
    """What `read` ("none", "get_scale", "state_dict") sees of the scaler."""
    return None if read == "none" else getattr(scaler, read)()


_SCALER_SHAPES = [(4,), (2, 3)]


def _scaler_plan_step(rng, inf=False, loss="scalar", step="step", update="update",
                      late_at="after_scale", reads=("none",) * 4):
    """One step of a call sequence for _scaler_calls: gradients (an inf in the first if
    asked); the loss: "scalar", "scalar_grad" (with an explicit seed) or "vector"; how it
    steps; how it updates ("late": after the next step's scale() or backward, per that
    step's late_at); what it reads at four points (_scaler_read)."""
    grads = [(rng.standard_normal(s) * 10.0 ** rng.uniform(-1, 1)).astype(np.float32)
             for s in _SCALER_SHAPES]
    if inf:
        grads[0][1] = np.inf
    return {"grads": grads, "loss": loss, "step": step, "update": update, "late_at": late_at,
            "reads": reads}


def _scaler_calls(backend, plan, growth_interval, at_once):
    """Run the call sequence `plan` on a fresh AdamW and scaler; at_once: a get_scale() right
    after every update(), which runs it then, and a state_dict() at every read. Returns every
    scaled loss, gradient, read and parameter seen, in order, and the final states."""
    initial = [a.astype(np.float32) for a in map(np.random.default_rng(37).standard_normal,
                                                 _SCALER_SHAPES)]
    params = [param(p, backend) for p in initial]
    opt = netcl.AdamW(params, lr=0.01)
    scaler = netcl.AMPGradScaler(init_scale=8.0, growth_factor=4.0,
                                 growth_interval=growth_interval)
    loaded = {"scale": 16.0, "growth_factor": 2.0, "backoff_factor": 0.25, "growth_interval": 2,
              "_growth_tracker": 1}
    seen = []

    def update(how):
        if how != "new_scale":
            scaler.update()
            if at_once:
                scaler.get_scale()
        if how in ("new_scale", "update_new_scale"):
            scaler.update(new_scale=32.0)
        elif how == "update_load":
            scaler.load_state_dict(loaded)

    late = None
    for step, p in enumerate(plan):
        reads = ["state_dict"] * 4 if at_once else p["reads"]
        seen.append(_scaler_read(scaler, reads[0]))
        opt.zero_grad()
        with netcl.Tape() as tape:
            pieces = [(q * g).reshape((-1,)) for q, g in zip(params, p["grads"])]
            loss = F.cat(pieces) if p["loss"] == "vector" else sum(
                (piece.sum() for piece in pieces), start=0.0)
        scaled = scaler.scale(loss)
        if late == "after_scale":
            update("update")
        seen.append(host(scaled))
        if p["loss"] == "scalar":
            tape.backward(scaled)
        else:
            tape.backward(scaled, grad=np.ones(scaled.shape, np.float32))
        if late == "after_backward":
            update("update")
        late = None
        seen.append([host(q.grad) for q in params])
        seen.append(_scaler_read(scaler, reads[1]))
        if p["step"].startswith("unscale"):
            scaler.unscale_(opt)
        if p["step"] == "unscale_clip_step":
            netcl.clip_grad_norm(params, 1.0)
        if p["step"] == "step_max_norm":
            scaler.step(opt, max_norm=1.0)
        else:
            scaler.step(opt)
        seen.append(_scaler_read(scaler, reads[2]))
        if p["update"] == "late" and step + 1 < len(plan):
            late = plan[step + 1]["late_at"]
        else:
            update("update" if p["update"] == "late" else p["update"])
        seen.append(_scaler_read(scaler, reads[3]))
        seen.append([host(q) for q in params])
    return seen, scaler.state_dict(), opt.state_dict()["state"]


def _assert_deferred_update_invisible(backend, plan, growth_interval):
    """The deferred update() against one run at once: the same everything, bit for bit."""
    eager, eager_state, eager_moments = _scaler_calls(backend, plan, growth_interval, True)
    deferred, state, moments = _scaler_calls(backend, plan, growth_interval, False)
    for i, (expected, got) in enumerate(zip(eager, deferred)):
        if isinstance(got, list):
            for a, b in zip(expected, got):
                np.testing.assert_array_equal(a, b, err_msg=f"record {i}")
        elif isinstance(got, np.ndarray):
            np.testing.assert_array_equal(expected, got, err_msg=f"record {i}")
        elif got is not None:  # a read: the eager run read state_dict() there
            assert got == (expected if isinstance(got, dict) else expected["scale"]), \
                f"record {i}"
    assert state == eager_state
    for i in moments:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(moments[i][key], eager_moments[i][key])


@TRAINING_SETTINGS
@given(data=st.data(), seed=st.integers(0, 2 ** 31 - 1))
def test_deferred_update_is_what_an_update_at_once_gives(backend, data, seed):
    """update() runs later (in the next scale() of a one-element loss, or first thing in
    whatever reads the scale before that): call sequences with reads anywhere give what a
    scaler whose every update() runs at once gives: the same scaled losses, gradients,
    parameters, moments, get_scale() and state_dict(), bit for bit, through update(new_scale),
    load_state_dict, unscale_, clipping, losses of several elements, explicit seeds and
    update() between a scale() and its backward."""
    rng = np.random.default_rng(seed)
    plan = [_scaler_plan_step(
        rng, inf=data.draw(st.booleans()),
        loss=data.draw(st.sampled_from(["scalar", "scalar_grad", "vector"])),
        step=data.draw(st.sampled_from(["step", "step_max_norm", "unscale_step",
                                        "unscale_clip_step"])),
        update=data.draw(st.sampled_from(["update", "update", "new_scale", "late",
                                          "update_new_scale", "update_load"])),
        late_at=data.draw(st.sampled_from(["after_scale", "after_backward"])),
        reads=data.draw(st.lists(st.sampled_from(["none", "none", "get_scale", "state_dict"]),
                                 min_size=4, max_size=4))) for _ in range(5)]
    # 1: every update() changes the scale; 3: most change only the growth tracker
    _assert_deferred_update_invisible(backend, plan, data.draw(st.sampled_from([1, 3])))


# Each way the scale is read while an update() is pending: (the first step's settings, the
# second's), every read "none" but where named.
_PENDING_UPDATE_READERS = {
    "backward's implicit seed": ({"update": "late"}, {"late_at": "after_scale"}),
    "backward's explicit seed": ({"update": "late"}, {"late_at": "after_scale",
                                                      "loss": "scalar_grad"}),
    "unscale_": ({"update": "late"}, {"late_at": "after_backward", "step": "unscale_step"}),
    "step's unscaling": ({"update": "late"}, {"late_at": "after_backward",
                                              "step": "step_max_norm"}),
    "update(new_scale)": ({"update": "update_new_scale"}, {}),
    "load_state_dict": ({"update": "update_load"}, {}),
    "scale() of several elements": ({}, {"loss": "vector"}),
    "get_scale": ({"reads": ("none", "none", "none", "get_scale")}, {}),
    "state_dict": ({"reads": ("none", "none", "none", "state_dict")}, {}),
}


@pytest.mark.parametrize("reader", list(_PENDING_UPDATE_READERS))
@pytest.mark.parametrize("growth_interval", [1, 2])
def test_whatever_reads_the_scale_runs_a_pending_update_first(backend, reader,
                                                              growth_interval):
    rng = np.random.default_rng(39)
    first, second = _PENDING_UPDATE_READERS[reader]
    plan = [_scaler_plan_step(rng, **first), _scaler_plan_step(rng, **second),
            _scaler_plan_step(rng, inf=True), _scaler_plan_step(rng, **second)]
    _assert_deferred_update_invisible(backend, plan, growth_interval)


@pytest.mark.usefixtures("portable_half")
def test_scale_of_a_float16_loss_runs_the_pending_update(opencl):
    """The next scale() of a one-element float16 loss (autocast's) runs the update() left
    pending (SGD's step has no adam_prepare to run it in) in its own kernel: the loss times
    the new scale, no launch of its own. With no update pending (the first scale()), the
    value waits until it is read: no launch."""
    p = param([1.0, 2.0], opencl)
    opt = netcl.SGD([p], lr=0.0)
    scaler = netcl.AMPGradScaler(init_scale=4.0, growth_interval=1)
    x = tensor(np.ones((1, 2), np.float32), opencl)
    for expected_scale in (4.0, 8.0):
        with netcl.Tape() as tape, netcl.autocast():
            out = F.linear(x, F.reshape(p, (1, 2))).reshape(())
        assert out.dtype == np.float16
        launches = opencl.launches
        scaled = scaler.scale(out)
        assert opencl.launches == launches + (expected_scale != 4.0)
        assert float(scaled.value) == 3.0 * expected_scale
        opt.zero_grad()
        tape.backward(scaled)
        np.testing.assert_array_equal(host(p.grad), [expected_scale] * 2)
        scaler.step(opt)
        scaler.update()
    assert scaler.state_dict()["scale"] == 16.0


_SCALER_REJECTED = [
    ({"scale": -1.0}, ValueError, "scale must be positive and finite"),
    ({"scale": math.inf}, ValueError, "scale must be positive and finite"),
    ({"growth_factor": 0.5}, ValueError, "The growth factor must be > 1.0"),
    ({"backoff_factor": 2.0}, ValueError, "The backoff factor must be < 1.0"),
    ({"growth_interval": 0}, ValueError, "growth_interval must be a positive integer"),
    ({"_growth_tracker": -1}, ValueError, "_growth_tracker"),
    ({"growth_factor": 4.0, "_growth_tracker": None}, KeyError, "_growth_tracker"),  # missing
]


@pytest.mark.parametrize("changes, error, message", _SCALER_REJECTED)
def test_scaler_load_state_dict_rejects_a_bad_state_and_changes_nothing(backend, changes, error,
                                                                        message):
    scaler = netcl.AMPGradScaler(init_scale=8.0, growth_interval=3)
    p = param(np.zeros(3), backend)
    _scaled_backward(scaler, [p], [np.ones(3, np.float32)])  # the device state exists
    scaler.step(netcl.SGD([p], lr=0.1))
    scaler.update()
    before = scaler.state_dict()
    state = {key: value for key, value in {**before, **changes}.items() if value is not None}
    assert state != before
    with raises_naming(error, message):
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before


def test_scaler_state_survives_save_and_load(backend, tmp_path):
    scaler = netcl.AMPGradScaler(init_scale=8.0, growth_interval=3)
    state = dict(scaler.state_dict(), scale=32.0, _growth_tracker=2)
    netcl.save(state, tmp_path / "scaler.npz")
    fresh = netcl.AMPGradScaler()
    fresh.load_state_dict(netcl.load(tmp_path / "scaler.npz"))  # 0-d arrays
    assert fresh.state_dict() == state


HALF_NEW_OP_CASES = [
    ("sqrt", _one(low=0.1), F.sqrt, np.sqrt, True),
    ("rsqrt", _one(low=0.1), F.rsqrt, lambda x: 1 / np.sqrt(x), True),
    ("abs", _one(), F.abs, np.abs, True),
    ("pow", _one(), lambda x: x ** 3, lambda x: x ** 3, True),
    ("clamp", _one(), lambda x: F.clamp(x, -0.5, 0.7), lambda x: np.clip(x, -0.5, 0.7), True),
    ("silu", _one(), F.silu, lambda x: x / (1 + np.exp(-x)), True),
    ("gelu_tanh", _one(), lambda x: F.gelu(x, approximate="tanh"), _gelu_tanh_ref, True),
    ("maximum", _two(), F.maximum, np.maximum, True),
    ("minimum_row", _two((5,)), F.minimum, np.minimum, True),
    ("where", _two((5,)), lambda a, b: F.where(np.arange(5) % 2 == 0, a, b),
     lambda a, b: np.where(np.arange(5) % 2 == 0, a, b), True),
    ("masked_fill", _one(), lambda x: x.masked_fill(np.arange(5) > 2, -3.0),
     lambda x: np.where(np.arange(5) > 2, -3.0, x), True),
    ("max_axis1", _one(), lambda x: F.max(x, 1), lambda x: x.max(1), False),
    ("min", _one(), F.min, np.min, False),
    ("var_axis0", _one(), lambda x: F.var(x, 0), lambda x: x.var(0, ddof=1), False),
    ("std", _one(), F.std, lambda x: x.std(ddof=1), False),
    ("logsumexp", _one(), lambda x: F.logsumexp(x, -1), lambda x: _logsumexp_ref(x, -1, False),
     False),
]


@pytest.mark.parametrize("case", HALF_NEW_OP_CASES, ids=[c[0] for c in HALF_NEW_OP_CASES])
def test_float16_storage_new_ops(opencl, case):
    """test_float16_storage_ops for these ops: float16 in, float16 out for the elementwise
    ones and their gradients, float32 for the reductions and theirs."""
    test_float16_storage_ops(opencl, case)


# ---------------------------------------------------------------------------------------------
# distributed: data-parallel training over MPI
# ---------------------------------------------------------------------------------------------

# The multi-rank tests run scripts under `mpiexec -n 2` (mpich's wheel, from the test extra),
# with one thread per rank: the machine has two cores.

import json  # noqa: E402


import shutil  # noqa: E402


def _mpiexec():
    """mpiexec beside this Python (a venv's bin) or on PATH: missing is a failure, not a skip."""
    search = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    found = shutil.which("mpiexec", path=search)
    assert found, "mpiexec not found: the test extra installs mpich, whose wheel brings it"
    return found


def _run_ranks(script, tmp_path, device, ranks=2, timeout=120):
    """Run `script` under mpiexec -n ranks with this checkout's netcl; (returncode, output,
    seconds)."""
    path = tmp_path / "ranks.py"
    path.write_text(script)
    env = dict(os.environ, NETCL_DEVICE=device, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               POCL_MAX_PTHREAD_COUNT="1",
               # An Open MPI mpiexec (where mpi4py came with one) refuses root without these.
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.abspath(netcl.__file__)),
                                           os.environ.get("PYTHONPATH", "")]))
    started = time.monotonic()
    done = subprocess.run([_mpiexec(), "-n", str(ranks), sys.executable, str(path), str(tmp_path)],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    return done.returncode, done.stdout, time.monotonic() - started


_MPI_SCRIPT = r'''
import json
import os
import sys

import numpy as np

import netcl
from netcl import nn
from netcl.data import ArrayDataset, DataLoader

dist = netcl.distributed
dist.init()  # before the device: it picks this rank's
from mpi4py import MPI  # noqa: E402  (only to gather results on rank 0)

comm = MPI.COMM_WORLD
rank, world = dist.rank(), dist.world_size()
queue = netcl.manager.default().queue
result = {"world": world}


def gathered(value):
    return comm.gather(value, root=0)


def mlp(seed):
    netcl.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16, queue=queue), nn.ReLU(), nn.Linear(16, 4, queue=queue))


def optimizer(kind, model):
    if kind == "adamw":
        return netcl.optim.AdamW(model.parameters(), lr=0.05)
    return netcl.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def flat_params(model):
    return np.concatenate([p.value.to_host().ravel() for p in model.parameters()])


def train(model, opt, loader, steps, max_norm):
    batches = iter(loader)
    for _ in range(steps):
        xb, yb = next(batches)
        with netcl.Tape() as tape:
            loss = netcl.functional.cross_entropy(model(netcl.Tensor.from_host(xb, queue=queue)), yb)
        opt.zero_grad()
        tape.backward(loss)
        if isinstance(opt, netcl.optim.SGD):  # the single-process reference clips by hand
            netcl.optim.clip_grad_norm(opt.params, max_norm)
            opt.step()
        else:
            opt.step(max_norm=max_norm)


rng = np.random.default_rng(0)
x = rng.normal(size=(96, 8)).astype(np.float32)
y = rng.integers(0, 4, size=96)
B, STEPS = 8, 4

# 1. Two ranks at batch B against one process at batch 2B, same seed: the same parameters.
for kind in ("adamw", "sgd"):
    model = mlp(seed=100 + rank)  # a different start on each rank: the broadcast fixes it
    before = dist.stats()["gradient_allreduces"]
    train(model, dist.DistributedOptimizer(optimizer(kind, model)),
          DataLoader(ArrayDataset(x, y), batch_size=B, seed=5), STEPS, max_norm=0.5)
    result[kind + "_allreduces"] = dist.stats()["gradient_allreduces"] - before
    ranks = gathered(flat_params(model))
    if rank == 0:
        single = mlp(seed=100)
        start = flat_params(single)
        train(single, optimizer(kind, single), DataLoader(ArrayDataset(x, y), batch_size=world * B,
              seed=5, rank=0, world_size=1), STEPS, max_norm=0.5)
        reference = flat_params(single)
        result[kind] = {"ranks_differ": float(max(np.abs(p - ranks[0]).max() for p in ranks)),
                        "vs_single": float(np.abs(ranks[0] - reference).max()),
                        "moved": float(np.abs(reference - start).max())}

# 2. Sharding: the same permutation everywhere (no seed given: rank 0's is agreed on).
ids = ArrayDataset(np.arange(11), np.zeros(11, np.int64))
for drop_last in (False, True):
    loader = DataLoader(ids, batch_size=2, drop_last=drop_last)
    epochs = [[int(i) for xb, _ in loader for i in xb] for _ in range(2)]
    shards = gathered({"epochs": epochs, "len": len(loader)})
    if rank == 0:
        result[f"shards_drop_last_{drop_last}"] = shards

# 3. AMP: a non-finite gradient on rank 1 only skips the step on every rank.
model = mlp(seed=7)
opt = dist.DistributedOptimizer(netcl.optim.AdamW(model.parameters(), lr=0.05))
scaler = netcl.amp.AMPGradScaler(init_scale=1024.0)
amp_steps = []
for poisoned in (True, False):
    xb = x[:B].copy()
    if poisoned and rank == 1:
        xb[0, 0] = np.inf
    start = flat_params(model)
    with netcl.Tape() as tape, np.errstate(invalid="ignore"):  # inf * 0 in the forward
        loss = netcl.functional.cross_entropy(model(netcl.Tensor.from_host(xb, queue=queue)), y[:B])
    opt.zero_grad()
    tape.backward(scaler.scale(loss))
    scaler.step(opt, max_norm=1.0)
    scaler.update()
    amp_steps.append({"changed": bool(np.any(flat_params(model) != start)),
                      "scale": scaler.get_scale()})
amp = gathered({"steps": amp_steps, "params": flat_params(model)})
if rank == 0:
    result["amp"] = [entry["steps"] for entry in amp]
    result["amp_ranks_differ"] = float(np.abs(amp[0]["params"] - amp[1]["params"]).max())

# 4. Trainer, unchanged: sharded training and validation reduced over ranks, rank 0 alone
#    prints and saves.
model = mlp(seed=200 + rank)
trainer = netcl.trainer.Trainer(model, netcl.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                device_queue=queue, grad_clip=1.0, metrics_stride=1)
train_loader = DataLoader(ArrayDataset(x[:64], y[:64]), batch_size=B, seed=3)
val_loader = DataLoader(ArrayDataset(x[64:], y[64:]), batch_size=B, shuffle=False)
before = dist.stats()
checkpoint = os.path.join(sys.argv[1], f"best-{rank}.npz")
history = trainer.fit(train_loader, val_loader, epochs=2, checkpoint=checkpoint)
after = dist.stats()
sharded = trainer.evaluate(val_loader)
whole = trainer.evaluate(DataLoader(ArrayDataset(x[64:], y[64:]), batch_size=B, shuffle=False,
                                    rank=0, world_size=1))
trainer_result = gathered({"history": [dict(h) for h in history], "params": flat_params(model),
                           "sharded": sharded, "whole": whole,
                           "saved": os.path.exists(checkpoint),
                           "allreduces": after["gradient_allreduces"] - before["gradient_allreduces"],
                           "metric_allreduces": after["metric_allreduces"] - before["metric_allreduces"],
                           "steps": 2 * len(train_loader)})
if rank == 0:
    first = trainer_result[0]["params"]
    for entry in trainer_result:
        entry["params"] = float(np.abs(entry["params"] - first).max())
    result["trainer"] = trainer_result
    print("RESULT " + json.dumps(result))
'''


def test_two_ranks_train_as_one_process_with_twice_the_batch(backend, tmp_path):
    returncode, output, _ = _run_ranks(_MPI_SCRIPT, tmp_path, backend.backend)
    assert returncode == 0, output
    (line,) = [line for line in output.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line[len("RESULT "):])
    assert result["world"] == 2

    # Same parameters as one process at batch 2B (float32 summation order apart), bit-identical
    # on both ranks, after one gradient all-reduce per step; and they did move.
    for kind in ("adamw", "sgd"):
        assert result[kind + "_allreduces"] == 4
        assert result[kind]["ranks_differ"] == 0.0
        assert result[kind]["moved"] > 1e-2
        assert result[kind]["vs_single"] < 1e-5, (kind, result[kind])

    # Sharding: each epoch's shards are disjoint and together every sample (DistributedSampler:
    # padded with the epoch's first sample without drop_last; cut to 10 with it).
    for drop_last, per_rank in ((False, 6), (True, 5)):
        shards = result[f"shards_drop_last_{drop_last}"]
        assert [shard["len"] for shard in shards] == ([3, 3] if not drop_last else [2, 2])
        for epoch in range(2):
            ours = [shard["epochs"][epoch] for shard in shards]
            assert [len(o) for o in ours] == ([per_rank] * 2 if not drop_last else [4, 4])
            everything = sorted(ours[0] + ours[1])
            if drop_last:  # the last batch of 1 is dropped too: 8 distinct samples
                assert len(set(everything)) == 8
            else:
                assert set(everything) == set(range(11))
                assert len(everything) == 12
        # A new permutation each epoch, and not the identity.
        assert shards[0]["epochs"][0] != shards[0]["epochs"][1]

    # AMP: rank 1's inf skipped the step on both ranks and backed off both scales; the clean
    # step after it applied on both; the ranks stayed identical.
    for steps in result["amp"]:
        assert [step["changed"] for step in steps] == [False, True]
        assert [step["scale"] for step in steps] == [512.0, 512.0]
    assert result["amp_ranks_differ"] == 0.0

    # Trainer: identical models and history on both ranks; one gradient all-reduce per step,
    # one metrics all-reduce per epoch and per evaluation; the sharded validation equals the
    # whole set's; only rank 0 printed and saved.
    ranks = result["trainer"]
    assert [entry["params"] for entry in ranks] == [0.0, 0.0]
    assert ranks[0]["history"][0]["loss"] == ranks[1]["history"][0]["loss"]
    assert ranks[0]["history"][1]["val_accuracy"] == ranks[1]["history"][1]["val_accuracy"]
    for entry in ranks:
        assert entry["allreduces"] == entry["steps"] == 8
        assert entry["metric_allreduces"] == 4
        assert entry["sharded"]["accuracy"] == entry["whole"]["accuracy"]
        assert entry["sharded"]["loss"] == pytest.approx(entry["whole"]["loss"], rel=1e-5)
    assert ranks[0]["history"][1]["val_loss"] == pytest.approx(ranks[0]["whole"]["loss"], rel=1e-5)
    assert [entry["saved"] for entry in ranks] == [True, False]
    # Each epoch's line once (Open MPI's mpiexec gives the ranks a terminal: rank 0's progress
    # bar, "epoch 1/2 [...", may be there too).
    assert output.count("epoch 1/2  loss") == 1 and output.count("epoch 2/2  loss") == 1


def test_a_failing_rank_ends_the_job_with_its_traceback(tmp_path):
    script = r'''
import time
import types
import warnings
import netcl
netcl.distributed.init()
from mpi4py import MPI
if netcl.distributed.rank() == 1:
    time.sleep(0.5)
    raise ValueError("rank 1 gave up")
MPI.COMM_WORLD.Barrier()  # rank 0 waits here for a rank that never comes
print("rank 0 went on")
'''
    returncode, output, seconds = _run_ranks(script, tmp_path, "cpu", timeout=60)
    assert returncode != 0
    assert "Traceback" in output and "ValueError: rank 1 gave up" in output
    assert "rank 0 went on" not in output
    assert seconds < 20, f"the job took {seconds:.1f} s to end"


def test_import_netcl_does_not_import_mpi4py():
    code = ("import sys, netcl\n"
            "assert netcl.distributed.world_size() == 1 and netcl.distributed.is_main()\n"
            "assert not netcl.distributed.is_initialized()\n"
            "assert 'mpi4py' not in sys.modules, 'netcl imported mpi4py'\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(netcl.__file__)))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr


@PROPERTY_SETTINGS
@given(n=st.integers(1, 40), world=st.integers(1, 4), batch_size=st.integers(1, 5),
       drop_last=st.booleans(), shuffle=st.booleans(), seed=st.integers(0, 2**31))
def test_dataloader_shards_split_every_epoch_among_ranks(n, world, batch_size, drop_last,
                                                         shuffle, seed):
    dataset = netcl.ArrayDataset(np.arange(n), np.zeros(n, np.int64))
    loaders = [netcl.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, seed=seed,
                                drop_last=drop_last, rank=r, world_size=world)
               for r in range(world)]
    whole = netcl.DataLoader(dataset, batch_size=1, shuffle=shuffle, seed=seed)
    per_rank = n // world if drop_last else -(-n // world)
    for epoch in range(2):
        order = [int(xb[0]) for xb, _ in whole]
        shards = [[int(i) for xb, _ in loader for i in xb] for loader in loaders]
        for loader, shard in zip(loaders, shards):
            batches = per_rank // batch_size if drop_last else -(-per_rank // batch_size)
            assert len(loader) == batches
            assert len(shard) == (len(loader) * batch_size if drop_last else per_rank)
        # DistributedSampler's rule, from the single-process order of the same seed.
        padded = (order * world)[:per_rank * world]
        for r, shard in enumerate(shards):
            assert shard == padded[r::world][:len(shard)]
        union = [i for shard in shards for i in shard]
        if not drop_last:  # every sample, plus fewer than `world` repeats from the start
            assert sorted(union) == sorted(padded) and set(union) == set(range(n))
        else:  # disjoint shards
            assert len(set(union)) == len(union)


def test_dataloader_shard_arguments_are_checked():
    dataset = netcl.ArrayDataset(np.arange(10), np.zeros(10, np.int64))
    with raises_naming(ValueError, "rank", "world_size"):
        netcl.DataLoader(dataset, rank=0)
    with raises_naming(ValueError, "rank", "world_size"):
        netcl.DataLoader(dataset, world_size=2)
    with raises_naming(ValueError, "rank", "2"):
        netcl.DataLoader(dataset, rank=2, world_size=2, seed=0)
    with raises_naming(ValueError, "world_size", "0"):
        netcl.DataLoader(dataset, rank=0, world_size=0, seed=0)
    with raises_naming(ValueError, "rank", "-1"):
        netcl.DataLoader(dataset, rank=-1, world_size=2, seed=0)
    # Shuffled shards without init() need a seed every rank shares: there is none to agree on.
    with raises_naming(ValueError, "seed", "init"):
        netcl.DataLoader(dataset, rank=0, world_size=2)
    assert len(netcl.DataLoader(dataset, rank=1, world_size=2, shuffle=False)) == 5


def test_distributed_optimizer_in_one_process_is_the_optimizer(backend):
    # Before init() (one rank) the wrapper changes nothing: the same steps, bit for bit, with
    # clipping through step(max_norm) for SGD too; lr and zero_grad reach the wrapped one.
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(16, 6)).astype(np.float32), rng.integers(0, 3, size=16)

    def run(kind, wrap):
        netcl.manual_seed(3)
        model = nn.Sequential(nn.Linear(6, 5, queue=backend.queue), nn.Tanh(),
                              nn.Linear(5, 3, queue=backend.queue))
        opt = (netcl.optim.AdamW(model.parameters(), lr=0.1) if kind == "adamw"
               else netcl.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        if wrap:
            opt = netcl.distributed.DistributedOptimizer(opt)
            opt.lr = 0.05
            assert opt.optimizer.lr == 0.05
        else:
            opt.lr = 0.05
        for _ in range(3):
            with netcl.Tape() as tape:
                loss = F.cross_entropy(model(tensor(x, backend)), y)
            opt.zero_grad()
            tape.backward(loss)
            if wrap or kind == "adamw":
                opt.step(max_norm=0.1)
            else:
                netcl.optim.clip_grad_norm(opt.params, 0.1)
                opt.step()
        assert all(p.grad is not None for p in model.parameters())
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        return [host(p) for p in model.parameters()]

    for kind in ("adamw", "sgd"):
        for wrapped, bare in zip(run(kind, True), run(kind, False)):
            np.testing.assert_array_equal(wrapped, bare)
    assert netcl.distributed.stats()["gradient_allreduces"] == 0  # one rank: no collective


def test_distributed_arguments_are_checked(backend):
    with raises_naming(TypeError, "DistributedOptimizer", "list"):
        netcl.distributed.DistributedOptimizer([])
    opt = netcl.distributed.DistributedOptimizer(
        netcl.optim.SGD([param(np.ones(3), backend)], lr=0.1))
    with raises_naming(TypeError, "DistributedOptimizer", "DistributedOptimizer"):
        netcl.distributed.DistributedOptimizer(opt)
    with raises_naming(ValueError, "max_norm", "-1"):
        opt.step(max_norm=-1)
    with raises_naming(TypeError, "broadcast_parameters", "item 1", "str"):
        netcl.distributed.broadcast_parameters([param(np.ones(3), backend), "weights"])
    with raises_naming(ValueError, "broadcast_parameters", "root", "1"):
        netcl.distributed.broadcast_parameters([param(np.ones(3), backend)], root=1)


def test_each_local_rank_takes_its_own_gpu(monkeypatch):
    # Four fake GPUs on one platform: local rank r gets GPU r % 4; NETCL_DEVICE still wins.
    import pyopencl as cl

    class FakeGpu:
        type = cl.device_type.GPU
        name = "fake GPU"

    gpus = [(0, d, FakeGpu()) for d in range(4)]
    monkeypatch.setattr(netcl, "_opencl_devices", lambda: gpus)
    monkeypatch.setattr(netcl, "_opencl_device", lambda p, d, device: ("opencl", p, d))
    monkeypatch.delenv("NETCL_DEVICE", raising=False)
    for local_rank, expected in ((0, 0), (1, 1), (5, 1)):
        monkeypatch.setattr(netcl, "_local_rank", local_rank)
        assert netcl.manager.default("gpu") == ("opencl", 0, expected)
        assert netcl.manager.default() == ("opencl", 0, expected)
    monkeypatch.setenv("NETCL_DEVICE", "opencl:0:3")
    assert netcl.manager.default() == ("opencl", 0, 3)


# ---------------------------------------------------------------------------------------------
# data: DataLoader, workers, shared memory, GpuBatch, load_idx
# ---------------------------------------------------------------------------------------------

# (num_workers, use_shared_mem) combinations every order test compares.
WORKER_SETUPS = [(0, False), (2, False), (2, True)]


# --- helpers

def _samples(n):
    """x[i] (2, 3) float32 all equal to i, y[i] = i as int64, extra[i] = i % 7 as int16."""
    x = np.repeat(np.arange(n, dtype=np.float32), 6).reshape(n, 2, 3)
    y = np.arange(n, dtype=np.int64)
    return x, y, (y % 7).astype(np.int16)


class SampleDataset:
    """A per-sample dataset (no fancy indexing), as users write them."""

    def __init__(self, n):
        self.x, self.y, self.extra = _samples(n)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        return self.x[index], self.y[index], self.extra[index]


def _dataset(kind, n):
    if kind == "arrays":
        return netcl.ArrayDataset(*_samples(n))
    if kind == "list":
        return list(zip(*_samples(n)))
    return SampleDataset(n)


class FailingDataset(SampleDataset):
    """Raises on one index, to check that a worker's error reaches the consumer."""

    def __init__(self, n, bad_index):
        super().__init__(n)
        self.bad_index = bad_index

    def __getitem__(self, index):
        if index == self.bad_index:
            raise ValueError(f"bad sample {index}")
        return super().__getitem__(index)


class SelfKillingDataset(SampleDataset):
    """A worker that touches `bad_index` is killed by SIGKILL, as by the OOM killer."""

    def __init__(self, n, bad_index):
        super().__init__(n)
        self.bad_index = bad_index
        self.parent_pid = os.getpid()

    def __getitem__(self, index):
        if index == self.bad_index and os.getpid() != self.parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(index)


def exit_soon_collate(samples):
    """Collate that makes its worker exit (code 3) shortly after sending the batch with sample 4."""
    if any(sample[1] == 4 for sample in samples):
        threading.Timer(0.05, os._exit, (3,)).start()
    return tuple(np.stack(field) for field in zip(*samples))


class CountingDataset(SampleDataset):
    def __init__(self, n):
        super().__init__(n)
        self.calls = 0

    def __getitem__(self, index):
        self.calls += 1
        return super().__getitem__(index)


def pad_collate(samples):
    """Variable-length samples padded to the longest in the batch (a custom collate_fn)."""
    width = max(len(sample[0]) for sample in samples)
    x = np.zeros((len(samples), width), np.float32)
    for row, (values, _) in enumerate(samples):
        x[row, :len(values)] = values
    return x, np.array([label for _, label in samples])


def dict_collate(samples):
    return {"ids": np.array([sample[1] for sample in samples]), "count": len(samples)}


def _ids(batches):
    return [int(i) for batch in batches for i in batch[1]]


def _shm_names(prefix=None):
    """The DataLoader's shared-memory blocks now in /dev/shm: this process's (named
    netcl_<pid>_...), or those under `prefix`; other programs' blocks are not ours to count."""
    prefix = f"netcl_{os.getpid()}_" if prefix is None else prefix
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {name for name in names if name.startswith(prefix)}


def _assert_clean(shm_before, timeout=5.0):
    """No worker process alive within `timeout` seconds, and no shared-memory block left."""
    deadline = time.monotonic() + timeout
    while multiprocessing.active_children():
        if time.monotonic() > deadline:
            pytest.fail(f"worker processes still alive after {timeout} s: {multiprocessing.active_children()}")
        time.sleep(0.02)
    assert _shm_names() - shm_before == set()


@contextlib.contextmanager
def _deadline(seconds):
    """Fail instead of hanging: SIGALRM interrupts a blocked wait in the main thread."""
    def expire(signum, frame):
        raise TimeoutError(f"no result within {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --- order and contents

@TRAINING_SETTINGS
@given(n=st.integers(1, 40), batch_size=st.integers(1, 12), drop_last=st.booleans(),
       shuffle=st.booleans(), seed=st.integers(0, 2**32), kind=st.sampled_from(["arrays", "list", "samples"]))
def test_every_sample_once_per_epoch_in_the_same_order_for_any_workers(n, batch_size, drop_last, shuffle, seed, kind):
    assume(not (drop_last and n < batch_size))
    dataset = _dataset(kind, n)
    epochs_by_setup = []
    with _deadline(60):
        for num_workers, use_shared_mem in WORKER_SETUPS:
            loader = netcl.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=num_workers,
                                   use_shared_mem=use_shared_mem, drop_last=drop_last, seed=seed)
            epochs = [list(loader) for _ in range(2)]
            for batches in epochs:
                assert len(batches) == len(loader) == (n // batch_size if drop_last else -(-n // batch_size))
                for batch_no, (xb, yb, extra) in enumerate(batches):
                    full = drop_last or batch_no < len(batches) - 1
                    rows = batch_size if full else n - batch_no * batch_size
                    assert xb.shape == (rows, 2, 3) and yb.shape == extra.shape == (rows,)
                    assert (xb.dtype, yb.dtype, extra.dtype) == (np.float32, np.int64, np.int16)
                    np.testing.assert_array_equal(xb[:, 1, 2], yb)
                    np.testing.assert_array_equal(extra, yb % 7)
                ids = _ids(batches)
                assert len(ids) == len(set(ids)) == len(loader) * batch_size if drop_last else n
                assert set(ids) <= set(range(n))
                if not shuffle:
                    assert ids == list(range(len(ids)))
            epochs_by_setup.append([_ids(batches) for batches in epochs])
    assert all(epochs == epochs_by_setup[0] for epochs in epochs_by_setup)


def test_shuffle_changes_every_epoch_and_with_the_seed():
    dataset = netcl.ArrayDataset(*_samples(64))
    loader = netcl.DataLoader(dataset, batch_size=8, seed=5)
    first, second = _ids(loader), _ids(loader)
    assert sorted(first) == sorted(second) == list(range(64)) and first != second
    assert _ids(netcl.DataLoader(dataset, batch_size=8, seed=5)) == first
    assert _ids(netcl.DataLoader(dataset, batch_size=8, seed=6)) != first


def test_seed_none_comes_from_manual_seed():
    dataset = netcl.ArrayDataset(*_samples(64))
    netcl.manual_seed(11)
    first = _ids(netcl.DataLoader(dataset, batch_size=8))
    netcl.manual_seed(11)
    assert _ids(netcl.DataLoader(dataset, batch_size=8)) == first


def test_array_dataset_gathers_a_batch_with_one_index():
    x, y, extra = _samples(10)
    dataset = netcl.ArrayDataset(x, y, extra)
    assert len(dataset) == 10
    xb, yb, eb = dataset[np.array([3, 1])]
    np.testing.assert_array_equal(yb, [3, 1])
    assert xb.shape == (2, 2, 3) and eb.dtype == np.int16
    with pytest.raises(ValueError, match="first dimension"):
        netcl.ArrayDataset(x, y[:9])


@pytest.mark.parametrize("num_workers, use_shared_mem", WORKER_SETUPS)
def test_collate_fn_receives_the_sample_tuples(num_workers, use_shared_mem):
    dataset = [(np.arange(i % 4 + 1, dtype=np.float32), i) for i in range(30)]
    loader = netcl.DataLoader(dataset, batch_size=4, shuffle=False, collate_fn=pad_collate,
                           num_workers=num_workers, use_shared_mem=use_shared_mem)
    with _deadline(30):
        batches = list(loader)
    assert _ids(batches) == list(range(30))
    # pad_collate saw each batch's (values, label) tuples: all but the last hold a length-4 sample.
    assert [xb.shape[1] for xb, _ in batches] == [4] * 7 + [2]
    dict_batches = list(netcl.DataLoader(dataset, batch_size=4, shuffle=False, collate_fn=dict_collate,
                                      num_workers=num_workers, use_shared_mem=use_shared_mem))
    assert [batch["count"] for batch in dict_batches] == [4] * 7 + [2]


def test_shared_memory_blocks_grow_for_larger_batches():
    # Batch 0 holds short samples; later batches are wider than the blocks sized from it.
    dataset = [(np.arange(1 + i // 8, dtype=np.float32), i) for i in range(40)]
    shm_before = _shm_names()
    with _deadline(30):
        expected = list(netcl.DataLoader(dataset, batch_size=8, shuffle=False, collate_fn=pad_collate))
        got = list(netcl.DataLoader(dataset, batch_size=8, shuffle=False, collate_fn=pad_collate,
                                 num_workers=2, use_shared_mem=True, prefetch=1))
    for (x_expected, y_expected), (x_got, y_got) in zip(expected, got):
        np.testing.assert_array_equal(x_got, x_expected)
        np.testing.assert_array_equal(y_got, y_expected)
    _assert_clean(shm_before)


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": 2.5}, "batch_size"),
    ({"batch_size": True}, "batch_size"),
    ({"num_workers": -1}, "num_workers"),
    ({"prefetch": 0}, "prefetch"),
    ({"seed": -3}, "seed"),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        netcl.DataLoader(netcl.ArrayDataset(*_samples(10)), **kwargs)


def test_bad_datasets_and_collate_fn_are_rejected():
    with pytest.raises(ValueError, match="empty"):
        netcl.DataLoader([])
    with pytest.raises(ValueError, match="empty"):
        netcl.DataLoader(netcl.ArrayDataset(np.zeros((0, 3)), np.zeros(0)))
    with pytest.raises(ValueError, match="__len__"):
        netcl.DataLoader(iter([(1, 2)]))
    with pytest.raises(ValueError, match="collate_fn"):
        netcl.DataLoader([(1, 2)], collate_fn=3)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_drop_last_may_leave_no_batch(num_workers):
    loader = netcl.DataLoader(netcl.ArrayDataset(*_samples(3)[:2]), batch_size=5, drop_last=True,
                           num_workers=num_workers)
    assert len(loader) == 0 and list(loader) == []  # as PyTorch
    with pytest.raises(TypeError, match="tuple"):
        list(netcl.DataLoader([np.zeros(2)], batch_size=1))


# --- workers: stopping and errors

@pytest.mark.parametrize("use_shared_mem", [False, True])
def test_early_break_stops_workers_and_frees_shared_memory(use_shared_mem):
    shm_before = _shm_names()
    loader = netcl.DataLoader(netcl.ArrayDataset(*_samples(400)), batch_size=4, num_workers=2,
                           use_shared_mem=use_shared_mem)
    with _deadline(30):
        for batch_no, _ in enumerate(loader):
            if batch_no == 3:
                break
    del loader
    _assert_clean(shm_before)


@pytest.mark.parametrize("use_shared_mem", [False, True])
def test_exception_in_the_consumer_stops_workers(use_shared_mem):
    shm_before = _shm_names()
    loader = netcl.DataLoader(SampleDataset(400), batch_size=4, num_workers=2, use_shared_mem=use_shared_mem)
    with _deadline(30), pytest.raises(KeyError):
        for batch in loader:
            raise KeyError("consumer failed")
    del loader, batch
    _assert_clean(shm_before)


def test_dropping_an_unstarted_iterator_stops_workers():
    shm_before = _shm_names()
    loader = netcl.DataLoader(netcl.ArrayDataset(*_samples(400)), batch_size=4, num_workers=2, use_shared_mem=True)
    iterator = iter(loader)
    assert len(multiprocessing.active_children()) == 2
    del iterator, loader
    _assert_clean(shm_before)


@pytest.mark.parametrize("use_shared_mem", [False, True])
def test_worker_exception_reaches_the_consumer_with_its_traceback(use_shared_mem):
    shm_before = _shm_names()
    loader = netcl.DataLoader(FailingDataset(40, bad_index=13), batch_size=4, shuffle=False, num_workers=2,
                           use_shared_mem=use_shared_mem)
    with _deadline(30), pytest.raises(RuntimeError) as caught:
        list(loader)
    message = str(caught.value)
    assert "bad sample 13" in message and "Traceback" in message and "__getitem__" in message
    del loader, caught
    _assert_clean(shm_before)
    with pytest.raises(ValueError, match="bad sample 13"):
        list(netcl.DataLoader(FailingDataset(40, bad_index=13), batch_size=4))


@pytest.mark.parametrize("use_shared_mem", [False, True])
def test_killed_worker_raises_instead_of_hanging(use_shared_mem):
    shm_before = _shm_names()
    loader = netcl.DataLoader(SelfKillingDataset(40, bad_index=13), batch_size=4, shuffle=False, num_workers=2,
                           use_shared_mem=use_shared_mem)
    with _deadline(30), pytest.raises(RuntimeError, match="worker 1 .*exit code -9"):
        list(loader)
    del loader
    _assert_clean(shm_before)


def test_worker_that_exits_between_batches_raises():
    # Worker 1 sends batch 1 and then exits: the next task sent to it finds no one listening.
    shm_before = _shm_names()
    loader = netcl.DataLoader(SampleDataset(40), batch_size=4, shuffle=False, num_workers=2,
                           collate_fn=exit_soon_collate)
    with _deadline(30), pytest.raises(RuntimeError, match="worker 1 .*exit code 3"):
        for _ in loader:
            time.sleep(0.2)
    del loader
    _assert_clean(shm_before)


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_workers_under_other_start_methods(start_method):
    if start_method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"{start_method} is not available here")
    script = f"""
import multiprocessing, os, sys
import numpy as np
sys.path[:0] = {sys.path!r}
import netcl
if __name__ == "__main__":
    multiprocessing.set_start_method({start_method!r})
    x = np.arange(600, dtype=np.float32).reshape(200, 3)
    dataset = netcl.ArrayDataset(x, np.arange(200))
    expected = [b[1].tolist() for b in netcl.DataLoader(dataset, batch_size=16, seed=3)]
    for use_shared_mem in (False, True):
        loader = netcl.DataLoader(dataset, batch_size=16, seed=3, num_workers=2, use_shared_mem=use_shared_mem)
        assert [b[1].tolist() for b in loader] == expected
        for batch_no, batch in enumerate(netcl.DataLoader(dataset, batch_size=16, num_workers=2,
                                                      use_shared_mem=use_shared_mem)):
            break
    # A collate_fn that cannot be pickled to a spawned worker fails at iter(), leaving nothing.
    try:
        iter(netcl.DataLoader(dataset, num_workers=2, collate_fn=lambda samples: samples))
    except Exception:
        assert not multiprocessing.active_children()
    else:
        raise AssertionError("an unpicklable collate_fn was accepted")
    print("ok", os.getpid())
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("ok "), result.stderr
    assert "leaked" not in result.stderr, result.stderr
    child_pid = result.stdout.split()[1]
    assert _shm_names(f"netcl_{child_pid}_") == set()  # the child's blocks are all unlinked


# --- device batches

@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("num_workers, use_shared_mem", [(0, False), (2, True)])
def test_gpu_batches_hold_the_host_batch_on_the_device(backend_name, num_workers, use_shared_mem):
    device = _get_device(backend_name)
    x, y, extra = _samples(37)
    dataset = netcl.ArrayDataset(x.astype(np.float64), y, extra)
    host_batches = list(netcl.DataLoader(dataset, batch_size=8, seed=2))
    loader = netcl.DataLoader(dataset, batch_size=8, seed=2, num_workers=num_workers, use_shared_mem=use_shared_mem)
    assert loader.bind_queue(device.queue) is loader
    with _deadline(60):
        gpu_batches = list(loader)
    assert len(gpu_batches) == len(host_batches) == 5
    for batch, host in zip(gpu_batches, host_batches):
        assert isinstance(batch, netcl.GpuBatch) and isinstance(batch, tuple) and len(batch) == 3
        xb, yb, eb = batch
        assert isinstance(xb, netcl.Tensor) and isinstance(yb, netcl.Tensor) and xb.device is device
        assert np.dtype(xb.dtype) == np.float32 and np.dtype(yb.dtype) == np.int32
        for field, expected in zip(batch.host, host):
            np.testing.assert_array_equal(field, expected)
        np.testing.assert_array_equal(xb.to_host(), host[0].astype(np.float32))
        np.testing.assert_array_equal(yb.to_host(), host[1])
        assert eb is batch.host[2]
    assert not isinstance(next(iter(loader.bind_queue(None))), netcl.GpuBatch)
    with pytest.raises(TypeError, match="tuple"):
        next(iter(netcl.DataLoader(dataset, collate_fn=dict_collate, device_queue=device.queue)))


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_device_queue_argument_uploads_prefetch_batches_ahead(backend_name):
    device = _get_device(backend_name)
    dataset = CountingDataset(20)
    loader = netcl.DataLoader(dataset, batch_size=1, shuffle=False, prefetch=2, device_queue=device.queue)
    iterator = iter(loader)
    first = next(iterator)
    # Batch 0 is handed out once batches 1 and 2 are already on their way to the device.
    assert dataset.calls == 3 and isinstance(first, netcl.GpuBatch)
    rest = list(iterator)
    assert [int(batch[1].to_host()[0]) for batch in [first] + rest] == list(range(20))


# --- IDX files

_IDX_CODES = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D, np.float64: 0x0E}


def _idx_bytes(array):
    dtype = np.dtype(array.dtype)
    header = bytes([0, 0, _IDX_CODES[dtype.type], array.ndim])
    header += b"".join(int(size).to_bytes(4, "big") for size in array.shape)
    return header + array.astype(dtype.newbyteorder(">")).tobytes()


@pytest.mark.parametrize("dtype", list(_IDX_CODES))
@pytest.mark.parametrize("name", ["plain-idx3-ubyte", "packed-idx3-ubyte.gz", "packed-without-suffix"])
def test_load_idx_round_trip(tmp_path, dtype, name):
    array = (np.arange(2 * 5 * 3) - 7).reshape(2, 5, 3).astype(dtype)
    data = _idx_bytes(array)
    path = tmp_path / name
    path.write_bytes(data if name.startswith("plain") else gzip.compress(data))
    for argument in (path, str(path)):
        loaded = netcl.load_idx(argument)
        assert loaded.dtype == dtype and loaded.dtype.isnative
        np.testing.assert_array_equal(loaded, array)


def test_load_idx_reads_mnist_shaped_labels(tmp_path):
    labels = np.arange(100, dtype=np.uint8) % 10
    path = tmp_path / "train-labels-idx1-ubyte"
    path.write_bytes(_idx_bytes(labels))
    loaded = netcl.load_idx(path)
    assert loaded.dtype == np.uint8 and loaded.shape == (100,)


@pytest.mark.parametrize("corrupt, message", [
    (lambda data: b"\x01\x00" + data[2:], "magic"),
    (lambda data: data[:2] + b"\x07" + data[3:], "type code"),
    (lambda data: data[:-5], "truncated"),
    (lambda data: data[:9], "truncated"),
    (lambda data: data[:3], "truncated"),
    (lambda data: data + b"\x00", "trailing"),
    (lambda data: gzip.compress(data)[:-12], "truncated"),
])
def test_load_idx_rejects_malformed_files_naming_them(tmp_path, corrupt, message):
    path = tmp_path / "broken-idx3-ubyte"
    path.write_bytes(corrupt(_idx_bytes(np.zeros((4, 28, 28), np.uint8))))
    with pytest.raises(ValueError, match=message) as caught:
        netcl.load_idx(path)
    assert str(path) in str(caught.value)


def test_load_idx_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(OSError):
        netcl.load_idx(tmp_path / "missing-idx1-ubyte")


def test_load_idx_stops_reading_a_gzip_file_after_the_declared_size(tmp_path):
    import tracemalloc
    path = tmp_path / "bomb-idx1-ubyte.gz"
    zeros, megabytes = bytes(1 << 20), 64
    with gzip.open(path, "wb") as f:  # one element declared, then 64 MB that compress to little
        f.write(bytes([0, 0, 0x08, 1]) + (1).to_bytes(4, "big") + b"\x07")
        for _ in range(megabytes):
            f.write(zeros)
    tracemalloc.start()
    try:
        started = time.perf_counter()
        with pytest.raises(ValueError, match="trailing") as caught:
            netcl.load_idx(path)
        seconds = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(path) in str(caught.value)
    assert peak < (megabytes << 20) // 16, f"load_idx allocated {peak} bytes"
    assert seconds < 5


def test_load_idx_of_dev_zero_stops_after_the_header():
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    # In a child whose address space is capped: a reader that does not stop would otherwise
    # take the machine's memory before failing.
    out = _run_python("""
import resource
import netcl
with open("/proc/self/statm") as f:
    mapped = int(f.read().split()[0]) * resource.getpagesize()
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
soft = mapped + (512 << 20)
resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
try:
    netcl.load_idx("/dev/zero")
except ValueError as error:
    print("ValueError:", error)
""", timeout=60)
    assert out.startswith("ValueError:") and "/dev/zero" in out and "type code 0x00" in out, out


def test_load_idx_names_the_file_for_impossible_dimensions(tmp_path):
    import tracemalloc
    path = tmp_path / "odd-idx-ubyte"
    dims = lambda sizes: b"".join(int(size).to_bytes(4, "big") for size in sizes)
    # 100 dimensions whose sizes match the data: more than an ndarray can have
    for sizes, data in (([1] * 100, b"\x07"), ([0] * 100, b"")):
        path.write_bytes(bytes([0, 0, 0x08, len(sizes)]) + dims(sizes) + data)
        with raises_naming(ValueError, str(path), "100 dimensions"):
            netcl.load_idx(path)
    # An absurd declared size (2**128 bytes) is checked against the bytes there, not allocated.
    path.write_bytes(bytes([0, 0, 0x08, 4]) + dims([2 ** 32 - 1] * 4) + bytes(10))
    tracemalloc.start()
    try:
        with raises_naming(ValueError, str(path), "truncated"):
            netcl.load_idx(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # a read buffer, not the declared size


# --- interrupts, shared memory, prefetch and timeout

def _leftovers(pid):
    """What a process still holds of the DataLoader's: its child processes (but for
    multiprocessing's resource tracker, a helper that lives as long as the process does) and
    its shared-memory blocks."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat, open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                parent, command = int(stat.read().rsplit(")", 1)[1].split()[1]), cmdline.read()
        except (OSError, ValueError, IndexError):
            continue  # it exited meanwhile
        if parent == pid and b"resource_tracker" not in command:
            children.append(int(entry))
    return children, sorted(_shm_names(f"netcl_{pid}_"))


def _assert_nothing_left(pid, timeout):
    deadline = time.monotonic() + timeout
    while any(_leftovers(pid)):
        if time.monotonic() > deadline:
            children, blocks = _leftovers(pid)
            pytest.fail(f"{timeout} s after the loader was dropped, {len(children)} worker(s) "
                        f"{children} and {len(blocks)} shared-memory block(s) {blocks} are left")
        time.sleep(0.05)


def _checked_and_released(child):
    """After a round of a child below: nothing of its loaders is left, and it may go on."""
    _assert_nothing_left(child.pid, timeout=3.0)
    child.stdin.write("\n")
    child.stdin.flush()


@contextlib.contextmanager
def _reaped(child):
    """The child must end by itself, with status 0; it is killed and reaped however the block
    ends, so a failing test leaves no process behind."""
    try:
        yield
        assert child.wait(10) == 0
    finally:
        child.kill()
        child.wait()


def _script(body):
    """A Python program that imports this netcl and runs `body`."""
    return f"import sys\nsys.path[:0] = {sys.path!r}\nimport netcl\n" + body


def _start(body, tmp_path, **popen_kwargs):
    """Run `_script(body)` with pipes to its stdin and stdout; returns the process and a
    function that reads what it wrote to stderr, for failure messages."""
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as stderr:
        child = subprocess.Popen([sys.executable, "-c", _script(body)], text=True, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=stderr, **popen_kwargs)
    return child, lambda: stderr_path.read_text()[-4000:]


_INTERRUPTED_AT_MOMENTS = """
import os, time
import numpy as np

class StuckDataset:
    # In a worker, samples from `stuck_from` on take 20 s: a worker stuck in user code. In this
    # process, sample 0 (the first batch, which sizes the shared-memory blocks) may announce
    # the start-up, so that the parent's Ctrl-C comes while blocks are made and workers start.
    def __init__(self, stuck_from, announce):
        self.stuck_from, self.announce, self.parent_pid = stuck_from, announce, os.getpid()
    def __len__(self):
        return 64
    def __getitem__(self, index):
        if os.getpid() != self.parent_pid:
            if index >= self.stuck_from:
                time.sleep(20)
        elif self.announce and index == 0:
            print("now", flush=True)
        return np.full(3, index, np.float32), index

def start_up(loader):
    next(iter(loader))

def stop_wait(loader):
    iterator = iter(loader)
    next(iterator)
    print("now", flush=True)
    iterator.close()  # waits for the workers, stuck in batches 1 to 3

def waiting_for_a_batch(loader):
    iterator = iter(loader)
    next(iterator)
    print("now", flush=True)
    next(iterator)  # batch 1 never comes

for action, stuck_from in ((start_up, 0), (stop_wait, 2), (waiting_for_a_batch, 2)):
    loader = netcl.DataLoader(StuckDataset(stuck_from, action is start_up), batch_size=2,
                           shuffle=False, num_workers=2, use_shared_mem=True)
    try:
        action(loader)
        outcome = "not interrupted"
    except KeyboardInterrupt:
        outcome = "interrupted"
    del loader
    print(outcome, flush=True)
    sys.stdin.readline()  # the parent looks for leftovers meanwhile
"""


def test_interrupts_at_start_up_and_during_the_stop_leave_nothing_behind(tmp_path):
    # Ctrl-C while workers start; one Ctrl-C while the stop waits for stuck workers; two, one
    # second apart, the second landing in the stop the first one began.
    child, errors = _start(_INTERRUPTED_AT_MOMENTS, tmp_path)
    with _reaped(child), _deadline(60):
        for delays in ([0.0], [0.5], [0.3, 1.0]):
            assert child.stdout.readline() == "now\n", errors()
            for delay in delays:
                time.sleep(delay)
                child.send_signal(signal.SIGINT)
            # The Ctrl-C reached the caller, once the cleanup was done.
            assert child.stdout.readline() == "interrupted\n", errors()
            _checked_and_released(child)


_INTERRUPTED_AT_RANDOM = """
import os, random, select, signal, time
import numpy as np

class SleepyDataset:
    def __len__(self):
        return 16
    def __getitem__(self, index):
        time.sleep(0.001)
        return np.full(3, index, np.float32), index

# Ctrl-C raises KeyboardInterrupt only inside a round, so that none escapes this program's own
# loop: the rounds are what is under test.
armed = False
def interrupt(signum, frame):
    if armed:
        raise KeyboardInterrupt
signal.signal(signal.SIGINT, interrupt)

rng, rounds, interrupted = random.Random(0), 0, 0
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0)[0]:
    rounds += 1
    batches = rng.randrange(6)  # 5: the whole epoch; fewer: drop the iterator after that many
    try:
        armed = True
        loader = netcl.DataLoader(SleepyDataset(), batch_size=4, num_workers=2, use_shared_mem=True)
        if batches == 5:
            for batch in loader:
                pass
        else:
            iterator = iter(loader)
            for _ in range(batches):
                next(iterator)
            iterator = None
    except KeyboardInterrupt:
        interrupted += 1
    finally:
        armed = False
loader = iterator = batch = None
print(rounds, interrupted, flush=True)
sys.stdin.readline()
sys.stdin.readline()  # the parent looks for leftovers meanwhile
"""


def test_many_random_interrupts_leave_nothing_behind(tmp_path):
    child, errors = _start(_INTERRUPTED_AT_RANDOM, tmp_path, start_new_session=True)
    rng = np.random.default_rng(0)
    with _reaped(child), _deadline(60):
        assert child.stdout.readline() == "ready\n", errors()
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.0, 0.03))
            os.killpg(child.pid, signal.SIGINT)  # as Ctrl-C: to the consumer and its workers
        assert child.poll() is None, errors()
        child.stdin.write("stop\n")
        child.stdin.flush()
        line = child.stdout.readline()
        assert line, errors()
        rounds, interrupted = map(int, line.split())
        assert interrupted >= 20 and rounds > interrupted  # interrupts came, and rounds ended
        _checked_and_released(child)


class SignalledDataset(SampleDataset):
    """A worker that touches `bad_index` dies of `signum` (SIGBUS: what writing to a shared
    memory block does when /dev/shm has no room left for its pages)."""

    def __init__(self, n, bad_index, signum):
        super().__init__(n)
        self.bad_index, self.signum, self.parent_pid = bad_index, signum, os.getpid()

    def __getitem__(self, index):
        if index == self.bad_index and os.getpid() != self.parent_pid:
            import faulthandler
            import resource
            faulthandler.disable()  # no traceback dump, and
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file: only the death
            os.kill(os.getpid(), self.signum)
        return super().__getitem__(index)


def test_worker_killed_by_sigbus_says_shared_memory_ran_out():
    shm_before = _shm_names()
    # Batches of 4 samples: x (4, 2, 3) float32, y (4,) int64, extra (4,) int16, each field
    # rounded up to 64 bytes: 128 + 64 + 64 bytes a block.
    loader = netcl.DataLoader(SignalledDataset(40, 13, signal.SIGBUS), batch_size=4, shuffle=False,
                           num_workers=2, use_shared_mem=True)
    with _deadline(30), raises_naming(RuntimeError, "worker 1", "exit code -7", "SIGBUS", "/dev/shm",
                                      "256 bytes", "use_shared_mem=False", "prefetch"):
        list(loader)
    del loader
    _assert_clean(shm_before)
    # Without shared memory a SIGBUS is only what it is.
    loader = netcl.DataLoader(SignalledDataset(40, 13, signal.SIGBUS), batch_size=4, shuffle=False,
                           num_workers=2)
    with _deadline(30), pytest.raises(RuntimeError, match="exit code -7") as caught:
        list(loader)
    assert "/dev/shm" not in str(caught.value)


@pytest.mark.parametrize("kwargs, needles", [
    ({"prefetch": 65}, ("prefetch", "65", "64")),
    ({"prefetch": 10**9}, ("prefetch", str(10**9), "64")),
    ({"num_workers": 17, "prefetch": 64}, ("num_workers * prefetch", "1088", "1024")),
    ({"num_workers": 2000}, ("num_workers * prefetch", "4000", "1024")),
])
def test_prefetch_and_batches_in_flight_are_bounded(kwargs, needles):
    # Each batch in flight holds a shared-memory block (two file descriptors): 10**9 of them
    # used to fail with "Too many open files".
    with raises_naming(ValueError, "DataLoader", *needles):
        netcl.DataLoader(netcl.ArrayDataset(*_samples(10)), **kwargs)
    for fine in ({"prefetch": 64}, {"num_workers": 16, "prefetch": 64}, {"num_workers": 512}):
        netcl.DataLoader(netcl.ArrayDataset(*_samples(10)), **fine)  # built, not iterated


class HangingDataset(SampleDataset):
    """In a worker, samples from `hang_from` on never come (a stuck network read, say)."""

    def __init__(self, n, hang_from):
        super().__init__(n)
        self.hang_from, self.parent_pid = hang_from, os.getpid()

    def __getitem__(self, index):
        if index >= self.hang_from and os.getpid() != self.parent_pid:
            time.sleep(60)
        return super().__getitem__(index)


@pytest.mark.parametrize("use_shared_mem", [False, True])
def test_timeout_raises_on_a_hung_worker_and_leaves_no_worker(use_shared_mem):
    shm_before = _shm_names()
    loader = netcl.DataLoader(HangingDataset(40, hang_from=8), batch_size=4, shuffle=False, num_workers=2,
                           use_shared_mem=use_shared_mem, timeout=0.5)
    batches = []
    start = time.monotonic()
    with _deadline(30), raises_naming(RuntimeError, "DataLoader timed out after 0.5 seconds", "batch 2"):
        for batch in loader:
            batches.append(batch)
    assert _ids(batches) == list(range(8))  # the batches before the hang all came
    assert time.monotonic() - start < 10
    del loader, batch
    _assert_clean(shm_before)


def test_bad_timeouts_are_rejected():
    dataset = netcl.ArrayDataset(*_samples(10))
    for bad in (-1, -0.5):
        with raises_naming(ValueError, "timeout", str(bad)):
            netcl.DataLoader(dataset, num_workers=2, timeout=bad)
    for bad in ("1", None, True, float("nan"), float("inf"), [1]):
        with raises_naming((TypeError, ValueError), "timeout", repr(bad)):
            netcl.DataLoader(dataset, num_workers=2, timeout=bad)
    # As PyTorch, a timeout is for waiting on workers: without them it is an error.
    with raises_naming(ValueError, "timeout", "num_workers"):
        netcl.DataLoader(dataset, timeout=1.0)
    for fine in (0, 2, 2.5, np.float64(0.25)):
        netcl.DataLoader(dataset, num_workers=2, timeout=fine)
    netcl.DataLoader(dataset, timeout=0)


# ---------------------------------------------------------------------------------------------
# Trainer: fit / evaluate, checkpoints, resume, schedules, History, progress
# ---------------------------------------------------------------------------------------------

# --- the fit/evaluate pipeline, errors, History, output and checkpoints

def _blobs(n=96, features=8, classes=3, seed=0):
    """Separable Gaussian blobs: x (n, features) float32, y (n,) int64."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((classes, features)) * 3
    y = rng.integers(0, classes, n)
    return (centers[y] + rng.standard_normal((n, features))).astype(np.float32), y


BLOBS_MLP = (8, 16, 3)  # the sizes of the MLP (`_mlp`) that classifies `_blobs()`


def _batches(x, y, batch_size):
    return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(x), batch_size)]


def test_trainer_history_records_every_epoch(backend, capsys):
    x, y = _blobs()
    model = _mlp(backend, BLOBS_MLP)
    trainer = netcl.Trainer(model, netcl.AdamW(model.parameters(), lr=1e-2),
                            device_queue=backend.queue, metrics_stride=1)
    history = trainer.fit(_batches(x, y, 32), _batches(x, y, 48), epochs=3)
    assert isinstance(history, list) and len(history) == 3
    assert [h["epoch"] for h in history] == [1, 2, 3]
    for h in history:
        assert set(h) == {"epoch", "loss", "accuracy", "val_loss", "val_accuracy",
                          "samples_per_s", "seconds"}
        assert h["samples_per_s"] == pytest.approx(len(x) / h["seconds"], rel=1e-6)
    assert history[-1]["loss"] < history[0]["loss"]
    no_val = trainer.fit(_batches(x, y, 32), epochs=1)
    assert "val_loss" not in no_val[0] and "val_accuracy" not in no_val[0]
    out = capsys.readouterr().out
    assert "\r" not in out and "\x1b" not in out  # not a terminal: plain lines only
    assert out.count("epoch ") == 4


@TRAINING_SETTINGS
@given(stride=st.integers(1, 4), bad_step=st.integers(0, 9))
def test_trainer_non_finite_loss_names_the_step(backend, stride, bad_step):
    x, y = _blobs(n=40)
    inner = _mlp(backend, BLOBS_MLP)
    calls = [0]

    def model(xb):  # NaN logits from training step `bad_step` on (SGD spreads it to weights)
        factor = math.nan if calls[0] >= bad_step else 1.0
        calls[0] += 1
        return inner(xb) * factor

    trainer = netcl.Trainer(model, netcl.SGD(inner.parameters(), lr=0.1),
                            device_queue=backend.queue, metrics_stride=stride)
    first_bad_metrics_step = -(-bad_step // stride) * stride
    batches = _batches(x, y, 4)  # 10 steps per epoch
    if first_bad_metrics_step < len(batches):
        with raises_naming(RuntimeError, f"non-finite loss at step {first_bad_metrics_step}"):
            trainer.fit(batches, epochs=1)
    else:
        trainer.fit(batches, epochs=1)


def test_trainer_index_and_one_hot_labels_give_the_same_history(backend):
    x, y = _blobs()
    histories = []
    for labels in (y, np.eye(3, dtype=np.float32)[y]):
        model = _mlp(backend, BLOBS_MLP)
        trainer = netcl.Trainer(model, netcl.AdamW(model.parameters(), lr=1e-2), grad_clip=1.0,
                                device_queue=backend.queue, metrics_stride=2)
        histories.append(trainer.fit(_batches(x, labels, 16), _batches(x, labels, 50), epochs=2))
    for a, b in zip(*histories):
        for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


def test_trainer_rejects_out_of_range_labels(backend):
    x, y = _blobs(n=32)
    model = _mlp(backend, BLOBS_MLP)
    trainer = netcl.Trainer(model, netcl.SGD(model.parameters(), lr=0.1), device_queue=backend.queue)
    bad = y.copy()
    bad[5] = 7
    with raises_naming(ValueError, "7"):
        trainer.fit([(x, bad)], epochs=1)
    with raises_naming(ValueError, "-1"):
        trainer.fit([(x, np.full(32, -1))], epochs=1)
    with raises_naming(ValueError, "4"):
        trainer.fit([(x, np.eye(4, dtype=np.float32)[y])], epochs=1)


def test_trainer_clips_through_the_fused_step_or_clip_grad_norm(backend, monkeypatch):
    x, y = _blobs(n=48)
    x = x * 100  # large gradients, so clipping matters
    clip_calls = []
    real_clip = netcl.clip_grad_norm
    monkeypatch.setattr(netcl, "clip_grad_norm",
                        lambda params, max_norm, *a, **k: clip_calls.append(max_norm)
                        or real_clip(params, max_norm, *a, **k))
    # SGD's step takes no max_norm: the Trainer clips with clip_grad_norm, then steps.
    model = _mlp(backend, BLOBS_MLP)
    before = [host(p) for p in model.parameters()]
    trainer = netcl.Trainer(model, netcl.SGD(model.parameters(), lr=1.0), grad_clip=0.5,
                            device_queue=backend.queue)
    trainer.fit([(x, y)], epochs=1)
    assert clip_calls == [0.5]
    update = math.sqrt(sum(float(((host(p) - b) ** 2).sum())
                           for p, b in zip(model.parameters(), before)))
    assert update <= 0.5 * (1 + 1e-4)  # lr 1: the update is the clipped gradient
    # AdamW clips inside its step: step(max_norm=...) once per batch, never clip_grad_norm.
    model = _mlp(backend, BLOBS_MLP)
    opt = netcl.AdamW(model.parameters(), lr=1e-3)
    steps = []
    real_step = opt.step
    opt.step = lambda max_norm=None: steps.append(max_norm) or real_step(max_norm=max_norm)
    netcl.Trainer(model, opt, grad_clip=0.5, device_queue=backend.queue).fit(
        _batches(x, y, 16), epochs=1)
    assert steps == [0.5, 0.5, 0.5] and clip_calls == [0.5]


def test_trainer_evaluate_changes_nothing_and_restores_the_mode(backend, capsys):
    x, y = _blobs(n=50)
    model = nn.Sequential(nn.Linear(8, 16, queue=backend.queue), nn.Dropout(0.5),
                          nn.Linear(16, 3, queue=backend.queue))
    opt = netcl.AdamW(model.parameters(), lr=1e-2)
    trainer = netcl.Trainer(model, opt, device_queue=backend.queue)
    trainer.fit(_batches(x, y, 25), epochs=1)
    params = [host(p) for p in model.parameters()]
    grads = [host(p.grad) for p in model.parameters()]
    state = opt.state_dict()
    for mode in (True, False):
        model.train(mode)
        result = trainer.evaluate(_batches(x, y, 20))
        assert model.training is mode
        assert set(result) == {"loss", "accuracy"}
        logits = host(model.eval()(tensor(x, backend)))
        model.train(mode)
        expected_loss = float(np.mean(
            np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1))
            + logits.max(1) - logits[np.arange(len(y)), y]))
        assert result["loss"] == pytest.approx(expected_loss, rel=1e-4)
        assert result["accuracy"] == pytest.approx((logits.argmax(1) == y).mean())
    for p, before, g in zip(model.parameters(), params, grads):
        np.testing.assert_array_equal(host(p), before)
        np.testing.assert_array_equal(host(p.grad), g)
    assert str(opt.state_dict()) == str(state)
    assert "accuracy" in capsys.readouterr().out


def test_trainer_checkpoint_saves_only_on_improvement(backend, tmp_path, monkeypatch):
    x, y = _blobs(n=30)
    model = _mlp(backend, BLOBS_MLP)
    trainer = netcl.Trainer(model, netcl.SGD(model.parameters(), lr=0.01), device_queue=backend.queue)
    scripted = iter([0.5, 0.4, 0.6, 0.6, 0.7])
    monkeypatch.setattr(trainer, "_evaluate", lambda *a: {"loss": 1.0, "accuracy": next(scripted)})
    saved = []
    real_save = netcl.save
    monkeypatch.setattr(netcl, "save", lambda state, path: saved.append(
        {k: v.copy() for k, v in state.items()}) or real_save(state, path))
    path = tmp_path / "best.npz"
    trainer.fit(_batches(x, y, 10), _batches(x, y, 10), epochs=4, checkpoint=path)
    assert len(saved) == 2  # epoch 1 (the first validation) and epoch 3 (0.6 > 0.5); not 0.6 again
    loaded = netcl.load(path)
    assert set(loaded) == set(saved[-1])
    for key in loaded:
        np.testing.assert_array_equal(loaded[key], saved[-1][key])
    fresh = _mlp(backend, BLOBS_MLP, seed=1)
    fresh.load_state_dict(loaded)
    assert path.exists()
    with raises_naming(ValueError, "checkpoint"):
        netcl.Trainer(lambda xb: xb, netcl.SGD(model.parameters(), lr=0.1)).fit(
            [], [], checkpoint=path)


def test_trainer_accepts_any_callable_loss_and_gpu_batches(backend):
    x, y = _blobs(n=64)
    extra = np.arange(64)
    w = param(np.random.default_rng(0).uniform(-0.3, 0.3, (3, 8)), backend)
    b = param(np.zeros(3), backend)
    model = lambda xb: F.linear(xb, w, b)  # a plain function: no train/eval/parameters
    calls = []

    def loss_fn(logits, target):
        calls.append(1)
        return F.cross_entropy(logits, target)

    loader = netcl.DataLoader(netcl.ArrayDataset(x, y, extra), batch_size=16, seed=0,
                              device_queue=backend.queue)
    trainer = netcl.Trainer(model, netcl.SGD([w, b], lr=0.1), device_queue=backend.queue,
                            loss_fn=lambda *a: 1 / 0, metrics_stride=1)
    history = trainer.fit(loader, epochs=2, loss_fn=loss_fn)  # fit's loss_fn wins
    assert len(calls) == 8 and history[-1]["accuracy"] > 0.5


def test_trainer_memory_stays_flat_without_gc(backend):
    x, y = _blobs(n=64)
    model = _mlp(backend, BLOBS_MLP)
    trainer = netcl.Trainer(model, netcl.AdamW(model.parameters(), lr=1e-2), grad_clip=1.0,
                            device_queue=backend.queue, metrics_stride=3)
    batches = _batches(x, y, 8)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        trainer.fit(batches, epochs=2)
        in_use = []
        for _ in range(4):
            trainer.fit(batches, epochs=1)
            in_use.append(backend.pool.stats()["in_use_bytes"])
    finally:
        if was_enabled:
            gc.enable()
    assert len(set(in_use)) == 1, in_use


def test_trainer_host_syncs_per_100_steps(opencl):
    x, y = _blobs(n=400)
    model = _mlp(opencl, BLOBS_MLP)
    trainer = netcl.Trainer(model, netcl.AdamW(model.parameters(), lr=1e-2), grad_clip=1.0,
                            device_queue=opencl.queue, metrics_stride=10)
    batches = _batches(x, y, 4)  # 100 steps
    trainer.fit(batches[:10], epochs=1)  # warm up: kernels built, buffers pooled
    before = opencl.syncs
    trainer.fit(batches, epochs=1)
    # Two reads (loss, logits) at each of the 10 metrics steps, one read of the epoch's loss;
    # and the drain's waits: once for each step's marker, once more for each metrics step's
    # forward.
    assert opencl.syncs - before == 2 * 10 + 1 + 100 + 10


def test_trainer_mixed_precision_on_cpu_is_float32_with_a_notice(cpu, capsys):
    x, y = _blobs()
    histories = []
    for mixed in (False, True):
        model = _mlp(cpu, BLOBS_MLP)
        trainer = netcl.Trainer(model, netcl.AdamW(model.parameters(), lr=1e-2),
                                device_queue=cpu.queue, mixed_precision=mixed, metrics_stride=1)
        histories.append(trainer.fit(_batches(x, y, 32), epochs=2))
    assert "mixed precision" in capsys.readouterr().out
    for a, b in zip(*histories):
        assert a["loss"] == b["loss"] and a["accuracy"] == b["accuracy"]


@pytest.mark.parametrize("kwargs, needle", [
    ({"metrics_stride": 0}, "metrics_stride"), ({"grad_clip": -1.0}, "grad_clip"),
    ({"loss_fn": 3}, "loss_fn")])
def test_trainer_validates_its_arguments(cpu, kwargs, needle):
    model = _mlp(cpu, BLOBS_MLP)
    with raises_naming(ValueError, needle):
        netcl.Trainer(model, netcl.SGD(model.parameters(), lr=0.1), **kwargs)


@pytest.mark.parametrize("mixed_precision", [False, True])
def test_trainer_reaches_95_percent_on_digits(backend, digits, mixed_precision):
    """The tutorial's Trainer run; with mixed_precision=True too (tensor cores on NVIDIA,
    float32 with a notice on PoCL and the NumPy backend)."""
    x = digits.x
    order = np.random.default_rng(0).permutation(len(x))
    train, test = order[:1400], order[1400:]
    model = _mlp(backend, (64, 128, 10))
    trainer = netcl.Trainer(model, netcl.AdamW(model.parameters(), lr=3e-3), grad_clip=1.0,
                            device_queue=backend.queue, mixed_precision=mixed_precision)
    train_loader = netcl.DataLoader(netcl.ArrayDataset(x[train], digits.y[train]),
                                    batch_size=32, seed=0)
    test_loader = netcl.DataLoader(netcl.ArrayDataset(x[test], digits.y[test]),
                                   batch_size=200, shuffle=False)
    trainer.fit(train_loader, epochs=15)
    assert trainer.evaluate(test_loader)["accuracy"] >= 0.95


def test_trainer_epoch_loss_is_the_mean_over_every_step(backend):
    x, y = _blobs(n=70)
    model = _mlp(backend, BLOBS_MLP)
    losses = []

    def loss_fn(logits, target):
        loss = F.cross_entropy(logits, target)
        losses.append((loss, logits.shape[0]))
        return loss

    trainer = netcl.Trainer(model, netcl.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn,
                            device_queue=backend.queue, metrics_stride=100)
    history = trainer.fit(_batches(x, y, 16), epochs=1)  # 5 steps, the last of 6 samples
    expected = sum(float(host(loss)) * n for loss, n in losses) / len(x)
    assert history[0]["loss"] == pytest.approx(expected, rel=1e-5)


def test_trainer_non_finite_loss_stops_before_its_update(backend):
    model = nn.Sequential(nn.Linear(4, 2, queue=backend.queue))
    trainer = netcl.Trainer(model, netcl.SGD(model.parameters(), lr=0.1),
                            device_queue=backend.queue, metrics_stride=1)
    x = np.ones((8, 4), np.float32)
    x_nan = x.copy()
    x_nan[0, 0] = np.nan
    y = np.zeros(8, np.int64)
    with raises_naming(RuntimeError, "non-finite loss at step 1"):
        trainer.fit([(x, y), (x_nan, y)])
    assert all(np.isfinite(v).all() for v in model.state_dict().values())


def test_trainer_accuracy_exists_for_every_epoch_and_log_every_sets_validation(backend, capsys,
                                                                                monkeypatch):
    x, y = _blobs(n=40)
    model = _mlp(backend, BLOBS_MLP)
    trainer = netcl.Trainer(model, netcl.AdamW(model.parameters(), lr=1e-2),
                            device_queue=backend.queue)  # metrics_stride 10 > 2 steps an epoch
    calls = []
    real_evaluate = trainer._evaluate
    monkeypatch.setattr(trainer, "_evaluate", lambda *a: calls.append(1) or real_evaluate(*a))
    history = trainer.fit(_batches(x, y, 20), _batches(x, y, 40), epochs=5, log_every=2)
    assert all(0.0 <= h["accuracy"] <= 1.0 for h in history)
    assert len(calls) == 2  # epochs 2 and 4
    assert [h["val_accuracy"] is not None for h in history] == [False, True, False, True, False]
    assert capsys.readouterr().out.count("epoch ") == 5  # a line every epoch


def test_trainer_integer_one_hot_labels_train_like_float_ones(backend):
    x, y = _blobs()
    histories = []
    for dtype in (np.int64, np.float32):
        model = _mlp(backend, BLOBS_MLP)
        trainer = netcl.Trainer(model, netcl.SGD(model.parameters(), lr=0.1),
                                device_queue=backend.queue, metrics_stride=1)
        histories.append(trainer.fit(_batches(x, np.eye(3, dtype=dtype)[y], 32), epochs=2))
    for a, b in zip(*histories):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["accuracy"] == b["accuracy"]


def test_fit_checkpoint_that_fails_to_save_names_it_and_keeps_the_best(backend, tmp_path,
                                                                      monkeypatch):
    import errno
    x, y = _blobs(n=30)
    model = _mlp(backend, BLOBS_MLP)
    trainer = netcl.Trainer(model, netcl.SGD(model.parameters(), lr=0.1), device_queue=backend.queue)
    scripted = iter([0.5, 0.6])
    monkeypatch.setattr(trainer, "_evaluate", lambda *a: {"loss": 1.0, "accuracy": next(scripted)})
    real_savez, saved = np.savez, []

    def savez_fails_the_second_time(file, **arrays):
        saved.append({key: value.copy() for key, value in arrays.items()})
        if len(saved) == 2:
            file.write(b"PK\x03\x04")
            raise OSError(errno.ENOSPC, "No space left on device")
        real_savez(file, **arrays)

    monkeypatch.setattr(np, "savez", savez_fails_the_second_time)
    path = tmp_path / "best.npz"
    with pytest.raises(OSError) as caught:
        trainer.fit(_batches(x, y, 10), _batches(x, y, 10), epochs=2, checkpoint=path)
    assert len(saved) == 2 and os.listdir(tmp_path) == ["best.npz"]
    best = netcl.load(path)
    _same_arrays(best, saved[0])
    _mlp(backend, BLOBS_MLP, seed=1).load_state_dict(best)
    assert str(path) in str(caught.value) and "No space left" in str(caught.value)


def test_trainer_refuses_an_empty_batch(backend):
    x, y = _blobs(n=8)
    model = _mlp(backend, BLOBS_MLP)
    trainer = netcl.Trainer(model, netcl.SGD(model.parameters(), lr=0.1),
                            device_queue=backend.queue)
    batches = [(x[:4], y[:4]), (x[:0], y[:0])]
    with raises_naming(ValueError, "empty batch", "(0, 8)"):
        trainer.fit(batches)
    with raises_naming(ValueError, "empty batch", "(0, 8)"):
        trainer.evaluate(batches)


@pytest.mark.parametrize("on_device", [False, True])
def test_trainer_trains_on_integer_inputs_as_on_their_float_values(backend, on_device, capsys):
    x, y = _blobs(n=48)
    images = np.clip(x * 20 + 128, 0, 255).astype(np.uint8)  # uint8 "pixels"
    results = []
    for inputs in (images, images.astype(np.float32)):
        model = _mlp(backend, BLOBS_MLP)
        loader = netcl.DataLoader(netcl.ArrayDataset(inputs, y), batch_size=16, shuffle=False,
                                  device_queue=backend.queue if on_device else None)
        trainer = netcl.Trainer(model, netcl.SGD(model.parameters(), lr=1e-4),
                                device_queue=backend.queue, metrics_stride=1)
        history = trainer.fit(loader, loader, epochs=2)
        results.append(([(h["loss"], h["accuracy"], h["val_loss"]) for h in history],
                        model.state_dict()))
    (history_u8, state_u8), (history_f32, state_f32) = results
    assert history_u8 == history_f32
    np.testing.assert_equal(state_u8, state_f32)


def test_trainer_needs_class_scores_from_the_model(backend, capsys):
    x, y = _blobs(n=16)
    inner = _mlp(backend, BLOBS_MLP)
    model = lambda xb: F.sum(inner(xb), axis=1)  # (N,), not (N, C)
    trainer = netcl.Trainer(model, netcl.SGD(inner.parameters(), lr=0.1),
                            device_queue=backend.queue, loss_fn=lambda out, t: F.mean(out * out))
    for run in (trainer.fit, trainer.evaluate):
        with raises_naming(ValueError, "Trainer", "(16,)", "class scores (N, C)"):
            run(_batches(x, y, 16))
    # A regression output (N, 1) against float targets (N, 1) with its own loss keeps working.
    head = param(np.full((1, 3), 0.1), backend)
    regression = netcl.Trainer(lambda xb: F.linear(inner(xb), head),
                               netcl.SGD([head], lr=1e-3), device_queue=backend.queue,
                               loss_fn=F.mse_loss)
    history = regression.fit(_batches(x, y[:, None].astype(np.float32), 8))
    assert math.isfinite(history[0]["loss"])


def _resume_run(dev, epochs, tmp_path, resume=None, training_checkpoint=None, mixed=False):
    """A fresh model, optimizer, StepLR and seeded DataLoader (the same seeds every time),
    trained to `epochs` with a Dropout, so the random stream matters too."""
    x, y = _blobs(n=64)
    netcl.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, queue=dev.queue), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(16, 3, queue=dev.queue))
    opt = netcl.AdamW(model.parameters(), lr=1e-2)
    loader = netcl.DataLoader(netcl.ArrayDataset(x, y), batch_size=16)
    trainer = netcl.Trainer(model, opt, device_queue=dev.queue, grad_clip=1.0, metrics_stride=1,
                            mixed_precision=mixed)
    history = trainer.fit(loader, _batches(x, y, 32), epochs=epochs, resume=resume,
                          scheduler=netcl.StepLR(opt, step_size=1, gamma=0.5),
                          training_checkpoint=training_checkpoint)
    return trainer, history


@pytest.mark.parametrize("mixed", [False, True])
def test_fit_resume_continues_exactly(backend, tmp_path, capsys, mixed):
    whole, whole_history = _resume_run(backend, 4, tmp_path, mixed=mixed)
    ckpt = tmp_path / "train.npz"
    first, _ = _resume_run(backend, 2, tmp_path, training_checkpoint=ckpt, mixed=mixed)
    first.save_checkpoint(tmp_path / "manual.npz")
    saved = netcl.load(ckpt)
    assert str(netcl.load(tmp_path / "manual.npz")) == str(saved)
    assert saved["trainer"]["epoch"] == 2 and saved["trainer"]["loader_epoch"] == 2
    assert saved["scheduler"]["last_epoch"] == 2 and saved["optimizer"]["state"][0]["step"] == 8
    assert "optimizer.state.0.exp_avg" in np.load(ckpt).files
    resumed, history = _resume_run(backend, 4, tmp_path, resume=ckpt, mixed=mixed)
    assert [h["epoch"] for h in history] == [3, 4]  # `epochs` is the last epoch's number
    for a, b in zip(whole_history[2:], history):
        for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
            assert a[key] == b[key], key
    # The same kernels in the same order: exactly equal parameters, moments and lr.
    _same_arrays(resumed.model.state_dict(), whole.model.state_dict())
    assert str(resumed.optimizer.state_dict()) == str(whole.optimizer.state_dict())
    # A Trainer that loads the checkpoint itself, then fits, continues the same way.
    again, _ = _resume_run(backend, 2, tmp_path)
    again.load_checkpoint(ckpt)
    _same_arrays(again.model.state_dict(), first.model.state_dict())
    assert "epoch 3/4" in capsys.readouterr().out


def test_resume_needs_a_training_checkpoint_and_its_scheduler(cpu, tmp_path):
    x, y = _blobs(n=32)
    model = _mlp(cpu, BLOBS_MLP)
    opt = netcl.SGD(model.parameters(), lr=0.1)
    trainer = netcl.Trainer(model, opt, device_queue=cpu.queue)
    trainer.fit(_batches(x, y, 16), epochs=1, scheduler=netcl.StepLR(opt, 1),
                training_checkpoint=tmp_path / "run.npz", checkpoint=tmp_path / "best.npz")
    with raises_naming(ValueError, "best.npz", "not a training checkpoint"):
        trainer.fit(_batches(x, y, 16), epochs=2, resume=tmp_path / "best.npz")
    with raises_naming(ValueError, "scheduler"):
        trainer.fit(_batches(x, y, 16), epochs=2, resume=tmp_path / "run.npz")
    with raises_naming(ValueError, "monitor", "'loss'"):
        trainer.fit(_batches(x, y, 16), epochs=2, resume=tmp_path / "run.npz", monitor="loss",
                    scheduler=netcl.StepLR(opt, 1))
    assert trainer.fit(_batches(x, y, 16), epochs=1, resume=tmp_path / "run.npz",
                       scheduler=netcl.StepLR(opt, 1)) == []  # epoch 1 is done already


class _LrSpy(netcl.SGD):
    """SGD that records the lr of every step it takes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def step(self):
        self.seen.append(self.lr)
        super().step()


def test_fit_steps_each_schedule_when_it_says(backend, monkeypatch):
    x, y = _blobs(n=48)
    batches = _batches(x, y, 16)  # 3 steps an epoch
    model = _mlp(backend, BLOBS_MLP)
    opt = _LrSpy(model.parameters(), lr=0.1)
    trainer = netcl.Trainer(model, opt, device_queue=backend.queue)
    schedule = netcl.WarmupCosine(opt, warmup_steps=2, total_steps=9)  # per batch
    trainer.fit(batches, epochs=3, scheduler=schedule)
    assert opt.seen == [schedule.lr_at(s) for s in range(9)]
    opt.seen, opt.lr = [], 0.1
    trainer.fit(batches, epochs=4, scheduler=netcl.StepLR(opt, step_size=2, gamma=0.5))
    assert opt.seen == [0.1] * 6 + [0.05] * 6  # per epoch
    # ReduceLROnPlateau: once per validated epoch, with the monitored value.
    scripted = iter([1.0, 1.0, 0.5, 0.6, 0.6, 0.6])
    monkeypatch.setattr(trainer, "_evaluate", lambda *a: {"loss": next(scripted), "accuracy": 0.5})
    opt.seen, opt.lr = [], 0.1
    trainer.fit(batches, batches, epochs=6, monitor="val_loss",
                scheduler=netcl.ReduceLROnPlateau(opt, patience=1, factor=0.5))
    expected = _plateau_reference([1.0, 1.0, 0.5, 0.6, 0.6, 0.6], 0.1, "min", 0.5, 1, 1e-4,
                                  "rel", 0, 0, 1e-8)
    assert opt.seen == [lr for lr in [0.1] + expected[:-1] for _ in range(3)]
    with raises_naming(ValueError, "ReduceLROnPlateau", "mode='max'"):
        trainer.fit(batches, batches, epochs=1, scheduler=netcl.ReduceLROnPlateau(opt))


def test_fit_and_evaluate_check_their_arguments_before_training(cpu, tmp_path):
    """Arguments that would fail only after the first epoch had trained (a loader that is no
    iterable, a loss that is no callable, a checkpoint that is no path or has no directory,
    a training checkpoint of a model without state_dict) are refused before any step: the
    weights are unchanged."""
    x, y = _blobs(n=16)
    batches = _batches(x, y, 8)
    model = _mlp(cpu, BLOBS_MLP)
    trainer = netcl.Trainer(model, netcl.SGD(model.parameters(), lr=0.5))
    weights = model.state_dict()
    for kwargs, error, words in (
            (dict(train_loader=None), TypeError, "train_loader NoneType"),
            (dict(val_loader=3), TypeError, "val_loader int"),
            (dict(loss_fn=3), ValueError, "loss_fn 3"),
            (dict(checkpoint=3), TypeError, "checkpoint int"),
            (dict(training_checkpoint=tmp_path / "no" / "run.npz"), ValueError,
             "training_checkpoint no")):
        with raises_naming(error, "fit", *words.split()):
            trainer.fit(**{"train_loader": batches, **kwargs})
    plain = netcl.Trainer(lambda xb: model(xb), netcl.SGD(model.parameters(), lr=0.5))
    with raises_naming(ValueError, "training_checkpoint", "state_dict"):
        plain.fit(batches, training_checkpoint=tmp_path / "run.npz")
    np.testing.assert_equal(model.state_dict(), weights)
    with raises_naming(TypeError, "evaluate", "data_loader"):
        trainer.evaluate(None)
    with raises_naming(ValueError, "evaluate", "loss_fn"):
        trainer.evaluate(batches, loss_fn=3)


def test_a_resume_of_a_run_that_stopped_early_stops_too(cpu, tmp_path, capsys):
    """A run that stopped early, resumed with the same patience, trains no more epochs: as
    if it had never stopped; with more patience it carries on."""
    x, y = _blobs(n=32)
    batches = _batches(x, y, 16)
    model = _mlp(cpu, BLOBS_MLP)
    trainer = netcl.Trainer(model, netcl.SGD(model.parameters(), lr=0.0))  # a plateau
    path = tmp_path / "run.npz"
    history = trainer.fit(batches, epochs=6, patience=2, monitor="loss", training_checkpoint=path)
    assert [h["epoch"] for h in history] == [1, 2, 3]
    capsys.readouterr()
    resumed = netcl.Trainer(model, netcl.SGD(model.parameters(), lr=0.0))
    assert list(resumed.fit(batches, epochs=6, patience=2, resume=path)) == []
    assert "early stopping" in capsys.readouterr().out
    longer = netcl.Trainer(model, netcl.SGD(model.parameters(), lr=0.0))
    assert [h["epoch"] for h in longer.fit(batches, epochs=6, patience=3, resume=path)] == [4]


def test_a_resume_that_fails_leaves_the_model_and_optimizer_as_they_were(cpu, tmp_path):
    """A checkpoint of an AdamW run resumed with SGD, or with another kind of scheduler, is
    rejected with a ValueError naming what does not fit, and the model, optimizer and
    schedule keep their own states (the model is not left loaded)."""
    x, y = _blobs(n=32)
    batches = _batches(x, y, 16)
    model = _mlp(cpu, BLOBS_MLP)
    trainer = netcl.Trainer(model, netcl.AdamW(model.parameters(), lr=0.01))
    path = tmp_path / "run.npz"
    trainer.fit(batches, epochs=1, training_checkpoint=path,
                scheduler=netcl.StepLR(trainer.optimizer, 1))
    other = _mlp(cpu, BLOBS_MLP)
    weights = other.state_dict()
    sgd = netcl.SGD(other.parameters(), lr=0.1, momentum=0.9)
    with raises_naming(ValueError, "'momentum_buffer'"):
        netcl.Trainer(other, sgd).fit(batches, epochs=2, resume=path)
    adamw = netcl.AdamW(other.parameters(), lr=0.5)
    schedule = netcl.WarmupCosine(adamw, 1, 10)
    before = adamw.state_dict()
    with raises_naming(ValueError, "WarmupCosine", "'base_lr'"):
        netcl.Trainer(other, adamw).fit(batches, epochs=2, resume=path, scheduler=schedule)
    np.testing.assert_equal(other.state_dict(), weights)
    np.testing.assert_equal(adamw.state_dict(), before)
    assert schedule.base_lr == 0.5 and adamw.lr == 0.0


def test_schedules_check_a_state_before_setting_any_of_it(cpu):
    """A rejected state (a bad value, a missing key) leaves the schedule and the optimizer's
    lr as they were; a second WarmupCosine on one optimizer starts from the lr it had before
    the first (PyTorch's initial_lr), not from the first one's lr(0) of 0."""
    opt = netcl.SGD([param(np.ones(2, np.float32), cpu)], lr=0.1)
    warmup = netcl.WarmupCosine(opt, 2, 10)
    assert opt.lr == 0.0 and netcl.WarmupCosine(opt, 2, 10).base_lr == 0.1
    good = warmup.state_dict()
    for change, error, words in ((dict(base_lr=-1.0), ValueError, "base_lr"),
                                 (dict(total_steps=1), ValueError, "warmup_steps"),
                                 (dict(last_step="x"), ValueError, "last_step")):
        with raises_naming(error, "WarmupCosine", *words.split()):
            warmup.load_state_dict({**good, **change})
        assert warmup.state_dict() == good and opt.lr == 0.0
    step = netcl.StepLR(opt, 2)
    good = step.state_dict()
    for bad in ({**good, "gamma": "x", "lr": 0.7}, {"lr": 0.7}):
        with pytest.raises((ValueError, TypeError)):
            step.load_state_dict(bad)
        assert step.state_dict() == good and opt.lr == 0.0


def test_fit_stops_early_on_a_plateau_and_resumes_the_count(backend, tmp_path, capsys):
    x, y = _blobs(n=32)
    batches = _batches(x, y, 16)
    model = _mlp(backend, BLOBS_MLP)
    trainer = netcl.Trainer(model, netcl.SGD(model.parameters(), lr=0.0),  # a plateau
                            device_queue=backend.queue)
    history = trainer.fit(batches, epochs=10, patience=2, monitor="loss")
    assert [h["epoch"] for h in history] == [1, 2, 3]  # best at 1, none better at 2 and 3
    assert "early stopping" in capsys.readouterr().out
    assert len(trainer.fit(batches, epochs=10, patience=3)) == 4  # default monitor: accuracy
    # The count survives a checkpoint: 1 epoch, then a resume stops at the same epoch 3.
    trainer.fit(batches, epochs=1, patience=2, training_checkpoint=tmp_path / "run.npz")
    resumed = trainer.fit(batches, epochs=10, patience=2, resume=tmp_path / "run.npz")
    assert [h["epoch"] for h in resumed] == [2, 3]
    with raises_naming(ValueError, "patience"):
        trainer.fit(batches, patience=0)
    with raises_naming(ValueError, "monitor", "val_loader"):
        trainer.fit(batches, monitor="val_loss")
    with raises_naming(ValueError, "monitor", "'best'"):
        trainer.fit(batches, monitor="best")


@pytest.mark.parametrize("scores, monitor, saved_epochs", [
    ([(0.5, 1.0), (0.6, 1.2), (0.6, 0.8), (0.7, 0.9)], None, [1, 2, 4]),  # val_accuracy
    ([(0.5, 1.0), (0.6, 1.2), (0.6, 0.8), (0.7, 0.9)], "val_loss", [1, 3])])
def test_the_best_checkpoint_follows_the_monitored_value(backend, tmp_path, monkeypatch, scores,
                                                         monitor, saved_epochs):
    x, y = _blobs(n=20)
    model = _mlp(backend, BLOBS_MLP)
    trainer = netcl.Trainer(model, netcl.SGD(model.parameters(), lr=0.01),
                            device_queue=backend.queue)
    scripted = iter(scores)
    epochs_run = []
    monkeypatch.setattr(trainer, "_evaluate", lambda *a: dict(
        zip(("accuracy", "loss"), next(scripted))))
    saves = []
    real_save = netcl.save
    monkeypatch.setattr(netcl, "save", lambda state, path: saves.append(len(epochs_run))
                        or real_save(state, path))
    real_fit_epoch_line = netcl._epoch_line
    monkeypatch.setattr(netcl, "_epoch_line", lambda record, epochs: epochs_run.append(1)
                        or real_fit_epoch_line(record, epochs))
    trainer.fit(_batches(x, y, 10), _batches(x, y, 10), epochs=4, monitor=monitor,
                checkpoint=tmp_path / "best.npz")
    assert [n + 1 for n in saves] == saved_epochs


@pytest.mark.parametrize("out_shape", [(1,), ()])
def test_fit_trains_a_regression_without_accuracy(backend, capsys, out_shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32))[:, None]
    y = y.reshape((48,) + out_shape)
    netcl.manual_seed(0)
    linear = nn.Linear(4, 1, queue=backend.queue)
    model = linear if out_shape else (lambda xb: F.reshape(linear(xb), (-1,)))
    trainer = netcl.Trainer(model, netcl.SGD(linear.parameters(), lr=0.05),
                            device_queue=backend.queue, loss_fn=F.mse_loss)
    history = trainer.fit(_batches(x, y, 16), _batches(x, y, 24), epochs=5)
    for record in history:
        assert set(record) == {"epoch", "loss", "val_loss", "samples_per_s", "seconds"}
    assert history[-1]["val_loss"] < history[0]["val_loss"]
    assert set(trainer.evaluate(_batches(x, y, 24))) == {"loss"}
    out = capsys.readouterr().out
    assert "accuracy" not in out and out.count("val_loss") == 5
    with raises_naming(ValueError, "val_accuracy", "regression"):
        trainer.fit(_batches(x, y, 16), _batches(x, y, 24), monitor="val_accuracy")
    # The default monitor of a regression is val_loss: a rising one stops it.
    rising = iter([1.0, 2.0, 3.0, 4.0])
    trainer._evaluate = lambda *a: {"loss": next(rising)}
    assert len(trainer.fit(_batches(x, y, 16), _batches(x, y, 24), epochs=4, patience=2)) == 3


def test_fit_names_per_sample_data_and_an_exhausted_loader(backend):
    x, y = _blobs(n=12)
    model = _mlp(backend, BLOBS_MLP)
    trainer = netcl.Trainer(model, netcl.SGD(model.parameters(), lr=0.1),
                            device_queue=backend.queue)
    samples = [(x[i], int(y[i])) for i in range(12)]
    for run in (trainer.fit, trainer.evaluate):
        with raises_naming(ValueError, "one sample", "(8,)", "DataLoader"):
            run(samples)
    trainer.fit(netcl.DataLoader(samples, batch_size=4))  # what the message says works
    generator = (batch for batch in _batches(x, y, 4))
    with raises_naming(ValueError, "train_loader", "no batches in epoch 2", "generator"):
        trainer.fit(generator, epochs=3)
    with raises_naming(ValueError, "train_loader", "no batches in epoch 1"):
        trainer.fit([], epochs=1)
    with raises_naming(ValueError, "val_loader", "no batches in epoch 1"):
        trainer.fit(_batches(x, y, 4), [], epochs=1)
    with raises_naming(ValueError, "evaluate", "no batches"):
        trainer.evaluate([])


def test_history_to_csv_round_trips(tmp_path):
    import csv
    history = netcl.History([
        {"epoch": 1, "loss": 0.5, "accuracy": 0.25, "val_loss": None, "val_accuracy": None,
         "samples_per_s": 100.0, "seconds": 0.5},
        {"epoch": 2, "loss": 0.25, "accuracy": 0.5, "val_loss": 0.125, "val_accuracy": 0.75,
         "samples_per_s": 200.0, "seconds": 0.25}])
    history.to_csv(tmp_path / "history.csv")
    with open(tmp_path / "history.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert list(rows[0]) == list(history[0])
    for row, record in zip(rows, history):
        assert {k: None if v == "" else float(v) for k, v in row.items()} == record


def test_history_plot_needs_matplotlib_or_writes_a_png(tmp_path, monkeypatch):
    history = netcl.History([{"epoch": e, "loss": 1 / e, "accuracy": 0.5, "val_loss": None,
                              "val_accuracy": None, "samples_per_s": 1.0, "seconds": 1.0}
                             for e in (1, 2)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        history.plot(tmp_path / "history.png")
        assert (tmp_path / "history.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import builtins
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with raises_naming(ImportError, "pip install matplotlib"):
        history.plot(tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


_PTY_FIT = """
import numpy as np, netcl
from netcl import nn
dev = netcl.manager.default({backend!r})
rng = np.random.default_rng(0)
x = rng.standard_normal((64, 8)).astype(np.float32)
y = rng.integers(0, 3, 64)
netcl.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 3, queue=dev.queue))
trainer = netcl.Trainer(model, netcl.SGD(model.parameters(), lr=0.1), device_queue=dev.queue,
                        metrics_stride=1)
val = netcl.DataLoader(netcl.ArrayDataset(x, y), batch_size=8, shuffle=False)
trainer.fit(netcl.DataLoader(netcl.ArrayDataset(x, y), batch_size=8, seed=0), val, epochs=2)
"""


def _terminal_lines(data):
    """What a terminal shows for `data`: \\r returns to the line's start, \\033[K erases to
    its end, \\n starts a new line."""
    lines, line, column = [], [], 0
    i = 0
    while i < len(data):
        if data.startswith("\x1b[K", i):
            del line[column:]
            i += 3
            continue
        char = data[i]
        if char == "\r":
            column = 0
        elif char == "\n":
            lines.append("".join(line))
            line, column = [], 0
        else:
            line[column:column + 1] = [char]
            column += 1
        i += 1
    if line:
        lines.append("".join(line))
    return lines


def test_fit_progress_on_a_terminal_leaves_only_the_epoch_lines(backend, tmp_path):
    import pty  # noqa: F401 (POSIX only: the test needs a pseudo-terminal)
    script = tmp_path / "fit.py"
    script.write_text(_PTY_FIT.format(backend=backend.backend))
    leader, follower = os.openpty()
    here = os.path.dirname(os.path.abspath(netcl.__file__))  # ahead of what the path held
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    process = subprocess.Popen([sys.executable, str(script)], stdout=follower,
                               stderr=subprocess.PIPE, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    stderr = process.communicate(timeout=120)[1]
    assert process.returncode == 0, stderr.decode()
    raw = b"".join(chunks).decode()
    lines = [line for line in _terminal_lines(raw)  # without netcl's device notices
             if line.strip() and not line.startswith("netcl:")]
    assert len(lines) == 2, lines
    for epoch, line in enumerate(lines, 1):
        assert line.startswith(f"epoch {epoch}/2  loss ") and "val_accuracy" in line
    assert "evaluate:" not in raw
    assert "epoch 1/2 [" in raw and "8/8" in raw and "ETA" in raw  # the bar names its epoch
    assert "epoch 2/2 validating..." in raw


def test_trainer_takes_its_device_from_the_model(backend, chosen_default):
    chosen_default(_other(backend))  # the default is elsewhere: only the model says `backend`
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    model = nn.Sequential(nn.Linear(4, 8, queue=backend.queue), nn.ReLU(),
                          nn.Linear(8, 2, queue=backend.queue))
    trainer = netcl.Trainer(model, netcl.optim.SGD(model.parameters(), lr=0.1))
    assert trainer.device is backend
    history = trainer.fit(netcl.DataLoader(netcl.ArrayDataset(x, y), batch_size=8, seed=0))
    assert math.isfinite(history[0]["loss"])


def test_trainer_device_errors_name_the_devices(opencl, cpu):
    model = nn.Sequential(nn.Linear(4, 8, queue=opencl.queue), nn.ReLU(), nn.Linear(8, 2, queue=cpu.queue))
    opt = netcl.optim.SGD(model.parameters(), lr=0.1)
    with raises_naming(ValueError, "Trainer", "'0.weight'", "'2.weight'", opencl.name, "NumPy", ".to("):
        netcl.Trainer(model, opt)
    model[2].to(opencl)
    with raises_naming(ValueError, "Trainer", "device_queue", opencl.name, "NumPy", ".to("):
        netcl.Trainer(model, opt, device_queue=cpu.queue)
    assert netcl.Trainer(model, opt, device_queue=opencl.queue).device is opencl
    assert netcl.Trainer(model, opt, device_queue="opencl").device is opencl


def _digits_batches(n=64):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 64)).astype(np.float32)
    return netcl.DataLoader(netcl.ArrayDataset(x, rng.integers(0, 10, n)), batch_size=16, seed=0)


@pytest.mark.parametrize("mixed_precision", [False, True])
def test_no_kernel_build_during_the_first_epoch(opencl, monkeypatch, mixed_precision):
    """kernels.cl is built when the Device is created, and the float16-storage build (made on
    first use) when a mixed-precision Trainer is: the first epoch's samples/s measures
    training, not the compiler."""
    import pyopencl as cl
    queue = cl.CommandQueue(cl.Context([opencl.cl_device]))  # a fresh Device: nothing built yet
    model = _digits_mlp(netcl.Tensor.empty((1,), queue=queue).device)
    device = model[0].weight.device
    assert device is not opencl and device.builds == 1 and device.build_seconds > 0
    # A device where autocast stores float16 (half arithmetic) without tensor cores.
    monkeypatch.setattr(device, "_tensor_cores", False)
    monkeypatch.setattr(device, "_has_fp16", True)
    trainer = netcl.Trainer(model, netcl.optim.AdamW(model.parameters()),
                            mixed_precision=mixed_precision)
    built = device.builds, device.build_seconds
    assert built[0] == (2 if mixed_precision else 1)
    trainer.fit(_digits_batches())
    assert (device.builds, device.build_seconds) == built


# ---------------------------------------------------------------------------------------------
# examples: the tutorial model, the example scripts
# ---------------------------------------------------------------------------------------------

# --- the tutorial model

def test_tutorial_mlp_on_digits(backend, digits):
    x_train, y_train, x_test, y_test = digits.x_train, digits.y_train, digits.x_test, digits.y_test
    model = _mlp(backend, (64, 128, 10))
    opt = netcl.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rng = np.random.default_rng(0)
    batch = 32
    for _ in range(15):
        order = rng.permutation(len(x_train))
        for start in range(0, len(order), batch):
            idx = order[start:start + batch]
            with netcl.Tape() as tape:
                xb = tensor(x_train[idx], backend)                        # (B, 64)
                yb = tensor(y_train[idx].astype(np.int32), backend)       # (B,) int32
                loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            tape.backward(loss)
            opt.step()
    model.eval()
    logits = host(model(tensor(x_test, backend)))
    accuracy = (logits.argmax(axis=1) == y_test).mean()
    assert accuracy >= 0.95, f"test accuracy {accuracy:.3f}"


EXAMPLES = pathlib.Path(__file__).resolve().parent / "examples"


def _checkout_copy(root):
    """netcl.py, kernels.cl and examples/ copied to `root`, netcl.py saying where it was
    imported from: what a fresh clone is, with nothing installed from it."""
    import shutil
    here = pathlib.Path(netcl.__file__).resolve().parent
    (root / "examples").mkdir(parents=True)
    source = (here / "netcl.py").read_text(encoding="utf-8")
    (root / "netcl.py").write_text(source + "\nprint('netcl imported from', __file__, file=sys.stderr)\n",
                                   encoding="utf-8")
    shutil.copy(here / "kernels.cl", root / "kernels.cl")
    for example in EXAMPLES.glob("*.py"):
        shutil.copy(example, root / "examples" / example.name)
    return root


def _run_example(tmp_path, name, *args):
    """Run examples/`name` of a checkout copy from another directory, on the NumPy backend;
    assert it used the copy's netcl.py (not an installed netcl) and return its stdout."""
    checkout = _checkout_copy(tmp_path / "checkout")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, NETCL_DEVICE="cpu", PYTHONNOUSERSITE="1")
    env.pop("PYTHONPATH", None)
    result = subprocess.run([sys.executable, str(checkout / "examples" / name), *args],
                            cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"netcl imported from {checkout / 'netcl.py'}" in result.stderr, result.stderr
    return result.stdout


def test_mnist_example_runs_from_a_checkout(tmp_path):
    out = _run_example(tmp_path, "mnist_mlp.py", "--epochs", "1",
                       "--checkpoint", str(tmp_path / "best.npz"))
    assert "test accuracy: Tape loop" in out and (tmp_path / "best.npz").exists()


def test_gpt_example_runs_from_a_checkout(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("to be or not to be, that is the question.\n" * 20, encoding="utf-8")
    out = _run_example(tmp_path, "gpt_char.py", "--data", str(text), "--steps", "2",
                       "--eval-interval", "1", "--n-layer", "1", "--n-head", "2",
                       "--n-embd", "16", "--block-size", "8", "--batch-size", "4")
    assert "tokens/s" in out and " parameters" in out


def _mnist_example():
    import importlib.util
    spec = importlib.util.spec_from_file_location("mnist_mlp_example", EXAMPLES / "mnist_mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_idx(path, array):
    """An IDX file of uint8 `array` (gzipped if the name ends in .gz)."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.mark.parametrize("sep, gz", [("-", ""), (".", ""), ("-", ".gz"), (".", ".gz")])
def test_mnist_example_reads_both_idx_name_styles(tmp_path, sep, gz):
    rng = np.random.default_rng(0)
    files = {"train-images": rng.integers(0, 256, (3, 28, 28)), "train-labels": np.array([1, 2, 3]),
             "t10k-images": rng.integers(0, 256, (2, 28, 28)), "t10k-labels": np.array([4, 5])}
    for stem, array in files.items():
        _write_idx(tmp_path / f"{stem}{sep}idx{array.ndim}-ubyte{gz}", array)
    x_train, y_train, x_test, y_test = _mnist_example().load_mnist(str(tmp_path))
    np.testing.assert_allclose(x_train, files["train-images"].reshape(3, 784) / 255.0)
    np.testing.assert_allclose(x_test, files["t10k-images"].reshape(2, 784) / 255.0)
    np.testing.assert_array_equal(y_train, [1, 2, 3])
    np.testing.assert_array_equal(y_test, [4, 5])


def test_mnist_example_names_the_files_it_tried(tmp_path):
    with raises_naming(FileNotFoundError, str(tmp_path), "train-images-idx3-ubyte",
                       "train-images.idx3-ubyte", "train-images.idx3-ubyte.gz"):
        _mnist_example().load_mnist(str(tmp_path))


def test_bench_kernel_profile_times_every_launch_of_a_step(opencl):
    """bench_netcl.py --kernels: the small MLP's training step profiled by OpenCL events
    (Device.launch returns each launch's event) counts every kernel netcl launches in the
    step, and its timeline keeps the in-order queue's order: each kernel queued, submitted,
    started and ended in that order, and started after the kernel before it ended."""
    import bench_netcl
    profile = bench_netcl.kernel_profile("mlp-small", opencl, steps=3)
    _, launches = bench_netcl.syncs_per_step(opencl, *bench_netcl.mlp_sizes("small"), steps=2)
    assert sum(count for _, count, _ in profile["kernels"]) == launches > 0
    assert all(each > 0 for _, _, each in profile["kernels"])
    assert profile["kernel_us"] == pytest.approx(
        sum(count * each for _, count, each in profile["kernels"]))
    assert profile["wall_us"] > 0
    timeline = profile["timeline"]
    assert len(timeline) == launches
    assert {name for name, *_ in timeline} == {name for name, _, _ in profile["kernels"]}
    ended_before = 0.0
    for name, called, returned, queued, submitted, started, ended in timeline:
        assert called <= returned and 0 <= queued <= submitted <= started <= ended
        assert started >= ended_before
        ended_before = ended
    for workload, device, word in (("mlp", opencl, "workload"),
                                   ("conv", netcl.manager.default("cpu"), "device")):
        with pytest.raises(ValueError, match=word):
            bench_netcl.kernel_profile(workload, device)
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        bench_netcl.kernel_profile("mlp-small", opencl, steps=0)


# ---------------------------------------------------------------------------------------------
# import aliases
# ---------------------------------------------------------------------------------------------

# (module, name there, the name of the same object in netcl). PyTorch's import paths name
# netcl's own objects; abs, pow, max and min would hide Python's own functions inside netcl.py,
# so netcl's flat names for them differ.
_FUNCTIONAL_FLAT = [
    "matmul", "linear", "add", "sub", "mul", "div", "relu", "leaky_relu", "sigmoid", "tanh",
    "gelu", "exp", "log", "sum", "mean", "reshape", "flatten", "softmax", "log_softmax",
    "cross_entropy", "mse_loss", "dropout", "sqrt", "rsqrt", "clamp", "silu", "maximum",
    "minimum", "where", "masked_fill", "argmax", "var", "std", "logsumexp", "conv2d",
    "max_pool2d", "avg_pool2d", "layer_norm", "batch_norm", "embedding",
    "scaled_dot_product_attention", "nll_loss", "binary_cross_entropy_with_logits"]


IMPORT_ALIASES = (
    [("netcl.functional", name, name) for name in _FUNCTIONAL_FLAT]
    + [("netcl.functional", "abs", "absolute"), ("netcl.functional", "pow", "power"),
       ("netcl.functional", "max", "reduce_max"), ("netcl.functional", "min", "reduce_min")]
    + [("netcl.nn.functional", name, name) for name in ["relu", "nll_loss"]]
    + [("netcl.nn", name, name) for name in ["Linear", "Sequential", "Conv2d", "MaxPool2d",
                                             "LayerNorm", "BatchNorm1d", "BatchNorm2d",
                                             "Embedding"]]
    + [("netcl.optim", "SGD", "SGD"), ("netcl.optim", "AMPGradScaler", "AMPGradScaler"),
       ("netcl.amp", "AMPGradScaler", "AMPGradScaler"), ("netcl.amp", "autocast", "autocast")]
    + [("netcl.data", name, name) for name in ["ArrayDataset", "DataLoader", "GpuBatch",
                                               "load_idx"]]
    + [("netcl.data.dataloader", "DataLoader", "DataLoader")])


@pytest.mark.parametrize("module, name, flat", IMPORT_ALIASES,
                         ids=[f"{module}.{name}" for module, name, _ in IMPORT_ALIASES])
def test_import_path_names_netcl_s_own_object(module, name, flat):
    assert getattr(importlib.import_module(module), name) is getattr(netcl, flat)


def test_alias_modules(backend):
    import netcl.autograd as ag
    from netcl.functional import relu
    import netcl.manager
    assert netcl.manager.default("cpu") is netcl.manager.default("cpu")
    x = param(np.array([[-1.0, 2.0]], np.float32), backend)
    with ag.Tape() as tape:
        loss = relu(x).sum()
    tape.backward(loss)
    np.testing.assert_array_equal(host(x.grad), [[0.0, 1.0]])
