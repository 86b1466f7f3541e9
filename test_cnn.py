"""Tests for conv2d, max_pool2d, avg_pool2d and the Conv2d / MaxPool2d modules.

Gradients are checked against central finite differences in float64 on the NumPy backend,
forwards against plain loops written from the definitions, and the OpenCL backend against
the NumPy one. Without an OpenCL device the OpenCL cases are skipped, unless
NETCL_REQUIRE_OPENCL=1, which makes them fail instead.
"""
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import netcl
from netcl import functional as F, nn

SETTINGS = settings(max_examples=40, deadline=None)


def _opencl_device():
    try:
        return netcl.manager.default("opencl")
    except RuntimeError as error:
        if os.environ.get("NETCL_REQUIRE_OPENCL") == "1":
            pytest.fail(f"NETCL_REQUIRE_OPENCL=1 but no OpenCL device: {error}")
        pytest.skip(f"no OpenCL device: {error}")


@pytest.fixture(scope="module", params=["cpu", "opencl"])
def device(request):
    return _opencl_device() if request.param == "opencl" else netcl.manager.default("cpu")


@pytest.fixture(scope="module")
def opencl():
    return _opencl_device()


# --- references written from the definitions, one output at a time ----------------------------

def conv2d_loops(x, w, b, stride, padding):
    (sh, sw), (ph, pw) = stride, padding
    N, C, H, W = x.shape
    K, _, R, S = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    OH, OW = (H + 2 * ph - R) // sh + 1, (W + 2 * pw - S) // sw + 1
    out = np.zeros((N, K, OH, OW))
    for i in range(OH):
        for j in range(OW):
            patch = xp[:, :, i * sh:i * sh + R, j * sw:j * sw + S]
            out[:, :, i, j] = np.tensordot(patch, w, axes=([1, 2, 3], [1, 2, 3]))
    return out if b is None else out + b.reshape(1, K, 1, 1)


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


# --- strategies -------------------------------------------------------------------------------

def pair_or_int(values):
    """An int, or a pair of them: both forms are accepted wherever PyTorch accepts them."""
    return st.one_of(values, st.tuples(values, values))


def as_pair(v):
    return v if isinstance(v, tuple) else (v, v)


@st.composite
def conv_cases(draw):
    N, C, K = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    R, S = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    stride = draw(pair_or_int(st.integers(1, 3)))
    padding = draw(pair_or_int(st.integers(0, 2)))
    (ph, pw) = as_pair(padding)
    H = draw(st.integers(max(1, R - 2 * ph), 7))  # sizes the stride need not divide
    W = draw(st.integers(max(1, S - 2 * pw), 7))
    bias = draw(st.booleans())
    seed = draw(st.integers(0, 2**32 - 1))
    return (N, C, H, W), (K, C, R, S), bias, stride, padding, seed


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


def f64(array, device):
    return netcl.Tensor.from_host(array, queue=device.queue, dtype=np.float64)


def numeric_grads(f, arrays, g, eps=1e-6):
    """Central differences of sum(f(*arrays) * g) with respect to each array."""
    grads = []
    for a in arrays:
        grad = np.zeros_like(a)
        for index in np.ndindex(a.shape):
            saved = a[index]
            a[index] = saved + eps
            plus = np.sum(f(*arrays) * g)
            a[index] = saved - eps
            minus = np.sum(f(*arrays) * g)
            a[index] = saved
            grad[index] = (plus - minus) / (2 * eps)
        grads.append(grad)
    return grads


def run_op(op, arrays, g, device, dtype=np.float32):
    """(output, [gradient of each array]) of sum(op(*arrays) * g), on `device`."""
    params = [netcl.Parameter(netcl.Tensor.from_host(a, queue=device.queue, dtype=dtype))
              for a in arrays]
    with netcl.Tape() as tape:
        out = op(*params)
    tape.backward(out, grad=g)
    return out.value.to_host(), [p.grad.to_host() for p in params]


# --- conv2d -----------------------------------------------------------------------------------

@SETTINGS
@given(conv_cases())
def test_conv2d_forward_and_gradients_float64(case):
    x_shape, w_shape, bias, stride, padding, seed = case
    cpu = netcl.manager.default("cpu")
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(x_shape), rng.standard_normal(w_shape)]
    if bias:
        arrays.append(rng.standard_normal(w_shape[0]))

    def f(x, w, b=None):
        out = F.conv2d(f64(x, cpu), f64(w, cpu), None if b is None else f64(b, cpu),
                       stride=stride, padding=padding)
        return out.value.to_host()

    expected = conv2d_loops(*arrays[:2], arrays[2] if bias else None, as_pair(stride),
                            as_pair(padding))
    g = rng.standard_normal(expected.shape)
    out, grads = run_op(lambda *p: F.conv2d(*p[:2], p[2] if bias else None, stride, padding),
                        arrays, g, cpu, np.float64)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    for analytic, numeric in zip(grads, numeric_grads(f, arrays, g)):
        np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-6)


@SETTINGS
@given(conv_cases())
def test_conv2d_opencl_matches_numpy(opencl, case):
    x_shape, w_shape, bias, stride, padding, seed = case
    cpu = netcl.manager.default("cpu")
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in
              (x_shape, w_shape) + (((w_shape[0],),) if bias else ())]
    op = lambda *p: F.conv2d(*p[:2], p[2] if bias else None, stride=stride, padding=padding)
    out_shape = conv2d_loops(np.zeros(x_shape), np.zeros(w_shape), None, as_pair(stride),
                             as_pair(padding)).shape
    g = rng.standard_normal(out_shape).astype(np.float32)
    ref_out, ref_grads = run_op(op, arrays, g, cpu)
    out, grads = run_op(op, arrays, g, opencl)
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-4)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_conv2d_im2col_in_chunks_matches_whole_batch(opencl, monkeypatch):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in ((5, 3, 6, 5), (4, 3, 3, 3), (4,))]
    g = rng.standard_normal((5, 4, 3, 3)).astype(np.float32)
    op = lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1)
    whole = run_op(op, arrays, g, opencl)
    monkeypatch.setattr(netcl, "_IM2COL_BYTES", 2 * 27 * 9 * 4)  # two samples per chunk
    launches = opencl.launches
    chunked = run_op(op, arrays, g, opencl)
    assert opencl.launches - launches > 15  # 3 chunks: the chunked path really ran
    np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-6, atol=1e-6)
    for got, want in zip(chunked[1], whole[1]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_conv2d_skips_gradients_nobody_needs(device):
    """The input of a first layer is data: its gradient is not computed, dw still is."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 5, 5)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    g = rng.standard_normal((2, 4, 5, 5)).astype(np.float32)
    launches = device.launches
    _, (_, want) = run_op(lambda x, w: F.conv2d(x, w, padding=1), [x, w], g, device)
    both = device.launches - launches
    weight = netcl.Parameter(netcl.Tensor.from_host(w, device.queue))
    launches = device.launches
    with netcl.Tape() as tape:
        out = F.conv2d(x, weight, padding=1)
    tape.backward(out, grad=g)
    np.testing.assert_allclose(weight.grad.to_host(), want, rtol=1e-6, atol=1e-6)
    if device.backend == "opencl":
        assert device.launches - launches < both


# --- pooling ----------------------------------------------------------------------------------

@SETTINGS
@given(pool_cases(), st.sampled_from(["max", "avg"]))
def test_pool_forward_and_gradients_float64(case, kind):
    x_shape, kernel, stride, padding, seed = case
    cpu = netcl.manager.default("cpu")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape)  # distinct values: no ties within eps of each other
    pool = F.max_pool2d if kind == "max" else F.avg_pool2d
    f = lambda x: pool(f64(x, cpu), kernel, stride, padding).value.to_host()
    expected, _ = pool_loops(x, as_pair(kernel), as_pair(kernel if stride is None else stride),
                             as_pair(padding), kind)
    g = rng.standard_normal(expected.shape)
    out, (grad,) = run_op(lambda p: pool(p, kernel, stride, padding), [x], g, cpu, np.float64)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grad, numeric_grads(f, [x], g)[0], rtol=1e-6, atol=1e-6)


@SETTINGS
@given(pool_cases(), st.sampled_from(["max", "avg"]))
def test_pool_opencl_matches_numpy(opencl, case, kind):
    x_shape, kernel, stride, padding, seed = case
    cpu = netcl.manager.default("cpu")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(np.float32)
    pool = F.max_pool2d if kind == "max" else F.avg_pool2d
    op = lambda p: pool(p, kernel, stride, padding)
    out_shape = op(x).shape
    g = rng.standard_normal(out_shape).astype(np.float32)
    ref_out, (ref_grad,) = run_op(op, [x], g, cpu)
    out, (grad,) = run_op(op, [x], g, opencl)
    np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)


@SETTINGS
@given(pool_cases(), st.data())
def test_max_pool_ties_go_to_the_first_maximum(device, case, data):
    """Few distinct values (and -inf) make ties everywhere; the gradient follows PyTorch:
    the first maximum in row-major order among each window's real pixels."""
    x_shape, kernel, stride, padding, seed = case
    x = np.random.default_rng(seed).choice(
        np.array([-np.inf, 0.0, 1.0, 2.0], np.float32), size=x_shape,
        p=data.draw(st.sampled_from([(0.1, 0.3, 0.3, 0.3), (0.7, 0.1, 0.1, 0.1)])))
    stride_pair = as_pair(kernel if stride is None else stride)
    expected, winner = pool_loops(x, as_pair(kernel), stride_pair, as_pair(padding), "max")
    g = np.random.default_rng(seed + 1).standard_normal(expected.shape).astype(np.float32)
    out, (grad,) = run_op(lambda p: F.max_pool2d(p, kernel, stride, padding), [x], g, device)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_allclose(grad, max_pool_grad_loops(g, winner, x_shape), rtol=1e-6,
                               atol=1e-6)


def test_max_pool_nan_propagates(device):
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    x[0, 0, 0, 1] = np.nan
    x[0, 0, 1, 0] = np.nan
    out, (grad,) = run_op(lambda p: F.max_pool2d(p, 2), [x], np.ones((1, 1, 2, 2), np.float32),
                          device)
    assert np.isnan(out[0, 0, 0, 0]) and np.array_equal(out[0, 0, 1], [13, 15])
    assert grad[0, 0, 0, 1] == 1 and grad[0, 0, 1, 0] == 0  # the first NaN wins its window


def test_pool_defaults_and_known_values(device):
    x = np.arange(1, 17, dtype=np.float32).reshape(1, 1, 4, 4)
    np.testing.assert_array_equal(F.max_pool2d(netcl.Tensor.from_host(x, device.queue), 2)
                                  .value.to_host(), [[[[6, 8], [14, 16]]]])
    avg = F.avg_pool2d(netcl.Tensor.from_host(x, device.queue), 3, stride=1, padding=1)
    assert avg.shape == (1, 1, 4, 4)  # padded zeros count: the corner is (1+2+5+6) / 9
    np.testing.assert_allclose(avg.value.to_host()[0, 0, 0, 0], 14 / 9, rtol=1e-6)
    assert F.max_pool2d(netcl.Tensor.from_host(np.zeros((1, 1, 5, 7), np.float32), device.queue),
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
def test_invalid_arguments_raise_value_error_naming_them(device, call, words):
    tensor = lambda *shape: netcl.Tensor.from_host(np.zeros(shape, np.float32), device.queue)
    launches = device.launches
    with pytest.raises(ValueError) as error:
        call(tensor)
    for word in words:
        assert word in str(error.value)
    assert device.launches == launches


# --- modules ----------------------------------------------------------------------------------

def test_conv2d_module_init_state_dict_and_names(device):
    netcl.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, queue=device.queue), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Conv2d(8, 4, (3, 2), stride=(1, 2), bias=False,
                                                     queue=device.queue),
                          nn.Flatten(), nn.Linear(4 * 3 * 2, 10, queue=device.queue))
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
    out = model(netcl.Tensor.from_host(x, device.queue))
    assert out.shape == (2, 10)
    netcl.manual_seed(0)
    again = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, queue=device.queue), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Conv2d(8, 4, (3, 2), stride=(1, 2), bias=False,
                                                     queue=device.queue),
                          nn.Flatten(), nn.Linear(4 * 3 * 2, 10, queue=device.queue))
    for key, value in again.state_dict().items():
        np.testing.assert_array_equal(value, state[key])  # manual_seed reproduces the init
    again.load_state_dict({k: v + 1 for k, v in state.items()})
    np.testing.assert_array_equal(again.state_dict()["3.weight"], state["3.weight"] + 1)

    expected = F.conv2d(x, conv.weight, conv.bias, padding=1).value.to_host()
    np.testing.assert_array_equal(conv(netcl.Tensor.from_host(x, device.queue)).value.to_host(),
                                  expected)


def test_import_paths():
    from netcl.functional import avg_pool2d, conv2d, max_pool2d
    from netcl.nn import Conv2d, MaxPool2d
    assert (conv2d, max_pool2d, avg_pool2d) == (netcl.conv2d, netcl.max_pool2d, netcl.avg_pool2d)
    assert (Conv2d, MaxPool2d) == (netcl.Conv2d, netcl.MaxPool2d)


def test_small_cnn_learns(device):
    """A conv-relu-pool CNN fits a batch of the digits: the whole stack trains end to end."""
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    x = (digits.images[:128] / 16).astype(np.float32).reshape(-1, 1, 8, 8)
    y = digits.target[:128]
    netcl.manual_seed(0)
    q = device.queue
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
