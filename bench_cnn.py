"""conv2d forward + backward: x (64, 32, 28, 28), 64 filters 3x3, padding 1, bias.

Times netcl's conv2d (forward, then backward for input, weight and bias) on each backend
present, next to a plain NumPy im2col implementation run in the same process, so the ratio
holds even on a noisy machine. `python bench_cnn.py [--repeat 5]` prints a table.
"""
import argparse
import statistics
import time

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

import netcl
from netcl import functional as F

N, C, H, W, K, R, S, PAD = 64, 32, 28, 28, 64, 3, 3, 1
FLOPS = 3 * 2 * N * H * W * K * C * R * S  # forward, dx and dw GEMMs (stride 1: OH, OW = H, W)


def numpy_im2col(x, w, b, g):
    """Plain NumPy: im2col + matmul forward, dw and dx by matmul, col2im by R*S slice adds.
    Columns are (N*OH*OW, C*R*S), the layout NumPy copies and multiplies fastest (measured)."""
    OH, OW = H + 2 * PAD - R + 1, W + 2 * PAD - S + 1
    padded = np.pad(x, ((0, 0), (0, 0), (PAD, PAD), (PAD, PAD)))
    cols = sliding_window_view(padded, (R, S), axis=(2, 3)).transpose(0, 2, 3, 1, 4, 5)
    cols = cols.reshape(N * OH * OW, C * R * S)                  # a copy
    w_rows = w.reshape(K, C * R * S)
    y = (cols @ w_rows.T).reshape(N, OH, OW, K).transpose(0, 3, 1, 2) + b.reshape(1, K, 1, 1)
    y = np.ascontiguousarray(y)
    g_pixels = g.transpose(0, 2, 3, 1).reshape(N * OH * OW, K)
    dw = (g_pixels.T @ cols).reshape(w.shape)
    db = g_pixels.sum(axis=0)
    dcols = (g_pixels @ w_rows).reshape(N, OH, OW, C, R, S)
    dpadded = np.zeros_like(padded)
    for r in range(R):
        for s in range(S):
            dpadded[:, :, r:r + OH, s:s + OW] += dcols[..., r, s].transpose(0, 3, 1, 2)
    return y, dpadded[:, :, PAD:PAD + H, PAD:PAD + W], dw, db


def netcl_conv(device, x, w, b, g):
    """One forward + backward on `device`; returns (forward s, total s) after a finish."""
    params = [netcl.Parameter(netcl.Tensor.from_host(a, device.queue)) for a in (x, w, b)]
    grad = netcl.Tensor.from_host(g, device.queue)
    device.finish()
    started = time.perf_counter()
    with netcl.Tape() as tape:
        out = F.conv2d(*params, padding=PAD)
    device.finish()  # deliberate: to split forward from backward in the timing
    forward = time.perf_counter() - started
    tape.backward(out, grad=grad)
    device.finish()
    return forward, time.perf_counter() - started, out, params


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, C, H, W)).astype(np.float32)
    w = (rng.standard_normal((K, C, R, S)) * 0.05).astype(np.float32)
    b = rng.standard_normal(K).astype(np.float32)
    g = rng.standard_normal((N, K, H, W)).astype(np.float32)

    devices = [netcl.manager.default("cpu")]
    try:
        devices.append(netcl.manager.default("opencl"))
    except RuntimeError as error:
        print(f"no OpenCL backend: {error}")

    reference = numpy_im2col(x, w, b, g)
    for device in devices:  # warm up (kernel compiles, pool) and check against the reference
        _, _, out, params = netcl_conv(device, x, w, b, g)
        np.testing.assert_allclose(out.value.to_host(), reference[0], rtol=1e-3, atol=1e-3)
        for param, want in zip(params, reference[1:]):
            np.testing.assert_allclose(param.grad.to_host(), want, rtol=1e-3, atol=1e-2)
    numpy_times = []
    netcl_times = {device.name: [] for device in devices}
    for _ in range(args.repeat):  # interleaved, so load on the machine hits all alike
        started = time.perf_counter()
        numpy_im2col(x, w, b, g)
        numpy_times.append(time.perf_counter() - started)
        for device in devices:
            forward, total, *_ = netcl_conv(device, x, w, b, g)
            netcl_times[device.name].append((forward, total))

    numpy_total = statistics.median(numpy_times)
    print(f"conv2d forward+backward, x ({N}, {C}, {H}, {W}), {K} filters {R}x{S}, padding {PAD}; "
          f"median of {args.repeat}")
    print(f"{'implementation':<44} {'forward ms':>10} {'fwd+bwd ms':>10} {'GFLOP/s':>8} "
          f"{'vs NumPy':>8}")
    print(f"{'plain NumPy im2col (same run)':<44} {'':>10} {1e3 * numpy_total:>10.1f} "
          f"{FLOPS / numpy_total / 1e9:>8.1f} {1.0:>8.2f}")
    for device in devices:
        forward = statistics.median(t[0] for t in netcl_times[device.name])
        total = statistics.median(t[1] for t in netcl_times[device.name])
        name = f"netcl {device.backend} ({device.name})"[:44]
        print(f"{name:<44} {1e3 * forward:>10.1f} {1e3 * total:>10.1f} "
              f"{FLOPS / total / 1e9:>8.1f} {numpy_total / total:>8.2f}")


if __name__ == "__main__":
    main()
