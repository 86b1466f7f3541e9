"""Tests of netcl's optimizers: SGD, Adam, AdamW, clip_grad_norm, WarmupCosine (pytest +
Hypothesis). Run with `python -m pytest -q test_optim.py`.

Every test that touches a device runs on both backends through the `backend` fixture: "cpu"
(the NumPy backend) and "opencl" (PoCL on a CPU in CI). Without an OpenCL platform the OpenCL
half is skipped, unless NETCL_REQUIRE_OPENCL=1 is set, in which case it fails.

The references below transcribe PyTorch's formulas to NumPy float64:
- torch/optim/sgd.py, _single_tensor_sgd (dampening 0);
- torch/optim/adam.py, _single_tensor_adam, and torch/optim/adamw.py (decoupled weight
  decay: param.mul_(1 - lr * weight_decay));
- torch/nn/utils/clip_grad.py, clip_grad_norm_ (_get_total_norm, _clip_grads_with_norm_).
"""
import contextlib
import inspect
import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import netcl

# ---------------------------------------------------------------------------------------------
# fixtures and helpers (the same as test_netcl.py's)
# ---------------------------------------------------------------------------------------------

BACKENDS = ["cpu", "opencl"]

# deadline=None: the first OpenCL call of a kernel may wait for PoCL to compile it.
OPT_SETTINGS = settings(max_examples=8, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow,
                                               HealthCheck.function_scoped_fixture])


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


def param(array, dev):
    return netcl.Parameter(netcl.Tensor.from_host(np.asarray(array, np.float32), queue=dev.queue))


def host(x):
    """A Node or Tensor's value as a NumPy array."""
    if isinstance(x, netcl.Node):
        x = x.value
    return x.to_host()


@contextlib.contextmanager
def raises_naming(exc, *needles):
    """pytest.raises that also checks that each needle appears in the message."""
    with pytest.raises(exc) as info:
        yield info
    for needle in needles:
        assert str(needle) in str(info.value), f"{needle!r} missing from {str(info.value)!r}"


def _set_grads(params, grads):
    """Give each parameter exactly `grad` through a backward pass: d/dp sum(p * g) = g."""
    with netcl.Tape() as tape:
        loss = sum(((p * g).sum() for p, g in zip(params, grads)), start=0.0)
    tape.backward(loss)


def _normal(rng, *shapes):
    """float32 standard-normal arrays of the given shapes."""
    return [rng.standard_normal(shape).astype(np.float32) for shape in shapes]


def _make(kind, params, lr, hyper):
    if kind == "sgd":
        return netcl.SGD(params, lr=lr, **hyper)
    return (netcl.Adam if kind == "adam" else netcl.AdamW)(params, lr=lr, **hyper)


# ---------------------------------------------------------------------------------------------
# references: PyTorch's formulas in NumPy float64
# ---------------------------------------------------------------------------------------------

def _total_norm_reference(grads, norm_type=2.0):
    """clip_grad.py's _get_total_norm: the norm of the per-tensor norms."""
    norms = [np.linalg.norm(g.astype(np.float64).ravel(), norm_type) for g in grads]
    return float(np.linalg.norm(np.array(norms), norm_type))


def _sgd_reference(initial, grads_per_step, lrs, momentum=0.0, weight_decay=0.0, nesterov=False):
    """torch/optim/sgd.py, _single_tensor_sgd with dampening 0."""
    params = [p.astype(np.float64) for p in initial]
    bufs = [None] * len(params)
    history = []
    for grads, lr in zip(grads_per_step, lrs):
        for i, g in enumerate(grads):
            d_p = g + weight_decay * params[i]
            if momentum:
                bufs[i] = d_p.copy() if bufs[i] is None else momentum * bufs[i] + d_p
                d_p = d_p + momentum * bufs[i] if nesterov else bufs[i]
            params[i] = params[i] - lr * d_p
        history.append([p.copy() for p in params])
    return history


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


# ---------------------------------------------------------------------------------------------
# trajectories against the references
# ---------------------------------------------------------------------------------------------

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


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
@OPT_SETTINGS
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


# ---------------------------------------------------------------------------------------------
# fused clipping, clip_grad_norm, non-finite gradients
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["adam", "adamw"])
@OPT_SETTINGS
@given(shapes=SHAPES, seed=st.integers(0, 2**31 - 1), max_norm=st.sampled_from([0.1, 1.0, 100.0]))
def test_fused_clip_step_equals_clip_then_step(backend, kind, shapes, seed, max_norm):
    rng = np.random.default_rng(seed)
    initial = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads_per_step = [[(3 * rng.standard_normal(s)).astype(np.float32) for s in shapes]
                      for _ in range(4)]
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
    for a, b in zip(opt_fused.state_dict()["state"].values(),
                    opt_unfused.state_dict()["state"].values()):
        assert a["step"] == b["step"] == 4
        np.testing.assert_allclose(a["exp_avg"], b["exp_avg"], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(a["exp_avg_sq"], b["exp_avg_sq"], rtol=1e-5, atol=1e-9)


@OPT_SETTINGS
@given(shapes=SHAPES, seed=st.integers(0, 2**31 - 1),
       norm_type=st.sampled_from([2.0, 1.0, 3.0, math.inf, "inf"]),
       max_norm=st.sampled_from([0.01, 1.0, 1e4]), without_grad=st.booleans())
def test_clip_grad_norm_matches_float64_reference(backend, shapes, seed, norm_type, max_norm,
                                                  without_grad):
    rng = np.random.default_rng(seed)
    grads = [(rng.standard_normal(s) * 10.0 ** rng.uniform(-2, 2)).astype(np.float32)
             for s in shapes]
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


# ---------------------------------------------------------------------------------------------
# launches, syncs, flat buffers
# ---------------------------------------------------------------------------------------------

def _mlp(layers, dev):
    modules = []
    for _ in range(layers):
        modules += [netcl.nn.Linear(8, 8, queue=dev.queue), netcl.nn.ReLU()]
    return netcl.nn.Sequential(*modules[:-1])


def _launches_per_step(dev, layers, max_norm):
    netcl.manual_seed(4)
    model = _mlp(layers, dev)
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
    netcl.manual_seed(5)
    model = _mlp(2, backend)
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


# ---------------------------------------------------------------------------------------------
# state, validation, API
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# WarmupCosine
# ---------------------------------------------------------------------------------------------

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


@pytest.mark.parametrize("warmup, total, needle", [
    (-1, 10, "warmup_steps"), (0, 0, "total_steps"), (11, 10, "warmup_steps"),
    (1.5, 10, "warmup_steps")])
def test_warmup_cosine_validates(warmup, total, needle):
    opt = netcl.SGD([param(np.zeros(2), netcl.manager.default("cpu"))], lr=0.1)
    with raises_naming(ValueError, needle):
        netcl.WarmupCosine(opt, warmup, total)
