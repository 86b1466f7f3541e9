"""Benchmark of one AdamW step with gradient clipping (max_norm=1.0) for an MLP 784-256-256-10
(batch 128), per backend. `python bench_optim.py` prints a table.

For each backend present it measures:
- launches and host syncs per AdamW step with clipping, for models of 2 and of 20 parameters
  (they must be equal: the step works on flat buffers);
- the time of one step: the fused step(max_norm=1.0) on the flat buffers; the same update
  parameter by parameter (gradients assigned by hand, outside the flat buffer, which is the
  optimizer's fallback path); and clip_grad_norm followed by step();
- the time of a whole training step (forward, backward, fused AdamW step) for context.
Times are per step over many steps with one finish at the end, so queued work is included.
"""
import sys
import time

import numpy as np

import netcl
from netcl import functional as F


def _mlp(device, sizes):
    netcl.manual_seed(0)
    layers = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        layers += [netcl.nn.Linear(fan_in, fan_out, queue=device.queue), netcl.nn.ReLU()]
    return netcl.nn.Sequential(*layers[:-1])


def _backward(model, x, y):
    with netcl.Tape() as tape:
        loss = F.cross_entropy(model(x), y)
    tape.backward(loss)


def _per_step(device, fn, repeats):
    """Seconds per call of fn, over `repeats` calls and one finish (after a warm-up)."""
    for _ in range(3):
        fn()
    device.finish()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    device.finish()
    return (time.perf_counter() - started) / repeats


def launches_per_step(device, layers):
    """(parameters, launches, syncs) of one AdamW step(max_norm=1.0) after a backward."""
    model = _mlp(device, [16] * (layers + 1))
    opt = netcl.AdamW(model.parameters(), lr=1e-3)
    x = netcl.Tensor.from_host(np.ones((4, 16), np.float32), queue=device.queue)
    with netcl.Tape() as tape:
        loss = model(x).sum()
    tape.backward(loss)
    launches, syncs = device.launches, device.syncs
    opt.step(max_norm=1.0)
    return len(model.parameters()), device.launches - launches, device.syncs - syncs


def adamw_step_figures(device_name, repeats=200):
    """Timings (seconds) and counts of one AdamW step with clipping, MLP 784-256-256-10."""
    device = netcl.manager.default(device_name)
    model = _mlp(device, (784, 256, 256, 10))
    params = model.parameters()
    opt = netcl.AdamW(params, lr=1e-3)
    rng = np.random.default_rng(0)
    x = netcl.Tensor.from_host(rng.standard_normal((128, 784), np.float32), device.queue)
    y = rng.integers(0, 10, 128)
    _backward(model, x, y)
    figures = {"device": device.name, "backend": device.backend}
    for layers in (1, 10):
        count, launches, syncs = launches_per_step(device, layers)
        figures[f"launches_{count}_params"] = launches
        figures[f"syncs_{count}_params"] = syncs
    figures["fused_step_s"] = _per_step(device, lambda: opt.step(max_norm=1.0), repeats)

    def clip_then_step():
        netcl.clip_grad_norm(params, 1.0)
        opt.step()
    figures["clip_then_step_s"] = _per_step(device, clip_then_step, repeats)
    launches = device.launches
    clip_then_step()
    figures["clip_then_step_launches"] = device.launches - launches

    saved = [p.grad for p in params]  # gradients outside the flat buffer: per-parameter path
    for p in params:
        p.grad = netcl.Tensor.from_host(p.grad.to_host(), device.queue)
    figures["per_parameter_step_s"] = _per_step(device, lambda: opt.step(max_norm=1.0), repeats)
    launches = device.launches
    opt.step(max_norm=1.0)
    figures["per_parameter_launches"] = device.launches - launches
    for p, g in zip(params, saved):
        p.grad = g

    def train_step():
        opt.zero_grad()
        _backward(model, x, y)
        opt.step(max_norm=1.0)
    figures["train_step_s"] = _per_step(device, train_step, max(repeats // 4, 10))
    return figures


def main():
    names = ["cpu"]
    try:
        netcl.manager.default("opencl")
        names.append("opencl")
    except RuntimeError as error:
        print(f"no OpenCL device: {error}", file=sys.stderr)
    rows = [adamw_step_figures(name) for name in names]
    print("AdamW step with clip (max_norm=1.0), MLP 784-256-256-10, batch 128")
    for row in rows:
        print(f"\n{row['backend']} ({row['device']})")
        print(f"  launches per step, 2 / 20 parameters: {row['launches_2_params']} / "
              f"{row['launches_20_params']}; syncs: {row['syncs_2_params']} / "
              f"{row['syncs_20_params']}")
        for label, key, launches in [
                ("fused step(max_norm=1.0), flat buffers", "fused_step_s", None),
                ("same, parameter by parameter", "per_parameter_step_s", "per_parameter_launches"),
                ("clip_grad_norm + step()", "clip_then_step_s", "clip_then_step_launches"),
                ("whole training step (fwd, bwd, fused)", "train_step_s", None)]:
            note = f"  ({row[launches]} launches)" if launches else ""
            print(f"  {label:40s} {1e6 * row[key]:8.1f} µs{note}")


if __name__ == "__main__":
    main()
